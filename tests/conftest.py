"""Fixtures shared by every test module: projects, mounts always unmounted in `finally`, and
the checks that the suite leaves no mount and no anchor behind (helpers: tests/support)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mounts import force_unmount, make_project, mounted

# Where a hung test's stacks go (pytest-timeout's hooks).
pytest_plugins = ["tests.support.timeouts"]


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
