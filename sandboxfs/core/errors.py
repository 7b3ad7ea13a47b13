"""The error every refused or failed filesystem operation raises inside the core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .policy import Rule

if TYPE_CHECKING:
    from .entry import AuditOp
    from .policy import Op, Zone


class SandboxError(Exception):
    """An operation refused by policy or failed in the store, with its errno and reason.

    The FUSE adapter turns it into `FUSEError` in one place; the Python API into one of its
    typed exceptions (sandboxfs.api.errors).
    """

    def __init__(self, errno: int, reason: str = "", rule: Rule = Rule.MATRIX) -> None:
        super().__init__(errno, reason)
        self.errno = errno
        self.reason = reason
        self.rule = rule  # see Decision.rule


class Refusal(SandboxError):
    """A rule's refusal on its way out of the gate, which audits it (Effects.refused) before
    its errno reaches the front end. `allowed` is False for a policy refusal and None for an
    answer that is not one (EXDEV across zones: `mv` copies instead)."""

    def __init__(
        self,
        errno: int,
        reason: str,
        rule: Rule,
        *,
        op: AuditOp | Op,
        path: str,
        zone: Zone | None,
        dest: str | None,
        pid: int,
        uid: int,
        allowed: bool | None = False,
    ) -> None:
        super().__init__(errno, reason, rule)
        self.op = op
        self.path = path
        self.zone = zone
        self.dest = dest
        self.pid = pid
        self.uid = uid
        self.allowed = allowed
        self.recorded = False  # set once audited (or, by a probe, once answered)
