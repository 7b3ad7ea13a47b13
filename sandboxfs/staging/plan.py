"""A staged commit compared with the repository: make_plan gives each path's Change against
HEAD, three-way from the commit HEAD pointed to when it was staged, and every Problem that
stands in the way (the path checks, conflicts, and for a commit on the current branch a
working tree or index that is not clean)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..core.policy import Patterns
from .format import DELETIONS_NAME, FILES_NAME, MESSAGE_NAME, StagedFile, StagedTree
from .git import MODE_GITLINK, MODE_LINK, Entry, Git
from .paths import flag_patterns, path_problem, review_order, runs_code
from .text import escape_name
from .worktree import WorkTree, WorkTreeError


class Problem(NamedTuple):
    text: str  # a phrase after the path, or a whole sentence for the commit as a whole
    conflict: bool = False


@dataclass
class Change:
    """What a staged commit does to one path, compared with HEAD."""

    path: str
    action: str  # create | update | mode | delete | same | absent | conflict
    old_mode: int | None = None
    mode: int | None = None
    old: bytes | None = None  # the content at HEAD
    new: bytes | None = None  # the content that would land (staged, or merged)
    runs_code: bool = False
    merged: bool = False
    problems: list[Problem] = field(default_factory=list)

    @property
    def lands(self) -> bool:
        return self.action in ("create", "update", "mode", "delete")

    @property
    def size(self) -> int | None:
        return None if self.new is None else len(self.new)

    @property
    def binary(self) -> bool:
        return any(b"\0" in data[:8000] for data in (self.old, self.new) if data is not None)


@dataclass
class Plan:
    """A staged commit compared with the repository: what would land, and why it would not."""

    changes: list[Change]
    problems: list[Problem]  # the commit's own (refused entries, message, nothing to do)
    head: str | None
    base: str | None

    def reasons(self) -> list[str]:
        """Every reason the commit is refused, one sentence each, names escaped."""
        out = [p.text for p in self.problems]
        out += [f"{escape_name(c.path)} {p.text}" for c in self.changes for p in c.problems]
        return out

    @property
    def applies(self) -> str:
        """yes, conflict (only conflicts stand in the way) or no."""
        every = [*self.problems, *(p for c in self.changes for p in c.problems)]
        if not every:
            return "yes"
        return "conflict" if all(p.conflict for p in every) else "no"

    def counts(self) -> tuple[int, int, int]:
        """(created, updated or mode-changed, deleted) paths."""
        actions = [c.action for c in self.changes]
        return (
            actions.count("create"),
            actions.count("update") + actions.count("mode"),
            actions.count("delete"),
        )


def _parents(path: str) -> Iterator[str]:
    parts = path.split("/")
    for depth in range(1, len(parts)):
        yield "/".join(parts[:depth])


def _dirs_of(paths: Iterable[str]) -> set[str]:
    return {parent for path in paths for parent in _parents(path)}


def message_problem(message: bytes | None) -> Problem | None:
    if message is None:
        return Problem(f"there is no {MESSAGE_NAME} (give the message with -m)")
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        return Problem(f"{MESSAGE_NAME} is not UTF-8 text (give the message with -m)")
    if not text.strip():
        return Problem(f"{MESSAGE_NAME} is empty (give the message with -m)")
    return None


@dataclass
class RepoState:
    """What a plan compares with: the git repository (None if the project is in none), its
    HEAD, the base of the staged commit, and the working tree if it is to be written."""

    project: Path
    git: Git | None
    deny: Patterns
    protect: Patterns
    flags: Patterns
    head: str | None = None
    _index: dict[str, list[tuple[int, str, int]]] | None = None

    @classmethod
    def open(cls, project: Path, deny: Sequence[str], protect: Sequence[str]) -> RepoState:
        git = Git.find(project)
        state = cls(project, git, Patterns(deny), Patterns(protect), flag_patterns())
        state.head = git.head() if git is not None else None
        return state

    def index(self) -> dict[str, list[tuple[int, str, int]]]:
        if self._index is None:
            self._index = self.git.index() if self.git is not None else {}
        return self._index


def make_plan(
    tree: StagedTree,
    repo: RepoState,
    base: str | None,
    *,
    worktree: bool,
    message_given: bool = False,
) -> Plan:
    """Compare `tree` with HEAD, three-way from `base` (the commit HEAD pointed to when it was
    staged; None: none known, so every change made in HEAD since is a conflict). With
    `worktree`, also check that the working tree and index can take the result (the commit
    on the current branch writes them)."""
    git = repo.git
    problems: list[Problem] = []
    if git is None:
        problems.append(Problem("the project is not in a git repository"))
    head_tree = git.tree(repo.head) if git is not None else {}
    base_tree = git.tree(base) if git is not None else {}
    head_dirs = _dirs_of(head_tree)
    if git is not None:
        git.fetch(
            e.sha
            for p in [*tree.files, *tree.deletions]
            for e in (head_tree.get(p), base_tree.get(p))
            if e is not None and e.mode != MODE_GITLINK
        )
    changes: list[Change] = []
    for path, staged in tree.files.items():
        change = Change(path, "create", mode=staged.mode, new=staged.data)
        _plan_file(change, staged, head_tree, head_dirs, base_tree, git)
        changes.append(change)
    for path in tree.deletions:
        change = Change(path, "delete")
        if path in tree.files:
            change.problems.append(Problem(f"is both in {FILES_NAME}/ and in {DELETIONS_NAME}"))
        _plan_deletion(change, head_tree, head_dirs, base_tree, git)
        changes.append(change)
    for change in changes:
        problem = path_problem(change.path, repo.deny, repo.protect)
        if problem is not None:
            change.problems.insert(0, Problem(problem))
        change.runs_code = runs_code(change.path, change.mode, repo.flags)
    if worktree and git is not None:
        _check_worktree(changes, repo, head_tree)
    for entry in tree.refused:
        problems.append(Problem(f"{escape_name(entry.path)} is a {entry.kind}, not a regular file"))
    if not message_given:
        bad_message = message_problem(tree.message)
        if bad_message is not None:
            problems.append(bad_message)
    if not any(c.lands for c in changes) and not any(c.problems for c in changes):
        what = "its files are all in HEAD already" if changes else "it has no files"
        problems.append(Problem(f"nothing to commit: {what}"))
    order = review_order([c.path for c in changes], [c.path for c in changes if c.runs_code])
    rank = {path: i for i, path in enumerate(order)}
    changes.sort(key=lambda c: (rank[c.path], c.action == "delete"))
    return Plan(changes, problems, repo.head, base)


def _type_problem(path: str, tree: Mapping[str, Entry], dirs: set[str]) -> str | None:
    """Why `path` cannot be a regular file in this tree (beyond it existing as one)."""
    if path in dirs:
        return "is a directory in the repository"
    for parent in _parents(path):
        if parent in tree:
            kind = "a symlink" if tree[parent].mode == MODE_LINK else "not a directory"
            return f"goes through {escape_name(parent)}, which is {kind} in the repository"
    entry = tree.get(path)
    if entry is not None and entry.mode == MODE_LINK:
        return "is a symlink in the repository"
    if entry is not None and entry.mode == MODE_GITLINK:
        return "is a submodule in the repository"
    return None


def _plan_file(
    change: Change,
    staged: StagedFile,
    head_tree: Mapping[str, Entry],
    head_dirs: set[str],
    base_tree: Mapping[str, Entry],
    git: Git | None,
) -> None:
    problem = _type_problem(change.path, head_tree, head_dirs)
    if problem is not None:
        change.problems.append(Problem(problem))
        return
    head, base = head_tree.get(change.path), base_tree.get(change.path)
    if head is None:
        if base is not None:
            change.action = "conflict"
            change.problems.append(
                Problem("was deleted in HEAD since it was staged (modify/delete)", True)
            )
        return
    assert git is not None
    old = git.blob(head.sha) or b""
    change.old, change.old_mode = old, head.mode
    if base is None:  # created by both sides (or no base is known)
        if old != staged.data:
            change.action = "conflict"
            change.problems.append(
                Problem("exists in HEAD with other content than staged (create/create)", True)
            )
            return
        result = old
    else:
        mine = git.blob(base.sha) or b""
        if head.sha == base.sha or old == staged.data:
            result = staged.data
        elif staged.data == mine:
            result = old
        else:
            merged = git.merge(old, mine, staged.data)
            if merged is None:
                change.action = "conflict"
                change.problems.append(
                    Problem("conflicts with changes made in HEAD since it was staged", True)
                )
                return
            result, change.merged = merged, True
        if staged.mode == base.mode:
            change.mode = head.mode
    change.new = result
    if result != old:
        change.action = "update"
    else:
        change.action = "mode" if change.mode != head.mode else "same"


def _plan_deletion(
    change: Change,
    head_tree: Mapping[str, Entry],
    head_dirs: set[str],
    base_tree: Mapping[str, Entry],
    git: Git | None,
) -> None:
    if change.path in head_dirs:
        change.problems.append(
            Problem("is a directory in the repository (list each of its files to delete)")
        )
        return
    head, base = head_tree.get(change.path), base_tree.get(change.path)
    if head is None:
        change.action = "absent"
        return
    change.old_mode = head.mode
    if head.mode == MODE_GITLINK:
        change.problems.append(Problem("is a submodule in the repository"))
        return
    if git is not None:
        change.old = git.blob(head.sha)  # a symlink's blob is its target
    if base is None or base != head:
        change.action = "conflict"
        why = "was created" if base is None else "changed"
        change.problems.append(Problem(f"{why} in HEAD since it was staged (delete/modify)", True))


def _check_worktree(changes: list[Change], repo: RepoState, head_tree: Mapping[str, Entry]) -> None:
    """Each path that lands must be clean: the working tree and the index hold what HEAD
    holds (or nothing, for a create), and no component of the way is a symlink."""
    index = repo.index()
    index_dirs = _dirs_of(index)
    with WorkTree(repo.project) as wt:
        for change in changes:
            if not change.lands or change.problems:
                continue
            path = change.path
            head = head_tree.get(path)
            staged_in_index = index.get(path, [])
            if any(stage != 0 for _, _, stage in staged_in_index):
                change.problems.append(Problem("has unresolved merge conflicts in the index"))
                continue
            expected = [(head.mode, head.sha, 0)] if head is not None else []
            if staged_in_index != expected or path in index_dirs:
                change.problems.append(Problem("has uncommitted changes (in the index)"))
                continue
            if any(parent in index for parent in _parents(path)):
                change.problems.append(Problem("has uncommitted changes (in the index)"))
                continue
            try:
                clean = wt.holds(path, change.old, change.old_mode)
            except WorkTreeError as exc:
                change.problems.append(Problem(exc.phrase))
                continue
            if clean:
                continue
            if head is None:
                change.problems.append(
                    Problem("exists in the working tree but is not in HEAD (untracked)")
                )
            else:
                change.problems.append(Problem("has uncommitted changes"))
