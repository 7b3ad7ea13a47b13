"""`sandboxfs run`: its options and the command, which turns them into a run request for
sandboxfs.run.supervisor: CMD confined to a private mount of the project."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TypeVar

from sandboxfs.audit.writer import record_now
from sandboxfs.cli import launch
from sandboxfs.cli.subcommands import trust_level
from sandboxfs.config import model as config_mod
from sandboxfs.config import user as userconfig
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.syscalls import die_with_parent
from sandboxfs.errors import NotRunnable, SetupError, UserError
from sandboxfs.layout import audit_path, state_dir, state_root
from sandboxfs.project import gitdir, state, workers
from sandboxfs.project import zones as project_mod
from sandboxfs.project.zones import (
    check_id,
    validate_project,
)
from sandboxfs.run import allowlist, confine, nest, registries, toolchain
from sandboxfs.run import supervisor as run_mod
from sandboxfs.run.request import RunRequest

P = TypeVar("P", bound=argparse.ArgumentParser)


def add_parser(sub: argparse._SubParsersAction[P]) -> None:
    """The options of `sandboxfs run`."""
    run = sub.add_parser(
        "run",
        help="run a command confined to a private mount of the project",
        description="Mount the project privately, run CMD inside a bubblewrap sandbox whose only "
        "view of it is the mount (at /sandbox), unmount, and exit with CMD's status "
        "(125: the sandbox could not be set up; 126: CMD cannot be executed; 127: not found).",
    )
    run.add_argument(
        "--trust", type=trust_level, help="as for mount (default: config, else session)"
    )
    launch.project_options(run)
    launch.approvals_options(
        run, "none: refuse them at once (the default when stdin is no terminal)"
    )
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


def main(args: argparse.Namespace) -> int:
    """Every option is checked, and what CMD needs of the host found, before anything starts:
    a refusal is one line, its exit code run's (sandboxfs.cli.main.exit_code)."""
    if args.parent_pid is not None:  # a nested child (sandboxfs.run.nest)
        die_with_parent(signal.SIGTERM)
        if os.getppid() != args.parent_pid:  # the parent ended before that took effect
            raise SetupError("the run that started this child has ended")
    state.check_state_root()  # before anything is written: the audit log's key is there
    command = _command(args.argv)
    project = validate_project(args.project)
    cfg = launch.load_config(args, project)
    workspace = check_id("workspace", args.workspace)
    launch.recover_landings(project, workspace)
    user = userconfig.load()
    profile = userconfig.agent(args.agent, user) if args.agent is not None else None
    net, hosts = _network(args, project, workspace, cfg, user, profile)
    try:
        allow = tuple(allowlist.parse_allow_host(h) for h in hosts) if net == "allow" else ()
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
    full = _within(args, full)
    nesting = _nesting(args)
    narrowed = launch.for_worker(args, project, full, trust)
    # A nested child shows its parent's view of the host, and finds CMD inside, in it.
    tools = (
        nesting.view
        if nesting.depth
        else _run_toolchain(args, project, command, env, user, profile, cfg.deny)
    )
    narrowed, session, _ = launch.session_with_attachments(
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
        approvals=launch.approvals_mode(args, "ask" if sys.stdin.isatty() else "none"),
        report_control=args.report_control,
        nesting=nesting,
    )
    try:
        return run_mod.run(req)
    finally:
        workers.discard_attachments(narrowed)  # copies: what was given is in the audit log


def _command(argv: list[str]) -> list[str]:
    """CMD and its arguments, after the `--` that separates them from run's options."""
    command = list(argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UserError("run needs a command: sandboxfs run [OPTIONS] -- CMD [ARG...]")
    return command


def _network(
    args: argparse.Namespace,
    project: Path,
    workspace: str,
    cfg: config_mod.Config,
    user: userconfig.UserConfig,
    profile: userconfig.AgentProfile | None,
) -> tuple[str, list[str]]:
    """The run's network mode and --net allow's hosts, as the user chose them
    (userconfig.network_choice); what the project's file asked beyond that is said and
    audited (_ignored_network)."""
    source = str(args.config) if args.config is not None else config_mod.PROJECT_CONFIG_NAME
    asked = [*args.allow_host, *registries.hosts(args.allow)]
    chosen = userconfig.network_choice(args.net, asked, profile, user, cfg.run, source)
    if asked and chosen.mode != "allow":
        raise UserError(f"{'--allow-host' if args.allow_host else '--allow'} needs --net allow")
    if chosen.ignored is not None:
        _ignored_network(project, workspace, chosen.ignored)
    return chosen.mode, chosen.hosts


def _within(args: argparse.Namespace, full: config_mod.Config) -> config_mod.Config:
    """`full` within --within, the ceiling a nested child's parent run passes (its zones)."""
    if args.within is None:
        return full
    try:
        return nest.within(full, config_mod.WorkerScope.model_validate_json(args.within))
    except ValueError:
        raise UserError("--within: not a worker scope") from None


def _nesting(args: argparse.Namespace) -> nest.Nesting:
    """This run's place in its tree of nested runs (--nesting; a top-level run's own)."""
    try:
        return nest.Nesting() if args.nesting is None else nest.Nesting.parse(args.nesting)
    except (ValueError, KeyError, TypeError):
        raise UserError("--nesting: not a place in a tree of nested runs") from None


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
