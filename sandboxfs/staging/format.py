"""The staged-commit format, read into memory and written back.

A staged commit is a directory (`<project>/.sandbox/workspaces/<ws>/staged/<id>/` in the /staged
zone, or the snapshot of a frozen review): `message.txt`, `files/<repo path>` with the full
proposed content of each file, and optionally `deletions.txt` (one repo path a line).
`read_tree` reads it as a StagedTree without following a symlink or blocking on a FIFO; an
entry that is no content is Refused, and one beyond MAX_TOTAL_BYTES, MAX_ENTRIES or MAX_DEPTH
is TooLarge. `write_tree` writes the snapshot; `StagedTree.digest` is what
`commit --expect DIGEST` checks.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass, field
from typing import NamedTuple

from ..core.syscalls import write_all
from ..errors import Failure
from .text import escape_name

MAX_TOTAL_BYTES = 100 * 1024 * 1024  # a staged commit larger than this is refused
MAX_ENTRIES = 10_000  # files, directories, other entries and deletions together
MAX_DEPTH = 200  # directories below files/
MESSAGE_NAME = "message.txt"
FILES_NAME = "files"
DELETIONS_NAME = "deletions.txt"
# How staged commits, snapshots and the working tree are opened: never through a symlink.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MODE_FILE = 0o100644
MODE_EXEC = 0o100755


@dataclass(frozen=True)
class StagedFile:
    path: str  # repository-relative, "/"-separated, os.fsdecode'd
    mode: int  # MODE_FILE or MODE_EXEC
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class Refused(NamedTuple):
    """An entry of a staged commit that is no content: a symlink, FIFO, socket, device, or an
    unreadable file. `path` is relative to the staged commit ("files/src/link")."""

    path: str
    kind: str


@dataclass
class StagedTree:
    """The content of one staged commit, read into memory (at most MAX_TOTAL_BYTES)."""

    message: bytes | None = None
    files: dict[str, StagedFile] = field(default_factory=dict)
    deletions: list[str] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def digest(self) -> str:
        """SHA-256 over a canonical listing: the message, every file's path, mode and content
        hash in path order, the deletions in order, and the refused entries. Each field is
        length-prefixed, so no two different listings hash alike."""
        h = hashlib.sha256()

        def put(value: bytes | str) -> None:
            raw = os.fsencode(value) if isinstance(value, str) else value
            h.update(b"%d:" % len(raw) + raw + b",")

        put("sandboxfs staged commit 1")
        put("message" if self.message is not None else "no message")
        put(self.message or b"")
        for path in sorted(self.files, key=os.fsencode):
            f = self.files[path]
            put("file")
            put(path)
            put(f"{f.mode:o}")
            put(f.sha256)
        for path in sorted(set(self.deletions), key=os.fsencode):
            put("delete")
            put(path)
        for entry in sorted(self.refused):
            put("refused")
            put(entry.path)
            put(entry.kind)
        return "sha256:" + h.hexdigest()


class TooLarge(Failure):
    """A staged commit beyond MAX_TOTAL_BYTES, MAX_ENTRIES or MAX_DEPTH: refused (exit 1)."""


class _Budget:
    def __init__(self, commit_id: str) -> None:
        self.commit_id = commit_id
        self.entries = 0
        self.bytes = 0

    def entry(self, count: int = 1) -> None:
        self.entries += count
        if self.entries > MAX_ENTRIES:
            raise TooLarge(
                f"staged commit {escape_name(self.commit_id)} is too large to review: more than "
                f"{MAX_ENTRIES} files, directories and deletions; stage smaller commits"
            )

    def data(self, size: int) -> None:
        self.bytes += size
        if self.bytes > MAX_TOTAL_BYTES:
            raise TooLarge(
                f"staged commit {escape_name(self.commit_id)} is too large to review: more than "
                f"{MAX_TOTAL_BYTES // (1024 * 1024)} MiB; stage smaller commits"
            )

    def remaining(self) -> int:
        return MAX_TOTAL_BYTES - self.bytes


def kind_of(mode: int) -> str:
    """What a stat mode is, as a review names it ("symlink", "fifo", ...)."""
    for test, name in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISCHR, "character device"),
    ):
        if test(mode):
            return name
    return "special file"


def _read_regular(dir_fd: int, name: str, budget: _Budget) -> tuple[bytes, int] | str:
    """(content, git mode) of the regular file `name`, or the kind of entry it is instead.
    Never follows a symlink, never blocks on a FIFO swapped in, reads no more than the budget."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "vanished entry"
    if not stat.S_ISREG(st.st_mode):
        return kind_of(st.st_mode)
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "unreadable file"
        if exc.errno == errno.ENOENT:
            return "vanished entry"
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return kind_of(st.st_mode)
        budget.data(st.st_size)
        chunks = []
        got = 0
        while True:
            chunk = os.read(fd, min(1 << 20, budget.remaining() + 1))
            if not chunk:
                break
            got += len(chunk)
            if got > st.st_size:  # grew while being read
                budget.data(len(chunk))
            chunks.append(chunk)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EIO):
            return "unreadable file"
        raise
    finally:
        os.close(fd)
    return b"".join(chunks), MODE_EXEC if st.st_mode & 0o111 else MODE_FILE


def _walk(dir_fd: int, prefix: str, depth: int, budget: _Budget, tree: StagedTree) -> None:
    for name in sorted(os.listdir(dir_fd), key=os.fsencode):
        budget.entry()
        path = prefix + name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                raise TooLarge(
                    f"staged commit {escape_name(budget.commit_id)} is too large to review: "
                    f"directories nested more than {MAX_DEPTH} deep"
                )
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.ENOENT):
                    raise
                if exc.errno != errno.ENOENT:
                    tree.refused.append(Refused(f"{FILES_NAME}/{path}", "unreadable directory"))
                continue
            try:
                _walk(sub, path + "/", depth + 1, budget, tree)
            finally:
                os.close(sub)
            continue
        got = _read_regular(dir_fd, name, budget)
        if isinstance(got, str):
            if got != "vanished entry":
                tree.refused.append(Refused(f"{FILES_NAME}/{path}", got))
        else:
            tree.files[path] = StagedFile(path, got[1], got[0])


def parse_deletions(data: bytes) -> list[str]:
    """deletions.txt: one path a line; blank lines and a trailing CR are ignored, and a path
    listed twice counts once."""
    seen: dict[str, None] = {}
    for raw in data.split(b"\n"):
        line = raw.removesuffix(b"\r")
        if line.strip():
            seen.setdefault(os.fsdecode(line))
    return list(seen)


def read_tree(dir_fd: int, commit_id: str) -> StagedTree:
    """Read the staged commit whose directory is open as `dir_fd` (see the module doc)."""
    budget = _Budget(commit_id)
    tree = StagedTree()
    for name in sorted(os.listdir(dir_fd), key=os.fsencode):
        budget.entry()
        if name in (MESSAGE_NAME, DELETIONS_NAME):
            got = _read_regular(dir_fd, name, budget)
            if isinstance(got, str):
                if got != "vanished entry":
                    tree.refused.append(Refused(name, got))
            elif name == MESSAGE_NAME:
                tree.message = got[0]
            else:
                tree.deletions = parse_deletions(got[0])
                budget.entry(len(tree.deletions))
        elif name == FILES_NAME:
            try:
                files_fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EACCES):
                    raise
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                tree.refused.append(Refused(name, kind_of(st.st_mode)))
                continue
            try:
                _walk(files_fd, "", 0, budget, tree)
            finally:
                os.close(files_fd)
        else:
            tree.unknown.append(name)
    return tree


def write_tree(tree: StagedTree, dir_fd: int) -> None:
    """Write `tree` in the staged-commit format into the empty directory `dir_fd` (the
    snapshot). Refused and unknown entries are not written: state.json keeps them."""

    def create(parent: int, name: str, data: bytes, mode: int) -> None:
        fd = os.open(name, CREATE_FLAGS, mode, dir_fd=parent)
        try:
            os.fchmod(fd, mode)
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    if tree.message is not None:
        create(dir_fd, MESSAGE_NAME, tree.message, 0o644)
    if tree.deletions:
        create(
            dir_fd, DELETIONS_NAME, b"".join(os.fsencode(d) + b"\n" for d in tree.deletions), 0o644
        )
    if not tree.files:
        return
    dirs: dict[str, int] = {}
    try:
        os.mkdir(FILES_NAME, 0o755, dir_fd=dir_fd)
        dirs[""] = os.open(FILES_NAME, DIR_FLAGS, dir_fd=dir_fd)
        for path in sorted(tree.files, key=os.fsencode):
            parent = ""
            parts = path.split("/")
            for name in parts[:-1]:
                here = f"{parent}/{name}" if parent else name
                if here not in dirs:
                    os.mkdir(name, 0o755, dir_fd=dirs[parent])
                    dirs[here] = os.open(name, DIR_FLAGS, dir_fd=dirs[parent])
                parent = here
            f = tree.files[path]
            create(dirs[parent], parts[-1], f.data, 0o755 if f.mode == MODE_EXEC else 0o644)
    finally:
        for fd in dirs.values():
            os.close(fd)
