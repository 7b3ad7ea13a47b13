"""What `sandboxfs mount` and `sandboxfs run` share: the options naming the project, its
workspace, session, worker and approvals, and the checks and the session set-up both make
before anything starts (one place, so that the two never drift apart)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sandboxfs.config import model as config_mod
from sandboxfs.core.policy import Trust
from sandboxfs.errors import UserError
from sandboxfs.layout import STATE_DIR_NAME, interrupted_landings, state_dir, state_root
from sandboxfs.project import workers
from sandboxfs.project.mounts import choose_session, discard_new_session
from sandboxfs.project.zones import check_home_project, home_project_config
from sandboxfs.run import toolchain


def project_options(parser: argparse.ArgumentParser) -> None:
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


def approvals_options(parser: argparse.ArgumentParser, none: str) -> None:
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


def approvals_mode(args: argparse.Namespace, default: str) -> str:
    """The approvals mode asked for (`default` when none is); --no-approvals says, on stderr,
    that it lets every `ask` rule pass."""
    if args.no_approvals:
        print(
            "sandboxfs: warning: --no-approvals: operations that approval rules ask about "
            "go ahead without asking (each is audited)",
            file=sys.stderr,
        )
        return "off"
    return str(args.approvals or default)


def load_config(args: argparse.Namespace, project: Path) -> config_mod.Config:
    """The project's config (--config, else its sandboxfs.yaml), with a home project's logins
    hidden where --allow-home-project lets the project be a home; its zones outside the
    project checked (check_zones_beside)."""
    home = check_home_project(project, args.allow_home_project)
    cfg = config_mod.load(project, args.config)
    if home:
        cfg = home_project_config(cfg, project)
    check_zones_beside(project, cfg, args.config)
    return cfg


def check_zones_beside(project: Path, cfg: config_mod.Config, config_file: Path | None) -> None:
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


def recover_landings(project: Path, workspace: str) -> None:
    """The landings a kill interrupted, finished or rolled back before a session starts over
    them (sandboxfs.cli.staged.recover_interrupted)."""
    if not interrupted_landings(project, workspace):
        return  # the staging code is loaded only when a kill left a landing to finish
    from sandboxfs.cli.staged import recover_interrupted

    recover_interrupted(project, workspace)


def for_worker(
    args: argparse.Namespace, project: Path, cfg: config_mod.Config, trust: Trust
) -> config_mod.Config:
    """`cfg` narrowed to the --worker's declaration (sandboxfs.project.workers), or as it is."""
    if args.worker is None:
        return cfg
    return workers.narrow(cfg, trust, workers.find(project, args.worker, cfg))


def session_with_attachments(
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
