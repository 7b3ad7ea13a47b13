"""`sandboxfs home [show]|seed|reset`: the home that `sandboxfs run` gives the program.

Under `run`, `$HOME` is `/sandbox/home`, a zone of the mount (so every access to it is
audited, like any other) backed by `<project>/.sandbox/workspaces/<ws>/homes/<level>/`: one
directory per workspace and trust level, kept across sessions. An agent's settings, caches
and login made in one session are there in the next one of the same workspace and level;
another workspace never sees them, and neither does another level (what a program writes
there at `session`, a shell rc or an agent's hook, is never run by a program at `full`). It
is never the user's real home.

`seed` copies (never binds) the user's own agent config into it once: `--agent NAME` copies
what the profile names (`~/.claude/.credentials.json`, `~/.claude.json`, ...: those that
exist), `--from PATH` (repeatable) a file or directory of the real home, to the same place
below the sandbox's home. Links are followed; secrets (`~/.ssh`, keys, `.env` files...) are
refused, and left out of a copied directory. A file already there is kept unless `--force`
(the agent may have refreshed its login since). Every level's home by default, `--trust
LEVEL` for one. `reset` empties them (asks first, or `--yes`); a home that a `run` is using
is left alone. `show` lists them. `seed` and `reset` are audited (op `home`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import state, subcommands, toolchain, userconfig
from .audit import record_now
from .audit_anchor import state_root
from .core.policy import Trust
from .errors import UserError
from .project import CONFINED_HOME, audit_path, check_id, ensure_home, home_dir, state_dir
from .project import validate_project as _validate_project

P = TypeVar("P", bound=argparse.ArgumentParser)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_ENTRIES = 10_000
MAX_BYTES = 100 * 1024 * 1024


# ----- in use -----------------------------------------------------------------------------------


def hold(project: Path, workspace: str, trust: Trust) -> int | None:
    """Mark the home `run` uses in use for as long as the descriptor stays open (a shared
    flock: `reset` leaves it alone meanwhile). None where it cannot be marked."""
    try:
        fd = os.open(ensure_home(project, workspace, trust), _DIR_FLAGS)
    except (OSError, UserError):
        return None
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


# ----- seed ---------------------------------------------------------------------------------------


@dataclass
class _Entry:
    rel: str  # below the home
    source: str  # the real file or directory
    mode: int
    is_dir: bool
    size: int = 0


@dataclass
class SeedResult:
    copied: int = 0
    kept: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # what a copied directory held, left out


def plan_seed(sources: list[tuple[str, bool]], limits: toolchain.Limits) -> list[_Entry]:
    """What seeding copies: [(path, required)] -> entries, checked. A path must be in the real
    home and no secret; a missing one is an error when `required` (--from), else skipped."""
    home = limits.home
    entries: list[_Entry] = []
    seen: set[tuple[int, int]] = set()
    total = 0
    for written, required in sources:
        path = os.path.abspath(os.path.expanduser(written))
        rel = os.path.relpath(path, home) if os.path.isabs(home) else path
        shown = "~/" + rel if not rel.startswith("..") else written
        if rel == "." or rel.startswith(".."):
            raise UserError(
                f"--from {written}: not in your home ({home}); seed copies from your home to "
                f"the same place in the sandbox's"
            )
        for place in (path, os.path.realpath(path)):
            why = limits.refusal(place, credentials=False)
            if why is not None:
                raise UserError(f"--from {written}: refused: {why}")
        if not os.path.exists(path):
            if required:
                raise UserError(f"--from {written}: no such file or directory")
            continue
        for entry in _walk(path, rel, limits, seen):
            entries.append(entry)
            total += entry.size
            if len(entries) > MAX_ENTRIES or total > MAX_BYTES:
                raise UserError(
                    f"{shown} is too large to seed (over {MAX_ENTRIES} entries or "
                    f"{MAX_BYTES // 2**20} MiB); name the files the agent needs with --from"
                )
    return entries


def _walk(
    path: str, rel: str, limits: toolchain.Limits, seen: set[tuple[int, int]]
) -> list[_Entry]:
    try:
        st = os.stat(path)
    except OSError:
        return []
    if (st.st_dev, st.st_ino) in seen:
        return []  # a loop of links, or twice the same
    seen.add((st.st_dev, st.st_ino))
    if limits.refusal(os.path.realpath(path), credentials=False) is not None:
        return []
    if stat.S_ISREG(st.st_mode):
        return [_Entry(rel, path, stat.S_IMODE(st.st_mode) & 0o777, False, st.st_size)]
    if not stat.S_ISDIR(st.st_mode):
        return []  # sockets, FIFOs, devices: nothing to copy
    entries = [_Entry(rel, path, stat.S_IMODE(st.st_mode) & 0o777 | 0o700, True)]
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return entries
    for name in names:
        entries += _walk(os.path.join(path, name), f"{rel}/{name}", limits, seen)
    return entries


def seed(home: Path, entries: list[_Entry], force: bool) -> SeedResult:
    """Copy `entries` below the home directory `home`, never following a link there: the
    sandbox may have left links in its home (a link is replaced, not written through)."""
    result = SeedResult()
    root = os.open(home, _DIR_FLAGS)
    try:
        for entry in entries:
            parts = entry.rel.split("/")
            parent = _open_parents(root, parts[:-1], force)
            if parent is None:
                result.kept += 1
                continue
            try:
                if entry.is_dir:
                    _make_dir(parent, parts[-1], entry.mode, force)
                elif _copy_file(parent, parts[-1], entry, force):
                    result.copied += 1
                    result.bytes += entry.size
                else:
                    result.kept += 1
            finally:
                os.close(parent)
    finally:
        os.close(root)
    return result


def _open_parents(root: int, parts: list[str], force: bool) -> int | None:
    fd = os.dup(root)
    for part in parts:
        nfd = _make_dir(fd, part, 0o700, force)
        os.close(fd)
        if nfd is None:
            return None
        fd = nfd
    return fd


def _make_dir(parent: int, name: str, mode: int, force: bool) -> int | None:
    """The directory `name` in `parent`, made if missing; a link there is replaced, a file
    too with `force` (else None)."""
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        if not (stat.S_ISLNK(st.st_mode) or force):
            return None
        os.unlink(name, dir_fd=parent)
        st = None
    if st is None:
        os.mkdir(name, mode, dir_fd=parent)
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _copy_file(parent: int, name: str, entry: _Entry, force: bool) -> bool:
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        st = None
    if st is not None and not force and not stat.S_ISLNK(st.st_mode):
        return False
    if st is not None and stat.S_ISDIR(st.st_mode):
        return False  # a directory where the file goes: left to the user
    temp = f".{name}.seed-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(temp, flags, 0o600, dir_fd=parent)
    try:
        with open(entry.source, "rb") as source:
            while chunk := source.read(1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        os.fchmod(out, entry.mode)
    except BaseException:
        os.close(out)
        os.unlink(temp, dir_fd=parent)
        raise
    os.close(out)
    os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)  # replaces a link itself
    return True


# ----- the command --------------------------------------------------------------------------------


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
    for parser in (seeding, reset):
        parser.add_argument(
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
    levels = [args.trust] if args.trust is not None else list(Trust)
    if action == "seed":
        return _seed(project, workspace, levels, args)
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
    kept = copied = 0
    for level in levels:
        result = seed(ensure_home(project, workspace, level), entries, args.force)
        copied, kept = max(copied, result.copied), max(kept, result.kept)
    what = ", ".join(sorted({"~/" + e.rel.split("/")[0] for e in entries}))
    print(
        f"sandboxfs: copied {copied} file{'s' * (copied != 1)} ({what}) into the home of "
        f"workspace {workspace} at {_levels(levels)}"
        + (f"; kept {kept} already there (--force replaces them)" if kept else "")
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
        "home",
        zone="home",
        workspace=workspace,
        detail=detail,
        nothing_done="; nothing changed",
    )
