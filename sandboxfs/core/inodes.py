"""The inode table: the nodes the kernel knows, their numbers, and the directory descriptors
they hold.

Inode numbers (the kernel's node ids, which are also the `st_ino` it shows) are the backing
files' own, as bindfs and containers show them, so that what git recorded in its index outside
still matches inside and nothing is hashed again. Where a backing number cannot be used (below
FIRST_DYNAMIC_INO, at or above SPARE_INO_BASE, or held by another live node: a second
filesystem's or zone's file with the same number, or a file that took a deleted one's number
while the kernel still knows the old one) a number of sandboxfs's own is used, from
SPARE_INO_BASE up and never given twice. A node id is therefore unique among the nodes the
kernel knows, and the generation tells apart two nodes that had the same id one after the other.

A directory node holds its O_PATH descriptor while it is cached (a bounded cache: a node that
is forgotten or removed closes its own); every descriptor the daemon makes while serving goes
through `InodeTable.allocating`, so that a full descriptor table never jams the mount.
"""

from __future__ import annotations

import errno
import os
import resource
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar

from .errors import SandboxError
from .policy import BUILTIN_ZONES, Zone

R = TypeVar("R")
P = ParamSpec("P")

ROOT_INO = 1
CONTROL_INO = 2
CONTEXT_INO = 3
# The built-in zone roots; project zones follow (up to FIRST_DYNAMIC_INO - 1).
ZONE_INO = {zone: 4 + i for i, zone in enumerate(BUILTIN_ZONES)}
FIRST_DYNAMIC_INO = 64
GUIDE_INO = FIRST_DYNAMIC_INO - 1  # /.sandboxfs/README (zone roots stop well below it)
# Numbers sandboxfs makes up start here: above what local filesystems hand out in practice
# (ext4's are 32 bits; XFS's and btrfs's stay below 2**48), below 2**53 (JavaScript reads
# st_ino as a double). Backing numbers from here up (overlayfs with xino, some network
# filesystems) are not passed on.
SPARE_INO_BASE = 1 << 48

CONTROL_NAME = b".sandboxfs"
CONTEXT_NAME = b"context.json"
GUIDE_NAME = b"README"

# The cache of directory descriptors takes a quarter of the descriptor limit (as read when the
# table is made: the daemon has raised its soft limit to the hard one), within these bounds;
# the rest is for open files, listings and the daemon's own. Under pressure (EMFILE, ENFILE)
# it gives back all but the _FD_KEEP most recently used, which the request being served may
# hold (a request holds a few directory descriptors at most, each just used).
_FD_CACHE_MIN = 16
_FD_CACHE_MAX = 4096
_FD_KEEP = 8
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)

Key = tuple[Zone, int, int]
# (st_dev, st_ino) of backing directories that are never part of a zone (the state dir).
Identity = tuple[int, int]


class StatLike(Protocol):
    """What attribute replies need of a stat: `os.stat_result` (fstat) or `syscalls.Stat`."""

    @property
    def st_mode(self) -> int: ...
    @property
    def st_ino(self) -> int: ...
    @property
    def st_dev(self) -> int: ...
    @property
    def st_nlink(self) -> int: ...
    @property
    def st_uid(self) -> int: ...
    @property
    def st_gid(self) -> int: ...
    @property
    def st_size(self) -> int: ...
    @property
    def st_rdev(self) -> int: ...
    @property
    def st_blksize(self) -> int: ...
    @property
    def st_blocks(self) -> int: ...
    @property
    def st_atime_ns(self) -> int: ...
    @property
    def st_mtime_ns(self) -> int: ...
    @property
    def st_ctime_ns(self) -> int: ...


@dataclass(eq=False, slots=True)
class Node:
    """One inode the kernel knows: where it lives (parent + name) and how often it was looked up.

    Paths are not stored: a node names its parent node, so renaming a directory moves every
    cached child with it.
    """

    ino: int
    zone: Zone | None
    parent: Node | None
    name: bytes
    is_dir: bool
    key: Key | None = None
    layer: int = 0
    lookups: int = 0
    created_here: bool = False
    fd: int = -1
    # Tuples, not lists: the empty tuple is shared, so a million idle nodes cost nothing here.
    open_fds: tuple[int, ...] = ()
    cache_stamp: tuple[int, int] | None = None
    links: tuple[tuple[Node, bytes], ...] = ()
    last_vpath: str = ""
    # Birth time of the backing inode (0 where the filesystem has none): an inode number reused
    # after a delete outside the mount is another file, and gets another node.
    birth_ns: int = 0
    # Told to the kernel with the node id: a node given a backing number gets a larger one than
    # every earlier node that had the number (0 for the fixed and spare numbers, given once).
    generation: int = 0
    # For a directory: whether a protect pattern could match inside it, as of the given count
    # of directory path changes (Store.moves; see Guard.could_protect_inside).
    protect_memo: tuple[int, bool] = (-1, False)
    # For a directory: the deny pattern that it or a directory above it matches (None: none),
    # as of the given count of directory path changes (see Guard.denied_pattern).
    deny_memo: tuple[int, str | None] = (-1, None)
    # For a directory: its inotify watch (see sandboxfs.fuse.host_watch; -1 none yet, -2 none
    # possible).
    watch: int = -1

    def relpath(self) -> bytes:
        """The path below the zone root, b"" for the root itself."""
        parts: list[bytes] = []
        node: Node | None = self
        while node is not None and node.parent is not None and node.parent.zone is not None:
            parts.append(node.name)
            node = node.parent
        return b"/".join(reversed(parts))

    def vpath(self, child: bytes | None = None) -> str:
        """The virtual path inside the mount, for audit entries and reasons.

        A node whose last name was removed keeps the path it had then.
        """
        if self.parent is None and self.ino != ROOT_INO and self.last_vpath:
            return self.last_vpath
        parts: list[bytes] = [child] if child is not None else []
        node: Node | None = self
        while node is not None and node.ino != ROOT_INO:
            parts.append(node.name)
            node = node.parent
        return "/" + "/".join(p.decode("utf-8", "surrogateescape") for p in reversed(parts))


class InodeTable:
    """The nodes the kernel knows, by number and by backing identity, and the cache of the
    directory descriptors they hold (the base of Store: see store)."""

    def __init__(self) -> None:
        self.root = Node(ROOT_INO, None, None, b"", True, lookups=1)
        self.control = Node(CONTROL_INO, None, self.root, CONTROL_NAME, True)
        self.context = Node(CONTEXT_INO, None, self.control, CONTEXT_NAME, False)
        self.guide = Node(GUIDE_INO, None, self.control, GUIDE_NAME, False)
        self.nodes: dict[int, Node] = {
            n.ino: n for n in (self.root, self.control, self.context, self.guide)
        }
        self.by_key: dict[Key, Node] = {}
        self._fd_cache: OrderedDict[int, Node] = OrderedDict()
        self.fd_cache_size = fd_cache_size()
        # Counts every change of a known directory's parent or name (renames through the
        # mount, names found moved): what is remembered about a directory's path (the memos on
        # Node) is valid until it changes. A file's names (hard links, renames) are no
        # directory's path, so they leave it alone: `git commit` links thousands of objects.
        self.moves = 0
        self._next_spare = SPARE_INO_BASE
        # The generation of nodes given a backing number now: one more after each node dropped,
        # so a number's next node always has a larger one (and nodes made in between share one
        # int object: no memory per node beyond the slot).
        self._generation = 1

    def get(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise SandboxError(errno.ESTALE, "unknown inode") from None

    def remember(self, parent: Node, name: bytes, st: StatLike, layer: int = 0) -> Node:
        """The node for a backing entry just found at parent/name, created if new.

        Counts one lookup, as the kernel will. A backing inode seen under a second name is
        the same node (hard links share one inode), now reachable under the newer name too.
        """
        zone = parent.zone
        assert zone is not None
        key = (zone, st.st_dev, st.st_ino)
        is_dir = stat.S_ISDIR(st.st_mode)
        birth = getattr(st, "st_birthtime_ns", 0)
        node = self.by_key.get(key)
        if node is not None and (
            node.is_dir != is_dir or (birth and node.birth_ns and birth != node.birth_ns)
        ):
            del self.by_key[key]
            node = None
        if node is None:
            node = Node(0, zone, parent, name, is_dir, key=key, layer=layer, birth_ns=birth)
            self._number(node, st.st_ino)
            self.nodes[node.ino] = node
            self.by_key[key] = node
        elif node.parent is not parent or node.name != name:
            self.moves += 1 if is_dir else 0
            _forget_link(node, parent, name)
            if not is_dir and node.parent is not None:
                node.links = (*node.links, (node.parent, node.name))
            node.parent, node.name, node.layer = parent, name, layer
        node.lookups += 1
        return node

    def _number(self, node: Node, backing: int) -> None:
        """Give a new node the backing file's inode number where no live node has it, else a
        spare one (see the module's docstring)."""
        if FIRST_DYNAMIC_INO <= backing < SPARE_INO_BASE and backing not in self.nodes:
            node.ino, node.generation = backing, self._generation
        else:
            node.ino = self.spare_ino()

    def spare_ino(self) -> int:
        """An inode number no other node or entry ever has (for a node whose backing number
        cannot be used, and for entries shown without attributes)."""
        self._next_spare += 1
        return self._next_spare - 1

    def forget(self, ino: int, count: int) -> None:
        node = self.nodes.get(ino)
        if node is None or node.ino < FIRST_DYNAMIC_INO:
            return
        node.lookups -= count
        if node.lookups > 0:
            return
        del self.nodes[ino]
        self._generation += 1
        if node.key is not None and self.by_key.get(node.key) is node:
            del self.by_key[node.key]
        self._drop_fd(node)

    def detach(self, node: Node, parent: Node, name: bytes, remaining: int) -> None:
        """Forget the name parent/name of node after it was unlinked or replaced.

        `remaining` is the backing link count left; while it is positive the node stays
        reachable through another known name.
        """
        _forget_link(node, parent, name)
        if node.parent is parent and node.name == name:
            if node.links and remaining > 0:
                node.parent, node.name = node.links[-1]
                node.links = node.links[:-1]
                self.moves += 1 if node.is_dir else 0
            else:
                node.last_vpath = node.vpath()
                node.parent, node.name = None, b""
                self._drop_fd(node)
        if (remaining < 1 or node.is_dir) and node.key and self.by_key.get(node.key) is node:
            del self.by_key[node.key]

    def moved(
        self, node: Node, old_parent: Node, old_name: bytes, parent: Node, name: bytes
    ) -> None:
        """Record that old_parent/old_name is now parent/name (children follow a directory)."""
        self.moves += 1 if node.is_dir else 0
        _forget_link(node, parent, name)
        if node.parent is old_parent and node.name == old_name:
            node.parent, node.name = parent, name
        else:
            _forget_link(node, old_parent, old_name)
            node.links = (*node.links, (parent, name))

    # ----- directory descriptors held by nodes ---------------------------------------------

    def _cache_fd(self, node: Node, fd: int) -> int:
        node.fd = fd
        self._fd_cache[node.ino] = node
        if len(self._fd_cache) > self.fd_cache_size:
            _, old = self._fd_cache.popitem(last=False)
            os.close(old.fd)
            old.fd = -1
        return fd

    def _used_fd(self, node: Node) -> None:
        """node's cached descriptor was just used: the cache gives it back last."""
        if node.ino >= FIRST_DYNAMIC_INO:
            self._fd_cache.move_to_end(node.ino)

    def make_room(self) -> int:
        """Give back cached directory descriptors after the descriptor limit was met: all but
        the _FD_KEEP most recently used (the request being served may hold those). Returns
        how many were closed; each is opened again when next needed."""
        released = 0
        while len(self._fd_cache) > _FD_KEEP:
            _, old = self._fd_cache.popitem(last=False)
            os.close(old.fd)
            old.fd = -1
            released += 1
        return released

    def allocating(self, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """call(...), which makes a descriptor; where the descriptor limit stops it (EMFILE,
        ENFILE), once more after make_room gave some back. Every descriptor the daemon makes
        while serving goes through here, so that a full table never jams the mount."""
        try:
            return call(*args, **kwargs)
        except OSError as exc:
            if exc.errno not in _NO_DESCRIPTOR or not self.make_room():
                raise
        return call(*args, **kwargs)

    def _drop_fd(self, node: Node) -> None:
        if node.fd >= 0 and node.ino >= FIRST_DYNAMIC_INO:
            self._fd_cache.pop(node.ino, None)
            os.close(node.fd)
            node.fd = -1


def fd_cache_size() -> int:
    """How many directory descriptors an InodeTable keeps open (see _FD_CACHE_MIN)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _FD_CACHE_MAX
    return max(_FD_CACHE_MIN, min(_FD_CACHE_MAX, soft // 4))


def same_inode(node: Node, st: StatLike) -> bool:
    """Whether a stat is of node's backing inode (the same number, and where both are known,
    the same birth time: ext4 hands a freed inode number to the next file at once)."""
    if node.key is not None and (st.st_dev, st.st_ino) != node.key[1:]:
        return False
    birth = getattr(st, "st_birthtime_ns", 0)
    return not (birth and node.birth_ns and birth != node.birth_ns)


def _forget_link(node: Node, parent: Node, name: bytes) -> None:
    """Drop parent/name from node's other known names (the current one is node.parent/name)."""
    node.links = tuple((p, n) for p, n in node.links if not (p is parent and n == name))
