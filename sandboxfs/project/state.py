"""What a project's state dir (`<project>/.sandbox/`) holds, and trimming it.

The state dir (laid out by sandboxfs.project.zones, its paths named by sandboxfs.layout) holds
the audit log (`audit.jsonl`, with its `.lock` and `.reserve`, and its rotated segments
`audit.<first id>-<last id>.jsonl`), the daemon logs (`logs/<session>.log`), the quota tallies
(`quota/<zone>-<dev>-<ino>`), and per workspace (`workspaces/<ws>/`) the /workspace zone
(`workspace/`), every session's /session zone (`sessions/<id>/`), the /staged zone (`staged/`)
and the reviews of staged commits (`review/<id>/`). Nothing removes any of it by itself:
`sandboxfs sessions prune`, `sandboxfs staged prune` (sandboxfs.staging.prune) and
`sandboxfs audit prune` do, when asked.

A session is *in use* while a mount, a `sandboxfs run` or an API sandbox has it: each holds a
shared `flock` on the session's directory for as long as it uses it (`hold`), and pruning takes
an exclusive one without waiting, so a session in use is never removed, whichever user or mount
namespace has it. A live mount that names the session in its context.json counts too (mounts
of an older sandboxfs hold no lock).

Sizes are what the files take on disk (allocated blocks), each inode once, without following a
symlink or entering another mount. The *last use* of a session is the latest change (mtime or
ctime) of anything in its directory or of its daemon log: reading changes neither, so a session
only read from looks unused since its last change.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sandboxfs.audit.anchor import make_private_dirs
from sandboxfs.audit.common import log_files
from sandboxfs.audit.writer import record_now
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.syscalls import fstat
from sandboxfs.errors import Failure, SandboxfsError, UserError
from sandboxfs.layout import (
    anchors_dir,
    audit_path,
    audit_reserve,
    control_dir,
    log_path,
    pruning_dir,
    quota_parts,
    run_dir,
    session_dir,
    sessions_dir,
    state_dir,
    state_root,
    workspaces_dir,
)
from sandboxfs.project.zones import check_id

_STATE_ROOT_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a named pipe",
    stat.S_IFSOCK: "a socket",
}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DURATION_RE = re.compile(r"^(\d+)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# A live mount: (mountpoint, its context.json), as `sandboxfs status` reads them.
LiveMount = tuple[str, dict[str, Any]]


# ----- durations and sizes ------------------------------------------------------------------------


def parse_duration(text: str) -> timedelta:
    """`30s`, `10m`, `12h`, `7d` or `2w`: a whole number and a unit; ValueError otherwise."""
    match = _DURATION_RE.match(text)
    if not match:
        raise ValueError(
            f"invalid duration {text!r}: a whole number and a unit, s, m, h, d or w (30m, 12h, 7d)"
        )
    return timedelta(seconds=int(match.group(1)) * _UNITS[match.group(2)])


def format_duration(seconds: float) -> str:
    """A duration in its largest whole unit: `45s`, `12m`, `5h`, `3d`."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def format_size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Usage:
    """What a tree takes on disk, how many entries it has (itself included), and its latest
    change (mtime or ctime; 0 when it does not exist)."""

    bytes: int = 0
    entries: int = 0
    newest: float = 0.0


def usage(path: Path) -> Usage:
    """Usage of the tree at `path`: never follows a symlink nor enters another mount; each
    inode counted once; what cannot be read is left out."""
    try:
        top = os.lstat(path)
    except OSError:
        return Usage()
    seen = {(top.st_dev, top.st_ino)}
    found = Usage(top.st_blocks * 512, 1, max(top.st_mtime, top.st_ctime))
    pending = [os.fspath(path)] if stat.S_ISDIR(top.st_mode) else []
    while pending:
        try:
            listing = os.scandir(pending.pop())
        except OSError:
            continue
        with listing:
            for entry in listing:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != top.st_dev:  # the root of another mount: not ours
                    continue
                found.newest = max(found.newest, st.st_mtime, st.st_ctime)
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                found.entries += 1
                found.bytes += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    pending.append(entry.path)
    return found


def audit_bytes(project: Path) -> int:
    """What the audit log takes on disk: every segment, the log, and its reserve."""
    files = [*log_files(audit_path(project)), audit_reserve(project)]
    return sum(usage(path).bytes for path in files)


def state_dir_bytes(project: Path) -> int:
    """What the project's state dir takes on disk (0 when there is none)."""
    return usage(state_dir(project)).bytes


# ----- in use -------------------------------------------------------------------------------------


def hold(path: Path, expected: tuple[int, int] | None = None) -> int:
    """Mark the session whose directory is `path` in use for as long as the returned
    descriptor stays open (a shared flock; see the module doc). `expected`: the (st_dev,
    st_ino) the caller opened it as. UserError (exit 1) when the directory was pruned or
    replaced meanwhile; a file system without flock leaves the mark out, nothing fails."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        raise _pruned(path) from None
    try:
        with contextlib.suppress(OSError):  # no flock here: in use is told by the mounts
            fcntl.flock(fd, fcntl.LOCK_SH)
        st = os.fstat(fd)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            raise _pruned(path) from None
        mine = (st.st_dev, st.st_ino)
        if mine != (now.st_dev, now.st_ino) or expected not in (None, mine):
            raise _pruned(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pruned(path: Path) -> Failure:
    return Failure(f"session directory {path} was pruned while it was being opened; try again")


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[int | None]:
    """An exclusive flock on the directory at `path`, or None if something holds it (it is in
    use) or it is gone; released at the end."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        except OSError:
            pass  # no flock on this file system: the mounts' context tells
        yield fd
    finally:
        os.close(fd)


def locked_by_someone(path: Path) -> bool:
    with _exclusive(path) as fd:
        return fd is None and path.is_dir()


# ----- sessions -----------------------------------------------------------------------------------


@dataclass
class Session:
    workspace: str
    id: str
    path: Path
    bytes: int  # its directory and its daemon log, on disk
    entries: int
    created: float | None  # the directory's birth time, where the file system keeps one
    last_used: float
    in_use: bool
    mounts: list[str] = field(default_factory=list)  # live mounts (and runs) that have it

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "workspace": self.workspace,
            "path": str(self.path),
            "bytes": self.bytes,
            "entries": self.entries,
            "created": iso(self.created) if self.created else None,
            "age_seconds": int(now - self.created) if self.created else None,
            "last_used": iso(self.last_used),
            "idle_seconds": int(max(0.0, now - self.last_used)),
            "in_use": self.in_use,
            "mounts": self.mounts,
        }


def workspaces(project: Path) -> list[str]:
    root = workspaces_dir(project)
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    return [name for name in names if _valid_id(name)]


def _valid_id(name: str) -> bool:
    try:
        check_id("session", name)
    except SandboxfsError:
        return False
    return True


def sessions(
    project: Path, live: Sequence[LiveMount], workspace: str | None = None
) -> list[Session]:
    """Every session of the project (of one workspace, if given), last used first."""
    found: list[Session] = []
    for ws in [workspace] if workspace is not None else workspaces(project):
        root = sessions_dir(project, ws)
        try:
            names = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for name in names:
            if _valid_id(name):
                found.append(_session(project, ws, name, live))
    found.sort(key=lambda s: (-s.last_used, s.workspace, s.id))
    return found


def _session(
    project: Path, workspace: str, name: str, live: Sequence[LiveMount], locks: bool = True
) -> Session:
    path = session_dir(project, workspace, name)
    tree = usage(path)
    log = usage(log_path(project, name))
    created: float | None = None
    with contextlib.suppress(OSError):
        fd = os.open(path, _DIR_FLAGS)
        try:
            birth = fstat(fd).st_birthtime_ns
        finally:
            os.close(fd)
        created = birth / 1e9 if birth else None
    mounts = _mounts_of(project, workspace, name, live)
    return Session(
        workspace,
        name,
        path,
        tree.bytes + log.bytes,
        tree.entries,
        created,
        max(tree.newest, log.newest),
        bool(mounts) or (locks and locked_by_someone(path)),
        mounts,
    )


def _mounts_of(project: Path, workspace: str, session: str, live: Sequence[LiveMount]) -> list[str]:
    return [
        mountpoint
        for mountpoint, context in live
        if (context.get("project"), context.get("workspace"), context.get("session"))
        == (str(project), workspace, session)
    ]


@dataclass
class Pruned:
    removed: list[Session] = field(default_factory=list)
    kept: list[tuple[Session, str]] = field(default_factory=list)  # found in use: why
    failed: list[tuple[Session, str]] = field(default_factory=list)  # not removed entirely: why


def stale_sessions(
    found: Iterable[Session], older_than: timedelta, now: float
) -> tuple[list[Session], list[Session]]:
    """(sessions last used more than `older_than` ago and not in use; those in use that
    would be otherwise)."""
    cutoff = now - older_than.total_seconds()
    old = [s for s in found if s.last_used < cutoff]
    return [s for s in old if not s.in_use], [s for s in old if s.in_use]


def prune_sessions(
    project: Path, chosen: Iterable[Session], older_than: timedelta, live: Sequence[LiveMount]
) -> Pruned:
    """Remove each chosen session that is, checked again under its exclusive lock, neither
    in use nor used since the cutoff: its directory, its daemon log (unless a session of the
    same id in another workspace still writes it) and its quota tally. Each is audited (op
    `prune`) before it goes."""
    result = Pruned()
    for session in chosen:
        with _exclusive(session.path) as fd:
            again = _session(project, session.workspace, session.id, live, locks=False)
            why = None
            if not os.path.lexists(session.path):
                why = "it is gone already"
            elif fd is None or again.mounts:
                why = "it is in use"
            elif again.last_used >= datetime.now(UTC).timestamp() - older_than.total_seconds():
                why = "it was used since it was listed"
            if why is not None:
                result.kept.append((session, why))
                continue
            assert fd is not None
            st = os.fstat(fd)
            _record(project, session)
            trash = move_to_trash(project, session.path)
        problem = remove_tree(trash)
        _unlink_quiet(project.joinpath(*quota_parts(), f"session-{st.st_dev}-{st.st_ino}"))
        if not any(session_dir(project, ws, session.id).exists() for ws in workspaces(project)):
            _unlink_quiet(log_path(project, session.id))
        if problem:
            result.failed.append((session, problem))
        else:
            result.removed.append(session)
    return result


def _record(project: Path, session: Session) -> None:
    """The audit entry of a pruned session, written before anything is removed."""
    detail = (
        f"pruned session {session.id} of workspace {session.workspace} "
        f"({format_size(session.bytes)}, last used {iso(session.last_used)})"
    )
    record_now(
        audit_path(project),
        AuditOp.PRUNE,
        zone="session",
        session=session.id,
        workspace=session.workspace,
        detail=detail,
        nothing_done="; nothing pruned",
    )


# ----- removing -----------------------------------------------------------------------------------


def move_to_trash(project: Path, path: Path) -> Path:
    """Rename `path` into the state dir's pruning directory (same file system): from here on
    nothing finds it by its name."""
    trash = pruning_dir(project)
    with contextlib.suppress(FileExistsError):
        os.mkdir(trash, 0o700)
    if trash.is_symlink() or not trash.is_dir():
        raise Failure(f"{trash} is not a directory; move it away")
    target = trash / f"{path.name}-{secrets.token_hex(4)}"
    os.rename(path, target)
    return target


def finish_interrupted(project: Path) -> None:
    """Delete what an interrupted prune left in the pruning directory."""
    trash = pruning_dir(project)
    if trash.is_dir() and not trash.is_symlink():
        for entry in os.scandir(trash):
            remove_tree(Path(entry.path))


def remove_tree(path: Path) -> str | None:
    """Delete the tree at `path` without following a symlink (directories an agent made
    read-only are made writable first); None when it is gone, else why not."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        _unlink_quiet(path)
        return None
    _writable_dirs(path)
    problems: list[str] = []

    def onerror(_function: Any, failed: str, info: Any) -> None:
        exc = info[1]
        if not (isinstance(exc, OSError) and exc.errno == errno.ENOENT):
            problems.append(f"{failed}: {getattr(exc, 'strerror', None) or exc}")

    shutil.rmtree(path, onerror=onerror)
    return problems[0] if problems else None


def _writable_dirs(path: Path) -> None:
    pending = [os.fspath(path)]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError):
            mode = os.lstat(current).st_mode
            if stat.S_ISDIR(mode) and mode & 0o700 != 0o700:
                os.chmod(current, stat.S_IMODE(mode) | 0o700)
            with os.scandir(current) as listing:
                pending.extend(e.path for e in listing if e.is_dir(follow_symlinks=False))


def _unlink_quiet(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def check_state_root() -> None:
    """UserError (one line) unless the user's state dir is a directory this process can write,
    made (0700) when missing. `mount` and `run` check it before they write anything: the audit
    log's key lives there, and a log opened without it would be written without macs."""
    root = state_root()
    problem = _state_root_problem(root)
    if problem is None:
        return
    if os.environ.get("SANDBOXFS_STATE_DIR"):
        source = "$SANDBOXFS_STATE_DIR"
    elif os.path.isabs(os.environ.get("XDG_STATE_HOME", "")):
        source = "$XDG_STATE_HOME/sandboxfs"
    else:
        source = "the default"
    raise UserError(
        f"state directory {root} ({source}) {problem}; set SANDBOXFS_STATE_DIR to a directory "
        f"you can write (it holds the audit logs' keys and the mountpoints of runs)"
    )


def _state_root_problem(root: Path) -> str | None:
    """What makes `root` unusable as the state dir, or None; a missing one is created."""
    try:
        make_private_dirs(root)
    except OSError as exc:
        return f"cannot be created ({exc.strerror})"
    for directory in (root, anchors_dir(), control_dir(), run_dir()):
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"cannot be looked at ({exc.strerror}: {directory})"
        if not stat.S_ISDIR(st.st_mode):
            kind = _STATE_ROOT_KINDS.get(stat.S_IFMT(st.st_mode), "not a directory")
            if directory == root:
                return f"is {kind}, not a directory"
            return f"holds {directory.name}, {kind}, where a directory belongs"
    try:
        fd, probe = tempfile.mkstemp(dir=root, prefix=".writable-")
    except OSError as exc:
        return f"cannot be written ({exc.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None
