"""The git surface: git run as the user, outside any sandbox, and what its refusals look like."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

GIT_ENV = {
    "GIT_AUTHOR_NAME": "User",
    "GIT_AUTHOR_EMAIL": "user@example.invalid",
    "GIT_COMMITTER_NAME": "User",
    "GIT_COMMITTER_EMAIL": "user@example.invalid",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}

READ_ONLY = "Read-only file system"


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The user's git, outside the mount, as it would run in a terminal."""
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **GIT_ENV},
    )


def fsmonitor(marker: Path) -> str:
    """A config that runs code as git's fsmonitor: it appends to `marker`."""
    return f'[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "echo ran >> {marker}; false"\n'


def user_repo(project: Path) -> None:
    """The user's repository, made natively before any agent runs."""
    for cmd in (
        ["init", "-q", "-b", "main"],
        ["add", "README.md", "src"],
        ["commit", "-qm", "initial"],
    ):
        result = git(project, *cmd)
        assert result.returncode == 0, result.stderr
