"""Folding floods of refusals, so that a program cannot grow the log without bound.

Identical refusals within a window become one entry with a count; distinct refusals past a
bucket are counted per op, without what they were refused (see `Folder`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sandboxfs.audit.common import canonical

# Identical refusals within a window become one entry with a count (see AuditLog.record).
REPEAT_WINDOW = 1.0  # seconds
# Distinct refusals are written in full from a bucket of ITEMISED_BURST (and ITEMISED_BYTES)
# refilled at ITEMISED_PER_SECOND (and ITEMISED_BYTES_PER_SECOND): a burst (`find` over a
# forbidden tree, a test) is itemised whole; a sustained flood of distinct refusals is counted
# per op past it, so the log grows at most by the refill rate.
ITEMISED_BURST = 1000
ITEMISED_BYTES = 512 << 10
ITEMISED_PER_SECOND = 20
ITEMISED_BYTES_PER_SECOND = 12 << 10
# What a refusal counted but not itemised keeps of its first entry: who, not what.
_UNITEMISED = ("path", "dest", "zone", "pid", "uid", "comm", "bytes", "detail", "errno")


@dataclass(slots=True)
class _Repeats:
    """Refusals identical to one written in full (`entry`) in the current window."""

    entry: dict[str, Any]
    count: int = 0
    first_ts: str = ""
    last_ts: str = ""

    def add(self, ts: str) -> None:
        self.count += 1
        self.first_ts = self.first_ts or ts
        self.last_ts = ts

    def summary(self, reason: str | None = None) -> dict[str, Any]:
        """The one entry that stands for them: `count` refusals from `first_ts` to `ts`."""
        entry = self.entry | {"count": self.count, "first_ts": self.first_ts, "ts": self.last_ts}
        if reason is not None:
            entry["reason"] = reason
        return entry


class Folder:
    """One writer's refusals of the current window: those written in full, those counted, and
    the bucket of distinct refusals that may still be itemised."""

    def __init__(self) -> None:
        self._repeats: dict[bytes, _Repeats] = {}  # this window's refusals written in full
        # By op, and whether the log was failing: refusals counted, not itemised.
        self._unitemised: dict[tuple[str, bool], _Repeats] = {}
        self._window_end = 0.0  # time.monotonic() when the current window of refusals ends
        self._tokens = float(ITEMISED_BURST)  # distinct refusals that may still be itemised
        self._token_bytes = float(ITEMISED_BYTES)  # and their bytes
        self._filled_at = time.monotonic()

    @property
    def counted_ops(self) -> int:
        """How many entries of refusals counted, not itemised, the window will end with."""
        return len(self._unitemised)

    def fold(self, entry: dict[str, Any], queue: list[dict[str, Any]], *, failing: bool) -> bool:
        """Count `entry`, a refusal, if one like it was written this window (True); False if
        it is to be written in full. A window that ended queues its counts on `queue` first."""
        now = time.monotonic()
        if now >= self._window_end:
            self.end_window(queue)
            self._window_end = now + REPEAT_WINDOW
        key = canonical({k: v for k, v in entry.items() if k != "ts"})
        repeats = self._repeats.get(key)
        if repeats is not None:
            repeats.add(entry["ts"])
            return True
        if self._take_token(now, len(key)):
            self._repeats[key] = _Repeats(entry)
            return False
        op = (str(entry.get("op")), failing)
        bucket = self._unitemised.get(op)
        if bucket is None:
            first = {k: (None if k in _UNITEMISED else v) for k, v in entry.items()}
            bucket = self._unitemised[op] = _Repeats(first)
        bucket.add(entry["ts"])
        return True

    def _take_token(self, now: float, size: int) -> bool:
        """Refill the bucket for the time since it was last, and take a refusal of `size`
        bytes from it; False if it has too little left."""
        elapsed, self._filled_at = now - self._filled_at, now
        self._tokens = min(ITEMISED_BURST, self._tokens + elapsed * ITEMISED_PER_SECOND)
        self._token_bytes = min(
            ITEMISED_BYTES, self._token_bytes + elapsed * ITEMISED_BYTES_PER_SECOND
        )
        if self._tokens >= 1 and self._token_bytes >= size:
            self._tokens -= 1
            self._token_bytes -= size
            return True
        return False

    def end_window(self, queue: list[dict[str, Any]], now: float | None = None) -> None:
        """Queue on `queue` the entries for the refusals counted in the window that ended (or,
        with no `now`, in the current one, as at close)."""
        if now is not None and now < self._window_end:
            return
        for repeats in self._repeats.values():
            if repeats.count:
                queue.append(repeats.summary())
        for (op, failing), bucket in self._unitemised.items():
            why = (
                "refused while the audit log could not be written"
                if failing
                else f"distinct refusals past {ITEMISED_BURST} at once (or"
                f" {ITEMISED_BYTES >> 10} KiB), then {ITEMISED_PER_SECOND} a second"
            )
            reason = f"{bucket.count} refusals of {op} counted, not itemised: {why}"
            queue.append(bucket.summary(reason))
        self._repeats.clear()
        self._unitemised.clear()
        self._window_end = 0.0


# Allowed reads and listings fold too (a `grep -r` opens every file, `git status` lists every
# directory): within a window, the first of a kind per top-level directory of a zone is
# written in full at once, and the others are counted, then written as one entry when the
# window ends. What is alike: every field but `ts`, `path` and `pid` (threads of one program).
FOLDED_OPS = frozenset({"read", "list"})
# At most this many kinds are counted in one window; past it, entries are written in full.
MAX_FOLDED_KINDS = 4096


@dataclass(slots=True)
class _Below:
    """The allowed entries of one kind counted in this window, under `parts` (the deepest
    directory that holds them all, or their one path)."""

    entry: dict[str, Any]  # the first one counted
    parts: list[str]
    count: int = 1
    same: bool = True  # all of one path

    def add(self, entry: dict[str, Any]) -> None:
        self.count += 1
        parts = entry["path"].split("/")
        if parts != self.parts:
            self.same = False
            common = 0
            for mine, theirs in zip(self.parts, parts, strict=False):
                if mine != theirs:
                    break
                common += 1
            del self.parts[common:]
        self.entry["ts"] = entry["ts"]

    def summary(self) -> dict[str, Any]:
        """The one entry that stands for them: `count` of them from `first_ts` to `ts`, at
        `path` (`below`: at or below it)."""
        entry = dict(self.entry)
        entry["path"] = "/".join(self.parts) or "/"
        entry["count"] = self.count
        if not self.same:
            entry["below"] = True
        return entry


def _foldable(entry: dict[str, Any]) -> tuple[Any, ...] | None:
    """The kind of an allowed read or listing (None: written in full): every field but `ts`,
    `path` and `pid`, and the top-level directory of its zone that holds its path."""
    if entry.get("allowed") is not True or entry.get("op") not in FOLDED_OPS:
        return None
    path = entry.get("path")
    if not isinstance(path, str) or entry.get("dest") is not None or entry.get("bytes"):
        return None
    if "detail" in entry or "count" in entry:
        return None
    fields = []
    for key, value in entry.items():
        if key in ("ts", "path", "pid"):
            continue
        if not (value is None or isinstance(value, str | int | float | bool)):
            return None  # an op's own structured field: written in full
        fields.append((key, value))
    top = "/".join(path.split("/", 3)[:3])  # "/repo/src" of "/repo/src/a/b.c"
    return (top, *sorted(fields))


class AllowedFolder:
    """One writer's allowed reads and listings of the current window (see FOLDED_OPS)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], _Below | None] = {}  # None: only the first so far
        self._window_end = 0.0

    @property
    def counted(self) -> int:
        """How many entries the window will end with."""
        return sum(1 for below in self._seen.values() if below is not None)

    def fold(self, entry: dict[str, Any], queue: list[dict[str, Any]]) -> bool:
        """Count `entry` if one of its kind was written this window (True); False if it is
        to be written in full. A window that ended queues its counts on `queue` first."""
        kind = _foldable(entry)
        if kind is None:
            return False
        now = time.monotonic()
        if now >= self._window_end:
            self.end_window(queue)
            self._window_end = now + REPEAT_WINDOW
        if kind not in self._seen:
            if len(self._seen) >= MAX_FOLDED_KINDS:
                return False
            self._seen[kind] = None
            return False
        below = self._seen[kind]
        if below is None:
            first = dict(entry)
            first["first_ts"] = entry["ts"]
            self._seen[kind] = _Below(first, entry["path"].split("/"))
        else:
            below.add(entry)
        return True

    def end_window(self, queue: list[dict[str, Any]], now: float | None = None) -> None:
        """Queue the entries of what was counted in the window that ended (or, with no
        `now`, in the current one, as at close)."""
        if now is not None and now < self._window_end:
            return
        queue.extend(below.summary() for below in self._seen.values() if below is not None)
        self._seen.clear()
        self._window_end = 0.0
