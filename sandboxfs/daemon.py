"""Mount lifecycle: validate the request, lay out the state dir, serve until unmounted.

`validate` runs in the `sandboxfs mount` process so that bad input fails before anything is
mounted; `serve` runs in the daemon and reports readiness (or one line of error) through a
pipe, so that `mount` returns only once the filesystem answers.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import inspect
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from . import control, request_wait
from .audit import AuditLog
from .config import Config
from .core.context import context_document
from .core.guard import MountInfo
from .core.policy import Trust, Zone
from .core.store import CONTEXT_NAME, CONTROL_NAME, STATE_DIR_NAME, Node, Store, ensure_dirs
from .core.syscalls import CAP_SYS_RESOURCE, drop_effective_capability, make_undumpable
from .errors import UserError
from .operations import SandboxOperations
from .project import (
    audit_path,
    check_id,
    config_source,
    hidden_identities,
    make_guard,
    new_session_id,
    prepare_zones,
    session_dir,
    state_dir,
    worker_layers,
)
from .state import hold

log = logging.getLogger(__name__)

FSTYPE = "fuse.sandboxfs"
_DEAD_MOUNT_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


@dataclass(frozen=True)
class MountRequest:
    mountpoint: Path
    project: Path
    trust: Trust
    workspace: str
    session: str
    config: Config
    audit_sync: bool = False
    debug: bool = False
    allow_other: bool = False
    config_file: Path | None = None
    command: tuple[str, ...] | None = None  # set by `sandboxfs run`: shown in context.json
    read_only: bool = False  # mounted `ro`: the kernel refuses every change


def choose_session(
    project: Path, workspace: str, session: str | None, new_session: str | None
) -> tuple[str, bool]:
    """The session to use and whether it is resumed.

    `--session ID` must name an existing session not in use by another mount (two mounts of
    one session would interleave its scratch files unnoticed); `--new-session ID` must not exist
    yet (a typo must not silently start an empty session); neither gives a random new id.
    """
    if session is not None:
        check_id("session", session)
        if not session_dir(project, workspace, session).is_dir():
            known = existing_sessions(project, workspace)
            listed = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "")
            raise UserError(
                f"session {session!r} does not exist in workspace {workspace!r} "
                f"({'existing, newest first: ' + listed if known else 'it has no sessions yet'}); "
                f"to start one with this id: --new-session {session}"
            )
        for mountpoint, context in _live_contexts():
            if (context.get("project"), context.get("workspace"), context.get("session")) == (
                str(project),
                workspace,
                session,
            ):
                raise UserError(
                    f"session {session} is already mounted at {mountpoint} "
                    f"(pid {context.get('pid')}); unmount it first "
                    f"(sandboxfs umount {mountpoint}) or start another session"
                )
        return session, True
    if new_session is not None:
        check_id("session", new_session)
        if session_dir(project, workspace, new_session).is_dir():
            raise UserError(
                f"session {new_session!r} already exists in workspace {workspace!r}; "
                f"resume it with --session {new_session}"
            )
        return new_session, False
    return new_session_id(), False


def existing_sessions(project: Path, workspace: str) -> list[str]:
    """Session ids of a workspace, most recently used first."""
    root = state_dir(project) / "workspaces" / workspace / "sessions"
    try:
        entries = [e for e in root.iterdir() if e.is_dir()]
    except OSError:
        return []
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    return [e.name for e in entries]


def _live_contexts() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for mountpoint in sandboxfs_mounts():
        context = read_context(Path(mountpoint), timeout=2.0)
        if isinstance(context, dict):
            found.append((mountpoint, context))
    return found


def validate_mountpoint(mountpoint: Path, project: Path) -> Path:
    """An existing, empty directory that nothing is mounted on; clears a dead sandboxfs mount."""
    try:
        mountpoint.stat()
    except FileNotFoundError:
        raise UserError(
            f"mountpoint {mountpoint} does not exist; create an empty directory first "
            f"(mkdir {mountpoint})"
        ) from None
    except OSError as exc:
        if exc.errno not in _DEAD_MOUNT_ERRNOS:
            raise UserError(f"mountpoint {mountpoint}: {exc.strerror}") from None
        lazy_unmount(mountpoint)
    mp = Path(os.path.abspath(mountpoint))
    if str(mp) in sandboxfs_mounts() and read_context(mp, timeout=2.0) == "dead":
        # stat() above may have been answered from the kernel's cache of a dead mount.
        lazy_unmount(mp)
    mp = mp.resolve()
    if os.path.ismount(mp):
        raise UserError(
            f"mountpoint {mountpoint} is already mounted; unmount it first "
            f"(sandboxfs umount {mountpoint})"
        )
    if not mp.is_dir():
        raise UserError(f"mountpoint {mountpoint} is not a directory")
    if any(mp.iterdir()):
        raise UserError(f"mountpoint {mountpoint} is not empty; use an empty directory")
    if mp == project:
        raise UserError(
            f"mountpoint {mountpoint} is the project directory itself; "
            f"use an empty directory, for example {project / 'mnt'}"
        )
    _check_dev_fuse()
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        raise UserError("fusermount3 not found; install fuse3 (apt-get install fuse3)")
    return mp


def _check_dev_fuse() -> None:
    """Missing and not permitted are different problems with different fixes."""
    try:
        st = os.stat("/dev/fuse")
    except FileNotFoundError:
        raise UserError(
            "/dev/fuse does not exist; install fuse3 and load the module "
            "(apt-get install fuse3; modprobe fuse), or in a container pass --device /dev/fuse"
        ) from None
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise UserError(
            f"/dev/fuse is not readable and writable by you (mode {st.st_mode & 0o777:04o}, "
            f"owner uid {st.st_uid}); Debian makes it 0666: sudo chmod 0666 /dev/fuse "
            f"(see 'sandboxfs doctor')"
        )


NOT_YOURS = "not yours"


def read_context(mountpoint: Path, timeout: float) -> dict[str, Any] | str:
    """A mount's context.json, or why not: "dead" (its daemon is gone: ENOTCONN), "not yours"
    (another user's mount: EACCES), "unresponsive" (no answer within `timeout`: hung or very
    busy), or "unreadable" (any other error).

    Opening the file always reaches the daemon (opens are never answered from the kernel's
    cache), so this tells a live mount from a dead one; a thread bounds a hung daemon.
    """
    result: dict[str, Any] | str = "unresponsive"

    def read() -> None:
        nonlocal result
        try:
            result = json.loads((mountpoint / ".sandboxfs" / "context.json").read_bytes())
        except OSError as exc:
            if exc.errno in _DEAD_MOUNT_ERRNOS:
                result = "dead"
            elif exc.errno in (errno.EACCES, errno.EPERM):
                result = NOT_YOURS
            else:
                result = "unreadable"
        except ValueError:
            result = "unreadable"

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout)
    return result


def mount_owner(mountpoint: str) -> int | None:
    """The uid that made a FUSE mount (its `user_id=` option in the mount table)."""
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and _unescape_mount_path(fields[1]) == mountpoint:
                for option in fields[3].split(","):
                    if option.startswith("user_id="):
                        return int(option.removeprefix("user_id="))
    return None


def lazy_unmount(mountpoint: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)


def prepare_store(req: MountRequest) -> Store:
    """Lay out the state dir for the session and open every zone once."""
    dirs = prepare_zones(
        req.project,
        req.workspace,
        req.session,
        req.config,
        config_source(req.project, req.config_file),
    )
    # The mountpoint is the directory under the mount (what a listing's d_ino names); once
    # mounted, lookups see a mount root, which is never entered anyway.
    return Store(dirs, worker_layers(req.project), hidden_identities(req.project, req.mountpoint))


def _identity(node: Node) -> tuple[int, int] | None:
    return node.key[1:] if node.key is not None else None


def _setup_logging(req: MountRequest) -> None:
    logs = ensure_dirs(req.project, STATE_DIR_NAME, "logs")
    stream = open(logs / f"{req.session}.log", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if req.debug else logging.INFO)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)


def serve(
    req: MountRequest,
    ready: Callable[[], None],
    lifeline: int | None = None,
    after: Callable[[], None] | None = None,
) -> None:
    """Mount and serve until unmounted or signalled; the audit log is flushed on the way out.

    `lifeline` is the read end of a pipe whose write end only the process that wants this
    mount holds (`sandboxfs run`): when it closes, even by that process being killed, the
    daemon unmounts and exits, so no mount outlives its user; `after` runs once it has
    unmounted (`run` removes its private mountpoint there).
    """
    os.umask(0)  # modes arrive already masked by the kernel; apply them exactly
    _raise_fd_limit()
    # Before the first descriptor into backing storage: a same-uid process must not reach
    # them through /proc/<pid>/fd, nor ptrace the daemon.
    make_undumpable()
    # Writes for callers are charged to them (see SandboxOperations._as_caller); a root
    # daemon that kept CAP_SYS_RESOURCE would let them use root's reserve and pass quotas.
    drop_effective_capability(CAP_SYS_RESOURCE)
    store = prepare_store(req)
    try:  # the session is in use while this daemon serves it (see sandboxfs.state)
        session_root = store.zone_roots[Zone.SESSION]
        in_use = hold(session_dir(req.project, req.workspace, req.session), _identity(session_root))
    except BaseException:
        store.close()
        raise
    _setup_logging(req)
    audit = AuditLog(audit_path(req.project), sync=req.audit_sync or req.config.audit.sync)
    pid = os.getpid()
    control_path = control.socket_path(pid)
    info = MountInfo(
        req.session,
        req.workspace,
        str(req.project),
        str(req.mountpoint),
        req.command,
        control=str(control_path),
    )
    try:
        guard = make_guard(req.project, req.config, req.config_file, req.trust, info, store, audit)
        listener = control.bind(control_path)
    except BaseException:
        audit.close()
        store.close()
        os.close(in_use)
        raise
    ops = SandboxOperations(
        store,
        guard,
        entry_timeout=req.config.cache.entry_timeout,
        attr_timeout=req.config.cache.attr_timeout,
        context_json=context_document(guard.policy, info, os.getpid(), guard.limits),
    )
    if req.debug:
        _log_requests(ops)
    options = set(pyfuse3.default_options)
    options |= {"fsname=sandboxfs", "subtype=sandboxfs", "nosuid", "nodev", "default_permissions"}
    if req.allow_other:
        options.add("allow_other")
    if req.read_only:
        options.add("ro")
    if req.debug:
        options.add("debug")
    comm = guard.process_names.get(pid)

    def lifecycle(op: str) -> None:
        guard.record(op, "/", None, pid=pid, uid=os.getuid(), comm=comm, detail=str(req.mountpoint))

    try:
        pyfuse3.init(ops, str(req.mountpoint), options)
    except RuntimeError as exc:
        listener.close()
        control_path.unlink(missing_ok=True)
        audit.close()
        store.close()
        os.close(in_use)
        raise UserError(f"cannot mount {req.mountpoint}: {exc}", exit_code=1) from None
    ops.kernel_store = pyfuse3.notify_store
    lifecycle("mount")
    log.info("mounted %s (trust %s, session %s)", req.mountpoint, req.trust.value, req.session)
    try:
        trio.run(_main, req, audit, ready, lifeline, Control(ops, info, listener))
    except BaseException:
        log.exception("the daemon stopped on an unexpected error")
        raise
    finally:
        ops.kernel_store = None  # the session goes away with close()
        with contextlib.suppress(Exception):
            pyfuse3.close(unmount=True)
        listener.close()
        control_path.unlink(missing_ok=True)
        ops.release_all()
        lifecycle("unmount")
        audit.close()
        store.close()
        os.close(in_use)
        log.info("unmounted %s", req.mountpoint)
        if after is not None:
            after()


async def _main(
    req: MountRequest,
    audit: AuditLog,
    ready: Callable[[], None],
    lifeline: int | None,
    ctl: Control,
) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_flush_audit, audit, req.config.audit.flush_interval)
        nursery.start_soon(ctl.serve)
        wait = request_wait.install(req.config.daemon.spin_us / 1e6)
        nursery.start_soon(_terminate_on_signal, wait)
        if lifeline is not None:
            nursery.start_soon(_terminate_when_closed, lifeline, wait)
        nursery.start_soon(_report_ready, req.mountpoint, ready)
        await pyfuse3.main(min_tasks=1, max_tasks=1)
        nursery.cancel_scope.cancel()


@dataclass
class Control:
    """The daemon's side of the control channel (see sandboxfs.control): requests are
    handled between two FUSE requests, in the daemon's only thread that touches its state."""

    ops: SandboxOperations
    info: MountInfo
    listener: socket.socket

    changing: trio.Lock = field(default_factory=trio.Lock)

    async def serve(self) -> None:
        """Each connection in a task of its own (an idle client holds up nobody); trust
        changes one at a time."""
        listener = trio.socket.from_stdlib_socket(self.listener)
        async with trio.open_nursery() as nursery:
            while True:
                conn, _ = await listener.accept()
                nursery.start_soon(self._connection, conn)

    async def _connection(self, conn: trio.socket.SocketType) -> None:
        with conn:
            try:
                with trio.move_on_after(10):
                    await conn.send(await self._answer(conn))
            except OSError as exc:
                log.warning("control connection: %s", exc)
            except Exception:  # no request may end the daemon
                log.exception("control request failed")
                with contextlib.suppress(OSError), trio.move_on_after(1):
                    await conn.send(control.reply(False, error="internal error"))

    async def _answer(self, conn: trio.socket.SocketType) -> bytes:
        peer = control.peer_of(conn)  # type: ignore[arg-type]
        data = await self._request_line(conn)
        why = control.refusal(peer, os.getuid())
        if why is not None:
            log.warning("control request from pid %d (uid %d) refused: %s", peer.pid, peer.uid, why)
            return control.reply(False, error=why)
        if len(data) > control.MAX_REQUEST:
            return control.reply(False, error=f"request larger than {control.MAX_REQUEST} bytes")
        try:
            request = control.parse_request(data)
        except control.BadRequest as exc:
            return control.reply(False, error=str(exc))
        guard = self.ops.guard
        if request["op"] == "status":
            return control.reply(True, trust=guard.policy.trust.value, session=self.info.session)
        trust: Trust = request["trust"]
        async with self.changing:
            old = self.ops.set_trust(trust, peer.pid, peer.uid, self._context)
            inodes, names = self.ops.kernel_caches()
            await trio.to_thread.run_sync(_invalidate, inodes, names)
        log.info("trust %s -> %s, asked by pid %d", old.value, trust.value, peer.pid)
        return control.reply(True, old=old.value, new=trust.value)

    async def _request_line(self, conn: trio.socket.SocketType) -> bytes:
        """The request (read whole before any answer, so the client never meets a closed
        socket), at most a little past MAX_REQUEST."""
        data = b""
        while not data.endswith(b"\n") and len(data) <= control.MAX_REQUEST:
            chunk = await conn.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    def _context(self) -> bytes:
        guard = self.ops.guard
        return context_document(guard.policy, self.info, os.getpid(), guard.limits)


def _invalidate(inodes: list[int], names: list[tuple[int, bytes]]) -> None:
    """Make the kernel forget every name, attribute and cached page it holds for the mount,
    so the next request of every kind reaches the daemon and the new trust level.
    In a worker thread: the kernel may wait for a request the daemon has yet to answer."""
    for parent, name in names:
        with contextlib.suppress(OSError):
            pyfuse3.invalidate_entry(parent, name)
    for inode in inodes:
        with contextlib.suppress(OSError):
            pyfuse3.invalidate_inode(inode, attr_only=False)


async def _flush_audit(audit: AuditLog, interval: float) -> None:
    """Write queued audit entries every `interval` seconds until cancelled, then once more."""
    try:
        while True:
            await trio.sleep(interval)
            audit.try_flush()
    finally:
        audit.try_flush()  # synchronous, so cancellation cannot interrupt it


async def _terminate_on_signal(wait: request_wait.RequestWait | None) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received signal %d, unmounting", signum)
            if wait is not None:
                wait.stop()
            pyfuse3.terminate()
            return


async def _terminate_when_closed(fd: int, wait: request_wait.RequestWait | None) -> None:
    """Unmount once the lifeline pipe reports end of file: its only writer is gone."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            if not os.read(fd, 4096):
                break
        except BlockingIOError:
            continue
    log.info("the process this mount was made for is gone, unmounting")
    if wait is not None:
        wait.stop()
    pyfuse3.terminate()


async def _report_ready(mountpoint: Path, ready: Callable[[], None]) -> None:
    """Tell the parent once the mount answers a real request (served by this very loop)."""
    probe = mountpoint / CONTROL_NAME.decode() / CONTEXT_NAME.decode()
    await trio.to_thread.run_sync(os.stat, probe)
    ready()


MOUNT_TIMEOUT = 20.0


def spawn_daemon(
    req: MountRequest, lifeline: int | None = None, after: Callable[[], None] | None = None
) -> int:
    """Fork the daemon (already validated and imported: no second interpreter start-up) and
    wait until it reports that the mount answers; its pid, or UserError saying why not.

    The daemon keeps no descriptor of its parent's but `lifeline` (see `serve`): a program's
    terminal, pipes or the write end of that very lifeline would otherwise live on in it.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon: its own session, no terminal, never returns into the caller
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            keep = sorted({0, 1, 2, write_end, *(() if lifeline is None else (lifeline,))})
            for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
                os.closerange(low + 1, high)
            code = _run_daemon(req, write_end, lifeline, after)
        finally:
            os._exit(code)
    os.close(write_end)
    message = _read_status(read_end, MOUNT_TIMEOUT)
    os.close(read_end)
    if message.startswith("READY"):
        return pid
    if not message:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        lazy_unmount(req.mountpoint)
        raise UserError(
            f"the daemon did not report a working mount within {MOUNT_TIMEOUT:.0f} s", exit_code=1
        )
    os.waitpid(pid, 0)
    status, _, text = message.partition(" ")[2].partition(" ")
    raise UserError(text.strip(), exit_code=int(status) if status.isdigit() else 1)


def _read_status(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


def _run_daemon(
    req: MountRequest, ready_fd: int, lifeline: int | None, after: Callable[[], None] | None
) -> int:
    def ready() -> None:
        os.write(ready_fd, b"READY\n")
        os.close(ready_fd)

    try:
        serve(req, ready, lifeline, after)
    except UserError as exc:
        os.write(ready_fd, f"ERROR {exc.exit_code} {exc.message}\n".encode())
        return exc.exit_code
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(ready_fd, f"ERROR 1 daemon failed: {type(exc).__name__}: {exc}\n".encode())
        raise
    return 0


# The requests a mount answers: what --debug logs, one line each.
_REQUESTS = (
    "lookup",
    "getattr",
    "setattr",
    "readlink",
    "forget",
    "opendir",
    "readdir",
    "releasedir",
    "fsyncdir",
    "open",
    "read",
    "write",
    "flush",
    "fsync",
    "release",
    "create",
    "mkdir",
    "symlink",
    "mknod",
    "link",
    "unlink",
    "rmdir",
    "rename",
    "getxattr",
    "listxattr",
    "setxattr",
    "removexattr",
    "statfs",
)


def _log_requests(ops: SandboxOperations) -> None:
    """(--debug) Wrap every request handler so that each request is logged to the daemon log
    with its opcode, inode or name, caller, result and time. Off by default: it costs."""
    for name in _REQUESTS:
        handler = getattr(ops, name, None)
        if handler is not None:
            setattr(ops, name, _logged(name, handler))


def _logged(name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
    async def logged(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            result = handler(*args)
            if inspect.isawaitable(result):  # forget is a plain function in pyfuse3
                result = await result
        except pyfuse3.FUSEError as exc:
            outcome = errno.errorcode.get(exc.errno, str(exc.errno))
            raise
        except BaseException as exc:
            outcome = f"raised {type(exc).__name__}"
            raise
        else:
            outcome = _shown(result)
            return result
        finally:
            took = (time.perf_counter() - start) * 1e6
            shown = " ".join(_shown(arg) for arg in args)
            log.debug("request %s %s -> %s (%.0f us)", name, shown, outcome, took)

    return logged


def _shown(value: Any) -> str:
    if value is None:
        return "ok"
    if isinstance(value, int | float | str):
        return str(value)
    if isinstance(value, bytes):
        return repr(value) if len(value) <= 64 else f"<{len(value)} bytes>"
    if isinstance(value, pyfuse3.RequestContext):
        return f"pid={value.pid} uid={value.uid}"
    if isinstance(value, pyfuse3.EntryAttributes):
        return f"ino={value.st_ino}" if value.st_ino else "absent (a negative entry)"
    if isinstance(value, pyfuse3.FileInfo):
        return f"fh={value.fh}"
    if isinstance(value, tuple):
        return "(" + " ".join(_shown(v) for v in value) + ")"
    return type(value).__name__


def _raise_fd_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def sandboxfs_mounts() -> list[str]:
    """Mountpoints of every sandboxfs mount on this machine, live or dead."""
    found = []
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == FSTYPE:
                found.append(_unescape_mount_path(fields[1]))
    return found


def _unescape_mount_path(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)
