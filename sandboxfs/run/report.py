"""What a run says of itself: its own audit entries (`run` start and end, `net`), the line it
prints once the program starts, and the summary once it ended (read back from the audit)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sandboxfs.audit import reader as audit_reader
from sandboxfs.audit.writer import AuditLog
from sandboxfs.core.entry import UNSET, AuditOp, Unset, audit_entry
from sandboxfs.core.policy import Op, Policy, Zone
from sandboxfs.layout import audit_path
from sandboxfs.run import confine
from sandboxfs.run.allowlist import rule_text
from sandboxfs.run.netdecision import printable
from sandboxfs.run.request import RunRequest, exit_status


class RunAudit:
    """The supervisor's own entries (`run` start and end, `net`), safe from proxy threads."""

    def __init__(self, req: RunRequest) -> None:
        self._log = AuditLog(
            audit_path(req.project), sync=req.audit_sync, rotate=req.config.audit.rotate_bytes
        )
        self._lock = threading.Lock()
        self._req = req
        self._uid = os.getuid()
        self._worker = req.config.worker.name if req.config.worker is not None else None

    def record(
        self,
        op: AuditOp,
        *,
        pid: int | None,
        comm: str | None,
        detail: str,
        allowed: bool | None = True,
        reason: str | Unset | None = UNSET,
        err: str | Unset | None = UNSET,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """An entry of this run (no path, no zone); `reason` and `errno` only where given."""
        entry = audit_entry(
            op,
            allowed,
            path=None,
            zone=None,
            session=self._req.session,
            workspace=self._req.workspace,
            trust=self._req.trust.value,
            worker=self._worker,
            reason=reason,
            err=err,
            pid=pid,
            uid=self._uid,
            comm=comm,
            detail=detail,
            extra=extra,
        )
        with self._lock:
            self._log.record(entry)
            if not self._log.try_flush():
                raise OSError(errno.EIO, "the audit log cannot be written")

    def close(self) -> None:
        with self._lock:
            self._log.close()


# ----- what run prints: the line at the start, the summary at the end -----------------------------


FIXES_SHOWN = 50  # hosts the closing line's flags admit at most (the audit has every one)


def start_line(req: RunRequest, policy: Policy, cwd: str) -> str:
    """The one line `run` prints once the program starts (not with --quiet; `Hold.line` puts
    "sandboxfs: " before it): who, where, what the program may see and change, its network."""
    groups: dict[str, list[str]] = {"writable": [], "read-only": [], "new files only": []}
    hidden: list[str] = []
    for zone in policy.zones:
        access = policy.access(zone)
        if access.create_only:
            groups["new files only"].append(zone.value)
        elif Op.WRITE in access.ops:
            groups["writable"].append(zone.value)
        elif Op.READ in access.ops or Op.LIST in access.ops:
            groups["read-only"].append(zone.value)
        else:
            hidden.append(zone.value)
    repo = policy.access(Zone.REPO) if Zone.REPO in policy.zones else None
    worker = f", worker {req.config.worker.name}" if req.config.worker is not None else ""
    if repo is None or not (Op.READ in repo.ops or Op.LIST in repo.ops):
        shown = "not visible"
    else:
        shown = "read-write" if Op.WRITE in repo.ops else "read-only"
    parts = [f"{name}: {', '.join(zones)}" for name, zones in groups.items() if zones]
    if hidden:
        parts.append(f"not visible: {', '.join(hidden)}")
    if not policy.zones:
        parts.append("no zones (the worker declared none)")
    if req.net == "allow":
        hosts = ", ".join(rule_text(rule) for rule in req.allow) or "no host yet"
        network = f"allow ({hosts}; through sandboxfs's proxy)"
    elif req.net == "host":
        network = "host (this machine's network)"
    else:
        network = "none"
    return (
        f"session {req.session}, trust {req.trust.value}{worker}: project {req.project} "
        f"at {confine.SANDBOX}/repo ({shown}); {'; '.join(parts)}; network: {network}; "
        f"starts in {cwd}"
    )


def summary(req: RunRequest, started: datetime, status: int, lost: str | None = None) -> str:
    query = audit_reader.AuditQuery(session=req.session, since=started)
    allowed = denied = 0
    staged: set[str] = set()
    refused: dict[str, None] = {}  # hosts and looked-up names, in order, once each
    unreached: dict[str, None] = {}
    fixes: dict[str, None] = {}  # the flags that would admit each host refused
    for entry in audit_reader.query(audit_path(req.project), query):
        if entry.get("op") in (AuditOp.RUN, AuditOp.MOUNT, AuditOp.UNMOUNT):
            continue
        if entry.get("op") == AuditOp.NET and entry.get("allowed") is not True:
            (refused if entry.get("allowed") is False else unreached)[_net_target(entry)] = None
            if isinstance(fix := entry.get("fix"), str) and len(fixes) < FIXES_SHOWN:
                fixes[printable(fix, 300)] = None
        count = entry.get("count", 1)  # entries folded into one (sandboxfs.audit.fold)
        count = count if isinstance(count, int) and not isinstance(count, bool) else 1
        if entry.get("allowed") is False:
            denied += count
            continue
        allowed += count
        if (
            entry.get("zone") == Zone.STAGED.value
            and entry.get("op") == AuditOp.WRITE
            and entry.get("detail") in (None, "create")  # a file's contents, not a mkdir
        ):
            staged.add(str(entry.get("path")))
    ended = f"exit {status}"
    if lost is not None:
        ended += f"; mount lost: the daemon {lost}; run exits {exit_status(status, lost)}"
    network = ""
    if refused or unreached:
        parts = [f"refused {_some(refused)}"] if refused else []
        parts += [f"not reached {_some(unreached)}"] if unreached else []
        network = f"; network: {'; '.join(parts)}"
    summary = (
        f"sandboxfs: session {req.session} ended ({ended}): "
        f"{_count(allowed, 'operation')} allowed, {denied} denied, "
        f"{_count(len(staged), 'file')} staged{network}; "
        f"details: sandboxfs audit --session {req.session}"
    )
    if fixes:  # one line that admits every host refused, rather than one more run per host
        given = {f"--allow-host {rule_text(rule)}": None for rule in req.allow}
        summary += (
            "\nsandboxfs: to allow every host refused as well, run again with: --net allow "
            + " ".join({**given, **fixes})
        )
    return summary


def _net_target(entry: dict[str, Any]) -> str:
    """A `net` entry's host as the summary names it: `host:port`, or `name (lookup)`."""
    host = printable(str(entry.get("host")), 255)
    port = entry.get("port")
    if port is None:
        return f"{host} (lookup)"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _some(names: dict[str, None], shown: int = 5) -> str:
    listed = ", ".join(list(names)[:shown])
    return listed if len(names) <= shown else f"{listed} and {len(names) - shown} more"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
