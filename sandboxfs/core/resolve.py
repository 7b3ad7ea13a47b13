"""Resolving nodes to backing directory descriptors, from the zone directories held open.

Every name is resolved one component at a time from a directory descriptor, or in one openat2
confined beneath a zone root, with no symlink, magic link or mount point followed on the way
(see CONFINED_RESOLVE), so neither a symlink planted in backing storage nor a `..` can lead the
daemon outside a zone's directory. Before anything reads or changes a directory's contents its
path is walked again from the zone root (`checked`): a cached descriptor follows its directory
wherever it goes, even out of the project.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .errors import SandboxError
from .inodes import ZONE_INO, InodeTable, Node, same_inode
from .policy import BUILTIN_ZONES, Zone
from .syscalls import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    openat2,
)

_DIR_OPEN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Every open of a backing name: no symlink, no magic link, no mount point, nothing outside.
CONFINED_RESOLVE = RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH
_SHORT_PATH = 3072  # relpaths walked in one openat2 (PATH_MAX is 4096)


class Resolver(InodeTable):
    """The zone directories held open (and the workers layers), and the descriptor of the
    backing directory behind a node, by its path from them."""

    def __init__(self, zone_dirs: dict[Zone, Path], worker_layers: list[Path]) -> None:
        super().__init__()
        self.zone_roots: dict[Zone, Node] = {}
        self.layer_paths = worker_layers
        self.layer_fds: list[int] = []
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

    # ----- descriptors --------------------------------------------------------------------

    def dir_fd(self, node: Node) -> int:
        """An O_PATH descriptor of a directory node, opened component by component."""
        if node.fd >= 0:
            self._used_fd(node)
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
            fd = self.allocating(openat2, dir_fd, path, _DIR_OPEN, 0, CONFINED_RESOLVE)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EXDEV, errno.ELOOP):
                raise SandboxError(errno.ESTALE, "the directory moved or was replaced") from None
            raise
        if not same_inode(node, os.stat(fd)):
            os.close(fd)
            raise SandboxError(errno.ESTALE, "the directory moved or was replaced")
        return fd

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

    def child_dir_fd(
        self, parent: Node, layer: int = 0, create: bool = False, checked: bool = False
    ) -> int:
        """Where names inside `parent` live; for the workers root, one of its layers.
        `checked`: before reading or changing contents (see checked_dir_fd)."""
        if parent.zone is Zone.WORKERS and parent.parent is self.root:
            return self.layer_fd(layer, create)
        return self.checked_dir_fd(parent) if checked else self.dir_fd(parent)


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
