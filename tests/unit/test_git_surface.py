"""git's code-running surface (what decides which programs the user's git runs): the rules of
sandboxfs.core.policy.git_rule as a table, the policy at every trust level whatever the config says,
and the guard through the operations adapter (no mount): every refusal EROFS and audited, what git
needs still allowed."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxfs.config.model import ProjectConfig, _merge, defaults, git_surface_protect
from sandboxfs.core.inodes import ZONE_INO
from sandboxfs.core.policy import (
    Patterns,
    Policy,
    Trust,
    Zone,
    git_name,
    git_rule,
    git_rule_below,
    in_git_dir,
)
from sandboxfs.project.zones import protected_patterns
from sandboxfs.staging.paths import path_problem
from tests.support.adapter import CTX, Harness, fails, make, no_mounts_left_behind

__all__ = ["make", "no_mounts_left_behind"]


# ===== the rules as a table ======================================================================


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        # A .git entry, at the zone root or below: it picks the repository git uses there.
        (".git", ".git"),
        ("src/.git", ".git"),
        ("a/b/c/.git", ".git"),
        (".GIT", ".git"),  # case-folding storage
        ("src/.Git", ".git"),
        ("\uff0egit", ".git"),  # fullwidth full stop: NFKC folds it to "."
        (".git.", ".git"),  # NTFS drops trailing dots and spaces
        (".git ", ".git"),
        ("GIT~1", ".git"),  # and its short name
        # What git reads from a git directory to find config, hooks and the common directory.
        (".git/config", ".git/config"),
        (".git/config.worktree", ".git/config.worktree"),
        (".git/commondir", ".git/commondir"),
        (".git/gitdir", ".git/gitdir"),
        (".git/hooks", ".git/hooks"),
        (".git/hooks/pre-commit", ".git/hooks"),
        (".git/branches/origin", ".git/branches"),
        (".git/remotes/origin", ".git/remotes"),
        (".git/objects/info/alternates", ".git/objects/info/alternates"),
        (".git/objects/info/http-alternates", ".git/objects/info/alternates"),
        (".Git/CONFIG", ".git/config"),
        # ...of every nested repository the user already has,
        ("src/lib/.git/config", ".git/config"),
        ("src/lib/.git/hooks/post-checkout", ".git/hooks"),
        # ...of submodules (names may hold "/"; modules nest),
        (".git/modules/lib/config", ".git/modules/**/config"),
        (".git/modules/lib/hooks/pre-commit", ".git/modules/**/hooks"),
        (".git/modules/a/b/commondir", ".git/modules/**/commondir"),
        (".git/modules/a/modules/b/config.worktree", ".git/modules/**/config.worktree"),
        (".git/modules/lib/objects/info/alternates", ".git/modules/**/objects/info/alternates"),
        # ...and of linked worktrees.
        (".git/worktrees/wt/commondir", ".git/worktrees/**/commondir"),
        (".git/worktrees/wt/gitdir", ".git/worktrees/**/gitdir"),
        (".git/worktrees/wt/config.worktree", ".git/worktrees/**/config.worktree"),
        # HEAD outside git directories: it makes its directory a bare repository.
        ("HEAD", "HEAD"),
        ("src/HEAD", "HEAD"),
        ("src/head", "HEAD"),
        # What git writes in everyday work stays writable.
        (".git/HEAD", None),
        (".git/index.lock", None),  # the new index is judged at its rename onto index
        (".git/config.lock", None),  # a later change may judge it at its rename
        (".git/objects/ab/cdef", None),
        (".git/objects/pack/pack-1.pack", None),
        (".git/refs/heads/main", None),
        (".git/refs/heads/config", None),  # a branch named config, at the top
        (".git/logs/HEAD", None),
        # What hides changes from the user's git status and git diff.
        (".git/index", ".git/index"),
        (".git/info/exclude", ".git/info"),
        (".git/info/attributes", ".git/info"),
        (".git/info/sparse-checkout", ".git/info"),
        (".git/INFO/exclude", ".git/info"),
        (".git/modules/lib/info/exclude", ".git/modules/**/info"),
        (".git/modules/lib/index", ".git/modules/**/index"),
        (".git/worktrees/wt/index", ".git/worktrees/**/index"),
        ("src/lib/.git/info/exclude", ".git/info"),
        (".git/info/grafts", ".git/info"),
        (".git/packed-refs", ".git/packed-refs"),
        (".git/refs/replace/abcd", ".git/refs/replace"),
        (".git/modules/lib/refs/replace/abcd", ".git/modules/**/refs/replace"),
        (".git/modules/lib/packed-refs", ".git/modules/**/packed-refs"),
        (".git/packed-refs.lock", None),  # judged at its rename
        (".git/objects/info/packs", None),  # git's own
        (".git/modules/lib/objects/info/commit-graph", None),
        (".git/rebase-merge/git-rebase-todo", None),  # see SECURITY.md
        (".git/modules/lib/HEAD", None),
        (".git/modules/lib/objects/ab/cdef", None),
        (".git/modules/lib/refs/remotes/origin/main", None),  # not the legacy remotes/
        (".git/worktrees/wt/HEAD", None),
        ("src/lib/.git/objects/ab/cdef", None),
        # The working tree: ordinary files.
        (".gitattributes", None),
        (".gitmodules", None),
        ("src/config", None),
        (".evil/config", None),
        ("hooks/pre-commit", None),
        ("HEAD.md", None),
        ("src/.github/workflows/ci.yml", None),
        (".gitignore", None),
        ("my.git", None),
    ],
)
def test_git_rule(path: str, rule: str | None) -> None:
    assert git_rule(path) == rule


@pytest.mark.parametrize(
    ("path", "pointer_rule"),
    [
        (".git/objects/ab/cdef", ".git/**: no links"),
        (".git/modules", ".git/**: no links"),
        (".git/worktrees", ".git/**: no links"),
        ("src/lib/.git/refs/heads/x", ".git/**: no links"),
        (".git/config", ".git/config"),  # a stronger rule wins
        ("src/link", None),  # symbolic links are fine outside git directories
        ("src/.git", ".git"),
    ],
)
def test_no_links_inside_git_directories(path: str, pointer_rule: str | None) -> None:
    assert git_rule(path, pointer=True) == pointer_rule


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        (".git", ".git"),
        ("src/.git", ".git"),
        (".git/modules", ".git/modules/**"),
        (".git/modules/lib", ".git/modules/**"),
        (".git/worktrees", ".git/worktrees/**"),
        (".git/worktrees/wt", ".git/worktrees/**"),
        (".git/objects", ".git/objects/info/alternates"),
        (".git/objects/info", ".git/objects/info/alternates"),
        (".git/hooks", ".git/hooks"),
        (".git/refs", ".git/refs/replace"),
        (".git/refs/heads", None),
        (".git/objects/ab", None),
        (".git/info", ".git/info"),
        ("src", None),  # .git and HEAD are judged by name wherever a directory moves
        ("vendor/lib", None),
    ],
)
def test_git_rule_below_moved_directories(path: str, rule: str | None) -> None:
    assert git_rule_below(path) == rule


def test_names_judged_anywhere_and_git_directories() -> None:
    for name in (".git", ".GIT", "HEAD", "head", "git~1"):
        assert git_name(name), name
    for name in ("src", ".gitignore", "HEADS", "config", ".github"):
        assert not git_name(name), name
    assert in_git_dir(".git") and in_git_dir("a/.git/objects") and in_git_dir(".GIT/x")
    assert not in_git_dir("src/config") and not in_git_dir(".github/x")


# ===== the policy ================================================================================


@pytest.mark.parametrize("trust", list(Trust))
@pytest.mark.parametrize(
    "path", [".git/commondir", "src/.git", ".git/modules/lib/hooks/post-checkout", "src/HEAD"]
)
def test_protected_at_every_level_whatever_the_config_says(trust: Trust, path: str) -> None:
    config = defaults()
    # A project that drops the inherited protect list still keeps git's rules.
    merged = _merge(config, ProjectConfig(protect=[], inherit_protect=False))
    for protect in (config.protect, merged["protect"], []):
        policy = Policy(config.matrix(), config.deny, trust, protect)
        decision = policy.protected(f"/repo/{path}", path, False)
        assert decision is not None and not decision.allowed
        assert decision.errno == errno.EROFS and decision.rule == "protect"
        assert "git's code-running surface" in decision.reason
        assert decision.reason.startswith(f"/repo/{path} ")
        assert policy.may_protect_under(path.rsplit("/", 1)[0] if "/" in path else "") or (
            git_name(path.rsplit("/", 1)[-1])
        )


def test_protect_list_reasons_come_first_and_ordinary_paths_pass() -> None:
    config = defaults()
    policy = Policy(config.matrix(), config.deny, Trust.FULL, config.protect)
    decision = policy.protected("/repo/.git/hooks/pre-commit", ".git/hooks/pre-commit", False)
    assert decision is not None and "'.git/hooks/'" in decision.reason  # the protect list's
    for path in (".git/index.lock", ".git/objects/ab/cd", "src/main.py", ".gitmodules"):
        assert policy.protected(f"/repo/{path}", path, False) is None
    assert policy.protected("/repo/src/x", "src/x", False, pointer=True) is None
    below = policy.protected_below("/repo/.git/modules/...", ".git/modules")
    assert below is not None and below.errno == errno.EROFS
    assert policy.protected_below("/repo/src/...", "src") is None
    assert not policy.may_protect_under("src")
    assert policy.may_protect_under(".git/objects")
    assert policy.may_protect_under("vendor/lib/.git")


# ===== through the operations adapter ===========================================================


def _nested_repo(h: Harness) -> None:
    """What the user has before the agent starts: a repository with a submodule checkout
    (src/lib/.git is a file) and a nested clone (vendor/tool/.git is a directory)."""
    git = h.project / ".git"
    for sub in ("hooks", "objects/ab", "refs/heads", "modules/lib/hooks", "modules/lib/objects"):
        (git / sub).mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "config").write_text("[core]\n")
    (git / "modules" / "lib" / "config").write_text("[core]\n\tworktree = ../../../src/lib\n")
    (git / "modules" / "lib" / "HEAD").write_text("ref: refs/heads/main\n")
    (h.project / "src" / "lib").mkdir()
    (h.project / "src" / "lib" / ".git").write_text("gitdir: ../../.git/modules/lib\n")
    tool = h.project / "vendor" / "tool" / ".git"
    (tool / "hooks").mkdir(parents=True)
    (tool / "objects").mkdir()
    (tool / "config").write_text("[core]\n")


async def test_the_commondir_reproduction_is_refused_at_full(
    make: Callable[[str], Harness],
) -> None:
    """mkdir .evil; ln -s ../.git/objects .evil/objects; ...; echo ../.evil > .git/commondir:
    the agent's own directory is its business, pointing git at it is refused and audited."""
    h = make("full")
    _nested_repo(h)
    repo = ZONE_INO[Zone.REPO]
    evil = (await h.ops.mkdir(repo, b".evil", 0o755, CTX)).st_ino
    await h.ops.symlink(evil, b"objects", b"../.git/objects", CTX)
    await h.write_new(evil, b"config", b'[core]\n\tfsmonitor = "id >&2; false"\n')
    git = await h.ino("/repo/.git")
    await fails(h.ops.create(git, b"commondir", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    h.denial("write", "/repo/.git/commondir", "repo", "EROFS", ".git/commondir")
    await fails(h.ops.symlink(git, b"commondir", b"../.evil/commondir", CTX), errno.EROFS)
    await fails(h.ops.rename(evil, b"config", git, b"commondir", 0, CTX), errno.EROFS)
    config = await h.ino("/repo/.evil/config")
    await fails(h.ops.link(config, git, b"commondir", CTX), errno.EROFS)
    await fails(h.ops.link(config, git, b"config.worktree", CTX), errno.EROFS)
    assert len(h.entries(allowed=False)) == 5
    assert all(e["errno"] == "EROFS" for e in h.entries(allowed=False))
    assert not (h.project / ".git" / "commondir").exists()


async def test_no_new_dot_git_below_any_zone_root(make: Callable[[str], Harness]) -> None:
    h = make("full")
    _nested_repo(h)
    repo = ZONE_INO[Zone.REPO]
    src = await h.ino("/repo/src")
    await fails(h.ops.mkdir(src, b".git", 0o755, CTX), errno.EROFS)
    h.denial("write", "/repo/src/.git", "repo", "EROFS", "a .git entry picks the repository")
    await fails(h.ops.create(src, b".git", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    await fails(h.ops.symlink(src, b".git", b"../.evil", CTX), errno.EROFS)
    await fails(h.ops.mkdir(src, b".GIT", 0o755, CTX), errno.EROFS)
    # Renamed or linked into place, a directory or a file written elsewhere.
    other = (await h.ops.mkdir(repo, b"other", 0o755, CTX)).st_ino
    gitfile = await h.write_new(other, b"gitfile", b"gitdir: ../.evil\n")
    await fails(h.ops.rename(repo, b"other", src, b".git", 0, CTX), errno.EROFS)
    await fails(h.ops.rename(other, b"gitfile", src, b".git", 0, CTX), errno.EROFS)
    await fails(h.ops.link(gitfile, src, b".git", CTX), errno.EROFS)
    # In every zone of the project, at every level that may write there: the user may run git
    # there later. Staged files land in the repo; workers are the project's.
    parent = await h.ino("/staged/c0")
    await fails(h.ops.mkdir(parent, b".git", 0o755, CTX), errno.EROFS)
    await fails(h.ops.create(parent, b"HEAD", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    h.denial("write", "/staged/c0/.git", "staged", "EROFS")
    for zone in (Zone.STAGED, Zone.WORKERS):
        await fails(h.ops.mkdir(ZONE_INO[zone], b".git", 0o755, CTX), errno.EROFS)
    # The sandbox's own scratch zones under the state dir: the agent's repositories.
    for zone_path in ("/session/working", "/workspace/data"):
        parent = await h.ino(zone_path)
        await h.ops.mkdir(parent, b".git", 0o755, CTX)
        await h.ops.create(parent, b"HEAD", 0o644, os.O_WRONLY, CTX)
    # The zone root's own .git: never replaced, moved or removed (nor created, were it absent).
    await fails(h.ops.rename(repo, b".git", repo, b"old-git", 0, CTX), errno.EROFS)
    await fails(h.ops.rename(repo, b"other", repo, b".git", 0, CTX), errno.EROFS)
    assert not (h.project / "src" / ".git").exists()
    assert (h.project / ".git" / "config").exists()


async def test_existing_nested_repositories_readable_but_pinned(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    _nested_repo(h)
    lib = await h.ino("/repo/src/lib")
    gitfile = await h.ino("/repo/src/lib/.git")
    assert await h.read_file(gitfile) == b"gitdir: ../../.git/modules/lib\n"
    for flags in (os.O_WRONLY, os.O_RDWR | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        await fails(h.ops.open(gitfile, flags, CTX), errno.EROFS)
    await fails(h.ops.unlink(lib, b".git", CTX), errno.EROFS)
    await fails(h.ops.rename(lib, b".git", lib, b"git-was-here", 0, CTX), errno.EROFS)
    # The submodule's git directory: config and hooks pinned, objects and HEAD writable.
    module = await h.ino("/repo/.git/modules/lib")
    config = await h.ino("/repo/.git/modules/lib/config")
    assert await h.read_file(config) == b"[core]\n\tworktree = ../../../src/lib\n"
    await fails(h.ops.open(config, os.O_WRONLY, CTX), errno.EROFS)
    await fails(h.ops.unlink(module, b"config", CTX), errno.EROFS)
    hooks = await h.ino("/repo/.git/modules/lib/hooks")
    await fails(h.ops.create(hooks, b"post-checkout", 0o755, os.O_WRONLY, CTX), errno.EROFS)
    await fails(h.ops.create(module, b"commondir", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    objects = await h.ino("/repo/.git/modules/lib/objects")
    await h.write_new(objects, b"new-object", b"x")
    head = await h.ino("/repo/.git/modules/lib/HEAD")
    fh = (await h.ops.open(head, os.O_WRONLY | os.O_TRUNC, CTX)).fh
    await h.ops.release(fh)
    # Its git directory cannot be moved away, nor one moved into modules/.
    modules = await h.ino("/repo/.git/modules")
    await fails(h.ops.rename(modules, b"lib", modules, b"lib2", 0, CTX), errno.EROFS)
    git = await h.ino("/repo/.git")
    await fails(h.ops.rename(git, b"modules", git, b"modules.old", 0, CTX), errno.EROFS)
    scratch = (await h.ops.mkdir(git, b"scratch", 0o755, CTX)).st_ino
    await fails(h.ops.rename(git, b"scratch", modules, b"evil", 0, CTX), errno.EROFS)
    del scratch
    # A nested clone (its .git a directory): the same rules inside it.
    tool_git = await h.ino("/repo/vendor/tool/.git")
    tool_config = await h.ino("/repo/vendor/tool/.git/config")
    await fails(h.ops.open(tool_config, os.O_WRONLY, CTX), errno.EROFS)
    tool_hooks = await h.ino("/repo/vendor/tool/.git/hooks")
    await fails(h.ops.create(tool_hooks, b"pre-commit", 0o755, os.O_WRONLY, CTX), errno.EROFS)
    await fails(h.ops.create(tool_git, b"commondir", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    tool_objects = await h.ino("/repo/vendor/tool/.git/objects")
    await h.write_new(tool_objects, b"obj", b"x")
    vendor = await h.ino("/repo/vendor")
    tool = await h.ino("/repo/vendor/tool")
    await fails(h.ops.rename(tool, b".git", vendor, b"git", 0, CTX), errno.EROFS)
    for entry in h.entries(allowed=False):
        assert entry["errno"] == "EROFS" and "code-running surface" in entry["reason"], entry


async def test_links_inside_git_directories(make: Callable[[str], Harness]) -> None:
    """`.git/worktrees -> ../.evil` would put the next linked worktree's commondir in the
    working tree: no symbolic link is made inside a git directory, none is moved in, and no
    second name for a file from outside; git's own links (objects) still work."""
    h = make("full")
    _nested_repo(h)
    repo = ZONE_INO[Zone.REPO]
    git = await h.ino("/repo/.git")
    await fails(h.ops.symlink(git, b"worktrees", b"../.evil", CTX), errno.EROFS)
    await fails(h.ops.symlink(git, b"modules2", b"../.evil", CTX), errno.EROFS)
    h.denial("write", "/repo/.git/worktrees", "repo", "EROFS", "no symbolic link")
    await h.ops.symlink(repo, b"planted", b"../.evil", CTX)  # outside: an ordinary link
    await fails(h.ops.rename(repo, b"planted", git, b"worktrees", 0, CTX), errno.EROFS)
    planted = await h.ino("/repo/planted")
    await fails(h.ops.link(planted, git, b"worktrees", CTX), errno.EROFS)
    readme = await h.ino("/repo/README.md")
    await fails(h.ops.link(readme, git, b"description", CTX), errno.EROFS)
    # git writes an object to a temporary name and links it into place.
    ab = await h.ino("/repo/.git/objects/ab")
    tmp = await h.write_new(ab, b"tmp_obj_1", b"blob")
    await h.ops.link(tmp, ab, b"cdef", CTX)
    await h.ops.unlink(ab, b"tmp_obj_1", CTX)
    # Directories move freely inside .git where nothing depends on their place.
    refs = await h.ino("/repo/.git/refs")
    await h.ops.mkdir(refs, b"tmp", 0o755, CTX)
    await h.ops.rename(refs, b"tmp", refs, b"tmp2", 0, CTX)
    assert (h.project / ".git" / "objects" / "ab" / "cdef").read_text() == "blob"


async def test_bare_repository_planting_is_refused(make: Callable[[str], Harness]) -> None:
    """src/HEAD + src/objects/ + src/refs/ + src/config (core.worktree, core.fsmonitor): git
    run in src/ takes src for a bare repository. HEAD is the piece that cannot be made."""
    h = make("full")
    _nested_repo(h)
    src = await h.ino("/repo/src")
    await h.ops.mkdir(src, b"objects", 0o755, CTX)
    await h.ops.mkdir(src, b"refs", 0o755, CTX)
    await h.write_new(src, b"config", b"[core]\n\tworktree = ..\n")  # an ordinary name
    await fails(h.ops.create(src, b"HEAD", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    h.denial("write", "/repo/src/HEAD", "repo", "EROFS", "bare repository")
    await fails(h.ops.symlink(src, b"HEAD", b"refs/heads/main", CTX), errno.EROFS)
    await fails(h.ops.rename(src, b"config", src, b"HEAD", 0, CTX), errno.EROFS)
    # Inside a git directory HEAD is git's own.
    head = await h.ino("/repo/.git/HEAD")
    fh = (await h.ops.open(head, os.O_WRONLY | os.O_TRUNC, CTX)).fh
    await h.ops.write(fh, 0, b"ref: refs/heads/feature\n")
    await h.ops.release(fh)
    assert not (h.project / "src" / "HEAD").exists()


@pytest.mark.parametrize("trust", ["untrusted", "session", "workspace"])
async def test_every_level_that_may_write_somewhere(
    make: Callable[[str], Harness], trust: str
) -> None:
    h = make(trust)
    staged = ZONE_INO[Zone.STAGED]
    commit = (await h.ops.mkdir(staged, b"mine", 0o755, CTX)).st_ino
    await fails(h.ops.mkdir(commit, b".git", 0o755, CTX), errno.EROFS)
    await fails(h.ops.create(commit, b"HEAD", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    h.denial("write", "/staged/mine/.git", "staged", "EROFS")
    h.denial("write", "/staged/mine/HEAD", "staged", "EROFS")
    await h.ops.mkdir(commit, b"ordinary", 0o755, CTX)
    working = await h.ino("/session/working")
    await h.ops.mkdir(working, b".git", 0o755, CTX)  # the agent's own scratch repository


# ===== core.hooksPath inside the project =========================================================


def _git(cwd: Path, *args: str) -> None:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize(
    ("hooks_path", "patterns"),
    [
        (None, []),  # .git/hooks: git_rule's already
        (".githooks", ["/.githooks/"]),
        ("tools/git hooks", ["/tools/git hooks/"]),
        (".husky/_", ["/.husky/"]),  # husky runs the hooks one level up
        ("./.husky", ["/.husky/"]),
        ("hooks[1]", ["/hooks[[]1]/"]),  # glob characters are literal
        ("/elsewhere/hooks", []),  # outside the project: out of the agent's reach
        ("../hooks", []),
        (".git/custom-hooks", []),  # a git directory's: git_rule's already
    ],
)
def test_hooks_path_inside_the_project_is_protected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hooks_path: str | None, patterns: list[str]
) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    _git(project, "init", "-q")
    if hooks_path is not None:
        _git(project, "config", "core.hooksPath", hooks_path)
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "not-this-one"))  # ignored by the probe
    assert git_surface_protect(project) == patterns
    # A project in a subdirectory of the work tree: hooks above it are out of the mount's reach.
    assert git_surface_protect(project / "src") == []


def test_hooks_path_of_no_repository(tmp_path: Path) -> None:
    assert git_surface_protect(tmp_path / "missing") == []


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_hooks_path_set_globally_applies_to_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative core.hooksPath in the user's global config names a directory in every
    repository: the project's is protected."""
    home = tmp_path / "gitconfig"
    home.write_text("[core]\n\thooksPath = .githooks\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    assert git_surface_protect(project) == ["/.githooks/"]
    config = defaults()
    policy = Policy(
        config.matrix(), config.deny, Trust.FULL, protected_patterns(project, config, None)
    )
    decision = policy.protected("/repo/.githooks/pre-commit", ".githooks/pre-commit", False)
    assert decision is not None and "'/.githooks/'" in decision.reason


# ===== staged commits land no part of it either ==================================================


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("src/HEAD", "code-running surface (HEAD)"),
        ("HEAD", "code-running surface (HEAD)"),
        ("sub/.git./config", "code-running surface (.git/config)"),
        ("sub/git~1", "code-running surface (.git)"),
        ("sub/.git/config", "inside .git"),
    ],
)
def test_staged_commits_never_write_it(path: str, problem: str) -> None:
    config = defaults()
    found = path_problem(path, Patterns(config.deny), Patterns(config.protect))
    assert found is not None and problem in found, found
    assert path_problem("src/HEAD.md", Patterns(config.deny), Patterns(config.protect)) is None


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_symlinked_hooks_and_git_dirs_inside_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`.git/hooks -> ../githooks` (a tracked hooks directory, linked in), and `.git` a link
    to a git directory under another name in the project: git_rule cannot see them by name,
    the probe finds them where git does."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    project = tmp_path / "project"
    project.mkdir()
    _git(project, "init", "-q")
    shutil.rmtree(project / ".git" / "hooks")
    (project / "githooks").mkdir()
    (project / ".git" / "hooks").symlink_to("../githooks")
    assert git_surface_protect(project) == ["/githooks/"]
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    (other / ".repo").mkdir()
    (other / ".git").rename(other / ".repo" / "main.git")
    (other / ".git").symlink_to(".repo/main.git")
    patterns = git_surface_protect(other)
    assert "/.repo/main.git/config" in patterns and "/.repo/main.git/hooks/" in patterns
    config = defaults()
    policy = Policy(config.matrix(), config.deny, Trust.FULL, patterns)
    for path in (".repo/main.git/config", ".repo/main.git/modules/a/b/hooks/x"):
        assert policy.protected(f"/repo/{path}", path, False) is not None, path
    assert policy.protected("/repo/.repo/main.git/index", ".repo/main.git/index", False) is None


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the project to another user")
def test_probe_reads_a_project_another_user_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root running sandboxfs on a user's project: git's safe.directory would stop there, and
    the hooks directory would go unprotected."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    project = tmp_path / "project"
    project.mkdir()
    _git(project, "init", "-q")
    _git(project, "config", "core.hooksPath", ".githooks")
    for path in (project, *project.rglob("*")):
        os.lchown(path, 65534, 65534)
    assert git_surface_protect(project) == ["/.githooks/"]
