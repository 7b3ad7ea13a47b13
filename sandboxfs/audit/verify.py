"""Verifying the audit log: every hash, link and mac of the chain, across its segments, and that
its end is where the anchor says (see `verify`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sandboxfs.audit.anchor import Anchor, Key, locate_anchor, read_anchor
from sandboxfs.audit.common import (
    GENESIS,
    Segment,
    digest,
    is_prune_header,
    lines_upto,
    lock_path,
    open_or_none,
    parse_entry,
    segments,
    visible_text,
)
from sandboxfs.audit.markers import dead_writers
from sandboxfs.core.entry import AuditOp


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
        lock_fd = os.open(lock_path(path), os.O_RDONLY | os.O_CLOEXEC)
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
                said = dead_writers(dir_fd, path.name, remove=False)
            finally:
                os.close(dir_fd)
            dead = [p if isinstance(p := s.get("pid"), int) else 0 for s in said]
        found = segments(path)
        stream = open_or_none(path)
        size = 0 if stream is None else os.fstat(stream.fileno()).st_size
        return _Snapshot(found, stream, size, anchor, why, dead)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)  # and with it the lock


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
    anchor = snap.anchor
    if snap.stream is None and not snap.segments:
        if anchor is not None and anchor.head_id > 0:
            message = f"no audit log at {path}, but its anchor says id {anchor.head_id} was written"
            return VerifyResult(False, 0, None, message, keyed=True)
        return VerifyResult(False, 0, None, f"no audit log at {path}")
    chain = _Chain(path, snap)
    try:
        chain.read_files()
        return chain.finish()
    except _Broken as broken:
        return chain.failed(broken.line, broken.problem)


class _Broken(Exception):
    """A check that failed: at `line` of the file being read (None: the file as a whole)."""

    def __init__(self, line: int | None, problem: str) -> None:
        super().__init__(problem)
        self.line = line
        self.problem = problem


class _Chain:
    """What `verify` has learnt of the chain so far, reading the snapshot's files oldest first;
    each check raises `_Broken` at the first thing wrong, which `failed` then reports."""

    def __init__(self, path: Path, snap: _Snapshot) -> None:
        self.path = path
        self.snap = snap
        self.anchor = snap.anchor
        self.key = Key(snap.anchor.key) if snap.anchor is not None else None
        self.torn: list[int] = []
        self.unexplained: list[int] = []  # unparsable lines not yet named by a recover entry
        self.entries = 0
        self.unkeyed = 0  # entries before the anchor's keyed_from
        self.with_mac = 0
        self.header: dict[str, Any] | None = None
        self.link: str | None = None  # what the next entry's prev must be
        self.link_source = ""
        self.last_id = 0
        self.line_no = 0
        self.where = ""  # the file being read, named when there are several
        self.unclean: list[int] = []
        # Of the file being read: its segment (None: the log itself), whether no entry of it
        # has been read yet, and whether it begins with a prune header.
        self.seg: Segment | None = None
        self.first_in_file = True
        self.pruned = False

    def failed(self, line: int | None, problem: str) -> VerifyResult:
        """The outcome when a check failed: `problem` at `line` (None: the file as a whole)."""
        message = (
            f"{self.where}{problem}" if line is None else f"{self.where}line {line}: {problem}"
        )
        return self._result(False, line, message)

    def _result(self, ok: bool, line: int | None, message: str) -> VerifyResult:
        return VerifyResult(
            ok,
            self.entries,
            line,
            message,
            tuple(self.torn),
            self.anchor is not None,
            self.unkeyed,
            tuple(self.unclean),
            tuple(self.snap.dead),
        )

    def read_files(self) -> None:
        files = _snapshot_files(self.snap)
        try:
            for seg, source, end in files:
                self._read_file(seg, source, end)
        finally:
            files.close()
            if self.snap.stream is not None:
                self.snap.stream.close()

    def _read_file(self, seg: Segment | None, source: BinaryIO | None, end: int) -> None:
        name = self.path.name if seg is None else seg.path.name
        self.where = f"{name} " if self.snap.segments else ""
        if source is None:
            raise _Broken(None, "vanished while it was verified (pruned meanwhile?): verify again")
        self.seg = seg
        self.first_in_file = True
        self.pruned = False
        self.line_no = 0
        for line_no, line in enumerate(lines_upto(source, end), 1):
            self.line_no = line_no
            self._read_line(line)
        self._check_file_end()

    def _read_line(self, line: bytes) -> None:
        entry = parse_entry(line)
        if entry is None:
            self.unexplained.append(self.line_no)
            return
        self._check_recovered(entry)
        if digest(entry) != entry["hash"]:
            raise _Broken(self.line_no, "hash mismatch (entry edited)")
        header = self.link is None and self.line_no == 1 and is_prune_header(entry)
        self.with_mac += "mac" in entry
        self._check_mac(entry, header)
        self._check_place(entry, header)
        if header:
            self.header, self.pruned = entry, True
            self.link, self.link_source = entry["anchor"], "the prune header's anchor"
        else:
            self._check_link(entry)
            self.link, self.link_source = entry["hash"], f"{self.where}line {self.line_no}'s hash"
            self.entries += 1
            self.unkeyed += self.anchor is not None and entry["id"] < self.anchor.keyed_from
        self.last_id = entry["id"]
        self._check_recorded(entry)

    def _check_recovered(self, entry: dict[str, Any]) -> None:
        """Unparsable lines just before `entry` are torn lines only if it is the recover
        entry that names the first of them."""
        if not self.unexplained:
            return
        if entry.get("op") != AuditOp.RECOVER or entry.get("torn_line") != self.unexplained[0]:
            raise _Broken(self.unexplained[0], "unparsable line that no recover entry names")
        self.torn += self.unexplained
        self.unexplained = []

    def _check_mac(self, entry: dict[str, Any], header: bool) -> None:
        """From the anchor's `keyed_from` on, an entry must carry a valid mac."""
        anchor, key = self.anchor, self.key
        if anchor is None or key is None or entry["id"] < anchor.keyed_from:
            return
        if key.valid(entry["hash"], entry.get("mac")):
            return
        problem = "mac missing" if "mac" not in entry else "mac mismatch"
        if header:
            raise _Broken(
                self.line_no,
                f"{problem} on the prune header"
                " (entries were removed from the start without the key)",
            )
        raise _Broken(self.line_no, f"{problem} (the chain was rebuilt without the key)")

    def _check_place(self, entry: dict[str, Any], header: bool) -> None:
        """A prune header comes only first, and a file's first entry where its name and the
        file before it say."""
        if self.link is not None and is_prune_header(entry):
            raise _Broken(
                self.line_no,
                "a prune header after older entries (an interrupted prune?"
                " `sandboxfs audit prune` again finishes it)",
            )
        if self.first_in_file and not header:
            self.first_in_file = False
            gap = _segment_start_problem(
                self.seg,
                entry["id"],
                self.last_id,
                chained=self.link is not None,
                named=not self.pruned,
            )
            if gap is not None:
                raise _Broken(self.line_no, gap)

    def _check_link(self, entry: dict[str, Any]) -> None:
        """An entry (not a prune header) follows the one before it: its prev is that one's
        hash (or GENESIS first), its id the next."""
        if self.link is None:
            self._check_first(entry)
        elif entry["prev"] != self.link:
            raise _Broken(
                self.line_no,
                f"prev does not match {self.link_source} (a line was inserted or removed)",
            )
        elif entry["id"] != self.last_id + 1:
            problem = f"id {entry['id']} does not follow id {self.last_id}"
            raise _Broken(self.line_no, problem + " (a line was inserted or removed)")

    def _check_first(self, entry: dict[str, Any]) -> None:
        """The chain's first entry, with no prune header before it, is id 1 after GENESIS."""
        if entry["id"] > 1 and self.snap.segments:
            raise _Broken(
                self.line_no,
                f"the first entry is id {entry['id']}, not id 1 chained to GENESIS"
                f" (ids 1 to {entry['id'] - 1} are in no file: segments or lines"
                " were removed from the start)",
            )
        if entry["id"] != 1 or entry["prev"] != GENESIS:
            raise _Broken(
                self.line_no,
                "the first entry is not id 1 chained to GENESIS"
                " (lines were removed from the start)",
            )

    def _check_recorded(self, entry: dict[str, Any]) -> None:
        """What the anchor and the writers recorded: the head's hash at its id, writers that
        ended without closing the log, and a writer that found the log tampered with."""
        anchor = self.anchor
        if anchor is not None and self.last_id == anchor.head_id and self.link != anchor.head_hash:
            raise _Broken(
                self.line_no,
                f"id {self.last_id} is not the entry its anchor records (the chain was rebuilt)",
            )
        if entry.get("op") == AuditOp.AUDIT_UNCLEAN:
            self.unclean.append(entry["id"])
        if entry.get("op") == AuditOp.AUDIT_TAMPER:
            raise _Broken(
                self.line_no,
                f"a writer found the log tampered with: {visible_text(entry.get('reason'))}",
            )

    def _check_file_end(self) -> None:
        """A segment ends with no torn line (only the log itself may), at the id its name says."""
        seg = self.seg
        if seg is None:
            return
        if self.unexplained:
            raise _Broken(self.unexplained[0], "unparsable line that no recover entry names")
        if self.last_id != seg.last:
            raise _Broken(
                None,
                f"ends at id {self.last_id} but its name says id {seg.last}: "
                + (
                    "entries were removed from its end (truncated)"
                    if self.last_id < seg.last
                    else "it holds entries its name does not (renamed?)"
                ),
            )

    def finish(self) -> VerifyResult:
        """After the last file: a torn line only at its very end, and no entry missing at the
        end the anchor records; then the chain is intact."""
        if self.unexplained:
            if self.unexplained != [self.line_no]:
                raise _Broken(self.unexplained[0], "unparsable line that no recover entry names")
            self.torn += self.unexplained
        self.where = ""
        anchor = self.anchor
        if anchor is not None and self.last_id < anchor.head_id:
            raise _Broken(
                None,
                f"the log ends at id {self.last_id} but its anchor says id {anchor.head_id} was"
                " written: entries were removed from the end",
            )
        return self._result(True, None, self._intact_message())

    def _intact_message(self) -> str:
        snap = self.snap
        message = f"ok: {self.entries} entries, chain intact"
        if snap.segments:
            files = len(snap.segments) + (snap.stream is not None)
            message = f"ok: {self.entries} entries in {files} files, chain intact across them"
        if self.header is not None:
            message += f" from the prune header (entries up to id {self.header['id']} pruned)"
        message += self._key_note()
        if self.torn:
            message += "; torn lines tolerated: " + ", ".join(map(str, self.torn))
        if self.unclean or snap.dead:
            message += _unclean_note(self.unclean, snap.dead)
        return message

    def _key_note(self) -> str:
        """What the message says of the key: checked up to the anchor's head, or not at all."""
        anchor = self.anchor
        if anchor is not None:
            note = f"; keyed, and complete up to its anchor's head (id {anchor.head_id})"
            if self.unkeyed:
                note += (
                    f"; the first {self.unkeyed} entries predate keyed entries"
                    " (written before this anchor existed)"
                )
            return note
        note = f"; unkeyed check only ({self.snap.no_anchor}"
        if self.with_mac:
            note += f", though {self.with_mac} entries carry a mac: moved project? deleted anchor?"
        return note + "): a cut end or a rebuilt chain would not show"


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
