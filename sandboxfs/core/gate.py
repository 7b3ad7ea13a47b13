"""The gate: one method per operation, each running all of that operation's rules in one order.

Both front ends call it and do nothing but translate: the FUSE adapter (sandboxfs.operations:
inode numbers, handles, errno, the kernel's caches) and the Python API (sandboxfs.api.sandbox:
paths, typed errors, tool text). For each operation the gate

1. runs the operation's checks (`check_<op>`: the guard's rules in this operation's order,
   then `_decide`, the one place where a later rule joins every operation),
2. charges the zone's limits (max_file_bytes, quota),
3. touches the store through the front end's `action` (the backing call, as the caller),
4. gives back what a failed or shorter change did not use, and
5. records the audit entry of the allowed operation.

Refusals are audited by the guard before its `SandboxError` leaves the gate. A permission
probe (the API's `check_permission`, `stage`'s precheck) is the same gate run without effect
(`without_effect`): the same `check_<op>` on the same policy, frozen commits, pinned
directories and own entries, with nothing audited, charged or changed, so it cannot drift
from the operation it answers for.

The rules themselves (the matrix, deny and protect patterns, git's surface, private keys,
frozen staged commits, limits) live in sandboxfs.core.guard and sandboxfs.core.policy.
"""

from __future__ import annotations

import copy
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .entry import AuditOp
from .errors import SandboxError
from .guard import Caller, Guard, ReadFile
from .inodes import Node, StatLike
from .policy import Decision, Op, Rule, Zone
from .store import HiddenEntry

T = TypeVar("T")

# Set-user-ID and set-group-ID bits never reach a backing file: a confined program (root,
# maybe) must not leave a set-id executable for someone outside to run.
SUID_SGID = stat.S_ISUID | stat.S_ISGID
# sandboxfs has no security.* namespace: it never shows or stores labels or file capabilities.
SECURITY_XATTR_PREFIX = b"security."


class Storage(Protocol):
    """What the gate asks of a front end's storage (core.store.Store, the API's backends)."""

    def find(self, parent: Node, name: bytes) -> tuple[StatLike, int] | None: ...
    def target(self, parent: Node, name: bytes) -> StatLike | None: ...
    def created(self, zone: Zone, st: StatLike) -> bool: ...
    def stat(self, node: Node) -> StatLike: ...


@dataclass(frozen=True, slots=True)
class Request:
    """One operation as `_decide`'s steps see it, once every built-in rule allowed it."""

    op: AuditOp | Op  # as audited: read, write, list, delete, rename, link
    caller: Caller
    path: str
    zone: Zone | None
    dest: str | None = None
    node: Node | None = None  # the existing entry, if there is one


# A rule that joins every operation (approvals, worker narrowing): returns to allow, or raises
# `gate.refuse(...)` (audited) to refuse. Steps run in the order they were added. For a probe
# (`gate.effect` is False) a step answers without asking anyone or changing anything.
Step = Callable[["Gate", Request], None]


FAIL_CLOSED = "the audit log cannot be written: refused until it can (fail closed)"


class _NullSink:
    """The audit log of a gate without effect: nothing is recorded."""

    failing = False

    def record(self, entry: dict[str, Any]) -> None:
        pass

    def try_flush(self) -> bool:
        return True


class Gate:
    """Every operation of one mount or sandbox, in its one order of rules.

    `_decide` (the added steps) runs in every operation that reads or changes an entry's
    contents or names: open (and the API's read and replace), readlink, create, make, link,
    remove, rename, setattr, setxattr/removexattr and listing. Lookups and attributes are
    judged by the guard alone (visibility), and a write through an open handle was decided
    when the handle was opened (a staged commit under review and a trust change aside).
    """

    def __init__(self, guard: Guard, storage: Storage, *, effect: bool = True) -> None:
        self.guard = guard
        self.storage = storage
        self.effect = effect
        self.steps: list[Step] = []

    def fail_closed(self, op: AuditOp | Op, path: str | None, *, pid: int, uid: int) -> None:
        """While the audit log cannot be written, nothing that would be audited happens: the
        one fail-closed rule of both front ends. The refusal is recorded (it waits in memory
        with the log's other refusals, counted at a constant cost) and raised as ENOSPC."""
        audit = self.guard.audit
        if audit.failing and not audit.try_flush():
            self.guard.record(
                op, path, None, pid=pid, uid=uid, allowed=False, reason=FAIL_CLOSED,
                err=errno.ENOSPC,
            )  # fmt: skip
            raise SandboxError(errno.ENOSPC, FAIL_CLOSED)

    def without_effect(self) -> Gate:
        """The same gate, run for its answer only: the guard's current policy, frozen commits,
        pinned directories, key scanner and own entries; no audit entry, no quota charge.
        Built per question, so that it follows trust changes."""
        dry = copy.copy(self.guard)
        dry.audit = _NullSink()
        dry.tallies = {}
        dry.consent = self.guard.consent.probe(dry.refuse)
        gate = Gate(dry, self.storage, effect=False)
        gate.steps = self.steps
        return gate

    # ----- the one place a later rule joins every operation ----------------------------------

    def _decide(self, request: Callable[[], Request]) -> None:
        """After the built-in rules of an operation allowed it and before anything is charged
        or changed: each added step (see `Step`). Approvals (the user's consent) and worker
        narrowing are added here, once, for every operation and for the probe alike.
        `request` builds the operation's Request only when a step is there to read it (a
        virtual path costs a walk up the tree)."""
        if self.steps:
            built = request()
            for step in self.steps:
                step(self, built)

    def refuse(
        self, request: Request, err: int, reason: str, rule: Rule = Rule.MATRIX
    ) -> SandboxError:
        """A step's refusal: audited, then returned for the step to raise."""
        decision = Decision(False, err, reason, rule)
        return self.guard.refuse(
            request.caller, request.op, request.path, request.zone, decision, request.dest
        )

    # ----- limits ----------------------------------------------------------------------------

    def _refund(self, zone: Zone | None, nbytes: int, nfiles: int) -> None:
        if self.effect:
            self.guard.freed(zone, nbytes, nfiles)

    # ----- resolving names -------------------------------------------------------------------

    def find(
        self, caller: Caller, op: Op, parent: Node, name: bytes
    ) -> tuple[StatLike, int] | None:
        """storage.find, with an entry that is never part of a zone (sandboxfs's state, another
        mount) refused as absent to a reader and as EACCES to a writer, audited as `op`."""
        try:
            return self.storage.find(parent, name)
        except HiddenEntry as exc:
            raise self.guard.hidden(caller, op, parent, name, exc.reason) from None

    def lookup(self, caller: Caller, parent: Node, name: bytes) -> tuple[StatLike, int] | None:
        """LOOKUP of parent/name (inside a zone): its lstat and workers layer, None when absent
        or refused as absent (see Guard.visible: the answer does not tell which). A creation
        after a refused lookup reaches its own operation and is refused there as `write`."""
        zone = parent.zone
        assert zone is not None
        found = self.find(caller, Op.READ, parent, name)
        st, layer = found if found is not None else (None, 0)
        created = st is not None and self.storage.created(zone, st)
        if not self.guard.visible(caller, parent, name, st, created) or st is None:
            return None
        return st, layer

    def getattr(self, caller: Caller, node: Node) -> None:
        """Attributes of a known entry: after a trust change, only what the level may resolve."""
        if self.guard.generation:
            self.guard.may_stat(caller, node)

    # ----- files -----------------------------------------------------------------------------

    def check_open(
        self,
        caller: Caller,
        node: Node,
        *,
        read: bool,
        write: bool,
        truncate: bool = False,
        in_place: bool = False,
    ) -> None:
        shared = write and self._shared(node)
        self.guard.may_open(
            caller, node, read, write, truncate=truncate, in_place=in_place, shared=shared
        )
        op = Op.WRITE if write else Op.READ
        self._decide(lambda: Request(op, caller, node.vpath(), node.zone, node=node))

    def open(
        self,
        caller: Caller,
        node: Node,
        action: Callable[[], T],
        *,
        read: bool,
        write: bool,
        truncate: bool = False,
        in_place: bool = False,
        comm: str | None = None,
    ) -> T:
        """Open an existing file (`action` opens it, and truncates with `truncate`; `in_place`:
        for writing without O_APPEND): what truncating frees leaves the quota; a read-only
        open is recorded as `read` (a writer's entry is written when its handle is released,
        with the bytes: see `release`)."""
        self.check_open(caller, node, read=read, write=write, truncate=truncate, in_place=in_place)
        old_size = -1
        if truncate and self.guard.zone_limits(node.zone).has_quota:
            old_size = self.storage.stat(node).st_size
        result = action()
        if old_size > 0:
            new_size = self.storage.stat(node).st_size
            if old_size > new_size:
                self._refund(node.zone, old_size - new_size, 0)
        if not write:
            self.guard.did(caller, Op.READ, node, comm=comm)
        return result

    def _made_here(self, zone: Zone, st: StatLike | None) -> bool:
        """Whether this mount created the entry `st` describes (not the user's: no approval
        rule asks about changing it); only asked where approval rules exist."""
        return st is not None and self.guard.consent.active and self.storage.created(zone, st)

    def _shared(self, node: Node) -> bool:
        """Whether a file's contents are also another name's (approval rules' exclusions do
        not apply to it); only asked where approval rules exist."""
        return self.guard.consent.active and self.storage.stat(node).st_nlink > 1

    def overwrite_in_place(self, caller: Caller, node: Node) -> None:
        """A write below the end of a file through a handle opened with O_APPEND (whose flag
        fcntl cleared since, or a shared mapping's writeback): an overwrite for the approval
        rules, as an open without O_APPEND is."""
        self.guard.may_open(caller, node, False, True, in_place=True, shared=self._shared(node))

    def open_document(self, caller: Caller, node: Node, *, write: bool) -> None:
        """The mount's own documents (/.sandboxfs/context.json and README): read-only at every
        level; reading them is not audited (`sandboxfs status` reads context.json to tell a
        live mount from a dead one)."""
        if write:
            self.guard.may_write_context(caller, node)

    def keep(
        self,
        caller: Caller,
        node: Node,
        *,
        read: bool,
        write: bool,
        created: bool,
        grant: int | None = None,
    ) -> None:
        """A handle opened under an earlier trust level or approval grant, used again (see
        Guard.may_keep)."""
        self.guard.may_keep(caller, node, read, write, created, grant)

    def write(
        self,
        caller: Caller,
        node: Node,
        off: int,
        length: int,
        action: Callable[[], int],
        *,
        size: Callable[[], int] | None = None,
        frozen: Callable[[], None] | None = None,
    ) -> int:
        """A write of `length` bytes at `off` through an open handle; `action` writes and
        returns how many bytes it wrote. In /staged each write asks again whether its commit
        is under review (`frozen` runs on that refusal: the front end drops its caches).
        `size`: the file's size now, where sizes matter (max_file_bytes, a quota): the growth
        is charged first and what was not written given back."""
        if node.zone is Zone.STAGED:
            try:
                self.guard.may_write_staged(caller, node)
            except SandboxError:
                if frozen is not None:
                    frozen()
                raise
        if size is None:
            return action()
        old_size = size()
        new_size = max(old_size, off + length)
        self.guard.may_resize(caller, node, old_size, new_size)
        try:
            written = action()
        except BaseException:
            self._refund(node.zone, new_size - old_size, 0)
            raise
        if written < length:
            self._refund(node.zone, new_size - max(old_size, off + written), 0)
        return written

    def release(
        self,
        caller: Caller,
        node: Node,
        *,
        wrote: bool,
        created: bool,
        nbytes: int,
        comm: str | None = None,
    ) -> None:
        """A handle closed: a writer's (or creator's) entry, with the bytes it wrote."""
        if wrote or created:
            detail = "create" if created else None
            self.guard.did(caller, Op.WRITE, node, comm=comm, nbytes=nbytes, detail=detail)

    def replace(
        self,
        caller: Caller,
        node: Node,
        length: int,
        append: bool,
        action: Callable[[Callable[[int], None]], None],
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Replace (or append to) an existing file's contents with `length` bytes (the API's
        write): `action(before)` opens the file and calls `before(size)` before changing it;
        the size is charged as the mount charges it (truncated, which is never refused, then
        written). `check`: the front end's own condition on the entry, after the rules.
        Replacing is an overwrite for the approval rules; appending is not."""
        self.check_open(caller, node, read=False, write=True, truncate=not append)
        if check is not None:
            check()
        g = self.guard
        expected = -1

        def before(old: int) -> None:
            nonlocal expected
            new = old + length if append else length
            if append or old == 0:
                g.may_resize(caller, node, old, new)
            else:
                g.may_resize(caller, node, old, 0)
                try:
                    g.may_resize(caller, node, 0, new)
                except BaseException:
                    self._refund(node.zone, -old, 0)  # charge again what truncating gave back
                    raise
            expected = new

        try:
            action(before)
        except BaseException:
            if expected >= 0:  # charged, then failed: give back what was not written
                try:
                    actual = self.storage.stat(node).st_size
                except (SandboxError, OSError):
                    actual = expected - length
                self._refund(node.zone, max(0, expected - actual), 0)
            raise
        g.did(caller, Op.WRITE, node, nbytes=length)

    def readlink(self, caller: Caller, node: Node, action: Callable[[], T]) -> T:
        """A symbolic link's target: its contents."""
        if node.zone is None:
            raise SandboxError(errno.EINVAL)
        self.guard.may_read_link(caller, node)
        self._decide(lambda: Request(Op.READ, caller, node.vpath(), node.zone, node=node))
        return action()

    # ----- creating entries ------------------------------------------------------------------

    def check_create(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        kind: str = "file",
        mode: int = 0,
        size: int = 0,
    ) -> Zone:
        """Checks for a new name (kind: file, mkdir, symlink, mknod) of `size` bytes; charges
        one entry (and the size) to the zone's quota. Returns the zone."""
        g = self.guard
        zone = g.may_create(caller, parent, name, kind, mode)
        if size:
            try:  # sizes are judged before anything exists
                g.may_resize(caller, Node(0, zone, parent, name, False), 0, size)
            except BaseException:
                self._refund(zone, 0, 1)
                raise
        try:
            self._decide(lambda: Request(Op.WRITE, caller, parent.vpath(name), zone))
        except BaseException:
            self._refund(zone, size, 1)
            raise
        return zone

    def existing(self, caller: Caller, parent: Node, name: bytes, zone: Zone, err: int) -> None:
        """A creation met an existing name (err): sandboxfs's state or another mount, or an
        entry of a create-only zone, are refused (EACCES, audited) as the write they were."""
        if err in (errno.EEXIST, errno.EISDIR, errno.EXDEV):
            self.find(caller, Op.WRITE, parent, name)
        if err == errno.EEXIST:
            self.guard.refuse_existing(caller, parent, name, zone)
            raise SandboxError(errno.EEXIST, f"{parent.vpath(name)} already exists")
        if err == errno.EXDEV:  # the name is the root of another mount
            self.guard.refuse_mount_root(caller, parent, name, zone)

    def create(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        action: Callable[[int, int], tuple[T, StatLike | None]],
        *,
        flags: int = os.O_WRONLY,
        mode: int = 0o666,
        size: int = 0,
        record: bool = False,
    ) -> T:
        """A new regular file: `action(flags, mode)` creates it (with the set-id bits
        stripped, and O_EXCL where the zone is create-only: "create" never reopens an existing
        file there) and returns what it made and its lstat. `record`: audited now, with `size`
        bytes (the API); else when its handle is released (the mount)."""
        zone = self.check_create(caller, parent, name, "file", size=size)
        if self.guard.create_only(zone):
            flags |= os.O_EXCL
        try:
            made, st = action(flags, stat.S_IMODE(mode) & ~SUID_SGID)
        except BaseException as exc:
            self._refund(zone, size, 1)
            if isinstance(exc, OSError) and exc.errno is not None:
                self.existing(caller, parent, name, zone, exc.errno)
            raise
        if st is not None:
            self.guard.created(zone, st)
        if record:
            path = parent.vpath(name)
            self.guard.record(
                Op.WRITE,
                path,
                zone,
                pid=caller.pid,
                uid=caller.uid,
                nbytes=size,
                detail="create",
            )
        return made

    def make(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        kind: str,
        action: Callable[[int], tuple[T, StatLike | None]],
        *,
        mode: int = 0,
    ) -> T:
        """mkdir, symlink or mknod (`kind`): `action(mode)` makes it (mode: the set-id bits
        stripped) and returns what it made and its lstat (None: the front end keeps its own
        record of what it created); recorded as `write` with the kind."""
        zone = self.check_create(caller, parent, name, kind, mode)
        try:
            made, st = action(stat.S_IFMT(mode) | (stat.S_IMODE(mode) & ~SUID_SGID))
        except BaseException as exc:
            self._refund(zone, 0, 1)
            if isinstance(exc, OSError) and exc.errno in (errno.EEXIST, errno.EADDRINUSE):
                # Only a creation that failed can have met sandboxfs's state or a mount.
                self.find(caller, Op.WRITE, parent, name)
                self.guard.refuse_existing(caller, parent, name, zone)
                if exc.errno == errno.EEXIST:
                    vpath = parent.vpath(name)
                    raise SandboxError(errno.EEXIST, f"{vpath} already exists") from None
            raise
        if st is not None:
            self.guard.created(zone, st)
        self.guard.record(
            Op.WRITE, parent.vpath(name), zone, pid=caller.pid, uid=caller.uid, detail=kind
        )
        return made

    def link(
        self, caller: Caller, node: Node, parent: Node, new_name: bytes, action: Callable[[], T]
    ) -> T:
        """A second name for node at parent/new_name (never onto sandboxfs's state or another
        mount); recorded as `link` from its current path."""
        g = self.guard
        src, dest = node.vpath(), parent.vpath(new_name)
        g.may_link(caller, node, parent, new_name)
        try:
            self.storage.target(parent, new_name)
        except HiddenEntry as exc:
            raise g.hidden_target(
                caller, AuditOp.LINK, src, parent.zone, dest, exc.reason
            ) from None
        self._decide(lambda: Request(AuditOp.LINK, caller, src, node.zone, dest, node))
        result = action()
        g.consent.moved(src, dest, caller.pid, caller.uid)  # the same file, by a new name
        g.did(caller, AuditOp.LINK, node, path=src, dest=dest)
        return result

    # ----- removing and renaming -------------------------------------------------------------

    def check_remove(self, caller: Caller, parent: Node, name: bytes) -> tuple[Zone, StatLike, int]:
        """Checks for deleting parent/name; returns its zone, its lstat and its layer."""
        g = self.guard
        op = Op.DELETE
        zone = g.may_remove_in(caller, parent, name, op)
        found = self.find(caller, Op.DELETE, parent, name)
        if found is None:
            raise SandboxError(errno.ENOENT, f"{parent.vpath(name)} does not exist")
        st, layer = found
        created = self._made_here(zone, st)
        g.may_remove(caller, parent, name, stat.S_ISDIR(st.st_mode), layer, op, created)
        self._decide(lambda: Request(Op.DELETE, caller, parent.vpath(name), zone))
        return zone, st, layer

    def remove(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        action: Callable[[Zone, StatLike, int], None],
        *,
        rmdir: bool | None = None,
    ) -> None:
        """unlink or rmdir (`rmdir`; None: by the entry's type): `action(zone, st, layer)`
        removes it; the quota gets back what it held; recorded as `delete`."""
        zone, st, layer = self.check_remove(caller, parent, name)
        action(zone, st, layer)
        self.guard.removed(zone, st)
        if rmdir is None:
            rmdir = stat.S_ISDIR(st.st_mode)
        self.guard.record(
            Op.DELETE,
            parent.vpath(name),
            zone,
            pid=caller.pid,
            uid=caller.uid,
            detail="rmdir" if rmdir else None,
        )

    def rename(
        self,
        caller: Caller,
        old_parent: Node,
        name_old: bytes,
        new_parent: Node,
        name_new: bytes,
        action: Callable[[Zone, StatLike, int, StatLike | None], None],
        *,
        flags_ok: bool = True,
        exchange: bool = False,
        read: ReadFile | None = None,
    ) -> None:
        """Move old_parent/name_old to new_parent/name_new in one zone (`exchange`: swap the
        two): `action(zone, src_st, src_layer, dst_st)` renames; what it replaced leaves the
        quota; recorded as `rename` src -> dest. `read`: see Guard.may_move."""
        g = self.guard
        src, dst = old_parent.vpath(name_old), new_parent.vpath(name_new)
        zone = g.may_rename_in(caller, old_parent, name_old, new_parent, name_new, flags_ok)
        found = self.find(caller, Op.WRITE, old_parent, name_old)
        if found is None:
            raise SandboxError(errno.ENOENT, f"{src} does not exist")
        src_st, src_layer = found
        g.may_rename_from(caller, old_parent, name_old, src_layer, dst)
        g.may_rename_to(caller, new_parent, name_new)
        try:
            dst_st = self.storage.target(new_parent, name_new)
        except HiddenEntry as exc:  # never onto sandboxfs's state or another mount
            raise g.hidden_target(caller, AuditOp.RENAME, src, zone, dst, exc.reason) from None
        moving = [(old_parent, name_old, src_st, new_parent, name_new)]
        if exchange and dst_st is not None:
            moving.append((new_parent, name_new, dst_st, old_parent, name_old))
        replaces = dst_st is not None and not exchange  # an overwrite too, for approvals
        for parent, name, st, to_parent, to_name in moving:
            g.may_move(
                caller,
                parent,
                name,
                st,
                to_parent,
                to_name,
                src,
                dst,
                read,
                replaces=replaces,
                created=self._made_here(zone, st),
                replaced_created=replaces and self._made_here(zone, dst_st),
            )
        self._decide(lambda: Request(AuditOp.RENAME, caller, src, zone, dst))
        action(zone, src_st, src_layer, dst_st)
        if dst_st is not None and not exchange and dst_st.st_ino != src_st.st_ino:
            g.removed(zone, dst_st)
        # What moved is not what a grant there covered (Consent.moved).
        for moved_from, moved_to in [(src, dst), (dst, src)][: 2 if exchange else 1]:
            g.consent.moved(moved_from, moved_to, caller.pid, caller.uid)
        g.record(AuditOp.RENAME, src, zone, pid=caller.pid, uid=caller.uid, dest=dst)

    # ----- changing attributes ---------------------------------------------------------------

    def setattr(
        self,
        caller: Caller,
        node: Node,
        *,
        size: tuple[Callable[[], int], Callable[[int], None], int] | None = None,
        mode: int | None = None,
        owner: tuple[int, int] | None = None,
        times: bool = False,
        creating: bool = False,
        overwrite_granted: bool = False,
        action: Callable[[int | None], None],
    ) -> None:
        """Change node's size (`size`: the current size, the truncation, the new size; by its
        creating handle only in a create-only zone), mode (set-id bits stripped), owner and/or
        times; `action(mode)` changes the rest; one `write` entry names what changed. A size
        change is an overwrite for the approval rules unless its handle was opened as one
        (`overwrite_granted`)."""
        g = self.guard
        overwrites = size is not None and not overwrite_granted
        g.may_change(
            caller,
            node,
            allow_created=creating or size is None,
            overwrites=overwrites,
            shared=overwrites and self._shared(node),
        )
        self._decide(lambda: Request(Op.WRITE, caller, node.vpath(), node.zone, node=node))
        changes: list[str] = []
        if size is not None:
            current, truncate, new_size = size
            old_size = current()
            g.may_resize(caller, node, old_size, new_size)
            try:
                truncate(new_size)
            except BaseException:
                self._refund(node.zone, new_size - old_size, 0)
                raise
            changes.append(f"size={new_size}")
        if mode is not None:
            mode = stat.S_IMODE(mode) & ~SUID_SGID
            changes.append(f"mode={mode:o}")
        if owner is not None:
            changes.append(f"owner={owner[0]}:{owner[1]}")
        if times:
            changes.append("times")
        action(mode)
        if changes:
            g.did(caller, Op.WRITE, node, detail="setattr " + " ".join(changes))

    # ----- extended attributes ---------------------------------------------------------------

    def getxattr(
        self, caller: Caller, node: Node, name: bytes, action: Callable[[], T]
    ) -> T | None:
        """An extended attribute's value; None when it shows none. sandboxfs has no security.*
        namespace: EOPNOTSUPP at once, without a policy check that would audit a phantom
        denial (the kernel asks for security.capability before writes, `ls -l` for
        security.selinux; EOPNOTSUPP lets ls remember the answer for the whole mount)."""
        if name.startswith(SECURITY_XATTR_PREFIX):
            raise SandboxError(errno.EOPNOTSUPP)
        if not self.guard.xattrs_visible(caller, node):
            return None
        return action()

    def listxattr(
        self, caller: Caller, node: Node, action: Callable[[], list[bytes]]
    ) -> list[bytes]:
        if not self.guard.xattrs_visible(caller, node):
            return []
        return [n for n in action() if not n.startswith(SECURITY_XATTR_PREFIX)]

    def change_xattr(
        self, caller: Caller, node: Node, name: bytes, what: str, action: Callable[[], None]
    ) -> None:
        """setxattr or removexattr (`what`): only user.* and POSIX ACLs."""
        self.guard.may_change_xattr(caller, node, name)
        self._decide(lambda: Request(Op.WRITE, caller, node.vpath(), node.zone, node=node))
        action()
        detail = f"{what} {name.decode('utf-8', 'replace')}"
        self.guard.did(caller, Op.WRITE, node, detail=detail)

    # ----- listing ---------------------------------------------------------------------------

    def check_list(self, caller: Caller, node: Node) -> None:
        g = self.guard
        if node.zone is not None:
            g.check_listing(caller, node)
            self._decide(lambda: Request(Op.LIST, caller, node.vpath(), node.zone, node=node))

    def opendir(self, caller: Caller, node: Node) -> None:
        """Opening a directory to list it (never a deny-listed one, nor one inside); recorded
        at once as `list`."""
        self.check_list(caller, node)
        if node.zone is not None:
            self.guard.did(caller, Op.LIST, node)

    def relist(self, caller: Caller, node: Node) -> None:
        """A directory handle opened under an earlier trust level, read again."""
        if node.zone is not None:
            self.guard.check_list(caller, node)

    def listed(
        self, parent: Node, name: bytes, is_dir: bool, ino: int | None = None, own: bool = False
    ) -> bool:
        """Whether a listing of parent shows name (see Guard.listed)."""
        return self.guard.listed(parent, name, is_dir, ino, own)

    def lists_all(self, parent: Node) -> bool:
        """Whether a listing of parent shows every name it holds (see Guard.lists_all)."""
        return self.guard.lists_all(parent.zone)
