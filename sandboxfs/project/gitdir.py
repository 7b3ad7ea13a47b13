"""A project whose `.git` is a file naming a git directory outside it: a linked worktree
(`git worktree add`), or a work tree made with `git init --separate-git-dir`.

Git follows the `gitdir:` line literally, so inside `run` the directory it names must be at that
very path. `run` shows the repository's git directory (for a linked worktree, the main
repository's: the common dir, which holds the worktree's own directory under `worktrees/`) as
one more zone, GIT_DIR_ZONE, served by the mount like any other (every access decided and
audited), and bubblewrap binds that zone, inside, onto the path the `.git` file names. The
zone's permissions are /repo's at every level (what git may do in /repo/.git it may do there),
and git's rules hold in it as below a `.git` (sandboxfs.core.policy.git_path): config judged,
hooks, `commondir`, `gitdir`, alternates and the rest protected.

What cannot be supported is refused before anything starts, with one line (exit 125): a `.git`
file with a relative path leading out of the project (a submodule's checkout run on its own,
`git worktree add --relative-paths`), a git directory at a path that the sandbox's own layout
occupies (/usr, /etc, /proc, /dev, /sandbox, ...), or one that contains the project.

A plain `sandboxfs mount` adds no such zone: there /repo shows the `.git` file as it is, naming
a directory outside the mount, and git works on the mount only from the host, where that
directory exists.
"""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from sandboxfs.config.model import Config, ZoneConfig
from sandboxfs.core import gitconfig
from sandboxfs.core.context import CONFINED_MOUNTPOINT
from sandboxfs.core.policy import Op, Trust, Zone
from sandboxfs.errors import SetupError
from sandboxfs.gitquery import rev_parse

GIT_DIR_ZONE = "gitdir"
_GITFILE_MAX = 4096
# Top-level directories of the sandbox's own layout (sandboxfs.run.confine): nothing can be bound
# below them. /tmp and /var are the sandbox's own tmpfs, where a bind can go.
_RESERVED = frozenset(
    {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev"}
    | {CONFINED_MOUNTPOINT.strip("/").split("/")[0]}
)


class GitDirZoneConfig(ZoneConfig):
    """The zone `run` adds for a project's git directory outside it (never read from a file).
    `inside`: the absolute path, as the `.git` file names it, where it is bound inside."""

    inside: str


@dataclass(frozen=True)
class OutsideGitDir:
    """The git directory a project's `.git` file names (`git_dir`, absolute, as written) and
    the directory shown for it (`common_dir`: the main repository's git directory for a
    linked worktree, else `git_dir` itself)."""

    git_dir: str
    common_dir: str


def _refuse(project: Path, problem: str, workaround: str) -> SetupError:
    return SetupError(f"{project}/.git {problem}; git could not work inside run: {workaround}")


def _read_small(path: Path) -> str | None:
    """The text of a regular file (not followed if a link), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _GITFILE_MAX).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)


def _gitfile_target(text: str) -> str | None:
    """The path a `.git` file names, as git reads it: `gitdir: <path>` on its first line."""
    line = text.split("\n", 1)[0].rstrip("\r")
    if not line.startswith("gitdir: "):
        return None
    target = line[len("gitdir: ") :]
    return target or None


def find(project: Path) -> OutsideGitDir | None:
    """The git directory outside `project` that its `.git` file names; None when `.git` is a
    directory, absent, not a `gitdir:` file or names a directory inside the project (then
    /repo shows it already). UserError (exit 125) for a layout that cannot work inside."""
    text = _read_small(project / ".git")
    if text is None:
        return None
    target = _gitfile_target(text)
    if target is None:
        return None
    if not os.path.isabs(target):
        joined = os.path.normpath(os.path.join(project, target))
        if joined == str(project) or joined.startswith(f"{project}/"):
            return None  # inside the project: /repo shows it at the same relative place
        raise _refuse(
            project,
            f"names its git directory by a relative path leading out of the project "
            f"({target!r}), which has no place inside the sandbox",
            "for a submodule, run sandboxfs on the superproject; for a worktree added with "
            "--relative-paths, run `git worktree repair` with worktree.useRelativePaths=false",
        )
    git_dir = os.path.normpath(target)
    if git_dir == str(project) or git_dir.startswith(f"{project}/"):
        raise _refuse(
            project,
            f"names a git directory inside the project by its absolute path ({git_dir}), "
            f"which is /sandbox/repo/... inside",
            f"write it relative to the project: gitdir: {os.path.relpath(git_dir, project)}",
        )
    common = _read_small(Path(git_dir) / "commondir")
    common_dir = git_dir
    if common is None and _sets_worktree(Path(git_dir) / "config"):
        raise _refuse(
            project,
            f"names {git_dir}, a submodule's git directory (its core.worktree names the "
            f"checkout by a path outside the sandbox)",
            "run sandboxfs on the superproject",
        )
    if common is not None:
        value = common.split("\n", 1)[0].rstrip("\r")
        common_dir = os.path.normpath(os.path.join(git_dir, value))
        if os.path.dirname(git_dir) != os.path.join(common_dir, "worktrees"):
            raise _refuse(
                project,
                f"names {git_dir}, whose common directory {common_dir} does not hold it under "
                f"worktrees/",
                "recreate the worktree with `git worktree add`",
            )
    if not os.path.isdir(common_dir):
        raise _refuse(
            project,
            f"names {git_dir}, whose repository {common_dir} is not a directory",
            "repair the worktree (`git worktree repair` in the main repository)",
        )
    top = common_dir.strip("/").split("/")[0]
    if top in _RESERVED or common_dir == "/":
        raise _refuse(
            project,
            f"names a git directory under /{top}, where the sandbox has its own files",
            "move the repository (`git worktree move`, or clone it elsewhere)",
        )
    if str(project).startswith(f"{common_dir.rstrip('/')}/"):
        raise _refuse(
            project,
            f"lies inside the git directory it names ({common_dir})",
            "add the worktree outside the main repository's .git",
        )
    return OutsideGitDir(git_dir, common_dir)


def _sets_worktree(config: Path) -> bool:
    """Whether the git config file `config` sets core.worktree (a submodule's does)."""
    try:
        fd = os.open(config, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        data = os.read(fd, gitconfig.MAX_CONFIG_BYTES)
    finally:
        os.close(fd)
    try:
        return any(entry.name == "core.worktree" for entry in gitconfig.parse(data))
    except gitconfig.ConfigSyntaxError:
        return False


def hooks_protect(project: Path, common_dir: str) -> list[str]:
    """Protect patterns for the hooks directory that core.hooksPath puts in the git directory
    under another name than `hooks/` (which git's rules protect already), as the user's git
    finds it. Zone-relative like every protect pattern: the same path in other zones is
    protected too, which errs on the safe side."""
    lines = rev_parse(project, "--git-path", "hooks")
    if lines is None or len(lines) != 1:
        return []
    hooks = os.path.realpath(os.path.join(project, lines[0]))
    rel = os.path.relpath(hooks, os.path.realpath(common_dir))
    if rel == ".":
        raise _refuse(
            project,
            f"leads to {common_dir}, which core.hooksPath makes git's hooks directory too",
            "point core.hooksPath elsewhere",
        )
    if rel == ".." or rel.startswith("../"):
        return []
    if rel == "hooks" or rel.startswith("hooks/"):
        return []
    return [f"/{glob.escape(rel)}/"]


def with_git_dir(config: Config, project: Path) -> Config:
    """`config` with the zone of the project's git directory outside it (see the module's
    docstring), or as it is when there is none."""
    found = find(project)
    if found is None:
        return config
    if GIT_DIR_ZONE in config.zones:
        raise SetupError(
            f"the project's config declares a zone named {GIT_DIR_ZONE!r}, where sandboxfs run "
            f"shows the git directory {found.common_dir} of this worktree; rename that zone"
        )
    zone = GitDirZoneConfig(
        path=found.common_dir,
        permissions={level: config.permissions[level][Zone.REPO.value] for level in Trust},
        inside=found.common_dir,
    )
    protect = [*config.protect]
    protect += [p for p in hooks_protect(project, found.common_dir) if p not in protect]
    return config.model_copy(
        update={"zones": {**config.zones, GIT_DIR_ZONE: zone}, "protect": protect}
    )


def git_dir_zones(config: Config) -> frozenset[Zone]:
    """The zones whose root is a git directory (sandboxfs.core.policy.Policy's `git_dirs`)."""
    return frozenset(
        Zone(name) for name, zone in config.zones.items() if isinstance(zone, GitDirZoneConfig)
    )


def environment(config: Config) -> dict[str, str]:
    """What `run` adds to the program's environment for such a project: git's automatic
    `worktree prune` (run by `git gc`) off. Inside, the work trees' own paths do not exist, so
    git would take every worktree for one that was deleted and remove its metadata (what git's
    rules let it: the worktree would be left broken)."""
    if not git_dir_zones(config):
        return {}
    return {
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "gc.worktreePruneExpire",
        "GIT_CONFIG_VALUE_0": "never",
    }


def bwrap_binds(config: Config, trust: Trust, mountpoint: Path) -> list[str]:
    """bubblewrap's options that put each such zone, served by the mount at `mountpoint`, at
    its path inside (none where the level may neither read nor list the zone)."""
    args: list[str] = []
    matrix = config.matrix()[trust]
    for name, zone in config.zones.items():
        if not isinstance(zone, GitDirZoneConfig):
            continue
        access = matrix[Zone(name)]
        if Op.READ in access.ops or Op.LIST in access.ops:
            args += ["--bind", str(mountpoint / name), zone.inside]
    return args
