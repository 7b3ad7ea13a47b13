"""Live writers' markers beside the log, so that a writer killed before it closed the log is
found: the next writer records it (`sweep_writers`), and `verify` names those not yet recorded
(`dead_writers`). The chain cannot show what such a writer had queued but not written.
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import Any

from sandboxfs.audit.common import now_ts
from sandboxfs.core.entry import AuditOp, audit_entry
from sandboxfs.core.syscalls import write_all

UNCLEAN_OP = AuditOp.AUDIT_UNCLEAN  # the entry of a writer that ended without closing it
_WRITER_PREFIX = ".writer."  # a live writer's marker beside the log, locked for its life
MARKER_END = 64  # the marker's JSON is padded to here; `lost` is written over its end


def make_marker(dir_fd: int, log_name: str) -> tuple[str, int]:
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
        body = b'{"pid":%d,"started":"%s"' % (os.getpid(), now_ts().encode())
        write_all(fd, body.ljust(MARKER_END) + b"}")
    except BaseException:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)
        raise
    return name, fd


def dead_writers(dir_fd: int, log_name: str, *, remove: bool) -> list[dict[str, Any]]:
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


def sweep_writers(dir_fd: int, log_name: str) -> list[dict[str, Any]]:
    """An entry for each writer that ended without closing the log (killed, or unable to write
    its last entries), removing its marker: the next writer records what the dead could not."""
    entries = []
    for said in dead_writers(dir_fd, log_name, remove=True):
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
                ts=now_ts(),
                reason="a writer ended without closing the log (killed?): " + reason,
                extra={"writer_pid": said.get("pid"), "started": said.get("started")},
            )
        )
    return entries
