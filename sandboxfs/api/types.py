"""The API's public value types and the protocol its backends implement."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..core.effects import AuditSink
from ..core.inodes import Node, StatLike
from ..core.policy import Zone


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks: this process (the guard's Caller protocol)."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class FileInfo:
    path: str
    zone: str | None
    kind: str  # "file", "dir", "symlink" or "other"
    size: int
    mtime: float
    created_here: bool


@dataclass(frozen=True, slots=True)
class Permission:
    allowed: bool
    op: str
    path: str
    zone: str | None
    trust: str
    reason: str  # "" when allowed
    error: str = ""  # the exception type the operation would raise ("" when allowed)


@dataclass(frozen=True, slots=True)
class StagedCommit:
    id: str
    path: str  # "/staged/<id>"
    files: tuple[str, ...]  # repo-relative paths
    message: str


class Backend(Protocol):
    """What a storage offers sandbox.py (disk.DiskBackend, memory.MemoryBackend)."""

    root: Node
    zone_roots: dict[Zone, Node]

    @property
    def moves(self) -> int: ...
    def find(self, parent: Node, name: bytes) -> tuple[StatLike, int] | None: ...
    def target(self, parent: Node, name: bytes) -> StatLike | None: ...
    def remember(self, parent: Node, name: bytes, st: StatLike, layer: int) -> Node: ...
    def release(self, node: Node) -> None: ...
    def created(self, zone: Zone, st: StatLike) -> bool: ...
    def stat(self, node: Node) -> StatLike: ...
    def read(self, node: Node, limit: int | None) -> bytes: ...
    def write(
        self, node: Node, data: bytes, append: bool, before: Callable[[int], None]
    ) -> None: ...
    def create(self, parent: Node, name: bytes, data: bytes) -> Node: ...
    def mkdir(self, parent: Node, name: bytes) -> Node: ...
    def list_entries(self, node: Node) -> list[tuple[bytes, bool]]: ...
    def remove(self, parent: Node, name: bytes, st: StatLike, layer: int) -> None: ...
    def rename(
        self,
        old_parent: Node,
        old_name: bytes,
        layer: int,
        new_parent: Node,
        new_name: bytes,
        src_st: StatLike,
        dst_st: StatLike | None,
    ) -> None: ...
    def close(self) -> None: ...


class ClosableSink(AuditSink, Protocol):
    def settle(self) -> None: ...
    def close(self) -> None: ...
