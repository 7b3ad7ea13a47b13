"""`sandboxfs doctor`: the real machine passes, and each missing piece is named with its fix.

Facts are injected (a fake /proc and /etc under tmp_path, a `which` that finds a fake bwrap
script) so the failure paths run anywhere, as root or not, in well under a second.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest

from sandboxfs.run import doctor
from sandboxfs.run.doctor import Check

NAMES = [
    "fuse3",
    "fusermount3-setuid",
    "dev-fuse",
    "user_allow_other",
    "python",
    "pyfuse3",
    "bubblewrap",
    "bubblewrap-version",
    "user-namespaces",
    "apparmor-userns",
    "bubblewrap-trial",
]
UID_MAP_DENIED = "bwrap: setting up uid map: Permission denied"


def fake_proc(
    tmp_path: Path,
    *,
    max_userns: str = "15000",
    clone: str | None = None,
    apparmor: str | None = None,
    cap_eff: str = "0000000000000000",
) -> Path:
    """A /proc with just the files the checks read."""
    proc = tmp_path / "proc"
    (proc / "sys/user").mkdir(parents=True)
    (proc / "sys/kernel").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "sys/user/max_user_namespaces").write_text(f"{max_userns}\n")
    if clone is not None:
        (proc / "sys/kernel/unprivileged_userns_clone").write_text(f"{clone}\n")
    if apparmor is not None:
        (proc / "sys/kernel/apparmor_restrict_unprivileged_userns").write_text(f"{apparmor}\n")
    (proc / "self/status").write_text(f"Name:\tpython\nCapEff:\t{cap_eff}\n")
    return proc


def fake_etc(tmp_path: Path, *, fuse_conf: str = "user_allow_other\n") -> Path:
    etc = tmp_path / "etc"
    (etc / "apparmor.d").mkdir(parents=True)
    (etc / "fuse.conf").write_text(fuse_conf)
    return etc


def fake_bwrap(tmp_path: Path, *, version: str = "0.8.0", trial: str = "exit 0") -> Path:
    """A bwrap that prints `version` for --version and otherwise runs the shell line `trial`."""
    script = tmp_path / "bwrap"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "bubblewrap {version}"; exit 0; fi\n'
        f"{trial}\n"
    )
    script.chmod(0o755)
    return script


def finding(**found: Path | None) -> Callable[[str], str | None]:
    """A `which` that answers for the names given and asks the real PATH for the rest."""

    def which(name: str) -> str | None:
        if name in found:
            path = found[name]
            return None if path is None else str(path)
        return shutil.which(name)

    return which


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


# ----- the real machine ---------------------------------------------------------------------------


def test_this_machine_has_everything_mount_and_run_need() -> None:
    checks = doctor.run_checks()
    report = doctor.format_report(checks)
    assert [c.name for c in checks] == NAMES
    assert [c.name for c in checks if not c.ok and not c.optional] == [], report
    assert doctor.exit_code(checks) == 0
    assert report.endswith("sandboxfs doctor: everything mount and run need is in place")
    assert doctor.confinement_problem() is None


def test_trial_argv_mirrors_the_system_as_run_does(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/true").touch()
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib").mkdir()
    argv = doctor.trial_argv("/x/bwrap", root=tmp_path)
    assert argv[:10] == [
        "/x/bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--ro-bind",
    ]
    joined = " ".join(argv)
    assert f"--ro-bind {tmp_path}/usr /usr" in joined
    assert "--symlink usr/bin /bin" in joined
    assert f"--ro-bind {tmp_path}/lib /lib" in joined
    assert "/lib64" not in joined and "/sbin" not in joined
    tail = ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "/usr/bin/true"]
    assert argv[-8:] == tail


# ----- user namespaces and AppArmor ---------------------------------------------------------------


def test_user_namespaces_disabled(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, max_userns="0")
    which = finding(bwrap=fake_bwrap(tmp_path))
    checks = by_name(doctor.run_checks(trial=False, proc=proc, etc=fake_etc(tmp_path), which=which))
    userns = checks["user-namespaces"]
    assert not userns.ok
    assert userns.fix is not None and "sysctl -w user.max_user_namespaces=" in userns.fix
    problem = doctor.confinement_problem(proc=proc, etc=fake_etc(tmp_path / "b"), which=which)
    assert problem is not None and "sysctl -w user.max_user_namespaces=" in problem
    assert "\n" not in problem


@pytest.mark.parametrize(("euid", "ok"), [(1000, False), (0, True)])
def test_unprivileged_userns_clone_matters_only_when_not_root(
    tmp_path: Path, euid: int, ok: bool
) -> None:
    proc = fake_proc(tmp_path, clone="0")
    checks = by_name(
        doctor.run_checks(
            trial=False,
            proc=proc,
            etc=fake_etc(tmp_path),
            which=finding(bwrap=fake_bwrap(tmp_path)),
            euid=euid,
        )
    )
    userns = checks["user-namespaces"]
    assert userns.ok is ok
    if not ok:
        assert userns.fix is not None and "kernel.unprivileged_userns_clone=1" in userns.fix


def test_apparmor_restriction_without_profile_names_both_fixes(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, apparmor="1")
    etc = fake_etc(tmp_path)
    which = finding(bwrap=fake_bwrap(tmp_path))
    check = by_name(doctor.run_checks(trial=False, proc=proc, etc=etc, which=which))[
        "apparmor-userns"
    ]
    assert not check.ok
    assert check.fix is not None
    assert "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0" in check.fix
    assert "/etc/sysctl.d/" in check.fix
    assert "/etc/apparmor.d/bwrap" in check.fix and "userns," in check.fix
    assert "\n" not in check.fix
    problem = doctor.confinement_problem(proc=proc, etc=etc, which=which)
    assert problem is not None and "apparmor_restrict_unprivileged_userns" in problem


def test_apparmor_profile_for_bwrap_passes(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, apparmor="1")
    etc = fake_etc(tmp_path)
    (etc / "apparmor.d/bwrap").write_text(
        "abi <abi/4.0>,\ninclude <tunables/global>\n"
        "profile bwrap /usr/bin/bwrap flags=(unconfined) {\n  userns,\n}\n"
    )
    which = finding(bwrap=fake_bwrap(tmp_path))
    check = by_name(doctor.run_checks(trial=False, proc=proc, etc=etc, which=which))[
        "apparmor-userns"
    ]
    assert check.ok, check
    assert doctor.confinement_problem(proc=proc, etc=etc, which=which) is None


def test_apparmor_profile_commented_out_or_disabled_does_not_count(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, apparmor="1")
    etc = fake_etc(tmp_path)
    (etc / "apparmor.d/bwrap").write_text("profile bwrap /usr/bin/bwrap {\n  # userns,\n}\n")
    (etc / "apparmor.d/bwrap2").write_text("profile b2 /usr/bin/bwrap {\n  userns,\n}\n")
    (etc / "apparmor.d/disable").mkdir()
    (etc / "apparmor.d/disable/bwrap2").symlink_to("../bwrap2")
    which = finding(bwrap=fake_bwrap(tmp_path))
    assert doctor.confinement_problem(proc=proc, etc=etc, which=which) is not None


@pytest.mark.parametrize(
    ("apparmor", "cap_eff"),
    [(None, "0"), ("0", "0"), ("1", "000001ffffffffff")],  # absent, off, spares CAP_SYS_ADMIN
)
def test_apparmor_not_restricting(tmp_path: Path, apparmor: str | None, cap_eff: str) -> None:
    proc = fake_proc(tmp_path, apparmor=apparmor, cap_eff=cap_eff)
    which = finding(bwrap=fake_bwrap(tmp_path))
    assert doctor.confinement_problem(proc=proc, etc=fake_etc(tmp_path), which=which) is None


# ----- bubblewrap ---------------------------------------------------------------------------------


def test_bwrap_missing(tmp_path: Path) -> None:
    proc, etc = fake_proc(tmp_path), fake_etc(tmp_path)
    which = finding(bwrap=None)
    problem = doctor.confinement_problem(proc=proc, etc=etc, which=which)
    assert problem is not None
    assert "apt-get install bubblewrap" in problem and "\n" not in problem
    checks = by_name(doctor.run_checks(proc=proc, etc=etc, which=which))
    assert not checks["bubblewrap"].ok
    for name in ("bubblewrap-version", "bubblewrap-trial"):
        assert not checks[name].ok and doctor.is_skipped(checks[name])
        assert checks[name].detail.startswith("skipped: ")
    report = doctor.format_report(list(checks.values()))
    assert "skip  bubblewrap-trial" in report
    assert "1 problem (2 checks skipped); mount: ready, run: NOT ready" in report.splitlines()[-1]


def test_bwrap_too_old(tmp_path: Path) -> None:
    proc, etc = fake_proc(tmp_path), fake_etc(tmp_path)
    which = finding(bwrap=fake_bwrap(tmp_path, version="0.4.0"))
    checks = by_name(doctor.run_checks(proc=proc, etc=etc, which=which))
    version = checks["bubblewrap-version"]
    assert not version.ok
    assert "0.4.0" in version.detail and "0.8.0" in version.detail
    assert version.fix is not None and "0.8.0" in version.fix
    assert doctor.is_skipped(checks["bubblewrap-trial"])
    problem = doctor.confinement_problem(proc=proc, etc=etc, which=which)
    assert problem is not None and "0.8.0" in problem


def test_bwrap_version_unreadable(tmp_path: Path) -> None:
    script = tmp_path / "bwrap"
    script.write_text("#!/bin/sh\necho 'usage: bwrap'\n")
    script.chmod(0o755)
    proc, etc = fake_proc(tmp_path), fake_etc(tmp_path)
    problem = doctor.confinement_problem(proc=proc, etc=etc, which=finding(bwrap=script))
    assert problem is not None and "not a version" in problem


def test_trial_failure_carries_bwraps_last_line(tmp_path: Path) -> None:
    proc, etc = fake_proc(tmp_path, apparmor="1"), fake_etc(tmp_path)
    bwrap = fake_bwrap(
        tmp_path, trial=f"echo 'bwrap: warming up' >&2; echo '{UID_MAP_DENIED}' >&2; exit 1"
    )
    checks = by_name(doctor.run_checks(proc=proc, etc=etc, which=finding(bwrap=bwrap)))
    trial = checks["bubblewrap-trial"]
    assert not trial.ok
    assert trial.detail == UID_MAP_DENIED
    assert trial.fix is not None and "AppArmor" in trial.fix and "\n" not in trial.fix


def test_trial_failure_without_a_known_cause_still_has_a_fix(tmp_path: Path) -> None:
    proc, etc = fake_proc(tmp_path), fake_etc(tmp_path)
    bwrap = fake_bwrap(tmp_path, trial="exit 1")
    trial = by_name(doctor.run_checks(proc=proc, etc=etc, which=finding(bwrap=bwrap)))[
        "bubblewrap-trial"
    ]
    assert not trial.ok
    assert trial.detail == "bwrap exited with status 1, no message"
    assert trial.fix is not None and trial.fix.startswith("likely cause: ")


def test_trial_timeout(tmp_path: Path) -> None:
    proc, etc = fake_proc(tmp_path), fake_etc(tmp_path)
    bwrap = fake_bwrap(tmp_path, trial="exec sleep 5")
    trial = by_name(
        doctor.run_checks(proc=proc, etc=etc, which=finding(bwrap=bwrap), trial_timeout=0.2)
    )["bubblewrap-trial"]
    assert not trial.ok and "within 0.2 s" in trial.detail


def test_trial_can_be_left_out(tmp_path: Path) -> None:
    which = finding(bwrap=fake_bwrap(tmp_path, trial="exit 1"))
    checks = doctor.run_checks(
        trial=False, proc=fake_proc(tmp_path), etc=fake_etc(tmp_path), which=which
    )
    assert [c.name for c in checks] == NAMES[:-1]


# ----- mount --------------------------------------------------------------------------------------


def test_fuse3_missing(tmp_path: Path) -> None:
    checks = by_name(
        doctor.run_checks(
            trial=False,
            proc=fake_proc(tmp_path),
            etc=fake_etc(tmp_path),
            which=finding(fusermount3=None, bwrap=fake_bwrap(tmp_path)),
        )
    )
    assert not checks["fuse3"].ok
    assert checks["fuse3"].fix == "install it: apt-get install fuse3"
    assert doctor.is_skipped(checks["fusermount3-setuid"])


def test_fusermount3_not_setuid_matters_when_not_root(tmp_path: Path) -> None:
    fusermount = tmp_path / "fusermount3"
    fusermount.write_text("#!/bin/sh\necho 'fusermount3 version: 3.14.0'\n")
    fusermount.chmod(0o755)
    proc, etc = fake_proc(tmp_path), fake_etc(tmp_path)
    which = finding(fusermount3=fusermount, bwrap=fake_bwrap(tmp_path))

    def checks(euid: int) -> dict[str, Check]:
        return by_name(doctor.run_checks(trial=False, proc=proc, etc=etc, which=which, euid=euid))

    as_user = checks(1000)
    assert as_user["fuse3"].ok and "3.14.0" in as_user["fuse3"].detail
    setuid = as_user["fusermount3-setuid"]
    assert not setuid.ok
    assert setuid.fix is not None and f"chmod 4755 {fusermount}" in setuid.fix
    assert checks(0)["fusermount3-setuid"].ok


def test_dev_fuse_missing(tmp_path: Path) -> None:
    check = by_name(
        doctor.run_checks(
            trial=False,
            proc=fake_proc(tmp_path),
            etc=fake_etc(tmp_path),
            dev=tmp_path,
            which=finding(bwrap=fake_bwrap(tmp_path)),
        )
    )["dev-fuse"]
    assert not check.ok
    assert check.detail == f"{tmp_path}/fuse does not exist"
    assert check.fix is not None and "modprobe fuse" in check.fix


def test_user_allow_other_is_only_a_warning(tmp_path: Path) -> None:
    checks = doctor.run_checks(
        trial=False,
        proc=fake_proc(tmp_path),
        etc=fake_etc(tmp_path, fuse_conf="#user_allow_other\n"),
        which=finding(bwrap=fake_bwrap(tmp_path)),
        euid=1000,
    )
    check = by_name(checks)["user_allow_other"]
    assert not check.ok and check.optional and check.needed_by == "mount --allow-other"
    assert check.fix == "echo user_allow_other | sudo tee -a /etc/fuse.conf"
    assert doctor.exit_code([check]) == 0
    assert "warn  user_allow_other" in doctor.format_report(checks)


# ----- report shapes ------------------------------------------------------------------------------

GOOD = Check("fuse3", "mount", True, "fusermount3 3.14.0 at /usr/bin/fusermount3", None)
WARN = Check(
    "user_allow_other",
    "mount --allow-other",
    False,
    "not set",
    "echo user_allow_other | sudo tee -a /etc/fuse.conf",
    optional=True,
)
BAD = Check(
    "bubblewrap",
    "run",
    False,
    "bubblewrap (bwrap) is not installed",
    "install it: apt-get install bubblewrap",
)


def test_format_report_all_good_with_a_warning() -> None:
    report = doctor.format_report([GOOD, WARN])
    assert report.splitlines() == [
        "ok    fuse3             fusermount3 3.14.0 at /usr/bin/fusermount3",
        "warn  user_allow_other  not set",
        "      fix: echo user_allow_other | sudo tee -a /etc/fuse.conf",
        "sandboxfs doctor: everything mount and run need is in place "
        "(1 warning: optional, see 'warn' above)",
    ]
    assert report.isascii()
    assert doctor.format_report([GOOD]).splitlines()[-1] == (
        "sandboxfs doctor: everything mount and run need is in place"
    )


def test_format_report_with_a_problem() -> None:
    report = doctor.format_report([GOOD, WARN, BAD])
    assert report.splitlines()[-3:] == [
        "FAIL  bubblewrap        bubblewrap (bwrap) is not installed",
        "      fix: install it: apt-get install bubblewrap",
        "sandboxfs doctor: 1 problem; mount: ready, run: NOT ready",
    ]
    bad_mount = Check("dev-fuse", "mount", False, "/dev/fuse does not exist", "modprobe fuse")
    last = doctor.format_report([bad_mount, BAD]).splitlines()[-1]
    assert last == "sandboxfs doctor: 2 problems; mount: NOT ready, run: NOT ready"


def test_report_json() -> None:
    data = json.loads(doctor.report_json([GOOD, WARN, BAD]))
    assert [d["name"] for d in data] == ["fuse3", "user_allow_other", "bubblewrap"]
    assert set(data[0]) == {f.name for f in fields(Check)}
    assert data[1]["optional"] is True and data[1]["ok"] is False
    assert data[2]["fix"] == "install it: apt-get install bubblewrap"
    assert data[0]["fix"] is None


def test_exit_code() -> None:
    assert doctor.exit_code([]) == 0
    assert doctor.exit_code([GOOD, WARN]) == 0
    assert doctor.exit_code([GOOD, WARN, BAD]) == 1


@pytest.mark.parametrize(
    ("version", "fixed"),
    [("0.8.0", False), ("0.11.1", False), ("0.11.2", True), ("0.12.0", True), ("0.13.1", True)],
)
def test_bwrap_version_says_whether_cve_2026_87766_is_fixed(
    tmp_path: Path, version: str, fixed: bool
) -> None:
    """Fixed in 0.12.0 and 0.11.2; an older one is still ok, and doctor says why."""
    which = finding(bwrap=fake_bwrap(tmp_path, version=version))
    checks = by_name(doctor.run_checks(trial=False, proc=fake_proc(tmp_path), which=which))
    check = checks["bubblewrap-version"]
    assert check.ok and check.detail.startswith(f"bubblewrap {version}; CVE-2026-87766: ")
    if fixed:
        assert check.detail.endswith("CVE-2026-87766: fixed in this version")
    else:
        assert "not fixed in this version (0.12.0, 0.11.2)" in check.detail
        assert "never has bubblewrap make a path inside a writable bind" in check.detail
    assert "\n" not in check.detail
