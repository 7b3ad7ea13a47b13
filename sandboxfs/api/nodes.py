"""The steps under `Sandbox`'s operations, on nodes: finding a virtual path's node one
component at a time, as the mount's lookups do (`Gate.lookup`), the checks each operation
makes first (which `check_permission` makes too, without effect), and the directories and
files that `write`, `mkdir` and `stage` create.

In a class of their own, which `Sandbox` builds on, so that sandbox.py holds what callers
see; nothing here is public.
"""

from __future__ import annotations

import errno
import stat

from sandboxfs.core.entry import AuditOp

from ..core.errors import SandboxError
from ..core.gate import Gate
from ..core.inodes import Node
from ..core.policy import ZONE_ROOT_REASON, Decision, Op, Zone
from .arguments import VirtualPath
from .types import Backend, Caller


class NodeSteps:
    """The node-level steps of `Sandbox`'s operations (see the module's docstring); the
    attributes are the sandbox's own, set by `Sandbox.__init__`."""

    _backend: Backend
    _caller: Caller
    _gate: Gate
    _held: list[Node]  # nodes looked up during the current call, released when it ends

    # ----- resolving --------------------------------------------------------------------------

    def _refuse_closed_zone(
        self, g: Gate, p: VirtualPath, op: Op, audited: AuditOp | Op | None = None
    ) -> None:
        """A path below the root of a zone this trust level may not access at all is refused
        as the zone is (PermissionDenied: "repo is not writable at trust level ..."), for the
        operation asked, before any name is looked up: every name there gets the same answer,
        so it tells nothing about what exists. (The mount answers ENOENT at the lookup: a
        kernel lookup cannot say more.)"""
        zone = p.zone
        policy = g.guard.policy
        if zone is None or not p.parts or policy.access(zone).any:
            return
        decision = policy.decide(zone, op)
        raise g.refusal(self._caller, audited or op, p.text, zone, decision)

    def _lookup(self, g: Gate, parent: Node, name: bytes) -> Node | None:
        """The node at parent/name, None when absent; refuses (ENOENT) what this level may
        not see, as the mount's lookup does (Gate.lookup)."""
        found = g.lookup(self._caller, parent, name)
        if found is None:
            return None
        st, layer = found
        node = self._backend.remember(parent, name, st, layer)
        self._held.append(node)
        return node

    def _absent(self, g: Gate, parent: Node, name: bytes) -> SandboxError:
        """ENOENT for a missing name, with the reason an existing one would have had where the
        level may not see it, so that the answer does not tell whether the name exists."""
        zone = parent.zone
        assert zone is not None
        vpath = parent.vpath(name)
        guard = g.guard
        policy = guard.policy
        if not policy.access(zone).any:
            return SandboxError(errno.ENOENT, policy.decide(zone, Op.READ).reason)
        pattern = None if guard.readable(zone) else guard.denied_pattern(parent, name, True)
        if pattern is not None:
            decision = policy.deny_list_decision(vpath, pattern, errno.ENOENT)
            return SandboxError(errno.ENOENT, decision.reason, decision.rule)
        return SandboxError(errno.ENOENT, f"{vpath} does not exist")

    def _dir(self, g: Gate, zone: Zone, parts: tuple[bytes, ...]) -> Node:
        """The directory at zone/parts..., looked up component by component."""
        node = self._backend.zone_roots[zone]
        for name in parts:
            child = self._lookup(g, node, name)
            if child is None:
                raise self._absent(g, node, name)
            if not child.is_dir:
                raise SandboxError(errno.ENOTDIR, self._not_dir_reason(child))
            node = child
        return node

    def _not_dir_reason(self, node: Node) -> str:
        if stat.S_ISLNK(self._backend.stat(node).st_mode):
            return f"{node.vpath()} is a symbolic link, which the API never follows"
        return f"{node.vpath()} is not a directory"

    def _node(self, g: Gate, p: VirtualPath) -> Node:
        if p.zone is None:
            return self._backend.root
        if not p.parts:
            return self._backend.zone_roots[p.zone]
        parent = self._dir(g, p.zone, p.parts[:-1])
        node = self._lookup(g, parent, p.parts[-1])
        if node is None:
            raise self._absent(g, parent, p.parts[-1])
        return node

    def _parent(self, g: Gate, p: VirtualPath) -> tuple[Node, bytes]:
        """Where p's last name lives: `/` for a zone root."""
        assert p.zone is not None
        if not p.parts:
            return self._backend.root, p.zone.value.encode()
        return self._dir(g, p.zone, p.parts[:-1]), p.parts[-1]

    def _seen_parent(self, g: Gate, p: VirtualPath) -> tuple[Node, bytes]:
        """_parent, after looking the name up as the kernel does before an unlink or rename
        through the mount: a name this level may not see is absent (ENOENT)."""
        parent, name = self._parent(g, p)
        if p.parts and self._lookup(g, parent, name) is None:
            raise self._absent(g, parent, name)
        return parent, name

    def _regular(self, g: Gate, op: Op, node: Node) -> None:
        """Only regular files are read or written: a symlink is never followed."""
        kind = stat.S_IFMT(self._backend.stat(node).st_mode)
        if kind == stat.S_IFREG:
            return
        vpath = node.vpath()
        if kind == stat.S_IFLNK:
            reason = f"{vpath} is a symbolic link; the API never follows symbolic links"
            decision = Decision(False, errno.ELOOP, reason)
        else:
            reason = f"{vpath} is not a regular file; only regular files can be read or written"
            decision = Decision(False, errno.EINVAL, reason)
        raise g.refusal(self._caller, op, vpath, node.zone, decision)

    # ----- the checks of each operation (shared by the operations and check_permission) -------

    def _file(self, g: Gate, p: VirtualPath, op: Op) -> Node:
        """The file at p, to read (a directory is refused with a hint)."""
        self._refuse_closed_zone(g, p, op)
        node = self._node(g, p)
        if node.is_dir:
            raise SandboxError(errno.EISDIR, f"{p.text} is a directory; list() shows its entries")
        return node

    def _target(self, g: Gate, p: VirtualPath) -> tuple[Node, bytes, Node | None, bool]:
        """A write's parent, name, existing node (None: to be created) and whether the lookup
        refused the name (the creation then decides, as after a refused lookup in the mount)."""
        if p.zone is None or not p.parts:
            raise SandboxError(errno.EISDIR, f"{p.text} is a directory")
        self._refuse_closed_zone(g, p, Op.WRITE)
        parent = self._dir(g, p.zone, p.parts[:-1])
        name = p.parts[-1]
        try:
            node = self._lookup(g, parent, name)
        except SandboxError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return parent, name, None, True
        if node is not None and node.is_dir:
            raise SandboxError(errno.EISDIR, f"{p.text} is a directory")
        return parent, name, node, False

    def _removal(self, g: Gate, p: VirtualPath) -> tuple[Node, bytes]:
        """Where the entry to delete is, looked up as the kernel does before an unlink."""
        if p.zone is None:
            raise SandboxError(errno.EACCES, ZONE_ROOT_REASON)
        self._refuse_closed_zone(g, p, Op.DELETE)
        return self._seen_parent(g, p)

    def _listable(self, g: Gate, p: VirtualPath) -> Node:
        self._refuse_closed_zone(g, p, Op.LIST)
        node = self._node(g, p)
        if not node.is_dir:
            raise SandboxError(errno.ENOTDIR, self._not_dir_reason(node))
        g.opendir(self._caller, node)
        return node

    def _probe_op(self, op: Op, p: VirtualPath) -> None:
        """The checks of the operation `op` on p, through the gate without effect: the same
        `check_<op>` methods the operations run, on the same rules."""
        g, caller = self._gate.without_effect(), self._caller
        if op is Op.READ:
            node = self._file(g, p, Op.READ)
            g.check_open(caller, node, read=True, write=False)
            self._regular(g, Op.READ, node)
        elif op is Op.LIST:
            self._listable(g, p)
        elif op is Op.DELETE:
            parent, name = self._removal(g, p)
            g.check_remove(caller, parent, name)
        else:
            parent, name, existing, refused = self._target(g, p)
            if existing is not None:
                g.check_open(caller, existing, read=False, write=True)
                self._regular(g, Op.WRITE, existing)
                return
            zone = g.check_create(caller, parent, name)
            if refused:
                g.existing(caller, parent, name, zone, errno.EEXIST)

    # ----- listing and creating ---------------------------------------------------------------

    def _zones_listed(self, g: Gate, recursive: bool) -> tuple[list[str], list[tuple[Node, str]]]:
        """Listing `/`: the zones' paths, and (recursive) the roots of those this level may
        list, opened as the directories to walk."""
        policy = g.guard.policy
        found: list[str] = []
        pending: list[tuple[Node, str]] = []
        for zone in policy.zones:
            found.append(f"/{zone.value}")
            if recursive and policy.decide(zone, Op.LIST).allowed:
                root = self._backend.zone_roots[zone]
                g.opendir(self._caller, root)
                pending.append((root, f"/{zone.value}"))
        return found, pending

    def _created_here(self, parent: Node, name: bytes) -> bool:
        """Whether this sandbox made parent/name (listing a create-only zone shows only those)."""
        assert parent.zone is not None
        try:
            found = self._backend.find(parent, name)
        except (SandboxError, OSError):
            return False
        return found is not None and self._backend.created(parent.zone, found[0])

    def _descend(self, g: Gate, parent: Node, name: bytes) -> Node | None:
        """A subdirectory to list recursively, or None if it cannot be (skipped)."""
        try:
            child = self._lookup(g, parent, name)
            if child is None or not child.is_dir:
                return None
            g.opendir(self._caller, child)
        except (SandboxError, OSError):
            return None
        return child

    def _create_file(self, parent: Node, name: bytes, payload: bytes) -> Node:
        def create(flags: int, mode: int) -> tuple[Node, None]:
            return self._backend.create(parent, name, payload), None

        node = self._gate.create(self._caller, parent, name, create, size=len(payload), record=True)
        self._held.append(node)
        return node

    def _make_dir(self, parent: Node, name: bytes) -> Node:
        def make(mode: int) -> tuple[Node, None]:
            node = self._backend.mkdir(parent, name)
            self._held.append(node)
            return node, None

        return self._gate.make(self._caller, parent, name, "mkdir", make)

    def _ensure_dir(self, parent: Node, name: bytes, create: bool, last: bool) -> Node:
        """parent/name as a directory: the existing one, or (create) a new one."""
        try:
            child = self._lookup(self._gate, parent, name)
        except SandboxError as exc:
            if exc.errno != errno.ENOENT or not create:
                raise
            child = None
        if child is None:
            if not create:
                raise self._absent(self._gate, parent, name)
            return self._make_dir(parent, name)
        if not child.is_dir:
            if last:
                raise SandboxError(errno.EEXIST, f"{child.vpath()} exists and is not a directory")
            raise SandboxError(errno.ENOTDIR, self._not_dir_reason(child))
        return child
