"""On a live mount at `full`: what the agent changes always shows in the user's own `git status` and
`git diff` outside. `.git/info/` (exclude, sparse-checkout, attributes) and `refs/replace/` are
protected like git's config; a new index renamed onto `.git/index` that marks a file
assume-unchanged or skip-worktree, or a packed-refs that adds a replace ref, is refused and audited;
git's everyday index and packed-refs writes (add, commit, pack-refs, index version 4) still work.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import sh
from tests.support.git import GIT_ENV, READ_ONLY, git, user_repo
from tests.support.mounts import make_project, mounted
from tests.support.run import NOBODY_UID

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


# An ordinary user inside, as root is.
AS_NOBODY = f"setpriv --reuid={NOBODY_UID} --regid={NOBODY_UID} --clear-groups -- "
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setpriv)")


def inside(cwd: Path, command: str, prefix: str = "") -> subprocess.CompletedProcess[str]:
    if prefix:
        command = f"{prefix}sh -c {shlex.quote(command)}"
    result = sh(command, cwd=cwd, env=GIT_ENV)
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


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory below /tmp that every user can traverse (pytest's are 0700), removed after."""
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-review-", dir="/tmp"))
    try:
        root.chmod(0o755)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    "prefix", ["", pytest.param(AS_NOBODY, marks=needs_root)], ids=["root", "nobody"]
)
def test_changes_stay_visible_to_the_users_git(
    open_tmp: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = make_project(open_tmp)
    user_repo(project)
    if prefix:  # the ordinary user's own repository, which root's git outside may read
        subprocess.run(["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(project)], check=True)
        for name, value in (("COUNT", "1"), ("KEY_0", "safe.directory"), ("VALUE_0", "*")):
            monkeypatch.setenv(f"GIT_CONFIG_{name}", value)
    exclude = project / ".git" / "info" / "exclude"
    before = exclude.read_bytes() if exclude.exists() else None
    with mounted(open_tmp / "mnt", project, "full", "--allow-other") as m:
        repo = m.mnt / "repo"
        assert inside(repo, "echo 'x = 1' > conftest.py", prefix).returncode == 0
        for command in HIDING:
            result = inside(repo, command, prefix)
            assert result.returncode != 0, (command, result.stdout, result.stderr)
        assert READ_ONLY in inside(repo, "echo x >> .git/info/exclude", prefix).stderr
        # git's own index and packed-refs writes still work, also in index version 4.
        for command in (
            "git reset -q",
            "git branch topic && git pack-refs --all && git branch -d topic",
            "git update-index --index-version 4",
            "echo more >> README.md && git add README.md",
            "git commit -qm readme",
            "git update-index --no-assume-unchanged src/main.py",
        ):
            result = inside(repo, command, prefix)
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
