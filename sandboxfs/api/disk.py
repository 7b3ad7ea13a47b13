"""The disk backend: a project's zones through the core's `Store`, as the mount sees them.

The store resolves every name one component at a time from a directory descriptor, never
following a symlink or crossing into another mount, and hides sandboxfs's own state by
identity; the guard and the audit log are the project's (`project.make_guard`, the project's
audit.jsonl), so an API sandbox and a mount of the same project share deny list, protected
paths, limits, quota tallies and log.

Nodes are remembered for one API call and forgotten at its end (`release`), so the inode
table stays small however much is touched; what this sandbox created is kept as a set of
backing identities instead, so that create-only zones keep knowing it across calls.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxfs.audit.reader import AuditQuery, query
from sandboxfs.audit.writer import AuditLog
from sandboxfs.config.model import Config
from sandboxfs.layout import audit_path
from sandboxfs.project.state import hold
from sandboxfs.project.zones import check_id as project_check_id
from sandboxfs.project.zones import (
    config_source,
    hidden_identities,
    hidden_names,
    make_guard,
    prepare_zones,
    worker_layers,
)

from ..core.approvals import Broker
from ..core.errors import SandboxError
from ..core.guard import Guard
from ..core.inodes import Node, StatLike
from ..core.policy import Trust, Zone
from ..core.rulebase import MountInfo
from ..core.store import Store
from ..core.syscalls import fstat, write_all
from ..errors import SandboxfsError

_READ_CHUNK = 1 << 20

Identity = tuple[Zone, int, int, int]  # zone, st_dev, st_ino, birth time (0: unknown)


def check_id(kind: str, value: str) -> str:
    """project.check_id, with the API's exceptions for bad arguments."""
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be a str, not {type(value).__name__}")
    try:
        return project_check_id(kind, value)
    except SandboxfsError as exc:
        raise ValueError(exc.message) from None


def _identity(zone: Zone, st: StatLike) -> Identity:
    return (zone, st.st_dev, st.st_ino, getattr(st, "st_birthtime_ns", 0))


class DiskBackend:
    """The primitives of sandbox.py over a `Store`."""

    def __init__(self, store: Store, in_use: int = -1) -> None:
        self.store = store
        self.root = store.root
        self.zone_roots = store.zone_roots
        self._created: set[Identity] = set()
        self._in_use = in_use  # the session's mark of use (sandboxfs.project.state.hold), or -1

    @property
    def moves(self) -> int:
        return self.store.moves

    def close(self) -> None:
        self.store.close()
        if self._in_use >= 0:
            os.close(self._in_use)
            self._in_use = -1

    def find(self, parent: Node, name: bytes) -> tuple[StatLike, int] | None:
        """lstat of parent/name and its workers layer; HiddenEntry for sandboxfs's state and
        other mounts."""
        return self.store.find(parent, name)

    def target(self, parent: Node, name: bytes) -> StatLike | None:
        """lstat of a rename's destination: in the workers root, the first (writable) layer."""
        return self.store.stat_child(parent, name, 0)

    def remember(self, parent: Node, name: bytes, st: StatLike, layer: int) -> Node:
        node = self.store.remember(parent, name, st, layer)
        if parent.zone is not None and _identity(parent.zone, st) in self._created:
            node.created_here = True
        return node

    def release(self, node: Node) -> None:
        self.store.forget(node.ino, 1)

    def created(self, zone: Zone, st: StatLike) -> bool:
        return _identity(zone, st) in self._created

    def stat(self, node: Node) -> StatLike:
        return self.store.stat_node(node)

    def read(self, node: Node, limit: int | None) -> bytes:
        fd = self.store.open_file(node, os.O_RDONLY)
        try:
            chunks: list[bytes] = []
            left = limit
            while left is None or left > 0:
                chunk = os.read(fd, _READ_CHUNK if left is None else min(left, _READ_CHUNK))
                if not chunk:
                    break
                chunks.append(chunk)
                if left is not None:
                    left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write(self, node: Node, data: bytes, append: bool, before: Callable[[int], None]) -> None:
        """Replace (or append to) node's file; `before` gets its size once it is open and
        may refuse (nothing is changed then)."""
        fd = self.store.open_file(node, os.O_WRONLY | (os.O_APPEND if append else 0))
        try:
            before(os.fstat(fd).st_size)
            if not append:
                os.ftruncate(fd, 0)
            write_all(fd, data)
        finally:
            os.close(fd)

    def create(self, parent: Node, name: bytes, data: bytes) -> Node:
        """A new file (never an existing one: EEXIST) with `data` in it; if writing fails,
        the file is removed again."""
        dir_fd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
        fd = self.store.create_file(dir_fd, name, os.O_WRONLY | os.O_EXCL, 0o666)
        try:
            write_all(fd, data)
            st = fstat(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)
        return self._created_node(parent, name, st)

    def mkdir(self, parent: Node, name: bytes) -> Node:
        dir_fd = self.store.child_dir_fd(parent, 0, create=True, checked=True)
        os.mkdir(name, 0o777, dir_fd=dir_fd)
        st = self.store.lstat(self.store.child_dir_fd(parent, 0), name)
        if st is None:
            raise SandboxError(errno.ENOENT, "the new directory vanished")
        return self._created_node(parent, name, st)

    def list_entries(self, node: Node) -> list[tuple[bytes, bool]]:
        return [(name, is_dir) for name, _layer, _ino, is_dir in self.store.list_entries(node)]

    def remove(self, parent: Node, name: bytes, st: StatLike, layer: int) -> None:
        assert parent.zone is not None
        dir_fd = self.store.child_dir_fd(parent, layer, checked=True)
        directory = stat.S_ISDIR(st.st_mode)
        (os.rmdir if directory else os.unlink)(name, dir_fd=dir_fd)
        remaining = 0 if directory else st.st_nlink - 1
        if remaining < 1:
            self._created.discard(_identity(parent.zone, st))
        node = self.store.by_key.get((parent.zone, st.st_dev, st.st_ino))
        if node is not None:
            self.store.detach(node, parent, name, remaining)

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
        zone = old_parent.zone
        assert zone is not None
        src_fd = self.store.child_dir_fd(old_parent, layer, checked=True)
        dst_fd = self.store.child_dir_fd(new_parent, 0, create=True, checked=True)
        os.rename(old_name, new_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        src_node = self.store.by_key.get((zone, src_st.st_dev, src_st.st_ino))
        if dst_st is not None and dst_st.st_ino != src_st.st_ino:
            remaining = 0 if stat.S_ISDIR(dst_st.st_mode) else dst_st.st_nlink - 1
            if remaining < 1:
                self._created.discard(_identity(zone, dst_st))
            dst_node = self.store.by_key.get((zone, dst_st.st_dev, dst_st.st_ino))
            if dst_node is not None:
                self.store.detach(dst_node, new_parent, new_name, remaining)
        if src_node is not None:
            self.store.moved(src_node, old_parent, old_name, new_parent, new_name)
            if new_parent is self.zone_roots.get(Zone.WORKERS):
                src_node.layer = 0

    def _created_node(self, parent: Node, name: bytes, st: StatLike) -> Node:
        assert parent.zone is not None
        self._created.add(_identity(parent.zone, st))
        node = self.store.remember(parent, name, st, 0)
        node.created_here = True
        return node


def open_disk(
    project: Path,
    config: Config,
    config_file: Path | None,
    trust: Trust,
    workspace: str,
    session: str,
    audit_sync: bool,
    approvals: Broker | None = None,
) -> tuple[DiskBackend, Guard, AuditLog]:
    """The store, guard and audit log of an API sandbox on `project` (already validated), laid
    out as daemon.prepare_store does for a mount."""
    dirs = prepare_zones(project, workspace, session, config, config_source(project, config_file))
    store = Store(dirs, worker_layers(project), hidden_identities(project), hidden_names(project))
    try:  # the session is in use while the sandbox is open, as while a mount has it
        root = store.zone_roots[Zone.SESSION].key
        in_use = hold(dirs[Zone.SESSION], root[1:] if root is not None else None)
    except BaseException:
        store.close()
        raise
    try:
        audit = AuditLog(
            audit_path(project),
            sync=audit_sync or config.audit.sync,
            rotate=config.audit.rotate_bytes,
        )
    except BaseException:
        store.close()
        os.close(in_use)
        raise
    worker = config.worker.name if config.worker is not None else None
    info = MountInfo(session, workspace, str(project), "", via="api", worker=worker)
    try:
        guard = make_guard(project, config, config_file, trust, info, store, audit, approvals)
    except BaseException:
        with contextlib.suppress(OSError):
            audit.close()
        store.close()
        os.close(in_use)
        raise
    return DiskBackend(store, in_use), guard, audit


def read_entries(project: Path, session: str, workspace: str) -> list[dict[str, Any]]:
    """The API's entries of one session, read back from the project's audit log."""
    entries = query(audit_path(project), AuditQuery(session=session, workspace=workspace))
    return [entry for entry in entries if entry.get("via") == "api"]
