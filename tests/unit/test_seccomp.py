"""The seccomp filter: its program against the kernel's own syscall tables and a small BPF
interpreter (for both machines), and installed for real in forked children — every denial next
to a control child without the filter, so a test can fail if the kernel would refuse anyway."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandboxfs import seccomp
from sandboxfs.seccomp import (
    BLOCKED_SYSCALLS,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    TIOCLINUX,
    TIOCSTI,
    SeccompUnsupported,
    build_filter,
    filter_fd,
    install,
)

DENY = SECCOMP_RET_ERRNO | errno.EPERM
AUDIT_ARCH_I386 = 0x40000003
CLONE_NEWUSER = 0x10000000
MACHINE = platform.machine()
NATIVE = {"amd64": "x86_64", "arm64": "aarch64"}.get(MACHINE.lower(), MACHINE.lower())
TABLES = {"x86_64": seccomp._X86_64_SYSCALLS, "aarch64": seccomp._AARCH64_SYSCALLS}
HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),  # the table arm64 uses
}
native_only = pytest.mark.skipif(NATIVE not in TABLES, reason=f"no filter for {MACHINE}")
x86_64_only = pytest.mark.skipif(NATIVE != "x86_64", reason="an x86_64 ABI")
_libc = ctypes.CDLL(None, use_errno=True)


def nr(name: str) -> int:
    return TABLES[NATIVE][name]


# --- the program, run in a small classic-BPF interpreter ---------------------------------------


def run_bpf(program: bytes, sysno: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """What the kernel would return for this seccomp_data (only the opcodes the filter uses)."""
    padded = (*args, *(0,) * (6 - len(args)))
    data = struct.pack("<iIQ6Q", sysno, arch, 0, *padded)
    insns = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # ld [k]
            (acc,) = struct.unpack_from("<I", data, k)
        elif code == 0x15:  # jeq #k
            pc += jt if acc == k else jf
        elif code == 0x45:  # jset #k
            pc += jt if acc & k else jf
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_program_decisions(machine: str) -> None:
    program = build_filter(machine)
    table = TABLES[machine]
    arch = seccomp._ARCHES[machine].audit_arch
    ioctl = table["ioctl"]
    for name in BLOCKED_SYSCALLS:
        if name in table:
            assert run_bpf(program, table[name], arch) == DENY, name
    for request in (TIOCSTI, TIOCLINUX, TIOCSTI | 1 << 32, TIOCLINUX | 0xFFFF << 48):
        assert run_bpf(program, ioctl, arch, (3, request)) == DENY, hex(request)
    for request in (termios.TIOCGWINSZ, TIOCSTI + 1, 1 << 32, TIOCSTI << 32):
        assert run_bpf(program, ioctl, arch, (3, request)) == SECCOMP_RET_ALLOW, hex(request)
    blocked = {table[name] for name in BLOCKED_SYSCALLS if name in table}
    for sysno in set(range(500)) - blocked:
        assert run_bpf(program, sysno, arch) == SECCOMP_RET_ALLOW, sysno
    for other in (AUDIT_ARCH_I386, 0xC000003E ^ 0xC00000B7 ^ arch, 0):
        assert run_bpf(program, 39, other) == DENY
    x32 = DENY if machine == "x86_64" else SECCOMP_RET_ALLOW
    assert run_bpf(program, 0x40000000 | 39, arch) == x32


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_program_shape(machine: str) -> None:
    program = build_filter(machine)
    assert len(program) % 8 == 0
    count = len(program) // 8
    assert 0 < count < 4096
    for at in range(count):
        code, jt, jf, _ = struct.unpack_from("<HBBI", program, at * 8)
        if code & 0x07 == 0x05:  # every jump lands inside the program
            assert at + 1 + max(jt, jf) < count


def test_machine_aliases() -> None:
    assert build_filter("amd64") == build_filter("x86_64") == build_filter("X86_64")
    assert build_filter("arm64") == build_filter("aarch64")
    assert build_filter("x86_64") != build_filter("aarch64")


@pytest.mark.parametrize("machine", ["riscv64", "i686", "", "aarch64_be"])
def test_unknown_machine(machine: str) -> None:
    with pytest.raises(SeccompUnsupported) as info:
        build_filter(machine)
    message = str(info.value)
    assert "\n" not in message
    assert repr(machine) in message
    assert "x86_64 and aarch64" in message
    with pytest.raises(SeccompUnsupported):
        filter_fd(machine)


def test_install_refuses_a_foreign_filter() -> None:
    foreign = "aarch64" if NATIVE == "x86_64" else "x86_64"
    with pytest.raises(SeccompUnsupported, match=foreign):
        install(foreign)


def test_tables() -> None:
    assert len(set(BLOCKED_SYSCALLS)) == len(BLOCKED_SYSCALLS)
    assert set(TABLES["x86_64"]) == {*BLOCKED_SYSCALLS, "ioctl"}
    assert set(TABLES["aarch64"]) == {*BLOCKED_SYSCALLS, "ioctl"} - {"uselib"}
    for table in TABLES.values():
        assert len(set(table.values())) == len(table)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_numbers_match_system_header(machine: str) -> None:
    header = HEADERS[machine]
    if not header.exists():
        pytest.skip(f"{header} is not installed")
    defined = dict(re.findall(r"^#define __NR_(\w+)\s+(\d+)\s*$", header.read_text(), re.M))
    for name, number in TABLES[machine].items():
        assert int(defined[name]) == number, name


def test_filter_fd() -> None:
    fd = filter_fd()
    try:
        assert not os.get_inheritable(fd)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert os.read(fd, 1 << 16) == build_filter()
    finally:
        os.close(fd)


# --- installed, in forked children -------------------------------------------------------------


def in_child(probe: Callable[[], Any], *, filtered: bool) -> Any:
    """Run `probe` in a forked child (filtered or not) and return what it returned."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_end)
            if filtered:
                install()
            reply: dict[str, Any] = {"result": probe()}
        except BaseException as exc:
            reply, code = {"error": repr(exc)}, 1
        try:
            os.write(write_end, json.dumps(reply).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        raw = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not raw:
        return {"died": os.waitstatus_to_exitcode(status)}
    reply = json.loads(raw)
    assert "error" not in reply, reply["error"]
    return reply["result"]


def errno_of(action: Callable[[], object]) -> int:
    """0 if the action succeeds, else the errno it failed with."""
    try:
        action()
    except OSError as exc:
        return exc.errno or -1
    return 0


def raw_syscall(*args: int) -> int:
    """syscall(2) with every argument as a full register: 0 on success, else errno."""
    ctypes.set_errno(0)
    result = _libc.syscall(*(ctypes.c_ulong(arg & (1 << 64) - 1) for arg in args))
    return ctypes.get_errno() if result == -1 else 0


def denied(probe: Callable[[], Any]) -> None:
    """The probe fails with EPERM under the filter, and did not without it (else: skip)."""
    control = in_child(probe, filtered=False)
    if control == errno.EPERM:
        pytest.skip("this kernel refuses it with EPERM even without the filter")
    assert in_child(probe, filtered=True) == errno.EPERM


def on_own_tty(request: int, *, wide: bool = False) -> Callable[[], int]:
    """A probe: become a session leader with a fresh pty as controlling tty, then ioctl it."""

    def probe() -> int:
        os.setsid()
        _master, slave = os.openpty()  # the master stays open while the probe runs
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        if wide:
            buf = ctypes.create_string_buffer(b"x\0\0\0\0\0\0\0")
            return raw_syscall(nr("ioctl"), slave, request, ctypes.addressof(buf))
        return errno_of(lambda: fcntl.ioctl(slave, request, b"x\0\0\0\0\0\0\0"))

    return probe


def tiocsti_works_unfiltered() -> bool:
    legacy = Path("/proc/sys/dev/tty/legacy_tiocsti")
    return os.geteuid() == 0 or not legacy.exists() or legacy.read_text().strip() != "0"


@native_only
@pytest.mark.parametrize("wide", [False, True], ids=["tiocsti", "tiocsti-high-bit"])
def test_tiocsti(wide: bool) -> None:
    request = TIOCSTI | (1 << 32 if wide else 0)
    control = in_child(on_own_tty(request, wide=wide), filtered=False)
    # Since Linux 6.2, legacy_tiocsti=0 refuses it (EIO) to all but CAP_SYS_ADMIN.
    assert control == (0 if tiocsti_works_unfiltered() else errno.EIO)
    assert in_child(on_own_tty(request, wide=wide), filtered=True) == errno.EPERM


@native_only
def test_tioclinux() -> None:
    assert in_child(on_own_tty(TIOCLINUX), filtered=False) in (errno.ENOTTY, errno.EINVAL)
    assert in_child(on_own_tty(TIOCLINUX), filtered=True) == errno.EPERM


@native_only
def test_unshare_user_namespace() -> None:
    denied(lambda: raw_syscall(nr("unshare"), CLONE_NEWUSER))


@native_only
def test_mount() -> None:
    # A bad filesystem-type pointer fails with EFAULT before any permission check.
    denied(lambda: raw_syscall(nr("mount"), 0, 0, 1, 0, 0))


@native_only
def test_keyctl() -> None:
    # KEYCTL_GET_KEYRING_ID of the session keyring: allowed to anyone.
    denied(lambda: raw_syscall(nr("keyctl"), 0, -3, 0))


@native_only
def test_bpf() -> None:
    # An unknown command is EINVAL, whether or not unprivileged BPF is disabled.
    denied(lambda: raw_syscall(nr("bpf"), 0x7FFF, 0, 0))


@x86_64_only
def test_i386_abi() -> None:
    """`int 0x80` reaches the i386 table, whose numbers differ: the arch check refuses it."""

    def probe() -> int:
        code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        code.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20 (getpid); int 0x80; ret
        function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
        result: int = function()
        return 0 if result == os.getpid() else -result

    control = in_child(probe, filtered=False)
    if control != 0:
        pytest.skip(f"no i386 emulation here: {control}")
    assert in_child(probe, filtered=True) == errno.EPERM


@x86_64_only
def test_x32_abi() -> None:
    denied(lambda: raw_syscall(0x40000000 | 39))  # x32 getpid


@native_only
def test_ordinary_things_still_work() -> None:
    def probe() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "f")
            path.write_bytes(b"hello")
            with path.open("r+b") as f:
                content = f.read()
                f.write(b"!")
        _master, slave = os.openpty()  # the master stays open while the probe runs
        winsize = fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8)
        true = subprocess.run(["/bin/true"], check=False).returncode
        return {
            "content": content.decode(),
            "winsize": len(winsize),
            "true": true,
            "pid": os.getpid() > 1,
            "keyctl": raw_syscall(nr("keyctl"), 0, -3, 0),
        }

    assert in_child(probe, filtered=True) == {
        "content": "hello",
        "winsize": 8,
        "true": 0,
        "pid": True,
        "keyctl": errno.EPERM,
    }


@native_only
def test_inherited_by_bwrap_children() -> None:
    """bubblewrap accepts the program and its command runs under it."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    script = (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        f"print(libc.syscall({nr('keyctl')}, 0, -3, 0), ctypes.get_errno())"
    )
    argv = [bwrap, "--dev-bind", "/", "/", "--unshare-user", "--die-with-parent"]
    fd = filter_fd()
    try:
        control = subprocess.run(
            [*argv, "--", sys.executable, "-c", script], capture_output=True, text=True
        )
        if control.returncode != 0:
            pytest.skip(f"bubblewrap cannot run here: {control.stderr.strip()}")
        result = subprocess.run(
            [*argv, "--seccomp", str(fd), "--", sys.executable, "-c", script],
            capture_output=True,
            text=True,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    assert control.stdout.split()[1] != str(errno.EPERM)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["-1", str(errno.EPERM)]
