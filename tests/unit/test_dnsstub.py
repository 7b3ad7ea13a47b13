"""The DNS stub against a real UDP socket on 127.0.0.1: every query answered REFUSED once it is
reported, what is no query ignored, which lookups are worth telling, and what `run` says."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from sandboxfs.run import dnsstub
from sandboxfs.run.allowlist import Allowlist, parse_allow_host

LOCAL = "127.0.0.1"


def stub_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sandboxfs-netproxy")]


def dns_query(name: str, qtype: int = 1, ident: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".") if p)
    return (
        struct.pack("!6H", ident, 0x0100, 1, 0, 0, 0)
        + labels
        + b"\0"
        + struct.pack("!2H", qtype, 1)
    )


@pytest.fixture
def dns_stub() -> Iterator[tuple[socket.socket, list[dnsstub.Lookup]]]:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((LOCAL, 0))
    seen: list[dnsstub.Lookup] = []
    stub = dnsstub.DnsStub([server], seen.append)
    stub.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(5)
    client.connect(server.getsockname())
    try:
        yield client, seen
    finally:
        client.close()
        stub.close()
        assert server.fileno() == -1
        assert stub_threads() == []


def test_dns_stub_refuses_and_reports(
    dns_stub: tuple[socket.socket, list[dnsstub.Lookup]],
) -> None:
    client, seen = dns_stub
    query = dns_query("PyPI.org.", qtype=28)
    client.send(query)
    answer = client.recv(4096)
    ident, flags, qd, an, ns, ar = struct.unpack_from("!6H", answer)
    assert (ident, flags & 0x8000, flags & 0x0100, flags & 0xF, qd, an, ns, ar) == (
        0x1234,
        0x8000,
        0x0100,
        5,
        1,
        0,
        0,
        0,
    )
    assert answer[12:] == query[12:]  # the question, echoed
    [lookup] = seen
    assert (lookup.name, lookup.qtype, lookup.client[0]) == ("pypi.org", 28, LOCAL)
    assert lookup.notable


def test_dns_stub_ignores_what_is_no_query(
    dns_stub: tuple[socket.socket, list[dnsstub.Lookup]],
) -> None:
    client, seen = dns_stub
    response = bytearray(dns_query("a.test"))
    response[2] |= 0x80
    pointer = dns_query("a.test")[:12] + b"\xc0\x0c" + struct.pack("!2H", 1, 1)
    for data in (b"", b"short", bytes(response), pointer, dns_query("a.test")[:-2]):
        client.send(data)
    client.send(dns_query("after.test"))
    assert struct.unpack_from("!H", client.recv(4096))[0] == 0x1234
    assert [lookup.name for lookup in seen] == ["after.test"]


@pytest.mark.parametrize(
    ("name", "qtype", "notable"),
    [
        ("pypi.org", 1, True),
        ("sandboxfs", 1, False),  # the sandbox's own host name: tools look it up for an FQDN
        ("1.0.0.127.in-addr.arpa", 12, False),
        ("example.com", 12, False),
    ],
)
def test_which_lookups_are_told(name: str, qtype: int, notable: bool) -> None:
    assert dnsstub.Lookup(name, qtype, (LOCAL, 1)).notable is notable


def test_lookup_messages() -> None:
    assert dnsstub.lookup_refusal("pypi.org", None) == (
        "the network is off (--net none): pypi.org was not looked up; to let the program "
        "reach it: --net allow --allow-host pypi.org"
    )
    allow = Allowlist([parse_allow_host("pypi.org")])
    admitted = dnsstub.lookup_refusal("pypi.org", allow)
    assert admitted == (
        "pypi.org was looked up inside the sandbox, which has no DNS (--net allow): programs "
        "reach hosts through the proxy, HTTPS_PROXY=http://127.0.0.1:3128, which resolves "
        "names itself"
    )
    assert dnsstub.lookup_refusal("files.pythonhosted.org", allow).endswith(
        "; files.pythonhosted.org is not allowed either: --allow-host files.pythonhosted.org"
    )
    assert "\\x1b" in dnsstub.lookup_refusal("a\x1b.test", None)
