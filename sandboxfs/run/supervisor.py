"""`sandboxfs run -- CMD`: a program inside the sandbox, from mount to unmount.

Three processes. The daemon serves a private mount of the project (forked first; it holds the
backing storage and dies with the lifeline pipe when this process goes). This process, the
supervisor, is non-dumpable: it relays the terminal, forwards signals, runs the network proxy
and writes the run's audit entries. bubblewrap runs CMD in the view `confine` describes. If
anything of that cannot be set up, CMD is not started: there is no unconfined fallback.

This module only puts the steps in order; each is a module of its own: the run directory
(`rundir`), starting and stopping bubblewrap and the daemon (`processes`), the wait for the
program (`waitloop`) with its terminal relay (`terminal`) and signals (`signals`), the network
namespace's DNS stub and proxy (`network`), and what the run records and prints (`report`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandboxfs import layout
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.policy import Op, Policy, Zone
from sandboxfs.core.resolve import ensure_dirs
from sandboxfs.core.syscalls import make_undumpable, write_all
from sandboxfs.errors import SandboxfsError, SetupError
from sandboxfs.fuse.spawn import Starting, start_daemon
from sandboxfs.project import control, gitdir, prompt
from sandboxfs.project.identity import project_identity
from sandboxfs.project.mounts import MountRequest
from sandboxfs.project.zones import CONFINED_HOME, HOME_ZONE
from sandboxfs.run import confine, doctor, home, seccomp
from sandboxfs.run.allowlist import rule_text
from sandboxfs.run.approval_notices import ApprovalNotices
from sandboxfs.run.nest import NEST_DIR, NestServer, child_argv
from sandboxfs.run.network import Network
from sandboxfs.run.processes import abandon_daemon, daemon_ended, start_child, stop_daemon
from sandboxfs.run.report import RunAudit, start_line, summary
from sandboxfs.run.request import EXIT_SETUP, RunRequest, exit_status
from sandboxfs.run.rundir import make_run_dir, record_process, remove_run_dir, sweep_dead_runs
from sandboxfs.run.screen import Hold
from sandboxfs.run.terminal import Terminal, TerminalRelay, write_out
from sandboxfs.run.waitloop import WaitLoop


def run(req: RunRequest) -> int:
    """Mount, start CMD confined, wait, unmount; CMD's exit status (125 if it never started)."""
    problem = doctor.confinement_problem()
    if problem is not None:
        raise SetupError(problem)
    bwrap = shutil.which("bwrap")
    if bwrap is None:  # checked by confinement_problem, unless PATH changed meanwhile
        raise SetupError(
            "bubblewrap (bwrap) is not installed; install it: apt-get install bubblewrap"
        )
    try:
        seccomp.build_filter()
    except seccomp.SeccompUnsupported as exc:
        raise SetupError(str(exc)) from None
    if shutil.which("setsid", path="/usr/bin:/bin") is None:
        raise SetupError("setsid is not in /usr/bin; install it: apt-get install util-linux")
    make_undumpable()
    sweep_dead_runs()
    cwd = _start_dir(req)
    if req.net == "host" and not req.quiet:
        print(
            "sandboxfs: warning: --net host: the program shares this machine's network, "
            "its loopback services and abstract sockets",
            file=sys.stderr,
        )
    audit = RunAudit(req)
    run_dir = make_run_dir(req.session)
    in_use = home.hold(req.project, req.workspace, req.trust)  # `home reset` waits for it
    try:
        who = project_identity(req.project)
        _identity_in_home(req, in_use, who)
        return _run_mounted(req, audit, run_dir, cwd, bwrap, who)
    finally:
        audit.close()
        remove_run_dir(run_dir)  # normally gone already: the daemon removes it
        if in_use is not None:
            os.close(in_use)


def _start_dir(req: RunRequest) -> str:
    """Where CMD starts: --cwd, else the repository where it may list it, else the session's
    working directory, else the sandbox's top."""
    policy = Policy(req.config.matrix(), req.config.deny, req.trust, req.config.protect)
    if req.cwd is not None:
        return req.cwd
    if Zone.REPO in policy.zones and Op.LIST in policy.access(Zone.REPO).ops:
        return f"{confine.SANDBOX}/repo"
    if Zone.SESSION in policy.zones:
        return f"{confine.SANDBOX}/session/working"
    return confine.SANDBOX  # a worker that declared neither (sandboxfs.project.workers)


def _identity_in_home(req: RunRequest, in_use: int | None, who: Mapping[str, str]) -> None:
    """The user's git identity in the program's home (its ~/.gitconfig; home.give_identity):
    the workspace's home at this level, or the session's home for a worker without one."""
    if HOME_ZONE in req.config.zones:
        if in_use is not None:
            home.give_identity(in_use, who)
        return
    if req.config.worker is not None and "session" not in req.config.worker.zones:
        return  # its home is the private /tmp: GIT_AUTHOR_* only
    try:
        session = ensure_dirs(req.project, *layout.session_parts(req.workspace, req.session))
        fd = os.open(ensure_dirs(session, "home", mode=0o755), home.DIR_FLAGS)
    except (OSError, SandboxError):
        return
    try:
        home.give_identity(fd, who)
    finally:
        os.close(fd)


def _run_mounted(
    req: RunRequest, audit: RunAudit, run_dir: Path, cwd: str, bwrap: str, who: dict[str, str]
) -> int:
    """The daemon mounting while bubblewrap's view is prepared, then CMD; and whatever of that
    happened, the end: the closing audit entry, the unmount, the summary."""
    mnt = run_dir / "mnt"
    starting, lifeline_w = _start_mount(req, run_dir)
    try:
        view = _prepare(req, audit, run_dir, cwd, who)
    except BaseException:
        abandon_daemon(starting, lifeline_w, mnt)  # its own failure first, as it comes first
        raise
    daemon = _mounted(starting, lifeline_w, view)
    record_process(run_dir / "daemon", daemon)  # the sweep clears the mount if it dies
    view.nest.control = control.socket_path(daemon)  # where children's level is asked
    if req.report_control is not None:  # a nested child: its parent's terminal asks for it
        with contextlib.suppress(OSError):
            write_all(req.report_control, str(control.socket_path(daemon)).encode())
        with contextlib.suppress(OSError):
            os.close(req.report_control)
    program = _Program(req, audit, daemon, started=datetime.now(UTC))
    try:
        return program.run(bwrap, mnt, cwd, view)
    finally:
        view.close()
        program.close()
        program.audit_end()
        problem = stop_daemon(daemon, lifeline_w, mnt, program.lost)
        if problem is not None:
            print(f"sandboxfs: {problem}", file=sys.stderr)
        if program.ran and program.status is not None and not req.quiet:
            print(summary(req, program.started, program.status, program.lost), file=sys.stderr)


def _start_mount(req: RunRequest, run_dir: Path) -> tuple[Starting, int]:
    """Fork the daemon of the run's private mount, which mounts while the rest is prepared; and
    the write end of its lifeline, which it unmounts and exits on once closed."""
    lifeline_r, lifeline_w = os.pipe()
    mount = MountRequest(
        mountpoint=run_dir / "mnt",
        project=req.project,
        trust=req.trust,
        workspace=req.workspace,
        session=req.session,
        config=req.config,
        audit_sync=req.audit_sync,
        config_file=req.config_file,
        command=req.command,
        approvals=req.approvals,
    )
    try:
        # The forked daemon imports pyfuse3 and trio (this process never does), then mounts.
        starting = start_daemon(mount, lifeline_r, after=lambda: remove_run_dir(run_dir))
    except BaseException:
        os.close(lifeline_w)
        raise
    finally:
        os.close(lifeline_r)
    return starting, lifeline_w


@dataclass
class _View:
    """What bubblewrap is given, made while the daemon mounts: the program's environment,
    bubblewrap's options, the nest server they show inside, and the /etc files they copy."""

    env: dict[str, str]
    options: list[str]
    nest: NestServer
    etc_copies: confine.EtcCopies

    def close(self) -> None:
        self.etc_copies.close()
        self.nest.close()


def _prepare(
    req: RunRequest, audit: RunAudit, run_dir: Path, cwd: str, who: dict[str, str]
) -> _View:
    """What does not look inside the mount, so it is made while the daemon mounts: the
    program's environment, the nest server and bubblewrap's options (they name the mountpoint,
    never read it). What was made is closed again if the rest cannot be."""
    mnt = run_dir / "mnt"
    nest: NestServer | None = None
    etc_copies = confine.EtcCopies(confine.ETC_COPY_FD)
    try:
        env = confine.sandbox_env(
            os.environ,
            home=_home_inside(req),
            path=req.tools.env_path(),
            session=req.session,
            # commits carry the user's name; a worktree's metadata is never pruned by gc inside
            extra={**who, **gitdir.environment(req.config), **req.env},
            proxy=req.net == "allow",
        )
        # The git directory of a worktree project, at the path its .git file names (gitdir).
        binds = gitdir.bwrap_binds(req.config, req.trust, mnt)
        # Child workers started from inside, never with more than this sandbox (sandboxfs.run.nest).
        nest = _nest_server(req, audit, run_dir)
        env["PATH"] = f"{NEST_DIR}/bin:{env['PATH']}"
        options = confine.bwrap_args(
            mountpoint=mnt,
            cwd=cwd,
            net=req.net,
            tools=[*binds, *nest.bwrap_args(), *req.tools.bwrap_args()],
            etc_copies=etc_copies,
        )
    except BaseException:
        etc_copies.close()
        if nest is not None:
            nest.close()
        raise
    return _View(env, options, nest, etc_copies)


def _home_inside(req: RunRequest) -> str:
    """The program's $HOME: the workspace's home at this level (project.with_home), else the
    session's, else (a worker with neither zone) the private /tmp."""
    if HOME_ZONE in req.config.zones:
        return CONFINED_HOME
    if req.config.worker is not None and "session" not in req.config.worker.zones:
        return "/tmp"
    return f"{confine.SANDBOX}/session/home"


def _mounted(starting: Starting, lifeline_w: int, view: _View) -> int:
    """The daemon's pid once its mount answers. If it does not, what was prepared is closed
    and the lifeline too, and the daemon's error is raised as a SetupError."""
    try:
        return starting.ready()
    except BaseException as exc:
        view.close()
        os.close(lifeline_w)
        if isinstance(exc, SandboxfsError):
            raise SetupError(exc.message) from None
        raise


@dataclass
class _Program:
    """CMD, from its start in the mounted sandbox to its end; and what the end of the run needs
    to know of it however far it got: whether it ran, its status, whether the mount was lost."""

    req: RunRequest
    audit: RunAudit
    daemon: int
    started: datetime
    status: int | None = None
    ran: bool = False  # CMD was started (the launcher ran inside)
    lost: str | None = None  # how the daemon ended while the program ran (the mount was lost)
    terminal: Terminal | None = None
    network: Network | None = None
    notices: ApprovalNotices | None = None

    def run(self, bwrap: str, mnt: Path, cwd: str, view: _View) -> int:
        """Start CMD, wait for it; its exit status as run's (a lost mount is no success)."""
        req = self.req
        if not (mnt / cwd.removeprefix(confine.SANDBOX).lstrip("/")).is_dir():
            raise SetupError(
                f"--cwd {cwd}: not a directory the program may enter at this trust level"
            )
        # never the terminal itself: run's pty or pipes
        self.terminal = terminal = Terminal.of_stdio()
        interactive = terminal is not None and terminal.controlling
        argv = [bwrap, "--args", str(confine.ARGS_FD), "--"]
        argv += confine.launcher_argv(interactive, req.command)
        self._audit_start()
        stdio = terminal.program if terminal else (0, 1, 2)
        child = start_child(argv, view.options, view.env, stdio, req.net, view.etc_copies.fds)
        view.etc_copies.close()
        if terminal is not None:
            terminal.started()
        hold = Hold(lambda data: write_out(2, data), terminal is not None and terminal.stderr_here)
        if req.net != "host":
            control_path = control.socket_path(self.daemon)
            self.network = Network(req, self.audit, child, control_path, hold.line)
        loop = WaitLoop(child, terminal, hold)
        if loop.relay is not None:
            _prompt_here(req, loop.relay, view.nest, self.daemon)
        tells_here = req.approvals != "off" and req.report_control is None
        if tells_here and (loop.relay is None or loop.relay.prompt is None):
            self.notices = ApprovalNotices(control.socket_path(self.daemon), hold.line)
        if not req.quiet:  # said once the sandbox is up: a setup error stays one line
            policy = Policy(req.config.matrix(), req.config.deny, req.trust, req.config.protect)
            loop.on_ready = lambda: hold.line(start_line(req, policy, cwd))
        self.status = status = loop.wait()  # the terminal is raw only in there
        self.ran = loop.ready
        if not self.ran:
            raise SetupError(_setup_failure(loop.setup_text, status))
        self.lost = daemon_ended(self.daemon)
        return exit_status(status, self.lost)

    def close(self) -> None:
        if self.terminal is not None:
            self.terminal.close()
        if self.notices is not None:
            self.notices.close()
        if self.network is not None:
            self.network.close()

    def _audit_start(self) -> None:
        req = self.req
        self.audit.record(
            AuditOp.RUN,
            pid=os.getpid(),
            comm="sandboxfs",
            detail=f"start (net {req.net}): {shlex.join(req.command)}",
            extra={
                "command": list(req.command),
                "net": req.net,
                "allow_hosts": [rule_text(r) for r in req.allow],
            },
        )

    def audit_end(self) -> None:
        """The run's closing entry, once bubblewrap was waited for (none when it never was)."""
        req, status = self.req, self.status
        if status is None:
            return
        detail = f"exit {status}" if self.ran else f"not started (exit {EXIT_SETUP})"
        extra: dict[str, Any] = {}
        if self.lost is not None:
            detail += f", mount lost: the daemon {self.lost}"
            extra = {"mount_lost": self.lost, "exit": exit_status(status, self.lost)}
        with contextlib.suppress(OSError):
            self.audit.record(
                AuditOp.RUN,
                pid=os.getpid(),
                comm="sandboxfs",
                detail=f"{detail}: {shlex.join(req.command)}",
                extra={
                    "command": list(req.command),
                    "net": req.net,
                    "status": status if self.ran else EXIT_SETUP,
                    **extra,
                },
            )


def _prompt_here(req: RunRequest, relay: TerminalRelay, nest: NestServer, daemon: int) -> None:
    """The approval prompt in this very terminal, for this run and the children started inside:
    where the program has the keyboard, and no parent's terminal asks for this run instead."""
    terminal = relay.terminal
    screen = terminal.screen if terminal.keyboard else None
    asks_here = req.approvals == "ask" and req.report_control is None
    if screen is None or not asks_here:
        return
    relay.prompt = prompt.RelayPrompt(
        control.socket_path(daemon),
        lambda data: write_out(screen, data),
        nest.prompts,
        size=terminal.size,
        tell=relay.hold.line,
        discard=terminal.discard_typed,
        alternate=lambda: terminal.full_screen.on,
    )
    nest.prompt_here = True


def _nest_server(req: RunRequest, audit: RunAudit, run_dir: Path) -> NestServer:
    """The socket a program inside starts child workers through (sandboxfs.run.nest), with this
    run's config as their ceiling and its mount's current trust level (its daemon's, once
    `control` is set) as their highest."""
    build = child_argv(req.project, req.workspace, req.config_file, req.config.worker)
    return NestServer(
        run_dir, req.project, req.config, req.trust, build, audit.record, req.nesting, req.tools
    )


def _setup_failure(text: bytes, status: int) -> str:
    lines = [line for line in text.decode("utf-8", "replace").splitlines() if line.strip()]
    detail = lines[-1].strip() if lines else f"bubblewrap exited with status {status}"
    return f"cannot start the sandbox: {detail} (run 'sandboxfs doctor' to check this machine)"
