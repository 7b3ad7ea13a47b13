"""Backing storage: zone directories held open as descriptors, and our own inode table.

Every name is resolved one component at a time from a directory descriptor with
`O_NOFOLLOW`, so neither a symlink planted in backing storage nor a `..` can lead the daemon
outside a zone's directory. Inode numbers are sandboxfs's own: backing `st_ino` values of
two filesystems (or two zones) can collide, and the kernel must never confuse them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .errors import SandboxError
from .policy import Zone

ROOT_INO = 1
CONTROL_INO = 2
CONTEXT_INO = 3
ZONE_INO = {zone: 4 + i for i, zone in enumerate(Zone)}
FIRST_DYNAMIC_INO = 16

CONTROL_NAME = b".sandboxfs"
CONTEXT_NAME = b"context.json"
STATE_DIR_NAME = ".sandbox"

_DIR_OPEN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FD_CACHE_SIZE = 1024

Key = tuple[Zone, int, int]
# A listed entry: name, layer, backing inode number (d_ino), whether it is a directory.
Listed = tuple[bytes, int, int, bool]


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
        hidden: set[tuple[int, int, bytes]],
    ) -> None:
        self.hidden = hidden
        self.root = Node(ROOT_INO, None, None, b"", True, lookups=1)
        self.control = Node(CONTROL_INO, None, self.root, CONTROL_NAME, True)
        self.context = Node(CONTEXT_INO, None, self.control, CONTEXT_NAME, False)
        self.nodes: dict[int, Node] = {n.ino: n for n in (self.root, self.control, self.context)}
        self.by_key: dict[Key, Node] = {}
        self.zone_roots: dict[Zone, Node] = {}
        self.layer_paths = worker_layers
        self.layer_fds: list[int] = []
        self._fd_cache: OrderedDict[int, Node] = OrderedDict()
        self._next_ino = FIRST_DYNAMIC_INO
        for zone in Zone:
            node = Node(ZONE_INO[zone], zone, self.root, zone.value.encode(), True)
            if zone is Zone.WORKERS:
                self.layer_fds = [_open_dir_or_missing(p) for p in worker_layers]
            else:
                node.fd = os.open(zone_dirs[zone], _DIR_OPEN)
                st = os.stat(node.fd)
                node.key = (zone, st.st_dev, st.st_ino)
            self.zone_roots[zone] = node
            self.nodes[node.ino] = node

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

    def remember(self, parent: Node, name: bytes, st: os.stat_result, layer: int = 0) -> Node:
        """The node for a backing entry just found at parent/name, created if new.

        Counts one lookup, as the kernel will. A backing inode seen under a second name is
        the same node (hard links share one inode), now reachable under the newer name too.
        """
        zone = parent.zone
        assert zone is not None
        key = (zone, st.st_dev, st.st_ino)
        is_dir = stat.S_ISDIR(st.st_mode)
        node = self.by_key.get(key)
        if node is not None and node.is_dir != is_dir:
            del self.by_key[key]
            node = None
        if node is None:
            node = Node(self._next_ino, zone, parent, name, is_dir, key=key, layer=layer)
            self._next_ino += 1
            self.nodes[node.ino] = node
            self.by_key[key] = node
        elif node.parent is not parent or node.name != name:
            _forget_link(node, parent, name)
            if not is_dir and node.parent is not None:
                node.links = (*node.links, (node.parent, node.name))
            node.parent, node.name, node.layer = parent, name, layer
        node.lookups += 1
        return node

    def spare_ino(self) -> int:
        """An inode number that no node will ever have (for entries shown without attributes)."""
        self._next_ino += 1
        return self._next_ino - 1

    def forget(self, ino: int, count: int) -> None:
        node = self.nodes.get(ino)
        if node is None or node.ino < FIRST_DYNAMIC_INO:
            return
        node.lookups -= count
        if node.lookups > 0:
            return
        del self.nodes[ino]
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
        fd = os.open(node.name, _DIR_OPEN, dir_fd=self.parent_fd(node))
        node.fd = fd
        self._fd_cache[node.ino] = node
        if len(self._fd_cache) > _FD_CACHE_SIZE:
            _, old = self._fd_cache.popitem(last=False)
            os.close(old.fd)
            old.fd = -1
        return fd

    def parent_fd(self, node: Node) -> int:
        """The descriptor of the backing directory that holds node's name."""
        parent = node.parent
        if parent is None:
            raise SandboxError(errno.ENOENT, "the entry was removed")
        if parent.zone is Zone.WORKERS and parent.parent is self.root:
            return self.layer_fd(node.layer, create=False)
        return self.dir_fd(parent)

    def layer_fd(self, layer: int, create: bool) -> int:
        fd = self.layer_fds[layer] if layer < len(self.layer_fds) else -1
        if fd < 0 and create and layer == 0:
            path = self.layer_paths[0]
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.name, 0o755, dir_fd=os.open(path.parent, _DIR_OPEN))
            fd = self.layer_fds[0] = _open_dir_or_missing(path)
        if fd < 0:
            raise SandboxError(errno.ENOENT, "no such workers directory")
        return fd

    def _drop_fd(self, node: Node) -> None:
        if node.fd >= 0 and node.ino >= FIRST_DYNAMIC_INO:
            self._fd_cache.pop(node.ino, None)
            os.close(node.fd)
            node.fd = -1

    # ----- backing operations --------------------------------------------------------------

    def stat_node(self, node: Node) -> os.stat_result:
        if node.open_fds:
            return os.stat(node.open_fds[-1])
        if node.fd >= 0:
            return os.stat(node.fd)
        return os.stat(node.name, dir_fd=self.parent_fd(node), follow_symlinks=False)

    def stat_child(self, parent: Node, name: bytes, layer: int = 0) -> os.stat_result | None:
        """lstat of parent/name, or None when absent."""
        try:
            return os.stat(name, dir_fd=self.child_dir_fd(parent, layer), follow_symlinks=False)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None

    def child_dir_fd(self, parent: Node, layer: int = 0, create: bool = False) -> int:
        """Where names inside `parent` live; for the workers root, one of its layers."""
        if parent.zone is Zone.WORKERS and parent.parent is self.root:
            return self.layer_fd(layer, create)
        return self.dir_fd(parent)

    def is_hidden(self, parent: Node, name: bytes) -> bool:
        if not self.hidden or parent.key is None:
            return False
        return (parent.key[1], parent.key[2], name) in self.hidden

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
                for name, ino, is_dir in _scan(fd):
                    if name not in seen:
                        seen.add(name)
                        union.append((name, layer, ino, is_dir))
            return union
        return [
            (name, node.layer, ino, is_dir)
            for name, ino, is_dir in _scan(self.dir_fd(node))
            if not self.is_hidden(node, name)
        ]

    def open_path_fd(self, node: Node) -> int:
        """A fresh O_PATH descriptor of node itself (for xattrs), never following a symlink."""
        return os.open(
            node.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.parent_fd(node)
        )


def _forget_link(node: Node, parent: Node, name: bytes) -> None:
    """Drop parent/name from node's other known names (the current one is node.parent/name)."""
    node.links = tuple((p, n) for p, n in node.links if not (p is parent and n == name))


def _open_dir_or_missing(path: Path) -> int:
    try:
        return os.open(path, _DIR_OPEN)
    except (FileNotFoundError, NotADirectoryError):
        return -1


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


# ----- renameat2, which the os module does not offer -----------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_renameat2 = _libc.renameat2
_renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_renameat2.restype = ctypes.c_int


def renameat2(src_fd: int, src: bytes, dst_fd: int, dst: bytes, flags: int) -> None:
    if flags == 0:
        os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        return
    if _renameat2(src_fd, src, dst_fd, dst, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


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
