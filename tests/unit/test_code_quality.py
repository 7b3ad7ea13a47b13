"""The code and the tests stay ruff- and mypy-clean (mypy strict on both: pyproject.toml
[tool.mypy] files), and the public API stays what it is."""

from __future__ import annotations

import ast
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


def test_test_modules_share_helpers_only_through_tests_support() -> None:
    """Test modules that import each other are tied together (renaming one breaks another, an
    imported fixture silently joins the importer): shared helpers live in tests/support, and
    conftest.py holds fixtures, which pytest hands out without an import."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = "." * node.level + (node.module or "")
            stem = module.rsplit(".", 1)[-1]
            if node.level or stem.startswith("test_") or stem == "conftest":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {module}")
    assert not offenders, offenders
