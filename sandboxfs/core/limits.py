"""Per-zone limits: the largest file, the suffixes files may have, and a quota of bytes and
entries, with the tally that enforces the quota across every mount and API sandbox of a zone.

Suffixes: in a zone with a `suffixes` list, every non-directory name must end with one of them
(compared case-folded) to be created, linked or renamed to, and an existing file with another
suffix can neither be opened nor renamed (the rule of a read tool that checks the suffix before
reading), though it is listed, stat'ed and, where the matrix allows, deleted.

Quota: bytes are the apparent sizes of regular files, entries are every file, directory, link
and special file below the zone root, each inode once. The tally lives in a small file under
the project's state dir, read and updated under a lock for every change that grows a zone, so
mounts and sandboxes of one project share it. It is recounted from the backing directory when a
mount starts and, at most once a second, when a change would be refused (so files the user
deleted outside the mount are given back). A recount replaces what concurrent writers had
charged meanwhile: each of them may overshoot the quota by at most the one write it had in
flight.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .policy import Decision, Rule, deny, fold

_TALLY = struct.Struct("<qq")
_RECOUNT_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class Quota:
    bytes: int | None = None
    files: int | None = None


@dataclass(frozen=True, slots=True)
class ZoneLimits:
    """What one zone allows beyond the matrix; every field optional."""

    max_file_bytes: int | None = None
    suffixes: tuple[str, ...] | None = None
    quota: Quota | None = None

    @classmethod
    def make(
        cls,
        max_file_bytes: int | None = None,
        suffixes: Sequence[str] | None = None,
        quota: Quota | None = None,
    ) -> ZoneLimits:
        folded = tuple(fold(s) for s in suffixes) if suffixes is not None else None
        return cls(max_file_bytes, folded, quota)

    @property
    def any(self) -> bool:
        return self.max_file_bytes is not None or self.suffixes is not None or self.has_quota

    @property
    def has_quota(self) -> bool:
        return self.quota is not None and (
            self.quota.bytes is not None or self.quota.files is not None
        )

    @property
    def sizes_matter(self) -> bool:
        """Whether writes must learn the file's size (for max_file_bytes or the quota)."""
        return self.max_file_bytes is not None or self.has_quota

    def suffix_allowed(self, name: str) -> bool:
        if self.suffixes is None:
            return True
        folded = fold(name)
        return any(folded.endswith(s) and len(folded) > len(s) for s in self.suffixes)

    def suffix_decision(self, vpath: str, zone: str, what: str) -> Decision:
        listed = ", ".join(self.suffixes or ())
        return deny(
            errno.EACCES,
            f"{vpath}: {what} a file whose name does not end with an allowed suffix is refused "
            f"in {zone}; allowed suffixes: {listed}",
            Rule.SUFFIX,
        )

    def size_decision(self, vpath: str, zone: str, size: int) -> Decision:
        return deny(
            errno.EFBIG,
            f"{vpath} would be {size} bytes; files in {zone} may be at most "
            f"{self.max_file_bytes} bytes (max_file_bytes)",
            Rule.SIZE,
        )


class Tally:
    """The bytes and entries used in one zone, kept in `path` (None: in memory only) and
    checked against its quota."""

    def __init__(
        self, zone: str, quota: Quota, path: Path | None, recount: Callable[[], tuple[int, int]]
    ) -> None:
        self.zone = zone
        self.quota = quota
        self._recount = recount
        self._recounted = 0.0
        self._memory = (0, 0)
        self._fd = -1
        if path is not None:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.recount()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def recount(self) -> None:
        """Count the zone again from its backing directory and make that the tally."""
        used = self._recount()
        self._recounted = time.monotonic()
        self._locked(lambda _: used)

    def usage(self) -> tuple[int, int]:
        return self._locked(lambda used: used)

    def charge(self, nbytes: int, nfiles: int, vpath: str) -> Decision | None:
        """Add to the tally if the quota allows it; else the refusal (nothing is added)."""
        if nbytes <= 0 and nfiles <= 0:
            self.credit(-nbytes, -nfiles)
            return None
        over = self._try_charge(nbytes, nfiles)
        if over is not None and time.monotonic() - self._recounted >= _RECOUNT_INTERVAL:
            self.recount()
            over = self._try_charge(nbytes, nfiles)
        if over is None:
            return None
        used_bytes, used_files = over
        quota = self.quota
        if quota.bytes is not None and used_bytes + nbytes > quota.bytes:
            what = f"{used_bytes} of {quota.bytes} bytes are used and this would add {nbytes}"
        else:
            what = f"{used_files} of {quota.files} entries are used and this would add {nfiles}"
        return deny(
            errno.EDQUOT,
            f"{vpath}: the quota of {self.zone} is exhausted: {what}; delete files in "
            f"{self.zone} to make room",
            Rule.QUOTA,
        )

    def credit(self, nbytes: int, nfiles: int) -> None:
        if nbytes or nfiles:
            self._locked(lambda u: (max(0, u[0] - nbytes), max(0, u[1] - nfiles)))

    def _try_charge(self, nbytes: int, nfiles: int) -> tuple[int, int] | None:
        quota = self.quota
        refused: list[tuple[int, int]] = []

        def update(used: tuple[int, int]) -> tuple[int, int]:
            b, f = used[0] + max(nbytes, 0), used[1] + max(nfiles, 0)
            if (nbytes > 0 and quota.bytes is not None and b > quota.bytes) or (
                nfiles > 0 and quota.files is not None and f > quota.files
            ):
                refused.append(used)
                return used
            return (b, f)

        self._locked(update)
        return refused[0] if refused else None

    def _locked(self, change: Callable[[tuple[int, int]], tuple[int, int]]) -> tuple[int, int]:
        if self._fd < 0:
            self._memory = change(self._memory)
            return self._memory
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            data = os.pread(self._fd, _TALLY.size, 0)
            used = _TALLY.unpack(data) if len(data) == _TALLY.size else (0, 0)
            new = change(used)
            if new != used:
                os.pwrite(self._fd, _TALLY.pack(*new), 0)
            return new
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
