"""The repository holds source and text: no binary file is committed outside a small allowlist.

A binary (a NUL byte in its first 8 KiB, git's own test) bloats every clone for good once it is in
the history: a 2.9 MB wheel once sat at the root, used by nothing. Data a test really needs goes in
`ALLOWED_BINARIES`, by its path, with a word on why.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Paths (relative to the repository root) of binary files that may be committed, and why.
ALLOWED_BINARIES: frozenset[str] = frozenset()

SNIFF_BYTES = 8192


def tracked_files() -> list[str]:
    if not (ROOT / ".git").exists():  # an sdist or an unpacked copy: nothing to check
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
    )
    return [name for name in listed.stdout.decode().split("\0") if name]


def is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(SNIFF_BYTES)


def test_no_binary_file_is_tracked_outside_the_allowlist() -> None:
    binaries = []
    for name in tracked_files():
        path = ROOT / name
        if path.is_symlink() or not path.is_file():  # a link, or deleted in the work tree
            continue
        if is_binary(path) and name not in ALLOWED_BINARIES:
            binaries.append(name)
    assert not binaries, f"binary files committed (add data to ALLOWED_BINARIES): {binaries}"


def test_the_allowlist_names_only_tracked_files() -> None:
    assert set(tracked_files()) >= ALLOWED_BINARIES


def test_the_check_sees_a_binary(tmp_path: Path) -> None:
    (tmp_path / "wheel.whl").write_bytes(b"PK\x03\x04\x14\x00\x00\x00")
    (tmp_path / "text.md").write_text("# text\n")
    assert is_binary(tmp_path / "wheel.whl") and not is_binary(tmp_path / "text.md")
