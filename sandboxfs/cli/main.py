"""The `sandboxfs` command: mount, umount, status, audit.

Every user error is one line on stderr and exit code 2; nothing is left mounted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from sandboxfs.audit.writer import record_now
from sandboxfs.cli import approvals as approvals_cli
from sandboxfs.cli import audit as audit_cli
from sandboxfs.cli import completion, manpage, staged_parser, subcommands
from sandboxfs.cli import home as home_mod
from sandboxfs.cli import sessions as sessions_cli
from sandboxfs.cli import workers as workers_cli
from sandboxfs.cli.suggest import suggestion
from sandboxfs.config import model as config_mod
from sandboxfs.config import user as userconfig
from sandboxfs.config.inputs import cut
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.policy import Trust
from sandboxfs.core.syscalls import die_with_parent
from sandboxfs.errors import (
    CannotExecute,
    Failure,
    NotRunnable,
    SandboxfsError,
    SetupError,
    UserError,
)
from sandboxfs.layout import (
    STATE_DIR_NAME,
    audit_path,
    control_dir,
    interrupted_landings,
    state_dir,
    state_root,
)
from sandboxfs.project import control, gitdir, state, workers
from sandboxfs.project import zones as project_mod
from sandboxfs.project.mounts import (
    FAILING_CLOSED,
    NOT_YOURS,
    MountRequest,
    choose_session,
    discard_new_session,
    live_contexts,
    mount_owner,
    read_context,
    sandboxfs_mounts,
    validate_mountpoint,
)
from sandboxfs.project.zones import (
    check_home_project,
    check_id,
    find_project,
    home_project_config,
    validate_project,
)
from sandboxfs.run import confine, nest, netproxy, registries, rundir, toolchain
from sandboxfs.run import doctor as doctor_mod
from sandboxfs.run import supervisor as run_mod
from sandboxfs.run.request import EXIT_SETUP, RunRequest

UNMOUNT_WAIT = 10.0
BUSY_WAIT = 2.0  # seconds umount tries again while the mount is busy
EXIT_CANNOT_EXECUTE = 126  # as `docker run`
EXIT_NOT_FOUND = 127


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}{suggestion(self, message)} (see '{self.prog} --help')")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser; `only`: a subcommand's name, the only one built."""
    parser = _Parser(
        prog="sandboxfs",
        description="A FUSE sandbox for AI agents: zones, trust levels, audit log.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for names, add in _SUBCOMMANDS:
        if only is None or only in names:
            add(sub)
    return parser


def _mount_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
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
        type=_trust,
        help="untrusted, session, workspace or full (default: config, else session)",
    )
    _project_options(mount)
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
    _approvals_options(mount, "none: refuse them at once, with the reason")
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


def _run_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The options of `sandboxfs run`."""
    run = sub.add_parser(
        "run",
        help="run a command confined to a private mount of the project",
        description="Mount the project privately, run CMD inside a bubblewrap sandbox whose only "
        "view of it is the mount (at /sandbox), unmount, and exit with CMD's status "
        "(125: the sandbox could not be set up; 126: CMD cannot be executed; 127: not found).",
    )
    run.add_argument("--trust", type=_trust, help="as for mount (default: config, else session)")
    _project_options(run)
    _approvals_options(run, "none: refuse them at once (the default when stdin is no terminal)")
    run.add_argument(
        "--net",
        choices=["none", "allow", "host"],
        help="none: loopback only; allow: only --allow-host hosts, through sandboxfs's proxy; "
        "host: the host's network (default: config, else none)",
    )
    run.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="with --net allow: a host the program may reach (name, *.suffix or address; "
        "no port: 80 and 443; NAME=IP: the name, also at that non-global address); repeatable",
    )
    run.add_argument(
        "--allow",
        action="append",
        default=[],
        choices=sorted(registries.REGISTRIES),
        metavar="REGISTRY",
        help="with --net allow: every host of a package registry ("
        + ", ".join(sorted(registries.REGISTRIES))
        + "), as this machine resolves them; repeatable",
    )
    run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="pass one more environment variable (your value, or VALUE); repeatable",
    )
    run.add_argument(
        "--cwd",
        metavar="VIRTUAL_PATH",
        help="working directory inside, e.g. /repo/src (default: /repo when the trust level "
        "can list it, else /session/working)",
    )
    run.add_argument(
        "--audit-sync",
        action="store_true",
        help="fsync every audit entry before the operation returns",
    )
    run.add_argument("--quiet", "-q", action="store_true", help="no summary line at exit")
    run.add_argument(
        "--agent",
        metavar="NAME",
        help="an agent profile: its hosts (with --net allow, the default then), environment "
        "variables and exposed paths: " + ", ".join(userconfig.BUILTIN_AGENTS) + " or your own",
    )
    run.add_argument(
        "--expose",
        action="append",
        default=[],
        metavar="PATH",
        help="show this host file or directory read-only at the same path inside (never a "
        "home, a secret, the project or sandboxfs's state); repeatable",
    )
    # The ceiling of a child worker started from inside a run (sandboxfs.run.nest): that run's
    # supervisor passes its own zones here. Not for people; a program inside never reaches it.
    run.add_argument("--within", help=argparse.SUPPRESS)
    # A nested child's: where its parent's supervisor reads this run's control socket from, to
    # ask its approval requests in the parent's terminal. Not for people either.
    run.add_argument("--report-control", type=int, help=argparse.SUPPRESS)
    # A nested child's: the parent run's pid; the child ends (SIGTERM: it unmounts) when that
    # run does, even killed, so no child outlives its parent.
    run.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    # A nested child's place in its tree of runs (depth, the top-level run's slots), from the
    # supervisor that starts it, which bounds them (sandboxfs.run.nest.Nesting). Not for people.
    run.add_argument("--nesting", help=argparse.SUPPRESS)
    run.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARG...]",
        help="the command to run inside, after --",
    )


def _doctor_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The options of `sandboxfs doctor`."""
    doctor = sub.add_parser("doctor", help="check what mount and run need on this machine")
    doctor.add_argument("--json", action="store_true", help="a JSON list of checks")


def _umount_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The options of `sandboxfs umount`."""
    umount = sub.add_parser("umount", help="unmount, also a mount whose daemon died")
    umount.add_argument("mountpoint", type=Path, help="where a sandboxfs mount is")
    umount.add_argument(
        "--lazy",
        action="store_true",
        help="detach it now even if busy or hung; it goes once no process uses it",
    )
    umount.add_argument(
        "--force",
        action="store_true",
        help="(root) unmount another user's live mount",
    )


def _status_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The options of `sandboxfs status`."""
    status = sub.add_parser("status", help="list sandboxfs mounts")
    status.add_argument("mountpoint", type=Path, nargs="?", help="only this mount")
    status.add_argument("--json", action="store_true", help="a JSON list instead of a table")


def _trust_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The options of `sandboxfs promote` and `sandboxfs demote`."""
    for name, verb in (("promote", "raise"), ("demote", "lower")):
        change = sub.add_parser(
            name,
            help=f"{verb} the trust level of a running mount or run, at once",
            description=f"{verb.capitalize()} the trust level of a live mount (or of the mount "
            "of a `sandboxfs run`, listed by `sandboxfs status`) through its control socket. "
            "It takes effect for the next operation: the kernel's cached names, attributes and "
            "file pages are dropped, and open files and directories are checked again.",
        )
        change.add_argument(
            "mountpoint",
            nargs="?",
            metavar="MOUNTPOINT|SESSION",
            help="the mount or the session id, as `sandboxfs status` shows them; left out: "
            "the only running session of the project",
        )
        change.add_argument(
            "--project", type=Path, default=None, help="the project (default: this directory)"
        )
        change.add_argument(
            "--trust", type=_trust, required=True, metavar="LEVEL", help="the new trust level"
        )
        change.add_argument("--json", action="store_true", help="print the daemon's JSON answer")


def _completion_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The options of `sandboxfs completion`."""
    shell = sub.add_parser(
        "completion",
        help="print the bash or zsh completion script",
        description="Print the shell completion script of sandboxfs, generated from its options. "
        "bash: sandboxfs completion bash > ~/.local/share/bash-completion/completions/sandboxfs, "
        'or eval "$(sandboxfs completion bash)" in ~/.bashrc. zsh: '
        'eval "$(sandboxfs completion zsh)" in ~/.zshrc, after compinit.',
    )
    shell.add_argument("shell", choices=completion.SHELLS, help="the shell: %(choices)s")


def _man_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The options of `sandboxfs man`."""
    sub.add_parser(
        "man",
        help="print the man page",
        description="Print the sandboxfs(1) man page, in roff. Read it: sandboxfs man | man -l -; "
        "install it: sandboxfs man > ~/.local/share/man/man1/sandboxfs.1",
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


class _VersionAction(argparse.Action):
    """--version, looked up only when asked for (importlib.metadata is start-up time of every
    command otherwise)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=0, help="show program's version number and exit"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"sandboxfs {_version()}")
        parser.exit()


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("sandboxfs")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        from sandboxfs import __version__

        return __version__


def _project_options(parser: argparse.ArgumentParser) -> None:
    """The options `mount` and `run` share: which project, workspace, session and config."""
    parser.add_argument(
        "--project", type=Path, default=Path("."), help="project directory (default: .)"
    )
    parser.add_argument("--workspace", default="default", help="workspace id (default: default)")
    sessions = parser.add_mutually_exclusive_group()
    sessions.add_argument("--session", metavar="ID", help="resume this existing session")
    sessions.add_argument(
        "--new-session", metavar="ID", help="start a new session with this id (default: random)"
    )
    parser.add_argument(
        "--config", type=Path, help="config file (default: <project>/sandboxfs.yaml)"
    )
    parser.add_argument(
        "--allow-home-project",
        action="store_true",
        help="let the project be a home directory (or one holding a home or sandboxfs's "
        "state); its logins (~/.gitconfig, ~/.config/gh, ~/.claude...) stay hidden",
    )
    parser.add_argument(
        "--worker",
        metavar="NAME",
        help="narrow to what NAME.worker declares (in .workers or SANDBOXFS_WORKERS_PATH): "
        "its zones, at most their modes, nothing else; wider than --trust allows: refused",
    )
    parser.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="VIRTUAL_PATH",
        help="with --worker: give it this file, which --trust may read (e.g. /repo/a.csv), "
        "read-only at /attachments/<name>; repeatable",
    )


def _for_worker(
    args: argparse.Namespace, project: Path, cfg: config_mod.Config, trust: Trust
) -> config_mod.Config:
    """`cfg` narrowed to the --worker's declaration (sandboxfs.project.workers), or as it is."""
    if args.worker is None:
        return cfg
    return workers.narrow(cfg, trust, workers.find(project, args.worker, cfg))


def _session_with_attachments(
    args: argparse.Namespace,
    project: Path,
    workspace: str,
    parent: config_mod.Config,
    cfg: config_mod.Config,
    trust: Trust,
) -> tuple[config_mod.Config, str, bool]:
    """The session chosen by --session/--new-session and `cfg` with the --attach files: (the
    config, the session, whether it is resumed). A new session is discarded if attaching
    fails."""
    session, resumed = choose_session(project, workspace, args.session, args.new_session)
    try:
        return _attach(args, project, parent, cfg, trust, workspace, session), session, resumed
    except UserError:
        if not resumed:
            discard_new_session(project, workspace, session)
        raise


def _attach(
    args: argparse.Namespace,
    project: Path,
    parent: config_mod.Config,
    cfg: config_mod.Config,
    trust: Trust,
    workspace: str,
    session: str,
) -> config_mod.Config:
    """The --attach files, read as the parent (`parent`: --trust, without the worker) reads
    them: an API sandbox on the same session, so each is checked and audited; given read-only
    to the worker of `cfg`."""
    if not args.attach:
        return cfg
    named = workers.attachment_names(args.attach)
    if cfg.worker is None:
        raise UserError("attachments are given to a worker: --attach needs --worker NAME")
    from sandboxfs.api import Sandbox as ApiSandbox
    from sandboxfs.api import SandboxAPIError

    files: dict[str, bytes] = {}
    try:
        config_file = args.config.absolute() if args.config is not None else None
        with ApiSandbox.on_disk(project, parent, config_file, trust, workspace, session) as reader:
            for name, path in named.items():
                files[name] = reader.read_bytes(path)
    except SandboxAPIError as exc:
        raise UserError(f"--attach: {exc}") from None
    return workers.attach(cfg, project, workspace, files)


def _approvals_options(parser: argparse.ArgumentParser, none: str) -> None:
    """--approvals and --no-approvals of mount and run (docs/approvals.md)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--approvals",
        choices=["ask", "none"],
        help="how operations under an `ask` approval rule are answered: ask: they wait for "
        f"`sandboxfs approvals` (refused until answered, then the retry passes); {none}",
    )
    which.add_argument(
        "--no-approvals",
        action="store_true",
        help="every `ask` approval rule passes without asking (audited; `blocked` still refuses)",
    )


def _approvals_mode(args: argparse.Namespace, default: str) -> str:
    if args.no_approvals:
        print(
            "sandboxfs: warning: --no-approvals: operations that approval rules ask about "
            "go ahead without asking (each is audited)",
            file=sys.stderr,
        )
        return "off"
    return str(args.approvals or default)


def _approvals_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mount",
        metavar="MOUNTPOINT|SESSION",
        help="the mount or the session id, as `sandboxfs status` shows them; left out: the "
        "only running session of the project",
    )
    parser.add_argument(
        "--project", type=Path, default=None, help="the project (default: this directory)"
    )


def cmd_approvals(args: argparse.Namespace) -> int:
    """approvals, approve, deny, grants: through the mount's control socket."""
    mountpoint = _trust_target(args.mount, args.project)
    context = read_context(mountpoint, timeout=5.0)
    if not isinstance(context, dict):
        why = "it is another user's mount" if context == NOT_YOURS else f"it is {context}"
        raise Failure(f"cannot reach the approvals of {mountpoint}: {why}")
    path = context.get("control")
    if not isinstance(path, str):
        raise UserError(f"{mountpoint} has no control socket (mounted by an older sandboxfs)")
    return approvals_cli.main(args, Path(path))


_trust = subcommands.trust_level


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


def _recover_landings(project: Path, workspace: str) -> None:
    if not interrupted_landings(project, workspace):
        return  # the staging code is loaded only when a kill left a landing to finish
    from sandboxfs.cli.staged import recover_interrupted

    recover_interrupted(project, workspace)


def cmd_mount(args: argparse.Namespace) -> int:
    state.check_state_root()  # before anything is written: the audit log's key is there
    rundir.sweep_dead_runs()
    read_only, cache = _apply_mount_options(args)
    project = validate_project(args.project)
    home = check_home_project(project, args.allow_home_project)
    cfg = config_mod.load(project, args.config)
    if home:
        cfg = home_project_config(cfg, project)
    _check_zones_beside(project, cfg, args.config)
    if cache:
        cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update=cache)})
    mountpoint = validate_mountpoint(args.mountpoint, project)
    workspace = check_id("workspace", args.workspace)
    _recover_landings(project, workspace)
    trust = args.trust or cfg.default_trust
    parent = cfg
    cfg = _for_worker(args, project, cfg, trust)
    cfg, session, resumed = _session_with_attachments(args, project, workspace, parent, cfg, trust)
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
        approvals=_approvals_mode(args, "ask"),
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


def _apply_mount_options(args: argparse.Namespace) -> tuple[bool, dict[str, float]]:
    """`-o a,b=c`: each option sets what its long flag sets; returns (ro, cache timeouts)."""
    read_only = False
    cache: dict[str, float] = {}
    flags = {"allow_other": "allow_other", "audit_sync": "audit_sync", "debug": "debug"}
    valued: dict[str, tuple[str, Callable[[str], Any]]] = {
        "trust": ("trust", _trust),
        "project": ("project", Path),
        "workspace": ("workspace", str),
        "session": ("session", str),
        "new_session": ("new_session", str),
        "config": ("config", Path),
    }
    accepted = ", ".join(MOUNT_OPTIONS)
    for group in args.options:
        for option in filter(None, group.split(",")):
            name, sep, value = option.partition("=")
            if name in flags or name == "ro":
                if sep:
                    raise UserError(f"mount option {name} takes no value (got {option!r})")
                if name == "ro":
                    read_only = True
                else:
                    setattr(args, flags[name], True)
            elif name in valued or name in ("entry_timeout", "attr_timeout"):
                if not value:
                    raise UserError(f"mount option {name} needs a value: {name}=...")
                if name in valued:
                    dest, convert = valued[name]
                    try:
                        setattr(args, dest, convert(value))
                    except argparse.ArgumentTypeError as exc:
                        raise UserError(f"mount option {option}: {exc}") from None
                else:
                    try:
                        seconds = float(value)
                    except ValueError:
                        seconds = -1.0
                    if not seconds >= 0:
                        raise UserError(f"mount option {option}: expected a number of seconds >= 0")
                    cache[name] = seconds
            else:
                raise UserError(f"unknown mount option {option!r}; accepted: {accepted}")
    if args.session is not None and args.new_session is not None:
        raise UserError("--session and --new-session (or their -o forms) exclude each other")
    return read_only, cache


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


# ----- run and doctor ----------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    if args.parent_pid is not None:  # a nested child (sandboxfs.run.nest)
        die_with_parent(signal.SIGTERM)
        if os.getppid() != args.parent_pid:  # the parent ended before that took effect
            raise SetupError("the run that started this child has ended")
    state.check_state_root()  # before anything is written: the audit log's key is there
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UserError("run needs a command: sandboxfs run [OPTIONS] -- CMD [ARG...]")
    project = validate_project(args.project)
    home = check_home_project(project, args.allow_home_project)
    cfg = config_mod.load(project, args.config)
    if home:
        cfg = home_project_config(cfg, project)
    _check_zones_beside(project, cfg, args.config)
    workspace = check_id("workspace", args.workspace)
    _recover_landings(project, workspace)
    user = userconfig.load()
    profile = userconfig.agent(args.agent, user) if args.agent is not None else None
    source = str(args.config) if args.config is not None else config_mod.PROJECT_CONFIG_NAME
    asked = [*args.allow_host, *registries.hosts(args.allow)]
    chosen = userconfig.network_choice(args.net, asked, profile, user, cfg.run, source)
    net, hosts = chosen.mode, chosen.hosts
    if asked and net != "allow":
        raise UserError(f"{'--allow-host' if args.allow_host else '--allow'} needs --net allow")
    if chosen.ignored is not None:
        _ignored_network(project, workspace, chosen.ignored)
    try:
        allow = tuple(netproxy.parse_allow_host(h) for h in hosts) if net == "allow" else ()
        env = profile.environment(os.environ) if profile is not None else {}
        env.update(confine.parse_env_option(e, os.environ) for e in args.env)
        cwd = confine.virtual_cwd(args.cwd) if args.cwd is not None else None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if net == "allow" and not allow:
        raise UserError(
            "--net allow needs at least one --allow-host HOST[:PORT] (or run.allow_hosts in "
            f"{userconfig.path()}); use --net none for no network"
        )
    trust = args.trust or cfg.default_trust
    full = gitdir.with_git_dir(project_mod.with_home(cfg, project, workspace, trust), project)
    if args.within is not None:
        try:
            full = nest.within(full, config_mod.WorkerScope.model_validate_json(args.within))
        except ValueError:
            raise UserError("--within: not a worker scope") from None
    try:
        nesting = nest.Nesting() if args.nesting is None else nest.Nesting.parse(args.nesting)
    except (ValueError, KeyError, TypeError):
        raise UserError("--nesting: not a place in a tree of nested runs") from None
    narrowed = _for_worker(args, project, full, trust)
    # A nested child shows its parent's view of the host, and finds CMD inside, in it.
    tools = (
        nesting.view
        if nesting.depth
        else _run_toolchain(args, project, command, env, user, profile, cfg.deny)
    )
    narrowed, session, _ = _session_with_attachments(
        args, project, workspace, full, narrowed, trust
    )
    req = RunRequest(
        project=project,
        trust=trust,
        workspace=workspace,
        session=session,
        config=narrowed,
        command=tuple(command),
        config_file=args.config,
        net=net,
        allow=allow,
        env=env,
        cwd=cwd,
        audit_sync=args.audit_sync,
        quiet=args.quiet,
        tools=tools,
        approvals=_approvals_mode(args, "ask" if sys.stdin.isatty() else "none"),
        report_control=args.report_control,
        nesting=nesting,
    )
    try:
        return run_mod.run(req)
    finally:
        workers.discard_attachments(narrowed)  # copies: what was given is in the audit log


def _check_zones_beside(project: Path, cfg: config_mod.Config, config_file: Path | None) -> None:
    """A zone outside the project, which a project's file names: never what `run --expose`
    would refuse to show (a home or what holds one, a secret, an agent's login, a system
    directory), nor another project with its state dir: a repository's own config shows
    nothing of the user's that the user would not expose. One line, exit 2 (run: 125)."""
    source = str(config_file) if config_file is not None else config_mod.PROJECT_CONFIG_NAME
    limits = toolchain.Limits.of(project, [state_dir(project), state_root()])
    for name, zone in cfg.zones.items():
        path = Path(os.path.realpath(project / Path(zone.path).expanduser()))
        if path.is_relative_to(project) or project.is_relative_to(path):
            continue  # in the project; the project or what holds it is refused later
        why = limits.refusal(str(path))
        if why is None and (path / STATE_DIR_NAME).is_dir():
            why = f"{path} holds a project's state dir ({STATE_DIR_NAME})"
        if why is not None:
            raise UserError(f"{source}: zones.{name}.path: {zone.path!r}: refused: {why}")


def _ignored_network(project: Path, workspace: str, ignored: str) -> None:
    """What the project's file asked of the network beyond the user's choice: one line, and
    an entry in the audit log (op net, refused), before anything starts."""
    print(f"sandboxfs: {ignored}", file=sys.stderr)
    record_now(
        audit_path(project),
        AuditOp.NET,
        zone=None,
        workspace=workspace,
        detail="project config",
        allowed=False,
        reason=ignored,
        nothing_done="; nothing was started",
    )


def _run_toolchain(
    args: argparse.Namespace,
    project: Path,
    command: list[str],
    env: dict[str, str],
    user: userconfig.UserConfig,
    profile: userconfig.AgentProfile | None,
    deny: list[str],
) -> toolchain.Toolchain:
    """What CMD needs of the host and what the user exposes (sandboxfs.run.toolchain), the
    project's deny list holding in it: one line and exit 125 for a path that may not be
    exposed, 127 when CMD cannot run inside."""
    limits = toolchain.Limits.of(project, [state_dir(project), state_root()])
    exposed = [(path, f"{userconfig.path()}: expose:") for path in user.expose]
    if profile is not None:
        exposed += [(path, f"--agent {args.agent}: expose:") for path in profile.expose]
    exposed += [(path, "--expose") for path in args.expose]
    tools = toolchain.expose(exposed, caller_env=os.environ, limits=limits, tools=None, deny=deny)
    for program in profile.programs if profile is not None else ():
        if program == command[0]:
            continue
        try:
            toolchain.resolve(
                [program],
                caller_env=os.environ,
                limits=limits,
                project=project,
                tools=tools,
                strict=False,
            )
        except NotRunnable as exc:
            if not args.quiet:
                print(f"sandboxfs: warning: --agent {args.agent}: {exc.message}", file=sys.stderr)
    return toolchain.resolve(
        command,
        caller_env=os.environ,
        limits=limits,
        project=project,
        tools=tools,
        strict="PATH" not in env,
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = doctor_mod.run_checks()
    print(doctor_mod.report_json(checks) if args.json else doctor_mod.format_report(checks))
    return doctor_mod.exit_code(checks)


# ----- umount and status --------------------------------------------------------------------------


def cmd_umount(args: argparse.Namespace) -> int:
    rundir.sweep_dead_runs()
    control.sweep()  # control sockets of daemons that were killed
    mountpoint = Path(os.path.abspath(args.mountpoint))
    if str(mountpoint) not in sandboxfs_mounts():
        raise UserError(f"{args.mountpoint} is not a sandboxfs mount (see 'sandboxfs status')")
    context = read_context(mountpoint, timeout=2.0)
    owner = mount_owner(str(mountpoint))
    if context == NOT_YOURS and not args.force:
        raise Failure(
            f"{args.mountpoint} is {_user_name(owner)}'s mount, in use by them; "
            + (
                "to unmount it anyway: sandboxfs umount --force " + str(args.mountpoint)
                if os.geteuid() == 0
                else "only they (or root, with --force) can unmount it"
            )
        )
    if context == "unresponsive" and not args.lazy:
        raise Failure(
            f"{args.mountpoint} does not answer (its daemon is alive but hung or very busy); "
            f"detach it now with: sandboxfs umount --lazy {args.mountpoint}"
        )
    dead = context == "dead"
    lazy = dead or args.lazy
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)]
    # Busy for a moment is not busy: a program that just exited, or the daemon's own walk that
    # warms the kernel's cache right after mounting (sandboxfs.fuse.warm), lets go shortly.
    deadline = time.monotonic() + BUSY_WAIT
    while True:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
        if result.returncode == 0 or "busy" not in detail.lower():
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if result.returncode != 0:
        if "busy" in detail.lower():
            raise Failure(
                f"{args.mountpoint} is busy: processes still use it (see: fuser -vm "
                f"{args.mountpoint}); close them, or detach it now with: "
                f"sandboxfs umount --lazy {args.mountpoint}"
            )
        raise Failure(f"cannot unmount {args.mountpoint}: {detail}")
    pid = context.get("pid") if isinstance(context, dict) else None
    if isinstance(pid, int):
        _wait_for_exit(pid, UNMOUNT_WAIT)
    how = " (its daemon had died)" if dead else " (detached: it goes once unused)" if lazy else ""
    print(f"unmounted {args.mountpoint}{how}")
    return 0


def _user_name(uid: int | None) -> str:
    if uid is None:
        return "another user"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


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
    control.sweep()  # control sockets of daemons that were killed
    mounts = sandboxfs_mounts()
    if args.mountpoint is not None:
        wanted = os.path.abspath(args.mountpoint)
        if wanted not in mounts:
            raise UserError(f"{args.mountpoint} is not a sandboxfs mount")
        mounts = [wanted]
    rows: list[dict[str, Any]] = []
    sizes: dict[str, int | None] = {}  # per project: several mounts of one are measured once
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
                    # `sandboxfs run` sessions name their command
                    **({"command": context["command"]} if "command" in context else {}),
                    "pending": _pending_staged(context),
                    "state_dir_bytes": _state_dir_bytes(context, sizes),
                }
            )
        elif context == NOT_YOURS:
            rows.append({"mountpoint": mp, "state": context, "owner": _user_name(mount_owner(mp))})
        elif context == FAILING_CLOSED:
            rows.append({"mountpoint": mp, "state": context, **_failing_closed(mp)})
        else:
            rows.append({"mountpoint": mp, "state": context})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no sandboxfs mounts")
        return 0
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
    return 0


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


def _trust_target(target: str | None, project: Path | None) -> Path:
    """The mount that promote/demote aim at: a mountpoint, a session id, or (none given) the
    only running session of the project."""
    if target is not None and os.path.abspath(target) in sandboxfs_mounts():
        return Path(os.path.abspath(target))
    live = live_contexts()
    if target is not None and ("/" in target or os.path.exists(target)):
        raise UserError(f"{target} is not a sandboxfs mount (see 'sandboxfs status')")
    if target is not None:
        found = [mnt for mnt, context in live if context.get("session") == target]
        if len(found) == 1:
            return Path(found[0])
        sessions = ", ".join(sorted({str(c.get("session")) for _, c in live})) or "none"
        raise UserError(
            f"{target} is neither a sandboxfs mount nor a running session "
            f"(running sessions: {sessions}; see 'sandboxfs status')"
        )
    where = project.resolve() if project is not None else find_project(Path.cwd())
    found = [mnt for mnt, context in live if context.get("project") == str(where)]
    if len(found) == 1:
        return Path(found[0])
    if not found:
        raise UserError(f"no session of {where} is running (see 'sandboxfs status')")
    sessions = ", ".join(
        sorted(str(c.get("session")) for m, c in live if c.get("project") == str(where))
    )
    raise UserError(f"{len(found)} sessions of {where} are running ({sessions}): name one")


def cmd_trust(args: argparse.Namespace) -> int:
    """promote and demote: one request on the mount's control socket."""
    mountpoint = _trust_target(args.mountpoint, args.project)
    args.mountpoint = str(mountpoint)
    context = read_context(mountpoint, timeout=5.0)
    if not isinstance(context, dict):
        why = "it is another user's mount" if context == NOT_YOURS else f"it is {context}"
        raise Failure(f"cannot change the trust level of {args.mountpoint}: {why}")
    levels = list(Trust)
    current, wanted = Trust(str(context.get("trust"))), args.trust
    promote = args.command == "promote"
    if wanted == current:
        raise Failure(f"{args.mountpoint} is at trust level {current.value} already")
    if (levels.index(wanted) > levels.index(current)) != promote:
        other = "demote" if promote else "promote"
        raise UserError(
            f"{wanted.value} is {'below' if promote else 'above'} the current level "
            f"{current.value}: use sandboxfs {other} {args.mountpoint} --trust {wanted.value}"
        )
    path = context.get("control")
    if not isinstance(path, str):
        raise UserError(f"{args.mountpoint} has no control socket (mounted by an older sandboxfs)")
    answer = control.request(Path(path), {"op": "trust", "trust": wanted.value})
    if args.json:
        print(json.dumps(answer))
    if not answer.get("ok"):
        raise Failure(f"the daemon refused: {answer.get('error')}")
    if not args.json:
        print(f"{args.mountpoint}: trust {answer.get('old')} -> {answer.get('new')}")
    return 0


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


def cmd_completion(args: argparse.Namespace) -> int:
    print(completion.script(build_parser(), args.shell), end="")  # script() annotates its parser
    return 0


def cmd_staged(args: argparse.Namespace) -> int:
    """`sandboxfs staged`: its module, and sandboxfs.staging, imported only when it runs."""
    from sandboxfs.cli import staged as staged_cli

    return staged_cli.main(args)


def cmd_man(args: argparse.Namespace) -> int:
    print(manpage.render(build_parser(), _version()), end="")
    return 0


# Each subcommand's parser, in the order --help lists them. A command line that names one gets
# only that one built: the others' options are a tenth of a short command's run time.
_SUBCOMMANDS: tuple[
    tuple[tuple[str, ...], Callable[[argparse._SubParsersAction[_Parser]], None]], ...
] = (
    (("mount",), _mount_parser),
    (("run",), _run_parser),
    (("doctor",), _doctor_parser),
    (("umount",), _umount_parser),
    (("status",), _status_parser),
    (("promote", "demote"), _trust_parsers),
    (
        ("approvals", "approve", "deny", "grants"),
        lambda sub: approvals_cli.add_parsers(sub, _approvals_target),
    ),
    (
        ("audit",),
        lambda sub: audit_cli.add_parser(
            sub, trust_type=_trust, when_type=_when, positive_type=_positive
        ),
    ),
    (("staged",), staged_parser.add_parser),
    (("sessions",), sessions_cli.add_parser),
    (("home",), home_mod.add_parser),
    (("workers",), workers_cli.add_parser),
    (("completion",), _completion_parser),
    (("man",), _man_parser),
)


COMMANDS = {
    "mount": cmd_mount,
    "run": cmd_run,
    "doctor": cmd_doctor,
    "completion": cmd_completion,
    "man": cmd_man,
    "umount": cmd_umount,
    "status": cmd_status,
    "promote": cmd_trust,
    "demote": cmd_trust,
    "approvals": cmd_approvals,
    "approve": cmd_approvals,
    "deny": cmd_approvals,
    "grants": cmd_approvals,
    "audit": audit_cli.main,
    "staged": cmd_staged,
    "sessions": sessions_cli.main,
    "home": home_mod.main,
    "workers": workers_cli.main,
}


def exit_code(exc: SandboxfsError, run: bool) -> int:
    """The one place an error's kind becomes an exit code: 2 for bad input, 1 for a failure;
    `run` answers as `docker run` does: 125 when the sandbox could not be set up or the
    input was bad (the program never ran), 126 and 127 when the program cannot run."""
    if isinstance(exc, CannotExecute):
        return EXIT_CANNOT_EXECUTE
    if isinstance(exc, NotRunnable):
        return EXIT_NOT_FOUND
    if isinstance(exc, SetupError) or (run and isinstance(exc, UserError)):
        return EXIT_SETUP
    return 2 if isinstance(exc, UserError) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(argv[0] if argv[:1] and argv[0] in COMMANDS else None).parse_args(argv)
        return COMMANDS[args.command](args)
    except SandboxfsError as exc:
        print(f"sandboxfs: {exc.message}", file=sys.stderr)
        return exit_code(exc, argv[:1] == ["run"])
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug of sandboxfs's: one line, the traceback kept in a file
        where = _write_crash_report(argv)
        detail = cut((str(exc).splitlines() or [""])[0])
        saved = f"the full traceback is in {where}" if where else "no traceback could be saved"
        print(
            f"sandboxfs: internal error: {type(exc).__name__}: {detail}; {saved} "
            f"(please report it)",
            file=sys.stderr,
        )
        return EXIT_SETUP if argv[:1] == ["run"] else 1


def _write_crash_report(argv: Sequence[str]) -> Path | None:
    """The traceback being handled, in `crash-<time>.txt` in the user's state dir (0600)."""
    import traceback

    text = f"sandboxfs {_version()}\nargv: {shlex.join(argv)}\n\n{traceback.format_exc()}"
    try:
        directory = state_root()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        path = directory / f"crash-{stamp}-{os.getpid()}.txt"
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(text)
    except OSError:
        return None
    return path


def entry() -> NoReturn:
    """The console script: `main`, then out without the interpreter's teardown.

    Tearing down the ~400 modules a command loads takes about 50 ms, a tenth of `run -- true`,
    and does nothing a command needs: every file sandboxfs writes is closed where it is written
    (`with` blocks, descriptors), and the audit log is flushed before its entry's call returns.
    What does need it is done here: standard output and error flushed, logging's handlers
    closed. A non-daemon thread still running gets the normal exit, which waits for it.
    """
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream
            stream.flush()
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    entry()
