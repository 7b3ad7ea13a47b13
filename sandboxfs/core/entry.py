"""What an audit entry is: every op the log knows (`AuditOp`) and the one builder of an entry.

Every writer of entries (the guard, approvals, the mount's lifecycle, `sandboxfs run`, the
commands of sandboxfs's own, the log itself) builds them here, so an op is spelled once and a
misspelled one is a type error. The shape of each kind of entry is what it has always been:
a field a writer leaves out is absent from its entries, not null, so old logs keep verifying
and their readers see the same keys (the log hashes its canonical JSON, keys sorted).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from enum import Enum, StrEnum
from typing import Any, Final, Literal

from .policy import Op


class AuditOp(StrEnum):
    """Every `op` an audit entry may have (`sandboxfs audit --op` offers these)."""

    # What a caller did to an entry of the tree; the first four are the matrix's Op, spelled
    # the same (an Op is audited as itself: see `audit_entry`).
    READ = Op.READ.value
    WRITE = Op.WRITE.value
    LIST = Op.LIST.value
    DELETE = Op.DELETE.value
    RENAME = "rename"
    LINK = "link"
    # A mount's life and what happened to it.
    MOUNT = "mount"
    UNMOUNT = "unmount"
    TRUST = "trust"  # a promotion or demotion
    APPROVAL = "approval"  # a request, an answer, a grant used or revoked, --no-approvals
    ERROR = "error"  # an unexpected error in a callback (EIO, the mount stays up)
    # `sandboxfs run`: its start and end, a nested worker, the network.
    RUN = "run"
    NET = "net"
    # Commands of sandboxfs's own, outside any mount.
    STAGE = "stage"  # a review step of a staged commit
    HOME = "home"  # a persistent home seeded or reset
    PRUNE = "prune"  # a pruned session; also the header `audit prune` puts first
    # The log about itself.
    RECOVER = "recover"  # a line torn by a crash, closed by the next writer
    AUDIT_DROPPED = "audit-dropped"  # entries lost while the log could not be written
    AUDIT_TAMPER = "audit-tamper"  # a writer found the log cut or forged
    AUDIT_UNCLEAN = "audit-unclean"  # a writer ended without closing the log
    # FUSE callbacks refused while the log cannot be written (fail closed), audited under the
    # callback's own name (link and rename above are two of them).
    OPEN = "open"
    OPENDIR = "opendir"
    CREATE = "create"
    MKDIR = "mkdir"  # also the API's mkdir refused in a zone the level cannot access
    SYMLINK = "symlink"
    MKNOD = "mknod"
    UNLINK = "unlink"
    RMDIR = "rmdir"
    SETATTR = "setattr"
    SETXATTR = "setxattr"
    REMOVEXATTR = "removexattr"


class _Unset(Enum):
    UNSET = "unset"


UNSET: Final = _Unset.UNSET
Unset = Literal[_Unset.UNSET]


def errno_name(err: int | None) -> str | None:
    """An entry's `errno`: the symbolic name (ENOENT), None for none."""
    return errno.errorcode.get(err, str(err)) if err else None


def audit_entry(
    op: AuditOp | Op,
    allowed: bool | None,
    *,
    path: str | Unset | None = UNSET,
    dest: str | Unset | None = UNSET,
    zone: str | Unset | None = UNSET,
    session: str | Unset | None = UNSET,
    workspace: str | Unset | None = UNSET,
    trust: str | Unset | None = UNSET,
    worker: str | None = None,
    reason: str | Unset | None = UNSET,
    err: str | Unset | None = UNSET,
    pid: int | Unset | None = UNSET,
    uid: int | Unset | None = UNSET,
    comm: str | Unset | None = UNSET,
    nbytes: int | Unset | None = UNSET,
    via: str | None = None,
    detail: str | None = None,
    ts: str | Unset = UNSET,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The one builder of an audit entry (`id`, `prev`, `hash`, `mac` and, when absent, `ts`
    are the log's to add).

    A field left UNSET is absent from the entry; None is written as null. `worker`, `via`
    and `detail` are absent when None (they appear only where they say something). `err` is
    the errno's name (`errno_name`); `nbytes` is written as `bytes`. `extra` holds the fields
    of the op's own (`approval`, `command`, `host`, `torn_line`...), which never replace the
    common ones.
    """
    entry: dict[str, Any] = {"op": op.value}
    if path is not UNSET:
        entry["path"] = path
    if dest is not UNSET:
        entry["dest"] = dest
    if zone is not UNSET:
        entry["zone"] = zone
    if session is not UNSET:
        entry["session"] = session
    if workspace is not UNSET:
        entry["workspace"] = workspace
    if trust is not UNSET:
        entry["trust"] = trust
    if worker is not None:
        entry["worker"] = worker
    entry["allowed"] = allowed
    if reason is not UNSET:
        entry["reason"] = reason
    if err is not UNSET:
        entry["errno"] = err
    if pid is not UNSET:
        entry["pid"] = pid
    if uid is not UNSET:
        entry["uid"] = uid
    if comm is not UNSET:
        entry["comm"] = comm
    if nbytes is not UNSET:
        entry["bytes"] = nbytes
    if via is not None:
        entry["via"] = via
    if detail is not None:
        entry["detail"] = detail
    if ts is not UNSET:
        entry["ts"] = ts
    if extra:
        clash = entry.keys() & extra.keys()
        if clash:
            raise ValueError(f"extra fields {sorted(clash)} would replace common ones")
        entry.update(extra)
    return entry
