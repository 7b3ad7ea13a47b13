"""The CLI behaves like the Unix tools its users know: --version, mount's -f/-d/-o, sessions
that must exist (or be new), one session id printed, a project git does not see changed, a
clear /dev/fuse error, and status/umount that tell another user's, a busy and a dead mount
apart. Everything is observed from the outside: the command, its output, its exit code, what
it changed on disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import SANDBOXFS, assert_one_line_error, sandboxfs, sh
from tests.support.mounts import force_unmount

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    try:
        yield mountpoint
    finally:
        if os.path.ismount(mountpoint) or str(mountpoint) in Path("/proc/mounts").read_text():
            force_unmount(mountpoint)


def test_version() -> None:
    result = sandboxfs("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == "sandboxfs 0.1.0"


def test_output_is_whole_through_a_pipe_and_a_closed_pipe_is_quiet(project: Path) -> None:
    """The command leaves without the interpreter's teardown (cli.main.entry): what it printed
    must still all arrive, a short line still in the stream's buffer too, its exit code must be
    its own, and a reader that stops early must not get a traceback."""
    from sandboxfs.cli import manpage
    from sandboxfs.cli.main import _version, build_parser

    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    short = subprocess.run(
        [*SANDBOXFS, "staged", "list", "--project", str(project), "--json"],
        capture_output=True,
        text=True,
        env=buffered,
        timeout=60,
    )
    assert (short.returncode, short.stdout, short.stderr) == (0, "[]\n", "")
    page = sandboxfs("man")
    assert page.returncode == 0, page.stderr
    assert page.stdout == manpage.render(build_parser(), _version())
    first = sh(f"{' '.join(SANDBOXFS)} man | head -c 10")
    assert first.returncode == 0
    assert first.stderr == ""
    bad = sandboxfs("umount", "/nonexistent/sandboxfs-mnt")
    assert bad.returncode == 2
    assert_one_line_error(bad)


def test_mount_o_options_and_one_session_line(mnt: Path, project: Path) -> None:
    result = sandboxfs(
        "mount", mnt, "-o", f"trust=full,project={project},ro", "-o", "entry_timeout=0"
    )
    try:
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        session = lines[-1].removeprefix("session: ")
        assert result.stdout.count(session) == 1, result.stdout  # the id, once
        assert "read-only" in lines[0] and "trust full" in lines[0]
        wrote = sh(f"echo x > {mnt}/session/working/x")
        assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr
        assert (mnt / "repo" / "README.md").read_text()  # trust=full: the repo reads
    finally:
        sandboxfs("umount", mnt)


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ("colour=red", "unknown mount option 'colour=red'; accepted: allow_other, ro"),
        ("ro=1", "mount option ro takes no value"),
        ("trust=admin", "unknown trust level 'admin'"),
        ("entry_timeout=-1", "expected a number of seconds >= 0"),
        ("session", "mount option session needs a value"),
    ],
)
def test_bad_mount_options(mnt: Path, project: Path, option: str, needle: str) -> None:
    assert_one_line_error(sandboxfs("mount", mnt, "--project", project, "-o", option), needle)
    assert not os.path.ismount(mnt)


def test_foreground_and_debug_short_flags(mnt: Path, project: Path) -> None:
    """-f stays in the foreground until Ctrl-C; -d logs each request to the daemon log."""
    proc = subprocess.Popen(
        [*SANDBOXFS, "mount", "-f", "-d", mnt, "--project", project, "--new-session", "dbg"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(f"mounted {mnt}")
        assert sh(f"ls {mnt}/session").returncode == 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    log = (project / ".sandbox" / "logs" / "dbg.log").read_text()
    assert "request lookup 1 b'session'" in log, log[-2000:]
    assert "request opendir" in log and " -> " in log and " us)" in log


def test_debug_logs_in_the_background_too(mnt: Path, project: Path) -> None:
    result = sandboxfs("mount", "-d", mnt, "--project", project, "--new-session", "bg")
    try:
        assert result.returncode == 0, result.stderr
        sh(f"cat {mnt}/session/nothing-here")
    finally:
        sandboxfs("umount", mnt)
    log = (project / ".sandbox" / "logs" / "bg.log").read_text()
    assert "b'nothing-here' pid=" in log and "-> absent" in log, log[-2000:]


def test_sessions_must_exist_or_be_new(mnt: Path, project: Path, tmp_path: Path) -> None:
    missing = sandboxfs("mount", mnt, "--project", project, "--session", "typo")
    line = assert_one_line_error(missing, "session 'typo' does not exist", "--new-session typo")
    assert "has no sessions yet" in line
    first = sandboxfs("mount", mnt, "--project", project, "--new-session", "s1")
    assert first.returncode == 0, first.stderr
    other = tmp_path / "other"
    other.mkdir()
    try:
        again = sandboxfs("mount", other, "--project", project, "--session", "s1")
        assert_one_line_error(again, "session s1 is already mounted at", str(mnt))
        exists = sandboxfs("mount", other, "--project", project, "--new-session", "s1")
        assert_one_line_error(exists, "already exists", "--session s1")
        listed = sandboxfs("mount", other, "--project", project, "--session", "s2")
        assert_one_line_error(listed, "existing, newest first: s1")
    finally:
        sandboxfs("umount", mnt)
    resumed = sandboxfs("mount", other, "--project", project, "--session", "s1")
    try:
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed session" in resumed.stdout
    finally:
        sandboxfs("umount", other)


def test_git_sees_nothing_new_after_a_session(mnt: Path, tmp_path: Path) -> None:
    project = tmp_path / "repo"
    project.mkdir()
    (project / "README.md").write_text("hello\n")
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    result = sandboxfs("mount", mnt, "--project", project, "--trust", "workspace")
    assert result.returncode == 0, result.stderr
    try:
        assert (
            sh(f"echo x > {mnt}/session/working/notes && cat {mnt}/repo/README.md").returncode == 0
        )
    finally:
        sandboxfs("umount", mnt)
    status = subprocess.run(
        [*git, "status", "--porcelain", "--ignored=no"], capture_output=True, text=True, check=True
    )
    assert status.stdout == "", status.stdout
    assert (project / ".sandbox" / ".gitignore").read_text().splitlines()[-1] == "*"
    subprocess.run([*git, "add", "-A"], check=True)
    staged = subprocess.run(
        [*git, "diff", "--cached", "--name-only"], capture_output=True, text=True
    )
    assert staged.stdout == ""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory below /tmp every user can traverse, owned by nobody inside."""
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-fit-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            if line.split()[1].startswith(str(root)):
                force_unmount(Path(line.split()[1]))
        shutil.rmtree(root, ignore_errors=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switches to nobody, needs root")


def as_nobody(root: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {
        "HOME": str(root / "home"),
        "PATH": "/usr/bin:/bin",
        "SANDBOXFS_STATE_DIR": str(root / "state"),
    }
    return subprocess.run(
        [*NOBODY, *SANDBOXFS, *map(str, args)], capture_output=True, text=True, env=env, timeout=60
    )


@needs_root
def test_another_users_mount_is_not_yours_not_dead(open_dir: Path) -> None:
    for name in ("project", "mnt", "home"):
        (open_dir / name).mkdir()
    subprocess.run(["chown", "-R", "65534:65534", str(open_dir)], check=True)
    mnt = open_dir / "mnt"
    mounted = as_nobody(open_dir, "mount", mnt, "--project", open_dir / "project")
    assert mounted.returncode == 0, mounted.stderr
    status = sandboxfs("status")
    row = next(line for line in status.stdout.splitlines() if line.startswith(str(mnt)))
    assert row.split()[1:4] == ["not", "yours", "nobody"], status.stdout
    refused = sandboxfs("umount", mnt)
    assert refused.returncode == 1
    assert "is nobody's mount" in refused.stderr and "--force" in refused.stderr
    assert str(mnt) in Path("/proc/mounts").read_text()  # still mounted (root cannot stat it)
    forced = sandboxfs("umount", "--force", mnt)
    assert forced.returncode == 0, forced.stderr
    assert "daemon had died" not in forced.stdout


def test_busy_mount_says_so(mnt: Path, project: Path) -> None:
    assert sandboxfs("mount", mnt, "--project", project).returncode == 0
    holder = subprocess.Popen(["sleep", "30"], cwd=mnt / "session")
    try:
        busy = sandboxfs("umount", mnt)
        assert busy.returncode == 1
        assert "is busy" in busy.stderr and f"fuser -vm {mnt}" in busy.stderr
        assert "--lazy" in busy.stderr and "died" not in busy.stderr
        lazy = sandboxfs("umount", "--lazy", mnt)
        assert lazy.returncode == 0, lazy.stderr
        assert "detached" in lazy.stdout
    finally:
        holder.kill()
        holder.wait()


@needs_root
def test_dev_fuse_permission_error_names_the_fix(open_dir: Path) -> None:
    for name in ("project", "mnt", "home"):
        (open_dir / name).mkdir()
    subprocess.run(["chown", "-R", "65534:65534", str(open_dir)], check=True)
    mode = os.stat("/dev/fuse").st_mode & 0o777
    os.chmod("/dev/fuse", 0o600)
    try:
        result = as_nobody(open_dir, "mount", open_dir / "mnt", "--project", open_dir / "project")
    finally:
        os.chmod("/dev/fuse", mode)
    line = assert_one_line_error(result, "/dev/fuse is not readable and writable by you")
    assert "chmod 0666 /dev/fuse" in line and "install fuse3" not in line


def test_every_option_has_help() -> None:
    from sandboxfs.cli.main import build_parser

    def walk(parser: object, where: str) -> list[str]:
        import argparse

        assert isinstance(parser, argparse.ArgumentParser)
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    missing += walk(child, f"{where} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                missing.append(f"{where}: {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert walk(build_parser(), "sandboxfs") == []


def test_short_f_means_foreground_only() -> None:
    """-f is mount's --foreground; no other subcommand gives -f another meaning."""
    for command in ("run", "umount", "status", "audit", "doctor"):
        result = subprocess.run(
            [sys.executable, "-m", "sandboxfs", command, "--help"], capture_output=True, text=True
        )
        assert " -f" not in result.stdout, (command, result.stdout)
