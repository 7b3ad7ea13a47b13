"""The control channel of a mount: a Unix socket the daemon serves for its owner.

Where: `<state root>/control/<daemon pid>.sock` (see sandboxfs.layout.state_root), a directory of
mode 0700 outside every project, which neither the mount nor a `run` sandbox shows; the socket
is mode 0600. Who: the credentials of the process that connected (SO_PEERCRED) must be the
mount's owner's or root's, in the daemon's own PID and user namespaces, so a process inside a
`run` sandbox is refused even if it could reach the socket.

Protocol (version 1): one request per connection, a JSON object on one line (at most 64 KiB),
answered by one JSON line (at most 16 MiB), each sent whole (a stream socket's `send` may take
only part of a long one) and read up to its newline. Every request has `"v": 1` and an `"op"`:

    {"v": 1, "op": "status"}                 -> {"v": 1, "ok": true, "trust": ..., "session": ...}
    {"v": 1, "op": "trust", "trust": LEVEL}  -> {"v": 1, "ok": true, "old": ..., "new": ...}
    {"v": 1, "op": "approvals"}              -> {"v": 1, "ok": true, "mode": ..., "pending": [...],
                                                 "grants": [...]}
    {"v": 1, "op": "approvals", "id": N}     -> {"v": 1, "ok": true, "request": {...}} (every path)
    {"v": 1, "op": "answer", "id": N, "answer": once|dir|everywhere|deny|never,
     "shown": N, "channel": terminal|command} -> {"v": 1, "ok": true, "grant": {...}}

`shown` is the version of the request the user saw (its "shown"): the answer covers those paths
and none that joined after; an allow-once needs it.
    {"v": 1, "op": "revoke", "grant": N}     -> {"v": 1, "ok": true, "grant": {...}}
    {"v": 1, "op": "connect", "host": "HOST:PORT", "pid": N}
                                             -> {"v": 1, "ok": true, "allowed": ..., "reason":
                                                 ..., "request": N or null}

A refused or malformed request gets `{"v": 1, "ok": false, "error": "..."}`; the daemon stays
up. The approvals ops answer the requests of sandboxfs.core.approvals: only from outside the
sandbox, as every op (see `refusal`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sandboxfs.core.approval_grants import Answer
from sandboxfs.core.policy import Trust
from sandboxfs.core.syscalls import is_dumpable, set_dumpable
from sandboxfs.errors import Failure
from sandboxfs.layout import control_dir as control_dir  # re-exported: where the sockets are

VERSION = 1
MAX_REQUEST = 64 << 10
# An answer past this is replaced by an error saying so, never cut: the approvals ops list
# requests and grants that other bounds keep far below it.
MAX_REPLY = 16 << 20
_SUN_PATH_MAX = 100
_UCRED = struct.Struct("3i")


def socket_path(pid: int) -> Path:
    return control_dir() / f"{pid}.sock"


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int


class BadRequest(Exception):
    """A request the daemon answers with an error."""


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return Peer(pid, uid, gid)


def refusal(peer: Peer, owner_uid: int) -> str | None:
    """Why the daemon refuses this peer, or None."""
    if peer.uid not in (owner_uid, 0):
        return f"uid {peer.uid} is neither the mount's owner (uid {owner_uid}) nor root"
    for ns in ("pid", "user"):
        try:
            theirs = os.readlink(f"/proc/{peer.pid}/ns/{ns}")
            ours = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            return "the requesting process cannot be identified"
        if theirs != ours:
            return "the request comes from inside a sandbox (another namespace)"
    return None


def parse_request(data: bytes) -> dict[str, Any]:
    """The request in `data`, checked; BadRequest with a message otherwise."""
    try:
        request = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest("the request is not JSON (or nested too deeply)") from None
    if not isinstance(request, dict):
        raise BadRequest("the request must be a JSON object")
    version = request.get("v")
    if type(version) is not int or version != VERSION:
        raise BadRequest(
            f"unsupported protocol version {request.get('v')!r}; this daemon speaks {VERSION}"
        )
    op = request.get("op")
    if op == "status":
        return {"op": op}
    if op == "trust":
        level = request.get("trust")
        try:
            trust = Trust(str(level))
        except ValueError:
            levels = ", ".join(t.value for t in Trust)
            raise BadRequest(f"unknown trust level {level!r}; levels: {levels}") from None
        return {"op": op, "trust": trust}
    if op == "approvals":
        return {"op": op, "id": _number(request, "id")} if "id" in request else {"op": op}
    if op == "answer":
        try:
            answer = Answer(str(request.get("answer")))
        except ValueError:
            answers = ", ".join(a.value for a in Answer)
            raise BadRequest(
                f"unknown answer {request.get('answer')!r}; answers: {answers}"
            ) from None
        channel = request.get("channel", "command")
        if channel not in CHANNELS:
            raise BadRequest(f"unknown channel {channel!r}; channels: {', '.join(CHANNELS)}")
        shown = _number(request, "shown") if request.get("shown") is not None else None
        return {
            "op": op,
            "id": _number(request, "id"),
            "answer": answer,
            "shown": shown,
            "channel": channel,
        }
    if op == "revoke":
        return {"op": op, "grant": _number(request, "grant")}
    if op == "connect":  # from `run`'s proxy: a host not on its allowlist
        host = request.get("host")
        if not isinstance(host, str) or not 0 < len(host) <= 300 or not host.isprintable():
            raise BadRequest("host must be HOST:PORT, at most 300 printable characters")
        pid = request.get("pid", 0)
        if type(pid) is not int or not 0 <= pid < 1 << 31:
            raise BadRequest(f"pid must be a process id, got {pid!r}")
        return {"op": op, "host": host, "pid": pid}
    raise BadRequest(f"unknown op {op!r}; ops: status, trust, approvals, answer, revoke, connect")


# Where an answer was given, as the audit log says it (never free text from the client).
CHANNELS = ("terminal", "command", "run")


def _number(request: dict[str, Any], key: str) -> int:
    value = request.get(key)
    if type(value) is not int or not 0 < value < 1 << 53:
        raise BadRequest(f"{key} must be a positive whole number, got {value!r}")
    return value


def reply(ok: bool, **fields: Any) -> bytes:
    """One answer line, at most MAX_REPLY bytes (an error saying so in place of a longer one)."""
    data = (json.dumps({"v": VERSION, "ok": ok, **fields}) + "\n").encode()
    if len(data) > MAX_REPLY:
        error = f"the answer ({len(data)} bytes) is larger than {MAX_REPLY} bytes"
        return (json.dumps({"v": VERSION, "ok": False, "error": error}) + "\n").encode()
    return data


class _Sender(Protocol):
    def send(self, data: memoryview, /) -> Awaitable[int]: ...


async def send_whole(conn: _Sender, data: bytes) -> None:
    """All of `data` on the daemon's (trio) socket: one `send` takes only what the socket's
    buffer holds (about 200 KiB), and the rest would be lost."""
    view = memoryview(data)
    while view:
        view = view[await conn.send(view) :]


def bind(path: Path) -> socket.socket:
    """A listening socket at `path` (mode 0600, in a 0700 directory), replacing a stale one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            socket_at(path, sock.bind)
        finally:
            os.umask(old)
        sock.listen(8)
    except BaseException:
        sock.close()
        raise
    return sock


def sweep() -> list[Path]:
    """Remove the sockets that daemons killed without unmounting (kill -9, a crash) left in
    the control directory; the paths removed.

    Only `<pid>.sock` whose pid is no live process, and that nothing answers on (a daemon in
    another PID namespace names its socket by a pid this one does not see), is removed; a
    socket whose pid was reused by another process is left alone.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(control_dir()))
    except OSError:
        return removed
    for entry in entries:
        stem, dot, ext = entry.name.partition(".")
        if not (dot and ext == "sock" and stem.isdigit()) or _alive(int(stem)):
            continue
        path = Path(entry.path)
        if _answered(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether pid is a running process (a zombie is not: a killed daemon whose parent is
    gone may stay one where nothing reaps orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # another user's process (EPERM)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return state not in ([b"Z"], [b"X"])


def _answered(path: Path) -> bool:
    """Whether something listens on the socket at `path` (never waits)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.setblocking(False)
        try:
            socket_at(path, sock.connect)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # EAGAIN: a full backlog, so a live listener; or unknown: keep it
    return True


_identifying = threading.Lock()
_requests_open = 0
_was_undumpable = False


@contextlib.contextmanager
def _identifiable() -> Iterator[None]:
    """The daemon tells a requester outside every sandbox by its namespaces in /proc/<pid>/ns
    (`refusal`), which an undumpable process (run's supervisor, which asks for its terminal's
    prompt and its proxy's hosts) shows to root only: an ordinary user's daemon could not tell
    and refused. Dumpable while a request is open; the process is outside the sandbox, so only
    the user's own processes outside it could reach it meanwhile."""
    global _requests_open, _was_undumpable
    with _identifying:
        if _requests_open == 0:
            _was_undumpable = not is_dumpable()
            if _was_undumpable:
                set_dumpable(True)
        _requests_open += 1
    try:
        yield
    finally:
        with _identifying:
            _requests_open -= 1
            if _requests_open == 0 and _was_undumpable:
                set_dumpable(False)


def request(path: Path, message: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to the daemon at `path` and return its reply (UserError if none)."""
    with (
        _identifiable(),
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock,
    ):
        sock.settimeout(timeout)
        try:
            socket_at(path, sock.connect)
            sock.sendall((json.dumps({"v": VERSION, **message}) + "\n").encode())
            data = _reply_line(sock)
        except OSError as exc:
            raise Failure(
                f"cannot reach the mount's control socket {path}: {exc.strerror or exc}"
            ) from None
    if len(data) > MAX_REPLY:
        raise Failure(f"the daemon's answer on {path} is larger than {MAX_REPLY} bytes")
    if not data.endswith(b"\n"):
        raise Failure(f"the daemon's answer on {path} was cut off after {len(data)} bytes")
    try:
        answer = json.loads(data)
    except ValueError:
        raise Failure(f"the daemon gave no valid answer on {path}") from None
    if not isinstance(answer, dict):
        raise Failure(f"the daemon gave no valid answer on {path}")
    return answer


def _reply_line(sock: socket.socket) -> bytes:
    """The answer up to its newline (or the end), a little past MAX_REPLY at most."""
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_REPLY:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return b"".join(chunks)


def socket_at(path: Path, call: Any) -> None:
    """bind/connect to `path`, through its directory's descriptor when the path is longer
    than a socket address can hold."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        call(os.fsencode(path))
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        call(f"/proc/self/fd/{fd}/{path.name}".encode())
    finally:
        os.close(fd)
