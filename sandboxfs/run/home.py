"""The home that `sandboxfs run` gives the program (the command is sandboxfs.cli.home).

Under `run`, `$HOME` is `/sandbox/home`, a zone of the mount (so every access to it is
audited, like any other) backed by `<project>/.sandbox/workspaces/<ws>/homes/<level>/`: one
directory per workspace and trust level, kept across sessions. An agent's settings, caches
and login made in one session are there in the next one of the same workspace and level;
another workspace never sees them, and neither does another level (what a program writes
there at `session`, a shell rc or an agent's hook, is never run by a program at `full`). It
is never the user's real home. `seed` copies (never binds) files of the user's real home into
it; links are followed, secrets refused, a file already there kept unless forced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sandboxfs.core.policy import Trust
from sandboxfs.errors import SandboxfsError, UserError
from sandboxfs.project.identity import home_config
from sandboxfs.project.zones import (
    ensure_home,
)
from sandboxfs.run import toolchain

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_ENTRIES = 10_000
MAX_BYTES = 100 * 1024 * 1024


# ----- in use -----------------------------------------------------------------------------------


def hold(project: Path, workspace: str, trust: Trust) -> int | None:
    """Mark the home `run` uses in use for as long as the descriptor stays open (a shared
    flock: `reset` leaves it alone meanwhile). None where it cannot be marked."""
    try:
        fd = os.open(ensure_home(project, workspace, trust), DIR_FLAGS)
    except (OSError, SandboxfsError):
        return None
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


# ----- the user's git identity -----------------------------------------------------------------

GITCONFIG = ".gitconfig"
_MAX_GITCONFIG = 1 << 20  # a home's ~/.gitconfig larger than this is left as it is


def give_identity(home_fd: int, found: Mapping[str, str]) -> bool:
    """Set the user's git identity (`found`: sandboxfs.project.identity.identity()) in the
    ~/.gitconfig of the home open as `home_fd`, so that what reads git's config rather than
    GIT_AUTHOR_* (`git config user.name`, GitPython and the agents built on it) finds it
    there, and never writes its own into the repository's config. Only user.name and
    user.email are set; what else the program keeps there stays. Never follows a link the
    program left (a link is replaced by a file); a directory, a device or a file too large
    is left alone. Whether the file was written."""
    current = _current_gitconfig(home_fd)
    if current is None:
        return False
    existing, mode = current
    wanted = home_config(b"" if existing is None else existing, found)
    if wanted is None or (existing is not None and wanted == existing):
        return False
    return _replace_gitconfig(home_fd, wanted, mode)


def _current_gitconfig(home_fd: int) -> tuple[bytes | None, int] | None:
    """(give_identity) The ~/.gitconfig there is, and its mode: no content when there is none,
    or a link (replaced); None when it is to be left alone (not a regular file, too large, or
    unreadable)."""
    try:
        fd = os.open(
            GITCONFIG, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=home_fd
        )
    except FileNotFoundError:
        return None, 0o644
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # ELOOP: a link, replaced below
            return None
        return None, 0o644
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_GITCONFIG:
            return None
        existing = _read_all(fd, _MAX_GITCONFIG + 1)
        mode = stat.S_IMODE(st.st_mode)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(existing) > _MAX_GITCONFIG:
        return None
    return existing, mode


def _replace_gitconfig(home_fd: int, wanted: bytes, mode: int) -> bool:
    """(give_identity) Write a new file beside it and rename it over ~/.gitconfig (over a link
    too, never through it); whether that was done."""
    temp = f".{GITCONFIG}.identity-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        out = os.open(temp, flags, 0o600, dir_fd=home_fd)
    except OSError:
        return False
    try:
        try:
            view = memoryview(wanted)
            while view:
                view = view[os.write(out, view) :]
            os.fchmod(out, mode)
        finally:
            os.close(out)
        os.rename(temp, GITCONFIG, src_dir_fd=home_fd, dst_dir_fd=home_fd)  # a link itself
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=home_fd)
        return False
    return True


def _read_all(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total < limit and (chunk := os.read(fd, min(1 << 16, limit - total))):
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


# ----- seed ---------------------------------------------------------------------------------------


@dataclass
class _Entry:
    rel: str  # below the home
    source: str  # the real file or directory
    mode: int
    is_dir: bool
    size: int = 0


@dataclass
class SeedResult:
    copied: int = 0
    kept: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # what a copied directory held, left out


def plan_seed(sources: list[tuple[str, bool]], limits: toolchain.Limits) -> list[_Entry]:
    """What seeding copies: [(path, required)] -> entries, checked. A path must be in the real
    home and no secret; a missing one is an error when `required` (--from), else skipped."""
    home = limits.home
    entries: list[_Entry] = []
    seen: set[tuple[int, int]] = set()
    total = 0
    for written, required in sources:
        path = os.path.abspath(os.path.expanduser(written))
        rel = os.path.relpath(path, home) if os.path.isabs(home) else path
        shown = "~/" + rel if not rel.startswith("..") else written
        if rel == "." or rel.startswith(".."):
            raise UserError(
                f"--from {written}: not in your home ({home}); seed copies from your home to "
                f"the same place in the sandbox's"
            )
        for place in (path, os.path.realpath(path)):
            why = limits.refusal(place, credentials=False)
            if why is not None:
                raise UserError(f"--from {written}: refused: {why}")
        if not os.path.exists(path):
            if required:
                raise UserError(f"--from {written}: no such file or directory")
            continue
        for entry in _walk(path, rel, limits, seen):
            entries.append(entry)
            total += entry.size
            if len(entries) > MAX_ENTRIES or total > MAX_BYTES:
                raise UserError(
                    f"{shown} is too large to seed (over {MAX_ENTRIES} entries or "
                    f"{MAX_BYTES // 2**20} MiB); name the files the agent needs with --from"
                )
    return entries


def _walk(
    path: str, rel: str, limits: toolchain.Limits, seen: set[tuple[int, int]]
) -> list[_Entry]:
    try:
        st = os.stat(path)
    except OSError:
        return []
    if (st.st_dev, st.st_ino) in seen:
        return []  # a loop of links, or twice the same
    seen.add((st.st_dev, st.st_ino))
    if limits.refusal(os.path.realpath(path), credentials=False) is not None:
        return []
    if stat.S_ISREG(st.st_mode):
        return [_Entry(rel, path, stat.S_IMODE(st.st_mode) & 0o777, False, st.st_size)]
    if not stat.S_ISDIR(st.st_mode):
        return []  # sockets, FIFOs, devices: nothing to copy
    entries = [_Entry(rel, path, stat.S_IMODE(st.st_mode) & 0o777 | 0o700, True)]
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return entries
    for name in names:
        entries += _walk(os.path.join(path, name), f"{rel}/{name}", limits, seen)
    return entries


def seed(home: Path, entries: list[_Entry], force: bool) -> SeedResult:
    """Copy `entries` below the home directory `home`, never following a link there: the
    sandbox may have left links in its home (a link is replaced, not written through)."""
    result = SeedResult()
    root = os.open(home, DIR_FLAGS)
    try:
        for entry in entries:
            parts = entry.rel.split("/")
            parent = _open_parents(root, parts[:-1], force)
            if parent is None:
                result.kept += 1
                continue
            try:
                if entry.is_dir:
                    _make_dir(parent, parts[-1], entry.mode, force)
                elif _copy_file(parent, parts[-1], entry, force):
                    result.copied += 1
                    result.bytes += entry.size
                else:
                    result.kept += 1
            finally:
                os.close(parent)
    finally:
        os.close(root)
    return result


def _open_parents(root: int, parts: list[str], force: bool) -> int | None:
    fd = os.dup(root)
    for part in parts:
        nfd = _make_dir(fd, part, 0o700, force)
        os.close(fd)
        if nfd is None:
            return None
        fd = nfd
    return fd


def _make_dir(parent: int, name: str, mode: int, force: bool) -> int | None:
    """The directory `name` in `parent`, made if missing; a link there is replaced, a file
    too with `force` (else None)."""
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        if not (stat.S_ISLNK(st.st_mode) or force):
            return None
        os.unlink(name, dir_fd=parent)
        st = None
    if st is None:
        os.mkdir(name, mode, dir_fd=parent)
    return os.open(name, DIR_FLAGS, dir_fd=parent)


def _copy_file(parent: int, name: str, entry: _Entry, force: bool) -> bool:
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        st = None
    if st is not None and not force and not stat.S_ISLNK(st.st_mode):
        return False
    if st is not None and stat.S_ISDIR(st.st_mode):
        return False  # a directory where the file goes: left to the user
    temp = f".{name}.seed-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(temp, flags, 0o600, dir_fd=parent)
    try:
        with open(entry.source, "rb") as source:
            while chunk := source.read(1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        os.fchmod(out, entry.mode)
    except BaseException:
        os.close(out)
        os.unlink(temp, dir_fd=parent)
        raise
    os.close(out)
    os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)  # replaces a link itself
    return True
