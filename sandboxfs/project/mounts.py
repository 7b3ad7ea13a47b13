"""The mount table and what `mount`, `run`, `umount`, `status` and `sessions` need of it,
without the daemon: nothing here imports pyfuse3 or trio, so that a command that does not mount
(`doctor` above all, whose check of pyfuse3 must run where it cannot be imported) never loads
them. sandboxfs.fuse.daemon imports what it needs from here.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandboxfs.config.model import Config
from sandboxfs.core.policy import Trust
from sandboxfs.errors import UserError
from sandboxfs.layout import session_dir, sessions_dir, state_dir
from sandboxfs.project.zones import check_id, new_session_id

FSTYPE = "fuse.sandboxfs"
DEAD_MOUNT_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


@dataclass(frozen=True)
class MountRequest:
    mountpoint: Path
    project: Path
    trust: Trust
    workspace: str
    session: str
    config: Config
    audit_sync: bool = False
    debug: bool = False
    allow_other: bool = False
    config_file: Path | None = None
    command: tuple[str, ...] | None = None  # set by `sandboxfs run`: shown in context.json
    read_only: bool = False  # mounted `ro`: the kernel refuses every change
    approvals: str = "ask"  # how `ask` rules are answered: ask, none, off (core.approvals.Mode)


def choose_session(
    project: Path, workspace: str, session: str | None, new_session: str | None
) -> tuple[str, bool]:
    """The session to use and whether it is resumed.

    `--session ID` must name an existing session not in use by another mount (two mounts of
    one session would interleave its scratch files unnoticed); `--new-session ID` must not exist
    yet (a typo must not silently start an empty session); neither gives a random new id.
    """
    if session is not None:
        check_id("session", session)
        if not session_dir(project, workspace, session).is_dir():
            known = existing_sessions(project, workspace)
            listed = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "")
            raise UserError(
                f"session {session!r} does not exist in workspace {workspace!r} "
                f"({'existing, newest first: ' + listed if known else 'it has no sessions yet'}); "
                f"to start one with this id: --new-session {session}"
            )
        for mountpoint, context in live_contexts():
            if (context.get("project"), context.get("workspace"), context.get("session")) == (
                str(project),
                workspace,
                session,
            ):
                raise UserError(
                    f"session {session} is already mounted at {mountpoint} "
                    f"(pid {context.get('pid')}); unmount it first "
                    f"(sandboxfs umount {mountpoint}) or start another session"
                )
        return session, True
    if new_session is not None:
        check_id("session", new_session)
        if session_dir(project, workspace, new_session).is_dir():
            raise UserError(
                f"session {new_session!r} already exists in workspace {workspace!r}; "
                f"resume it with --session {new_session}"
            )
        return new_session, False
    return new_session_id(), False


def existing_sessions(project: Path, workspace: str) -> list[str]:
    """Session ids of a workspace, most recently used first."""
    root = sessions_dir(project, workspace)
    try:
        entries = [e for e in root.iterdir() if e.is_dir()]
    except OSError:
        return []
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    return [e.name for e in entries]


def live_contexts() -> list[tuple[str, dict[str, Any]]]:
    """The live mounts (and runs) whose context.json can be read: (mountpoint, context)."""
    found = []
    for mountpoint in sandboxfs_mounts():
        context = read_context(Path(mountpoint), timeout=2.0)
        if isinstance(context, dict):
            found.append((mountpoint, context))
    return found


def validate_mountpoint(mountpoint: Path, project: Path) -> Path:
    """An existing, empty directory that nothing is mounted on, outside the project's state
    dir, that fusermount3 will mount on for this user; clears a dead sandboxfs mount."""
    state = Path(os.path.realpath(state_dir(project)))
    if Path(os.path.realpath(mountpoint)).is_relative_to(state):
        raise UserError(
            f"mountpoint {mountpoint} is inside the project's state dir {state}, which the "
            f"mount serves from; use an empty directory elsewhere, for example {project / 'mnt'}"
        )
    try:
        mountpoint.stat()
    except FileNotFoundError:
        raise UserError(
            f"mountpoint {mountpoint} does not exist; create an empty directory first "
            f"(mkdir {mountpoint})"
        ) from None
    except OSError as exc:
        if exc.errno not in DEAD_MOUNT_ERRNOS:
            raise UserError(f"mountpoint {mountpoint}: {exc.strerror}") from None
        lazy_unmount(mountpoint)
    mp = Path(os.path.abspath(mountpoint))
    if str(mp) in sandboxfs_mounts() and read_context(mp, timeout=2.0) == "dead":
        # stat() above may have been answered from the kernel's cache of a dead mount.
        lazy_unmount(mp)
    mp = mp.resolve()
    if os.path.ismount(mp):
        raise UserError(
            f"mountpoint {mountpoint} is already mounted; unmount it first "
            f"(sandboxfs umount {mountpoint})"
        )
    if not mp.is_dir():
        raise UserError(f"mountpoint {mountpoint} is not a directory")
    try:
        st = mp.stat()
        empty = not any(mp.iterdir())
    except OSError as exc:
        raise UserError(
            f"mountpoint {mountpoint} cannot be listed ({exc.strerror}; owner "
            f"{_owner(mp)}); use an empty directory of your own"
        ) from None
    if not empty:
        raise UserError(f"mountpoint {mountpoint} is not empty; use an empty directory")
    if os.getuid() != 0 and (
        not os.access(mp, os.W_OK) or (st.st_mode & stat.S_ISVTX and st.st_uid != os.getuid())
    ):
        # What fusermount3 refuses, with a vague "fuse_session_mount failed" once mounting.
        raise UserError(
            f"mountpoint {mountpoint} is not writable by you (owner {_owner(mp)}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}); fusermount3 mounts only on a directory you may "
            f"write: use an empty directory of your own"
        )
    if mp == project:
        raise UserError(
            f"mountpoint {mountpoint} is the project directory itself; "
            f"use an empty directory, for example {project / 'mnt'}"
        )
    _check_dev_fuse()
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        raise UserError("fusermount3 not found; install fuse3 (apt-get install fuse3)")
    return mp


def _owner(path: Path) -> str:
    try:
        uid = path.stat().st_uid
    except OSError:
        return "unknown"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def discard_new_session(project: Path, workspace: str, session: str) -> None:
    """Remove what a mount of a new session that never served created: its session
    directory, when it holds nothing but empty directories (never a file)."""
    root = session_dir(project, workspace, session)
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            return


def _check_dev_fuse() -> None:
    """Missing and not permitted are different problems with different fixes."""
    try:
        st = os.stat("/dev/fuse")
    except FileNotFoundError:
        raise UserError(
            "/dev/fuse does not exist; install fuse3 and load the module "
            "(apt-get install fuse3; modprobe fuse), or in a container pass --device /dev/fuse"
        ) from None
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise UserError(
            f"/dev/fuse is not readable and writable by you (mode {st.st_mode & 0o777:04o}, "
            f"owner uid {st.st_uid}); Debian makes it 0666: sudo chmod 0666 /dev/fuse "
            f"(see 'sandboxfs doctor')"
        )


NOT_YOURS = "not yours"
# What a mount whose audit log cannot be written answers every operation with (ENOSPC, even
# opening its read-only context.json): it fails closed until entries can be written.
FAILING_CLOSED = "failing closed"


def read_context(mountpoint: Path, timeout: float) -> dict[str, Any] | str:
    """A mount's context.json, or why not: "dead" (its daemon is gone: ENOTCONN), "not yours"
    (another user's mount: EACCES), "failing closed" (its audit log cannot be written:
    ENOSPC), "unresponsive" (no answer within `timeout`: hung or very busy), or "unreadable"
    (any other error).

    Opening the file always reaches the daemon (opens are never answered from the kernel's
    cache), so this tells a live mount from a dead one; a thread bounds a hung daemon.
    """
    result: dict[str, Any] | str = "unresponsive"

    def read() -> None:
        nonlocal result
        try:
            result = json.loads((mountpoint / ".sandboxfs" / "context.json").read_bytes())
        except OSError as exc:
            if exc.errno in DEAD_MOUNT_ERRNOS:
                result = "dead"
            elif exc.errno in (errno.EACCES, errno.EPERM):
                result = NOT_YOURS
            elif exc.errno == errno.ENOSPC:
                result = FAILING_CLOSED
            else:
                result = "unreadable"
        except ValueError:
            result = "unreadable"

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout)
    return result


def mount_owner(mountpoint: str) -> int | None:
    """The uid that made a FUSE mount (its `user_id=` option in the mount table)."""
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and _unescape_mount_path(fields[1]) == mountpoint:
                for option in fields[3].split(","):
                    if option.startswith("user_id="):
                        return int(option.removeprefix("user_id="))
    return None


def lazy_unmount(mountpoint: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)


def sandboxfs_mounts() -> list[str]:
    """Mountpoints of every sandboxfs mount on this machine, live or dead."""
    found = []
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == FSTYPE:
                found.append(_unescape_mount_path(fields[1]))
    return found


def _unescape_mount_path(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)
