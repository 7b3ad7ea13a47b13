"""A proxy request's header as the proxy reads it: where it ends, what it asks, and the request
rewritten for the origin server.

Only two forms are served: CONNECT HOST:PORT (HTTPS and anything else tunnelled) and an
absolute-form http:// request (plain HTTP); anything else is a `Refusal`, the 400 to answer.
Pure functions of bytes, kept apart from the proxy's sockets and threads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandboxfs.run.allowlist import parse_port

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(r"HTTP/1\.[0-9]")
_DROPPED_HEADERS = frozenset(
    {"proxy-authorization", "proxy-connection", "connection", "keep-alive", "host"}
)


class Refusal(Exception):
    """An HTTP error response to send (and, with a decision, to report first)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class ProxyRequest:
    method: str
    host: str  # as the client wrote it (brackets removed)
    port: int
    authority: str  # as the client wrote it, for the Host header
    target: str  # origin-form path for plain HTTP; "" for CONNECT
    version: str
    headers: tuple[tuple[str, str], ...]
    rest: bytes  # bytes read after the header (body or tunnel data)


def head_end(buf: bytearray) -> tuple[int, bytes] | None:
    """Where the request header in `buf` ends, and with which blank line; None while it has not.
    Leading empty lines before a request line are allowed (RFC 9112, 2.2): dropped here."""
    while buf.startswith(b"\r\n") or buf.startswith(b"\n"):
        del buf[: 2 if buf.startswith(b"\r\n") else 1]
    ends = [(buf.find(t), t) for t in (b"\r\n\r\n", b"\n\n")]
    found = [(i, t) for i, t in ends if i >= 0]
    return min(found) if found else None


def parse_request(head: bytes, rest: bytes) -> ProxyRequest:
    """Parse a proxy request header: CONNECT authority or an absolute-form http:// URL."""
    lines = [line.removesuffix(b"\r").decode("latin-1") for line in head.split(b"\n")]
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _VERSION.fullmatch(parts[2]):
        raise Refusal("400 Bad Request", "not an HTTP/1.x request line")
    method, target, version = parts
    headers: list[tuple[str, str]] = []
    if any("\r" in line for line in lines):
        raise Refusal("400 Bad Request", "a stray carriage return in the request header")
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise Refusal("400 Bad Request", "a malformed header line")
        headers.append((name, value.strip(" \t")))
    if method == "CONNECT":
        authority, path = target, ""
        default_port = 443
    else:
        scheme, sep, remainder = target.partition("://")
        if not sep or scheme.lower() != "http":
            raise Refusal(
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
        raise Refusal("400 Bad Request", f"not a valid host[:port]: {authority[:100]!r}")
    host, port = parsed
    return ProxyRequest(method, host, port, authority, path, version, tuple(headers), rest)


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
    port = parse_port(port_text)
    return None if port is None else (host, port)


def origin_request(request: ProxyRequest) -> bytes:
    """The request rewritten for the origin server: origin-form target, the client's Host
    replaced by the URL's authority (RFC 9112, 3.2.2), proxy headers dropped, one request."""
    lines = [f"{request.method} {request.target} {request.version}", f"Host: {request.authority}"]
    lines += [f"{n}: {v}" for n, v in request.headers if n.lower() not in _DROPPED_HEADERS]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.rest
