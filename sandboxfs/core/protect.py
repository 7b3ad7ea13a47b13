"""The guard's protection rules (sandboxfs.core.guard): zone roots pinned in /repo, protected
paths and git's code-running surface, and renames onto git's config, index and packed-refs,
judged by what they change."""

from __future__ import annotations

import errno
import stat
from collections.abc import Callable

from . import gitconfig, gitindex
from .entry import AuditOp
from .inodes import Node, StatLike
from .policy import (
    GIT_ZONES_EXEMPT,
    Decision,
    Op,
    Rule,
    Zone,
    fold,
    git_name,
    git_path,
    git_rule,
    in_git_dir,
)
from .rulebase import Caller, ReadFile, RuleBase, relpath_of


class ProtectRules(RuleBase):
    """What may never change through the mount, at any trust level."""

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

    def reject_zone_root(
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

    def reject_protected(
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
        self.reject_zone_root(caller, op, parent, name, dest)
        if parent.zone is None:
            return
        git = parent.zone not in GIT_ZONES_EXEMPT
        if not self.could_protect_inside(parent) and not (
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

    def could_protect_inside(self, directory: Node) -> bool:
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

    def reject_protected_node(self, caller: Caller, op: AuditOp | Op, node: Node) -> None:
        if node.parent is not None and node.zone is not None:
            self.reject_protected(caller, op, node.parent, node.name, node.is_dir)

    def judge_config(
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

        def judge(rule: str, old: bytes | None, new: bytes) -> str | None:
            refusal = gitconfig.judge(old or b"", new)
            return None if refusal is None else refusal.reason

        moved = (caller, parent, name, st, to_parent, to_name, src, dst, read)
        return self._judge_git_file(
            moved,
            gitconfig.CONFIG_NAMES,
            gitconfig.MAX_CONFIG_BYTES,
            "the new content",
            judge,
            lambda rule: (
                f"{rule} may change only branch tracking, remotes with ordinary URLs, user.* "
                f"and similar settings; change others outside the sandbox"
            ),
        )

    def judge_index(
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
        writes them, through `index.lock`, `packed-refs.lock`), as judge_config: True when
        the new index sets no assume-unchanged or skip-worktree flag and adds no cache the old
        one lacked, or the new packed-refs adds no replace ref (sandboxfs.core.gitindex), else
        refused (EROFS, audited): the user's git status and git diff would skip what the agent
        changed. False when it is not such a rename."""

        def judge(rule: str, old: bytes | None, new: bytes) -> str | None:
            packed = rule.endswith("packed-refs")
            return (gitindex.judge_packed_refs if packed else gitindex.judge)(old, new)

        moved = (caller, parent, name, st, to_parent, to_name, src, dst, read)
        return self._judge_git_file(
            moved,
            gitindex.INDEX_NAMES,
            gitindex.MAX_INDEX_BYTES,
            "the new index",
            judge,
            lambda rule: (
                f"a new {rule} may not hide changes from the user's git status and git diff: "
                f"no assume-unchanged or skip-worktree flag, no new untracked or fsmonitor "
                f"cache, no replace ref"
            ),
        )

    def _judge_git_file(
        self,
        moved: tuple[Caller, Node, bytes, StatLike, Node, bytes, str, str, ReadFile | None],
        names: frozenset[str],
        limit: int,
        content: str,
        judge: Callable[[str, bytes | None, bytes], str | None],
        allows: Callable[[str], str],
    ) -> bool:
        """What judge_config and judge_index share: whether the rename `moved` lands on one of
        git's files named `names` that git_rule protects (False: not such a rename), then the
        destination's zone root and protect patterns, then the new content (one name, at most
        `limit` bytes, read whole) given to `judge(rule, old, new)`: True when it finds no
        problem, else refused (EROFS) with what the file `allows`."""
        caller, parent, name, st, to_parent, to_name, src, dst, read = moved
        zone = to_parent.zone
        if (
            read is None
            or zone is None
            or zone in GIT_ZONES_EXEMPT
            or not stat.S_ISREG(st.st_mode)
            or fold(to_name.decode("utf-8", "surrogateescape")) not in names
        ):
            return False
        relpath = relpath_of(to_parent, to_name)
        rule = git_rule(git_path(relpath, zone in self.policy.git_dirs))
        if rule is None or rule.rsplit("/", 1)[-1] not in names:
            return False
        self.reject_zone_root(caller, AuditOp.RENAME, to_parent, to_name, dst)
        pattern = self.policy.protect.match_within(relpath, False)
        if pattern is not None:
            decision = self.policy.protect_decision(dst, pattern)
            raise self.refuse(caller, AuditOp.RENAME, dst, zone, decision, dest=dst)
        problem: str | None
        if st.st_nlink != 1:
            problem = "the file renamed onto it has other names, through which it could change"
        elif st.st_size > limit:
            problem = f"{content} is larger than {limit} bytes"
        else:
            new = read(parent, name, (st.st_dev, st.st_ino), limit)
            if new is None:
                problem = "the file renamed onto it changed or could not be read"
            else:
                problem = judge(rule, read(to_parent, to_name, None, limit), new)
        if problem is None:
            return True
        reason = f"{dst}: {problem}: refused ({allows(rule)})"
        decision = Decision(False, errno.EROFS, reason, Rule.PROTECT)
        raise self.refuse(caller, AuditOp.RENAME, src, zone, decision, dest=dst)

    def links_from_outside_git(self, node: Node) -> bool:
        """Whether a second name for node would point into a git directory from outside every
        git directory (git itself only links its objects into place)."""
        assert node.parent is not None
        return node.zone not in self.policy.git_dirs and not in_git_dir(
            relpath_of(node.parent, node.name)
        )

    # ----- directories that carry patterns with them -------------------------------------------

    def reject_dir_move(
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
