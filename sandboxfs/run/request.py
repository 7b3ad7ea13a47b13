"""What `sandboxfs run` is asked to do, and the exit statuses it answers with of its own.

A module of its own: the supervisor, the network it serves and the lines it prints all take a
`RunRequest`, and none of them imports the supervisor (or each other) to get it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sandboxfs.config.model import Config
from sandboxfs.core.policy import Trust
from sandboxfs.run.allowlist import HostRule
from sandboxfs.run.nest import Nesting
from sandboxfs.run.toolchain import Toolchain

EXIT_SETUP = 125  # as `docker run`: the sandbox could not be set up, CMD never ran
EXIT_MOUNT_LOST = 1  # CMD exited 0, but its mount was lost while it ran (the daemon died)


@dataclass(frozen=True)
class RunRequest:
    project: Path
    trust: Trust
    workspace: str
    session: str
    config: Config
    command: tuple[str, ...]
    config_file: Path | None = None
    net: str = "none"
    allow: tuple[HostRule, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    audit_sync: bool = False
    quiet: bool = False
    # What CMD needs of the host, read-only (sandboxfs.run.toolchain): its trees and the PATH.
    tools: Toolchain = field(default_factory=Toolchain)
    approvals: str = "ask"  # how `ask` rules are answered (MountRequest.approvals)
    # A nested child's: the descriptor its parent reads this mount's control socket from, to
    # ask this run's approval requests in the parent's terminal (sandboxfs.run.nest).
    report_control: int | None = None
    # A nested child's place in its tree of runs (its depth, the top-level run's slots).
    nesting: Nesting = field(default_factory=Nesting)


def exit_status(status: int, lost: str | None) -> int:
    """run's exit status: CMD's, except that a lost mount is never a success (CMD's own status
    when it failed, else EXIT_MOUNT_LOST)."""
    return EXIT_MOUNT_LOST if lost is not None and status == 0 else status
