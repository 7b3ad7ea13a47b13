"""How the daemon waits for the next FUSE request.

A synchronous client pays one FUSE round trip per request, and most of that round trip is not
work: it is the wake-up of the daemon's CPU from idle when the request arrives (tens of
microseconds on a VM, where the idle vCPU halts). Programs that touch many files send their
requests back to back, a few microseconds of their own work apart. So after answering one request
the daemon keeps looking for the next one for a short while (`spin`) before it sleeps; on a busy
mount it then never sleeps at all. The cost is at most `spin` of CPU time after the last request of
a burst, and the spin yields the CPU to any other runnable thread.

pyfuse3 waits for each request with its private `_wait_fuse_readable`: a lock and a full trip
through trio's scheduler and epoll, even when the next request is already queued. `install`
replaces it, but only where it is the coroutine function this was written against; otherwise
pyfuse3's own wait runs unchanged. sandboxfs runs a single request task (every handler runs to
completion without awaiting, so more tasks would only add the lock), and this wait lets trio run
its other tasks (audit flushes, signal handling) at least every `_YIELD_EVERY` requests.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import select
import time

import pyfuse3
import trio

_YIELD_EVERY = 64


class RequestWait:
    """A replacement for pyfuse3's `_wait_fuse_readable`: True when a request is ready to read,
    False when the loop should end."""

    def __init__(self, fuse_fd: int, spin: float) -> None:
        self._fd = fuse_fd
        self._spin = spin
        self._poller = select.poll()
        self._poller.register(fuse_fd, select.POLLIN)
        self._since_yield = 0
        self._stopped = False

    def stop(self) -> None:
        """Make the next wait return False; pair with `pyfuse3.terminate()`."""
        self._stopped = True

    async def __call__(self) -> bool:
        self._since_yield += 1
        if self._since_yield >= _YIELD_EVERY:
            self._since_yield = 0
            await trio.lowlevel.checkpoint()
        if self._stopped:
            return False
        if self._ready():
            return True
        self._since_yield = 0
        try:
            await trio.lowlevel.wait_readable(self._fd)
        except trio.ClosedResourceError:  # pyfuse3.terminate()
            return False
        return not self._stopped

    def _ready(self) -> bool:
        poll = self._poller.poll
        if poll(0):
            return True
        if self._spin <= 0:
            return False
        clock = time.perf_counter
        deadline = clock() + self._spin
        while clock() < deadline:
            os.sched_yield()
            if poll(0):
                return True
        return False


def install(spin: float) -> RequestWait | None:
    """Replace pyfuse3's request wait (see the module docstring); None where that cannot be done."""
    original = getattr(pyfuse3, "_wait_fuse_readable", None)
    fuse_fd = _dev_fuse_fd()
    if fuse_fd is None or not inspect.iscoroutinefunction(original):
        return None
    wait = RequestWait(fuse_fd, spin)
    setattr(pyfuse3, "_wait_fuse_readable", wait)  # noqa: B010
    return wait


def _dev_fuse_fd() -> int | None:
    """The descriptor of this process's FUSE session (pyfuse3 does not expose it)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.append(int(name))
    return found[0] if len(found) == 1 else None
