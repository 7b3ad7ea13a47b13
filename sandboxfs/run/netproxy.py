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

`Notices` prints each refusal once on `run`'s stderr, the proxy's and the DNS stub's
(sandboxfs.run.dnsstub: the sandbox's only nameserver, with `--net none` too).

Everything is stdlib and thread-based: one accept thread and one thread per connection, with
non-blocking sockets waited on with poll() together with a wake-up socket that `close()` makes
readable, so every thread notices a close at once. Only the default resolver (getaddrinfo) and
`on_decision` itself cannot be interrupted.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sandboxfs.run.registries import registry_of

logger = logging.getLogger(__name__)

HEADER_LIMIT = 64 * 1024  # a request header larger than this is refused (400)
HEADER_TIMEOUT = 30.0  # seconds for a client to send its complete request header
CONNECT_TIMEOUT = 10.0  # seconds to connect to each upstream address
SEND_TIMEOUT = 30.0  # seconds to deliver an error response to a client that does not read
MAX_CONNECTIONS = 512  # connections served at once; more are closed at once (bounds threads)
NOTICE_LIMIT = 20  # refused hosts that `run` names on its stderr; the audit has every one
WEB_PORTS = (80, 443)  # what a rule without a port admits
_RELAY_BUFFER = 64 * 1024
THREAD_PREFIX = "sandboxfs-netproxy"
_EXPECTED = "expected HOST, HOST:PORT, *.DOMAIN[:PORT], IP[:PORT], [IPv6]:PORT or HOST[:PORT]=IP"

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(r"HTTP/1\.[0-9]")
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_ULA = ipaddress.IPv6Network("fc00::/7")
_RFC1918 = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)
_METADATA = (ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"))
_DROPPED_HEADERS = frozenset(
    {"proxy-authorization", "proxy-connection", "connection", "keep-alive", "host"}
)


class AllowHostError(ValueError):
    """A bad `--allow-host` value; the message is one line naming it and what is accepted."""


@dataclass(frozen=True)
class HostRule:
    """One `--allow-host` entry, normalized so that matching is plain comparison."""

    host: str  # lowercase (IDNA) name, "*.suffix" wildcard, or IP literal (IPv6 without brackets)
    port: int | None  # None: the web ports 80 and 443 only
    # `NAME=ADDRESS`: the name may also be connected at this address (an IP literal) when that
    # address is loopback, private or otherwise not global; None: its global addresses only.
    address: str | None = None


@dataclass(frozen=True)
class NetDecision:
    """What the proxy decided for one request naming a host, for the caller's audit entry.

    Three outcomes: connected (`allowed`, no `error`); refused by the policy (not `allowed`:
    `cause` says why in a few words, `fix` is the `--allow-host` flag that would admit it);
    admitted but not completed (`allowed` and an `error`: the name did not resolve, the
    upstream refused or did not answer)."""

    host: str
    port: int
    allowed: bool
    reason: str | None  # why refused (or "connect failed: ..."), in words a model can act on
    address: str | None  # the IP address connected to (allowed) or refused
    client: tuple[str, int]  # peer address of the client connection (inside the sandbox)
    method: str  # "CONNECT" or the HTTP method
    cause: str | None = None  # (refused, failed) the reason in brief, without the fix
    fix: str | None = None  # (refused) the flag that would admit it: "--allow-host pypi.org"
    error: str | None = None  # (failed) what failed, as an error name: ECONNREFUSED, EAI_NONAME

    @property
    def failed(self) -> bool:
        """Admitted by the policy, but the connection could not be made."""
        return self.allowed and self.error is not None

    def target(self) -> str:
        """`host:port` as a user would type it (IPv6 in brackets), made safe to print."""
        return printable(_with_port(self.host, self.port))

    def notice(self) -> str | None:
        """The one line `run` prints on its stderr the first time a host is refused or cannot
        be reached (None for a connection made): what, why, and the flag that would allow it.
        The same words (after "sandboxfs") are the reason phrase of the proxy's 403 or 502,
        which is what clients show (`Tunnel connection failed: 403 sandboxfs refused ...`)."""
        if not self.allowed:
            line = f"refused {self.target()} ({self.cause or self.reason})"
            line += f"; to allow it: {self.fix}" if self.fix else ""
        elif self.error is not None:
            line = f"could not reach {self.target()}: {self.cause or self.reason}"
        else:
            return None
        return f"network: {printable(line, 400)}"


# ----- rules --------------------------------------------------------------------------------------


def parse_allow_host(text: str) -> HostRule:
    """Parse one `--allow-host` value, refusing anything ambiguous rather than guessing."""

    def bad(why: str) -> AllowHostError:
        return AllowHostError(f"bad --allow-host value {text!r}: {why} ({_EXPECTED})")

    if not text:
        raise bad("it is empty")
    if any(c.isspace() for c in text):
        raise bad("it contains white space")
    if "=" in text:
        return _parse_pinned(text, bad)
    if "://" in text:
        raise bad("give a host name, not a URL")
    if any(c in text for c in "/?#@\\%"):
        raise bad("give a host name only, without a path, user or zone")
    host, port_text = _split_host_port(text, bad)
    port = None
    if port_text is not None:
        port = _parse_port(port_text)
        if port is None:
            raise bad(f"the port must be a number from 1 to 65535, not {port_text!r}")
    return _host_rule(host, port, bad)


def _split_host_port(text: str, bad: Callable[[str], AllowHostError]) -> tuple[str, str | None]:
    """`HOST[:PORT]` or `[IPv6][:PORT]` as the host and the port's text (None: no port)."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise bad("missing ']' after the IPv6 address")
        host, rest = text[1:close], text[close + 1 :]
        port_text = None
        if rest:
            if not rest.startswith(":"):
                raise bad("expected ':PORT' after ']'")
            port_text = rest[1:]
        if _ip(host) is None or ":" not in host:
            raise bad("only an IPv6 address goes in brackets")
        return host, port_text
    if text.count(":") == 1:
        host, port_text = text.split(":")
        return host, port_text
    return text, None


def _host_rule(host: str, port: int | None, bad: Callable[[str], AllowHostError]) -> HostRule:
    """The rule for an IP literal, a `*.DOMAIN` wildcard or a host name, checked."""
    address = _ip(host)
    if address is not None:
        return HostRule(str(address), port)
    if ":" in host:
        raise bad("not a valid IPv6 address")
    if host.startswith("*."):
        try:
            suffix = _normalize_name(host[2:])
        except ValueError as exc:
            raise bad(str(exc)) from None
        if "." not in suffix:
            raise bad("a wildcard needs at least two labels after '*.' (e.g. *.example.com)")
        return HostRule(f"*.{suffix}", port)
    if host == "*":
        raise bad("'*' would admit every host; list the hosts the program needs")
    if "*" in host:
        raise bad("a wildcard is only accepted as a leading '*.' (e.g. *.example.com)")
    try:
        return HostRule(_normalize_name(host), port)
    except ValueError as exc:
        raise bad(str(exc)) from None


def _parse_pinned(text: str, bad: Callable[[str], AllowHostError]) -> HostRule:
    """`NAME[:PORT]=ADDRESS`: the name, and the one address it may resolve to outside the
    globally routable ones."""
    left, _, right = text.partition("=")
    if "=" in right:
        raise bad("only one '=ADDRESS' is accepted")
    address = _ip(right[1:-1] if right.startswith("[") and right.endswith("]") else right)
    if address is None:
        raise bad(f"after '=' give the IP address the name resolves to, not {right!r}")
    try:
        rule = parse_allow_host(left)
    except AllowHostError:
        raise bad(f"{left!r} before '=' is not a HOST[:PORT]") from None
    if _ip(rule.host) is not None:
        raise bad("'=ADDRESS' follows a host name; an address alone is listed as IP[:PORT]")
    if rule.host.startswith("*."):
        raise bad("a wildcard cannot be pinned to an address; name the host")
    return HostRule(rule.host, rule.port, str(address))


def rule_text(rule: HostRule) -> str:
    """A rule as `--allow-host` takes it (and as messages and the audit show it)."""
    text = _with_port(rule.host, rule.port)
    return text if rule.address is None else f"{text}={rule.address}"


def _parse_port(text: str) -> int | None:
    if not _PORT.fullmatch(text):
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def _ip(text: str) -> _IPAddress | None:
    """An IP literal (brackets and zone not included), IPv4-mapped IPv6 as IPv4; else None."""
    if "%" in text:
        return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _normalize_name(text: str) -> str:
    """Lowercase, IDNA-encode and check a host name, without its trailing dot."""
    name = text[:-1] if text.endswith(".") else text
    if not name:
        raise ValueError("the host name is empty")
    try:
        name = name.lower().encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise ValueError("not a valid host name (an empty or over-long label)") from None
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError("not a valid host name")
    if labels[-1].isdigit():
        # "127.1" or "1.2.3.4.5": the resolver may read these as numbers; say what they are.
        raise ValueError("neither a valid IP address nor a host name")
    return name


def canonical_host(text: str) -> str:
    """The host as the client asked, in rule form: an IP literal or a normalized name."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    address = _ip(text)
    return str(address) if address is not None else _normalize_name(text)


def _with_port(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def _port_matches(rule_port: int | None, port: int) -> bool:
    return port in WEB_PORTS if rule_port is None else port == rule_port


class Allowlist:
    """The `--allow-host` rules: which hosts a request may name, which addresses are listed."""

    def __init__(self, rules: Sequence[HostRule]) -> None:
        self.rules = tuple(rules)

    def admits(self, host: str, port: int) -> bool:
        """Whether a request naming `host` (name or IP literal, as the client asked) may go on."""
        try:
            canonical = canonical_host(host)
        except ValueError:
            return False
        address = _ip(canonical)
        for rule in self.rules:
            if not _port_matches(rule.port, port):
                continue
            if address is not None:
                if _ip(rule.host) == address:
                    return True
            elif rule.host.startswith("*."):
                if canonical.endswith(rule.host[1:]):
                    return True
            elif rule.host == canonical:
                return True
        return False

    def lists_address(self, ip: str, port: int, host: str | None = None) -> bool:
        """True when a rule names exactly this address (and port): an IP-literal rule, or a
        `NAME=ADDRESS` rule for `host` (the name as the client asked). Only then may a loopback,
        private or otherwise non-global address be connected to."""
        address = _ip(ip.split("%", 1)[0])
        if address is None:
            return False
        try:
            name = None if host is None else canonical_host(host)
        except ValueError:
            name = None
        for rule in self.rules:
            if not _port_matches(rule.port, port):
                continue
            if _ip(rule.host) == address:
                return True
            if rule.address is not None and rule.host == name and _ip(rule.address) == address:
                return True
        return False

    def describe(self, limit: int = 20) -> str:
        """The rules as a user would type them, for messages."""
        shown = [rule_text(rule) for rule in self.rules[:limit]]
        if len(self.rules) > limit:
            shown.append(f"... ({len(self.rules) - limit} more)")
        return ", ".join(shown) or "(none)"


def _address_class(address: _IPAddress) -> str | None:
    """Why a connection to `address` is refused by default, or None when it is global."""
    if isinstance(address, ipaddress.IPv6Address) and address in _NAT64:
        # DNS64 gives v4-only hosts these addresses; judge the IPv4 address inside.
        embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        inner = _address_class(embedded)
        return None if inner is None else f"NAT64 of {embedded}, {inner}"
    kind = _scope_class(address) or _network_class(address)
    if kind is not None:
        return kind
    if address.is_reserved:
        return "reserved"
    if address.is_private or not address.is_global:
        return "special-purpose, not globally routable"
    return None


def _scope_class(address: _IPAddress) -> str | None:
    """(_address_class) What the address's own scope refuses, in either family."""
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address in _METADATA:
        return "link-local, cloud metadata"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    return None


def _network_class(address: _IPAddress) -> str | None:
    """(_address_class) The private networks of the address's family (NAT64 judged before)."""
    if isinstance(address, ipaddress.IPv4Address):
        if address in _CGNAT:
            return "carrier-grade NAT, shared"
        if any(address in net for net in _RFC1918):
            return "private"
        return None
    if address in _ULA:
        return "private, unique local"
    if address.is_site_local:
        return "site-local"
    return None


# ----- the proxy ----------------------------------------------------------------------------------


class _Closing(Exception):
    """The proxy is closing: the connection ends now."""


class _Refusal(Exception):
    """An HTTP error response to send (and, with a decision, to report first)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class _Request:
    method: str
    host: str  # as the client wrote it (brackets removed)
    port: int
    authority: str  # as the client wrote it, for the Host header
    target: str  # origin-form path for plain HTTP; "" for CONNECT
    version: str
    headers: tuple[tuple[str, str], ...]
    rest: bytes  # bytes read after the header (body or tunnel data)


@dataclass(frozen=True)
class _Asked:
    """One request naming a host, as the proxy decides on it."""

    conn: socket.socket
    client: tuple[str, int]
    request: _Request
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
            request = _parse_request(*head)
        except _Refusal as refusal:
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
                self._relay(conn, upstream, bytearray(_origin_request(request)), True)
        except OSError as exc:
            logger.debug("proxy: a connection ended: %s", exc)  # a client or server went away
        finally:
            if upstream is not None:
                self._forget(upstream)

    def _decide_and_connect(
        self, conn: socket.socket, client: tuple[str, int], request: _Request
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
        shown = _with_port(host, port)
        if valid:
            fix = f"--allow-host {_with_port(host, None if port in WEB_PORTS else port)}"
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
        literal = _ip(host)
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

    def _usable(self, asked: _Asked, candidates: list[str]) -> list[_IPAddress] | None:
        """The candidates that may be connected to, each once: global addresses, and those a
        rule lists exactly; None once the client has been answered (403: only refused ones)."""
        host, port = asked.host, asked.request.port
        passing: list[_IPAddress] = []
        refused: list[tuple[_IPAddress, str]] = []
        for text in candidates:
            address = _ip(str(text).split("%", 1)[0])
            if address is None:
                continue
            if address in passing or any(address == a for a, _ in refused):
                continue
            kind = _address_class(address)
            if kind is None or self._allowlist.lists_address(str(address), port, host):
                passing.append(address)
            else:
                refused.append((address, kind))
        if passing:
            return passing
        if not refused:
            self._fail(asked, f"{host} resolved to no usable address", "EAI_NONAME", None)
            return None
        cause, fix = _address_refusal(host, port, refused)
        self._refuse(asked, cause, fix, str(refused[0][0]))
        return None

    def _connect_any(self, asked: _Asked, passing: list[_IPAddress]) -> socket.socket | None:
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
        shown = _with_port(host, port)
        brief = texts[0].removeprefix(f"{shown}: ") if _ip(host) is not None else None
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
                f"the request to {_with_port(host, port)} could not be recorded in the "
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
        self, address: _IPAddress, port: int, failures: list[tuple[str, str]]
    ) -> socket.socket | None:
        """Connect to one address within CONNECT_TIMEOUT; on failure note why (and the error's
        name) and return None."""
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        sock = self._open_upstream(family)
        shown = _with_port(str(address), port)
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
            found = _head_end(buf)
            if found is not None:
                index, term = found
                if index + len(term) > HEADER_LIMIT:
                    break
                return bytes(buf[:index]), bytes(buf[index + len(term) :])
            if len(buf) >= HEADER_LIMIT:
                break
            if not self._wait(conn, select.POLLIN, deadline):
                raise _Refusal(
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
                raise _Refusal("400 Bad Request", "the request header ended early")
            buf += data
        raise _Refusal(
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
            _Pipe(client, upstream, to_upstream),
            _Pipe(upstream, client, bytearray()),
        )
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        wake = self._wake_r.fileno()
        registered: dict[int, int] = {}
        while not all(p.done for p in pipes):
            if end_with_upstream and pipes[1].done:
                return
            _update_poller(poller, registered, _wanted_events(pipes))
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


def _head_end(buf: bytearray) -> tuple[int, bytes] | None:
    """Where the request header in `buf` ends, and with which blank line; None while it has not.
    Leading empty lines before a request line are allowed (RFC 9112, 2.2): dropped here."""
    while buf.startswith(b"\r\n") or buf.startswith(b"\n"):
        del buf[: 2 if buf.startswith(b"\r\n") else 1]
    ends = [(buf.find(t), t) for t in (b"\r\n\r\n", b"\n\n")]
    found = [(i, t) for i, t in ends if i >= 0]
    return min(found) if found else None


def _wanted_events(pipes: tuple[_Pipe, _Pipe]) -> dict[int, int]:
    """(relay) What to poll each socket for: reading while its pipe has room, writing while
    the other way has bytes waiting."""
    wanted: dict[int, int] = {pipes[0].src.fileno(): 0, pipes[0].dst.fileno(): 0}
    for pipe in pipes:
        if not pipe.eof and len(pipe.buf) < _RELAY_BUFFER:
            wanted[pipe.src.fileno()] |= select.POLLIN
        if pipe.buf:
            wanted[pipe.dst.fileno()] |= select.POLLOUT
    return wanted


def _update_poller(poller: select.poll, registered: dict[int, int], wanted: dict[int, int]) -> None:
    """Register what is wanted now with `poller`, where it changed (`registered`: what it has)."""
    for fd, events in wanted.items():
        if registered.get(fd, 0) == events:
            continue
        if events:
            poller.register(fd, events)
        else:
            poller.unregister(fd)
        registered[fd] = events


class _Pipe:
    """One direction of a relay: bytes read from `src`, waiting in `buf`, written to `dst`."""

    def __init__(self, src: socket.socket, dst: socket.socket, buf: bytearray) -> None:
        self.src = src
        self.dst = dst
        self.buf = buf
        self.eof = False  # src has ended
        self.done = False  # ... and that end was passed on to dst

    def step(self, src_events: int, dst_events: int) -> None:
        readable = select.POLLIN | select.POLLHUP | select.POLLERR
        if src_events & readable and not self.eof and len(self.buf) < _RELAY_BUFFER:
            try:
                data = self.src.recv(_RELAY_BUFFER - len(self.buf))
            except (BlockingIOError, InterruptedError):
                data = None
            if data is not None:
                if data:
                    self.buf += data
                else:
                    self.eof = True
        if dst_events & (select.POLLOUT | select.POLLHUP | select.POLLERR) and self.buf:
            try:
                sent = self.dst.send(self.buf)
            except (BlockingIOError, InterruptedError):
                sent = 0
            del self.buf[:sent]
        if self.eof and not self.buf and not self.done:
            self.done = True
            with contextlib.suppress(OSError):
                self.dst.shutdown(socket.SHUT_WR)


# ----- what run prints ----------------------------------------------------------------------------


class Notices:
    """Lines for `run`'s stderr as refusals happen: each at most once (by `key`, such as the
    host and port), at most `limit` in all, then one `overflow` line; safe from any thread."""

    def __init__(self, write: Callable[[str], None], overflow: str, limit: int = NOTICE_LIMIT):
        self._write = write
        self._overflow = overflow
        self._limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def add(self, key: str, line: str | None) -> None:
        if line is None:
            return
        with self._lock:  # decided here, written outside: a stalled stderr holds one thread
            if key in self._seen:
                return
            if len(self._seen) >= self._limit:
                line, self._overflow = self._overflow, ""
                if not line:
                    return
            else:
                self._seen.add(key)
        self._write(line)


# ----- parsing ------------------------------------------------------------------------------------


def _parse_request(head: bytes, rest: bytes) -> _Request:
    """Parse a proxy request header: CONNECT authority or an absolute-form http:// URL."""
    lines = [line.removesuffix(b"\r").decode("latin-1") for line in head.split(b"\n")]
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _VERSION.fullmatch(parts[2]):
        raise _Refusal("400 Bad Request", "not an HTTP/1.x request line")
    method, target, version = parts
    headers: list[tuple[str, str]] = []
    if any("\r" in line for line in lines):
        raise _Refusal("400 Bad Request", "a stray carriage return in the request header")
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise _Refusal("400 Bad Request", "a malformed header line")
        headers.append((name, value.strip(" \t")))
    if method == "CONNECT":
        authority, path = target, ""
        default_port = 443
    else:
        scheme, sep, remainder = target.partition("://")
        if not sep or scheme.lower() != "http":
            raise _Refusal(
                "400 Bad Request",
                "this is a proxy: send CONNECT host:port (for https) or an absolute-form "
                "request such as GET http://host/path",
            )
        cut = min((i for i in (remainder.find(c) for c in "/?#") if i >= 0), default=None)
        authority, path = (remainder, "") if cut is None else (remainder[:cut], remainder[cut:])
        path = path.partition("#")[0]
        path = path if path.startswith("/") else "/" + path
        default_port = 80
    parsed = _split_authority(authority, default_port)
    if parsed is None:
        raise _Refusal("400 Bad Request", f"not a valid host[:port]: {authority[:100]!r}")
    host, port = parsed
    return _Request(method, host, port, authority, path, version, tuple(headers), rest)


def _split_authority(text: str, default_port: int) -> tuple[str, int] | None:
    """`host[:port]` or `[v6][:port]` as host (brackets removed) and port; None if malformed."""
    if not text or any(c in text for c in "@/?#\\") or any(c.isspace() for c in text):
        return None
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            return None
        host, rest = text[1:close], text[close + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        return None
    else:
        host, port_text = text, None
    if not host:
        return None
    if port_text is None:
        return host, default_port
    port = _parse_port(port_text)
    return None if port is None else (host, port)


def _origin_request(request: _Request) -> bytes:
    """The request rewritten for the origin server: origin-form target, the client's Host
    replaced by the URL's authority (RFC 9112, 3.2.2), proxy headers dropped, one request."""
    lines = [f"{request.method} {request.target} {request.version}", f"Host: {request.authority}"]
    lines += [f"{n}: {v}" for n, v in request.headers if n.lower() not in _DROPPED_HEADERS]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.rest


def _address_refusal(
    host: str, port: int, refused: list[tuple[_IPAddress, str]]
) -> tuple[str, str]:
    """Why a host whose addresses are all non-global is refused, and the one flag that admits
    it: `NAME=ADDRESS` for a name (the first address it resolved to is enough: the proxy tries
    the listed ones), the address itself for an IP literal."""
    rule_port = None if port in WEB_PORTS else port
    first = refused[0][0]
    if _ip(host) == first:
        cause = f"{first} is a {refused[0][1]} address, which is refused unless listed exactly"
        return cause, f"--allow-host {_with_port(str(first), rule_port)}"
    listed = ", ".join(f"{address} ({kind})" for address, kind in refused)
    verb = "is" if len(refused) == 1 else "are"
    cause = f"{host} resolves to {listed}, which {verb} refused unless listed exactly"
    return cause, f"--allow-host {_with_port(host, rule_port)}={first}"


def printable(text: str | None, limit: int = 300) -> str:
    """`text` as one line of printable ASCII: what a program inside chose (a host name it sent,
    a name it looked up) must not reach the user's terminal as control sequences."""
    if text is None:
        return ""
    shown = "".join(
        c if c.isascii() and c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in text
    )
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


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
