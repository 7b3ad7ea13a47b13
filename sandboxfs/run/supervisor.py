"""`sandboxfs run -- CMD`: a program inside the sandbox, from mount to unmount.

Three processes. The daemon serves a private mount of the project (forked first; it holds the
backing storage and dies with the lifeline pipe when this process goes). This process, the
supervisor, is non-dumpable: it relays the terminal, forwards signals, runs the network proxy
and writes the run's audit entries. bubblewrap runs CMD in the view `confine` describes. If
anything of that cannot be set up, CMD is not started: there is no unconfined fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import struct
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandboxfs import layout
from sandboxfs.audit import log as audit_mod
from sandboxfs.audit.log import AuditLog
from sandboxfs.config.model import Config
from sandboxfs.core.entry import UNSET, AuditOp, Unset, audit_entry
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.policy import Op, Policy, Trust, Zone
from sandboxfs.core.resolve import ensure_dirs
from sandboxfs.core.syscalls import make_undumpable, set_dumpable, write_all
from sandboxfs.errors import SandboxfsError, SetupError, UserError
from sandboxfs.fuse.spawn import Starting, start_daemon
from sandboxfs.layout import audit_path
from sandboxfs.project import control, gitdir, prompt
from sandboxfs.project.identity import project_identity
from sandboxfs.project.mounts import MountRequest, lazy_unmount, sandboxfs_mounts
from sandboxfs.project.zones import CONFINED_HOME, HOME_ZONE
from sandboxfs.run import confine, doctor, home, seccomp
from sandboxfs.run.nest import (
    NEST_DIR,
    NEST_HOST_DIR,
    NEST_SLOTS_DIR,
    Nesting,
    NestServer,
    child_argv,
)
from sandboxfs.run.netproxy import (
    Allowlist,
    DnsStub,
    HostRule,
    Lookup,
    NetDecision,
    Notices,
    Proxy,
    lookup_refusal,
    printable,
    rule_text,
)
from sandboxfs.run.screen import FullScreen, Hold
from sandboxfs.run.toolchain import Toolchain

EXIT_SETUP = 125  # as `docker run`: the sandbox could not be set up, CMD never ran
EXIT_MOUNT_LOST = 1  # CMD exited 0, but its mount was lost while it ran (the daemon died)
STOP_GRACE = 10.0  # seconds between a forwarded SIGTERM/SIGHUP and killing the sandbox
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_CHANNEL_FD = 7  # (--net none, allow) where the child hands the sockets it bound inside over
DNS_ADDRESS = ("127.0.0.1", 53)  # (--net none, allow) the DNS stub, inside: resolv.conf's
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class RunRequest:
    project: Path
    trust: Trust
    workspace: str
    session: str
    config: Config
    command: tuple[str, ...]
    config_file: Path | None = None
    net: str = "none"
    allow: tuple[HostRule, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    audit_sync: bool = False
    quiet: bool = False
    # What CMD needs of the host, read-only (sandboxfs.run.toolchain): its trees and the PATH.
    tools: Toolchain = field(default_factory=Toolchain)
    approvals: str = "ask"  # how `ask` rules are answered (MountRequest.approvals)
    # A nested child's: the descriptor its parent reads this mount's control socket from, to
    # ask this run's approval requests in the parent's terminal (sandboxfs.run.nest).
    report_control: int | None = None
    # A nested child's place in its tree of runs (its depth, the top-level run's slots).
    nesting: Nesting = field(default_factory=Nesting)


# ----- the run directory: where the private mount lives, and how a dead one is cleaned ------


def runtime_root() -> Path:
    """Private mountpoints of `run`, in the user's own 0700 state dir (never in a project)."""
    return layout.run_dir()


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(record: Path) -> bool | None:
    """Whether the process a `PID START-TIME` file names still runs (a zombie does not); None
    when there is no such file (yet, or any more) or it is still being written."""
    try:
        pid_text, _, started = record.read_text().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in ("Z", "X") and fields[19] == started.strip()


def _record_process(record: Path, pid: int) -> None:
    with contextlib.suppress(OSError):  # the daemon may have removed the directory already
        record.write_text(f"{pid} {_start_time(pid)}\n")


def sweep_dead_runs() -> None:
    """Clear at once what a killed `run` or daemon left.

    A mount whose daemon is gone (ENOTCONN for ever after) is detached, even while its `run`
    still lives; a directory whose `run` is gone is removed once nothing is mounted on it. A
    directory with no `owner` and nothing mounted is one being created (for a minute); with a
    mount it is a dead one (`owner` is written before the mount is made, and removed after).
    Only /proc and the run directories are read: never the mounts, whose daemon may be hung.
    """
    root = runtime_root()
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    mounted = set(sandboxfs_mounts())
    for run_dir in entries:
        mnt = run_dir / "mnt"
        owner = _alive(run_dir / "owner")
        if str(mnt) in mounted:
            if owner and _alive(run_dir / "daemon") is not False:
                continue  # in use (or its daemon is being started)
            lazy_unmount(mnt)
        elif owner:
            continue
        elif owner is None:
            with contextlib.suppress(OSError):
                if time.time() - run_dir.stat().st_mtime < 60:
                    continue  # being created right now
        if not owner:
            remove_run_dir(run_dir)


def _make_run_dir(session: str) -> Path:
    root = runtime_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    run_dir = root / f"{session}-{os.getpid()}"
    run_dir.mkdir(mode=0o700)
    _record_process(run_dir / "owner", os.getpid())
    (run_dir / "mnt").mkdir(mode=0o700)
    return run_dir


def remove_run_dir(run_dir: Path) -> None:
    """Once unmounted (by the daemon, by `run`, or by the sweep for a daemon that died too).

    While `mnt` is still mounted (rmdir fails: EBUSY) nothing is removed, so that the sweep
    still finds whose mount it is and clears it when its `run` is gone.
    """
    try:
        (run_dir / "mnt").rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return
    for name in ("daemon", "owner"):
        with contextlib.suppress(OSError):
            (run_dir / name).unlink()
    shutil.rmtree(run_dir / NEST_HOST_DIR, ignore_errors=True)  # a run that died: its socket
    shutil.rmtree(run_dir / NEST_SLOTS_DIR, ignore_errors=True)  # and its tree's slot files
    with contextlib.suppress(OSError):
        run_dir.rmdir()


# ----- audit entries of the run itself ---------------------------------------------------------


class RunAudit:
    """The supervisor's own entries (`run` start and end, `net`), safe from proxy threads."""

    def __init__(self, req: RunRequest) -> None:
        self._log = AuditLog(
            audit_path(req.project), sync=req.audit_sync, rotate=req.config.audit.rotate_bytes
        )
        self._lock = threading.Lock()
        self._req = req
        self._uid = os.getuid()
        self._worker = req.config.worker.name if req.config.worker is not None else None

    def record(
        self,
        op: AuditOp,
        *,
        pid: int | None,
        comm: str | None,
        detail: str,
        allowed: bool | None = True,
        reason: str | Unset | None = UNSET,
        err: str | Unset | None = UNSET,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """An entry of this run (no path, no zone); `reason` and `errno` only where given."""
        entry = audit_entry(
            op,
            allowed,
            path=None,
            zone=None,
            session=self._req.session,
            workspace=self._req.workspace,
            trust=self._req.trust.value,
            worker=self._worker,
            reason=reason,
            err=err,
            pid=pid,
            uid=self._uid,
            comm=comm,
            detail=detail,
            extra=extra,
        )
        with self._lock:
            self._log.record(entry)
            if not self._log.try_flush():
                raise OSError(errno.EIO, "the audit log cannot be written")

    def close(self) -> None:
        with self._lock:
            self._log.close()


# ----- the program's process: namespaces, descriptors, exec ---------------------------------------


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
class _Child:
    pid: int
    sync: int  # read end: a byte once the launcher runs inside
    errors: int  # read end: bwrap's own stderr
    status: int  # read end: bwrap's --json-status-fd
    listener: socket.socket | None = None  # (--net allow) the proxy's, bound inside
    dns: socket.socket | None = None  # (--net none, allow) the DNS stub's, bound inside


def _start_child(
    argv: list[str],
    options: list[str],
    env: dict[str, str],
    stdio: tuple[int, int, int],
    net: str,
    files: dict[int, int],
) -> _Child:
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
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _die_with_parent(parent)
            os.setsid()
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
            _arrange_fds(fds)  # nothing of the supervisor's is left from here on
            if channel is not None:
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
    for fd in (sync_w, err_w, status_w, filter_fd, options_fd):
        os.close(fd)
    if resolv_fd is not None:
        os.close(resolv_fd)
    child = _Child(pid, sync_r, err_r, status_r)
    if channel is not None:
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
    return child


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


# ----- the terminal ----------------------------------------------------------------------------


class _Terminal:
    """The user's terminal, relayed: the program never holds a descriptor of it.

    Wherever 0, 1 or 2 is the terminal, the program gets the slave of a pty of run's own
    instead (`run -- agent < task.txt`: 1 and 2; `run -- agent | tee log`: 0 and 2), and what
    is not a terminal as it is. TIOCSTI, mode changes and every other ioctl reach only that
    pty; what the program writes there is copied to the terminal. When 0 is the terminal,
    keystrokes are the program's: the terminal is raw, they are relayed, the pty does the line
    discipline (Ctrl-C, job control, full-screen programs) and is the program's controlling
    terminal. When 0 is not, they are not: the terminal keeps its modes, Ctrl-C reaches `run`
    as a signal (forwarded), and the program has no controlling terminal. A descriptor on a
    second terminal (`2>/dev/pts/5`) gets a pipe, copied there. Every terminal of 0, 1 and 2
    is left with the modes it had at the start (`restore`).
    """

    def __init__(self, ttys: list[int]) -> None:
        self.saved = {fd: termios.tcgetattr(fd) for fd in ttys}
        device = {fd: os.fstat(fd).st_rdev for fd in ttys}
        self.home = ttys[0]  # 0, when 0 is the terminal
        on_home = [fd for fd in ttys if device[fd] == device[self.home]]
        self.keyboard = 0 in on_home
        self.stderr_here = 2 in on_home  # run's own lines land on the program's screen
        self.full_screen = FullScreen()
        # Where the pty's output goes; with 1 and 2 elsewhere (`run -- CMD > log`), the
        # terminal itself, for the echo of what is typed.
        self.screen: int | None = next((fd for fd in (1, 2) if fd in on_home), None)
        self.own_screen = False
        if self.screen is None and self.keyboard:
            with contextlib.suppress(OSError):
                flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC
                self.screen, self.own_screen = os.open("/proc/self/fd/0", flags), True
        self.master, slave = os.openpty()
        self.ends = [slave]  # the program's ends, closed here once it holds them
        program = [0, 1, 2]
        for fd in on_home:
            program[fd] = slave
        self.copies: dict[int, int] = {}  # read end of a pipe -> the terminal it is copied to
        for other in sorted({device[fd] for fd in ttys} - {device[self.home]}):
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            fds = [fd for fd in ttys if device[fd] == other]
            self.copies[read_end] = fds[0]
            for fd in fds:
                program[fd] = write_end
            self.ends.append(write_end)
        self.program = (program[0], program[1], program[2])
        self.is_raw = False
        termios.tcsetattr(slave, termios.TCSANOW, self.saved[self.home])
        self.resize()
        os.set_blocking(self.master, False)
        self.pending = b""  # keyboard input the program has not taken yet

    @classmethod
    def of_stdio(cls) -> _Terminal | None:
        """The relay for whichever of 0, 1 and 2 is a terminal; None when none is."""
        ttys = [fd for fd in (0, 1, 2) if os.isatty(fd)]
        return cls(ttys) if ttys else None

    @property
    def controlling(self) -> bool:
        """The pty is the program's 0, so the launcher makes it its controlling terminal."""
        return self.keyboard

    def started(self) -> None:
        """The program holds its ends now; run keeps the master and the pipes' read ends."""
        for fd in self.ends:
            os.close(fd)
        self.ends = []

    def size(self) -> tuple[int, int]:
        """Rows and columns of the user's terminal (24 x 80 when it does not say)."""
        with contextlib.suppress(OSError):
            rows, cols, _, _ = struct.unpack(
                "HHHH", fcntl.ioctl(self.home, termios.TIOCGWINSZ, b"\0" * 8)
            )
            if rows and cols:
                return rows, cols
        return 24, 80

    def discard_typed(self) -> None:
        """Drop what was typed on the keyboard and not yet read (before a prompt is drawn)."""
        if self.keyboard:
            with contextlib.suppress(termios.error, OSError):
                termios.tcflush(0, termios.TCIFLUSH)

    def resize(self) -> None:
        with contextlib.suppress(OSError):
            size = fcntl.ioctl(self.home, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, size)

    def raw(self) -> None:
        if self.keyboard:
            self.is_raw = True
            tty.setraw(0, termios.TCSANOW)

    def restore(self) -> None:
        """Each terminal of 0, 1 and 2 as it was at the start: the one made raw here always;
        any other whose modes changed all the same only while `run` is in its foreground (in
        the background, they are the shell's line editor's by now)."""
        for fd, saved in self.saved.items():
            with contextlib.suppress(termios.error, OSError):
                if termios.tcgetattr(fd) != saved and (
                    (self.is_raw and fd == 0) or os.tcgetpgrp(fd) == os.getpgrp()
                ):
                    termios.tcsetattr(fd, termios.TCSANOW, saved)
        self.is_raw = False

    def close(self) -> None:
        self.restore()
        mine = [*self.ends, self.master, *self.copies]
        if self.own_screen and self.screen is not None:
            mine.append(self.screen)
        for fd in mine:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.ends, self.copies, self.own_screen = [], {}, False

    def foreground(self) -> int | None:
        try:
            return os.tcgetpgrp(self.master)
        except OSError:
            return None


# ----- the supervisor --------------------------------------------------------------------------


FIXES_SHOWN = 50  # hosts the closing line's flags admit at most (the audit has every one)
KILL_WAIT = 5.0  # seconds to wait for bubblewrap after SIGKILL before giving up on it


@dataclass
class Outcome:
    status: int
    started: datetime


class Supervisor:
    """Waits for the program, relaying its terminal and forwarding signals to it."""

    def __init__(self, child: _Child, terminal: _Terminal | None, hold: Hold) -> None:
        self.child = child
        self.hold = hold  # run's own lines, held while the prompt or a full screen is up
        self.terminal = terminal
        self.sel = selectors.DefaultSelector()
        self.pidfd = os.pidfd_open(child.pid)
        self.signals: list[int] = []
        self.setup_text = b""
        self.status_text = b""
        self.ready = False
        self.init_pid: int | None = None  # bwrap's PID 1 inside, as seen from here
        self.cmd_pid: int | None = None
        self.kill_at: float | None = None
        self.reap_by: float | None = None  # set once bwrap was killed
        self.status: int | None = None
        self.on_ready: Callable[[], None] | None = None  # once CMD is about to start
        # The approval prompt in this terminal (prompt.RelayPrompt), and whether it is
        # shown now (the program's output then waits, and keys are the prompt's).
        self.prompt: prompt.RelayPrompt | None = None
        self.prompting = False

    def wait(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        watched = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGWINCH)
        old = {s: signal.signal(s, lambda n, _f: self.signals.append(n)) for s in watched}
        old_wake = signal.set_wakeup_fd(wake_w)
        try:
            self.sel.register(wake_r, selectors.EVENT_READ, "wake")
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
            self.sel.register(self.child.sync, selectors.EVENT_READ, "sync")
            self.sel.register(self.child.errors, selectors.EVENT_READ, "errors")
            self.sel.register(self.child.status, selectors.EVENT_READ, "status")
            if self.terminal is not None:
                if self.terminal.keyboard:
                    self.sel.register(0, selectors.EVENT_READ, "stdin")
                self.sel.register(self.terminal.master, selectors.EVENT_READ, "master")
                for fd in self.terminal.copies:
                    self.sel.register(fd, selectors.EVENT_READ, "copy")
                self.terminal.raw()  # only now: from here on a signal is handled, and undone
            while self.status is None:
                deadlines = [t for t in (self.kill_at, self.reap_by) if t is not None]
                if self.prompt is not None:
                    deadlines.append(time.monotonic() + prompt.POLL)
                timeout = max(0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, events in self.sel.select(timeout):
                    self._handle(key.data, key.fd, events, wake_r)
                self._ask_user()
                self._forward_signals()
                if self.kill_at is not None and time.monotonic() >= self.kill_at:
                    self._kill_sandbox()
                if self.status is None and self.reap_by and time.monotonic() >= self.reap_by:
                    self.status = 128 + signal.SIGKILL  # killed, and not waited for any longer
            if self.prompting and self.prompt is not None:
                self.prompt.close("the program ended")
                self.prompting = False
            self._drain()
            return self.status
        finally:
            if self.terminal is not None:
                self.terminal.restore()  # before the signals are run's own again
            self.hold.release()  # what waited for the prompt or a full screen: said now
            signal.set_wakeup_fd(old_wake)
            for signum, handler in old.items():
                signal.signal(signum, handler)
            self.sel.close()
            for fd in (wake_r, wake_w, self.pidfd, self.child.sync, self.child.errors):
                os.close(fd)
            os.close(self.child.status)

    def _handle(self, what: str, fd: int, events: int, wake_r: int) -> None:
        if what == "wake":
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        elif what == "exit":
            _, wait_status = os.waitpid(self.child.pid, 0)
            code = os.waitstatus_to_exitcode(wait_status)
            self.status = code if code >= 0 else 128 - code
        elif what == "sync":
            if os.read(self.child.sync, 1):
                self.ready = True
                self.cmd_pid = self._find_cmd()
                if self.on_ready is not None:
                    self.on_ready()
            self.sel.unregister(self.child.sync)
        elif what == "errors":
            data = os.read(self.child.errors, 65536)
            if not data:
                self.sel.unregister(self.child.errors)
            elif self.ready:
                self.hold.bytes(data)
            else:
                self.setup_text = (self.setup_text + data)[-65536:]
        elif what == "status":
            data = os.read(self.child.status, 4096)
            if not data:
                self.sel.unregister(self.child.status)
            elif self.init_pid is None:
                self.status_text += data
                line, sep, _ = self.status_text.partition(b"\n")
                if sep:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        self.init_pid = int(json.loads(line)["child-pid"])
        elif what == "stdin" and self.terminal is not None:
            data = b""
            with contextlib.suppress(OSError):
                data = os.read(0, 65536)
            if not data:
                self.sel.unregister(0)
                return
            if self.prompting and self.prompt is not None:  # the user's keys, for the prompt
                if self.prompt.key(data):
                    self._resume_relay()
                return
            self.terminal.pending += data
            self.sel.modify(
                self.terminal.master, selectors.EVENT_READ | selectors.EVENT_WRITE, "master"
            )
        elif what == "master" and self.terminal is not None:
            self._pump_master(events)
        elif what == "copy" and self.terminal is not None:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.sel.unregister(fd)
            else:
                _write_all(self.terminal.copies[fd], data)

    def _ask_user(self) -> None:
        """Show a pending approval request in this terminal: the program's output (its pty
        is not read) and run's own lines are held back until it is answered, here or
        elsewhere, or expires."""
        term = self.terminal
        if self.prompt is None or not self.ready or term is None:
            return
        if self.prompting:
            if not self.prompt.poll(time.monotonic()):  # answered elsewhere, or expired
                self._resume_relay()
            return
        self.hold.hold("prompt")  # before it is drawn: no notice lands in it
        if self.prompt.poll(time.monotonic()):
            self.prompting = True
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(term.master)
        else:
            self.hold.release("prompt")

    def _resume_relay(self) -> None:
        term = self.terminal
        assert term is not None
        self.prompting = False
        self.hold.release("prompt")
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if term.pending else 0)
        self.sel.register(term.master, events, "master")
        if (group := term.foreground()) is not None:  # a full-screen program draws again
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGWINCH)

    def _pump_master(self, events: int) -> None:
        term = self.terminal
        assert term is not None
        if events & selectors.EVENT_READ:
            try:
                data = os.read(term.master, 65536)
            except BlockingIOError:
                data = b"-"
            except OSError:  # EIO: nobody holds the pty any more
                data = b""
            if not data:
                self.sel.unregister(term.master)
                return
            if data != b"-" and term.screen is not None:
                _write_all(term.screen, data)
                full = term.full_screen.feed(data)
                if full is True:
                    self.hold.hold("full screen")
                elif full is False:
                    self.hold.release("full screen")
        if events & selectors.EVENT_WRITE and term.pending:
            with contextlib.suppress(BlockingIOError):
                term.pending = term.pending[os.write(term.master, term.pending) :]
            if not term.pending:
                self.sel.modify(term.master, selectors.EVENT_READ, "master")

    def _drain(self) -> None:
        """What the program wrote just before it ended is still in its pty or pipes."""
        if self.terminal is None:
            return
        deadline = time.monotonic() + 1.0
        copies: list[tuple[int, int | None]] = [*self.terminal.copies.items()]
        for source, target in [(self.terminal.master, self.terminal.screen), *copies]:
            while time.monotonic() < deadline:
                try:
                    data = os.read(source, 65536)
                except OSError:  # nothing more (EAGAIN), or nobody holds the pty (EIO)
                    break
                if not data:
                    break
                if target is not None:
                    _write_all(target, data)

    def _find_cmd(self) -> int | None:
        if self.init_pid is None:
            return None
        children = Path(f"/proc/{self.init_pid}/task/{self.init_pid}/children")
        with contextlib.suppress(OSError, ValueError):
            first = children.read_text().split()
            return int(first[0]) if first else None
        return None

    def _forward_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            if signum == signal.SIGWINCH:
                if self.terminal is not None:
                    self.terminal.resize()
                if self.prompting and self.prompt is not None:
                    self.prompt.redraw()
                continue
            targets = {self.cmd_pid} if self.cmd_pid else set()
            if self.terminal is not None and (group := self.terminal.foreground()):
                targets.add(group)
            if not self.ready or not targets:
                self._kill_sandbox()  # still being set up: nothing to hand the signal to
                continue
            for group in targets:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signum)
            if signum in (signal.SIGTERM, signal.SIGHUP) and self.kill_at is None:
                self.kill_at = time.monotonic() + STOP_GRACE

    def _kill_sandbox(self) -> None:
        """bwrap dies; its PID 1 dies with it (--die-with-parent), and with that all inside."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child.pid, signal.SIGKILL)
        self.kill_at = None
        if self.reap_by is None:
            self.reap_by = time.monotonic() + KILL_WAIT


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select_wait = selectors.DefaultSelector()
            select_wait.register(fd, selectors.EVENT_WRITE)
            select_wait.select(1.0)
            select_wait.close()
        except OSError:
            return


# ----- the whole run ---------------------------------------------------------------------------


def run(req: RunRequest) -> int:
    """Mount, start CMD confined, wait, unmount; CMD's exit status (125 if it never started)."""
    problem = doctor.confinement_problem()
    if problem is not None:
        raise SetupError(problem)
    bwrap = shutil.which("bwrap")
    if bwrap is None:  # checked by confinement_problem, unless PATH changed meanwhile
        raise SetupError(
            "bubblewrap (bwrap) is not installed; install it: apt-get install bubblewrap"
        )
    try:
        seccomp.build_filter()
    except seccomp.SeccompUnsupported as exc:
        raise SetupError(str(exc)) from None
    if shutil.which("setsid", path="/usr/bin:/bin") is None:
        raise SetupError("setsid is not in /usr/bin; install it: apt-get install util-linux")
    make_undumpable()
    sweep_dead_runs()
    policy = Policy(req.config.matrix(), req.config.deny, req.trust, req.config.protect)
    if req.cwd is not None:
        cwd = req.cwd
    elif Zone.REPO in policy.zones and Op.LIST in policy.access(Zone.REPO).ops:
        cwd = f"{confine.SANDBOX}/repo"
    elif Zone.SESSION in policy.zones:
        cwd = f"{confine.SANDBOX}/session/working"
    else:  # a worker that declared neither (sandboxfs.project.workers)
        cwd = confine.SANDBOX
    if req.net == "host" and not req.quiet:
        print(
            "sandboxfs: warning: --net host: the program shares this machine's network, "
            "its loopback services and abstract sockets",
            file=sys.stderr,
        )
    audit = RunAudit(req)
    run_dir = _make_run_dir(req.session)
    in_use = home.hold(req.project, req.workspace, req.trust)  # `home reset` waits for it
    try:
        who = project_identity(req.project)
        _identity_in_home(req, in_use, who)
        return _run_mounted(req, audit, run_dir, cwd, bwrap, who)
    finally:
        audit.close()
        remove_run_dir(run_dir)  # normally gone already: the daemon removes it
        if in_use is not None:
            os.close(in_use)


def _identity_in_home(req: RunRequest, in_use: int | None, who: Mapping[str, str]) -> None:
    """The user's git identity in the program's home (its ~/.gitconfig; home.give_identity):
    the workspace's home at this level, or the session's home for a worker without one."""
    if HOME_ZONE in req.config.zones:
        if in_use is not None:
            home.give_identity(in_use, who)
        return
    if req.config.worker is not None and "session" not in req.config.worker.zones:
        return  # its home is the private /tmp: GIT_AUTHOR_* only
    try:
        session = ensure_dirs(req.project, *layout.session_parts(req.workspace, req.session))
        fd = os.open(ensure_dirs(session, "home", mode=0o755), home.DIR_FLAGS)
    except (OSError, SandboxError):
        return
    try:
        home.give_identity(fd, who)
    finally:
        os.close(fd)


def _run_mounted(
    req: RunRequest, audit: RunAudit, run_dir: Path, cwd: str, bwrap: str, who: dict[str, str]
) -> int:
    mnt = run_dir / "mnt"
    lifeline_r, lifeline_w = os.pipe()
    mount = MountRequest(
        mountpoint=mnt,
        project=req.project,
        trust=req.trust,
        workspace=req.workspace,
        session=req.session,
        config=req.config,
        audit_sync=req.audit_sync,
        config_file=req.config_file,
        command=req.command,
        approvals=req.approvals,
    )
    try:
        # The forked daemon imports pyfuse3 and trio (this process never does), then mounts.
        starting = start_daemon(mount, lifeline_r, after=lambda: remove_run_dir(run_dir))
    except BaseException:
        os.close(lifeline_w)
        raise
    finally:
        os.close(lifeline_r)
    # Meanwhile, what does not look inside the mount: the program's environment, the nest
    # server and bubblewrap's options (they name the mountpoint, never read it).
    nest: NestServer | None = None
    etc_copies = confine.EtcCopies(confine.ETC_COPY_FD)
    try:
        home_inside = CONFINED_HOME  # the workspace's home at this level (project.with_home)
        if HOME_ZONE not in req.config.zones:
            home_inside = f"{confine.SANDBOX}/session/home"
            if req.config.worker is not None and "session" not in req.config.worker.zones:
                home_inside = "/tmp"  # a worker without either zone: the private /tmp
        env = confine.sandbox_env(
            os.environ,
            home=home_inside,
            path=req.tools.env_path(),
            session=req.session,
            # commits carry the user's name; a worktree's metadata is never pruned by gc inside
            extra={**who, **gitdir.environment(req.config), **req.env},
            proxy=req.net == "allow",
        )
        # The git directory of a worktree project, at the path its .git file names (gitdir).
        binds = gitdir.bwrap_binds(req.config, req.trust, mnt)
        # Child workers started from inside, never with more than this sandbox (sandboxfs.run.nest).
        nest = _nest_server(req, audit, run_dir)
        env["PATH"] = f"{NEST_DIR}/bin:{env['PATH']}"
        options = confine.bwrap_args(
            mountpoint=mnt,
            cwd=cwd,
            net=req.net,
            tools=[*binds, *nest.bwrap_args(), *req.tools.bwrap_args()],
            etc_copies=etc_copies,
        )
    except BaseException:
        etc_copies.close()
        if nest is not None:
            nest.close()
        _abandon_daemon(starting, lifeline_w, mnt)  # its own failure first, as it comes first
        raise
    try:
        daemon = starting.ready()
    except BaseException as exc:
        etc_copies.close()
        nest.close()
        os.close(lifeline_w)
        if isinstance(exc, SandboxfsError):
            raise SetupError(exc.message) from None
        raise
    _record_process(run_dir / "daemon", daemon)  # the sweep clears the mount if it dies
    nest.control = control.socket_path(daemon)  # where children's level is asked
    if req.report_control is not None:  # a nested child: its parent's terminal asks for it
        with contextlib.suppress(OSError):
            write_all(req.report_control, str(control.socket_path(daemon)).encode())
        with contextlib.suppress(OSError):
            os.close(req.report_control)
    started = datetime.now(UTC)
    status: int | None = None
    ran = False  # CMD was started (the launcher ran inside)
    lost: str | None = None  # how the daemon ended while the program ran (the mount was lost)
    network: _Network | None = None
    terminal: _Terminal | None = None
    try:
        if not (mnt / cwd.removeprefix(confine.SANDBOX).lstrip("/")).is_dir():
            raise SetupError(
                f"--cwd {cwd}: not a directory the program may enter at this trust level"
            )
        terminal = _Terminal.of_stdio()  # never the terminal itself: run's pty or pipes
        interactive = terminal is not None and terminal.controlling
        argv = [bwrap, "--args", str(confine.ARGS_FD), "--"]
        argv += confine.launcher_argv(interactive, req.command)
        audit.record(
            AuditOp.RUN,
            pid=os.getpid(),
            comm="sandboxfs",
            detail=f"start (net {req.net}): {shlex.join(req.command)}",
            extra={
                "command": list(req.command),
                "net": req.net,
                "allow_hosts": [_rule_text(r) for r in req.allow],
            },
        )
        stdio = terminal.program if terminal else (0, 1, 2)
        child = _start_child(argv, options, env, stdio, req.net, etc_copies.fds)
        etc_copies.close()
        if terminal is not None:
            terminal.started()
        hold = Hold(lambda data: _write_all(2, data), terminal is not None and terminal.stderr_here)
        if req.net != "host":
            network = _Network(req, audit, child, control.socket_path(daemon), hold.line)
        supervisor = Supervisor(child, terminal, hold)
        screen = terminal.screen if terminal is not None and terminal.keyboard else None
        asks_here = req.approvals == "ask" and req.report_control is None
        if terminal is not None and screen is not None and asks_here:
            # the prompt in this very terminal, for this run and the children started inside
            supervisor.prompt = prompt.RelayPrompt(
                control.socket_path(daemon),
                lambda data: _write_all(screen, data),
                nest.prompts,
                size=terminal.size,
                tell=hold.line,
                discard=terminal.discard_typed,
                alternate=lambda: terminal.full_screen.on,
            )
            nest.prompt_here = True
        if not req.quiet:  # said once the sandbox is up: a setup error stays one line
            policy = Policy(req.config.matrix(), req.config.deny, req.trust, req.config.protect)
            supervisor.on_ready = lambda: hold.line(start_line(req, policy, cwd))
        status = supervisor.wait()  # the terminal is raw only in there
        ran = supervisor.ready
        if not ran:
            raise SetupError(_setup_failure(supervisor.setup_text, status))
        lost = _daemon_ended(daemon)
        return _exit_status(status, lost)
    finally:
        etc_copies.close()
        nest.close()
        if terminal is not None:
            terminal.close()
        if network is not None:
            network.close()
        if status is not None:
            detail = f"exit {status}" if ran else f"not started (exit {EXIT_SETUP})"
            extra: dict[str, Any] = {}
            if lost is not None:
                detail += f", mount lost: the daemon {lost}"
                extra = {"mount_lost": lost, "exit": _exit_status(status, lost)}
            with contextlib.suppress(OSError):
                audit.record(
                    AuditOp.RUN,
                    pid=os.getpid(),
                    comm="sandboxfs",
                    detail=f"{detail}: {shlex.join(req.command)}",
                    extra={
                        "command": list(req.command),
                        "net": req.net,
                        "status": status if ran else EXIT_SETUP,
                        **extra,
                    },
                )
        problem = _stop_daemon(daemon, lifeline_w, mnt, lost)
        if problem is not None:
            print(f"sandboxfs: {problem}", file=sys.stderr)
        if ran and status is not None and not req.quiet:
            print(_summary(req, started, status, lost), file=sys.stderr)


def _abandon_daemon(starting: Starting, lifeline_w: int, mnt: Path) -> None:
    """Stop a daemon still starting when run fails before it is ready: once it answers (or
    fails: that, the earlier error, is raised as the SetupError it always was), as after a run."""
    try:
        daemon = starting.ready()
    except SandboxfsError as exc:
        os.close(lifeline_w)
        raise SetupError(exc.message) from None
    problem = _stop_daemon(daemon, lifeline_w, mnt)
    if problem is not None:
        print(f"sandboxfs: {problem}", file=sys.stderr)


def _nest_server(req: RunRequest, audit: RunAudit, run_dir: Path) -> NestServer:
    """The socket a program inside starts child workers through (sandboxfs.run.nest), with this
    run's config as their ceiling and its mount's current trust level (its daemon's, once
    `control` is set) as their highest."""
    build = child_argv(req.project, req.workspace, req.config_file, req.config.worker)
    return NestServer(
        run_dir, req.project, req.config, req.trust, build, audit.record, req.nesting, req.tools
    )


def _daemon_ended(daemon: int) -> str | None:
    """How the daemon ended, if it has (the program then got ENOTCONN or SIGBUS from its
    mount): looked at, not reaped, so that `_stop_daemon` still finds and clears its mount."""
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


def _exit_status(status: int, lost: str | None) -> int:
    """run's exit status: CMD's, except that a lost mount is never a success (CMD's own status
    when it failed, else EXIT_MOUNT_LOST)."""
    return EXIT_MOUNT_LOST if lost is not None and status == 0 else status


DAEMON_GRACE = 10.0  # seconds for the daemon to unmount and exit once its lifeline is closed


def _stop_daemon(daemon: int, lifeline_w: int, mnt: Path, lost: str | None = None) -> str | None:
    """Close the daemon's lifeline and wait for it to unmount and exit: DAEMON_GRACE seconds at
    most, less if SIGINT, SIGTERM or SIGHUP come meanwhile; then it is killed (stopped, hung).
    A mount left behind (its daemon killed, now or while the program ran: `lost` says how) is
    detached. What went wrong, in one line; None when nothing did."""
    try:
        pidfd = os.pidfd_open(daemon)
    except OSError:  # already reaped: nothing to wait for
        os.close(lifeline_w)
        return None
    interrupted: list[int] = []
    watched = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, lambda n, _f: interrupted.append(n)) for s in watched}
    try:
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
        for signum, handler in old.items():
            signal.signal(signum, handler)
        os.close(pidfd)


def _exit_code(pid: int, pidfd: int, timeout: float) -> int | None:
    """A child's exit code (-N: killed by signal N) once it ends within `timeout`, else None."""
    with selectors.DefaultSelector() as sel:
        sel.register(pidfd, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _setup_failure(text: bytes, status: int) -> str:
    lines = [line for line in text.decode("utf-8", "replace").splitlines() if line.strip()]
    detail = lines[-1].strip() if lines else f"bubblewrap exited with status {status}"
    return f"cannot start the sandbox: {detail} (run 'sandboxfs doctor' to check this machine)"


def _rule_text(rule: HostRule) -> str:
    return rule_text(rule)


DNS_LOOKUPS_AUDITED = 1024  # distinct names a run audits as refused lookups; later ones are not


class _Network:
    """(--net none, allow) What serves the sandbox's namespace from here: the DNS stub, the
    proxy (allow), and the one line each prints on run's stderr for a host refused, a host not
    reached, or a name looked up, the first time. Printed with --quiet too: it says why the
    program fails. A child that failed before handing its sockets over says why itself."""

    def __init__(
        self,
        req: RunRequest,
        audit: RunAudit,
        child: _Child,
        control_path: Path,
        notify: Callable[[str], None],
    ) -> None:
        more = (
            "network: more hosts refused or not reached than shown here; all are in "
            f"'sandboxfs audit --session {req.session} --op net'"
        )
        self.notices = Notices(notify, more)
        self.dns = None if child.dns is None else _start_dns(req, audit, child, self.notices)
        self.proxy = None
        if child.listener is not None:
            self.proxy = _start_proxy(req, audit, child, self.notices, control_path)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.dns is not None:
            self.dns.close()


def _start_proxy(
    req: RunRequest, audit: RunAudit, child: _Child, notices: Notices, control_path: Path
) -> Proxy:
    assert child.listener is not None

    def on_decision(decision: NetDecision) -> None:
        pid, comm = connecting_process(child.pid, decision.client[1])
        # Refused by the policy: allowed false (EACCES). Admitted but not completed (no such
        # name, refused or silent upstream): neither allowed nor denied, with its error, which
        # `audit` shows as `failed`. Otherwise allowed.
        allowed = None if decision.failed else decision.allowed
        audit.record(
            AuditOp.NET,
            allowed=allowed,
            pid=pid,
            comm=comm,
            reason=decision.reason,
            err="EACCES" if not decision.allowed else decision.error,
            detail=f"{decision.method} {decision.target()}",
            extra={
                "host": decision.host,
                "port": decision.port,
                "address": decision.address,
                **({"fix": decision.fix} if decision.fix else {}),
            },
        )
        notices.add(decision.target(), decision.notice())

    ask = _host_asker(req, child, control_path) if req.approvals == "ask" else None
    proxy = Proxy(child.listener, Allowlist(req.allow), on_decision, ask=ask)
    proxy.start()
    return proxy


def _host_asker(
    req: RunRequest, child: _Child, path: Path
) -> Callable[[str, int, tuple[str, int], Callable[[], bool]], bool]:
    """The proxy's question about a host not on the allowlist, put to the daemon (approvals:
    a `connect` rule that asks): True once the user allowed it, False when refused, when the
    request timed out, when no rule asks, or once the client went away (Ctrl-C, kill). Waits in
    the connection's own thread only."""

    def ask(host: str, port: int, client: tuple[str, int], gone: Callable[[], bool]) -> bool:
        pid, _ = connecting_process(child.pid, client[1])
        first: int | None = None
        while True:
            message = {"op": "connect", "host": f"{host}:{port}", "pid": pid or 0}
            try:
                reply = control.request(path, message, timeout=5.0)
            except UserError:
                return False
            if not reply.get("ok"):
                return False
            if reply.get("allowed") is True:
                return True
            request = reply.get("request")
            if not isinstance(request, int) or first not in (None, request):
                return False  # refused, or its request timed out (another one was made)
            first = request
            time.sleep(0.5)
            if gone():
                return False

    return ask


def _start_dns(req: RunRequest, audit: RunAudit, child: _Child, notices: Notices) -> DnsStub:
    """The stub every lookup inside reaches: each name a program looks up (a host, not the
    sandbox's own name or a reverse lookup) is audited as a refused lookup and told once."""
    assert child.dns is not None
    allowlist = Allowlist(req.allow) if req.net == "allow" else None
    seen: set[str] = set()  # the stub answers from one thread

    def on_lookup(lookup: Lookup) -> None:
        if not lookup.notable or lookup.name in seen or len(seen) >= DNS_LOOKUPS_AUDITED:
            return
        seen.add(lookup.name)
        pid, comm = connecting_process(child.pid, lookup.client[1], "udp")
        reason = lookup_refusal(lookup.name, allowlist)
        audit.record(
            AuditOp.NET,
            allowed=False,
            pid=pid,
            comm=comm,
            reason=reason,
            detail=f"lookup {printable(lookup.name, 255)}",
            extra={"host": lookup.name, "port": None, "address": None},
        )
        notices.add(f"lookup {lookup.name}", reason)

    stub = DnsStub([child.dns], on_lookup)
    stub.start()
    return stub


def connecting_process(
    netns_pid: int, port: int, protocol: str = "tcp"
) -> tuple[int | None, str | None]:
    """The process inside that holds the socket (TCP, or UDP) bound at 127.0.0.1:`port`.

    Found from this side: the socket's inode in the sandbox's /proc/net/tcp or udp (read
    through a process in that network namespace), then the process holding it among those
    sharing it. Best effort: a process that closed its socket already is (None, None).
    """
    wanted = f"0100007F:{port:04X}"
    inode = None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{netns_pid}/net/{protocol}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == wanted:
                inode = fields[9]
                break
    if inode is None:
        return None, None
    target = f"socket:[{inode}]"
    try:
        netns = os.readlink(f"/proc/{netns_pid}/ns/net")
    except OSError:
        return None, None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "ns" / "net") != netns:
                continue
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) == target:
                    return int(entry.name), (entry / "comm").read_text().strip()
    return None, None


def start_line(req: RunRequest, policy: Policy, cwd: str) -> str:
    """The one line `run` prints once the program starts (not with --quiet; `Hold.line` puts
    "sandboxfs: " before it): who, where, what the program may see and change, its network."""
    groups: dict[str, list[str]] = {"writable": [], "read-only": [], "new files only": []}
    hidden: list[str] = []
    for zone in policy.zones:
        access = policy.access(zone)
        if access.create_only:
            groups["new files only"].append(zone.value)
        elif Op.WRITE in access.ops:
            groups["writable"].append(zone.value)
        elif Op.READ in access.ops or Op.LIST in access.ops:
            groups["read-only"].append(zone.value)
        else:
            hidden.append(zone.value)
    repo = policy.access(Zone.REPO) if Zone.REPO in policy.zones else None
    worker = f", worker {req.config.worker.name}" if req.config.worker is not None else ""
    if repo is None or not (Op.READ in repo.ops or Op.LIST in repo.ops):
        shown = "not visible"
    else:
        shown = "read-write" if Op.WRITE in repo.ops else "read-only"
    parts = [f"{name}: {', '.join(zones)}" for name, zones in groups.items() if zones]
    if hidden:
        parts.append(f"not visible: {', '.join(hidden)}")
    if not policy.zones:
        parts.append("no zones (the worker declared none)")
    if req.net == "allow":
        hosts = ", ".join(_rule_text(rule) for rule in req.allow) or "no host yet"
        network = f"allow ({hosts}; through sandboxfs's proxy)"
    elif req.net == "host":
        network = "host (this machine's network)"
    else:
        network = "none"
    return (
        f"session {req.session}, trust {req.trust.value}{worker}: project {req.project} "
        f"at {confine.SANDBOX}/repo ({shown}); {'; '.join(parts)}; network: {network}; "
        f"starts in {cwd}"
    )


def _summary(req: RunRequest, started: datetime, status: int, lost: str | None = None) -> str:
    query = audit_mod.AuditQuery(session=req.session, since=started)
    allowed = denied = 0
    staged: set[str] = set()
    refused: dict[str, None] = {}  # hosts and looked-up names, in order, once each
    unreached: dict[str, None] = {}
    fixes: dict[str, None] = {}  # the flags that would admit each host refused
    for entry in audit_mod.query(audit_path(req.project), query):
        if entry.get("op") in (AuditOp.RUN, AuditOp.MOUNT, AuditOp.UNMOUNT):
            continue
        if entry.get("op") == AuditOp.NET and entry.get("allowed") is not True:
            (refused if entry.get("allowed") is False else unreached)[_net_target(entry)] = None
            if isinstance(fix := entry.get("fix"), str) and len(fixes) < FIXES_SHOWN:
                fixes[printable(fix, 300)] = None
        if entry.get("allowed") is False:
            count = entry.get("count", 1)  # identical refusals folded into one entry
            denied += count if isinstance(count, int) else 1
            continue
        allowed += 1
        if (
            entry.get("zone") == Zone.STAGED.value
            and entry.get("op") == AuditOp.WRITE
            and entry.get("detail") in (None, "create")  # a file's contents, not a mkdir
        ):
            staged.add(str(entry.get("path")))
    ended = f"exit {status}"
    if lost is not None:
        ended += f"; mount lost: the daemon {lost}; run exits {_exit_status(status, lost)}"
    network = ""
    if refused or unreached:
        parts = [f"refused {_some(refused)}"] if refused else []
        parts += [f"not reached {_some(unreached)}"] if unreached else []
        network = f"; network: {'; '.join(parts)}"
    summary = (
        f"sandboxfs: session {req.session} ended ({ended}): "
        f"{_count(allowed, 'operation')} allowed, {denied} denied, "
        f"{_count(len(staged), 'file')} staged{network}; "
        f"details: sandboxfs audit --session {req.session}"
    )
    if fixes:  # one line that admits every host refused, rather than one more run per host
        given = {f"--allow-host {_rule_text(rule)}": None for rule in req.allow}
        summary += (
            "\nsandboxfs: to allow every host refused as well, run again with: --net allow "
            + " ".join({**given, **fixes})
        )
    return summary


def _net_target(entry: dict[str, Any]) -> str:
    """A `net` entry's host as the summary names it: `host:port`, or `name (lookup)`."""
    host = printable(str(entry.get("host")), 255)
    port = entry.get("port")
    if port is None:
        return f"{host} (lookup)"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _some(names: dict[str, None], shown: int = 5) -> str:
    listed = ", ".join(list(names)[:shown])
    return listed if len(names) <= shown else f"{listed} and {len(names) - shown} more"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
