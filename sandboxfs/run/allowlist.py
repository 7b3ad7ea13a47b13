"""The `--allow-host` rules of `sandboxfs run --net allow`: parsed, matched, and which addresses
they let a connection reach.

Parsing refuses anything ambiguous rather than guessing, and normalizes each rule so that matching
is plain comparison. A rule without a port admits the web ports only. An allowed name reaches only
globally routable addresses unless a rule lists the address exactly (an IP literal, or
`NAME=ADDRESS`): `address_class` says why any other address is refused, and `address_refusal`
which flag would admit it. Its own module: the proxy (sandboxfs.run.netproxy), the DNS stub
(sandboxfs.run.dnsstub) and the run's report share it, and none of it touches a socket.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WEB_PORTS = (80, 443)  # what a rule without a port admits
_EXPECTED = "expected HOST, HOST:PORT, *.DOMAIN[:PORT], IP[:PORT], [IPv6]:PORT or HOST[:PORT]=IP"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_ULA = ipaddress.IPv6Network("fc00::/7")
_RFC1918 = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)
_METADATA = (ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"))


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
        port = parse_port(port_text)
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
        if ip_literal(host) is None or ":" not in host:
            raise bad("only an IPv6 address goes in brackets")
        return host, port_text
    if text.count(":") == 1:
        host, port_text = text.split(":")
        return host, port_text
    return text, None


def _host_rule(host: str, port: int | None, bad: Callable[[str], AllowHostError]) -> HostRule:
    """The rule for an IP literal, a `*.DOMAIN` wildcard or a host name, checked."""
    address = ip_literal(host)
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
    address = ip_literal(right[1:-1] if right.startswith("[") and right.endswith("]") else right)
    if address is None:
        raise bad(f"after '=' give the IP address the name resolves to, not {right!r}")
    try:
        rule = parse_allow_host(left)
    except AllowHostError:
        raise bad(f"{left!r} before '=' is not a HOST[:PORT]") from None
    if ip_literal(rule.host) is not None:
        raise bad("'=ADDRESS' follows a host name; an address alone is listed as IP[:PORT]")
    if rule.host.startswith("*."):
        raise bad("a wildcard cannot be pinned to an address; name the host")
    return HostRule(rule.host, rule.port, str(address))


def rule_text(rule: HostRule) -> str:
    """A rule as `--allow-host` takes it (and as messages and the audit show it)."""
    text = with_port(rule.host, rule.port)
    return text if rule.address is None else f"{text}={rule.address}"


def parse_port(text: str) -> int | None:
    if not _PORT.fullmatch(text):
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def ip_literal(text: str) -> IPAddress | None:
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
    address = ip_literal(text)
    return str(address) if address is not None else _normalize_name(text)


def with_port(host: str, port: int | None) -> str:
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
        address = ip_literal(canonical)
        for rule in self.rules:
            if not _port_matches(rule.port, port):
                continue
            if address is not None:
                if ip_literal(rule.host) == address:
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
        address = ip_literal(ip.split("%", 1)[0])
        if address is None:
            return False
        try:
            name = None if host is None else canonical_host(host)
        except ValueError:
            name = None
        for rule in self.rules:
            if not _port_matches(rule.port, port):
                continue
            if ip_literal(rule.host) == address:
                return True
            if (
                rule.address is not None
                and rule.host == name
                and ip_literal(rule.address) == address
            ):
                return True
        return False

    def describe(self, limit: int = 20) -> str:
        """The rules as a user would type them, for messages."""
        shown = [rule_text(rule) for rule in self.rules[:limit]]
        if len(self.rules) > limit:
            shown.append(f"... ({len(self.rules) - limit} more)")
        return ", ".join(shown) or "(none)"


def address_class(address: IPAddress) -> str | None:
    """Why a connection to `address` is refused by default, or None when it is global."""
    if isinstance(address, ipaddress.IPv6Address) and address in _NAT64:
        # DNS64 gives v4-only hosts these addresses; judge the IPv4 address inside.
        embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        inner = address_class(embedded)
        return None if inner is None else f"NAT64 of {embedded}, {inner}"
    kind = _scope_class(address) or _network_class(address)
    if kind is not None:
        return kind
    if address.is_reserved:
        return "reserved"
    if address.is_private or not address.is_global:
        return "special-purpose, not globally routable"
    return None


def _scope_class(address: IPAddress) -> str | None:
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


def _network_class(address: IPAddress) -> str | None:
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


def address_refusal(host: str, port: int, refused: list[tuple[IPAddress, str]]) -> tuple[str, str]:
    """Why a host whose addresses are all non-global is refused, and the one flag that admits
    it: `NAME=ADDRESS` for a name (the first address it resolved to is enough: the proxy tries
    the listed ones), the address itself for an IP literal."""
    rule_port = None if port in WEB_PORTS else port
    first = refused[0][0]
    if ip_literal(host) == first:
        cause = f"{first} is a {refused[0][1]} address, which is refused unless listed exactly"
        return cause, f"--allow-host {with_port(str(first), rule_port)}"
    listed = ", ".join(f"{address} ({kind})" for address, kind in refused)
    verb = "is" if len(refused) == 1 else "are"
    cause = f"{host} resolves to {listed}, which {verb} refused unless listed exactly"
    return cause, f"--allow-host {with_port(host, rule_port)}={first}"
