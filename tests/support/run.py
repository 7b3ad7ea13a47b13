"""`sandboxfs run` driven from outside: bounded runs, terminals, servers, nobody, leftovers."""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import SANDBOXFS
from tests.support.mounts import make_project

NOBODY_UID = 65534
NOBODY = ["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups", "--"]
TIMEOUT = 60.0
PY = "/usr/bin/python3"  # the system's, which the sandbox's read-only /usr holds

needs_bwrap = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)


# ----- running sandboxfs run ---------------------------------------------------------------------


def sbx(
    *args: str | Path,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT,
    pass_fds: Sequence[int] = (),
) -> subprocess.CompletedProcess[str]:
    """The sandboxfs CLI, stdin from /dev/null, its own process group (killed on a timeout)."""
    proc = subprocess.Popen(
        [*prefix, *SANDBOXFS, *map(str, args)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"sandboxfs {' '.join(map(str, args))} hung") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def audit(project: Path, *filters: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*SANDBOXFS, "audit", "--project", str(project), "--json", *filters],
        capture_output=True,
        text=True,
        check=True,
    )
    return [json.loads(line) for line in result.stdout.splitlines()]


def run_dirs() -> list[Path]:
    root = Path(os.environ["SANDBOXFS_STATE_DIR"]) / "run"
    return sorted(root.iterdir()) if root.is_dir() else []


def fuse_mounts() -> list[str]:
    text = Path("/proc/self/mounts").read_text()
    return [line.split()[1] for line in text.splitlines() if " fuse.sandboxfs " in line]


@pytest.fixture(autouse=True)
def nothing_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No mount of this test session's (below its base temporary directory, where its state
    dir and projects are) outlives a test: another session's mounts are not ours to judge."""
    ours = f"{tmp_path_factory.getbasetemp()}/"

    def mounts() -> set[str]:
        return {mnt for mnt in fuse_mounts() if mnt.startswith(ours)}

    before = mounts()
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (mounts() - before or run_dirs()):
        time.sleep(0.05)
    left = mounts() - before
    for mnt in left:
        subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
    assert not left, f"mounts left behind: {left}"
    assert not run_dirs(), f"run directories left behind: {run_dirs()}"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    proj = make_project(tmp_path)
    (proj / "README.md").write_text("the project readme\n")
    return proj


def lines(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """`name: outcome` lines printed by a probe script."""
    found = {}
    for line in result.stdout.splitlines():
        name, sep, outcome = line.partition(": ")
        if sep:
            found[name.strip()] = outcome.strip()
    return found


# ----- a terminal: a pty of the test's own -------------------------------------------------------


class Pty:
    """`sandboxfs run` on a pty of the test's own, driven like a user at a keyboard."""

    def __init__(self, *args: str | Path, prefix: Sequence[str] = ()) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # pragma: no cover - the child
            os.environ["TERM"] = "dumb"
            argv = [*prefix, *SANDBOXFS, *map(str, args)]
            os.execvp(argv[0], argv)
        self.output = b""
        self.status: int | None = None

    def read_until(self, needle: bytes, timeout: float = 15) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.output:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"{needle!r} not seen; output: {self.output[-2000:]!r}")
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                data = b""
            if not data:
                raise AssertionError(f"{needle!r} not seen before EOF: {self.output[-2000:]!r}")
            self.output += data
        return self.output

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self.status is None:
            with suppress(OSError):
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.output += os.read(self.fd, 65536)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"run did not end; output: {self.output[-2000:]!r}")
        return self.status

    def kill(self) -> None:
        if self.status is None:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.status = -9

    def close(self) -> None:
        self.kill()
        os.close(self.fd)


@contextmanager
def on_pty(*args: str | Path, prefix: Sequence[str] = ()) -> Iterator[Pty]:
    term = Pty(*args, prefix=prefix)
    try:
        yield term
    finally:
        term.close()


class UserTerminal:
    """A pty standing for the user's terminal; `start` runs `sandboxfs run` with it as its
    controlling terminal and each of 0, 1, 2 either on it or redirected."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        os.set_blocking(self.master, False)
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, b"\x18\x00\x50\x00\x00\x00\x00\x00")
        self.output = b""
        self.proc: subprocess.Popen[bytes] | None = None

    def modes(self) -> list[Any]:
        return termios.tcgetattr(self.slave)

    def start(
        self, *args: str | Path, stdin: Any = "tty", stdout: Any = "tty", stderr: Any = "tty"
    ) -> subprocess.Popen[bytes]:
        slave = self.slave

        def controlling_terminal() -> None:  # after setsid (start_new_session), in the child
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

        streams = [slave if s == "tty" else s for s in (stdin, stdout, stderr)]
        self.proc = subprocess.Popen(
            [*SANDBOXFS, *map(str, args)],
            stdin=streams[0],
            stdout=streams[1],
            stderr=streams[2],
            start_new_session=True,
            pass_fds=(slave,),
            preexec_fn=controlling_terminal,  # the test runs no threads here
        )
        return self.proc

    def read_until(self, needle: bytes, timeout: float = 20) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.output:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{needle!r} not seen; output: {self.output[-2000:]!r}")
            if select.select([self.master], [], [], min(left, 0.1))[0]:
                with suppress(BlockingIOError, OSError):
                    self.output += os.read(self.master, 65536)
        return self.output

    def collect(self) -> bytes:
        with suppress(BlockingIOError, OSError):
            while data := os.read(self.master, 65536):
                self.output += data
        return self.output

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait(self, timeout: float = TIMEOUT) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise AssertionError(f"run did not end; terminal: {self.collect()[-2000:]!r}")
            self.collect()
            time.sleep(0.05)
        self.collect()
        return self.proc.returncode

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        for fd in (self.master, self.slave):
            os.close(fd)


# ----- the network -------------------------------------------------------------------------------


@contextmanager
def http_server(text: str) -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# ----- as an ordinary user -----------------------------------------------------------------------


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    """A home, state dir and project owned by nobody, in a directory everyone can traverse."""
    if os.geteuid() != 0:
        pytest.skip("the ordinary-user tests switch to nobody, which needs root")
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-run-", dir="/tmp"))
    try:
        root.chmod(0o755)
        make_project(root)
        (root / "project" / "README.md").write_text("the project readme\n")
        (root / "home").mkdir()
        subprocess.run(["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(root)], check=True)
        usable = subprocess.run(
            [*NOBODY, sys.executable, "-c", "import sandboxfs.cli.main"], capture_output=True
        )
        assert usable.returncode == 0, f"nobody cannot run sandboxfs: {usable.stderr!r}"
        yield root
    finally:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            if str(root) in line.split()[1]:
                subprocess.run(["fusermount3", "-u", "-z", line.split()[1]], check=False)
        shutil.rmtree(root, ignore_errors=True)


def nobody_env(root: Path) -> dict[str, str]:
    return {
        "HOME": str(root / "home"),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "SANDBOXFS_STATE_DIR": str(root / "home" / "state"),
        "SECRET_TOKEN": "sekrit",
    }
