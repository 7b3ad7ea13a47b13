"""Every path sandboxfs keeps state at: the user's own state dir, and a project's `.sandbox/`.

One place, so that the layout is read here rather than pieced together from spellings. A
project's paths come in two forms: `*_parts(...)`, the names below the project, for
`core.store.ensure_dirs` (which makes them one component at a time, never through a link), and
the `Path` of the same place.

The user's state dir (`state_root`) is never inside a project, so a program that sees only
the project through a mount cannot reach what is kept there: the audit anchors, the control
sockets, the private mountpoints of `run`, crash reports.
"""

from __future__ import annotations

import os
from pathlib import Path

from sandboxfs.core.store import STATE_DIR_NAME

__all__ = ["STATE_DIR_NAME"]

AUDIT_LOG_NAME = "audit.jsonl"
PRUNING_DIR_NAME = ".pruning"


# ----- the user's own state dir -----------------------------------------------------------------


def state_root() -> Path:
    """The user's own sandboxfs state directory: $SANDBOXFS_STATE_DIR, else
    $XDG_STATE_HOME/sandboxfs, else ~/.local/state/sandboxfs."""
    explicit = os.environ.get("SANDBOXFS_STATE_DIR")
    if explicit:
        return Path(explicit).absolute()
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec says to ignore a relative one
        return Path(xdg) / "sandboxfs"
    return Path.home() / ".local" / "state" / "sandboxfs"


def anchors_dir() -> Path:
    """The audit logs' anchors, one file per log (sandboxfs.audit.anchor)."""
    return state_root() / "anchors"


def control_dir() -> Path:
    """The control sockets of live mounts, `<daemon pid>.sock` (sandboxfs.project.control)."""
    return state_root() / "control"


def run_dir() -> Path:
    """The private mountpoints of `sandboxfs run`, one directory per run."""
    return state_root() / "run"


# ----- a project's state dir ----------------------------------------------------------------------


def state_dir(project: Path) -> Path:
    return project / STATE_DIR_NAME


def audit_path(project: Path) -> Path:
    return state_dir(project) / AUDIT_LOG_NAME


def audit_reserve(project: Path) -> Path:
    """The space the audit log keeps preallocated for a full disk (sandboxfs.audit.reserve)."""
    return audit_path(project).with_suffix(".reserve")


def logs_parts() -> tuple[str, ...]:
    """The daemon logs, `<session>.log`."""
    return (STATE_DIR_NAME, "logs")


def log_path(project: Path, session: str) -> Path:
    return project.joinpath(*logs_parts(), f"{session}.log")


def quota_parts() -> tuple[str, ...]:
    """The quota tallies shared by the mounts of the project (sandboxfs.core.limits)."""
    return (STATE_DIR_NAME, "quota")


def pruning_dir(project: Path) -> Path:
    """Where a pruned directory is moved before it is deleted (one rename: whatever the
    deletion meets, the name is gone at once); a later prune finishes what an interrupted one
    left (sandboxfs.project.state)."""
    return state_dir(project) / PRUNING_DIR_NAME


def workspaces_dir(project: Path) -> Path:
    return state_dir(project) / "workspaces"


def workspace_parts(workspace: str) -> tuple[str, ...]:
    return (STATE_DIR_NAME, "workspaces", workspace)


def sessions_dir(project: Path, workspace: str) -> Path:
    return project.joinpath(*workspace_parts(workspace), "sessions")


def session_parts(workspace: str, session: str) -> tuple[str, ...]:
    return (*workspace_parts(workspace), "sessions", session)


def session_dir(project: Path, workspace: str, session: str) -> Path:
    return project.joinpath(*session_parts(workspace, session))


def home_parts(workspace: str, level: str) -> tuple[str, ...]:
    """The persistent home of `run` programs of `workspace` at trust `level`."""
    return (*workspace_parts(workspace), "homes", level)


def home_dir(project: Path, workspace: str, level: str) -> Path:
    return project.joinpath(*home_parts(workspace, level))


def staged_parts(workspace: str) -> tuple[str, ...]:
    """The workspace's `/staged` zone: the agent's staged commits."""
    return (*workspace_parts(workspace), "staged")


def staged_dir(project: Path, workspace: str) -> Path:
    return project.joinpath(*staged_parts(workspace))


def attachments_parts(workspace: str) -> tuple[str, ...]:
    """Copies of the files given to child workers, one directory per child."""
    return (*workspace_parts(workspace), "attachments")


def review_parts(workspace: str) -> tuple[str, ...]:
    """Review state of staged commits (frozen copies, verdicts), outside every zone."""
    return (*workspace_parts(workspace), "review")


def review_dir(project: Path, workspace: str) -> Path:
    return project.joinpath(*review_parts(workspace))


LANDING_JOURNAL = "landing.json"
"""review/<id>/landing.json: a landing under way; left behind only by a kill."""


def interrupted_landings(project: Path, workspace: str) -> list[Path]:
    """The journals a kill left, found without loading the staging code (run's start-up)."""
    return sorted(review_dir(project, workspace).glob(f"*/{LANDING_JOURNAL}"))
