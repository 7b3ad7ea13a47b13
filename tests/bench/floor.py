#!/usr/bin/env python3
"""The floor of sandboxfs's stack: a pyfuse3 passthrough that checks, audits and caches nothing.

    python tests/bench/floor.py SOURCE MOUNTPOINT [--spin US]

It serves SOURCE at MOUNTPOINT in the foreground until unmounted, the way sandboxfs's daemon
serves a zone: pyfuse3 on trio, one request task, sandboxfs's request wait (polling `--spin`
microseconds before it sleeps, sandboxfs's default 100), the same mount options
(`default_permissions`, `nosuid`, `nodev`, no writeback cache), the same kernel cache timeouts
and FLUSH answered ENOSYS. Each handler is the least that serves the request: one backing
system call and the attributes. What a workload costs here and not natively is the price of the
stack itself (the kernel's round trips, pyfuse3, trio, the interpreter); what sandboxfs costs
above it is its own work. `bench.py --floor` runs it as a peer in the same run.

Not part of sandboxfs and not a test: inode numbers are the backing ones and paths are kept per
inode (a renamed directory's descendants are rewritten), good for benchmarks, not for users.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from sandboxfs.fuse import request_wait  # the daemon's own wait

TIMEOUT = 10.0  # cache.entry_timeout and cache.attr_timeout of sandboxfs's defaults
R = TypeVar("R")


class Floor(pyfuse3.Operations):  # type: ignore[misc]
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, source: str) -> None:
        super().__init__()
        self.root_ino = os.lstat(source).st_ino
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: source}
        self.dirs: dict[int, tuple[int, list[str]]] = {}  # opendir handle: inode, listing
        self.next_fh = 0

    def _attrs(self, st: os.stat_result, path: str) -> pyfuse3.EntryAttributes:
        ino = pyfuse3.ROOT_INODE if st.st_ino == self.root_ino else st.st_ino
        self.paths[ino] = path
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = TIMEOUT
        a.st_mode, a.st_nlink, a.st_uid, a.st_gid = st.st_mode, st.st_nlink, st.st_uid, st.st_gid
        a.st_rdev, a.st_size, a.st_blksize = st.st_rdev, st.st_size, st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        return a

    def _path(self, ino: int, name: bytes | None = None) -> str:
        path = self.paths[ino]
        return path if name is None else os.path.join(path, os.fsdecode(name))

    def _entry(self, path: str) -> pyfuse3.EntryAttributes:
        return self._attrs(_call(os.lstat, path), path)

    async def lookup(self, parent: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        path = self._path(parent, name)
        try:
            return self._attrs(os.lstat(path), path)
        except FileNotFoundError:
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = TIMEOUT
            return negative

    async def getattr(self, ino: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._entry(self._path(ino))

    async def setattr(
        self, ino: int, attr: Any, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        path = self._path(ino)
        if fields.update_size:
            _call(os.truncate, path, attr.st_size)
        if fields.update_mode:
            _call(os.chmod, path, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            _call(os.lchown, path, uid, gid)
        if fields.update_atime or fields.update_mtime:
            st = _call(os.lstat, path)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            _call(lambda: os.utime(path, ns=(atime, mtime), follow_symlinks=False))
        return self._entry(path)

    async def readlink(self, ino: int, ctx: Any) -> bytes:
        return os.fsencode(_call(os.readlink, self._path(ino)))

    async def opendir(self, ino: int, ctx: Any) -> int:
        self.next_fh += 1
        self.dirs[self.next_fh] = (ino, [])
        return self.next_fh

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        ino, names = self.dirs[fh]
        path = self._path(ino)
        if start_id == 0:  # listed once per opendir, as sandboxfs does
            names[:] = sorted(_call(os.listdir, path))
        for index in range(start_id, len(names)):
            child = os.path.join(path, names[index])
            try:
                st = os.lstat(child)
            except OSError:
                continue
            attrs = self._attrs(st, child)
            if not pyfuse3.readdir_reply(token, os.fsencode(names[index]), attrs, index + 1):
                return

    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Any) -> Any:
        path = self._path(parent, name)
        _call(os.mkdir, path, mode)
        return self._entry(path)

    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: Any) -> Any:
        path = self._path(parent, name)
        _call(os.symlink, target, path)
        return self._entry(path)

    async def link(self, ino: int, new_parent: int, new_name: bytes, ctx: Any) -> Any:
        path = self._path(new_parent, new_name)
        _call(os.link, self._path(ino), path)
        return self._entry(path)

    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        _call(os.unlink, self._path(parent, name))

    async def rmdir(self, parent: int, name: bytes, ctx: Any) -> None:
        _call(os.rmdir, self._path(parent, name))

    async def rename(
        self, old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int, ctx: Any
    ) -> None:
        src, dst = self._path(old_parent, old), self._path(new_parent, new)
        st = _call(os.lstat, src)
        _call(os.rename, src, dst)
        self.paths[st.st_ino] = dst
        if stat.S_ISDIR(st.st_mode):
            prefix = src + "/"
            for ino, path in list(self.paths.items()):
                if path.startswith(prefix):
                    self.paths[ino] = dst + path[len(src) :]

    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._path(parent, name)
        fd = _call(os.open, path, flags | os.O_CREAT, mode)
        return pyfuse3.FileInfo(fh=fd), self._attrs(os.fstat(fd), path)

    async def open(self, ino: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        fd = _call(os.open, self._path(ino), flags & ~os.O_CREAT)
        return pyfuse3.FileInfo(fh=fd, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return _call(os.pread, fh, size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return _call(os.pwrite, fh, buf, off)

    async def flush(self, fh: int) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)  # as sandboxfs: no FLUSH round trip per close

    async def fsync(self, fh: int, datasync: bool) -> None:
        _call(os.fdatasync if datasync else os.fsync, fh)

    async def release(self, fh: int) -> None:
        os.close(fh)

    async def getxattr(self, ino: int, name: bytes, ctx: Any) -> bytes:
        path = self._path(ino)
        return _call(lambda: os.getxattr(path, os.fsdecode(name), follow_symlinks=False))

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.paths[pyfuse3.ROOT_INODE])
        out = pyfuse3.StatvfsData()
        for field in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files"):
            setattr(out, field, getattr(st, field))
        out.f_ffree, out.f_favail, out.f_namemax = st.f_ffree, st.f_favail, st.f_namemax
        return out

    def forget(self, inode_list: Any) -> None:
        pass


def _call(fn: Callable[..., R], *args: Any) -> R:
    try:
        return fn(*args)
    except OSError as exc:
        raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--spin", type=float, default=100.0, help="µs (sandboxfs's daemon.spin_us)")
    args = ap.parse_args()
    os.umask(0)  # as the daemon: modes arrive already masked by the kernel
    options = set(pyfuse3.default_options)
    options |= {"fsname=floor", "subtype=floor", "nosuid", "nodev", "default_permissions"}
    pyfuse3.init(Floor(os.path.abspath(args.source)), args.mountpoint, options)

    async def serve() -> None:
        request_wait.install(args.spin / 1e6)
        await pyfuse3.main(min_tasks=1, max_tasks=1)

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
