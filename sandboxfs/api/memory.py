"""The memory backend: every zone a tree of dicts, nothing on disk.

It offers the same primitives as the disk backend (find, read, write, create, mkdir, list,
remove, rename, stat) over store-like `Node`s it builds itself, so the one `Guard` and the one
sequence of checks in sandbox.py and nodes.py apply unchanged: a memory sandbox refuses
exactly what a disk sandbox (and the mount) refuses. /workers is a plain zone here (a single
layer, 0).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sandboxfs.config.model import Config
from sandboxfs.project.zones import SESSION_SUBDIRS

from ..core.errors import SandboxError
from ..core.guard import Guard
from ..core.inodes import FIRST_DYNAMIC_INO, ROOT_INO, Node, StatLike
from ..core.limits import Tally
from ..core.policy import Policy, Trust, Zone
from ..core.rulebase import MountInfo
from ..core.secrets import KeyScanner

_LAYOUT: dict[Zone, list[tuple[bytes, ...]]] = {
    Zone.SESSION: [(name.encode(),) for name in SESSION_SUBDIRS],
    Zone.WORKSPACE: [
        (b"cache", b"web"),
        (b"cache", b"pdfs"),
        (b"cache", b"attachments"),
        (b"data",),
    ],
}
_FILE_MODE = stat.S_IFREG | 0o644
_DIR_MODE = stat.S_IFDIR | 0o755


@dataclass(frozen=True, slots=True)
class MemStat:
    """What `os.stat_result` offers (core.store.StatLike), for an in-memory entry."""

    st_mode: int
    st_ino: int
    st_size: int
    st_mtime_ns: int
    st_nlink: int = 1
    st_dev: int = 0
    st_uid: int = field(default_factory=os.getuid)
    st_gid: int = field(default_factory=os.getgid)
    st_rdev: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0

    @property
    def st_atime_ns(self) -> int:
        return self.st_mtime_ns

    @property
    def st_ctime_ns(self) -> int:
        return self.st_mtime_ns


@dataclass(eq=False, slots=True)
class _Entry:
    """A file (data) or a directory (children) and the node the guard sees it as."""

    node: Node
    data: bytearray | None = None
    children: dict[bytes, _Entry] | None = None
    mtime_ns: int = field(default_factory=time.time_ns)

    def stat(self) -> MemStat:
        if self.children is not None:
            return MemStat(_DIR_MODE, self.node.ino, 0, self.mtime_ns, st_nlink=2)
        size = len(self.data or b"")
        return MemStat(
            _FILE_MODE, self.node.ino, size, self.mtime_ns, st_blocks=(size + 511) // 512
        )

    def walk(self) -> Iterator[_Entry]:
        """Every entry below this one (not this one)."""
        for child in (self.children or {}).values():
            yield child
            yield from child.walk()


class MemorySink:
    """The memory backend's audit log: entries kept in a list (an AuditSink)."""

    failing = False

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def record(self, entry: dict[str, Any]) -> None:
        stamped = dict(entry)
        if "ts" not in stamped:  # as the audit log stamps them: UTC, microseconds, "Z"
            now = datetime.now(UTC).replace(tzinfo=None)
            stamped["ts"] = now.isoformat(timespec="microseconds") + "Z"
        self.entries.append(stamped)

    def try_flush(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryBackend:
    """Zones as trees of `_Entry`; node inode numbers laid out like the store's."""

    def __init__(self, zones: Iterable[Zone]) -> None:
        self.root = Node(ROOT_INO, None, None, b"", True, lookups=1)
        self.zone_roots: dict[Zone, Node] = {}
        self._entries: dict[int, _Entry] = {}
        self._next_ino = FIRST_DYNAMIC_INO
        self.moves = 0
        for index, zone in enumerate(zones):
            node = Node(4 + index, zone, self.root, zone.value.encode(), True)
            self.zone_roots[zone] = node
            self._entries[node.ino] = _Entry(node, children={})
        # The directories prepare_zones makes on disk for every session and workspace.
        for zone, dirs in _LAYOUT.items():
            if zone in self.zone_roots:
                for parts in dirs:
                    self.seed_dir(zone, parts)

    def close(self) -> None:
        pass

    # ----- setup (not audited, not checked) ----------------------------------------------------

    def seed_dir(self, zone: Zone, parts: tuple[bytes, ...]) -> _Entry:
        """The directory at zone/parts..., made with the ones above it if missing."""
        entry = self._entries[self.zone_roots[zone].ino]
        for part in parts:
            assert entry.children is not None
            child = entry.children.get(part)
            if child is None:
                child = self._add(entry, part, directory=True)
            elif child.children is None:
                raise ValueError(f"{child.node.vpath()} is a file, not a directory")
            entry = child
        return entry

    def seed(self, zone: Zone, parts: tuple[bytes, ...], data: bytes) -> None:
        """Put a file at zone/parts..., making the directories on the way."""
        entry = self.seed_dir(zone, parts[:-1])
        assert entry.children is not None
        existing = entry.children.get(parts[-1])
        if existing is not None and existing.children is not None:
            raise ValueError(f"{existing.node.vpath()} is a directory")
        target = existing or self._add(entry, parts[-1], directory=False)
        target.data = bytearray(data)

    def usage(self, zone: Zone) -> Callable[[], tuple[int, int]]:
        """A recount for the zone's quota tally: (bytes of files, entries) below its root."""

        def count() -> tuple[int, int]:
            nbytes = files = 0
            for entry in self._entries[self.zone_roots[zone].ino].walk():
                files += 1
                nbytes += len(entry.data) if entry.data is not None else 0
            return nbytes, files

        return count

    # ----- the primitives sandbox.py uses ------------------------------------------------------

    def find(self, parent: Node, name: bytes) -> tuple[StatLike, int] | None:
        children = self._dir(parent).children
        child = children.get(name) if children is not None else None
        return (child.stat(), 0) if child is not None else None

    def target(self, parent: Node, name: bytes) -> StatLike | None:
        found = self.find(parent, name)
        return found[0] if found is not None else None

    def remember(self, parent: Node, name: bytes, st: StatLike, layer: int) -> Node:
        return self._entries[st.st_ino].node

    def release(self, node: Node) -> None:
        pass  # nodes live as long as their entries

    def created(self, zone: Zone, st: StatLike) -> bool:
        entry = self._entries.get(st.st_ino)
        return entry is not None and entry.node.created_here

    def stat(self, node: Node) -> StatLike:
        return self._entry(node).stat()

    def read(self, node: Node, limit: int | None) -> bytes:
        data = self._file(node).data or bytearray()
        return bytes(data if limit is None else data[:limit])

    def write(self, node: Node, data: bytes, append: bool, before: Callable[[int], None]) -> None:
        entry = self._file(node)
        content = entry.data if entry.data is not None else bytearray()
        before(len(content))
        if append:
            content += data
        else:
            content[:] = data
        entry.data = content
        entry.mtime_ns = time.time_ns()

    def create(self, parent: Node, name: bytes, data: bytes) -> Node:
        entry = self._new_child(parent, name, directory=False)
        entry.data = bytearray(data)
        return entry.node

    def mkdir(self, parent: Node, name: bytes) -> Node:
        return self._new_child(parent, name, directory=True).node

    def list_entries(self, node: Node) -> list[tuple[bytes, bool]]:
        children = self._dir(node).children or {}
        return sorted((name, child.children is not None) for name, child in children.items())

    def remove(self, parent: Node, name: bytes, st: StatLike, layer: int) -> None:
        directory = self._dir(parent)
        assert directory.children is not None
        entry = directory.children.get(name)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory")
        if entry.children:
            raise OSError(errno.ENOTEMPTY, "the directory is not empty")
        del directory.children[name]
        self._drop(entry)
        directory.mtime_ns = time.time_ns()

    def rename(
        self,
        old_parent: Node,
        old_name: bytes,
        layer: int,
        new_parent: Node,
        new_name: bytes,
        src_st: StatLike,
        dst_st: StatLike | None,
    ) -> None:
        source_dir, target_dir = self._dir(old_parent), self._dir(new_parent)
        assert source_dir.children is not None and target_dir.children is not None
        entry = source_dir.children.get(old_name)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory")
        existing = target_dir.children.get(new_name)
        if existing is entry:
            return
        if entry.children is not None:
            up: Node | None = new_parent
            while up is not None:
                if up is entry.node:
                    raise OSError(errno.EINVAL, "a directory cannot be moved into itself")
                up = up.parent
        if existing is not None:
            if existing.children is not None and entry.children is None:
                raise IsADirectoryError(errno.EISDIR, "the destination is a directory")
            if existing.children is None and entry.children is not None:
                raise NotADirectoryError(errno.ENOTDIR, "the destination is not a directory")
            if existing.children:
                raise OSError(errno.ENOTEMPTY, "the destination directory is not empty")
            self._drop(existing)
        del source_dir.children[old_name]
        target_dir.children[new_name] = entry
        entry.node.parent, entry.node.name = new_parent, new_name
        self.moves += 1
        source_dir.mtime_ns = target_dir.mtime_ns = time.time_ns()

    # ----- helpers ----------------------------------------------------------------------------

    def _entry(self, node: Node) -> _Entry:
        entry = self._entries.get(node.ino)
        if entry is None or entry.node is not node:
            raise SandboxError(errno.ESTALE, "the entry was removed")
        return entry

    def _dir(self, node: Node) -> _Entry:
        entry = self._entry(node)
        if entry.children is None:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        return entry

    def _file(self, node: Node) -> _Entry:
        entry = self._entry(node)
        if entry.children is not None:
            raise IsADirectoryError(errno.EISDIR, "it is a directory")
        return entry

    def _new_child(self, parent: Node, name: bytes, directory: bool) -> _Entry:
        entry = self._dir(parent)
        assert entry.children is not None
        if name in entry.children:
            raise FileExistsError(errno.EEXIST, "it already exists")
        child = self._add(entry, name, directory)
        child.node.created_here = True
        entry.mtime_ns = time.time_ns()
        return child

    def _add(self, parent: _Entry, name: bytes, directory: bool) -> _Entry:
        node = Node(self._next_ino, parent.node.zone, parent.node, name, directory)
        self._next_ino += 1
        entry = _Entry(node, children={} if directory else None)
        assert parent.children is not None
        parent.children[name] = entry
        self._entries[node.ino] = entry
        return entry

    def _drop(self, entry: _Entry) -> None:
        entry.node.last_vpath = entry.node.vpath()
        entry.node.parent = None
        del self._entries[entry.node.ino]


def open_memory(
    config: Config,
    trust: Trust,
    session: str,
    workspace: str,
    seeds: Iterable[tuple[Zone, tuple[bytes, ...], bytes]],
) -> tuple[MemoryBackend, Guard, MemorySink]:
    """The backend, guard and audit sink of a memory sandbox: the config's zones (seeded with
    files), policy, limits, and a quota tally per zone that has one (counted in memory)."""
    backend = MemoryBackend(config.zone_list())
    for zone, parts, data in seeds:
        backend.seed(zone, parts, data)
    sink = MemorySink()
    return backend, memory_guard(config, trust, session, workspace, backend, sink), sink


def memory_guard(
    config: Config,
    trust: Trust,
    session: str,
    workspace: str,
    backend: MemoryBackend,
    sink: MemorySink,
) -> Guard:
    """The guard of a memory sandbox on `backend` (also a worker's, which shares its
    parent's backend and sink: sandboxfs.api.Sandbox.restrict)."""
    limits = config.zone_limits()
    tallies = {
        zone: Tally(zone.value, found.quota, None, backend.usage(zone))
        for zone, found in limits.items()
        if found.has_quota and found.quota is not None
    }
    policy = Policy(
        config.matrix(),
        config.deny,
        trust,
        config.protect,
        config.deny_private_keys,
        worker=config.worker_label(),
        credential_patterns=config.deny_credentials,
    )
    worker = config.worker.name if config.worker is not None else None
    info = MountInfo(session, workspace, "", "", via="api", worker=worker)
    guard = Guard(policy, sink, info, moves=lambda: backend.moves, limits=limits, tallies=tallies)
    guard.inspect_contents(KeyScanner(MemoryContents(backend)))
    return guard


class MemoryContents:
    """What the private-key scanner reads (sandboxfs.core.secrets.Contents), in memory."""

    def __init__(self, backend: MemoryBackend) -> None:
        self._backend = backend

    def stat(self, parent: Node, name: bytes, layer: int) -> StatLike | None:
        try:
            found = self._backend.find(parent, name)
        except NotADirectoryError:
            return None
        except SandboxError as exc:  # the directory is gone (or not made yet): nothing there
            if exc.errno != errno.ESTALE:
                raise
            return None
        return found[0] if found is not None else None

    def head(self, parent: Node, name: bytes, layer: int, limit: int) -> tuple[StatLike, bytes]:
        st = self.stat(parent, name, layer)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise SandboxError(errno.ESTALE, "the file was removed")
        node = self._backend.remember(parent, name, st, layer)
        return st, self._backend.read(node, limit)
