"""Warming the kernel's cache after mounting: the daemon lists the repository through its own
mount, so that the first `git status` finds every name and attribute cached.

Without it, the first `git status` after mounting sends one LOOKUP per tracked file (20,000 for a
20,000-file repository, over a second here), because the kernel knows nothing yet. A listing
hands the kernel names and attributes for a whole directory in a few requests (READDIRPLUS),
about a fifth of the daemon's time per entry, and where the daemon watches the directories
(see host_watch) they then stay cached until something changes them.

The walk runs in a thread of the daemon, breadth first from the zone's root, and lists at most
`cache.warm_entries` entries; the mount is reported ready when it ends (or after
daemon.WARM_WAIT, when it goes on in the background), so that a program started on the mount
does not race it. It does not descend into names that start with a dot (`.git`,
`.venv`, tool caches: large, and looked up by name when used) and stops at a trust change or
when the mount ends. Its requests come from the daemon's own thread, which the FUSE adapter
recognises (`tid`): they are decided by the gate without effect (Gate.without_effect: nothing is
audited, nobody is asked), so the walk lists exactly what every caller of the mount may list at
that level, and leaves no trace but a line in the daemon log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)


class Warm:
    """One walk; `tid` is its thread's id while it runs (0 before and after)."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root = root
        self.limit = limit
        self.tid = 0
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sandboxfs-warm", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> None:
        """Until the walk ends, at most `timeout` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        # Set before the first request and cleared before the thread ends: a thread id is
        # reused only after its thread is gone.
        self.tid = threading.get_native_id()
        started = time.monotonic()
        try:
            dirs, entries = self._walk()
        except Exception:  # a cache warm must never take the daemon down
            log.exception("warming the kernel's cache failed")
            return
        finally:
            self.tid = 0
        log.info(
            "warmed the kernel's cache: %d entries in %d directories of %s in %.2f s%s",
            entries,
            dirs,
            self.root,
            time.monotonic() - started,
            " (stopped)" if self.stop.is_set() else "",
        )

    def _walk(self) -> tuple[int, int]:
        queue: deque[str] = deque([str(self.root)])
        dirs = entries = 0
        while queue and entries < self.limit and not self.stop.is_set():
            path = queue.popleft()
            try:
                with os.scandir(path) as listing:
                    dirs += 1
                    for entry in listing:
                        entries += 1
                        if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                            queue.append(entry.path)
                        if entries >= self.limit or self.stop.is_set():
                            break
            except OSError:  # refused, gone, or the mount ended
                continue
        return dirs, entries
