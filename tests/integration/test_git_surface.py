"""git's code-running surface on a live mount: nothing the agent writes through sandboxfs decides
what code the user's git runs later, outside. Each attack is made with real tools through the mount
at `full`; each step that must fail fails with EROFS and is audited; then the user's real `git
status` runs outside and must run nothing. A control makes the same attack natively and shows the
marker appearing, so the check would see the attack if it worked.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh
from tests.support.git import GIT_ENV, READ_ONLY, fsmonitor, git, user_repo
from tests.support.mounts import Mount, denial
from tests.support.run import audit, sbx

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def steps(m: Mount, script: list[tuple[str, str]], cwd: Path) -> dict[str, str]:
    """Run each (name, shell command) through the mount; "ok" or its stderr."""
    outcome: dict[str, str] = {}
    for name, command in script:
        result = sh(command, cwd=cwd, env=GIT_ENV)
        outcome[name] = "ok" if result.returncode == 0 else result.stderr.strip() or "failed"
        assert "Input/output error" not in result.stderr, result.stderr
    return outcome


# The issue's reproduction, one step at a time, with the marker where it says /tmp/PWNED.
REPRODUCTION = [
    ("mkdir", "mkdir .evil"),
    ("objects", "ln -s ../.git/objects .evil/objects"),
    ("refs", "ln -s ../.git/refs .evil/refs"),
    ("head", "cp .git/HEAD .evil/"),
    ("config", "printf '{config}' > .evil/config"),
    ("commondir", "echo ../.evil > .git/commondir"),
    # and its other spellings
    ("commondir-symlink", "ln -s ../.evil/commondir .git/commondir"),
    ("commondir-rename", "echo ../.evil > c && mv c .git/commondir"),
    ("commondir-link", "echo ../.evil > d && ln d .git/commondir"),
    ("config-worktree", "cp .evil/config .git/config.worktree"),
    ("hooks-rename", "mkdir h && mv h .git/hooks/h"),
    ("worktree-commondir", "mkdir -p .git/worktrees/x && echo ../.. > .git/worktrees/x/commondir"),
    ("worktrees-symlink", "rmdir .git/worktrees/x .git/worktrees; ln -s ../.evil .git/worktrees"),
]


def test_the_commondir_reproduction_runs_nothing_outside(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    user_repo(project)
    control = tmp_path / "control"
    shutil.copytree(project, control, symlinks=True)
    marker = tmp_path / "PWNED"
    script = [(n, c.replace("{config}", fsmonitor(marker))) for n, c in REPRODUCTION[:6]]
    # The control: natively, the same steps make the user's git run the agent's fsmonitor.
    for name, command in script:
        assert sh(command, cwd=control).returncode == 0, name
    git(control, "status")
    assert marker.read_text().startswith("ran"), "the control did not reproduce the attack"
    marker.unlink()

    full = [(n, c.replace("{config}", fsmonitor(marker))) for n, c in REPRODUCTION]
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        outcome = steps(m, full, repo)
        # The agent's own directory is its business; HEAD outside .git and pointing git at
        # anything are not.
        assert {k: outcome[k] for k in ("mkdir", "objects", "refs", "config")} == dict.fromkeys(
            ("mkdir", "objects", "refs", "config"), "ok"
        ), outcome
        refused = [name for name, _ in full if name not in ("mkdir", "objects", "refs", "config")]
        for name in refused:
            assert READ_ONLY in outcome[name], (name, outcome[name])
        denied = m.audit("--denied")
        for path in (
            "/repo/.evil/HEAD",
            "/repo/.git/commondir",
            "/repo/.git/config.worktree",
            "/repo/.git/worktrees/x/commondir",
            "/repo/.git/worktrees",
        ):
            entry = denial(m, path, entries=denied)
            assert entry["errno"] == "EROFS", entry
            assert "git's code-running surface" in entry["reason"], entry
        assert any(e["op"] == "rename" and e.get("dest") == "/repo/.git/commondir" for e in denied)
        assert any(e["op"] == "link" and e.get("dest") == "/repo/.git/commondir" for e in denied)
        # git itself still works inside.
        assert sh("git status --porcelain", cwd=repo, env=GIT_ENV).returncode == 0
    assert not (project / ".git" / "commondir").exists()
    assert not (project / ".git" / "config.worktree").exists()
    status = git(project, "status", "--porcelain")
    assert status.returncode == 0, status.stderr
    assert not marker.exists(), marker.read_text()


def test_no_nested_repository_and_no_bare_one(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    """git in src/ would use a new src/.git (directory, or file naming any git dir), or take
    src/ for a bare repository if it held HEAD, objects/ and refs/. None can be made, in the
    repo nor in any other zone the user may run git in later."""
    user_repo(project)
    marker = tmp_path / "PWNED"
    evil = fsmonitor(marker).replace("[core]\n", "[core]\n\tworktree = ..\n")
    (tmp_path / "evil.config").write_text(evil)
    script = [
        ("evil-dir", f"mkdir -p .evil/objects .evil/refs && cp {tmp_path}/evil.config .evil/"),
        ("git-dir", "mkdir src/.git"),
        ("git-file", "echo 'gitdir: ../.evil' > src/.git"),
        ("git-file-rename", "echo 'gitdir: ../.evil' > g && mv g src/.git"),
        ("git-dir-rename", "mv .evil src/.git"),
        ("git-symlink", "ln -s ../.evil src/.git"),
        ("git-upper", "mkdir src/.GIT"),
        ("git-init", "git init -q src/new"),
        ("git-clone", f"git clone -q {project} third_party/clone"),
        ("bare-dirs", f"mkdir src/objects src/refs && cp {tmp_path}/evil.config src/config"),
        ("bare-head", "echo 'ref: refs/heads/main' > src/HEAD"),
        ("bare-head-symlink", "ln -s refs/heads/main src/HEAD"),
        ("workspace-init", "git init -q ../workspace/scratch"),
        ("session-init", "git init -q ../session/working/scratch"),
    ]
    with mount_at("full") as m:
        outcome = steps(m, script, m.mnt / "repo")
        assert outcome.pop("evil-dir") == "ok"
        assert outcome.pop("bare-dirs") == "ok"
        # The sandbox's own scratch zones, under the state dir and outside the work tree: an
        # agent may make and clone repositories there (GIT_ZONES_EXEMPT).
        assert outcome.pop("workspace-init") == "ok"
        assert outcome.pop("session-init") == "ok"
        for name, result in outcome.items():
            assert result != "ok", name
        for name in ("git-dir", "git-file", "git-file-rename", "git-dir-rename", "bare-head"):
            assert READ_ONLY in outcome[name], (name, outcome[name])
        denied = m.audit("--denied")
        for path in ("/repo/src/.git", "/repo/src/.GIT", "/repo/src/HEAD"):
            assert denial(m, path, entries=denied)["errno"] == "EROFS"
        for path in (
            "/repo/src/new/.git",
            "/repo/third_party/clone/.git",
        ):
            assert denial(m, path, entries=denied)["errno"] == "EROFS", path
    for name in (".git", ".GIT", "HEAD"):
        assert not os.path.lexists(project / "src" / name), name
    for where in (project / "src", project / "src" / "objects", project):
        git(where, "status")
        git(where, "log", "-1")
    assert not marker.exists(), marker.read_text()


def test_submodule_and_nested_clone_readable_but_pinned(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    """`git status` outside recurses into submodules and runs their fsmonitor: a submodule's
    git dir (.git/modules/src/lib) and its checkout's .git file are pinned, and still work."""
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "lib.py").write_text("x = 1\n")
    for cmd in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-qm", "lib"]):
        assert git(sub, *cmd).returncode == 0
    user_repo(project)
    added = git(
        project, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "src/lib"
    )
    assert added.returncode == 0, added.stderr
    assert git(project, "commit", "-qm", "add lib").returncode == 0
    nested = project / "vendor" / "tool"
    nested.mkdir(parents=True)
    assert git(nested, "init", "-q", "-b", "main").returncode == 0
    marker = tmp_path / "PWNED"
    (tmp_path / "evil.config").write_text(fsmonitor(marker))
    hook = f"#!/bin/sh\necho ran >> {marker}\n"
    (tmp_path / "hook").write_text(hook)
    script = [
        ("module-config", "echo '\tfsmonitor = \"echo x; false\"' >> .git/modules/src/lib/config"),
        (
            "module-config-rename",
            f"cp {tmp_path}/evil.config c && mv c .git/modules/src/lib/config",
        ),
        ("module-hook", f"cp {tmp_path}/hook .git/modules/src/lib/hooks/post-checkout"),
        ("module-commondir", "echo ../../../.evil > .git/modules/src/lib/commondir"),
        ("module-move", "mv .git/modules/src/lib .git/modules/src/lib.old"),
        ("modules-move", "mv .git/modules .git/modules.old"),
        ("gitfile-write", "echo 'gitdir: ../../.evil' > src/lib/.git"),
        ("gitfile-remove", "rm src/lib/.git"),
        ("gitfile-move", "mv src/lib/.git src/lib/git.old"),
        ("nested-config", f"cp {tmp_path}/evil.config vendor/tool/.git/config"),
        ("nested-hook", f"cp {tmp_path}/hook vendor/tool/.git/hooks/pre-commit"),
        ("nested-remove", "rm -rf vendor/tool/.git"),
    ]
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        assert (repo / "src" / "lib" / ".git").read_text().startswith("gitdir: ")
        assert (repo / ".git" / "modules" / "src" / "lib" / "config").read_text()
        outcome = steps(m, script, repo)
        for name, result in outcome.items():
            assert READ_ONLY in result, (name, result)
        denied = m.audit("--denied")
        for path in (
            "/repo/.git/modules/src/lib/config",
            "/repo/.git/modules/src/lib/hooks/post-checkout",
            "/repo/.git/modules/src/lib/commondir",
            "/repo/src/lib/.git",
            "/repo/vendor/tool/.git/config",
        ):
            assert denial(m, path, entries=denied)["errno"] == "EROFS", path
        # The submodule still works inside: status recurses, a commit in it writes objects.
        inside = sh("git status --porcelain", cwd=repo, env=GIT_ENV)
        assert inside.returncode == 0, inside.stderr
        edit = sh(
            "echo 'y = 2' >> lib.py && git commit -qam edit && git log --format=%s -1",
            cwd=repo / "src" / "lib",
            env=GIT_ENV,
        )
        assert edit.returncode == 0 and edit.stdout == "edit\n", edit.stderr
    status = git(project, "status")
    assert status.returncode == 0, status.stderr
    assert "src/lib (new commits)" in status.stdout
    git(nested, "status")
    assert not marker.exists(), marker.read_text()


def test_hooks_path_in_the_working_tree_is_pinned(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    """core.hooksPath = .husky/_ (husky): git runs .husky/_/pre-commit, which runs the user's
    .husky/pre-commit. Both stay as the user wrote them; the user's commit runs only theirs."""
    user_repo(project)
    husky = project / ".husky"
    (husky / "_").mkdir(parents=True)
    (husky / "_" / "pre-commit").write_text('#!/bin/sh\n. "$(dirname "$0")/../pre-commit"\n')
    (husky / "pre-commit").write_text("#!/bin/sh\ntrue\n")
    for hook in (husky / "_" / "pre-commit", husky / "pre-commit"):
        hook.chmod(0o755)
    assert git(project, "config", "core.hooksPath", ".husky/_").returncode == 0
    marker = tmp_path / "PWNED"
    script = [
        ("user-hook", f"echo 'echo ran >> {marker}' >> .husky/pre-commit"),
        ("stub", f"printf '#!/bin/sh\\necho ran >> {marker}\\n' > .husky/_/pre-commit"),
        ("new-hook", f"printf '#!/bin/sh\\necho ran >> {marker}\\n' > .husky/_/post-commit"),
        ("move", "mv .husky husky.old"),
    ]
    with mount_at("full") as m:
        outcome = steps(m, script, m.mnt / "repo")
        for name, result in outcome.items():
            assert READ_ONLY in result, (name, result)
        entry = denial(m, "/repo/.husky/pre-commit")
        assert entry["errno"] == "EROFS" and "'/.husky/'" in entry["reason"], entry
        (m.mnt / "repo" / "src" / "new.py").write_text("x = 1\n")  # ordinary work goes on
    commit = git(project, "add", "src/new.py")
    commit = git(project, "commit", "-qm", "user commit")
    assert commit.returncode == 0, commit.stderr
    assert not marker.exists(), marker.read_text()


@pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)
def test_the_issue_reproduction_through_run(project: Path, tmp_path: Path) -> None:
    """The reproduction exactly as the issue ran it (`sandboxfs run --trust full`), each step
    reported; the user's `git status` afterwards."""
    user_repo(project)
    marker = tmp_path / "PWNED"
    probe = r"""
cd /sandbox/repo
try() { if sh -c "$2" 2>/dev/null; then echo "$1: ok"; else echo "$1: refused"; fi; }
try mkdir 'mkdir .evil'
try objects 'ln -s ../.git/objects .evil/objects'
try refs 'ln -s ../.git/refs .evil/refs'
try head 'cp .git/HEAD .evil/'
try config 'printf "[core]\n\tfsmonitor = \"echo ran >> MARKER; false\"\n" > .evil/config'
try commondir 'echo ../.evil > .git/commondir'
try nested 'mkdir src/.git'
try gitfile 'echo "gitdir: ../.evil" > src/.git'
""".replace("MARKER", str(marker))
    result = sbx("run", "--quiet", "--project", project, "--trust", "full", "--", "sh", "-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "mkdir: ok",
        "objects: ok",
        "refs: ok",
        "head: refused",
        "config: ok",
        "commondir: refused",
        "nested: refused",
        "gitfile: refused",
    ], result.stdout
    denied = audit(project, "--denied")
    for path in ("/repo/.evil/HEAD", "/repo/.git/commondir", "/repo/src/.git"):
        entries = [e for e in denied if e["path"] == path and e["errno"] == "EROFS"]
        assert entries and "git's code-running surface" in entries[-1]["reason"], path
    assert git(project, "status").returncode == 0
    assert not marker.exists(), marker.read_text()
