"""A project on disk: its state dir, the backing directory of every zone, and the guard that
enforces its config. Shared by the mount, `run` and the Python API, so all three see the same
zones, deny list, limits and audit log; nothing here imports pyfuse3 or trio.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

from .audit_anchor import state_root
from .config import PROJECT_CONFIG_NAME, Config
from .core.errors import SandboxError
from .core.guard import AuditSink, Guard, MountInfo
from .core.limits import Tally
from .core.policy import Policy, Trust, Zone
from .core.store import STATE_DIR_NAME, Store, ensure_dirs
from .errors import UserError

SESSION_SUBDIRS = ("inputs", "working", "outputs", "home")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def new_session_id() -> str:
    return secrets.token_hex(4)


def check_id(kind: str, value: str) -> str:
    if not _ID_RE.match(value):
        raise UserError(
            f"invalid {kind} id {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )
    return value


def hidden_identities(project: Path, mountpoint: Path | None = None) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of the directories no zone ever shows: the state dir, hidden by
    identity rather than name (on case-folding storage `.SANDBOX` is the same directory), the
    user's own state dir (the audit log's key) should the project contain it, and the
    mountpoint."""
    hidden: set[tuple[int, int]] = set()
    for path in (state_dir(project), state_root(), mountpoint):
        if path is None:
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        hidden.add((st.st_dev, st.st_ino))
    return hidden


def state_dir(project: Path) -> Path:
    return project / STATE_DIR_NAME


def audit_path(project: Path) -> Path:
    return state_dir(project) / "audit.jsonl"


def session_dir(project: Path, workspace: str, session: str) -> Path:
    return state_dir(project) / "workspaces" / workspace / "sessions" / session


def validate_project(project: Path) -> Path:
    if not project.exists():
        raise UserError(f"project directory {project} does not exist")
    if not project.is_dir():
        raise UserError(f"project {project} is not a directory")
    return project.resolve()


def worker_layers(project: Path) -> list[Path]:
    layers = [project / ".workers"]
    for entry in os.environ.get("SANDBOXFS_WORKERS_PATH", "").split(":"):
        if entry:
            layers.append(Path(entry).expanduser().resolve())
    return layers


def project_zone_dirs(project: Path, config: Config, source: str) -> dict[Zone, Path]:
    """The backing directory of each project zone, checked: it exists, is a directory, and
    overlaps neither another project zone, the workers directory, the state dir nor the
    project as a whole (a zone inside the project is fine: /repo shows it too)."""
    dirs: dict[Zone, Path] = {}
    state = state_dir(project).resolve()
    workers = (project / ".workers").resolve()
    user_state = state_root().resolve()
    for name, zone in config.zones.items():
        raw = Path(zone.path).expanduser()
        path = (raw if raw.is_absolute() else project / raw).resolve()
        where = f"{source}: zones.{name}.path: {zone.path!r}"
        if _overlaps(path, project) and not _inside(path, project):
            raise UserError(f"{where}: {path} contains the project; a zone must lie beside it")
        if path == project:
            raise UserError(f"{where}: that is the project itself, which /repo already shows")
        if path == user_state or _inside(path, user_state):
            raise UserError(
                f"{where}: {path} is in your sandboxfs state dir ({user_state}), which holds "
                f"the audit log's key; no zone may show it"
            )
        for other, label in [(state, "the state dir"), (workers, "/workers")] + [
            (p, f"zone {z.value}") for z, p in dirs.items()
        ]:
            if _overlaps(path, other):
                raise UserError(f"{where}: {path} overlaps {label} ({other})")
        if not path.exists():
            raise UserError(f"{where}: {path} does not exist; create the directory first")
        if not path.is_dir():
            raise UserError(f"{where}: {path} is not a directory")
        dirs[Zone(name)] = path
    return dirs


def _inside(path: Path, other: Path) -> bool:
    return path != other and path.is_relative_to(other)


def _overlaps(path: Path, other: Path) -> bool:
    return path == other or path.is_relative_to(other) or other.is_relative_to(path)


def prepare_zones(
    project: Path, workspace: str, session: str, config: Config, source: str
) -> dict[Zone, Path]:
    """Create the state dir's zone directories for a session and return every zone's
    backing directory (the built-in ones but /workers, and the project's)."""
    zone_dirs = project_zone_dirs(project, config, source)
    ws = ("workspaces", workspace)
    try:
        _ignore_in_git(ensure_dirs(project, STATE_DIR_NAME))
        session_path = ensure_dirs(project, STATE_DIR_NAME, *ws, "sessions", session)
        for name in SESSION_SUBDIRS:
            ensure_dirs(session_path, name, mode=0o755)
        workspace_path = ensure_dirs(project, STATE_DIR_NAME, *ws, "workspace")
        for sub in (("cache", "web"), ("cache", "pdfs"), ("cache", "attachments"), ("data",)):
            ensure_dirs(workspace_path, *sub, mode=0o755)
        staged = ensure_dirs(project, STATE_DIR_NAME, *ws, "staged")
    except SandboxError as exc:
        raise UserError(f"cannot create the state dir: {exc.reason}") from None
    except OSError as exc:
        raise UserError(f"cannot create the state dir under {project}: {exc.strerror}") from None
    return {
        Zone.SESSION: session_path,
        Zone.WORKSPACE: workspace_path,
        Zone.REPO: project,
        Zone.STAGED: staged,
        **zone_dirs,
    }


def _ignore_in_git(state: Path) -> None:
    """`.sandbox/.gitignore` of `*`: `git add -A` in the project never takes the audit log,
    sessions or workspaces. Created without following a planted link, never rewritten."""
    with contextlib.suppress(FileExistsError):
        fd = os.open(
            state / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644
        )
        try:
            os.write(fd, b"# sandboxfs state: sessions, workspaces, audit log. Not for git.\n*\n")
        finally:
            os.close(fd)


def protected_patterns(project: Path, config: Config, config_file: Path | None) -> list[str]:
    """The config's protect list, plus the config file given with --config when it lies
    inside the project (the mount must not let an agent choose its next policy)."""
    patterns = list(config.protect)
    if config_file is not None:
        try:
            inside = config_file.resolve().relative_to(project)
        except ValueError:
            return patterns
        patterns.append("/" + inside.as_posix())
    return patterns


def config_source(project: Path, config_file: Path | None) -> str:
    return str(config_file if config_file is not None else project / PROJECT_CONFIG_NAME)


def make_guard(
    project: Path,
    config: Config,
    config_file: Path | None,
    trust: Trust,
    info: MountInfo,
    store: Store,
    audit: AuditSink,
) -> Guard:
    """The guard of one mount or sandbox: the policy, the limits, and a quota tally per zone
    that has one (shared through files in the state dir by every mount of the project)."""
    policy = Policy(
        config.matrix(), config.deny, trust, protected_patterns(project, config, config_file)
    )
    limits = config.zone_limits()
    tallies: dict[Zone, Tally] = {}
    with _closing_on_error(tallies):
        for zone, zone_limits in limits.items():
            if zone_limits.has_quota and zone_limits.quota is not None:
                root = store.zone_roots[zone]
                assert root.key is not None
                quotas = ensure_dirs(project, STATE_DIR_NAME, "quota")
                path = quotas / f"{zone.value}-{root.key[1]}-{root.key[2]}"
                tallies[zone] = Tally(zone.value, zone_limits.quota, path, _usage(store, zone))
    return Guard(
        policy,
        audit,
        info,
        moves=lambda: store.moves,
        limits=limits,
        tallies=tallies,
        frozen=_under_review(review_dir(project, info.workspace)),
    )


def review_dir(project: Path, workspace: str) -> Path:
    """Where the user's review of staged commits is kept (sandboxfs.staging): beside the
    staged zone's directory, in no zone."""
    return state_dir(project) / "workspaces" / workspace / "review"


def _under_review(review: Path) -> Callable[[str], bool]:
    def frozen(commit_id: str) -> bool:
        return commit_id not in ("", ".", "..") and (review / commit_id / "state.json").exists()

    return frozen


def _usage(store: Store, zone: Zone) -> Callable[[], tuple[int, int]]:
    return lambda: store.usage(zone)


@contextlib.contextmanager
def _closing_on_error(tallies: dict[Zone, Tally]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for tally in tallies.values():
            tally.close()
        raise
