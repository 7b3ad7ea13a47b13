"""`sandboxfs run` and socket families: a program under `--net none` could open AF_VSOCK sockets,
which no network namespace confines, and reach the hypervisor's port space around the namespace and
the proxy. The seccomp filter now admits only AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK (route and
sock_diag); everything else fails with EAFNOSUPPORT, as on a kernel without that family. Here with
the real command, as root and as an ordinary user, next to a control run of the same probe outside
the sandbox.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.run import (
    NOBODY,
    PY,
    lines,
    nobody_env,
    nobody_home,
    nothing_left_behind,
    project,
    sbx,
)

__all__ = ["nobody_home", "nothing_left_behind", "project"]  # fixtures, used by name

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)

# One line per attempt, `name: ok` or `name: ERRNO`. Numbers, not socket.AF_* names, so that a
# Python built without a constant still probes the family.
SOCKET_PROBE = r"""
import ctypes, errno, socket

def attempt(name, make):
    try:
        make()
        print(f"{name}: ok")
    except OSError as exc:
        print(f"{name}: {errno.errorcode.get(exc.errno, exc.errno)}")

def sock(*args):
    socket.socket(*args).close()

def pair(*args):
    for s in socket.socketpair(*args):
        s.close()

def loopback_tcp():
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname(), timeout=5) as client:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"x")
                assert client.recv(1) == b"x"

def io_uring():
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    if libc.syscall(425, 1, params) == -1:  # io_uring_setup, on x86_64 and aarch64
        raise OSError(ctypes.get_errno(), "io_uring_setup")

attempt("vsock", lambda: sock(40, socket.SOCK_STREAM))
attempt("vsock-pair", lambda: pair(40, socket.SOCK_STREAM))
attempt("packet", lambda: sock(17, socket.SOCK_RAW, 0x0300))
attempt("inet-sock-packet", lambda: sock(2, 10, 0x0300))
attempt("xdp", lambda: sock(44, socket.SOCK_RAW))
attempt("netlink-audit", lambda: sock(16, socket.SOCK_RAW, 9))
attempt("netlink-generic", lambda: sock(16, socket.SOCK_RAW, 16))
attempt("io-uring", io_uring)
attempt("unix", lambda: sock(1, socket.SOCK_STREAM))
attempt("unix-pair", lambda: pair(1, socket.SOCK_STREAM))
attempt("inet", lambda: sock(2, socket.SOCK_DGRAM))
attempt("inet6", lambda: sock(10, socket.SOCK_STREAM))
attempt("loopback-tcp", loopback_tcp)
attempt("netlink-route", lambda: sock(16, socket.SOCK_RAW, 0))
attempt("if-nameindex", socket.if_nameindex)
"""

REFUSED = {
    "vsock": "EAFNOSUPPORT",
    "vsock-pair": "EAFNOSUPPORT",
    "packet": "EAFNOSUPPORT",  # not EPERM: the filter answers before the capability check
    "inet-sock-packet": "EAFNOSUPPORT",
    "xdp": "EAFNOSUPPORT",
    "netlink-audit": "EPROTONOSUPPORT",
    "netlink-generic": "EPROTONOSUPPORT",
    "io-uring": "EPERM",
}
WORKS = ["unix", "unix-pair", "inet", "loopback-tcp", "netlink-route", "if-nameindex"]


def outside(prefix: list[str] | None = None) -> dict[str, str]:
    """The same probe outside any sandbox: what this kernel does without the filter."""
    result = subprocess.run(
        [*(prefix or []), PY, "-c", SOCKET_PROBE], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return lines(result)


def check(found: dict[str, str], control: dict[str, str]) -> None:
    for name, refusal in REFUSED.items():
        assert found[name] == refusal, (name, found)
    for name in WORKS:
        assert found[name] == "ok", (name, found)
    assert found["inet6"] == control["inet6"], found  # as the host has it (IPv6 may be off)
    # Where the host opens vsock (a VM with virtio-vsock), the sandbox did not: the hole is shut.
    if control["vsock"] == "ok":
        assert found["vsock"] == "EAFNOSUPPORT"
    assert control["netlink-audit"] != "EPROTONOSUPPORT", control
    assert errno.EAFNOSUPPORT == 97  # the errno programs check for a missing family


@pytest.mark.parametrize("net", ["none", "host"])
def test_socket_families_through_run(project: Path, net: str) -> None:
    result = sbx("run", "--quiet", "--project", project, "--net", net, "--", PY, "-c", SOCKET_PROBE)
    assert result.returncode == 0, result.stderr
    check(lines(result), outside())


def test_socket_families_ordinary_user(nobody_home: Path) -> None:
    project_dir = nobody_home / "project"
    result = sbx(
        "run",
        "--quiet",
        "--project",
        project_dir,
        "--net",
        "none",
        "--",
        PY,
        "-c",
        SOCKET_PROBE,
        prefix=NOBODY,
        env=nobody_env(nobody_home),
    )
    assert result.returncode == 0, result.stderr
    control = outside(NOBODY)
    assert control["packet"] == "EPERM", control  # without the filter: the kernel's refusal
    check(lines(result), control)
