"""Starting the daemon: fork it, and wait for its word that the mount answers.

The parent does not import the daemon (pyfuse3, trio, the FUSE adapter): the forked child
does, so `sandboxfs run`'s own process never loads them, and `import sandboxfs.fuse.spawn`
stays as light as `project.mounts`.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

from sandboxfs.errors import KINDS, Failure
from sandboxfs.project.mounts import MountRequest, lazy_unmount

MOUNT_TIMEOUT = 20.0


class Starting:
    """A daemon forked and mounting: `ready()` waits for it."""

    def __init__(self, pid: int, status_fd: int, mountpoint: Path) -> None:
        self.pid = pid
        self._status_fd = status_fd
        self._mountpoint = mountpoint

    def ready(self) -> int:
        """The daemon's pid once it reports that the mount answers, or the error saying why
        not (the daemon then gone, and no mount left)."""
        message = _read_status(self._status_fd, MOUNT_TIMEOUT)
        os.close(self._status_fd)
        if message.startswith("READY"):
            return self.pid
        if not message:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            lazy_unmount(self._mountpoint)
            raise Failure(f"the daemon did not report a working mount within {MOUNT_TIMEOUT:.0f} s")
        os.waitpid(self.pid, 0)
        kind, _, text = message.partition(" ")[2].partition(" ")
        raise KINDS.get(kind, Failure)(text.strip())


def start_daemon(
    req: MountRequest, lifeline: int | None = None, after: Callable[[], None] | None = None
) -> Starting:
    """Fork the daemon for a validated request (no second interpreter start-up); it imports
    what serves the mount itself. Pair with `Starting.ready()`.

    The daemon keeps no descriptor of its parent's but `lifeline` (see `daemon.serve`): a
    program's terminal, pipes or the write end of that very lifeline would otherwise live on
    in it.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon: its own session, no terminal, never returns into the caller
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            keep = sorted({0, 1, 2, write_end, *(() if lifeline is None else (lifeline,))})
            for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
                os.closerange(low + 1, high)
            try:
                from sandboxfs.fuse.daemon import _run_daemon
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.write(write_end, f"ERROR Failure daemon failed: {exc!r}\n".encode())
                raise
            code = _run_daemon(req, write_end, lifeline, after)
        finally:
            os._exit(code)
    os.close(write_end)
    return Starting(pid, read_end, req.mountpoint)


def _read_status(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()
