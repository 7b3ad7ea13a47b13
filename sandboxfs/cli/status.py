"""`sandboxfs status`: the user's sandboxfs mounts, as a table or a JSON list: each one's
state, trust level, session, pending staged commits and the size of its project's state dir."""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shlex
from pathlib import Path
from typing import Any, TypeVar

from sandboxfs.errors import SandboxfsError, UserError
from sandboxfs.layout import control_dir
from sandboxfs.project import control, state
from sandboxfs.project.mounts import (
    FAILING_CLOSED,
    NOT_YOURS,
    mount_owner,
    read_context,
    sandboxfs_mounts,
)

P = TypeVar("P", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[P]) -> None:
    """The options of `sandboxfs status`."""
    status = sub.add_parser("status", help="list sandboxfs mounts")
    status.add_argument("mountpoint", type=Path, nargs="?", help="only this mount")
    status.add_argument("--json", action="store_true", help="a JSON list instead of a table")


def main(args: argparse.Namespace) -> int:
    """Each mount is asked through its own /.sandboxfs/context.json, bounded in time, so that
    a hung daemon shows as unresponsive instead of hanging status."""
    control.sweep()  # control sockets of daemons that were killed
    mounts = sandboxfs_mounts()
    if args.mountpoint is not None:
        wanted = os.path.abspath(args.mountpoint)
        if wanted not in mounts:
            raise UserError(f"{args.mountpoint} is not a sandboxfs mount")
        mounts = [wanted]
    sizes: dict[str, int | None] = {}  # per project: several mounts of one are measured once
    rows = [_row(mp, sizes) for mp in mounts]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no sandboxfs mounts")
        return 0
    _print_table(rows)
    return 0


def _row(mp: str, sizes: dict[str, int | None]) -> dict[str, Any]:
    """One mount's row: what its daemon says of it when it answers, else its state and what
    else can be told (another user's: whose; failing closed: why, from its control socket)."""
    context = read_context(Path(mp), timeout=2.0)
    if isinstance(context, dict):
        return {
            "mountpoint": mp,
            "state": "running",
            **{k: context.get(k) for k in ("trust", "session", "workspace", "project", "pid")},
            # `sandboxfs run` sessions name their command
            **({"command": context["command"]} if "command" in context else {}),
            "pending": _pending_staged(context),
            "state_dir_bytes": _state_dir_bytes(context, sizes),
        }
    if context == NOT_YOURS:
        return {"mountpoint": mp, "state": context, "owner": user_name(mount_owner(mp))}
    if context == FAILING_CLOSED:
        return {"mountpoint": mp, "state": context, **_failing_closed(mp)}
    return {"mountpoint": mp, "state": context}


def _print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a table, a column only where a row has a value for it (OWNER, COMMAND),
    then a line for each mount whose state has a reason."""
    headers = [
        "MOUNTPOINT",
        "STATE",
        "TRUST",
        "SESSION",
        "WORKSPACE",
        "PID",
        "PENDING",
        "STATE DIR",
        "PROJECT",
    ]
    if any(r.get("owner") for r in rows):
        headers.insert(2, "OWNER")  # other users' mounts
    if any(r.get("command") for r in rows):
        headers.append("COMMAND")  # `sandboxfs run` sessions
    for shown in rows:
        size = shown.get("state_dir_bytes")
        # one word, as every other cell: `du -h` style, 12.5MiB
        shown["state dir"] = (
            state.format_size(size).replace(" ", "") if isinstance(size, int) else None
        )
    table = [[_status_cell(r.get(k.lower())) for k in headers] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    for row in [headers, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for shown in rows:
        if shown.get("reason"):
            print(f"{shown['mountpoint']}: {shown['state']}: {shown['reason']}")


def user_name(uid: int | None) -> str:
    """The owner of another user's mount, by name (status's OWNER column, umount's refusal)."""
    if uid is None:
        return "another user"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _failing_closed(mountpoint: str) -> dict[str, Any]:
    """What the daemon of a mount that fails closed says over its control socket (which it
    answers while it refuses every operation, context.json included): why, its level and
    session. The socket is found among the user's own, by the mountpoint each names."""
    found: dict[str, Any] = {"reason": "the audit log cannot be written"}
    try:
        sockets = sorted(control_dir().glob("*.sock"))
    except OSError:
        return found
    for path in sockets:
        try:
            answer = control.request(path, {"op": "status"}, timeout=2.0)
        except SandboxfsError:
            continue
        if answer.get("mountpoint") != mountpoint:
            continue
        if isinstance(answer.get("failing"), str):
            found["reason"] += f" ({answer['failing']})"
        found.update({k: answer.get(k) for k in ("trust", "session")})
        break
    return found


def _pending_staged(context: dict[str, Any]) -> int | None:
    """How many staged commits of the mount's workspace wait for review (None: unknown)."""
    project, workspace = context.get("project"), context.get("workspace")
    if not isinstance(project, str) or not isinstance(workspace, str):
        return None
    from sandboxfs import staging  # only here, not at each start of every command

    try:
        return len(staging.pending(Path(project), workspace))
    except (OSError, SandboxfsError):
        return None


def _state_dir_bytes(context: dict[str, Any], sizes: dict[str, int | None]) -> int | None:
    """What the mount's project's state dir takes on disk (None: unknown); the table shows it
    as STATE DIR, and `sandboxfs sessions` tells what in it."""
    project = context.get("project")
    if not isinstance(project, str):
        return None
    if project not in sizes:
        sizes[project] = state.state_dir_bytes(Path(project)) if Path(project).is_dir() else None
    return sizes[project]


def _status_cell(value: Any) -> str:
    if isinstance(value, list):
        return shlex.join(str(v) for v in value)
    return "" if value is None else str(value)
