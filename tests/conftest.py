"""Fixtures shared by every test module: projects, mounts always unmounted in `finally`, and
the checks that the suite leaves no mount and no anchor behind (helpers: tests/support); and
the hooks that send a hung test's stacks where an xdist run shows them."""

from __future__ import annotations

import faulthandler
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mounts import force_unmount, make_project, mounted

_HANG_TIMER = pytest.StashKey[threading.Timer]()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's "thread" method, but the stacks go to file descriptor 2.

    pytest-timeout writes them with the terminal writer, which in an xdist worker (the suite runs
    with -n) goes nowhere: the run would say only "worker crashed". A worker's descriptor 2 is the
    run's own stderr, so the traceback of every thread shows in the output, and the worker's
    exit makes xdist fail the test by name."""
    if settings.method != "thread" or settings.timeout <= 0:
        return None
    timer = threading.Timer(settings.timeout, _hung, (item, settings.timeout))
    timer.name = "pytest-timeout watchdog"
    timer.daemon = True
    item.stash[_HANG_TIMER] = timer
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    timer = item.stash.get(_HANG_TIMER, None)
    if timer is None:
        return None
    timer.cancel()
    timer.join()
    del item.stash[_HANG_TIMER]
    return True


def _hung(item: pytest.Item, timeout: float) -> None:
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)  # descriptor 2 is the real stderr again
    header = f"\n+++ Timeout: {item.nodeid} ran past {timeout:g} s; every thread's stack:\n"
    os.write(2, header.encode())
    faulthandler.dump_traceback(file=2, all_threads=True)
    os._exit(1)


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
