"""A hung test fails, under xdist too, with the stack of every thread on stderr: pytest-timeout's
"thread" method with the hooks of tests/support/timeouts.py, in a pytest run of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HANGS = """\
import time


def test_fine():
    pass


def test_hangs():
    time.sleep(60)
"""


def test_a_hung_test_fails_with_its_stack_under_xdist(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
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
    assert 'test_hung.py", line 9 in test_hangs' in out, out  # where it hung
    assert "worker 'gw" in out and "crashed while running 'test_hung.py::test_hangs'" in out, out
    assert "1 failed, 1 passed" in out, out
