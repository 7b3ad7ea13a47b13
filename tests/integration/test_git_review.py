"""Issue 34 case 19 on a live mount at `full`: what the agent changes always shows in the user's
own `git status` and `git diff` outside. `.git/info/` (exclude, sparse-checkout, attributes) and
`refs/replace/` are protected like git's config; a new index renamed onto `.git/index` that marks
a file assume-unchanged or skip-worktree, or a packed-refs that adds a replace ref, is refused and
audited; git's everyday index and packed-refs writes (add, commit, pack-refs, index version 4)
still work.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh
from tests.support.git import GIT_ENV, READ_ONLY, git, user_repo

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def inside(cwd: Path, command: str) -> subprocess.CompletedProcess[str]:
    result = sh(command, cwd=cwd, **GIT_ENV)
    assert "Input/output error" not in result.stderr, result.stderr
    return result


HIDING = [
    "echo planted >> src/main.py && git update-index --assume-unchanged src/main.py",
    "git update-index --skip-worktree src/main.py",
    # the same index flag written by hand, through a lock file renamed as git does
    "cp .git/index i.lock && git update-index --assume-unchanged src/main.py; "
    "GIT_INDEX_FILE=i.lock git update-index --assume-unchanged src/main.py && "
    "mv i.lock .git/index; s=$?; rm -f i.lock; exit $s",
    "echo conftest.py >> .git/info/exclude",
    "mkdir -p .git/info && echo conftest.py > .git/info/exclude",
    "printf '/*\\n!/src/\\n' > .git/info/sparse-checkout",
    "echo '*.py -diff' > .git/info/attributes",
    "mv .git/info .git/info.old",
    "rm -f .git/index",
    # a replace ref shows the user another commit for HEAD: one whose tree has the change
    "git add src/main.py && git replace HEAD $(git commit-tree $(git write-tree) -p HEAD~0 -m x)",
    '(cat .git/packed-refs 2>/dev/null; echo "$(git commit-tree $(git write-tree) -m x) '
    'refs/replace/$(git rev-parse HEAD)") > p.lock && mv p.lock .git/packed-refs; s=$?; '
    "rm -f p.lock; exit $s",
]


def test_changes_stay_visible_to_the_users_git(mount_at: Callable[..., Any], project: Path) -> None:
    user_repo(project)
    exclude = project / ".git" / "info" / "exclude"
    before = exclude.read_bytes() if exclude.exists() else None
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        assert inside(repo, "echo 'x = 1' > conftest.py").returncode == 0
        for command in HIDING:
            result = inside(repo, command)
            assert result.returncode != 0, (command, result.stdout, result.stderr)
        assert READ_ONLY in inside(repo, "echo x >> .git/info/exclude").stderr
        # git's own index and packed-refs writes still work, also in index version 4.
        for command in (
            "git reset -q",
            "git branch topic && git pack-refs --all && git branch -d topic",
            "git update-index --index-version 4",
            "echo more >> README.md && git add README.md",
            "git commit -qm readme",
            "git update-index --no-assume-unchanged src/main.py",
        ):
            result = inside(repo, command)
            assert result.returncode == 0, (command, result.stderr)
        denied = [e for e in m.audit("--denied") if e.get("dest") == "/repo/.git/index"]
        reasons = " | ".join(e["reason"] for e in denied)
        assert "marks 'src/main.py' assume-unchanged" in reasons, reasons
        assert "marks 'src/main.py' skip-worktree" in reasons, reasons
        packed = [e for e in m.audit("--denied") if e.get("dest") == "/repo/.git/packed-refs"]
        assert packed and "adds the replace ref" in packed[0]["reason"], packed
        replace = [e for e in m.audit("--denied") if "/repo/.git/refs/replace" in e["path"]]
        assert replace, m.audit("--denied")
        assert all(e["errno"] == "EROFS" for e in denied), denied
        info = [e for e in m.audit("--denied") if "/repo/.git/info" in e["path"]]
        assert info and all(".git/info" in e["reason"] for e in info), info
    assert (exclude.read_bytes() if exclude.exists() else None) == before
    assert not (project / ".git" / "info" / "sparse-checkout").exists()
    status = git(project, "status", "--porcelain").stdout
    assert " M src/main.py" in status.splitlines(), status
    assert "?? conftest.py" in status.splitlines(), status
    assert "planted" in git(project, "diff").stdout
    assert git(project, "replace", "-l").stdout == ""
    flags = git(project, "ls-files", "-v").stdout.splitlines()
    assert all(line.startswith("H ") for line in flags), flags
