"""Staged commits: what an agent proposes in /staged, how the user reviews it
(`sandboxfs staged`, sandboxfs.cli.staged), and how it lands as one git commit.

The first review freezes a staged commit into a snapshot in no zone, so what was reviewed is
what lands. Nothing here follows a symlink in the staged tree or the working tree, runs the
repository's code, or imports pyfuse3 or trio. The modules, each importing only ones above it:

- text: names and content escaped for terminals
- format: the staged-commit format: reading it (O_NOFOLLOW, within budgets), digest, snapshot
- paths: paths a staged commit may never write, and paths flagged as running code
- git: git plumbing that runs none of the repository's code
- worktree: the working tree, read and written without following symlinks
- plan: a staged commit against HEAD, three-way: what would land, and what stands in the way
- review: a workspace's staged commits, their review state, freezing, pending
- land: the audit entry, and landing a frozen staged commit as one commit
- prune: removing what committed, discarded (and, when asked, pending) staged commits leave
"""

from .format import (
    MODE_EXEC,
    MODE_FILE,
    Refused,
    StagedFile,
    StagedTree,
    TooLarge,
    parse_deletions,
    read_tree,
    write_tree,
)
from .git import Git
from .land import (
    JOURNAL,
    CommitRefused,
    commit_message,
    finish_landing,
    land,
    record,
    recover_landings,
)
from .paths import flag_patterns, path_problem, review_order, runs_code
from .plan import Change, Plan, RepoState, make_plan
from .review import Review, Workspace, iso, pending, valid_id
from .text import decode, escape_name, escape_text

__all__ = [
    "JOURNAL",
    "MODE_EXEC",
    "MODE_FILE",
    "Change",
    "CommitRefused",
    "Git",
    "Plan",
    "Refused",
    "RepoState",
    "Review",
    "StagedFile",
    "StagedTree",
    "TooLarge",
    "Workspace",
    "commit_message",
    "decode",
    "escape_name",
    "escape_text",
    "finish_landing",
    "flag_patterns",
    "iso",
    "land",
    "make_plan",
    "parse_deletions",
    "path_problem",
    "pending",
    "read_tree",
    "record",
    "recover_landings",
    "review_order",
    "runs_code",
    "valid_id",
    "write_tree",
]
