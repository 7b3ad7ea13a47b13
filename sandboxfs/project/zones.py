"""A project on disk: its state dir, the backing directory of every zone, and the guard that
enforces its config. Shared by the mount, `run` and the Python API, so all three see the same
zones, deny list, limits and audit log; nothing here imports pyfuse3 or trio.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath

from sandboxfs import layout
from sandboxfs.config import user as userconfig
from sandboxfs.config.inputs import shown
from sandboxfs.config.model import (
    PROJECT_CONFIG_NAME,
    Config,
    ZoneConfig,
    git_surface_protect,
    make_broker,
)
from sandboxfs.core.approvals import Broker, Mode
from sandboxfs.core.context import CONFINED_MOUNTPOINT
from sandboxfs.core.effects import AuditSink
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.guard import Guard
from sandboxfs.core.limits import Tally
from sandboxfs.core.policy import BUILTIN_ZONES, Policy, Trust, Zone, fold
from sandboxfs.core.resolve import ensure_dirs
from sandboxfs.core.rulebase import MountInfo
from sandboxfs.core.secrets import KeyScanner, StoreContents
from sandboxfs.core.store import STATE_DIR_NAME, Store
from sandboxfs.errors import UserError
from sandboxfs.layout import review_dir, state_dir, state_root
from sandboxfs.project.gitdir import git_dir_zones

SESSION_SUBDIRS = ("inputs", "working", "outputs", "home")
# Under `sandboxfs run` the program's $HOME is this zone, at /sandbox/home: a directory per
# workspace and trust level in the state dir (`workspaces/<ws>/homes/<level>/`), kept across
# sessions, so an agent's settings and login persist; one per level, so that nothing a program
# writes there at one level (a shell rc, a git config, an agent's hooks, a planted .pyc) is
# run by a program at another.
HOME_ZONE = "home"
CONFINED_HOME = f"{CONFINED_MOUNTPOINT}/{HOME_ZONE}"  # $HOME inside `run`
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def new_session_id() -> str:
    return secrets.token_hex(4)


def check_id(kind: str, value: str) -> str:
    if not _ID_RE.match(value):
        raise UserError(
            f"invalid {kind} id {shown(value)}: use 1-64 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )
    return value


# The logins a home holds, by their path below it (globs): never shown when the user makes a
# home, or a directory holding one, the project (`--allow-home-project`).
HOME_CREDENTIALS = (
    ".gitconfig",
    ".config/git",
    ".git-credentials",
    ".netrc",
    ".ssh",
    ".gnupg",
    ".aws",
    ".azure",
    ".docker",
    ".kube",
    ".npmrc",
    ".pypirc",
    ".pgpass",
    ".my.cnf",
    ".vault-token",
    ".password-store",
    ".terraform.d",
    ".config/gh",
    ".config/hub",
    ".config/gcloud",
    ".config/op",
    ".config/rclone",
    ".config/sandboxfs",
    ".config/opencode",
    ".config/google-chrome",
    ".config/chromium",
    ".mozilla",
    ".claude",
    ".claude.json*",
    ".codex",
    ".gemini",
    ".aider*",
    ".local/share/opencode",
    ".local/share/keyrings",
    ".local/state/sandboxfs",
    ".cargo/credentials*",
    ".gem/credentials",
    ".m2/settings.xml",
    ".gradle/gradle.properties",
)
# Another project's state dir below a home made the project (its agents' homes hold the logins
# `home seed` copied there): a deny pattern, since where such projects are is not known.
NESTED_STATE_DIR = f"*/{STATE_DIR_NAME}/"


def homes_within(project: Path) -> list[Path]:
    """The home directories `project` is or holds: the caller's ($HOME, and their account's),
    root's and every person's (uid 1000 up, not nobody's; system accounts' "homes" such as
    /var/www hold no logins). A home of `/` is no home here: `/` is never a project."""
    import pwd

    people = [e for e in pwd.getpwall() if e.pw_uid in (0, os.getuid()) or 1000 <= e.pw_uid < 65534]
    homes = {os.environ.get("HOME", ""), *(entry.pw_dir for entry in people)}
    found: list[Path] = []
    for home in sorted(h for h in homes if os.path.isabs(h)):
        real = Path(os.path.realpath(home))
        if real != Path("/") and real.is_relative_to(project) and real not in found:
            found.append(real)
    return found


def check_home_project(project: Path, allowed: bool) -> bool:
    """Whether `project` (resolved) is a home directory, holds one, or holds the user's
    sandboxfs state dir; UserError then, unless the user said so (`allowed`): run from `~`, the
    whole home would otherwise be the project, its logins readable wherever /repo is."""
    root = Path(os.path.realpath(state_root()))
    homes = homes_within(project)
    if not homes and not root.is_relative_to(project):
        return False
    if allowed:
        return True
    mine = Path(os.path.realpath(os.environ.get("HOME") or "/"))
    what = (
        "is your home directory"
        if project == mine
        else "holds your home directory"
        if mine in homes
        else f"is the home directory {homes[0]}"
        if project in homes
        else f"holds the home directory {homes[0]}"
        if homes
        else f"holds your sandboxfs state dir {root}"
    )
    raise UserError(
        f"project {project} {what}: the sandbox would see every login in it as /repo; run in "
        f"one project's directory (or --project DIR), or give --allow-home-project to mean it "
        f"(its credentials are then hidden)"
    )


def home_project_config(config: Config, project: Path) -> Config:
    """`config` for a home made the project (check_home_project): other projects' state dirs
    deny-listed too (the home's own logins are hidden by identity: hidden_identities)."""
    if not homes_within(project) or NESTED_STATE_DIR in config.deny:
        return config
    return config.model_copy(update={"deny": [*config.deny, NESTED_STATE_DIR]})


def hidden_names(project: Path) -> dict[bytes, set[tuple[int, int]]]:
    """In each home `project` is or holds: name -> the directories (identities) where an entry
    of that name is never shown (HOME_CREDENTIALS, those named exactly and those found), so
    that a login its program replaces while mounted (`git config --global`, an agent
    rewriting ~/.claude.json) stays hidden as the one that was there."""
    found: dict[bytes, set[tuple[int, int]]] = {}
    for home in homes_within(project):
        exact = [str(home / rel) for rel in HOME_CREDENTIALS if "*" not in rel]
        for login in {*exact, *_home_logins_of(home)}:
            parent, name = os.path.split(login)
            with contextlib.suppress(OSError):
                st = os.stat(parent)
                found.setdefault(os.fsencode(name), set()).add((st.st_dev, st.st_ino))
    return found


def _home_logins(project: Path) -> list[str]:
    """The logins of each home `project` is or holds (HOME_CREDENTIALS that exist)."""
    return [login for home in homes_within(project) for login in _home_logins_of(home)]


def _home_logins_of(home: Path) -> list[str]:
    import glob

    found: list[str] = []
    for pattern in HOME_CREDENTIALS:
        found += glob.glob(os.path.join(glob.escape(str(home)), pattern))
    return found


def hidden_identities(project: Path, mountpoint: Path | None = None) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of the directories no zone ever shows: the state dir, hidden by
    identity rather than name (on case-folding storage `.SANDBOX` is the same directory), the
    user's own state dir (the audit log's key) should the project contain it, and the
    mountpoint; in a home made the project, the logins it holds (HOME_CREDENTIALS)."""
    hidden: set[tuple[int, int]] = set()
    for path in (state_dir(project), state_root(), mountpoint, *_home_logins(project)):
        if path is None:
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        hidden.add((st.st_dev, st.st_ino))
    for login in _home_logins(project):  # a link to a login too, not only what it leads to
        with contextlib.suppress(OSError):
            st = os.lstat(login)
            hidden.add((st.st_dev, st.st_ino))
    return hidden


class HomeZoneConfig(ZoneConfig):
    """The home zone `run` adds to a mount's config (never read from a file: a project's
    zones are ZoneConfig). Its directory is made in the state dir by prepare_zones."""


class AttachmentsZoneConfig(ZoneConfig):
    """A worker's attachments (sandboxfs.project.workers.attach): copies of files its parent could
    read, in the state dir (`workspaces/<ws>/attachments/<id>/`), shown read-only at
    /attachments. Never read from a file."""


ATTACHMENTS_ZONE = "attachments"


def with_home(config: Config, project: Path, workspace: str, trust: Trust) -> Config:
    """`config` with the zone of the persistent home, which every trust level may use whole."""
    if HOME_ZONE in config.zones:
        raise UserError(
            f"the project's config declares a zone named {HOME_ZONE!r}, where sandboxfs run "
            f"shows the program's home ({CONFINED_HOME}); rename that zone"
        )
    home = HomeZoneConfig(
        path=str(layout.home_dir(project, workspace, trust.value)),
        permissions={level: "rwld" for level in Trust},
    )
    return config.model_copy(update={"zones": {**config.zones, HOME_ZONE: home}})


def ensure_home(project: Path, workspace: str, trust: Trust) -> Path:
    """Create the home of `workspace` at `trust` (without following a link on the way)."""
    try:
        return ensure_dirs(project, *layout.home_parts(workspace, trust.value), mode=0o700)
    except SandboxError as exc:
        raise UserError(f"cannot create the state dir: {exc.reason}") from None
    except OSError as exc:
        raise UserError(f"cannot create the state dir under {project}: {exc.strerror}") from None


def validate_project(project: Path, *, discover: bool = True) -> Path:
    """The project a command works on, resolved. `--project` left out (or `.`, the default
    every subcommand has), with `discover`: found from the current directory (`find_project`)."""
    if discover and project == Path("."):
        project = find_project(Path.cwd())
    if not project.exists():
        raise UserError(f"project directory {project} does not exist")
    if not project.is_dir():
        raise UserError(f"project {project} is not a directory")
    resolved = project.resolve()
    if resolved == Path("/"):
        raise UserError(
            f"project {project} is the root directory: the sandbox would see the whole machine "
            f"as /repo; use the directory of one project"
        )
    root = state_root().resolve()
    if resolved == root or resolved.is_relative_to(root):
        raise UserError(
            f"project {project} is inside your sandboxfs state dir {root}, which holds the "
            f"audit logs' keys; use the directory of one project"
        )
    return resolved


def find_project(start: Path) -> Path:
    """The project of a command run in `start` without --project, as git finds a repository.

    Inside a git work tree (a `.git` directory or file in `start` or a directory above it, on
    the same filesystem, as git looks by default), the nearest directory from `start` up to the
    work tree's top that already has sandboxfs's state dir (`.sandbox/` with `workspaces/` or
    `audit.jsonl` in it: its sessions, staged commits and audit log stay where they are), else
    the top level itself, unless that is the home directory (dotfiles kept in git: then
    `start`). Outside a work tree, `start` itself: above it, a state dir of an unrelated
    directory (the home) would make that the project. Only directories are looked at; git
    itself is not run (no config, no hooks).
    """
    start = start.resolve()
    try:
        device = start.stat().st_dev
    except OSError as exc:
        raise UserError(f"cannot use the current directory {start}: {exc.strerror}") from None
    walked: list[Path] = []
    for directory in (start, *start.parents):
        try:
            if directory.stat().st_dev != device:
                break  # a filesystem boundary: git stops here too
        except OSError:
            break
        walked.append(directory)
        if os.path.lexists(directory / ".git"):
            for candidate in walked:
                if _has_state(candidate):
                    return candidate
            if directory != start and directory == Path.home().resolve():
                return start  # a home kept in git (dotfiles) is not every subdirectory's project
            return directory
    return start


def _has_state(directory: Path) -> bool:
    state = directory / STATE_DIR_NAME
    if state.is_symlink() or not state.is_dir():
        return False
    return layout.workspaces_dir(directory).is_dir() or layout.audit_path(directory).is_file()


def worker_layers(project: Path) -> list[Path]:
    """<project>/.workers, then each directory of SANDBOXFS_WORKERS_PATH (read-only layers).
    A layer inside the project is reached without following any link there, as a zone is."""
    layers = [project / ".workers"]
    for entry in os.environ.get("SANDBOXFS_WORKERS_PATH", "").split(":"):
        if entry:
            where = f"SANDBOXFS_WORKERS_PATH: {entry!r}"
            raw = Path(entry).expanduser().absolute()
            path, _ = walk_zone_path(project, raw, where, missing_ok=True)
            layers.append(path)
    return layers


# A symlink chain longer than this is refused, as the kernel refuses it (ELOOP).
_MAX_LINKS = 40


def walk_zone_path(
    project: Path, raw: Path, where: str, missing_ok: bool = False
) -> tuple[Path, list[Path]]:
    """Where a zone's path leads, and every real directory the walk stood on (the last is
    the result).

    The path is walked one component at a time. Outside the project a symbolic link is
    followed (the user's own disks may be laid out with links); from the moment the walk
    stands in the project (`project` is already resolved), none is, and no `..` either: a
    link there may have been made by the sandbox itself through /repo, and following it would
    show the next sandbox any host directory. Such a link is refused with one line naming the
    zone and the component. A missing component is refused too, unless `missing_ok` (then
    the rest is joined as written, never followed).
    """
    project_id = _identity(project)
    cur = project if not raw.is_absolute() else Path(raw.anchor)
    pending = list(reversed(raw.parts[1:] if raw.is_absolute() else raw.parts))
    chain = [cur]
    links = 0
    while pending:
        part = pending.pop()
        inside = cur == project or _inside(cur, project)
        if part == ".":
            continue
        if part == "..":
            if inside and cur != project:
                raise UserError(
                    f"{where}: '..' after {cur.relative_to(project)} inside the project is not "
                    f"accepted; write the zone's path from the project down, without '..'"
                )
            cur = cur.parent
            chain.append(cur)
            continue
        nxt = cur / part
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            if missing_ok:
                return nxt.joinpath(*reversed(pending)), chain
            raise UserError(f"{where}: {nxt} does not exist; create the directory first") from None
        except OSError as exc:
            raise UserError(f"{where}: {nxt}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            if inside:
                component = nxt.relative_to(project).as_posix()
                raise UserError(
                    f"{where}: {component!r} in the project is a symbolic link "
                    f"(to {os.readlink(nxt)!r}); a zone inside the project is opened without "
                    f"following links: make {component!r} a real directory, or name the "
                    f"link's target in the config"
                )
            links += 1
            if links > _MAX_LINKS:
                raise UserError(f"{where}: too many levels of symbolic links at {nxt}")
            target = Path(os.readlink(nxt))
            if target.is_absolute():
                cur = Path(target.anchor)
                chain.append(cur)
            pending.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
            continue
        if not stat.S_ISDIR(st.st_mode):
            if missing_ok:
                return nxt.joinpath(*reversed(pending)), chain
            raise UserError(f"{where}: {nxt} is not a directory")
        # The project reached by another name (a bind mount of it): from here on, the project.
        cur = project if (st.st_dev, st.st_ino) == project_id else nxt
        chain.append(cur)
    return cur, chain


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def project_zone_dirs(project: Path, config: Config, source: str) -> dict[Zone, Path]:
    """The backing directory of each project zone, checked: it exists, is a directory, is
    reached without a link inside the project (see walk_zone_path), and overlaps neither
    another project zone, the workers directory, the state dir nor the project as a whole (a
    zone inside the project is fine: /repo shows it too). A zone that only passes through
    one of those on its way (a link in a zone beside the project) overlaps it too."""
    dirs: dict[Zone, Path] = {}
    chains: dict[Zone, list[Path]] = {}
    # As named: a zone inside the project never passes a link, so it meets them by name.
    state = state_dir(project)
    workers = project / ".workers"
    user_state = state_root().resolve()
    for name, zone in config.zones.items():
        if isinstance(zone, HomeZoneConfig | AttachmentsZoneConfig):
            continue  # in the state dir, made by prepare_zones
        where = f"{source}: zones.{name}.path: {zone.path!r}"
        path, chain = walk_zone_path(project, Path(zone.path).expanduser(), where)
        if _overlaps(path, project) and not _inside(path, project):
            if path == project:
                raise UserError(f"{where}: that is the project itself, which /repo already shows")
            raise UserError(f"{where}: {path} contains the project; a zone must lie beside it")
        if user_state in chain or _inside(path, user_state):
            raise UserError(
                f"{where}: {path} is in your sandboxfs state dir ({user_state}), which holds "
                f"the audit log's key; no zone may show it"
            )
        for other, label, other_chain in [
            (state, "the state dir", [state]),
            (workers, "/workers", [workers]),
        ] + [(p, f"zone {z.value}", chains[z]) for z, p in dirs.items()]:
            if _overlaps(path, other) or other in chain or path in other_chain:
                raise UserError(f"{where}: {path} overlaps {label} ({other})")
        dirs[Zone(name)] = path
        chains[Zone(name)] = chain
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
    try:
        _ignore_in_git(ensure_dirs(project, STATE_DIR_NAME))
        session_path = ensure_dirs(project, *layout.session_parts(workspace, session))
        for name in SESSION_SUBDIRS:
            ensure_dirs(session_path, name, mode=0o755)
        workspace_path = ensure_dirs(project, *layout.workspace_parts(workspace), "workspace")
        for sub in (("cache", "web"), ("cache", "pdfs"), ("cache", "attachments"), ("data",)):
            ensure_dirs(workspace_path, *sub, mode=0o755)
        staged = ensure_dirs(project, *layout.staged_parts(workspace))
        home = config.zones.get(HOME_ZONE)
        if isinstance(home, HomeZoneConfig):
            level = Path(home.path).name
            made = ensure_dirs(project, *layout.home_parts(workspace, level), mode=0o700)
            if made != Path(home.path):
                raise UserError(f"the home {home.path} is not one of workspace {workspace}")
            zone_dirs[Zone(HOME_ZONE)] = made
        for name, zone in config.zones.items():
            if isinstance(zone, AttachmentsZoneConfig):
                where = Path(zone.path).name
                made = ensure_dirs(project, *layout.attachments_parts(workspace), where)
                if made != Path(zone.path):
                    raise UserError(f"the attachments {zone.path} are not of workspace {workspace}")
                zone_dirs[Zone(name)] = made
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
    inside the project (the mount must not let an agent choose its next policy). For a config
    file that is a link, both: the link and the file it leads to are the next policy."""
    patterns = list(config.protect)
    # What of git's code-running surface (the files that decide which programs the user's git
    # runs) its built-in rules cannot see.
    patterns += [p for p in git_surface_protect(project) if p not in patterns]
    names = [Path(os.path.abspath(config_file))] if config_file is not None else []
    source = config_file if config_file is not None else project / PROJECT_CONFIG_NAME
    with contextlib.suppress(OSError, RuntimeError):
        names.append(source.resolve())
    for path in names:
        if _inside(path, project):
            pattern = "/" + path.relative_to(project).as_posix()
            if pattern not in patterns:
                patterns.append(pattern)
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
    approvals: Broker | None = None,
) -> Guard:
    """The guard of one mount or sandbox: the policy, the limits, a quota tally per zone
    that has one (shared through files in the state dir by every mount of the project), and
    the approvals (default: answered over the control channel, see `approval_broker`)."""
    policy = Policy(
        config.matrix(),
        config.deny,
        trust,
        protected_patterns(project, config, config_file),
        config.deny_private_keys,
        git_dir_zones(config),
        config.worker_label(),
        config.deny_credentials,
    )
    limits = config.zone_limits()
    tallies: dict[Zone, Tally] = {}
    with _closing_on_error(tallies):
        for zone, zone_limits in limits.items():
            if zone_limits.has_quota and zone_limits.quota is not None:
                root = store.zone_roots[zone]
                assert root.key is not None
                quotas = ensure_dirs(project, *layout.quota_parts())
                path = quotas / f"{zone.value}-{root.key[1]}-{root.key[2]}"
                tallies[zone] = Tally(zone.value, zone_limits.quota, path, _usage(store, zone))
    guard = Guard(
        policy,
        audit,
        info,
        moves=lambda: store.moves,
        limits=limits,
        tallies=tallies,
        frozen=_under_review(review_dir(project, info.workspace)),
    )
    pinned = zone_roots_in_repo(project, store.zone_paths)
    if pinned:
        guard.pin_zone_roots(lambda relpath: pinned.get(fold(relpath)))
    guard.inspect_contents(KeyScanner(StoreContents(store)))
    guard.effects.consent.broker = (
        approvals if approvals is not None else approval_broker(config, Mode.ASK)
    )
    return guard


def approval_broker(config: Config, mode: Mode, nobody: str | None = None) -> Broker:
    """The approvals of a mount: the project's rules with the user's own (sandboxfs.userconfig)."""
    broker = make_broker(config.approvals, userconfig.load().approvals, mode, config.worker)
    if nobody is not None:
        broker.nobody = nobody
    return broker


def zone_roots_in_repo(project: Path, dirs: Mapping[Zone, Path]) -> dict[str, str]:
    """The directory of every project zone inside the project and each directory above it,
    by its path relative to the project (folded, as the guard compares names), each with what
    it is. The guard keeps the sandbox from removing, renaming or replacing them through
    /repo (see Guard.pin_zone_roots)."""
    pinned: dict[str, str] = {}
    for zone, path in dirs.items():
        if zone in BUILTIN_ZONES or not _inside(path, project) or _inside(path, state_dir(project)):
            continue
        rel = path.relative_to(project).as_posix()
        pinned[fold(rel)] = f"is the directory of zone {zone.value}"
        for above in PurePosixPath(rel).parents[:-1]:
            what = f"holds the directory of zone {zone.value} ({rel})"
            pinned.setdefault(fold(above.as_posix()), what)
    return pinned


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
