"""The network proxy behind `sandboxfs run --net allow`: the sandbox's only way out.

The program runs in a network namespace of its own that has nothing but loopback; the supervisor
binds a listening socket in it and hands it to `Proxy`, which serves HTTP proxy requests on it
from outside, so outbound connections are made from the host. Only hosts named by `--allow-host`
are admitted (CONNECT for HTTPS and anything else tunnelled, absolute-form requests for plain
HTTP); everything else gets a plain-text HTTP error that says why and which flag would allow it,
in the body and in the reason phrase (which is what pip, requests and http.client show:
`Tunnel connection failed: 403 sandboxfs refused pypi.org:443 (...); to allow it: ...`).

The proxy resolves names itself and connects only to globally routable addresses, unless a rule
lists the address exactly: an IP-literal rule, or `NAME=ADDRESS`, which admits the name and lets
it connect at that one non-global address. An allowed *name* alone must not become a way to reach
the host's own services (loopback), its LAN, or a cloud metadata endpoint, however its DNS is
pointed. A name that is not admitted is never resolved (that would carry it out as a query).

Every request that names a host is reported once through `on_decision`, before the client learns
the outcome, so the audit entry exists first. If reporting fails the request is refused (fail
closed). Reported as refused (`allowed=False`, with `cause` and `fix`): a host not in the
allowlist, or one whose addresses are all refused (403). Reported as failed (`allowed=True` with
an `error`): admitted by the policy, but the name did not resolve or no address could be
connected to (502; the caller audits it as a failure, not as a refusal). Otherwise connected.

The rules and the address classes are sandboxfs.run.allowlist; parsing the request header is
sandboxfs.run.proxyrequest; the copying of an admitted connection sandboxfs.run.relay.
`NetDecision` and `Notices` (sandboxfs.run.netdecision) carry each outcome to the audit and,
once per refused host, to `run`'s stderr, the proxy's and the DNS stub's
(sandboxfs.run.dnsstub: the sandbox's only nameserver, with `--net none` too).

Everything is stdlib and thread-based: one accept thread and one thread per connection, with
non-blocking sockets waited on with poll() together with a wake-up socket that `close()` makes
readable, so every thread notices a close at once. Only the default resolver (getaddrinfo) and
`on_decision` itself cannot be interrupted.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sandboxfs.run.allowlist import (
    WEB_PORTS,
    Allowlist,
    IPAddress,
    address_class,
    address_refusal,
    canonical_host,
    ip_literal,
    with_port,
)
from sandboxfs.run.netdecision import NetDecision
from sandboxfs.run.proxyrequest import (
    ProxyRequest,
    Refusal,
    head_end,
    origin_request,
    parse_request,
)
from sandboxfs.run.registries import registry_of
from sandboxfs.run.relay import Pipe, update_poller, wanted_events

logger = logging.getLogger(__name__)

HEADER_LIMIT = 64 * 1024  # a request header larger than this is refused (400)
HEADER_TIMEOUT = 30.0  # seconds for a client to send its complete request header
CONNECT_TIMEOUT = 10.0  # seconds to connect to each upstream address
SEND_TIMEOUT = 30.0  # seconds to deliver an error response to a client that does not read
MAX_CONNECTIONS = 512  # connections served at once; more are closed at once (bounds threads)
THREAD_PREFIX = "sandboxfs-netproxy"


class _Closing(Exception):
    """The proxy is closing: the connection ends now."""


@dataclass(frozen=True)
class _Asked:
    """One request naming a host, as the proxy decides on it."""

    conn: socket.socket
    client: tuple[str, int]
    request: ProxyRequest
    host: str  # in rule form (canonical_host), or as sent (cut) when it is no valid name


class Proxy:
    """Serves HTTP/HTTPS proxy requests on `listener`, admitting only the allowlist's hosts."""

    def __init__(
        self,
        listener: socket.socket,
        allowlist: Allowlist,
        on_decision: Callable[[NetDecision], None],
        resolve: Callable[[str, int], list[str]] | None = None,
        ask: Callable[[str, int, tuple[str, int], Callable[[], bool]], bool] | None = None,
    ) -> None:
        self._listener = listener
        # Asks the user about a valid host not on the allowlist (approvals: a `connect` rule
        # that asks), in the connection's own thread: True admits it like a name rule. Its
        # last argument tells whether the client went away (or the proxy closed): no more wait.
        self._ask = ask
        self._allowlist = allowlist
        self._on_decision = on_decision
        self._resolve = resolve or _getaddrinfo
        self._lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_closed = False
        self._joined = False  # close() has waited for the threads
        self._accepting = False  # the accept thread may still poll the wake-up socket
        self._accept_thread: threading.Thread | None = None
        self._threads: set[threading.Thread] = set()
        self._sockets: set[socket.socket] = set()

    def start(self) -> None:
        """Serve in daemon threads: one accepting, one per connection."""
        if self._accept_thread is not None or self._closed:
            raise RuntimeError("the proxy was already started")
        self._listener.setblocking(False)
        thread = threading.Thread(target=self._accept_loop, name=f"{THREAD_PREFIX}-accept")
        thread.daemon = True
        self._accept_thread = thread
        self._accepting = True
        thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the listener and every connection, and wait for the threads.

        A thread still inside the resolver or `on_decision` after `timeout` is left behind
        (it is a daemon thread and closes its own sockets when it returns)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
            for sock in self._sockets:  # peers see the end at once, even if a thread is stuck
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        if self._accept_thread is not None:
            self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._joined = True
            self._close_wake()

    def _close_wake(self) -> None:
        """(with the lock) Close the wake-up pair once no thread can poll it any more."""
        if self._joined and not self._threads and not self._accepting and not self._wake_closed:
            self._wake_closed = True
            self._wake_r.close()
            self._wake_w.close()

    # ----- threads --------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        try:
            self._accept()
        finally:
            with self._lock:
                self._accepting = False
                self._close_wake()

    def _accept(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        wake = self._wake_r.fileno()
        pause = -1
        while True:
            ready = poller.poll(pause)
            pause = -1
            if any(fd == wake for fd, _ in ready) or self._closed:
                return
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    logger.warning("proxy: cannot accept a connection: %s", exc)
                    pause = 100  # let descriptors free up rather than spin
                    continue
                if not self._closed:
                    logger.error("proxy: the listener failed, no longer serving: %s", exc)
                return
            self._spawn(conn)

    def _spawn(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed or len(self._threads) >= MAX_CONNECTIONS:
                conn.close()
                if not self._closed:
                    logger.warning("proxy: over %d connections, one refused", MAX_CONNECTIONS)
                return
            conn.setblocking(False)
            self._sockets.add(conn)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"{THREAD_PREFIX}-conn"
            )
            thread.daemon = True
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # no more threads on this machine: drop this one
            logger.warning("proxy: cannot serve a connection: %s", exc)
            with self._lock:
                self._threads.discard(thread)
            self._forget(conn)

    def _serve(self, conn: socket.socket) -> None:
        """One client connection, from its header to the end of the relay; never raises."""
        try:
            self._handle(conn)
        except _Closing:
            pass
        except Exception:
            logger.exception("proxy: a connection failed")
        finally:
            self._forget(conn)
            with self._lock:
                self._threads.discard(threading.current_thread())
                self._close_wake()

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        sock.close()

    def _open_upstream(self, family: socket.AddressFamily) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        with self._lock:
            closed = self._closed
            if not closed:
                self._sockets.add(sock)
        if closed:
            sock.close()
            raise _Closing
        return sock

    # ----- one request ----------------------------------------------------------------------------

    def _handle(self, conn: socket.socket) -> None:
        try:
            peer = conn.getpeername()
        except OSError:
            return  # already gone
        client = (str(peer[0]), int(peer[1]))
        try:
            head = self._read_head(conn)
            if head is None:
                return  # connected and closed without a word: nothing to answer
            request = parse_request(*head)
        except Refusal as refusal:
            self._respond(conn, refusal.status, refusal.reason, denied=False)
            return
        upstream: socket.socket | None = None
        try:
            upstream = self._decide_and_connect(conn, client, request)
            if upstream is None:
                return
            if request.method == "CONNECT":
                self._send_all(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
                self._relay(conn, upstream, bytearray(request.rest), end_with_upstream=False)
            else:
                self._relay(conn, upstream, bytearray(origin_request(request)), True)
        except OSError as exc:
            logger.debug("proxy: a connection ended: %s", exc)  # a client or server went away
        finally:
            if upstream is not None:
                self._forget(upstream)

    def _decide_and_connect(
        self, conn: socket.socket, client: tuple[str, int], request: ProxyRequest
    ) -> socket.socket | None:
        """Apply the policy, connect, report; answer the client on refusal or failure.

        Returns the connected upstream socket, or None once the client has been answered."""
        valid = True
        try:
            host = canonical_host(request.host)
        except ValueError:
            host, valid = request.host[:255], False
        asked = _Asked(conn, client, request, host)
        port = request.port
        admitted = self._allowlist.admits(host, port)
        if not admitted and valid and self._ask is not None:  # approvals: the user may admit it
            admitted = self._ask_user(conn, host, port, client)
        if not admitted:
            self._refuse_unlisted(asked, valid)
            return None
        candidates = self._candidates(asked)
        if candidates is None:
            return None
        passing = self._usable(asked, candidates)
        if passing is None:
            return None
        return self._connect_any(asked, passing)

    def _refuse_unlisted(self, asked: _Asked, valid: bool) -> None:
        """A host the allowlist does not admit (nor the user): 403, with the flag that would."""
        host, port = asked.host, asked.request.port
        shown = with_port(host, port)
        if valid:
            fix = f"--allow-host {with_port(host, None if port in WEB_PORTS else port)}"
            if (registry := registry_of(host)) is not None and port in WEB_PORTS:
                fix = f"--allow {registry}"  # its other hosts and addresses with it
            cause = "not in --allow-host"
            reason = (
                f"host {shown} is not in the allowlist (--allow-host); to allow it, start "
                f"sandboxfs run with {fix} (allowed now: {self._allowlist.describe()})"
            )
            self._refuse(asked, cause, fix, None, reason)
        else:
            cause = "not a valid host name"
            reason = f"host {shown} is {cause}, so it is not in the allowlist"
            self._refuse(asked, cause, None, None, reason)

    def _candidates(self, asked: _Asked) -> list[str] | None:
        """The addresses to try: an IP literal's own, or what the name resolves to; None once
        the client has been answered (502: no such name, no address)."""
        host, port = asked.host, asked.request.port
        literal = ip_literal(host)
        if literal is not None:
            return [str(literal)]
        try:
            candidates = list(self._resolve(host, port))
        except Exception as exc:
            cause = f"cannot resolve {host} ({_describe_error(exc)})"
            self._fail(asked, cause, _resolve_error(exc), None)
            return None
        if not candidates:
            self._fail(asked, f"{host} has no address", "EAI_NONAME", None)
            return None
        return candidates

    def _usable(self, asked: _Asked, candidates: list[str]) -> list[IPAddress] | None:
        """The candidates that may be connected to, each once: global addresses, and those a
        rule lists exactly; None once the client has been answered (403: only refused ones)."""
        host, port = asked.host, asked.request.port
        passing: list[IPAddress] = []
        refused: list[tuple[IPAddress, str]] = []
        for text in candidates:
            address = ip_literal(str(text).split("%", 1)[0])
            if address is None:
                continue
            if address in passing or any(address == a for a, _ in refused):
                continue
            kind = address_class(address)
            if kind is None or self._allowlist.lists_address(str(address), port, host):
                passing.append(address)
            else:
                refused.append((address, kind))
        if passing:
            return passing
        if not refused:
            self._fail(asked, f"{host} resolved to no usable address", "EAI_NONAME", None)
            return None
        cause, fix = address_refusal(host, port, refused)
        self._refuse(asked, cause, fix, str(refused[0][0]))
        return None

    def _connect_any(self, asked: _Asked, passing: list[IPAddress]) -> socket.socket | None:
        """The first address that connects, reported; else None once the client has been
        answered (502, with what failed at each)."""
        host, port = asked.host, asked.request.port
        failures: list[tuple[str, str]] = []
        for address in passing:
            upstream = self._connect(address, port, failures)
            if upstream is None:
                continue
            if self._report(asked, True, None, str(address)):
                return upstream
            self._forget(upstream)
            return None
        texts = [text for text, _ in failures]
        # An address asked for by itself: "Connection refused", not "ADDRESS:PORT: Connection ..."
        shown = with_port(host, port)
        brief = texts[0].removeprefix(f"{shown}: ") if ip_literal(host) is not None else None
        self._fail(asked, "; ".join(texts), failures[-1][1], str(passing[-1]), brief)
        return None

    def _report(
        self,
        asked: _Asked,
        allowed: bool,
        reason: str | None,
        address: str | None,
        cause: str | None = None,
        fix: str | None = None,
        error: str | None = None,
    ) -> NetDecision | None:
        """Report the decision before the client learns it; None (and 403) when it cannot be
        recorded: a request not in the audit is refused."""
        host, port, request = asked.host, asked.request.port, asked.request
        decision = NetDecision(
            host, port, allowed, reason, address, asked.client, request.method, cause, fix, error
        )
        try:
            self._on_decision(decision)
        except Exception:
            logger.exception("proxy: reporting a network decision failed; refusing")
            self._respond(
                asked.conn,
                "403 Forbidden",
                f"the request to {with_port(host, port)} could not be recorded in the "
                "audit log, so it is refused",
                denied=True,
            )
            return None
        return decision

    def _refuse(
        self,
        asked: _Asked,
        cause: str,
        fix: str | None,
        address: str | None,
        reason: str | None = None,
    ) -> None:
        """Refused by the policy: 403, with why and the flag that would allow it."""
        reason = reason or f"{cause}; to allow it, start sandboxfs run with {fix}"
        decision = self._report(asked, False, reason, address, cause, fix)
        if decision is not None:
            self._respond(asked.conn, "403 Forbidden", reason, denied=True, decision=decision)

    def _fail(
        self, asked: _Asked, cause: str, error: str, address: str | None, brief: str | None = None
    ) -> None:
        """Admitted, but not completed: 502, with what failed (`brief`: in fewer words)."""
        reason = f"connect failed: {cause}"
        decision = self._report(asked, True, reason, address, brief or cause, None, error)
        if decision is not None:
            self._respond(asked.conn, "502 Bad Gateway", reason, denied=False, decision=decision)

    def _connect(
        self, address: IPAddress, port: int, failures: list[tuple[str, str]]
    ) -> socket.socket | None:
        """Connect to one address within CONNECT_TIMEOUT; on failure note why (and the error's
        name) and return None."""
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        sock = self._open_upstream(family)
        shown = with_port(str(address), port)
        try:
            code = sock.connect_ex((str(address), port))
            if code in (errno.EINPROGRESS, errno.EAGAIN):
                if not self._wait(sock, select.POLLOUT, time.monotonic() + CONNECT_TIMEOUT):
                    failures.append(
                        (f"{shown}: timed out after {CONNECT_TIMEOUT:g} s", "ETIMEDOUT")
                    )
                    self._forget(sock)
                    return None
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code != 0:
                text = _describe_error(OSError(code, os.strerror(code)))
                failures.append((f"{shown}: {text}", errno.errorcode.get(code, str(code))))
                self._forget(sock)
                return None
        except BaseException:
            self._forget(sock)
            raise
        return sock

    # ----- reading and answering ------------------------------------------------------------------

    def _ask_user(self, conn: socket.socket, host: str, port: int, client: tuple[str, int]) -> bool:
        assert self._ask is not None

        def gone() -> bool:
            if self._closed:
                return True
            try:
                return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True

        try:
            return self._ask(host, port, client, gone)
        except Exception:
            logger.exception("proxy: asking about %s:%d failed; refusing", host, port)
            return False

    def _read_head(self, conn: socket.socket) -> tuple[bytes, bytes] | None:
        """The request header (without its blank line) and the bytes after it; None when the
        client closed without sending anything."""
        deadline = time.monotonic() + HEADER_TIMEOUT
        buf = bytearray()
        while True:
            found = head_end(buf)
            if found is not None:
                index, term = found
                if index + len(term) > HEADER_LIMIT:
                    break
                return bytes(buf[:index]), bytes(buf[index + len(term) :])
            if len(buf) >= HEADER_LIMIT:
                break
            if not self._wait(conn, select.POLLIN, deadline):
                raise Refusal(
                    "400 Bad Request",
                    f"no complete request header within {HEADER_TIMEOUT:g} s",
                )
            try:
                data = conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return None
            if not data:
                if not buf:
                    return None
                raise Refusal("400 Bad Request", "the request header ended early")
            buf += data
        raise Refusal(
            "400 Bad Request", f"the request header is larger than {HEADER_LIMIT // 1024} KiB"
        )

    def _respond(
        self,
        conn: socket.socket,
        status: str,
        reason: str,
        *,
        denied: bool,
        decision: NetDecision | None = None,
    ) -> None:
        """Send a plain-text error response; the connection is closed after it. For a decision
        the reason phrase says what the body says, in brief (clients show the phrase)."""
        body = f"sandboxfs: {reason}\n".encode()
        notice = decision.notice() if decision is not None else None
        if notice is not None:
            status = f"{status.split(' ')[0]} sandboxfs {notice.removeprefix('network: ')}"
        head = (
            f"HTTP/1.1 {status}\r\n"
            "Content-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n" + ("X-Sandboxfs-Denied: 1\r\n" if denied else "") + "\r\n"
        )
        with contextlib.suppress(OSError):
            self._send_all(conn, head.encode("ascii") + body)
            conn.shutdown(socket.SHUT_WR)
            # Drain briefly so closing with unread input does not reset the answer away.
            deadline = time.monotonic() + 0.5
            while self._wait(conn, select.POLLIN, deadline):
                try:
                    if not conn.recv(65536):
                        break
                except BlockingIOError:
                    continue

    def _send_all(self, sock: socket.socket, data: bytes) -> None:
        deadline = time.monotonic() + SEND_TIMEOUT
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except (BlockingIOError, InterruptedError):
                sent = 0
            view = view[sent:]
            if view and not self._wait(sock, select.POLLOUT, deadline):
                raise TimeoutError("the client does not read")

    def _wait(self, sock: socket.socket, events: int, deadline: float) -> bool:
        """Wait for `events` on `sock` until `deadline`: True when ready, False on timeout;
        raises _Closing when the proxy closes."""
        poller = select.poll()
        poller.register(sock, events)
        poller.register(self._wake_r, select.POLLIN)
        wake = self._wake_r.fileno()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready = poller.poll(max(1, int(remaining * 1000)))
            if any(fd == wake for fd, _ in ready):
                raise _Closing
            if ready:
                return True

    def _relay(
        self,
        client: socket.socket,
        upstream: socket.socket,
        to_upstream: bytearray,
        end_with_upstream: bool,
    ) -> None:
        """Copy bytes both ways until both directions have ended (a half-close is passed on
        with shutdown(SHUT_WR)), or, for plain HTTP, until the upstream's answer has ended."""
        pipes = (
            Pipe(client, upstream, to_upstream),
            Pipe(upstream, client, bytearray()),
        )
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        wake = self._wake_r.fileno()
        registered: dict[int, int] = {}
        while not all(p.done for p in pipes):
            if end_with_upstream and pipes[1].done:
                return
            update_poller(poller, registered, wanted_events(pipes))
            if not any(registered.values()):
                return  # cannot happen: a pipe not done always wants something
            ready = dict(poller.poll())
            if wake in ready:
                raise _Closing
            for pipe in pipes:
                try:
                    pipe.step(ready.get(pipe.src.fileno(), 0), ready.get(pipe.dst.fileno(), 0))
                except OSError:
                    return  # a reset or a broken pipe ends the whole connection


def _getaddrinfo(host: str, port: int) -> list[str]:
    """The default resolver: the host's own, TCP addresses in its preferred order."""
    addresses: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


def _resolve_error(exc: BaseException) -> str:
    """A resolver failure as an error name: EAI_NONAME, EAI_AGAIN (or an errno's name)."""
    code = getattr(exc, "errno", None)
    if isinstance(exc, socket.gaierror) and isinstance(code, int):
        for name in dir(socket):
            if name.startswith("EAI_") and getattr(socket, name) == code:
                return name
    if isinstance(code, int) and code in errno.errorcode:
        return errno.errorcode[code]
    return "EAI_FAIL"


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
