"""sandboxfs.core.gitindex on indexes real git writes: versions 2 to 4, SHA-1 and SHA-256, the
flags that hide a tracked file's changes and the caches that hide untracked ones."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sandboxfs.core import gitindex
from tests.support.git import GIT_ENV

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> None:
    env = {"PATH": "/usr/bin:/bin", **GIT_ENV}
    subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)


def repo_with_files(tmp_path: Path, *init: str) -> Path:
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q", *init)
    for name in ("a.txt", "dir/b.txt", "dir/deeper/c.txt"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(name)
    git(repo, "add", "-A")
    return repo


def index(repo: Path) -> bytes:
    return (repo / ".git" / "index").read_bytes()


@pytest.mark.parametrize("version", ["2", "3", "4"])
@pytest.mark.parametrize("init", [(), ("--object-format=sha256",)])
def test_flags_set_by_git_are_found(tmp_path: Path, version: str, init: tuple[str, ...]) -> None:
    repo = repo_with_files(tmp_path, *init)
    git(repo, "update-index", "--index-version", version)
    plain = index(repo)
    flags, _ = gitindex.parse(plain)
    assert set(flags) == {(b"a.txt", 0), (b"dir/b.txt", 0), (b"dir/deeper/c.txt", 0)}
    assert gitindex.judge(plain, plain) is None
    assert gitindex.judge(None, plain) is None
    git(repo, "update-index", "--assume-unchanged", "dir/b.txt")
    assumed = index(repo)
    assert "marks 'dir/b.txt' assume-unchanged" in (gitindex.judge(plain, assumed) or "")
    assert gitindex.judge(assumed, assumed) is None  # the user's own flag may stay
    git(repo, "update-index", "--skip-worktree", "dir/deeper/c.txt")
    skipped = index(repo)
    assert "marks 'dir/deeper/c.txt' skip-worktree" in (gitindex.judge(assumed, skipped) or "")
    git(repo, "update-index", "--no-assume-unchanged", "--no-skip-worktree", "dir/b.txt")
    assert gitindex.judge(skipped, index(repo)) is None  # clearing is fine


def test_caches_and_garbage(tmp_path: Path) -> None:
    repo = repo_with_files(tmp_path)
    plain = index(repo)
    git(repo, "update-index", "--untracked-cache")
    git(repo, "-c", "core.untrackedCache=true", "status")
    cached = index(repo)
    assert "untracked cache" in (gitindex.judge(plain, cached) or "")
    assert gitindex.judge(cached, cached) is None
    git(repo, "update-index", "--split-index")
    assert "split index" in (gitindex.judge(cached, index(repo)) or "")
    for junk in (b"", b"DIRC", plain[:-5], plain + b"x", b"not an index" * 10):
        assert "cannot be read as a git index" in (gitindex.judge(plain, junk) or ""), junk


def test_packed_refs_gain_no_replace_ref() -> None:
    head = b"# pack-refs with: peeled fully-peeled sorted \n"
    old = head + b"1" * 40 + b" refs/heads/main\n"
    assert gitindex.judge_packed_refs(old, old + b"2" * 40 + b" refs/tags/v1\n") is None
    replace = b"3" * 40 + b" refs/replace/" + b"1" * 40 + b"\n"
    assert "replace ref" in (gitindex.judge_packed_refs(old, old + replace) or "")
    assert gitindex.judge_packed_refs(old + replace, old + replace) is None  # the user's own
    assert gitindex.judge_packed_refs(None, head) is None
