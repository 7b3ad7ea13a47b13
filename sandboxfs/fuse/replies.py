"""What the kernel is told about inodes, and for how long: the attribute replies of the FUSE
adapter, and the last attributes given per inode, which a listing may repeat.

pyfuse3's types live here and in operations.py only; nothing here decides or audits.
"""

from __future__ import annotations

import stat
import time
from collections.abc import Callable

import pyfuse3

from sandboxfs.core.inodes import CONTEXT_INO, FIRST_DYNAMIC_INO, GUIDE_INO, Node, StatLike
from sandboxfs.core.policy import Zone
from sandboxfs.core.store import Store
from sandboxfs.fuse.host_watch import HostWatch

# At most this many attribute replies are kept for listings to repeat (see replayed).
_GIVEN_LIMIT = 1 << 16


class Replies:
    """Attribute replies for one mount."""

    def __init__(
        self,
        store: Store,
        readable: Callable[[Zone], bool],
        context_size: Callable[[], int],
        *,
        entry_timeout: float,
        attr_timeout: float,
        owner: tuple[int, int],
        host_watch: HostWatch | None = None,
        watched_timeout: float = 0.0,
        guide_size: Callable[[], int] = lambda: 0,
    ) -> None:
        self.store = store
        self.readable = readable
        self.context_size = context_size
        self.guide_size = guide_size
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        # Entries of a backing directory that host_watch watches may be held this long.
        self.host_watch = host_watch
        self.watched_timeout = watched_timeout
        if host_watch is not None:
            host_watch.told = self.told
        self.owner = owner
        self.mounted_ns = time.time_ns()
        # inode -> (monotonic time until which the kernel may use them, attributes): the last
        # attributes given to the kernel for each inode, which a listing may repeat.
        self.given: dict[int, tuple[float, pyfuse3.EntryAttributes]] = {}

    # ----- attributes -----------------------------------------------------------------------------

    def attrs(self, node: Node, st: StatLike) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.ino
        entry.generation = node.generation
        if self._watched(node, st.st_nlink):
            entry.entry_timeout = entry.attr_timeout = self.watched_timeout
        else:
            entry.entry_timeout = self.entry_timeout
            entry.attr_timeout = self.attr_timeout
        entry.st_mode = st.st_mode
        entry.st_nlink = st.st_nlink
        entry.st_uid = st.st_uid
        entry.st_gid = st.st_gid
        entry.st_rdev = st.st_rdev
        entry.st_size = st.st_size
        entry.st_blksize = st.st_blksize
        entry.st_blocks = st.st_blocks
        entry.st_atime_ns = st.st_atime_ns
        entry.st_mtime_ns = st.st_mtime_ns
        entry.st_ctime_ns = st.st_ctime_ns
        if node.ino >= FIRST_DYNAMIC_INO:
            given = self.given
            if len(given) >= _GIVEN_LIMIT:
                given.clear()
            given[node.ino] = (time.monotonic() + entry.attr_timeout, entry)
        return entry

    def told(self, ino: int, st: StatLike) -> bool:
        """Whether the kernel holds no attributes of `ino` but those of `st`: the last given
        are st's (same ctime, mtime and size), or ran out. False where that is not known (none
        recorded: the kernel may still hold some)."""
        given = self.given.get(ino)
        if given is None:
            return False
        until, entry = given
        if until <= time.monotonic():
            return True
        return (
            entry.st_ctime_ns == st.st_ctime_ns
            and entry.st_mtime_ns == st.st_mtime_ns
            and entry.st_size == st.st_size
        )

    def _watched(self, node: Node, nlink: int) -> bool:
        """Whether every change to node's name and attributes is reported (see
        sandboxfs.fuse.host_watch): its directory is watched and, for a directory, itself;
        a file has no other name. What is not watched yet is watched from now on, and held
        long from its next reply: this one's lstat came before the watch."""
        watch = self.host_watch
        parent = node.parent
        if watch is None or parent is None:
            return False
        watched = parent.watch >= 0
        if not watched:
            watch.cover(parent)
        if node.is_dir:
            if node.watch < 0:
                watch.cover(node)
                return False
            return watched
        return watched and nlink == 1

    def changing(self, *nodes: Node | None) -> None:
        """Forget the attributes last given for nodes about to change through the mount (or
        whose atime the kernel stops trusting), so that no listing repeats them."""
        given = self.given
        for node in nodes:
            if node is not None:
                given.pop(node.ino, None)

    def replayed(
        self, parent: Node, name: bytes, ino: int, is_dir: bool, now: float
    ) -> pyfuse3.EntryAttributes | None:
        """The attributes last given to the kernel for the inode listed as parent/name, if
        the kernel may still use them and nothing changed them through the mount since.

        READDIRPLUS needs attributes for every entry; a `git status` lists every directory of
        a tree whose attributes the kernel holds anyway. Repeating them, with only the
        validity they have left, tells the kernel nothing it does not already know, and saves
        an lstat and a reply build per entry. Only for an inode already known under exactly
        this name whose backing inode number the directory still lists; anything else is
        stat'ed.
        """
        assert parent.zone is not None and parent.key is not None
        node = self.store.by_key.get((parent.zone, parent.key[1], ino))
        if node is None or node.is_dir != is_dir:
            return None
        if not (node.parent is parent and node.name == name) and (parent, name) not in node.links:
            return None
        given = self.given.get(node.ino)
        if given is None:
            return None
        until, entry = given
        left = until - now
        if left <= 0:
            return None
        entry.attr_timeout = left
        node.lookups += 1
        return entry

    def virtual_attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        """Attributes of `/`, the zone roots and `/.sandboxfs`: modes that let requests reach
        the daemon, so every refusal is decided and audited here rather than by the kernel."""
        if node.zone is not None and node.key is not None and self.readable(node.zone):
            st = self.store.stat_node(node)
            entry = self.attrs(node, st)
            entry.st_mode = stat.S_IFDIR | 0o755
            return entry
        # `/`, /.sandboxfs, and a zone root the level cannot read or list: it looks like an
        # empty directory made at mount time, so its size, times, owner and link count (which
        # counts hidden subdirectories) say nothing about what it holds.
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.ino
        entry.entry_timeout = self.entry_timeout
        entry.attr_timeout = self.attr_timeout
        entry.st_uid, entry.st_gid = self.owner
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = self.mounted_ns
        if node.ino in (CONTEXT_INO, GUIDE_INO):
            entry.st_mode = stat.S_IFREG | 0o644  # writes reach the daemon: refused, audited
            entry.st_nlink = 1
            entry.st_size = self.context_size() if node.ino == CONTEXT_INO else self.guide_size()
        else:
            entry.st_mode = stat.S_IFDIR | 0o755
            entry.st_nlink = 2
        entry.st_blksize = 4096
        return entry

    def node_attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        if node.ino < FIRST_DYNAMIC_INO:
            return self.virtual_attrs(node)
        return self.attrs(node, self.store.stat_node(node))

    def negative_entry(self) -> pyfuse3.EntryAttributes:
        # st_ino 0 lets the kernel cache "does not exist" for entry_timeout. Never longer, even
        # in a watched directory: a trust change cannot name the negative entries to forget.
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = 0
        entry.entry_timeout = self.entry_timeout
        return entry

    def opaque_attrs(self) -> pyfuse3.EntryAttributes:
        """A listing entry without attributes: an inode number nothing else has and no file
        type, which the kernel shows by name and then forgets; a later stat asks lookup."""
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = self.store.spare_ino()
        return entry


def dot_attrs(node: Node) -> pyfuse3.EntryAttributes:
    """Listing attributes of `.` and `..`: the kernel takes only their inode number and type
    (it never makes dentries or counts lookups for them), so no stat is needed."""
    entry = pyfuse3.EntryAttributes()
    entry.st_ino = node.ino
    entry.st_mode = stat.S_IFDIR
    return entry
