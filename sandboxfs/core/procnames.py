"""Which program a calling thread belongs to, for audit entries and approval requests: its
command name and its process (thread group), read from /proc once and remembered."""

from __future__ import annotations

import os
from collections import OrderedDict


def _read_comm(fd: int) -> str:
    return os.pread(fd, 64, 0).rstrip(b"\n").decode("utf-8", "replace")


class ProcessNames:
    """`comm` of recent callers, read through a descriptor kept open per pid.

    Opening /proc/<pid>/comm is most of the cost of reading it, and the same few processes
    make most requests. A descriptor stays bound to the process it was opened for: once that
    process is gone, reading fails (ESRCH) even if its pid has been reused, and the pid is
    looked up afresh. A name changed by exec or prctl shows on the next read.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._fds: OrderedDict[int, int] = OrderedDict()
        # Thread id -> its thread group (process) id, while its comm descriptor is kept:
        # valid exactly as long as that descriptor still reads (the same thread).
        self._groups: dict[int, int] = {}

    def process(self, tid: int) -> int:
        """The process (thread group id, `Tgid:` of /proc/<tid>/status) of thread `tid`, or
        `tid` itself when that cannot be read. Read once per thread, and trusted only if the
        thread's comm descriptor, opened before, still reads after: a tid reused meanwhile
        by another process fails it."""
        if self.get(tid) is None:
            return tid
        known = self._groups.get(tid)
        if known is not None:
            return known
        bound = self._fds[tid]  # opened for this very thread
        try:
            fd = os.open(f"/proc/{tid}/status", os.O_RDONLY | os.O_CLOEXEC)
            try:
                status = os.pread(fd, 4096, 0)
            finally:
                os.close(fd)
            group = int(status.split(b"\nTgid:", 1)[1].split(b"\n", 1)[0])
            _read_comm(bound)  # still that thread: the status read was its own
        except (OSError, IndexError, ValueError):
            return tid
        if group <= 0:
            return tid
        self._groups[tid] = group
        return group

    def get(self, pid: int) -> str | None:
        fd = self._fds.get(pid)
        if fd is not None:
            try:
                name = _read_comm(fd)
            except OSError:
                del self._fds[pid]
                self._groups.pop(pid, None)
                os.close(fd)
            else:
                self._fds.move_to_end(pid)
                return name
        if pid <= 0:
            return None
        try:
            fd = os.open(f"/proc/{pid}/comm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            name = _read_comm(fd)
        except OSError:
            os.close(fd)
            return None
        self._fds[pid] = fd
        if len(self._fds) > self._capacity:
            gone, oldest = self._fds.popitem(last=False)
            self._groups.pop(gone, None)
            os.close(oldest)
        return name

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._groups.clear()
