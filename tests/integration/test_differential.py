"""Differential tests: the same random syscalls on a native directory and through a `full`
mount must give the same results and the same errnos; and an fsstress-like workload of
concurrent processes must leave the mount answering and the daemon healthy."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.support.cli import sh
from tests.support.mounts import Mount, make_project, mounted

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.renameat2.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
]
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(src: str, dst: str, flags: int) -> None:
    if _libc.renameat2(-100, src.encode(), -100, dst.encode(), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.fixture(scope="module")
def full_mount() -> Iterator[Mount]:
    """One `full` mount for the module, outside pytest's tmp dirs (a concurrent pytest
    session's end-of-session sweep of "pytest-of-" mounts would unmount it)."""
    with tempfile.TemporaryDirectory(prefix="sandboxfs-diff-") as tmp:
        root = Path(tmp)
        with mounted(root / "mnt", make_project(root), "full") as m:
            yield m


def log_text(m: Mount) -> str:
    log = m.project / ".sandbox" / "logs" / f"{m.session}.log"
    return log.read_text(errors="replace") if log.exists() else ""


# ----- the state machine --------------------------------------------------------------------------

PATHS = ["a", "b", "c", "d", "d/e", "d/f", "d/g", "d/g/h"]
LINK_TARGETS = ["a", "b", "d", "e", "../a", "../d/e", "missing", "g/h", "d/g"]
MODES = [0o600, 0o644, 0o755, 0o444, 0o700, 0o1777, 0o000]
ACCESS = [os.O_RDONLY, os.O_WRONLY, os.O_RDWR]
EXTRA = [os.O_CREAT, os.O_EXCL, os.O_TRUNC, os.O_APPEND]
OFFSETS = [0, 1, 3, 100, 4095, 4096, 70000]
SIZES = [0, 1, 5, 100, 5000]

paths = st.sampled_from(PATHS)
datas = st.binary(min_size=0, max_size=300)
offsets = st.sampled_from(OFFSETS)
sizes = st.sampled_from(SIZES)
modes = st.sampled_from(MODES)
flag_sets = st.tuples(st.sampled_from(ACCESS), st.sets(st.sampled_from(EXTRA)))
fd_indexes = st.integers(min_value=0, max_value=7)

Result = tuple[str, Any]


def outcome(fn: Callable[[], Any]) -> Result:
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno or 0, str(exc.errno)))


def describe(path: str) -> tuple[Any, ...]:
    """What must be equal about an entry: type, permission bits, nlink, size (not dirs)."""
    s = os.stat(path, follow_symlinks=False)
    kind = stat.S_IFMT(s.st_mode)
    size = None if stat.S_ISDIR(s.st_mode) else s.st_size
    return (kind, stat.S_IMODE(s.st_mode), s.st_nlink, size)


def tree(root: str) -> dict[str, Any]:
    """Every entry below root with its description, file contents and link texts."""
    found: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            key = os.path.normpath(os.path.join(rel, name))
            try:  # as a non-root user, chmod'ed entries may be unreadable: compare the errno
                info: list[Any] = list(describe(full))
                if os.path.islink(full):
                    info.append(os.readlink(full))
                elif os.path.isfile(full):
                    with open(full, "rb") as fh:
                        info.append(fh.read())
            except OSError as exc:
                info = ["error", errno.errorcode.get(exc.errno or 0, exc.errno)]
            found[key] = info
    return found


class FsMachine(RuleBasedStateMachine):
    """Apply each step to the native root and the mount root; demand identical outcomes."""

    roots: ClassVar[tuple[Path, Path]]
    counter: ClassVar[Iterator[int]]
    fd_metadata: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        run = f"run{next(self.counter)}"
        self.dirs = [str(root / run) for root in self.roots]
        for d in self.dirs:
            os.mkdir(d)
            # start from a populated tree: most random steps then meet existing entries
            for sub in ("d", "d/g"):
                os.mkdir(os.path.join(d, sub), 0o755)
            for name in ("a", "c", "d/e"):
                with open(os.path.join(d, name), "wb") as fh:
                    fh.write(name.encode() * 3)
        self.fds: list[tuple[int, int]] = []

    def both(self, what: str, fn: Callable[[str], Any]) -> Result:
        results = [outcome(lambda d=d: fn(d)) for d in self.dirs]  # type: ignore[misc]
        assert results[0] == results[1], f"{what}: native {results[0]!r} != mount {results[1]!r}"
        return results[0]

    def teardown(self) -> None:
        for pair in self.fds:
            for fd in pair:
                os.close(fd)
        self.fds = []
        self.same_tree()

    # -- whole files by path --

    @rule(path=paths, flags=flag_sets, mode=modes, keep=st.booleans())
    def open_file(self, path: str, flags: tuple[int, set[int]], mode: int, keep: bool) -> None:
        value = flags[0]
        for extra in flags[1]:
            value |= extra
        opened: list[int | None] = []
        results: list[tuple[str, str | None]] = []
        for d in self.dirs:
            try:
                opened.append(os.open(os.path.join(d, path), value, mode))
                results.append(("ok", None))
            except OSError as exc:
                opened.append(None)
                results.append(("err", errno.errorcode.get(exc.errno or 0)))
        fds = [fd for fd in opened if fd is not None]
        if len(fds) == 2 and keep and len(self.fds) < 4:
            self.fds.append((fds[0], fds[1]))
        else:
            for fd in fds:
                os.close(fd)
        assert results[0] == results[1], f"open {path} {value:o}: {results[0]} != {results[1]}"

    @rule(path=paths, flags=flag_sets, offset=offsets, data=datas, positional=st.booleans())
    def write_file(
        self, path: str, flags: tuple[int, set[int]], offset: int, data: bytes, positional: bool
    ) -> None:
        value = flags[0] | os.O_CREAT
        for extra in flags[1]:
            value |= extra

        def go(d: str) -> int:
            fd = os.open(os.path.join(d, path), value, 0o644)
            try:
                return os.pwrite(fd, data, offset) if positional else os.write(fd, data)
            finally:
                os.close(fd)

        self.both(f"write {path} flags={value:o} at {offset}", go)

    @rule(path=paths)
    def read_file(self, path: str) -> None:
        def go(d: str) -> bytes:
            with open(os.path.join(d, path), "rb") as fh:
                return fh.read()

        self.both(f"read {path}", go)

    @rule(path=paths, size=sizes)
    def truncate(self, path: str, size: int) -> None:
        self.both(f"truncate {path} {size}", lambda d: os.truncate(os.path.join(d, path), size))

    # -- open descriptors --

    def pair(self, index: int) -> tuple[int, int]:
        return self.fds[index % len(self.fds)]

    @precondition(lambda self: self.fds)
    @rule(index=fd_indexes, offset=offsets, data=datas, positional=st.booleans())
    def write_fd(self, index: int, offset: int, data: bytes, positional: bool) -> None:
        fds = iter(self.pair(index))

        def go(_: str) -> int:
            fd = next(fds)
            return os.pwrite(fd, data, offset) if positional else os.write(fd, data)

        self.both(f"write fd at {offset} positional={positional}", go)

    @precondition(lambda self: self.fds)
    @rule(index=fd_indexes, offset=offsets, size=st.sampled_from([1, 10, 1000, 100000]))
    def read_fd(self, index: int, offset: int, size: int) -> None:
        fds = iter(self.pair(index))
        self.both(f"pread fd {size} at {offset}", lambda _: os.pread(next(fds), size, offset))

    @precondition(lambda self: self.fds)
    @rule(index=fd_indexes, size=sizes)
    def ftruncate_fd(self, index: int, size: int) -> None:
        fds = iter(self.pair(index))
        self.both(f"ftruncate fd {size}", lambda _: os.ftruncate(next(fds), size))

    @precondition(lambda self: self.fds)
    @rule(index=fd_indexes)
    def fstat_fd(self, index: int) -> None:
        fds = iter(self.pair(index))

        def go(_: str) -> tuple[int, int, int]:
            s = os.fstat(next(fds))
            return stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_size

        self.both("fstat fd", go)

    @precondition(lambda self: self.fds)
    @rule(index=fd_indexes, mode=modes)
    def fchmod_fd(self, index: int, mode: int) -> None:
        fds = iter(self.pair(index))
        self.both(f"fchmod fd {mode:o}", lambda _: os.chmod(next(fds), mode))

    @precondition(lambda self: self.fds and self.fd_metadata)
    @rule(index=fd_indexes)
    def futimes_fd(self, index: int) -> None:
        fds = iter(self.pair(index))

        def go(_: str) -> int:
            fd = next(fds)
            os.utime(fd, ns=(10**9, 2 * 10**9))
            return os.fstat(fd).st_mtime_ns

        self.both("futimens fd", go)

    @precondition(lambda self: self.fds)
    @rule(index=fd_indexes)
    def close_fd(self, index: int) -> None:
        pair = self.pair(index)
        self.fds.remove(pair)
        for fd in pair:
            os.close(fd)

    # -- namespace --

    @rule(path=paths, mode=modes)
    def mkdir(self, path: str, mode: int) -> None:
        self.both(f"mkdir {path} {mode:o}", lambda d: os.mkdir(os.path.join(d, path), mode))

    @rule(path=paths)
    def rmdir(self, path: str) -> None:
        self.both(f"rmdir {path}", lambda d: os.rmdir(os.path.join(d, path)))

    @rule(path=paths)
    def unlink(self, path: str) -> None:
        self.both(f"unlink {path}", lambda d: os.unlink(os.path.join(d, path)))

    @rule(src=paths, dst=paths, flags=st.sampled_from([0, 0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
    def rename(self, src: str, dst: str, flags: int) -> None:
        self.both(
            f"rename {src} {dst} flags={flags}",
            lambda d: renameat2(os.path.join(d, src), os.path.join(d, dst), flags),
        )

    @rule(src=paths, dst=paths)
    def link(self, src: str, dst: str) -> None:
        self.both(
            f"link {src} {dst}",
            lambda d: os.link(os.path.join(d, src), os.path.join(d, dst), follow_symlinks=False),
        )

    @rule(text=st.sampled_from(LINK_TARGETS), path=paths)
    def symlink(self, text: str, path: str) -> None:
        self.both(f"symlink {text} {path}", lambda d: os.symlink(text, os.path.join(d, path)))

    @rule(path=paths)
    def readlink(self, path: str) -> None:
        self.both(f"readlink {path}", lambda d: os.readlink(os.path.join(d, path)))

    @rule(path=paths, mode=modes)
    def chmod(self, path: str, mode: int) -> None:
        self.both(f"chmod {path} {mode:o}", lambda d: os.chmod(os.path.join(d, path), mode))

    @rule(path=paths, follow=st.booleans())
    def stat(self, path: str, follow: bool) -> None:
        def go(d: str) -> tuple[Any, ...]:
            full = os.path.join(d, path)
            if not follow:
                return describe(full)
            s = os.stat(full)
            return (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_nlink)

        self.both(f"stat {path} follow={follow}", go)

    @rule(path=st.sampled_from([".", "d", "d/g", "a"]))
    def listdir(self, path: str) -> None:
        self.both(f"listdir {path}", lambda d: sorted(os.listdir(os.path.join(d, path))))

    @rule()
    def same_tree(self) -> None:
        """Walk both trees (a rule, not an invariant: the readdirplus of a walk refreshes
        the kernel's dentries and would hide stale-inode bugs if it ran after every step)."""
        native, mounted_tree = (tree(d) for d in self.dirs)
        assert native == mounted_tree


MACHINE_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def run_machine(m: Mount, tmp_path: Path, fd_metadata: bool, derandomize: bool = False) -> None:
    native = tmp_path / "native"
    native.mkdir()
    through = m.mnt / "session" / "working" / f"diff-{tmp_path.name}-{int(fd_metadata)}"
    through.mkdir()
    old_umask = os.umask(0o022)
    try:
        machine = type(
            "Machine",
            (FsMachine,),
            {
                "roots": (native, through),
                "counter": itertools.count(),
                "fd_metadata": fd_metadata,
            },
        )
        run_state_machine_as_test(
            machine, settings=settings(MACHINE_SETTINGS, derandomize=derandomize)
        )
    finally:
        os.umask(old_umask)
    assert sh(f"ls {m.mnt}/session").returncode == 0
    assert "internal error" not in log_text(m)


def test_differential_syscalls(full_mount: Mount, tmp_path: Path) -> None:
    """Random sequences of every rule but futimens on descriptors."""
    run_machine(full_mount, tmp_path, fd_metadata=False)


def test_differential_syscalls_fd_metadata(full_mount: Mount, tmp_path: Path) -> None:
    """Random sequences including futimens on descriptors whose name was unlinked or replaced."""
    run_machine(full_mount, tmp_path, fd_metadata=True)


# ----- fsstress-like concurrency ---------------------------------------------------------------

_STRESS = r"""
import errno, json, mmap, os, random, sys, time
root, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rnd = random.Random(seed)
names = ["f%d" % i for i in range(12)] + ["d%d" % i for i in range(4)]
names += ["d%d/f%d" % (i, j) for i in range(4) for j in range(4)] + ["d0/d1", "d1/d2/f0"]
expected = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR,
            errno.EINVAL, errno.EBADF, errno.ELOOP, errno.EPERM, errno.ENODATA, errno.ENXIO}
if os.geteuid() != 0:  # random chmods lock an ordinary owner out, natively too
    expected.add(errno.EACCES)
flag_bits = [os.O_CREAT, os.O_EXCL, os.O_TRUNC, os.O_APPEND, os.O_DIRECT, os.O_NOATIME,
             os.O_SYNC, os.O_DSYNC]
aligned = mmap.mmap(-1, 8192)
aligned.write(b"%d" % seed * 4096)
unexpected = {}
counts = {}

def p():
    return os.path.join(root, rnd.choice(names))

def op_open():
    flags = rnd.choice([os.O_RDONLY, os.O_WRONLY, os.O_RDWR])
    for bit in flag_bits:
        if rnd.random() < 0.3:
            flags |= bit
    fd = os.open(p(), flags, 0o644)
    try:
        for _ in range(rnd.randint(0, 3)):
            off = rnd.choice([0, 4096, 8192, 1, 12345, 1 << 20])
            if flags & os.O_ACCMODE != os.O_RDONLY:
                if flags & os.O_DIRECT and rnd.random() < 0.7:
                    os.pwrite(fd, memoryview(aligned)[:4096], off & ~4095)
                else:
                    os.pwrite(fd, os.urandom(rnd.randint(1, 5000)), off)
            if flags & os.O_ACCMODE != os.O_WRONLY:
                os.pread(fd, rnd.choice([1, 4096, 100000]), off)
            if rnd.random() < 0.2:
                os.fsync(fd)
            if rnd.random() < 0.1:
                os.ftruncate(fd, rnd.choice([0, 10, 5000]))
    finally:
        os.close(fd)

def op_mmap():
    # a name of this process only: a mapping that another process truncates is SIGBUS
    fd = os.open(os.path.join(root, "mmap-%d" % seed), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, 8192)
        with mmap.mmap(fd, 8192) as mem:
            mem[:4] = b"mmap"
            mem.flush()
    finally:
        os.close(fd)

def op_xattr():
    path = p()
    os.setxattr(path, "user.s%d" % rnd.randint(0, 2), b"v")
    os.listxattr(path)
    os.removexattr(path, "user.s%d" % rnd.randint(0, 2))

ops = [
    op_open, op_open, op_open, op_mmap, op_xattr,
    lambda: os.mkdir(p(), 0o755),
    lambda: os.rmdir(p()),
    lambda: os.unlink(p()),
    lambda: os.rename(p(), p()),
    lambda: os.link(p(), p()),
    lambda: os.symlink(rnd.choice(names), p()),
    lambda: os.readlink(p()),
    lambda: os.chmod(p(), rnd.choice([0o600, 0o644, 0o755])),
    lambda: os.stat(p()),
    lambda: os.lstat(p()),
    lambda: os.listdir(os.path.dirname(p())),
    lambda: os.truncate(p(), rnd.choice([0, 100, 1 << 20])),
    lambda: os.utime(p(), ns=(1, 2)),
]
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    op = rnd.choice(ops)
    try:
        op()
        counts["ok"] = counts.get("ok", 0) + 1
    except OSError as exc:
        counts["err"] = counts.get("err", 0) + 1
        if exc.errno not in expected:
            key = "%s %s" % (getattr(op, "__name__", "?"), errno.errorcode.get(exc.errno))
            unexpected[key] = unexpected.get(key, 0) + 1
print(json.dumps({"counts": counts, "unexpected": unexpected}))
"""


def test_concurrent_stress(full_mount: Mount) -> None:
    m = full_mount
    shared = m.mnt / "session" / "working" / "stress"
    shared.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STRESS, str(shared), str(seed), "4"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(6)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    assert all(r["counts"].get("ok", 0) > 0 for r in reports), reports
    unexpected = [r["unexpected"] for r in reports if r["unexpected"]]
    # the mount still answers
    listing = sh(f"ls -la {shared}")
    assert listing.returncode == 0, listing.stderr
    assert os.stat(shared).st_mode & stat.S_IFDIR
    probe = shared / "after-stress"
    probe.write_text("still here\n")
    assert probe.read_text() == "still here\n"
    # random chmods may have locked the (non-root) owner out, natively too
    assert sh(f"chmod -R u+rwX {shared}").returncode == 0
    walked = sh(f"find {shared} -exec stat -c %n {{}} + > /dev/null")
    assert walked.returncode == 0, walked.stderr
    os.kill(m.daemon_pid(), 0)
    log = log_text(m)
    assert "internal error" not in log, log[log.index("internal error") - 2000 :][:6000]
    assert not unexpected, unexpected
