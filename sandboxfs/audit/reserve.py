"""Room kept for the log on its file system: a denial must be on disk before its errno returns,
even when the disk is full. A few MiB are kept preallocated in `audit.reserve` beside the log and
given back, a slice at a time, when an append fails with ENOSPC or EDQUOT.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sandboxfs.audit.common import log

RESERVE_BYTES = 4 << 20  # room kept for the log on its file system; ~7k distinct denials
_RELEASE_STEP = 1 << 16  # the reserve is given back in slices of at least this
_REFILL_EVERY = 1.0  # seconds between attempts to fill a short reserve again


class Reserve:
    """The reserve file `name` in the directory `dir_fd` (of the log at `log_path`, which the
    warnings name), `size` bytes when full (0: none)."""

    def __init__(self, dir_fd: int, name: str, size: int, log_path: Path) -> None:
        self._dir_fd = dir_fd
        self._name = name
        self._size = size
        self._log_path = log_path
        self._short = False
        self._tried = 0.0  # time.monotonic() of the last fill or release

    def due(self) -> bool:
        """Whether it is short and long enough untried that filling it again is worth a try."""
        return self._short and time.monotonic() - self._tried >= _REFILL_EVERY

    def release(self, needed: int) -> bool:
        """Shrink the reserve by enough for `needed` bytes (and block rounding); False if there
        was none left to give. A slice at a time, so the reserve lasts for many denials."""
        step = (needed // _RELEASE_STEP + 2) * _RELEASE_STEP
        try:
            fd = os.open(
                self._name, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self._dir_fd
            )
        except OSError:
            return False
        try:
            have = os.fstat(fd).st_size
            if have == 0:
                return False
            os.ftruncate(fd, max(0, have - step))
        except OSError:
            return False
        finally:
            os.close(fd)
        self._short = True
        self._tried = time.monotonic()  # no use filling it again right away
        log.warning(
            "audit log %s: file system full, %d bytes of its reserve given back",
            self._log_path,
            min(have, step),
        )
        return True

    def fill(self) -> None:
        """Preallocate the reserve, or top it up; if the file system has no room for it (with
        as much again to spare, so this never takes the last free space), try later."""
        self._tried = time.monotonic()
        if self._size <= 0:
            return
        try:
            fd = os.open(
                self._name,
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
                dir_fd=self._dir_fd,
            )
        except OSError as exc:
            log.warning("audit log %s: no reserve: %s", self._log_path, exc.strerror)
            return
        try:
            st = os.fstat(fd)
            missing = self._size - min(st.st_size, st.st_blocks * 512)
            if missing <= 0:
                self._short = False
                return
            self._short = True
            fs = os.fstatvfs(fd)
            if fs.f_bavail * fs.f_frsize < missing + self._size:
                return
            try:
                os.posix_fallocate(fd, 0, self._size)
                self._short = False
            except OSError:
                os.ftruncate(fd, st.st_size)  # give back what a partial allocation took
        except OSError as exc:
            log.warning("audit log %s: cannot fill its reserve: %s", self._log_path, exc.strerror)
        finally:
            os.close(fd)
