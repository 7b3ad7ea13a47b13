"""The `sandboxfs` command: mount, umount, status, audit.

Every user error is one line on stderr and exit code 2; nothing is left mounted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from . import audit as audit_mod
from . import config as config_mod
from .daemon import (
    MountRequest,
    audit_path,
    check_id,
    lazy_unmount,
    new_session_id,
    read_context,
    sandboxfs_mounts,
    serve,
    session_dir,
    validate_mountpoint,
    validate_project,
)
from .errors import UserError
from .policy import Op, Trust, Zone

MOUNT_TIMEOUT = 20.0
UNMOUNT_WAIT = 10.0


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sandboxfs",
        description="A FUSE sandbox for AI agents: zones, trust levels, audit log.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mount = sub.add_parser("mount", help="mount the virtual tree; returns when it answers")
    mount.add_argument("mountpoint", type=Path)
    mount.add_argument(
        "--trust",
        type=_trust,
        help="untrusted, session, workspace or full (default: config, else session)",
    )
    mount.add_argument(
        "--project", type=Path, default=Path("."), help="project directory (default: .)"
    )
    mount.add_argument("--workspace", default="default", help="workspace id (default: default)")
    mount.add_argument("--session", help="resume this session id (default: a new one)")
    mount.add_argument(
        "--config", type=Path, help="config file (default: <project>/sandboxfs.yaml)"
    )
    mount.add_argument(
        "--foreground",
        action="store_true",
        help="stay in the foreground; unmount on SIGINT/SIGTERM",
    )
    mount.add_argument(
        "--audit-sync",
        action="store_true",
        help="fsync every audit entry before the operation returns",
    )
    mount.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users use the mount (needs user_allow_other)",
    )
    mount.add_argument(
        "--debug", action="store_true", help="log every FUSE request to the daemon log"
    )

    umount = sub.add_parser("umount", help="unmount, also a mount whose daemon died")
    umount.add_argument("mountpoint", type=Path)

    status = sub.add_parser("status", help="list sandboxfs mounts")
    status.add_argument("mountpoint", type=Path, nargs="?")
    status.add_argument("--json", action="store_true")

    audit = sub.add_parser("audit", help="show, verify or prune the audit log")
    audit.add_argument("action", nargs="?", choices=["show", "verify", "prune"], default="show")
    audit.add_argument(
        "--project", type=Path, default=Path("."), help="project directory (default: .)"
    )
    audit.add_argument("--session")
    audit.add_argument("--workspace")
    audit.add_argument(
        "--op",
        choices=[
            *(o.value for o in Op),
            "rename",
            "link",
            "mount",
            "unmount",
            "error",
            "recover",
            "prune",
        ],
    )
    audit.add_argument("--zone", choices=[z.value for z in Zone])
    audit.add_argument("--trust", type=_trust)
    allowed = audit.add_mutually_exclusive_group()
    allowed.add_argument("--denied", action="store_true", help="only denials")
    allowed.add_argument("--allowed", action="store_true", help="only allowed operations")
    audit.add_argument("--since", type=_when, help="ISO time or age such as 10m, 2h, 7d")
    audit.add_argument("--until", type=_when, help="ISO time or age such as 10m, 2h, 7d")
    audit.add_argument("--pid", type=int)
    audit.add_argument("--limit", type=_positive, help="only the last N matching entries")
    audit.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    audit.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    audit.add_argument("--before", type=_when, help="with prune: drop entries older than this")
    return parser


def _trust(text: str) -> Trust:
    try:
        return Trust(text)
    except ValueError:
        accepted = ", ".join(t.value for t in Trust)
        raise argparse.ArgumentTypeError(
            f"unknown trust level {text!r}; accepted: {accepted}"
        ) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


_AGE_RE = re.compile(r"^(\d+)([smhdw])$")
_AGE_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def _when(text: str) -> datetime:
    match = _AGE_RE.match(text)
    if match:
        return datetime.now(UTC) - timedelta(**{_AGE_UNITS[match.group(2)]: int(match.group(1))})
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid time {text!r}: expected ISO 8601 (2026-11-22T08:00:00Z) "
            f"or an age (30s, 10m, 2h, 7d)"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


# ----- mount ------------------------------------------------------------------------------------


def cmd_mount(args: argparse.Namespace) -> int:
    project = validate_project(args.project)
    cfg = config_mod.load(project, args.config)
    mountpoint = validate_mountpoint(args.mountpoint, project)
    workspace = check_id("workspace", args.workspace)
    session = check_id("session", args.session) if args.session else new_session_id()
    resumed = session_dir(project, workspace, session).is_dir()
    req = MountRequest(
        mountpoint=mountpoint,
        project=project,
        trust=args.trust or cfg.default_trust,
        workspace=workspace,
        session=session,
        config=cfg,
        audit_sync=args.audit_sync,
        debug=args.debug,
        allow_other=args.allow_other,
        config_file=args.config,
    )
    if args.foreground:

        def announce() -> None:
            print(_mounted_line(req, resumed), flush=True)

        serve(req, announce)
        return 0
    return _spawn_daemon(req, resumed)


def _mounted_line(req: MountRequest, resumed: bool) -> str:
    return (
        f"mounted {req.mountpoint} (trust {req.trust.value}, workspace {req.workspace}, "
        f"session {req.session}{' resumed' if resumed else ''})\nsession: {req.session}"
    )


def _spawn_daemon(req: MountRequest, resumed: bool) -> int:
    """Fork the daemon (already validated and imported: no second interpreter start-up) and
    wait until it reports that the mount answers, or why it could not mount."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon: its own session, no terminal, never returns into the CLI
        os.close(read_end)
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            code = _run_daemon(req, write_end)
        finally:
            os._exit(code)
    os.close(write_end)
    message = _read_status(read_end, MOUNT_TIMEOUT)
    os.close(read_end)
    if message.startswith("READY"):
        print(_mounted_line(req, resumed))
        return 0
    if not message:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        lazy_unmount(req.mountpoint)
        raise UserError(
            f"the daemon did not report a working mount within {MOUNT_TIMEOUT:.0f} s", exit_code=1
        )
    os.waitpid(pid, 0)
    status, _, text = message.partition(" ")[2].partition(" ")
    raise UserError(text.strip(), exit_code=int(status) if status.isdigit() else 1)


def _read_status(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


def _run_daemon(req: MountRequest, ready_fd: int) -> int:
    def ready() -> None:
        os.write(ready_fd, b"READY\n")
        os.close(ready_fd)

    try:
        serve(req, ready)
    except UserError as exc:
        os.write(ready_fd, f"ERROR {exc.exit_code} {exc.message}\n".encode())
        return exc.exit_code
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(ready_fd, f"ERROR 1 daemon failed: {type(exc).__name__}: {exc}\n".encode())
        raise
    return 0


# ----- umount and status --------------------------------------------------------------------------


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = Path(os.path.abspath(args.mountpoint))
    if str(mountpoint) not in sandboxfs_mounts():
        raise UserError(f"{args.mountpoint} is not a sandboxfs mount (see 'sandboxfs status')")
    context = read_context(mountpoint, timeout=2.0)
    pid = context.get("pid") if isinstance(context, dict) else None
    alive = isinstance(context, dict)
    cmd = (
        ["fusermount3", "-u", str(mountpoint)]
        if alive
        else ["fusermount3", "-u", "-z", str(mountpoint)]
    )
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
        raise UserError(f"cannot unmount {args.mountpoint}: {detail}", exit_code=1)
    if isinstance(pid, int):
        _wait_for_exit(pid, UNMOUNT_WAIT)
    print(f"unmounted {args.mountpoint}" + ("" if alive else " (its daemon had died)"))
    return 0


def _wait_for_exit(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
        except (OSError, IndexError):
            return
        if state == "Z":
            return
        time.sleep(0.02)


def cmd_status(args: argparse.Namespace) -> int:
    mounts = sandboxfs_mounts()
    if args.mountpoint is not None:
        wanted = os.path.abspath(args.mountpoint)
        if wanted not in mounts:
            raise UserError(f"{args.mountpoint} is not a sandboxfs mount")
        mounts = [wanted]
    rows: list[dict[str, Any]] = []
    for mp in mounts:
        context = read_context(Path(mp), timeout=2.0)
        if isinstance(context, dict):
            rows.append(
                {
                    "mountpoint": mp,
                    "state": "running",
                    **{
                        k: context.get(k)
                        for k in ("trust", "session", "workspace", "project", "pid")
                    },
                }
            )
        else:
            rows.append({"mountpoint": mp, "state": context})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no sandboxfs mounts")
        return 0
    headers = ["MOUNTPOINT", "STATE", "TRUST", "SESSION", "WORKSPACE", "PID", "PROJECT"]
    table = [[str(r.get(k.lower(), "") or "") for k in headers] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    for row in [headers, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


# ----- audit --------------------------------------------------------------------------------------


def cmd_audit(args: argparse.Namespace) -> int:
    project = validate_project(args.project)
    path = audit_path(project)
    if args.action == "verify":
        result = audit_mod.verify(path)
        print(result.message)
        return 0 if result.ok else 1
    if args.action == "prune":
        if args.before is None:
            raise UserError("audit prune needs --before T (ISO time or an age such as 30d)")
        dropped = audit_mod.prune(path, args.before)
        print(f"pruned {dropped} entries older than {args.before.isoformat()}")
        return 0
    query = audit_mod.AuditQuery(
        session=args.session,
        workspace=args.workspace,
        op=args.op,
        zone=args.zone,
        trust=args.trust.value if args.trust else None,
        allowed=False if args.denied else True if args.allowed else None,
        since=args.since,
        until=args.until,
        pid=args.pid,
        limit=args.limit,
    )
    start = path.stat().st_size if path.exists() else 0
    entries = audit_mod.query(path, query)
    if args.json:
        for entry in entries:
            print(json.dumps(entry, sort_keys=True))
    elif entries or not args.follow:
        print(audit_mod.format_table(entries) if entries else "no matching audit entries")
    sys.stdout.flush()
    if args.follow:
        try:
            shown = max((e["id"] for e in entries), default=0)
            audit_mod.follow(path, query, sys.stdout, as_json=args.json, resume=(start, shown))
        except KeyboardInterrupt:
            return 0
    return 0


COMMANDS = {"mount": cmd_mount, "umount": cmd_umount, "status": cmd_status, "audit": cmd_audit}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"sandboxfs: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
