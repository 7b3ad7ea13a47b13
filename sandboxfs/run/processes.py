"""The two processes `run` starts and waits for: bubblewrap, which runs CMD confined, and the
daemon, which serves the private mount.

bubblewrap is forked here with exactly the descriptors the launcher expects, and with --net none
or allow in a user and network namespace of its own, whose DNS stub's and proxy's sockets it
hands back bound. The daemon is forked by sandboxfs.fuse.spawn; here it is stopped (its lifeline
closed, then waited for within a bound) and looked at for having died while the program ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from sandboxfs.core.syscalls import set_dumpable, write_all
from sandboxfs.errors import SandboxfsError, SetupError
from sandboxfs.fuse.spawn import Starting
from sandboxfs.project.mounts import lazy_unmount, sandboxfs_mounts
from sandboxfs.run import confine, seccomp, signals
from sandboxfs.run.request import EXIT_SETUP

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_CHANNEL_FD = 7  # (--net none, allow) where the child hands the sockets it bound inside over
DNS_ADDRESS = ("127.0.0.1", 53)  # (--net none, allow) the DNS stub, inside: resolv.conf's
_libc = ctypes.CDLL(None, use_errno=True)
KILL_WAIT = 5.0  # seconds to wait for bubblewrap after SIGKILL before giving up on it


# ----- bubblewrap: CMD's process, its namespaces and descriptors ---------------------------------


def _die_with_parent(parent: int) -> None:
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(EXIT_SETUP)


def _own_network(channel: socket.socket, proxy: bool) -> None:
    """(--net none and allow, in the child) A user and network namespace of its own with
    loopback up, and bound in it the DNS stub's socket (the nameserver /etc/resolv.conf names)
    and, with `proxy`, the proxy's listening socket, handed to the supervisor; bwrap shares it.
    Binding port 53 works: this process holds every capability in the namespace it made."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "cannot create a network namespace")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH", b"lo", 0).ljust(40, b"\0")
        flags = struct.unpack_from("16sH", fcntl.ioctl(probe, 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(probe, 0x8914, struct.pack("16sH", b"lo", flags | 1).ljust(40, b"\0"))
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as dns,
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener,
    ):
        dns.bind(DNS_ADDRESS)
        handed, tags = [dns.fileno()], b"D"
        if proxy:
            listener.bind(confine.PROXY_ADDRESS)
            listener.listen(128)
            handed, tags = [*handed, listener.fileno()], tags + b"L"
        socket.send_fds(channel, [tags], handed)
    channel.close()


def _arrange_fds(targets: dict[int, int]) -> None:
    """Make each target fd a copy of its source, close-on-exec off, and close everything else.
    The sources are first copied above every target, so that no dup2 replaces one still to be
    copied."""
    above = max(100, max(targets) + 1)
    high = {
        target: fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, above)
        for target, source in targets.items()
    }
    for target, copy in high.items():
        os.dup2(copy, target, inheritable=True)
    os.closerange(max(targets) + 1, os.sysconf("SC_OPEN_MAX"))


@dataclass
class Child:
    pid: int
    sync: int  # read end: a byte once the launcher runs inside
    errors: int  # read end: bwrap's own stderr
    status: int  # read end: bwrap's --json-status-fd
    listener: socket.socket | None = None  # (--net allow) the proxy's, bound inside
    dns: socket.socket | None = None  # (--net none, allow) the DNS stub's, bound inside


def start_child(
    argv: list[str],
    options: list[str],
    env: dict[str, str],
    stdio: tuple[int, int, int],
    net: str,
    files: dict[int, int],
) -> Child:
    """Fork and exec bubblewrap, with exactly the descriptors the launcher expects, and
    `files` (there -> here: what bubblewrap copies into /etc)."""
    options_fd = _options_file(options)
    sync_r, sync_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    filter_fd = seccomp.filter_fd()
    own_network = net != "host"  # none, allow: a namespace of its own, with the DNS stub
    channel = socket.socketpair() if own_network else None
    resolv_fd = _resolv_conf(net) if own_network else None
    fds = {
        0: stdio[0],
        1: stdio[1],
        2: err_w,
        confine.SYNC_FD: sync_w,
        confine.STDERR_FD: stdio[2],
        confine.SECCOMP_FD: filter_fd,
        confine.STATUS_FD: status_w,
        confine.ARGS_FD: options_fd,
        **files,
    }
    if channel is not None and resolv_fd is not None:
        fds[_CHANNEL_FD] = channel[1].fileno()
        fds[confine.DNS_FD] = resolv_fd
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _exec_bwrap(parent, argv, env, fds, err_w, net)
    for fd in (sync_w, err_w, status_w, filter_fd, options_fd):
        os.close(fd)
    if resolv_fd is not None:
        os.close(resolv_fd)
    child = Child(pid, sync_r, err_r, status_r)
    if channel is not None:
        _receive_sockets(channel, child)
    return child


def _exec_bwrap(
    parent: int, argv: list[str], env: dict[str, str], fds: dict[int, int], err_w: int, net: str
) -> NoReturn:
    """(in the forked child) Become bubblewrap, holding `fds` and nothing else; on any failure
    say why on bwrap's stderr and exit EXIT_SETUP: CMD never runs unconfined."""
    try:
        _die_with_parent(parent)
        os.setsid()
        _arrange_fds(fds)  # nothing of the supervisor's is left from here on
        if net != "host":
            # Writing its own uid_map needs a dumpable process (the supervisor is not);
            # exec would make it dumpable anyway.
            set_dumpable(True)
            _own_network(socket.socket(fileno=_CHANNEL_FD), proxy=net == "allow")
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        os.execve(argv[0], argv, env)
    except BaseException as exc:
        message = f"sandboxfs: {_describe(exc)}\n".encode()
        for fd in (err_w, 2):  # err_w is fd 2 once the descriptors are arranged
            with contextlib.suppress(OSError):
                os.write(fd, message)
                break
    os._exit(EXIT_SETUP)


def _receive_sockets(channel: tuple[socket.socket, socket.socket], child: Child) -> None:
    """(--net none, allow) The sockets the child bound inside its namespace: the DNS stub's,
    and with allow the proxy's listener; none when it failed first (it says why itself)."""
    channel[1].close()
    with channel[0]:
        channel[0].settimeout(10)
        try:
            tags, handed, _, _ = socket.recv_fds(channel[0], 2, 2)
        except OSError:
            tags, handed = b"", []
    for tag, fd in zip(tags, handed, strict=False):
        sock = socket.socket(fileno=fd)
        if tag == ord("L"):
            child.listener = sock
        else:
            child.dns = sock


def _resolv_conf(net: str) -> int:
    """The sandbox's /etc/resolv.conf (--net none, allow), in an anonymous file for bwrap."""
    if net == "allow":
        why = (
            "programs reach hosts through sandboxfs's proxy, "
            "HTTPS_PROXY=http://{}:{}, which resolves names itself".format(*confine.PROXY_ADDRESS)
        )
    else:
        why = "the network is off"
    text = (
        f"# sandboxfs: there is no DNS in this sandbox (--net {net}): {why}.\n"
        "# The nameserver below is sandboxfs's own: it answers every query REFUSED, resolves\n"
        "# nothing, and tells the user which name was looked up.\n"
        f"nameserver {DNS_ADDRESS[0]}\n"
        "options attempts:1 timeout:2\n"
    )
    fd = os.memfd_create("sandboxfs-resolv.conf", os.MFD_CLOEXEC)
    write_all(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _options_file(options: list[str]) -> int:
    """bubblewrap's options, NUL-separated, in an anonymous file read from its start (--args)."""
    fd = os.memfd_create("sandboxfs-bwrap-args", os.MFD_CLOEXEC)
    write_all(fd, b"".join(os.fsencode(option) + b"\0" for option in options))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


# ----- the daemon: waiting for it to unmount, and seeing whether it died --------------------------


def abandon_daemon(starting: Starting, lifeline_w: int, mnt: Path) -> None:
    """Stop a daemon still starting when run fails before it is ready: once it answers (or
    fails: that, the earlier error, is raised as the SetupError it always was), as after a run."""
    try:
        daemon = starting.ready()
    except SandboxfsError as exc:
        os.close(lifeline_w)
        raise SetupError(exc.message) from None
    problem = stop_daemon(daemon, lifeline_w, mnt)
    if problem is not None:
        print(f"sandboxfs: {problem}", file=sys.stderr)


def daemon_ended(daemon: int) -> str | None:
    """How the daemon ended, if it has (the program then got ENOTCONN or SIGBUS from its
    mount): looked at, not reaped, so that `stop_daemon` still finds and clears its mount."""
    try:
        info = os.waitid(os.P_PID, daemon, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        # Seen under load: a daemon already a zombie that waitid does not report yet.
        with contextlib.suppress(OSError, IndexError):
            state = Path(f"/proc/{daemon}/stat").read_text().rsplit(") ", 1)[1].split()[0]
            if state in ("Z", "X"):
                info = os.waitid(os.P_PID, daemon, os.WEXITED | os.WNOWAIT)
        if info is None:
            return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        try:
            name = f" ({signal.Signals(info.si_status).name})"
        except ValueError:
            name = ""
        return f"was killed by signal {info.si_status}{name}"
    return f"exited (status {info.si_status})"


DAEMON_GRACE = 10.0  # seconds for the daemon to unmount and exit once its lifeline is closed


def stop_daemon(daemon: int, lifeline_w: int, mnt: Path, lost: str | None = None) -> str | None:
    """Close the daemon's lifeline and wait for it to unmount and exit: DAEMON_GRACE seconds at
    most, less if SIGINT, SIGTERM or SIGHUP come meanwhile; then it is killed (stopped, hung).
    A mount left behind (its daemon killed, now or while the program ran: `lost` says how) is
    detached. What went wrong, in one line; None when nothing did."""
    try:
        pidfd = os.pidfd_open(daemon)
    except OSError:  # already reaped: nothing to wait for
        os.close(lifeline_w)
        return None
    try:
        with signals.noted((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) as interrupted:
            os.close(lifeline_w)  # the daemon unmounts and exits
            deadline = time.monotonic() + DAEMON_GRACE
            code = _exit_code(daemon, pidfd, 0)
            while code is None and not interrupted and time.monotonic() < deadline:
                code = _exit_code(daemon, pidfd, min(0.2, max(0, deadline - time.monotonic())))
            problem = None
            if lost is not None:
                problem = f"mount lost: the daemon (pid {daemon}) {lost} while the program ran"
            elif code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(daemon, signal.SIGKILL)
                _exit_code(daemon, pidfd, KILL_WAIT)
                problem = (
                    f"interrupted while the daemon (pid {daemon}) unmounted: killed it"
                    if interrupted
                    else f"the daemon (pid {daemon}) did not unmount within {DAEMON_GRACE:.0f} s "
                    "after the program ended (stopped or hung): killed it"
                )
            elif code != 0:
                how = f"was killed by signal {-code}" if code < 0 else f"failed (status {code})"
                problem = f"the daemon (pid {daemon}) {how} while it unmounted"
            if str(mnt) in sandboxfs_mounts():
                with contextlib.suppress(OSError):
                    lazy_unmount(mnt)
                problem = (problem or f"the daemon (pid {daemon}) left its mount") + (
                    f"; detached the mount {mnt}"
                )
            return problem
    finally:
        os.close(pidfd)


def _exit_code(pid: int, pidfd: int, timeout: float) -> int | None:
    """A child's exit code (-N: killed by signal N) once it ends within `timeout`, else None."""
    with selectors.DefaultSelector() as sel:
        sel.register(pidfd, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
