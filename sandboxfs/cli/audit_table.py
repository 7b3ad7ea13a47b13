"""The table `sandboxfs audit show` prints: fixed-width columns, times in a chosen zone, and
every cell made one line of visible text, so that a file name cannot forge a row.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sandboxfs.audit.common import visible_text


@dataclass(frozen=True, slots=True)
class Clock:
    """Which time the table's TIME column shows; JSON keeps `ts` in UTC whatever this says.

    Local time is the TZ variable's zone (else /etc/localtime), each entry at its own offset,
    so a log spanning a change to or from daylight saving time is right on both sides.
    """

    local: bool = False

    def label(self) -> str:
        """The zone as the header names it: UTC, JST, or CET/CEST for a zone with summer time."""
        if not self.local:
            return "UTC"
        standard, summer = time.tzname
        return standard if not time.daylight or standard == summer else f"{standard}/{summer}"

    def show(self, ts: object) -> str:
        """`ts` to the second in this clock's zone; text that is no time is shown as it is."""
        if not isinstance(ts, str):
            return ""
        if not self.local:
            return ts[:19].replace("T", " ")
        try:
            moment = datetime.fromisoformat(ts)
        except ValueError:
            return visible_text(ts)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)  # as format_ts: a naive time is UTC
        return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


_UTC = Clock()


_COLUMNS = (
    ("TIME", 19),
    ("OP", 8),
    ("RESULT", 6),
    ("ZONE", 9),
    ("PATH", 40),
    ("PROCESS", 22),
    ("REASON", 0),
)


def _row(cells: Sequence[str]) -> str:
    # Widths are fixed, so rows printed one at a time by `follow` line up; a longer cell
    # is shown whole and pushes the rest of its row right.
    padded = (cell.ljust(width) for cell, (_, width) in zip(cells, _COLUMNS, strict=True))
    return "  ".join(padded).rstrip()


def _result(entry: dict[str, Any]) -> str:
    """The RESULT cell: `DENIED` (refused by the policy), `failed` (not refused, yet not done:
    a rename or link across zones, EXDEV, which `mv` answers by copying), `-` (neither allowed
    nor refused: an approval request asking the user, a grant revoked), or `ok`."""
    allowed = entry.get("allowed")
    if allowed is False:
        return "DENIED"
    if allowed is None:
        return "failed" if entry.get("errno") is not None else "-"
    return "ok"


def _table_row(entry: dict[str, Any], clock: Clock | None = None) -> str:
    path = visible_text(entry.get("path"))
    if entry.get("path") is None and entry.get("detail") is not None:
        path = visible_text(entry["detail"])  # `run` and `net` entries: the command, the host
    if entry.get("below") is True:  # entries folded into one: at or below that directory
        path += "/..."
    if entry.get("dest") is not None:
        path += " -> " + visible_text(entry["dest"])
    pid = entry.get("pid")
    process = visible_text(entry.get("comm"))
    if pid is not None:
        process = f"{process or '?'}[{visible_text(pid)}]"
    result = _result(entry)
    reason = ""
    if result in ("DENIED", "failed"):  # refused, or failed (EXDEV): the errno and why
        code = entry.get("errno")
        name = errno.errorcode.get(code, str(code)) if isinstance(code, int) else visible_text(code)
        reason = ": ".join(part for part in (name, visible_text(entry.get("reason"))) if part)
    elif entry.get("path") is not None and entry.get("detail") is not None:
        reason = visible_text(entry["detail"])  # what an allowed `stage` or `setattr` did
    count = entry.get("count")
    if isinstance(count, int) and not isinstance(count, bool):  # entries folded into one
        reason = f"{reason} ({count} times since {(clock or _UTC).show(entry.get('first_ts'))})"
    cells = [
        (clock or _UTC).show(entry.get("ts")),
        visible_text(entry.get("op")),
        result,
        visible_text(entry.get("zone")),
        path,
        process,
        reason,
    ]
    return _row(cells)


def format_row(entry: dict[str, Any], clock: Clock | None = None) -> str:
    """One entry's row of `format_table`, without the header (for output streamed a row at a
    time)."""
    return _table_row(entry, clock)


def format_table(entries: Sequence[dict[str, Any]], clock: Clock | None = None) -> str:
    """A header line and one row per entry; `format_table([], clock)` is the header alone.

    With a `clock` the header names its zone (`TIME (UTC)`); without one the times are UTC and
    the header is a bare `TIME`, as it was before times named their zone.
    """
    names = [name for name, _ in _COLUMNS]
    if clock is not None:
        names[0] += f" ({clock.label()})"
    return "\n".join([_row(names), *(_table_row(entry, clock) for entry in entries)])
