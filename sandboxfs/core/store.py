"""Backing storage: every backing call a front end makes on the zones' entries.

Every name is resolved one component at a time from a directory descriptor with
`O_NOFOLLOW`, so neither a symlink planted in backing storage nor a `..` can lead the daemon
outside a zone's directory (see resolve). No backing call crosses a mount point (the
`find -xdev` rule): an entry that is the root of another mount — another sandboxfs, bindfs, a
tmpfs, a bind mount — is treated as absent, recognised without sending a request into it (see
`syscalls.lstat_at`), and every open refuses to cross one (`RESOLVE_NO_XDEV`).

The inode table and its numbers are inodes'; the quota's count of a zone is zone_usage's.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .errors import SandboxError
from .inodes import FIRST_DYNAMIC_INO, Identity, Node, StatLike, same_inode
from .policy import Zone
from .resolve import CONFINED_RESOLVE, Resolver
from .syscalls import Stat, caches_attributes, lstat_at, openat2, renameat2
from .zone_usage import tree_usage

R = TypeVar("R")

# The name of a project's state dir (sandboxfs's own, hidden by identity: see Store.lstat).
STATE_DIR_NAME = ".sandbox"
# The open flags passed on to a backing file. The kernel's FUSE OPEN carries internal bits
# too (__FMODE_EXEC for execve), which openat2 refuses with EINVAL where open(2) ignored them.
_OPEN_PASSED = (
    os.O_ACCMODE
    | os.O_APPEND
    | os.O_TRUNC
    | os.O_NONBLOCK
    | os.O_DSYNC
    | os.O_SYNC
    | os.O_NOATIME
    | os.O_EXCL
    | getattr(os, "O_LARGEFILE", 0)
)


# A listed entry: name, layer, backing inode number (d_ino), whether it is a directory.
Listed = tuple[bytes, int, int, bool]


class HiddenEntry(SandboxError):
    """A backing entry that is never part of a zone; it looks absent (ENOENT)."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.ENOENT, reason)


class Store(Resolver):
    """Zone directories, the inode table, and descriptor-relative operations on both."""

    def __init__(
        self,
        zone_dirs: dict[Zone, Path],
        worker_layers: list[Path],
        hidden: set[Identity],
        hidden_names: dict[bytes, set[Identity]] | None = None,
    ) -> None:
        self.hidden = hidden
        # name: the directories (identities) where an entry of that name is never shown,
        # whatever it is now (a login a home holds, replaced by its program while mounted).
        self.hidden_names = hidden_names or {}
        super().__init__(zone_dirs, worker_layers)
        # On FUSE or network storage a DONT_SYNC statx may be stale: stat again (with sync)
        # whatever is not a mount root.
        self.resync = any(
            caches_attributes(fd)
            for fd in [*self.layer_fds, *(n.fd for n in self.zone_roots.values())]
            if fd >= 0
        )

    # ----- backing operations --------------------------------------------------------------

    def stat_node(self, node: Node) -> StatLike:
        if node.open_fds:
            return os.stat(node.open_fds[-1])
        if node.fd >= 0:
            return os.stat(node.fd)
        st = self.lstat(self.parent_fd(node), node.name)
        if st is None or (node.key is not None and (st.st_dev, st.st_ino) != node.key[1:]):
            raise SandboxError(errno.ESTALE, "the entry moved or was replaced")
        return st

    def lstat(self, dir_fd: int, name: bytes) -> Stat | None:
        """lstat of a backing name, or None when it is missing.

        Raises HiddenEntry for an entry that is never part of a zone: the root of another
        mount (never entered) or sandboxfs's own state, recognised by identity so that a
        case-folding filesystem's `.SANDBOX` is hidden too.
        """
        try:
            st = lstat_at(dir_fd, name)
            if st.mount_root:
                raise HiddenEntry(
                    "it is the root of another mount; sandboxfs never crosses into other mounts"
                )
            if self.resync:  # the name is no mount root: a plain lstat cannot cross
                _refresh(st, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if self.hidden and (st.st_dev, st.st_ino) in self.hidden:
            raise HiddenEntry("it is sandboxfs's own state or mountpoint, not part of any zone")
        where = self.hidden_names.get(name)
        if where is not None:
            parent = os.fstat(dir_fd)
            if (parent.st_dev, parent.st_ino) in where:
                raise HiddenEntry("it is a login in a home made the project, not shown")
        return st

    def stat_child(self, parent: Node, name: bytes, layer: int = 0) -> Stat | None:
        """lstat of parent/name, or None when absent (see lstat)."""
        try:
            dir_fd = self.child_dir_fd(parent, layer)
        except NotADirectoryError:
            return None
        return self.lstat(dir_fd, name)

    def target(self, parent: Node, name: bytes) -> Stat | None:
        """lstat of a rename's or link's destination: in the workers root, the first
        (writable) layer."""
        return self.stat_child(parent, name, 0)

    def created(self, zone: Zone, st: StatLike) -> bool:
        """Whether the node known for st was created through this mount (the same inode and,
        where the filesystem keeps one, birth time)."""
        known = self.by_key.get((zone, st.st_dev, st.st_ino))
        return (
            known is not None
            and known.created_here
            and (not known.birth_ns or known.birth_ns == getattr(st, "st_birthtime_ns", 0))
        )

    def stat(self, node: Node) -> StatLike:
        return self.stat_node(node)

    def find(self, parent: Node, name: bytes) -> tuple[Stat, int] | None:
        """lstat of a name in a directory node and its layer; for the workers root, the first
        layer holding the name wins."""
        if parent.zone is Zone.WORKERS and parent.parent is self.root:
            for layer, fd in enumerate(self.layer_fds):
                if fd >= 0 and (st := self.lstat(fd, name)) is not None:
                    return st, layer
            return None
        st = self.stat_child(parent, name)
        return (st, parent.layer) if st is not None else None

    def usage(self, zone: Zone) -> tuple[int, int]:
        """(bytes of regular files, entries) below a zone's root, for quotas (see
        zone_usage)."""
        return tree_usage(self, self.zone_roots[zone].fd, self.hidden)

    def list_entries(self, node: Node) -> list[Listed]:
        """The entries of a directory node, sorted by name, with their layer; for the workers
        root, the union of its layers (each layer's names sorted, the first layer with a name
        winning)."""
        if node.zone is Zone.WORKERS and node.parent is self.root:
            seen: set[bytes] = set()
            union: list[Listed] = []
            for layer, fd in enumerate(self.layer_fds):
                if fd < 0:
                    continue
                dev = os.stat(fd).st_dev
                for name, ino, is_dir in self.allocating(_scan, fd):
                    if name not in seen and (dev, ino) not in self.hidden:
                        seen.add(name)
                        union.append((name, layer, ino, is_dir))
            return union
        fd = self.checked_dir_fd(node)
        dev = node.key[1] if node.key is not None else os.stat(fd).st_dev
        names: set[bytes] = set()
        if self.hidden_names:
            here = node.key[1:] if node.key is not None else None
            names = {n for n, where in self.hidden_names.items() if here in where}
        return [
            (name, node.layer, ino, is_dir)
            for name, ino, is_dir in self.allocating(_scan, fd)
            if (dev, ino) not in self.hidden and name not in names
        ]

    def open_path_fd(self, node: Node) -> int:
        """A fresh O_PATH descriptor of node itself (for xattrs), never following a symlink or
        crossing into a mount."""
        return self.allocating(
            openat2,
            self.parent_fd(node),
            node.name,
            os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
            0,
            CONFINED_RESOLVE,
        )

    def open_file(self, node: Node, flags: int) -> int:
        """Open node's backing file by name, checked to still be node's regular file (see
        open_file_stat)."""
        return self.open_file_stat(node, flags)[0]

    def open_file_stat(self, node: Node, flags: int) -> tuple[int, os.stat_result]:
        """Open node's backing file by name, checked to still be node's regular file; the
        descriptor and the fstat that checked it (the FUSE adapter's open needs it too).

        The name may have been replaced outside the mount since the kernel cached it, by a
        FIFO (whose open would block the whole daemon) or by another file. O_NONBLOCK keeps
        the open from waiting; the fstat then compares the identity; a mismatch is ESTALE,
        which makes the kernel look the path up again (and open a FIFO itself). O_NONBLOCK
        stays set: a regular file ignores it for reads and writes, and where a lease would
        make the open wait, failing is what the daemon wants.
        """
        parent_fd = self.parent_fd(node, checked=True)
        # Never open anything but node's regular file: not even with O_NONBLOCK, since
        # opening a device can act on it. The fstat below catches a swap after this check.
        found = self.lstat(parent_fd, node.name)
        if found is not None and same_inode(node, found) and stat.S_ISLNK(found.st_mode):
            raise SandboxError(errno.ELOOP, "a symlink is never followed")
        if found is None or not stat.S_ISREG(found.st_mode) or not same_inode(node, found):
            raise SandboxError(errno.ESTALE, "the file moved or was replaced")
        fd = self.allocating(
            openat2,
            parent_fd,
            node.name,
            (flags & _OPEN_PASSED) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            0,
            CONFINED_RESOLVE,
        )
        try:
            st = os.stat(fd)
            if not stat.S_ISREG(st.st_mode) or not same_inode(node, st):
                raise SandboxError(errno.ESTALE, "the file moved or was replaced")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def create_file(self, dir_fd: int, name: bytes, flags: int, mode: int) -> int:
        """Create (or, without O_EXCL, open) a regular file, never through a mount point."""
        fd = self.allocating(
            openat2,
            dir_fd,
            name,
            (flags & _OPEN_PASSED) | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            mode,
            CONFINED_RESOLVE,
        )
        try:
            if not stat.S_ISREG(os.stat(fd).st_mode):  # a FIFO or device raced in: look again
                raise SandboxError(errno.ESTALE, "not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    # ----- changing entries: every backing call a front end makes once the guard allowed it --

    def reopen(self, node: Node, flags: int) -> int:
        """A new descriptor of node's file, through an open one if there is one."""
        if node.open_fds:
            return self.allocating(
                os.open, f"/proc/self/fd/{node.open_fds[-1]}", flags | os.O_CLOEXEC
            )
        return self.open_file(node, flags)

    def change_meta(
        self,
        node: Node,
        mode: int | None = None,
        owner: tuple[int, int] | None = None,
        times: tuple[int, int] | None = None,
    ) -> None:
        """chmod, chown and utime of node: through an open descriptor when there is one (it
        still works after the name was unlinked or replaced), else by parent + name, checked
        to still be node's."""
        target: int | bytes
        how: dict[str, Any] = {}
        if node.open_fds:
            target = node.open_fds[-1]
        else:
            how = {"dir_fd": self.parent_fd(node, checked=True), "follow_symlinks": False}
            self.stat_node(node)  # the name must still be node's (ESTALE otherwise)
            target = node.name
        if mode is not None:
            os.chmod(target, mode, **how)
        if owner is not None:
            os.chown(target, *owner, **how)
        if times is not None:
            os.utime(target, ns=times, **how)

    def readlink(self, node: Node) -> bytes:
        return os.readlink(node.name, dir_fd=self.parent_fd(node))

    def give(self, dir_fd: int, name: bytes, uid: int, gid: int) -> None:
        """Make a new entry the caller's, as the kernel would on a local filesystem."""
        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    def make_dir(self, dir_fd: int, name: bytes, mode: int) -> None:
        os.mkdir(name, mode, dir_fd=dir_fd)

    def make_symlink(self, dir_fd: int, name: bytes, target: bytes) -> None:
        os.symlink(target, name, dir_fd=dir_fd)

    def make_node(self, dir_fd: int, name: bytes, mode: int) -> None:
        os.mknod(name, mode, dir_fd=dir_fd)

    def link_source(self, node: Node) -> int:
        """The descriptor of the directory holding node's name, checked to still lead to node
        (ESTALE otherwise): what `link` needs, found with the daemon's own identity (the walk
        from the zone root passes directories a caller may not search)."""
        src_fd = self.parent_fd(node, checked=True)
        self.stat_node(node)
        return src_fd

    def link(self, src_fd: int, name: bytes, dir_fd: int, new_name: bytes) -> None:
        """A second name, dir_fd/new_name, for src_fd/name (see link_source)."""
        os.link(name, new_name, src_dir_fd=src_fd, dst_dir_fd=dir_fd, follow_symlinks=False)

    def remove(self, dir_fd: int, name: bytes, is_dir: bool) -> None:
        (os.rmdir if is_dir else os.unlink)(name, dir_fd=dir_fd)

    def rename(self, src_fd: int, old: bytes, dst_fd: int, new: bytes, flags: int) -> None:
        renameat2(src_fd, old, dst_fd, new, flags)

    def fsync_dir(self, node: Node) -> None:
        dir_fd = self.dir_fd(node)
        fd = self.allocating(
            os.open, b".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd
        )
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def statvfs(self, zone: Zone) -> os.statvfs_result:
        return os.statvfs(self.zone_roots[zone].fd)

    def read_whole(self, fd: int, limit: int) -> tuple[bytes, os.stat_result] | None:
        """The whole content of an open file of at most `limit` bytes, read through a new
        read-only descriptor; None when it is larger, unreadable or changed while read."""
        try:
            rfd = self.allocating(os.open, f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # e.g. a write-only file the daemon may not read
        try:
            st = os.fstat(rfd)
            if st.st_size > limit:
                return None
            data = os.pread(rfd, st.st_size, 0)
            return (data, st) if len(data) == st.st_size else None
        except OSError:
            return None
        finally:
            os.close(rfd)

    # ----- extended attributes ------------------------------------------------------------

    def get_xattr(self, node: Node, name: bytes) -> bytes | None:
        """node's attribute `name`; None for symlinks and virtual nodes, which carry none."""
        return self._with_xattr_path(node, lambda path: os.getxattr(path, name), None)

    def list_xattrs(self, node: Node) -> list[str]:
        return self._with_xattr_path(node, os.listxattr, [])

    def set_xattr(self, node: Node, name: bytes, value: bytes) -> bool:
        """False for a node that carries no attributes (a symlink)."""

        def put(path: str) -> bool:
            os.setxattr(path, name, value)
            return True

        return self._with_xattr_path(node, put, False)

    def remove_xattr(self, node: Node, name: bytes) -> bool:
        def remove(path: str) -> bool:
            os.removexattr(path, name)
            return True

        return self._with_xattr_path(node, remove, False)

    def _with_xattr_path(self, node: Node, fn: Callable[[str], R], missing: R) -> R:
        """fn of a /proc path to node (via an O_PATH descriptor), or `missing` for symlinks
        and virtual nodes."""
        if node.zone is None or (node.key is None and node.ino < FIRST_DYNAMIC_INO):
            return missing
        fd = -1
        if node.open_fds:
            path = f"/proc/self/fd/{node.open_fds[-1]}"
        elif node.is_dir:
            path = f"/proc/self/fd/{self.dir_fd(node)}"
        else:
            fd = self.open_path_fd(node)
            if stat.S_ISLNK(os.stat(fd).st_mode):
                os.close(fd)
                return missing
            path = f"/proc/self/fd/{fd}"
        try:
            return fn(path)
        finally:
            if fd >= 0:
                os.close(fd)


def _scan(fd: int) -> list[tuple[bytes, int, bool]]:
    """(name, inode number, is a directory) of each entry, sorted by name.

    O_PATH descriptors cannot be read. Reopen the directory through /proc rather than as "."
    relative to itself, which would need its x bit (natively, listing needs only r). A bytes
    path gives the names' exact bytes.
    """
    with os.scandir(b"/proc/self/fd/%d" % fd) as entries:
        found = [(e.name, e.inode(), e.is_dir(follow_symlinks=False)) for e in entries]
    found.sort()
    return found


def _refresh(st: Stat, fresh: os.stat_result) -> None:
    """Copy what may have been stale into a DONT_SYNC statx result."""
    for field in (
        "st_mode",
        "st_nlink",
        "st_uid",
        "st_gid",
        "st_size",
        "st_blocks",
        "st_atime_ns",
        "st_mtime_ns",
        "st_ctime_ns",
    ):
        setattr(st, field, getattr(fresh, field))
