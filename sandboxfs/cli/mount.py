"""`sandboxfs mount`: its options (also in the `-o` form that sshfs and bindfs take) and the
command, which serves the mount from a daemon of its own, or in the foreground."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sandboxfs.cli import launch
from sandboxfs.cli.subcommands import trust_level
from sandboxfs.errors import SandboxfsError, UserError
from sandboxfs.project import state
from sandboxfs.project.mounts import MountRequest, discard_new_session, validate_mountpoint
from sandboxfs.project.zones import (
    check_id,
    validate_project,
)
from sandboxfs.run import rundir

P = TypeVar("P", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[P]) -> None:
    """The options of `sandboxfs mount`."""
    mount = sub.add_parser(
        "mount",
        help="mount the virtual tree; returns when it answers",
        description="Mount the project's virtual tree at MOUNTPOINT and return once it answers "
        "(the daemon stays in the background; -f keeps it in the foreground).",
    )
    mount.add_argument("mountpoint", type=Path, help="an existing, empty directory")
    mount.add_argument(
        "--trust",
        type=trust_level,
        help="untrusted, session, workspace or full (default: config, else session)",
    )
    launch.project_options(mount)
    mount.add_argument(
        "-f",
        "--foreground",
        action="store_true",
        help="stay in the foreground; unmount on Ctrl-C, SIGINT or SIGTERM",
    )
    mount.add_argument(
        "--audit-sync",
        action="store_true",
        help="fsync every audit entry before the operation returns",
    )
    mount.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users use the mount (needs user_allow_other in /etc/fuse.conf)",
    )
    mount.add_argument(
        "-d",
        "--debug",
        action="store_true",
        help="log every FUSE request (opcode, inode or name, result, time) to the daemon log",
    )
    launch.approvals_options(mount, "none: refuse them at once, with the reason")
    mount.add_argument(
        "-o",
        dest="options",
        action="append",
        default=[],
        metavar="OPT[,OPT...]",
        help="mount options, as sshfs and bindfs take them: "
        + ", ".join(MOUNT_OPTIONS)
        + "; repeatable",
    )


MOUNT_OPTIONS = {
    "allow_other": "as --allow-other",
    "ro": "read-only: nothing changes through the mount, at any trust level",
    "trust=LEVEL": "as --trust",
    "project=DIR": "as --project",
    "workspace=ID": "as --workspace",
    "session=ID": "as --session",
    "new_session=ID": "as --new-session",
    "config=FILE": "as --config",
    "entry_timeout=SECONDS": "how long the kernel caches names",
    "attr_timeout=SECONDS": "how long the kernel caches attributes",
    "audit_sync": "as --audit-sync",
    "debug": "as --debug",
}


def main(args: argparse.Namespace) -> int:
    """Everything is checked before the mount is made; a new session that never served is
    discarded, so that a refusal leaves nothing behind."""
    state.check_state_root()  # before anything is written: the audit log's key is there
    rundir.sweep_dead_runs()
    read_only, cache = _apply_mount_options(args)
    project = validate_project(args.project)
    cfg = launch.load_config(args, project)
    if cache:
        cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update=cache)})
    mountpoint = validate_mountpoint(args.mountpoint, project)
    workspace = check_id("workspace", args.workspace)
    launch.recover_landings(project, workspace)
    trust = args.trust or cfg.default_trust
    parent = cfg
    cfg = launch.for_worker(args, project, cfg, trust)
    cfg, session, resumed = launch.session_with_attachments(
        args, project, workspace, parent, cfg, trust
    )
    req = MountRequest(
        mountpoint=mountpoint,
        project=project,
        trust=trust,
        workspace=workspace,
        session=session,
        config=cfg,
        audit_sync=args.audit_sync,
        debug=args.debug,
        allow_other=args.allow_other,
        config_file=args.config,
        read_only=read_only,
        approvals=launch.approvals_mode(args, "ask"),
    )
    from sandboxfs.fuse.daemon import serve

    try:
        if args.foreground:

            def announce() -> None:
                print(_mounted_line(req, resumed), flush=True)

            serve(req, announce)
            return 0
        return _spawn_daemon(req, resumed)
    except SandboxfsError:
        if not resumed:  # a session that never served is not left behind
            discard_new_session(project, workspace, session)
        raise


# The -o options that are flags (`ro` also, which has no long flag), and the long flag each sets.
_FLAG_OPTIONS = {"allow_other": "allow_other", "audit_sync": "audit_sync", "debug": "debug"}
# The -o options that take a value: the long option each sets, and its argparse type.
_VALUE_OPTIONS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "trust": ("trust", trust_level),
    "project": ("project", Path),
    "workspace": ("workspace", str),
    "session": ("session", str),
    "new_session": ("new_session", str),
    "config": ("config", Path),
}
_CACHE_OPTIONS = ("entry_timeout", "attr_timeout")


def _apply_mount_options(args: argparse.Namespace) -> tuple[bool, dict[str, float]]:
    """`-o a,b=c`: each option sets what its long flag sets; returns (ro, cache timeouts)."""
    read_only = False
    cache: dict[str, float] = {}
    for group in args.options:
        for option in filter(None, group.split(",")):
            name, sep, value = option.partition("=")
            if name in _FLAG_OPTIONS or name == "ro":
                if _set_flag(args, name, sep, option):
                    read_only = True
            elif name in _VALUE_OPTIONS:
                _set_value(args, name, value, option)
            elif name in _CACHE_OPTIONS:
                cache[name] = _seconds(name, value, option)
            else:
                accepted = ", ".join(MOUNT_OPTIONS)
                raise UserError(f"unknown mount option {option!r}; accepted: {accepted}")
    if args.session is not None and args.new_session is not None:
        raise UserError("--session and --new-session (or their -o forms) exclude each other")
    return read_only, cache


def _set_flag(args: argparse.Namespace, name: str, sep: str, option: str) -> bool:
    """A flag option: sets its long flag, or returns True for `ro`, which has none."""
    if sep:
        raise UserError(f"mount option {name} takes no value (got {option!r})")
    if name == "ro":
        return True
    setattr(args, _FLAG_OPTIONS[name], True)
    return False


def _set_value(args: argparse.Namespace, name: str, value: str, option: str) -> None:
    """An option with a value: sets its long option, converted as argparse would."""
    dest, convert = _VALUE_OPTIONS[name]
    text = _needed(name, value)
    try:
        setattr(args, dest, convert(text))
    except argparse.ArgumentTypeError as exc:
        raise UserError(f"mount option {option}: {exc}") from None


def _seconds(name: str, value: str, option: str) -> float:
    """A cache timeout's value: a number of seconds, 0 or more."""
    text = _needed(name, value)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise UserError(f"mount option {option}: expected a number of seconds >= 0")
    return seconds


def _needed(name: str, value: str) -> str:
    """`value`, refused when empty (`-o trust=`, or `-o trust` with no `=`)."""
    if not value:
        raise UserError(f"mount option {name} needs a value: {name}=...")
    return value


def _mounted_line(req: MountRequest, resumed: bool) -> str:
    return (
        f"mounted {req.mountpoint} (trust {req.trust.value}, workspace {req.workspace}, "
        f"{'resumed' if resumed else 'new'} session{', read-only' if req.read_only else ''}"
        f"{', worker ' + req.config.worker.name if req.config.worker is not None else ''})\n"
        f"session: {req.session}"
    )


def _spawn_daemon(req: MountRequest, resumed: bool) -> int:
    from sandboxfs.fuse.daemon import spawn_daemon

    spawn_daemon(req)
    print(_mounted_line(req, resumed))
    return 0
