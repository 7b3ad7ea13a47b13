"""Landing a frozen staged commit as ONE git commit (land), on the current branch or a new
one, all or nothing (CommitRefused), also across a kill (the landing journal:
recover_landings); its message with the sandboxfs trailers (commit_message); and the audit
entry of every review, commit and discard (record)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandboxfs.audit.writer import record_now
from sandboxfs.core.entry import AuditOp
from sandboxfs.layout import LANDING_JOURNAL, audit_path, interrupted_landings

from ..core.syscalls import write_all
from .format import CREATE_FLAGS, DIR_FLAGS, MODE_FILE
from .git import Git
from .plan import Change, Plan, RepoState, make_plan
from .review import Review, Workspace, iso, valid_id
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
    journal: Path,
    message: str | None = None,
    branch: str | None = None,
    expect: str | None = None,
) -> Landed:
    """Make ONE git commit of a frozen staged commit: on the current branch (working tree and
    index follow), or on a new `branch` (nothing checked out changes). All or nothing: any
    reason raises CommitRefused before a file, the index or a ref changes; on the current
    branch the landing `journal` (see _land_here) makes it so across a kill too."""
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
        old_index, new_index = _new_index(git, Path(tmp), head, info)
    _reached("objects")
    here = Landed(new_commit, git.branch(), False, plan)
    _land_here(git, repo.project, review, head, here, landing, (old_index, new_index), journal)
    return here


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


def _new_index(git: Git, tmp: Path, head: str | None, info: bytes) -> tuple[bytes | None, bytes]:
    """The real index as it is now (None if there is none), and the same with the landed
    entries: what replaces it, through index.lock, once the working tree holds them."""
    index = tmp / "new-index"
    real = git.git_dir / "index"
    try:
        old: bytes | None = real.read_bytes()
    except FileNotFoundError:
        old = None
    if old is not None:
        index.write_bytes(old)
    else:
        git.run("read-tree", *(["--empty"] if head is None else [head]), index=index)
    git.run("update-index", "-z", "--index-info", data=info, index=index)
    return old, index.read_bytes()


# ----- the landing journal ------------------------------------------------------------------------
#
# Landing on the checked-out branch changes three things no one transaction covers: files of the
# working tree, the index and HEAD's branch. The journal, review/<id>/landing.json, is written
# durably before the first of them changes and names every temporary file and the index.lock
# the landing makes. While its phase is "prepared" nothing the user sees has changed: the next
# `sandboxfs staged` command that finds it rolls it back (removes those files). Once it is
# "placing" every new file is written and the working tree was checked: it is finished (temps
# renamed into place, deletions, index.lock onto index, then HEAD's branch moved from the old
# commit, last). Either way that command records it in the audit log (recover_landings).

JOURNAL = LANDING_JOURNAL
_JOURNAL_KEYS = frozenset(
    {
        "commit_id",
        "session",
        "phase",
        "head",
        "commit",
        "branch",
        "counts",
        "index",
        "files",
        "dirs",
    }
)
# Tests kill the landing at a named step (tests/integration/test_staged_crash.py).
KILL_AT_ENV = "SANDBOXFS_TEST_LANDING_KILL"


def _reached(step: str) -> None:
    if os.environ.get(KILL_AT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _write_journal(path: Path, doc: Mapping[str, Any]) -> None:
    """Replace the journal durably: a temporary file, fsync, rename, fsync of its directory."""
    temp = path.with_name(f".landing-{secrets.token_hex(6)}.tmp")
    fd = os.open(temp, CREATE_FLAGS, 0o600)
    try:
        write_all(fd, json.dumps(dict(doc), sort_keys=True).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temp, path)
    _sync_dir(path.parent)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_journal(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _sync_dir(path.parent)


def _missing_dirs(wt: WorkTree, paths: Sequence[str]) -> list[str]:
    """The directories on the way to `paths` that do not exist yet, parents first."""
    missing: list[str] = []
    for path in paths:
        parts = path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            rel = "/".join(parts[:depth])
            if rel not in missing and wt.directory(rel) is None:
                missing.append(rel)
    return missing


def _write_index_lock(git: Git, old: bytes | None, new: bytes) -> None:
    """Take git's index lock (as git does: O_EXCL) and write the new index into it; refused
    when another git holds it, or changed the index since `old` was read."""
    try:
        fd = os.open(git.git_dir / "index.lock", CREATE_FLAGS, 0o666)
    except FileExistsError:
        raise CommitRefused(["another git process is running (.git/index.lock exists)"]) from None
    try:
        write_all(fd, new)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        now: bytes | None = (git.git_dir / "index").read_bytes()
    except FileNotFoundError:
        now = None
    if now != old:
        raise WorkTreeError("the index changed meanwhile")


def _remove_index_lock(git: Git, digest: str) -> None:
    """Remove index.lock if it is the landing's own (holds the new index of `digest`)."""
    lock = git.git_dir / "index.lock"
    with contextlib.suppress(OSError):
        if hashlib.sha256(lock.read_bytes()).hexdigest() == digest:
            lock.unlink()


def _roll_back(wt: WorkTree, git: Git, doc: Mapping[str, Any]) -> None:
    """Undo a landing still "prepared": its temporary files, its index.lock, the directories
    it made (when left empty). Nothing else had changed."""
    for item in doc["files"]:
        if item["temp"] is not None:
            with contextlib.suppress(OSError, WorkTreeError):
                wt.remove_temp(item["path"], item["temp"])
    _remove_index_lock(git, doc["index"])
    for rel in reversed(doc["dirs"]):
        parent_rel, _, name = rel.rpartition("/")
        with contextlib.suppress(OSError, WorkTreeError):
            parent = wt.directory(parent_rel)
            if parent is not None:
                os.rmdir(name, dir_fd=parent)


def _place(wt: WorkTree, git: Git, doc: Mapping[str, Any]) -> list[str]:
    """Finish a landing that is "placing", again from where it stopped: each temporary file
    still there renamed onto its path, each deletion, index.lock onto index. Returns warnings
    about files that could not be put in place."""
    warnings: list[str] = []
    for item in doc["files"]:
        path = item["path"]
        try:
            if item["temp"] is None:
                wt.delete(path)
            else:
                with contextlib.suppress(FileNotFoundError):  # placed already
                    wt.replace(path, item["temp"])
        except (OSError, WorkTreeError) as exc:
            why = exc.phrase if isinstance(exc, WorkTreeError) else exc.strerror
            warnings.append(f"{escape_name(path)} was not written ({why})")
    lock = git.git_dir / "index.lock"
    with contextlib.suppress(OSError):
        if hashlib.sha256(lock.read_bytes()).hexdigest() == doc["index"]:
            os.rename(lock, git.git_dir / "index")
    return warnings


def _land_here(
    git: Git,
    project: Path,
    review: Review,
    head: str | None,
    landed: Landed,
    landing: Sequence[Change],
    index: tuple[bytes | None, bytes],
    journal: Path,
) -> None:
    """Write every file beside its target and the new index into index.lock (journal
    "prepared"), check that nothing changed meanwhile (else roll back and refuse), then
    (journal "placing") put the files and the index in place and move HEAD's branch to the
    new commit, last, against the old one. The caller marks the review committed, records
    it, and drops the journal."""
    old_index, new_index = index
    temps = {c.path: f".sandboxfs-{secrets.token_hex(8)}.tmp" for c in landing}
    with WorkTree(project) as wt:
        doc: dict[str, Any] = {
            "commit_id": review.commit_id,
            "session": review.session,
            "phase": "prepared",
            "head": head,
            "commit": landed.commit,
            "branch": landed.branch,
            "counts": list(landed.plan.counts()),
            "index": hashlib.sha256(new_index).hexdigest(),
            "files": [
                {"path": c.path, "temp": None if c.action == "delete" else temps[c.path]}
                for c in landing
            ],
        }
        try:
            doc["dirs"] = _missing_dirs(wt, [c.path for c in landing if c.action != "delete"])
            _write_journal(journal, doc)
            _reached("prepared")
            for change in landing:
                if change.action != "delete":
                    wt.write_temp(
                        change.path,
                        change.new or b"",
                        change.mode or MODE_FILE,
                        name=temps[change.path],
                    )
                    _reached("temp")
            _write_index_lock(git, old_index, new_index)
            _reached("index.lock")
            for change in landing:
                if not wt.holds(change.path, change.old, change.old_mode):
                    raise WorkTreeError(f"{escape_name(change.path)} changed meanwhile")
            if git.head() != head:
                raise CommitRefused(["HEAD moved meanwhile"])
        except (OSError, WorkTreeError, CommitRefused) as exc:
            if "dirs" in doc:
                _roll_back(wt, git, doc)
            _drop_journal(journal)
            if isinstance(exc, CommitRefused):
                raise
            why = exc.phrase if isinstance(exc, WorkTreeError) else exc.strerror
            raise CommitRefused([f"the working tree cannot be written: {why}"]) from None
        doc["phase"] = "placing"
        _write_journal(journal, doc)
        _reached("placing")
        landed.warnings += _place(wt, git, doc)
        _reached("placed")
        try:
            _update_ref(git, "HEAD", landed.commit, head, review.commit_id)
        except CommitRefused:
            _restore(wt, git, landing, old_index)
            _drop_journal(journal)
            raise
    _reached("ref")


def _restore(wt: WorkTree, git: Git, landing: Sequence[Change], old_index: bytes | None) -> None:
    """Put back what HEAD has, when HEAD's branch moved after the files were placed (another
    program moved it between the last check and the compare-and-swap): each file as it was,
    the index as it was."""
    for change in landing:
        with contextlib.suppress(OSError, WorkTreeError):
            if change.old_mode is None:
                wt.delete(change.path)
            else:
                temp = wt.write_temp(change.path, change.old or b"", change.old_mode)
                wt.replace(change.path, temp)
    with contextlib.suppress(OSError):
        if old_index is None:
            os.unlink(git.git_dir / "index")
        else:
            lock = git.git_dir / "index.lock"
            lock.write_bytes(old_index)
            os.rename(lock, git.git_dir / "index")


# ----- after a kill: finishing or rolling back ----------------------------------------------------


def mark_committed(
    ws: Workspace, commit_id: str, commit: str, branch: str | None, counts: Sequence[int]
) -> None:
    """The review's state: committed as `commit`."""
    state = dict(ws.read_state(commit_id) or {})
    state.update(
        status="committed",
        committed_at=iso(datetime.now(UTC)),
        commit=commit,
        branch=branch,
        counts=list(counts),
    )
    ws.write_state(commit_id, state)


def finish_landing(
    ws: Workspace, journal: Path, landed: Landed, commit_id: str, session: str | None
) -> None:
    """After HEAD moved: the review committed, the audit entry, then the journal dropped (a
    kill between leaves the journal, and the next command records it again, never not)."""
    mark_committed(ws, commit_id, landed.commit, landed.branch, landed.plan.counts())
    record(ws, commit_id, session, f"commit {landed.commit}")
    _drop_journal(journal)


def recover_landings(ws: Workspace, git: Git | None) -> list[str]:
    """Find every landing of this workspace a kill interrupted (its journal is left) and
    finish it ("placing") or roll it back ("prepared"), each audited; returns one line for
    the user about each."""
    if git is None or not ws.review.is_dir():
        return []
    notes = []
    for journal in interrupted_landings(ws.project, ws.name):
        commit_id = journal.parent.name
        if not valid_id(commit_id):
            continue
        with ws.locked(commit_id):
            try:
                doc = json.loads(journal.read_bytes())
            except FileNotFoundError:
                continue  # finished by another command meanwhile
            except ValueError:
                doc = None
            if (
                not isinstance(doc, dict)
                or doc.get("commit_id") != commit_id
                or not doc.keys() >= _JOURNAL_KEYS
            ):
                why = f"{journal} is not a landing journal; move it away"
                record(ws, commit_id, None, f"landing recovery refused: {why}", False, why)
                notes.append(why)
                continue
            notes.append(_recover(ws, git, journal, doc))
    return notes


def _recover(ws: Workspace, git: Git, journal: Path, doc: Mapping[str, Any]) -> str:
    commit_id, session, head, new = doc["commit_id"], doc["session"], doc["head"], doc["commit"]
    with WorkTree(ws.project) as wt:
        if doc["phase"] == "prepared":
            _roll_back(wt, git, doc)
            detail = "landing interrupted before anything changed: rolled back, still pending"
            record(ws, commit_id, session, detail)
            _drop_journal(journal)
            return f"staged commit {commit_id}: {detail}"
        warnings = _place(wt, git, doc)
    now = git.head()
    if now == head:
        try:
            _update_ref(git, "HEAD", new, head, commit_id)
            now = new
        except CommitRefused:
            now = git.head()
    if now != new:
        why = f"HEAD moved to {now} meanwhile; the working tree and index hold {new}"
        record(ws, commit_id, session, f"landing interrupted, not finished: {why}", False, why)
        _drop_journal(journal)
        return f"staged commit {commit_id}: an interrupted landing could not finish: {why}"
    mark_committed(ws, commit_id, new, doc["branch"], doc["counts"])
    detail = f"landing interrupted, finished: commit {new}"
    record(ws, commit_id, session, detail)
    _drop_journal(journal)
    return f"staged commit {commit_id}: {detail}" + "".join(f"; {w}" for w in warnings)
