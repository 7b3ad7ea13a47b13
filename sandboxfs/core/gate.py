"""The gate: one method per operation, and in it that operation's rule list, in order.

Both front ends call it and do nothing but translate: the FUSE adapter (sandboxfs.operations:
inode numbers, handles, errno, the kernel's caches) and the Python API (sandboxfs.api.sandbox:
paths, typed errors, tool text). Each operation's method (or its `check_<op>`, which the
operation and a permission probe share) reads as its list:

1. the rules, each a check of the guard's families (sandboxfs.core.guard): the matrix, the
   deny list, private keys, protected paths and git's files, frozen staged commits, zone
   roots, worker layers, the zone's limits;
2. the approval step (`_approve`: the user's consent, asked only once every rule allowed);
3. `_decide`, where a later rule joins every operation (worker narrowing, a test's step);
4. the quota charged, the store touched through the front end's `action` (the backing call,
   as the caller), what a failed or shorter change did not use given back;
5. the audit entry of the allowed operation.

What an operation leaves behind (entries, quota, consent) is the gate's `Effects`
(sandboxfs.core.effects). Every refusal a rule raises is audited by the gate on its way out
(every public method: `_audited`), before the front end sees its errno. A permission probe
(the API's `check_permission`, `stage`'s precheck, the cache warm) is the same gate with
`NoEffects` (`without_effect`): the same lists on the same policy, frozen commits, pinned
directories and own entries, with nothing audited, charged, asked or changed.
"""

from __future__ import annotations

import errno
import inspect
import stat
from collections.abc import Callable

from .approval_rules import Kind
from .errors import SandboxError
from .gate_names import NamesGate
from .gatebase import (
    _ACL_XATTRS,
    _WRITABLE_XATTR_PREFIX,
    SECURITY_XATTR_PREFIX,
    SUID_SGID,
    Request,
    T,
    audited,
)
from .inodes import FIRST_DYNAMIC_INO, ROOT_INO, Node
from .policy import CONTEXT_REASON, ZONE_ROOT_REASON, Decision, Op, Rule, Zone
from .rulebase import Caller


class Gate(NamesGate):
    """Every operation of one mount or sandbox, each with its one list of rules (names:
    sandboxfs.core.gate_names; what they share: sandboxfs.core.gatebase)."""

    # ----- files -----------------------------------------------------------------------------

    def _open_rules(self, caller: Caller, node: Node, read: bool, write: bool) -> None:
        """The rules of opening an existing file to read and/or to write: never a deny-listed
        one, nor (checked last: it reads the file) one that holds a private key."""
        g = self.guard
        assert node.zone is not None
        op = Op.WRITE if write else Op.READ
        g.reject_denied_node(caller, op, node)
        if read and not g.own_readable(node):
            g.check(caller, Op.READ, node)
        if write:
            g.reject_protected_node(caller, Op.WRITE, node)
            g.check(caller, Op.WRITE, node)
            g.check_layer(caller, node, Op.WRITE)
            g.reject_frozen_node(caller, Op.WRITE, node)
        g.check_suffix_node(caller, node, op, "opening")
        g.reject_private_key_node(caller, op, node)

    def _approve_open(
        self, caller: Caller, node: Node, read: bool, write: bool, overwrites: bool
    ) -> None:
        """The approval step of an open: reading, writing, and overwriting (truncating, or
        writing in place, a file this session did not create destroys what it held). A file
        with other names gets no rule's exclusions (a hard link in `build/` to the user's file
        is the user's file)."""
        if not self.effects.asks:
            return
        assert node.zone is not None
        kinds = [Kind.OVERWRITE] if overwrites and not node.created_here else []
        kinds += [Kind.WRITE] if write else []
        kinds += [Kind.READ] if read else []
        shared = write and self._shared(node)
        op = Op.WRITE if write else Op.READ
        self._approve(caller, kinds, node.zone, node.vpath, op, exclusions=not shared)

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
        """Opening an existing file (`in_place`: for writing without O_APPEND)."""
        self._open_rules(caller, node, read, write)
        self._approve_open(caller, node, read, write, truncate or in_place)
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
            self.effects.did(caller, Op.READ, node, comm=comm)
        return result

    def overwrite_in_place(self, caller: Caller, node: Node) -> None:
        """A write below the end of a file through a handle opened with O_APPEND (whose flag
        fcntl cleared since, or a shared mapping's writeback): an overwrite for the approval
        rules, as an open without O_APPEND is."""
        self._open_rules(caller, node, False, True)
        self._approve_open(caller, node, False, True, True)

    def read_open_key(self, caller: Caller, node: Node, fd: int) -> None:
        """Reading through a handle on a file that may hold a private key and changed since
        it was checked (Guard.may_read_open_key)."""
        self.guard.may_read_open_key(caller, node, fd)

    def open_document(self, caller: Caller, node: Node, *, write: bool) -> None:
        """The mount's own documents (/.sandboxfs/context.json and README): read-only at every
        level; reading them is not audited (`sandboxfs status` reads context.json to tell a
        live mount from a dead one)."""
        if write:
            decision = Decision(False, errno.EACCES, CONTEXT_REASON)
            raise self.guard.refuse(caller, Op.WRITE, node.vpath(), None, decision)

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
        """A handle opened under an earlier trust level or approval grant, used again to read
        or to write: that must be allowed now (a handle that created its file keeps it while
        creating is), and the approval grant it was opened under (`grant`) must not have been
        revoked. Nobody is asked again."""
        g = self.guard
        assert node.zone is not None
        op = Op.WRITE if write else Op.READ
        if grant is not None and grant in self.effects.consent.revoked_grants:
            reason = f"{node.vpath()} was opened under approval grant {grant}, since revoked"
            decision = Decision(False, errno.EACCES, reason, Rule.APPROVAL)
            raise g.refuse(caller, op, node.vpath(), node.zone, decision)
        if not created:
            self._open_rules(caller, node, read, write)
            return
        decision = g.policy.decide_create(node.zone)
        if not decision.allowed:
            raise g.refuse(caller, Op.WRITE, node.vpath(), node.zone, decision)
        if write:
            g.reject_frozen_node(caller, Op.WRITE, node)

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
        is under review (the handle may be older than the review: `frozen` runs on that
        refusal, and the front end drops its caches). `size`: the file's size now, where sizes
        matter (max_file_bytes, a quota): the growth is charged first and what was not written
        given back."""
        if node.zone is Zone.STAGED:
            try:
                self.guard.reject_frozen_node(caller, Op.WRITE, node)
            except SandboxError:
                if frozen is not None:
                    frozen()
                raise
        if size is None:
            return action()
        old_size = size()
        new_size = max(old_size, off + length)
        self._resize(caller, node, old_size, new_size)
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
            self.effects.did(caller, Op.WRITE, node, comm=comm, nbytes=nbytes, detail=detail)

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
        expected = -1

        def before(old: int) -> None:
            nonlocal expected
            new = old + length if append else length
            if append or old == 0:
                self._resize(caller, node, old, new)
            else:
                self._resize(caller, node, old, 0)
                try:
                    self._resize(caller, node, 0, new)
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
        self.effects.did(caller, Op.WRITE, node, nbytes=length)

    def readlink(self, caller: Caller, node: Node, action: Callable[[], T]) -> T:
        """A symbolic link's target is its contents: refused for a deny-listed link."""
        g = self.guard
        if node.zone is None:
            raise SandboxError(errno.EINVAL)
        if not g.own_readable(node):
            g.check(caller, Op.READ, node)
        g.reject_denied_node(caller, Op.READ, node)
        self._decide(lambda: Request(Op.READ, caller, node.vpath(), node.zone, node=node))
        return action()

    # ----- changing attributes ---------------------------------------------------------------

    def _check_change(
        self,
        caller: Caller,
        node: Node,
        allow_created: bool = True,
        *,
        overwrites: bool = False,
    ) -> None:
        """The rules of writing to an existing entry (setattr, xattrs): never to `/`, a zone
        root or /.sandboxfs. In a create-only zone, entries this mount created may still get
        their mode, times and xattrs set (tar and cp -p do that after writing), but only their
        creating handle may change their size. `overwrites`: a size change (truncate(2),
        ftruncate) not covered by how its handle was opened, an overwrite for the approval
        step too."""
        g = self.guard
        if node.ino < FIRST_DYNAMIC_INO:
            reason = (
                CONTEXT_REASON if node.zone is None and node.ino != ROOT_INO else ZONE_ROOT_REASON
            )
            raise g.refuse(
                caller, Op.WRITE, node.vpath(), node.zone, Decision(False, errno.EACCES, reason)
            )
        assert node.zone is not None
        g.reject_denied_node(caller, Op.WRITE, node)
        g.reject_protected_node(caller, Op.WRITE, node)
        g.reject_frozen_node(caller, Op.WRITE, node)
        if not (allow_created and node.created_here and g.policy.access(node.zone).create_only):
            g.check(caller, Op.WRITE, node)
            g.check_layer(caller, node, Op.WRITE)
        g.reject_private_key_node(caller, Op.WRITE, node)
        if not node.created_here and self.effects.asks:  # approvals: truncate, chmod, xattr
            kinds = [Kind.OVERWRITE, Kind.WRITE] if overwrites else [Kind.WRITE]
            shared = overwrites and self._shared(node)
            self._approve(caller, kinds, node.zone, node.vpath, Op.WRITE, exclusions=not shared)

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
        overwrites = size is not None and not overwrite_granted
        self._check_change(
            caller, node, allow_created=creating or size is None, overwrites=overwrites
        )
        self._decide(lambda: Request(Op.WRITE, caller, node.vpath(), node.zone, node=node))
        changes: list[str] = []
        if size is not None:
            current, truncate, new_size = size
            old_size = current()
            self._resize(caller, node, old_size, new_size)
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
            self.effects.did(caller, Op.WRITE, node, detail="setattr " + " ".join(changes))

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
        self._check_change(caller, node)
        if not name.startswith(_WRITABLE_XATTR_PREFIX) and name not in _ACL_XATTRS:
            reason = (
                "only user.* extended attributes and POSIX ACLs can be set or removed "
                "through sandboxfs"
            )
            decision = Decision(False, errno.EPERM, reason)
            raise self.guard.refuse(caller, Op.WRITE, node.vpath(), node.zone, decision)
        self._decide(lambda: Request(Op.WRITE, caller, node.vpath(), node.zone, node=node))
        action()
        detail = f"{what} {name.decode('utf-8', 'replace')}"
        self.effects.did(caller, Op.WRITE, node, detail=detail)

    # ----- listing ---------------------------------------------------------------------------

    def _list_rules(self, caller: Caller, node: Node) -> None:
        """Listing a zone's directory: the matrix (or a directory this mount created, at a
        create-only level), then never a deny-listed directory, nor one inside."""
        g = self.guard
        g.check_list(caller, node)
        g.reject_denied_node(caller, Op.LIST, node)

    def check_list(self, caller: Caller, node: Node) -> None:
        if node.zone is not None:
            self._list_rules(caller, node)
            self._decide(lambda: Request(Op.LIST, caller, node.vpath(), node.zone, node=node))

    def opendir(self, caller: Caller, node: Node) -> None:
        """Opening a directory to list it; recorded at once as `list`."""
        self.check_list(caller, node)
        if node.zone is not None:
            self.effects.did(caller, Op.LIST, node)

    def relist(self, caller: Caller, node: Node) -> None:
        """A directory handle opened under an earlier trust level, read again."""
        if node.zone is not None:
            self._list_rules(caller, node)

    def listed(
        self, parent: Node, name: bytes, is_dir: bool, ino: int | None = None, own: bool = False
    ) -> bool:
        """Whether a listing of parent shows name (see Guard.listed)."""
        return self.guard.listed(parent, name, is_dir, ino, own)

    def lists_all(self, parent: Node) -> bool:
        """Whether a listing of parent shows every name it holds (see Guard.lists_all)."""
        return self.guard.lists_all(parent.zone)


# Every public operation audits the refusals its rules raise as they leave the gate.
for _name, _method in inspect.getmembers(Gate, inspect.isfunction):
    if not _name.startswith("_") and not getattr(_method, "audits_refusals", False):
        setattr(Gate, _name, audited(_method))
del _name, _method
