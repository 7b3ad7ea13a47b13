"""`sandboxfs home [show]|seed|reset`: the home that `sandboxfs run` gives the program
(the model is sandboxfs.run.home).

What that home is, and why one per workspace and level: sandboxfs.run.home.

`seed` copies (never binds) the user's own agent config into it once: `--agent NAME` copies
what the profile names (`~/.claude/.credentials.json`, `~/.claude.json`, ...: those that
exist), `--from PATH` (repeatable) a file or directory of the real home, to the same place
below the sandbox's home. Links are followed; secrets (`~/.ssh`, keys, `.env` files...) are
refused, and left out of a copied directory. A file already there is kept unless `--force`
(the agent may have refreshed its login since). `--trust LEVEL` (repeatable) names the
levels whose homes get the copies; by default every level's but untrusted's, the level for a
program nobody vouches for, which gets the user's logins only when named (with a warning).
`reset` empties them (asks first, or `--yes`); a home that a `run` is using
is left alone. `show` lists them. `seed` and `reset` are audited (op `home`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TypeVar

from sandboxfs.audit.writer import record_now
from sandboxfs.cli import subcommands
from sandboxfs.config import user as userconfig
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.policy import Trust
from sandboxfs.errors import UserError
from sandboxfs.layout import audit_path, home_dir, state_dir, state_root
from sandboxfs.project import state
from sandboxfs.project.zones import CONFINED_HOME, check_id, ensure_home
from sandboxfs.project.zones import validate_project as _validate_project
from sandboxfs.run import toolchain
from sandboxfs.run.home import plan_seed, seed

P = TypeVar("P", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[P]) -> None:
    home = sub.add_parser(
        "home",
        help="show, seed or reset the persistent home that `run` gives the program",
        description=f"Under `sandboxfs run` $HOME is {CONFINED_HOME}: kept across sessions, one "
        "per workspace and trust level, in the project's state dir. Without a subcommand: show.",
    )
    actions = home.add_subparsers(
        dest="home_action",
        metavar="{show,seed,reset}",
        help="what to do (default: show); SUBCOMMAND --help for its options",
        parser_class=type(home),
    )
    show = actions.add_parser(
        "show",
        help="where each trust level's home is, its size, and whether a run uses it",
        description="One row per trust level: the home's directory, size, and whether a run "
        "uses it now.",
    )
    seeding = actions.add_parser(
        "seed",
        help="copy your agent's config and login into the sandbox's home, once",
        description="Copy files of your home (never bind them) to the same place in the "
        "sandbox's home: what an agent profile names (--agent), or any file or directory "
        "(--from). Secrets (~/.ssh, keys, .env files...) are refused. Files already there are "
        "kept unless --force.",
    )
    reset = actions.add_parser(
        "reset",
        help="empty the sandbox's home (every level, or --trust LEVEL)",
        description="Remove everything in the sandbox's home of the workspace: every trust "
        "level's, or one with --trust. A home a run uses now is left alone. Asks first, or "
        "needs --yes without a terminal.",
    )
    for parser in (show, seeding, reset):
        parser.add_argument(
            "--project", type=Path, default=Path("."), metavar="DIR", help="default: ."
        )
        parser.add_argument("--workspace", default="default", metavar="ID", help="default: default")
    seeding.add_argument(
        "--trust",
        type=subcommands.trust_level,
        action="append",
        metavar="LEVEL",
        help="the home of this trust level (repeatable; default: every level's but "
        "untrusted's, which gets copies only when named)",
    )
    reset.add_argument(
        "--trust",
        type=subcommands.trust_level,
        metavar="LEVEL",
        help="only the home of this trust level (default: every level's)",
    )
    show.add_argument("--json", action="store_true", help="a JSON list, not a table")
    seeding.add_argument(
        "--from",
        dest="sources",
        action="append",
        default=[],
        metavar="PATH",
        help="a file or directory of your home to copy (repeatable)",
    )
    seeding.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME",
        help="copy what this agent profile names: "
        + ", ".join(userconfig.BUILTIN_AGENTS)
        + " or your own (repeatable)",
    )
    seeding.add_argument("--force", action="store_true", help="replace files already there")
    reset.add_argument("--yes", action="store_true", help="do not ask")
    subcommands.with_default(home, {"show": show, "seed": seeding, "reset": reset}, "show")


def main(args: argparse.Namespace) -> int:
    project = _validate_project(args.project)
    workspace = check_id("workspace", args.workspace)
    action = args.home_action or "show"
    if action == "show":
        return _show(project, workspace, args.json)
    if action == "seed":
        named = args.trust or [level for level in Trust if level is not Trust.UNTRUSTED]
        return _seed(project, workspace, [lv for lv in Trust if lv in named], args)
    levels = [args.trust] if args.trust is not None else list(Trust)
    return _reset(project, workspace, levels, args.yes)


def _show(project: Path, workspace: str, as_json: bool) -> int:
    rows: list[dict[str, Any]] = []
    for level in Trust:
        path = home_dir(project, workspace, level)
        exists = path.is_dir() and not path.is_symlink()
        rows.append(
            {
                "trust": level.value,
                "path": str(path),
                "exists": exists,
                "bytes": state.usage(path).bytes if exists else 0,
                "in_use": exists and state.locked_by_someone(path),
            }
        )
    if as_json:
        print(json.dumps(rows))
        return 0
    print(f"{'TRUST':<10} {'SIZE':>9}  {'IN USE':<6}  PATH")
    for row in rows:
        size = state.format_size(row["bytes"]) if row["exists"] else "-"
        use = "yes" if row["in_use"] else "no"
        print(f"{row['trust']:<10} {size:>9}  {use:<6}  {row['path']}")
    print(f"(inside `sandboxfs run` each is {CONFINED_HOME}, the program's $HOME)")
    return 0


def _seed(project: Path, workspace: str, levels: list[Trust], args: argparse.Namespace) -> int:
    sources: list[tuple[str, bool]] = [(s, True) for s in args.sources]
    user = userconfig.load()
    for name in args.agent:
        profile = userconfig.agent(name, user)
        sources += [(f"~/{rel}", False) for rel in profile.seed]
    if not sources:
        raise UserError(
            "home seed needs what to copy: --agent NAME (profiles: "
            + ", ".join(userconfig.profiles(user))
            + ") or --from PATH"
        )
    limits = toolchain.Limits.of(project, [state_dir(project), state_root()])
    entries = plan_seed(sources, limits)
    files = sum(1 for e in entries if not e.is_dir)
    if not files:
        named = ", ".join(written for written, _ in sources)
        print(f"sandboxfs: nothing to copy: no file at or below {named}", file=sys.stderr)
        return 1
    _record(
        project,
        workspace,
        f"seed {files} files into {_levels(levels)}: "
        + ", ".join(sorted({e.rel.split("/")[0] for e in entries})),
    )
    what = ", ".join(sorted({"~/" + e.rel.split("/")[0] for e in entries}))
    if Trust.UNTRUSTED in levels:
        print(
            f"sandboxfs: warning: the untrusted home now holds copies of {what}: every program "
            f"run at trust untrusted can read them",
            file=sys.stderr,
        )
    kept = copied = 0
    for level in levels:
        result = seed(ensure_home(project, workspace, level), entries, args.force)
        copied, kept = max(copied, result.copied), max(kept, result.kept)
    print(
        f"sandboxfs: copied {copied} file{'s' * (copied != 1)} ({what}) into the home of "
        f"workspace {workspace} at {_levels(levels)}"
        + (f"; kept {kept} already there (--force replaces them)" if kept else "")
        + ("; untrusted not seeded (name it with --trust untrusted)" if args.trust is None else "")
    )
    return 0


def _levels(levels: list[Trust]) -> str:
    if len(levels) == len(Trust):
        return "every trust level"
    return "trust " + ", ".join(level.value for level in levels)


def _reset(project: Path, workspace: str, levels: list[Trust], yes: bool) -> int:
    homes = [(lv, home_dir(project, workspace, lv)) for lv in levels]
    present = [(lv, p) for lv, p in homes if p.is_dir() and not p.is_symlink()]
    if not present:
        print(f"sandboxfs: no home to reset in workspace {workspace}")
        return 0
    what = f"empty the sandbox's home of workspace {workspace} at {_levels(levels)}"
    if not subcommands.ask_first("home reset", what, yes):
        return 1
    failed = 0
    for level, path in present:
        if state.locked_by_someone(path):
            print(
                f"sandboxfs: the {level.value} home is in use by a run; left as it is",
                file=sys.stderr,
            )
            failed += 1
            continue
        _record(project, workspace, f"reset the {level.value} home")
        problem = state.remove_tree(state.move_to_trash(project, path))
        if problem is not None:
            print(f"sandboxfs: {problem}", file=sys.stderr)
            failed += 1
    print(
        f"sandboxfs: reset {len(present) - failed} of {len(present)} homes of workspace {workspace}"
    )
    return 1 if failed else 0


def _record(project: Path, workspace: str, detail: str) -> None:
    """The audit entry (op `home`) of a seed or reset, written first."""
    record_now(
        audit_path(project),
        AuditOp.HOME,
        zone="home",
        workspace=workspace,
        detail=detail,
        nothing_done="; nothing changed",
    )
