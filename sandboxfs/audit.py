"""The audit log: append-only JSON lines, chained by SHA-256, shared by concurrent mounts.

Every entry carries `id` (consecutive), `prev` (the previous entry's hash) and `hash` (SHA-256 of
the entry's canonical JSON without `hash`), so `verify` finds an edited, inserted, removed or
reordered line. Writers take a `flock` on a lock file beside the log and append with one `write`,
so several mounts (processes) can share one log and the chain stays linear. The chain has no
secret key: it detects tampering by anyone who did not also rewrite every later line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import trio

log = logging.getLogger(__name__)
_MAX_QUEUED = 100_000
GENESIS: str = "0" * 64

_CHUNK = 1 << 16
_EXACT_FIELDS = ("pid", "session", "workspace", "zone", "op", "trust", "allowed")
_DENIED = b'"allowed":false'


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
    return hashlib.sha256(_canonical({k: v for k, v in entry.items() if k != "hash"})).hexdigest()


def _seal(entry: dict[str, Any], entry_id: int, prev: str) -> dict[str, Any]:
    """A copy of `entry` placed in the chain: with `id`, `prev` and its own `hash`."""
    sealed = {k: v for k, v in entry.items() if k != "hash"} | {"id": entry_id, "prev": prev}
    sealed["hash"] = _digest(sealed)
    return sealed


def _sealed_line(entry: dict[str, Any], entry_id: int, prev: str) -> tuple[bytes, str]:
    """The line for `entry` placed in the chain, and its hash, serialising only once: the hash
    covers the canonical JSON without "hash", which is then appended as the last key."""
    body = _canonical(
        {k: v for k, v in entry.items() if k != "hash"} | {"id": entry_id, "prev": prev}
    )
    digest = hashlib.sha256(body).hexdigest()
    return body[:-1] + b',"hash":"' + digest.encode("ascii") + b'"}\n', digest


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
        and entry.get("op") == "prune"
        and isinstance(entry.get("anchor"), str)
        and entry["prev"] == GENESIS
    )


def _lock_path(path: Path) -> Path:
    # Beside the log, not the log itself: prune replaces the log, and a lock on a replaced
    # inode would exclude nobody.
    return path.with_name(path.name + ".lock")


def _open_lock(path: Path) -> int:
    return os.open(_lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def _exclusive(lock_fd: int) -> Iterator[None]:
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)


def _open_log(path: Path) -> int:
    # Read access too: the tail is read back to continue the chain.
    return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _same_file(fd: int, path: Path) -> bool:
    """False once `path` names another file than `fd` (prune replaced it) or none."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _make_private_dirs(directory: Path) -> None:
    """Like `mkdir -p`, but every directory it creates is 0o700, not just the last."""
    if directory.is_dir():
        return
    _make_private_dirs(directory.parent)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)


@dataclass(frozen=True, slots=True)
class _Tail:
    """Where the chain stands at the end of a file of `size` bytes.

    `valid_end` is the offset just past the last complete entry; anything after it is torn.
    """

    size: int
    last_id: int
    last_hash: str
    valid_end: int

    @classmethod
    def after(cls, entry: dict[str, Any], size: int, valid_end: int) -> _Tail:
        # A prune header alone in the file: the chain continues from its anchor.
        link = entry["anchor"] if _is_header(entry) else entry["hash"]
        return cls(size, entry["id"], link, valid_end)


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
    """Append-only, SHA-256 hash-chained JSON-lines log shared safely by several processes.

    Entries are queued and written in batches, except denials (which must be on disk before the
    caller sees its errno) and everything in sync mode. One instance is used from one thread.
    """

    def __init__(self, path: Path, *, sync: bool = False, batch_size: int = 512) -> None:
        self._path = path
        self._sync = sync
        self._batch_size = batch_size
        self._queue: list[dict[str, Any]] = []
        self._dropped = 0
        self._tail: _Tail | None = None  # valid while the file still has tail.size bytes
        _make_private_dirs(path.parent)
        self._lock_fd = _open_lock(path)
        self._fd = _open_log(path)

    def record(self, entry: dict[str, Any]) -> None:
        """Queue a copy of `entry` (stamped with `ts` if it has none); flush when it can't wait."""
        if self._fd < 0:
            raise ValueError(f"audit log {self._path} is closed")
        queued = dict(entry)
        if "ts" not in queued:
            queued["ts"] = _now()
        self._queue.append(queued)
        if self._sync or queued.get("allowed") is False or len(self._queue) >= self._batch_size:
            self.try_flush()

    def try_flush(self) -> bool:
        """Flush, but keep the entries queued (and the mount up) if the disk refuses them.

        A full or failing disk must not turn a policy refusal into a different error, or take
        the daemon down; the entries are retried on the next flush. Past _MAX_QUEUED the
        oldest are dropped and their number is recorded once writing works again.
        """
        try:
            self.flush()
            return True
        except OSError as exc:
            log.error(
                "cannot write audit log %s: %s; %d entries kept queued",
                self._path,
                exc.strerror,
                len(self._queue),
            )
            if len(self._queue) > _MAX_QUEUED:
                excess = len(self._queue) - _MAX_QUEUED
                self._dropped += excess
                del self._queue[:excess]
            return False

    def flush(self) -> None:
        """Chain and append every queued entry in one write, under the lock all writers share."""
        if not self._queue:
            return
        with _exclusive(self._lock_fd):
            size = self._follow_replacement()
            tail = self._tail
            if tail is None or tail.size != size:  # another process wrote since we did
                tail = _scan_tail(self._fd, size)
            pending = self._queue
            if self._dropped:
                lost = {
                    "op": "audit-dropped",
                    "dropped": self._dropped,
                    "allowed": True,
                    "ts": _now(),
                    "reason": "entries dropped while the log could not be written",
                }
                pending = [lost, *pending]
            out = bytearray()
            if tail.valid_end < size:  # a writer died mid-line: close that line, say so
                if os.pread(self._fd, 1, size - 1) != b"\n":
                    out += b"\n"
                torn_line = _count_lines(self._fd, tail.valid_end) + 1
                recover = {"op": "recover", "torn_line": torn_line, "allowed": True, "ts": _now()}
                pending = [recover, *pending]
            last_id, last_hash = tail.last_id, tail.last_hash
            for entry in pending:
                last_id += 1
                line, last_hash = _sealed_line(entry, last_id, last_hash)
                out += line
            self._tail = None  # unknown if the write fails part way
            try:
                _write_all(self._fd, out)
                if self._sync:
                    os.fsync(self._fd)
            except OSError:
                os.ftruncate(self._fd, size)  # leave no torn line behind
                raise
            end = size + len(out)
            self._tail = _Tail(end, last_id, last_hash, end)
            self._queue = []
            self._dropped = 0

    def _follow_replacement(self) -> int:
        """Reopen the log if prune replaced it since we opened it; return its size."""
        if not _same_file(self._fd, self._path):
            fd = _open_log(self._path)
            os.close(self._fd)
            self._fd = fd
            self._tail = None
        return os.fstat(self._fd).st_size

    async def run(self, interval: float = 0.05) -> None:
        """Flush every `interval` seconds until cancelled, then flush what is left."""
        try:
            while True:
                await trio.sleep(interval)
                self.try_flush()
        finally:
            self.try_flush()  # synchronous, so cancellation cannot interrupt it

    def close(self) -> None:
        """Flush, make it durable and release the files; later calls do nothing."""
        if self._fd < 0:
            return
        try:
            if self.try_flush():
                os.fsync(self._fd)
            elif self._queue:
                log.error(
                    "audit log %s: %d entries could not be written and are lost",
                    self._path,
                    len(self._queue),
                )
        except OSError as exc:
            log.error("cannot sync audit log %s: %s", self._path, exc.strerror)
        finally:
            os.close(self._fd)
            os.close(self._lock_fd)
            self._fd = -1


def read_entries(path: Path) -> Iterator[dict[str, Any]]:
    """Every entry in file order, skipping torn lines; nothing if there is no log."""
    try:
        stream = path.open("rb")
    except FileNotFoundError:
        return
    with stream:
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
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    matches = _Filter(q)
    found = [
        entry
        for line in matches.candidate_lines(data)
        if (entry := _parse_entry(line)) is not None and matches(entry)
    ]
    found.sort(key=lambda entry: str(entry.get("ts", "")))
    if q.limit is not None:
        found = found[max(0, len(found) - q.limit) :]
    return found


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


def _table_row(entry: dict[str, Any]) -> str:
    ts = entry.get("ts")
    path = _text(entry.get("path"))
    if entry.get("dest") is not None:
        path += " -> " + _text(entry["dest"])
    pid = entry.get("pid")
    process = _text(entry.get("comm"))
    if pid is not None:
        process = f"{process or '?'}[{_text(pid)}]"
    denied = entry.get("allowed") is False
    reason = ""
    if denied:
        code = entry.get("errno")
        name = errno.errorcode.get(code, str(code)) if isinstance(code, int) else _text(code)
        reason = ": ".join(part for part in (name, _text(entry.get("reason"))) if part)
    cells = [
        ts[:19].replace("T", " ") if isinstance(ts, str) else "",
        _text(entry.get("op")),
        "DENIED" if denied else "ok",
        _text(entry.get("zone")),
        path,
        process,
        reason,
    ]
    return _row(cells)


def format_table(entries: Sequence[dict[str, Any]]) -> str:
    """A header line and one row per entry (UTC times); `format_table([])` is the header."""
    return "\n".join([_row([name for name, _ in _COLUMNS]), *map(_table_row, entries)])


def follow(
    path: Path,
    q: AuditQuery,
    out: TextIO,
    *,
    as_json: bool,
    poll: float = 0.2,
    stop: Callable[[], bool] = lambda: False,
    resume: tuple[int, int] | None = None,
) -> None:
    """Print entries appended from now on that match `q` (its `limit` is ignored), until stop().

    Entries are recognised as new by id, so re-reading a log that prune replaced prints nothing
    twice. Table rows come without a header. `resume` = (file offset, last id already shown)
    continues a `query` without a gap: pass the log's size from before the query and the
    largest id it printed.
    """
    last_id = 0
    pending = b""
    matches = _Filter(q)
    stream = _open_or_none(path)
    try:
        if stream is not None and resume is not None:
            stream.seek(resume[0])
            last_id = resume[1]
        elif stream is not None:
            tail = _scan_tail(stream.fileno(), os.fstat(stream.fileno()).st_size)
            stream.seek(tail.valid_end)  # a line being written right now is still to come
            last_id = tail.last_id
        while not stop():
            if stream is None or not _same_file(stream.fileno(), path):
                if stream is not None:
                    stream.close()
                stream, pending = _open_or_none(path), b""
            if stream is not None:
                *lines, pending = (pending + stream.read()).split(b"\n")
                for line in lines:
                    entry = _parse_entry(line)
                    if entry is None or entry["id"] <= last_id:
                        continue
                    last_id = entry["id"]
                    if matches(entry):
                        text = _canonical(entry).decode() if as_json else _table_row(entry)
                        out.write(text + "\n")
                out.flush()
            time.sleep(poll)
    finally:
        if stream is not None:
            stream.close()


def _open_or_none(path: Path) -> BinaryIO | None:
    try:
        return path.open("rb")
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of `verify`; `message` is one line fit to show the user."""

    ok: bool
    entries: int
    first_bad_line: int | None
    message: str
    torn_lines: tuple[int, ...] = ()


def verify(path: Path) -> VerifyResult:
    """Check every hash and link of the chain; line numbers are 1-based lines of the file.

    An unparsable line is accepted as torn (a writer died mid-write) only if it is the last line,
    or if the entry right after it (and any torn lines that follow it) is the "recover" entry
    that names it.
    """
    try:
        stream = path.open("rb")
    except FileNotFoundError:
        return VerifyResult(False, 0, None, f"no audit log at {path}")
    torn: list[int] = []
    unexplained: list[int] = []  # unparsable lines not yet named by a recover entry
    entries = 0
    header: dict[str, Any] | None = None
    link: str | None = None  # what the next entry's prev must be
    link_source = ""
    last_id = 0
    line_no = 0

    def bad(line: int, problem: str) -> VerifyResult:
        return VerifyResult(False, entries, line, f"line {line}: {problem}", tuple(torn))

    with stream:
        for line_no, line in enumerate(stream, 1):
            entry = _parse_entry(line)
            if entry is None:
                unexplained.append(line_no)
                continue
            if unexplained:
                if entry.get("op") != "recover" or entry.get("torn_line") != unexplained[0]:
                    return bad(unexplained[0], "unparsable line that no recover entry names")
                torn += unexplained
                unexplained = []
            if _digest(entry) != entry["hash"]:
                return bad(line_no, "hash mismatch (entry edited)")
            if link is None:
                if line_no == 1 and _is_header(entry):
                    header = entry
                    link, link_source = entry["anchor"], "the prune header's anchor"
                    last_id = entry["id"]
                    continue
                if entry["id"] != 1 or entry["prev"] != GENESIS:
                    return bad(
                        line_no,
                        "the first entry is not id 1 chained to GENESIS"
                        " (lines were removed from the start)",
                    )
            elif entry["prev"] != link:
                return bad(
                    line_no, f"prev does not match {link_source} (a line was inserted or removed)"
                )
            elif entry["id"] != last_id + 1:
                problem = f"id {entry['id']} does not follow id {last_id}"
                return bad(line_no, problem + " (a line was inserted or removed)")
            link, link_source, last_id = entry["hash"], f"line {line_no}'s hash", entry["id"]
            entries += 1
    if unexplained:
        if unexplained != [line_no]:
            return bad(unexplained[0], "unparsable line that no recover entry names")
        torn += unexplained
    message = f"ok: {entries} entries, chain intact"
    if header is not None:
        message += f" from the prune header (entries up to id {header['id']} pruned)"
    if torn:
        message += "; torn lines tolerated: " + ", ".join(map(str, torn))
    return VerifyResult(True, entries, None, message, tuple(torn))


def _replace(path: Path, data: bytes) -> None:
    """Atomically and durably make `data` the content of `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def prune(path: Path, before: datetime) -> int:
    """Drop the leading entries older than `before`, keeping the rest verifiable.

    Only a leading run can go, or the chain would break: an older entry that follows a newer one
    (mounts flush batches at different times) stays. The kept entries are unchanged; torn lines
    are not carried over (their recover entries are). Returns how many entries were dropped.
    """
    cutoff = _format_ts(before)
    try:
        lock_fd = _open_lock(path)
    except FileNotFoundError:  # no state dir, so no log
        return 0
    try:
        with _exclusive(lock_fd):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                return 0
            lines = data.split(b"\n")
            if _is_header(_parse_entry(lines[0])):
                lines = lines[1:]
            chain = [(line, e) for line in lines if (e := _parse_entry(line)) is not None]
            dropped = 0
            while dropped < len(chain) and str(chain[dropped][1].get("ts", "")) < cutoff:
                dropped += 1
            if dropped == 0:
                return 0
            last = chain[dropped - 1][1]
            header = _seal(
                {
                    "op": "prune",
                    "before": cutoff,
                    "dropped": dropped,
                    "anchor": last["hash"],
                    "ts": _now(),
                    "allowed": True,
                },
                last["id"],
                GENESIS,
            )
            kept = [_canonical(header), *(line for line, _ in chain[dropped:])]
            _replace(path, b"\n".join(kept) + b"\n")
            return dropped
    finally:
        os.close(lock_fd)
