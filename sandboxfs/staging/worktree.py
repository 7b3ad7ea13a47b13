"""The working tree, read and written one component at a time with O_NOFOLLOW: no symlink,
mount point or sandboxfs state directory is ever gone through (WorkTree, WorkTreeError)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from sandboxfs.project.zones import hidden_identities

from ..core.syscalls import write_all
from .format import CREATE_FLAGS, DIR_FLAGS, MODE_EXEC, MODE_FILE, READ_FLAGS, kind_of
from .git import MODE_LINK
from .text import escape_name


class WorkTreeError(Exception):
    def __init__(self, phrase: str) -> None:
        super().__init__(phrase)
        self.phrase = phrase


class WorkTree:
    """The project directory, walked one component at a time with O_NOFOLLOW: no symlink,
    mount point or sandboxfs state directory is ever gone through."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._fds: dict[str, int] = {}
        self._dev = 0
        self._hidden: set[tuple[int, int]] = set()

    def __enter__(self) -> WorkTree:
        fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds[""] = fd
        self._dev = os.fstat(fd).st_dev
        self._hidden = hidden_identities(self._root)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def directory(self, rel: str, create: bool = False) -> int | None:
        """The descriptor of the directory `rel` ("" for the root); None if it does not exist
        (and not `create`). Raises WorkTreeError for a symlink or anything not a directory."""
        if rel in self._fds:
            return self._fds[rel]
        parent_rel, _, name = rel.rpartition("/")
        parent = self.directory(parent_rel, create)
        if parent is None:
            return None
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            os.mkdir(name, 0o777, dir_fd=parent)
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise WorkTreeError(
                        f"goes through a symlink in the repository ({escape_name(rel)})"
                    ) from None
                raise WorkTreeError(
                    f"goes through {escape_name(rel)}, which is not a directory in the working tree"
                ) from None
            raise
        st = os.fstat(fd)
        if st.st_dev != self._dev:
            os.close(fd)
            raise WorkTreeError(f"goes through a mount point ({escape_name(rel)})")
        if (st.st_dev, st.st_ino) in self._hidden:
            os.close(fd)
            raise WorkTreeError(f"goes through sandboxfs's state directory ({escape_name(rel)})")
        self._fds[rel] = fd
        return fd

    def inspect(self, path: str) -> tuple[bytes, int] | None:
        """(content, git mode) of the regular file at `path`, or None if nothing is there."""
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        if parent is None:
            return None
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise WorkTreeError("is a symlink in the working tree")
        if not stat.S_ISREG(st.st_mode):
            raise WorkTreeError(f"is a {kind_of(st.st_mode)} in the working tree")
        fd = os.open(name, READ_FLAGS, dir_fd=parent)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WorkTreeError(f"is a {kind_of(st.st_mode)} in the working tree")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks), MODE_EXEC if st.st_mode & 0o100 else MODE_FILE

    def holds(self, path: str, data: bytes | None, mode: int | None) -> bool:
        """Whether the working tree has exactly this at `path`: a file with this content and
        git mode, a symlink with this target (mode 120000), or nothing (mode None)."""
        if mode != MODE_LINK:
            return self.inspect(path) == (None if mode is None else (data, mode))
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        if parent is None:
            return False
        try:
            return os.readlink(os.fsencode(name), dir_fd=parent) == data
        except OSError:
            return False

    def write_temp(self, path: str, data: bytes, mode: int, name: str | None = None) -> str:
        """Write `data` to a new temporary name beside `path` (`name`, or a random one;
        creating the directories on the way); returns that name, for `replace`."""
        parent_rel = path.rpartition("/")[0]
        parent = self.directory(parent_rel, create=True)
        assert parent is not None
        name = name or f".sandboxfs-{secrets.token_hex(8)}.tmp"
        fd = os.open(name, CREATE_FLAGS, 0o777 if mode == MODE_EXEC else 0o666, dir_fd=parent)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return name

    def replace(self, path: str, temp: str) -> None:
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        assert parent is not None
        os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)

    def remove_temp(self, path: str, temp: str) -> None:
        parent = self.directory(path.rpartition("/")[0])
        if parent is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=parent)

    def delete(self, path: str) -> None:
        """Remove the file at `path`, then each directory above it that is left empty."""
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        if parent is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        while parent_rel:
            above, _, name = parent_rel.rpartition("/")
            fd = self._fds.pop(parent_rel)
            os.close(fd)
            try:
                os.rmdir(name, dir_fd=self._fds[above])
            except OSError:
                return
            parent_rel = above
