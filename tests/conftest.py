"""Shared fixtures: real mounts driven as a user would, always unmounted in `finally`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

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
    command: str, cwd: Path | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run a shell command line with real tools; never raises on failure."""
    return subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        check=False,
        env={**os.environ, **env},
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


def force_unmount(mountpoint: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)


@dataclass
class Mount:
    """A live sandboxfs mount made by `sandboxfs mount`."""

    mnt: Path
    project: Path
    trust: str
    session: str
    workspace: str = "default"
    stdout: str = ""
    extra: tuple[str, ...] = field(default_factory=tuple)

    def audit(self, *filters: str) -> list[dict[str, Any]]:
        """Audit entries (JSON) of this project, optionally filtered with CLI flags."""
        result = sandboxfs("audit", "--project", self.project, "--json", *filters)
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]

    def wait_audit(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0
    ) -> dict[str, Any]:
        """The first audit entry matching predicate, waiting for the background batch flush."""
        deadline = time.monotonic() + timeout
        while True:
            for entry in self.audit():
                if predicate(entry):
                    return entry
            if time.monotonic() > deadline:
                raise AssertionError("no matching audit entry")
            time.sleep(0.05)

    def daemon_pid(self) -> int:
        context = json.loads((self.mnt / ".sandboxfs" / "context.json").read_text())
        return int(context["pid"])

    def unmount(self) -> None:
        if os.path.ismount(self.mnt) or _listed(self.mnt):
            result = sandboxfs("umount", self.mnt)
            if result.returncode != 0:
                force_unmount(self.mnt)


def _listed(mountpoint: Path) -> bool:
    text = Path("/proc/self/mounts").read_text()
    return any(line.split()[1] == str(mountpoint) for line in text.splitlines() if "fuse" in line)


class MountError(Exception):
    def __init__(self, result: subprocess.CompletedProcess[str]) -> None:
        super().__init__(f"sandboxfs mount failed ({result.returncode}): {result.stderr.strip()}")
        self.result = result


@contextmanager
def mounted(
    mnt: Path,
    project: Path,
    trust: str,
    *extra: str,
) -> Iterator[Mount]:
    """Mount, yield, and unmount in `finally` whatever happened."""
    mnt.mkdir(parents=True, exist_ok=True)
    result = sandboxfs("mount", mnt, "--project", project, "--trust", trust, *extra)
    try:
        if result.returncode != 0:
            raise MountError(result)
        session = ""
        for line in result.stdout.splitlines():
            if line.startswith("session: "):
                session = line.split(": ", 1)[1].strip()
        workspace = extra[extra.index("--workspace") + 1] if "--workspace" in extra else "default"
        yield Mount(mnt, project, trust, session, workspace, result.stdout, tuple(extra))
    finally:
        if os.path.ismount(mnt) or _listed(mnt):
            sandboxfs("umount", mnt)
        if _listed(mnt):
            force_unmount(mnt)


def make_project(root: Path) -> Path:
    """A small git-like project with a README, sources and secrets that must stay hidden."""
    project = root / "project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("# demo project\n")
    (project / "src" / "main.py").write_text("print('hello')\n")
    (project / ".env").write_text("API_KEY=secret\n")
    (project / "server.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (project / ".ssh").mkdir()
    (project / ".ssh" / "id_rsa").write_text("private\n")
    (project / ".workers").mkdir()
    (project / ".workers" / "review.worker").write_text("name: review\n")
    return project


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_project(tmp_path)


@pytest.fixture
def mount_at(tmp_path: Path, project: Path) -> Iterator[Callable[..., Any]]:
    """`mount_at(trust, *extra)` → a context manager mounting `project` at a fresh mountpoint."""
    counter = iter(range(1000))

    def factory(trust: str, *extra: str, mnt: Path | None = None, proj: Path | None = None) -> Any:
        target = mnt if mnt is not None else tmp_path / f"mnt{next(counter)}"
        return mounted(target, proj if proj is not None else project, trust, *extra)

    yield factory


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Audit anchors of the suite's projects go to a temporary state dir, not ~/.local/state
    (mount daemons and the CLI inherit the variable)."""
    saved = os.environ.get("SANDBOXFS_STATE_DIR")
    os.environ["SANDBOXFS_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if saved is None:
        os.environ.pop("SANDBOXFS_STATE_DIR", None)
    else:
        os.environ["SANDBOXFS_STATE_DIR"] = saved


@pytest.fixture(scope="session", autouse=True)
def no_mounts_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite must leave no sandboxfs mount behind (under this run's own temp dir)."""
    base = str(tmp_path_factory.getbasetemp())
    yield
    text = Path("/proc/self/mounts").read_text()
    left = [
        line.split()[1]
        for line in text.splitlines()
        if "fuse.sandboxfs" in line and line.split()[1].startswith(base)
    ]
    for mnt in left:
        force_unmount(Path(mnt))
    assert not left, f"sandboxfs mounts left behind: {left}"
