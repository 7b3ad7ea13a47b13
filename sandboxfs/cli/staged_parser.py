"""The `sandboxfs staged` command line: its parser, without what reviews and lands.

`sandboxfs.cli.staged` (and sandboxfs.staging with it) is imported only when `staged` runs:
the parser of every command is built at each start, and these imports would otherwise be
start-up time of `run` and the others.
"""

from __future__ import annotations

import argparse
from typing import TypeVar

from sandboxfs.cli import subcommands as subcommands_mod

P = TypeVar("P", bound=argparse.ArgumentParser)

SUBCOMMANDS = ("list", "show", "diff", "commit", "discard", "prune")
COLORS = ("auto", "always", "never")


def add_parser(sub: argparse._SubParsersAction[P]) -> None:
    """Add `staged` and its subcommands to the top-level subparsers `sub` (parsers of the
    class `sub` makes, with its one-line usage errors)."""
    staged = sub.add_parser(
        "staged",
        help="review the agent's staged commits and commit them into git",
        description="Review the commits an agent proposed in /staged and land them in git as "
        "one commit each, or discard them. show, diff and commit freeze a staged commit: from "
        "then on what is reviewed is what lands.",
    )
    subcommands = staged.add_subparsers(
        dest="staged_action",
        metavar="{" + ",".join(SUBCOMMANDS) + "}",
        required=True,
        help="what to do; SUBCOMMAND --help for its options",
        parser_class=type(staged),
    )
    parsers = {
        "list": subcommands.add_parser(
            "list",
            help="one row per staged commit: files, status, whether it applies",
            description="List the staged commits of the workspace (committed and discarded "
            "ones too): id, session, creation time (UTC), files (+created ~updated -deleted), "
            "status, whether a commit would succeed now (yes, no, conflict), subject.",
        ),
        "show": subcommands.add_parser(
            "show",
            help="what a staged commit changes, file by file, and its digest",
            description="Freeze the staged commit and list what it changes, file by file "
            "(paths that run code on your machine first, marked !), why it would be refused, "
            "and its digest.",
        ),
        "diff": subcommands.add_parser(
            "diff",
            help="a unified diff of a staged commit against the repository",
            description="Freeze the staged commit and print what it would commit as a unified "
            "diff against HEAD (binary files named, not shown).",
        ),
        "commit": subcommands.add_parser(
            "commit",
            help="land a staged commit as one git commit",
            description="Land the frozen staged commit as ONE git commit on the current branch "
            "(working tree and index follow) or on a new branch (nothing checked out changes). "
            "All or nothing: if any path cannot land, nothing changes (exit 1, one line per "
            "reason). Git runs no hook, filter or fsmonitor of the repository.",
        ),
        "discard": subcommands.add_parser(
            "discard",
            help="drop a staged commit (its review record is kept)",
            description="Mark the staged commit discarded and remove it from /staged; the "
            "snapshot and state in the review directory are kept for the record.",
        ),
        "prune": subcommands.add_parser(
            "prune",
            help="remove what committed and discarded staged commits leave, after a while",
            description="Remove the files in /staged and the review (state, snapshot) of the "
            "staged commits committed or discarded more than DURATION ago; with --pending also "
            "of the pending ones unchanged for that long (never otherwise). Each is audited as "
            "op stage. Lists them and asks first, or needs --yes when stdin is not a terminal.",
        ),
    }
    for name, parser in parsers.items():
        if name not in ("list", "prune"):
            parser.add_argument("commit_id", metavar="ID", help="the staged commit's id")
        subcommands_mod.project_option(parser)
        parser.add_argument(
            "--workspace",
            default="default",
            metavar="ID",
            help="workspace whose /staged to use (default: default)",
        )
        parser.add_argument(
            "--json",
            action="store_true",
            help="one JSON array, not a table" if name == "list" else "one JSON object, not text",
        )
    for name in ("show", "diff"):
        parsers[name].add_argument(
            "--color",
            choices=COLORS,
            default="auto",
            help="color the output: %(choices)s (default: auto, when stdout is a terminal)",
        )
    commit = parsers["commit"]
    commit.add_argument(
        "-m", "--message", metavar="MSG", help="the commit message instead of message.txt's"
    )
    commit.add_argument(
        "--branch",
        metavar="NAME",
        help="commit on a new branch NAME made from HEAD, leaving HEAD, the index and the "
        "working tree alone (refused if NAME exists)",
    )
    commit.add_argument(
        "--expect",
        metavar="DIGEST",
        help="refuse unless the staged commit's digest (from show or diff) is DIGEST",
    )
    prune = parsers["prune"]
    prune.add_argument(
        "--older-than",
        type=subcommands_mod.duration,
        required=True,
        metavar="DURATION",
        help="committed or discarded (with --pending: last changed) more than DURATION ago: "
        + subcommands_mod.DURATION_HELP,
    )
    prune.add_argument(
        "--pending",
        action="store_true",
        help="also the pending ones (never reviewed, or reviewed and not committed)",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="only list what would be removed; remove nothing"
    )
    prune.add_argument(
        "-y", "--yes", action="store_true", help="do not ask (needed when stdin is no terminal)"
    )
