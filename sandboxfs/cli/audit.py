"""`sandboxfs audit show|verify|prune`: read, check and trim a project's audit log.

`sandboxfs audit` with no subcommand is `show`, as it was before there were subcommands; options
written before the subcommand (`audit --project P verify`) still work. Each subcommand accepts
only its own options: `audit verify --denied` is a usage error (one line, exit 2), not ignored.

A project that has no log yet (nothing was mounted there, or it is no project at all) gets the
same line on stderr from every subcommand, `no audit log at PATH (nothing has been mounted in
this project yet)`, with the exit code that fits what was asked:

- `show`: exit 0, nothing on stdout: there is nothing to show, which is no error.
- `verify`: exit 1: nothing was verified, and a script must not take that for "intact". (A log
  that is gone while its anchor says entries were written is reported as tampering, exit 1.)
- `prune`: exit 0: there is nothing to prune.
- `show --follow` instead says `no audit log yet at PATH; waiting for entries` and waits.

A --project that does not exist or is no directory is a usage error (exit 2), as for `mount`.

`-n N` (alias `--lines`, and `--limit` as before) means the last N matching entries. With
`--follow` it defaults to 0, like `tail -f`: only entries that arrive after the start are printed,
unless `-n N` asks for the last N first.

`prune` asks before it deletes anything (`drop N entries older than T from LOG? [y/N]`, exit 1
if the answer is not yes); when stdin is not a terminal it needs `--yes` instead (without it:
one line, exit 2, nothing deleted). When nothing would be deleted it neither asks nor needs
`--yes`.

Times in the table say their zone (`TIME (UTC)`, or with `--local` the TZ zone's abbreviation);
JSON keeps `ts` as it is stored, ISO 8601 UTC.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sandboxfs.audit import prune as prune_mod
from sandboxfs.audit import verify as verify_mod
from sandboxfs.audit.common import log_files
from sandboxfs.audit.reader import AuditQuery, follow, iter_query, json_line
from sandboxfs.cli import subcommands as subcommands_mod
from sandboxfs.cli.audit_table import Clock, format_row, format_table
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.policy import BUILTIN_ZONES, Trust
from sandboxfs.errors import Failure
from sandboxfs.layout import audit_path
from sandboxfs.project.zones import validate_project

P = TypeVar("P", bound=argparse.ArgumentParser)

OPS = tuple(op.value for op in AuditOp)  # --op: every op an entry may have
_AGE_HELP = "an ISO 8601 time (2026-11-22T08:00:00Z) or an age (30s, 10m, 2h, 7d)"


def add_parser(
    sub: argparse._SubParsersAction[P],
    *,
    trust_type: Callable[[str], Any],
    when_type: Callable[[str], datetime],
    positive_type: Callable[[str], int],
) -> None:
    """Add `audit` and its subcommands to the top-level subparsers `sub`.

    The parsers are of the class `sub` makes (the caller's, with its one-line usage errors);
    the argument types are the caller's too, so that every subcommand parses times, trust
    levels and counts like the rest of the command line.
    """
    audit = sub.add_parser(
        "audit",
        help="show, verify or prune the audit log",
        description="Show, verify or prune the project's audit log (.sandbox/audit.jsonl). "
        "Without a subcommand: show.",
    )
    subcommands = audit.add_subparsers(
        dest="audit_action",
        metavar="{show,verify,prune}",
        help="what to do (default: show); SUBCOMMAND --help for its options",
        parser_class=type(audit),
    )
    show = subcommands.add_parser(
        "show",
        help="print matching entries as a table or JSON lines (the default)",
        description="Print the entries that match every filter given, oldest first, as a table "
        "(times in UTC unless --local) or JSON lines. Without a log: a note on stderr, exit 0.",
    )
    verify = subcommands.add_parser(
        "verify",
        help="check the hash chain, its keys and its anchor",
        description="Check every hash, link and mac of the log, and that it ends where its "
        "anchor says. Exit 0 if intact, 1 at the first problem or if there is no log.",
    )
    prune = subcommands.add_parser(
        "prune",
        help="drop old entries, keeping the chain verifiable",
        description="Drop the entries older than --before T from the start of the log; the rest "
        "stays verifiable. Asks first, or needs --yes when stdin is not a terminal.",
    )
    for parser in (show, verify, prune):
        subcommands_mod.project_option(parser)
    _show_options(show, trust_type, when_type, positive_type)
    prune.add_argument(
        "--before",
        type=when_type,
        required=True,
        metavar="T",
        help=f"drop entries older than T: {_AGE_HELP}",
    )
    prune.add_argument(
        "-y", "--yes", action="store_true", help="do not ask (needed when stdin is no terminal)"
    )
    subcommands_mod.with_default(audit, {"show": show, "verify": verify, "prune": prune}, "show")


def _show_options(
    show: argparse.ArgumentParser,
    trust_type: Callable[[str], Any],
    when_type: Callable[[str], datetime],
    positive_type: Callable[[str], int],
) -> list[argparse.Action]:
    """Add show's filters and output options; returns them."""
    add = show.add_argument
    allowed = show.add_mutually_exclusive_group()
    return [
        add("--session", metavar="ID", help="only entries of this session"),
        add("--workspace", metavar="ID", help="only entries of this workspace"),
        add("--op", choices=OPS, metavar="OP", help="only this operation: %(choices)s"),
        add(
            "--zone",
            metavar="ZONE",
            help="only this zone: "
            + ", ".join(z.value for z in BUILTIN_ZONES)
            + ", or one the project declares",
        ),
        add(
            "--trust",
            type=trust_type,
            metavar="LEVEL",
            help="only entries at this trust level: " + ", ".join(t.value for t in Trust),
        ),
        allowed.add_argument("--denied", action="store_true", help="only refusals"),
        allowed.add_argument("--allowed", action="store_true", help="only allowed operations"),
        add(
            "--since", type=when_type, metavar="T", help=f"only entries at or after T: {_AGE_HELP}"
        ),
        add("--until", type=when_type, metavar="T", help="only entries before T (as --since)"),
        add("--pid", type=int, help="only entries of this process id"),
        add("--worker", metavar="NAME", help="only entries of sandboxes narrowed to this worker"),
        add(
            "-n",
            "--lines",
            "--limit",
            dest="lines",
            type=positive_type,
            metavar="N",
            help="only the last N matching entries; with --follow, print the last N before the "
            "new ones (default: none, only new ones)",
        ),
        add(
            "--json",
            action="store_true",
            help="one JSON object a line, as in the log (ts in UTC, as stored), not a table",
        ),
        add(
            "--follow",  # no -f: that is mount's --foreground, and means nothing else anywhere
            action="store_true",
            help="print entries as they arrive, like tail -f, until interrupted (Ctrl-C)",
        ),
        add("--local", action="store_true", help="table times in the TZ time zone, not in UTC"),
    ]


def main(args: argparse.Namespace) -> int:
    """Run the subcommand that the parser made by `add_parser` parsed; returns the exit code."""
    path = audit_path(validate_project(args.project))
    run = {"show": _show, "verify": _verify, "prune": _prune}[args.audit_action]
    return run(args, path)


def _no_log(path: Path) -> str:
    return f"no audit log at {path} (nothing has been mounted in this project yet)"


def _note(message: str) -> None:
    print(f"sandboxfs: {message}", file=sys.stderr)


def _show(args: argparse.Namespace, path: Path) -> int:
    q = AuditQuery(
        session=args.session,
        workspace=args.workspace,
        op=args.op,
        zone=args.zone,
        trust=args.trust.value if args.trust else None,
        allowed=False if args.denied else True if args.allowed else None,
        since=args.since,
        until=args.until,
        pid=args.pid,
        worker=args.worker,
        limit=None if args.follow else args.lines,
    )
    clock = Clock(local=args.local)
    if args.follow:
        if not log_files(path):
            _note(f"no audit log yet at {path}; waiting for entries")
        if not args.json:
            print(format_table([], clock), flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # the way to stop following: no failure
            render = json_line if args.json else functools.partial(format_row, clock=clock)
            follow(path, q, sys.stdout, render=render, last=args.lines or 0)
        return 0
    if not log_files(path):
        _note(_no_log(path))
        return 0
    # Streamed: one entry at a time, so memory stays flat whatever the log's size.
    shown = 0
    for entry in iter_query(path, q):
        if args.json:
            line = json.dumps(entry, sort_keys=True)
        else:
            if not shown:
                print(format_table([], clock))
            line = format_row(entry, clock)
        print(line)
        shown += 1
    if not shown and not args.json:
        print("no matching audit entries")
    return 0


def _verify(args: argparse.Namespace, path: Path) -> int:
    result = verify_mod.verify(path)
    # No log and no anchor that says otherwise: nothing was ever written, so nothing to verify.
    if not result.ok and not result.keyed and not log_files(path):
        raise Failure(_no_log(path))
    print(result.message)
    return 0 if result.ok else 1


def _prune(args: argparse.Namespace, path: Path) -> int:
    if not log_files(path):
        _note(_no_log(path))
        return 0
    before = args.before.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    count = prune_mod.prune(path, args.before, dry_run=True)
    if count == 0:
        print(f"nothing to prune: no entries older than {before} at the start of {path}")
        return 0
    what = f"drop {count} entries older than {before} from {path}"
    if not subcommands_mod.ask_first("audit prune", what, args.yes):
        _note("nothing pruned")
        return 1
    dropped = prune_mod.prune(path, args.before)
    print(f"pruned {dropped} entries older than {before} from {path}")
    return 0
