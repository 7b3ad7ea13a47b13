"""The pyfuse3 adapter: a translator between FUSE callbacks and the core.

Each callback resolves inodes to store nodes, calls the gate's method for its operation
(sandboxfs.core.gate: the rules in their order, limits, the audit entry) with the backing call
to make as the caller, and answers the kernel: attribute replies (sandboxfs.fuse.replies),
handles, lookup counts, the kernel's page cache. It decides nothing and builds no audit entry
itself.

By concern: the guard and the shared state in sandboxfs.fuse.ops_base, the handles in
sandboxfs.fuse.handles, the file callbacks in sandboxfs.fuse.file_ops, the directory ones in
sandboxfs.fuse.dir_ops; names, attributes, entries, extended attributes and trust changes here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

import pyfuse3

from sandboxfs.core.entry import AuditOp
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.gitconfig import read_bounded
from sandboxfs.core.inodes import CONTROL_INO, ROOT_INO, Node, StatLike
from sandboxfs.core.policy import Trust, Zone
from sandboxfs.core.syscalls import Stat
from sandboxfs.fuse.dir_ops import DirectoryOperations
from sandboxfs.fuse.file_ops import FileOperations
from sandboxfs.fuse.handles import FileHandle
from sandboxfs.fuse.ops_base import guarded

__all__ = ["SandboxOperations"]

log = logging.getLogger(__name__)


class SandboxOperations(FileOperations, DirectoryOperations):
    """Translate FUSE callbacks into policy checks, store operations and audit entries."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    # The kernel caches and enforces POSIX ACLs itself (with default_permissions) instead of
    # asking the daemon for them on every `ls -l`; the ACLs live on the backing files.
    enable_acl = True

    # ----- lookup and attributes ------------------------------------------------------------------

    @guarded
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

    @guarded
    def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        node = self.store.get(inode)
        self.gate.getattr(ctx, node)
        return self.replies.node_attrs(node)

    @guarded
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

    @guarded
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

    # ----- creating entries -----------------------------------------------------------------------

    def _own(self, path_fd: int, name: bytes, ctx: Any) -> None:
        """Give a new entry to the caller, as the kernel would on a local filesystem."""
        if self.running_as_root and (ctx.uid != 0 or ctx.gid != 0):
            self.store.give(path_fd, name, ctx.uid, ctx.gid)

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

    @guarded
    def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int, new_mode: int) -> None:
            self.store.make_dir(dfd, name, stat.S_IMODE(new_mode))

        return self._make_entry(ctx, parent, name, "mkdir", make, stat.S_IFDIR | stat.S_IMODE(mode))

    @guarded
    def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int, new_mode: int) -> None:
            self.store.make_symlink(dfd, name, target)

        return self._make_entry(ctx, parent, name, "symlink", make)

    @guarded
    def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        parent = self.store.get(parent_inode)

        def make(dfd: int, new_mode: int) -> None:
            self.store.make_node(dfd, name, new_mode)

        return self._make_entry(ctx, parent, name, "mknod", make, mode)

    @guarded
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

    @guarded
    def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._remove(ctx, parent_inode, name, rmdir=False)

    @guarded
    def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._remove(ctx, parent_inode, name, rmdir=True)

    @guarded
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

    @guarded
    def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        node = self.store.get(inode)
        value = self.gate.getxattr(ctx, node, name, lambda: self.store.get_xattr(node, name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @guarded
    def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        node = self.store.get(inode)

        def names() -> list[bytes]:
            return [n.encode("utf-8", "surrogateescape") for n in self.store.list_xattrs(node)]

        return self.gate.listxattr(ctx, node, names)

    @guarded
    def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        node = self.store.get(inode)

        def change() -> None:
            self.replies.changing(node)
            if not self.store.set_xattr(node, name, value):
                raise SandboxError(errno.EPERM, "symlinks cannot carry extended attributes")

        self.gate.change_xattr(ctx, node, name, "setxattr", change)

    @guarded
    def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        node = self.store.get(inode)

        def change() -> None:
            self.replies.changing(node)
            if not self.store.remove_xattr(node, name):
                raise SandboxError(pyfuse3.ENOATTR, "symlinks cannot carry extended attributes")

        self.gate.change_xattr(ctx, node, name, "removexattr", change)

    @guarded
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
