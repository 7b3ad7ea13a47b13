"""Checks of the zone tests: a command's outcome, a refusal by its errno, the mount table."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from tests.support.mounts import Mount


def denial(m: Mount, path: str, errno: str, op: str | None = None) -> dict[str, Any]:
    """The refusal of `path` with `errno` by this mount (refusals are written before the
    error is returned, so no waiting)."""
    for entry in m.audit("--denied"):
        if (
            entry["session"] == m.session
            and entry["path"] == path
            and entry["errno"] == errno
            and (op is None or entry["op"] == op)
        ):
            assert entry["allowed"] is False, entry
            return entry
    raise AssertionError(f"no {errno} denial of {path} in session {m.session}")


def failed(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode != 0, (result.returncode, result.stdout, result.stderr)
    assert message in result.stderr, result.stderr


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.returncode, result.stderr)
    return result.stdout


def is_mounted(mnt: Path) -> bool:
    text = Path("/proc/self/mounts").read_text()
    return any(line.split()[1] == str(mnt) for line in text.splitlines())
