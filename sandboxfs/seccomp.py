"""The seccomp filter `sandboxfs run` hands to bubblewrap (`bwrap --seccomp FD`).

bubblewrap installs a compiled classic-BPF program; libseccomp would compile one for us but is
not pip-installable, so this module assembles the few dozen instructions itself. The filter
closes what the namespaces bubblewrap sets up leave open: the other syscall ABIs (i386 and x32,
whose numbers differ from the table checked here), typing into the terminal (TIOCSTI and
TIOCLINUX), and the kernel interfaces no agent needs — keyrings, mounts, namespaces, modules,
BPF, perf, the clock, swap and reboot. Everything else is allowed: `clone(CLONE_NEWUSER)` is
stopped by bubblewrap's `--disable-userns`, and `ptrace` reaches only the sandbox's own PID
namespace.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from .core.syscalls import write_all

# Classic BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
BPF_LD = 0x00
BPF_JMP = 0x05
BPF_RET = 0x06
BPF_W = 0x00
BPF_ABS = 0x20
BPF_JEQ = 0x10
BPF_JGE = 0x30
BPF_JSET = 0x40
BPF_K = 0x00
BPF_MAXINSNS = 4096

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_DATA = 0x0000FFFF
_DENY = SECCOMP_RET_ERRNO | (errno.EPERM & SECCOMP_RET_DATA)

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6].
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARGS = 16
_ARG1_LOW = _OFF_ARGS + 8  # the low word of args[1] on a little-endian machine

_X32_SYSCALL_BIT = 0x40000000
TIOCSTI = 0x5412
TIOCLINUX = 0x541C

_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_MODE_FILTER = 2

_INSN = struct.Struct("<HBBI")  # struct sock_filter; both supported machines are little-endian

BLOCKED_SYSCALLS: tuple[str, ...] = (
    "keyctl",
    "add_key",
    "request_key",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "perf_event_open",
    "syslog",
    "acct",
    "quotactl",
    "quotactl_fd",
    "uselib",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "userfaultfd",
    "lookup_dcookie",
    "swapon",
    "swapoff",
    "reboot",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
)

# arch/x86/entry/syscalls/syscall_64.tbl (the "common" and "64" rows).
_X86_64_SYSCALLS: Mapping[str, int] = {
    "ioctl": 16,
    "syslog": 103,
    "uselib": 134,
    "adjtimex": 159,
    "pivot_root": 155,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "clock_adjtime": 305,
    "setns": 308,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "quotactl_fd": 443,
}

# include/uapi/asm-generic/unistd.h, which arm64 uses: no uselib, and umount2 is the only umount.
_AARCH64_SYSCALLS: Mapping[str, int] = {
    "lookup_dcookie": 18,
    "ioctl": 29,
    "umount2": 39,
    "mount": 40,
    "pivot_root": 41,
    "chroot": 51,
    "quotactl": 60,
    "acct": 89,
    "unshare": 97,
    "kexec_load": 104,
    "init_module": 105,
    "delete_module": 106,
    "clock_settime": 112,
    "syslog": 116,
    "reboot": 142,
    "settimeofday": 170,
    "adjtimex": 171,
    "add_key": 217,
    "request_key": 218,
    "keyctl": 219,
    "swapon": 224,
    "swapoff": 225,
    "perf_event_open": 241,
    "clock_adjtime": 266,
    "setns": 268,
    "finit_module": 273,
    "bpf": 280,
    "userfaultfd": 282,
    "kexec_file_load": 294,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "quotactl_fd": 443,
}


@dataclass(frozen=True)
class _Arch:
    audit_arch: int  # seccomp_data.arch of this machine's native syscalls
    syscalls: Mapping[str, int]  # ioctl and every blocked syscall the machine has
    x32: bool  # whether x32 syscalls (nr | 0x40000000) arrive with the same audit_arch


_ARCHES: Mapping[str, _Arch] = {
    "x86_64": _Arch(0xC000003E, _X86_64_SYSCALLS, x32=True),
    "aarch64": _Arch(0xC00000B7, _AARCH64_SYSCALLS, x32=False),
}
_ALIASES: Mapping[str, str] = {"amd64": "x86_64", "arm64": "aarch64"}


class SeccompUnsupported(Exception):
    """There is no filter for this machine, so `sandboxfs run` must not start the command."""


def _machine(machine: str | None) -> str:
    """The canonical name of the given machine (default: this one), or SeccompUnsupported."""
    given = platform.machine() if machine is None else machine
    name = given.lower()
    name = _ALIASES.get(name, name)
    if name not in _ARCHES:
        raise SeccompUnsupported(
            f"no seccomp filter for machine {given!r}; sandboxfs run supports x86_64 and aarch64"
        )
    return name


# The assembler: jump targets are label names, resolved to relative offsets by _assemble.
_Insn = tuple[int, int, str | int, str | int]  # code, k, jt, jf (a label or a literal offset)


def _stmt(code: int, k: int) -> _Insn:
    return (code, k, 0, 0)


def _jump(code: int, k: int, jt: str | int, jf: str | int) -> _Insn:
    return (code, k, jt, jf)


def _assemble(program: list[_Insn | str]) -> bytes:
    """Pack the program; a bare string marks the label of the next instruction."""
    labels: dict[str, int] = {}
    insns: list[_Insn] = []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)

    def offset(at: int, target: str | int) -> int:
        off = target if isinstance(target, int) else labels[target] - at - 1
        if not 0 <= off < 256:
            raise ValueError(f"BPF jump at {at} out of range: {off}")
        return off

    if not 0 < len(insns) < BPF_MAXINSNS:
        raise ValueError(f"BPF program of {len(insns)} instructions")
    return b"".join(
        _INSN.pack(code, offset(at, jt), offset(at, jf), k)
        for at, (code, k, jt, jf) in enumerate(insns)
    )


def build_filter(machine: str | None = None) -> bytes:
    """The compiled program for `machine` (default: this one), as bubblewrap reads it."""
    arch = _ARCHES[_machine(machine)]
    ld = BPF_LD | BPF_W | BPF_ABS
    jeq = BPF_JMP | BPF_JEQ | BPF_K
    program: list[_Insn | str] = [
        _stmt(ld, _OFF_ARCH),
        _jump(jeq, arch.audit_arch, 0, "deny"),
        _stmt(ld, _OFF_NR),
    ]
    if arch.x32:
        program.append(_jump(BPF_JMP | BPF_JSET | BPF_K, _X32_SYSCALL_BIT, "deny", 0))
    program += [
        _jump(jeq, arch.syscalls["ioctl"], 0, "syscalls"),
        _stmt(ld, _ARG1_LOW),  # the kernel truncates the request to 32 bits: so do we
        _jump(jeq, TIOCSTI, "deny", 0),
        _jump(jeq, TIOCLINUX, "deny", "allow"),
        "syscalls",
    ]
    program += [
        _jump(jeq, arch.syscalls[name], "deny", 0)
        for name in BLOCKED_SYSCALLS
        if name in arch.syscalls
    ]
    program += ["allow", _stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)]
    program += ["deny", _stmt(BPF_RET | BPF_K, _DENY)]
    return _assemble(program)


def filter_fd(machine: str | None = None) -> int:
    """A close-on-exec memfd holding the program at offset 0, for `bwrap --seccomp FD`.

    The caller passes it with `pass_fds` (which makes it inheritable in the child only) and
    closes it afterwards.
    """
    program = build_filter(machine)
    fd = os.memfd_create("sandboxfs-seccomp", os.MFD_CLOEXEC)
    try:
        write_all(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def install(machine: str | None = None) -> None:
    """Apply the filter to the calling thread (and what it later forks and executes).

    Only this machine's own filter can be installed: a foreign one would fail every syscall,
    including exit.
    """
    name = _machine(machine)
    if name != _machine(None):
        raise SeccompUnsupported(
            f"cannot install the {name} seccomp filter on machine {platform.machine()!r}"
        )
    code = build_filter(name)
    program = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // _INSN.size, ctypes.addressof(program))
    libc = ctypes.CDLL(None, use_errno=True)
    _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1, 0)  # lets an unprivileged process install a filter
    _prctl(libc, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog))


def _prctl(libc: ctypes.CDLL, option: int, arg2: int, arg3: int) -> None:
    """prctl(option, arg2, arg3, 0, 0), raising OSError on failure."""
    args = (ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if libc.prctl(option, *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")
