"""What every family of the guard's rules shares (sandboxfs.core.guard): the policy at its
trust level, the caller and mount an entry names, the refusal a rule raises, the matrix, and
the entries this mount created."""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from .effects import AuditSink, Effects
from .entry import AuditOp, audit_entry, errno_name
from .errors import Refusal
from .inodes import FIRST_DYNAMIC_INO, Node, StatLike
from .limits import Tally, ZoneLimits
from .policy import Decision, Op, Policy, Trust, Zone, cross_zone_reason
from .procnames import ProcessNames

# What a front end gives Guard.reject_move to judge a rename onto git's config or index by content:
# the bytes of parent/name (at most the limit given), or None (see Guard.judge_config).
ReadFile = Callable[[Node, bytes, tuple[int, int] | None, int], bytes | None]


class Caller(Protocol):
    """Who asks: pyfuse3's RequestContext, or the API's own."""

    @property
    def pid(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MountInfo:
    """Who this mount or sandbox is for; copied into every audit entry and context.json."""

    session: str
    workspace: str
    project: str
    mountpoint: str
    command: tuple[str, ...] | None = None  # what `sandboxfs run` started on this mount
    via: str | None = None  # "api" for the Python API; absent for the mount
    control: str | None = None  # the mount's control socket (see sandboxfs.project.control)
    worker: str | None = None  # whose declaration narrowed it (sandboxfs.project.workers)


class RuleBase:
    """The policy of one mount or sandbox and what every family of rules shares: the trust
    level, the refusals and the entries they are audited as, the matrix, and what this mount
    created."""

    def __init__(
        self,
        policy: Policy,
        audit: AuditSink,
        info: MountInfo,
        *,
        moves: Callable[[], int] = lambda: 0,
        limits: Mapping[Zone, ZoneLimits] | None = None,
        tallies: Mapping[Zone, Tally] | None = None,
        frozen: Callable[[str], bool] | None = None,
    ) -> None:
        self.policy = policy
        self.info = info
        self.limits = dict(limits or {})
        self.process_names = ProcessNames()
        self._moves = moves
        # Whether the staged commit of that name is under review (frozen: see sandboxfs.staging).
        self._frozen = frozen
        # Counts trust changes: what was allowed under an older level is checked again.
        self.generation = 0
        # Entries this mount created in a zone that is create-only at some level (`/staged`):
        # (zone, backing inode number) -> (device, birth time or 0). At a create-only level the
        # caller may read, list and resolve these, and only these (see `owns`), so an agent
        # can check what it staged; other parties' entries stay absent. Shared with the API's
        # probe guard. Kept for the life of the mount, whatever the level meanwhile.
        self.own_entries: dict[tuple[Zone, int], tuple[int, int]] = {}
        self._own_zones = frozenset(
            zone
            for levels in policy.matrix.values()
            for zone, access in levels.items()
            if access.create_only
        )
        # What this guard's operations leave behind: audit entries, quota, the user's consent.
        self.effects = Effects(self, audit, tallies)

    def recheck(self) -> None:
        """What an open handle was allowed is to be checked again at its next use."""
        self.generation += 1

    def set_trust(self, trust: Trust) -> Trust:
        """Switch to another trust level (live promotion or demotion); returns the old one.
        Takes effect for the next check: the policy is rebuilt for the new level."""
        old = self.policy
        self.policy = old.with_trust(trust)
        self.generation += 1
        return old.trust

    def close(self) -> None:
        self.process_names.close()
        self.effects.close()

    # ----- refusals and the entries they are audited as -------------------------------------

    def entry(
        self,
        op: AuditOp | Op,
        path: str | None,
        zone: Zone | None,
        *,
        pid: int,
        uid: int,
        comm: str | None = None,
        allowed: bool | None = True,
        reason: str | None = None,
        err: int | None = None,
        dest: str | None = None,
        nbytes: int | None = None,
        detail: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """An audit entry of this mount or sandbox (`extra`: fields of its own op), built by
        sandboxfs.core.entry.audit_entry with who it is for and who asked. Recording it is an
        effect (sandboxfs.core.effects)."""
        return audit_entry(
            op,
            allowed,
            path=path,
            dest=dest,
            zone=zone.value if zone else None,
            session=self.info.session,
            workspace=self.info.workspace,
            trust=self.policy.trust.value,
            worker=self.info.worker or None,
            reason=reason,
            err=errno_name(err),
            pid=pid,
            uid=uid,
            comm=comm if comm is not None else self.process_names.get(pid),
            nbytes=nbytes,
            via=self.info.via or None,
            detail=detail,
            extra=extra,
        )

    def refuse(
        self,
        caller: Caller,
        op: AuditOp | Op,
        path: str,
        zone: Zone | None,
        decision: Decision,
        dest: str | None = None,
    ) -> Refusal:
        """A denial, for the rule to raise: the gate audits it on its way out (Effects.refused),
        before the errno reaches the front end."""
        return Refusal(
            decision.errno,
            decision.reason,
            decision.rule,
            op=op,
            path=path,
            zone=zone,
            dest=dest,
            pid=caller.pid,
            uid=caller.uid,
        )

    def cross_zone(
        self,
        op: AuditOp,
        caller: Caller,
        src: str,
        dst: str,
        zone: Zone | None,
        to: Zone | None,
    ) -> NoReturn:
        """EXDEV for a rename or link across zones. Not a policy refusal (`mv` then copies
        and deletes, each checked on its own), so it is recorded without `allowed: false`."""
        what = "renames" if op is AuditOp.RENAME else "hard links"
        reason = cross_zone_reason(what, zone, to)
        refusal = self.refuse(caller, op, src, zone, Decision(False, errno.EXDEV, reason), dst)
        refusal.allowed = None
        raise refusal

    # ----- the matrix -----------------------------------------------------------------------------

    def check(self, caller: Caller, op: Op, node: Node, child: bytes | None = None) -> None:
        assert node.zone is not None
        decision = self.policy.decide(node.zone, op)
        if not decision.allowed:
            raise self.refuse(caller, op, node.vpath(child), node.zone, decision)

    def readable(self, zone: Zone) -> bool:
        ops = self.policy.access(zone).ops
        return Op.READ in ops or Op.LIST in ops

    def create_only(self, zone: Zone) -> bool:
        return self.policy.access(zone).create_only

    # ----- what this mount created (create-only zones) ----------------------------------------

    def created(self, zone: Zone, st: StatLike) -> None:
        """A front end made parent/name (st: its lstat): remembered where it matters."""
        if zone in self._own_zones:
            birth = getattr(st, "st_birthtime_ns", 0) or 0
            self.own_entries[(zone, st.st_ino)] = (st.st_dev, birth)

    def owns(self, zone: Zone, st: StatLike) -> bool:
        """Whether this mount created the entry st describes (the same inode, device and,
        where the filesystem keeps one, birth time: a reused inode number is another file)."""
        known = self.own_entries.get((zone, st.st_ino))
        if known is None or known[0] != st.st_dev:
            return False
        birth = getattr(st, "st_birthtime_ns", 0) or 0
        return not (birth and known[1] and birth != known[1])

    def owns_node(self, node: Node) -> bool:
        if node.created_here:
            return True
        zone = node.zone
        if zone is None or node.ino < FIRST_DYNAMIC_INO:
            return False
        ino = node.key[2] if node.key is not None else node.ino
        dev = node.key[1] if node.key is not None else 0
        known = self.own_entries.get((zone, ino))
        if known is None or known[0] != dev:
            return False
        return not (node.birth_ns and known[1] and node.birth_ns != known[1])

    def reads_own(self, zone: Zone) -> bool:
        """Whether the level may read and list only what this mount created in `zone`
        (create-only there)."""
        access = self.policy.access(zone)
        return access.create_only and Op.READ not in access.ops

    def own_readable(self, node: Node) -> bool:
        """An entry this mount created in a zone that is create-only at this level: readable,
        and (a directory) listable, showing only what this mount created in it. The zone root
        stays unlisted: the caller knows the ids it made."""
        zone = node.zone
        if zone is None or node.ino < FIRST_DYNAMIC_INO or not self.reads_own(zone):
            return False
        return self.owns_node(node)

    def check_list(self, caller: Caller, node: Node) -> None:
        """Listing `node` (a zone's directory): the matrix, or at a create-only level a
        directory this mount created."""
        if not self.own_readable(node):
            self.check(caller, Op.LIST, node)

    def cacheable(self, zone: Zone) -> bool:
        """Whether file contents may be handed to the kernel's cache (someone may read them)."""
        return self.policy.decide(zone, Op.READ).allowed


def _absent(decision: Decision) -> Decision:
    """A refusal answered as ENOENT: the name looks absent to the caller."""
    return Decision(False, errno.ENOENT, decision.reason)


def relpath_of(parent: Node, name: bytes) -> str:
    """parent/name relative to its zone root, as text for pattern matching."""
    rel = parent.relpath()
    return (rel + b"/" + name if rel else name).decode("utf-8", "surrogateescape")
