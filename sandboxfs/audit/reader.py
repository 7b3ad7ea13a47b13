"""Reading the audit log: every entry in file order, queries in time order, and following it
as it grows (`tail -f`), across its segments and a rotation or prune meanwhile.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from sandboxfs.audit.common import (
    READ_BLOCK,
    canonical,
    format_ts,
    open_or_none,
    parse_entry,
    read_blocks,
    same_file,
    scan_tail,
    segments,
)

_EXACT_FIELDS = ("pid", "session", "workspace", "zone", "op", "trust", "allowed", "worker")
_DENIED = b'"allowed":false'
_REORDER = 4096  # entries `iter_query` holds to put concurrent writers' entries in time order


def _open_files(path: Path) -> Iterator[BinaryIO]:
    """The log's files open, oldest first, a segment at a time, then the log itself; a rotation
    meanwhile is followed (the renamed file is read as the segment it became), and a segment
    pruned meanwhile is skipped. Nothing if there is no log."""
    after = 0  # the last id of the segments read so far
    while True:
        pending = [seg for seg in segments(path) if seg.last > after]
        if pending:
            after = pending[0].last
            try:
                segment = pending[0].path.open("rb")
            except FileNotFoundError:
                continue
            with segment:
                yield segment
            continue
        stream = open_or_none(path)
        if stream is None:
            if any(seg.last > after for seg in segments(path)):
                continue  # rotated between the listing and the open
            return
        with stream:
            if any(seg.last > after for seg in segments(path)):
                continue  # rotated meanwhile: what was opened is a segment now
            yield stream
        return


def read_entries(path: Path) -> Iterator[dict[str, Any]]:
    """Every entry in file order (its segments first), skipping torn lines; nothing if there
    is no log."""
    for stream in _open_files(path):
        for line in stream:
            entry = parse_entry(line)
            if entry is not None:
                yield entry


@dataclass(frozen=True)
class AuditQuery:
    """Which entries to show; a None field does not filter. `since` <= ts < `until`."""

    session: str | None = None
    workspace: str | None = None
    op: str | None = None
    zone: str | None = None
    trust: str | None = None
    allowed: bool | None = None
    since: datetime | None = None
    until: datetime | None = None
    pid: int | None = None
    worker: str | None = None  # entries a worker's sandbox caused (sandboxfs.project.workers)
    limit: int | None = None  # keep only the last `limit` matching entries


class _Filter:
    """An AuditQuery prepared once for many entries, with byte needles to skip most lines."""

    def __init__(self, q: AuditQuery) -> None:
        self._wanted = [(k, v) for k in _EXACT_FIELDS if (v := getattr(q, k)) is not None]
        self._since = None if q.since is None else format_ts(q.since)
        self._until = None if q.until is None else format_ts(q.until)
        # Canonical JSON has no spaces, so a wanted field appears in its line exactly like this.
        needles = [b'"%s":%s' % (k.encode(), json.dumps(v).encode()) for k, v in self._wanted]
        needles.sort(key=lambda needle: needle != _DENIED)  # denials are rare: search for them
        self._needles = needles

    def __call__(self, entry: dict[str, Any]) -> bool:
        if any(entry.get(k) != v for k, v in self._wanted):
            return False
        ts = str(entry.get("ts", ""))
        if self._since is not None and ts < self._since:
            return False
        return self._until is None or ts < self._until

    def candidate_lines(self, data: bytes) -> Iterator[bytes]:
        """The lines of `data` that contain every needle: a superset of the matching lines."""
        if not self._needles:
            yield from data.split(b"\n")
            return
        first, rest = self._needles[0], self._needles[1:]
        pos = 0
        while (hit := data.find(first, pos)) >= 0:
            start = data.rfind(b"\n", 0, hit) + 1
            end = data.find(b"\n", hit)
            if end < 0:
                end = len(data)
            line = data[start:end]
            pos = end + 1
            if all(needle in line for needle in rest):
                yield line


def query(path: Path, q: AuditQuery) -> list[dict[str, Any]]:
    """Entries matching `q`, in timestamp order (so concurrent mounts interleave by time)."""
    return list(iter_query(path, q))


def iter_query(path: Path, q: AuditQuery) -> Iterator[dict[str, Any]]:
    """`query`, streamed: the log is read a block at a time and memory stays bounded whatever
    its size (with `limit`, the last `limit` matches; without, a reorder buffer of _REORDER
    entries, so entries further out of time order than that come in file order)."""
    blocks = (
        block
        for stream in _open_files(path)
        for block in read_blocks(stream, os.fstat(stream.fileno()).st_size)
    )
    yield from _select(blocks, q)


def _select(blocks: Iterable[bytes], q: AuditQuery) -> Iterator[dict[str, Any]]:
    """`query` on the log's `blocks` (of whole lines), so that `follow` can use what it has
    opened."""
    matches = _Filter(q)
    held: list[tuple[str, int, dict[str, Any]]] = []  # a heap, by time then file order
    seq = 0
    for block in blocks:
        for line in matches.candidate_lines(block):
            entry = parse_entry(line)
            if entry is None or not matches(entry):
                continue
            seq += 1
            item = (str(entry.get("ts", "")), seq, entry)
            if q.limit is not None:  # keep the `limit` latest
                if len(held) < q.limit:
                    heapq.heappush(held, item)
                elif q.limit > 0 and item[:2] > held[0][:2]:
                    heapq.heapreplace(held, item)
            else:
                heapq.heappush(held, item)
                if len(held) > _REORDER:
                    yield heapq.heappop(held)[2]
    while held:
        yield heapq.heappop(held)[2]


def json_line(entry: dict[str, Any]) -> str:
    """An entry as `follow` prints it for --json: its canonical JSON, as it is stored."""
    return canonical(entry).decode()


def follow(
    path: Path,
    q: AuditQuery,
    out: TextIO,
    *,
    render: Callable[[dict[str, Any]], str],
    poll: float = 0.2,
    stop: Callable[[], bool] = lambda: False,
    resume: tuple[int, int] | None = None,
    last: int = 0,
) -> None:
    """Print entries appended from now on that match `q` (its `limit` is ignored), until stop(),
    like `tail -f`; first the `last` latest matching entries already there, as `query` orders
    them, read from the same open file so that none is missed or shown twice.

    Entries are recognised as new by id, so re-reading a log that prune replaced prints nothing
    twice; when the log is rotated, the rest of the old file is read, then any segment rotated
    since, then the new file. Each entry is printed as `render` makes it (`json_line`, or a
    table row without a header). `resume` = (file offset, last id already shown) continues a
    `query` without a gap: pass the log's size from before the query and the largest id it
    printed.
    """
    follower = _Follower(path, q, out, render)
    try:
        follower.start(resume, last)
        while not stop():
            follower.poll()
            time.sleep(poll)
    finally:
        follower.close()


class _Follower:
    """What `follow` keeps between polls: the log's file it reads (None while there is none)
    and the last id it has read, which tells a new entry from one shown already."""

    def __init__(
        self, path: Path, q: AuditQuery, out: TextIO, render: Callable[[dict[str, Any]], str]
    ) -> None:
        self._path = path
        self._q = q
        self._matches = _Filter(q)
        self._out = out
        self._render = render
        self._stream = open_or_none(path)
        # Where the log was rotated and no new file holds an entry yet, now is the newest
        # segment's end.
        self._last_id = max((seg.last for seg in segments(path)), default=0)

    def _show(self, entry: dict[str, Any]) -> None:
        self._out.write(self._render(entry) + "\n")

    def start(self, resume: tuple[int, int] | None, last: int) -> None:
        """Stand where following begins: at `resume`, or at the log's end after showing the
        `last` latest matching entries."""
        stream = self._stream
        if stream is None:
            return
        if resume is not None:
            stream.seek(resume[0])
            self._last_id = resume[1]
            return
        tail = scan_tail(stream.fileno(), os.fstat(stream.fileno()).st_size)
        if last > 0:  # up to the last complete line: one being written is still to come
            earlier = (block for seg in segments(self._path) for block in _segment_blocks(seg.path))
            blocks = itertools.chain(earlier, read_blocks(stream, tail.valid_end))
            for known in _select(blocks, replace(self._q, limit=last)):
                self._show(known)
            self._out.flush()
        stream.seek(tail.valid_end)
        self._last_id = max(self._last_id, tail.last_id)

    def poll(self) -> None:
        """Show what was appended since the last poll, following a prune or rotation."""
        if self._stream is None or not same_file(self._stream.fileno(), self._path):
            if self._stream is not None:  # replaced (pruned) or rotated: finish it first
                self._read_new(self._stream)
                self._stream.close()
            self._stream = open_or_none(self._path)
            self._read_segments()
        if self._stream is not None:
            self._read_new(self._stream)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def _read_new(self, source: BinaryIO) -> None:
        """Show the matching entries of `source` from where it stands past the last id."""
        pending = b""
        while data := source.read(READ_BLOCK):
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                entry = parse_entry(line)
                if entry is None or entry["id"] <= self._last_id:
                    continue
                self._last_id = entry["id"]
                if self._matches(entry):
                    self._show(entry)
            self._out.flush()
        source.seek(-len(pending), os.SEEK_CUR)  # a line still being written: read it again

    def _read_segments(self) -> None:
        """Read the segments that hold entries past the last id (rotated since it was shown)."""
        for seg in segments(self._path):
            if seg.last > self._last_id:
                with contextlib.suppress(FileNotFoundError), seg.path.open("rb") as source:
                    self._read_new(source)


def _segment_blocks(segment: Path) -> Iterator[bytes]:
    """The blocks of a segment's lines; nothing if it was pruned meanwhile."""
    try:
        stream = segment.open("rb")
    except FileNotFoundError:
        return
    with stream:
        yield from read_blocks(stream, os.fstat(stream.fileno()).st_size)
