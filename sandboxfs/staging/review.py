"""The staged commits of a workspace and their review state (Workspace, Review).

The first review *freezes* a staged commit: a copy (the snapshot) is taken into
`<project>/.sandbox/workspaces/<ws>/review/<id>/`, beside the zone and in no zone, and from then
on every review and the commit read the snapshot, so what was reviewed is exactly what lands;
`review/<id>/state.json`, written before the copy starts, also makes the mount refuse further
changes below /staged/<id> (sandboxfs.core.guard). `pending` lists the ones still waiting,
freezing nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandboxfs.audit.reader import AuditQuery, query
from sandboxfs.core.entry import AuditOp
from sandboxfs.layout import audit_path, review_dir, review_parts, staged_dir
from sandboxfs.project.zones import check_id

from ..core.errors import SandboxError
from ..core.resolve import ensure_dirs
from ..errors import Failure, SandboxfsError, UserError
from .format import (
    CREATE_FLAGS,
    DIR_FLAGS,
    READ_FLAGS,
    Refused,
    StagedTree,
    TooLarge,
    kind_of,
    read_tree,
    write_tree,
)
from .git import Git
from .text import decode, escape_name

STATUSES = ("pending", "committed", "discarded")

_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")


def valid_id(commit_id: str) -> bool:
    return bool(_ID_RE.match(commit_id))


def check_commit_id(commit_id: str) -> str:
    if not valid_id(commit_id):
        raise UserError(
            f"invalid staged commit id {escape_name(commit_id)!s}: use 1-64 letters, digits, "
            "'.', '_' or '-', not starting with '.'"
        )
    return commit_id


def _now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(text: object) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass
class Review:
    """One staged commit as a review sees it: its content (the snapshot once frozen) and its
    recorded state."""

    commit_id: str
    tree: StagedTree | None  # None: its content could not be read (see `error`)
    state: dict[str, Any]
    frozen: bool
    error: str | None = None

    @property
    def status(self) -> str:
        return str(self.state.get("status") or "pending")

    @property
    def session(self) -> str | None:
        session = self.state.get("session")
        return session if isinstance(session, str) else None

    @property
    def created(self) -> datetime | None:
        return _parse_ts(self.state.get("created"))

    @property
    def base(self) -> str | None:
        base = self.state.get("base")
        return base if isinstance(base, str) else None

    @property
    def digest(self) -> str | None:
        if self.frozen:
            digest = self.state.get("digest")
            return digest if isinstance(digest, str) else None
        return self.tree.digest() if self.tree is not None else None

    def subject(self) -> str:
        message = self.tree.message if self.tree is not None else None
        if not message:
            return ""
        return decode(message).strip().split("\n", 1)[0].strip()


class Workspace:
    """The staged commits of one workspace of a project, and their review state."""

    def __init__(self, project: Path, workspace: str) -> None:
        self.project = project
        self.name = check_id("workspace", workspace)
        self.staged = staged_dir(project, workspace)
        self.review = review_dir(project, workspace)
        self._sessions: dict[str, tuple[str | None, datetime | None]] | None = None

    # -- finding them

    def listing(self, *, skip_unreadable: bool = False) -> tuple[list[str], list[str]]:
        """(staged commit ids, staged or under review, in name order; names in /staged that
        are none, with why). With `skip_unreadable`, an entry that cannot be read (its
        state.json not JSON, say) is left out instead of raising."""

        def has_state(name: str) -> bool:
            try:
                return self.read_state(name) is not None
            except (OSError, SandboxfsError):
                if skip_unreadable:
                    return False
                raise

        ids: set[str] = set()
        ignored: list[str] = []
        fd = self._open_dir(self.staged)
        if fd is not None:
            try:
                for name in os.listdir(fd):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    except OSError:
                        if skip_unreadable:
                            continue
                        raise
                    shown = f"/staged/{escape_name(name)}"
                    if not valid_id(name):
                        ignored.append(f"{shown}: not a staged commit id")
                    elif not stat.S_ISDIR(st.st_mode):
                        ignored.append(f"{shown}: a {kind_of(st.st_mode)}, not a directory")
                    else:
                        ids.add(name)
            finally:
                os.close(fd)
        fd = self._open_dir(self.review)
        if fd is not None:
            try:
                ids.update(name for name in os.listdir(fd) if valid_id(name) and has_state(name))
            finally:
                os.close(fd)
        return sorted(ids), sorted(ignored)

    @staticmethod
    def _open_dir(path: Path) -> int | None:
        try:
            return os.open(path, DIR_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Failure(f"{path} is not a directory") from None
            raise

    def open_staged(self, commit_id: str) -> int | None:
        """A descriptor of /staged/<id>'s backing directory, or None if there is none."""
        parent = self._open_dir(self.staged)
        if parent is None:
            return None
        try:
            return os.open(commit_id, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return None
            raise
        finally:
            os.close(parent)

    def exists_staged(self, commit_id: str) -> bool:
        fd = self.open_staged(commit_id)
        if fd is not None:
            os.close(fd)
        return fd is not None

    def exists(self, commit_id: str) -> bool:
        return self.exists_staged(commit_id) or self.read_state(commit_id) is not None

    def require(self, commit_id: str) -> str:
        check_commit_id(commit_id)
        if not self.exists(commit_id):
            raise UserError(
                f"no staged commit {commit_id} in workspace {self.name} of {self.project} "
                "(see 'sandboxfs staged list')"
            )
        return commit_id

    # -- where they came from

    def sessions(self) -> dict[str, tuple[str | None, datetime | None]]:
        """For each staged commit id, the session and time of the first audit entry below
        /staged/<id>."""
        if self._sessions is None:
            found: dict[str, tuple[str | None, datetime | None]] = {}
            for entry in query(
                audit_path(self.project), AuditQuery(workspace=self.name, zone="staged")
            ):
                path = entry.get("path")
                if entry.get("op") == AuditOp.STAGE or not isinstance(path, str):
                    continue
                if not path.startswith("/staged/"):
                    continue
                commit_id = path[len("/staged/") :].split("/", 1)[0]
                if commit_id and commit_id not in found:
                    session = entry.get("session")
                    found[commit_id] = (
                        session if isinstance(session, str) else None,
                        _parse_ts(entry.get("ts")),
                    )
            self._sessions = found
        return self._sessions

    def _origin(self, commit_id: str, dir_fd: int) -> tuple[str | None, datetime]:
        """The session that staged it, and when it was created: the earliest of its
        directory's mtime and ctime and its first audit entry."""
        st = os.fstat(dir_fd)
        session, first = self.sessions().get(commit_id, (None, None))
        created = datetime.fromtimestamp(min(st.st_mtime, st.st_ctime), UTC)
        if first is not None and first < created:
            created = first
        return session, created

    # -- review state

    def _review_dir(self, commit_id: str) -> Path:
        try:
            return ensure_dirs(self.project, *review_parts(self.name), commit_id)
        except SandboxError as exc:
            raise Failure(f"cannot create the review directory: {exc.reason}") from None

    def read_state(self, commit_id: str) -> dict[str, Any] | None:
        path = self.review / commit_id / "state.json"
        try:
            fd = os.open(path, READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            stream = os.fdopen(fd, "rb")
        except OSError:  # state.json is a directory, say: fdopen leaves `fd` open
            os.close(fd)
            raise
        try:
            with stream:
                data = json.loads(stream.read())
        except (ValueError, UnicodeDecodeError):
            raise Failure(f"{path} is not valid JSON; move it away") from None
        return data if isinstance(data, dict) else None

    def write_state(self, commit_id: str, state: Mapping[str, Any]) -> None:
        directory = self._review_dir(commit_id)
        fd = os.open(directory, DIR_FLAGS)
        try:
            temp = f".state-{secrets.token_hex(6)}.tmp"
            out = os.open(temp, CREATE_FLAGS, 0o600, dir_fd=fd)
            with os.fdopen(out, "wb") as stream:
                stream.write(json.dumps(dict(state), indent=2, sort_keys=True).encode() + b"\n")
                stream.flush()
                os.fsync(stream.fileno())
            os.rename(temp, "state.json", src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def locked(self, commit_id: str) -> Iterator[None]:
        """One review, freeze, commit or discard of a staged commit at a time."""
        directory = self._review_dir(commit_id)
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- reading, freezing

    def load(self, commit_id: str, git: Git | None) -> Review:
        """The staged commit as it is now: its snapshot if frozen, else its live directory
        (read, not frozen)."""
        state = self.read_state(commit_id)
        if state is not None and state.get("digest"):
            return self._snapshot(commit_id, state)
        fd = self.open_staged(commit_id)
        if fd is None:
            return Review(commit_id, None, state or {}, False, "its files are gone")
        try:
            fresh = state or self._fresh_state(commit_id, fd, git)
            try:
                tree = read_tree(fd, commit_id)
            except TooLarge as exc:
                return Review(commit_id, None, fresh, False, exc.message)
        finally:
            os.close(fd)
        return Review(commit_id, tree, fresh, False)

    def _fresh_state(self, commit_id: str, dir_fd: int, git: Git | None) -> dict[str, Any]:
        session, created = self._origin(commit_id, dir_fd)
        return {
            "id": commit_id,
            "status": "pending",
            "digest": None,
            "session": session,
            "created": iso(created),
            "base": git.base_before(created.timestamp()) if git is not None else None,
            "shown_at": None,
            "committed_at": None,
            "commit": None,
            "branch": None,
            "discarded_at": None,
        }

    def _snapshot(self, commit_id: str, state: dict[str, Any]) -> Review:
        fd = self._open_dir(self.review / commit_id / "snapshot")
        if fd is None:
            return Review(commit_id, None, state, True, "its snapshot is gone")
        try:
            tree = read_tree(fd, commit_id)
        finally:
            os.close(fd)
        tree.refused = [Refused(str(p), str(k)) for p, k in state.get("refused", [])]
        tree.unknown = [str(u) for u in state.get("unknown", [])]
        return Review(commit_id, tree, state, True)

    def freeze(self, commit_id: str, git: Git | None) -> Review:
        """Take the snapshot if it has none yet (see the module doc); the review of it."""
        with self.locked(commit_id):
            state = self.read_state(commit_id)
            if state is not None and state.get("digest"):
                return self._snapshot(commit_id, state)
            fd = self.open_staged(commit_id)
            if fd is None:
                raise Failure(f"staged commit {commit_id} has no files to review")
            try:
                if state is None:
                    state = self._fresh_state(commit_id, fd, git)
                    state["shown_at"] = iso(_now())
                    self.write_state(commit_id, state)  # from here on the mount refuses changes
                tree = read_tree(fd, commit_id)
            finally:
                os.close(fd)
            directory = self._review_dir(commit_id)
            snapshot, temp = directory / "snapshot", directory / "snapshot.tmp"
            for stale in (snapshot, temp):
                if stale.exists() or stale.is_symlink():
                    shutil.rmtree(stale)
            ensure_dirs(directory, "snapshot.tmp", mode=0o700)
            out = os.open(temp, DIR_FLAGS)
            try:
                write_tree(tree, out)
            finally:
                os.close(out)
            os.rename(temp, snapshot)
            state["digest"] = tree.digest()
            state["refused"] = [list(r) for r in tree.refused]
            state["unknown"] = list(tree.unknown)
            self.write_state(commit_id, state)
            return Review(commit_id, tree, state, True)

    def remove_staged(self, commit_id: str) -> bool:
        """Remove /staged/<id> from the backing directory; never follows a symlink in it."""
        parent = self._open_dir(self.staged)
        if parent is None:
            return False
        try:
            try:
                st = os.stat(commit_id, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(commit_id, dir_fd=parent)
            else:
                os.unlink(commit_id, dir_fd=parent)
            return True
        finally:
            os.close(parent)


def pending(project: Path, workspace: str) -> list[str]:
    """Ids of the workspace's staged commits still pending (neither committed nor discarded),
    in name order. Freezes nothing and writes nothing; an entry that cannot be read is left
    out; [] when the workspace has staged nothing."""
    space = Workspace(project, workspace)
    ids, _ = space.listing(skip_unreadable=True)
    waiting = []
    for commit_id in ids:
        try:
            state = space.read_state(commit_id)
        except (OSError, SandboxfsError):
            continue
        if Review(commit_id, None, state or {}, False).status == "pending":
            waiting.append(commit_id)
    return waiting
