"""`sandboxfs run` and the user's terminal, and the end of a run whose daemon is stopped or dead.

The user's terminal is a pty of the test's own (its controlling terminal for `run`); stdin,
stdout and stderr are put on it or redirected, as a user's shell would. Whichever of them is
on the terminal, the program must never hold a descriptor of it (run relays through a pty or a
pipe of its own), and the terminal's modes must be as they were when `run` ends, however it
ends. A daemon that is stopped must not hold `run` for ever, and a dead mount must not outlive
its daemon: the next command clears it at once. Every run is bounded by a timeout, and nothing
may be left mounted (checked after each test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import pytest

from sandboxfs.run import rundir
from tests.support.cli import SANDBOXFS, wait_until
from tests.support.run import UserTerminal, fuse_mounts, nothing_left_behind, run_dirs

__all__ = ["nothing_left_behind"]  # the run tests' check that no mount is left, used here too

TIMEOUT = 60.0
PY = "/usr/bin/python3"  # the system's, which the sandbox's read-only /usr holds
SECRET = b"my-typed-secret"

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)


# ----- the user's terminal: a pty of the test's own ----------------------------------------------


@contextmanager
def user_terminal() -> Iterator[UserTerminal]:
    term = UserTerminal()
    try:
        yield term
    finally:
        term.close()


def sleeping(marker: str) -> int | None:
    """The pid of a `sleep MARKER` running anywhere on this machine."""
    for entry in Path("/proc").iterdir():
        with suppress(OSError):
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == (
                b"sleep\0" + marker.encode() + b"\0"
            ):
                return int(entry.name)
    return None


def marker() -> str:
    return f"{time.monotonic_ns() % 10**7}.5"


# ----- the reproduction: stdin redirected, the terminal on 1 and 2 ------------------------------


def test_redirected_stdin_cannot_read_the_keyboard(project: Path) -> None:
    """The issue's reproduction as printed, under `script` (a terminal), with what is typed
    four seconds in: the program reads its stdout as a terminal and gets nothing typed; and
    echo is on afterwards."""
    inner = (
        f"cd {project} && timeout 8 {' '.join(SANDBOXFS)} run --quiet -- "
        "sh -c 'stty -echo <&1; read x <&1; echo read: $x' < /dev/null; "
        "echo run-status=$?; stty -a"
    )
    typed = f"sleep 4; printf '{SECRET.decode()}\\n'; sleep 6"
    result = subprocess.run(
        ["sh", "-c", f'({typed}) | script -qec "$0" /dev/null', inner],
        capture_output=True,
        timeout=TIMEOUT,
        check=False,
    )
    out = result.stdout
    assert b"run-status=124" in out, out  # still reading its own pty when `timeout` ended it
    assert b"read: " + SECRET not in out, out
    assert b"read:" not in out, out
    assert b" echo " in out.replace(b"\r\n", b" ").replace(b";", b" "), out  # not -echo


PROBE = r"""
import json, os
found = {}
for fd in (0, 1, 2):
    st = os.fstat(fd)
    found[fd] = [st.st_dev, st.st_ino, st.st_rdev, os.isatty(fd)]
try:
    os.close(os.open("/dev/tty", os.O_RDWR))
    found["ctty"] = True
except OSError:
    found["ctty"] = False
print("PROBE " + json.dumps(found), flush=True)
"""


def probe_result(text: bytes) -> dict[str, Any]:
    for line in text.replace(b"\r", b"").splitlines():
        if line.startswith(b"PROBE "):
            found: dict[str, Any] = json.loads(line.removeprefix(b"PROBE "))
            return found
    raise AssertionError(f"no probe output in {text[-2000:]!r}")


@pytest.mark.parametrize(
    ("stdin", "stdout", "stderr"),
    [
        ("file", "tty", "tty"),  # run -- agent < task.txt
        ("devnull", "tty", "tty"),  # the reproduction
        ("tty", "pipe", "tty"),  # run -- agent | tee log
        ("tty", "file", "file"),  # run -- agent > log 2>&1
        ("tty", "tty", "file"),  # run -- agent 2> err
        ("file", "file", "tty"),  # only stderr
        ("tty", "tty", "tty"),  # a plain interactive run
    ],
)
def test_the_program_never_holds_the_terminal(
    project: Path, tmp_path: Path, stdin: str, stdout: str, stderr: str
) -> None:
    """Each descriptor on the terminal is a pty of run's in the program (a terminal, but not
    the user's), each redirected one is what the user gave; keystrokes are the program's only
    when stdin is the terminal, and then the pty is its controlling terminal."""
    task = tmp_path / "task.txt"
    task.write_text("the task\n")
    out_file, err_file = tmp_path / "out.log", tmp_path / "err.log"
    opened: list[IO[bytes]] = []

    def stream(kind: str, path: Path, mode: str) -> Any:
        if kind in ("tty", "pipe"):
            return kind if kind == "tty" else subprocess.PIPE
        if kind == "devnull":
            return subprocess.DEVNULL
        opened.append(path.open(mode))
        return opened[-1]

    with user_terminal() as term:
        outer = os.fstat(term.slave)
        proc = term.start(
            "run",
            "--project",
            project,
            "--quiet",
            "--",
            PY,
            "-c",
            PROBE,
            stdin=stream(stdin, task, "rb"),
            stdout=stream(stdout, out_file, "wb"),
            stderr=stream(stderr, err_file, "wb"),
        )
        piped = proc.stdout.read() if proc.stdout is not None else b""
        assert term.wait() == 0, term.output
        for f in opened:
            f.close()
    text = {"tty": term.output, "pipe": piped}.get(stdout) or out_file.read_bytes()
    found = probe_result(text)
    for fd, kind in enumerate((stdin, stdout, stderr)):
        dev, ino, rdev, isatty = found[str(fd)]
        assert (dev, ino) != (outer.st_dev, outer.st_ino), (fd, found)
        assert rdev != outer.st_rdev, (fd, found)
        assert isatty == (kind == "tty"), (fd, kind, found)
    if stdin == "file":
        assert found["0"][:2] == [os.stat(task).st_dev, os.stat(task).st_ino]
    assert found["ctty"] == (stdin == "tty"), found


def test_a_second_terminal_gets_a_pipe(project: Path) -> None:
    """stderr on another terminal (`2>/dev/pts/N`): the program gets a pipe there, copied to
    that terminal, never the terminal itself."""
    second_master, second_slave = os.openpty()
    try:
        second = os.fstat(second_slave)
        with user_terminal() as term:
            code = PROBE + "import sys; print('to-second', file=sys.stderr, flush=True)\n"
            term.start("run", "--project", project, "-q", "--", PY, "-c", code, stderr=second_slave)
            assert term.wait() == 0, term.output
        found = probe_result(term.output)
        dev, ino, _rdev, isatty = found["2"]
        assert (dev, ino) != (second.st_dev, second.st_ino) and not isatty, found
        assert found["0"][3] and found["1"][3] and found["ctty"], found
        os.set_blocking(second_master, False)
        assert b"to-second" in os.read(second_master, 65536)
    finally:
        os.close(second_master)
        os.close(second_slave)


def test_keystrokes_reach_the_program_through_its_pty_when_stdout_is_a_pipe(
    project: Path,
) -> None:
    """`run -- agent | tee log`: stdin and stderr are the terminal, relayed: what is typed is
    echoed on the terminal by the program's pty and read by the program; its stdout stays the
    pipe."""
    script = "echo ready >&2; read line; echo got: $line"
    with user_terminal() as term:
        proc = term.start(
            "run", "--project", project, "-q", "--", "sh", "-c", script, stdout=subprocess.PIPE
        )
        term.read_until(b"ready")
        term.send(b"typed-words\r")
        assert proc.stdout is not None
        assert proc.stdout.read() == b"got: typed-words\n"
        assert term.wait() == 0
        assert b"typed-words" in term.output  # the pty's echo, relayed to the terminal


# ----- the terminal's modes, however run ends ----------------------------------------------------


LEAVE_RAW = "stty raw -echo; echo ready; exec sleep {marker}"


@pytest.mark.parametrize("how", ["exit", "SIGTERM", "SIGHUP", "SIGINT", "program-killed"])
def test_terminal_modes_are_restored_however_run_ends(project: Path, how: str) -> None:
    """The program leaves its terminal raw without echo; run made the user's terminal raw to
    relay keystrokes; after run, by any of these ends, the modes are exactly as before."""
    mark = marker()
    script = LEAVE_RAW.format(marker=mark)
    if how == "exit":
        script = "stty raw -echo; echo ready; sleep 0.5"
    with user_terminal() as term:
        before = term.modes()
        proc = term.start("run", "--project", project, "-q", "--", "sh", "-c", script)
        term.read_until(b"ready")
        assert term.modes() != before, "run relays keystrokes with the terminal raw"
        if how == "program-killed":
            assert wait_until(lambda: sleeping(mark) is not None, timeout=10)  # after "ready"
            pid = sleeping(mark)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        elif how != "exit":
            os.kill(proc.pid, signal.Signals[how])
        status = term.wait()
        assert term.modes() == before, (how, status, term.output[-500:])
    expected = {
        "exit": 0,
        "SIGTERM": 128 + signal.SIGTERM,
        "SIGHUP": 128 + signal.SIGHUP,
        "SIGINT": 128 + signal.SIGINT,
        "program-killed": 128 + signal.SIGKILL,
    }[how]
    assert status == expected, (how, status, term.output[-500:])


def test_output_only_terminal_keeps_its_modes(project: Path) -> None:
    """stdin redirected: run does not touch the terminal's modes at all, and the program's
    own `stty raw -echo` reaches only its pty."""
    mark = marker()
    with user_terminal() as term:
        before = term.modes()
        term.start(
            "run",
            "--project",
            project,
            "-q",
            "--",
            "sh",
            "-c",
            f"stty raw -echo <&1; echo ready; exec sleep {mark}",
            stdin=subprocess.DEVNULL,
        )
        term.read_until(b"ready")
        assert term.modes() == before
        assert term.proc is not None
        os.kill(term.proc.pid, signal.SIGTERM)
        assert term.wait() == 128 + signal.SIGTERM
        assert term.modes() == before


# ----- a stopped or dead daemon ------------------------------------------------------------------


def daemon_row(session: str) -> dict[str, Any]:
    status = subprocess.run(
        [*SANDBOXFS, "status", "--json"], capture_output=True, text=True, timeout=TIMEOUT
    )
    rows: list[dict[str, Any]] = json.loads(status.stdout)
    return next(r for r in rows if r.get("session") == session)


@contextmanager
def running(*args: str | Path) -> Iterator[subprocess.Popen[str]]:
    """`sandboxfs run ARGS` on pipes (stdin one the test may write), once CMD printed ready."""
    with subprocess.Popen(
        [*SANDBOXFS, "run", *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def problem_lines(err: str) -> list[str]:
    """The lines about the daemon, the summary (which says the mount was lost) aside."""
    return [
        line for line in err.splitlines() if "daemon" in line and "sandboxfs: session " not in line
    ]


def test_a_stopped_daemon_does_not_hold_run(project: Path) -> None:
    """SIGTERM to run while its daemon is stopped (SIGSTOP): CMD ends, and run, after a
    bounded wait, kills the daemon, detaches the mount and says so in one line."""
    args: list[str | Path] = [
        "--project",
        project,
        "--new-session",
        "frozen",
        "--",
        "sh",
        "-c",
        "echo ready; sleep 300",
    ]
    with running(*args) as proc:
        row = daemon_row("frozen")
        os.kill(row["pid"], signal.SIGSTOP)
        try:
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=40)
            took = time.monotonic() - started
        finally:
            with suppress(ProcessLookupError):
                os.kill(row["pid"], signal.SIGCONT)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert took < 25, took  # the daemon's grace (10 s), the kill, the lazy unmount
    lines = problem_lines(err)
    assert len(lines) == 1, err
    assert "did not unmount within 10 s" in lines[0] and "killed it" in lines[0], lines
    assert "Traceback" not in err
    assert row["mountpoint"] not in fuse_mounts()
    assert not run_dirs()
    assert not Path(f"/proc/{row['pid']}").exists()


def test_a_killed_daemon_is_cleared_by_the_next_run_at_once(project: Path) -> None:
    """The daemon killed while its run goes on: the next `sandboxfs run` (a second later,
    not a minute) detaches the dead mount; the first run, when its program ends, says what
    happened in one line and leaves nothing behind."""
    args: list[str | Path] = ["--project", project, "--new-session", "victim", "--", "sh", "-c"]
    script = "echo ready; read go; ls /sandbox/repo >/dev/null 2>&1 || echo gone; echo done"
    with running(*args, script) as proc:
        row = daemon_row("victim")
        os.kill(row["pid"], signal.SIGKILL)
        assert wait_until(lambda: "Z" in _state(row["pid"]), timeout=10)
        assert row["mountpoint"] in fuse_mounts()
        nxt = subprocess.run(
            [*SANDBOXFS, "run", "--project", project, "-q", "--", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert nxt.returncode == 0, nxt.stderr
        assert row["mountpoint"] not in fuse_mounts(), "the dead mount was left for later"
        out, err = proc.communicate("\n", timeout=30)
    assert proc.returncode == 1, err  # the program exited 0, but its mount was lost
    assert "gone" in out and "done" in out, out
    lines = problem_lines(err)
    assert len(lines) == 1 and "killed by signal 9" in lines[0], err
    assert not run_dirs()


def test_a_killed_daemon_is_cleared_by_its_own_run(project: Path) -> None:
    """The daemon killed, then the program ends: run itself detaches the dead mount and
    removes its directory, at once (no sweep needed)."""
    args: list[str | Path] = ["--project", project, "--new-session", "alone", "--", "sh", "-c"]
    with running(*args, "echo ready; read go; echo done") as proc:
        row = daemon_row("alone")
        os.kill(row["pid"], signal.SIGKILL)
        assert wait_until(lambda: "Z" in _state(row["pid"]), timeout=10)  # dead, before CMD ends
        out, err = proc.communicate("\n", timeout=30)
    assert proc.returncode == 1, err  # the program exited 0, but its mount was lost
    assert "done" in out
    assert len(problem_lines(err)) == 1, err
    assert row["mountpoint"] not in fuse_mounts()
    assert not run_dirs()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone Z"


def test_the_sweep_tells_a_dead_run_from_one_being_created(tmp_path: Path) -> None:
    """Without mounts: a directory whose run is gone (or a zombie) is removed at once; one
    with no owner yet, or an owner still being written, is left alone while it is young."""
    root = rundir.runtime_root()
    root.mkdir(parents=True, exist_ok=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    zombie = subprocess.Popen(["true"])
    assert wait_until(lambda: "Z" in _state(zombie.pid), timeout=10)
    dirs = {name: root / name for name in ("dead", "zombie", "creating", "writing", "live")}
    for path in dirs.values():
        (path / "mnt").mkdir(parents=True)
    (dirs["dead"] / "owner").write_text(f"{gone.pid} 1\n")
    (dirs["zombie"] / "owner").write_text(f"{zombie.pid} {rundir._start_time(zombie.pid)}\n")
    (dirs["writing"] / "owner").write_text("")
    (dirs["live"] / "owner").write_text(f"{os.getpid()} {rundir._start_time(os.getpid())}\n")
    try:
        rundir.sweep_dead_runs()
        assert sorted(p.name for p in run_dirs()) == ["creating", "live", "writing"]
    finally:
        zombie.wait()
        for path in dirs.values():
            rundir.remove_run_dir(path)
            for leftover in path.glob("*"):
                leftover.unlink()
            with suppress(OSError):
                path.rmdir()
