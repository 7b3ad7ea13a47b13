"""The code stays ruff- and mypy-clean, and the public API stays what it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sandboxfs

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_ruff_check() -> None:
    result = run("ruff", "check", "sandboxfs", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run("ruff", "format", "--check", "sandboxfs", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_api() -> None:
    assert sandboxfs.__all__ == [
        "Decision",
        "Op",
        "Policy",
        "Sandbox",
        "SandboxAPIError",
        "SandboxError",
        "Trust",
        "UserError",
        "Zone",
        "ZoneAccess",
    ]
