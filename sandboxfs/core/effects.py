"""What an operation leaves behind besides its backing call: its audit entries, the quota it
charges and gives back, and the user's consent it asks for.

The gate runs each operation's rule list with one `Effects`; a permission probe runs the same
lists with `NoEffects`, which records, charges and asks nothing, so a probe cannot drift from
the operation it answers for. Fail-closed (nothing audited happens while the audit log cannot
be written) lives here once, for both front ends.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .approval_rules import Kind
from .consent import Consent
from .entry import AuditOp
from .errors import Refusal, SandboxError
from .limits import Tally
from .policy import Op, Zone

if TYPE_CHECKING:
    from .inodes import Node
    from .rulebase import Caller, RuleBase

FAIL_CLOSED = "the audit log cannot be written: refused until it can (fail closed)"


class AuditSink(Protocol):
    """Where audit entries go (sandboxfs.audit.writer.AuditLog, the API's memory sink)."""

    @property
    def failing(self) -> bool: ...
    def record(self, entry: dict[str, Any]) -> None: ...
    def try_flush(self) -> bool: ...


class _NullSink:
    """The audit log of a probe: nothing is recorded."""

    failing = False

    def record(self, entry: dict[str, Any]) -> None:
        pass

    def try_flush(self) -> bool:
        return True


class Effects:
    """The audit log, the quota tallies and the approvals of one mount or sandbox."""

    effect = True

    def __init__(
        self, guard: RuleBase, audit: AuditSink, tallies: Mapping[Zone, Tally] | None = None
    ) -> None:
        self.guard = guard  # builds the entries: who asked, under which session and level
        self.audit = audit
        self.tallies = dict(tallies or {})
        # Approvals (core/consent.py): its broker is set by make_guard, its approver by the API.
        self.consent = Consent(
            self.record,
            guard.refuse,
            lambda: guard.policy.trust.value,
            guard.process_names.get,
            guard.recheck,
            lambda: guard.policy.git_dirs,
            guard.process_names.process,
        )

    def close(self) -> None:
        for tally in self.tallies.values():
            tally.close()

    # ----- audit entries ---------------------------------------------------------------------

    def record(self, op: AuditOp | Op, path: str | None, zone: Zone | None, **fields: Any) -> None:
        """An entry (fields: those of Guard.entry: pid, uid, allowed, reason, err, ...)."""
        self.audit.record(self.guard.entry(op, path, zone, **fields))

    def did(
        self,
        caller: Caller,
        op: AuditOp | Op,
        node: Node,
        *,
        path: str | None = None,
        **fields: Any,
    ) -> None:
        """An allowed operation on node (at `path`, if its name changed since)."""
        where = path if path is not None else node.vpath()
        self.record(op, where, node.zone, pid=caller.pid, uid=caller.uid, **fields)

    def refused(self, refusal: Refusal) -> None:
        """Audit a rule's refusal, once, before its errno leaves the gate."""
        if refusal.recorded:
            return
        refusal.recorded = True
        self.record(
            refusal.op,
            refusal.path,
            refusal.zone,
            pid=refusal.pid,
            uid=refusal.uid,
            allowed=refusal.allowed,
            reason=refusal.reason,
            err=refusal.errno,
            dest=refusal.dest,
        )

    def internal_error(self, callback: str, exc: BaseException) -> None:
        self.record(
            AuditOp.ERROR,
            None,
            None,
            pid=0,
            uid=0,
            allowed=False,
            reason=f"internal error in {callback}: {type(exc).__name__}: {exc}",
            err=errno.EIO,
        )

    def fail_closed(self, op: AuditOp | Op, path: str | None, *, pid: int, uid: int) -> None:
        """While the audit log cannot be written, nothing that would be audited happens: the
        one fail-closed rule of both front ends. The refusal is recorded (it waits in memory
        with the log's other refusals, counted at a constant cost) and raised as ENOSPC."""
        audit = self.audit
        if audit.failing and not audit.try_flush():
            self.record(
                op, path, None, pid=pid, uid=uid, allowed=False, reason=FAIL_CLOSED,
                err=errno.ENOSPC,
            )  # fmt: skip
            raise SandboxError(errno.ENOSPC, FAIL_CLOSED)

    # ----- quota -----------------------------------------------------------------------------

    def charges(self, zone: Zone) -> bool:
        """Whether the zone has a quota to charge (callers skip building a virtual path)."""
        return zone in self.tallies

    def charge(self, caller: Caller, zone: Zone, path: str, nbytes: int, nfiles: int) -> None:
        """Charge the zone's quota for `nbytes` more bytes and `nfiles` more entries; refused
        (a Refusal, audited by the gate) when the quota has no room."""
        tally = self.tallies.get(zone)
        if tally is None or not (nbytes or nfiles):
            return
        refused = tally.charge(nbytes, nfiles, path)
        if refused is not None:
            raise self.guard.refuse(caller, Op.WRITE, path, zone, refused)

    def credit(self, zone: Zone | None, nbytes: int, nfiles: int) -> None:
        """Give back to the zone's quota what a failed change or a removal no longer uses."""
        tally = self.tallies.get(zone) if zone is not None else None
        if tally is not None:
            tally.credit(nbytes, nfiles)

    # ----- the user's consent ----------------------------------------------------------------

    @property
    def asks(self) -> bool:
        """Whether any approval rule exists (callers skip building a virtual path otherwise)."""
        return self.consent.active

    def approve(
        self,
        caller: Caller,
        kinds: list[Kind],
        zone: Zone,
        path: str,
        op: AuditOp | Op,
        dest: str | None = None,
        *,
        exclusions: bool = True,
    ) -> None:
        """The approval rules, for an operation every other rule allowed (Consent.check)."""
        if self.consent.active:
            self.consent.check(caller, kinds, zone, path, op, dest, exclusions=exclusions)


class NoEffects(Effects):
    """A probe's effects: the same rules and grants, nothing recorded, charged or asked."""

    effect = False

    def __init__(self, effects: Effects) -> None:
        self.guard = effects.guard
        self.audit = _NullSink()
        self.tallies = {}
        self.consent = effects.consent.probe(effects.guard.refuse)

    def close(self) -> None:
        pass
