"""A hung test's stacks where an xdist run shows them: hooks over pytest-timeout.

pytest-timeout (`timeout` and `timeout_method = "thread"` in pyproject.toml) ends a test that
runs past its limit. Its "thread" method writes the stacks with pytest's terminal writer, which in
an xdist worker (the suite runs with -n) goes nowhere: the run would say only "worker crashed".
These hooks replace that one step: the stacks go to file descriptor 2, which in a worker is the
run's own stderr, and the worker's exit makes xdist fail the test by name. "thread" rather than
"signal": a SIGALRM exception raised inside trio's run loop or a FUSE callback would not unwind
cleanly. Loaded by tests/conftest.py; tests/unit/test_timeouts.py hangs a test to check it.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import threading
import traceback
from typing import Any

import pytest
from pytest_timeout import is_debugging  # type: ignore[import-untyped]  # it ships no type hints

_HANG_TIMER = pytest.StashKey[threading.Timer]()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's "thread" method, but the stacks go to file descriptor 2."""
    if settings.method != "thread" or settings.timeout <= 0:
        return None
    timer = threading.Timer(settings.timeout, _hung, (item, settings))
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


def _hung(item: pytest.Item, settings: Any) -> None:
    if not settings.disable_debugger_detection and is_debugging():
        return  # someone is debugging (pdb entered): no timeout, as pytest-timeout does
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)  # descriptor 2 is the real stderr again
    took = f"{item.nodeid} ran past {settings.timeout:g} s"
    os.write(2, f"\n+++ Timeout: {took}; every thread's stack:\n".encode())
    faulthandler.dump_traceback(file=2, all_threads=True)
    os.write(2, _trio_tasks().encode())
    os._exit(1)


def _trio_tasks() -> str:
    """Where each trio task waits: a trio test's thread stack ends in trio's run loop, its
    tasks' coroutines are not on it. Read from another thread, without the loop's consent, from
    a process about to end: good enough to say where a test hung."""
    runners = [obj for obj in gc.get_objects() if type(obj).__qualname__ == "Runner"]
    text = ""
    for runner in runners:
        if type(runner).__module__ != "trio._core._run":
            continue
        for task in list(runner.tasks):
            frames = traceback.StackSummary.extract(task.iter_await_frames())
            text += f"\nTrio task {task.name} (most recent call last):\n"
            text += "".join(traceback.format_list(frames))
    return text
