"""git inside `run` in a project that is a linked worktree (its `.git` a file naming
`<main>/.git/worktrees/<id>`, outside the project) and in a repository with a submodule. The main
repository's git dir is shown inside at the path the `.git` file names, through the mount (zone
`gitdir`), under git's rules as `.git` itself: hooks and the rest protected, config judged, every
refusal audited. What cannot work is refused in one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sandboxfs.config.model import Config
from sandboxfs.core.policy import Policy, Trust, Zone
from tests.support.git import READ_ONLY, git
from tests.support.run import audit, sbx

pytestmark = [
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
    pytest.mark.skipif(
        not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
    ),
]

IDENTITY = "git -c user.name=Agent -c user.email=agent@example.invalid"


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout


def main_with_worktree(tmp_path: Path) -> tuple[Path, Path]:
    """The user's repository `main` and a linked worktree of it, `wt` on branch `wt`."""
    main = tmp_path / "main"
    main.mkdir()
    (main / "README.md").write_text("readme\n")
    for cmd in (["init", "-q", "-b", "main"], ["add", "README.md"], ["commit", "-qm", "initial"]):
        ok(git(main, *cmd))
    wt = tmp_path / "wt"
    ok(git(main, "worktree", "add", "-q", "-b", "wt", str(wt)))
    assert (wt / ".git").read_text() == f"gitdir: {main}/.git/worktrees/wt\n"
    return main, wt


def run_in(project: Path, trust: str, script: str) -> subprocess.CompletedProcess[str]:
    return sbx("run", "--quiet", "--project", project, "--trust", trust, "--", "sh", "-c", script)


def test_worktree_status_commit_and_log_at_full(tmp_path: Path) -> None:
    main, wt = main_with_worktree(tmp_path)
    config_before = (main / ".git" / "config").read_bytes()
    script = f"""
set -e
git status --porcelain
echo more >> README.md
{IDENTITY} commit -qam 'from inside'
git log --format=%s
git rev-parse --git-common-dir
git config gc.worktreePruneExpire
git gc -q
"""
    out = ok(run_in(wt, "full", script))
    assert out.splitlines() == ["from inside", "initial", f"{main}/.git", "never"], out
    # gc inside left the worktree's metadata alone (its path does not exist inside).
    assert (main / ".git" / "worktrees" / "wt" / "HEAD").is_file()
    # The commit is in the user's repository, and both work trees are clean outside.
    assert ok(git(main, "log", "--format=%s", "wt")).splitlines() == ["from inside", "initial"]
    assert ok(git(wt, "status", "--porcelain")) == ""
    assert ok(git(main, "status", "--porcelain")) == ""
    assert (main / ".git" / "config").read_bytes() == config_before


def test_worktree_main_repository_hooks_and_config_protected(tmp_path: Path) -> None:
    main, wt = main_with_worktree(tmp_path)
    common = main / ".git"
    config_before = (common / "config").read_bytes()
    script = f"""
try() {{ if sh -c "$2" 2>/dev/null; then echo "$1: ok"; else echo "$1: refused"; fi; }}
try hook 'echo "touch {tmp_path}/PWNED" > {common}/hooks/pre-commit'
try commondir 'echo /elsewhere > {common}/worktrees/wt/commondir'
try alternates 'echo /elsewhere > {common}/objects/info/alternates'
try fsmonitor 'git config core.fsmonitor "touch {tmp_path}/PWNED"'
try upstream 'git config branch.wt.remote origin'
try link 'ln -s /tmp {common}/evil'
"""
    out = ok(run_in(wt, "full", script))
    assert out.splitlines() == [
        "hook: refused",
        "commondir: refused",
        "alternates: refused",
        "fsmonitor: refused",
        "upstream: ok",
        "link: refused",
    ], out
    assert not (common / "hooks" / "pre-commit").exists()
    assert not (tmp_path / "PWNED").exists()
    config = (common / "config").read_text()
    assert "fsmonitor" not in config and "remote = origin" in config, config
    assert config.startswith(config_before.decode())
    denied = audit(wt, "--denied")
    hook = [e for e in denied if e["path"] == "/gitdir/hooks/pre-commit"]
    assert hook and hook[-1]["zone"] == "gitdir" and hook[-1]["errno"] == "EROFS", denied
    assert "git's code-running surface (.git/hooks)" in hook[-1]["reason"]
    renames = [e for e in denied if e["op"] == "rename" and e.get("dest") == "/gitdir/config"]
    assert renames and "core.fsmonitor" in renames[-1]["reason"], denied


def test_worktree_at_workspace_reads_only(tmp_path: Path) -> None:
    main, wt = main_with_worktree(tmp_path)
    script = f"""
git status --porcelain && echo status: ok
git log --format=%s
echo more >> README.md 2>/dev/null || echo edit: refused
{IDENTITY} commit -q --allow-empty -m x 2>&1 | grep -q '{READ_ONLY}' && echo commit: refused
"""
    out = ok(run_in(wt, "workspace", script))
    assert out.splitlines() == ["status: ok", "initial", "edit: refused", "commit: refused"], out
    assert ok(git(main, "log", "--format=%s", "wt")).splitlines() == ["initial"]


def test_submodule_status_commit_and_log_at_full(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "lib.txt").write_text("lib\n")
    for cmd in (["init", "-q", "-b", "main"], ["add", "lib.txt"], ["commit", "-qm", "lib"]):
        ok(git(lib, *cmd))
    sup = tmp_path / "sup"
    sup.mkdir()
    (sup / "README.md").write_text("sup\n")
    ok(git(sup, "init", "-q", "-b", "main"))
    ok(git(sup, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib"))
    ok(git(sup, "add", "README.md"))
    ok(git(sup, "commit", "-qm", "with lib"))
    assert (sup / "lib" / ".git").read_text() == "gitdir: ../.git/modules/lib\n"
    script = f"""
set -e
git status --porcelain
echo more >> lib/lib.txt
{IDENTITY} -C lib commit -qam 'lib inside'
git add lib
{IDENTITY} commit -qm 'bump lib'
git log --format=%s
git -C lib log --format=%s
git submodule status | cut -c2-8
"""
    out = ok(run_in(sup, "full", script))
    head = ok(git(sup / "lib", "rev-parse", "--short=7", "HEAD")).strip()
    assert out.splitlines() == ["bump lib", "with lib", "lib inside", "lib", head], out
    assert ok(git(sup, "status", "--porcelain")) == ""
    denied = run_in(sup, "full", "echo x > .git/modules/lib/hooks/pre-commit")
    assert denied.returncode != 0 and READ_ONLY in denied.stderr


def test_what_cannot_work_is_refused_in_one_line(tmp_path: Path) -> None:
    # A submodule's checkout run on its own: its .git names ../.git/modules/x, outside.
    lib = tmp_path / "lib"
    lib.mkdir()
    ok(git(lib, "init", "-q", "-b", "main"))
    ok(git(lib, "commit", "-q", "--allow-empty", "-m", "lib"))
    sup = tmp_path / "sup"
    sup.mkdir()
    ok(git(sup, "init", "-q", "-b", "main"))
    ok(git(sup, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib"))
    result = run_in(sup / "lib", "full", "true")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 125, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "relative path leading out of the project" in lines[0]
    assert "run sandboxfs on the superproject" in lines[0]
    # A git directory where the sandbox has its own files.
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / ".git").write_text("gitdir: /usr/share/nothing/.git\n")
    result = run_in(odd, "full", "true")
    assert result.returncode == 125, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_git_rules_hold_at_a_git_dir_zone_root() -> None:
    """The zone's root is a git directory: its relative paths judged as below `.git`."""
    config = Config()
    matrix = {t: {**row, Zone("gitdir"): row[Zone.REPO]} for t, row in config.matrix().items()}
    policy = Policy(matrix, [], Trust.FULL, git_dirs=[Zone("gitdir")])
    for rel, rule in (
        ("hooks/pre-commit", ".git/hooks"),
        ("config", ".git/config"),
        ("worktrees/wt/commondir", ".git/worktrees/**/commondir"),
        ("worktrees/wt/gitdir", ".git/worktrees/**/gitdir"),
        ("objects/info/alternates", ".git/objects/info/alternates"),
        ("worktrees/wt/index", ".git/worktrees/**/index"),  # judged at its rename
        ("info/exclude", ".git/info"),
    ):
        found = policy.protected(f"/gitdir/{rel}", rel, False, git_root=True)
        assert found is not None and f"({rule})" in found.reason, (rel, found)
        assert policy.protected(f"/repo/{rel}", rel, False) is None, rel
    for rel in ("worktrees/wt/HEAD", "worktrees/wt/index.lock", "refs/heads/wt", "objects/ab/cd"):
        assert policy.protected(f"/gitdir/{rel}", rel, False, git_root=True) is None, rel
    link = policy.protected("/gitdir/evil", "evil", False, pointer=True, git_root=True)
    assert link is not None and "no symbolic link" in link.reason
    assert policy.may_protect_under("", git_root=True)


def test_nothing_is_exposed_inside_the_writable_git_directory(tmp_path: Path) -> None:
    """The git directory is bound writable (through the mount): bubblewrap making a mount
    point in it would follow what an earlier session planted there (CVE-2026-87766), so an
    --expose below it is refused in one line, and nothing runs."""
    main, wt = main_with_worktree(tmp_path)
    (main / ".git" / "info").mkdir(exist_ok=True)
    result = sbx(
        "run", "--project", wt, "--trust", "full", "--expose", main / ".git" / "info",
        "--", "touch", f"{main}/.git/ran",
    )  # fmt: skip
    assert result.returncode == 125, (result.stdout, result.stderr)
    [line] = result.stderr.splitlines()
    assert f"would make {main}/.git/info inside {main}/.git" in line and "CVE-2026-87766" in line
    assert not (main / ".git" / "ran").exists()
    assert ok(run_in(wt, "full", f"test -d {main}/.git/info && echo shown")) == "shown\n"
