"""Named sets of hosts for `sandboxfs run --allow NAME`: the package registries agents use.

Installing from a registry takes more than one host (pypi.org serves the index,
files.pythonhosted.org the files), and on a machine whose resolver points a registry's names at
a mirror on a private address the proxy refuses each address until it is listed as NAME=ADDRESS
(an allowed name alone never reaches a non-global address). `--allow pypi` takes every host of
the set and, for each name that resolves here to addresses outside the globally routable ones,
pins it to those addresses - never to a loopback, link-local (cloud metadata), multicast or
unspecified one, which no registry mirror needs.
"""

from __future__ import annotations

import ipaddress
import socket

REGISTRIES: dict[str, tuple[str, ...]] = {
    "pypi": ("pypi.org", "files.pythonhosted.org"),
    "npm": ("registry.npmjs.org",),
    "github": ("github.com", "codeload.github.com", "objects.githubusercontent.com"),
}
PINNED_AT_MOST = 4  # addresses a name is pinned to


def registry_of(host: str) -> str | None:
    """The registry whose set holds `host`, if one does."""
    return next((name for name, hosts in REGISTRIES.items() if host in hosts), None)


def hosts(names: list[str]) -> list[str]:
    """The `--allow-host` values for the named registries, as this machine resolves them."""
    values: list[str] = []
    for name in dict.fromkeys(names):
        for host in REGISTRIES[name]:
            values += _as_resolved(host)
    return list(dict.fromkeys(values))


def _as_resolved(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return [host]  # not resolvable here: the proxy says so when the program tries
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    local = [a for a in addresses if not a.is_global]
    if not local:
        return [host]
    pinned = [
        a
        for a in local
        if not (a.is_loopback or a.is_link_local or a.is_multicast or a.is_unspecified)
    ][:PINNED_AT_MOST]
    return [f"{host}={a}" for a in pinned] or [host]
