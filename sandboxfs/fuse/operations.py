"""The pyfuse3 adapter: a translator between FUSE callbacks and the core.

Each callback resolves inodes to store nodes, calls the gate's method for its operation
(sandboxfs.core.gate: the rules in their order, limits, the audit entry) with the backing call
to make as the caller, and answers the kernel: attribute replies (sandboxfs.fuse.replies),
handles, lookup counts, the kernel's page cache. It decides nothing and builds no audit entry
itself.

Handlers do their work synchronously between awaits, so the inode table never changes under
a running callback. One guard (`_guarded`) turns `SandboxError` and `OSError` into
`FUSEError`, and anything unexpected into a logged, audited `EIO`: only `FUSEError` may leave
a handler, or pyfuse3 takes the whole mount down.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import pyfuse3

from sandboxfs.core.context import confined_context, guide
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.gate import Gate
from sandboxfs.core.gitconfig import read_bounded
from sandboxfs.core.guard import Guard
from sandboxfs.core.inodes import (
    CONTEXT_INO,
    CONTEXT_NAME,
    CONTROL_INO,
    CONTROL_NAME,
    GUIDE_INO,
    GUIDE_NAME,
    ROOT_INO,
    Node,
    StatLike,
)
from sandboxfs.core.policy import Trust, Zone
from sandboxfs.core.rulebase import MountInfo
from sandboxfs.core.store import HiddenEntry, Listed, Store
from sandboxfs.core.syscalls import Stat, fstat, set_fs_ids
from sandboxfs.fuse.host_watch import HostWatch
from sandboxfs.fuse.replies import Replies, dot_attrs
from sandboxfs.fuse.warm import Warm

__all__ = ["FileHandle", "MountInfo", "SandboxOperations"]

log = logging.getLogger(__name__)

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Files up to this size are handed to the kernel's page cache whole after a write that left
# pages partly written (see _release); larger ones are re-read by the next reader instead.
_KERNEL_STORE_LIMIT = 256 << 10
_OPEN_STRIP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_DIRECT

# Callbacks that write an audit entry when they succeed: refused while the log is failing,
# audited then under the callback's own name.
_AUDITED_CALLBACKS = frozenset(
    {
        AuditOp.OPEN,
        AuditOp.OPENDIR,
        AuditOp.CREATE,
        AuditOp.MKDIR,
        AuditOp.SYMLINK,
        AuditOp.MKNOD,
        AuditOp.LINK,
        AuditOp.UNLINK,
        AuditOp.RMDIR,
        AuditOp.RENAME,
        AuditOp.SETATTR,
        AuditOp.SETXATTR,
        AuditOp.REMOVEXATTR,
    }
)

P = ParamSpec("P")
R = TypeVar("R")


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
    # Writes must check the file's size first (max_file_bytes or a quota in its zone).
    sized: bool = False
    # The guard's generation when the handle was opened, or last checked again for reading
    # and for writing (each right is checked again on its own after a trust change).
    read_generation: int = 0
    write_generation: int = 0
    # The approval grant it was opened under (core.approvals): revoking it ends the handle.
    grant: int | None = None
    # Opened with O_APPEND on an existing file: judged a write, not an overwrite, so a cut
    # (ftruncate) or a write below the end through it is still asked about as one.
    appends: bool = False
    # Its file matches a private-key pattern: each read checks the file again for a key once
    # its (mtime_ns, size, ctime_ns) differ from `key_stamp`, those when it was last checked.
    key_named: bool = False
    key_stamp: tuple[int, int, int] = (0, 0, 0)


@dataclass(slots=True)
class DirHandle:
    node: Node
    entries: list[Listed] | None = None
    generation: int = 0
    caller: tuple[int, int, int] = (0, 0, 0)


@dataclass(slots=True)
class BlobHandle:
    data: bytes


def _guarded(
    fn: Callable[Concatenate[SandboxOperations, P], R],
) -> Callable[Concatenate[SandboxOperations, P], Awaitable[R]]:
    """Run a synchronous handler as the async callback pyfuse3 expects, mapping every error."""

    audited = AuditOp(fn.__name__) if fn.__name__ in _AUDITED_CALLBACKS else None

    async def wrapper(self: SandboxOperations, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if audited is not None:
            ctx = next((a for a in args if isinstance(a, pyfuse3.RequestContext)), None)
            try:
                self.gate.fail_closed(
                    audited,
                    None,
                    pid=ctx.pid if ctx is not None else 0,
                    uid=ctx.uid if ctx is not None else 0,
                )
            except SandboxError as exc:
                raise pyfuse3.FUSEError(exc.errno) from None
        try:
            return fn(self, *args, **kwargs)
        except SandboxError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors outside the store's own retries: give the cached ones
                # back, so that this request fails alone and the next ones are served.
                self.store.make_room()
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            log.exception("internal error in %s", fn.__name__)
            self.gate.effects.internal_error(fn.__name__, exc)
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
        guard: Guard,
        *,
        entry_timeout: float,
        attr_timeout: float,
        context_json: bytes,
        host_watch: HostWatch | None = None,
        watched_timeout: float = 0.0,
    ) -> None:
        super().__init__()
        self.store = store
        self.guard = guard
        self.gate = Gate(guard, store, guard.effects)
        self.context_json = context_json
        self._write_guides()
        self._pid_namespace = os.readlink("/proc/self/ns/pid")
        self.running_as_root = os.geteuid() == 0
        session_root = os.stat(store.zone_roots[Zone.SESSION].fd)
        self.replies = Replies(
            store,
            guard.readable,
            lambda: len(self.context_json),
            entry_timeout=entry_timeout,
            attr_timeout=attr_timeout,
            host_watch=host_watch,
            watched_timeout=watched_timeout,
            owner=(session_root.st_uid, session_root.st_gid),
            guide_size=lambda: len(self.guides[1]) + len(self._pending_text()),
        )
        self._handles: dict[int, FileHandle | BlobHandle] = {}
        self._dirs: dict[int, DirHandle] = {}
        self._next_fh = 1
        # pyfuse3.notify_store once the mount is up: (inode, offset, data) into the page cache.
        self.kernel_store: Callable[[int, int, bytes], None] | None = None
        # The daemon's own walk that warms the kernel's cache (sandboxfs.fuse.warm), if any.
        self.warm: Warm | None = None
        self._zone_names = {zone.value.encode(): zone for zone in guard.policy.zones}

    def _gate(self, pid: int) -> Gate:
        """The gate, or for the daemon's own cache warm the gate without effect: what it may
        list is what every caller may, and it is nobody's operation to audit or ask about."""
        warm = self.warm
        if warm is not None and pid != 0 and pid == warm.tid:
            return self.gate.without_effect()
        return self.gate

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
            node = self._control_child(name)
        else:
            return self._lookup_zone(parent, name, ctx)
        node.lookups += 1
        return self.replies.node_attrs(node)

    def _lookup_root(self, name: bytes) -> Node:
        if name == CONTROL_NAME:
            return self.store.control
        zone = self._zone_names.get(name)
        if zone is None:
            raise SandboxError(errno.ENOENT)
        return self.store.zone_roots[zone]

    def _lookup_zone(self, parent: Node, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        """LOOKUP: the guard decides whether the name is visible (see Guard.visible); a
        CREATE, MKDIR, SYMLINK, MKNOD or LINK that follows a refused lookup reaches its own
        callback and is refused and audited there as `write`."""
        found = self._gate(ctx.pid).lookup(ctx, parent, name)
        if found is None:
            return self.replies.negative_entry()
        st, layer = found
        node = self.store.remember(parent, name, st, layer)
        return self.replies.attrs(node, st)

    @_guarded
    def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        node = self.store.get(inode)
        self.gate.getattr(ctx, node)
        return self.replies.node_attrs(node)

    @_guarded
    def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self.store.get(inode)
        handle = self._handles.get(fh) if fh is not None else None
        creating = isinstance(handle, FileHandle) and handle.created
        fd = handle.fd if isinstance(handle, FileHandle) else None
        writable = isinstance(handle, FileHandle) and handle.writable
        # ftruncate through a handle opened for writing in place: its open was the overwrite
        granted = (
            isinstance(handle, FileHandle)
            and writable
            and not handle.appends
            and handle.grant not in self.gate.effects.consent.revoked_grants
        )
        opened: list[int] = []
        keeps_cache = False

        def current_size() -> int:
            self.replies.changing(node)
            wfd = fd if fd is not None and writable else self.store.reopen(node, os.O_WRONLY)
            if wfd != fd:
                opened.append(wfd)
            return os.fstat(wfd).st_size

        def truncate(new_size: int) -> None:
            with self._as_caller(ctx.uid, ctx.gid):  # growing a file allocates blocks
                os.truncate(opened[-1] if opened else fd, new_size)  # type: ignore[arg-type]

        def change(mode: int | None) -> None:
            nonlocal keeps_cache
            self.replies.changing(node)
            times = None
            # A new mtime alone leaves the kernel's cached pages valid (`tar` sets it after
            # writing): carry the cache stamp over, if it held up to now.
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
                times = (atime, mtime)
            if mode is not None or owner is not None or times is not None:
                self.store.change_meta(node, mode, owner, times)

        owner = None
        if fields.update_uid or fields.update_gid:
            owner = (
                attr.st_uid if fields.update_uid else -1,
                attr.st_gid if fields.update_gid else -1,
            )
        try:
            self.gate.setattr(
                ctx,
                node,
                size=(current_size, truncate, attr.st_size) if fields.update_size else None,
                mode=attr.st_mode if fields.update_mode else None,
                owner=owner,
                times=bool(fields.update_atime or fields.update_mtime),
                creating=creating,
                overwrite_granted=granted,
                action=change,
            )
        finally:
            for wfd in opened:
                os.close(wfd)
        attrs = self.replies.node_attrs(node)
        if keeps_cache:
            node.cache_stamp = (attrs.st_mtime_ns, attrs.st_size)
        return attrs

    @_guarded
    def readlink(self, inode: int, ctx: Any) -> bytes:
        node = self.store.get(inode)

        def read() -> bytes:
            self.replies.changing(node)  # the kernel stops trusting a read link's atime
            return self.store.readlink(node)

        return self.gate.readlink(ctx, node, read)

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """Drop what the kernel no longer references. Synchronous on purpose: pyfuse3 awaits
        only a returned coroutine, and FORGET gets no reply, so there is no errno to map."""
        watch = self.replies.host_watch
        for inode, count in inode_list:
            try:
                node = self.store.nodes.get(inode)
                self.store.forget(inode, count)
                if inode not in self.store.nodes:
                    self.replies.given.pop(inode, None)
                    if watch is not None and node is not None and node.watch >= 0:
                        watch.dropped(node)
            except Exception:
                log.exception("internal error in forget")

    # ----- directories ----------------------------------------------------------------------------

    @_guarded
    def opendir(self, inode: int, ctx: Any) -> int:
        node = self.store.get(inode)
        if not node.is_dir:
            raise SandboxError(errno.ENOTDIR)
        self._gate(ctx.pid).opendir(ctx, node)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = DirHandle(node, None, self.guard.generation, (ctx.pid, ctx.uid, ctx.gid))
        return fh

    @_guarded
    def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._dirs[fh]
        node = handle.node
        if handle.generation != self.guard.generation:
            self._gate(handle.caller[0]).relist(_Caller(*handle.caller), node)
            handle.generation = self.guard.generation
        if handle.entries is None or start_id == 0:
            handle.entries = self._dir_entries(node)
            self.replies.changing(node)  # the kernel stops trusting a listed directory's atime
        entries = handle.entries
        replay = node.key is not None and not (
            node.zone is Zone.WORKERS and node.parent is self.store.root
        )
        now = time.monotonic()
        layer_fds: dict[int, int] = {}  # where each layer's names live, looked up once
        for index in range(start_id, len(entries)):
            name, layer, ino, is_dir = entries[index]
            if name == b".":
                attrs = dot_attrs(node)
            elif name == b"..":
                attrs = dot_attrs(node.parent or node)
            elif node.zone is None:
                child = self._virtual_child(node, name)
                attrs = self.replies.node_attrs(child)
                if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                    return
                child.lookups += 1
                continue
            else:
                replayed = self.replies.replayed(node, name, ino, is_dir, now) if replay else None
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
                    if not pyfuse3.readdir_reply(
                        token, name, self.replies.opaque_attrs(), index + 1
                    ):
                        return
                    continue
                if st is None:
                    continue
                child = self.store.remember(node, name, st, layer)
                attrs = self.replies.attrs(child, st)
                if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                    child.lookups -= 1
                    return
                continue
            if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                return

    def _entry_stat(
        self, node: Node, name: bytes, dir_fd: int, listed_as_dir: bool
    ) -> StatLike | None:
        """lstat of a listed entry, or None if it vanished or turned into a directory the
        guard leaves out of listings since the listing (which checked it with the type it had
        then).

        PermissionError means the daemon cannot search the directory (no x bit): the caller
        lists the name without attributes, as getdents does natively.
        """
        try:
            st = self.store.lstat(dir_fd, name)
        except HiddenEntry:  # became a mount root since the listing
            return None
        if st is None:
            return None
        if (
            stat.S_ISDIR(st.st_mode)
            and not listed_as_dir
            and not self.gate.listed(node, name, True, st.st_ino)
        ):
            return None
        return st

    def _dir_entries(self, node: Node) -> list[Listed]:
        dots: list[Listed] = [(b".", 0, 0, True), (b"..", 0, 0, True)]
        if node.ino == ROOT_INO:
            zones: list[Listed] = [(name, 0, 0, True) for name in self._zone_names]
            return dots + zones + [(CONTROL_NAME, 0, 0, True)]
        if node.ino == CONTROL_INO:
            return [*dots, (CONTEXT_NAME, 0, 0, False), (GUIDE_NAME, 0, 0, False)]
        # Names the guard leaves out (Guard.listed: deny-listed ones, only where the level may
        # not list the zone) are dropped here, before offsets are given, so that the offsets
        # do not jump where a hidden name was and reveal how many sort before a visible one.
        if self.gate.lists_all(node):
            return dots + self.store.list_entries(node)
        return dots + [
            entry
            for entry in self.store.list_entries(node)
            if self.gate.listed(node, entry[0], entry[3], entry[2])
        ]

    def _virtual_child(self, node: Node, name: bytes) -> Node:
        if node.ino == ROOT_INO:
            return self._lookup_root(name)
        return self._control_child(name)

    def _control_child(self, name: bytes) -> Node:
        if name == CONTEXT_NAME:
            return self.store.context
        if name == GUIDE_NAME:
            return self.store.guide
        raise SandboxError(errno.ENOENT)

    def _pending_text(self) -> bytes:
        """What waits for the user's approval, at the end of the guide (core.approvals)."""
        broker = self.gate.effects.consent.broker
        return broker.pending_text().encode() if broker is not None else b""

    def _write_guides(self) -> None:
        """/.sandboxfs/README as the host side and a program inside `run` read it (the same
        text, with the mount's own path or /sandbox), from the policy of the current level."""
        info = self.guard.info
        self.guides = (
            guide(self.guard.policy, info, info.mountpoint),
            guide(self.guard.policy, info),
        )

    @_guarded
    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_guarded
    def fsyncdir(self, fh: int, datasync: bool) -> None:
        node = self._dirs[fh].node
        if node.zone is not None and node.key is not None:
            self.store.fsync_dir(node)

    # ----- files ----------------------------------------------------------------------------------

    @_guarded
    def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self.store.get(inode)
        accmode = flags & os.O_ACCMODE
        wants_write = accmode != os.O_RDONLY or bool(flags & os.O_TRUNC)
        if node.ino in (CONTEXT_INO, GUIDE_INO):
            self.gate.open_document(ctx, node, write=wants_write)
        if node.ino == CONTEXT_INO:
            # Not audited: the mount's public description, which `sandboxfs status` and
            # `mount` read to tell a live mount from a dead one. A process in a PID namespace
            # of its own (a program of `run`) is not shown the host's paths. Never from the
            # page cache: the two documents differ.
            document = self.context_json
            if not self._host_side(ctx.pid):
                document = confined_context(self.context_json)
            return self._new_handle(BlobHandle(document), keep_cache=False, direct_io=True)
        if node.ino == GUIDE_INO:  # the same, in plain text for the program
            document = self.guides[0] if self._host_side(ctx.pid) else self.guides[1]
            document += self._pending_text()
            return self._new_handle(BlobHandle(document), keep_cache=False, direct_io=True)
        if node.zone is None or node.is_dir:
            raise SandboxError(errno.EISDIR)
        truncate = bool(flags & os.O_TRUNC)
        appends = bool(flags & os.O_APPEND)

        def open_file() -> tuple[int, os.stat_result]:
            if truncate:
                self.replies.changing(node)
            return self.store.open_file_stat(node, flags & ~_OPEN_STRIP)

        comm = self.guard.process_names.get(ctx.pid)
        read = accmode != os.O_WRONLY
        fd, st = self.gate.open(
            ctx,
            node,
            open_file,
            read=read,
            write=wants_write,
            truncate=truncate,
            in_place=accmode != os.O_RDONLY and not appends,
            comm=comm,
        )
        grant = self.gate.effects.consent.last_grant  # the approval grant that let it open, if any
        stamp = (st.st_mtime_ns, st.st_size)
        keep_cache = node.cache_stamp == stamp and not truncate
        node.cache_stamp = stamp
        limits = self.guard.zone_limits(node.zone)
        handle = FileHandle(fd, node, wants_write, False, ctx.pid, ctx.uid, ctx.gid, comm)
        handle.sized = limits.sizes_matter
        handle.grant = grant
        handle.appends = wants_write and appends and not truncate and not node.created_here
        handle.read_generation = handle.write_generation = self.guard.generation
        handle.key_named = read and self.guard.names_private_key(node)
        handle.key_stamp = _key_stamp(st)
        node.open_fds = (*node.open_fds, fd)
        return self._new_handle(handle, keep_cache=keep_cache, direct_io=bool(flags & os.O_DIRECT))

    def _host_side(self, pid: int) -> bool:
        """Whether `pid` shares the daemon's PID namespace (False when that cannot be told)."""
        try:
            return os.readlink(f"/proc/{pid}/ns/pid") == self._pid_namespace
        except OSError:
            return False

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
        if handle.read_generation != self.guard.generation:
            self.gate.keep(
                handle,
                handle.node,
                read=True,
                write=False,
                created=handle.created,
                grant=handle.grant,
            )
            handle.read_generation = self.guard.generation
        self.replies.changing(handle.node)  # the kernel stops trusting a read file's atime
        if not handle.key_named:
            return os.pread(handle.fd, size, off)
        self._no_key_since(handle)
        data = os.pread(handle.fd, size, off)
        self._no_key_since(handle)  # a key written while it was read is not handed out
        return data

    def _no_key_since(self, handle: FileHandle) -> None:
        """A handle on a file named as keys are: once the file changed since it was last
        checked (the user's tool wrote a key into it), reading it is refused if it holds one
        now, as opening it would be (mapped pages come through read too: direct_io is off)."""
        stamp = _key_stamp(os.fstat(handle.fd))
        if stamp != handle.key_stamp:
            self.gate.read_open_key(handle, handle.node, handle.fd)
            handle.key_stamp = stamp

    @_guarded
    def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handles[fh]
        if not isinstance(handle, FileHandle) or not handle.writable:
            raise SandboxError(errno.EBADF)
        node = handle.node
        if handle.write_generation != self.guard.generation:
            self.gate.keep(
                handle, node, read=False, write=True, created=handle.created, grant=handle.grant
            )
            handle.write_generation = self.guard.generation
        if (
            handle.appends
            and self.gate.effects.consent.active
            and off < os.fstat(handle.fd).st_size
        ):
            self.gate.overwrite_in_place(handle, node)
            handle.appends = False

        def frozen() -> None:
            # Pages of a shared mapping the kernel failed to write back stay in its cache as
            # the program changed them: the next open drops them (keep_cache is False), and
            # release hands the kernel the file as it is on disk where it can (_release).
            node.cache_stamp = None
            handle.partial_pages = True

        def pwrite() -> int:
            self.replies.changing(node)
            with self._as_caller(handle.uid, handle.gid):
                return os.pwrite(handle.fd, buf, off)

        # The mount runs without the writeback cache, so write(2), O_APPEND, sendfile, the
        # fallbacks of fallocate and copy_file_range (neither is implemented here) and the
        # writeback of a shared mapping all arrive here as WRITE requests (Gate.write).
        size = (lambda: os.fstat(handle.fd).st_size) if handle.sized else None
        written = self.gate.write(handle, node, off, len(buf), pwrite, size=size, frozen=frozen)
        return _wrote(handle, off, written)

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
        self.guard.close()

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
        self.gate.release(
            handle,
            node,
            wrote=handle.writable,
            created=handle.created,
            nbytes=handle.bytes_written,
            comm=handle.comm,
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
        if not self.guard.cacheable(node.zone):
            return None  # nobody may read it here (a create-only zone): nothing to cache
        whole = self.store.read_whole(fd, _KERNEL_STORE_LIMIT)
        if whole is None:
            return None
        data, st = whole
        try:
            self.kernel_store(node.ino, 0, data)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _made_here(self, parent: Node, name: bytes, st: StatLike | None) -> None:
        """parent/name was just made `st` (None: removed) here; see HostWatch.made_here."""
        if self.replies.host_watch is not None:
            self.replies.host_watch.made_here(parent, name, st)

    # ----- creating entries -----------------------------------------------------------------------

    def _own(self, path_fd: int, name: bytes, ctx: Any) -> None:
        """Give a new entry to the caller, as the kernel would on a local filesystem."""
        if self.running_as_root and (ctx.uid != 0 or ctx.gid != 0):
            self.store.give(path_fd, name, ctx.uid, ctx.gid)

    @_guarded
    def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self.store.get(parent_inode)

        def make(open_flags: int, file_mode: int) -> tuple[tuple[int, Stat], Stat]:
            self.replies.changing(parent)
            dfd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
            with self._as_caller(ctx.uid, ctx.gid):
                fd = self.store.create_file(dfd, name, open_flags, file_mode)
            try:
                if self.running_as_root and (ctx.uid != 0 or ctx.gid != 0):
                    os.fchown(fd, ctx.uid, ctx.gid)
                st = fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            return (fd, st), st

        fd, st = self.gate.create(
            ctx, parent, name, make, flags=flags & ~(os.O_NOCTTY | os.O_DIRECT), mode=mode
        )
        zone = parent.zone
        node = self.store.remember(parent, name, st, 0)
        self._made_here(parent, name, st)
        node.created_here = True
        node.cache_stamp = (st.st_mtime_ns, st.st_size)
        node.open_fds = (*node.open_fds, fd)
        comm = self.guard.process_names.get(ctx.pid)
        handle = FileHandle(fd, node, True, True, ctx.pid, ctx.uid, ctx.gid, comm)
        handle.sized = self.guard.zone_limits(zone).sizes_matter
        handle.read_generation = handle.write_generation = self.guard.generation
        info = self._new_handle(handle, keep_cache=True, direct_io=bool(flags & os.O_DIRECT))
        return info, self.replies.attrs(node, st)

    def _make_entry(
        self,
        ctx: Any,
        parent: Node,
        name: bytes,
        kind: str,
        make: Callable[[int, int], None],
        mode: int = 0,
    ) -> pyfuse3.EntryAttributes:
        """mkdir, symlink and mknod: the gate's checks, the backing call as the caller (with
        the mode the gate gives), the new node."""

        def made(new_mode: int) -> tuple[tuple[Node, Stat], Stat]:
            self.replies.changing(parent)
            dfd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
            with self._as_caller(ctx.uid, ctx.gid):
                make(dfd, new_mode)
            dfd = self.store.child_dir_fd(parent, 0)
            self._own(dfd, name, ctx)
            st = self.store.lstat(dfd, name)
            if st is None:
                raise SandboxError(errno.ENOENT, "the new entry vanished")
            node = self.store.remember(parent, name, st, 0)
            self._made_here(parent, name, st)
            node.created_here = True
            return (node, st), st

        node, st = self.gate.make(ctx, parent, name, kind, made, mode=mode)
        return self.replies.attrs(node, st)

    @_guarded
    def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int, new_mode: int) -> None:
            self.store.make_dir(dfd, name, stat.S_IMODE(new_mode))

        return self._make_entry(ctx, parent, name, "mkdir", make, stat.S_IFDIR | stat.S_IMODE(mode))

    @_guarded
    def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int, new_mode: int) -> None:
            self.store.make_symlink(dfd, name, target)

        return self._make_entry(ctx, parent, name, "symlink", make)

    @_guarded
    def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int, new_mode: int) -> None:
            self.store.make_node(dfd, name, new_mode)

        return self._make_entry(ctx, parent, name, "mknod", make, mode)

    @_guarded
    def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self.store.get(inode)
        parent = self.store.get(new_parent_inode)

        def link() -> Stat:
            self.replies.changing(node, parent)
            # Every check and walk with the daemon's identity, as create does: only the link
            # itself is the caller's (a caller cannot search the state dir above the zones).
            dfd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
            src_fd = self.store.link_source(node)
            with self._as_caller(ctx.uid, ctx.gid):
                self.store.link(src_fd, node.name, dfd, new_name)
            st = self.store.lstat(dfd, new_name)
            if st is None:
                raise SandboxError(errno.ENOENT, "the new link vanished")
            self.store.remember(parent, new_name, st, 0)
            self._made_here(parent, new_name, st)
            return st

        st = self.gate.link(ctx, node, parent, new_name, link)
        return self.replies.attrs(node, st)

    # ----- removing and renaming ------------------------------------------------------------------

    def _remove(self, ctx: Any, parent_inode: int, name: bytes, rmdir: bool) -> None:
        parent = self.store.get(parent_inode)

        def remove(zone: Zone, st: StatLike, layer: int) -> None:
            dfd = self.store.child_dir_fd(parent, layer, checked=True)
            node = self.store.by_key.get((zone, st.st_dev, st.st_ino))
            self.replies.changing(parent, node)
            self.store.remove(dfd, name, rmdir)
            self._made_here(parent, name, None)
            if node is not None:
                self.store.detach(node, parent, name, st.st_nlink - 1 if not rmdir else 0)

        self.gate.remove(ctx, parent, name, remove, rmdir=rmdir)

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
        flags_ok = not flags & ~(pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE)
        exchange = bool(flags & pyfuse3.RENAME_EXCHANGE)

        def rename(zone: Zone, src_st: StatLike, src_layer: int, dst_st: StatLike | None) -> None:
            src_fd = self.store.child_dir_fd(old_parent, src_layer, checked=True)
            dst_fd = self.store.child_dir_fd(new_parent, 0, create=True, checked=True)
            src_node = self.store.by_key.get((zone, src_st.st_dev, src_st.st_ino))
            dst_node = None
            if dst_st is not None:
                dst_node = self.store.by_key.get((zone, dst_st.st_dev, dst_st.st_ino))
            self.replies.changing(old_parent, new_parent, src_node, dst_node)
            self.store.rename(src_fd, name_old, dst_fd, name_new, flags)
            self._made_here(old_parent, name_old, dst_st if exchange else None)
            self._made_here(new_parent, name_new, src_st)
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

        self.gate.rename(
            ctx,
            old_parent,
            name_old,
            new_parent,
            name_new,
            rename,
            flags_ok=flags_ok,
            exchange=exchange,
            read=self._judged,
        )

    def _judged(
        self, parent: Node, name: bytes, expect: tuple[int, int] | None, limit: int
    ) -> bytes | None:
        """The content of parent/name (at most `limit` bytes) for the guard to judge a rename
        onto git's config or index (Guard._judge_config, Guard._judge_index). For the file
        renamed (`expect`: its (st_dev, st_ino)), every open handle stops writing first, so
        that what is judged is what stays: git closes its config.lock or index.lock before the
        rename, and a later write through a handle kept open (or a shared mapping) fails with
        EBADF."""
        if expect is not None:
            for handle in self._handles.values():
                if isinstance(handle, FileHandle) and handle.writable:
                    with contextlib.suppress(OSError):
                        held = os.fstat(handle.fd)
                        if (held.st_dev, held.st_ino) == expect:
                            handle.writable = False
        dir_fd = self.store.child_dir_fd(parent, 0, checked=True)
        return read_bounded(dir_fd, name, expect, limit)

    # ----- live trust changes (sandboxfs.project.control) ----------------------------------

    def set_trust(self, trust: Trust, pid: int, uid: int, context: Callable[[], bytes]) -> Trust:
        """Switch the mount to another trust level between two requests; returns the old one.
        The caller then has the kernel forget what it cached (see kernel_caches)."""
        old = self.guard.set_trust(trust)
        self.context_json = context()
        self._write_guides()
        self.replies.given.clear()
        detail = f"{old.value} -> {trust.value}"
        self.gate.effects.record(AuditOp.TRUST, None, None, pid=pid, uid=uid, detail=detail)
        self.gate.effects.audit.try_flush()
        return old

    def kernel_caches(self) -> tuple[list[int], list[tuple[int, bytes]]]:
        """Every inode and every name the kernel may hold, for invalidation."""
        inodes = list(self.store.nodes)
        names: list[tuple[int, bytes]] = []
        for node in self.store.nodes.values():
            if node.parent is not None:
                names.append((node.parent.ino, node.name))
            names.extend((parent.ino, name) for parent, name in node.links)
        return inodes, names

    # ----- extended attributes and statfs ---------------------------------------------------------

    @_guarded
    def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        node = self.store.get(inode)
        value = self.gate.getxattr(ctx, node, name, lambda: self.store.get_xattr(node, name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @_guarded
    def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        node = self.store.get(inode)

        def names() -> list[bytes]:
            return [n.encode("utf-8", "surrogateescape") for n in self.store.list_xattrs(node)]

        return self.gate.listxattr(ctx, node, names)

    @_guarded
    def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        node = self.store.get(inode)

        def change() -> None:
            self.replies.changing(node)
            if not self.store.set_xattr(node, name, value):
                raise SandboxError(errno.EPERM, "symlinks cannot carry extended attributes")

        self.gate.change_xattr(ctx, node, name, "setxattr", change)

    @_guarded
    def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        node = self.store.get(inode)

        def change() -> None:
            self.replies.changing(node)
            if not self.store.remove_xattr(node, name):
                raise SandboxError(pyfuse3.ENOATTR, "symlinks cannot carry extended attributes")

        self.gate.change_xattr(ctx, node, name, "removexattr", change)

    @_guarded
    def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = self.store.statvfs(Zone.REPO)
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


def _wrote(handle: FileHandle, off: int, written: int) -> int:
    """Count a write on its handle, and note pages it left partly written (see _release)."""
    handle.bytes_written += written
    if off % _PAGE_SIZE:
        handle.partial_pages = True
    elif (off + written) % _PAGE_SIZE:
        handle.ragged_end = True
    return written


@dataclass(frozen=True, slots=True)
class _Caller:
    pid: int
    uid: int
    gid: int


def _text(name: bytes) -> str:
    return name.decode("utf-8", "replace")


def _key_stamp(st: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file is written, for FileHandle.key_stamp."""
    return (st.st_mtime_ns, st.st_size, st.st_ctime_ns)
