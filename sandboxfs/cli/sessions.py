"""`sandboxfs sessions [list]|prune`: what the project's sessions take, and removing the ones
left unused (the model is sandboxfs.project.state).

`sessions` with no subcommand is `list`. `list` prints one row per session (workspace, id, size
on disk, age, last use, in use and where), newest use first, and a line with the totals and the
state dir's size; `--json` prints one JSON array of them.

`prune --older-than DURATION` removes the sessions last used more than DURATION ago (30m, 12h,
7d) that no mount, run or API sandbox has: their directory (the /session zone), their daemon
log and their quota tally; each is audited (op `prune`) first. A session in use is never
removed, however old (it is named on stderr). It lists what it would remove and asks first, as
`audit prune` does: on a terminal it asks, else it needs `--yes` (without it: one line, exit 2,
nothing removed); `--dry-run` only lists. Exit 0 when done, 1 if not confirmed or a session
could not be removed entirely.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TypeVar

from sandboxfs.cli import subcommands
from sandboxfs.layout import state_dir
from sandboxfs.project import state
from sandboxfs.project.mounts import live_contexts
from sandboxfs.project.zones import check_id, validate_project

P = TypeVar("P", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[P]) -> None:
    """Add `sessions` and its subcommands to the top-level subparsers `sub` (parsers of the
    class `sub` makes, with its one-line usage errors)."""
    sessions = sub.add_parser(
        "sessions",
        help="list the project's sessions with their size and last use, or prune old ones",
        description="List the sessions kept in the project's state dir (.sandbox/), or remove "
        "the ones unused for long. Without a subcommand: list.",
    )
    actions = sessions.add_subparsers(
        dest="sessions_action",
        metavar="{list,prune}",
        help="what to do (default: list); SUBCOMMAND --help for its options",
        parser_class=type(sessions),
    )
    listing = actions.add_parser(
        "list",
        help="one row per session: size on disk, age, last use, in use (the default)",
        description="One row per session, last used first: workspace, id, size on disk (its "
        "directory and daemon log), age, last use (the latest change in it), and whether a "
        "mount, run or API sandbox has it now; then the totals and the state dir's size.",
    )
    prune = actions.add_parser(
        "prune",
        help="remove the sessions unused for longer than a duration, never one in use",
        description="Remove the sessions last used more than DURATION ago that no mount, run "
        "or API sandbox has: their directory, daemon log and quota tally (audited as op prune). "
        "Lists them and asks first, or needs --yes when stdin is not a terminal.",
    )
    for parser in (listing, prune):
        subcommands.project_option(parser)
        parser.add_argument(
            "--workspace", metavar="ID", help="only the sessions of this workspace (default: all)"
        )
    listing.add_argument("--json", action="store_true", help="one JSON array, not a table")
    prune.add_argument(
        "--older-than",
        type=subcommands.duration,
        required=True,
        metavar="DURATION",
        help=f"remove the sessions last used more than DURATION ago: {subcommands.DURATION_HELP}",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="only list what would be removed; remove nothing"
    )
    prune.add_argument(
        "-y", "--yes", action="store_true", help="do not ask (needed when stdin is no terminal)"
    )
    prune.add_argument(
        "--json", action="store_true", help="one JSON object: what was removed, what was kept"
    )
    subcommands.with_default(sessions, {"list": listing, "prune": prune}, "list")


def main(args: argparse.Namespace) -> int:
    """Run the subcommand that the parser made by `add_parser` parsed; returns the exit code."""
    project = validate_project(args.project)
    if args.workspace is not None:
        check_id("workspace", args.workspace)
    if args.sessions_action == "prune":
        return _prune(args, project)
    return _list(args, project)


def _note(message: str) -> None:
    print(f"sandboxfs: {message}", file=sys.stderr)


def _in_use(session: state.Session) -> str:
    if session.mounts:
        return "yes: " + ", ".join(session.mounts)
    return "yes" if session.in_use else "no"


def _table(found: list[state.Session], now: float) -> list[str]:
    rows = [["WORKSPACE", "SESSION", "SIZE", "AGE", "LAST USE", "IN USE"]]
    for s in found:
        rows.append(
            [
                s.workspace,
                s.id,
                state.format_size(s.bytes),
                state.format_duration(now - s.created) if s.created else "-",
                state.format_duration(now - s.last_used) + " ago",
                _in_use(s),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    padded = [[*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]] for r in rows]
    return ["  ".join(cells) for cells in padded]


def _list(args: argparse.Namespace, project: Path) -> int:
    now = time.time()
    found = state.sessions(project, live_contexts(), args.workspace)
    if args.json:  # a list: one JSON array (see "JSON output" in docs/commands.md)
        print(json.dumps([s.as_json(now) for s in found], indent=2))
        return 0
    where = f" of workspace {args.workspace}" if args.workspace else ""
    if found:
        print("\n".join(_table(found, now)))
    else:
        print(f"no sessions{where} in {project}")
    total = sum(s.bytes for s in found)
    used = sum(1 for s in found if s.in_use)
    log = state.audit_bytes(project)
    print(
        f"{len(found)} session{'' if len(found) == 1 else 's'}{where}, {used} in use, "
        f"{state.format_size(total)}; the state dir {state_dir(project)} takes "
        f"{state.format_size(state.state_dir_bytes(project))}, of which the audit log "
        f"{state.format_size(log)} (with the space it keeps for a full disk)"
    )
    return 0


def _prune(args: argparse.Namespace, project: Path) -> int:
    state.finish_interrupted(project)
    live = live_contexts()
    now = time.time()
    older = state.format_duration(args.older_than.total_seconds())
    found = state.sessions(project, live, args.workspace)
    stale, busy = state.stale_sessions(found, args.older_than, now)

    def note_busy() -> None:
        for session in busy:
            _note(f"kept session {session.id} of workspace {session.workspace}: in use")

    size = state.format_size(sum(s.bytes for s in stale))
    what = (
        f"remove {len(stale)} session{'' if len(stale) == 1 else 's'} ({size}) unused for "
        f"more than {older} from {project}"
    )
    if not stale or args.dry_run:
        note_busy()
        return _nothing_pruned(args, project, stale, busy, older, what, now)
    if not args.yes and not args.json:
        print("\n".join(_table(stale, now)))
    if not subcommands.ask_first("sessions prune", what, args.yes):
        _note("nothing pruned")
        return 1
    note_busy()
    result = state.prune_sessions(project, stale, args.older_than, live)
    for session, why in result.kept:
        _note(f"kept session {session.id} of workspace {session.workspace}: {why}")
    for session, why in result.failed:
        _note(f"session {session.id} of workspace {session.workspace} not removed entirely: {why}")
    if args.json:
        _print_json(result.removed, [], busy + [s for s, _ in result.kept], result.failed, now)
    else:
        freed = state.format_size(sum(s.bytes for s in result.removed))
        count = len(result.removed)
        print(
            f"pruned {count} session{'' if count == 1 else 's'} ({freed}) unused for more "
            f"than {older} from {project}"
        )
    return 1 if result.failed else 0


def _nothing_pruned(
    args: argparse.Namespace,
    project: Path,
    stale: list[state.Session],
    busy: list[state.Session],
    older: str,
    what: str,
    now: float,
) -> int:
    """A dry run's answer (what would be removed), or that there is nothing to prune."""
    if args.json:
        _print_json([], stale if args.dry_run else [], busy, [], now)
    elif not stale:
        print(f"nothing to prune: no session unused for more than {older} in {project}")
    else:
        print("\n".join(_table(stale, now)))
        print(f"would {what}")
    return 0


def _print_json(
    removed: list[state.Session],
    would: list[state.Session],
    kept: list[state.Session],
    failed: list[tuple[state.Session, str]],
    now: float,
) -> None:
    doc = {
        "removed": [s.as_json(now) for s in removed],
        "would_remove": [s.as_json(now) for s in would],
        "kept_in_use": [s.as_json(now) for s in kept],
        "failed": [{**s.as_json(now), "error": why} for s, why in failed],
        "freed_bytes": sum(s.bytes for s in removed),
    }
    print(json.dumps(doc, indent=2))
