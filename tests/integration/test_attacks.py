"""Attacks on a live mount: each must fail, leave nothing behind outside the zones, and — when
it is a policy refusal — be audited with a reason. After every test the daemon is still alive,
the mount still answers and the audit chain still verifies.

The attacks are made with real programs (sh, ln, mv, cat, touch, setfattr, ...) and, for
system calls that no tool exposes, with small python subprocesses calling os.* directly.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sandboxfs, sh
from tests.support.mounts import Mount, denial, make_project, mounted_fs

ZONES = ("session", "workspace", "repo", "staged", "workers")

# A python prologue for syscall probes: `attempt(fn, *args)` gives OK or the errno name.
_PROBE = """
import ctypes, ctypes.util, errno, os, socket, stat, sys
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
RENAME_EXCHANGE = 2
def renameat2(src, dst, flags):
    if libc.renameat2(-100, os.fsencode(src), -100, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
def create(path, mode=0o644):
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, mode))
def bind(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(path)
    finally:
        s.close()
def attempt(fn, *args):
    try:
        fn(*args)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "OK"
"""


def syscall(statement: str) -> str:
    """Run one python expression in a subprocess: "OK", or the errno name it failed with."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE + f"print(attempt(lambda: {statement}))"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# ----- helpers -------------------------------------------------------------------------------


def backing(m: Mount, zone: str) -> Path:
    """The backing directory of a zone of mount m."""
    ws = m.project / ".sandbox" / "workspaces" / m.workspace
    return {
        "session": ws / "sessions" / m.session,
        "workspace": ws / "workspace",
        "repo": m.project,
        "staged": ws / "staged",
        "workers": m.project / ".workers",
    }[zone]


def crossing(
    m: Mount,
    path: str,
    op: str,
    dest: str,
    entries: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The entry of a rename or link refused with EXDEV for crossing zones. It is no policy
    denial (`mv` then copies and deletes, each checked on its own): recorded with
    `allowed: null`, so it is looked for among all entries, not `audit --denied`."""
    matches = [
        e
        for e in (entries if entries is not None else m.audit())
        if e["op"] == op and e["path"] == path and e.get("dest") == dest
    ]
    assert matches, f"no {op} of {path} to {dest} audited"
    entry = matches[-1]
    assert "allowed" in entry and entry["allowed"] is None, entry
    assert entry["errno"] == "EXDEV", entry
    assert "cannot cross zones" in entry["reason"], entry
    assert entry["session"] == m.session
    return entry


def refused(result: subprocess.CompletedProcess[str], message: str | None = None) -> None:
    """The command failed (with `message` on stderr), and not with an internal error."""
    assert result.returncode != 0, result
    if message is not None:
        assert message in result.stderr, result.stderr
    assert "Input/output error" not in result.stderr, result.stderr


def assert_healthy(m: Mount, pid: int, session_gone: bool = False) -> None:
    """The daemon survived, the mount answers, nothing went wrong inside, the chain verifies."""
    os.kill(pid, 0)
    listing = sh(f"ls {m.mnt}", timeout=10)
    assert listing.stdout.split() == sorted(ZONES), listing
    if not session_gone:
        assert sh(f"ls {m.mnt}/session/working > /dev/null", timeout=10).returncode == 0
    assert sh(f"ls {m.mnt}/workers", timeout=10).returncode == 0
    # An unexpected exception in a callback is logged ("internal error in ...") and audited.
    log = m.project / ".sandbox" / "logs" / f"{m.session}.log"
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "internal error" not in text, text
    verified = sandboxfs("audit", "verify", "--project", m.project)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def sneaky_target(link_dir: Path, outside: Path) -> str:
    """Relative symlink text that, read in `link_dir` (backing storage), names `outside`.

    `outside` lies below a directory with a unique name, and the text climbs exactly to the
    common ancestor. Read inside the (shallower) mount, the same text climbs to a different
    directory, where that unique name does not exist: the caller's kernel, which resolves link
    text seen through the mount, finds nothing there. Only a daemon that followed the link in
    backing storage could reach `outside`.
    """
    return os.path.relpath(outside, link_dir)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    target = tmp_path / "sandboxfs-attack-outside-7f3a" / "outside"
    target.mkdir(parents=True)
    return target


# ----- symlinks planted in backing storage ----------------------------------------------------


def test_planted_symlinks_are_shown_unchanged(
    mount_at: Callable[..., Any], project: Path, outside: Path
) -> None:
    (project / "passwd-link").symlink_to("/etc/passwd")
    (project / "out-link").symlink_to("../../outside")
    (project / "evil").symlink_to(outside)
    (outside / "secret.txt").write_text("outside\n")
    with mount_at("full") as m:
        pid = m.daemon_pid()
        assert sh(f"readlink {m.mnt}/repo/passwd-link").stdout == "/etc/passwd\n"
        assert sh(f"readlink {m.mnt}/repo/out-link").stdout == "../../outside\n"
        assert sh(f"readlink {m.mnt}/repo/evil").stdout == f"{outside}\n"
        assert stat.S_ISLNK(os.lstat(m.mnt / "repo" / "evil").st_mode)
        nofollow = "os.O_RDONLY | os.O_NOFOLLOW"
        for name in ("passwd-link", "evil"):
            assert syscall(f"os.open({str(m.mnt / 'repo' / name)!r}, {nofollow})") == "ELOOP"
        # Following them is the caller's kernel's business: an absolute link reads the host file.
        assert sh(f"cat {m.mnt}/repo/passwd-link").stdout == Path("/etc/passwd").read_text()
        assert sh(f"ls {m.mnt}/repo/evil/").stdout.split() == ["secret.txt"]
        # Listing the repo shows the links as links.
        long = sh(f"ls -l {m.mnt}/repo").stdout
        assert f"evil -> {outside}" in long
        assert "passwd-link -> /etc/passwd" in long
        assert_healthy(m, pid)


def test_cached_directory_replaced_by_symlink(mount_at: Callable[..., Any], outside: Path) -> None:
    """A directory the kernel has cached is swapped for a symlink in backing storage: creating
    inside it through the mount must not create anything in the symlink's target.

    Three variants: the directory was listed (the daemon holds a descriptor of it) and then
    removed, or renamed away; or it was only looked up, never listed, so the daemon must
    resolve it by name from its parent's descriptor when asked to create inside it.
    """
    hows = ("removed", "renamed-away", "never-opened")
    with mount_at("full") as m:
        pid = m.daemon_pid()
        working = m.mnt / "session" / "working"
        real = backing(m, "session") / "working"
        for how in hows:
            made = sh(f"mkdir -p {working}/{how}/sub && touch {working}/{how}/sub/old")
            assert made.returncode == 0, made.stderr
            if how == "never-opened":
                assert sh(f"stat {working}/{how}/sub").returncode == 0
            else:
                assert sh(f"ls {working}/{how} {working}/{how}/sub").returncode == 0
        for how in hows:
            parent = real / how
            if how == "renamed-away":
                (parent / "sub").rename(real / "sub.moved")
            else:
                assert sh(f"rm -rf {parent}/sub").returncode == 0
            (parent / "sub").symlink_to(sneaky_target(parent, outside))
            assert (parent / "sub").resolve() == outside
        for how in hows:
            sub = working / how / "sub"
            for command in (
                f"touch {sub}/x",
                f"mkdir {sub}/y",
                f"sh -c 'echo pwned > {sub}/z'",
                f"ln -s /etc {sub}/w",
            ):
                result = sh(command, timeout=10)
                if how != "renamed-away":
                    refused(result)
                assert "Input/output error" not in result.stderr, (how, result.stderr)
        assert list(outside.iterdir()) == []
        # The descriptor of the renamed directory followed it: whatever landed, landed there.
        assert {p.name for p in (real / "sub.moved").iterdir()} <= {"old", "x", "y", "z", "w"}
        assert_healthy(m, pid)


def test_planted_workers_and_state_dir_symlinks(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path, outside: Path
) -> None:
    """A repo that arrives with `.workers` or `.sandbox` as symlinks to somewhere else: the
    daemon neither lists nor creates through them."""
    (outside / "secret.worker").write_text("name: outside\n")
    workers = project / ".workers"
    workers.rename(tmp_path / "workers.real")
    workers.symlink_to(outside)
    with mount_at("full") as m:
        pid = m.daemon_pid()
        assert sh(f"ls {m.mnt}/workers").stdout.split() == []
        refused(sh(f"cat {m.mnt}/workers/secret.worker"))
        refused(sh(f"sh -c 'echo x > {m.mnt}/workers/new.worker'"))
        refused(sh(f"mkdir {m.mnt}/workers/dir"))
        assert sorted(p.name for p in outside.iterdir()) == ["secret.worker"]
        assert workers.is_symlink()
        assert_healthy(m, pid)
    # A planted state dir: mounting refuses with one clear line and mounts nothing.
    sandbox = project / ".sandbox"
    sandbox.rename(tmp_path / "sandbox.real")
    sandbox.symlink_to(outside)
    mnt = tmp_path / "mnt-planted"
    mnt.mkdir()
    result = sandboxfs("mount", mnt, "--project", project, "--trust", "full")
    try:
        assert result.returncode != 0, result
        assert "is not a directory" in result.stderr, result.stderr
    finally:
        if os.path.ismount(mnt):
            sandboxfs("umount", mnt)
    assert not os.path.ismount(mnt)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.worker"]


def test_directory_symlink_swap_race(
    mount_at: Callable[..., Any], tmp_path: Path, outside: Path
) -> None:
    """A background thread swaps a backing directory with a symlink to outside, over and over,
    while the foreground keeps creating files and directories through the mount (with kernel
    caching off, so that every name is resolved by the daemon again)."""
    config = tmp_path / "nocache.yaml"
    config.write_text("cache:\n  entry_timeout: 0\n  attr_timeout: 0\n")
    with mount_at("full", "--config", str(config)) as m:
        pid = m.daemon_pid()
        working = backing(m, "session") / "working"
        race, real, link = working / "race", working / "race.real", working / "race.link"
        assert sh(f"mkdir {m.mnt}/session/working/race").returncode == 0
        link.symlink_to(sneaky_target(working, outside))
        assert link.resolve() == outside
        stop = threading.Event()
        swaps = 0

        def swapper() -> None:
            nonlocal swaps
            while not stop.is_set() and swaps < 400:
                os.rename(race, real)
                os.rename(link, race)
                os.rename(race, link)
                os.rename(real, race)
                swaps += 1

        thread = threading.Thread(target=swapper)
        thread.start()
        try:
            loop = sh(
                "i=0; while [ $i -lt 100 ]; do i=$((i+1)); "
                "mkdir race/d$i 2>/dev/null; echo x > race/d$i/f 2>/dev/null; "
                "echo y > race/f$i 2>/dev/null; ls race >/dev/null 2>&1; done; true",
                cwd=m.mnt / "session" / "working",
                timeout=60,
            )
        finally:
            stop.set()
            thread.join()
        assert loop.returncode == 0, loop.stderr
        assert swaps > 0
        assert list(outside.iterdir()) == []
        assert sh(f"ls {m.mnt}/session/working/race > /dev/null").returncode == 0
        assert_healthy(m, pid)


# ----- hard links and renames across zones ----------------------------------------------------


def test_links_and_renames_across_zones_are_exdev(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        pid = m.daemon_pid()
        for zone in ZONES:
            assert sh(f"echo {zone} > {m.mnt}/{zone}/attack-{zone}.txt").returncode == 0
        expected = []
        for src in ZONES:
            for dst in ZONES:
                if src == dst:
                    continue
                source = f"{m.mnt}/{src}/attack-{src}.txt"
                linked = sh(f"ln {source} {m.mnt}/{dst}/link-from-{src}")
                refused(linked, "Invalid cross-device link")
                moved = f"{m.mnt}/{dst}/moved-from-{src}"
                renamed = syscall(f"os.rename({source!r}, {moved!r})")
                assert renamed == "EXDEV", (src, dst, renamed)
                expected.append(("link", src, f"/{dst}/link-from-{src}"))
                expected.append(("rename", src, f"/{dst}/moved-from-{src}"))
        entries = m.audit()
        for op, src, dest in expected:
            crossing(m, f"/{src}/attack-{src}.txt", op, dest, entries)
        # Crossing zones is no policy denial: none of them shows among the denials.
        assert not [e for e in m.audit("--denied") if e["errno"] == "EXDEV"]
        for zone in ZONES:
            names = {p.name for p in backing(m, zone).iterdir()}
            assert not {n for n in names if "-from-" in n}, (zone, names)
            assert (backing(m, zone) / f"attack-{zone}.txt").read_text() == f"{zone}\n"
        assert_healthy(m, pid)


# ----- the deny list --------------------------------------------------------------------------


def test_renaming_and_linking_to_deny_listed_names(
    mount_at: Callable[..., Any], project: Path
) -> None:
    with mount_at("full") as m:
        pid = m.daemon_pid()
        repo = m.mnt / "repo"
        working = m.mnt / "session" / "working"
        assert sh(f"echo data > {repo}/x.txt").returncode == 0
        denied = "Permission denied"
        # command -> (virtual path audited, message, op audited there)
        attacks = {
            f"mv {repo}/x.txt {repo}/.env": ("/repo/.env", denied, "rename"),
            f"mv {repo}/x.txt {repo}/.netrc": ("/repo/.netrc", denied, "rename"),
            # .ssh exists (and is shown): mv moves into it, which the deny list refuses.
            f"mv {repo}/x.txt {repo}/.ssh": ("/repo/.ssh/x.txt", denied, "rename"),
            f"mv {repo}/src {repo}/.aws": ("/repo/.aws", denied, "rename"),
            f"ln {repo}/x.txt {repo}/.git-credentials": ("/repo/.git-credentials", denied, "link"),
            f"ln -s x.txt {repo}/.env.local": ("/repo/.env.local", denied, "write"),
            f"sh -c 'echo > {repo}/.env'": ("/repo/.env", denied, "write"),
            f"sh -c 'echo > {repo}/src/.env.production'": (
                "/repo/src/.env.production",
                denied,
                "write",
            ),
            f"mkdir {working}/.ssh": ("/session/working/.ssh", denied, "write"),
            f"sh -c 'echo > {working}/.env.local'": (
                "/session/working/.env.local",
                denied,
                "write",
            ),
            f"rm -f {repo}/.env": ("/repo/.env", denied, "delete"),
            f"ls {repo}/.ssh": ("/repo/.ssh", denied, "list"),
        }
        # A private key (found by its contents) is never read, moved, linked or deleted.
        keys = {
            f"cat {repo}/server.pem": ("/repo/server.pem", denied, "read"),
            f"cp {repo}/server.pem {working}/copy": ("/repo/server.pem", denied, "read"),
            f"mv {repo}/server.pem {repo}/server.txt": ("/repo/server.pem", denied, "rename"),
            f"ln {repo}/server.pem {repo}/copy.txt": ("/repo/server.pem", denied, "link"),
            f"rm -f {repo}/server.pem": ("/repo/server.pem", denied, "delete"),
            f"sh -c 'echo > {repo}/server.pem'": ("/repo/server.pem", denied, "write"),
        }
        for command, (_, message, _) in {**attacks, **keys}.items():
            refused(sh(command), message)
        # statement -> (virtual path audited, errno, op audited there)
        probes = {
            f"os.rename({str(repo / 'x.txt')!r}, {str(repo / '.env')!r})": (
                "/repo/.env",
                "EACCES",
                "rename",
            ),
            f"os.link({str(repo / 'x.txt')!r}, {str(repo / '.env.test')!r})": (
                "/repo/.env.test",
                "EACCES",
                "link",
            ),
            f"create({str(repo / '.netrc')!r})": ("/repo/.netrc", "EACCES", "write"),
            # An exchange would put the key under another name.
            f"renameat2({str(repo / 'x.txt')!r}, {str(repo / 'server.pem')!r}, RENAME_EXCHANGE)": (
                "/repo/server.pem",
                "EACCES",
                "rename",
            ),
        }
        for statement, (_, err, _) in probes.items():
            assert syscall(statement) == err, statement
        denials = m.audit("--denied")
        for vpath, _, op in attacks.values():
            entry = denial(m, vpath, op, entries=denials)
            assert "deny pattern" in entry["reason"], entry
            assert entry["errno"] == "EACCES", entry
        for vpath, _, op in keys.values():
            entry = denial(m, vpath, op, entries=denials)
            assert "holds a private key" in entry["reason"], entry
            assert entry["errno"] == "EACCES", entry
        for vpath, err, op in probes.values():
            entry = denial(m, vpath, op, entries=denials, errno=err)
            assert "deny pattern" in entry["reason"] or "private key" in entry["reason"], entry
        assert (project / "x.txt").read_text() == "data\n"
        assert (project / ".env").read_text() == "API_KEY=secret\n"
        assert (project / "server.pem").read_text() == "-----BEGIN PRIVATE KEY-----\n"
        assert sorted(p.name for p in (project / ".ssh").iterdir()) == ["id_rsa"]
        assert (project / "src" / "main.py").exists()
        for name in (".netrc", ".aws", ".git-credentials", ".env.local", "src/.env.production"):
            assert not (project / name).exists(), name
        for name in (".env.test", ".netrc", "server.txt", "copy.txt"):
            assert not (project / name).exists(), name
        assert not (backing(m, "session") / "working" / ".ssh").exists()
        assert not (backing(m, "session") / "working" / ".env.local").exists()
        assert not (backing(m, "session") / "working" / "copy").exists()
        assert_healthy(m, pid)


# ----- the state dir and the mountpoint through /repo -----------------------------------------


def test_state_dir_and_mountpoint_unreachable_through_repo(
    mount_at: Callable[..., Any], project: Path
) -> None:
    with mount_at("full", mnt=project / "mnt") as m:
        pid = m.daemon_pid()
        repo = m.mnt / "repo"
        audit_before = (project / ".sandbox" / "audit.jsonl").stat().st_ino
        assert sh(f"echo data > {repo}/x").returncode == 0
        names = sh(f"ls -a {repo}", timeout=10).stdout.split()
        assert ".sandbox" not in names and "mnt" not in names
        refused(sh(f"ls {repo}/.sandbox", timeout=10), "No such file or directory")
        refused(sh(f"cat {repo}/.sandbox/audit.jsonl", timeout=10), "No such file or directory")
        refused(sh(f"cat {repo}/src/../.sandbox/audit.jsonl", timeout=10))
        refused(sh(f"mkdir {repo}/.sandbox", timeout=10), "Permission denied")
        refused(sh(f"sh -c 'echo > {repo}/.sandbox'", timeout=10), "Permission denied")
        refused(sh(f"mv {repo}/x {repo}/.sandbox", timeout=10), "Permission denied")
        refused(sh(f"ln {repo}/x {repo}/.sandbox", timeout=10), "Permission denied")
        refused(sh(f"ln {repo}/x {repo}/mnt", timeout=10), "Permission denied")
        refused(sh(f"ls {repo}/mnt", timeout=10), "No such file or directory")
        refused(sh(f"ls {repo}/mnt/repo/mnt", timeout=10))
        refused(sh(f"mkdir {repo}/mnt", timeout=10), "Permission denied")
        refused(sh(f"touch {repo}/mnt", timeout=10), "Permission denied")
        # A symlink made through the mount that points at the state dir re-enters the mount,
        # where the state dir still does not exist.
        assert sh(f"ln -s .sandbox {repo}/sb").returncode == 0
        refused(sh(f"cat {repo}/sb/audit.jsonl", timeout=10), "No such file or directory")
        denials = m.audit("--denied")
        # The state dir is hidden by identity, the mountpoint as the mount root it is.
        for vpath, why in (
            ("/repo/.sandbox", "sandboxfs's own state"),
            ("/repo/mnt", "the root of another mount"),
        ):
            looked_up = denial(m, vpath, "read", denials, errno="ENOENT")
            assert why in looked_up["reason"], looked_up
            created = denial(m, vpath, "write", denials, errno="EACCES")
            assert why in created["reason"], created
        renamed = denial(m, "/repo/x", "rename", denials, dest="/repo/.sandbox")
        assert renamed["errno"] == "EACCES", renamed
        assert "sandboxfs's own state" in renamed["reason"], renamed
        for dest, why in (("/repo/.sandbox", "sandboxfs's own state"), ("/repo/mnt", "mount")):
            linked = denial(m, "/repo/x", "link", denials, dest=dest)
            assert linked["errno"] == "EACCES" and why in linked["reason"], linked
        assert (project / "x").stat().st_nlink == 1
        assert (project / "x").read_text() == "data\n"
        assert (project / ".sandbox" / "audit.jsonl").stat().st_ino == audit_before
        assert (project / ".sandbox").is_dir() and not (project / ".sandbox").is_symlink()
        assert_healthy(m, pid)


# ----- `/` and the zone roots -----------------------------------------------------------------


def test_nothing_can_be_created_at_root(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        pid = m.daemon_pid()
        mnt = m.mnt
        for command in (
            f"touch {mnt}/t",
            f"mkdir {mnt}/d",
            f"ln -s /etc {mnt}/l",
            f"sh -c 'echo > {mnt}/e'",
        ):
            refused(sh(command))
        for mode in ("stat.S_IFREG | 0o644", "stat.S_IFIFO | 0o644"):
            assert syscall(f"os.mknod({str(mnt / 'n')!r}, {mode})") == "EACCES"
        # A hard link from a zone to `/` crosses zones.
        refused(sh(f"ln {mnt}/repo/README.md {mnt}/h"), "Invalid cross-device link")
        denials = m.audit("--denied")
        for name in ("t", "d", "l", "e", "n"):
            entry = denial(m, f"/{name}", "write", entries=denials)
            assert entry["zone"] is None and entry["errno"] == "EACCES", entry
            assert "nothing can be created at /" in entry["reason"], entry
        crossing(m, "/repo/README.md", "link", "/h")
        assert sh(f"ls -a {mnt}").stdout.split() == [".", "..", ".sandboxfs", *sorted(ZONES)]
        assert_healthy(m, pid)


def test_zone_roots_cannot_be_removed_renamed_or_changed(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        pid = m.daemon_pid()
        mnt = m.mnt
        for zone in ZONES:
            refused(sh(f"rmdir {mnt}/{zone}"))
            refused(sh(f"mv {mnt}/{zone} {mnt}/{zone}2"))
            refused(sh(f"chmod 700 {mnt}/{zone}"))
            refused(sh(f"touch {mnt}/{zone}"))
            refused(sh(f"chown 1:1 {mnt}/{zone}"))
        denials = m.audit("--denied")
        for zone in ZONES:
            for op in ("delete", "rename", "write"):
                reason = denial(m, f"/{zone}", op, denials)["reason"]
                assert "cannot be removed, renamed or changed" in reason
        refused(sh(f"mv {mnt}/staged {mnt}/session/staged"))
        refused(sh(f"mv {mnt}/session/working {mnt}/working"))
        plain = syscall(f"os.rename({str(mnt / 'session')!r}, {str(mnt / 'workspace')!r})")
        assert plain == "EACCES"
        exchange = syscall(
            f"renameat2({str(mnt / 'session')!r}, {str(mnt / 'repo')!r}, RENAME_EXCHANGE)"
        )
        assert exchange == "EACCES"
        inner = syscall(
            f"renameat2({str(mnt / 'session' / 'working')!r}, {str(mnt / 'repo')!r}, "
            "RENAME_EXCHANGE)"
        )
        assert inner == "EACCES"
        assert syscall(f"os.rmdir({str(mnt / 'workers')!r})") == "EACCES"
        assert syscall(f"os.chmod({str(mnt)!r}, 0o700)") == "EACCES"
        refused(sh(f"touch {mnt}"))
        refused(sh(f"touch {mnt}/.sandboxfs/context.json"))
        refused(sh(f"rm -f {mnt}/.sandboxfs/context.json"))
        for zone in ZONES:
            assert stat.S_IMODE(os.stat(mnt / zone).st_mode) == 0o755
        assert (backing(m, "session") / "working").is_dir()
        assert (m.project / ".workers" / "review.worker").is_file()
        assert_healthy(m, pid)


# ----- device nodes, FIFOs, sockets -----------------------------------------------------------


def test_device_nodes_are_refused_fifos_work(mount_at: Callable[..., Any], project: Path) -> None:
    planted = os.geteuid() == 0  # only root can make a device node to plant
    if planted:
        os.mknod(project / "planted-zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    with mount_at("full") as m:
        pid = m.daemon_pid()
        working = m.mnt / "session" / "working"
        null = str(working / "null")
        assert syscall(f"os.mknod({null!r}, stat.S_IFCHR | 0o600, os.makedev(1, 3))") == "EPERM"
        disk = str(m.mnt / "repo" / "sda")
        assert syscall(f"os.mknod({disk!r}, stat.S_IFBLK | 0o600, os.makedev(8, 0))") == "EPERM"
        refused(sh(f"mknod {working}/zero c 1 5"), "Operation not permitted")
        assert syscall(f"bind({str(working / 'sock')!r})") == "OK"  # sockets are harmless
        assert stat.S_ISSOCK(os.lstat(backing(m, "session") / "working" / "sock").st_mode)
        if planted:  # as non-root the kernel refuses device nodes itself (no CAP_MKNOD)
            denials = m.audit("--denied")
            for vpath in ("/session/working/null", "/repo/sda", "/session/working/zero"):
                entry = denial(m, vpath, "write", denials, errno="EPERM")
                assert "device nodes" in entry["reason"], entry
        for name in ("null", "zero"):
            assert not os.path.lexists(backing(m, "session") / "working" / name)
        assert not os.path.lexists(m.project / "sda")
        if planted:  # a device node planted in backing storage cannot be opened: nodev
            refused(sh(f"head -c 1 {m.mnt}/repo/planted-zero"), "Permission denied")
        # A FIFO is fine in /session.
        assert syscall(f"os.mkfifo({str(working / 'pipe')!r}, 0o600)") == "OK"
        assert stat.S_ISFIFO(os.lstat(backing(m, "session") / "working" / "pipe").st_mode)
        assert stat.S_ISFIFO(os.lstat(working / "pipe").st_mode)
        assert_healthy(m, pid)


def test_rename_whiteout_creates_no_device_node(mount_at: Callable[..., Any]) -> None:
    """renameat2(RENAME_WHITEOUT) leaves a whiteout — a character device 0:0 — at the source:
    a device node made without mknod."""
    with mount_at("full") as m:
        pid = m.daemon_pid()
        working = m.mnt / "session" / "working"
        assert sh(f"echo a > {working}/a").returncode == 0
        result = syscall(f"renameat2({str(working / 'a')!r}, {str(working / 'b')!r}, 4)")
        kinds = {
            p.name: stat.S_IFMT(p.lstat().st_mode)
            for p in (backing(m, "session") / "working").iterdir()
        }
        assert stat.S_IFCHR not in kinds.values(), kinds
        assert result in ("EINVAL", "EPERM"), result
        assert_healthy(m, pid)


# ----- set-uid / set-gid ----------------------------------------------------------------------


def test_setuid_and_setgid_bits_are_never_stored(
    mount_at: Callable[..., Any], project: Path
) -> None:
    with mount_at("full") as m:
        pid = m.daemon_pid()
        repo = m.mnt / "repo"
        made = sh(f"printf '#!/bin/sh\\nid\\n' > {repo}/tool && chmod 755 {repo}/tool")
        assert made.returncode == 0, made.stderr
        assert sh(f"mkdir {repo}/shared").returncode == 0
        for command in (
            f"chmod u+s {repo}/tool",
            f"chmod g+s {repo}/tool",
            f"chmod 6755 {repo}/tool",
            f"chmod g+s {repo}/shared",
            f"chmod 4755 {repo}/shared",
        ):
            sh(command)  # may report success; what matters is what reached the disk
        assert syscall(f"create({str(repo / 'created')!r}, 0o6755)") == "OK"
        assert syscall(f"os.mkdir({str(repo / 'made')!r}, 0o6755)") == "OK"
        assert syscall(f"os.mknod({str(repo / 'node')!r}, stat.S_IFREG | 0o6755)") == "OK"
        for name in ("tool", "shared", "created", "made", "node"):
            mode = os.lstat(project / name).st_mode
            assert not mode & (stat.S_ISUID | stat.S_ISGID), (name, oct(mode))
            shown = os.lstat(repo / name).st_mode
            assert not shown & (stat.S_ISUID | stat.S_ISGID), (name, oct(shown))
        options = next(
            line.split()[3].split(",")
            for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1] == str(m.mnt)
        )
        assert "nosuid" in options and "nodev" in options, options
        assert_healthy(m, pid)


# ----- extended attributes --------------------------------------------------------------------


def test_only_user_xattrs_can_be_set(mount_at: Callable[..., Any], project: Path) -> None:
    with mount_at("full") as m:
        pid = m.daemon_pid()
        target = m.mnt / "repo" / "README.md"
        capability = "0sAQAAAgAgAAAAAAAAAAAAAAAAAAA="
        refused(
            sh(f"setfattr -n security.capability -v {capability} {target}"),
            "Operation not permitted",
        )
        refused(sh(f"setfattr -n trusted.x -v 1 {target}"), "Operation not permitted")
        refused(sh(f"setfattr -n security.selinux -v x {m.mnt}/session/working"))
        if os.geteuid() == 0:  # otherwise the kernel refuses these before sandboxfs sees them
            entry = denial(m, "/repo/README.md", "write", errno="EPERM")
            assert "user.*" in entry["reason"]
        # Zone roots cannot be changed, not even their user xattrs.
        refused(sh(f"setfattr -n user.x -v 1 {m.mnt}/session"))
        assert "user.x" not in os.listxattr(backing(m, "session"))
        backing_names = os.listxattr(project / "README.md")
        assert not [n for n in backing_names if not n.startswith("user.")], backing_names
        assert sh(f"setfattr -n user.x -v hello {target}").returncode == 0
        assert os.getxattr(project / "README.md", "user.x") == b"hello"
        shown = sh(f"getfattr --only-values -n user.x {target}")
        assert shown.stdout == "hello", shown
        assert sh(f"setfattr -x user.x {target}").returncode == 0
        assert "user.x" not in os.listxattr(project / "README.md")
        assert_healthy(m, pid)


# ----- names ----------------------------------------------------------------------------------


def test_long_names_dotdot_and_non_utf8_names(mount_at: Callable[..., Any]) -> None:
    with mount_at("untrusted") as m:
        pid = m.daemon_pid()
        working = m.mnt / "session" / "working"
        long_name = "a" * 256
        refused(sh(f"touch {working}/{long_name}"), "File name too long")
        assert syscall(f"create({str(working / long_name)!r})") == "ENAMETOOLONG"
        assert sh(f"touch {working}/{'b' * 255}").returncode == 0
        # `..` is resolved by the kernel: this is a lookup in /repo, which untrusted cannot read:
        # the name looks absent.
        refused(sh(f"cat {working}/../../repo/README.md"), "No such file or directory")
        entry = denial(m, "/repo/README.md", "read", errno="ENOENT")
        assert "not readable at trust level untrusted" in entry["reason"]
        refused(sh(f"sh -c 'echo x > {working}/../../repo/new.txt'"))
        refused(sh(f"ls {m.mnt}/staged/../workspace/"))
        assert not (m.project / "new.txt").exists()
        # A name that is not UTF-8 is stored and listed back byte for byte.
        raw = b"\xff\xfe.txt"
        path = os.fsencode(working) + b"/" + raw
        assert syscall(f"create({path!r})") == "OK"
        assert raw in os.listdir(os.fsencode(working))
        assert raw in os.listdir(os.fsencode(backing(m, "session") / "working"))
        assert sh(f"ls {working} > /dev/null").returncode == 0
        assert_healthy(m, pid)


# ----- a full backing filesystem --------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs to hold a project."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with mounted_fs(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as root:
        yield root


def test_full_repo_filesystem(mount_at: Callable[..., Any], small_fs: Path, tmp_path: Path) -> None:
    """The repo's disk fills up: the writer gets ENOSPC and the mount carries on. The state dir
    is bind-mounted from a roomy disk, so the audit log is not on the full one (see below)."""
    project = make_project(small_fs)
    state = tmp_path / "state"
    state.mkdir()
    with (
        mounted_fs(project / ".sandbox", "--bind", str(state)),
        mount_at("full", proj=project) as m,
    ):
        pid = m.daemon_pid()
        filled = sh(f"head -c 2000000 /dev/zero > {m.mnt}/repo/big", timeout=30)
        refused(filled, "No space left on device")
        assert os.statvfs(small_fs).f_bavail == 0
        listed = sh(f"ls {m.mnt}/repo", timeout=10).stdout.split()
        assert listed == ["README.md", "big", "server.pem", "src"]
        assert sh(f"cat {m.mnt}/repo/README.md", timeout=10).stdout == "# demo project\n"
        refused(sh(f"cat {m.mnt}/repo/.env", timeout=10), "Permission denied")
        assert denial(m, "/repo/.env", "read")["errno"] == "EACCES"
        # Other zones live on another disk and are unaffected.
        assert sh(f"echo ok > {m.mnt}/session/working/ok", timeout=10).returncode == 0
        assert sh(f"rm {m.mnt}/repo/big", timeout=10).returncode == 0
        assert sh(f"echo after > {m.mnt}/repo/after.txt", timeout=10).returncode == 0
        assert (project / "after.txt").read_text() == "after\n"
        m.wait_audit(lambda e: e["op"] == "write" and e["path"] == "/repo/big")
        assert_healthy(m, pid)


def test_full_audit_log_filesystem(mount_at: Callable[..., Any], small_fs: Path) -> None:
    """An untrusted agent fills /session, which shares a disk with the state dir, then keeps
    getting refused: the mount must survive, refusing, and audit the refusals once there is
    room again."""
    project = make_project(small_fs)
    with mount_at("untrusted", proj=project) as m:
        pid = m.daemon_pid()
        fill = f"{m.mnt}/session/working/fill"
        refused(sh(f"head -c 2000000 /dev/zero > {fill}", timeout=30), "No space left on device")
        attempts = sh(f"for i in $(seq 40); do cat {m.mnt}/repo/README.md; done", timeout=60)
        assert "demo project" not in attempts.stdout
        assert attempts.stderr.count("README.md") == 40, attempts.stderr
        # Make room again from outside, as the user would.
        (backing(m, "session") / "working" / "fill").unlink()
        # The refusals waited in memory while the log could not be written, and audited
        # callbacks fail closed (ENOSPC) until the next periodic flush writes them (every
        # audit.flush_interval, 0.05 s by default): the mount must be back well within 5 s.
        deadline = time.monotonic() + 5
        while (listed := sh(f"ls {m.mnt}/session/working", timeout=10)).returncode != 0:
            assert "No space left on device" in listed.stderr, listed.stderr
            assert time.monotonic() < deadline, "the mount did not recover after making room"
            time.sleep(0.05)
        refused(sh(f"cat {m.mnt}/repo/README.md", timeout=10), "No such file or directory")
        os.kill(pid, 0)
        readme = [e for e in m.audit("--denied") if e["path"] == "/repo/README.md"]
        assert len(readme) == 41, len(readme)
        assert all(e["op"] == "read" and e["errno"] == "ENOENT" for e in readme), readme
        assert_healthy(m, pid)


def test_status_says_why_a_mount_fails_closed(mount_at: Callable[..., Any], small_fs: Path) -> None:
    """While the audit log cannot be written, `status` says so and why, not `unreadable`."""
    project = make_project(small_fs)
    with mount_at("untrusted", proj=project) as m:
        fill = f"{m.mnt}/session/working/fill"
        refused(sh(f"head -c 2000000 /dev/zero > {fill}", timeout=30), "No space left on device")
        sh(f"for i in $(seq 40); do cat {m.mnt}/repo/README.md; done", timeout=60)
        assert "No space left" in sh(f"ls {m.mnt}/session", timeout=10).stderr
        shown = sandboxfs("status", "--json", m.mnt)
        assert shown.returncode == 0, shown.stderr
        [row] = json.loads(shown.stdout)
        assert row["state"] == "failing closed", row
        assert row["reason"] == "the audit log cannot be written (No space left on device)"
        assert (row["trust"], row["session"]) == ("untrusted", m.session)
        table = sandboxfs("status", m.mnt).stdout
        assert "failing closed" in table and "(No space left on device)" in table, table
        (backing(m, "session") / "working" / "fill").unlink()


# ----- backing directories removed or replaced while mounted ----------------------------------


def test_backing_dirs_removed_or_replaced_while_mounted(
    mount_at: Callable[..., Any], outside: Path
) -> None:
    with mount_at("full") as m:
        pid = m.daemon_pid()
        session = m.mnt / "session"
        assert sh(f"echo a > {session}/working/a && mkdir {session}/working/sub").returncode == 0
        assert sh(f"ls -R {session} {m.mnt}/workspace").returncode == 0
        # 1. The session's backing directory disappears.
        assert sh(f"rm -rf {backing(m, 'session')}").returncode == 0
        for command in (
            f"ls {session}",
            f"ls {session}/working",
            f"cat {session}/working/a",
            f"sh -c 'echo b > {session}/working/b'",
            f"mkdir {session}/working/sub/deeper",
            f"touch {session}/new",
            f"rm {session}/working/a",
        ):
            result = sh(command, timeout=10)
            assert "Input/output error" not in result.stderr, (command, result.stderr)
            assert "Transport endpoint" not in result.stderr, (command, result.stderr)
        assert not backing(m, "session").exists()
        # 2. The workspace's backing directory is swapped for a symlink to outside.
        ws = backing(m, "workspace")
        ws.rename(ws.with_name("workspace.old"))
        ws.symlink_to(outside)
        for command in (
            f"sh -c 'echo pwned > {m.mnt}/workspace/data/p'",
            f"touch {m.mnt}/workspace/p",
            f"mkdir {m.mnt}/workspace/cache/p",
            f"ls {m.mnt}/workspace",
        ):
            result = sh(command, timeout=10)
            assert "Input/output error" not in result.stderr, (command, result.stderr)
        assert list(outside.iterdir()) == []
        # Other zones still answer.
        assert sh(f"cat {m.mnt}/repo/README.md").stdout == "# demo project\n"
        assert sh(f"echo s > {m.mnt}/staged/s && cat {m.mnt}/staged/s").stdout == "s\n"
        assert sh(f"ls {m.mnt}/workers").stdout.split() == ["review.worker"]
        assert_healthy(m, pid, session_gone=True)
