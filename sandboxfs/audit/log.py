"""The audit log: append-only JSON lines, chained by SHA-256, keyed, shared by concurrent mounts.

Every entry carries `id` (consecutive), `prev` (the previous entry's hash) and `hash` (SHA-256 of
the entry's canonical JSON without `hash` and `mac`), so `verify` finds an edited, inserted,
removed or reordered line. Writers take a `flock` on a lock file beside the log and append with
one `write`, so several mounts (processes) can share one log and the chain stays linear.

The chain alone has no secret: whoever can write the file can cut its end or rebuild all of it.
So each log also has an *anchor* in the user's own state directory, outside every project
(sandboxfs.audit.anchor): a random key, the id from which entries are keyed, and the chain's
head (the last id and hash written), updated on every flush under the same lock. Each entry
carries `mac`, an HMAC-SHA256 of its hash under that key. The hash stays unkeyed on purpose:
anyone (another user, an auditor without the key, a log whose anchor is lost) can still check
the chain, and logs written before keys existed keep verifying. `verify` then also finds a cut
end (the log ends before the anchor's head) and a rebuilt chain (a mac that does not match).

A denial must be on disk before its errno returns, even when the disk is full: a few MiB are
kept preallocated in `audit.reserve` beside the log and given back, a slice at a time, when an
append fails with ENOSPC or EDQUOT; `AuditLog.failing` says when even that was not enough.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import heapq
import itertools
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from sandboxfs.audit.anchor import (
    Anchor,
    AnchorFile,
    Key,
    fsync_dir,
    locate_anchor,
    make_private_dirs,
    read_anchor,
)
from sandboxfs.core.entry import AuditOp, audit_entry
from sandboxfs.core.syscalls import write_all
from sandboxfs.errors import Failure

log = logging.getLogger(__name__)
_MAX_QUEUED = 100_000
GENESIS: str = "0" * 64

_CHUNK = 1 << 16
_SEALS = ("hash", "mac")  # what an entry's hash does not cover
TAMPER_OP = AuditOp.AUDIT_TAMPER  # the entry of a writer that finds the log cut or forged
RESERVE_BYTES = 4 << 20  # room kept for the log on its file system; ~7k distinct denials
_RELEASE_STEP = 1 << 16  # the reserve is given back in slices of at least this
_REFILL_EVERY = 1.0  # seconds between attempts to fill a short reserve again
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_EXACT_FIELDS = ("pid", "session", "workspace", "zone", "op", "trust", "allowed", "worker")
_DENIED = b'"allowed":false'
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
_RETRY_EVERY = 0.25  # seconds between attempts to write while the log is failing
UNCLEAN_OP = AuditOp.AUDIT_UNCLEAN  # the entry of a writer that ended without closing it
_WRITER_PREFIX = ".writer."  # a live writer's marker beside the log, locked for its life
_READ_BLOCK = 1 << 20
_REORDER = 4096  # entries `iter_query` holds to put concurrent writers' entries in time order
# Past this size the log is renamed to a segment and a new file continues the chain (0: never).
ROTATE_BYTES = 64 << 20
MIN_ROTATE_BYTES = 4096  # a smaller setting would make a file of a few entries


def _format_ts(moment: datetime) -> str:
    """UTC, microseconds, trailing Z: fixed width, so comparing the text compares the times.

    A naive datetime is taken to be UTC already.
    """
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return moment.isoformat(timespec="microseconds") + "Z"


_second_cache: tuple[int, str] = (-1, "")


def _now() -> str:
    """`_format_ts` of the current time, formatting the date and time of day once per second."""
    global _second_cache
    micros = time.time_ns() // 1000
    second, fraction = divmod(micros, 1_000_000)
    cached_second, prefix = _second_cache
    if second != cached_second:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second_cache = (second, prefix)
    return f"{prefix}.{fraction:06d}Z"


# Built once: json.dumps with options builds a new encoder on every call.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def _canonical(entry: dict[str, Any]) -> bytes:
    """The one byte form of an entry that is hashed and written; values JSON lacks become str."""
    return _ENCODER.encode(entry).encode("ascii")


def _digest(entry: dict[str, Any]) -> str:
    return hashlib.sha256(
        _canonical({k: v for k, v in entry.items() if k not in _SEALS})
    ).hexdigest()


def _sealed_line(
    entry: dict[str, Any], entry_id: int, prev: str, key: Key | None = None
) -> tuple[bytes, str]:
    """The line for `entry` placed in the chain, and its hash, serialising only once: the hash
    covers the canonical JSON without "hash" and "mac", which are then appended as the last
    keys (`mac` only with a key)."""
    body = _canonical(
        {k: v for k, v in entry.items() if k not in _SEALS} | {"id": entry_id, "prev": prev}
    )
    digest = hashlib.sha256(body).hexdigest()
    seals = b',"hash":"' + digest.encode("ascii")
    if key is not None:
        seals += b'","mac":"' + key.mac(digest).encode("ascii")
    return body[:-1] + seals + b'"}\n', digest


def _parse_entry(line: bytes) -> dict[str, Any] | None:
    """The entry on one line, or None for a torn or foreign line (no id, prev and hash)."""
    try:
        entry = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    if (
        isinstance(entry, dict)
        and isinstance(entry.get("id"), int)
        and isinstance(entry.get("prev"), str)
        and isinstance(entry.get("hash"), str)
    ):
        return entry
    return None


def _is_header(entry: dict[str, Any] | None) -> bool:
    """Whether `entry` is the header `prune` puts first, which links the chain to its anchor."""
    return (
        entry is not None
        and entry.get("op") == AuditOp.PRUNE
        and isinstance(entry.get("anchor"), str)
        and entry["prev"] == GENESIS
    )


def _lock_path(path: Path) -> Path:
    # Beside the log, not the log itself: prune replaces the log, and a lock on a replaced
    # inode would exclude nobody.
    return path.with_name(path.name + ".lock")


def _open_lock(path: Path, dir_fd: int | None = None) -> int:
    where = _lock_path(path) if dir_fd is None else _lock_path(path).name
    return os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


@contextlib.contextmanager
def _exclusive(lock_fd: int) -> Iterator[None]:
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)


def _open_log(path: Path | str, dir_fd: int | None = None) -> int:
    # Read access too: the tail is read back to continue the chain.
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    return os.open(path, flags, 0o600, dir_fd=dir_fd)


def _same_file(fd: int, path: Path | str, dir_fd: int | None = None) -> bool:
    """False once `path` names another file than `fd` (prune replaced it) or none."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, dir_fd=dir_fd))
    except FileNotFoundError:
        return False


@dataclass(frozen=True, slots=True)
class Segment:
    """A rotated part of the log: `audit.<first id>-<last id>.jsonl` beside `audit.jsonl`.

    The ids in the name are the ones it was written with, so `verify` can tell a deleted
    segment (ids that no file holds) from a truncated one (a file that ends before its name).
    """

    path: Path
    first: int
    last: int


def segment_name(log_name: str, first: int, last: int) -> str:
    """The name a log file holding ids `first` to `last` takes when it is rotated."""
    stem, suffix = os.path.splitext(log_name)
    return f"{stem}.{first:012d}-{last:012d}{suffix}"


def segments(path: Path, dir_fd: int | None = None) -> list[Segment]:
    """The rotated segments of the log at `path`, oldest first (none if there is no directory).

    With `dir_fd` (the log's directory, open) the directory is listed through it.
    """
    stem, suffix = os.path.splitext(path.name)
    pattern = re.compile(rf"{re.escape(stem)}\.([0-9]+)-([0-9]+){re.escape(suffix)}")
    try:
        names = os.listdir(dir_fd if dir_fd is not None else path.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if (match := pattern.fullmatch(name)) is not None:
            found.append(Segment(path.with_name(name), int(match[1]), int(match[2])))
    return sorted(found, key=lambda seg: (seg.first, seg.last))


def log_files(path: Path) -> list[Path]:
    """Every file of the log, oldest first: its segments, then `path` (if it exists)."""
    files = [seg.path for seg in segments(path)]
    return [*files, path] if path.exists() else files


def _first_id(fd: int, end: int) -> int | None:
    """The id of the first entry (not a prune header) in the first `end` bytes of `fd`."""
    offset = 0
    carry = b""
    while offset < end:
        data = carry + os.pread(fd, min(_READ_BLOCK, end - offset), offset)
        if len(data) == len(carry):
            return None
        offset += len(data) - len(carry)
        *lines, carry = data.split(b"\n")
        for line in lines:
            entry = _parse_entry(line)
            if entry is not None and not _is_header(entry):
                return int(entry["id"])
    return None


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


# What a refusal counted but not itemised keeps of its first entry: who, not what.
_UNITEMISED = ("path", "dest", "zone", "pid", "uid", "comm", "bytes", "detail", "errno")


@dataclass(frozen=True, slots=True)
class _Tail:
    """Where the chain stands at the end of a file of `size` bytes.

    `valid_end` is the offset just past the last complete entry; anything after it is torn.
    `last_hash` is what the next entry's prev must be; `entry_hash` and `mac` are the last
    entry's own (they differ from `last_hash` only for a prune header alone in the file).
    """

    size: int
    last_id: int
    last_hash: str
    valid_end: int
    entry_hash: str = GENESIS
    mac: object = None

    @classmethod
    def after(cls, entry: dict[str, Any], size: int, valid_end: int) -> _Tail:
        # A prune header alone in the file: the chain continues from its anchor.
        link = entry["anchor"] if _is_header(entry) else entry["hash"]
        return cls(size, entry["id"], link, valid_end, entry["hash"], entry.get("mac"))


def _scan_tail(fd: int, size: int) -> _Tail:
    """Find the last complete entry by reading backwards, so a large log costs one small read."""
    buf = b""  # the file's bytes from `pos` to `size`
    pos = size
    end: int | None = None  # index in buf of the newline that ends the next line to try
    while True:
        if end is None and (found := buf.rfind(b"\n")) >= 0:
            end = found
        if end is not None:
            start = buf.rfind(b"\n", 0, end) + 1
            if start > 0 or pos == 0:
                entry = _parse_entry(buf[start:end])
                if entry is not None:
                    return _Tail.after(entry, size, pos + end + 1)
                if start == 0:
                    break
                end = start - 1
                continue
        if pos == 0:
            break
        read_from = max(0, pos - _CHUNK)
        chunk = os.pread(fd, pos - read_from, read_from)
        buf = chunk + buf
        pos = read_from
        if end is not None:
            end += len(chunk)
    return _Tail(size, 0, GENESIS, 0)


def _count_lines(fd: int, end: int) -> int:
    """Newlines in the first `end` bytes; only needed to name a torn line, which is rare."""
    count = 0
    for offset in range(0, end, _CHUNK):
        count += os.pread(fd, min(_CHUNK, end - offset), offset).count(b"\n")
    return count


class AuditLog:
    """Append-only, SHA-256 hash-chained, keyed JSON-lines log shared safely by several processes.

    Entries are queued and written in batches, except denials (which must be on disk before the
    caller sees its errno) and everything in sync mode. One instance is used from one thread.
    `reserve` bytes are kept preallocated beside the log for when its file system fills up.
    Past `rotate` bytes the log is renamed to a segment (see `Segment`) and a new file continues
    the chain; whichever writer flushes first past it rotates, under the lock all writers share,
    and the others follow it to the new file. `fold_refusals=False` writes every refusal in
    full (see `record`): for tests and imports.
    """

    def __init__(
        self,
        path: Path,
        *,
        sync: bool = False,
        batch_size: int = 512,
        reserve: int = RESERVE_BYTES,
        rotate: int = ROTATE_BYTES,
        fold_refusals: bool = True,
    ) -> None:
        self._path = path
        self._rotate = rotate
        self._fold_refusals = fold_refusals
        self._sync = sync
        self._batch_size = batch_size
        self._queue: list[dict[str, Any]] = []
        self._dropped = 0
        self._tail: _Tail | None = None  # valid while the file still has tail.size bytes
        self._failing = False
        self._failure: str | None = None  # why, while failing: the last write's error
        self._reserve_path = path.with_suffix(".reserve")
        self._reserve_size = reserve
        self._reserve_short = False
        self._reserve_tried = 0.0  # time.monotonic() of the last fill or release
        self._anchor: AnchorFile | None = None
        self._repeats: dict[bytes, _Repeats] = {}  # this window's refusals written in full
        # By op, and whether the log was failing: refusals counted, not itemised.
        self._unitemised: dict[tuple[str, bool], _Repeats] = {}
        self._window_end = 0.0  # time.monotonic() when the current window of refusals ends
        self._tokens = float(ITEMISED_BURST)  # distinct refusals that may still be itemised
        self._token_bytes = float(ITEMISED_BYTES)  # and their bytes
        self._filled_at = time.monotonic()
        self._retry_at = 0.0  # while failing: no new attempt to write before this
        self._last_error = 0
        anchor, why = locate_anchor(path)
        if anchor is None:
            raise Failure(f"audit log {path}: {why}; no entry is written without its key")
        self._anchor_path = anchor
        make_private_dirs(path.parent)
        # The directory is kept open and every file in it named relative to it: a project
        # renamed (or moved) under a live mount keeps its log, and no entry is dropped.
        self._name = path.name
        self._reserve_name = self._reserve_path.name
        self._dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._lock_fd = self._fd = self._marker_fd = -1
        try:
            self._lock_fd = _open_lock(path, self._dir_fd)
            self._fd = _open_log(self._name, self._dir_fd)
            with _exclusive(self._lock_fd):
                self._fill_reserve()
                try:
                    self._follow_anchor(os.fstat(self._fd).st_size)
                except OSError as exc:
                    raise Failure(
                        f"audit log {path}: {exc.strerror}; no entry is written without its key"
                    ) from None
                self._queue.extend(_sweep_writers(self._dir_fd, self._name))
                self._marker_name, self._marker_fd = _make_marker(self._dir_fd, self._name)
        except BaseException:
            for fd in (self._marker_fd, self._fd, self._lock_fd, self._dir_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        if self._queue:
            self.try_flush()

    @property
    def failing(self) -> bool:
        """True while entries cannot be written, even with the reserve given back.

        Entries (denials too) then wait in memory and would be lost if the daemon died, so the
        FUSE adapter refuses operations while this is True: it fails closed. Entries recorded
        meanwhile stay queued; the next flush that succeeds (`run` retries every interval)
        writes them and clears this.
        """
        return self._failing

    @property
    def failure(self) -> str | None:
        """Why entries cannot be written (the last attempt's error), while `failing`."""
        return self._failure

    def record(self, entry: dict[str, Any]) -> None:
        """Queue a copy of `entry` (stamped with `ts` if it has none); flush when it can't wait.

        Refusals are folded, so that a program cannot grow the log without bound: within a
        window of REPEAT_WINDOW seconds, the first of identical refusals (every field but `ts`
        equal: process, op, path, reason...) is written in full at once, and the others are
        counted, then written as one entry with `count` (how many), `first_ts` and `ts` (the
        first and last of them) when the window ends. Distinct refusals past the bucket
        (ITEMISED_BURST at once, then ITEMISED_PER_SECOND a second), further ones are counted per op
        without their path or process (one entry per op and window, `count` exact). So
        `count` (1 when absent) summed over refusals is every refusal, also of those refused
        while the log could not be written.
        """
        if self._fd < 0:
            raise ValueError(f"audit log {self._path} is closed")
        queued = dict(entry)
        if "ts" not in queued:
            queued["ts"] = _now()
        if queued.get("allowed") is False and self._fold_refusals and self._fold(queued):
            if self._queue:  # the window ended: its counts are due
                self.try_flush()
            return
        self._queue.append(queued)
        if self._sync or queued.get("allowed") is False or len(self._queue) >= self._batch_size:
            self.try_flush()

    def _fold(self, entry: dict[str, Any]) -> bool:
        """Count `entry`, a refusal, if one like it was written this window (True); False if
        it is to be written in full."""
        now = time.monotonic()
        if now >= self._window_end:
            self._end_window()
            self._window_end = now + REPEAT_WINDOW
        key = _canonical({k: v for k, v in entry.items() if k != "ts"})
        repeats = self._repeats.get(key)
        if repeats is not None:
            repeats.add(entry["ts"])
            return True
        elapsed, self._filled_at = now - self._filled_at, now
        self._tokens = min(ITEMISED_BURST, self._tokens + elapsed * ITEMISED_PER_SECOND)
        self._token_bytes = min(
            ITEMISED_BYTES, self._token_bytes + elapsed * ITEMISED_BYTES_PER_SECOND
        )
        if self._tokens >= 1 and self._token_bytes >= len(key):
            self._repeats[key] = _Repeats(entry)
            self._tokens -= 1
            self._token_bytes -= len(key)
            return False
        op = (str(entry.get("op")), self._failing)
        bucket = self._unitemised.get(op)
        if bucket is None:
            first = {k: (None if k in _UNITEMISED else v) for k, v in entry.items()}
            bucket = self._unitemised[op] = _Repeats(first)
        bucket.add(entry["ts"])
        return True

    def _end_window(self, now: float | None = None) -> None:
        """Queue the entries for the refusals counted in the window that ended (or, with no
        `now`, in the current one, as at close)."""
        if now is not None and now < self._window_end:
            return
        for repeats in self._repeats.values():
            if repeats.count:
                self._queue.append(repeats.summary())
        for (op, failing), bucket in self._unitemised.items():
            why = (
                "refused while the audit log could not be written"
                if failing
                else f"distinct refusals past {ITEMISED_BURST} at once (or"
                f" {ITEMISED_BYTES >> 10} KiB), then {ITEMISED_PER_SECOND} a second"
            )
            reason = f"{bucket.count} refusals of {op} counted, not itemised: {why}"
            self._queue.append(bucket.summary(reason))
        self._repeats.clear()
        self._unitemised.clear()
        self._window_end = 0.0

    def try_flush(self) -> bool:
        """Flush, but keep the entries queued (and the mount up) if the disk refuses them.

        A full or failing disk must not turn a policy refusal into a different error, or take
        the daemon down; the entries are retried on the next flush (and `failing` tells the
        adapter to refuse operations meanwhile). Past _MAX_QUEUED the oldest are dropped and
        their number is recorded once writing works again.
        """
        now = time.monotonic()
        if self._failing and now < self._retry_at:
            return False  # constant cost per request while failing: no new attempt yet
        if self._failing and self._last_error in _NO_SPACE and not self._room_for_queue():
            self._retry_at = now + _RETRY_EVERY
            return False
        try:
            self.flush()
            return True
        except OSError as exc:
            self._last_error = exc.errno or 0
            self._retry_at = time.monotonic() + _RETRY_EVERY
            if len(self._queue) > _MAX_QUEUED:
                excess = len(self._queue) - _MAX_QUEUED
                self._dropped += excess
                del self._queue[:excess]
            return False

    def _room_for_queue(self) -> bool:
        """Whether the log's file system seems to have room for the queue (a cheap check)."""
        try:
            fs = os.fstatvfs(self._fd)
        except OSError:
            return True
        return fs.f_bavail * fs.f_frsize > 1024 * (len(self._queue) + len(self._unitemised) + 16)

    def flush(self) -> None:
        """Chain and append every queued entry in one write, under the lock all writers share,
        then record the new head in the anchor."""
        self._end_window(time.monotonic())
        if not self._queue:
            return
        try:
            with _exclusive(self._lock_fd):
                self._flush_locked()
        except OSError as exc:
            if not self._failing:
                log.error(
                    "cannot write audit log %s: %s; %d entries kept queued until it works again",
                    self._path,
                    exc.strerror,
                    len(self._queue),
                )
            self._failing = True
            self._failure = exc.strerror or str(exc)
            raise
        if self._failing:
            log.warning("audit log %s is writable again", self._path)
        self._failing = False
        self._failure = None

    def _flush_locked(self) -> None:
        size = self._follow_replacement()
        anchor_changed = self._follow_anchor(size)
        tail = self._tail
        pending = self._queue
        if tail is None or tail.size != size or anchor_changed:  # another process wrote
            tail = self._chain_tail(size)
            problem = self._tail_problem(tail)
            if problem is not None:
                log.error("audit log %s: %s", self._path, problem["reason"])
                pending = [problem, *pending]
        if 0 < self._rotate <= size and tail.valid_end == size and self._rotate_file(tail):
            size = 0
            tail = replace(tail, size=0, valid_end=0)
        if self._dropped:
            lost = audit_entry(
                AuditOp.AUDIT_DROPPED,
                True,
                ts=_now(),
                reason="entries dropped while the log could not be written",
                extra={"dropped": self._dropped},
            )
            pending = [lost, *pending]
        out = bytearray()
        if tail.valid_end < size:  # a writer died mid-line: close that line, say so
            if os.pread(self._fd, 1, size - 1) != b"\n":
                out += b"\n"
            torn_line = _count_lines(self._fd, tail.valid_end) + 1
            recover = audit_entry(AuditOp.RECOVER, True, ts=_now(), extra={"torn_line": torn_line})
            pending = [recover, *pending]
        key = self._anchor.key if self._anchor is not None else None
        last_id, last_hash = tail.last_id, tail.last_hash
        for entry in pending:
            last_id += 1
            line, last_hash = _sealed_line(entry, last_id, last_hash, key)
            out += line
        self._tail = None  # unknown if the write fails part way
        self._append(out, size)
        end = size + len(out)
        self._tail = _Tail(end, last_id, last_hash, end, last_hash)
        self._queue = []
        self._dropped = 0
        if self._anchor is not None:
            try:
                self._anchor.set_head(last_id, last_hash)
            except OSError as exc:  # the log itself is fine; the next flush tries again
                log.error("audit log %s: cannot update its anchor: %s", self._path, exc.strerror)
        if self._reserve_short and time.monotonic() - self._reserve_tried >= _REFILL_EVERY:
            self._fill_reserve()

    def _chain_tail(self, size: int) -> _Tail:
        """Where the chain stands at the end of the log file of `size` bytes: in it, or, when
        it holds no entry yet (just rotated), at the end of the newest segment."""
        tail = _scan_tail(self._fd, size)
        if tail.last_id or tail.last_hash != GENESIS:
            return tail
        newest = segments(self._path, self._dir_fd)
        if not newest:
            return tail
        fd = os.open(newest[-1].path.name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dir_fd)
        try:
            before = _scan_tail(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return replace(before, size=size, valid_end=tail.valid_end)

    def _rotate_file(self, tail: _Tail) -> bool:
        """Rename the log (ending at `tail`, no torn line) to its segment and open a new one,
        in which the next entry chains to `tail`; False (and the log kept) if it cannot."""
        first = _first_id(self._fd, tail.valid_end)
        if first is None or first > tail.last_id:
            return False
        name = segment_name(self._name, first, tail.last_id)
        try:
            os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            log.error("audit log %s: not rotated: %s already exists", self._path, name)
            return False
        except FileNotFoundError:
            pass
        try:
            os.fsync(self._fd)  # the segment is whole on disk before it takes its name
            os.rename(self._name, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as exc:
            log.error("audit log %s: not rotated: %s", self._path, exc.strerror)
            return False
        self._tail = None
        # Raises if no new file can be made: the flush fails and is retried, and the next one
        # finds the name free (`_follow_replacement`) rather than appending to the segment.
        fd = _open_log(self._name, self._dir_fd)
        os.close(self._fd)
        self._fd = fd
        os.fsync(self._dir_fd)
        return True

    def _tail_problem(self, tail: _Tail) -> dict[str, Any] | None:
        """An entry saying how the log was cut or forged, if its end disagrees with the anchor.

        Appending after a cut end would move the anchor's head there and hide the cut, so the
        writer records it instead: the entry is keyed, and `verify` reports it.
        """
        if self._anchor is None:
            return None
        try:
            head_id, head_hash = self._anchor.head()
        except (OSError, ValueError) as exc:
            log.error("audit log %s: cannot read its anchor's head: %s", self._path, exc)
            return None
        if tail.last_id < head_id:
            reason = (
                f"the log ended at id {tail.last_id} but its anchor says id {head_id} was"
                " written: entries were removed from the end"
            )
        elif tail.last_id == head_id and tail.last_hash != head_hash:
            reason = f"id {head_id} is not the entry its anchor records: the chain was rebuilt"
        elif tail.last_id >= self._anchor.keyed_from and not self._anchor.key.valid(
            tail.entry_hash, tail.mac
        ):
            reason = (
                f"the last entry (id {tail.last_id}) has no valid mac:"
                " the chain was rebuilt without the key"
            )
        else:
            return None
        return audit_entry(
            AuditOp.AUDIT_TAMPER,
            True,
            ts=_now(),
            reason=reason,
            extra={"found_id": tail.last_id, "anchor_id": head_id},
        )

    def _append(self, data: bytes | bytearray, size: int) -> None:
        """Append `data` to the log that ends at `size`; when the disk is full, give back
        reserve and try again, until the write fits or there is no reserve left."""
        while True:
            try:
                write_all(self._fd, data)
                if self._sync:
                    os.fsync(self._fd)
                return
            except OSError as exc:
                os.ftruncate(self._fd, size)  # leave no torn line behind
                if exc.errno not in _NO_SPACE or not self._release_reserve(len(data)):
                    raise

    def _release_reserve(self, needed: int) -> bool:
        """Shrink the reserve by enough for `needed` bytes (and block rounding); False if there
        was none left to give. A slice at a time, so the reserve lasts for many denials."""
        step = (needed // _RELEASE_STEP + 2) * _RELEASE_STEP
        try:
            fd = os.open(
                self._reserve_name, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self._dir_fd
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
        self._reserve_short = True
        self._reserve_tried = time.monotonic()  # no use filling it again right away
        log.warning(
            "audit log %s: file system full, %d bytes of its reserve given back",
            self._path,
            min(have, step),
        )
        return True

    def _fill_reserve(self) -> None:
        """Preallocate the reserve, or top it up; if the file system has no room for it (with
        as much again to spare, so this never takes the last free space), try later."""
        self._reserve_tried = time.monotonic()
        if self._reserve_size <= 0:
            return
        try:
            fd = os.open(
                self._reserve_name,
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
                dir_fd=self._dir_fd,
            )
        except OSError as exc:
            log.warning("audit log %s: no reserve: %s", self._path, exc.strerror)
            return
        try:
            st = os.fstat(fd)
            missing = self._reserve_size - min(st.st_size, st.st_blocks * 512)
            if missing <= 0:
                self._reserve_short = False
                return
            self._reserve_short = True
            fs = os.fstatvfs(fd)
            if fs.f_bavail * fs.f_frsize < missing + self._reserve_size:
                return
            try:
                os.posix_fallocate(fd, 0, self._reserve_size)
                self._reserve_short = False
            except OSError:
                os.ftruncate(fd, st.st_size)  # give back what a partial allocation took
        except OSError as exc:
            log.warning("audit log %s: cannot fill its reserve: %s", self._path, exc.strerror)
        finally:
            os.close(fd)

    def _follow_replacement(self) -> int:
        """Reopen the log if prune replaced it, or another writer rotated it, since we opened
        it; return its size."""
        if not _same_file(self._fd, self._name, self._dir_fd):
            fd = _open_log(self._name, self._dir_fd)
            os.close(self._fd)
            self._fd = fd
            self._tail = None
        return os.fstat(self._fd).st_size

    def _follow_anchor(self, size: int) -> bool:
        """Use the anchor now at the anchor's path, opening or creating it if ours was deleted
        or replaced (or we have none yet); True if the anchor changed. OSError when it cannot
        be used: the log then fails closed (entries stay queued), as writing them without the
        key would make every later `verify` report a rebuilt chain."""
        if self._anchor is not None:
            if self._anchor.is_current():
                return False
            self._anchor.close()
            self._anchor = None
        try:

            def tail() -> tuple[int, str]:
                found = self._chain_tail(size)
                return found.last_id, found.last_hash

            self._anchor = AnchorFile.open(self._anchor_path, self._path, tail)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot use its anchor {self._anchor_path} ({exc})") from None
        except ValueError as exc:
            raise OSError(errno.EIO, f"cannot use its anchor {self._anchor_path} ({exc})") from None
        return True

    def close(self) -> None:
        """Flush, make it durable and release the files; later calls do nothing."""
        if self._fd < 0:
            return
        clean = False
        try:
            self._end_window()
            self._retry_at = 0.0
            if self.try_flush():
                os.fsync(self._fd)
                clean = True
            elif self._queue:
                log.error(
                    "audit log %s: %d entries could not be written and are lost",
                    self._path,
                    len(self._queue),
                )
                # The marker stays: the next writer records this end as unclean, with the count.
                with contextlib.suppress(OSError):
                    os.pwrite(self._marker_fd, b',"lost":%d}' % len(self._queue), _MARKER_END)
        except OSError as exc:
            log.error("cannot sync audit log %s: %s", self._path, exc.strerror)
        finally:
            if clean:
                with contextlib.suppress(OSError):
                    os.unlink(self._marker_name, dir_fd=self._dir_fd)
            for fd in (self._fd, self._lock_fd, self._marker_fd, self._dir_fd):
                os.close(fd)
            if self._anchor is not None:
                self._anchor.close()
                self._anchor = None
            self._fd = -1


_MARKER_END = 64  # the marker's JSON is padded to here; `lost` is written over its end


def _make_marker(dir_fd: int, log_name: str) -> tuple[str, int]:
    """A file beside the log that says this writer is live: locked for as long as it runs,
    removed by a clean close. Made under the writers' lock, so no sweep sees it unlocked."""
    name = f"{log_name}{_WRITER_PREFIX}{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(
        name,
        os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        body = b'{"pid":%d,"started":"%s"' % (os.getpid(), _now().encode())
        write_all(fd, body.ljust(_MARKER_END) + b"}")
    except BaseException:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)
        raise
    return name, fd


def _dead_writers(dir_fd: int, log_name: str, *, remove: bool) -> list[dict[str, Any]]:
    """The markers of writers that ended without closing the log (their lock is free): what
    each says (pid, started, and `lost` if it knew it lost entries). Only under the writers'
    lock (shared to look, exclusive to `remove`)."""
    found = []
    prefix = log_name + _WRITER_PREFIX
    try:
        names = sorted(n for n in os.listdir(dir_fd) if n.startswith(prefix))
    except OSError:
        return []
    for name in names:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer
            try:
                said = json.loads(os.pread(fd, 4096, 0).replace(b" ", b""))
            except ValueError:
                said = {}
            found.append(said if isinstance(said, dict) else {})
            if remove:
                os.unlink(name, dir_fd=dir_fd)
        except OSError:
            continue
        finally:
            os.close(fd)
    return found


def _sweep_writers(dir_fd: int, log_name: str) -> list[dict[str, Any]]:
    """An entry for each writer that ended without closing the log (killed, or unable to write
    its last entries), removing its marker: the next writer records what the dead could not."""
    entries = []
    for said in _dead_writers(dir_fd, log_name, remove=True):
        lost = said.get("lost")
        reason = (
            f"{lost} queued entries could not be written and are lost"
            if isinstance(lost, int)
            else "entries it had queued but not yet written (allowed operations of at most the"
            " last flush interval) are lost without a trace"
        )
        entries.append(
            audit_entry(
                AuditOp.AUDIT_UNCLEAN,
                True,
                ts=_now(),
                reason="a writer ended without closing the log (killed?): " + reason,
                extra={"writer_pid": said.get("pid"), "started": said.get("started")},
            )
        )
    return entries


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
        stream = _open_or_none(path)
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
            entry = _parse_entry(line)
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
        self._since = None if q.since is None else _format_ts(q.since)
        self._until = None if q.until is None else _format_ts(q.until)
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
        for block in _blocks(stream, os.fstat(stream.fileno()).st_size)
    )
    yield from _select(blocks, q)


def _blocks(stream: BinaryIO, end: int) -> Iterator[bytes]:
    """The first `end` bytes of `stream` from where it stands, in blocks of whole lines (the
    last one may end without a newline)."""
    left = end - stream.tell()
    carry = b""
    while left > 0:
        data = stream.read(min(_READ_BLOCK, left))
        if not data:
            break
        left -= len(data)
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            carry += data
            continue
        yield carry + data[:cut]
        carry = data[cut:]
    if carry:
        yield carry


def _select(blocks: Iterable[bytes], q: AuditQuery) -> Iterator[dict[str, Any]]:
    """`query` on the log's `blocks` (of whole lines), so that `follow` can use what it has
    opened."""
    matches = _Filter(q)
    held: list[tuple[str, int, dict[str, Any]]] = []  # a heap, by time then file order
    seq = 0
    for block in blocks:
        for line in matches.candidate_lines(block):
            entry = _parse_entry(line)
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
            return _text(ts)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)  # as _format_ts: a naive time is UTC
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


def _text(value: object) -> str:
    """A value as one line of visible text: a file name must not be able to forge table rows."""
    if value is None:
        return ""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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
    path = _text(entry.get("path"))
    if entry.get("path") is None and entry.get("detail") is not None:
        path = _text(entry["detail"])  # `run` and `net` entries: the command, the host
    if entry.get("dest") is not None:
        path += " -> " + _text(entry["dest"])
    pid = entry.get("pid")
    process = _text(entry.get("comm"))
    if pid is not None:
        process = f"{process or '?'}[{_text(pid)}]"
    result = _result(entry)
    reason = ""
    if result in ("DENIED", "failed"):  # refused, or failed (EXDEV): the errno and why
        code = entry.get("errno")
        name = errno.errorcode.get(code, str(code)) if isinstance(code, int) else _text(code)
        reason = ": ".join(part for part in (name, _text(entry.get("reason"))) if part)
    elif entry.get("path") is not None and entry.get("detail") is not None:
        reason = _text(entry["detail"])  # what an allowed `stage` or `setattr` did
    count = entry.get("count")
    if isinstance(count, int) and not isinstance(count, bool):  # refusals folded into one
        reason = f"{reason} ({count} times since {(clock or _UTC).show(entry.get('first_ts'))})"
    cells = [
        (clock or _UTC).show(entry.get("ts")),
        _text(entry.get("op")),
        result,
        _text(entry.get("zone")),
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


def follow(
    path: Path,
    q: AuditQuery,
    out: TextIO,
    *,
    as_json: bool,
    poll: float = 0.2,
    stop: Callable[[], bool] = lambda: False,
    resume: tuple[int, int] | None = None,
    last: int = 0,
    clock: Clock | None = None,
) -> None:
    """Print entries appended from now on that match `q` (its `limit` is ignored), until stop(),
    like `tail -f`; first the `last` latest matching entries already there, as `query` orders
    them, read from the same open file so that none is missed or shown twice.

    Entries are recognised as new by id, so re-reading a log that prune replaced prints nothing
    twice; when the log is rotated, the rest of the old file is read, then any segment rotated
    since, then the new file. Table rows (times per `clock`) come without a header. `resume` =
    (file offset, last id already shown) continues a `query` without a gap: pass the log's size
    from before the query and the largest id it printed.
    """
    matches = _Filter(q)
    stream = _open_or_none(path)
    # Where the log was rotated and no new file holds an entry yet, now is the newest segment's end.
    last_id = max((seg.last for seg in segments(path)), default=0)

    def show(entry: dict[str, Any]) -> None:
        out.write((_canonical(entry).decode() if as_json else _table_row(entry, clock)) + "\n")

    def read_new(source: BinaryIO) -> None:
        """Show the matching entries of `source` from where it stands past `last_id`."""
        nonlocal last_id
        pending = b""
        while data := source.read(_READ_BLOCK):
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                entry = _parse_entry(line)
                if entry is None or entry["id"] <= last_id:
                    continue
                last_id = entry["id"]
                if matches(entry):
                    show(entry)
            out.flush()
        source.seek(-len(pending), os.SEEK_CUR)  # a line still being written: read it again

    def read_segments() -> None:
        """Read the segments that hold entries past `last_id` (rotated since it was shown)."""
        for seg in segments(path):
            if seg.last > last_id:
                with contextlib.suppress(FileNotFoundError), seg.path.open("rb") as source:
                    read_new(source)

    try:
        if stream is not None and resume is not None:
            stream.seek(resume[0])
            last_id = resume[1]
        elif stream is not None:
            tail = _scan_tail(stream.fileno(), os.fstat(stream.fileno()).st_size)
            if last > 0:  # up to the last complete line: one being written is still to come
                earlier = (block for seg in segments(path) for block in _segment_blocks(seg.path))
                blocks = itertools.chain(earlier, _blocks(stream, tail.valid_end))
                for known in _select(blocks, replace(q, limit=last)):
                    show(known)
                out.flush()
            stream.seek(tail.valid_end)
            last_id = max(last_id, tail.last_id)
        while not stop():
            if stream is None or not _same_file(stream.fileno(), path):
                if stream is not None:  # replaced (pruned) or rotated: finish it first
                    read_new(stream)
                    stream.close()
                stream = _open_or_none(path)
                read_segments()
            if stream is not None:
                read_new(stream)
            time.sleep(poll)
    finally:
        if stream is not None:
            stream.close()


def _segment_blocks(segment: Path) -> Iterator[bytes]:
    """The blocks of a segment's lines; nothing if it was pruned meanwhile."""
    try:
        stream = segment.open("rb")
    except FileNotFoundError:
        return
    with stream:
        yield from _blocks(stream, os.fstat(stream.fileno()).st_size)


def _open_or_none(path: Path) -> BinaryIO | None:
    try:
        return path.open("rb")
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of `verify`; `message` is one line fit to show the user.

    `keyed` says whether the log's anchor was found and checked; without it only the unkeyed
    chain was, and a cut end or a rebuilt chain would pass. `unkeyed_entries` counts entries
    written before the anchor existed, which the key does not cover.
    """

    ok: bool
    entries: int
    first_bad_line: int | None
    message: str
    torn_lines: tuple[int, ...] = ()
    keyed: bool = False
    unkeyed_entries: int = 0
    # Writers that ended without closing the log: the ids of the entries that record it, and
    # the pids of those not yet recorded (no writer has opened the log since).
    unclean_ids: tuple[int, ...] = ()
    unclean_pids: tuple[int, ...] = ()


@dataclass
class _Snapshot:
    """What `verify` checks, taken under the writers' lock so that its parts agree: the log's
    segments, the log itself (open, or None if there is none) and its size, its anchor (or
    None and why not) and the pids of writers that ended without closing it."""

    segments: list[Segment]
    stream: BinaryIO | None
    size: int
    anchor: Anchor | None
    no_anchor: str
    dead: list[int]


def _snapshot(path: Path) -> _Snapshot:
    where, why = locate_anchor(path)
    try:
        lock_fd = os.open(_lock_path(path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        lock_fd = -1  # no writer has run yet, or the lock is not ours to take: go without
    try:
        if lock_fd >= 0:
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
        anchor, why = read_anchor(where, why)
        dead: list[int] = []
        with contextlib.suppress(OSError):
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                said = _dead_writers(dir_fd, path.name, remove=False)
            finally:
                os.close(dir_fd)
            dead = [p if isinstance(p := s.get("pid"), int) else 0 for s in said]
        found = segments(path)
        stream = _open_or_none(path)
        size = 0 if stream is None else os.fstat(stream.fileno()).st_size
        return _Snapshot(found, stream, size, anchor, why, dead)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)  # and with it the lock


def _lines_upto(stream: BinaryIO, size: int) -> Iterator[bytes]:
    """The lines of the first `size` bytes of `stream`: what was there at the snapshot."""
    offset = 0
    for line in stream:
        if offset >= size:
            return
        if offset + len(line) > size:
            line = line[: size - offset]
        offset += len(line)
        yield line


def _snapshot_files(
    snap: _Snapshot,
) -> Generator[tuple[Segment | None, BinaryIO | None, int]]:
    """Each file of the snapshot, oldest first, open (None if a segment is gone since), with
    the size to read: the segments (which no writer appends to), then the log itself."""
    for seg in snap.segments:
        try:
            source = seg.path.open("rb")
        except FileNotFoundError:
            yield seg, None, 0
            continue
        with source:
            yield seg, source, os.fstat(source.fileno()).st_size
    if snap.stream is not None:
        with snap.stream:
            yield None, snap.stream, snap.size


def verify(path: Path) -> VerifyResult:
    """Check every hash, link and mac of the chain, across its segments, and that its end is
    where the anchor says; line numbers are 1-based lines of the file, which is named when the
    log has segments.

    An unparsable line is accepted as torn (a writer died mid-write) only if it is the last line,
    or if the entry right after it (and any torn lines that follow it) is the "recover" entry
    that names it. Entries from the anchor's `keyed_from` on must carry a valid mac. Without an
    anchor (another user, a moved project, a deleted anchor) only the unkeyed chain is checked,
    and the message says so. A segment's name gives the first and last id it was written
    with: one that ends early was truncated, ids that no file holds were in a deleted segment.
    """
    snap = _snapshot(path)
    anchor, dead = snap.anchor, snap.dead
    unclean: list[int] = []
    keyed = anchor is not None
    if snap.stream is None and not snap.segments:
        if anchor is not None and anchor.head_id > 0:
            message = f"no audit log at {path}, but its anchor says id {anchor.head_id} was written"
            return VerifyResult(False, 0, None, message, keyed=True)
        return VerifyResult(False, 0, None, f"no audit log at {path}")
    key = Key(anchor.key) if anchor is not None else None
    torn: list[int] = []
    unexplained: list[int] = []  # unparsable lines not yet named by a recover entry
    entries = 0
    unkeyed = 0  # entries before the anchor's keyed_from
    with_mac = 0
    header: dict[str, Any] | None = None
    link: str | None = None  # what the next entry's prev must be
    link_source = ""
    last_id = 0
    line_no = 0
    where = ""  # the file being read, named when there are several

    def bad(line: int | None, problem: str) -> VerifyResult:
        message = f"{where}{problem}" if line is None else f"{where}line {line}: {problem}"
        return VerifyResult(
            False, entries, line, message, tuple(torn), keyed, unkeyed, tuple(unclean), tuple(dead)
        )

    files = _snapshot_files(snap)
    try:
        for seg, source, end in files:
            name = path.name if seg is None else seg.path.name
            where = f"{name} " if snap.segments else ""
            if source is None:
                return bad(None, "vanished while it was verified (pruned meanwhile?): verify again")
            first_in_file = True
            pruned = False  # whether this file begins with a prune header
            line_no = 0
            for line_no, line in enumerate(_lines_upto(source, end), 1):
                entry = _parse_entry(line)
                if entry is None:
                    unexplained.append(line_no)
                    continue
                if unexplained:
                    if (
                        entry.get("op") != AuditOp.RECOVER
                        or entry.get("torn_line") != unexplained[0]
                    ):
                        return bad(unexplained[0], "unparsable line that no recover entry names")
                    torn += unexplained
                    unexplained = []
                if _digest(entry) != entry["hash"]:
                    return bad(line_no, "hash mismatch (entry edited)")
                is_header = link is None and line_no == 1 and _is_header(entry)
                with_mac += "mac" in entry
                if (
                    anchor is not None
                    and key is not None
                    and entry["id"] >= anchor.keyed_from
                    and not key.valid(entry["hash"], entry.get("mac"))
                ):
                    problem = "mac missing" if "mac" not in entry else "mac mismatch"
                    if is_header:
                        return bad(
                            line_no,
                            f"{problem} on the prune header"
                            " (entries were removed from the start without the key)",
                        )
                    return bad(line_no, f"{problem} (the chain was rebuilt without the key)")
                if link is not None and _is_header(entry):
                    return bad(
                        line_no,
                        "a prune header after older entries (an interrupted prune?"
                        " `sandboxfs audit prune` again finishes it)",
                    )
                if first_in_file and not is_header:
                    first_in_file = False
                    gap = _segment_start_problem(
                        seg, entry["id"], last_id, chained=link is not None, named=not pruned
                    )
                    if gap is not None:
                        return bad(line_no, gap)
                if is_header:
                    header, pruned = entry, True
                    link, link_source = entry["anchor"], "the prune header's anchor"
                elif link is None:
                    if entry["id"] > 1 and snap.segments:
                        return bad(
                            line_no,
                            f"the first entry is id {entry['id']}, not id 1 chained to GENESIS"
                            f" (ids 1 to {entry['id'] - 1} are in no file: segments or lines"
                            " were removed from the start)",
                        )
                    if entry["id"] != 1 or entry["prev"] != GENESIS:
                        return bad(
                            line_no,
                            "the first entry is not id 1 chained to GENESIS"
                            " (lines were removed from the start)",
                        )
                elif entry["prev"] != link:
                    return bad(
                        line_no,
                        f"prev does not match {link_source} (a line was inserted or removed)",
                    )
                elif entry["id"] != last_id + 1:
                    problem = f"id {entry['id']} does not follow id {last_id}"
                    return bad(line_no, problem + " (a line was inserted or removed)")
                if not is_header:
                    link, link_source = entry["hash"], f"{where}line {line_no}'s hash"
                    entries += 1
                    unkeyed += anchor is not None and entry["id"] < anchor.keyed_from
                last_id = entry["id"]
                if anchor is not None and last_id == anchor.head_id and link != anchor.head_hash:
                    return bad(
                        line_no,
                        f"id {last_id} is not the entry its anchor records (the chain was rebuilt)",
                    )
                if entry.get("op") == AuditOp.AUDIT_UNCLEAN:
                    unclean.append(entry["id"])
                if entry.get("op") == AuditOp.AUDIT_TAMPER:
                    return bad(
                        line_no,
                        f"a writer found the log tampered with: {_text(entry.get('reason'))}",
                    )
            if seg is not None and unexplained:  # only the log itself may end in a torn line
                return bad(unexplained[0], "unparsable line that no recover entry names")
            if seg is not None and last_id != seg.last:
                return bad(
                    None,
                    f"ends at id {last_id} but its name says id {seg.last}: "
                    + (
                        "entries were removed from its end (truncated)"
                        if last_id < seg.last
                        else "it holds entries its name does not (renamed?)"
                    ),
                )
    finally:
        files.close()
        if snap.stream is not None:
            snap.stream.close()
    if unexplained:
        if unexplained != [line_no]:
            return bad(unexplained[0], "unparsable line that no recover entry names")
        torn += unexplained
    where = ""
    if anchor is not None and last_id < anchor.head_id:
        return bad(
            None,
            f"the log ends at id {last_id} but its anchor says id {anchor.head_id} was written:"
            " entries were removed from the end",
        )
    message = f"ok: {entries} entries, chain intact"
    if snap.segments:
        message = f"ok: {entries} entries in {len(snap.segments) + (snap.stream is not None)}"
        message += " files, chain intact across them"
    if header is not None:
        message += f" from the prune header (entries up to id {header['id']} pruned)"
    if anchor is not None:
        message += f"; keyed, and complete up to its anchor's head (id {anchor.head_id})"
        if unkeyed:
            message += (
                f"; the first {unkeyed} entries predate keyed entries"
                " (written before this anchor existed)"
            )
    else:
        message += f"; unkeyed check only ({snap.no_anchor}"
        if with_mac:
            message += f", though {with_mac} entries carry a mac: moved project? deleted anchor?"
        message += "): a cut end or a rebuilt chain would not show"
    if torn:
        message += "; torn lines tolerated: " + ", ".join(map(str, torn))
    if unclean or dead:
        message += _unclean_note(unclean, dead)
    return VerifyResult(
        True, entries, None, message, tuple(torn), keyed, unkeyed, tuple(unclean), tuple(dead)
    )


def _segment_start_problem(
    seg: Segment | None, first: int, last_id: int, *, chained: bool, named: bool
) -> str | None:
    """What is wrong where a file's first entry (id `first`, after any prune header) meets the
    end of the file before it (at `last_id`; `chained` unless it is the first file): a segment
    that does not begin at the id its name says (unless `named` is False: a pruned first
    file), or ids that no file holds."""
    if seg is not None and named and first != seg.first:
        if first > seg.first:
            return (
                f"begins at id {first} but its name says id {seg.first}:"
                " lines were removed from its start"
            )
        return f"begins at id {first} but its name says id {seg.first} (renamed?)"
    if chained and first > last_id + 1:
        return (
            f"ids {last_id + 1} to {first - 1} are in no file: a segment was deleted"
            f" (the file before this one ends at id {last_id})"
        )
    return None


def _unclean_note(recorded: list[int], dead: list[int]) -> str:
    """What verify says of writers that ended without closing the log: the chain cannot show
    what such a writer had queued but not written, so "complete" does not cover it."""
    parts = []
    if recorded:
        shown = ", ".join(map(str, recorded[:10])) + (", ..." if len(recorded) > 10 else "")
        parts.append(f"{len(recorded)} recorded (ids {shown}; audit --op {AuditOp.AUDIT_UNCLEAN})")
    if dead:
        pids = ", ".join(map(str, dead[:10])) + (", ..." if len(dead) > 10 else "")
        parts.append(f"{len(dead)} not yet recorded (pid {pids})")
    return (
        "; NOT complete where writers ended without closing the log (killed?): "
        + ", ".join(parts)
        + ": the allowed operations each had queued, at most its last flush interval, have no"
        " entry, nor do the repeats of refusals it had counted in its last second (the first"
        " refusal of each kind, and every --audit-sync entry, is written before it returns)"
    )


_SEALED_END = re.compile(rb',"hash":"[0-9a-f]{64}"(?:,"mac":"[0-9a-f]{64}")?\}\Z')


def _complete(line: bytes) -> bool:
    """Whether `line` (no newline) is surely a whole entry as a writer wrote it, not a torn one:
    the seals are written last, so a cut line never ends with them. Cheaper than parsing it;
    False says only "parse it to know" (logs of older versions may order keys otherwise)."""
    return line.startswith(b"{") and _SEALED_END.search(line, max(0, len(line) - 160)) is not None


def prune(path: Path, before: datetime, *, dry_run: bool = False) -> int:
    """Drop the leading entries older than `before`, keeping the rest verifiable.

    Only a leading run can go, or the chain would break: an older entry that follows a newer one
    (mounts flush batches at different times) stays. Segments all of whose entries go are
    deleted; the file where the kept entries begin (a segment, or the log itself) is rewritten
    with a header in place of the dropped entries, under its own name. The kept entries are
    unchanged; torn lines are not carried over (their recover entries are). The header is keyed
    with the anchor's key if this user has it: without a mac, a header could be made up by
    anyone to hide entries removed from the start. The anchor's head stays right, since the
    last entry is always kept (or, when all go, the header takes its id). Returns how many
    entries were dropped, or with `dry_run` how many would be (and drops none), so that a user
    can be asked first. Streams: memory stays bounded whatever the log's size.
    """
    cutoff = _format_ts(before)
    try:
        lock_fd = _open_lock(path)
    except FileNotFoundError:  # no state dir, so no log
        return 0
    try:
        with _exclusive(lock_fd):
            return _prune_locked(path, cutoff, dry_run)
    finally:
        os.close(lock_fd)


def _prune_locked(path: Path, cutoff: str, dry_run: bool) -> int:
    files = [seg.path for seg in segments(path)]
    if not files and not path.exists():
        return 0
    files.append(path)  # the log itself last, even if a rotation left none yet
    dropped = 0
    last: tuple[int, str] | None = None  # the id and hash the kept entries chain to
    keep = len(files) - 1  # the file where the kept entries begin
    keep_from = 0  # the offset in it just past the last entry dropped
    for index, name in enumerate(files):
        offset = 0
        newer = False
        try:
            stream = name.open("rb")
        except FileNotFoundError:
            continue
        with stream:
            size = os.fstat(stream.fileno()).st_size
            for line_no, line in enumerate(_lines_upto(stream, size)):
                offset += len(line)
                entry = _parse_entry(line)
                if entry is None:
                    continue
                if line_no == 0 and _is_header(entry):  # an earlier prune's, which this replaces
                    last = entry["id"], entry["anchor"]
                    continue
                if str(entry.get("ts", "")) >= cutoff:
                    newer = True
                    break
                dropped += 1
                last = entry["id"], entry["hash"]
        keep, keep_from = index, (offset - len(line) if newer else offset)
        if newer:
            break
    if dropped == 0 or dry_run or last is None:
        return dropped
    anchor, _ = read_anchor(*locate_anchor(path))
    header, _ = _sealed_line(
        audit_entry(
            AuditOp.PRUNE,
            True,
            ts=_now(),
            extra={"before": cutoff, "dropped": dropped, "anchor": last[1]},
        ),
        last[0],
        GENESIS,
        Key(anchor.key) if anchor is not None else None,
    )
    _rewrite(files[keep], header, keep_from)
    # Only then the files before it: a prune cut short leaves them before a file that begins
    # with a header, which `verify` names and the next prune deletes.
    for name in files[:keep]:
        with contextlib.suppress(FileNotFoundError):
            name.unlink()
    fsync_dir(path.parent)
    return dropped


def _rewrite(path: Path, header: bytes, keep_from: int) -> None:
    """Replace the file at `path` with `header` and its complete lines from `keep_from` on."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            with os.fdopen(os.dup(fd), "wb", buffering=_READ_BLOCK) as out:
                out.write(header)
                with contextlib.suppress(FileNotFoundError), path.open("rb") as stream:
                    stream.seek(keep_from)
                    for block in _blocks(stream, os.fstat(stream.fileno()).st_size):
                        lines = block.split(b"\n")
                        if not lines[-1]:
                            lines.pop()
                        kept = (ln for ln in lines if _complete(ln) or _parse_entry(ln) is not None)
                        out.write(b"".join(ln + b"\n" for ln in kept))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def record_now(
    path: Path,
    op: AuditOp,
    *,
    zone: str | None,
    workspace: str | None,
    detail: str,
    session: str | None = None,
    vpath: str | None = None,
    allowed: bool = True,
    reason: str | None = None,
    nothing_done: str = "",
) -> None:
    """One entry of a command of sandboxfs's own (`staged`, `sessions prune`, `home`), written
    durably before the command acts; a log that cannot be written is a UserError (exit 1)
    saying so, plus `nothing_done`."""
    entry = audit_entry(
        op,
        allowed,
        path=vpath,
        zone=zone,
        session=session,
        workspace=workspace,
        trust=None,
        reason=reason,
        err=None,
        pid=os.getpid(),
        uid=os.getuid(),
        comm="sandboxfs",
        nbytes=None,
        detail=detail,
    )
    try:
        log = AuditLog(path)
        try:
            log.record(entry)
            log.flush()
        finally:
            log.close()
    except OSError as exc:
        raise Failure(f"cannot write the audit log {path}: {exc.strerror}{nothing_done}") from None
