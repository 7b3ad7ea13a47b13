"""The signals `run` notes instead of dying of them: while it waits for the program (to forward
them) and while the daemon unmounts (to cut that wait short), and how it sends one on.

A noted signal is only appended to a list; what it means is decided in the loop that reads the
list, outside the handler, where it is safe to do anything.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def noted(watched: Iterable[int], wakeup_fd: int | None = None) -> Iterator[list[int]]:
    """Each of `watched`, as it comes, appended to the list given, and with `wakeup_fd` a byte
    written there (signal.set_wakeup_fd) to wake a select; the handlers (and wake-up descriptor)
    there were before are back at the end."""
    seen: list[int] = []
    old = {signum: signal.signal(signum, lambda n, _f: seen.append(n)) for signum in watched}
    old_wake = None if wakeup_fd is None else signal.set_wakeup_fd(wakeup_fd)
    try:
        yield seen
    finally:
        if old_wake is not None:
            signal.set_wakeup_fd(old_wake)
        for signum, handler in old.items():
            signal.signal(signum, handler)


def send_to_groups(groups: Iterable[int], signum: int) -> None:
    """`signum` to each process group; one already gone (or no longer the user's) is skipped."""
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)
