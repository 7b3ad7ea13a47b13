"""Projects and live `sandboxfs mount` mounts, always unmounted in `finally`, and their denials."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sandboxfs


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


def denial(
    m: Mount,
    path: str,
    op: str | None = None,
    entries: list[dict[str, Any]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The denial audited for virtual `path` (denials are written before the errno returns);
    `entries` are the mount's denials read once, to save running the CLI for each check."""
    entries = [
        e
        for e in (entries if entries is not None else m.audit("--denied"))
        if e["path"] == path
        and (op is None or e["op"] == op)
        and all(e.get(k) == v for k, v in fields.items())
    ]
    assert entries, f"no denial audited for {path} (op {op}, {fields})"
    entry = entries[-1]
    assert entry["allowed"] is False
    assert entry["reason"], entry
    assert entry["session"] == m.session
    return entry


@contextmanager
def mounted_fs(target: Path, *args: str) -> Iterator[Path]:
    """`mount *args target` (a tmpfs or a bind mount), lazily unmounted in `finally`."""
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", *args, str(target)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount {args}: {result.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)
