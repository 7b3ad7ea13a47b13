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
