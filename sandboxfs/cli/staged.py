"""`sandboxfs staged list|show|diff|commit|discard|prune`: review an agent's staged commits and
land them in git (the model is sandboxfs.staging).

Every subcommand takes `--project DIR` (default: .), `--workspace ID` (default: default) and
`--json` (`list`: one JSON array; the others: one JSON object). `show`, `diff` and `commit`
freeze the staged commit (a snapshot in the review state, which the agent cannot reach), so
what is reviewed is what lands; each of them, `discard` and `prune` is audited as op `stage`.
`prune --older-than DURATION` removes what committed and discarded staged commits leave (their
files in /staged and their review), and with `--pending` the pending ones too; it asks first
as `audit prune` does (sandboxfs.staging.prune).

Exit codes: 0 done; 1 refused (a commit that cannot land, with one line per reason: `sandboxfs:
staged commit ID not committed: REASON`; a staged commit too large to review); 2 bad input
(an unknown id, an invalid option), one line.

Reviews print every name and every line of content with terminal control characters escaped
(`\\x1b`), and never shorten the list of changes, deletions or refused entries.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

from sandboxfs.cli import subcommands as subcommands_mod
from sandboxfs.config import model as config_mod
from sandboxfs.errors import Failure, SandboxfsError, UserError
from sandboxfs.project.state import finish_interrupted, format_duration, format_size
from sandboxfs.project.zones import validate_project
from sandboxfs.staging import (
    JOURNAL,
    Change,
    CommitRefused,
    Git,
    Plan,
    RepoState,
    Review,
    StagedTree,
    TooLarge,
    Workspace,
    decode,
    escape_name,
    escape_text,
    finish_landing,
    iso,
    land,
    make_plan,
    record,
    recover_landings,
)
from sandboxfs.staging import prune as pruning

_BOLD, _RED, _GREEN, _CYAN, _YELLOW, _RESET = (
    "\x1b[1m",
    "\x1b[31m",
    "\x1b[32m",
    "\x1b[36m",
    "\x1b[33m",
    "\x1b[m",
)


def main(args: argparse.Namespace) -> int:
    """Run the subcommand that the parser made by `add_parser` parsed; returns the exit code."""
    _escaping_stdout()
    project = validate_project(args.project)
    ws = Workspace(project, args.workspace)
    recover_interrupted(project, args.workspace)
    run: dict[str, Callable[[argparse.Namespace, Workspace], int]] = {
        "list": _list,
        "show": _show,
        "diff": _diff,
        "commit": _commit,
        "discard": _discard,
        "prune": _prune,
    }
    return run[args.staged_action](args, ws)


def recover_interrupted(project: Path, workspace: str) -> None:
    """The landings a kill interrupted, finished or rolled back (audited) by the next command
    that opens the project: `mount` and `run` as well as every `staged` command, so that no
    session starts over a half-landed commit."""
    for note in recover_landings(Workspace(project, workspace), _git_or_none(project)):
        _note(note)


def _escaping_stdout() -> None:
    """Names are escaped already; this only keeps a non-UTF-8 locale from failing on them."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def _note(message: str) -> None:
    print(f"sandboxfs: {message}", file=sys.stderr)


def _repo(ws: Workspace, need_git: bool) -> RepoState:
    config = config_mod.load(ws.project)
    repo = RepoState.open(ws.project, config.deny, config.protect)
    if need_git and repo.git is None:
        raise UserError(
            f"{ws.project} is not in a git repository; staged commits land in git (git init, "
            "and commit once, first)"
        )
    return repo


def _git_or_none(project: Path) -> Git | None:
    try:
        return Git.find(project)
    except SandboxfsError:
        return None


# ----- list -------------------------------------------------------------------------------------


def _list(args: argparse.Namespace, ws: Workspace) -> int:
    ids, ignored = ws.listing()
    for line in ignored:
        _note(f"ignored {line}")
    repo = _repo(ws, need_git=False)
    rows = [_list_row(ws.load(commit_id, repo.git), repo) for commit_id in ids]
    if args.json:  # a list: one JSON array (see "JSON output" in docs/commands.md)
        print(json.dumps(rows, sort_keys=True, indent=2))
        return 0
    if not rows:
        print(f"no staged commits in workspace {ws.name} of {ws.project}")
        return 0
    table = [["ID", "SESSION", "CREATED (UTC)", "FILES", "STATUS", "APPLIES", "SUBJECT"]]
    for row in rows:
        counts = row["files"]
        table.append(
            [
                escape_name(row["id"]),
                escape_name(row["session"] or "-"),
                (row["created"] or "-").replace("T", " ").removesuffix("Z"),
                "?" if counts is None else f"+{counts[0]} ~{counts[1]} -{counts[2]}",
                row["status"],
                row["applies"],
                _shorten(escape_name(row["subject"]), 60),
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _list_row(review: Review, repo: RepoState) -> dict[str, Any]:
    counts: list[int] | None = None
    applies, reasons = "no", [review.error] if review.error else []
    if review.tree is not None:
        plan = make_plan(review.tree, repo, review.base, worktree=review.status == "pending")
        counts = list(plan.counts())
        if review.status == "pending":
            applies, reasons = plan.applies, plan.reasons()
    if review.status == "committed":
        stored = review.state.get("counts")
        counts = list(stored) if isinstance(stored, list) else counts
    if review.status != "pending":
        applies, reasons = "-", []
    return {
        "id": review.commit_id,
        "session": review.session,
        "created": review.state.get("created"),
        "subject": review.subject(),
        "files": counts,
        "status": review.status,
        "applies": applies,
        "reasons": reasons,
        "frozen": review.frozen,
        "digest": review.digest,
        "commit": review.state.get("commit"),
        "branch": review.state.get("branch"),
    }


# ----- show -------------------------------------------------------------------------------------


def _frozen(args: argparse.Namespace, ws: Workspace, repo: RepoState) -> Review:
    commit_id = ws.require(args.commit_id)
    review = ws.freeze(commit_id, repo.git)
    if review.tree is None:
        raise Failure(f"staged commit {commit_id}: {review.error}")
    return review


def _use_color(args: argparse.Namespace) -> bool:
    if args.color == "always":
        return True
    if args.color == "never" or args.json:
        return False
    return (
        sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    )


def _paint(on: bool) -> Callable[[str, str], str]:
    return lambda code, text: f"{code}{text}{_RESET}" if on else text


def _show(args: argparse.Namespace, ws: Workspace) -> int:
    repo = _repo(ws, need_git=True)
    review = _frozen(args, ws, repo)
    assert review.tree is not None
    plan = make_plan(review.tree, repo, review.base, worktree=True)
    record(ws, review.commit_id, review.session, "show")
    if args.json:
        print(json.dumps(_show_json(review, plan), sort_keys=True, indent=2))
        return 0
    paint = _paint(_use_color(args))
    tree = review.tree
    print(paint(_BOLD, f"staged commit {escape_name(review.commit_id)}") + f"  {review.status}")
    for label, value in _header(review, plan):
        print(f"{label:<9} {value}")
    print("message")
    message = decode(tree.message).rstrip("\n") if tree.message is not None else "(none)"
    for line in escape_text(message).split("\n"):
        print(f"    {line}".rstrip())
    print(f"changes   {_summary(plan)}")
    for change in plan.changes:
        line = _change_line(change)
        print(paint(_YELLOW, line) if change.runs_code else line)
    _print_odd_entries(tree)
    print(f"applies   {_applies(review, plan)}")
    if review.status == "pending":
        for reason in plan.reasons():
            print(f"    {reason}")
    return 0


def _summary(plan: Plan) -> str:
    """show's `changes` line: how many paths are created, updated, deleted, and how many of
    them run code on the reviewer's machine (flagged)."""
    created, updated, deleted = plan.counts()
    flagged = sum(1 for c in plan.changes if c.runs_code)
    summary = f"+{created} ~{updated} -{deleted}"
    if flagged:
        summary += f"; {flagged} run{'s' if flagged == 1 else ''} code on your machine (!)"
    return summary


def _print_odd_entries(tree: StagedTree) -> None:
    """The entries of the staged tree that are not files to apply: refused ones (which
    refuse the commit) and unknown ones (ignored)."""
    if tree.refused:
        print("refused entries (the commit is refused while they exist)")
        for entry in tree.refused:
            print(f"    {entry.kind:<17} {escape_name(entry.path)}")
    if tree.unknown:
        print("unknown entries (ignored)")
        for name in tree.unknown:
            print(f"    {escape_name(name)}")


def _header(review: Review, plan: Plan) -> list[tuple[str, str]]:
    created = review.state.get("created") or "-"
    head = plan.head or "none (unborn branch)"
    base = review.base or "none (no commit of HEAD's history is older than the staged commit)"
    rows = [
        ("session", escape_name(review.session or "unknown")),
        ("created", created.replace("T", " ").replace("Z", " UTC")),
        ("base", base + (" (HEAD when it was staged)" if review.base else "")),
        ("head", head),
        ("digest", review.digest or "-"),
    ]
    if review.status == "committed":
        where = review.state.get("branch") or "a detached HEAD"
        rows.append(("commit", f"{review.state.get('commit')} on {escape_name(str(where))}"))
    return rows


def _applies(review: Review, plan: Plan) -> str:
    if review.status == "committed":
        return f"- (committed as {review.state.get('commit')})"
    if review.status == "discarded":
        return "- (discarded)"
    return plan.applies


def _mode(mode: int | None) -> str:
    return "-" if mode is None else f"{mode:o}"


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    if size < 10 * 1024:
        return f"{size} B"
    if size < 10 * 1024 * 1024:
        return f"{size / 1024:.1f} KiB"
    return f"{size / (1024 * 1024):.1f} MiB"


def _notes(change: Change) -> list[str]:
    notes = []
    if change.runs_code:
        notes.append("runs code on your machine")
    if change.old_mode is not None and change.mode is not None and change.old_mode != change.mode:
        notes.append(f"mode {change.old_mode:o} -> {change.mode:o}")
    if change.merged:
        notes.append("merged with changes made in HEAD since it was staged")
    if change.action == "same":
        notes.append("already in HEAD")
    if change.action == "absent":
        notes.append("not in HEAD: nothing to delete")
    if change.binary:
        notes.append("binary")
    for problem in change.problems:
        notes.append(("CONFLICT: " if problem.conflict else "REFUSED: ") + problem.text)
    return notes


def _change_line(change: Change) -> str:
    mode = change.mode if change.action != "delete" else change.old_mode
    size = change.size if change.action != "delete" else None
    notes = _notes(change)
    tail = f"  ({'; '.join(notes)})" if notes else ""
    return (
        f"  {'!' if change.runs_code else ' '} {change.action:<8} {_mode(mode):>6} "
        f"{_size(size):>10}  {escape_name(change.path)}{tail}"
    )


def _show_json(review: Review, plan: Plan) -> dict[str, Any]:
    tree = review.tree
    assert tree is not None
    message = decode(tree.message) if tree.message is not None else None
    counts = plan.counts()
    return {
        "id": review.commit_id,
        "status": review.status,
        "session": review.session,
        "created": review.state.get("created"),
        "base": review.base,
        "head": plan.head,
        "digest": review.digest,
        "message": message,
        "counts": {"create": counts[0], "update": counts[1], "delete": counts[2]},
        "changes": [_change_json(c) for c in plan.changes],
        "deletions": list(tree.deletions),
        "refused": [{"path": r.path, "kind": r.kind} for r in tree.refused],
        "unknown": list(tree.unknown),
        "applies": plan.applies if review.status == "pending" else "-",
        "reasons": plan.reasons() if review.status == "pending" else [],
        "commit": review.state.get("commit"),
        "branch": review.state.get("branch"),
    }


def _change_json(change: Change) -> dict[str, Any]:
    return {
        "path": change.path,
        "action": change.action,
        "mode": None if change.mode is None else f"{change.mode:o}",
        "old_mode": None if change.old_mode is None else f"{change.old_mode:o}",
        "size": change.size if change.action != "delete" else None,
        "runs_code": change.runs_code,
        "merged": change.merged,
        "binary": change.binary,
        "problems": [{"text": p.text, "conflict": p.conflict} for p in change.problems],
    }


# ----- diff -------------------------------------------------------------------------------------


def _diff(args: argparse.Namespace, ws: Workspace) -> int:
    repo = _repo(ws, need_git=True)
    review = _frozen(args, ws, repo)
    assert review.tree is not None
    plan = make_plan(review.tree, repo, review.base, worktree=True)
    record(ws, review.commit_id, review.session, "diff")
    shown = [c for c in plan.changes if c.action not in ("same", "absent")]
    if args.json:
        print(json.dumps(_diff_json(review, plan, shown), sort_keys=True, indent=2))
        return 0
    paint = _paint(_use_color(args))
    out = sys.stdout
    out.write(
        f"# staged commit {escape_name(review.commit_id)} ({review.status}), "
        f"digest {review.digest}\n"
    )
    for change in shown:
        if change.runs_code:
            out.write(paint(_YELLOW, f"# ! {escape_name(change.path)} runs code on your machine"))
            out.write("\n")
    if review.status == "pending" and plan.applies != "yes":
        out.write(f"# applies: {plan.applies}\n")
        for reason in plan.reasons():
            out.write(f"#   {reason}\n")
    for change in shown:
        for line in _file_diff(change):
            out.write(_painted(paint, line) + "\n")
    return 0


def _diff_json(review: Review, plan: Plan, shown: list[Change]) -> dict[str, Any]:
    """diff --json: the commit, whether it applies (pending only), each changed file's diff."""
    return {
        "id": review.commit_id,
        "status": review.status,
        "digest": review.digest,
        "applies": plan.applies if review.status == "pending" else "-",
        "reasons": plan.reasons() if review.status == "pending" else [],
        "files": [
            {**_change_json(c), "diff": None if c.binary else "\n".join(_hunks(c))} for c in shown
        ],
    }


def _painted(paint: Callable[[str, str], str], line: str) -> str:
    """A line of the diff in git's colours: headers bold, hunks cyan, + green, - red, and
    sandboxfs's own # notes yellow."""
    if line.startswith(("diff --git", "old mode", "new ", "deleted ", "--- ", "+++ ")):
        return paint(_BOLD, line)
    if line.startswith("@@"):
        return paint(_CYAN, line)
    if line.startswith("+"):
        return paint(_GREEN, line)
    if line.startswith("-"):
        return paint(_RED, line)
    if line.startswith("#"):
        return paint(_YELLOW, line)
    return line


def _file_diff(change: Change) -> Iterator[str]:
    name = escape_name(change.path)
    yield f"diff --git a/{name} b/{name}"
    for problem in change.problems:
        yield f"# {'CONFLICT' if problem.conflict else 'REFUSED'}: {name} {problem.text}"
    if change.merged:
        yield f"# {name}: merged with changes made in HEAD since it was staged"
    old = None if change.old_mode is None else change.old
    new = None if change.action == "delete" else change.new
    if change.action == "delete":
        yield f"deleted file mode {_mode(change.old_mode)}"
    elif change.old_mode is None:
        yield f"new file mode {_mode(change.mode)}"
    elif change.mode != change.old_mode:
        yield f"old mode {_mode(change.old_mode)}"
        yield f"new mode {_mode(change.mode)}"
    if old == new:
        return
    a = f"a/{name}" if old is not None else "/dev/null"
    b = f"b/{name}" if new is not None else "/dev/null"
    if change.binary:
        yield f"Binary files {a} and {b} differ"
        return
    yield f"--- {a}"
    yield f"+++ {b}"
    yield from _hunks(change)


def _lines(data: bytes | None) -> list[str]:
    if not data:
        return []
    parts = decode(data).split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _range(start: int, stop: int) -> str:
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start + 1 if length else start},{length}"


def _hunks(change: Change) -> Iterator[str]:
    a = _lines(change.old if change.old_mode is not None else None)
    b = _lines(change.new if change.action != "delete" else None)
    for group in SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(3):
        first, last = group[0], group[-1]
        yield f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@"
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                yield from _content(" ", a[a1:a2])
                continue
            if tag in ("replace", "delete"):
                yield from _content("-", a[a1:a2])
            if tag in ("replace", "insert"):
                yield from _content("+", b[b1:b2])


def _content(prefix: str, lines: Sequence[str]) -> Iterator[str]:
    for line in lines:
        yield prefix + escape_text(line.removesuffix("\n"))
        if not line.endswith("\n"):
            yield "\\ No newline at end of file"


# ----- commit, discard --------------------------------------------------------------------------


def _commit(args: argparse.Namespace, ws: Workspace) -> int:
    repo = _repo(ws, need_git=True)
    commit_id = ws.require(args.commit_id)
    if args.message is not None and not args.message.strip():
        raise UserError("-m needs a message that is not empty")
    ws.freeze(commit_id, repo.git)
    with ws.locked(commit_id):
        review = ws.load(commit_id, repo.git)
        journal = ws.review / commit_id / JOURNAL
        try:
            landed = land(
                review,
                repo,
                journal=journal,
                message=args.message,
                branch=args.branch,
                expect=args.expect,
            )
        except SandboxfsError as exc:  # git failed: nothing was moved, but it is recorded
            why = exc.message
            record(ws, commit_id, review.session, f"commit refused: {why}", False, why)
            raise
        except CommitRefused as exc:
            why = "; ".join(exc.reasons)
            record(ws, commit_id, review.session, f"commit refused: {why}", False, why)
            if args.json:
                doc = {"id": commit_id, "committed": False, "reasons": exc.reasons}
                print(json.dumps(doc, sort_keys=True, indent=2))
            for reason in exc.reasons:
                _note(f"staged commit {commit_id} not committed: {reason}")
            return 1
        finish_landing(ws, journal, landed, commit_id, review.session)
    counts = landed.plan.counts()
    files = f"+{counts[0]} ~{counts[1]} -{counts[2]}"
    if args.json:
        doc = {
            "id": commit_id,
            "committed": True,
            "commit": landed.commit,
            "branch": landed.branch,
            "new_branch": landed.new_branch,
            "digest": review.digest,
            "counts": {"create": counts[0], "update": counts[1], "delete": counts[2]},
            "warnings": landed.warnings,
        }
        print(json.dumps(doc, sort_keys=True, indent=2))
    elif landed.new_branch:
        print(
            f"committed staged commit {commit_id} as {landed.commit} on the new branch "
            f"{escape_name(landed.branch or '')} ({files}); HEAD, the index and the working tree "
            "are unchanged"
        )
    else:
        where = f"on {escape_name(landed.branch)}" if landed.branch else "on the detached HEAD"
        print(f"committed staged commit {commit_id} as {landed.commit} {where} ({files})")
    for warning in landed.warnings:
        _note(f"warning: {warning}")
    return 1 if landed.warnings else 0


def _discard(args: argparse.Namespace, ws: Workspace) -> int:
    commit_id = ws.require(args.commit_id)
    state = ws.read_state(commit_id)
    if state is None or not state.get("digest"):
        try:
            ws.freeze(commit_id, _git_or_none(ws.project))  # the snapshot, for the record
        except TooLarge as exc:
            _note(f"no snapshot kept: {exc.message}")
    with ws.locked(commit_id):
        state = ws.read_state(commit_id) or {"id": commit_id, "status": "pending"}
        if state.get("status") == "discarded" and not ws.exists_staged(commit_id):
            print(f"staged commit {commit_id} was discarded already")
            return 0
        if state.get("status") != "committed":
            state["status"] = "discarded"
        state["discarded_at"] = iso(datetime.now(UTC))
        ws.write_state(commit_id, state)  # before the files go: the mount stays refusing
        removed = ws.remove_staged(commit_id)
    session = state.get("session")
    record(ws, commit_id, session if isinstance(session, str) else None, "discard")
    kept = ws.review / commit_id
    if args.json:
        doc = {"id": commit_id, "status": state["status"], "removed": removed, "review": str(kept)}
        print(json.dumps(doc, sort_keys=True, indent=2))
    else:
        committed = " (it stays committed)" if state["status"] == "committed" else ""
        print(f"discarded staged commit {commit_id}{committed}; its review record is in {kept}")
    return 0


# ----- prune --------------------------------------------------------------------------------------


def _prune(args: argparse.Namespace, ws: Workspace) -> int:
    finish_interrupted(ws.project)
    now = datetime.now(UTC)
    older = args.older_than
    chosen, waiting = pruning.select(pruning.candidates(ws), older, now, args.pending)
    shown = format_duration(older.total_seconds())

    def note_kept() -> None:
        if waiting:
            _note(
                f"kept {len(waiting)} pending staged commit{'' if len(waiting) == 1 else 's'} "
                f"unchanged for more than {shown} (--pending prunes them too)"
            )

    count = len(chosen)
    what = (
        f"remove {count} staged commit{'' if count == 1 else 's'} "
        f"({format_size(sum(p.bytes for p in chosen))}) finished more than {shown} ago from "
        f"workspace {ws.name} of {ws.project}"
    )
    if not chosen or args.dry_run:
        note_kept()
        return _nothing_pruned(args, chosen, waiting, shown, what)
    if not args.yes and not args.json:
        print("\n".join(_prune_table(chosen)))
    if not subcommands_mod.ask_first("staged prune", what, args.yes):
        _note("nothing pruned")
        return 1
    note_kept()
    removed: list[pruning.Prunable] = []
    failed: list[tuple[pruning.Prunable, str]] = []
    for item in chosen:
        problem = pruning.prune(ws, item, older)
        if problem is None:
            removed.append(item)
        else:
            failed.append((item, problem))
            _note(f"staged commit {escape_name(item.commit_id)}: {problem}")
    if args.json:
        _prune_json(removed, [], waiting, failed)
    else:
        print(
            f"pruned {len(removed)} staged commit{'' if len(removed) == 1 else 's'} "
            f"({format_size(sum(p.bytes for p in removed))}) from workspace {ws.name} of "
            f"{ws.project}"
        )
    return 1 if failed else 0


def _nothing_pruned(
    args: argparse.Namespace,
    chosen: Sequence[pruning.Prunable],
    waiting: Sequence[pruning.Prunable],
    shown: str,
    what: str,
) -> int:
    """A dry run's answer (what would be removed), or that there is nothing to prune."""
    if args.json:
        _prune_json([], chosen if args.dry_run else [], waiting, [])
    elif not chosen:
        print(f"nothing to prune: no staged commit finished more than {shown} ago")
    else:
        print("\n".join(_prune_table(chosen)))
        print(f"would {what}")
    return 0


def _prune_table(chosen: Sequence[pruning.Prunable]) -> list[str]:
    rows = [["ID", "STATUS", "SINCE (UTC)", "SIZE", "SESSION"]]
    for item in chosen:
        rows.append(
            [
                escape_name(item.commit_id),
                item.status,
                iso(item.when).replace("T", " ").removesuffix("Z"),
                format_size(item.bytes),
                escape_name(item.session or "-"),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]) for r in rows
    ]


def _prune_json(
    removed: Sequence[pruning.Prunable],
    would: Sequence[pruning.Prunable],
    kept: Sequence[pruning.Prunable],
    failed: Sequence[tuple[pruning.Prunable, str]],
) -> None:
    doc = {
        "removed": [p.as_json() for p in removed],
        "would_remove": [p.as_json() for p in would],
        "kept_pending": [p.as_json() for p in kept],
        "failed": [{**p.as_json(), "error": why} for p, why in failed],
        "freed_bytes": sum(p.bytes for p in removed),
    }
    print(json.dumps(doc, sort_keys=True, indent=2))
