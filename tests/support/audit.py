"""The audit log's test helpers: `sandboxfs audit` run as a command and followed in the
background, and entries shaped like the ones the mount records."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.cli import SANDBOXFS

__all__ = ["T0", "Follower", "_entry", "_ts", "audit", "follow"]


def audit(
    *args: str | Path, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """The CLI with stdin that is no terminal, whatever runs the tests."""
    return subprocess.run(
        [*SANDBOXFS, "audit", *map(str, args)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **env},
        timeout=30,
        check=False,
    )


class Follower:
    """`sandboxfs audit --follow ...` in the background, its output read line by line."""

    def __init__(self, project: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*SANDBOXFS, "audit", "--project", str(project), "--follow", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.stdout = self._pump(self.proc.stdout)
        self.stderr = self._pump(self.proc.stderr)

    @staticmethod
    def _pump(stream: IO[str]) -> queue.Queue[str]:
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            for line in stream:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        return lines

    @staticmethod
    def line(lines: queue.Queue[str], timeout: float = 10) -> str:
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no line in time") from None


@pytest.fixture
def follow() -> Iterator[Callable[..., Follower]]:
    """`follow(project, *args)` starts a Follower; all are killed at the end of the test."""
    started: list[Follower] = []

    def start(project: Path, *args: str) -> Follower:
        started.append(Follower(project, *args))
        return started[-1]

    yield start
    for follower in started:
        follower.proc.kill()
        follower.proc.communicate(timeout=10)


T0 = datetime(2026, 11, 22, 8, 0, tzinfo=UTC)


def _ts(minutes: float) -> str:
    moment = T0 + timedelta(minutes=minutes)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _entry(**fields: Any) -> dict[str, Any]:
    """An entry shaped like the ones the FUSE adapter records."""
    base: dict[str, Any] = {
        "op": "read",
        "path": "/session/working/a.txt",
        "dest": None,
        "zone": "session",
        "session": "s1",
        "workspace": "default",
        "trust": "untrusted",
        "allowed": True,
        "reason": None,
        "errno": None,
        "pid": 4242,
        "uid": 1000,
        "comm": "cat",
        "bytes": None,
    }
    return base | fields
