"""The audit log's writer: append-only JSON lines, chained by SHA-256, keyed, shared by
concurrent mounts (the format: sandboxfs.audit.common).

Entries are queued and written in batches under the lock all writers share; each flush records
the chain's new head in the anchor. A denial must be on disk before its errno returns, even when
the disk is full (sandboxfs.audit.reserve); `AuditLog.failing` says when even that was not
enough, and the FUSE adapter then fails closed. Past a size the log is rotated into a segment.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandboxfs.audit.anchor import AnchorFile, locate_anchor, make_private_dirs
from sandboxfs.audit.common import (
    CHUNK,
    GENESIS,
    READ_BLOCK,
    Tail,
    exclusive,
    is_prune_header,
    log,
    now_ts,
    open_lock,
    parse_entry,
    same_file,
    scan_tail,
    sealed_line,
    segment_name,
    segments,
)
from sandboxfs.audit.fold import AllowedFolder, Folder
from sandboxfs.audit.markers import MARKER_END, make_marker, sweep_writers
from sandboxfs.audit.reserve import RESERVE_BYTES, Reserve
from sandboxfs.core.entry import AuditOp, audit_entry
from sandboxfs.core.syscalls import write_all
from sandboxfs.errors import Failure

_MAX_QUEUED = 100_000
TAMPER_OP = AuditOp.AUDIT_TAMPER  # the entry of a writer that finds the log cut or forged
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_RETRY_EVERY = 0.25  # seconds between attempts to write while the log is failing
# Past this size the log is renamed to a segment and a new file continues the chain (0: never).
ROTATE_BYTES = 64 << 20
MIN_ROTATE_BYTES = 4096  # a smaller setting would make a file of a few entries


def _open_log(path: Path | str, dir_fd: int | None = None) -> int:
    # Read access too: the tail is read back to continue the chain.
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    return os.open(path, flags, 0o600, dir_fd=dir_fd)


def _first_id(fd: int, end: int) -> int | None:
    """The id of the first entry (not a prune header) in the first `end` bytes of `fd`."""
    offset = 0
    carry = b""
    while offset < end:
        data = carry + os.pread(fd, min(READ_BLOCK, end - offset), offset)
        if len(data) == len(carry):
            return None
        offset += len(data) - len(carry)
        *lines, carry = data.split(b"\n")
        for line in lines:
            entry = parse_entry(line)
            if entry is not None and not is_prune_header(entry):
                return int(entry["id"])
    return None


def _count_lines(fd: int, end: int) -> int:
    """Newlines in the first `end` bytes; only needed to name a torn line, which is rare."""
    count = 0
    for offset in range(0, end, CHUNK):
        count += os.pread(fd, min(CHUNK, end - offset), offset).count(b"\n")
    return count


class AuditLog:
    """Append-only, SHA-256 hash-chained, keyed JSON-lines log shared safely by several processes.

    Entries are queued and written in batches, except denials (which must be on disk before the
    caller sees its errno) and everything in sync mode. One instance is used from one thread.
    `reserve` bytes are kept preallocated beside the log for when its file system fills up.
    Past `rotate` bytes the log is renamed to a segment (see `Segment`) and a new file continues
    the chain; whichever writer flushes first past it rotates, under the lock all writers share,
    and the others follow it to the new file. `fold=False` writes every entry in
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
        fold: bool = True,
    ) -> None:
        self._path = path
        self._rotate = rotate
        self._fold = fold
        self._sync = sync
        self._batch_size = batch_size
        self._queue: list[dict[str, Any]] = []
        self._dropped = 0
        self._tail: Tail | None = None  # valid while the file still has tail.size bytes
        self._failing = False
        self._failure: str | None = None  # why, while failing: the last write's error
        self._anchor: AnchorFile | None = None
        self._folder = Folder()
        self._allowed = AllowedFolder()
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
        self._dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._reserve = Reserve(self._dir_fd, path.with_suffix(".reserve").name, reserve, path)
        self._lock_fd = self._fd = self._marker_fd = -1
        try:
            self._lock_fd = open_lock(path, self._dir_fd)
            self._fd = _open_log(self._name, self._dir_fd)
            with exclusive(self._lock_fd):
                self._reserve.fill()
                try:
                    self._follow_anchor(os.fstat(self._fd).st_size)
                except OSError as exc:
                    raise Failure(
                        f"audit log {path}: {exc.strerror}; no entry is written without its key"
                    ) from None
                self._queue.extend(sweep_writers(self._dir_fd, self._name))
                self._marker_name, self._marker_fd = make_marker(self._dir_fd, self._name)
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

        Allowed reads and listings fold alike, per top-level directory of a zone and program
        (sandboxfs.audit.fold.AllowedFolder): the first is written in full, the others of the
        window as one entry with `count`, `first_ts`, and the deepest directory holding them
        as `path` (with `below: true`), so a `grep -r` or `git status` costs a few entries per
        top-level directory, not one per file. Summed `count` is every operation.
        """
        if self._fd < 0:
            raise ValueError(f"audit log {self._path} is closed")
        queued = dict(entry)
        stamped = "ts" not in queued  # an entry of now (one with its own `ts` is imported)
        if stamped:
            queued["ts"] = now_ts()
        if (
            queued.get("allowed") is False
            and self._fold
            and self._folder.fold(queued, self._queue, failing=self._failing)
        ):
            if self._queue:  # the window ended: its counts are due
                self.try_flush()
            return
        if self._fold and stamped and not self._sync and self._allowed.fold(queued, self._queue):
            return  # counted: written with its window (the next flush after it ends)
        self._queue.append(queued)
        if self._sync or queued.get("allowed") is False or len(self._queue) >= self._batch_size:
            self.try_flush()

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
            # Still failing if nothing was due to be written (entries counted in a window
            # that has not ended): the adapter goes on refusing until a write succeeds.
            return not self._failing
        except OSError as exc:
            self._last_error = exc.errno or 0
            self._retry_at = time.monotonic() + _RETRY_EVERY
            if len(self._queue) > _MAX_QUEUED:
                excess = len(self._queue) - _MAX_QUEUED
                self._dropped += excess
                del self._queue[:excess]
            return False

    def settle(self) -> None:
        """End the windows of counted entries now and try to write everything: for a reader
        that must see every operation so far (the API's audit_entries)."""
        self._folder.end_window(self._queue)
        self._allowed.end_window(self._queue)
        self.try_flush()

    def _room_for_queue(self) -> bool:
        """Whether the log's file system seems to have room for the queue (a cheap check)."""
        try:
            fs = os.fstatvfs(self._fd)
        except OSError:
            return True
        pending = len(self._queue) + self._folder.counted_ops + self._allowed.counted + 16
        return fs.f_bavail * fs.f_frsize > 1024 * pending

    def flush(self) -> None:
        """Chain and append every queued entry in one write, under the lock all writers share,
        then record the new head in the anchor."""
        now = time.monotonic()
        self._folder.end_window(self._queue, now)
        self._allowed.end_window(self._queue, now)
        if not self._queue:
            return
        try:
            with exclusive(self._lock_fd):
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
        tail, pending = self._current_tail(size)
        if 0 < self._rotate <= size and tail.valid_end == size and self._rotate_file(tail):
            size = 0
            tail = replace(tail, size=0, valid_end=0)
        if self._dropped:
            pending = [self._dropped_entry(), *pending]
        out = bytearray()
        if tail.valid_end < size:  # a writer died mid-line: close that line, say so
            if os.pread(self._fd, 1, size - 1) != b"\n":
                out += b"\n"
            torn_line = _count_lines(self._fd, tail.valid_end) + 1
            recover = audit_entry(
                AuditOp.RECOVER, True, ts=now_ts(), extra={"torn_line": torn_line}
            )
            pending = [recover, *pending]
        key = self._anchor.key if self._anchor is not None else None
        last_id, last_hash = tail.last_id, tail.last_hash
        for entry in pending:
            last_id += 1
            line, last_hash = sealed_line(entry, last_id, last_hash, key)
            out += line
        self._tail = None  # unknown if the write fails part way
        self._append(out, size)
        end = size + len(out)
        self._tail = Tail(end, last_id, last_hash, end, last_hash)
        self._queue = []
        self._dropped = 0
        self._set_head(last_id, last_hash)
        if self._reserve.due():
            self._reserve.fill()

    def _current_tail(self, size: int) -> tuple[Tail, list[dict[str, Any]]]:
        """Where the chain stands at the end of the log of `size` bytes, and the entries to
        write: the queue, after an entry saying how the log was cut or forged if it was."""
        anchor_changed = self._follow_anchor(size)
        tail = self._tail
        pending = self._queue
        if tail is None or tail.size != size or anchor_changed:  # another process wrote
            tail = self._chain_tail(size)
            problem = self._tail_problem(tail)
            if problem is not None:
                log.error("audit log %s: %s", self._path, problem["reason"])
                pending = [problem, *pending]
        return tail, pending

    def _dropped_entry(self) -> dict[str, Any]:
        """The entry that records how many entries were dropped while the log failed."""
        return audit_entry(
            AuditOp.AUDIT_DROPPED,
            True,
            ts=now_ts(),
            reason="entries dropped while the log could not be written",
            extra={"dropped": self._dropped},
        )

    def _set_head(self, last_id: int, last_hash: str) -> None:
        """Record the chain's new head in the anchor (if there is one)."""
        if self._anchor is None:
            return
        try:
            self._anchor.set_head(last_id, last_hash)
        except OSError as exc:  # the log itself is fine; the next flush tries again
            log.error("audit log %s: cannot update its anchor: %s", self._path, exc.strerror)

    def _chain_tail(self, size: int) -> Tail:
        """Where the chain stands at the end of the log file of `size` bytes: in it, or, when
        it holds no entry yet (just rotated), at the end of the newest segment."""
        tail = scan_tail(self._fd, size)
        if tail.last_id or tail.last_hash != GENESIS:
            return tail
        newest = segments(self._path, self._dir_fd)
        if not newest:
            return tail
        fd = os.open(newest[-1].path.name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dir_fd)
        try:
            before = scan_tail(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return replace(before, size=size, valid_end=tail.valid_end)

    def _rotate_file(self, tail: Tail) -> bool:
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

    def _tail_problem(self, tail: Tail) -> dict[str, Any] | None:
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
            ts=now_ts(),
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
                if exc.errno not in _NO_SPACE or not self._reserve.release(len(data)):
                    raise

    def _follow_replacement(self) -> int:
        """Reopen the log if prune replaced it, or another writer rotated it, since we opened
        it; return its size."""
        if not same_file(self._fd, self._name, self._dir_fd):
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
            self._folder.end_window(self._queue)
            self._allowed.end_window(self._queue)
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
                    os.pwrite(self._marker_fd, b',"lost":%d}' % len(self._queue), MARKER_END)
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
