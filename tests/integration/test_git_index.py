"""git's index stays valid across the mount: inside, files show the backing files' inode numbers.

git records each tracked file's ctime, mtime, inode number, owner and size in its index and
re-reads (re-hashes) every file whose stat data no longer matches. With inode numbers of its own,
every `git status` inside a read-only repo re-hashed the whole tree, and at `full` each switch
between a shell outside and the mount did once. These tests count what git re-hashed from its
own trace (`refresh/sum_scan` in GIT_TRACE2_PERF), check `git diff-files` (which compares stat
data without refreshing anything), and check that `.git/index` was never rewritten; never a
timing.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Index Test",
    "GIT_AUTHOR_EMAIL": "index@example.invalid",
    "GIT_COMMITTER_NAME": "Index Test",
    "GIT_COMMITTER_EMAIL": "index@example.invalid",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}
FILES = 300
_SCAN = re.compile(r"refresh/sum_scan:(\d+)")


def run(cmd: str, cwd: Path, **env: str) -> str:
    result = sh(cmd, cwd=cwd, env={**GIT_ENV, **env})
    assert result.returncode == 0, f"{cmd!r} in {cwd}: {result.returncode}\n{result.stderr}"
    return result.stdout


def in_the_past(path: Path) -> None:
    """Times a minute back: a file as new as the index is "racily clean", and git compares its
    content whatever its stat data says."""
    past = time.time_ns() - 60 * 10**9
    os.utime(path, ns=(past, past), follow_symlinks=False)


def make_repo(root: Path) -> Path:
    """A committed repository of FILES files in 10 directories (no deny-listed names)."""
    project = root / "gitproject"
    for i in range(FILES):
        path = project / f"pkg{i % 10}" / f"mod{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE = {i}\n")
        in_the_past(path)
    (project / "README.md").write_text("# generated\n")
    in_the_past(project / "README.md")
    run("git -c init.defaultBranch=main init -q && git add -A && git commit -qm one", project)
    return project


def status(where: Path, trace: Path) -> tuple[str, int]:
    """`git status --porcelain` at `where`: its output and how many entries it re-hashed."""
    trace.unlink(missing_ok=True)
    out = run("git status --porcelain", where, GIT_TRACE2_PERF=str(trace))
    scans = [int(n) for n in _SCAN.findall(trace.read_text())]
    assert scans, "git traced no index refresh"
    return out, sum(scans)


def index_state(project: Path) -> tuple[int, int, str]:
    index = project / ".git" / "index"
    st = os.stat(index)
    return st.st_ino, st.st_mtime_ns, hashlib.sha256(index.read_bytes()).hexdigest()


@pytest.mark.parametrize("trust", ["full", "workspace"])
def test_git_status_inside_and_after_switching_rehashes_nothing(
    mount_at: Callable[..., Any], tmp_path: Path, trust: str
) -> None:
    project = make_repo(tmp_path)
    trace = tmp_path / "trace2"
    assert status(project, trace) == ("", 0)
    index = index_state(project)
    with mount_at(trust, proj=project) as m:
        repo = m.mnt / "repo"
        for rel in ("README.md", "pkg3/mod0003.py", "pkg3"):
            assert os.lstat(repo / rel).st_ino == os.lstat(project / rel).st_ino, rel
        # Every entry's stat data as recorded outside matches inside: nothing to refresh.
        assert run("git diff-files --name-only", repo) == ""
        assert status(repo, trace) == ("", 0)  # the first call
        assert status(repo, trace) == ("", 0)  # and the next
        assert status(project, trace) == ("", 0)  # a shell outside, while mounted
        assert status(repo, trace) == ("", 0)  # and back inside
        assert index_state(project) == index  # never refreshed, never rewritten
    assert status(project, trace) == ("", 0)
    assert index_state(project) == index


def test_git_index_written_inside_stays_valid_outside(
    mount_at: Callable[..., Any], tmp_path: Path
) -> None:
    """At `full`, what `git add` and `git commit` record inside matches outside, and back."""
    project = make_repo(tmp_path)
    trace = tmp_path / "trace2"
    with mount_at("full", proj=project) as m:
        repo = m.mnt / "repo"
        changed = repo / "pkg1" / "mod0001.py"
        changed.write_text("VALUE = 'changed'\n")
        in_the_past(changed)
        assert status(repo, trace) == (" M pkg1/mod0001.py\n", 1)  # only the changed file
        run("git add pkg1/mod0001.py", repo)
        assert status(project, trace) == ("M  pkg1/mod0001.py\n", 0)
        assert status(repo, trace) == ("M  pkg1/mod0001.py\n", 0)
        run("git commit -qm two", repo)
        index = index_state(project)
        assert status(project, trace) == ("", 0)
        assert status(repo, trace) == ("", 0)
        assert run("git diff-files --name-only", project) == ""
        assert index_state(project) == index
