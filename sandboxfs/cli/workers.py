"""`sandboxfs workers [list]|show NAME`: the workers a project's workers layers declare, and what
each would get under a parent at a trust level (sandboxfs.project.workers).

`list` prints one row per worker (the first layer holding a name wins): its effective zones at
`--trust`, or why it would be refused; a file that does not parse is shown with its one-line
error and makes the exit code 1. `show NAME` prints one worker whole: its file, description,
each declared zone with its mode, what it gets and its approval rules, and its instructions.
`--json`: an array for `list`, an object for `show` (see "JSON output" in docs/commands.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TypeVar

from sandboxfs.cli import subcommands
from sandboxfs.config import model as config_mod
from sandboxfs.config.model import Config
from sandboxfs.core.policy import Trust
from sandboxfs.errors import UserError
from sandboxfs.project import workers
from sandboxfs.project.zones import validate_project

P = TypeVar("P", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[P]) -> None:
    """Add `workers` and its subcommands to the top-level subparsers `sub`."""
    parser = sub.add_parser(
        "workers",
        help="list the project's workers and what each gets at a trust level",
        description="List the workers declared by <name>.worker files in <project>/.workers and "
        "the directories of SANDBOXFS_WORKERS_PATH (the first holding a name wins), with the "
        "zones each would get under a parent at --trust. Without a subcommand: list.",
    )
    actions = parser.add_subparsers(
        dest="workers_action",
        metavar="{list,show}",
        help="what to do (default: list); SUBCOMMAND --help for its options",
        parser_class=type(parser),
    )
    listing = actions.add_parser(
        "list",
        help="one row per worker: its effective zones at --trust (the default)",
        description="One row per worker: its effective zones and modes at --trust, or why a "
        "parent at that level could not start it.",
    )
    show = actions.add_parser(
        "show",
        help="one worker: its declaration, effective access and instructions",
        description="One worker: its file, description, each declared zone with its mode, "
        "what it gets at --trust and its approval rules, then its instructions.",
    )
    show.add_argument("name", metavar="NAME", help="the worker's name (its file is NAME.worker)")
    for action in (listing, show):
        action.add_argument(
            "--project", type=Path, default=Path("."), metavar="DIR", help="project directory"
        )
        action.add_argument(
            "--config", type=Path, help="config file (default: <project>/sandboxfs.yaml)"
        )
        action.add_argument(
            "--trust",
            type=subcommands.trust_level,
            help="the parent's trust level (default: config, else session)",
        )
        action.add_argument("--json", action="store_true", help="JSON instead of text")
    subcommands.with_default(parser, {"list": listing, "show": show}, "list")


def main(args: argparse.Namespace) -> int:
    project = validate_project(args.project)
    cfg = config_mod.load(project, args.config)
    trust: Trust = args.trust or cfg.default_trust
    if args.workers_action == "show":
        found = _as_json(workers.find(project, args.name, cfg), cfg, trust)
        print(json.dumps(found, indent=2) if args.json else "\n".join(_show(found)))
        return 0
    rows: list[dict[str, Any]] = []
    failed = False
    for name in workers.names(project):
        try:
            rows.append(_as_json(workers.find(project, name, cfg), cfg, trust))
        except UserError as exc:
            failed = True
            rows.append({"name": name, "trust": trust.value, "invalid": exc.message})
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print("\n".join(_table(rows)))
    else:
        print(f"no workers in {project / '.workers'} or SANDBOXFS_WORKERS_PATH")
    return 1 if failed else 0


def _as_json(worker: workers.Worker, cfg: Config, trust: Trust) -> dict[str, Any]:
    got = workers.effective(cfg, trust, worker)
    return {
        "name": worker.name,
        "source": worker.source,
        "description": worker.description,
        "trust": trust.value,
        "declared": dict(worker.zones) if worker.zones is not None else None,
        "allowed": got["allowed"],
        "error": got["error"],
        "zones": got["zones"],
        "approval": {
            zone: rules.model_dump(exclude_none=True) for zone, rules in worker.approval.items()
        },
        "body": worker.body,
    }


def _access(row: dict[str, Any]) -> str:
    if "invalid" in row:
        return f"invalid: {row['invalid']}"
    if not row["allowed"]:
        return f"refused: {row['error']}"
    return workers.describe_zones(row["zones"])


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cells = [["WORKER", "TRUST", "ACCESS", "DESCRIPTION"]]
    cells += [[r["name"], r["trust"], _access(r), r.get("description", "")] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return ["  ".join([*(c[i].ljust(widths[i]) for i in range(3)), c[3]]).rstrip() for c in cells]


def _show(row: dict[str, Any]) -> list[str]:
    lines = [
        f"worker:      {row['name']}",
        f"file:        {row['source']}",
        f"description: {row['description']}",
        f"trust:       {row['trust']} (the parent's)",
    ]
    if row["declared"] is None:
        lines.append("zones:       none declared (no sandbox: key): no file access at all")
    elif not row["allowed"]:
        lines.append(f"refused:     {row['error']}")
    else:
        lines.append("zones:" if row["zones"] else "zones:       none")
        for zone, got in row["zones"].items():
            rules = row["approval"].get(zone, {})
            approval = ", ".join(f"{op} {rule}" for op, rule in rules.items())
            access = " ".join(got["access"]) or "—"
            lines.append(
                f"  /{zone}: {got['mode']} ({access})"
                + (f"; approval: {approval}" if approval else "")
            )
    body = row["body"].strip("\n")
    if body:
        lines += ["", body]
    return lines
