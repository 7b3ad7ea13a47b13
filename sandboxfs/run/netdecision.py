"""What the network side of `sandboxfs run` decided, and what of it `run` prints.

`NetDecision` is the proxy's verdict on one request, which the caller audits before the client
learns it; `Notices` puts each refusal (the proxy's and the DNS stub's) once on `run`'s stderr;
`printable` keeps what a program inside chose to send (a host name, a looked-up name) from
reaching the user's terminal as control sequences. Its own module so that the audit and the
report need none of the proxy's sockets and threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from sandboxfs.run.allowlist import with_port

NOTICE_LIMIT = 20  # refused hosts that `run` names on its stderr; the audit has every one


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
        return printable(with_port(self.host, self.port))

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
