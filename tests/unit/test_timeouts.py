"""A hung test fails, under xdist too, with the stack of every thread (and every trio task) on
stderr: pytest-timeout's "thread" method with the hooks of tests/support/timeouts.py, in a pytest
run of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HANGS = """\
import time

import trio


def test_fine():
    pass


def test_hangs():
    time.sleep(60)


async def waits_for_ever():
    await trio.sleep(60)


async def test_trio_hangs():
    await waits_for_ever()
"""


def test_a_hung_test_fails_with_its_stack_under_xdist(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
    (tmp_path / "test_hung.py").write_text(HANGS)
    argv = [sys.executable, "-m", "pytest", "-p", "tests.support.timeouts", "-n", "2"]
    argv += ["-p", "no:cacheprovider", "-o", "timeout=2", "-o", "timeout_method=thread"]
    argv += ["test_hung.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "+++ Timeout: test_hung.py::test_hangs ran past 2 s; every thread's stack:" in out, out
    assert 'test_hung.py", line 11 in test_hangs' in out, out  # where it hung
    assert "worker 'gw" in out and "crashed while running 'test_hung.py::test_hangs'" in out, out
    # A trio test: its thread waits in trio's loop; the task's own stack says where it hung.
    assert "+++ Timeout: test_hung.py::test_trio_hangs ran past 2 s" in out, out
    assert 'test_hung.py", line 15, in waits_for_ever' in out, out
    assert "2 failed, 1 passed" in out, out
