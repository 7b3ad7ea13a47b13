"""The guard: every rule of what a trust level may do in each zone, and every audit entry.

Each method takes the caller, what it asks for and where (store nodes: a parent and a name,
or an existing node), and either returns (allowed) or audits the refusal and raises
`SandboxError` with the errno and a reason written for the agent that was refused. Allowed
operations are recorded through `record` once they happened. The gate (sandboxfs.core.gate)
strings these rules together, one order per operation, for the FUSE adapter and the Python API
alike: a rule lives here once, and the order it runs in lives there once.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from . import gitconfig, gitindex
from .approval_rules import Kind
from .consent import Consent
from .entry import AuditOp, audit_entry, errno_name
from .errors import SandboxError
from .inodes import FIRST_DYNAMIC_INO, ROOT_INO, Node, StatLike
from .limits import Tally, ZoneLimits
from .policy import (
    CONTEXT_REASON,
    GIT_ZONES_EXEMPT,
    ZONE_ROOT_REASON,
    Decision,
    Op,
    Policy,
    Rule,
    Trust,
    Zone,
    cross_zone_reason,
    fold,
    git_name,
    git_path,
    git_rule,
    in_git_dir,
)
from .secrets import KeyScanner

_WRITABLE_XATTR_PREFIX = b"user."
_ACL_XATTRS = (b"system.posix_acl_access", b"system.posix_acl_default")
_NO_LIMITS = ZoneLimits()

# What a front end gives Guard.may_move to judge a rename onto git's config or index by content:
# the bytes of parent/name (at most the limit given), or None (see Guard._judge_config).
ReadFile = Callable[[Node, bytes, tuple[int, int] | None, int], bytes | None]


class Caller(Protocol):
    """Who asks: pyfuse3's RequestContext, or the API's own."""

    @property
    def pid(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...


class AuditSink(Protocol):
    """Where entries go (sandboxfs.audit.log.AuditLog)."""

    @property
    def failing(self) -> bool: ...
    def record(self, entry: dict[str, Any]) -> None: ...
    def try_flush(self) -> bool: ...


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


class Guard:
    """The policy of one mount or sandbox, applied to nodes, with its audit entries."""

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
        self.audit = audit
        self.info = info
        self.limits = dict(limits or {})
        self.tallies = dict(tallies or {})
        self.process_names = ProcessNames()
        # Approvals (core/consent.py), the last step of each check: its broker is set by
        # make_guard, its approver by the API.
        self.consent = Consent(
            self.record,
            self.refuse,
            lambda: self.policy.trust.value,
            self.process_names.get,
            self._recheck,
            lambda: self.policy.git_dirs,
            self.process_names.process,
        )
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

    def _recheck(self) -> None:
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
        for tally in self.tallies.values():
            tally.close()

    # ----- audit entries --------------------------------------------------------------------------

    def record(
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
    ) -> None:
        """An entry of this mount or sandbox (`extra`: fields of its own op), built by
        sandboxfs.core.entry.audit_entry with who it is for and who asked."""
        self.audit.record(
            audit_entry(
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
        )

    def did(
        self,
        caller: Caller,
        op: AuditOp | Op,
        node: Node,
        *,
        path: str | None = None,
        dest: str | None = None,
        detail: str | None = None,
        comm: str | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Record an allowed operation on node (at `path`, if its name changed since)."""
        self.record(
            op,
            path if path is not None else node.vpath(),
            node.zone,
            pid=caller.pid,
            uid=caller.uid,
            comm=comm,
            dest=dest,
            nbytes=nbytes,
            detail=detail,
        )

    def refuse(
        self,
        caller: Caller,
        op: AuditOp | Op,
        path: str,
        zone: Zone | None,
        decision: Decision,
        dest: str | None = None,
    ) -> SandboxError:
        """Audit a denial (the entry is written before this returns) and build its error."""
        self.record(
            op,
            path,
            zone,
            pid=caller.pid,
            uid=caller.uid,
            allowed=False,
            reason=decision.reason,
            err=decision.errno,
            dest=dest,
        )
        return SandboxError(decision.errno, decision.reason, decision.rule)

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
        self.record(
            op,
            src,
            zone,
            pid=caller.pid,
            uid=caller.uid,
            allowed=None,
            reason=reason,
            err=errno.EXDEV,
            dest=dst,
        )
        raise SandboxError(errno.EXDEV, reason)

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

    def _owns_node(self, node: Node) -> bool:
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

    def _own_readable(self, node: Node) -> bool:
        """An entry this mount created in a zone that is create-only at this level: readable,
        and (a directory) listable, showing only what this mount created in it. The zone root
        stays unlisted: the caller knows the ids it made."""
        zone = node.zone
        if zone is None or node.ino < FIRST_DYNAMIC_INO or not self.reads_own(zone):
            return False
        return self._owns_node(node)

    def check_list(self, caller: Caller, node: Node) -> None:
        """Listing `node` (a zone's directory): the matrix, or at a create-only level a
        directory this mount created."""
        if not self._own_readable(node):
            self.check(caller, Op.LIST, node)

    def may_cache(self, zone: Zone) -> bool:
        """Whether file contents may be handed to the kernel's cache (someone may read them)."""
        return self.policy.decide(zone, Op.READ).allowed

    # ----- resolving names ------------------------------------------------------------------------

    def visible(
        self, caller: Caller, parent: Node, name: bytes, st: StatLike | None, created_here: bool
    ) -> bool:
        """Whether parent/name (st: its lstat, None when absent) may be resolved.

        Answers False ("absent") for every absent name, and refuses as absent (ENOENT,
        audited as `read`: the caller was reaching for it) every existing name this level may
        not know about: everything in a zone the level cannot access, existing files of a
        create-only zone that this mount did not create, and there deny-listed names. The
        answer is the same whether the name exists or not, so it tells the caller nothing.

        Where the level may read or list the zone, a deny-listed entry resolves with its real
        attributes like any other (a file that exists never looks deleted: git would stage its
        deletion); only its contents are refused (may_open, may_list, may_read_link, ...).
        """
        zone = parent.zone
        assert zone is not None
        if not self.policy.access(zone).any:
            if st is None:
                return False
            decision = self.policy.decide(zone, Op.READ)
            raise self.refuse(caller, Op.READ, parent.vpath(name), zone, _absent(decision))
        is_dir = st is None or stat.S_ISDIR(st.st_mode)
        pattern = None if self.readable(zone) else self.denied_pattern(parent, name, is_dir)
        if pattern is not None:
            if st is None:
                return False
            vpath = parent.vpath(name)
            decision = self.policy.deny_list_decision(vpath, pattern, errno.ENOENT)
            raise self.refuse(caller, Op.READ, vpath, zone, decision)
        if st is None:
            return False
        created_here = created_here or self.owns(zone, st)
        decision = self.policy.decide_lookup(zone, stat.S_ISDIR(st.st_mode), created_here)
        if not decision.allowed:
            raise self.refuse(caller, Op.READ, parent.vpath(name), zone, _absent(decision))
        return True

    def hidden(self, caller: Caller, op: Op, parent: Node, name: bytes, why: str) -> SandboxError:
        """An entry that is never part of a zone (sandboxfs's state, another mount): absent
        to a reader, refused to a writer."""
        err = errno.ENOENT if op is Op.READ else errno.EACCES
        vpath = parent.vpath(name)
        return self.refuse(caller, op, vpath, parent.zone, Decision(False, err, f"{vpath}: {why}"))

    def denied_pattern(self, parent: Node, name: bytes, is_dir: bool) -> str | None:
        """The deny pattern that parent/name matches (with its type as given), or that a
        directory above it matches, if any."""
        found = self._denied_here(parent, name, is_dir)
        return found if found is not None else self._denied_dir(parent)

    def _denied_here(self, parent: Node, name: bytes, is_dir: bool) -> str | None:
        text = name.decode("utf-8", "surrogateescape")
        relpath = ""
        if self.policy.has_path_patterns:
            relpath = relpath_of(parent, name)
        return self.policy.denied_name(text, relpath, is_dir)

    def _denied_dir(self, directory: Node) -> str | None:
        """The deny pattern that `directory` or a directory above it matches (a zone root
        matches none), remembered on each node until any known path changes (Store.moves)."""
        moves = self._moves()
        stale: list[Node] = []
        found: str | None = None
        node = directory
        while node.zone is not None and node.parent is not None and node.parent.zone is not None:
            memo_moves, memo = node.deny_memo
            if memo_moves == moves:
                found = memo
                break
            stale.append(node)
            node = node.parent
        for node in reversed(stale):  # from the top down, each step one name
            if found is None:
                assert node.parent is not None
                found = self._denied_here(node.parent, node.name, True)
            node.deny_memo = (moves, found)
        return found

    def listed(
        self, parent: Node, name: bytes, is_dir: bool, ino: int | None = None, own: bool = False
    ) -> bool:
        """Whether a directory listing shows parent/name: always where the level may read or
        list the zone (deny-listed entries too), else not a deny-listed one; where it may only
        create (`reads_own`), only what this mount created (`own`, or its inode number `ino`
        is one this mount created)."""
        zone = parent.zone
        if self.lists_all(zone):
            return True
        if (
            zone is not None
            and self.reads_own(zone)
            and not (own or (ino is not None and (zone, ino) in self.own_entries))
        ):
            return False
        return self.denied_pattern(parent, name, is_dir) is None

    def lists_all(self, zone: Zone | None) -> bool:
        """Whether listings in `zone` show every name (see listed), so that a listing need
        not ask about each entry: the level may read or list the zone, all of it."""
        return zone is not None and self.readable(zone) and not self.reads_own(zone)

    def _reject_denied(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        is_dir: bool,
        op: AuditOp | Op,
        dest: str | None = None,
        src: str | None = None,
    ) -> None:
        pattern = self.denied_pattern(parent, name, is_dir)
        if pattern is not None:
            vpath = parent.vpath(name)
            decision = self.policy.deny_list_decision(vpath, pattern)
            raise self.refuse(caller, op, src or vpath, parent.zone, decision, dest=dest)

    def _reject_denied_node(self, caller: Caller, op: AuditOp | Op, node: Node) -> None:
        """The contents of an existing deny-listed entry (or of one inside a deny-listed
        directory) are refused: reading, writing, listing, changing."""
        if node.parent is not None and node.zone is not None and node.ino >= FIRST_DYNAMIC_INO:
            self._reject_denied(caller, node.parent, node.name, node.is_dir, op)

    # ----- private keys found by their contents (sandboxfs.core.secrets) --------------------

    # Set by inspect_contents: reads files whose names match a deny_private_keys pattern.
    keys: KeyScanner | None = None

    def inspect_contents(self, keys: KeyScanner | None) -> None:
        """Refuse files matching the policy's private-key patterns whose contents hold a
        private key, as deny-listed ones are (without a scanner, none is)."""
        self.keys = keys

    def _reject_private_key(
        self,
        caller: Caller,
        op: AuditOp | Op,
        parent: Node,
        name: bytes,
        layer: int = 0,
        st: StatLike | None = None,
        dest: str | None = None,
        src: str | None = None,
    ) -> None:
        """A regular file at parent/name that matches a private-key pattern and holds a key
        is never read, changed, renamed, linked or deleted."""
        keys = self.keys
        zone = parent.zone
        if keys is None or zone is None or not self.policy.private_keys.written:
            return
        relpath = relpath_of(parent, name) if self.policy.private_keys.has_paths else ""
        text = name.decode("utf-8", "surrogateescape")
        pattern = self.policy.private_keys.match(text, relpath, False)
        if pattern is None:
            return
        what = keys.holds_key(parent, name, layer, st)
        if what is not None:
            vpath = parent.vpath(name)
            decision = self.policy.private_key_decision(vpath, pattern, what)
            raise self.refuse(caller, op, src or vpath, zone, decision, dest=dest)

    def names_private_key(self, node: Node) -> bool:
        """Whether `node`, a file, matches a private-key pattern (so that a handle on it is
        checked again when its file changes: may_read_open_key)."""
        if self.keys is None or node.parent is None or node.zone is None:
            return False
        relpath = relpath_of(node.parent, node.name) if self.policy.private_keys.has_paths else ""
        text = node.name.decode("utf-8", "surrogateescape")
        return self.policy.private_keys.match(text, relpath, False) is not None

    def may_read_open_key(self, caller: Caller, node: Node, fd: int) -> None:
        """Reading through a handle on a file matching a private-key pattern that has changed
        since it was checked: a key written into it since (by the user's own tool, outside) is
        refused to the handle as it is to a fresh open, audited."""
        keys = self.keys
        zone = node.zone
        if keys is None or zone is None or node.parent is None:
            return
        what = keys.holds_key_open(fd)
        if what is not None:
            text = node.name.decode("utf-8", "surrogateescape")
            relpath = (
                relpath_of(node.parent, node.name) if self.policy.private_keys.has_paths else ""
            )
            pattern = self.policy.private_keys.match(text, relpath, False) or text
            vpath = node.vpath()
            decision = self.policy.private_key_decision(vpath, pattern, what)
            raise self.refuse(caller, Op.READ, vpath, zone, decision)

    def _reject_private_key_node(
        self, caller: Caller, op: AuditOp | Op, node: Node, dest: str | None = None
    ) -> None:
        if node.parent is not None and not node.is_dir and node.ino >= FIRST_DYNAMIC_INO:
            self._reject_private_key(caller, op, node.parent, node.name, node.layer, dest=dest)

    # ----- staged commits under review ------------------------------------------------------------

    def _reject_frozen(
        self,
        caller: Caller,
        op: AuditOp | Op,
        parent: Node,
        name: bytes,
        dest: str | None = None,
        src: str | None = None,
    ) -> None:
        """A staged commit the user has shown for review no longer changes: what was reviewed
        is what lands. `src`: the path audited when parent/name is the target of a rename or
        link (its `dest`)."""
        if parent.zone is not Zone.STAGED or self._frozen is None:
            return
        top = relpath_of(parent, name).split("/", 1)[0]
        self._reject_frozen_commit(caller, op, top, parent.vpath(name), dest, src)

    def _reject_frozen_commit(
        self,
        caller: Caller,
        op: AuditOp | Op,
        top: str,
        vpath: str,
        dest: str | None = None,
        src: str | None = None,
    ) -> None:
        assert self._frozen is not None
        if self._frozen(top):
            reason = (
                f"{vpath}: the staged commit {top} is under review and can no longer change; "
                f"stage a new commit (a new directory in /staged) instead"
            )
            decision = Decision(False, errno.EACCES, reason)
            raise self.refuse(caller, op, src or vpath, Zone.STAGED, decision, dest=dest)

    def _reject_frozen_node(self, caller: Caller, op: AuditOp | Op, node: Node) -> None:
        """Every name the store knows for node (hard links stay inside one staged commit: see
        may_link); a node whose last known name was removed, by the commit of that name (an
        unknown name may still reach the inode there)."""
        if node.zone is not Zone.STAGED or self._frozen is None:
            return
        if node.parent is not None:
            self._reject_frozen(caller, op, node.parent, node.name)
        for parent, name in node.links:
            self._reject_frozen(caller, op, parent, name)
        if node.parent is None and not node.links:
            parts = node.last_vpath.split("/", 3)  # "", "staged", id, ...
            if len(parts) > 2:
                self._reject_frozen_commit(caller, op, parts[2], node.last_vpath)

    def may_write_staged(self, caller: Caller, node: Node) -> None:
        """A write through a handle of a file in /staged (write, and what the kernel turns into
        writes: O_APPEND, writeback of a shared mapping, fallocate's and copy_file_range's
        fallbacks). The handle may be older than the review that froze its staged commit, so
        each write asks again; callers skip it for every other zone, where it costs nothing."""
        self._reject_frozen_node(caller, Op.WRITE, node)

    def _reject_cross_commit_link(
        self, caller: Caller, node: Node, parent: Node, new_name: bytes, dest: str
    ) -> None:
        """A hard link between two staged commits would let a write through the name in one
        change the other after it is frozen: each staged commit keeps its own inodes."""
        if parent.zone is not Zone.STAGED or node.parent is None:
            return
        top = relpath_of(node.parent, node.name).split("/", 1)[0]
        to = relpath_of(parent, new_name).split("/", 1)[0]
        if top != to:
            src = node.vpath()
            reason = (
                f"{src} is in the staged commit {top}: hard links between staged commits are "
                f"refused (each is reviewed on its own); copy the file instead"
            )
            decision = Decision(False, errno.EXDEV, reason)
            raise self.refuse(caller, AuditOp.LINK, src, Zone.STAGED, decision, dest=dest)

    # ----- project zones' directories in /repo: never removed, renamed or replaced ----------------

    # Set by pin_zone_roots: what lies at a path of /repo (relative to it), if a project zone's
    # directory is there or below it.
    _zone_root_at: Callable[[str], str | None] | None = None

    def pin_zone_roots(self, zone_root_at: Callable[[str], str | None]) -> None:
        """Through /repo, the directory of a project zone inside the project, and every
        directory above it, is never removed, renamed, replaced (or created, should it be
        missing) nor has its attributes changed, at any trust level, as the zone's own root
        in / is not: the next mount would open whatever took its place (project.py refuses a
        link there with one line). `zone_root_at(relpath)` says what is at relpath, or None."""
        self._zone_root_at = zone_root_at

    def _reject_zone_root(
        self, caller: Caller, op: AuditOp | Op, parent: Node, name: bytes, dest: str | None
    ) -> None:
        zone_root_at = self._zone_root_at
        if zone_root_at is None or parent.zone is not Zone.REPO:
            return
        what = zone_root_at(relpath_of(parent, name))
        if what is not None:
            vpath = parent.vpath(name)
            reason = (
                f"{vpath} {what}: it cannot be removed, renamed, replaced or changed through "
                f"/repo at any trust level (what is inside it can, where the level allows)"
            )
            decision = Decision(False, errno.EBUSY, reason, Rule.PROTECT)
            raise self.refuse(caller, op, vpath, parent.zone, decision, dest=dest)

    # ----- protected paths ------------------------------------------------------------------------

    def _reject_protected(
        self,
        caller: Caller,
        op: AuditOp | Op,
        parent: Node,
        name: bytes,
        is_dir: bool,
        dest: str | None = None,
        pointer: bool = False,
    ) -> None:
        """Protected paths (and everything inside a protected directory) are never changed,
        nor is git's code-running surface (sandboxfs.core.policy.git_rule; `pointer`: the new
        entry is a symbolic link, or a second name for a file outside every git directory)."""
        self._reject_zone_root(caller, op, parent, name, dest)
        if parent.zone is None:
            return
        git = parent.zone not in GIT_ZONES_EXEMPT
        if not self._may_protect(parent) and not (
            git and git_name(name.decode("utf-8", "surrogateescape"))
        ):
            return
        vpath = parent.vpath(name)
        git_root = parent.zone in self.policy.git_dirs
        decision = self.policy.protected(
            vpath, relpath_of(parent, name), is_dir, pointer, git, git_root
        )
        if decision is not None:
            raise self.refuse(caller, op, vpath, parent.zone, decision, dest=dest)

    def _may_protect(self, directory: Node) -> bool:
        """Whether a protect pattern or a git rule could match inside `directory` by path,
        remembered on the node until any known path changes (Store.moves)."""
        moves = self._moves()
        memo_moves, may = directory.protect_memo
        if memo_moves != moves:
            rel = directory.relpath().decode("utf-8", "surrogateescape")
            may = self.policy.may_protect_under(
                rel,
                directory.zone not in GIT_ZONES_EXEMPT,
                directory.zone in self.policy.git_dirs,
            )
            directory.protect_memo = (moves, may)
        return may

    def _reject_protected_node(self, caller: Caller, op: AuditOp | Op, node: Node) -> None:
        if node.parent is not None and node.zone is not None:
            self._reject_protected(caller, op, node.parent, node.name, node.is_dir)

    def _judge_config(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        st: StatLike,
        to_parent: Node,
        to_name: bytes,
        src: str,
        dst: str,
        read: ReadFile | None,
    ) -> bool:
        """A regular file renamed onto one of git's config files (`config`, `config.worktree`
        of any git directory git_rule protects: how git writes them, through `config.lock`).
        False when the destination is not one, or the rename cannot be judged (a directory, a
        link, a front end without `read`): the destination's protection then refuses it.
        True when every setting the new content adds or changes is one sandboxfs.core.gitconfig
        allows; otherwise refused (EROFS, audited as the rename src -> dst with the setting).

        `read(parent, name, expect)` returns the file's content (at most MAX_CONFIG_BYTES),
        None when it is absent or not the file `expect` ((st_dev, st_ino)) names; for the
        source, every open handle of the file has stopped writing first, so what is judged
        is what git will read. A protect pattern matching the destination refuses as always."""
        zone = to_parent.zone
        if (
            read is None
            or zone is None
            or zone in GIT_ZONES_EXEMPT
            or not stat.S_ISREG(st.st_mode)
            or fold(to_name.decode("utf-8", "surrogateescape")) not in gitconfig.CONFIG_NAMES
        ):
            return False
        relpath = relpath_of(to_parent, to_name)
        rule = git_rule(git_path(relpath, zone in self.policy.git_dirs))
        if rule is None or rule.rsplit("/", 1)[-1] not in gitconfig.CONFIG_NAMES:
            return False
        self._reject_zone_root(caller, AuditOp.RENAME, to_parent, to_name, dst)
        pattern = self.policy.protect.match_within(relpath, False)
        if pattern is not None:
            decision = self.policy.protect_decision(dst, pattern)
            raise self.refuse(caller, AuditOp.RENAME, dst, zone, decision, dest=dst)
        problem: str | None
        if st.st_nlink != 1:
            problem = "the file renamed onto it has other names, through which it could change"
        elif st.st_size > gitconfig.MAX_CONFIG_BYTES:
            problem = f"the new content is larger than {gitconfig.MAX_CONFIG_BYTES} bytes"
        else:
            new = read(parent, name, (st.st_dev, st.st_ino), gitconfig.MAX_CONFIG_BYTES)
            if new is None:
                problem = "the file renamed onto it changed or could not be read"
            else:
                old = read(to_parent, to_name, None, gitconfig.MAX_CONFIG_BYTES)
                refusal = gitconfig.judge(old or b"", new)
                problem = None if refusal is None else refusal.reason
        if problem is None:
            return True
        reason = (
            f"{dst}: {problem}: refused ({rule} may change only branch tracking, remotes with "
            f"ordinary URLs, user.* and similar settings; change others outside the sandbox)"
        )
        decision = Decision(False, errno.EROFS, reason, Rule.PROTECT)
        raise self.refuse(caller, AuditOp.RENAME, src, zone, decision, dest=dst)

    def _judge_index(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        st: StatLike,
        to_parent: Node,
        to_name: bytes,
        src: str,
        dst: str,
        read: ReadFile | None,
    ) -> bool:
        """A regular file renamed onto the `index` or `packed-refs` of a git directory (how git
        writes them, through `index.lock`, `packed-refs.lock`), as _judge_config: True when
        the new index sets no assume-unchanged or skip-worktree flag and adds no cache the old
        one lacked, or the new packed-refs adds no replace ref (sandboxfs.core.gitindex), else
        refused (EROFS, audited): the user's git status and git diff would skip what the agent
        changed. False when it is not such a rename."""
        zone = to_parent.zone
        if (
            read is None
            or zone is None
            or zone in GIT_ZONES_EXEMPT
            or not stat.S_ISREG(st.st_mode)
            or fold(to_name.decode("utf-8", "surrogateescape")) not in gitindex.INDEX_NAMES
        ):
            return False
        relpath = relpath_of(to_parent, to_name)
        rule = git_rule(git_path(relpath, zone in self.policy.git_dirs))
        if rule is None or rule.rsplit("/", 1)[-1] not in gitindex.INDEX_NAMES:
            return False
        self._reject_zone_root(caller, AuditOp.RENAME, to_parent, to_name, dst)
        pattern = self.policy.protect.match_within(relpath, False)
        if pattern is not None:
            decision = self.policy.protect_decision(dst, pattern)
            raise self.refuse(caller, AuditOp.RENAME, dst, zone, decision, dest=dst)
        problem: str | None
        if st.st_nlink != 1:
            problem = "the file renamed onto it has other names, through which it could change"
        elif st.st_size > gitindex.MAX_INDEX_BYTES:
            problem = f"the new index is larger than {gitindex.MAX_INDEX_BYTES} bytes"
        else:
            new = read(parent, name, (st.st_dev, st.st_ino), gitindex.MAX_INDEX_BYTES)
            if new is None:
                problem = "the file renamed onto it changed or could not be read"
            else:
                old = read(to_parent, to_name, None, gitindex.MAX_INDEX_BYTES)
                packed = rule.endswith("packed-refs")
                problem = (gitindex.judge_packed_refs if packed else gitindex.judge)(old, new)
        if problem is None:
            return True
        reason = (
            f"{dst}: {problem}: refused (a new {rule} may not hide changes from the user's "
            f"git status and git diff: no assume-unchanged or skip-worktree flag, no new "
            f"untracked or fsmonitor cache, no replace ref)"
        )
        decision = Decision(False, errno.EROFS, reason, Rule.PROTECT)
        raise self.refuse(caller, AuditOp.RENAME, src, zone, decision, dest=dst)

    # ----- reading and changing existing entries --------------------------------------------------

    def may_open(
        self,
        caller: Caller,
        node: Node,
        read: bool,
        write: bool,
        *,
        truncate: bool = False,
        in_place: bool = False,
        shared: bool = False,
        consent: bool = True,
    ) -> None:
        """Opening an existing file to read and/or to write (or truncate): never a deny-listed
        one, nor one that holds a private key (checked last: it reads the file); then the
        approval rules (not for a handle kept open: `consent` False). Truncating, or writing
        in place (`in_place`: without O_APPEND), a file this session did not create destroys
        what it held: an overwrite too. `shared`: the file has other names, so no rule's
        exclusions apply (a hard link in `build/` to the user's file is the user's file)."""
        assert node.zone is not None
        self._reject_denied_node(caller, Op.WRITE if write else Op.READ, node)
        if read and not self._own_readable(node):
            self.check(caller, Op.READ, node)
        if write:
            self._reject_protected_node(caller, Op.WRITE, node)
            self.check(caller, Op.WRITE, node)
            self._check_layer(caller, node, Op.WRITE)
            self._reject_frozen_node(caller, Op.WRITE, node)
        limits = self.limits.get(node.zone)
        if limits is not None and not limits.suffix_allowed(node.name.decode("utf-8", "replace")):
            op = Op.WRITE if write else Op.READ
            decision = limits.suffix_decision(node.vpath(), node.zone.value, "opening")
            raise self.refuse(caller, op, node.vpath(), node.zone, decision)
        self._reject_private_key_node(caller, Op.WRITE if write else Op.READ, node)
        if consent:  # approvals: reading, writing, overwriting an existing file
            overwrites = (truncate or in_place) and not node.created_here
            kinds = [Kind.OVERWRITE] if overwrites else []
            kinds += [Kind.WRITE] if write else []
            kinds += [Kind.READ] if read else []
            op = Op.WRITE if write else Op.READ
            if self.consent.active:  # a virtual path costs a walk up the tree
                path = node.vpath()
                self.consent.check(caller, kinds, node.zone, path, op, exclusions=not shared)

    def may_keep(
        self,
        caller: Caller,
        node: Node,
        read: bool,
        write: bool,
        created: bool,
        grant: int | None = None,
    ) -> None:
        """A handle opened under an earlier trust level, used again to read or to write: that
        must be allowed now (a handle that created its file keeps it while creating is), and
        the approval grant it was opened under (`grant`) must not have been revoked."""
        assert node.zone is not None
        if grant is not None and grant in self.consent.revoked_grants:
            reason = f"{node.vpath()} was opened under approval grant {grant}, since revoked"
            decision = Decision(False, errno.EACCES, reason, Rule.APPROVAL)
            raise self.refuse(
                caller, Op.WRITE if write else Op.READ, node.vpath(), node.zone, decision
            )
        if not created:
            self.may_open(caller, node, read, write, consent=False)
            return
        decision = self.policy.decide_create(node.zone)
        if not decision.allowed:
            raise self.refuse(caller, Op.WRITE, node.vpath(), node.zone, decision)
        if write:
            self._reject_frozen_node(caller, Op.WRITE, node)

    def may_stat(self, caller: Caller, node: Node) -> None:
        """Attributes of a known entry after the trust level changed: only what the new level
        may resolve (the kernel forgot its names, but open descriptors still ask)."""
        zone = node.zone
        if zone is None or node.ino < FIRST_DYNAMIC_INO:
            return
        decision = self.policy.decide_lookup(zone, node.is_dir, self._owns_node(node))
        if not decision.allowed:
            raise self.refuse(caller, Op.READ, node.vpath(), zone, _absent(decision))

    def may_read_link(self, caller: Caller, node: Node) -> None:
        """A symbolic link's target is its contents: refused for a deny-listed link."""
        if not self._own_readable(node):
            self.check(caller, Op.READ, node)
        self._reject_denied_node(caller, Op.READ, node)

    def may_change(
        self,
        caller: Caller,
        node: Node,
        allow_created: bool = True,
        *,
        overwrites: bool = False,
        shared: bool = False,
    ) -> None:
        """Writes to an existing entry (setattr, xattrs): never to `/`, a zone root or
        /.sandboxfs.

        In a create-only zone, entries this mount created may still get their mode, times and
        xattrs set (tar and cp -p do that after writing), but only their creating handle may
        change their size. `overwrites`: a size change (truncate(2), ftruncate) not covered
        by how its handle was opened, an overwrite for the approval rules too; `shared`: as
        in may_open.
        """
        if node.ino < FIRST_DYNAMIC_INO:
            reason = (
                CONTEXT_REASON if node.zone is None and node.ino != ROOT_INO else ZONE_ROOT_REASON
            )
            raise self.refuse(
                caller, Op.WRITE, node.vpath(), node.zone, Decision(False, errno.EACCES, reason)
            )
        assert node.zone is not None
        self._reject_denied_node(caller, Op.WRITE, node)
        self._reject_protected_node(caller, Op.WRITE, node)
        self._reject_frozen_node(caller, Op.WRITE, node)
        if not (allow_created and node.created_here and self.policy.access(node.zone).create_only):
            self.check(caller, Op.WRITE, node)
            self._check_layer(caller, node, Op.WRITE)
        self._reject_private_key_node(caller, Op.WRITE, node)
        if not node.created_here and self.consent.active:  # approvals: truncate, chmod, xattr
            kinds = [Kind.OVERWRITE, Kind.WRITE] if overwrites else [Kind.WRITE]
            path = node.vpath()
            self.consent.check(caller, kinds, node.zone, path, Op.WRITE, exclusions=not shared)

    def may_write_context(self, caller: Caller, node: Node) -> NoReturn:
        decision = Decision(False, errno.EACCES, CONTEXT_REASON)
        raise self.refuse(caller, Op.WRITE, node.vpath(), None, decision)

    def may_change_xattr(self, caller: Caller, node: Node, name: bytes) -> None:
        self.may_change(caller, node)
        if not name.startswith(_WRITABLE_XATTR_PREFIX) and name not in _ACL_XATTRS:
            reason = (
                "only user.* extended attributes and POSIX ACLs can be set or removed "
                "through sandboxfs"
            )
            raise self.refuse(
                caller, Op.WRITE, node.vpath(), node.zone, Decision(False, errno.EPERM, reason)
            )

    def xattrs_visible(self, caller: Caller, node: Node) -> bool:
        """Whether node's extended attributes may be read (refusals are audited). A zone root
        the level cannot read or list shows none, like the empty directory it looks like; nor
        does a deny-listed entry (silently: `ls -l` asks for every file it shows)."""
        if node.zone is None:
            return True
        if node.ino < FIRST_DYNAMIC_INO:
            return self.readable(node.zone)
        self.check(caller, Op.READ, node)
        parent = node.parent
        return parent is None or self.denied_pattern(parent, node.name, node.is_dir) is None

    def may_list(self, caller: Caller, node: Node) -> None:
        """Opening a directory to list it (never a deny-listed one, nor one inside); allowed
        listings are audited at once."""
        if node.zone is not None:
            self.check_listing(caller, node)
            self.did(caller, Op.LIST, node)

    def check_listing(self, caller: Caller, node: Node) -> None:
        """may_list without its entry: the matrix (or an own directory), then the deny list."""
        if node.zone is not None:
            self.check_list(caller, node)
            self._reject_denied_node(caller, Op.LIST, node)

    def _check_layer(
        self, caller: Caller, node: Node, op: AuditOp | Op, child: bytes | None = None
    ) -> None:
        """Only the first workers directory (<project>/.workers) can be changed."""
        self._reject_layer(caller, op, node, child, node.layer)

    def _reject_layer(
        self,
        caller: Caller,
        op: AuditOp | Op,
        node: Node,
        name: bytes | None,
        layer: int,
        dest: str | None = None,
    ) -> None:
        """The one read-only workers-layer rule: what comes from a SANDBOXFS_WORKERS_PATH
        directory (layer > 0) is never changed, removed or renamed (node/name, or node)."""
        if node.zone is Zone.WORKERS and layer > 0:
            vpath = node.vpath(name)
            reason = (
                f"{vpath} comes from SANDBOXFS_WORKERS_PATH, which is read-only; "
                f"only <project>/.workers can be changed"
            )
            decision = Decision(False, errno.EROFS, reason)
            raise self.refuse(caller, op, vpath, node.zone, decision, dest=dest)

    # ----- sizes and quotas -----------------------------------------------------------------------

    def zone_limits(self, zone: Zone | None) -> ZoneLimits:
        return self.limits.get(zone, _NO_LIMITS) if zone is not None else _NO_LIMITS

    def may_resize(self, caller: Caller, node: Node, old_size: int, new_size: int) -> None:
        """A write or truncate taking node's file from old_size to new_size bytes: within
        max_file_bytes and the zone's quota (charged here; `freed` gives back)."""
        zone = node.zone
        assert zone is not None
        limits = self.limits.get(zone)
        if limits is None:
            return
        limit = limits.max_file_bytes
        if limit is not None and new_size > limit and new_size > old_size:
            decision = limits.size_decision(node.vpath(), zone.value, new_size)
            raise self.refuse(caller, Op.WRITE, node.vpath(), zone, decision)
        tally = self.tallies.get(zone)
        if tally is not None and new_size != old_size:
            refused = tally.charge(new_size - old_size, 0, node.vpath())
            if refused is not None:
                raise self.refuse(caller, Op.WRITE, node.vpath(), zone, refused)

    def freed(self, zone: Zone | None, nbytes: int, nfiles: int) -> None:
        """Give back to the zone's quota what a failed change or a removal no longer uses."""
        tally = self.tallies.get(zone) if zone is not None else None
        if tally is not None:
            tally.credit(nbytes, nfiles)

    # ----- creating entries -----------------------------------------------------------------------

    def may_create(
        self, caller: Caller, parent: Node, name: bytes, kind: str = "file", mode: int = 0
    ) -> Zone:
        """Checks for a new name in `parent` (kind: file, mkdir, symlink, mknod); returns its
        zone. Charges one entry to the zone's quota: `freed` gives it back if creating fails."""
        if parent.zone is None:
            reason = self.policy.root_create_reason if parent.ino == ROOT_INO else CONTEXT_REASON
            raise self.refuse(
                caller, Op.WRITE, parent.vpath(name), None, Decision(False, errno.EACCES, reason)
            )
        zone = parent.zone
        if kind == "mknod" and not (
            stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
        ):
            reason = (
                "only regular files, FIFOs and sockets can be created; device nodes are refused"
            )
            raise self.refuse(
                caller, Op.WRITE, parent.vpath(name), zone, Decision(False, errno.EPERM, reason)
            )
        self._reject_denied(caller, parent, name, True, Op.WRITE)
        if kind == "file":  # CREATE without O_EXCL opens a file the kernel thought absent
            self._reject_private_key(caller, Op.WRITE, parent, name)
        self._reject_protected(caller, Op.WRITE, parent, name, True, pointer=kind == "symlink")
        self._reject_frozen(caller, Op.WRITE, parent, name)
        decision = self.policy.decide_create(zone)
        if not decision.allowed:
            raise self.refuse(caller, Op.WRITE, parent.vpath(name), zone, decision)
        self._check_layer(caller, parent, Op.WRITE, name)
        limits = self.limits.get(zone)
        if limits is not None and kind != "mkdir":
            self._check_suffix(caller, limits, parent, name, Op.WRITE, "creating")
        if self.consent.active:  # approvals
            self.consent.check(caller, [Kind.CREATE], zone, parent.vpath(name), Op.WRITE)
        tally = self.tallies.get(zone)
        if tally is not None:
            refused = tally.charge(0, 1, parent.vpath(name))
            if refused is not None:
                raise self.refuse(caller, Op.WRITE, parent.vpath(name), zone, refused)
        return zone

    def _check_suffix(
        self,
        caller: Caller,
        limits: ZoneLimits,
        parent: Node,
        name: bytes,
        op: AuditOp | Op,
        what: str,
        dest: str | None = None,
        src: str | None = None,
    ) -> None:
        if not limits.suffix_allowed(name.decode("utf-8", "replace")):
            assert parent.zone is not None
            vpath = parent.vpath(name)
            decision = limits.suffix_decision(vpath, parent.zone.value, what)
            raise self.refuse(caller, op, src or vpath, parent.zone, decision, dest=dest)

    def refuse_existing(self, caller: Caller, parent: Node, name: bytes, zone: Zone) -> None:
        """A name that exists where lookup answered "absent" (create-only zones): refused as
        the write it is, like every other refused creation, rather than EEXIST."""
        if not self.policy.access(zone).create_only:
            return
        vpath = parent.vpath(name)
        reason = (
            f"{vpath} exists, and {zone.value} is create-only at trust level "
            f"{self.policy.trust.value}: existing entries cannot be replaced"
        )
        raise self.refuse(caller, Op.WRITE, vpath, zone, Decision(False, errno.EACCES, reason))

    def refuse_mount_root(self, caller: Caller, parent: Node, name: bytes, zone: Zone) -> NoReturn:
        vpath = parent.vpath(name)
        reason = f"{vpath} is the root of another mount"
        raise self.refuse(caller, Op.WRITE, vpath, zone, Decision(False, errno.EACCES, reason))

    def may_link(self, caller: Caller, node: Node, parent: Node, new_name: bytes) -> None:
        """A second name for node at parent/new_name."""
        src = node.vpath()
        dest = parent.vpath(new_name)
        if node.zone is None or node.ino < FIRST_DYNAMIC_INO:
            decision = Decision(False, errno.EPERM, ZONE_ROOT_REASON)
            raise self.refuse(caller, AuditOp.LINK, src, node.zone, decision, dest=dest)
        if parent.zone is not node.zone:
            self.cross_zone(AuditOp.LINK, caller, src, dest, node.zone, parent.zone)
        if node.parent is None:
            raise SandboxError(errno.ENOENT, "the entry was removed")
        # The source is judged by its current path, whatever name the kernel used for it: a
        # second name for a deny-listed or protected file would carry it out from under its
        # pattern (writing through a hard link writes the protected file).
        self._reject_denied(caller, node.parent, node.name, node.is_dir, AuditOp.LINK, dest)
        self._reject_private_key_node(caller, AuditOp.LINK, node, dest)
        self._reject_protected(caller, AuditOp.LINK, node.parent, node.name, node.is_dir, dest=dest)
        self._reject_denied(caller, parent, new_name, False, AuditOp.LINK)
        # Inside a git directory, a second name only for a file of a git directory (git links
        # its objects into place): one from outside may be a symbolic link.
        outsider = node.zone not in self.policy.git_dirs and not in_git_dir(
            relpath_of(node.parent, node.name)
        )
        self._reject_protected(caller, AuditOp.LINK, parent, new_name, False, dest, outsider)
        # A new name changes the source too (its link count, and it can be written through
        # the new name): neither may be in a frozen staged commit, nor the two in different ones.
        self._reject_frozen(caller, AuditOp.LINK, node.parent, node.name, dest=dest)
        self._reject_frozen(caller, AuditOp.LINK, parent, new_name, dest=dest, src=src)
        self._reject_cross_commit_link(caller, node, parent, new_name, dest)
        assert parent.zone is not None
        # A second name for an existing file changes it (its link count, and every later
        # write through either name): write access, which create-only does not give.
        for decision in (
            self.policy.decide_create(parent.zone),
            self.policy.decide(node.zone, Op.WRITE),
        ):
            if not decision.allowed:
                raise self.refuse(caller, AuditOp.LINK, src, parent.zone, decision, dest=dest)
        limits = self.limits.get(parent.zone)
        if limits is not None and not node.is_dir:
            # Both names: a second name with an allowed suffix would open the file the
            # first one keeps closed.
            self._check_suffix(
                caller, limits, node.parent, node.name, AuditOp.LINK, "linking", dest, src
            )
            self._check_suffix(caller, limits, parent, new_name, AuditOp.LINK, "linking", dest, src)
        self._check_layer(caller, parent, AuditOp.LINK, new_name)
        self._check_layer(caller, node, AuditOp.LINK)
        if self.consent.active:  # approvals
            # The link's source goes with it: a grant for it covers that source only.
            self.consent.check(caller, [Kind.CREATE], parent.zone, dest, AuditOp.LINK, src)

    def hidden_target(
        self, caller: Caller, op: AuditOp | Op, src: str, zone: Zone | None, dest: str, why: str
    ) -> SandboxError:
        """A link or rename onto sandboxfs's state or another mount."""
        decision = Decision(False, errno.EACCES, f"{dest}: {why}")
        return self.refuse(caller, op, src, zone, decision, dest=dest)

    # ----- removing and renaming ------------------------------------------------------------------

    def may_remove_in(self, caller: Caller, parent: Node, name: bytes, op: Op) -> Zone:
        """Checks on parent/name before it is looked up for deletion; returns its zone."""
        if parent.zone is None:
            reason = ZONE_ROOT_REASON if parent.ino == ROOT_INO else CONTEXT_REASON
            raise self.refuse(
                caller, op, parent.vpath(name), None, Decision(False, errno.EACCES, reason)
            )
        self._reject_denied(caller, parent, name, True, Op.DELETE)
        self.check(caller, Op.DELETE, parent, name)
        return parent.zone

    def may_remove(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        is_dir: bool,
        layer: int,
        op: Op,
        created: bool = False,
    ) -> None:
        """Checks on the entry found at parent/name (in workers layer `layer`); `created`: this
        mount made it, so it is not the user's and no approval rule asks."""
        zone = parent.zone
        assert zone is not None
        self._reject_protected(caller, Op.DELETE, parent, name, is_dir)
        self._reject_frozen(caller, Op.DELETE, parent, name)
        self._reject_layer(caller, op, parent, name, layer)
        if not is_dir:
            self._reject_private_key(caller, Op.DELETE, parent, name, layer)
        if self.consent.active and not created:  # approvals
            self.consent.check(caller, [Kind.DELETE], zone, parent.vpath(name), op)

    def removed(self, zone: Zone, st: StatLike) -> None:
        """A name was unlinked or replaced: its inode's bytes and entry leave the quota when it
        was the last name."""
        if stat.S_ISDIR(st.st_mode):
            self.freed(zone, 0, 1)
        elif st.st_nlink <= 1:
            self.freed(zone, st.st_size if stat.S_ISREG(st.st_mode) else 0, 1)
        if (stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1) and self.owns(zone, st):
            del self.own_entries[(zone, st.st_ino)]  # its number may be another file's next

    def may_rename_in(
        self,
        caller: Caller,
        old_parent: Node,
        name_old: bytes,
        new_parent: Node,
        name_new: bytes,
        flags_ok: bool,
    ) -> Zone:
        """Checks on a rename before either name is looked up; returns the zone."""
        src, dst = old_parent.vpath(name_old), new_parent.vpath(name_new)
        if old_parent.zone is None or new_parent.zone is None:
            reason = ZONE_ROOT_REASON if old_parent.zone is None else self.policy.root_create_reason
            raise self.refuse(
                caller,
                AuditOp.RENAME,
                src,
                old_parent.zone,
                Decision(False, errno.EACCES, reason),
                dest=dst,
            )
        if old_parent.zone is not new_parent.zone:
            self.cross_zone(AuditOp.RENAME, caller, src, dst, old_parent.zone, new_parent.zone)
        zone = old_parent.zone
        if not flags_ok:
            reason = "only the RENAME_NOREPLACE and RENAME_EXCHANGE flags are supported"
            decision = Decision(False, errno.EINVAL, reason)
            raise self.refuse(caller, AuditOp.RENAME, src, zone, decision, dest=dst)
        for parent, name in ((old_parent, name_old), (new_parent, name_new)):
            self._reject_denied(caller, parent, name, True, AuditOp.RENAME)
        for decision in (self.policy.decide(zone, Op.DELETE), self.policy.decide(zone, Op.WRITE)):
            if not decision.allowed:
                raise self.refuse(caller, AuditOp.RENAME, src, zone, decision, dest=dst)
        return zone

    def may_rename_from(
        self, caller: Caller, old_parent: Node, name_old: bytes, layer: int, dest: str
    ) -> None:
        self._reject_layer(caller, AuditOp.RENAME, old_parent, name_old, layer, dest)

    def may_rename_to(self, caller: Caller, new_parent: Node, name_new: bytes) -> None:
        self._check_layer(caller, new_parent, Op.WRITE, name_new)
        # What a rename would replace there: never a file that holds a private key.
        self._reject_private_key(caller, AuditOp.RENAME, new_parent, name_new)

    def may_move(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        st: StatLike,
        to_parent: Node,
        to_name: bytes,
        src: str,
        dst: str,
        read: ReadFile | None = None,
        *,
        replaces: bool = False,
        created: bool = False,
        replaced_created: bool = False,
    ) -> None:
        """Patterns survive renames: nothing protected is moved away or onto, and no directory
        is moved while a deny or protect path pattern, or a git rule that depends on where the
        directory is, could match something inside it (it would carry that entry out from under
        its pattern), nor onto such a place. A symbolic link is never moved into a git
        directory. Suffixes too: a file keeps an
        allowed suffix, and one without can only be deleted. A file renamed onto one of git's
        config files is judged by what it changes (`read`: see _judge_config). Last, the approval
        rules (`replaces`: the rename replaces an existing entry, an overwrite too), which never
        ask about moving what this mount created (`created`) nor about replacing it
        (`replaced_created`)."""
        is_dir = stat.S_ISDIR(st.st_mode)
        link = stat.S_ISLNK(st.st_mode)
        self._reject_protected(caller, AuditOp.RENAME, parent, name, is_dir, dest=dst)
        # Renames onto git's config, index or packed-refs are judged by what they change.
        judged = (caller, parent, name, st, to_parent, to_name, src, dst, read)
        if not self._judge_config(*judged) and not self._judge_index(*judged):
            self._reject_protected(caller, AuditOp.RENAME, to_parent, to_name, is_dir, dst, link)
        self._reject_frozen(caller, AuditOp.RENAME, parent, name, dest=dst)
        self._reject_frozen(caller, AuditOp.RENAME, to_parent, to_name, dest=dst, src=src)
        if stat.S_ISREG(st.st_mode):  # a private key never leaves its name
            self._reject_private_key(caller, AuditOp.RENAME, parent, name, 0, st, dst, src)
        if not is_dir:
            limits = self.limits.get(parent.zone) if parent.zone is not None else None
            if limits is not None:
                self._check_suffix(
                    caller, limits, parent, name, AuditOp.RENAME, "renaming", dst, src
                )
                self._check_suffix(
                    caller, limits, to_parent, to_name, AuditOp.RENAME, "renaming to", dst, src
                )
        else:
            self._may_move_dir(caller, parent, name, to_parent, to_name, src, dst)
        kinds = [] if created else [Kind.RENAME]
        kinds += [Kind.OVERWRITE] if replaces and not replaced_created else []
        if self.consent.active and kinds:
            assert parent.zone is not None
            dest = to_parent.vpath(to_name)
            path = parent.vpath(name)
            self.consent.check(caller, kinds, parent.zone, path, AuditOp.RENAME, dest)

    def _may_move_dir(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        to_parent: Node,
        to_name: bytes,
        src: str,
        dst: str,
    ) -> None:
        """A directory moves only where no deny or protect pattern, nor a git rule that depends
        on where it is, could match something inside it, before or after."""
        pattern = self.policy.deny.match_below(relpath_of(parent, name))
        if pattern is not None:
            decision = self.policy.deny_list_decision(f"{parent.vpath(name)}/...", pattern)
            raise self.refuse(caller, AuditOp.RENAME, src, parent.zone, decision, dest=dst)
        # Protect patterns and git's rules that depend on where a directory is (what is inside
        # .git/modules/, say): neither from under them nor under them.
        for at, at_name in ((parent, name), (to_parent, to_name)):
            found = self.policy.protected_below(
                f"{at.vpath(at_name)}/...",
                relpath_of(at, at_name),
                at.zone not in GIT_ZONES_EXEMPT,
                at.zone in self.policy.git_dirs,
            )
            if found is not None:
                raise self.refuse(caller, AuditOp.RENAME, src, parent.zone, found, dest=dst)


def _absent(decision: Decision) -> Decision:
    """A refusal answered as ENOENT: the name looks absent to the caller."""
    return Decision(False, errno.ENOENT, decision.reason)


def relpath_of(parent: Node, name: bytes) -> str:
    """parent/name relative to its zone root, as text for pattern matching."""
    rel = parent.relpath()
    return (rel + b"/" + name if rel else name).decode("utf-8", "surrogateescape")


def _read_comm(fd: int) -> str:
    return os.pread(fd, 64, 0).rstrip(b"\n").decode("utf-8", "replace")


class ProcessNames:
    """`comm` of recent callers, read through a descriptor kept open per pid.

    Opening /proc/<pid>/comm is most of the cost of reading it, and the same few processes
    make most requests. A descriptor stays bound to the process it was opened for: once that
    process is gone, reading fails (ESRCH) even if its pid has been reused, and the pid is
    looked up afresh. A name changed by exec or prctl shows on the next read.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._fds: OrderedDict[int, int] = OrderedDict()
        # Thread id -> its thread group (process) id, while its comm descriptor is kept:
        # valid exactly as long as that descriptor still reads (the same thread).
        self._groups: dict[int, int] = {}

    def process(self, tid: int) -> int:
        """The process (thread group id, `Tgid:` of /proc/<tid>/status) of thread `tid`, or
        `tid` itself when that cannot be read. Read once per thread, and trusted only if the
        thread's comm descriptor, opened before, still reads after: a tid reused meanwhile
        by another process fails it."""
        if self.get(tid) is None:
            return tid
        known = self._groups.get(tid)
        if known is not None:
            return known
        bound = self._fds[tid]  # opened for this very thread
        try:
            fd = os.open(f"/proc/{tid}/status", os.O_RDONLY | os.O_CLOEXEC)
            try:
                status = os.pread(fd, 4096, 0)
            finally:
                os.close(fd)
            group = int(status.split(b"\nTgid:", 1)[1].split(b"\n", 1)[0])
            _read_comm(bound)  # still that thread: the status read was its own
        except (OSError, IndexError, ValueError):
            return tid
        if group <= 0:
            return tid
        self._groups[tid] = group
        return group

    def get(self, pid: int) -> str | None:
        fd = self._fds.get(pid)
        if fd is not None:
            try:
                name = _read_comm(fd)
            except OSError:
                del self._fds[pid]
                self._groups.pop(pid, None)
                os.close(fd)
            else:
                self._fds.move_to_end(pid)
                return name
        if pid <= 0:
            return None
        try:
            fd = os.open(f"/proc/{pid}/comm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            name = _read_comm(fd)
        except OSError:
            os.close(fd)
            return None
        self._fds[pid] = fd
        if len(self._fds) > self._capacity:
            gone, oldest = self._fds.popitem(last=False)
            self._groups.pop(gone, None)
            os.close(oldest)
        return name

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._groups.clear()
