"""The directory callbacks: opening, listing, syncing and releasing directories.

A listing is taken once per handle (at offset 0) with the hidden names already dropped, so
the offsets the kernel is given never reveal where a hidden name sorts.
"""

from __future__ import annotations

import errno
import stat
import time
from dataclasses import dataclass
from typing import Any

import pyfuse3

from sandboxfs.core.errors import SandboxError
from sandboxfs.core.inodes import (
    CONTEXT_NAME,
    CONTROL_INO,
    CONTROL_NAME,
    GUIDE_NAME,
    ROOT_INO,
    Node,
    StatLike,
)
from sandboxfs.core.policy import Zone
from sandboxfs.core.store import HiddenEntry, Listed
from sandboxfs.fuse.handles import DirHandle
from sandboxfs.fuse.ops_base import OperationsBase, guarded
from sandboxfs.fuse.replies import dot_attrs

__all__ = ["DirectoryOperations"]


class DirectoryOperations(OperationsBase):
    """OPENDIR, READDIR, FSYNCDIR and RELEASEDIR (a mixin of SandboxOperations)."""

    @guarded
    def opendir(self, inode: int, ctx: Any) -> int:
        node = self.store.get(inode)
        if not node.is_dir:
            raise SandboxError(errno.ENOTDIR)
        self._gate(ctx.pid).opendir(ctx, node)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = DirHandle(node, None, self.guard.generation, (ctx.pid, ctx.uid, ctx.gid))
        return fh

    @guarded
    def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._dirs[fh]
        node = handle.node
        if handle.generation != self.guard.generation:
            self._gate(handle.caller[0]).relist(_Caller(*handle.caller), node)
            handle.generation = self.guard.generation
        if handle.entries is None or start_id == 0:
            handle.entries = self._dir_entries(node)
            self.replies.changing(node)  # the kernel stops trusting a listed directory's atime
        entries = handle.entries
        replay = node.key is not None and not (
            node.zone is Zone.WORKERS and node.parent is self.store.root
        )
        now = time.monotonic()
        layer_fds: dict[int, int] = {}  # where each layer's names live, looked up once
        for index in range(start_id, len(entries)):
            name, layer, ino, is_dir = entries[index]
            if name == b".":
                attrs = dot_attrs(node)
            elif name == b"..":
                attrs = dot_attrs(node.parent or node)
            elif node.zone is None:
                child = self._virtual_child(node, name)
                attrs = self.replies.node_attrs(child)
                if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                    return
                child.lookups += 1
                continue
            else:
                replayed = self.replies.replayed(node, name, ino, is_dir, now) if replay else None
                if replayed is not None:
                    if not pyfuse3.readdir_reply(token, name, replayed, index + 1):
                        self.store.get(replayed.st_ino).lookups -= 1
                        return
                    continue
                try:
                    fd = layer_fds.get(layer)
                    if fd is None:
                        fd = layer_fds[layer] = self.store.child_dir_fd(node, layer)
                    st = self._entry_stat(node, name, fd, is_dir)
                except PermissionError:
                    if not pyfuse3.readdir_reply(
                        token, name, self.replies.opaque_attrs(), index + 1
                    ):
                        return
                    continue
                if st is None:
                    continue
                child = self.store.remember(node, name, st, layer)
                attrs = self.replies.attrs(child, st)
                if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                    child.lookups -= 1
                    return
                continue
            if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                return

    def _entry_stat(
        self, node: Node, name: bytes, dir_fd: int, listed_as_dir: bool
    ) -> StatLike | None:
        """lstat of a listed entry, or None if it vanished or turned into a directory the
        guard leaves out of listings since the listing (which checked it with the type it had
        then).

        PermissionError means the daemon cannot search the directory (no x bit): the caller
        lists the name without attributes, as getdents does natively.
        """
        try:
            st = self.store.lstat(dir_fd, name)
        except HiddenEntry:  # became a mount root since the listing
            return None
        if st is None:
            return None
        if (
            stat.S_ISDIR(st.st_mode)
            and not listed_as_dir
            and not self.gate.listed(node, name, True, st.st_ino)
        ):
            return None
        return st

    def _dir_entries(self, node: Node) -> list[Listed]:
        dots: list[Listed] = [(b".", 0, 0, True), (b"..", 0, 0, True)]
        if node.ino == ROOT_INO:
            zones: list[Listed] = [(name, 0, 0, True) for name in self._zone_names]
            return dots + zones + [(CONTROL_NAME, 0, 0, True)]
        if node.ino == CONTROL_INO:
            return [*dots, (CONTEXT_NAME, 0, 0, False), (GUIDE_NAME, 0, 0, False)]
        # Names the guard leaves out (Guard.listed: deny-listed ones, only where the level may
        # not list the zone) are dropped here, before offsets are given, so that the offsets
        # do not jump where a hidden name was and reveal how many sort before a visible one.
        if self.gate.lists_all(node):
            return dots + self.store.list_entries(node)
        return dots + [
            entry
            for entry in self.store.list_entries(node)
            if self.gate.listed(node, entry[0], entry[3], entry[2])
        ]

    def _virtual_child(self, node: Node, name: bytes) -> Node:
        if node.ino == ROOT_INO:
            return self._lookup_root(name)
        return self._control_child(name)

    @guarded
    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @guarded
    def fsyncdir(self, fh: int, datasync: bool) -> None:
        node = self._dirs[fh].node
        if node.zone is not None and node.key is not None:
            self.store.fsync_dir(node)


@dataclass(frozen=True, slots=True)
class _Caller:
    pid: int
    uid: int
    gid: int
