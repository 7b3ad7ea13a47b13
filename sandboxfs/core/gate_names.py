"""The gate's operations on names (sandboxfs.core.gate): creating, linking, removing and
renaming entries, each with its rule list in one method."""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable

from .approval_rules import Kind
from .entry import AuditOp
from .errors import SandboxError
from .gatebase import SUID_SGID, GateBase, Request, T
from .inodes import FIRST_DYNAMIC_INO, ROOT_INO, Node, StatLike
from .policy import CONTEXT_REASON, ZONE_ROOT_REASON, Decision, Op, Zone
from .rulebase import Caller, ReadFile
from .store import HiddenEntry


class NamesGate(GateBase):
    """Creating, linking, removing and renaming entries."""

    # ----- creating entries ------------------------------------------------------------------

    def check_create(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        kind: str = "file",
        mode: int = 0,
        size: int = 0,
    ) -> Zone:
        """A new name (kind: file, mkdir, symlink, mknod) of `size` bytes in `parent`; charges
        one entry (and the size) to the zone's quota. Returns the zone."""
        g = self.guard
        if parent.zone is None:
            reason = g.policy.root_create_reason if parent.ino == ROOT_INO else CONTEXT_REASON
            raise g.refuse(
                caller, Op.WRITE, parent.vpath(name), None, Decision(False, errno.EACCES, reason)
            )
        zone = parent.zone
        if kind == "mknod" and not (
            stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
        ):
            reason = (
                "only regular files, FIFOs and sockets can be created; device nodes are refused"
            )
            raise g.refuse(
                caller, Op.WRITE, parent.vpath(name), zone, Decision(False, errno.EPERM, reason)
            )
        g.reject_denied(caller, parent, name, True, Op.WRITE)
        if kind == "file":  # CREATE without O_EXCL opens a file the kernel thought absent
            g.reject_private_key(caller, Op.WRITE, parent, name)
        g.reject_protected(caller, Op.WRITE, parent, name, True, pointer=kind == "symlink")
        g.reject_frozen(caller, Op.WRITE, parent, name)
        decision = g.policy.decide_create(zone)
        if not decision.allowed:
            raise g.refuse(caller, Op.WRITE, parent.vpath(name), zone, decision)
        g.check_layer(caller, parent, Op.WRITE, name)
        if kind != "mkdir":
            g.check_suffix(caller, parent, name, Op.WRITE, "creating")
        self._approve(caller, [Kind.CREATE], zone, lambda: parent.vpath(name), Op.WRITE)
        if self.effects.charges(zone):
            self.effects.charge(caller, zone, parent.vpath(name), 0, 1)
        if size:
            try:  # sizes are judged before anything exists
                self._resize(caller, Node(0, zone, parent, name, False), 0, size)
            except BaseException:
                self._refund(zone, 0, 1)
                raise
        try:
            self._decide(lambda: Request(Op.WRITE, caller, parent.vpath(name), zone))
        except BaseException:
            self._refund(zone, size, 1)
            raise
        return zone

    def existing(self, caller: Caller, parent: Node, name: bytes, zone: Zone, err: int) -> None:
        """A creation met an existing name (err): sandboxfs's state or another mount, or an
        entry of a create-only zone, are refused (EACCES, audited) as the write they were."""
        if err in (errno.EEXIST, errno.EISDIR, errno.EXDEV):
            self.find(caller, Op.WRITE, parent, name)
        if err == errno.EEXIST:
            self.guard.refuse_existing(caller, parent, name, zone)
            raise SandboxError(errno.EEXIST, f"{parent.vpath(name)} already exists")
        if err == errno.EXDEV:  # the name is the root of another mount
            self.guard.refuse_mount_root(caller, parent, name, zone)

    def create(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        action: Callable[[int, int], tuple[T, StatLike | None]],
        *,
        flags: int = os.O_WRONLY,
        mode: int = 0o666,
        size: int = 0,
        record: bool = False,
    ) -> T:
        """A new regular file: `action(flags, mode)` creates it (with the set-id bits
        stripped, and O_EXCL where the zone is create-only: "create" never reopens an existing
        file there) and returns what it made and its lstat. `record`: audited now, with `size`
        bytes (the API); else when its handle is released (the mount)."""
        zone = self.check_create(caller, parent, name, "file", size=size)
        if self.guard.create_only(zone):
            flags |= os.O_EXCL
        try:
            made, st = action(flags, stat.S_IMODE(mode) & ~SUID_SGID)
        except BaseException as exc:
            self._refund(zone, size, 1)
            if isinstance(exc, OSError) and exc.errno is not None:
                self.existing(caller, parent, name, zone, exc.errno)
            raise
        if st is not None:
            self.guard.created(zone, st)
        if record:
            self.effects.record(
                Op.WRITE,
                parent.vpath(name),
                zone,
                pid=caller.pid,
                uid=caller.uid,
                nbytes=size,
                detail="create",
            )
        return made

    def make(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        kind: str,
        action: Callable[[int], tuple[T, StatLike | None]],
        *,
        mode: int = 0,
    ) -> T:
        """mkdir, symlink or mknod (`kind`): `action(mode)` makes it (mode: the set-id bits
        stripped) and returns what it made and its lstat (None: the front end keeps its own
        record of what it created); recorded as `write` with the kind."""
        zone = self.check_create(caller, parent, name, kind, mode)
        try:
            made, st = action(stat.S_IFMT(mode) | (stat.S_IMODE(mode) & ~SUID_SGID))
        except BaseException as exc:
            self._refund(zone, 0, 1)
            if isinstance(exc, OSError) and exc.errno in (errno.EEXIST, errno.EADDRINUSE):
                # Only a creation that failed can have met sandboxfs's state or a mount.
                self.find(caller, Op.WRITE, parent, name)
                self.guard.refuse_existing(caller, parent, name, zone)
                if exc.errno == errno.EEXIST:
                    vpath = parent.vpath(name)
                    raise SandboxError(errno.EEXIST, f"{vpath} already exists") from None
            raise
        if st is not None:
            self.guard.created(zone, st)
        self.effects.record(
            Op.WRITE, parent.vpath(name), zone, pid=caller.pid, uid=caller.uid, detail=kind
        )
        return made

    def check_link(self, caller: Caller, node: Node, parent: Node, new_name: bytes) -> None:
        """A second name for node at parent/new_name (never onto sandboxfs's state or another
        mount). The source is judged by its current path, whatever name the kernel used for
        it: a second name for a deny-listed or protected file would carry it out from under
        its pattern (writing through a hard link writes the protected file)."""
        g = self.guard
        src, dest = node.vpath(), parent.vpath(new_name)
        if node.zone is None or node.ino < FIRST_DYNAMIC_INO:
            decision = Decision(False, errno.EPERM, ZONE_ROOT_REASON)
            raise g.refuse(caller, AuditOp.LINK, src, node.zone, decision, dest=dest)
        if parent.zone is not node.zone:
            g.cross_zone(AuditOp.LINK, caller, src, dest, node.zone, parent.zone)
        if node.parent is None:
            raise SandboxError(errno.ENOENT, "the entry was removed")
        zone = node.zone
        g.reject_denied(caller, node.parent, node.name, node.is_dir, AuditOp.LINK, dest)
        g.reject_private_key_node(caller, AuditOp.LINK, node, dest)
        g.reject_protected(caller, AuditOp.LINK, node.parent, node.name, node.is_dir, dest=dest)
        g.reject_denied(caller, parent, new_name, False, AuditOp.LINK)
        # Inside a git directory, a second name only for a file of a git directory (git links
        # its objects into place): one from outside may be a symbolic link.
        g.reject_protected(
            caller, AuditOp.LINK, parent, new_name, False, dest, g.links_from_outside_git(node)
        )
        # A new name changes the source too (its link count, and it can be written through
        # the new name): neither may be in a frozen staged commit, nor the two in different ones.
        g.reject_frozen(caller, AuditOp.LINK, node.parent, node.name, dest=dest)
        g.reject_frozen(caller, AuditOp.LINK, parent, new_name, dest=dest, src=src)
        g.reject_cross_commit_link(caller, node, parent, new_name, dest)
        # A second name for an existing file changes it (its link count, and every later
        # write through either name): write access, which create-only does not give.
        for decision in (g.policy.decide_create(zone), g.policy.decide(zone, Op.WRITE)):
            if not decision.allowed:
                raise g.refuse(caller, AuditOp.LINK, src, zone, decision, dest=dest)
        if not node.is_dir:
            # Both names: a second name with an allowed suffix would open the file the
            # first one keeps closed.
            g.check_suffix(caller, node.parent, node.name, AuditOp.LINK, "linking", dest, src)
            g.check_suffix(caller, parent, new_name, AuditOp.LINK, "linking", dest, src)
        g.check_layer(caller, parent, AuditOp.LINK, new_name)
        g.check_layer(caller, node, AuditOp.LINK)
        try:
            self.storage.target(parent, new_name)
        except HiddenEntry as exc:
            raise g.hidden_target(caller, AuditOp.LINK, src, zone, dest, exc.reason) from None
        # The link's source goes with it: a grant for it covers that source only.
        self._approve(caller, [Kind.CREATE], zone, lambda: dest, AuditOp.LINK, src)
        self._decide(lambda: Request(AuditOp.LINK, caller, src, zone, dest, node))

    def link(
        self, caller: Caller, node: Node, parent: Node, new_name: bytes, action: Callable[[], T]
    ) -> T:
        """A second name for node at parent/new_name; recorded as `link` from its current
        path."""
        self.check_link(caller, node, parent, new_name)
        src, dest = node.vpath(), parent.vpath(new_name)
        result = action()
        self.effects.consent.moved(src, dest, caller.pid, caller.uid)  # the same file, renamed
        self.effects.did(caller, AuditOp.LINK, node, path=src, dest=dest)
        return result

    # ----- removing and renaming -------------------------------------------------------------

    def check_remove(self, caller: Caller, parent: Node, name: bytes) -> tuple[Zone, StatLike, int]:
        """Deleting parent/name; returns its zone, its lstat and its workers layer."""
        g = self.guard
        op = Op.DELETE
        if parent.zone is None:
            reason = ZONE_ROOT_REASON if parent.ino == ROOT_INO else CONTEXT_REASON
            raise g.refuse(
                caller, op, parent.vpath(name), None, Decision(False, errno.EACCES, reason)
            )
        zone = parent.zone
        g.reject_denied(caller, parent, name, True, op)
        g.check(caller, op, parent, name)
        found = self.find(caller, op, parent, name)
        if found is None:
            raise SandboxError(errno.ENOENT, f"{parent.vpath(name)} does not exist")
        st, layer = found
        is_dir = stat.S_ISDIR(st.st_mode)
        g.reject_protected(caller, op, parent, name, is_dir)
        g.reject_frozen(caller, op, parent, name)
        g.reject_layer(caller, op, parent, name, layer)
        if not is_dir:
            g.reject_private_key(caller, op, parent, name, layer)
        # What this mount made is not the user's: no approval rule asks about it.
        if not self._made_here(zone, st):
            self._approve(caller, [Kind.DELETE], zone, lambda: parent.vpath(name), op)
        self._decide(lambda: Request(op, caller, parent.vpath(name), zone))
        return zone, st, layer

    def remove(
        self,
        caller: Caller,
        parent: Node,
        name: bytes,
        action: Callable[[Zone, StatLike, int], None],
        *,
        rmdir: bool | None = None,
    ) -> None:
        """unlink or rmdir (`rmdir`; None: by the entry's type): `action(zone, st, layer)`
        removes it; the quota gets back what it held; recorded as `delete`."""
        zone, st, layer = self.check_remove(caller, parent, name)
        action(zone, st, layer)
        self._removed(zone, st)
        if rmdir is None:
            rmdir = stat.S_ISDIR(st.st_mode)
        self.effects.record(
            Op.DELETE,
            parent.vpath(name),
            zone,
            pid=caller.pid,
            uid=caller.uid,
            detail="rmdir" if rmdir else None,
        )

    def check_rename(
        self,
        caller: Caller,
        old_parent: Node,
        name_old: bytes,
        new_parent: Node,
        name_new: bytes,
        *,
        flags_ok: bool = True,
        exchange: bool = False,
        read: ReadFile | None = None,
    ) -> tuple[Zone, StatLike, int, StatLike | None]:
        """Moving old_parent/name_old to new_parent/name_new in one zone (`exchange`: swapping
        the two); returns the zone, the source's lstat and layer and the replaced entry's
        lstat. `read`: see Guard.judge_config."""
        g = self.guard
        src, dst = old_parent.vpath(name_old), new_parent.vpath(name_new)
        if old_parent.zone is None or new_parent.zone is None:
            reason = ZONE_ROOT_REASON if old_parent.zone is None else g.policy.root_create_reason
            decision = Decision(False, errno.EACCES, reason)
            raise g.refuse(caller, AuditOp.RENAME, src, old_parent.zone, decision, dest=dst)
        if old_parent.zone is not new_parent.zone:
            g.cross_zone(AuditOp.RENAME, caller, src, dst, old_parent.zone, new_parent.zone)
        zone = old_parent.zone
        if not flags_ok:
            reason = "only the RENAME_NOREPLACE and RENAME_EXCHANGE flags are supported"
            decision = Decision(False, errno.EINVAL, reason)
            raise g.refuse(caller, AuditOp.RENAME, src, zone, decision, dest=dst)
        for parent, name in ((old_parent, name_old), (new_parent, name_new)):
            g.reject_denied(caller, parent, name, True, AuditOp.RENAME)
        for decision in (g.policy.decide(zone, Op.DELETE), g.policy.decide(zone, Op.WRITE)):
            if not decision.allowed:
                raise g.refuse(caller, AuditOp.RENAME, src, zone, decision, dest=dst)
        found = self.find(caller, Op.WRITE, old_parent, name_old)
        if found is None:
            raise SandboxError(errno.ENOENT, f"{src} does not exist")
        src_st, src_layer = found
        g.reject_layer(caller, AuditOp.RENAME, old_parent, name_old, src_layer, dst)
        g.check_layer(caller, new_parent, Op.WRITE, name_new)
        # What a rename would replace there: never a file that holds a private key.
        g.reject_private_key(caller, AuditOp.RENAME, new_parent, name_new)
        try:
            dst_st = self.storage.target(new_parent, name_new)
        except HiddenEntry as exc:  # never onto sandboxfs's state or another mount
            raise g.hidden_target(caller, AuditOp.RENAME, src, zone, dst, exc.reason) from None
        moving = [(old_parent, name_old, src_st, new_parent, name_new)]
        if exchange and dst_st is not None:
            moving.append((new_parent, name_new, dst_st, old_parent, name_old))
        for parent, name, st, to_parent, to_name in moving:
            g.reject_move(caller, parent, name, st, to_parent, to_name, src, dst, read)
        # The approval step: moving the user's entry, and replacing one (an overwrite too).
        # Never about moving or replacing what this mount created.
        replaces = dst_st is not None and not exchange
        if self.effects.asks:
            overwrite = replaces and not self._made_here(zone, dst_st)
            for parent, name, st, to_parent, to_name in moving:
                kinds = [] if self._made_here(zone, st) else [Kind.RENAME]
                kinds += [Kind.OVERWRITE] if overwrite else []
                dest = to_parent.vpath(to_name)
                path = functools.partial(parent.vpath, name)
                self._approve(caller, kinds, zone, path, AuditOp.RENAME, dest)
        self._decide(lambda: Request(AuditOp.RENAME, caller, src, zone, dst))
        return zone, src_st, src_layer, dst_st

    def rename(
        self,
        caller: Caller,
        old_parent: Node,
        name_old: bytes,
        new_parent: Node,
        name_new: bytes,
        action: Callable[[Zone, StatLike, int, StatLike | None], None],
        *,
        flags_ok: bool = True,
        exchange: bool = False,
        read: ReadFile | None = None,
    ) -> None:
        """Move old_parent/name_old to new_parent/name_new (`exchange`: swap the two):
        `action(zone, src_st, src_layer, dst_st)` renames; what it replaced leaves the
        quota; recorded as `rename` src -> dest."""
        zone, src_st, src_layer, dst_st = self.check_rename(
            caller,
            old_parent,
            name_old,
            new_parent,
            name_new,
            flags_ok=flags_ok,
            exchange=exchange,
            read=read,
        )
        src, dst = old_parent.vpath(name_old), new_parent.vpath(name_new)
        action(zone, src_st, src_layer, dst_st)
        if dst_st is not None and not exchange and dst_st.st_ino != src_st.st_ino:
            self._removed(zone, dst_st)
        # What moved is not what a grant there covered (Consent.moved).
        for moved_from, moved_to in [(src, dst), (dst, src)][: 2 if exchange else 1]:
            self.effects.consent.moved(moved_from, moved_to, caller.pid, caller.uid)
        self.effects.record(AuditOp.RENAME, src, zone, pid=caller.pid, uid=caller.uid, dest=dst)
