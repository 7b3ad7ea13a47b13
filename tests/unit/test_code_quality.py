"""The code and the tests stay ruff- and mypy-clean (mypy strict on both: pyproject.toml
[tool.mypy] files), and the public API stays what it is."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


# A reference to text the repository does not have: a section of the specification ("SPEC §3",
# "SPEC section 4", "§4"), an issue ("issue 19", "Issues 20 and 21", "issue #34") or a bare
# "#34". Such a comment says what the rule is instead.
CITATION = re.compile(r"SPEC\s*(§|section)|§\s*\d|\b[Ii]ssues?\s+#?\d|(?<![\w&/])#\d+\b")


def test_no_comment_cites_a_spec_section_or_an_issue() -> None:
    this = Path(__file__).resolve()
    found = []
    for top in ("sandboxfs", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            if path == this or "__pycache__" in path.parts or not path.is_file():
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue  # not text
            for number, line in enumerate(text.splitlines(), 1):
                if CITATION.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "say what the rule is instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "# SPEC §3, cell by cell",
        "(SPEC section 4)",
        "(issue 19 §4)",
        "Issues 20 and 21",
        "see issue #34",
        "(#34)",
        "§5: other users",
    ],
)
def test_the_citation_check_sees_each_form(line: str) -> None:
    assert CITATION.search(line)


@pytest.mark.parametrize(
    "line",
    ["GIT_LITERAL_PATHSPECS", "AF_UNSPEC", "an issue with the mount", "color: #fff", "fd 3"],
)
def test_the_citation_check_passes_ordinary_text(line: str) -> None:
    assert not CITATION.search(line)
