"""A case-insensitive, case-preserving passthrough FUSE filesystem, for tests.

    python tests/integration/casefold_fs.py SOURCE MOUNTPOINT

mirrors SOURCE at MOUNTPOINT the way ext4 casefold or vfat treat names: a name finds an entry
that differs from it only in case (an exact match is preferred), creating a name that exists in
another case opens or refuses the existing entry, and listings show names as they were created.
Names are compared canonically caseless (NFD, case-folded), as ext4 casefold does.

FUSE inode numbers are the backing inode numbers (the root's and 1 swap places), so every
spelling of a name, and every hard link, is the same inode. Runs in the foreground, prints
nothing, and unmounts on SIGTERM or SIGINT.

Test infrastructure, simple rather than fast: nothing is cached by the kernel (every name is
looked up again), requests are served one at a time, and SOURCE must be one filesystem (inode
numbers of two filesystems could collide).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import stat
import sys
import unicodedata
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_STAT_FIELDS = (
    "st_mode",
    "st_nlink",
    "st_uid",
    "st_gid",
    "st_rdev",
    "st_size",
    "st_blksize",
    "st_blocks",
    "st_atime_ns",
    "st_mtime_ns",
    "st_ctime_ns",
)
_NOT_FOR_OPEN = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_DIRECT

Op = TypeVar("Op", bound=Callable[..., Coroutine[Any, Any, Any]])


def errors_as_replies(fn: Op) -> Op:
    """Answer an OSError of the backing filesystem with its errno (instead of ending the loop)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

    return wrapper  # type: ignore[return-value]


def fold(name: str) -> str:
    """The form in which two names are compared: canonical caseless (NFD, case-folded, NFD)."""
    nfd = unicodedata.normalize("NFD", name)
    return unicodedata.normalize("NFD", nfd.casefold())


def fail(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)


class CaseFoldFS(pyfuse3.Operations):  # type: ignore[misc]
    """The operations; each entry is reached by the backing path last seen for its inode."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = os.path.abspath(source)
        self.root_ino = os.lstat(self.source).st_ino
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: self.source}
        self.files: dict[int, int] = {}  # file handle (the backing descriptor) -> inode
        self.dirs: dict[int, tuple[str, list[str]]] = {}  # directory handle -> (path, names)
        self.next_dir = 1

    # ----- names, paths and attributes -------------------------------------------------------

    def inode_of(self, st: os.stat_result) -> int:
        """The FUSE inode of a backing entry: its inode number, the root's swapped with 1."""
        root = int(pyfuse3.ROOT_INODE)
        if st.st_ino == self.root_ino:
            return root
        return self.root_ino if st.st_ino == root else st.st_ino

    def attributes(self, st: os.stat_result) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        for name in _STAT_FIELDS:
            setattr(attr, name, getattr(st, name))
        attr.st_ino = self.inode_of(st)
        attr.entry_timeout = 0
        attr.attr_timeout = 0
        return attr

    def remember(self, path: str) -> pyfuse3.EntryAttributes:
        """The attributes of `path`, noted as the way to its inode."""
        attr = self.attributes(os.lstat(path))
        self.paths[attr.st_ino] = path
        return attr

    def path_of(self, inode: int) -> str:
        """The backing path of `inode`, checked to still lead to it."""
        path = self.paths.get(inode)
        if path is None:
            raise fail(errno.ESTALE)
        try:
            if self.inode_of(os.lstat(path)) == inode:
                return path
        except FileNotFoundError:
            pass
        raise fail(errno.ESTALE)

    def find(self, dir_path: str, name: bytes) -> str | None:
        """The backing path of the entry of `dir_path` that `name` names, if there is one."""
        text = os.fsdecode(name)
        exact = os.path.join(dir_path, text)
        if os.path.lexists(exact):
            return exact
        key = fold(text)
        for entry in sorted(os.listdir(dir_path)):
            if fold(entry) == key:
                return os.path.join(dir_path, entry)
        return None

    def new_name(self, parent: int, name: bytes) -> str:
        """The backing path for a new entry `name` in `parent`; EEXIST if it exists in any case."""
        dir_path = self.path_of(parent)
        if self.find(dir_path, name) is not None:
            raise fail(errno.EEXIST)
        return os.path.join(dir_path, os.fsdecode(name))

    def created(self, path: str, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """A new entry belongs to the caller (when this server may give it away)."""
        if os.geteuid() == 0:
            os.chown(path, ctx.uid, ctx.gid, follow_symlinks=False)
        return self.remember(path)

    # ----- attributes ------------------------------------------------------------------------

    @errors_as_replies
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self.find(self.path_of(parent_inode), name)
        if path is None:
            raise fail(errno.ENOENT)
        return self.remember(path)

    @errors_as_replies
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            return self.attributes(os.lstat(self.path_of(inode)))
        except pyfuse3.FUSEError:
            for fd, ino in self.files.items():  # unlinked while open
                if ino == inode:
                    return self.attributes(os.fstat(fd))
            raise

    @errors_as_replies
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        path = self.path_of(inode) if fh is None else None
        target: Any = fh if path is None else path
        follow = path is None  # symbolic links are changed themselves; a descriptor is a file
        if fields.update_size:
            os.truncate(target, attr.st_size)
        if fields.update_mode:
            if path is not None and stat.S_ISLNK(os.lstat(path).st_mode):
                raise fail(errno.EOPNOTSUPP)
            os.chmod(target, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            os.chown(target, uid, gid, follow_symlinks=follow)
        if fields.update_atime or fields.update_mtime:
            st = os.stat(target, follow_symlinks=follow)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            os.utime(target, ns=(atime, mtime), follow_symlinks=follow)
        return self.attributes(os.stat(target, follow_symlinks=follow))

    @errors_as_replies
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.source)
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail"):
            setattr(data, name, getattr(st, name))
        for name in ("f_files", "f_ffree", "f_favail", "f_namemax"):
            setattr(data, name, getattr(st, name))
        return data

    # ----- directories -----------------------------------------------------------------------

    @errors_as_replies
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self.path_of(inode)
        handle, self.next_dir = self.next_dir, self.next_dir + 1
        self.dirs[handle] = (path, sorted(os.listdir(path)))
        return handle

    @errors_as_replies
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path, names = self.dirs[fh]
        for index in range(start_id, len(names)):
            try:
                attr = self.remember(os.path.join(path, names[index]))
            except FileNotFoundError:
                continue  # removed since the directory was opened
            if not pyfuse3.readdir_reply(token, os.fsencode(names[index]), attr, index + 1):
                break

    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    @errors_as_replies
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self.new_name(parent_inode, name)
        os.mkdir(path, mode)
        return self.created(path, ctx)

    @errors_as_replies
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self.new_name(parent_inode, name)
        os.mknod(path, mode, rdev)
        return self.created(path, ctx)

    @errors_as_replies
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self.new_name(parent_inode, name)
        os.symlink(target, os.fsencode(path))
        return self.created(path, ctx)

    @errors_as_replies
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return os.readlink(os.fsencode(self.path_of(inode)))

    @errors_as_replies
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        source = self.path_of(inode)
        path = self.new_name(new_parent_inode, new_name)
        os.link(source, path, follow_symlinks=False)
        return self.remember(path)

    @errors_as_replies
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self.find(self.path_of(parent_inode), name)
        if path is None:
            raise fail(errno.ENOENT)
        os.unlink(path)

    @errors_as_replies
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self.find(self.path_of(parent_inode), name)
        if path is None:
            raise fail(errno.ENOENT)
        os.rmdir(path)

    @errors_as_replies
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        old = self.find(self.path_of(parent_inode_old), name_old)
        if old is None:
            raise fail(errno.ENOENT)
        new_dir = self.path_of(parent_inode_new)
        existing = self.find(new_dir, name_new)
        if existing == old:  # the same entry in another case: only its spelling changes
            new = os.path.join(new_dir, os.fsdecode(name_new))
            if new == old:
                return
            if flags & pyfuse3.RENAME_EXCHANGE:
                raise fail(errno.EINVAL)
            flags &= ~pyfuse3.RENAME_NOREPLACE
        else:
            # onto an existing entry: it is replaced and keeps its spelling, as in ext4 casefold
            new = existing if existing is not None else os.path.join(new_dir, os.fsdecode(name_new))
        if _libc.renameat2(_AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), flags):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        self.moved(old, new, exchanged=bool(flags & pyfuse3.RENAME_EXCHANGE))

    def moved(self, old: str, new: str, exchanged: bool) -> None:
        """Point the remembered paths below `old` (and `new`, when exchanged) at their new place."""
        swaps = [(old, new), (new, old)] if exchanged else [(old, new)]
        for inode, path in list(self.paths.items()):
            for src, dst in swaps:
                if path == src or path.startswith(src + os.sep):
                    self.paths[inode] = dst + path[len(src) :]
                    break

    # ----- files -----------------------------------------------------------------------------

    def opened(self, fd: int) -> pyfuse3.FileInfo:
        self.files[fd] = self.inode_of(os.fstat(fd))
        return pyfuse3.FileInfo(fh=fd)

    @errors_as_replies
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        return self.opened(os.open(self.path_of(inode), flags & ~_NOT_FOR_OPEN | os.O_NOFOLLOW))

    @errors_as_replies
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        dir_path = self.path_of(parent_inode)
        existing = self.find(dir_path, name)
        if existing is not None and flags & os.O_EXCL:
            raise fail(errno.EEXIST)
        flags &= ~_NOT_FOR_OPEN
        if existing is not None:
            info = self.opened(os.open(existing, flags | os.O_NOFOLLOW))
            return info, self.remember(existing)
        path = os.path.join(dir_path, os.fsdecode(name))
        info = self.opened(os.open(path, flags | os.O_CREAT | os.O_EXCL, stat.S_IMODE(mode)))
        return info, self.created(path, ctx)

    @errors_as_replies
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    @errors_as_replies
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return os.pwrite(fh, buf, off)

    async def flush(self, fh: int) -> None:
        pass

    @errors_as_replies
    async def fsync(self, fh: int, datasync: bool) -> None:
        (os.fdatasync if datasync else os.fsync)(fh)

    @errors_as_replies
    async def release(self, fh: int) -> None:
        self.files.pop(fh, None)
        os.close(fh)

    # ----- extended attributes (passed through) ----------------------------------------------

    @errors_as_replies
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return os.getxattr(self.path_of(inode), os.fsdecode(name), follow_symlinks=False)

    @errors_as_replies
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        names = os.listxattr(self.path_of(inode), follow_symlinks=False)
        return [os.fsencode(name) for name in names]

    @errors_as_replies
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        os.setxattr(self.path_of(inode), os.fsdecode(name), value, follow_symlinks=False)

    @errors_as_replies
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        os.removexattr(self.path_of(inode), os.fsdecode(name), follow_symlinks=False)


async def serve() -> None:
    """Answer requests until SIGTERM or SIGINT."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def stop_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def main(argv: Sequence[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} SOURCE MOUNTPOINT", file=sys.stderr)
        return 2
    os.umask(0)  # the kernel has applied the caller's umask to every mode it sends
    operations = CaseFoldFS(argv[1])
    pyfuse3.init(operations, argv[2], {"fsname=casefold", "default_permissions"})
    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
