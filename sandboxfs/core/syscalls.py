"""The Linux system calls the os module does not offer, through ctypes.

`statx` and `openat2` are how the daemon touches backing storage without ever entering another
mount: `statx(AT_STATX_DONT_SYNC)` reports `STATX_ATTR_MOUNT_ROOT` without sending a request into
a FUSE mount, and `openat2(RESOLVE_NO_XDEV | RESOLVE_BENEATH)` refuses to cross a mount point or
to leave the directory it starts from. The rest are small: `renameat2`, `setfsuid`/`setfsgid`,
dropping one capability from the effective set, `prctl(PR_SET_DUMPABLE)` and inotify.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any

# The C library the interpreter runs on (dlopen(NULL)), as run.py and seccomp.py take it:
# ctypes.util.find_library would run `ldconfig -p` in a subprocess at every start-up.
_libc = ctypes.CDLL(None, use_errno=True)

# Without argtypes ctypes converts int and bytes arguments itself, which is cheaper per call.
_statx: Any = _libc.statx
_syscall: Any = _libc.syscall
_renameat2: Any = _libc.renameat2
_setfsuid: Any = _libc.setfsuid
_setfsgid: Any = _libc.setfsgid
_prctl: Any = _libc.prctl
_inotify_init1: Any = _libc.inotify_init1
_inotify_add_watch: Any = _libc.inotify_add_watch
_inotify_rm_watch: Any = _libc.inotify_rm_watch

AT_SYMLINK_NOFOLLOW = 0x100
AT_NO_AUTOMOUNT = 0x800
AT_EMPTY_PATH = 0x1000
AT_STATX_DONT_SYNC = 0x4000
_STATX_BASIC_STATS = 0x7FF
_STATX_BTIME = 0x800
_STATX_ATTR_MOUNT_ROOT = 0x2000
_LSTAT_FLAGS = AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT | AT_STATX_DONT_SYNC
_LSTAT_MASK = _STATX_BASIC_STATS | _STATX_BTIME

# struct statx up to stx_mnt_id (the rest of its 256 bytes is not needed here).
_STATX = struct.Struct("=IIQIIIHxxQQQQqIxxxxqIxxxxqIxxxxqIxxxxIIIIQ")
_statx_buf = ctypes.create_string_buffer(256)
_devices: dict[tuple[int, int], int] = {}

_SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class Stat:
    """The lstat fields sandboxfs uses, from statx: os.stat_result's names, plus birth time and
    whether the entry is the root of a mount (which the daemon never enters)."""

    __slots__ = (
        "mount_root",
        "st_atime_ns",
        "st_birthtime_ns",
        "st_blksize",
        "st_blocks",
        "st_ctime_ns",
        "st_dev",
        "st_gid",
        "st_ino",
        "st_mode",
        "st_mtime_ns",
        "st_nlink",
        "st_rdev",
        "st_size",
        "st_uid",
    )

    def __init__(self, raw: tuple[int, ...], dev: int) -> None:
        (
            _mask,
            self.st_blksize,
            attributes,
            self.st_nlink,
            self.st_uid,
            self.st_gid,
            self.st_mode,
            self.st_ino,
            self.st_size,
            self.st_blocks,
            _attributes_mask,
            a_sec,
            a_nsec,
            b_sec,
            b_nsec,
            c_sec,
            c_nsec,
            m_sec,
            m_nsec,
            r_major,
            r_minor,
            _d_major,
            _d_minor,
            _mnt_id,
        ) = raw
        self.st_dev = dev
        self.st_atime_ns = a_sec * 1_000_000_000 + a_nsec
        self.st_mtime_ns = m_sec * 1_000_000_000 + m_nsec
        self.st_ctime_ns = c_sec * 1_000_000_000 + c_nsec
        self.st_birthtime_ns = b_sec * 1_000_000_000 + b_nsec
        self.st_rdev = os.makedev(r_major, r_minor) if r_major or r_minor else 0
        self.mount_root = bool(attributes & _STATX_ATTR_MOUNT_ROOT)


def lstat_at(dir_fd: int, name: bytes, flags: int = _LSTAT_FLAGS) -> Stat:
    """lstat of `name` in `dir_fd`, never waiting on another filesystem.

    AT_STATX_DONT_SYNC makes FUSE (and network filesystems) answer from what the kernel already
    holds instead of asking their server: a mount root inside a zone is recognised without a
    request into that mount, which could be another daemon waiting on this one.
    """
    if _statx(dir_fd, name, flags, _LSTAT_MASK, _statx_buf):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)
    raw = _STATX.unpack_from(_statx_buf)
    major_minor = (raw[21], raw[22])
    dev = _devices.get(major_minor)
    if dev is None:
        dev = _devices[major_minor] = os.makedev(*major_minor)
    return Stat(raw, dev)


def fstat(fd: int) -> Stat:
    """fstat with the birth time, which os.fstat does not give."""
    return lstat_at(fd, b"", AT_EMPTY_PATH | AT_STATX_DONT_SYNC)


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


# One open_how reused for every call (the daemon serves one request at a time): building a
# ctypes structure per call cost more than the system call itself.
_how = _OpenHow()
_how_ref = ctypes.byref(_how)
_HOW_SIZE = ctypes.sizeof(_how)


def openat2(dir_fd: int, path: bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): open `path` relative to `dir_fd` under the RESOLVE_* restrictions."""
    _how.flags = flags
    _how.mode = mode
    _how.resolve = resolve
    fd: int = _syscall(_SYS_OPENAT2, dir_fd, path, _how_ref, _HOW_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def renameat2(src_fd: int, src: bytes, dst_fd: int, dst: bytes, flags: int) -> None:
    if flags == 0:
        os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        return
    if _renameat2(src_fd, src, dst_fd, dst, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_fs_ids(uid: int, gid: int) -> None:
    """setfsgid + setfsuid of the calling thread: the identity the kernel checks and charges
    (disk quotas, ext4's reserved blocks) for filesystem calls."""
    _setfsgid(gid)
    _setfsuid(uid)


_PR_SET_DUMPABLE = 4
_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3


def make_undumpable() -> None:
    """Keep same-uid processes out of /proc/<pid>/fd, /proc/<pid>/mem and ptrace."""
    set_dumpable(False)


def die_with_parent(signum: int) -> None:
    """Be sent `signum` when the thread that started this process ends (its process dying)."""
    if _prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def is_dumpable() -> bool:
    return bool(_prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1)


def set_dumpable(dumpable: bool) -> None:
    if _prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SYS_CAPGET = 125 if os.uname().machine == "x86_64" else 90
_SYS_CAPSET = 126 if os.uname().machine == "x86_64" else 91
CAP_SYS_RESOURCE = 24


def drop_effective_capability(cap: int) -> bool:
    """Remove `cap` from this thread's effective set (it stays permitted); True if it was set.

    A root daemon keeps CAP_SYS_RESOURCE otherwise, and with it every write it makes for a
    caller may use the blocks ext4 reserves for root and ignore disk quotas.
    """
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _syscall(_SYS_CAPGET, ctypes.byref(header), data) != 0:
        return False
    word, bit = divmod(cap, 32)
    if not data[word].effective & (1 << bit):
        return False
    data[word].effective &= ~(1 << bit)
    if _syscall(_SYS_CAPSET, ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return True


_FSTATFS_BUF = ctypes.create_string_buffer(128)
_FUSE_SUPER_MAGIC = 0x65735546
# Filesystems that answer AT_STATX_DONT_SYNC from a cache that may be stale.
_CACHING_MAGICS = frozenset(
    {
        _FUSE_SUPER_MAGIC,
        0x6969,  # NFS
        0xFF534D42,  # CIFS
        0xFE534D42,  # SMB2
        0x01021997,  # 9P (v9fs)
        0x00C36400,  # Ceph
        0x786F4256,  # vboxsf
    }
)


def _fs_magic(fd: int) -> int | None:
    """The type (magic number) of the filesystem holding `fd`; None if fstatfs fails."""
    if _libc.fstatfs(fd, _FSTATFS_BUF) != 0:
        return None
    (f_type,) = struct.unpack_from("l", _FSTATFS_BUF)
    return int(f_type) & 0xFFFFFFFF


def caches_attributes(fd: int) -> bool:
    """Whether the filesystem holding `fd` may answer a DONT_SYNC statx with stale attributes."""
    magic = _fs_magic(fd)
    return magic is None or magic in _CACHING_MAGICS


# Local filesystems, where inotify reports every change whoever makes it (on network and FUSE
# storage it reports only the changes made through this machine's kernel, on overlayfs not
# those made to its layers).
_LOCAL_MAGICS = frozenset(
    {
        0xEF53,  # ext2, ext3, ext4
        0x58465342,  # XFS
        0x9123683E,  # Btrfs
        0x01021994,  # tmpfs
        0xF2F52010,  # F2FS
        0x2FC12FC1,  # ZFS
        0xCA451A4E,  # bcachefs
    }
)


def reports_changes(fd: int) -> bool:
    """Whether inotify watches on the filesystem holding `fd` see every change made to it."""
    return _fs_magic(fd) in _LOCAL_MAGICS


IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_EXCL_UNLINK = 0x04000000
_IN_NONBLOCK_CLOEXEC = os.O_NONBLOCK | os.O_CLOEXEC


def inotify_init() -> int:
    """A non-blocking, close-on-exec inotify descriptor."""
    fd = int(_inotify_init1(_IN_NONBLOCK_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def inotify_add_watch(inotify_fd: int, dir_fd: int, mask: int) -> int:
    """Watch the directory open as `dir_fd` (an O_PATH descriptor will do); its watch number."""
    wd = int(_inotify_add_watch(inotify_fd, f"/proc/self/fd/{dir_fd}".encode(), mask))
    if wd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return wd


def inotify_rm_watch(inotify_fd: int, wd: int) -> None:
    _inotify_rm_watch(inotify_fd, wd)  # EINVAL: the watch already went with its directory


def write_all(fd: int, data: bytes | bytearray) -> None:
    """os.write until all of `data` is written (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
