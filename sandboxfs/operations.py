"""The pyfuse3 adapter: each callback maps onto a policy operation (SPEC §4), the store, and
an audit entry.

Handlers do their work synchronously between awaits, so the inode table never changes under
a running callback. One guard (`_guarded`) turns `SandboxError` and `OSError` into
`FUSEError`, and anything unexpected into a logged, audited `EIO`: only `FUSEError` may leave
a handler, or pyfuse3 takes the whole mount down.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar

import pyfuse3

from .audit import AuditLog
from .errors import SandboxError
from .policy import (
    CONTEXT_REASON,
    ROOT_CREATE_REASON,
    ZONE_ROOT_REASON,
    Decision,
    Op,
    Policy,
    Zone,
    cross_zone_reason,
)
from .store import (
    CONTEXT_INO,
    CONTEXT_NAME,
    CONTROL_INO,
    CONTROL_NAME,
    FIRST_DYNAMIC_INO,
    ROOT_INO,
    HiddenEntry,
    Listed,
    Node,
    StatLike,
    Store,
)
from .syscalls import Stat, fstat, renameat2, set_fs_ids

log = logging.getLogger(__name__)

_SUID_SGID = stat.S_ISUID | stat.S_ISGID
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Files up to this size are handed to the kernel's page cache whole after a write that left
# pages partly written (see _release); larger ones are re-read by the next reader instead.
_KERNEL_STORE_LIMIT = 256 << 10
# At most this many attribute replies are kept for listings to repeat (see _replayed).
_GIVEN_LIMIT = 1 << 16
_OPEN_STRIP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_DIRECT
_ZONE_NAMES = {zone.value.encode(): zone for zone in Zone}
_WRITABLE_XATTR_PREFIX = b"user."
_ACL_XATTRS = (b"system.posix_acl_access", b"system.posix_acl_default")
_SECURITY_XATTR_PREFIX = b"security."

# Callbacks that write an audit entry when they succeed: refused while the log is failing.
_AUDITED_CALLBACKS = frozenset(
    {
        "open",
        "opendir",
        "create",
        "mkdir",
        "symlink",
        "mknod",
        "link",
        "unlink",
        "rmdir",
        "rename",
        "setattr",
        "setxattr",
        "removexattr",
    }
)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class MountInfo:
    """Who this mount is for; copied into every audit entry and into context.json."""

    session: str
    workspace: str
    project: str
    mountpoint: str
    command: tuple[str, ...] | None = None  # what `sandboxfs run` started on this mount


@dataclass(slots=True)
class FileHandle:
    fd: int
    node: Node
    writable: bool
    created: bool
    pid: int
    uid: int
    gid: int
    comm: str | None
    bytes_written: int = 0
    # A write began inside a page: the kernel then holds pages only partly written through
    # this handle, which it never marks up to date and later reads back one page per request.
    partial_pages: bool = False
    # A write ended inside a page (a file's tail): one page the kernel will read back.
    ragged_end: bool = False


@dataclass(slots=True)
class DirHandle:
    node: Node
    entries: list[Listed] | None = None


@dataclass(slots=True)
class BlobHandle:
    data: bytes


def _guarded(
    fn: Callable[Concatenate[SandboxOperations, P], R],
) -> Callable[Concatenate[SandboxOperations, P], Awaitable[R]]:
    """Run a synchronous handler as the async callback pyfuse3 expects, mapping every error."""

    audited = fn.__name__ in _AUDITED_CALLBACKS

    async def wrapper(self: SandboxOperations, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if audited and self.audit.failing and not self.audit.try_flush():
            # Fail closed: nothing that would be audited happens while the log cannot be
            # written (its refusals wait in memory; see AuditLog.failing).
            raise pyfuse3.FUSEError(errno.ENOSPC)
        try:
            return fn(self, *args, **kwargs)
        except SandboxError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            log.exception("internal error in %s", fn.__name__)
            self.audit_internal_error(fn.__name__, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class SandboxOperations(pyfuse3.Operations):  # type: ignore[misc]
    """Translate FUSE callbacks into policy checks, store operations and audit entries."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    # The kernel caches and enforces POSIX ACLs itself (with default_permissions) instead of
    # asking the daemon for them on every `ls -l`; the ACLs live on the backing files.
    enable_acl = True

    def __init__(
        self,
        store: Store,
        policy: Policy,
        audit: AuditLog,
        info: MountInfo,
        *,
        entry_timeout: float,
        attr_timeout: float,
        context_json: bytes,
    ) -> None:
        super().__init__()
        self.store = store
        self.policy = policy
        self.audit = audit
        self.info = info
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.context_json = context_json
        self.running_as_root = os.geteuid() == 0
        session_root = os.stat(store.zone_roots[Zone.SESSION].fd)
        self.owner = (session_root.st_uid, session_root.st_gid)
        self.mounted_ns = time.time_ns()
        self._handles: dict[int, FileHandle | BlobHandle] = {}
        self._dirs: dict[int, DirHandle] = {}
        self._next_fh = 1
        self.process_names = ProcessNames()
        # pyfuse3.notify_store once the mount is up: (inode, offset, data) into the page cache.
        self.kernel_store: Callable[[int, int, bytes], None] | None = None
        # inode -> (monotonic time until which the kernel may use them, attributes): the last
        # attributes given to the kernel for each inode, which a listing may repeat.
        self._given: dict[int, tuple[float, pyfuse3.EntryAttributes]] = {}
        self._base_entry = {
            "session": info.session,
            "workspace": info.workspace,
            "trust": policy.trust.value,
        }

    # ----- auditing -------------------------------------------------------------------------------

    def record(
        self,
        op: str,
        path: str | None,
        zone: Zone | None,
        *,
        pid: int,
        uid: int,
        comm: str | None = None,
        allowed: bool | None = True,
        reason: str | None = None,
        err: int | None = None,
        dest: str | None = None,
        nbytes: int | None = None,
        detail: str | None = None,
    ) -> None:
        entry: dict[str, Any] = {
            "op": op,
            "path": path,
            "dest": dest,
            "zone": zone.value if zone else None,
            **self._base_entry,
            "allowed": allowed,
            "reason": reason,
            "errno": errno.errorcode.get(err, str(err)) if err else None,
            "pid": pid,
            "uid": uid,
            "comm": comm if comm is not None else self.process_names.get(pid),
            "bytes": nbytes,
        }
        if detail is not None:
            entry["detail"] = detail
        self.audit.record(entry)

    def refuse(
        self,
        ctx: Any,
        op: str,
        path: str,
        zone: Zone | None,
        decision: Decision,
        dest: str | None = None,
    ) -> SandboxError:
        """Audit a denial (the entry is written before this returns) and build its error."""
        self.record(
            op,
            path,
            zone,
            pid=ctx.pid,
            uid=ctx.uid,
            allowed=False,
            reason=decision.reason,
            err=decision.errno,
            dest=dest,
        )
        return SandboxError(decision.errno, decision.reason)

    def check(self, ctx: Any, op: Op, node: Node, child: bytes | None = None) -> None:
        assert node.zone is not None
        decision = self.policy.decide(node.zone, op)
        if not decision.allowed:
            raise self.refuse(ctx, op.value, node.vpath(child), node.zone, decision)

    def audit_internal_error(self, callback: str, exc: BaseException) -> None:
        self.record(
            "error",
            None,
            None,
            pid=0,
            uid=0,
            allowed=False,
            reason=f"internal error in {callback}: {type(exc).__name__}: {exc}",
            err=errno.EIO,
        )

    # ----- attributes -----------------------------------------------------------------------------

    def attrs(self, node: Node, st: StatLike) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.ino
        entry.generation = 0
        entry.entry_timeout = self.entry_timeout
        entry.attr_timeout = self.attr_timeout
        entry.st_mode = st.st_mode
        entry.st_nlink = st.st_nlink
        entry.st_uid = st.st_uid
        entry.st_gid = st.st_gid
        entry.st_rdev = st.st_rdev
        entry.st_size = st.st_size
        entry.st_blksize = st.st_blksize
        entry.st_blocks = st.st_blocks
        entry.st_atime_ns = st.st_atime_ns
        entry.st_mtime_ns = st.st_mtime_ns
        entry.st_ctime_ns = st.st_ctime_ns
        if node.ino >= FIRST_DYNAMIC_INO:
            given = self._given
            if len(given) >= _GIVEN_LIMIT:
                given.clear()
            given[node.ino] = (time.monotonic() + self.attr_timeout, entry)
        return entry

    def _changing(self, *nodes: Node | None) -> None:
        """Forget the attributes last given for nodes about to change through the mount (or
        whose atime the kernel stops trusting), so that no listing repeats them."""
        given = self._given
        for node in nodes:
            if node is not None:
                given.pop(node.ino, None)

    def _replayed(
        self, parent: Node, name: bytes, ino: int, is_dir: bool, now: float
    ) -> pyfuse3.EntryAttributes | None:
        """The attributes last given to the kernel for the inode listed as parent/name, if
        the kernel may still use them and nothing changed them through the mount since.

        READDIRPLUS needs attributes for every entry; a `git status` lists every directory of
        a tree whose attributes the kernel holds anyway. Repeating them, with only the
        validity they have left, tells the kernel nothing it does not already know, and saves
        an lstat and a reply build per entry. Only for an inode already known under exactly
        this name whose backing inode number the directory still lists; anything else is
        stat'ed.
        """
        assert parent.zone is not None and parent.key is not None
        node = self.store.by_key.get((parent.zone, parent.key[1], ino))
        if node is None or node.is_dir != is_dir:
            return None
        if not (node.parent is parent and node.name == name) and (parent, name) not in node.links:
            return None
        given = self._given.get(node.ino)
        if given is None:
            return None
        until, entry = given
        left = until - now
        if left <= 0:
            return None
        entry.attr_timeout = left
        entry.entry_timeout = self.entry_timeout
        node.lookups += 1
        return entry

    def virtual_attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        """Attributes of `/`, the zone roots and `/.sandboxfs`: modes that let requests reach
        the daemon, so every refusal is decided and audited here rather than by the kernel."""
        if node.zone is not None and node.key is not None and self._readable(node.zone):
            st = self.store.stat_node(node)
            entry = self.attrs(node, st)
            entry.st_mode = stat.S_IFDIR | 0o755
            return entry
        # `/`, /.sandboxfs, and a zone root the level cannot read or list: it looks like an
        # empty directory made at mount time, so its size, times, owner and link count (which
        # counts hidden subdirectories) say nothing about what it holds.
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.ino
        entry.entry_timeout = self.entry_timeout
        entry.attr_timeout = self.attr_timeout
        entry.st_uid, entry.st_gid = self.owner
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = self.mounted_ns
        if node.ino == CONTEXT_INO:
            entry.st_mode = stat.S_IFREG | 0o644  # writes reach the daemon: refused, audited
            entry.st_nlink = 1
            entry.st_size = len(self.context_json)
        else:
            entry.st_mode = stat.S_IFDIR | 0o755
            entry.st_nlink = 2
        entry.st_blksize = 4096
        return entry

    def _readable(self, zone: Zone) -> bool:
        ops = self.policy.access(zone).ops
        return Op.READ in ops or Op.LIST in ops

    @contextlib.contextmanager
    def _as_caller(self, uid: int, gid: int) -> Iterator[None]:
        """Make backing calls with the caller's filesystem identity, so the kernel charges
        their blocks and inodes to the caller (disk quotas, ext4's reserve for root) rather
        than to a root daemon. The daemon keeps its own identity for everything else."""
        if not self.running_as_root or (uid == 0 and gid == 0):
            yield
            return
        set_fs_ids(uid, gid)
        try:
            yield
        finally:
            set_fs_ids(0, 0)

    def node_attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        if node.ino < FIRST_DYNAMIC_INO:
            return self.virtual_attrs(node)
        return self.attrs(node, self.store.stat_node(node))

    # ----- lookup and attributes ------------------------------------------------------------------

    @_guarded
    def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)
        if name == b".":
            node = parent
        elif name == b"..":
            node = parent.parent or parent
        elif parent.ino == ROOT_INO:
            node = self._lookup_root(name)
        elif parent.ino == CONTROL_INO:
            if name != CONTEXT_NAME:
                raise SandboxError(errno.ENOENT)
            node = self.store.context
        else:
            return self._lookup_zone(parent, name, ctx)
        node.lookups += 1
        return self.node_attrs(node)

    def _lookup_root(self, name: bytes) -> Node:
        if name == CONTROL_NAME:
            return self.store.control
        zone = _ZONE_NAMES.get(name)
        if zone is None:
            raise SandboxError(errno.ENOENT)
        return self.store.zone_roots[zone]

    def _lookup_zone(self, parent: Node, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        """LOOKUP answers "absent" for every name this level may not know about: deny-listed
        names, sandboxfs's own state, other mounts, everything in a zone the level cannot
        access, and existing files of a create-only zone that this mount did not create. The
        answer is the same whether the name exists or not, so it tells the caller nothing;
        when the name exists the refusal is audited as `read` (the caller was reaching for
        it). A CREATE, MKDIR, SYMLINK, MKNOD or LINK that follows a refused lookup reaches
        its own callback and is refused and audited there as `write`.
        """
        zone = parent.zone
        assert zone is not None
        vpath = parent.vpath(name)
        found = self._find(ctx, Op.READ, parent, name)
        st, layer = found if found is not None else (None, 0)
        if not self.policy.access(zone).any:
            if st is None:
                return self._negative_entry()
            decision = self.policy.decide(zone, Op.READ)
            raise self.refuse(ctx, Op.READ.value, vpath, zone, _absent(decision))
        is_dir = st is None or stat.S_ISDIR(st.st_mode)
        pattern = self._denied_pattern(parent, name, is_dir)
        if pattern is not None:
            if st is None:
                return self._negative_entry()
            decision = self.policy.deny_list_decision(vpath, pattern, errno.ENOENT)
            raise self.refuse(ctx, Op.READ.value, vpath, zone, decision)
        if st is None:
            return self._negative_entry()
        key = (zone, st.st_dev, st.st_ino)
        known = self.store.by_key.get(key)
        created_here = (
            known is not None
            and known.created_here
            and (not known.birth_ns or known.birth_ns == st.st_birthtime_ns)
        )
        decision = self.policy.decide_lookup(zone, stat.S_ISDIR(st.st_mode), created_here)
        if not decision.allowed:
            raise self.refuse(ctx, Op.READ.value, vpath, zone, _absent(decision))
        node = self.store.remember(parent, name, st, layer)
        return self.attrs(node, st)

    def _find(self, ctx: Any, op: Op, parent: Node, name: bytes) -> tuple[Stat, int] | None:
        """store.find, with an entry that is never part of a zone (sandboxfs's state, another
        mount) refused as absent and audited as `op`."""
        try:
            return self.store.find(parent, name)
        except HiddenEntry as exc:
            err = errno.ENOENT if op is Op.READ else errno.EACCES
            reason = f"{parent.vpath(name)}: {exc.reason}"
            decision = Decision(False, err, reason)
            raise self.refuse(ctx, op.value, parent.vpath(name), parent.zone, decision) from None

    def _negative_entry(self) -> pyfuse3.EntryAttributes:
        # st_ino 0 lets the kernel cache "does not exist" for entry_timeout.
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = 0
        entry.entry_timeout = self.entry_timeout
        return entry

    def _denied_pattern(self, parent: Node, name: bytes, is_dir: bool) -> str | None:
        """The deny pattern that parent/name matches (with its type as given), if any."""
        text = name.decode("utf-8", "surrogateescape")
        relpath = ""
        if self.policy.has_path_patterns:
            relpath = _relpath(parent, name)
        return self.policy.denied_name(text, relpath, is_dir)

    def _reject_denied_name(
        self, ctx: Any, parent: Node, name: bytes, is_dir: bool, op: Op | str
    ) -> None:
        pattern = self._denied_pattern(parent, name, is_dir)
        if pattern is not None:
            vpath = parent.vpath(name)
            decision = self.policy.deny_list_decision(vpath, pattern)
            raise self.refuse(ctx, str(op), vpath, parent.zone, decision)

    def _reject_protected(
        self,
        ctx: Any,
        op: Op | str,
        parent: Node,
        name: bytes,
        is_dir: bool,
        dest: str | None = None,
    ) -> None:
        """Protected paths (and everything inside a protected directory) are never changed."""
        if parent.zone is None or not self._may_protect(parent):
            return
        pattern = self.policy.protect.match_within(_relpath(parent, name), is_dir)
        if pattern is not None:
            vpath = parent.vpath(name)
            decision = self.policy.protect_decision(vpath, pattern)
            raise self.refuse(ctx, str(op), vpath, parent.zone, decision, dest=dest)

    def _may_protect(self, directory: Node) -> bool:
        """Whether a protect pattern could match inside `directory`, remembered on the node
        until any known path changes (Store.moves)."""
        moves, may = directory.protect_memo
        if moves != self.store.moves:
            rel = directory.relpath().decode("utf-8", "surrogateescape")
            may = self.policy.protect.may_match_under(rel)
            directory.protect_memo = (self.store.moves, may)
        return may

    def _reject_protected_node(self, ctx: Any, op: Op | str, node: Node) -> None:
        if node.parent is not None and node.zone is not None:
            self._reject_protected(ctx, op, node.parent, node.name, node.is_dir)

    @_guarded
    def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self.node_attrs(self.store.get(inode))

    @_guarded
    def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self.store.get(inode)
        handle = self._handles.get(fh) if fh is not None else None
        creating = isinstance(handle, FileHandle) and handle.created
        self._check_change(ctx, node, allow_created=creating or not fields.update_size)
        self._changing(node)
        fd = handle.fd if isinstance(handle, FileHandle) else None
        changes: list[str] = []
        target, how = self._meta_target(node)
        if fields.update_size:
            writable = handle is not None and handle.writable  # type: ignore[union-attr]
            wfd = fd if fd is not None and writable else self._reopen(node, os.O_WRONLY)
            try:
                with self._as_caller(ctx.uid, ctx.gid):  # growing a file allocates blocks
                    os.truncate(wfd, attr.st_size)
            finally:
                if wfd != fd:
                    os.close(wfd)
            changes.append(f"size={attr.st_size}")
        if fields.update_mode:
            mode = stat.S_IMODE(attr.st_mode) & ~_SUID_SGID
            os.chmod(target, mode, **how)
            changes.append(f"mode={mode:o}")
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            os.chown(target, uid, gid, **how)
            changes.append(f"owner={uid}:{gid}")
        # A new mtime alone leaves the kernel's cached pages valid (`tar` sets it after
        # writing): carry the cache stamp over, if it held up to now.
        keeps_cache = False
        if fields.update_atime or fields.update_mtime:
            if node.cache_stamp is None or fields.update_size:
                current = None
            else:
                current = self.store.stat_node(node)
                keeps_cache = node.cache_stamp == (current.st_mtime_ns, current.st_size)
            if fields.update_atime and fields.update_mtime:
                atime, mtime = attr.st_atime_ns, attr.st_mtime_ns
            else:  # os.utime has no UTIME_OMIT: keep the other time as it is
                current = current or self.store.stat_node(node)
                atime = attr.st_atime_ns if fields.update_atime else current.st_atime_ns
                mtime = attr.st_mtime_ns if fields.update_mtime else current.st_mtime_ns
            os.utime(target, ns=(atime, mtime), **how)
            changes.append("times")
        if changes:
            self.record(
                Op.WRITE.value,
                node.vpath(),
                node.zone,
                pid=ctx.pid,
                uid=ctx.uid,
                detail="setattr " + " ".join(changes),
            )
        attrs = self.node_attrs(node)
        if keeps_cache:
            node.cache_stamp = (attrs.st_mtime_ns, attrs.st_size)
        return attrs

    def _meta_target(self, node: Node) -> tuple[int | bytes, dict[str, Any]]:
        """What to pass to os.chmod/chown/utime for node: an open descriptor when there is
        one (it still works after the name was unlinked or replaced), else parent + name."""
        if node.open_fds:
            return node.open_fds[-1], {}
        parent_fd = self.store.parent_fd(node, checked=True)
        self.store.stat_node(node)  # the name must still be node's (ESTALE otherwise)
        return node.name, {"dir_fd": parent_fd, "follow_symlinks": False}

    def _reopen(self, node: Node, flags: int) -> int:
        """A new descriptor of node's file, through an open one if there is one."""
        if node.open_fds:
            return os.open(f"/proc/self/fd/{node.open_fds[-1]}", flags | os.O_CLOEXEC)
        return self.store.open_file(node, flags)

    def _check_change(self, ctx: Any, node: Node, allow_created: bool = True) -> None:
        """Writes to an existing entry: never to `/`, a zone root or /.sandboxfs.

        In a create-only zone, entries this mount created may still get their mode, times and
        xattrs set (tar and cp -p do that after writing), but only their creating handle may
        change their size.
        """
        if node.ino < FIRST_DYNAMIC_INO:
            reason = (
                CONTEXT_REASON if node.zone is None and node.ino != ROOT_INO else ZONE_ROOT_REASON
            )
            raise self.refuse(
                ctx, Op.WRITE.value, node.vpath(), node.zone, Decision(False, errno.EACCES, reason)
            )
        assert node.zone is not None
        self._reject_protected_node(ctx, Op.WRITE, node)
        if allow_created and node.created_here and self.policy.access(node.zone).create_only:
            return
        self.check(ctx, Op.WRITE, node)
        self._check_layer(ctx, node, Op.WRITE)

    def _link_decision(self, node: Node) -> Decision:
        """A second name for an existing file changes it (its link count, and every later
        write through either name): write access, which create-only does not give."""
        assert node.zone is not None
        return self.policy.decide(node.zone, Op.WRITE)

    def _check_layer(self, ctx: Any, node: Node, op: Op | str, child: bytes | None = None) -> None:
        """Only the first workers directory (<project>/.workers) can be changed."""
        if node.zone is Zone.WORKERS and node.layer > 0:
            reason = (
                f"{node.vpath(child)} comes from SANDBOXFS_WORKERS_PATH, which is read-only; "
                f"only <project>/.workers can be changed"
            )
            raise self.refuse(
                ctx, str(op), node.vpath(child), node.zone, Decision(False, errno.EROFS, reason)
            )

    @_guarded
    def readlink(self, inode: int, ctx: Any) -> bytes:
        node = self.store.get(inode)
        if node.zone is None:
            raise SandboxError(errno.EINVAL)
        self.check(ctx, Op.READ, node)
        self._changing(node)  # the kernel stops trusting a read link's atime
        return os.readlink(node.name, dir_fd=self.store.parent_fd(node))

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """Drop what the kernel no longer references. Synchronous on purpose: pyfuse3 awaits
        only a returned coroutine, and FORGET gets no reply, so there is no errno to map."""
        for inode, count in inode_list:
            try:
                self.store.forget(inode, count)
                if inode not in self.store.nodes:
                    self._given.pop(inode, None)
            except Exception:
                log.exception("internal error in forget")

    # ----- directories ----------------------------------------------------------------------------

    @_guarded
    def opendir(self, inode: int, ctx: Any) -> int:
        node = self.store.get(inode)
        if not node.is_dir:
            raise SandboxError(errno.ENOTDIR)
        if node.zone is not None:
            self.check(ctx, Op.LIST, node)
            self.record(Op.LIST.value, node.vpath(), node.zone, pid=ctx.pid, uid=ctx.uid)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = DirHandle(node)
        return fh

    @_guarded
    def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._dirs[fh]
        node = handle.node
        if handle.entries is None or start_id == 0:
            handle.entries = self._dir_entries(node)
            self._changing(node)  # the kernel stops trusting a listed directory's atime
        entries = handle.entries
        replay = node.key is not None and not (
            node.zone is Zone.WORKERS and node.parent is self.store.root
        )
        now = time.monotonic()
        layer_fds: dict[int, int] = {}  # where each layer's names live, looked up once
        for index in range(start_id, len(entries)):
            name, layer, ino, is_dir = entries[index]
            if name == b".":
                attrs = _dot_attrs(node)
            elif name == b"..":
                attrs = _dot_attrs(node.parent or node)
            elif node.zone is None:
                child = self._virtual_child(node, name)
                attrs = self.node_attrs(child)
                if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                    return
                child.lookups += 1
                continue
            else:
                replayed = self._replayed(node, name, ino, is_dir, now) if replay else None
                if replayed is not None:
                    if not pyfuse3.readdir_reply(token, name, replayed, index + 1):
                        self.store.get(replayed.st_ino).lookups -= 1
                        return
                    continue
                try:
                    fd = layer_fds.get(layer)
                    if fd is None:
                        fd = layer_fds[layer] = self.store.child_dir_fd(node, layer)
                    st = self._entry_stat(node, name, fd, is_dir)
                except PermissionError:
                    if not pyfuse3.readdir_reply(token, name, self._opaque_attrs(), index + 1):
                        return
                    continue
                if st is None:
                    continue
                child = self.store.remember(node, name, st, layer)
                attrs = self.attrs(child, st)
                if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                    child.lookups -= 1
                    return
                continue
            if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                return

    def _denied_entry(self, node: Node, name: bytes, is_dir: bool) -> bool:
        """Whether the deny list hides a listed entry (its type as the directory gives it)."""
        text = name.decode("utf-8", "surrogateescape")
        relpath = ""
        if self.policy.has_path_patterns:
            rel = node.relpath()
            relpath = (rel + b"/" + name if rel else name).decode("utf-8", "surrogateescape")
        return self.policy.denied_name(text, relpath, is_dir) is not None

    def _entry_stat(
        self, node: Node, name: bytes, dir_fd: int, listed_as_dir: bool
    ) -> StatLike | None:
        """lstat of a listed entry, or None if it vanished or turned into a deny-listed
        directory since the listing (which checked it with the type it had then).

        PermissionError means the daemon cannot search the directory (no x bit): the caller
        lists the name without attributes, as getdents does natively.
        """
        try:
            st = self.store.lstat(dir_fd, name)
        except HiddenEntry:  # became a mount root since the listing
            return None
        if st is None:
            return None
        if stat.S_ISDIR(st.st_mode) and not listed_as_dir and self._denied_entry(node, name, True):
            return None
        return st

    def _opaque_attrs(self) -> pyfuse3.EntryAttributes:
        """A listing entry without attributes: an inode number nothing else has and no file
        type, which the kernel shows by name and then forgets; a later stat asks lookup."""
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = self.store.spare_ino()
        return entry

    def _dir_entries(self, node: Node) -> list[Listed]:
        dots: list[Listed] = [(b".", 0, 0, True), (b"..", 0, 0, True)]
        if node.ino == ROOT_INO:
            zones: list[Listed] = [(zone.value.encode(), 0, 0, True) for zone in Zone]
            return dots + zones + [(CONTROL_NAME, 0, 0, True)]
        if node.ino == CONTROL_INO:
            return [*dots, (CONTEXT_NAME, 0, 0, False)]
        # Deny-listed names are dropped here, before offsets are given, so that the offsets
        # do not jump where a hidden name was and reveal how many sort before a visible one.
        return dots + [
            entry
            for entry in self.store.list_entries(node)
            if not self._denied_entry(node, entry[0], entry[3])
        ]

    def _virtual_child(self, node: Node, name: bytes) -> Node:
        if node.ino == ROOT_INO:
            return self._lookup_root(name)
        return self.store.context

    @_guarded
    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_guarded
    def fsyncdir(self, fh: int, datasync: bool) -> None:
        node = self._dirs[fh].node
        if node.zone is not None and node.key is not None:
            fd = os.open(
                ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.store.dir_fd(node)
            )
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # ----- files ----------------------------------------------------------------------------------

    @_guarded
    def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self.store.get(inode)
        accmode = flags & os.O_ACCMODE
        wants_write = accmode != os.O_RDONLY or bool(flags & os.O_TRUNC)
        if node.ino == CONTEXT_INO:
            if wants_write:
                raise self.refuse(
                    ctx,
                    Op.WRITE.value,
                    node.vpath(),
                    None,
                    Decision(False, errno.EACCES, CONTEXT_REASON),
                )
            # Not audited: the mount's public description, which `sandboxfs status` and
            # `mount` read to tell a live mount from a dead one.
            return self._new_handle(BlobHandle(self.context_json), keep_cache=False)
        if node.zone is None or node.is_dir:
            raise SandboxError(errno.EISDIR)
        if accmode != os.O_WRONLY:
            self.check(ctx, Op.READ, node)
        if wants_write:
            self._reject_protected_node(ctx, Op.WRITE, node)
            self.check(ctx, Op.WRITE, node)
            self._check_layer(ctx, node, Op.WRITE)
        if flags & os.O_TRUNC:
            self._changing(node)
        fd = self.store.open_file(node, flags & ~_OPEN_STRIP)
        st = os.stat(fd)
        stamp = (st.st_mtime_ns, st.st_size)
        keep_cache = node.cache_stamp == stamp and not flags & os.O_TRUNC
        node.cache_stamp = stamp
        comm = self.process_names.get(ctx.pid)
        if not wants_write:
            self.record(Op.READ.value, node.vpath(), node.zone, pid=ctx.pid, uid=ctx.uid, comm=comm)
        handle = FileHandle(fd, node, wants_write, False, ctx.pid, ctx.uid, ctx.gid, comm)
        node.open_fds = (*node.open_fds, fd)
        return self._new_handle(handle, keep_cache=keep_cache, direct_io=bool(flags & os.O_DIRECT))

    def _new_handle(
        self, handle: FileHandle | BlobHandle, keep_cache: bool, direct_io: bool = False
    ) -> pyfuse3.FileInfo:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=direct_io)

    @_guarded
    def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handles[fh]
        if isinstance(handle, BlobHandle):
            return handle.data[off : off + size]
        self._changing(handle.node)  # the kernel stops trusting a read file's atime
        return os.pread(handle.fd, size, off)

    @_guarded
    def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handles[fh]
        if not isinstance(handle, FileHandle) or not handle.writable:
            raise SandboxError(errno.EBADF)
        self._changing(handle.node)
        with self._as_caller(handle.uid, handle.gid):
            written = os.pwrite(handle.fd, buf, off)
        handle.bytes_written += written
        if off % _PAGE_SIZE:
            handle.partial_pages = True
        elif (off + written) % _PAGE_SIZE:
            handle.ragged_end = True
        return written

    async def flush(self, fh: int) -> None:
        """Writes go straight to the backing file, so there is nothing to flush.

        ENOSYS makes the kernel stop sending FLUSH at all, saving a round trip per close().
        """
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_guarded
    def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handles[fh]
        if isinstance(handle, FileHandle):
            (os.fdatasync if datasync else os.fsync)(handle.fd)

    @_guarded
    def release(self, fh: int) -> None:
        self._release(fh)

    def release_all(self) -> None:
        """Close what is still open when the mount stops, auditing writes as release would."""
        for fh in list(self._handles):
            try:
                self._release(fh)
            except OSError as exc:
                log.warning("closing handle %d on unmount: %s", fh, exc.strerror)
        self.process_names.close()

    def _release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if not isinstance(handle, FileHandle):
            return
        node = handle.node
        try:
            node.open_fds = tuple(fd for fd in node.open_fds if fd != handle.fd)
            stored = None
            if handle.partial_pages or handle.ragged_end:
                stored = self._complete_kernel_copy(node, handle.fd)
            if stored is not None or handle.partial_pages:
                # Unstored partial pages: the next open drops the kernel's copy, so a reader
                # fetches whole read-ahead windows rather than one page per request.
                node.cache_stamp = stored
            elif handle.writable or handle.created:
                st = os.stat(handle.fd)
                node.cache_stamp = (st.st_mtime_ns, st.st_size)
        finally:
            os.close(handle.fd)
        if handle.writable or handle.created:
            self.record(
                Op.WRITE.value,
                node.vpath(),
                node.zone,
                pid=handle.pid,
                uid=handle.uid,
                comm=handle.comm,
                nbytes=handle.bytes_written,
                detail="create" if handle.created else None,
            )

    def _complete_kernel_copy(self, node: Node, fd: int) -> tuple[int, int] | None:
        """After writes that left pages partly written (`tar` writes 10 KiB records; most files
        end inside a page), give the kernel the whole file, so that the next reader finds it
        cached instead of fetching the pages the kernel never marked up to date one request
        each. Returns the cache stamp, or None if the file was not stored.

        Only when no other handle of the node is open: then no write or read through the mount
        can be in flight on it, so nothing newer can be overwritten and no page the kernel
        holds locked while it waits for this daemon can block the store.
        """
        if self.kernel_store is None or node.open_fds or node.zone is None:
            return None
        if not self.policy.decide(node.zone, Op.READ).allowed:
            return None  # nobody may read it here (a create-only zone): nothing to cache
        try:
            rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # e.g. a write-only file the daemon may not read
        try:
            st = os.fstat(rfd)
            if st.st_size > _KERNEL_STORE_LIMIT:
                return None
            data = os.pread(rfd, st.st_size, 0)
            if len(data) != st.st_size:
                return None
            self.kernel_store(node.ino, 0, data)
        except OSError:
            return None
        finally:
            os.close(rfd)
        return (st.st_mtime_ns, st.st_size)

    # ----- creating entries -----------------------------------------------------------------------

    def _creatable_parent(self, ctx: Any, parent: Node, name: bytes) -> Zone:
        """Checks for a new name in `parent`; returns its zone."""
        if parent.zone is None:
            reason = ROOT_CREATE_REASON if parent.ino == ROOT_INO else CONTEXT_REASON
            raise self.refuse(
                ctx, Op.WRITE.value, parent.vpath(name), None, Decision(False, errno.EACCES, reason)
            )
        zone = parent.zone
        self._reject_denied_name(ctx, parent, name, True, Op.WRITE)
        self._reject_protected(ctx, Op.WRITE, parent, name, True)
        decision = self.policy.decide_create(zone)
        if not decision.allowed:
            raise self.refuse(ctx, Op.WRITE.value, parent.vpath(name), zone, decision)
        self._check_layer(ctx, parent, Op.WRITE, name)
        return zone

    def _own(self, path_fd: int, name: bytes, ctx: Any) -> None:
        """Give a new entry to the caller, as the kernel would on a local filesystem."""
        if self.running_as_root and (ctx.uid != 0 or ctx.gid != 0):
            os.chown(name, ctx.uid, ctx.gid, dir_fd=path_fd, follow_symlinks=False)

    @_guarded
    def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self.store.get(parent_inode)
        zone = self._creatable_parent(ctx, parent, name)
        self._changing(parent)
        dfd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
        open_flags = flags & ~(os.O_NOCTTY | os.O_DIRECT)
        create_only = self.policy.access(zone).create_only
        if create_only:
            open_flags |= os.O_EXCL  # never reopen an existing file through "create"
        try:
            with self._as_caller(ctx.uid, ctx.gid):
                fd = self.store.create_file(dfd, name, open_flags, stat.S_IMODE(mode) & ~_SUID_SGID)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.EISDIR, errno.EXDEV):
                self._find(ctx, Op.WRITE, parent, name)  # sandboxfs's state, a mount: EACCES
            if exc.errno == errno.EEXIST:
                self._refuse_existing(ctx, parent, name, zone)
            if exc.errno == errno.EXDEV:  # the name is the root of another mount
                reason = f"{parent.vpath(name)} is the root of another mount"
                decision = Decision(False, errno.EACCES, reason)
                raise self.refuse(ctx, Op.WRITE.value, parent.vpath(name), zone, decision) from None
            raise
        try:
            if self.running_as_root and (ctx.uid != 0 or ctx.gid != 0):
                os.fchown(fd, ctx.uid, ctx.gid)
            st = fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        node = self.store.remember(parent, name, st, 0)
        node.created_here = True
        node.cache_stamp = (st.st_mtime_ns, st.st_size)
        node.open_fds = (*node.open_fds, fd)
        comm = self.process_names.get(ctx.pid)
        handle = FileHandle(fd, node, True, True, ctx.pid, ctx.uid, ctx.gid, comm)
        info = self._new_handle(handle, keep_cache=True, direct_io=bool(flags & os.O_DIRECT))
        return info, self.attrs(node, st)

    def _make_entry(
        self, ctx: Any, parent: Node, name: bytes, detail: str, make: Callable[[int], None]
    ) -> pyfuse3.EntryAttributes:
        """mkdir, symlink and mknod: checks, the backing call as the caller, the new node."""
        zone = self._creatable_parent(ctx, parent, name)
        self._changing(parent)
        dfd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
        try:
            with self._as_caller(ctx.uid, ctx.gid):
                make(dfd)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.EADDRINUSE):
                # Only a creation that failed can have met sandboxfs's state or a mount.
                self._find(ctx, Op.WRITE, parent, name)
                self._refuse_existing(ctx, parent, name, zone)
            raise
        return self._finish_new(ctx, parent, name, detail)

    def _refuse_existing(self, ctx: Any, parent: Node, name: bytes, zone: Zone) -> None:
        """A name that exists where lookup answered "absent" (create-only zones): refused as
        the write it is, like every other refused creation, rather than EEXIST."""
        if not self.policy.access(zone).create_only:
            return
        vpath = parent.vpath(name)
        reason = (
            f"{vpath} exists, and {zone.value} is create-only at trust level "
            f"{self.policy.trust.value}: existing entries cannot be replaced"
        )
        raise self.refuse(ctx, Op.WRITE.value, vpath, zone, Decision(False, errno.EACCES, reason))

    def _finish_new(
        self, ctx: Any, parent: Node, name: bytes, detail: str
    ) -> pyfuse3.EntryAttributes:
        dfd = self.store.child_dir_fd(parent, 0)
        self._own(dfd, name, ctx)
        st = self.store.lstat(dfd, name)
        if st is None:
            raise SandboxError(errno.ENOENT, "the new entry vanished")
        node = self.store.remember(parent, name, st, 0)
        node.created_here = True
        self.record(
            Op.WRITE.value, node.vpath(), node.zone, pid=ctx.pid, uid=ctx.uid, detail=detail
        )
        return self.attrs(node, st)

    @_guarded
    def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int) -> None:
            os.mkdir(name, stat.S_IMODE(mode) & ~_SUID_SGID, dir_fd=dfd)

        return self._make_entry(ctx, parent, name, "mkdir", make)

    @_guarded
    def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int) -> None:
            os.symlink(target, name, dir_fd=dfd)

        return self._make_entry(ctx, parent, name, "symlink", make)

    @_guarded
    def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            reason = (
                "only regular files, FIFOs and sockets can be created; device nodes are refused"
            )
            raise self.refuse(
                ctx,
                Op.WRITE.value,
                parent.vpath(name),
                parent.zone,
                Decision(False, errno.EPERM, reason),
            )

        def make(dfd: int) -> None:
            os.mknod(name, stat.S_IFMT(mode) | (stat.S_IMODE(mode) & ~_SUID_SGID), dir_fd=dfd)

        return self._make_entry(ctx, parent, name, "mknod", make)

    @_guarded
    def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self.store.get(inode)
        parent = self.store.get(new_parent_inode)
        src = node.vpath()
        if node.zone is None or node.ino < FIRST_DYNAMIC_INO:
            raise self.refuse(
                ctx,
                "link",
                src,
                node.zone,
                Decision(False, errno.EPERM, ZONE_ROOT_REASON),
                dest=parent.vpath(new_name),
            )
        if parent.zone is not node.zone:
            self._cross_zone("link", ctx, src, parent.vpath(new_name), node.zone, parent.zone)
        dest = parent.vpath(new_name)
        if node.parent is None:
            raise SandboxError(errno.ENOENT, "the entry was removed")
        # The source is judged by its current path, whatever name the kernel used for it: a
        # second name for a deny-listed or protected file would carry it out from under its
        # pattern (writing through a hard link writes the protected file).
        self._reject_denied_name(ctx, node.parent, node.name, node.is_dir, "link")
        self._reject_protected(ctx, "link", node.parent, node.name, node.is_dir, dest=dest)
        self._reject_denied_name(ctx, parent, new_name, False, "link")
        self._reject_protected(ctx, "link", parent, new_name, False, dest=dest)
        assert parent.zone is not None
        for decision in (self.policy.decide_create(parent.zone), self._link_decision(node)):
            if not decision.allowed:
                raise self.refuse(ctx, "link", src, parent.zone, decision, dest=dest)
        try:
            self.store.stat_child(parent, new_name, 0)
        except HiddenEntry as exc:  # never onto sandboxfs's state or another mount
            decision = Decision(False, errno.EACCES, f"{dest}: {exc.reason}")
            raise self.refuse(ctx, "link", src, parent.zone, decision, dest=dest) from None
        self._check_layer(ctx, parent, "link", new_name)
        self._check_layer(ctx, node, "link")
        self._changing(node, parent)
        dfd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
        src_fd = self.store.parent_fd(node, checked=True)
        self.store.stat_node(node)  # the name must still be node's (ESTALE otherwise)
        with self._as_caller(ctx.uid, ctx.gid):
            os.link(node.name, new_name, src_dir_fd=src_fd, dst_dir_fd=dfd, follow_symlinks=False)
        st = self.store.lstat(dfd, new_name)
        if st is None:
            raise SandboxError(errno.ENOENT, "the new link vanished")
        self.store.remember(parent, new_name, st, 0)
        self.record("link", src, node.zone, pid=ctx.pid, uid=ctx.uid, dest=parent.vpath(new_name))
        return self.attrs(node, st)

    # ----- removing and renaming ------------------------------------------------------------------

    def _removable(
        self, ctx: Any, parent: Node, name: bytes, op_name: str
    ) -> tuple[Zone, int, StatLike]:
        """Checks for deleting parent/name; returns its zone, the backing directory fd and the
        entry's lstat."""
        if parent.zone is None:
            reason = ZONE_ROOT_REASON if parent.ino == ROOT_INO else CONTEXT_REASON
            raise self.refuse(
                ctx, op_name, parent.vpath(name), None, Decision(False, errno.EACCES, reason)
            )
        zone = parent.zone
        self._reject_denied_name(ctx, parent, name, True, Op.DELETE)
        self.check(ctx, Op.DELETE, parent, name)
        found = self._find(ctx, Op.DELETE, parent, name)
        if found is None:
            raise SandboxError(errno.ENOENT)
        st, layer = found
        self._reject_protected(ctx, Op.DELETE, parent, name, stat.S_ISDIR(st.st_mode))
        if zone is Zone.WORKERS and layer > 0:
            vpath = parent.vpath(name)
            reason = f"{vpath} comes from SANDBOXFS_WORKERS_PATH, which is read-only"
            raise self.refuse(ctx, op_name, vpath, zone, Decision(False, errno.EROFS, reason))
        return zone, self.store.child_dir_fd(parent, layer, checked=True), st

    def _remove(self, ctx: Any, parent_inode: int, name: bytes, rmdir: bool) -> None:
        parent = self.store.get(parent_inode)
        zone, dfd, st = self._removable(ctx, parent, name, Op.DELETE.value)
        node = self.store.by_key.get((zone, st.st_dev, st.st_ino))
        self._changing(parent, node)
        (os.rmdir if rmdir else os.unlink)(name, dir_fd=dfd)
        if node is not None:
            self.store.detach(node, parent, name, st.st_nlink - 1 if not rmdir else 0)
        self.record(
            Op.DELETE.value,
            parent.vpath(name),
            zone,
            pid=ctx.pid,
            uid=ctx.uid,
            detail="rmdir" if rmdir else None,
        )

    @_guarded
    def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._remove(ctx, parent_inode, name, rmdir=False)

    @_guarded
    def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._remove(ctx, parent_inode, name, rmdir=True)

    @_guarded
    def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: Any,
    ) -> None:
        old_parent = self.store.get(parent_inode_old)
        new_parent = self.store.get(parent_inode_new)
        src, dst = old_parent.vpath(name_old), new_parent.vpath(name_new)
        if old_parent.zone is None or new_parent.zone is None:
            reason = ZONE_ROOT_REASON if old_parent.zone is None else ROOT_CREATE_REASON
            raise self.refuse(
                ctx, "rename", src, old_parent.zone, Decision(False, errno.EACCES, reason), dest=dst
            )
        if old_parent.zone is not new_parent.zone:
            self._cross_zone("rename", ctx, src, dst, old_parent.zone, new_parent.zone)
        zone = old_parent.zone
        if flags & ~(pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE):
            reason = "only the RENAME_NOREPLACE and RENAME_EXCHANGE flags are supported"
            decision = Decision(False, errno.EINVAL, reason)
            raise self.refuse(ctx, "rename", src, old_parent.zone, decision, dest=dst)
        exchange = bool(flags & pyfuse3.RENAME_EXCHANGE)
        for parent, name in ((old_parent, name_old), (new_parent, name_new)):
            self._reject_denied_name(ctx, parent, name, True, "rename")
        for decision in (self.policy.decide(zone, Op.DELETE), self.policy.decide(zone, Op.WRITE)):
            if not decision.allowed:
                raise self.refuse(ctx, "rename", src, zone, decision, dest=dst)
        found_old = self._find(ctx, Op.WRITE, old_parent, name_old)
        if found_old is None:
            raise SandboxError(errno.ENOENT)
        src_st, src_layer = found_old
        if zone is Zone.WORKERS and src_layer > 0:
            reason = f"{src} comes from SANDBOXFS_WORKERS_PATH, which is read-only"
            raise self.refuse(
                ctx, "rename", src, zone, Decision(False, errno.EROFS, reason), dest=dst
            )
        self._check_layer(ctx, new_parent, Op.WRITE, name_new)
        try:
            dst_st = self.store.stat_child(new_parent, name_new, 0)
        except HiddenEntry as exc:  # never onto sandboxfs's state or another mount
            decision = Decision(False, errno.EACCES, f"{dst}: {exc.reason}")
            raise self.refuse(ctx, "rename", src, zone, decision, dest=dst) from None
        moving = [(old_parent, name_old, src_st, new_parent, name_new)]
        if exchange and dst_st is not None:
            moving.append((new_parent, name_new, dst_st, old_parent, name_old))
        for parent, name, st, to_parent, to_name in moving:
            self._check_move(ctx, parent, name, st, to_parent, to_name, src, dst)
        src_fd = self.store.child_dir_fd(old_parent, src_layer, checked=True)
        dst_fd = self.store.child_dir_fd(new_parent, 0, create=True, checked=True)
        src_node = self.store.by_key.get((zone, src_st.st_dev, src_st.st_ino))
        dst_node = self.store.by_key.get((zone, dst_st.st_dev, dst_st.st_ino)) if dst_st else None
        self._changing(old_parent, new_parent, src_node, dst_node)
        renameat2(src_fd, name_old, dst_fd, name_new, flags)
        if dst_node is not None and dst_node is not src_node:
            if exchange:
                self.store.moved(dst_node, new_parent, name_new, old_parent, name_old)
            else:
                nlink = dst_st.st_nlink - 1 if dst_st and not dst_node.is_dir else 0
                self.store.detach(dst_node, new_parent, name_new, nlink)
        if src_node is not None:
            self.store.moved(src_node, old_parent, name_old, new_parent, name_new)
            if new_parent.zone is Zone.WORKERS and new_parent.parent is self.store.root:
                src_node.layer = 0
        self.record("rename", src, zone, pid=ctx.pid, uid=ctx.uid, dest=dst)

    def _check_move(
        self,
        ctx: Any,
        parent: Node,
        name: bytes,
        st: StatLike,
        to_parent: Node,
        to_name: bytes,
        src: str,
        dst: str,
    ) -> None:
        """Patterns survive renames: nothing protected is moved away or onto, and no directory
        is moved while a deny or protect path pattern could match something inside it (it
        would carry that entry out from under its pattern)."""
        is_dir = stat.S_ISDIR(st.st_mode)
        self._reject_protected(ctx, "rename", parent, name, is_dir, dest=dst)
        self._reject_protected(ctx, "rename", to_parent, to_name, is_dir, dest=dst)
        if not is_dir:
            return
        for patterns, decide, rel in (
            (self.policy.deny, self.policy.deny_list_decision, _relpath(parent, name)),
            (self.policy.protect, self.policy.protect_decision, _relpath(parent, name)),
            (self.policy.protect, self.policy.protect_decision, _relpath(to_parent, to_name)),
        ):
            pattern = patterns.match_below(rel)
            if pattern is not None:
                decision = decide(f"{parent.vpath(name)}/...", pattern)
                raise self.refuse(ctx, "rename", src, parent.zone, decision, dest=dst)

    def _cross_zone(
        self, what: str, ctx: Any, src: str, dst: str, zone: Zone | None, to: Zone | None
    ) -> NoReturn:
        """EXDEV for a rename or link across zones. Not a policy refusal (`mv` then copies
        and deletes, each checked on its own), so it is recorded without `allowed: false`."""
        reason = cross_zone_reason(f"{what}s" if what == "rename" else "hard links", zone, to)
        self.record(
            what,
            src,
            zone,
            pid=ctx.pid,
            uid=ctx.uid,
            allowed=None,
            reason=reason,
            err=errno.EXDEV,
            dest=dst,
        )
        raise SandboxError(errno.EXDEV, reason)

    # ----- extended attributes and statfs ---------------------------------------------------------

    def _xattr_target(self, node: Node) -> tuple[str, int] | None:
        """A /proc path to node (via an O_PATH descriptor); None for symlinks and virtual nodes."""
        if node.zone is None or (node.key is None and node.ino < FIRST_DYNAMIC_INO):
            return None
        if node.open_fds:
            return f"/proc/self/fd/{node.open_fds[-1]}", -1
        fd = self.store.dir_fd(node) if node.is_dir else self.store.open_path_fd(node)
        if not node.is_dir and stat.S_ISLNK(os.stat(fd).st_mode):
            os.close(fd)
            return None
        return f"/proc/self/fd/{fd}", (-1 if node.is_dir else fd)

    def _with_xattr_path(self, node: Node, fn: Callable[[str], R], missing: R) -> R:
        target = self._xattr_target(node)
        if target is None:
            return missing
        path, fd = target
        try:
            return fn(path)
        finally:
            if fd >= 0:
                os.close(fd)

    @_guarded
    def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if name.startswith(_SECURITY_XATTR_PREFIX):
            # sandboxfs has no security.* namespace: it never shows or stores labels or file
            # capabilities (the mount is nosuid). Say so at once, without a policy check that
            # would audit a phantom denial. The kernel asks for security.capability before
            # writes and `ls -l` for security.selinux; EOPNOTSUPP rather than ENODATA lets
            # ls remember the answer for the whole mount instead of asking for every file.
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        node = self.store.get(inode)
        if not self._xattrs_visible(ctx, node):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

        def get(path: str) -> bytes:
            return os.getxattr(path, name)

        value = self._with_xattr_path(node, get, None)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @_guarded
    def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        node = self.store.get(inode)
        empty: list[str] = []
        if not self._xattrs_visible(ctx, node):
            return []
        names = self._with_xattr_path(node, os.listxattr, empty)
        encoded = (n.encode("utf-8", "surrogateescape") for n in names)
        return [n for n in encoded if not n.startswith(_SECURITY_XATTR_PREFIX)]

    def _xattrs_visible(self, ctx: Any, node: Node) -> bool:
        """Whether node's extended attributes may be read (refusals are audited). A zone root
        the level cannot read or list shows none, like the empty directory it looks like."""
        if node.zone is None:
            return True
        if node.ino < FIRST_DYNAMIC_INO:
            return self._readable(node.zone)
        self.check(ctx, Op.READ, node)
        return True

    def _check_xattr_change(self, ctx: Any, node: Node, name: bytes) -> None:
        self._check_change(ctx, node)
        if not name.startswith(_WRITABLE_XATTR_PREFIX) and name not in _ACL_XATTRS:
            reason = (
                "only user.* extended attributes and POSIX ACLs can be set or removed "
                "through sandboxfs"
            )
            raise self.refuse(
                ctx, Op.WRITE.value, node.vpath(), node.zone, Decision(False, errno.EPERM, reason)
            )

    @_guarded
    def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        def put(path: str) -> None:
            os.setxattr(path, name, value)

        self._change_xattr(ctx, inode, name, put, "setxattr", errno.EPERM)

    @_guarded
    def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        def remove(path: str) -> None:
            os.removexattr(path, name)

        self._change_xattr(ctx, inode, name, remove, "removexattr", pyfuse3.ENOATTR)

    def _change_xattr(
        self,
        ctx: Any,
        inode: int,
        name: bytes,
        change: Callable[[str], None],
        what: str,
        symlink_errno: int,
    ) -> None:
        """Set or remove one xattr after the write check; symlinks carry none."""
        node = self.store.get(inode)
        self._check_xattr_change(ctx, node, name)
        self._changing(node)

        def apply(path: str) -> bool:
            change(path)
            return True

        if not self._with_xattr_path(node, apply, False):
            raise SandboxError(symlink_errno, "symlinks cannot carry extended attributes")
        detail = f"{what} {name.decode('utf-8', 'replace')}"
        self.record(
            Op.WRITE.value, node.vpath(), node.zone, pid=ctx.pid, uid=ctx.uid, detail=detail
        )

    @_guarded
    def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.store.zone_roots[Zone.REPO].fd)
        data = pyfuse3.StatvfsData()
        for attr in (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
            "f_namemax",
        ):
            setattr(data, attr, getattr(st, attr))
        return data


def _absent(decision: Decision) -> Decision:
    """A refusal answered as ENOENT: the name looks absent to the caller."""
    return Decision(False, errno.ENOENT, decision.reason)


def _relpath(parent: Node, name: bytes) -> str:
    """parent/name relative to its zone root, as text for pattern matching."""
    rel = parent.relpath()
    return (rel + b"/" + name if rel else name).decode("utf-8", "surrogateescape")


def _dot_attrs(node: Node) -> pyfuse3.EntryAttributes:
    """Listing attributes of `.` and `..`: the kernel takes only their inode number and type
    (it never makes dentries or counts lookups for them), so no stat is needed."""
    entry = pyfuse3.EntryAttributes()
    entry.st_ino = node.ino
    entry.st_mode = stat.S_IFDIR
    return entry


def _read_comm(fd: int) -> str:
    return os.pread(fd, 64, 0).rstrip(b"\n").decode("utf-8", "replace")


class ProcessNames:
    """`comm` of recent callers, read through a descriptor kept open per pid.

    Opening /proc/<pid>/comm is most of the cost of reading it, and the same few processes
    make most requests. A descriptor stays bound to the process it was opened for: once that
    process is gone, reading fails (ESRCH) even if its pid has been reused, and the pid is
    looked up afresh. A name changed by exec or prctl shows on the next read.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._fds: OrderedDict[int, int] = OrderedDict()

    def get(self, pid: int) -> str | None:
        fd = self._fds.get(pid)
        if fd is not None:
            try:
                name = _read_comm(fd)
            except OSError:
                del self._fds[pid]
                os.close(fd)
            else:
                self._fds.move_to_end(pid)
                return name
        if pid <= 0:
            return None
        try:
            fd = os.open(f"/proc/{pid}/comm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            name = _read_comm(fd)
        except OSError:
            os.close(fd)
            return None
        self._fds[pid] = fd
        if len(self._fds) > self._capacity:
            _, oldest = self._fds.popitem(last=False)
            os.close(oldest)
        return name

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def context_document(policy: Policy, info: MountInfo, pid: int) -> bytes:
    """The security context shown at /.sandboxfs/context.json."""
    zones = {}
    for zone in Zone:
        access = policy.access(zone)
        zones[zone.value] = {
            "read": Op.READ in access.ops,
            "write": Op.WRITE in access.ops,
            "list": Op.LIST in access.ops,
            "delete": Op.DELETE in access.ops,
            "create_only": access.create_only,
        }
    doc = {
        "trust": policy.trust.value,
        "session": info.session,
        "workspace": info.workspace,
        "project": info.project,
        "mountpoint": info.mountpoint,
        "pid": pid,
        **({"command": list(info.command)} if info.command is not None else {}),
        "zones": zones,
        "deny": list(policy.deny_patterns),
    }
    return (json.dumps(doc, indent=2) + "\n").encode()
