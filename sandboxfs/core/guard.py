"""The guard: a library of rule checks, by family, for what a trust level may do in each zone.

Families: the matrix (`check`), visibility (`visible`, `listed`, `xattrs_visible`), the deny
list, private keys, frozen staged commits, zone roots pinned in /repo, protected paths and
git's files (`reject_protected`, `judge_config`, `judge_index`), worker layers and the zone's
limits. Each check takes the caller, what it asks for and where (store nodes: a parent and a
name, or an existing node), and either returns (allowed) or raises the `Refusal` it built
with `refuse`: an errno and a reason written for the agent that was refused. The order the
checks run in for each operation is read in one place, the gate (sandboxfs.core.gate), which
audits every refusal on its way out; what an operation leaves behind (entries, quota,
consent) is its Effects (sandboxfs.core.effects). A rule lives here once.
"""

from __future__ import annotations

import errno
import stat
from typing import NoReturn

from .entry import AuditOp
from .errors import SandboxError
from .inodes import FIRST_DYNAMIC_INO, Node, StatLike
from .limits import ZoneLimits
from .policy import Decision, Op, Zone
from .protect import ProtectRules
from .rulebase import Caller, ReadFile, _absent, relpath_of
from .secrets import KeyScanner

_NO_LIMITS = ZoneLimits()


class Guard(ProtectRules):
    """The policy of one mount or sandbox, applied to nodes: its rule checks, by family (the
    shared base and the matrix: sandboxfs.core.rulebase; protection: sandboxfs.core.protect)."""

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

    def may_stat(self, caller: Caller, node: Node) -> None:
        """Attributes of a known entry after the trust level changed: only what the new level
        may resolve (the kernel forgot its names, but open descriptors still ask)."""
        zone = node.zone
        if zone is None or node.ino < FIRST_DYNAMIC_INO:
            return
        decision = self.policy.decide_lookup(zone, node.is_dir, self.owns_node(node))
        if not decision.allowed:
            raise self.refuse(caller, Op.READ, node.vpath(), zone, _absent(decision))

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

    def reject_denied(
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

    def reject_denied_node(self, caller: Caller, op: AuditOp | Op, node: Node) -> None:
        """The contents of an existing deny-listed entry (or of one inside a deny-listed
        directory) are refused: reading, writing, listing, changing."""
        if node.parent is not None and node.zone is not None and node.ino >= FIRST_DYNAMIC_INO:
            self.reject_denied(caller, node.parent, node.name, node.is_dir, op)

    # ----- private keys found by their contents (sandboxfs.core.secrets) --------------------

    # Set by inspect_contents: reads files whose names match a deny_private_keys pattern.
    keys: KeyScanner | None = None

    def inspect_contents(self, keys: KeyScanner | None) -> None:
        """Refuse files matching the policy's private-key patterns whose contents hold a
        private key, as deny-listed ones are (without a scanner, none is)."""
        self.keys = keys

    def reject_private_key(
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

    def reject_private_key_node(
        self, caller: Caller, op: AuditOp | Op, node: Node, dest: str | None = None
    ) -> None:
        if node.parent is not None and not node.is_dir and node.ino >= FIRST_DYNAMIC_INO:
            self.reject_private_key(caller, op, node.parent, node.name, node.layer, dest=dest)

    # ----- staged commits under review ------------------------------------------------------------

    def reject_frozen(
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
        self.reject_frozen_commit(caller, op, top, parent.vpath(name), dest, src)

    def reject_frozen_commit(
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

    def reject_frozen_node(self, caller: Caller, op: AuditOp | Op, node: Node) -> None:
        """Every name the store knows for node (hard links stay inside one staged commit: see
        may_link); a node whose last known name was removed, by the commit of that name (an
        unknown name may still reach the inode there)."""
        if node.zone is not Zone.STAGED or self._frozen is None:
            return
        if node.parent is not None:
            self.reject_frozen(caller, op, node.parent, node.name)
        for parent, name in node.links:
            self.reject_frozen(caller, op, parent, name)
        if node.parent is None and not node.links:
            parts = node.last_vpath.split("/", 3)  # "", "staged", id, ...
            if len(parts) > 2:
                self.reject_frozen_commit(caller, op, parts[2], node.last_vpath)

    def reject_cross_commit_link(
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

    # ----- extended attributes -------------------------------------------------------------

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

    # ----- worker layers ---------------------------------------------------------------------

    def check_layer(
        self, caller: Caller, node: Node, op: AuditOp | Op, child: bytes | None = None
    ) -> None:
        """Only the first workers directory (<project>/.workers) can be changed."""
        self.reject_layer(caller, op, node, child, node.layer)

    def reject_layer(
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

    # ----- sizes and suffixes (the zone's limits) --------------------------------------------

    def zone_limits(self, zone: Zone | None) -> ZoneLimits:
        return self.limits.get(zone, _NO_LIMITS) if zone is not None else _NO_LIMITS

    def check_size(self, caller: Caller, node: Node, old_size: int, new_size: int) -> None:
        """A write or truncate taking node's file from old_size to new_size bytes: within
        max_file_bytes (the quota is charged by the gate's effects)."""
        zone = node.zone
        assert zone is not None
        limits = self.limits.get(zone)
        if limits is None:
            return
        limit = limits.max_file_bytes
        if limit is not None and new_size > limit and new_size > old_size:
            decision = limits.size_decision(node.vpath(), zone.value, new_size)
            raise self.refuse(caller, Op.WRITE, node.vpath(), zone, decision)

    def check_suffix(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        op: AuditOp | Op,
        what: str,
        dest: str | None = None,
        src: str | None = None,
    ) -> None:
        """A name without a suffix the zone allows (its limits' allowed suffixes) is refused
        `what` (creating, linking, renaming)."""
        limits = self.limits.get(parent.zone) if parent.zone is not None else None
        if limits is not None and not limits.suffix_allowed(name.decode("utf-8", "replace")):
            assert parent.zone is not None
            vpath = parent.vpath(name)
            decision = limits.suffix_decision(vpath, parent.zone.value, what)
            raise self.refuse(caller, op, src or vpath, parent.zone, decision, dest=dest)

    def check_suffix_node(self, caller: Caller, node: Node, op: AuditOp | Op, what: str) -> None:
        """check_suffix for an existing entry, by its current name."""
        limits = self.limits.get(node.zone) if node.zone is not None else None
        if limits is not None and not limits.suffix_allowed(node.name.decode("utf-8", "replace")):
            assert node.zone is not None
            decision = limits.suffix_decision(node.vpath(), node.zone.value, what)
            raise self.refuse(caller, op, node.vpath(), node.zone, decision)

    # ----- names that exist, and entries this mount made ----------------------------------------

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

    def hidden_target(
        self, caller: Caller, op: AuditOp | Op, src: str, zone: Zone | None, dest: str, why: str
    ) -> SandboxError:
        """A link or rename onto sandboxfs's state or another mount."""
        decision = Decision(False, errno.EACCES, f"{dest}: {why}")
        return self.refuse(caller, op, src, zone, decision, dest=dest)

    def forget(self, zone: Zone, st: StatLike) -> None:
        """A name was unlinked or replaced: an entry this mount created is forgotten when it
        was the last name (its number may be another file's next)."""
        if (stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1) and self.owns(zone, st):
            del self.own_entries[(zone, st.st_ino)]

    # ----- renames: patterns survive them ------------------------------------------------------

    def reject_move(
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
    ) -> None:
        """Patterns survive renames: nothing protected is moved away or onto, and no directory
        is moved while a deny or protect path pattern, or a git rule that depends on where the
        directory is, could match something inside it (it would carry that entry out from under
        its pattern), nor onto such a place. A symbolic link is never moved into a git
        directory. Suffixes too: a file keeps an
        allowed suffix, and one without can only be deleted. A file renamed onto one of git's
        config files is judged by what it changes (`read`: see judge_config)."""
        is_dir = stat.S_ISDIR(st.st_mode)
        link = stat.S_ISLNK(st.st_mode)
        self.reject_protected(caller, AuditOp.RENAME, parent, name, is_dir, dest=dst)
        # Renames onto git's config, index or packed-refs are judged by what they change.
        judged = (caller, parent, name, st, to_parent, to_name, src, dst, read)
        if not self.judge_config(*judged) and not self.judge_index(*judged):
            self.reject_protected(caller, AuditOp.RENAME, to_parent, to_name, is_dir, dst, link)
        self.reject_frozen(caller, AuditOp.RENAME, parent, name, dest=dst)
        self.reject_frozen(caller, AuditOp.RENAME, to_parent, to_name, dest=dst, src=src)
        if stat.S_ISREG(st.st_mode):  # a private key never leaves its name
            self.reject_private_key(caller, AuditOp.RENAME, parent, name, 0, st, dst, src)
        if not is_dir:
            self.check_suffix(caller, parent, name, AuditOp.RENAME, "renaming", dst, src)
            self.check_suffix(caller, to_parent, to_name, AuditOp.RENAME, "renaming to", dst, src)
        else:
            self.reject_dir_move(caller, parent, name, to_parent, to_name, src, dst)
