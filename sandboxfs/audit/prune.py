"""Pruning the audit log: dropping its oldest entries and keeping the rest verifiable, with a
header that links what is kept to its anchor (see `prune`).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from sandboxfs.audit.anchor import Key, fsync_dir, locate_anchor, read_anchor
from sandboxfs.audit.common import (
    GENESIS,
    READ_BLOCK,
    exclusive,
    format_ts,
    is_prune_header,
    lines_upto,
    now_ts,
    open_lock,
    parse_entry,
    read_blocks,
    sealed_line,
    segments,
)
from sandboxfs.core.entry import AuditOp, audit_entry

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
    cutoff = format_ts(before)
    try:
        lock_fd = open_lock(path)
    except FileNotFoundError:  # no state dir, so no log
        return 0
    try:
        with exclusive(lock_fd):
            return _prune_locked(path, cutoff, dry_run)
    finally:
        os.close(lock_fd)


@dataclass
class _Cut:
    """Where prune cuts the log: how many entries go, the id and hash the kept entries chain
    to (None: no entry yet), the file where the kept entries begin and the offset in it just
    past the last entry dropped."""

    keep: int
    dropped: int = 0
    last: tuple[int, str] | None = None
    keep_from: int = 0


def _prune_locked(path: Path, cutoff: str, dry_run: bool) -> int:
    files = [seg.path for seg in segments(path)]
    if not files and not path.exists():
        return 0
    files.append(path)  # the log itself last, even if a rotation left none yet
    cut = _find_cut(files, cutoff)
    last = cut.last
    if cut.dropped == 0 or dry_run or last is None:
        return cut.dropped
    anchor, _ = read_anchor(*locate_anchor(path))
    header, _ = sealed_line(
        audit_entry(
            AuditOp.PRUNE,
            True,
            ts=now_ts(),
            extra={"before": cutoff, "dropped": cut.dropped, "anchor": last[1]},
        ),
        last[0],
        GENESIS,
        Key(anchor.key) if anchor is not None else None,
    )
    _rewrite(files[cut.keep], header, cut.keep_from)
    # Only then the files before it: a prune cut short leaves them before a file that begins
    # with a header, which `verify` names and the next prune deletes.
    for name in files[: cut.keep]:
        with contextlib.suppress(FileNotFoundError):
            name.unlink()
    fsync_dir(path.parent)
    return cut.dropped


def _find_cut(files: list[Path], cutoff: str) -> _Cut:
    """Where the leading run of entries older than `cutoff` ends, across `files`."""
    cut = _Cut(keep=len(files) - 1)
    for index, name in enumerate(files):
        try:
            stream = name.open("rb")
        except FileNotFoundError:
            continue
        with stream:
            offset, newer = _drop_older(stream, cutoff, cut)
        cut.keep, cut.keep_from = index, offset
        if newer:
            break
    return cut


def _drop_older(stream: BinaryIO, cutoff: str, cut: _Cut) -> tuple[int, bool]:
    """Count into `cut` the entries of `stream` older than `cutoff`, up to the first newer one:
    the offset in it where the kept lines begin, and whether a newer one was found."""
    offset = 0
    size = os.fstat(stream.fileno()).st_size
    for line_no, line in enumerate(lines_upto(stream, size)):
        offset += len(line)
        entry = parse_entry(line)
        if entry is None:
            continue
        if line_no == 0 and is_prune_header(entry):  # an earlier prune's, which this replaces
            cut.last = entry["id"], entry["anchor"]
            continue
        if str(entry.get("ts", "")) >= cutoff:
            return offset - len(line), True
        cut.dropped += 1
        cut.last = entry["id"], entry["hash"]
    return offset, False


def _rewrite(path: Path, header: bytes, keep_from: int) -> None:
    """Replace the file at `path` with `header` and its complete lines from `keep_from` on."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            with os.fdopen(os.dup(fd), "wb", buffering=READ_BLOCK) as out:
                out.write(header)
                with contextlib.suppress(FileNotFoundError), path.open("rb") as stream:
                    stream.seek(keep_from)
                    for block in read_blocks(stream, os.fstat(stream.fileno()).st_size):
                        lines = block.split(b"\n")
                        if not lines[-1]:
                            lines.pop()
                        kept = (ln for ln in lines if _complete(ln) or parse_entry(ln) is not None)
                        out.write(b"".join(ln + b"\n" for ln in kept))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
