"""Asking the user's git where things are, as it would find them: `git rev-parse`, which reads
config and runs nothing (no hook, fsmonitor or pager). `safe.directory=*` lets root ask about a
project another user owns; the caller's GIT_DIR and the like are dropped so that the project
itself is asked about."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

_LOCATION_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_COMMON_DIR", "GIT_INDEX_FILE")


def rev_parse(project: Path, *args: str) -> list[str] | None:
    """The lines `git rev-parse ARGS` prints in `project` (paths relative to it where git
    gives them so); None when git is missing, fails, or the project is in no repository."""
    git = shutil.which("git")
    if git is None:
        return None
    env = {k: v for k, v in os.environ.items() if k not in _LOCATION_ENV}
    env["GIT_OPTIONAL_LOCKS"] = "0"
    try:
        result = subprocess.run(
            [git, "-c", "safe.directory=*", "rev-parse", *args],
            cwd=project,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = os.fsdecode(result.stdout).split("\n")
    if result.returncode != 0 or lines[-1]:
        return None  # every answer ends with a newline: anything else is cut short
    return lines[:-1]
