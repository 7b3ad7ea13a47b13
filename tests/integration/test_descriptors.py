"""Out of descriptors, killed, shared: the daemon keeps serving, cleans up after itself, and
other users' hard links work.

Daemons are started under `prlimit --nofile=N:N` (soft and hard: the daemon cannot raise it)
so that their descriptor table is small enough to fill from a test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandboxfs.project import control
from tests.support.cli import SANDBOXFS, sandboxfs, sh, wait_until
from tests.support.mounts import Mount, force_unmount, make_project, mounted

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit")

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


@contextmanager
def limited_mount(mnt: Path, project: Path, nofile: int, *extra: str) -> Iterator[Mount]:
    """`sandboxfs mount` with the daemon's descriptor limit (soft and hard) set to nofile."""
    mnt.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            *("prlimit", f"--nofile={nofile}:{nofile}", *SANDBOXFS, "mount", str(mnt)),
            *("--project", str(project), "--trust", "full", *extra),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        assert result.returncode == 0, result.stderr
        session = next(
            line.split(": ", 1)[1] for line in result.stdout.splitlines() if "session: " in line
        )
        yield Mount(mnt, project, "full", session, stdout=result.stdout)
    finally:
        sandboxfs("umount", mnt)
        force_unmount(mnt)


def nofile_limit(pid: int) -> tuple[str, str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no open-files limit")


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ----- a full descriptor table never jams or kills the mount --------------------------------------


def test_a_find_over_more_directories_than_descriptors_leaves_the_mount_working(
    tmp_path: Path, project: Path
) -> None:
    """Before, the directory-descriptor cache kept 1,024 whatever the limit: one find over
    more directories than the limit allowed left every create and listing failing (EMFILE)."""
    for i in range(300):
        (project / "tree" / str(i)).mkdir(parents=True)
    with limited_mount(tmp_path / "mnt", project, 256) as m:
        pid = m.daemon_pid()
        assert nofile_limit(pid) == ("256", "256")
        found = sh(f"find {m.mnt}/repo/tree -type d")
        assert found.returncode == 0, found.stderr[-2000:]
        assert len(found.stdout.splitlines()) == 301
        assert open_descriptors(pid) < 256 - 64  # the cache is sized from the limit
        (m.mnt / "repo" / "tree" / "7" / "new.txt").write_text("made\n")
        assert (project / "tree" / "7" / "new.txt").read_text() == "made\n"
        assert len(os.listdir(m.mnt / "repo" / "tree")) == 300
        (m.mnt / "repo" / "tree" / "8" / "sub").mkdir()
        again = sh(f"find {m.mnt}/repo/tree -type d")
        assert len(again.stdout.splitlines()) == 302, again.stderr[-2000:]


HOLDER = """
import os, sys
held = []
for name in sorted(os.listdir(sys.argv[1])):
    try:
        held.append(os.open(os.path.join(sys.argv[1], name), os.O_RDONLY))
    except OSError as exc:
        print(len(held), exc.errno, flush=True)
        break
else:
    print(len(held), 0, flush=True)
sys.stdin.read()
"""


def test_a_control_request_while_the_daemon_is_out_of_descriptors(
    tmp_path: Path, project: Path
) -> None:
    """An agent holding every descriptor the daemon may have: `demote` still works and the
    mount serves on (before, accept() failed with EMFILE and the daemon exited)."""
    many = project / "many"
    many.mkdir()
    for i in range(400):
        (many / f"f{i:03}").write_text("x")
    with limited_mount(tmp_path / "mnt", project, 256) as m:
        pid = m.daemon_pid()
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(m.mnt / "repo" / "many")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            count, err = map(int, holder.stdout.readline().split())
            assert err == 24, (count, err)  # EMFILE: the daemon's table is full
            assert count > 200
            assert open_descriptors(pid) >= 250
            for _ in range(2):  # twice: the spare descriptor is taken again after the first
                demoted = sandboxfs("demote", m.mnt, "--trust", "workspace", "--json")
                assert demoted.returncode == 0, demoted.stderr
                assert json.loads(demoted.stdout)["new"] == "workspace"
                promoted = sandboxfs("promote", m.mnt, "--trust", "full")
                assert promoted.returncode == 0, promoted.stderr
            status = sandboxfs("status", "--json")
            assert any(row.get("pid") == pid for row in json.loads(status.stdout)), status
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(timeout=30)
            assert holder.stdout is not None
            holder.stdout.close()
        os.kill(pid, 0)  # still alive
        # The kernel sends the holder's RELEASEs on its own time.
        assert wait_until(lambda: open_descriptors(pid) < 100)
        (m.mnt / "repo" / "after.txt").write_text("served\n")
        assert (project / "after.txt").read_text() == "served\n"
        assert len(os.listdir(m.mnt / "repo" / "many")) == 400
        log = (project / ".sandbox" / "logs" / f"{m.session}.log").read_text()
        assert "out of descriptors" in log
        assert "Traceback" not in log


# ----- control sockets of killed daemons are swept ------------------------------------------------


def _wait_dead(pid: int) -> None:
    """Until pid is gone or a zombie (nothing may reap an orphaned daemon here)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return
        except OSError:
            return
        assert time.monotonic() < deadline, f"{pid} survived SIGKILL"
        time.sleep(0.05)


def _leftover(path: Path) -> None:
    """A socket file nothing listens on, as a killed daemon leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def test_control_sockets_of_killed_daemons_are_swept(
    tmp_path: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, each `kill -9` of a daemon left its socket in the control dir for good."""
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(tmp_path / "state"))
    sockets = tmp_path / "state" / "control"
    with mounted(tmp_path / "mnt0", project, "full") as m:
        pid = m.daemon_pid()
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)
        assert (sockets / f"{pid}.sock").exists()
    # `sandboxfs umount` of the dead mount (in `mounted`) swept it.
    assert not (sockets / f"{pid}.sock").exists()
    # A daemon sweeps at start, `status` too; only sockets of pids that are no live process
    # (and that nothing answers on) go: not one whose pid lives on, nor other files.
    _leftover(sockets / "999999999.sock")
    _leftover(sockets / f"{os.getpid()}.sock")
    (sockets / "notes.txt").touch()
    with mounted(tmp_path / "live", project, "full") as live:
        pid = live.daemon_pid()
        left = sorted(p.name for p in sockets.iterdir())
        assert left == sorted([f"{pid}.sock", f"{os.getpid()}.sock", "notes.txt"])
        _leftover(sockets / "999999998.sock")
        assert sandboxfs("status").returncode == 0
        assert not (sockets / "999999998.sock").exists()
        assert (sockets / f"{pid}.sock").exists()
        assert sandboxfs("demote", live.mnt, "--trust", "session").returncode == 0
    assert control.sweep() == []


# ----- other users' hard links on a root --allow-other mount --------------------------------------


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A tmp dir every user can traverse (pytest's are 0700), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-descriptors-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
@pytest.mark.parametrize("zone", ["session/working", "workspace"])
def test_another_user_hard_links_its_own_file(open_tmp: Path, zone: str) -> None:
    """pjdfstest link/06, link/07: the store walked from the zone root as the caller, who
    cannot search the 0700 state dir above it: EACCES, and no audit entry."""
    project = make_project(open_tmp)
    project.chmod(0o755)
    with mounted(open_tmp / "mnt", project, "full", "--allow-other") as m:
        own = m.mnt / zone / "nb"
        own.mkdir()
        os.chown(own, 65534, 65534)
        made = subprocess.run(
            [*NOBODY, "sh", "-c", f"cd {own} && echo x > f && ln f g && ls -i"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert made.returncode == 0, made.stderr
        inodes = made.stdout.split()
        assert inodes[0] == inodes[2], made.stdout  # f and g: one file
        st = os.stat(own / "g")
        assert (st.st_nlink, st.st_uid) == (2, 65534)
        path = f"/{zone}/nb/f"
        entry = m.wait_audit(lambda e: e["op"] == "link" and e["path"] == path)
        assert entry["allowed"] is True
        assert entry["uid"] == 65534
        assert entry["dest"] == f"/{zone}/nb/g"
