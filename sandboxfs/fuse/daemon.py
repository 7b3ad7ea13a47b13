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
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from sandboxfs.audit.writer import AuditLog
from sandboxfs.config.model import CacheConfig
from sandboxfs.core.approvals import ApprovalError, Mode
from sandboxfs.core.consent import Consent
from sandboxfs.core.context import context_document
from sandboxfs.core.effects import AuditSink
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.inodes import CONTEXT_NAME, CONTROL_NAME, Node
from sandboxfs.core.policy import Trust, Zone
from sandboxfs.core.resolve import ensure_dirs
from sandboxfs.core.rulebase import MountInfo
from sandboxfs.core.store import Store
from sandboxfs.core.syscalls import CAP_SYS_RESOURCE, drop_effective_capability, make_undumpable
from sandboxfs.errors import Failure, SandboxfsError
from sandboxfs.fuse import request_wait
from sandboxfs.fuse.host_watch import HostWatch, MountTable
from sandboxfs.fuse.operations import SandboxOperations
from sandboxfs.fuse.spawn import start_daemon
from sandboxfs.fuse.warm import Warm
from sandboxfs.layout import audit_path, logs_parts, session_dir
from sandboxfs.project import control
from sandboxfs.project.mounts import MountRequest
from sandboxfs.project.state import hold
from sandboxfs.project.zones import (
    approval_broker,
    config_source,
    hidden_identities,
    hidden_names,
    make_guard,
    prepare_zones,
    worker_layers,
)

log = logging.getLogger(__name__)

# At most this long the mount is reported ready only after the kernel's cache is warm.
WARM_WAIT = 2.0

# accept() errors of the control socket: out of descriptors, and a connection gone before it
# was accepted (nothing to do but take the next).
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_TRANSIENT_ACCEPT = (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN)


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
    hidden = hidden_identities(req.project, req.mountpoint)
    return Store(dirs, worker_layers(req.project), hidden, hidden_names(req.project))


def _identity(node: Node) -> tuple[int, int] | None:
    return node.key[1:] if node.key is not None else None


def _setup_logging(req: MountRequest) -> None:
    logs = ensure_dirs(req.project, *logs_parts())
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
    with contextlib.ExitStack() as stack:  # the one way down, from wherever setup stopped
        mounted = False

        def unmounted() -> None:
            if mounted:
                log.info("unmounted %s", req.mountpoint)
                if after is not None:
                    after()

        stack.callback(unmounted)
        store = prepare_store(req)
        stack.callback(store.close)
        # The session is in use while this daemon serves it (see sandboxfs.project.state).
        session_root = store.zone_roots[Zone.SESSION]
        in_use = hold(session_dir(req.project, req.workspace, req.session), _identity(session_root))
        stack.callback(os.close, in_use)
        _setup_logging(req)
        audit = stack.enter_context(
            contextlib.closing(
                AuditLog(
                    audit_path(req.project),
                    sync=req.audit_sync or req.config.audit.sync,
                    rotate=req.config.audit.rotate_bytes,
                )
            )
        )
        pid = os.getpid()
        control_path = control.socket_path(pid)
        info = MountInfo(
            req.session,
            req.workspace,
            str(req.project),
            str(req.mountpoint),
            req.command,
            control=str(control_path),
            worker=req.config.worker.name if req.config.worker is not None else None,
        )
        approvals = approval_broker(req.config, Mode(req.approvals))
        guard = make_guard(
            req.project, req.config, req.config_file, req.trust, info, store, audit, approvals
        )
        control.sweep()  # what daemons killed before they could unmount left behind
        listener = stack.enter_context(control.bind(control_path))
        stack.callback(control_path.unlink, missing_ok=True)
        cache = req.config.cache
        host_watch = _host_watch(store, cache)
        if host_watch is not None:
            stack.callback(host_watch.close)
        ops = SandboxOperations(
            store,
            guard,
            entry_timeout=cache.entry_timeout,
            attr_timeout=cache.attr_timeout,
            context_json=context_document(guard.policy, info, os.getpid(), guard.limits),
            host_watch=host_watch,
            watched_timeout=cache.watched_timeout,
        )
        if (
            host_watch is not None
            and cache.warm_entries > 0
            and Zone.REPO in guard.policy.zones  # a worker's mount may have no repo
            and guard.lists_all(Zone.REPO)
        ):
            ops.warm = Warm(req.mountpoint / Zone.REPO.value, cache.warm_entries)
        if req.debug:
            _log_requests(ops)
        comm = guard.process_names.get(pid)

        def lifecycle(op: AuditOp) -> None:
            guard.effects.record(
                op, "/", None, pid=pid, uid=os.getuid(), comm=comm, detail=str(req.mountpoint)
            )

        try:
            pyfuse3.init(ops, str(req.mountpoint), _mount_options(req))
        except RuntimeError as exc:
            raise Failure(f"cannot mount {req.mountpoint}: {exc}") from None
        mounted = True
        stack.callback(lifecycle, AuditOp.UNMOUNT)
        stack.callback(ops.release_all)
        stack.callback(_close_session, ops)
        ops.kernel_store = pyfuse3.notify_store
        lifecycle(AuditOp.MOUNT)
        if approvals.mode is Mode.OFF and approvals.asks:  # --no-approvals: loudly, audited
            guard.effects.record(
                AuditOp.APPROVAL,
                "/",
                None,
                pid=pid,
                uid=os.getuid(),
                comm=comm,
                allowed=True,
                reason="--no-approvals: every approval rule that asks passes without asking on "
                "this mount",
                extra={"approval": {"answer": "no-approvals"}},
            )
        log.info("mounted %s (trust %s, session %s)", req.mountpoint, req.trust.value, req.session)
        try:
            trio.run(_main, req, audit, ready, lifeline, Control(ops, info, listener))
        except BaseException:
            log.exception("the daemon stopped on an unexpected error")
            raise


def _mount_options(req: MountRequest) -> set[str]:
    options = set(pyfuse3.default_options)
    options |= {"fsname=sandboxfs", "subtype=sandboxfs", "nosuid", "nodev", "default_permissions"}
    if req.allow_other:
        options.add("allow_other")
    if req.read_only:
        options.add("ro")
    if req.debug:
        options.add("debug")
    return options


def _close_session(ops: SandboxOperations) -> None:
    """Unmount and end the FUSE session (nothing may be stored into it after this)."""
    ops.kernel_store = None
    with contextlib.suppress(Exception):
        pyfuse3.close(unmount=True)


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
        nursery.start_soon(_report_ready, req.mountpoint, ready, ctl.ops.warm)
        if ctl.ops.replies.host_watch is not None:
            nursery.start_soon(_follow_host_changes, ctl.ops, ctl.ops.replies.host_watch)
            nursery.start_soon(_follow_mounts, ctl.ops, ctl.ops.replies.host_watch.mounts)
        try:
            await pyfuse3.main(min_tasks=1, max_tasks=1)
        finally:
            if ctl.ops.warm is not None:
                ctl.ops.warm.stop.set()
        nursery.cancel_scope.cancel()


@dataclass
class Control:
    """The daemon's side of the control channel (see sandboxfs.project.control): requests are
    handled between two FUSE requests, in the daemon's only thread that touches its state."""

    ops: SandboxOperations
    info: MountInfo
    listener: socket.socket

    changing: trio.Lock = field(default_factory=trio.Lock)

    # A descriptor held for nothing but to be given up when the table is full, so that the
    # owner can still reach the daemon (to demote an agent that holds every descriptor).
    spare: int = -1

    async def serve(self) -> None:
        """Each connection in a task of its own (an idle client holds up nobody); trust
        changes one at a time. No error ends the server (or the daemon): a failed accept
        is logged and the next one tried."""
        listener = trio.socket.from_stdlib_socket(self.listener)
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    self._keep_spare()
                    try:
                        conn = await self._accept(listener)
                    except Exception:
                        log.exception("control socket: accept failed")
                        await trio.sleep(0.1)
                        continue
                    if conn is not None:
                        nursery.start_soon(self._connection, conn)
        finally:
            if self.spare >= 0:
                os.close(self.spare)
                self.spare = -1

    async def _accept(self, listener: trio.socket.SocketType) -> trio.socket.SocketType | None:
        """The next connection, or None after an error that is passed over. Out of
        descriptors (EMFILE, ENFILE), the store gives back its cached ones, or else the spare
        descriptor is given up, and the connection is accepted in the room made."""
        try:
            conn, _ = await listener.accept()
            return conn
        except OSError as exc:
            if exc.errno in _TRANSIENT_ACCEPT:
                return None
            if exc.errno not in _NO_DESCRIPTOR:
                log.warning("control socket: accept failed: %s", exc)
                await trio.sleep(0.1)
                return None
        log.warning("control socket: out of descriptors; making room for the request")
        if self.ops.store.make_room() == 0 and self.spare >= 0:
            os.close(self.spare)
            self.spare = -1
        try:
            conn, _ = await listener.accept()
            return conn
        except OSError as exc:
            log.warning("control socket: accept failed: %s", exc)
            await trio.sleep(0.1)  # the next try after descriptors were given back
            return None

    def _keep_spare(self) -> None:
        if self.spare < 0:
            with contextlib.suppress(OSError):
                self.spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    async def _connection(self, conn: trio.socket.SocketType) -> None:
        try:
            await self._served(conn)
        finally:
            self._keep_spare()

    async def _served(self, conn: trio.socket.SocketType) -> None:
        with conn:
            try:
                with trio.move_on_after(10):
                    await control.send_whole(conn, await self._answer(conn))
            except OSError as exc:
                log.warning("control connection: %s", exc)
            except Exception:  # no request may end the daemon
                log.exception("control request failed")
                with contextlib.suppress(OSError), trio.move_on_after(1):
                    await control.send_whole(conn, control.reply(False, error="internal error"))

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
            return control.reply(
                True,
                trust=guard.policy.trust.value,
                session=self.info.session,
                mountpoint=self.info.mountpoint,
                failing=_audit_failure(guard.effects.audit),
            )
        if request["op"] in ("approvals", "answer", "revoke", "connect"):
            return approvals_reply(guard.effects.consent, request, peer.pid, peer.uid)
        trust: Trust = request["trust"]
        async with self.changing:
            if self.ops.warm is not None:  # it listed what the old level may list
                self.ops.warm.stop.set()
            old = self.ops.set_trust(trust, peer.pid, peer.uid, self._context)
            inodes, names = self.ops.kernel_caches()
            await trio.to_thread.run_sync(_invalidate, inodes, names, False)
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


def _audit_failure(audit: AuditSink) -> str | None:
    """Why the mount fails closed (its audit log's last error), for `status`; None if not."""
    if not audit.failing:
        return None
    return (audit.failure if isinstance(audit, AuditLog) else None) or "unknown error"


def approvals_reply(consent: Consent, request: dict[str, Any], pid: int, uid: int) -> bytes:
    """The approvals ops of the control channel (sandboxfs.core.consent): list, answer,
    revoke, and `run`'s proxy asking about a host; every answer and revocation audited with
    who gave it."""
    broker = consent.broker
    if broker is None:
        return control.reply(False, error="this mount has no approvals")
    consent.tidy()
    who = f"{request.get('channel', 'command')} (pid {pid}, uid {uid})"
    if request["op"] == "connect":  # the asking process, as `run` found it
        allowed, reason, pending = consent.connect(request["host"], request["pid"], uid)
        return control.reply(True, allowed=allowed, reason=reason, request=pending)
    try:
        if request["op"] == "answer":
            shown = request["shown"]
            grant = consent.answer(request["id"], request["answer"], who, pid, uid, shown)
            return control.reply(True, grant=grant.describe())
        if request["op"] == "approvals" and "id" in request:
            return control.reply(True, request=broker.listing(request["id"]))
        if request["op"] == "revoke":
            revoked = consent.revoke(request["grant"], who, pid, uid)
            return control.reply(True, grant=revoked.describe())
    except ApprovalError as exc:
        return control.reply(False, error=str(exc))
    return control.reply(True, **broker.snapshot())


def _host_watch(store: Store, cache: CacheConfig) -> HostWatch | None:
    """The watches that let the kernel hold entries long, where they are asked for and longer
    than the plain timeouts (0 there turns the kernel's caching off, and keeps it off)."""
    if not cache.watch or cache.watched_timeout <= max(cache.entry_timeout, cache.attr_timeout):
        return None
    if min(cache.entry_timeout, cache.attr_timeout) <= 0:
        return None
    try:
        return HostWatch(store)
    except OSError as exc:
        log.warning("no inotify (%s): the kernel caches entries for cache.attr_timeout", exc)
        return None


async def _follow_host_changes(ops: SandboxOperations, watch: HostWatch) -> None:
    """Have the kernel forget what changes made to the backing directories made stale (see
    sandboxfs.fuse.host_watch), as they are reported."""
    while True:
        await trio.lowlevel.wait_readable(watch.fd)
        changes = watch.changes()
        if not changes:
            continue
        if changes.everything:  # events were lost
            await _forget_all(ops)
            continue
        ops.replies.changing(*changes.nodes)
        # A name in pyfuse3's notification thread (the kernel takes the directory's lock,
        # which a request the daemon has yet to answer may hold). Attributes here: with no
        # writeback cache and no pages (a file's cached pages go when the kernel sees its new
        # mtime or size, and at the next open), that takes no lock a request may hold.
        for parent, name in changes.names:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        for inode in changes.inodes:
            with contextlib.suppress(OSError):
                pyfuse3.invalidate_inode(inode, attr_only=True)


async def _follow_mounts(ops: SandboxOperations, mounts: MountTable) -> None:
    """Have the kernel forget everything it cached for the mount when a mount point below a
    zone's directory comes or goes (inotify does not report mounts; see host_watch)."""
    while True:
        await trio.lowlevel.wait_readable(mounts.fd)
        if mounts.changed():
            await _forget_all(ops)


async def _forget_all(ops: SandboxOperations) -> None:
    """Have the kernel forget every name and attribute it holds for the mount."""
    ops.replies.given.clear()
    inodes, names = ops.kernel_caches()
    await trio.to_thread.run_sync(_invalidate, inodes, names, True)


def _invalidate(inodes: list[int], names: list[tuple[int, bytes]], attr_only: bool) -> None:
    """Make the kernel forget these names and these inodes' attributes (and, unless
    `attr_only`, their cached pages), so that the next request for them reaches the daemon.
    In a worker thread: the kernel may wait for a request the daemon has yet to answer."""
    for parent, name in names:
        with contextlib.suppress(OSError):
            pyfuse3.invalidate_entry(parent, name)
    for inode in inodes:
        with contextlib.suppress(OSError):
            pyfuse3.invalidate_inode(inode, attr_only=attr_only)


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


async def _report_ready(mountpoint: Path, ready: Callable[[], None], warm: Warm | None) -> None:
    """Tell the parent once the mount answers a real request (served by this very loop) and
    the kernel's cache is warm (sandboxfs.fuse.warm), or WARM_WAIT has passed: the walk then
    goes on in the background."""
    probe = mountpoint / CONTROL_NAME.decode() / CONTEXT_NAME.decode()
    await trio.to_thread.run_sync(os.stat, probe)
    if warm is not None:
        warm.start()
        await trio.to_thread.run_sync(warm.wait, WARM_WAIT, abandon_on_cancel=True)
    ready()


def spawn_daemon(
    req: MountRequest, lifeline: int | None = None, after: Callable[[], None] | None = None
) -> int:
    """Fork the daemon and wait until it reports that the mount answers
    (sandboxfs.fuse.spawn); its pid, or the error saying why not."""
    return start_daemon(req, lifeline, after).ready()


def _run_daemon(
    req: MountRequest, ready_fd: int, lifeline: int | None, after: Callable[[], None] | None
) -> int:
    def ready() -> None:
        os.write(ready_fd, b"READY\n")
        os.close(ready_fd)

    try:
        serve(req, ready, lifeline, after)
    except SandboxfsError as exc:
        os.write(ready_fd, f"ERROR {type(exc).__name__} {exc.message}\n".encode())
        return 1
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
    """Raise the soft limit on descriptors to the hard one (each file open through the mount
    holds one in the daemon); the store sizes its cache of descriptors from the result."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard
    if hard == resource.RLIM_INFINITY:  # the kernel allows at most fs.nr_open
        try:
            wanted = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            return
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
