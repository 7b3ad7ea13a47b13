"""What every operation of the gate (sandboxfs.core.gate) shares: its storage, guard and
effects, the approval step and `_decide` every rule list ends with, the quota, resolving
names, and the audit of every refusal as it leaves a public method (`audited`)."""

from __future__ import annotations

import functools
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

from .approval_rules import Kind
from .effects import Effects, NoEffects
from .entry import AuditOp
from .errors import Refusal, SandboxError
from .guard import Guard
from .inodes import Node, StatLike
from .policy import Decision, Op, Rule, Zone
from .rulebase import Caller
from .store import HiddenEntry

T = TypeVar("T")

# Set-user-ID and set-group-ID bits never reach a backing file: a confined program (root,
# maybe) must not leave a set-id executable for someone outside to run.
SUID_SGID = stat.S_ISUID | stat.S_ISGID
# sandboxfs has no security.* namespace: it never shows or stores labels or file capabilities.
SECURITY_XATTR_PREFIX = b"security."
_WRITABLE_XATTR_PREFIX = b"user."
_ACL_XATTRS = (b"system.posix_acl_access", b"system.posix_acl_default")


class Storage(Protocol):
    """What the gate asks of a front end's storage (core.store.Store, the API's backends)."""

    def find(self, parent: Node, name: bytes) -> tuple[StatLike, int] | None: ...
    def target(self, parent: Node, name: bytes) -> StatLike | None: ...
    def created(self, zone: Zone, st: StatLike) -> bool: ...
    def stat(self, node: Node) -> StatLike: ...


@dataclass(frozen=True, slots=True)
class Request:
    """One operation as `_decide`'s steps see it, once every built-in rule allowed it."""

    op: AuditOp | Op  # as audited: read, write, list, delete, rename, link
    caller: Caller
    path: str
    zone: Zone | None
    dest: str | None = None
    node: Node | None = None  # the existing entry, if there is one


# A rule that joins every operation (worker narrowing, a test's step): returns to allow, or
# raises `gate.refuse(...)` to refuse. Steps run in the order they were added. For a probe
# (`gate.effect` is False) a step answers without asking anyone or changing anything.
Step = Callable[["GateBase", Request], None]


def audited(method: Callable[..., Any]) -> Callable[..., Any]:
    """A gate method whose rules' refusals are audited (Effects.refused) as they leave it."""

    @functools.wraps(method)
    def audited(self: GateBase, /, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Refusal as refusal:
            self.effects.refused(refusal)
            raise

    audited.audits_refusals = True  # type: ignore[attr-defined]
    return audited


class GateBase:
    """What every operation of one mount or sandbox shares.

    `_decide` (the added steps) runs in every operation that reads or changes an entry's
    contents or names: open (and the API's read and replace), readlink, create, make, link,
    remove, rename, setattr, setxattr/removexattr and listing. Lookups and attributes are
    judged by the guard's visibility rules alone, and a write through an open handle was
    decided when the handle was opened (a staged commit under review and a trust change aside).
    """

    def __init__(self, guard: Guard, storage: Storage, effects: Effects | None = None) -> None:
        self.guard = guard
        self.storage = storage
        self.effects = effects if effects is not None else guard.effects
        self.steps: list[Step] = []

    @property
    def effect(self) -> bool:
        """False for a probe: nothing is recorded, charged, asked or changed."""
        return self.effects.effect

    def fail_closed(self, op: AuditOp | Op, path: str | None, *, pid: int, uid: int) -> None:
        """Nothing audited happens while the audit log cannot be written (Effects.fail_closed)."""
        self.effects.fail_closed(op, path, pid=pid, uid=uid)

    def without_effect(self) -> Self:
        """The same gate, run for its answer only (NoEffects): the guard's current policy,
        frozen commits, pinned directories, key scanner and own entries; no audit entry, no
        quota charge, nobody asked. Built per question, so that it follows trust changes."""
        gate = type(self)(self.guard, self.storage, NoEffects(self.effects))
        gate.steps = self.steps
        return gate

    def refusal(
        self, caller: Caller, op: AuditOp | Op, path: str, zone: Zone | None, decision: Decision
    ) -> SandboxError:
        """A front end's own refusal (what only it can see), audited now, for it to raise."""
        refusal = self.guard.refuse(caller, op, path, zone, decision)
        self.effects.refused(refusal)
        return refusal

    # ----- the steps every list ends with ----------------------------------------------------

    def _approve(
        self,
        caller: Caller,
        kinds: list[Kind],
        zone: Zone,
        path: Callable[[], str],
        op: AuditOp | Op,
        dest: str | None = None,
        *,
        exclusions: bool = True,
    ) -> None:
        """The approval step: the user's consent (sandboxfs.core.consent), asked only once
        every rule of the operation allowed it. `path` is built only where a rule exists (a
        virtual path costs a walk up the tree)."""
        if kinds and self.effects.asks:
            self.effects.approve(caller, kinds, zone, path(), op, dest, exclusions=exclusions)

    def _decide(self, request: Callable[[], Request]) -> None:
        """After the rules and the approval step of an operation and before anything is
        charged or changed: each added step (see `Step`), for the probe alike. `request`
        builds the operation's Request only when a step is there to read it."""
        if self.steps:
            built = request()
            for step in self.steps:
                step(self, built)

    def refuse(
        self, request: Request, err: int, reason: str, rule: Rule = Rule.MATRIX
    ) -> SandboxError:
        """A step's refusal, for the step to raise (audited as it leaves the gate)."""
        decision = Decision(False, err, reason, rule)
        return self.guard.refuse(
            request.caller, request.op, request.path, request.zone, decision, request.dest
        )

    # ----- limits ----------------------------------------------------------------------------

    def _resize(self, caller: Caller, node: Node, old_size: int, new_size: int) -> None:
        """A write or truncate from old_size to new_size bytes: within max_file_bytes, and
        charged to the zone's quota (`_refund` gives back)."""
        zone = node.zone
        assert zone is not None
        self.guard.check_size(caller, node, old_size, new_size)
        if new_size != old_size and self.effects.charges(zone):
            self.effects.charge(caller, zone, node.vpath(), new_size - old_size, 0)

    def _refund(self, zone: Zone | None, nbytes: int, nfiles: int) -> None:
        self.effects.credit(zone, nbytes, nfiles)

    def _removed(self, zone: Zone, st: StatLike) -> None:
        """A name was unlinked or replaced: its inode's bytes and entry leave the quota when
        it was the last name, and this mount forgets it made it."""
        if stat.S_ISDIR(st.st_mode):
            self._refund(zone, 0, 1)
        elif st.st_nlink <= 1:
            self._refund(zone, st.st_size if stat.S_ISREG(st.st_mode) else 0, 1)
        self.guard.forget(zone, st)

    # ----- resolving names -------------------------------------------------------------------

    def find(
        self, caller: Caller, op: Op, parent: Node, name: bytes
    ) -> tuple[StatLike, int] | None:
        """storage.find, with an entry that is never part of a zone (sandboxfs's state, another
        mount) refused as absent to a reader and as EACCES to a writer, audited as `op`."""
        try:
            return self.storage.find(parent, name)
        except HiddenEntry as exc:
            raise self.guard.hidden(caller, op, parent, name, exc.reason) from None

    def lookup(self, caller: Caller, parent: Node, name: bytes) -> tuple[StatLike, int] | None:
        """LOOKUP of parent/name (inside a zone): its lstat and workers layer, None when absent
        or refused as absent (see Guard.visible: the answer does not tell which). A creation
        after a refused lookup reaches its own operation and is refused there as `write`."""
        zone = parent.zone
        assert zone is not None
        found = self.find(caller, Op.READ, parent, name)
        st, layer = found if found is not None else (None, 0)
        created = st is not None and self.storage.created(zone, st)
        if not self.guard.visible(caller, parent, name, st, created) or st is None:
            return None
        return st, layer

    def getattr(self, caller: Caller, node: Node) -> None:
        """Attributes of a known entry: after a trust change, only what the level may resolve."""
        if self.guard.generation:
            self.guard.may_stat(caller, node)

    def _made_here(self, zone: Zone, st: StatLike | None) -> bool:
        """Whether this mount created the entry `st` describes (not the user's: no approval
        rule asks about changing it); only asked where approval rules exist."""
        return st is not None and self.effects.asks and self.storage.created(zone, st)

    def _shared(self, node: Node) -> bool:
        """Whether a file's contents are also another name's (approval rules' exclusions do
        not apply to it); only asked where approval rules exist."""
        return self.effects.asks and self.storage.stat(node).st_nlink > 1
