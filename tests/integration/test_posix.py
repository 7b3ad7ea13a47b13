"""POSIX semantics through a live `full` mount: os.* calls in /session/working and /repo,
compared with the backing directory (the native files) where that says more."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh
from tests.support.mounts import Mount, make_project, mounted

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _check(result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def renameat2(src: Path, dst: Path, flags: int) -> None:
    _check(_libc.renameat2(AT_FDCWD, bytes(src), AT_FDCWD, bytes(dst), ctypes.c_uint(flags)))


def utimensat(path: Path, atime: tuple[int, int], mtime: tuple[int, int]) -> None:
    times = (Timespec * 2)(Timespec(*atime), Timespec(*mtime))
    _check(_libc.utimensat(AT_FDCWD, bytes(path), times, 0))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _check(_libc.fallocate(fd, mode, offset, length))


# ----- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared() -> Iterator[Mount]:
    """One `full` mount for the module; each test works in its own directory.

    It lives outside pytest's tmp dirs: a concurrent pytest session's end-of-session sweep
    of "pytest-of-" mounts would otherwise unmount it under our feet.
    """
    with tempfile.TemporaryDirectory(prefix="sandboxfs-posix-") as tmp:
        root = Path(tmp)
        with mounted(root / "mnt", make_project(root), "full") as m:
            yield m


@dataclass
class Dirs:
    m: Mount
    path: Path  # the test's directory through the mount
    native: Path  # the same directory in backing storage


@pytest.fixture
def wd(shared: Mount, request: pytest.FixtureRequest) -> Iterator[Dirs]:
    name = request.node.name.replace("[", "-").replace("]", "")[:200]
    path = shared.mnt / "session" / "working" / name
    path.mkdir()
    yield Dirs(shared, path, backing_work(shared) / name)
    assert_healthy(shared)


@pytest.fixture
def umask022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def work(m: Mount) -> Path:
    return m.mnt / "session" / "working"


def backing_work(m: Mount) -> Path:
    return m.project / ".sandbox" / "workspaces" / m.workspace / "sessions" / m.session / "working"


def log_path(m: Mount) -> Path:
    return m.project / ".sandbox" / "logs" / f"{m.session}.log"


def assert_healthy(m: Mount) -> None:
    """The mount answers, the daemon lives, and it logged no internal error."""
    listing = sh(f"ls {m.mnt}")
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.split() == ["repo", "session", "staged", "workers", "workspace"]
    probe = work(m) / "health-probe"
    probe.write_text("alive\n")
    assert probe.read_text() == "alive\n"
    probe.unlink()
    os.kill(m.daemon_pid(), 0)
    log = log_path(m)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert "internal error" not in text, text


def errno_of(fn: Callable[[], object]) -> int | None:
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return None


def pause_for_clock() -> None:
    """Let the (coarse) kernel clock move on, so a changed ctime is observable."""
    time.sleep(0.05)


# ----- modes, owners, times ---------------------------------------------------------------------


@pytest.mark.usefixtures("umask022")
def test_create_mode_umask_and_owner(wd: Dirs) -> None:
    d = wd.path
    fd = os.open(d / "f", os.O_CREAT | os.O_WRONLY, 0o666)
    os.close(fd)
    os.mkdir(d / "sub", 0o777)
    st = os.stat(d / "f")
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert stat.S_IMODE(os.stat(d / "sub").st_mode) == 0o755
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    native = os.stat(wd.native / "f")
    assert stat.S_IMODE(native.st_mode) == 0o644
    assert (native.st_uid, native.st_gid) == (os.getuid(), os.getgid())
    os.chmod(d / "f", 0o640)
    assert stat.S_IMODE(os.stat(d / "f").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(wd.native / "f").st_mode) == 0o640


def test_chown_as_root(wd: Dirs) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    f = wd.path / "owned"
    f.write_text("x")
    os.chown(f, 1234, 1234)
    st = os.stat(f)
    assert (st.st_uid, st.st_gid) == (1234, 1234)
    native = os.stat(wd.native / "owned")
    assert (native.st_uid, native.st_gid) == (1234, 1234)
    done = sh(f"chown 4321:4321 {f}")
    assert done.returncode == 0, done.stderr
    assert os.stat(f).st_uid == 4321


def test_utime_nanoseconds_now_and_omit(wd: Dirs) -> None:
    f = wd.path / "times"
    f.write_text("x")
    os.utime(f, ns=(1_000_000_123, 2_000_000_456))
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    native = os.stat(wd.native / "times")
    assert (native.st_atime_ns, native.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    touched = sh(f"touch -a {f}")
    assert touched.returncode == 0, touched.stderr
    st = os.stat(f)
    assert st.st_atime_ns > 2_000_000_456
    assert st.st_mtime_ns == 2_000_000_456
    os.utime(f, ns=(1_000_000_123, 2_000_000_456))
    touched = sh(f"touch -m {f}")
    assert touched.returncode == 0, touched.stderr
    st = os.stat(f)
    assert st.st_atime_ns == 1_000_000_123
    assert st.st_mtime_ns > 2_000_000_456
    os.utime(f, ns=(1_000_000_123, 2_000_000_456))
    utimensat(f, (0, UTIME_OMIT), (0, UTIME_OMIT))
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    utimensat(f, (0, UTIME_NOW), (7, 89))
    st = os.stat(f)
    assert st.st_atime_ns > 2_000_000_456
    assert st.st_mtime_ns == 7_000_000_089


@pytest.mark.parametrize("op", ["rename", "link", "chmod", "truncate"])
def test_ctime_updated(wd: Dirs, op: str) -> None:
    d = wd.path
    f = d / "c"
    f.write_text("content")
    os.chmod(f, 0o644)
    before = os.stat(f).st_ctime_ns
    pause_for_clock()
    if op == "rename":
        os.rename(f, d / "c2")
        f = d / "c2"
    elif op == "link":
        os.link(f, d / "c-link")
    elif op == "chmod":
        os.chmod(f, 0o600)
    else:
        os.truncate(f, 1)
    assert os.stat(f).st_ctime_ns > before
    assert os.stat(wd.native / f.name).st_ctime_ns > before


# ----- hard links -------------------------------------------------------------------------------


def test_hard_links_share_one_inode(wd: Dirs) -> None:
    d = wd.path
    (d / "a").write_text("shared\n")
    os.link(d / "a", d / "b")
    sa, sb = os.stat(d / "a"), os.stat(d / "b")
    assert sa.st_ino == sb.st_ino
    assert sa.st_nlink == sb.st_nlink == 2
    os.chmod(d / "a", 0o600)
    assert stat.S_IMODE(os.stat(d / "b").st_mode) == 0o600
    with open(d / "b", "a") as fh:
        fh.write("more\n")
    assert (d / "a").read_text() == "shared\nmore\n"
    os.unlink(d / "a")
    assert (d / "b").read_text() == "shared\nmore\n"
    assert os.stat(d / "b").st_nlink == 1
    assert not (d / "a").exists()


def test_unlink_newest_hard_link_keeps_the_other(wd: Dirs) -> None:
    d = wd.path
    out = sh(f"echo A > {d}/p && ln {d}/p {d}/q && rm {d}/q && cat {d}/p && stat -c %h {d}/p")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["A", "1"]


def test_relink_after_unlink_keeps_the_file_reachable(wd: Dirs) -> None:
    d = wd.path
    (d / "a").write_text("data\n")
    os.link(d / "a", d / "b")
    os.unlink(d / "a")
    out = sh(f"ln {d}/b {d}/c && stat -c %h {d}/b && rm {d}/b && cat {d}/c && stat -c %h {d}/c")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "data", "1"]


def test_hard_link_in_subdir_after_original_unlinked(wd: Dirs) -> None:
    d = wd.path
    (d / "sub").mkdir()
    (d / "orig").write_text("data")
    os.link(d / "orig", d / "sub" / "alias")
    os.unlink(d / "orig")
    assert (d / "sub" / "alias").read_text() == "data"
    os.chmod(d / "sub" / "alias", 0o604)
    os.utime(d / "sub" / "alias", ns=(10, 20))
    st = os.stat(d / "sub" / "alias")
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_nlink) == (0o604, 20, 1)


# ----- names and paths --------------------------------------------------------------------------


def test_name_length_limits(wd: Dirs) -> None:
    d = wd.path
    longest = d / ("n" * 255)
    longest.write_text("ok")
    assert longest.read_text() == "ok"
    assert ("n" * 255) in os.listdir(d)
    assert errno_of(lambda: (d / ("n" * 256)).write_text("no")) == errno.ENAMETOOLONG
    assert errno_of(lambda: os.mkdir(d / ("m" * 256))) == errno.ENAMETOOLONG
    assert os.statvfs(wd.m.mnt).f_namemax == 255
    assert os.statvfs(d).f_namemax == 255


def _open_dir(name: bytes, parent: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)


def test_deep_path_beyond_path_max_with_openat(wd: Dirs) -> None:
    levels = 60
    names = [(b"%03d" % i) + b"d" * 197 for i in range(levels)]
    assert len(b"/".join(names)) > 4096
    fds = [os.open(wd.path, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for name in names:
            os.mkdir(name, 0o755, dir_fd=fds[-1])
            fds.append(_open_dir(name, fds[-1]))
        fd = os.open(b"leaf", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fds[-1])
        os.write(fd, b"deep down\n")
        os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)

    def walk(top: Path) -> bytes:
        opened = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
        try:
            for name in names:
                opened.append(_open_dir(name, opened[-1]))
            assert os.listdir(opened[-1]) == ["leaf"]
            fd = os.open(b"leaf", os.O_RDONLY, dir_fd=opened[-1])
            try:
                return os.read(fd, 100)
            finally:
                os.close(fd)
        finally:
            for fd in opened:
                os.close(fd)

    assert walk(wd.path) == b"deep down\n"
    assert walk(wd.native) == b"deep down\n"
    found = sh(f"cd {wd.path} && find . -name leaf | wc -l")
    assert found.stdout.strip() == "1", found.stderr


def test_non_utf8_names(wd: Dirs) -> None:
    d = bytes(wd.path)
    name = b"caf\xe9-\xff\xfe.txt"
    with open(d + b"/" + name, "wb") as fh:
        fh.write(b"latin-1")
    assert name in os.listdir(d)
    assert name in os.listdir(bytes(wd.native))
    with open(d + b"/" + name, "rb") as fh:
        assert fh.read() == b"latin-1"
    os.rename(d + b"/" + name, d + b"/\x80renamed")
    assert os.listdir(d) == [b"\x80renamed"]
    os.mkdir(d + b"/dir\xc3\x28")
    os.rename(d + b"/\x80renamed", d + b"/dir\xc3\x28/\x80")
    with open(d + b"/dir\xc3\x28/\x80", "rb") as fh:
        assert fh.read() == b"latin-1"
    listed = subprocess.run(["ls", d + b"/dir\xc3\x28"], capture_output=True, check=False)
    assert (listed.returncode, listed.stdout) == (0, b"\x80\n"), listed.stderr
    os.unlink(d + b"/dir\xc3\x28/\x80")
    os.rmdir(d + b"/dir\xc3\x28")
    assert os.listdir(d) == []


# ----- rename -----------------------------------------------------------------------------------


def test_rename_over_file_and_dirs(wd: Dirs) -> None:
    d = wd.path
    (d / "src").write_text("new")
    (d / "dst").write_text("old")
    os.rename(d / "src", d / "dst")
    assert (d / "dst").read_text() == "new"
    assert not (d / "src").exists()
    (d / "empty").mkdir()
    (d / "moving").mkdir()
    (d / "moving" / "inside").write_text("in")
    os.rename(d / "moving", d / "empty")
    assert (d / "empty" / "inside").read_text() == "in"
    assert not (d / "moving").exists()
    (d / "full").mkdir()
    (d / "full" / "x").write_text("x")
    (d / "other").mkdir()
    assert errno_of(lambda: os.rename(d / "other", d / "full")) == errno.ENOTEMPTY
    assert errno_of(lambda: os.rename(d / "other", d / "dst")) == errno.ENOTDIR
    assert errno_of(lambda: os.rename(d / "dst", d / "other")) == errno.EISDIR
    assert errno_of(lambda: os.rename(d / "full", d / "full" / "sub")) == errno.EINVAL
    assert sorted(os.listdir(d)) == ["dst", "empty", "full", "other"]


def test_rename_directory_with_open_file_and_cached_children(wd: Dirs) -> None:
    d = wd.path
    (d / "d" / "sub").mkdir(parents=True)
    (d / "d" / "sub" / "f").write_text("nested")
    assert os.stat(d / "d" / "sub" / "f").st_size == 6  # cache the children
    fd = os.open(d / "d" / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"before ")
        os.rename(d / "d", d / "e")
        os.write(fd, b"after")
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (d / "e" / "f").read_text() == "before after"
    assert os.stat(d / "e" / "sub" / "f").st_size == 6
    assert (d / "e" / "sub" / "f").read_text() == "nested"
    assert not (d / "d").exists()
    assert (wd.native / "e" / "f").read_text() == "before after"
    # the cached children keep working for changes, too
    os.chmod(d / "e" / "sub" / "f", 0o600)
    (d / "e" / "sub" / "g").write_text("g")
    os.rename(d / "e" / "sub" / "f", d / "e" / "sub" / "h")
    assert sorted(os.listdir(wd.native / "e" / "sub")) == ["g", "h"]


def test_renameat2_noreplace_and_exchange(wd: Dirs) -> None:
    d = wd.path
    (d / "x").write_text("X")
    (d / "y").write_text("Y")
    assert errno_of(lambda: renameat2(d / "x", d / "y", RENAME_NOREPLACE)) == errno.EEXIST
    assert (d / "x").read_text() == "X"
    renameat2(d / "x", d / "z", RENAME_NOREPLACE)
    assert (d / "z").read_text() == "X"
    renameat2(d / "z", d / "y", RENAME_EXCHANGE)
    assert ((d / "z").read_text(), (d / "y").read_text()) == ("Y", "X")
    # exchange two directories whose children the kernel has cached
    for name, child in (("d1", "one"), ("d2", "two")):
        (d / name).mkdir()
        (d / name / child).write_text(child)
        os.stat(d / name / child)
    renameat2(d / "d1", d / "d2", RENAME_EXCHANGE)
    assert os.listdir(d / "d1") == ["two"]
    assert (d / "d1" / "two").read_text() == "two"
    assert (d / "d2" / "one").read_text() == "one"
    os.chmod(d / "d2" / "one", 0o600)
    assert stat.S_IMODE(os.stat(wd.native / "d2" / "one").st_mode) == 0o600
    assert errno_of(lambda: renameat2(d / "y", d / "absent", RENAME_EXCHANGE)) == errno.ENOENT


# ----- open flags -------------------------------------------------------------------------------

_APPENDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
for i in range(int(sys.argv[3])):
    os.write(fd, b"%s-%05d-" % (sys.argv[2].encode(), i) + b"." * 20 + b"\\n")
os.close(fd)
"""


def test_o_append_two_processes(wd: Dirs) -> None:
    f = wd.path / "log"
    f.write_bytes(b"")
    count = 400
    procs = [
        subprocess.Popen([sys.executable, "-c", _APPENDER, str(f), tag, str(count)])
        for tag in ("A", "B")
    ]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    lines = f.read_bytes().splitlines()
    assert len(lines) == 2 * count
    expected = {b"%s-%05d-" % (tag, i) + b"." * 20 for tag in (b"A", b"B") for i in range(count)}
    assert set(lines) == expected
    assert os.stat(f).st_size == 2 * count * 29
    assert (wd.native / "log").stat().st_size == 2 * count * 29


def test_o_trunc_o_excl_and_access_modes(wd: Dirs) -> None:
    f = wd.path / "flags"
    f.write_text("some content")
    fd = os.open(f, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert os.stat(f).st_size == 0
    assert f.read_text() == ""
    assert errno_of(lambda: os.open(f, os.O_CREAT | os.O_EXCL | os.O_WRONLY)) == errno.EEXIST
    fd = os.open(wd.path / "fresh", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    ro = os.open(f, os.O_RDONLY)
    rw = os.open(f, os.O_RDWR)
    try:
        assert errno_of(lambda: os.write(ro, b"no")) == errno.EBADF
        assert os.write(rw, b"yes") == 3
        assert os.pread(ro, 10, 0) == b"yes"
        assert errno_of(lambda: os.ftruncate(ro, 0)) in (errno.EINVAL, errno.EBADF)
    finally:
        os.close(ro)
        os.close(rw)
    wo = os.open(f, os.O_WRONLY)
    try:
        assert errno_of(lambda: os.read(wo, 1)) == errno.EBADF
    finally:
        os.close(wo)
    fd = os.open(f, os.O_RDONLY | os.O_NOATIME)
    try:
        assert os.read(fd, 10) == b"yes"
    finally:
        os.close(fd)


def test_o_direct_served_or_refused(wd: Dirs) -> None:
    f = wd.path / "direct"
    block = mmap.mmap(-1, 4096)
    block.write(b"D" * 4096)
    try:
        fd = os.open(f, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
    else:
        try:
            assert os.pwrite(fd, block, 0) == 4096
            back = mmap.mmap(-1, 4096)
            assert os.preadv(fd, [back], 0) == 4096
            assert back[:] == b"D" * 4096
            # unaligned I/O: either served or refused with EINVAL
            assert errno_of(lambda: os.pwrite(fd, b"xyz", 1)) in (None, errno.EINVAL)
        finally:
            os.close(fd)
        assert (wd.native / "direct").read_bytes()[:3] in (b"DDD", b"Dxy")
    out = sh(f"dd if=/dev/zero of={f} bs=4096 count=4 oflag=direct && stat -c %s {f}")
    assert out.returncode == 0 or "Invalid argument" in out.stderr, out.stderr
    assert sh(f"ls {wd.path}").returncode == 0


# ----- sizes, holes, allocation -----------------------------------------------------------------


def test_sparse_files_and_beyond_4gib(wd: Dirs) -> None:
    d = wd.path
    fd = os.open(d / "sparse", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"end", 1 << 30)
    finally:
        os.close(fd)
    st = os.stat(d / "sparse")
    assert st.st_size == (1 << 30) + 3
    assert st.st_blocks * 512 < 1 << 20
    with open(d / "sparse", "rb") as fh:
        assert fh.read(16) == b"\0" * 16
        fh.seek(1 << 30)
        assert fh.read() == b"end"
    big = 5 << 30
    fd = os.open(d / "big", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert os.pwrite(fd, b"!", big) == 1
        assert os.pread(fd, 10, big) == b"!"
    finally:
        os.close(fd)
    assert os.stat(d / "big").st_size == big + 1
    assert (wd.native / "big").stat().st_size == big + 1
    with open(d / "big", "rb") as fh:
        fh.seek(big - 1)
        assert fh.read() == b"\0!"
    os.truncate(d / "big", (4 << 30) + 7)
    assert os.stat(d / "big").st_size == (4 << 30) + 7


def test_fallocate_and_punch_hole(wd: Dirs) -> None:
    f = wd.path / "alloc"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        assert os.fstat(fd).st_size == 1 << 20
        os.pwrite(fd, b"x" * 8192, 0)
        try:
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096)
        except OSError as exc:
            assert exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS), exc
            assert os.pread(fd, 4, 0) == b"xxxx"
        else:
            assert os.pread(fd, 4, 0) == b"\0\0\0\0"
        assert os.pread(fd, 4, 4096) == b"xxxx"
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)
    assert f.stat().st_size == 1 << 20


def test_seek_data_and_hole(wd: Dirs) -> None:
    f = wd.path / "holes"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"a" * 4096, 0)
        os.pwrite(fd, b"b" * 4096, 1 << 30)
        size = (1 << 30) + 4096
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
        assert hole in (4096, size)  # real answer, or the generic "no holes"
        data = os.lseek(fd, 8192, os.SEEK_DATA)
        assert data in (1 << 30, 8192)
        assert errno_of(lambda: os.lseek(fd, size + 10, os.SEEK_DATA)) == errno.ENXIO
        assert os.pread(fd, 1, 1 << 30) == b"b"
    finally:
        os.close(fd)


def test_huge_offsets_are_refused(wd: Dirs) -> None:
    f = wd.path / "huge"
    f.write_text("x")
    fd = os.open(f, os.O_RDWR)
    try:
        assert errno_of(lambda: os.pwrite(fd, b"x", 2**63 - 1)) in (errno.EFBIG, errno.EINVAL)
        assert errno_of(lambda: os.pwrite(fd, b"xy", 2**63 - 2)) in (errno.EFBIG, errno.EINVAL)
        assert os.pread(fd, 10, 2**62) == b""
        assert errno_of(lambda: os.ftruncate(fd, 2**63 - 1)) in (errno.EFBIG, errno.EINVAL)
    finally:
        os.close(fd)
    assert f.read_text() == "x"


def test_shared_writable_mmap(wd: Dirs) -> None:
    f = wd.path / "mapped"
    f.write_bytes(b"\0" * 8192)
    fd = os.open(f, os.O_RDWR)
    other = os.open(f, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mem:
            mem[0:5] = b"hello"
            mem[4096:4101] = b"world"
            mem.flush()
            assert os.pread(other, 5, 0) == b"hello"
            assert os.pread(other, 5, 4096) == b"world"
    finally:
        os.close(fd)
        os.close(other)
    native = (wd.native / "mapped").read_bytes()
    assert native[:5] == b"hello"
    assert native[4096:4101] == b"world"
    assert len(native) == 8192


def test_fsync_and_fdatasync(wd: Dirs) -> None:
    f = wd.path / "synced"
    fd = os.open(f, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"durable")
        os.fsync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dfd = os.open(wd.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    assert (wd.native / "synced").read_bytes() == b"durable"
    assert sh(f"sync {f}").returncode == 0


def test_fifo_passes_data(wd: Dirs) -> None:
    fifo = wd.path / "pipe"
    os.mkfifo(fifo, 0o644)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert stat.S_ISFIFO(os.stat(wd.native / "pipe").st_mode)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    writer = sh(f"printf 'through the fifo\\n' > {fifo}")
    out, _ = reader.communicate(timeout=30)
    assert writer.returncode == 0, writer.stderr
    assert out == b"through the fifo\n"
    assert reader.returncode == 0


def test_user_xattrs(wd: Dirs) -> None:
    f = wd.path / "attrs"
    f.write_text("x")
    os.setxattr(f, "user.color", b"blue")
    os.setxattr(f, "user.empty", b"")
    assert os.getxattr(f, "user.color") == b"blue"
    assert os.getxattr(f, "user.empty") == b""
    assert sorted(os.listxattr(f)) == ["user.color", "user.empty"]
    assert os.getxattr(wd.native / "attrs", "user.color") == b"blue"
    os.removexattr(f, "user.color")
    assert os.listxattr(f) == ["user.empty"]
    assert errno_of(lambda: os.getxattr(f, "user.color")) == errno.ENODATA
    assert errno_of(lambda: os.removexattr(f, "user.color")) == errno.ENODATA
    flag = os.XATTR_CREATE
    assert errno_of(lambda: os.setxattr(f, "user.empty", b"1", flag)) == errno.EEXIST
    d = wd.path / "dir"
    d.mkdir()
    os.setxattr(d, "user.tag", b"dir")
    assert os.getxattr(d, "user.tag") == b"dir"
    out = sh(f"setfattr -n user.shell -v hi {f} && getfattr --only-values -n user.shell {f}")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hi"


def test_no_security_namespace(wd: Dirs) -> None:
    """security.* is not supported through the mount: reads say so, listings leave backing
    labels out, and `ls -l` and `cp -a` work without complaint."""
    f = wd.path / "labelled"
    f.write_text("x")
    if os.geteuid() == 0:  # only root can label the backing file
        os.setxattr(wd.native / "labelled", "security.sandboxfs-test", b"label")
    os.setxattr(f, "user.kept", b"1")
    assert errno_of(lambda: os.getxattr(f, "security.selinux")) == errno.EOPNOTSUPP
    assert os.listxattr(f) == ["user.kept"]
    copied = wd.path / "copied"
    out = sh(f"ls -l {f} && cp -a {f} {copied} && getfattr --absolute-names -d -m - {copied}")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    attrs = [line.split("=")[0] for line in out.stdout.splitlines()[2:] if line]
    assert attrs == ["user.kept"]  # the copy carries no security.* label


def test_metadata_via_fd_of_unlinked_file(wd: Dirs) -> None:
    f = wd.path / "doomed"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"still here")
        os.unlink(f)
        os.chmod(fd, 0o600)
        os.ftruncate(fd, 5)
        assert os.pread(fd, 20, 0) == b"still"
        os.utime(fd, ns=(5, 6))
        assert os.fstat(fd).st_mtime_ns == 6
        os.chown(fd, os.getuid(), os.getgid())
        os.setxattr(fd, "user.k", b"v")
        assert os.getxattr(fd, "user.k") == b"v"
    finally:
        os.close(fd)


def test_futimens_on_replaced_open_file(wd: Dirs) -> None:
    d = wd.path
    (d / "v").write_text("v")
    (d / "w").write_text("w")
    fd = os.open(d / "v", os.O_RDWR)
    try:
        os.rename(d / "w", d / "v")
        os.utime(fd, ns=(5, 6))
        assert os.fstat(fd).st_mtime_ns == 6
    finally:
        os.close(fd)
    assert (d / "v").read_text() == "w"


# ----- directories ------------------------------------------------------------------------------


def test_listing_stable_while_entries_change(wd: Dirs) -> None:
    d = wd.path / "busy"
    d.mkdir()
    pad = "p" * 90  # long names: the listing needs many getdents/readdir rounds
    keep = {f"keep-{i:04d}-{pad}" for i in range(1000)}
    doomed = [f"tmp-{i:04d}-{pad}" for i in range(200)]
    for name in [*keep, *doomed]:
        os.close(os.open(d / name, os.O_CREAT | os.O_WRONLY, 0o644))
    seen: list[str] = []
    with os.scandir(d) as it:
        for entry in it:
            seen.append(entry.name)
            if len(seen) == 600:
                for i, name in enumerate(doomed):
                    os.unlink(d / name)
                    os.close(os.open(d / f"new-{i:04d}", os.O_CREAT | os.O_WRONLY, 0o644))
    assert len(seen) == len(set(seen)), "an entry was listed twice"
    assert keep <= set(seen), f"missed: {sorted(keep - set(seen))[:5]}"
    assert len(os.listdir(d)) == 1200


def test_dot_entries_carry_the_right_inode_numbers(wd: Dirs) -> None:
    """`.` and `..` in a listing name the directory and its parent, as stat does."""
    child = wd.path / "child"
    (child / "grandchild").mkdir(parents=True)
    listed = sh(f"ls -ai {child}")
    assert listed.returncode == 0, listed.stderr
    inodes = {name: int(ino) for ino, name in (line.split() for line in listed.stdout.splitlines())}
    assert inodes == {
        ".": child.stat().st_ino,
        "..": wd.path.stat().st_ino,
        "grandchild": (child / "grandchild").stat().st_ino,
    }


def _resident_pages(fd: int, size: int) -> int:
    """How many of the file's pages are in the page cache (mincore on a shared mapping)."""
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long]  # fmt: skip
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    _check(0 if addr not in (None, ctypes.c_void_p(-1).value) else -1)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        _check(_libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec))
        return sum(byte & 1 for byte in vec)
    finally:
        _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


def test_file_written_in_records_stays_cached_for_its_reader(wd: Dirs) -> None:
    """tar writes 10 KiB records, which leave pages partly written. At close sandboxfs hands
    the kernel the whole file, so the next open keeps the cache (every page resident, without
    a READ) and reads return exactly what was written, also after a later in-place change."""
    path = wd.path / "extracted.py"
    records = [bytes([65 + i]) * 10240 for i in range(5)] + [b"tail\n"]
    content = b"".join(records)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    for record in records:
        os.write(fd, record)
    os.close(fd)
    os.utime(path, ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))  # as tar does
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = (len(content) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        assert _resident_pages(fd, len(content)) == pages
        assert os.pread(fd, len(content) + 1, 0) == content
    finally:
        os.close(fd)
    with open(path, "r+b") as f:
        f.seek(10000)
        f.write(b"changed")
    expected = content[:10000] + b"changed" + content[10007:]
    assert path.read_bytes() == expected
    assert (wd.native / "extracted.py").read_bytes() == expected


@pytest.mark.slow
@pytest.mark.timeout(600)  # 100,000 creates, then a listing allowed 300 s
def test_hundred_thousand_entries(mount_at: Callable[..., Any], project: Path) -> None:
    big = project / "bigdir"
    big.mkdir()
    for i in range(100_000):
        os.close(os.open(big / f"entry-{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644))
    with mount_at("full") as m:
        out = sh(f"ls -f {m.mnt}/repo/bigdir | wc -l", timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "100002"
        assert os.stat(m.mnt / "repo" / "bigdir" / "entry-099999").st_size == 0
        assert_healthy(m)


def test_deep_tree_find(wd: Dirs) -> None:
    top = wd.path / "deep"
    path = top
    for _ in range(200):
        path = path / "d"
    os.makedirs(path)
    (path / "bottom").write_text("found me")
    out = sh(f"cd {wd.path} && find deep | wc -l && find deep -name bottom -exec cat {{}} +")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["202", "found", "me"]
    removed = sh(f"rm -rf {top}")
    assert removed.returncode == 0, removed.stderr
    assert os.listdir(wd.path) == []
