"""The DNS stub: the one nameserver a sandbox has (`sandboxfs run --net none` and `allow`).

The sandbox's /etc/resolv.conf names it. It answers every query REFUSED, resolving nothing, and
reports the name so that `run` can say that the network is off, or that names go through the
proxy (sandboxfs.run.netproxy). Its own module: it shares only the allowlist and the printing of
names with the proxy, and serves with `--net none` too, where there is no proxy.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sandboxfs.run.allowlist import WEB_PORTS, Allowlist, canonical_host
from sandboxfs.run.confine import PROXY_ADDRESS
from sandboxfs.run.netdecision import printable
from sandboxfs.run.netproxy import THREAD_PREFIX

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lookup:
    """One DNS query a program inside sent to the stub."""

    name: str  # lowercase, without the trailing dot; as sent (not necessarily a valid name)
    qtype: int  # 1 A, 28 AAAA, 12 PTR...
    client: tuple[str, int]  # the querying socket's address inside the sandbox

    @property
    def notable(self) -> bool:
        """A host on a network, worth telling the user about: not a reverse lookup and not a
        single label (the sandbox's own host name, which tools look up to find their FQDN)."""
        return self.qtype != _PTR and "." in self.name and not self.name.endswith(".arpa")


def lookup_refusal(name: str, allowlist: Allowlist | None) -> str:
    """Why a lookup inside got no answer, and what to do: `allowlist` None is `--net none`."""
    shown = printable(name, 255)
    if allowlist is None:
        return (
            f"the network is off (--net none): {shown} was not looked up; to let the program "
            f"reach it: --net allow --allow-host {shown}"
        )
    proxy = "http://{}:{}".format(*PROXY_ADDRESS)
    text = (
        f"{shown} was looked up inside the sandbox, which has no DNS (--net allow): programs "
        f"reach hosts through the proxy, HTTPS_PROXY={proxy}, which resolves names itself"
    )
    try:
        admitted = any(allowlist.admits(name, port) for port in WEB_PORTS) or any(
            rule.host == canonical_host(name) for rule in allowlist.rules
        )
    except ValueError:
        admitted = False
    return text if admitted else f"{text}; {shown} is not allowed either: --allow-host {shown}"


class DnsStub:
    """Answers every DNS query that reaches `sockets` (UDP, bound inside the sandbox where its
    /etc/resolv.conf points) with REFUSED, once `on_lookup` has been told of it: the sandbox
    has no DNS, and this is how `run` learns that a program looked a name up, and says so.

    Nothing is ever resolved: a name a program chose must not leave the sandbox as a query."""

    def __init__(self, sockets: Sequence[socket.socket], on_lookup: Callable[[Lookup], None]):
        self._sockets = list(sockets)
        self._on_lookup = on_lookup
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        for sock in self._sockets:
            sock.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name=f"{THREAD_PREFIX}-dns")
        self._thread.daemon = True
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            for sock in (*self._sockets, self._wake_r, self._wake_w):
                sock.close()

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd = {sock.fileno(): sock for sock in self._sockets}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        while True:
            ready = poller.poll()
            if self._closed or any(fd == self._wake_r.fileno() for fd, _ in ready):
                return
            for fd, _ in ready:
                sock = by_fd.get(fd)
                if sock is None:
                    continue
                try:
                    data, peer = sock.recvfrom(4096)
                except OSError:
                    continue  # nothing after all, or an ICMP error from an earlier answer
                self._answer(sock, data, peer)

    def _answer(self, sock: socket.socket, data: bytes, peer: tuple[str, int]) -> None:
        query = parse_dns_query(data)
        if query is None:
            return  # not a query a resolver sends: no answer
        ident, flags, question, name, qtype = query
        try:
            self._on_lookup(Lookup(name, qtype, (str(peer[0]), int(peer[1]))))
        except Exception:
            logger.exception("dns stub: reporting a lookup failed")
        with contextlib.suppress(OSError):
            sock.sendto(dns_refused(ident, flags, question), peer)


_PTR = 12
_REFUSED = 5


def parse_dns_query(data: bytes) -> tuple[int, int, bytes, str, int] | None:
    """A standard query with one question: (id, flags, the question's bytes, its name, its
    type); None for anything else (a response, a compressed or truncated question)."""
    if len(data) < 12:
        return None
    ident, flags, questions = struct.unpack_from("!3H", data)
    if flags & 0x8000 or questions != 1:
        return None
    pos, labels, length = 12, [], 0
    while True:
        if pos >= len(data):
            return None
        size = data[pos]
        pos += 1
        if size == 0:
            break
        if size & 0xC0 or pos + size > len(data):
            return None
        labels.append(data[pos : pos + size].decode("latin-1"))
        pos += size
        length += size + 1
        if length > 255:
            return None
    if pos + 4 > len(data):
        return None
    qtype = struct.unpack_from("!H", data, pos)[0]
    name = ".".join(labels).lower()
    return ident, flags, data[12 : pos + 4], name, qtype


def dns_refused(ident: int, flags: int, question: bytes) -> bytes:
    """The answer REFUSED to a query: its id, opcode and recursion-desired bit, its question."""
    return struct.pack("!6H", ident, 0x8000 | (flags & 0x7900) | _REFUSED, 1, 0, 0, 0) + question
