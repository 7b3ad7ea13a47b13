"""(--net none, allow) What serves the sandbox's own network namespace from outside it: the DNS
stub (sandboxfs.run.dnsstub) and, with allow, the proxy (sandboxfs.run.netproxy), each wired to
the run's audit entries, to the lines `run` prints, and to the approvals that may admit a host.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from sandboxfs.core.entry import AuditOp
from sandboxfs.errors import UserError
from sandboxfs.project import control
from sandboxfs.run.allowlist import Allowlist
from sandboxfs.run.dnsstub import DnsStub, Lookup, lookup_refusal
from sandboxfs.run.netdecision import NetDecision, Notices, printable
from sandboxfs.run.netproxy import Proxy
from sandboxfs.run.processes import Child
from sandboxfs.run.report import RunAudit
from sandboxfs.run.request import RunRequest

DNS_LOOKUPS_AUDITED = 1024  # distinct names a run audits as refused lookups; later ones are not


class Network:
    """(--net none, allow) What serves the sandbox's namespace from here: the DNS stub, the
    proxy (allow), and the one line each prints on run's stderr for a host refused, a host not
    reached, or a name looked up, the first time. Printed with --quiet too: it says why the
    program fails. A child that failed before handing its sockets over says why itself."""

    def __init__(
        self,
        req: RunRequest,
        audit: RunAudit,
        child: Child,
        control_path: Path,
        notify: Callable[[str], None],
    ) -> None:
        more = (
            "network: more hosts refused or not reached than shown here; all are in "
            f"'sandboxfs audit --session {req.session} --op net'"
        )
        self.notices = Notices(notify, more)
        self.dns = None if child.dns is None else _start_dns(req, audit, child, self.notices)
        self.proxy = None
        if child.listener is not None:
            self.proxy = _start_proxy(req, audit, child, self.notices, control_path)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.dns is not None:
            self.dns.close()


def _start_proxy(
    req: RunRequest, audit: RunAudit, child: Child, notices: Notices, control_path: Path
) -> Proxy:
    assert child.listener is not None

    def on_decision(decision: NetDecision) -> None:
        pid, comm = connecting_process(child.pid, decision.client[1])
        # Refused by the policy: allowed false (EACCES). Admitted but not completed (no such
        # name, refused or silent upstream): neither allowed nor denied, with its error, which
        # `audit` shows as `failed`. Otherwise allowed.
        allowed = None if decision.failed else decision.allowed
        audit.record(
            AuditOp.NET,
            allowed=allowed,
            pid=pid,
            comm=comm,
            reason=decision.reason,
            err="EACCES" if not decision.allowed else decision.error,
            detail=f"{decision.method} {decision.target()}",
            extra={
                "host": decision.host,
                "port": decision.port,
                "address": decision.address,
                **({"fix": decision.fix} if decision.fix else {}),
            },
        )
        notices.add(decision.target(), decision.notice())

    ask = _host_asker(req, child, control_path) if req.approvals == "ask" else None
    proxy = Proxy(child.listener, Allowlist(req.allow), on_decision, ask=ask)
    proxy.start()
    return proxy


def _host_asker(
    req: RunRequest, child: Child, path: Path
) -> Callable[[str, int, tuple[str, int], Callable[[], bool]], bool]:
    """The proxy's question about a host not on the allowlist, put to the daemon (approvals:
    a `connect` rule that asks): True once the user allowed it, False when refused, when the
    request timed out, when no rule asks, or once the client went away (Ctrl-C, kill). Waits in
    the connection's own thread only."""

    def ask(host: str, port: int, client: tuple[str, int], gone: Callable[[], bool]) -> bool:
        pid, _ = connecting_process(child.pid, client[1])
        first: int | None = None
        while True:
            message = {"op": "connect", "host": f"{host}:{port}", "pid": pid or 0}
            try:
                reply = control.request(path, message, timeout=5.0)
            except UserError:
                return False
            if not reply.get("ok"):
                return False
            if reply.get("allowed") is True:
                return True
            request = reply.get("request")
            if not isinstance(request, int) or first not in (None, request):
                return False  # refused, or its request timed out (another one was made)
            first = request
            time.sleep(0.5)
            if gone():
                return False

    return ask


def _start_dns(req: RunRequest, audit: RunAudit, child: Child, notices: Notices) -> DnsStub:
    """The stub every lookup inside reaches: each name a program looks up (a host, not the
    sandbox's own name or a reverse lookup) is audited as a refused lookup and told once."""
    assert child.dns is not None
    allowlist = Allowlist(req.allow) if req.net == "allow" else None
    seen: set[str] = set()  # the stub answers from one thread

    def on_lookup(lookup: Lookup) -> None:
        if not lookup.notable or lookup.name in seen or len(seen) >= DNS_LOOKUPS_AUDITED:
            return
        seen.add(lookup.name)
        pid, comm = connecting_process(child.pid, lookup.client[1], "udp")
        reason = lookup_refusal(lookup.name, allowlist)
        audit.record(
            AuditOp.NET,
            allowed=False,
            pid=pid,
            comm=comm,
            reason=reason,
            detail=f"lookup {printable(lookup.name, 255)}",
            extra={"host": lookup.name, "port": None, "address": None},
        )
        notices.add(f"lookup {lookup.name}", reason)

    stub = DnsStub([child.dns], on_lookup)
    stub.start()
    return stub


def connecting_process(
    netns_pid: int, port: int, protocol: str = "tcp"
) -> tuple[int | None, str | None]:
    """The process inside that holds the socket (TCP, or UDP) bound at 127.0.0.1:`port`.

    Found from this side: the socket's inode in the sandbox's /proc/net/tcp or udp (read
    through a process in that network namespace), then the process holding it among those
    sharing it. Best effort: a process that closed its socket already is (None, None).
    """
    wanted = f"0100007F:{port:04X}"
    inode = None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{netns_pid}/net/{protocol}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == wanted:
                inode = fields[9]
                break
    if inode is None:
        return None, None
    target = f"socket:[{inode}]"
    try:
        netns = os.readlink(f"/proc/{netns_pid}/ns/net")
    except OSError:
        return None, None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "ns" / "net") != netns:
                continue
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) == target:
                    return int(entry.name), (entry / "comm").read_text().strip()
    return None, None
