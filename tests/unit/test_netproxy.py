"""The network proxy against real sockets on 127.0.0.1 (never any outside address): parsing and
matching of --allow-host rules, CONNECT tunnels and plain HTTP to local servers, refusals by
allowlist and by address class, errors, reporting before answering, and a clean close."""

from __future__ import annotations

import http.server
import select
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

import sandboxfs.run.netproxy as netproxy
from sandboxfs.run.allowlist import (
    AllowHostError,
    Allowlist,
    HostRule,
    address_class,
    ip_literal,
    parse_allow_host,
    rule_text,
)
from sandboxfs.run.netdecision import NetDecision, Notices
from sandboxfs.run.netproxy import Proxy

LOCAL = "127.0.0.1"
Resolve = Callable[[str, int], list[str]]

# ----- helpers ------------------------------------------------------------------------------------


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        assert chunk, data
        data += chunk
    return data


def exchange(address: tuple[str, int], data: bytes) -> bytes:
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(data)
        return read_all(sock)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    phrase: str = ""


def parse_response(raw: bytes) -> Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    _, status, phrase = lines[0].split(" ", 2)
    return Response(int(status), {k.lower(): v for k, v in headers.items()}, body, phrase)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL, 0))
        port: int = sock.getsockname()[1]
    return port


def no_such_host(host: str, port: int) -> list[str]:
    raise OSError(f"no such host in this test: {host}")


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sandboxfs-netproxy")]


@dataclass
class Harness:
    proxy: Proxy
    listener: socket.socket
    decisions: list[NetDecision] = field(default_factory=list)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()
        return host, port

    def request(self, data: bytes) -> Response:
        return parse_response(exchange(self.address, data))


MakeProxy = Callable[..., Harness]


@pytest.fixture
def make_proxy() -> Iterator[MakeProxy]:
    made: list[Harness] = []

    def make(
        *rules: str,
        resolve: Resolve = no_such_host,
        before: Callable[[NetDecision], None] | None = None,
    ) -> Harness:
        listener = socket.create_server((LOCAL, 0))
        decisions: list[NetDecision] = []

        def on_decision(decision: NetDecision) -> None:
            decisions.append(decision)
            if before is not None:
                before(decision)

        allowlist = Allowlist([parse_allow_host(rule) for rule in rules])
        proxy = Proxy(listener, allowlist, on_decision, resolve)
        harness = Harness(proxy, listener, decisions)
        made.append(harness)
        proxy.start()
        return harness

    yield make
    for harness in made:
        harness.proxy.close()
    assert proxy_threads() == []


@dataclass
class Echo:
    """Echoes what it reads; at the end of input answers b"bye" and closes (a half-close)."""

    port: int
    connections: list[tuple[str, int]]


@pytest.fixture
def echo() -> Iterator[Echo]:
    listener = socket.create_server((LOCAL, 0))
    listener.settimeout(0.05)
    stop = threading.Event()
    server = Echo(listener.getsockname()[1], [])

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            server.connections.append(peer)
            with conn:
                conn.settimeout(5)
                try:
                    while data := conn.recv(65536):
                        conn.sendall(data)
                    conn.sendall(b"bye")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(5)
        listener.close()


class _Server(http.server.HTTPServer):
    seen: list[tuple[str, dict[str, str], bytes]]

    def server_bind(self) -> None:  # without HTTPServer's reverse DNS lookup
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = LOCAL, self.server_address[1]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self.answer(b"")

    def do_POST(self) -> None:
        self.answer(self.rfile.read(int(self.headers["Content-Length"])))

    def answer(self, body: bytes) -> None:
        self.server.seen.append((self.requestline, dict(self.headers.items()), body))
        out = f"hello from origin {self.path} ".encode() + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def web() -> Iterator[Callable[[], _Server]]:
    servers: list[tuple[_Server, threading.Thread]] = []

    def start() -> _Server:
        server = _Server((LOCAL, 0), _Handler)
        server.seen = []
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        servers.append((server, thread))
        return server

    yield start
    for server, thread in servers:
        server.shutdown()
        thread.join(5)
        server.server_close()


# ----- rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("example.com", HostRule("example.com", None)),
        ("Example.COM.", HostRule("example.com", None)),
        ("example.com:8443", HostRule("example.com", 8443)),
        ("*.example.com", HostRule("*.example.com", None)),
        ("*.Example.com:443", HostRule("*.example.com", 443)),
        ("localhost", HostRule("localhost", None)),
        ("127.0.0.1:8080", HostRule("127.0.0.1", 8080)),
        ("10.1.2.3", HostRule("10.1.2.3", None)),
        ("[::1]:8080", HostRule("::1", 8080)),
        ("[::1]", HostRule("::1", None)),
        ("::1", HostRule("::1", None)),
        ("2001:DB8:0::1", HostRule("2001:db8::1", None)),
        ("[::ffff:127.0.0.1]:80", HostRule("127.0.0.1", 80)),
        ("Bücher.example", HostRule("xn--bcher-kva.example", None)),
        ("api.example.com:65535", HostRule("api.example.com", 65535)),
        ("pypi.org=203.0.113.80", HostRule("pypi.org", None, "203.0.113.80")),
        ("PyPI.org:8443=10.0.0.5", HostRule("pypi.org", 8443, "10.0.0.5")),
        ("localhost:8000=::1", HostRule("localhost", 8000, "::1")),
        ("localhost=[::ffff:127.0.0.1]", HostRule("localhost", None, "127.0.0.1")),
    ],
)
def test_parse_allow_host_accepts(text: str, rule: HostRule) -> None:
    assert parse_allow_host(text) == rule


@pytest.mark.parametrize(
    "text",
    [
        "",
        "*",
        "*:443",
        "*.com",
        "*.com.",
        "foo.*.com",
        "*foo.com",
        "*.*.com",
        "example.com:0",
        "example.com:65536",
        "example.com:99999999",
        "example.com:",
        "example.com:http",
        "example.com:+80",
        "exa mple.com",
        " example.com",
        "example.com\n",
        "https://example.com",
        "example.com/path",
        "user@example.com",
        "a..b",
        ".example.com",
        "-a.example.com",
        "a" * 64 + ".com",
        "127.1",
        "1.2.3.4.5",
        "[::1",
        "[::1]x",
        "[::1]:",
        "[example.com]:80",
        "[127.0.0.1]:80",
        "fe80::1%eth0",
        "1:2:3",
        "example.com:80:80",
        "pypi.org=",
        "pypi.org=pypi.org",
        "pypi.org=10.0.0.1=10.0.0.2",
        "=10.0.0.1",
        "10.0.0.1=10.0.0.1",
        "*.example.com=10.0.0.1",
        "pypi.org=fe80::1%eth0",
        "pypi.org=10.0.0.1:443",
    ],
)
def test_parse_allow_host_rejects(text: str) -> None:
    with pytest.raises(AllowHostError) as info:
        parse_allow_host(text)
    message = str(info.value)
    assert "\n" not in message
    assert repr(text) in message
    assert "HOST:PORT" in message
    assert isinstance(info.value, ValueError)


def test_wildcard_matches_subdomains_only() -> None:
    allow = Allowlist([parse_allow_host("*.example.com")])
    assert allow.admits("a.example.com", 443)
    assert allow.admits("a.b.example.com", 80)
    assert allow.admits("A.Example.COM.", 443)
    assert not allow.admits("example.com", 443)
    assert not allow.admits("badexample.com", 443)
    assert not allow.admits("a.example.com.evil.test", 443)
    assert not allow.admits("a.example.com", 8443)


def test_names_match_exactly_and_normalized() -> None:
    allow = Allowlist([parse_allow_host("api.example.com"), parse_allow_host("bücher.example")])
    assert allow.admits("API.example.com.", 443)
    assert allow.admits("xn--bcher-kva.example", 443)
    assert allow.admits("BÜCHER.example", 80)
    assert not allow.admits("www.api.example.com", 443)
    assert not allow.admits("api.example.co", 443)
    assert not allow.admits("", 443)
    assert not allow.admits("not a host", 443)


def test_port_rules() -> None:
    allow = Allowlist(
        [parse_allow_host("web.test"), parse_allow_host("svc.test:8443"), parse_allow_host("::1")]
    )
    assert allow.admits("web.test", 80)
    assert allow.admits("web.test", 443)
    assert not allow.admits("web.test", 8080)
    assert not allow.admits("web.test", 22)
    assert allow.admits("svc.test", 8443)
    assert not allow.admits("svc.test", 443)
    assert allow.admits("[::1]", 443)
    assert allow.admits("0:0::1", 80)
    assert not allow.admits("::1", 22)


def test_ip_rules_and_listed_addresses() -> None:
    allow = Allowlist([parse_allow_host("127.0.0.1:8080"), parse_allow_host("api.test:8080")])
    assert allow.admits("127.0.0.1", 8080)
    assert allow.admits("::ffff:127.0.0.1", 8080)
    assert not allow.admits("127.0.0.2", 8080)
    assert not allow.admits("localhost", 8080)
    assert not allow.admits("127.0.0.1", 8081)
    assert allow.lists_address("127.0.0.1", 8080)
    assert allow.lists_address("::ffff:127.0.0.1", 8080)
    assert not allow.lists_address("127.0.0.1", 8081)
    assert not allow.lists_address("127.0.0.2", 8080)
    assert not allow.lists_address("api.test", 8080)


def test_pinned_rules_admit_the_name_and_list_its_address() -> None:
    rule = parse_allow_host("api.test:8080=10.0.0.5")
    allow = Allowlist([rule, parse_allow_host("web.test=127.0.0.1")])
    assert rule_text(rule) == "api.test:8080=10.0.0.5"
    assert allow.describe() == "api.test:8080=10.0.0.5, web.test=127.0.0.1"
    assert allow.admits("API.test", 8080)
    assert not allow.admits("api.test", 443)
    assert not allow.admits("10.0.0.5", 8080)  # the address alone is not admitted
    assert allow.lists_address("10.0.0.5", 8080, "api.test")
    assert allow.lists_address("10.0.0.5", 8080, "API.test.")
    assert not allow.lists_address("10.0.0.5", 8080)
    assert not allow.lists_address("10.0.0.5", 8080, "other.test")
    assert not allow.lists_address("10.0.0.5", 443, "api.test")
    assert not allow.lists_address("10.0.0.6", 8080, "api.test")
    assert allow.lists_address("127.0.0.1", 443, "web.test")
    assert not allow.lists_address("127.0.0.1", 8443, "web.test")


def test_address_classes() -> None:
    def cls(text: str) -> str | None:
        address = ip_literal(text)
        assert address is not None
        return address_class(address)

    assert cls("8.8.8.8") is None
    assert cls("2606:4700::1111") is None
    assert cls("64:ff9b::808:808") is None  # NAT64 of a global address
    assert cls("127.0.0.1") == "loopback"
    assert cls("::ffff:127.0.0.1") == "loopback"
    assert cls("169.254.169.254") == "link-local, cloud metadata"
    assert cls("100.64.0.1") == "carrier-grade NAT, shared"
    assert cls("192.168.1.1") == "private"
    assert cls("fd12::1") == "private, unique local"
    assert cls("0.0.0.0") == "unspecified"
    assert cls("64:ff9b::7f00:1") == "NAT64 of 127.0.0.1, loopback"


# ----- the proxy ----------------------------------------------------------------------------------


def test_connect_relays_both_ways_with_half_close(make_proxy: MakeProxy, echo: Echo) -> None:
    harness = make_proxy(f"{LOCAL}:{echo.port}")
    with socket.create_connection(harness.address, timeout=5) as client:
        client.sendall(f"CONNECT {LOCAL}:{echo.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert read_head(client) == b"HTTP/1.1 200 Connection established\r\n\r\n"
        client.sendall(b"ping")
        assert client.recv(4) == b"ping"
        client.sendall(b"x" * 300_000)
        got = b""
        while len(got) < 300_000:
            got += client.recv(65536)
        assert got == b"x" * 300_000
        client.shutdown(socket.SHUT_WR)
        assert read_all(client) == b"bye"
        me = client.getsockname()
    [decision] = harness.decisions
    assert decision == NetDecision(LOCAL, echo.port, True, None, LOCAL, me, "CONNECT")


def test_plain_http_get_and_post(make_proxy: MakeProxy, web: Callable[[], _Server]) -> None:
    server = web()
    port = server.server_port
    harness = make_proxy(f"{LOCAL}:{port}")
    response = harness.request(
        f"GET http://{LOCAL}:{port}/a/b?q=1#frag HTTP/1.1\r\n"
        "Host: elsewhere.test\r\nProxy-Authorization: Basic c2VjcmV0\r\n"
        "Proxy-Connection: keep-alive\r\nConnection: keep-alive\r\nX-Kept: yes\r\n\r\n".encode()
    )
    assert response.status == 200
    assert response.body == b"hello from origin /a/b?q=1 "
    requestline, headers, _ = server.seen[0]
    assert requestline == "GET /a/b?q=1 HTTP/1.1"
    assert headers["Host"] == f"{LOCAL}:{port}"
    assert headers["Connection"] == "close"
    assert headers["X-Kept"] == "yes"
    assert "Proxy-Authorization" not in headers
    assert "Proxy-Connection" not in headers

    response = harness.request(
        f"POST http://{LOCAL}:{port} HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello".encode()
    )
    assert response.status == 200
    assert response.body == b"hello from origin / hello"
    assert [(d.method, d.allowed, d.address) for d in harness.decisions] == [
        ("GET", True, LOCAL),
        ("POST", True, LOCAL),
    ]


def test_unlisted_server_is_refused(
    make_proxy: MakeProxy, web: Callable[[], _Server], echo: Echo
) -> None:
    listed, unlisted = web(), web()
    harness = make_proxy(f"{LOCAL}:{listed.server_port}", "*.example.net:8443")
    response = harness.request(
        f"GET http://{LOCAL}:{unlisted.server_port}/ HTTP/1.1\r\n\r\n".encode()
    )
    assert response.status == 403
    assert response.headers["x-sandboxfs-denied"] == "1"
    assert response.headers["content-type"] == "text/plain"
    assert response.headers["connection"] == "close"
    target = f"{LOCAL}:{unlisted.server_port}"
    reason = (
        f"host {target} is not in the allowlist (--allow-host); to allow it, start sandboxfs "
        f"run with --allow-host {target} (allowed now: {LOCAL}:{listed.server_port}, "
        "*.example.net:8443)"
    )
    assert response.body == f"sandboxfs: {reason}\n".encode()
    notice = f"refused {target} (not in --allow-host); to allow it: --allow-host {target}"
    assert response.phrase == f"sandboxfs {notice}"
    assert unlisted.seen == []
    [decision] = harness.decisions
    assert (decision.allowed, decision.reason, decision.address) == (False, reason, None)
    assert (decision.host, decision.port, decision.method) == (LOCAL, unlisted.server_port, "GET")
    assert (decision.fix, decision.error, decision.failed) == (
        f"--allow-host {target}",
        None,
        False,
    )
    assert decision.notice() == f"network: {notice}"

    response = harness.request(f"CONNECT localhost:{echo.port} HTTP/1.1\r\n\r\n".encode())
    assert response.status == 403
    assert echo.connections == []


def test_allowed_name_resolving_to_loopback_is_refused(make_proxy: MakeProxy, echo: Echo) -> None:
    asked: list[tuple[str, int]] = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return [LOCAL]

    harness = make_proxy(f"api.test:{echo.port}", resolve=resolve)
    response = harness.request(f"CONNECT API.test:{echo.port} HTTP/1.1\r\n\r\n".encode())
    assert response.status == 403
    cause = "api.test resolves to 127.0.0.1 (loopback), which is refused unless listed exactly"
    fix = f"--allow-host api.test:{echo.port}=127.0.0.1"
    reason = f"{cause}; to allow it, start sandboxfs run with {fix}"
    assert response.body == f"sandboxfs: {reason}\n".encode()
    assert (
        response.phrase == f"sandboxfs refused api.test:{echo.port} ({cause}); to allow it: {fix}"
    )
    assert asked == [("api.test", echo.port)]
    assert echo.connections == []
    [decision] = harness.decisions
    assert (decision.host, decision.allowed, decision.reason) == ("api.test", False, reason)
    assert (decision.address, decision.cause, decision.fix) == (LOCAL, cause, fix)


def test_the_suggested_pin_admits_the_name(make_proxy: MakeProxy, echo: Echo) -> None:
    """The one flag a refusal names is enough: the name, at the address it resolves to."""
    harness = make_proxy(f"api.test:{echo.port}", resolve=lambda h, p: [LOCAL])
    harness.request(f"CONNECT api.test:{echo.port} HTTP/1.1\r\n\r\n".encode())
    [refusal] = harness.decisions
    assert refusal.fix is not None
    pinned = make_proxy(refusal.fix.removeprefix("--allow-host "), resolve=lambda h, p: [LOCAL])
    with socket.create_connection(pinned.address, timeout=5) as client:
        client.sendall(f"CONNECT api.test:{echo.port} HTTP/1.1\r\n\r\n".encode())
        assert read_head(client).startswith(b"HTTP/1.1 200 ")
        client.shutdown(socket.SHUT_WR)
        assert read_all(client) == b"bye"
    [decision] = pinned.decisions
    assert (decision.allowed, decision.address, decision.error) == (True, LOCAL, None)
    # ... and nothing more: another name at that address, or the address itself, is refused.
    for target in (f"other.test:{echo.port}", f"{LOCAL}:{echo.port}"):
        response = pinned.request(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
        assert response.status == 403, target
    assert len(echo.connections) == 1


def test_web_ports_suggest_a_rule_without_port(make_proxy: MakeProxy) -> None:
    harness = make_proxy("api.test", resolve=lambda h, p: ["203.0.113.80"])
    for request in (
        b"CONNECT example.org:443",
        b"GET http://[2001:db8::1]:8080/",
        b"GET http://api.test/",
    ):
        harness.request(request + b" HTTP/1.1\r\n\r\n")
    assert [d.notice() for d in harness.decisions] == [
        "network: refused example.org:443 (not in --allow-host); to allow it: "
        "--allow-host example.org",
        "network: refused [2001:db8::1]:8080 (not in --allow-host); to allow it: "
        "--allow-host [2001:db8::1]:8080",
        "network: refused api.test:80 (api.test resolves to 203.0.113.80 (special-purpose, not "
        "globally routable), which is refused unless listed exactly); to allow it: "
        "--allow-host api.test=203.0.113.80",
    ]


def test_a_host_name_that_is_no_name_gets_no_fix(make_proxy: MakeProxy) -> None:
    harness = make_proxy("api.test")
    response = harness.request(b"CONNECT bad\x1b[2J\xff.test:443 HTTP/1.1\r\n\r\n")
    assert response.status == 403
    [decision] = harness.decisions
    assert decision.fix is None
    assert decision.notice() == (
        "network: refused bad\\x1b[2J\\xff.test:443 (not a valid host name)"
    )
    assert response.phrase.isascii() and response.phrase.isprintable()


def test_name_resolving_to_a_listed_address_is_allowed(make_proxy: MakeProxy, echo: Echo) -> None:
    harness = make_proxy(
        f"api.test:{echo.port}", f"{LOCAL}:{echo.port}", resolve=lambda h, p: ["10.0.0.1", LOCAL]
    )
    with socket.create_connection(harness.address, timeout=5) as client:
        client.sendall(f"CONNECT api.test:{echo.port} HTTP/1.1\r\n\r\n".encode())
        assert read_head(client).startswith(b"HTTP/1.1 200 ")
        client.shutdown(socket.SHUT_WR)
        assert read_all(client) == b"bye"
    [decision] = harness.decisions
    assert (decision.host, decision.allowed, decision.address) == ("api.test", True, LOCAL)


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("169.254.169.254", "169.254.169.254 (link-local, cloud metadata)"),
        ("::ffff:127.0.0.1", "127.0.0.1 (loopback)"),
        ("::1", "::1 (loopback)"),
        ("10.1.2.3", "10.1.2.3 (private)"),
        ("100.64.1.1", "100.64.1.1 (carrier-grade NAT, shared)"),
        ("0.0.0.0", "0.0.0.0 (unspecified)"),
        ("fe80::1%eth0", "fe80::1 (link-local)"),
        ("224.0.0.1", "224.0.0.1 (multicast)"),
        ("240.0.0.1", "240.0.0.1 (reserved)"),
    ],
)
def test_non_global_addresses_are_refused(make_proxy: MakeProxy, address: str, kind: str) -> None:
    harness = make_proxy("metadata.test", resolve=lambda h, p: [address])
    response = harness.request(b"GET http://metadata.test/latest/meta-data/ HTTP/1.1\r\n\r\n")
    assert response.status == 403
    assert f"metadata.test resolves to {kind}, which is refused" in response.body.decode()
    [decision] = harness.decisions
    assert not decision.allowed
    assert decision.address == kind.split(" ")[0]


def test_several_refused_addresses_are_all_named(make_proxy: MakeProxy) -> None:
    harness = make_proxy("multi.test", resolve=lambda h, p: ["10.0.0.1", "127.0.0.1", "10.0.0.1"])
    response = harness.request(b"CONNECT multi.test:443 HTTP/1.1\r\n\r\n")
    assert response.status == 403
    assert response.body == (
        b"sandboxfs: multi.test resolves to 10.0.0.1 (private), 127.0.0.1 (loopback), "
        b"which are refused unless listed exactly; to allow it, start sandboxfs run with "
        b"--allow-host multi.test=10.0.0.1\n"
    )


def test_metadata_literal_without_rule_is_refused(make_proxy: MakeProxy) -> None:
    harness = make_proxy("api.test")
    response = harness.request(b"GET http://169.254.169.254/ HTTP/1.1\r\n\r\n")
    assert response.status == 403
    assert b"169.254.169.254:80 is not in the allowlist" in response.body


def test_resolution_and_connection_failures_are_502(make_proxy: MakeProxy) -> None:
    port = closed_port()
    harness = make_proxy("gone.test", f"{LOCAL}:{port}", resolve=no_such_host)
    response = harness.request(b"CONNECT gone.test:443 HTTP/1.1\r\n\r\n")
    assert response.status == 502
    assert "x-sandboxfs-denied" not in response.headers
    assert response.body.startswith(b"sandboxfs: connect failed: cannot resolve gone.test")
    response = harness.request(f"CONNECT {LOCAL}:{port} HTTP/1.1\r\n\r\n".encode())
    assert response.status == 502
    assert (
        response.body == f"sandboxfs: connect failed: {LOCAL}:{port}: Connection refused\n".encode()
    )
    assert response.phrase == f"sandboxfs could not reach {LOCAL}:{port}: Connection refused"
    first, second = harness.decisions
    assert first.allowed and first.reason is not None and first.address is None
    assert first.reason.startswith("connect failed: cannot resolve gone.test")
    assert (first.failed, first.error, first.fix) == (True, "EAI_FAIL", None)
    assert second.allowed and second.address == LOCAL
    assert second.reason == f"connect failed: {LOCAL}:{port}: Connection refused"
    assert (second.failed, second.error) == (True, "ECONNREFUSED")
    assert second.notice() == f"network: could not reach {LOCAL}:{port}: Connection refused"


def test_resolver_errors_are_named() -> None:
    gaierror = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert netproxy._resolve_error(gaierror) == "EAI_NONAME"
    assert netproxy._resolve_error(socket.gaierror(socket.EAI_AGAIN, "later")) == "EAI_AGAIN"
    assert netproxy._resolve_error(OSError(110, "timed out")) == "ETIMEDOUT"
    assert netproxy._resolve_error(RuntimeError("?")) == "EAI_FAIL"


def test_notices_once_per_key_and_bounded() -> None:
    written: list[str] = []
    notices = Notices(written.append, "more: see the audit", limit=2)
    for key in ("a", "a", "b", None, "c", "d", "a"):
        notices.add(str(key), None if key is None else f"line {key}")
    assert written == ["line a", "line b", "more: see the audit"]


@pytest.mark.parametrize(
    "data",
    [
        b"hello\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
        b"GET https://example.com/ HTTP/1.1\r\n\r\n",
        b"GET http:///path HTTP/1.1\r\n\r\n",
        b"GET http://user@example.com/ HTTP/1.1\r\n\r\n",
        b"CONNECT example.com:99999 HTTP/1.1\r\n\r\n",
        b"CONNECT ::1:443 HTTP/1.1\r\n\r\n",
        b"CONNECT example.com:443 HTTP/2.0\r\n\r\n",
        b"CONNECT example.com:443 HTTP/1.1\r\nBad Header: x\r\n\r\n",
        b"CONNECT example.com:443 HTTP/1.1\r\nX: a\rb\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n",
        b"GET http://example.com/",  # then the end of input
    ],
)
def test_garbage_is_400_and_not_reported(make_proxy: MakeProxy, data: bytes) -> None:
    harness = make_proxy("example.com")
    with socket.create_connection(harness.address, timeout=5) as client:
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)
        response = parse_response(read_all(client))
    assert response.status == 400
    assert response.body.startswith(b"sandboxfs: ")
    assert harness.decisions == []


def test_oversized_header_is_400(make_proxy: MakeProxy) -> None:
    harness = make_proxy("example.com")
    response = harness.request(b"GET http://example.com/ HTTP/1.1\r\nX: " + b"a" * 70_000)
    assert response.status == 400
    assert b"larger than 64 KiB" in response.body
    assert harness.decisions == []


def test_slow_header_is_400(make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netproxy, "HEADER_TIMEOUT", 0.2)
    harness = make_proxy("example.com")
    with socket.create_connection(harness.address, timeout=5) as client:
        client.sendall(b"GET http://example.com/ HTTP/1.1\r\n")
        response = parse_response(read_all(client))
    assert response.status == 400
    assert b"no complete request header within 0.2 s" in response.body


def test_silent_connection_gets_nothing(make_proxy: MakeProxy) -> None:
    harness = make_proxy("example.com")
    with socket.create_connection(harness.address, timeout=5) as client:
        client.shutdown(socket.SHUT_WR)
        assert read_all(client) == b""
    assert harness.decisions == []


def test_decision_is_reported_before_the_client_is_answered(
    make_proxy: MakeProxy, echo: Echo
) -> None:
    entered, release = threading.Event(), threading.Event()

    def before(decision: NetDecision) -> None:
        entered.set()
        release.wait(5)

    harness = make_proxy(f"{LOCAL}:{echo.port}", before=before)
    for target in (f"{LOCAL}:{echo.port}", "elsewhere.test:443"):
        entered.clear()
        release.clear()
        with socket.create_connection(harness.address, timeout=5) as client:
            client.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            client.shutdown(socket.SHUT_WR)
            assert entered.wait(5)
            readable, _, _ = select.select([client], [], [], 0.05)
            assert readable == []  # nothing answered while on_decision runs
            release.set()
            assert read_all(client).startswith(b"HTTP/1.1 ")
    assert [d.allowed for d in harness.decisions] == [True, False]


def test_failing_on_decision_refuses_and_keeps_serving(make_proxy: MakeProxy, echo: Echo) -> None:
    def before(decision: NetDecision) -> None:
        raise OSError("the audit log cannot be written")

    harness = make_proxy(f"{LOCAL}:{echo.port}", before=before)
    for _ in range(2):
        response = harness.request(f"CONNECT {LOCAL}:{echo.port} HTTP/1.1\r\n\r\n".encode())
        assert response.status == 403
        assert response.headers["x-sandboxfs-denied"] == "1"
        assert b"could not be recorded in the audit log" in response.body
    response = harness.request(b"CONNECT other.test:443 HTTP/1.1\r\n\r\n")
    assert response.status == 403
    assert len(harness.decisions) == 3


def test_close_ends_every_thread_and_connection(make_proxy: MakeProxy, echo: Echo) -> None:
    harness = make_proxy(f"{LOCAL}:{echo.port}")
    with (
        socket.create_connection(harness.address, timeout=5) as tunnel,
        socket.create_connection(harness.address, timeout=5) as pending,
    ):
        tunnel.sendall(f"CONNECT {LOCAL}:{echo.port} HTTP/1.1\r\n\r\n".encode())
        assert read_head(tunnel).startswith(b"HTTP/1.1 200 ")
        pending.sendall(b"GET http://exam")
        deadline = time.monotonic() + 5
        while len(proxy_threads()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(proxy_threads()) == 3  # accepting, the tunnel, the pending header
        started = time.monotonic()
        harness.proxy.close()
        assert time.monotonic() - started < 1
        assert proxy_threads() == []
        assert harness.listener.fileno() == -1
        assert read_all(tunnel) == b""
        assert read_all(pending) == b""
    harness.proxy.close()  # twice is fine


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        (["151.101.0.223"], ["pypi.org"]),  # global: the name, as any other
        (["203.0.113.80", "203.0.113.81"], ["pypi.org=203.0.113.80", "pypi.org=203.0.113.81"]),
        (["10.1.2.3", "151.101.0.223"], ["pypi.org=10.1.2.3"]),  # the mirror, pinned
        (["127.0.0.1"], ["pypi.org"]),  # never pinned to loopback: refused as usual
        (["169.254.169.254"], ["pypi.org"]),  # nor to a metadata address
        ([], ["pypi.org"]),
    ],
)
def test_a_registry_host_is_pinned_only_to_a_mirrors_address(
    monkeypatch: pytest.MonkeyPatch, addresses: list[str], expected: list[str]
) -> None:
    from sandboxfs.run import registries

    def resolve(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
        if not addresses:
            raise socket.gaierror("no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr("socket.getaddrinfo", resolve)
    monkeypatch.setitem(registries.REGISTRIES, "pypi", ("pypi.org",))
    assert registries.hosts(["pypi"]) == expected
