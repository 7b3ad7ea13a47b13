"""Commands and mounts bounded by timeouts: a hang inside a mount fails a test, not the suite."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.cli import SANDBOXFS

ACCESS = 10.0  # seconds one access to a mount may take; answering takes milliseconds
ENOENT_TEXT = "No such file or directory"
EACCES_TEXT = "Permission denied"


class Hang(AssertionError):
    """A command did not finish within its timeout: something blocked inside a mount."""


def run(
    cmd: str | Sequence[str | Path],
    timeout: float = ACCESS,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command (a string goes to sh -c) in its own process group; never raises on failure,
    raises Hang when it is still running after `timeout` (its whole group is killed first)."""
    argv = ["sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            # Killed, but its request was already taken by a daemon: it waits (uninterruptibly)
            # for the answer, until that mount's connection is aborted (see sandbox_mount).
            STUCK.append(proc)
        raise Hang(f"timed out after {timeout:g} s (hung): {' '.join(argv)}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


STUCK: list[subprocess.Popen[str]] = []


def reap_stuck() -> None:
    for proc in list(STUCK):
        with suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=5)
            STUCK.remove(proc)


def fuse_connection(mountpoint: Path) -> int | None:
    """The FUSE connection number of a mount (the minor of its device), from mountinfo."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mountpoint):
            return int(fields[2].split(":")[1])
    return None


def abort_connection(conn: int) -> None:
    """Abort a FUSE connection (its daemon and callers get ENOTCONN/ENODEV): the only way out
    of a deadlock between daemons, where even SIGKILL waits. Mounts fusectl privately if it is
    not mounted at /sys/fs/fuse/connections."""
    control = Path("/sys/fs/fuse/connections")
    private = None
    if not control.joinpath(str(conn)).exists():
        private = Path(tempfile.mkdtemp(prefix="sandboxfs-fusectl-"))
        if run(["mount", "-t", "fusectl", "fusectl", private]).returncode != 0:
            private.rmdir()
            return
        control = private
    try:
        with suppress(OSError):
            control.joinpath(str(conn), "abort").write_text("1")
    finally:
        if private is not None:
            run(["umount", "-l", private])
            private.rmdir()


Runner = Callable[..., subprocess.CompletedProcess[str]]  # (argv, timeout=ACCESS)


def is_mountpoint(path: Path) -> bool:
    """From the mount table, without touching the path (which could hang)."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if line.split()[1].replace("\\040", " ") == str(path):
            return True
    return False


def wait_or_kill(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """Wait for a process the test started; SIGKILL it if it does not end in time."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def threads_of(pid: int) -> set[int]:
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")} | {pid}
    except OSError:
        return {pid}


@dataclass
class Live:
    """A sandboxfs mount made here, with its daemon's pid."""

    mnt: Path
    project: Path
    session: str
    pid: int = 0
    tids: set[int] = field(default_factory=set)
    debug_log: Path | None = None
    runner: Runner = run  # how the mount's owner runs commands
    conn: int | None = None  # FUSE connection number

    def context(self) -> dict[str, Any]:
        """context.json, read through the mount by a child process within ACCESS seconds."""
        path = self.mnt / ".sandboxfs" / "context.json"
        result = self.runner(["cat", path])
        assert result.returncode == 0, f"{path}: {result.stderr}"
        return dict(json.loads(result.stdout))

    def note_threads(self) -> None:
        self.tids |= threads_of(self.pid)

    def umount(self) -> None:
        """`sandboxfs umount`, which must succeed."""
        argv = [*SANDBOXFS, "umount", self.mnt]
        result = self.runner(argv, 30)
        assert result.returncode == 0, result.stderr
        assert "unmounted" in result.stdout, result.stdout
        assert not is_mountpoint(self.mnt)

    def audit(self) -> list[dict[str, Any]]:
        """This mount's session's audit entries (every mount of the project shares one log)."""
        result = run(
            [*SANDBOXFS, "audit", "--project", self.project, "--session", self.session, "--json"],
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]

    def requesters(self) -> set[int]:
        """Pids in the FUSE requests this mount received (from its --debug output)."""
        assert self.debug_log is not None
        text = self.debug_log.read_text(errors="replace")
        found = re.findall(r"^unique: \d+, opcode: .*, pid: (\d+)$", text, re.M)
        return {int(pid) for pid in found}


@contextmanager
def sandbox_mount(
    mnt: Path,
    project: Path,
    trust: str,
    *extra: str,
    debug_log: Path | None = None,
    runner: Runner = run,
) -> Iterator[Live]:
    """`sandboxfs mount` (with `debug_log`: `--foreground --debug`, its stderr, which names the
    caller of every request, kept there); unmounted in `finally` whatever happened: `sandboxfs
    umount`, then a lazy unmount, then the daemon ended by its pid if it is still running."""
    mnt.mkdir(parents=True, exist_ok=True)
    argv: list[str | Path] = [*SANDBOXFS, "mount", mnt, "--project", project, "--trust", trust]
    argv += extra
    live = Live(mnt, project, "", debug_log=debug_log, runner=runner)
    proc: subprocess.Popen[bytes] | None = None
    try:
        if debug_log is None:
            result = runner(argv, 30)
            assert result.returncode == 0, f"sandboxfs mount failed: {result.stderr}"
            out = result.stdout
        else:
            out_file = debug_log.with_suffix(".out")
            with open(out_file, "wb") as out_fd, open(debug_log, "wb") as err_fd:
                proc = subprocess.Popen(
                    [str(a) for a in [*argv, "--foreground", "--debug"]],
                    stdout=out_fd,
                    stderr=err_fd,
                    start_new_session=True,
                )
            live.pid = proc.pid  # --foreground: the daemon itself
            deadline = time.monotonic() + 30
            while "session: " not in (out := out_file.read_text()):
                assert proc.poll() is None, f"sandboxfs mount failed: {debug_log.read_text()}"
                assert time.monotonic() < deadline, "sandboxfs mount --foreground: no mount"
                time.sleep(0.05)
        live.session = out.split("session: ", 1)[1].split()[0]
        live.conn = fuse_connection(mnt)
        live.pid = int(live.context()["pid"])
        live.note_threads()
        yield live
    finally:
        if live.conn is None:
            live.conn = fuse_connection(mnt)
        if live.conn is not None and is_mountpoint(mnt):
            try:
                runner(["cat", mnt / ".sandboxfs" / "context.json"], 3)
            except Hang:  # the daemon is stuck (in a request to another mount): cut it loose
                abort_connection(live.conn)
        if is_mountpoint(mnt):
            with suppress(Hang):
                runner([*SANDBOXFS, "umount", mnt], 15)
        if is_mountpoint(mnt):
            with suppress(Hang):
                run(["fusermount3", "-u", "-z", mnt])
        deadline = time.monotonic() + 3
        while live.pid and process_alive(live.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if live.conn is not None and live.pid and process_alive(live.pid):
            abort_connection(live.conn)  # the daemon is stuck: cut it loose
            deadline = time.monotonic() + 5
            while live.pid and process_alive(live.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        if live.pid and process_alive(live.pid):
            with suppress(ProcessLookupError):
                os.kill(live.pid, signal.SIGKILL)
        if proc is not None:
            wait_or_kill(proc)
        reap_stuck()
