"""`sandboxfs doctor`: is everything `mount` and `run` need in place on this machine?

Each requirement is one `Check` with what was found and, when it is missing, the one line that
fixes it. `run` calls `confinement_problem` before it starts anything: a machine where
bubblewrap cannot confine the command must refuse to run it, never run it unconfined.

The machine's facts (PATH lookups, /proc, /etc, /dev, the effective uid) are keyword
arguments, so the tests can point them at a fake tree instead of patching globals.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sandboxfs.run import confine

BWRAP_MINIMUM = (0, 8, 0)  # --disable-userns, --size; with --json-status-fd, --perms, --cap-drop
# CVE-2026-87766 (making a path inside a directory the program could write follows a link it
# planted there) is fixed in 0.12.0 and, on the 0.11 branch, 0.11.2.
BWRAP_CVE_2026_87766_FIXED = ((0, 11, 2), (0, 12, 0))
PYTHON_MINIMUM = (3, 11)
PYFUSE3_RANGE = ((3, 3), (4,))  # daemon.py relies on pyfuse3 3.x internals
TRIAL_TIMEOUT = 10.0
VERSION_TIMEOUT = 5.0
SKIPPED = "skipped: "  # how the detail of a check that could not be tried begins
SYSCTL_FILE = "/etc/sysctl.d/60-sandboxfs.conf"  # where the fixes persist a sysctl
CAP_SYS_ADMIN = 21

Which = Callable[[str], str | None]


@dataclass(frozen=True)
class Check:
    """One requirement: what was found and, when it is missing, the one-line fix."""

    name: str  # short id, e.g. "bubblewrap-version"
    needed_by: str  # "mount", "run", or "mount --allow-other"
    ok: bool
    detail: str  # what was found, one line
    fix: str | None  # the command or change that fixes it; None when ok
    optional: bool = False  # a warning only: never makes doctor fail


@dataclass(frozen=True)
class _Host:
    """The facts every check reads, in one place so tests can replace them."""

    which: Which
    proc: Path
    etc: Path
    dev: Path
    euid: int


def run_checks(
    *,
    trial: bool = True,
    proc: Path = Path("/proc"),
    etc: Path = Path("/etc"),
    dev: Path = Path("/dev"),
    which: Which = shutil.which,
    euid: int | None = None,
    trial_timeout: float = TRIAL_TIMEOUT,
) -> list[Check]:
    """Every check, mount's first, then run's; `trial` starts bubblewrap once for real.

    A check that depends on an earlier failure is not tried: it is reported not ok with a
    detail starting "skipped: " and a fix pointing at the check to fix first.
    """
    host = _host(proc, etc, dev, which, euid)
    checks = _mount_checks(host)
    run = list(_run_checks(host))
    checks += run
    if trial:
        checks.append(_trial_check(host, {c.name: c for c in run}, trial_timeout))
    return checks


def confinement_problem(
    *,
    proc: Path = Path("/proc"),
    etc: Path = Path("/etc"),
    which: Which = shutil.which,
    euid: int | None = None,
) -> str | None:
    """The first missing requirement of `run` as one line "<detail>; <fix>", or None.

    Fast enough to call before every run: no trial, at most `bwrap --version`.
    """
    host = _host(proc, etc, Path("/dev"), which, euid)
    for check in _run_checks(host):
        if not check.ok and not check.optional:
            return _one_line(f"{check.detail}; {check.fix}")
    return None


def format_report(checks: Sequence[Check]) -> str:
    """The human report: one line per check, its fix below it, and a verdict (ASCII only)."""
    width = max((len(c.name) for c in checks), default=0) + 2
    lines: list[str] = []
    for check in checks:
        lines.append(f"{_status(check):<6}{check.name:<{width}}{check.detail}")
        if not check.ok and check.fix and not is_skipped(check):
            lines.append(f"{'':6}fix: {check.fix}")
    lines.append(_verdict(checks))
    return "\n".join(lines)


def report_json(checks: Sequence[Check]) -> str:
    """The checks as a JSON list of objects with the fields of `Check`."""
    return json.dumps([asdict(c) for c in checks], indent=2)


def exit_code(checks: Sequence[Check]) -> int:
    """0 when every check that is not optional is ok, else 1."""
    return 0 if all(c.ok or c.optional for c in checks) else 1


def is_skipped(check: Check) -> bool:
    """Not tried because an earlier check failed (its failure is reported there)."""
    return not check.ok and check.detail.startswith(SKIPPED)


def trial_argv(bwrap: str, root: Path = Path("/")) -> list[str]:
    """The trial command line: bubblewrap set up as `run` sets it up, running `true`."""
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        *confine.system_args(root),
    ]
    return [*args, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", _usr_true(root)]


# ----- the report ---------------------------------------------------------------------------------


def _status(check: Check) -> str:
    if check.ok:
        return "ok"
    if check.optional:
        return "warn"
    return "skip" if is_skipped(check) else "FAIL"


def _verdict(checks: Sequence[Check]) -> str:
    warnings = sum(1 for c in checks if not c.ok and c.optional)
    if exit_code(checks) == 0:
        line = "sandboxfs doctor: everything mount and run need is in place"
        if warnings:
            line += f" ({_plural(warnings, 'warning')}: optional, see 'warn' above)"
        return line
    failed = [c for c in checks if not c.ok and not c.optional]
    problems = sum(1 for c in failed if not is_skipped(c))
    skipped = len(failed) - problems
    mount_ready = all(c.ok for c in checks if c.needed_by == "mount")
    run_ready = mount_ready and all(c.ok for c in checks if c.needed_by == "run")
    line = f"sandboxfs doctor: {_plural(problems, 'problem')}"
    if skipped:
        line += f" ({_plural(skipped, 'check')} skipped)"
    line += f"; mount: {_ready(mount_ready)}, run: {_ready(run_ready)}"
    return line


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ready(ready: bool) -> str:
    return "ready" if ready else "NOT ready"


# ----- mount --------------------------------------------------------------------------------------


def _mount_checks(host: _Host) -> list[Check]:
    fusermount = host.which("fusermount3")
    return [
        _fuse3(fusermount),
        _fusermount_setuid(host, fusermount),
        _dev_fuse(host),
        _user_allow_other(host),
        _python(),
        _pyfuse3(),
    ]


def _fuse3(fusermount: str | None) -> Check:
    if fusermount is None:
        return Check(
            "fuse3",
            "mount",
            False,
            "fusermount3 is not on PATH (package fuse3)",
            "install it: apt-get install fuse3",
        )
    output = _output([fusermount, "--version"]) or ""
    found = re.search(r"\d+\.\d+(?:\.\d+)?", output)
    version = found.group(0) if found else "(version unknown)"
    return Check("fuse3", "mount", True, f"fusermount3 {version} at {fusermount}", None)


def _fusermount_setuid(host: _Host, fusermount: str | None) -> Check:
    name = "fusermount3-setuid"
    if fusermount is None:
        return _skipped(name, "mount", "fusermount3 is not installed", "fuse3")
    try:
        st = os.stat(fusermount)
        nosuid = bool(os.statvfs(fusermount).f_flag & os.ST_NOSUID)
    except OSError as exc:
        return Check(name, "mount", False, f"cannot stat {fusermount}: {exc.strerror}", _REINSTALL)
    setuid_root = st.st_uid == 0 and bool(st.st_mode & stat.S_ISUID) and not nosuid
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"
    if host.euid == 0:
        state = "setuid root" if setuid_root else f"not setuid root: {mode}"
        return Check(name, "mount", True, f"not needed as root ({fusermount} is {state})", None)
    if setuid_root:
        return Check(name, "mount", True, f"{fusermount} is setuid root", None)
    if nosuid:
        return Check(
            name,
            "mount",
            False,
            f"{fusermount} is on a file system mounted nosuid",
            "remount that file system without nosuid, or mount as root",
        )
    return Check(
        name,
        "mount",
        False,
        f"{fusermount} is not setuid root ({mode}): FUSE mounts need it when not root",
        f"sudo chown root {fusermount} && sudo chmod 4755 {fusermount} (or: {_REINSTALL})",
    )


_REINSTALL = "sudo apt-get install --reinstall fuse3"


def _dev_fuse(host: _Host) -> Check:
    path = host.dev / "fuse"
    container = "in a container, pass the device: docker run --device /dev/fuse --cap-add SYS_ADMIN"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Check(
            "dev-fuse",
            "mount",
            False,
            f"{path} does not exist",
            f"load the module: sudo modprobe fuse ({container})",
        )
    except OSError as exc:
        return Check("dev-fuse", "mount", False, f"cannot stat {path}: {exc.strerror}", container)
    if not stat.S_ISCHR(st.st_mode):
        return Check(
            "dev-fuse",
            "mount",
            False,
            f"{path} is not a character device",
            f"sudo rm {path} && sudo modprobe fuse ({container})",
        )
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, group gid {st.st_gid}"
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except PermissionError:
        return Check(
            "dev-fuse",
            "mount",
            False,
            f"{path} is not readable and writable by uid {host.euid} ({mode})",
            f"sudo chmod 0666 {path} (the usual mode), or join its group: "
            f"sudo usermod -aG $(stat -c %G {path}) $USER",
        )
    except OSError as exc:
        return Check(
            "dev-fuse", "mount", False, f"cannot open {path}: {exc.strerror} ({mode})", container
        )
    return Check("dev-fuse", "mount", True, f"{path} opens read-write ({mode})", None)


def _user_allow_other(host: _Host) -> Check:
    path = host.etc / "fuse.conf"
    name, needed_by = "user_allow_other", "mount --allow-other"
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        lines = []
    if "user_allow_other" in lines:
        return Check(name, needed_by, True, f"set in {path}", None, optional=True)
    if host.euid == 0:
        detail = f"not set in {path}; not needed when mounting as root"
        return Check(name, needed_by, True, detail, None, optional=True)
    return Check(
        name,
        needed_by,
        False,
        f"not set in {path}: only `mount --allow-other` needs it",
        "echo user_allow_other | sudo tee -a /etc/fuse.conf",
        optional=True,
    )


def _python() -> Check:
    found = f"Python {platform.python_version()} at {sys.executable}"
    if sys.version_info >= PYTHON_MINIMUM:
        return Check("python", "mount", True, found, None)
    return Check(
        "python",
        "mount",
        False,
        f"{found}; sandboxfs needs 3.11 or newer",
        "install sandboxfs with Python 3.11 or newer (e.g. apt-get install python3.11)",
    )


def _pyfuse3() -> Check:
    install = (
        f"install it into this Python: {sys.executable} -m pip install 'pyfuse3>=3.3,<4' "
        f"(building it needs libfuse3-dev and pkg-config)"
    )
    try:
        spec = importlib.util.find_spec("pyfuse3")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return Check(
            "pyfuse3", "mount", False, f"pyfuse3 is not importable by {sys.executable}", install
        )
    try:
        version = importlib.metadata.version("pyfuse3")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    where = spec.origin or "(namespace package)"
    if Path(where).name.startswith("__init__."):
        where = str(Path(where).parent)
    failure = _import_failure("pyfuse3")
    if failure is not None:
        return Check(
            "pyfuse3",
            "mount",
            False,
            f"pyfuse3 {version} at {where} cannot be imported by {sys.executable}: {failure}",
            install,
        )
    found = _version(version)
    low, high = PYFUSE3_RANGE
    if found is not None and not low <= found < high:
        return Check(
            "pyfuse3",
            "mount",
            False,
            f"pyfuse3 {version} at {where}; sandboxfs needs >= 3.3 and < 4",
            install,
        )
    return Check("pyfuse3", "mount", True, f"pyfuse3 {version} at {where}", None)


def _import_failure(module: str) -> str | None:
    """Why `module` does not import here, in one line, or None: found is not enough, as its
    compiled part may need a library that is gone (libfuse3). Imported in this process, the
    one whose fork serves the mount, so its path and environment are the daemon's."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # an import runs the module's code: any error means unusable
        return _one_line(f"{type(exc).__name__}: {exc}") or type(exc).__name__
    return None


# ----- run ----------------------------------------------------------------------------------------


def _run_checks(host: _Host) -> Iterator[Check]:
    """run's static checks, in order; lazy, so `confinement_problem` stops at the first."""
    bwrap = host.which("bwrap")
    if bwrap is None:
        yield Check(
            "bubblewrap",
            "run",
            False,
            "bubblewrap (bwrap) is not installed",
            "install it: apt-get install bubblewrap",
        )
        yield _skipped("bubblewrap-version", "run", "bubblewrap is not installed", "bubblewrap")
    else:
        yield Check("bubblewrap", "run", True, f"bwrap at {bwrap}", None)
        yield _bwrap_version(bwrap)
    yield _user_namespaces(host)
    yield _apparmor_userns(host, bwrap)


def _bwrap_version(bwrap: str) -> Check:
    name = "bubblewrap-version"
    need = ".".join(map(str, BWRAP_MINIMUM))
    upgrade = (
        f"install bubblewrap {need} or newer (Debian 12, Ubuntu 24.04 and later ship it: "
        f"apt-get install bubblewrap), or build it from https://github.com/containers/bubblewrap"
    )
    output = _output([bwrap, "--version"])
    if output is None:
        return Check(name, "run", False, f"`{bwrap} --version` failed", upgrade)
    found = re.search(r"bubblewrap\s+(\d+(?:\.\d+)*)", output)
    version = _version(found.group(1)) if found else None
    if found is None or version is None:
        shown = _one_line(output.strip())[:80] or "nothing"
        return Check(
            name, "run", False, f"`{bwrap} --version` printed {shown!r}, not a version", upgrade
        )
    if version < BWRAP_MINIMUM:
        return Check(
            name,
            "run",
            False,
            f"bubblewrap {found.group(1)} is older than {need} (run needs --disable-userns)",
            upgrade,
        )
    return Check(
        name, "run", True, f"bubblewrap {found.group(1)}; {_cve_2026_87766(version)}", None
    )


def _cve_2026_87766(version: tuple[int, ...]) -> str:
    """Whether this bubblewrap has the fix, and why `run` is safe with one that does not."""
    branch, current = BWRAP_CVE_2026_87766_FIXED
    if version >= current or (version[:2] == branch[:2] and version >= branch):
        return "CVE-2026-87766: fixed in this version"
    return (
        "CVE-2026-87766: not fixed in this version (0.12.0, 0.11.2), and run is not exposed: "
        "it never has bubblewrap make a path inside a writable bind (every run's options are "
        "checked; a layout that would is refused)"
    )


def _user_namespaces(host: _Host) -> Check:
    max_path = host.proc / "sys/user/max_user_namespaces"
    clone_path = host.proc / "sys/kernel/unprivileged_userns_clone"
    maximum = _read_int(max_path)
    if maximum is None:
        return Check(
            "user-namespaces",
            "run",
            False,
            f"cannot read {max_path}: this kernel may lack user namespaces",
            "use a kernel built with CONFIG_USER_NS=y",
        )
    problems: list[str] = []
    fixes: list[str] = []
    found = [f"max_user_namespaces {maximum}"]
    if maximum <= 0:
        problems.append(f"{max_path} is {maximum}: user namespaces are disabled")
        fixes.append(_sysctl("user.max_user_namespaces", "15000"))
    clone = _read_int(clone_path)
    if clone is not None:
        found.append(f"unprivileged_userns_clone {clone}")
        if clone != 1 and host.euid != 0:
            problems.append(f"{clone_path} is {clone}: only root may create user namespaces")
            fixes.append(_sysctl("kernel.unprivileged_userns_clone", "1"))
    if problems:
        return Check("user-namespaces", "run", False, "; ".join(problems), "; and ".join(fixes))
    return Check("user-namespaces", "run", True, ", ".join(found), None)


def _apparmor_userns(host: _Host, bwrap: str | None) -> Check:
    name = "apparmor-userns"
    path = host.proc / "sys/kernel/apparmor_restrict_unprivileged_userns"
    value = _read_int(path)
    if value is None:
        return Check(name, "run", True, "no AppArmor user-namespace restriction here", None)
    if value == 0:
        return Check(name, "run", True, "apparmor_restrict_unprivileged_userns is 0", None)
    if _has_cap(host.proc, CAP_SYS_ADMIN):
        detail = (
            f"apparmor_restrict_unprivileged_userns is {value}; it spares CAP_SYS_ADMIN, held here"
        )
        return Check(name, "run", True, detail, None)
    paths = {"/usr/bin/bwrap"}
    if bwrap is not None:
        paths |= {bwrap, os.path.realpath(bwrap)}
    profile = _bwrap_profile(host.etc / "apparmor.d", paths)
    if profile is not None:
        detail = f"apparmor_restrict_unprivileged_userns is {value}; {profile} allows bwrap userns"
        return Check(name, "run", True, detail, None)
    return Check(
        name,
        "run",
        False,
        f"{path} is {value} and no profile under {host.etc / 'apparmor.d'} lets bwrap "
        f"create user namespaces",
        _apparmor_fix(os.path.realpath(bwrap) if bwrap else "/usr/bin/bwrap"),
    )


def _apparmor_fix(bwrap: str) -> str:
    """Both ways out: lift the restriction, or give bwrap a profile allowing `userns,`."""
    profile = (
        f"abi <abi/4.0>,\\ninclude <tunables/global>\\n"
        f"profile bwrap {bwrap} flags=(unconfined) {{\\n  userns,\\n}}\\n"
    )
    sysctl = _sysctl("kernel.apparmor_restrict_unprivileged_userns", "0")
    return (
        f"either lift the restriction: {sysctl}"
        f"; or allow bwrap alone: printf '{profile}' | sudo tee /etc/apparmor.d/bwrap "
        f"&& sudo apparmor_parser -r /etc/apparmor.d/bwrap"
    )


def _bwrap_profile(directory: Path, bwrap_paths: set[str]) -> Path | None:
    """The first AppArmor profile (not disabled) naming bwrap and a `userns` rule."""
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return None
    for path in entries:
        if (directory / "disable" / path.name).exists():
            continue
        try:
            if not path.is_file():
                continue
            text = path.read_text(errors="replace")
        except OSError:
            continue
        text = "\n".join(_strip_comment(line) for line in text.splitlines())
        if any(p in text for p in bwrap_paths) and re.search(r"\buserns\b", text):
            return path
    return None


def _strip_comment(line: str) -> str:
    if line.lstrip().startswith("#include"):
        return line
    return line.split("#", 1)[0]


def _trial_check(host: _Host, earlier: dict[str, Check], timeout: float) -> Check:
    """Start bubblewrap once as `run` does; the real answer where the static checks guess."""
    name = "bubblewrap-trial"
    for needed in ("bubblewrap", "bubblewrap-version"):
        check = earlier[needed]
        if not check.ok:
            why = "bubblewrap is not installed" if needed == "bubblewrap" else check.detail
            return _skipped(name, "run", why, needed)
    bwrap = host.which("bwrap")
    if bwrap is None:  # gone since the bubblewrap check found it
        return _skipped(name, "run", "bubblewrap is not installed", "bubblewrap")
    argv = trial_argv(bwrap)
    try:
        result = _quiet_run(argv, timeout)
    except subprocess.TimeoutExpired:
        return Check(
            name,
            "run",
            False,
            f"bwrap did not finish starting {argv[-1]} within {timeout:g} s",
            _trial_fix(host, earlier),
        )
    except OSError as exc:
        return Check(
            name, "run", False, f"cannot start {bwrap}: {exc.strerror}", _trial_fix(host, earlier)
        )
    if result.returncode == 0:
        detail = f"bwrap started {argv[-1]} as run does (all namespaces, --disable-userns, no caps)"
        return Check(name, "run", True, detail, None)
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    detail = lines[-1] if lines else f"bwrap exited with status {result.returncode}, no message"
    return Check(name, "run", False, _one_line(detail), _trial_fix(host, earlier))


def _trial_fix(host: _Host, earlier: dict[str, Check]) -> str:
    """The likely cause of a failed trial, and its fix, as one line."""
    for needed, cause in (
        ("apparmor-userns", "AppArmor restricts unprivileged user namespaces"),
        ("user-namespaces", "user namespaces are disabled"),
    ):
        check = earlier.get(needed)
        if check is not None and not check.ok:
            return f"likely cause: {cause}; {check.fix}"
    if _in_container(host.proc):
        return (
            "likely cause: this runs in a container that forbids nested user namespaces; "
            "run sandboxfs on the host, or start the container with them allowed (docker: "
            "--security-opt seccomp=unconfined --security-opt apparmor=unconfined "
            "--security-opt systempaths=unconfined; "
            "LXC/Incus: security.nesting=true)"
        )
    return (
        "likely cause: a security policy (AppArmor, SELinux, seccomp) denies user namespaces; "
        "try `unshare --user --map-root-user --net true` and look for denials in "
        "`sudo dmesg | tail`"
    )


def _in_container(proc: Path) -> bool:
    """A best guess: the usual marker files, PID 1's `container=`, or a container cgroup."""
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    try:
        environ = (proc / "1/environ").read_bytes().split(b"\0")
    except OSError:
        environ = []
    if any(entry.startswith(b"container=") for entry in environ):
        return True
    try:
        cgroup = (proc / "1/cgroup").read_text(errors="replace")
    except OSError:
        return False
    return any(word in cgroup for word in ("docker", "lxc", "kubepods", "containerd", "libpod"))


# ----- helpers ------------------------------------------------------------------------------------


def _host(proc: Path, etc: Path, dev: Path, which: Which, euid: int | None) -> _Host:
    return _Host(which, proc, etc, dev, os.geteuid() if euid is None else euid)


def _skipped(name: str, needed_by: str, why: str, first: str) -> Check:
    return Check(name, needed_by, False, f"{SKIPPED}{why}", f"fix '{first}' first")


def _sysctl(key: str, value: str) -> str:
    return (
        f"sudo sysctl -w {key}={value} "
        f"(to keep it after a reboot: echo {key}={value} | sudo tee -a {SYSCTL_FILE})"
    )


def _output(argv: list[str]) -> str | None:
    """stdout and stderr of a quick command that succeeded, or None."""
    try:
        result = _quiet_run(argv, VERSION_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout + result.stderr if result.returncode == 0 else None


def _quiet_run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        check=False,
    )


def _version(text: str) -> tuple[int, ...] | None:
    found = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in found.group(0).split(".")) if found else None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _has_cap(proc: Path, cap: int) -> bool:
    """Whether this process has `cap` in its effective set, per /proc/self/status."""
    try:
        status = (proc / "self/status").read_text()
    except OSError:
        return False
    found = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", status, re.MULTILINE)
    return bool(found and int(found.group(1), 16) >> cap & 1)


def _usr_true(root: Path) -> str:
    """`true` as the sandbox sees it: it must live under /usr, the only tree bound whole."""
    for directory in ("usr/bin", "usr/local/bin", "usr/sbin"):
        if (root / directory / "true").is_file():
            return f"/{directory}/true"
    return "/usr/bin/true"


def _one_line(text: str) -> str:
    """Lines joined by one space (inner spacing kept): a report line never spans two."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
