"""Landing a frozen staged commit as ONE git commit (land), on the current branch or a new
one, all or nothing (CommitRefused); its message with the sandboxfs trailers
(commit_message); and the audit entry of every review, commit and discard (record)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sandboxfs.audit.log import record_now
from sandboxfs.core.entry import AuditOp
from sandboxfs.layout import audit_path

from .format import MODE_FILE
from .git import Git
from .plan import Change, Plan, RepoState, make_plan
from .review import Review, Workspace
from .text import decode, escape_name, escape_text
from .worktree import WorkTree, WorkTreeError

# ----- audit --------------------------------------------------------------------------------------


def record(
    ws: Workspace,
    commit_id: str,
    session: str | None,
    detail: str,
    allowed: bool = True,
    reason: str | None = None,
) -> None:
    """Append an entry of op `stage` to the project's audit log, durably."""
    record_now(
        audit_path(ws.project),
        AuditOp.STAGE,
        vpath=f"/staged/{commit_id}",
        zone="staged",
        session=session,
        workspace=ws.name,
        allowed=allowed,
        reason=reason,
        detail=detail,
    )


# ----- committing ---------------------------------------------------------------------------------


class CommitRefused(Exception):
    def __init__(self, reasons: Sequence[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = list(reasons)


@dataclass
class Landed:
    commit: str
    branch: str | None  # the branch it is on; None when HEAD is detached
    new_branch: bool
    plan: Plan
    warnings: list[str] = field(default_factory=list)


_TRAILER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*: ")


def commit_message(text: str, session: str | None, commit_id: str) -> bytes:
    """The message, trailing spaces and blank lines trimmed, with the two sandboxfs trailers
    (in the message's own trailer block if it ends with one)."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    paragraph: list[str] = []
    for line in reversed(lines):
        if not line:
            break
        paragraph.append(line)
    has_trailers = len(paragraph) < len(lines) and all(_TRAILER_RE.match(x) for x in paragraph)
    if not has_trailers:
        lines.append("")
    lines += [f"Sandboxfs-Session: {session or 'unknown'}", f"Sandboxfs-Staged: {commit_id}"]
    return ("\n".join(lines) + "\n").encode("utf-8")


def land(
    review: Review,
    repo: RepoState,
    *,
    message: str | None = None,
    branch: str | None = None,
    expect: str | None = None,
) -> Landed:
    """Make ONE git commit of a frozen staged commit: on the current branch (working tree and
    index follow), or on a new `branch` (nothing checked out changes). All or nothing: any
    reason raises CommitRefused before a file, the index or a ref changes."""
    git = repo.git
    if git is None:
        raise CommitRefused(["the project is not in a git repository"])
    tree = review.tree
    if tree is None:
        raise CommitRefused([review.error or "its content cannot be read"])
    if review.status != "pending":
        done = f" as {review.state.get('commit')}" if review.status == "committed" else ""
        raise CommitRefused([f"it was {review.status}{done} already"])
    reasons: list[str] = []
    if review.digest != tree.digest():
        reasons.append("its snapshot changed on disk after it was frozen")
    elif expect is not None and normal_digest(expect) != review.digest:
        reasons.append(f"its digest is {review.digest}, not the expected {escape_name(expect)}")
    ref = None
    if branch is not None:
        ref = _branch_ref(git, branch, reasons)
    elif (git.git_dir / "index.lock").exists():
        reasons.append("another git process is running (.git/index.lock exists)")
    plan = make_plan(
        tree, repo, review.base, worktree=branch is None, message_given=message is not None
    )
    reasons += plan.reasons()
    if reasons:
        raise CommitRefused(reasons)
    text = message if message is not None else (tree.message or b"").decode("utf-8")
    body = commit_message(text, review.session, review.commit_id)
    landing = [c for c in plan.changes if c.lands]
    head = repo.head
    with tempfile.TemporaryDirectory(prefix="sandboxfs-staged-") as tmp:
        new_commit, info = _make_commit(git, Path(tmp), head, landing, body)
    if ref is not None:
        _update_ref(git, ref, new_commit, None, review.commit_id)
        return Landed(new_commit, branch, True, plan)
    warnings = _land_here(git, repo.project, review.commit_id, head, new_commit, landing)
    updated = git.run("update-index", "-z", "--index-info", data=info, check=False)
    if updated.returncode != 0:
        warnings.append("the index was not updated: 'git reset -q' brings it to HEAD")
    return Landed(new_commit, git.branch(), False, plan, warnings)


def normal_digest(text: str) -> str:
    text = text.strip().lower()
    return text if text.startswith("sha256:") else f"sha256:{text}"


def _branch_ref(git: Git, branch: str, reasons: list[str]) -> str | None:
    checked = git.run("check-ref-format", "--branch", branch, check=False)
    if branch.startswith("-") or checked.returncode != 0:
        reasons.append(f"{escape_name(branch)} is not a valid branch name")
        return None
    ref = f"refs/heads/{decode(checked.stdout).strip()}"
    if git.run("rev-parse", "-q", "--verify", ref, check=False).returncode == 0:
        reasons.append(f"branch {escape_name(branch)} exists already")
        return None
    return ref


def _make_commit(
    git: Git, tmp: Path, head: str | None, landing: Sequence[Change], message: bytes
) -> tuple[str, bytes]:
    """Blobs, a tree from a private index, and the commit object; no ref changes. Returns
    the commit and the --index-info lines that bring an index at HEAD to it."""
    blobs = tmp / "blobs"
    blobs.mkdir()
    written = [c for c in landing if c.action != "delete"]
    names = []
    for number, change in enumerate(written):
        (blobs / str(number)).write_bytes(change.new or b"")
        names.append(str(blobs / str(number)))
    shas: dict[str, str] = {}
    if names:
        out = git.run(
            "hash-object", "-w", "--no-filters", "--stdin-paths", data="\n".join(names).encode()
        )
        shas = dict(zip((c.path for c in written), decode(out.stdout).split(), strict=True))
    zero = "0" * len(head or next(iter(shas.values()), "0" * 40))
    lines = []
    for change in landing:
        name = os.fsencode(git.full(change.path))
        if change.action == "delete":
            lines.append(b"0 %s\t%s\0" % (zero.encode(), name))
        else:
            mode = change.mode or MODE_FILE
            lines.append(b"%o %s\t%s\0" % (mode, shas[change.path].encode(), name))
    info = b"".join(lines)
    index = tmp / "index"
    git.run("read-tree", *(["--empty"] if head is None else [head]), index=index)
    git.run("update-index", "-z", "--index-info", data=info, index=index)
    new_tree = decode(git.run("write-tree", index=index).stdout).strip()
    parents = ["-p", head] if head is not None else []
    out = git.run(
        "commit-tree",
        new_tree,
        *parents,
        "--no-gpg-sign",
        "-F",
        "-",
        data=message,
        env=git.identity(),
    )
    return decode(out.stdout).strip(), info


def _update_ref(git: Git, ref: str, new: str, old: str | None, commit_id: str) -> None:
    result = git.run(
        "update-ref",
        "-m",
        f"sandboxfs: staged commit {commit_id}",
        ref,
        new,
        old or "",
        check=False,
    )
    if result.returncode != 0:
        why = decode(result.stderr).strip().splitlines()
        raise CommitRefused(
            [f"{ref} moved meanwhile ({escape_text(why[-1] if why else 'update-ref failed')})"]
        )


def _land_here(
    git: Git,
    project: Path,
    commit_id: str,
    head: str | None,
    new_commit: str,
    landing: Sequence[Change],
) -> list[str]:
    """Write every file beside its target, check that nothing changed meanwhile, move HEAD's
    branch to `new_commit` (compare-and-swap), then rename the files into place and delete
    the deleted ones. Before the ref moves, any failure undoes the temporary files. Returns
    warnings about files that could not be put in place after the ref moved."""
    temps: dict[str, str] = {}
    warnings: list[str] = []
    with WorkTree(project) as wt:
        try:
            for change in landing:
                if change.action != "delete":
                    temps[change.path] = wt.write_temp(
                        change.path, change.new or b"", change.mode or MODE_FILE
                    )
            for change in landing:
                if not wt.holds(change.path, change.old, change.old_mode):
                    raise WorkTreeError(f"{escape_name(change.path)} changed meanwhile")
            _update_ref(git, "HEAD", new_commit, head, commit_id)
        except (OSError, WorkTreeError, CommitRefused) as exc:
            for path, temp in temps.items():
                wt.remove_temp(path, temp)
            wt.remove_created_dirs()
            if isinstance(exc, CommitRefused):
                raise
            why = exc.phrase if isinstance(exc, WorkTreeError) else exc.strerror
            raise CommitRefused([f"the working tree cannot be written: {why}"]) from None
        for change in landing:
            try:
                if change.action == "delete":
                    wt.delete(change.path)
                else:
                    wt.replace(change.path, temps[change.path])
            except (OSError, WorkTreeError) as exc:
                why = exc.phrase if isinstance(exc, WorkTreeError) else exc.strerror
                warnings.append(f"{escape_name(change.path)} was not written ({why})")
    return warnings
