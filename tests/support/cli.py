"""Running the sandboxfs CLI and shell commands as a user would, and checking what they print."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

SANDBOXFS = [sys.executable, "-m", "sandboxfs"]


def sandboxfs(
    *args: str | Path, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the sandboxfs CLI as a user would, capturing its output."""
    return subprocess.run(
        [*SANDBOXFS, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def sh(
    command: str,
    cwd: Path | None = None,
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a shell command line with real tools, with `env` added to the environment; never
    raises on failure."""
    return subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, exactly one line on stderr (no traceback) containing every needle."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
