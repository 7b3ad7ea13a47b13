"""Isolation: a mount never reaches into another mount, secrets stay hidden on storage that folds
case, and nothing can read around the daemon.

Every access to a mount runs in a child process with a timeout (a hang fails the test instead of
blocking the suite; the child's process group is killed), and every mount made here — sandboxfs,
bindfs, tmpfs, bind, loop — is undone in `finally`, lazily when a plain unmount does not work. Two
daemons deadlocked on each other's requests do not even die of SIGKILL, so a sandboxfs mount whose
daemon no longer answers has its FUSE connection aborted (fusectl) before it is unmounted.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.support.bounded import (
    ACCESS,
    EACCES_TEXT,
    ENOENT_TEXT,
    Hang,
    Live,
    Runner,
    is_mountpoint,
    process_alive,
    run,
    sandbox_mount,
)
from tests.support.mounts import make_project

NOBODY_UID = 65534
NOBODY = ["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups", "--"]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, losetup, setpriv)")


# ----- running things ----------------------------------------------------------------------------


def prefixed(prefix: Sequence[str], home: Path | None = None) -> Runner:
    """`run`, with every command started through `prefix` (setpriv ...), HOME=`home`."""
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}

    def runner(argv: Sequence[str | Path], timeout: float = ACCESS) -> Any:
        return run([*prefix, *argv], timeout, env if home else None, home)

    return runner


def absent(result: subprocess.CompletedProcess[str], what: str = "") -> str | None:
    """None when the command failed with ENOENT, else a description of what happened."""
    if result.returncode != 0 and ENOENT_TEXT in result.stderr:
        return None
    return (
        f"{what or result.args}: expected '{ENOENT_TEXT}', got rc={result.returncode} "
        f"stdout={result.stdout[:200]!r} stderr={result.stderr.strip()[:300]!r}"
    )


def check(problems: list[str], outcome: str | None) -> None:
    if outcome is not None:
        problems.append(outcome)


def attempt(problems: list[str], fn: Any, *args: Any) -> Any:
    """fn(*args); when it fails (a Hang: then later probes would only hang too), the test ends
    naming every problem found so far."""
    try:
        return fn(*args)
    except AssertionError as exc:
        raise AssertionError("\n".join([*problems, f"{type(exc).__name__}: {exc}"])) from None


def listing(path: Path, problems: list[str], *flags: str) -> list[str]:
    result = attempt(problems, run, ["ls", *flags, path])
    if result.returncode != 0:
        problems.append(f"ls {' '.join(flags)} {path}: rc={result.returncode} {result.stderr!r}")
    return str(result.stdout).split()


# ----- sandboxfs mounts --------------------------------------------------------------------------


@contextmanager
def foreign_mounts() -> Iterator[list[Path]]:
    """A list to append mountpoints of non-sandboxfs mounts to; each is lazily unmounted in
    `finally`, the last first."""
    mounts: list[Path] = []
    try:
        yield mounts
    finally:
        for mp in reversed(mounts):
            if is_mountpoint(mp):
                with suppress(Hang):
                    run(["umount", "-l", mp], 10)


def mount_foreign(mounts: list[Path], argv: Sequence[str | Path], mountpoint: Path) -> None:
    result = run(argv, 20)
    if is_mountpoint(mountpoint):
        mounts.append(mountpoint)
    assert result.returncode == 0, f"{argv}: {result.stderr}"
    assert is_mountpoint(mountpoint), argv


def assert_answers(m: Live) -> None:
    """The daemon lives and its mount answers within a few seconds."""
    assert process_alive(m.pid), f"daemon {m.pid} of {m.mnt} died"
    assert m.context()["session"] == m.session


def assert_no_crossing(mounts: Sequence[Live]) -> None:
    """No mount's audit log, nor (for --debug mounts) its request log, names another mount's
    daemon as a caller. Call once all are unmounted (audit entries are then flushed)."""
    problems = []
    for m in mounts:
        others = {tid for o in mounts if o is not m for tid in o.tids}
        entries = m.audit()
        assert entries, f"no audit entries for session {m.session} (at least its mount)"
        for e in entries:
            if e.get("pid") in others:
                problems.append(f"audit of {m.mnt.name} has a daemon as caller: {e}")
        if m.debug_log is not None:
            seen = m.requesters() & others
            if seen:
                problems.append(f"{m.mnt.name} received FUSE requests from daemons {seen}")
    assert not problems, "\n".join(problems)


# ----- 1. a mount never reaches into another mount -----------------------------------------------


def test_sandboxfs_mounts_inside_the_project_never_reach_each_other(tmp_path: Path) -> None:
    """The reproduction: mounts b (full) and a (workspace) inside their own project. Through
    /repo each one's mountpoint is absent; the paths that used to hang both daemons fail fast."""
    p = make_project(tmp_path)
    problems: list[str] = []
    with ExitStack() as stack:
        b = stack.enter_context(
            sandbox_mount(
                p / "mnt-b", p, "full", "--workspace", "wsb", debug_log=tmp_path / "b.log"
            )
        )
        made = run(f"echo private > {b.mnt}/session/working/b.txt")
        assert made.returncode == 0, made.stderr
        a = stack.enter_context(
            sandbox_mount(p / "mnt-a", p, "workspace", debug_log=tmp_path / "a.log")
        )
        probes = [
            ["cat", a.mnt / "repo/mnt-b/session/working/b.txt"],
            ["cat", a.mnt / "repo/mnt-b/repo/mnt-a/.sandboxfs/context.json"],
            ["cat", b.mnt / "repo/mnt-a/.sandboxfs/context.json"],
            ["cat", b.mnt / "repo/mnt-a/repo/mnt-b/session/working/b.txt"],
            ["stat", a.mnt / "repo/mnt-b"],
            ["ls", a.mnt / "repo/mnt-b"],
            ["stat", b.mnt / "repo/mnt-a"],
            ["stat", a.mnt / "repo/mnt-a"],  # its own mountpoint, hidden by identity
        ]
        for probe in probes:
            result = attempt(problems, run, probe)
            check(problems, absent(result))
        for m in (a, b):
            names = listing(m.mnt / "repo", problems, "-a")
            if not {"README.md", "src"} <= set(names) or {"mnt-a", "mnt-b"} & set(names):
                problems.append(f"ls -a {m.mnt}/repo: {names}")
            listing(m.mnt / "repo", problems, "-la")  # stats every entry: must not hang
        for m in (a, b):
            attempt(problems, assert_answers, m)
            m.note_threads()
        assert not problems, "\n".join(problems)
        a.umount()
        b.umount()
    assert b.session != a.session
    assert_no_crossing([a, b])


def test_three_mounts_in_a_cycle_never_hang_nor_cross(tmp_path: Path) -> None:
    """Three mounts with ordinary names inside one project, each probing the others (and the
    cycles through them) through /repo, all probes at once: all absent, nothing hangs."""
    p = make_project(tmp_path)
    levels = {
        "build": ("workspace",),
        "dist": ("full", "--workspace", "w2"),
        "out": ("full", "--workspace", "w3"),
    }
    problems: list[str] = []
    with ExitStack() as stack:
        mounts = {n: stack.enter_context(sandbox_mount(p / n, p, *lv)) for n, lv in levels.items()}
        for name, m in mounts.items():
            made = run(f"echo {name} > {m.mnt}/session/working/f.txt")
            assert made.returncode == 0, made.stderr
        probes: list[list[str | Path]] = []
        for x in mounts:
            for y in mounts:
                if x == y:
                    continue
                (z,) = set(mounts) - {x, y}
                via = p / x / "repo" / y
                probes += [
                    ["cat", via / "session/working/f.txt"],
                    ["cat", via / ".sandboxfs/context.json"],
                    ["cat", via / "repo" / z / "repo" / x / ".sandboxfs/context.json"],
                    ["ls", via / "repo"],
                ]
        with ThreadPoolExecutor(max_workers=len(probes)) as pool:
            futures = [pool.submit(run, probe) for probe in probes]
            for future in futures:
                try:
                    check(problems, absent(future.result()))
                except Hang as exc:
                    problems.append(str(exc))
        assert not any("hung" in problem for problem in problems), "\n".join(problems)
        for m in mounts.values():
            names = set(listing(m.mnt / "repo", problems, "-a"))
            if "README.md" not in names or names & set(mounts):
                problems.append(f"ls -a {m.mnt}/repo: {sorted(names)}")
        for m in mounts.values():
            attempt(problems, assert_answers, m)
            m.note_threads()
        assert not problems, "\n".join(problems)
        for m in mounts.values():
            m.umount()
    assert_no_crossing(list(mounts.values()))


@needs_root
def test_other_kinds_of_mounts_in_backing_storage_are_absent(tmp_path: Path) -> None:
    """bindfs, tmpfs, a bind mount of a directory and of a file, in the project (before and
    after sandboxfs mounted it) and in a session's directory: absent through the mount, left
    out of listings, nothing created in them."""
    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed (apt-get install bindfs)")
    p = make_project(tmp_path)
    src = tmp_path / "outside-src"
    src.mkdir()
    (src / "secret.txt").write_text("outside\n")
    src_file = tmp_path / "outside-file.txt"
    src_file.write_text("outside file\n")
    for name in ("vendor", "tmp", "build", "late"):
        (p / name).mkdir()
    (p / "notes.txt").write_text("underneath\n")
    problems: list[str] = []
    with foreign_mounts() as mounts:
        mount_foreign(mounts, ["mount", "--bind", src, p / "vendor"], p / "vendor")
        mount_foreign(mounts, ["mount", "-t", "tmpfs", "-o", "size=1m", "t", p / "tmp"], p / "tmp")
        (p / "tmp" / "secret.txt").write_text("in tmpfs\n")
        mount_foreign(mounts, ["mount", "--bind", src_file, p / "notes.txt"], p / "notes.txt")
        with sandbox_mount(tmp_path / "mnt", p, "full") as m:
            repo = m.mnt / "repo"
            # `late` is known to the kernel and the daemon before something is mounted on it.
            assert run(["ls", repo / "late"]).returncode == 0
            mount_foreign(mounts, ["bindfs", src, p / "build"], p / "build")
            mount_foreign(mounts, ["mount", "-t", "tmpfs", "t", p / "late"], p / "late")
            (p / "late" / "secret.txt").write_text("late tmpfs\n")
            scratch = p / ".sandbox/workspaces/default/sessions" / m.session / "working/scratch"
            scratch.mkdir()
            mount_foreign(mounts, ["mount", "-t", "tmpfs", "t", scratch], scratch)
            (scratch / "secret.txt").write_text("session tmpfs\n")

            for name in ("vendor", "tmp", "build"):
                for probe in (["cat", repo / name / "secret.txt"], ["stat", repo / name]):
                    result = attempt(problems, run, probe)
                    check(problems, absent(result))
                result = attempt(problems, run, ["touch", repo / name / "new.txt"])
                check(problems, absent(result))
            for probe in (
                ["cat", repo / "notes.txt"],
                ["cat", m.mnt / "session/working/scratch/secret.txt"],
                ["stat", m.mnt / "session/working/scratch"],
            ):
                result = attempt(problems, run, probe)
                check(problems, absent(result))
            late = attempt(problems, run, ["cat", repo / "late" / "secret.txt"])
            if late.returncode == 0:
                problems.append(f"read a file in a tmpfs mounted on a known directory: {late}")
            # The kernel still knows /repo/late, so this may fail (ENOENT, ESTALE) or show
            # the empty directory underneath; it must not show the tmpfs.
            late = attempt(problems, run, ["ls", "-a", repo / "late"])
            if "secret.txt" in late.stdout:
                problems.append(f"ls /repo/late lists the tmpfs mounted on it: {late.stdout!r}")
            names = set(listing(repo, problems, "-a"))
            hidden = {"vendor", "tmp", "build", "notes.txt"}
            if "README.md" not in names or names & hidden:
                problems.append(f"ls -a /repo: {sorted(names)}")
            long = attempt(problems, run, ["ls", "-la", repo])
            if long.returncode != 0 or long.stderr:
                problems.append(f"ls -la /repo: rc={long.returncode} {long.stderr!r}")
            if "scratch" in listing(m.mnt / "session/working", problems, "-a"):
                problems.append("ls /session/working lists the tmpfs in the session's directory")
            created = [str(f) for f in (src / "new.txt", p / "tmp" / "new.txt") if f.exists()]
            if created:
                problems.append(f"created inside another mount: {created}")
            attempt(problems, assert_answers, m)
            assert not problems, "\n".join(problems)


# ----- 2. secrets stay unreadable whatever the case ---------------------------------------------


def refused(result: subprocess.CompletedProcess[str], what: str) -> str | None:
    """None when the command failed with EACCES, else a description of what happened."""
    if result.returncode != 0 and EACCES_TEXT in result.stderr:
        return None
    return (
        f"{what}: expected '{EACCES_TEXT}', got rc={result.returncode} "
        f"stdout={result.stdout[:200]!r} stderr={result.stderr.strip()[:300]!r}"
    )


# Names that are never created through the mount, in any spelling (the deny list's names).
NEW_DENIED = (".eNV", ".NetRC", ".Env.Prod")


def check_secrets_refused(
    m: Live, refused_spellings: Sequence[str], absent_spellings: Sequence[str], problems: list[str]
) -> None:
    """Deny-listed entries and private keys are shown but their contents refused (EACCES), in
    every spelling; sandboxfs's state looks absent; deny-listed names are never created."""
    repo = m.mnt / "repo"
    for rel in refused_spellings:
        result = attempt(problems, run, ["cat", repo / rel])
        check(problems, refused(result, f"cat /repo/{rel}"))
    for rel in absent_spellings:
        result = attempt(problems, run, ["cat", repo / rel])
        check(problems, absent(result, f"cat /repo/{rel}"))
    for new in NEW_DENIED:
        result = attempt(problems, run, f"echo x > {repo / new}")
        if result.returncode == 0 or EACCES_TEXT not in result.stderr:
            problems.append(f"create /repo/{new}: rc={result.returncode} {result.stderr!r}")


CASE_FOLDED_SECRETS = (".env", ".env.local", "id_rsa", "server.pem", "deploy.key", ".ssh/config")
# What the private-key files hold (assembled here, so no scanner mistakes the test for a leak).
KEY_TEXT = "-----BEGIN " + "PRIVATE KEY-----\nsecret\n"


def make_secrets(project: Path) -> None:
    (project / ".ssh").mkdir()
    (project / "config").mkdir()
    for rel in CASE_FOLDED_SECRETS:
        key = rel in ("id_rsa", "server.pem", "deploy.key")
        (project / rel).write_text(KEY_TEXT if key else "secret\n")
    (project / "config" / "production.yaml").write_text("password: hunter2\n")
    (project / "config" / "staging.yaml").write_text("fine: yes\n")
    (project / "README.md").write_text("# p\n")
    (project / "sandboxfs.yaml").write_text("deny:\n  - config/production.yaml\n")


@contextmanager
def casefold_ext4(tmp_path: Path) -> Iterator[Path]:
    """An empty casefolded directory on a loop-mounted ext4 made with -O casefold; skips when
    this machine cannot make one. Unmounted and its loop device detached in `finally`."""
    img, top = tmp_path / "casefold.img", tmp_path / "casefold"
    top.mkdir()
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    made = run(["mkfs.ext4", "-q", "-O", "casefold", img], 60)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 cannot make a casefold filesystem: {made.stderr.strip()}")
    attached = run(["losetup", "--find", "--show", img], 30)
    if attached.returncode != 0:
        pytest.skip(f"no loop device: {attached.stderr.strip()}")
    device = attached.stdout.strip()
    try:
        mounted = run(["mount", device, top], 30)
        if mounted.returncode != 0:
            dmesg = run("dmesg 2>/dev/null | grep -i -e casefold -e unicode | tail -1")
            pytest.skip(
                "cannot mount a casefold ext4 here (kernel without CONFIG_UNICODE?): "
                f"{mounted.stderr.strip()} {dmesg.stdout.strip()}"
            )
        try:
            project = top / "p"
            project.mkdir()
            folded = run(["chattr", "+F", project])
            if folded.returncode != 0:
                pytest.skip(f"chattr +F (casefold) refused: {folded.stderr.strip()}")
            yield project
        finally:
            if is_mountpoint(top):
                with suppress(Hang):
                    run(["umount", top], 30)
            if is_mountpoint(top):
                run(["umount", "-l", top], 30)
    finally:
        run(["losetup", "-d", device], 30)


@needs_root
def test_secrets_stay_unreadable_on_case_folding_storage(tmp_path: Path) -> None:
    with casefold_ext4(tmp_path) as p:
        make_secrets(p)
        assert (p / ".ENV").read_text() == "secret\n", "the directory does not fold case"
        problems: list[str] = []
        with sandbox_mount(tmp_path / "mnt", p, "full") as m:
            refused_spellings = [
                ".ENV",
                ".Env",
                ".env",
                ".ENV.Local",
                "ID_RSA",
                "Server.Pem",
                "DEPLOY.KEY",
                ".SSH/config",
                ".Ssh/CONFIG",
                "CONFIG/Production.YAML",
                "config/production.yaml",
            ]
            absent_spellings = [".SANDBOX/audit.jsonl", ".Sandbox", ".sandbox"]
            check_secrets_refused(m, refused_spellings, absent_spellings, problems)
            for spelling in ("SERVER.PEM", "Deploy.Key"):  # an existing key: never rewritten
                result = attempt(problems, run, f"echo x > {m.mnt / 'repo' / spelling}")
                check(problems, refused(result, f"echo x > /repo/{spelling}"))
            names = {n.casefold() for n in listing(m.mnt / "repo", problems, "-a")}
            for shown in (".env", ".env.local", "id_rsa", "server.pem", ".ssh"):
                if shown not in names:
                    problems.append(f"ls -a /repo does not show {shown}: {sorted(names)}")
            if ".sandbox" in names:
                problems.append(f"ls -a /repo shows .sandbox (some case): {sorted(names)}")
            config = {n.casefold() for n in listing(m.mnt / "repo" / "CONFIG", problems, "-a")}
            if not {"production.yaml", "staging.yaml"} <= config:
                problems.append(f"ls -a /repo/CONFIG: {sorted(config)}")
            if (p / "server.pem").read_text() != KEY_TEXT:
                problems.append("writing SERVER.PEM through the mount changed server.pem")
            attempt(problems, assert_answers, m)
        assert not problems, "\n".join(problems)


def test_deny_patterns_ignore_case_and_canonical_equivalence(tmp_path: Path) -> None:
    """On case-sensitive storage too: names that differ from a deny pattern only in case, or by
    a canonically equivalent character (KELVIN SIGN is K), are refused."""
    p = tmp_path / "p"
    p.mkdir()
    make_secrets(p)
    odd = [".ENV", ".Env.Local", "ID_RSA", "Id_Ed25519", "Server.PEM", "deploy.\u212aEY"]
    for rel in [*odd, ".SSH/config", ".Aws/credentials", "CONFIG/Production.YAML"]:
        (p / rel).parent.mkdir(exist_ok=True)
        (p / rel).write_text(KEY_TEXT)
    problems: list[str] = []
    with sandbox_mount(tmp_path / "mnt", p, "full") as m:
        spellings = [*odd, ".SSH/config", ".Aws/credentials", "CONFIG/Production.YAML"]
        check_secrets_refused(m, spellings, [], problems)
        names = set(listing(m.mnt / "repo", problems, "-a"))
        missing = {*odd, ".SSH", ".Aws", ".env", "id_rsa", "server.pem", ".ssh"} - names
        if missing or "README.md" not in names:
            problems.append(f"ls -a /repo does not show {sorted(missing)}: {sorted(names)}")
        for directory in (".SSH", ".Aws"):
            result = attempt(problems, run, ["ls", m.mnt / "repo" / directory])
            check(problems, refused(result, f"ls /repo/{directory}"))
        created = [n for n in NEW_DENIED if (p / n).exists()]
        if created:
            problems.append(f"created in the project: {created}")
        attempt(problems, assert_answers, m)
    assert not problems, "\n".join(problems)


# ----- 3. nothing can read around the daemon -----------------------------------------------------


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory below /tmp that every user can traverse (pytest's are 0700), removed after."""
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-isolation-", dir="/tmp"))
    try:
        root.chmod(0o755)
        yield root
    finally:
        if is_mountpoint(root / "mnt"):
            run(["fusermount3", "-u", "-z", root / "mnt"], 10)
        shutil.rmtree(root, ignore_errors=True)


_PTRACE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)
pid = int(sys.argv[1])
if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
    print("ERR", os.strerror(ctypes.get_errno()))
else:
    os.waitpid(pid, 0)
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    print("OK")
"""
# uid 0 without CAP_SYS_PTRACE (a container's root): the daemon and the prober both run so,
# with equal capabilities, and only the daemon's dumpable flag stands in the way.
NO_PTRACE = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"]


@needs_root
@pytest.mark.parametrize("who", ["nobody", "root-without-cap-sys-ptrace"])
def test_same_uid_cannot_reach_into_the_daemon(who: str, open_tmp: Path) -> None:
    """A daemon run by an ordinary user: another process of that user can neither list nor
    open the daemon's descriptors under /proc, nor ptrace it; a plain process of the same user,
    for comparison, can be. The same for root without CAP_SYS_PTRACE (listing /proc/PID/fd is
    then allowed: a non-dumpable process's /proc files belong to root)."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    nobody = who == "nobody"
    as_user = prefixed(NOBODY, open_tmp) if nobody else prefixed(NO_PTRACE)
    if nobody:
        os.chown(open_tmp, NOBODY_UID, NOBODY_UID)
        usable = as_user([sys.executable, "-c", "import sandboxfs.cli.main, pyfuse3"], 30)
        if usable.returncode != 0:
            pytest.skip(f"nobody cannot run {sys.executable} with sandboxfs: {usable.stderr}")
        fuse = as_user(["test", "-r", "/dev/fuse", "-a", "-w", "/dev/fuse"])
        if fuse.returncode != 0:
            mode = oct(os.stat("/dev/fuse").st_mode & 0o777)
            pytest.skip(f"/dev/fuse is {mode} here: sandboxfs refuses to mount for nobody")
    project = make_project(open_tmp)
    (open_tmp / "mnt").mkdir()
    if nobody:
        run(["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", project, open_tmp / "mnt"])
    problems: list[str] = []
    with sandbox_mount(open_tmp / "mnt", project, "full", runner=as_user) as m:
        owner = Path(f"/proc/{m.pid}/status").read_text()
        uid = NOBODY_UID if nobody else 0
        assert re.search(rf"^Uid:\s+{uid}\s", owner, re.M), f"the daemon is not uid {uid}'s"
        fd_dir = f"/proc/{m.pid}/fd"
        listed = as_user(["ls", fd_dir])
        if nobody and (listed.returncode == 0 or EACCES_TEXT not in listed.stderr):
            problems.append(f"ls {fd_dir}: rc={listed.returncode} {listed.stdout!r}")
        for n in (3, 4, 5, 6):
            opened = as_user([sys.executable, "-c", f"open('{fd_dir}/{n}', 'rb')"])
            if opened.returncode == 0:
                problems.append(f"opened {fd_dir}/{n} (ls: {listed.stdout.split()})")
        traced = as_user([sys.executable, "-c", _PTRACE, str(m.pid)])
        if traced.stdout.strip() != "ERR Operation not permitted":
            problems.append(f"ptrace attach of the daemon: {traced.stdout} {traced.stderr}")
        # The control: the same probes succeed against an ordinary process of the same user.
        prefix = NOBODY if nobody else NO_PTRACE
        sleeper = subprocess.Popen(
            [*prefix, "sleep", "30"], stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            time.sleep(0.2)
            control = as_user([sys.executable, "-c", f"open('/proc/{sleeper.pid}/fd/0', 'rb')"])
            assert control.returncode == 0, f"control: {control.stderr}"
            control = as_user([sys.executable, "-c", _PTRACE, str(sleeper.pid)])
            assert control.stdout.strip() == "OK", f"control: {control.stdout} {control.stderr}"
        finally:
            sleeper.kill()
            sleeper.wait(timeout=10)
        attempt(problems, assert_answers, m)
        m.umount()
    assert not problems, "\n".join(problems)
