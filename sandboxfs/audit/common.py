"""What every part of the audit log shares: an entry's byte form and seals, parsing a line, the
lock beside the log, the log's files (the log and its rotated segments), and its tail.

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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from sandboxfs.audit.anchor import Key
from sandboxfs.core.entry import AuditOp

# One logger for every part: session logs have always named audit messages "sandboxfs.audit.log".
log = logging.getLogger("sandboxfs.audit.log")
GENESIS: str = "0" * 64

CHUNK = 1 << 16  # what the tail is read backwards by
READ_BLOCK = 1 << 20  # what the log is read forwards by
_SEALS = ("hash", "mac")  # what an entry's hash does not cover


def format_ts(moment: datetime) -> str:
    """UTC, microseconds, trailing Z: fixed width, so comparing the text compares the times.

    A naive datetime is taken to be UTC already.
    """
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return moment.isoformat(timespec="microseconds") + "Z"


_second_cache: tuple[int, str] = (-1, "")


def now_ts() -> str:
    """`format_ts` of the current time, formatting the date and time of day once per second."""
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


def canonical(entry: dict[str, Any]) -> bytes:
    """The one byte form of an entry that is hashed and written; values JSON lacks become str."""
    return _ENCODER.encode(entry).encode("ascii")


def digest(entry: dict[str, Any]) -> str:
    """The hash an entry must carry: of its canonical JSON without its seals."""
    return hashlib.sha256(
        canonical({k: v for k, v in entry.items() if k not in _SEALS})
    ).hexdigest()


def sealed_line(
    entry: dict[str, Any], entry_id: int, prev: str, key: Key | None = None
) -> tuple[bytes, str]:
    """The line for `entry` placed in the chain, and its hash, serialising only once: the hash
    covers the canonical JSON without "hash" and "mac", which are then appended as the last
    keys (`mac` only with a key)."""
    body = canonical(
        {k: v for k, v in entry.items() if k not in _SEALS} | {"id": entry_id, "prev": prev}
    )
    hashed = hashlib.sha256(body).hexdigest()
    seals = b',"hash":"' + hashed.encode("ascii")
    if key is not None:
        seals += b'","mac":"' + key.mac(hashed).encode("ascii")
    return body[:-1] + seals + b'"}\n', hashed


def parse_entry(line: bytes) -> dict[str, Any] | None:
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


def is_prune_header(entry: dict[str, Any] | None) -> bool:
    """Whether `entry` is the header `prune` puts first, which links the chain to its anchor."""
    return (
        entry is not None
        and entry.get("op") == AuditOp.PRUNE
        and isinstance(entry.get("anchor"), str)
        and entry["prev"] == GENESIS
    )


def visible_text(value: object) -> str:
    """A value as one line of visible text: a file name must not be able to forge table rows."""
    if value is None:
        return ""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def lock_path(path: Path) -> Path:
    """The writers' lock file of the log at `path`."""
    # Beside the log, not the log itself: prune replaces the log, and a lock on a replaced
    # inode would exclude nobody.
    return path.with_name(path.name + ".lock")


def open_lock(path: Path, dir_fd: int | None = None) -> int:
    where = lock_path(path) if dir_fd is None else lock_path(path).name
    return os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


@contextlib.contextmanager
def exclusive(lock_fd: int) -> Iterator[None]:
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)


def same_file(fd: int, path: Path | str, dir_fd: int | None = None) -> bool:
    """False once `path` names another file than `fd` (prune replaced it) or none."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, dir_fd=dir_fd))
    except FileNotFoundError:
        return False


def open_or_none(path: Path) -> BinaryIO | None:
    try:
        return path.open("rb")
    except FileNotFoundError:
        return None


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


@dataclass(frozen=True, slots=True)
class Tail:
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
    def after(cls, entry: dict[str, Any], size: int, valid_end: int) -> Tail:
        # A prune header alone in the file: the chain continues from its anchor.
        link = entry["anchor"] if is_prune_header(entry) else entry["hash"]
        return cls(size, entry["id"], link, valid_end, entry["hash"], entry.get("mac"))


def scan_tail(fd: int, size: int) -> Tail:
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
                entry = parse_entry(buf[start:end])
                if entry is not None:
                    return Tail.after(entry, size, pos + end + 1)
                if start == 0:
                    break
                end = start - 1
                continue
        if pos == 0:
            break
        read_from = max(0, pos - CHUNK)
        chunk = os.pread(fd, pos - read_from, read_from)
        buf = chunk + buf
        pos = read_from
        if end is not None:
            end += len(chunk)
    return Tail(size, 0, GENESIS, 0)


def read_blocks(stream: BinaryIO, end: int) -> Iterator[bytes]:
    """The first `end` bytes of `stream` from where it stands, in blocks of whole lines (the
    last one may end without a newline)."""
    left = end - stream.tell()
    carry = b""
    while left > 0:
        data = stream.read(min(READ_BLOCK, left))
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


def lines_upto(stream: BinaryIO, size: int) -> Iterator[bytes]:
    """The lines of the first `size` bytes of `stream`: what was there at the snapshot."""
    offset = 0
    for line in stream:
        if offset >= size:
            return
        if offset + len(line) > size:
            line = line[: size - offset]
        offset += len(line)
        yield line
