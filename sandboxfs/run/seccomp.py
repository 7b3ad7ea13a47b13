"""The seccomp filter `sandboxfs run` hands to bubblewrap (`bwrap --seccomp FD`).

bubblewrap installs a compiled classic-BPF program; libseccomp would compile one for us but is
not pip-installable, so this module assembles the few dozen instructions itself. The filter
closes what the namespaces bubblewrap sets up leave open: the other syscall ABIs (i386 and x32,
whose numbers differ from the table checked here), typing into the terminal (TIOCSTI and
TIOCLINUX), the kernel interfaces no agent needs — keyrings, mounts, namespaces, modules,
BPF, perf, io_uring, the clock, swap and reboot — and the socket families that are not
network-namespaced or that no agent needs (see SOCKET_FAMILIES). Everything else is allowed:
`clone(CLONE_NEWUSER)` is stopped by bubblewrap's `--disable-userns`, and `ptrace` reaches only
the sandbox's own PID namespace.

Sockets. `socket(2)` and `socketpair(2)` are allowed for AF_UNIX, AF_INET, AF_INET6 and
AF_NETLINK only; any other family fails with EAFNOSUPPORT, what a kernel built without that
family answers, so programs take their usual fallback. The rest is an allowlist too, so a family
added to a later kernel is refused as well. Within the allowed families:

- AF_NETLINK: only NETLINK_ROUTE (getaddrinfo's AI_ADDRCONFIG, getifaddrs, if_nameindex, `ip`)
  and NETLINK_SOCK_DIAG (`ss`; it lists the sockets of the program's network namespace, its own
  or with `--net host` the host's, which /proc/net shows anyway). Every other protocol — audit,
  uevents, netfilter, xfrm, generic netlink, connector, crypto... — fails with EPROTONOSUPPORT,
  as on a kernel without it (libaudit, libudev and the like treat that as "not available").
- AF_INET and AF_INET6: the IP protocol numbers (0 to 255) and IPPROTO_MPTCP (262). The numbers
  above 255 are not IP protocols but switches to other socket code: IPPROTO_SMC (256) makes an
  AF_SMC socket through AF_INET, so those fail with EPROTONOSUPPORT, as on a kernel without
  them. `socket(AF_INET, SOCK_PACKET)`, the obsolete spelling the kernel turns into an
  AF_PACKET socket, fails with EAFNOSUPPORT like AF_PACKET itself.

The arguments are `int`s that the kernel truncates from the 64-bit registers seccomp_data
holds, so the filter compares the low 32 bits and ignores the high word, exactly as the kernel
does: a value with junk in the high word is judged by what the kernel will see.

No supported machine has socketcall(2), the multiplexer through which 32-bit x86 (and other
32-bit ABIs) create sockets with the family in user memory, out of the filter's reach: on x86_64
the i386 and x32 ABIs are refused whole, on aarch64 the AArch32 one, by the architecture check
(`socketcall` is i386 syscall 102). io_uring is refused because its IORING_OP_SOCKET creates
sockets without passing through socket(2), and so around this filter.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from sandboxfs.core.syscalls import write_all

# Classic BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
BPF_LD = 0x00
BPF_ALU = 0x04
BPF_JMP = 0x05
BPF_RET = 0x06
BPF_W = 0x00
BPF_ABS = 0x20
BPF_AND = 0x50
BPF_JEQ = 0x10
BPF_JGE = 0x30
BPF_JSET = 0x40
BPF_K = 0x00
BPF_MAXINSNS = 4096

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_DATA = 0x0000FFFF
_DENY = SECCOMP_RET_ERRNO | (errno.EPERM & SECCOMP_RET_DATA)
_NO_FAMILY = SECCOMP_RET_ERRNO | (errno.EAFNOSUPPORT & SECCOMP_RET_DATA)
_NO_PROTOCOL = SECCOMP_RET_ERRNO | (errno.EPROTONOSUPPORT & SECCOMP_RET_DATA)

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6].
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARGS = 16
# The low word of args[i] on a little-endian machine (the kernel truncates int arguments to it).
_ARG0_LOW = _OFF_ARGS
_ARG1_LOW = _OFF_ARGS + 8
_ARG2_LOW = _OFF_ARGS + 16

_X32_SYSCALL_BIT = 0x40000000
TIOCSTI = 0x5412
TIOCLINUX = 0x541C

# Socket families (linux/socket.h) and protocols (linux/netlink.h, linux/in.h).
AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_NETLINK = 16
SOCKET_FAMILIES: tuple[int, ...] = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
NETLINK_ROUTE = 0
NETLINK_SOCK_DIAG = 4
NETLINK_PROTOCOLS: tuple[int, ...] = (NETLINK_ROUTE, NETLINK_SOCK_DIAG)
IPPROTO_MAX_IP = 255  # the last IP protocol number; higher ones pick other socket code
IPPROTO_MPTCP = 262
SOCK_TYPE_MASK = 0xF  # SOCK_NONBLOCK and SOCK_CLOEXEC are flags above it
SOCK_PACKET = 10

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
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
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
    "socket": 41,
    "socketpair": 53,
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
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
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
    "socket": 198,
    "socketpair": 199,
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
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
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
    syscalls: Mapping[str, int]  # ioctl, socket(pair) and every blocked syscall the machine has
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
    jge = BPF_JMP | BPF_JGE | BPF_K
    ret = BPF_RET | BPF_K
    program: list[_Insn | str] = [
        _stmt(ld, _OFF_ARCH),
        _jump(jeq, arch.audit_arch, 0, "deny"),
        _stmt(ld, _OFF_NR),
    ]
    if arch.x32:
        program.append(_jump(BPF_JMP | BPF_JSET | BPF_K, _X32_SYSCALL_BIT, "deny", 0))
    program += [
        _jump(jeq, arch.syscalls["socket"], "socket", 0),
        _jump(jeq, arch.syscalls["socketpair"], "socket", 0),
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
    program += ["allow", _stmt(ret, SECCOMP_RET_ALLOW)]
    program += ["deny", _stmt(ret, _DENY)]
    # socket(family, type, protocol) and socketpair(family, type, protocol, sv): each argument is
    # an int, compared on its low 32 bits as the kernel truncates it. Jumps go forward only, so
    # the block has its own allow.
    program += [
        "socket",
        _stmt(ld, _ARG0_LOW),
        _jump(jeq, AF_UNIX, "socket_allow", 0),
        _jump(jeq, AF_INET6, "ip", 0),
        _jump(jeq, AF_NETLINK, "netlink", 0),
        _jump(jeq, AF_INET, 0, "no_family"),
        _stmt(ld, _ARG1_LOW),
        _stmt(BPF_ALU | BPF_AND | BPF_K, SOCK_TYPE_MASK),
        _jump(jeq, SOCK_PACKET, "no_family", 0),  # (AF_INET, SOCK_PACKET) is AF_PACKET
        "ip",
        _stmt(ld, _ARG2_LOW),
        _jump(jge, IPPROTO_MAX_IP + 1, 0, "socket_allow"),
        _jump(jeq, IPPROTO_MPTCP, "socket_allow", "no_protocol"),
        "netlink",
        _stmt(ld, _ARG2_LOW),
    ]
    program += [_jump(jeq, protocol, "socket_allow", 0) for protocol in NETLINK_PROTOCOLS]
    program += ["no_protocol", _stmt(ret, _NO_PROTOCOL)]
    program += ["no_family", _stmt(ret, _NO_FAMILY)]
    program += ["socket_allow", _stmt(ret, SECCOMP_RET_ALLOW)]
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
