"""Backing storage: zone directories held open as descriptors, and our own inode table.

Every name is resolved one component at a time from a directory descriptor with
`O_NOFOLLOW`, so neither a symlink planted in backing storage nor a `..` can lead the daemon
outside a zone's directory. No backing call crosses a mount point (the `find -xdev` rule): an
entry that is the root of another mount — another sandboxfs, bindfs, a tmpfs, a bind mount — is
treated as absent, recognised without sending a request into it (see `syscalls.lstat_at`), and
every open refuses to cross one (`RESOLVE_NO_XDEV`).

Inode numbers (the kernel's node ids, which are also the `st_ino` it shows) are the backing
files' own, as bindfs and containers show them, so that what git recorded in its index outside
still matches inside and nothing is hashed again. Where a backing number cannot be used (below
FIRST_DYNAMIC_INO, at or above SPARE_INO_BASE, or held by another live node: a second
filesystem's or zone's file with the same number, or a file that took a deleted one's number
while the kernel still knows the old one) a number of sandboxfs's own is used, from
SPARE_INO_BASE up and never given twice. A node id is therefore unique among the nodes the
kernel knows, and the generation tells apart two nodes that had the same id one after the other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

from .errors import SandboxError
from .policy import BUILTIN_ZONES, Zone
from .syscalls import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    Stat,
    caches_attributes,
    lstat_at,
    openat2,
    renameat2,
)

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
STATE_DIR_NAME = ".sandbox"

_DIR_OPEN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Every open of a backing name: no symlink, no magic link, no mount point, nothing outside.
_RESOLVE = RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH
# The cache of directory descriptors takes a quarter of the descriptor limit (as read when the
# Store is made: the daemon has raised its soft limit to the hard one), within these bounds;
# the rest is for open files, listings and the daemon's own. Under pressure (EMFILE, ENFILE)
# it gives back all but the _FD_KEEP most recently used, which the request being served may
# hold (a request holds a few directory descriptors at most, each just used).
_FD_CACHE_MIN = 16
_FD_CACHE_MAX = 4096
_FD_KEEP = 8
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)
_SHORT_PATH = 3072  # relpaths walked in one openat2 (PATH_MAX is 4096)
# The open flags passed on to a backing file. The kernel's FUSE OPEN carries internal bits
# too (__FMODE_EXEC for execve), which openat2 refuses with EINVAL where open(2) ignored them.
_OPEN_PASSED = (
    os.O_ACCMODE
    | os.O_APPEND
    | os.O_TRUNC
    | os.O_NONBLOCK
    | os.O_DSYNC
    | os.O_SYNC
    | os.O_NOATIME
    | os.O_EXCL
    | getattr(os, "O_LARGEFILE", 0)
)

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


# A listed entry: name, layer, backing inode number (d_ino), whether it is a directory.
Listed = tuple[bytes, int, int, bool]


class HiddenEntry(SandboxError):
    """A backing entry that is never part of a zone; it looks absent (ENOENT)."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.ENOENT, reason)


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
    # of directory path changes (Store.moves; see Guard._may_protect).
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


class Store:
    """Zone directories, the inode table, and descriptor-relative operations on both."""

    def __init__(
        self,
        zone_dirs: dict[Zone, Path],
        worker_layers: list[Path],
        hidden: set[Identity],
        hidden_names: dict[bytes, set[Identity]] | None = None,
    ) -> None:
        self.hidden = hidden
        # name: the directories (identities) where an entry of that name is never shown,
        # whatever it is now (a login a home holds, replaced by its program while mounted).
        self.hidden_names = hidden_names or {}
        self.root = Node(ROOT_INO, None, None, b"", True, lookups=1)
        self.control = Node(CONTROL_INO, None, self.root, CONTROL_NAME, True)
        self.context = Node(CONTEXT_INO, None, self.control, CONTEXT_NAME, False)
        self.guide = Node(GUIDE_INO, None, self.control, GUIDE_NAME, False)
        self.nodes: dict[int, Node] = {
            n.ino: n for n in (self.root, self.control, self.context, self.guide)
        }
        self.by_key: dict[Key, Node] = {}
        self.zone_roots: dict[Zone, Node] = {}
        self.layer_paths = worker_layers
        self.layer_fds: list[int] = []
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
        # Where each zone's directory was named (the project's zones: see project_zone_dirs).
        self.zone_paths = dict(zone_dirs)
        self.project = zone_dirs[Zone.REPO]
        zones = [*BUILTIN_ZONES, *(z for z in zone_dirs if z not in ZONE_INO)]
        try:
            project_fd = os.open(self.project, _DIR_OPEN)
            try:
                self._open_zones(zones, zone_dirs, project_fd)
            finally:
                os.close(project_fd)
        except BaseException:
            self.close()
            raise
        # On FUSE or network storage a DONT_SYNC statx may be stale: stat again (with sync)
        # whatever is not a mount root.
        self.resync = any(
            caches_attributes(fd)
            for fd in [*self.layer_fds, *(n.fd for n in self.zone_roots.values())]
            if fd >= 0
        )

    def _open_zones(self, zones: list[Zone], zone_dirs: dict[Zone, Path], project_fd: int) -> None:
        for index, zone in enumerate(zones):
            node = Node(4 + index, zone, self.root, zone.value.encode(), True)
            self.zone_roots[zone] = node
            self.nodes[node.ino] = node
            if zone is Zone.WORKERS:
                self.layer_fds = [
                    _open_dir_or_missing(p, self.project, project_fd) for p in self.layer_paths
                ]
                continue
            try:
                node.fd = _open_dir(zone_dirs[zone], self.project, project_fd)
            except OSError as exc:
                raise SandboxError(
                    exc.errno or errno.EIO,
                    f"cannot open the directory of zone {zone.value}, {zone_dirs[zone]}: "
                    f"{_open_failure(exc)}",
                ) from None
            st = os.stat(node.fd)
            node.key = (zone, st.st_dev, st.st_ino)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.fd >= 0:
                os.close(node.fd)
                node.fd = -1
        for fd in self.layer_fds:
            if fd >= 0:
                os.close(fd)
        self.layer_fds = []

    # ----- inode table -------------------------------------------------------------------

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

    # ----- descriptors --------------------------------------------------------------------

    def dir_fd(self, node: Node) -> int:
        """An O_PATH descriptor of a directory node, opened component by component."""
        if node.fd >= 0:
            if node.ino >= FIRST_DYNAMIC_INO:
                self._fd_cache.move_to_end(node.ino)
            return node.fd
        if node.zone is Zone.WORKERS and node.parent is self.root:
            raise SandboxError(errno.EINVAL, "the workers root is a union of directories")
        if not node.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        return self._cache_fd(node, self._open_checked(self.parent_fd(node), node.name, node))

    def checked_dir_fd(self, node: Node) -> int:
        """dir_fd, after checking that node's path from its zone root still leads to it.

        A cached descriptor follows its directory wherever it goes: one moved out of the
        project by its user would otherwise let the mount create and read files there. Before
        anything reads or changes contents, the path is walked again from the zone root
        (one openat2 confined beneath it) and must reach the same inode; else ESTALE, which
        makes the kernel look the path up again.
        """
        if node.parent is None or node.parent.zone is None:
            return self.dir_fd(node)  # a zone root (the workers root raises in dir_fd)
        relpath = node.relpath()
        if len(relpath) < _SHORT_PATH:
            fd = self._open_checked(self._zone_root_fd(node), relpath, node)
        else:  # beyond PATH_MAX: check the parent the same way, then this one step
            fd = self._open_checked(self.parent_fd(node, checked=True), node.name, node)
        if node.fd >= 0:  # the same directory (checked): keep the descriptor callers hold
            os.close(fd)
            return self.dir_fd(node)
        return self._cache_fd(node, fd)

    def _zone_root_fd(self, node: Node) -> int:
        """The descriptor of the backing directory that node's relpath starts from: the zone
        root's, or for /workers the layer of the entry below its root that the path passes
        through (the workers root itself is no directory: its layer says nothing)."""
        top, below = node, node
        while top.parent is not None and top.parent.zone is not None:
            below, top = top, top.parent
        if top.zone is Zone.WORKERS:
            return self.layer_fd(below.layer, create=False)
        return top.fd

    def _open_checked(self, dir_fd: int, path: bytes, node: Node) -> int:
        """An O_PATH descriptor of path (below dir_fd) that must be node's directory."""
        try:
            fd = self.allocating(openat2, dir_fd, path, _DIR_OPEN, 0, _RESOLVE)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EXDEV, errno.ELOOP):
                raise SandboxError(errno.ESTALE, "the directory moved or was replaced") from None
            raise
        if not _is(node, os.stat(fd)):
            os.close(fd)
            raise SandboxError(errno.ESTALE, "the directory moved or was replaced")
        return fd

    def _cache_fd(self, node: Node, fd: int) -> int:
        node.fd = fd
        self._fd_cache[node.ino] = node
        if len(self._fd_cache) > self.fd_cache_size:
            _, old = self._fd_cache.popitem(last=False)
            os.close(old.fd)
            old.fd = -1
        return fd

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

    def parent_fd(self, node: Node, checked: bool = False) -> int:
        """The descriptor of the backing directory that holds node's name (`checked`: see
        checked_dir_fd)."""
        parent = node.parent
        if parent is None:
            raise SandboxError(errno.ENOENT, "the entry was removed")
        if parent.zone is Zone.WORKERS and parent.parent is self.root:
            return self.layer_fd(node.layer, create=False)
        return self.checked_dir_fd(parent) if checked else self.dir_fd(parent)

    def layer_fd(self, layer: int, create: bool) -> int:
        fd = self.layer_fds[layer] if layer < len(self.layer_fds) else -1
        if fd < 0 and create and layer == 0:
            path = self.layer_paths[0]  # <project>/.workers: made in the project's descriptor
            project_fd = self.zone_roots[Zone.REPO].fd
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.name, 0o755, dir_fd=project_fd)
            fd = self.layer_fds[0] = _open_dir_or_missing(path, self.project, project_fd)
        if fd < 0:
            raise SandboxError(errno.ENOENT, "no such workers directory")
        return fd

    def _drop_fd(self, node: Node) -> None:
        if node.fd >= 0 and node.ino >= FIRST_DYNAMIC_INO:
            self._fd_cache.pop(node.ino, None)
            os.close(node.fd)
            node.fd = -1

    # ----- backing operations --------------------------------------------------------------

    def stat_node(self, node: Node) -> StatLike:
        if node.open_fds:
            return os.stat(node.open_fds[-1])
        if node.fd >= 0:
            return os.stat(node.fd)
        st = self.lstat(self.parent_fd(node), node.name)
        if st is None or (node.key is not None and (st.st_dev, st.st_ino) != node.key[1:]):
            raise SandboxError(errno.ESTALE, "the entry moved or was replaced")
        return st

    def lstat(self, dir_fd: int, name: bytes) -> Stat | None:
        """lstat of a backing name, or None when it is missing.

        Raises HiddenEntry for an entry that is never part of a zone: the root of another
        mount (never entered) or sandboxfs's own state, recognised by identity so that a
        case-folding filesystem's `.SANDBOX` is hidden too.
        """
        try:
            st = lstat_at(dir_fd, name)
            if st.mount_root:
                raise HiddenEntry(
                    "it is the root of another mount; sandboxfs never crosses into other mounts"
                )
            if self.resync:  # the name is no mount root: a plain lstat cannot cross
                _refresh(st, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if self.hidden and (st.st_dev, st.st_ino) in self.hidden:
            raise HiddenEntry("it is sandboxfs's own state or mountpoint, not part of any zone")
        where = self.hidden_names.get(name)
        if where is not None:
            parent = os.fstat(dir_fd)
            if (parent.st_dev, parent.st_ino) in where:
                raise HiddenEntry("it is a login in a home made the project, not shown")
        return st

    def stat_child(self, parent: Node, name: bytes, layer: int = 0) -> Stat | None:
        """lstat of parent/name, or None when absent (see lstat)."""
        try:
            dir_fd = self.child_dir_fd(parent, layer)
        except NotADirectoryError:
            return None
        return self.lstat(dir_fd, name)

    def target(self, parent: Node, name: bytes) -> Stat | None:
        """lstat of a rename's or link's destination: in the workers root, the first
        (writable) layer."""
        return self.stat_child(parent, name, 0)

    def created(self, zone: Zone, st: StatLike) -> bool:
        """Whether the node known for st was created through this mount (the same inode and,
        where the filesystem keeps one, birth time)."""
        known = self.by_key.get((zone, st.st_dev, st.st_ino))
        return (
            known is not None
            and known.created_here
            and (not known.birth_ns or known.birth_ns == getattr(st, "st_birthtime_ns", 0))
        )

    def stat(self, node: Node) -> StatLike:
        return self.stat_node(node)

    def find(self, parent: Node, name: bytes) -> tuple[Stat, int] | None:
        """lstat of a name in a directory node and its layer; for the workers root, the first
        layer holding the name wins."""
        if parent.zone is Zone.WORKERS and parent.parent is self.root:
            for layer, fd in enumerate(self.layer_fds):
                if fd >= 0 and (st := self.lstat(fd, name)) is not None:
                    return st, layer
            return None
        st = self.stat_child(parent, name)
        return (st, parent.layer) if st is not None else None

    def child_dir_fd(
        self, parent: Node, layer: int = 0, create: bool = False, checked: bool = False
    ) -> int:
        """Where names inside `parent` live; for the workers root, one of its layers.
        `checked`: before reading or changing contents (see checked_dir_fd)."""
        if parent.zone is Zone.WORKERS and parent.parent is self.root:
            return self.layer_fd(layer, create)
        return self.checked_dir_fd(parent) if checked else self.dir_fd(parent)

    def usage(self, zone: Zone) -> tuple[int, int]:
        """(bytes of regular files, entries) below a zone's root, each inode once, never
        crossing into another mount or sandboxfs's own state (for quotas).

        Depth first, holding the descriptors of the directories on the current path only
        (not of every directory found: a wide tree would use up the descriptor table)."""
        root = self.zone_roots[zone]
        seen: set[tuple[int, int]] = set()
        nbytes = 0
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        path: list[tuple[int, list[bytes]]] = []

        def enter(fd: int) -> None:
            nonlocal nbytes
            below: list[bytes] = []
            path.append((fd, below))
            with contextlib.suppress(OSError):
                dev = os.fstat(fd).st_dev
                with self.allocating(os.scandir, b"/proc/self/fd/%d" % fd) as entries:
                    for entry in entries:
                        st = entry.stat(follow_symlinks=False)
                        key = (st.st_dev, st.st_ino)
                        if st.st_dev != dev or key in self.hidden or key in seen:
                            continue
                        seen.add(key)
                        if stat.S_ISREG(st.st_mode):
                            nbytes += st.st_size
                        elif stat.S_ISDIR(st.st_mode):
                            below.append(entry.name)

        try:
            enter(self.allocating(os.open, b".", flags, dir_fd=root.fd))
            while path:
                fd, below = path[-1]
                if not below:
                    os.close(fd)
                    path.pop()
                    continue
                with contextlib.suppress(OSError):
                    enter(self.allocating(openat2, fd, below.pop(), flags, 0, _RESOLVE))
        finally:
            for fd, _ in path:
                os.close(fd)
        return nbytes, len(seen)

    def list_entries(self, node: Node) -> list[Listed]:
        """The entries of a directory node, sorted by name, with their layer; for the workers
        root, the union of its layers (each layer's names sorted, the first layer with a name
        winning)."""
        if node.zone is Zone.WORKERS and node.parent is self.root:
            seen: set[bytes] = set()
            union: list[Listed] = []
            for layer, fd in enumerate(self.layer_fds):
                if fd < 0:
                    continue
                dev = os.stat(fd).st_dev
                for name, ino, is_dir in self.allocating(_scan, fd):
                    if name not in seen and (dev, ino) not in self.hidden:
                        seen.add(name)
                        union.append((name, layer, ino, is_dir))
            return union
        fd = self.checked_dir_fd(node)
        dev = node.key[1] if node.key is not None else os.stat(fd).st_dev
        names: set[bytes] = set()
        if self.hidden_names:
            here = node.key[1:] if node.key is not None else None
            names = {n for n, where in self.hidden_names.items() if here in where}
        return [
            (name, node.layer, ino, is_dir)
            for name, ino, is_dir in self.allocating(_scan, fd)
            if (dev, ino) not in self.hidden and name not in names
        ]

    def open_path_fd(self, node: Node) -> int:
        """A fresh O_PATH descriptor of node itself (for xattrs), never following a symlink or
        crossing into a mount."""
        return self.allocating(
            openat2,
            self.parent_fd(node),
            node.name,
            os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
            0,
            _RESOLVE,
        )

    def open_file(self, node: Node, flags: int) -> int:
        """Open node's backing file by name, checked to still be node's regular file (see
        open_file_stat)."""
        return self.open_file_stat(node, flags)[0]

    def open_file_stat(self, node: Node, flags: int) -> tuple[int, os.stat_result]:
        """Open node's backing file by name, checked to still be node's regular file; the
        descriptor and the fstat that checked it (the FUSE adapter's open needs it too).

        The name may have been replaced outside the mount since the kernel cached it, by a
        FIFO (whose open would block the whole daemon) or by another file. O_NONBLOCK keeps
        the open from waiting; the fstat then compares the identity; a mismatch is ESTALE,
        which makes the kernel look the path up again (and open a FIFO itself). O_NONBLOCK
        stays set: a regular file ignores it for reads and writes, and where a lease would
        make the open wait, failing is what the daemon wants.
        """
        parent_fd = self.parent_fd(node, checked=True)
        # Never open anything but node's regular file: not even with O_NONBLOCK, since
        # opening a device can act on it. The fstat below catches a swap after this check.
        found = self.lstat(parent_fd, node.name)
        if found is not None and _is(node, found) and stat.S_ISLNK(found.st_mode):
            raise SandboxError(errno.ELOOP, "a symlink is never followed")
        if found is None or not stat.S_ISREG(found.st_mode) or not _is(node, found):
            raise SandboxError(errno.ESTALE, "the file moved or was replaced")
        fd = self.allocating(
            openat2,
            parent_fd,
            node.name,
            (flags & _OPEN_PASSED) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            0,
            _RESOLVE,
        )
        try:
            st = os.stat(fd)
            if not stat.S_ISREG(st.st_mode) or not _is(node, st):
                raise SandboxError(errno.ESTALE, "the file moved or was replaced")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def create_file(self, dir_fd: int, name: bytes, flags: int, mode: int) -> int:
        """Create (or, without O_EXCL, open) a regular file, never through a mount point."""
        fd = self.allocating(
            openat2,
            dir_fd,
            name,
            (flags & _OPEN_PASSED) | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            mode,
            _RESOLVE,
        )
        try:
            if not stat.S_ISREG(os.stat(fd).st_mode):  # a FIFO or device raced in: look again
                raise SandboxError(errno.ESTALE, "not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    # ----- changing entries: every backing call a front end makes once the guard allowed it --

    def reopen(self, node: Node, flags: int) -> int:
        """A new descriptor of node's file, through an open one if there is one."""
        if node.open_fds:
            return self.allocating(
                os.open, f"/proc/self/fd/{node.open_fds[-1]}", flags | os.O_CLOEXEC
            )
        return self.open_file(node, flags)

    def change_meta(
        self,
        node: Node,
        mode: int | None = None,
        owner: tuple[int, int] | None = None,
        times: tuple[int, int] | None = None,
    ) -> None:
        """chmod, chown and utime of node: through an open descriptor when there is one (it
        still works after the name was unlinked or replaced), else by parent + name, checked
        to still be node's."""
        target: int | bytes
        how: dict[str, Any] = {}
        if node.open_fds:
            target = node.open_fds[-1]
        else:
            how = {"dir_fd": self.parent_fd(node, checked=True), "follow_symlinks": False}
            self.stat_node(node)  # the name must still be node's (ESTALE otherwise)
            target = node.name
        if mode is not None:
            os.chmod(target, mode, **how)
        if owner is not None:
            os.chown(target, *owner, **how)
        if times is not None:
            os.utime(target, ns=times, **how)

    def readlink(self, node: Node) -> bytes:
        return os.readlink(node.name, dir_fd=self.parent_fd(node))

    def give(self, dir_fd: int, name: bytes, uid: int, gid: int) -> None:
        """Make a new entry the caller's, as the kernel would on a local filesystem."""
        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    def make_dir(self, dir_fd: int, name: bytes, mode: int) -> None:
        os.mkdir(name, mode, dir_fd=dir_fd)

    def make_symlink(self, dir_fd: int, name: bytes, target: bytes) -> None:
        os.symlink(target, name, dir_fd=dir_fd)

    def make_node(self, dir_fd: int, name: bytes, mode: int) -> None:
        os.mknod(name, mode, dir_fd=dir_fd)

    def link_source(self, node: Node) -> int:
        """The descriptor of the directory holding node's name, checked to still lead to node
        (ESTALE otherwise): what `link` needs, found with the daemon's own identity (the walk
        from the zone root passes directories a caller may not search)."""
        src_fd = self.parent_fd(node, checked=True)
        self.stat_node(node)
        return src_fd

    def link(self, src_fd: int, name: bytes, dir_fd: int, new_name: bytes) -> None:
        """A second name, dir_fd/new_name, for src_fd/name (see link_source)."""
        os.link(name, new_name, src_dir_fd=src_fd, dst_dir_fd=dir_fd, follow_symlinks=False)

    def remove(self, dir_fd: int, name: bytes, is_dir: bool) -> None:
        (os.rmdir if is_dir else os.unlink)(name, dir_fd=dir_fd)

    def rename(self, src_fd: int, old: bytes, dst_fd: int, new: bytes, flags: int) -> None:
        renameat2(src_fd, old, dst_fd, new, flags)

    def fsync_dir(self, node: Node) -> None:
        dir_fd = self.dir_fd(node)
        fd = self.allocating(
            os.open, b".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd
        )
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def statvfs(self, zone: Zone) -> os.statvfs_result:
        return os.statvfs(self.zone_roots[zone].fd)

    def read_whole(self, fd: int, limit: int) -> tuple[bytes, os.stat_result] | None:
        """The whole content of an open file of at most `limit` bytes, read through a new
        read-only descriptor; None when it is larger, unreadable or changed while read."""
        try:
            rfd = self.allocating(os.open, f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # e.g. a write-only file the daemon may not read
        try:
            st = os.fstat(rfd)
            if st.st_size > limit:
                return None
            data = os.pread(rfd, st.st_size, 0)
            return (data, st) if len(data) == st.st_size else None
        except OSError:
            return None
        finally:
            os.close(rfd)

    # ----- extended attributes ------------------------------------------------------------

    def get_xattr(self, node: Node, name: bytes) -> bytes | None:
        """node's attribute `name`; None for symlinks and virtual nodes, which carry none."""
        return self._with_xattr_path(node, lambda path: os.getxattr(path, name), None)

    def list_xattrs(self, node: Node) -> list[str]:
        return self._with_xattr_path(node, os.listxattr, [])

    def set_xattr(self, node: Node, name: bytes, value: bytes) -> bool:
        """False for a node that carries no attributes (a symlink)."""

        def put(path: str) -> bool:
            os.setxattr(path, name, value)
            return True

        return self._with_xattr_path(node, put, False)

    def remove_xattr(self, node: Node, name: bytes) -> bool:
        def remove(path: str) -> bool:
            os.removexattr(path, name)
            return True

        return self._with_xattr_path(node, remove, False)

    def _with_xattr_path(self, node: Node, fn: Callable[[str], R], missing: R) -> R:
        """fn of a /proc path to node (via an O_PATH descriptor), or `missing` for symlinks
        and virtual nodes."""
        if node.zone is None or (node.key is None and node.ino < FIRST_DYNAMIC_INO):
            return missing
        fd = -1
        if node.open_fds:
            path = f"/proc/self/fd/{node.open_fds[-1]}"
        elif node.is_dir:
            path = f"/proc/self/fd/{self.dir_fd(node)}"
        else:
            fd = self.open_path_fd(node)
            if stat.S_ISLNK(os.stat(fd).st_mode):
                os.close(fd)
                return missing
            path = f"/proc/self/fd/{fd}"
        try:
            return fn(path)
        finally:
            if fd >= 0:
                os.close(fd)


def fd_cache_size() -> int:
    """How many directory descriptors a Store keeps open (see _FD_CACHE_MIN)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _FD_CACHE_MAX
    return max(_FD_CACHE_MIN, min(_FD_CACHE_MAX, soft // 4))


def _is(node: Node, st: StatLike) -> bool:
    """Whether a stat is of node's backing inode (the same number, and where both are known,
    the same birth time: ext4 hands a freed inode number to the next file at once)."""
    if node.key is not None and (st.st_dev, st.st_ino) != node.key[1:]:
        return False
    birth = getattr(st, "st_birthtime_ns", 0)
    return not (birth and node.birth_ns and birth != node.birth_ns)


def _forget_link(node: Node, parent: Node, name: bytes) -> None:
    """Drop parent/name from node's other known names (the current one is node.parent/name)."""
    node.links = tuple((p, n) for p, n in node.links if not (p is parent and n == name))


def _open_dir(path: Path, project: Path, project_fd: int) -> int:
    """An O_PATH descriptor of a zone's directory (or a workers layer).

    One inside the project is opened from the project's descriptor in one openat2 that
    follows no symlink on the way (RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH): the sandbox can
    make links in the project through /repo, and a zone's directory must never lead anywhere
    else. The project itself and directories beside it are named by the user and opened by
    path (the last component never a link). Mounts may be crossed here: a zone may be one.
    """
    if path != project and path.is_relative_to(project):
        rel = os.fsencode(path.relative_to(project))
        resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH
        return openat2(project_fd, rel, _DIR_OPEN, 0, resolve)
    return os.open(path, _DIR_OPEN)


def _open_failure(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symbolic link is on the way from the project, and none is followed"
    if exc.errno == errno.ENOTDIR:
        return "not a directory (a symbolic link?)"
    return exc.strerror or str(exc)


def _open_dir_or_missing(path: Path, project: Path, project_fd: int) -> int:
    """_open_dir, or -1 where the directory is missing, not a directory or reached only
    through a link in the project (as if missing: nothing is listed or created there)."""
    try:
        return _open_dir(path, project, project_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return -1
        raise


def _scan(fd: int) -> list[tuple[bytes, int, bool]]:
    """(name, inode number, is a directory) of each entry, sorted by name.

    O_PATH descriptors cannot be read. Reopen the directory through /proc rather than as "."
    relative to itself, which would need its x bit (natively, listing needs only r). A bytes
    path gives the names' exact bytes.
    """
    with os.scandir(b"/proc/self/fd/%d" % fd) as entries:
        found = [(e.name, e.inode(), e.is_dir(follow_symlinks=False)) for e in entries]
    found.sort()
    return found


def _refresh(st: Stat, fresh: os.stat_result) -> None:
    """Copy what may have been stale into a DONT_SYNC statx result."""
    for field in (
        "st_mode",
        "st_nlink",
        "st_uid",
        "st_gid",
        "st_size",
        "st_blocks",
        "st_atime_ns",
        "st_mtime_ns",
        "st_ctime_ns",
    ):
        setattr(st, field, getattr(fresh, field))


def ensure_dirs(base: Path, *parts: str, mode: int = 0o700) -> Path:
    """Create base/parts... one level at a time, refusing to pass through a symlink."""
    fd = os.open(base, _DIR_OPEN)
    try:
        for part in parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode, dir_fd=fd)
            try:
                nfd = os.open(part, _DIR_OPEN, dir_fd=fd)
            except (NotADirectoryError, OSError) as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SandboxError(
                        exc.errno, f"{base.joinpath(part)} is not a directory"
                    ) from None
                raise
            os.close(fd)
            fd = nfd
            base = base / part
    finally:
        os.close(fd)
    return base
