"""The file callbacks: opening and creating files, reading, writing, syncing, releasing.

Each open file is a `FileHandle` (or a `BlobHandle` for the mount's own documents); what a
handle wrote decides, on release, what the kernel's page cache may keep of the file.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import pyfuse3

from sandboxfs.core.context import confined_context
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.inodes import CONTEXT_INO, GUIDE_INO, Node
from sandboxfs.core.syscalls import Stat, fstat
from sandboxfs.fuse.handles import BlobHandle, FileHandle
from sandboxfs.fuse.ops_base import OperationsBase, guarded

__all__ = ["FileOperations"]

log = logging.getLogger("sandboxfs.fuse.operations")  # the name the mount's log has always shown

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Files up to this size are handed to the kernel's page cache whole after a write that left
# pages partly written (see _release); larger ones are re-read by the next reader instead.
_KERNEL_STORE_LIMIT = 256 << 10
_OPEN_STRIP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_DIRECT


class FileOperations(OperationsBase):
    """OPEN, CREATE, READ, WRITE, FLUSH, FSYNC and RELEASE (a mixin of SandboxOperations)."""

    @guarded
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

    @guarded
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

    @guarded
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

    @guarded
    def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handles[fh]
        if isinstance(handle, FileHandle):
            (os.fdatasync if datasync else os.fsync)(handle.fd)

    @guarded
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

    @guarded
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


def _wrote(handle: FileHandle, off: int, written: int) -> int:
    """Count a write on its handle, and note pages it left partly written (see _release)."""
    handle.bytes_written += written
    if off % _PAGE_SIZE:
        handle.partial_pages = True
    elif (off + written) % _PAGE_SIZE:
        handle.ragged_end = True
    return written


def _key_stamp(st: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file is written, for FileHandle.key_stamp."""
    return (st.st_mtime_ns, st.st_size, st.st_ctime_ns)
