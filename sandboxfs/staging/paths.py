"""Which repository paths a staged commit may write (path_problem: never outside the
repository, in .git or sandboxfs's state directory, deny-listed or protected), and which run
code on the user's machine (flag patterns, runs_code), listed first in reviews (review_order).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from ..core.policy import Patterns, fold, git_rule
from ..core.store import STATE_DIR_NAME
from .format import MODE_EXEC

FLAG_ENV = "SANDBOXFS_STAGED_FLAG"
# Paths that run code on the user's machine once they are in the repository (CI, build files,
# editor settings, direnv, git's own configuration): listed first in reviews and marked `!`.
# The deny-list forms (sandboxfs.core.policy.Patterns): a name glob matches at any depth, a glob
# with a "/" inside matches from the repository root, a trailing "/" everything below that
# directory. SANDBOXFS_STAGED_FLAG adds colon-separated globs. (Executable `*.sh` files are
# flagged too: see `runs_code`.)
FLAG_PATTERNS: tuple[str, ...] = (
    ".git/",
    ".github/workflows/",
    ".gitlab-ci.yml",
    "Makefile",
    "*.mk",
    "package.json",
    "setup.py",
    "pyproject.toml",
    ".envrc",
    ".vscode/",
    ".idea/",
    ".pre-commit-config.yaml",
    "Dockerfile",
    ".gitattributes",
    ".gitmodules",
    ".husky/",
)


def flag_patterns(environ: Mapping[str, str] | None = None) -> Patterns:
    """FLAG_PATTERNS and the globs of $SANDBOXFS_STAGED_FLAG (colon-separated)."""
    extra = (environ if environ is not None else os.environ).get(FLAG_ENV, "")
    return Patterns([*FLAG_PATTERNS, *(g for g in extra.split(":") if g.strip())])


def runs_code(path: str, mode: int | None, flags: Patterns) -> bool:
    """Whether `path` (with git mode `mode`, None for a deletion) runs code on the user's
    machine: it matches a flag pattern, or it is an executable `*.sh`."""
    if flags.match_within(path, False) is not None:
        return True
    return mode == MODE_EXEC and fold(path).endswith(".sh")


def review_order(paths: Iterable[str], flagged: Iterable[str]) -> list[str]:
    """Flagged paths first, then the rest; each group in byte order."""
    marked = set(flagged)
    return sorted(paths, key=lambda p: (p not in marked, os.fsencode(p)))


def path_problem(path: str, deny: Patterns, protect: Patterns) -> str | None:
    """Why `path` (repository-relative) may never be written by a staged commit, as a phrase
    that follows the path ("src/a is deny-listed (.env)"), or None if it may."""
    if not path:
        return "is an empty path"
    if "\0" in path:
        return "leaves the repository (it contains a NUL byte)"
    if path.startswith("/"):
        return "leaves the repository (it is absolute)"
    parts = path.split("/")
    if ".." in parts:
        return "leaves the repository (it has a '..' component)"
    if "" in parts or "." in parts:
        return "is not a normalized path (an empty or '.' component)"
    if any(fold(part) == ".git" for part in parts):
        return "is inside .git, which a staged commit never writes"
    rule = git_rule(path)  # HEAD outside .git, and .git's other spellings
    if rule is not None:
        return f"is part of git's code-running surface ({rule}), which a staged commit never writes"
    if fold(parts[0]) == fold(STATE_DIR_NAME):
        return f"is inside {STATE_DIR_NAME}, sandboxfs's state directory"
    pattern = deny.match_within(path, False)
    if pattern is not None:
        return f"is deny-listed ({pattern})"
    pattern = protect.match_within(path, False)
    if pattern is not None:
        return f"is protected ({pattern})"
    return None
