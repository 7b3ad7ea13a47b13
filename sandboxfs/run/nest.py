"""Nesting: a program inside `sandboxfs run` starting a child worker with fewer rights.

The `run` supervisor (outside the sandbox) listens on a Unix socket that it shows inside, with
a small client, at NEST_DIR: `sandboxfs run --worker NAME [--attach PATH]... -- CMD` typed
inside is that client. A request carries only a worker's name, CMD and attachment paths, with
the caller's stdin, stdout and stderr (SCM_RIGHTS); never a declaration, a trust level, a
project or a config. The supervisor reads the worker's `.worker` file itself and narrows *its
own* config (the parent's: the trust level's row, or the parent worker's zones) to it
(sandboxfs.project.workers.narrow): a declaration asking more — a forged `.worker` file
included — is refused with the usual line, audited (op `run`, denied) before the answer goes
back. An accepted one starts an ordinary `sandboxfs run` outside, as the user, with the
parent's zones as its ceiling (`--within`), its worker, `--net none`, at the lower of the run's
trust level and the mount's current one, in a new session; its exit status goes back to the
client. The current level is the daemon's, asked over its control socket (which nothing inside
reaches), never read through the mount, where a program can make the read fail: when the daemon
gives no level, the child is refused.

Nothing here changes the parent's mount or policy: the child is another mount, another
sandbox. The socket is reachable only inside this sandbox and in the user's own 0700 run
directory.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Concatenate

from sandboxfs.config.model import Config, WorkerScope
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.policy import Trust
from sandboxfs.errors import SandboxfsError, UserError
from sandboxfs.project import control
from sandboxfs.run.toolchain import Toolchain

NEST_DIR = "/sandboxfs"  # inside: nest.sock and bin/sandboxfs, the client
SOCKET_NAME = "nest.sock"
NEST_HOST_DIR = "nest"  # in the run directory: what NEST_DIR shows
MAX_CHILDREN = 8  # child workers running at once, per run
# A tree of nested runs, counted by the supervisors outside: a top-level run's children are at
# depth 1, theirs at 2, which start none; and at most MAX_NESTED runs of one tree are alive at
# once, each holding a lock on one of as many slot files in the top-level run's directory.
MAX_DEPTH = 2
MAX_NESTED = 8
NEST_SLOTS_DIR = "nest-slots"  # in the top-level run's directory, which nothing inside shows
MAX_REQUEST = 64 * 1024
# Connections served at once (each a thread; those of running children included), and how long
# one may take to send its request; one more is answered at once and closed.
MAX_CONNECTIONS = 16
REQUEST_WAIT = 5.0  # seconds
_TRUST_ORDER = list(Trust)

# The client, run by the system's Python inside (its /usr is the host's, read-only).
CLIENT = r'''#!/usr/bin/python3 -I
"""sandboxfs inside a sandbox: only `run --worker NAME [--attach PATH]... -- CMD` (nesting)."""
import array, json, os, socket, sys

USAGE = "usage: sandboxfs run --worker NAME [--attach VIRTUAL_PATH]... -- CMD [ARG...]"


def main(argv):
    if argv[:1] != ["run"]:
        print("sandboxfs: inside a sandbox only 'run --worker NAME -- CMD' is offered (it "
              "starts a child worker with at most this sandbox's access); " + USAGE,
              file=sys.stderr)
        return 2
    worker, attach, rest = None, [], argv[1:]
    while rest and rest[0] != "--":
        opt = rest.pop(0)
        if opt in ("--worker", "--attach") and rest:
            value = rest.pop(0)
            if opt == "--worker":
                worker = value
            else:
                attach.append(value)
        elif opt.startswith(("--worker=", "--attach=")):
            name, _, value = opt.partition("=")
            if name == "--worker":
                worker = value
            else:
                attach.append(value)
        else:
            print(f"sandboxfs: unknown option {opt!r} inside a sandbox; " + USAGE,
                  file=sys.stderr)
            return 2
    command = rest[1:]
    if worker is None or not command:
        print("sandboxfs: " + USAGE, file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(os.path.dirname(os.path.dirname(__file__)), "nest.sock"))
    except OSError as exc:
        print(f"sandboxfs: cannot reach the sandbox's supervisor: {exc.strerror}",
              file=sys.stderr)
        return 125
    request = json.dumps({"worker": worker, "argv": command, "attach": attach}).encode()
    fds = array.array("i", [0, 1, 2])
    sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    sock.shutdown(socket.SHUT_WR)
    answer = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    try:
        reply = json.loads(answer)
    except ValueError:
        print("sandboxfs: the supervisor ended before the child worker did", file=sys.stderr)
        return 125
    if reply.get("error"):
        print(f"sandboxfs: {reply['error']}", file=sys.stderr)
    return int(reply.get("status", 125))


sys.exit(main(sys.argv[1:]))
'''


@dataclass(frozen=True)
class Nesting:
    """Where a run is in its tree of nested runs: given to a child by the supervisor that
    starts it (a hidden option of `run`), never by anything inside."""

    depth: int = 0
    slots: Path | None = None  # the top-level run's slot files (None: this run is the top)
    # What a child shows of the host: its parent's (CMD's toolchain, exposed paths), never
    # more, and its CMD is looked up inside, on that PATH, never on the host.
    view: Toolchain = field(default_factory=Toolchain)

    def dump(self) -> str:
        return json.dumps(
            {"depth": self.depth, "slots": str(self.slots), "view": asdict(self.view)}
        )

    @classmethod
    def parse(cls, text: str) -> Nesting:
        """A dumped Nesting; ValueError for anything else."""
        fields = json.loads(text)
        depth, slots, raw = fields["depth"], fields["slots"], fields["view"]
        if type(depth) is not int or not 0 < depth <= MAX_DEPTH or not isinstance(slots, str):
            raise ValueError("not a nesting")
        lists = [raw[name] for name in ("binds", "path", "shown")]
        links, covers = raw["links"], raw["covers"]
        if not (
            all(isinstance(x, list) and all(isinstance(y, str) for y in x) for x in lists)
            and isinstance(links, dict)
            and all(isinstance(v, str) for v in links.values())
            and isinstance(covers, list)
            and all(
                isinstance(c, list)
                and len(c) == 2
                and isinstance(c[0], str)
                and isinstance(c[1], bool)
                for c in covers
            )
        ):
            raise ValueError("not a view")
        # The parent's covers too: what its exposed trees hide stays hidden in the child.
        view = Toolchain(
            binds=lists[0],
            links=links,
            path=lists[1],
            shown=lists[2],
            covers=[(path, is_dir) for path, is_dir in covers],
        )
        return cls(depth, Path(slots), view)


def lower(a: Trust, b: Trust) -> Trust:
    return a if _TRUST_ORDER.index(a) <= _TRUST_ORDER.index(b) else b


def within(config: Config, scope: WorkerScope) -> Config:
    """`config` cut to a parent worker's `scope` (its zones and modes, as checked when the
    parent started): the ceiling a nested child is narrowed under. Zones of the scope that
    `config` lacks (the parent's attachments) are left out."""
    known = {z.value for z in config.zone_list()}
    zones = {name: mode for name, mode in scope.zones.items() if name in known}
    kept = {name: zone for name, zone in config.zones.items() if name in zones}
    return config.model_copy(
        update={
            "zones": kept,
            "worker": WorkerScope(
                name=scope.name,
                zones=zones,
                approval={z: rules for z, rules in scope.approval.items() if z in zones},
            ),
        }
    )


class NestServer:
    """The supervisor's side: the socket, the client, and the children it started."""

    def __init__(
        self,
        run_dir: Path,
        project: Path,
        config: Config,
        trust: Trust,
        child_argv: Callable[[str, Trust, list[str], list[str], int | None, Nesting], list[str]],
        record: Callable[Concatenate[AuditOp, ...], None],  # RunAudit.record
        nesting: Nesting,
        view: Toolchain,  # this run's: what its children show of the host
    ) -> None:
        self._project = project
        self._config = config
        self._trust = trust
        self._child_argv = child_argv
        # The daemon's control socket, once it answers: where the current level is asked.
        self.control: Path | None = None
        self._record = record
        self.host_dir = run_dir / NEST_HOST_DIR
        self.host_dir.mkdir(mode=0o700)
        self._depth = nesting.depth
        self._view = view
        self._own_slots = nesting.slots is None
        self._slots = run_dir / NEST_SLOTS_DIR if nesting.slots is None else nesting.slots
        if self._own_slots:
            self._slots.mkdir(mode=0o700)
        (self.host_dir / "bin").mkdir(mode=0o700)
        client = self.host_dir / "bin" / "sandboxfs"
        client.write_text(CLIENT)
        client.chmod(0o755)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        control.socket_at(self.host_dir / SOCKET_NAME, self._listener.bind)  # a long path too
        self._listener.listen(8)
        self._children: set[subprocess.Popen[bytes]] = set()
        # Whether this run prompts in its terminal: a child's requests are then asked there
        # (`prompts`: each live child's control socket and label), else the child refuses
        # what would ask at once, never waiting on nobody.
        self.prompt_here = False  # set by the supervisor once its terminal prompts
        self._prompts: dict[Path, str] = {}
        self._lock = threading.Lock()
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        threading.Thread(target=self._serve, name="nest", daemon=True).start()

    def prompts(self) -> list[tuple[Path, str]]:
        """The control sockets of the children whose approval requests this run's terminal
        asks, each with the label the prompt shows."""
        with self._lock:
            return list(self._prompts.items())

    def _current_trust(self) -> Trust:
        """The mount's trust level now, as its daemon holds it; UserError when the daemon does
        not say (not up yet, gone, a bad answer): the child is then refused, never started at
        a level the run may no longer have."""
        if self.control is None:
            raise UserError("this run's mount is not ready: no child worker yet")
        refused = "the run's daemon did not say its current trust level: no child worker"
        try:
            reply = control.request(self.control, {"op": "status"}, timeout=10.0)
        except SandboxfsError as exc:
            raise UserError(f"{refused} ({exc.message})") from None
        level = reply.get("trust")
        if reply.get("ok") is not True or level not in {t.value for t in Trust}:
            raise UserError(refused)
        return Trust(level)

    def _learn_control(self, report: int, label: str) -> Path | None:
        """The child's control socket, as its `run` reports it once its mount answers."""
        data = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(report, 4096):
                data += chunk
                if len(data) > 4096:
                    return None
        os.close(report)
        text = data.decode("utf-8", "replace").strip()
        if not text.startswith("/"):
            return None
        path = Path(text)
        with self._lock:
            self._prompts[path] = label
        return path

    def bwrap_args(self) -> list[str]:
        return ["--ro-bind", str(self.host_dir), NEST_DIR]

    def close(self) -> None:
        """Stop listening; children still running are asked to end (SIGTERM: each unmounts)."""
        with self._lock:
            self._closed = True
            children = list(self._children)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(15)
        shutil.rmtree(self.host_dir, ignore_errors=True)
        if self._own_slots:
            shutil.rmtree(self._slots, ignore_errors=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._connections.acquire(blocking=False):
                _refuse_at_once(conn)
                continue
            conn.settimeout(REQUEST_WAIT)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        """One request, from its first byte to its child's end; a connection slot is held."""
        fds: list[int] = []
        try:
            request, fds = _receive(conn)
            reply = self._start(request, fds, _peer_pid(conn))
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode())
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"status": 125, "error": f"bad request: {exc}"}).encode())
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
            self._connections.release()

    def _start(self, request: dict[str, Any], fds: list[int], pid: int) -> dict[str, Any]:
        from sandboxfs.project import workers

        unknown = sorted(set(request) - {"worker", "argv", "attach"})
        if unknown:  # a trust level, a declaration, a project: never taken from inside
            raise ValueError(f"unknown fields {unknown}; a request names a worker, argv, attach")
        name = request.get("worker")
        argv = request.get("argv")
        attach = request.get("attach", [])
        if not (
            isinstance(name, str)
            and isinstance(argv, list)
            and argv
            and all(isinstance(a, str) for a in argv)
            and isinstance(attach, list)
            and all(isinstance(a, str) for a in attach)
            and len(fds) == 3
        ):
            raise ValueError("expected a worker's name, a command and the caller's stdio")
        _check_stdio(fds)
        try:
            if self._depth >= MAX_DEPTH:
                raise UserError(
                    f"child workers nest at most {MAX_DEPTH} deep: this run is a child's child"
                )
            trust = lower(self._trust, self._current_trust())
            # The authoritative check: the parent's own config, as this supervisor holds it.
            worker = workers.find(self._project, name, self._config)
            workers.narrow(self._config, trust, worker)
        except UserError as exc:
            return self._refuse(pid, name, argv, exc.message)
        slot = self._take_slot()
        if slot is None:
            why = f"{MAX_NESTED} nested runs are alive already in this top-level run's tree"
            return self._refuse(pid, name, argv, why)
        try:
            return self._start_holding(name, trust, argv, attach, fds, pid)
        finally:
            os.close(slot)

    def _refuse(self, pid: int, name: str, argv: list[str], why: str) -> dict[str, Any]:
        """A child refused: audited (op `run`, denied), then told to the client."""
        self._record(
            AuditOp.RUN,
            allowed=False,
            pid=pid,
            comm="sandboxfs",
            reason=why,
            err="EACCES",
            detail=f"nested worker {name} refused: {shlex.join(argv)}",
        )
        return {"status": 125, "error": why}

    def _take_slot(self) -> int | None:
        """A slot of the tree's MAX_NESTED (a locked file, held while the child lives: the lock
        goes with the descriptor, even when this process is killed); None when all are held."""
        for index in range(MAX_NESTED):
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            try:
                fd = os.open(self._slots / str(index), flags, 0o600)
            except OSError:
                return None  # the top-level run is ending: its directory is going
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd
        return None

    def _start_holding(
        self, name: str, trust: Trust, argv: list[str], attach: list[str], fds: list[int], pid: int
    ) -> dict[str, Any]:
        """Start the accepted child and wait for it (its slot held by the caller)."""
        with self._lock:
            if self._closed:
                return self._refuse(pid, name, argv, "the parent sandbox is ending")
            if len(self._children) >= MAX_CHILDREN:
                return self._refuse(pid, name, argv, f"{MAX_CHILDREN} child workers run already")
            self._record(
                AuditOp.RUN,
                pid=pid,
                comm="sandboxfs",
                detail=f"nested worker {name} started: {shlex.join(argv)}",
            )
            report, report_w = os.pipe() if self.prompt_here else (-1, -1)
            try:
                report_to = report_w if report >= 0 else None
                nesting = Nesting(self._depth + 1, self._slots, self._view)
                child = subprocess.Popen(
                    self._child_argv(name, trust, argv, attach, report_to, nesting),
                    stdin=fds[0],
                    stdout=fds[1],
                    stderr=fds[2],
                    start_new_session=True,
                    pass_fds=(report_w,) if report >= 0 else (),
                )
            except BaseException:
                if report >= 0:
                    os.close(report)
                raise
            finally:
                if report_w >= 0:
                    os.close(report_w)
            self._children.add(child)
        learned: Path | None = None
        try:
            if report >= 0:
                parent = self._config.worker.name if self._config.worker else "this run"
                label = f"worker {name}, started inside {parent} (pid {child.pid})"
                learned = self._learn_control(report, label)
            status = child.wait()
        finally:
            with self._lock:
                self._children.discard(child)
                if learned is not None:
                    self._prompts.pop(learned, None)
        return {"status": status if status >= 0 else 128 - status}


def _refuse_at_once(conn: socket.socket) -> None:
    """A connection past MAX_CONNECTIONS: one line of why, if it fits at once, then closed."""
    why = f"{MAX_CONNECTIONS} requests to start child workers are open already"
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(json.dumps({"status": 125, "error": why}).encode())
    conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request (JSON, at most MAX_REQUEST bytes) and the descriptors that came with it."""
    data = b""
    fds: list[int] = []
    try:
        while True:
            chunk, ancdata, _flags, _addr = conn.recvmsg(
                MAX_REQUEST + 1, socket.CMSG_SPACE(3 * array.array("i").itemsize)
            )
            fds.extend(_passed_fds(ancdata))
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_REQUEST:
                raise ValueError("request too large")
        request = json.loads(data)
        if not isinstance(request, dict):
            raise ValueError("expected a JSON object")
    except ValueError:  # a request refused: the descriptors that came with it are closed
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _passed_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an SCM_RIGHTS message carried (now this process's own)."""
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    return fds


def _check_stdio(fds: list[int]) -> None:
    """The caller's stdin, stdout and stderr are what a shell redirects to: pipes, sockets,
    terminals and other character devices, regular files. Not a directory, nor an O_PATH
    handle: through one the child would reach, by `openat`, names of the parent's mount that
    its declaration leaves out."""
    for fd in fds:
        mode = os.fstat(fd).st_mode
        if os.O_PATH & fcntl.fcntl(fd, fcntl.F_GETFL) or not (
            stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISREG(mode)
        ):
            raise ValueError("stdin, stdout and stderr must be pipes, terminals or files")


def _peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


def child_argv(
    project: Path,
    workspace: str,
    config_file: Path | None,
    scope: WorkerScope | None,
) -> Callable[[str, Trust, list[str], list[str], int | None, Nesting], list[str]]:
    """How the supervisor starts a nested child: `sandboxfs run` outside, as the user.
    `report`: a descriptor the child writes its control socket's path to, for the parent's
    terminal to ask its approval requests (None: the parent has no prompt). `nesting`: the
    child's place in the tree."""

    def build(
        name: str,
        trust: Trust,
        argv: list[str],
        attach: list[str],
        report: int | None,
        nesting: Nesting,
    ) -> list[str]:
        args = [sys.executable, "-m", "sandboxfs", "run", "--project", str(project)]
        args += ["--workspace", workspace, "--trust", trust.value, "--net", "none"]
        args += ["--parent-pid", str(os.getpid())]  # it ends with this run, even killed
        args += ["--nesting", nesting.dump()]
        # The child's requests are asked in the parent's terminal; where the parent has no
        # prompt, what would ask is refused at once: a child never waits on nobody.
        if report is None:
            args += ["--approvals", "none"]
        else:
            args += ["--approvals", "ask", "--report-control", str(report)]
        if config_file is not None:
            args += ["--config", str(config_file)]
        if scope is not None:
            args += ["--within", scope.model_dump_json()]
        args += ["--worker", name]
        for path in attach:
            args += ["--attach", path]
        return [*args, "--", *argv]

    return build
