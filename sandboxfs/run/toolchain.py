"""What CMD needs inside `sandboxfs run`: the program and the trees it runs from, read-only.

The sandbox's own PATH is the system's (`confine.PATH`), which holds what `/usr` holds. A
program installed elsewhere — `npm install -g --prefix ~/.local`, nvm, pyenv, pipx, a
virtualenv, cargo, `/opt`, a single binary under `~/.local/share/<tool>/versions/` — is found
on the caller's PATH, as their shell finds it, and followed link by link: a link outside the
system is made again as a link inside, at the same path, and the file it leads to is shown
with its tree, read-only, at the same path (so hard-coded paths and `#!` lines work):

- below a `node_modules` directory: the package (the directory just below the first
  `node_modules` on the path, `@scope/name` included), which holds its own dependencies;
- in a `bin/` whose parent holds `lib/` or `pyvenv.cfg`: that parent, the prefix of an
  interpreter or a virtualenv (`~/.nvm/versions/node/v22`, `~/.pyenv/versions/3.12.1`);
- under `/opt/<name>`: `/opt/<name>`;
- else the file alone.

A script's `#!` line is followed the same way (`#!/usr/bin/env node`: the `node` the caller's
PATH finds), and a pyenv, rbenv or nodenv shim is replaced by the version it would run. The
directories where the caller's PATH found them go before the system's on the sandbox's PATH.

Never shown, whatever asks (the program's resolution, `--expose`, the user config): `/` and
whole system or user directories (`/home`, `/root`, `/tmp`, `/var`), what the sandbox has its
own of (`/proc`, `/sys`, `/dev`, `/run`, `/etc`), the caller's home itself or anything holding
it, a secret (`~/.ssh`, `~/.aws`, `~/.gnupg`, `~/.config/gh`, `~/.docker`, `~/.kube`, keys,
`.env` files, an agent's own credentials...) or anything holding one, the project (the sandbox
sees it only through the mount) and sandboxfs's state. A tree refused falls back to the file
alone; a file refused makes CMD not runnable: one line saying where it is and why, exit 127.

It costs a few `stat` calls and one read of the first bytes of each script: well under a
millisecond for a program under /usr.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sandboxfs.core.policy import Patterns, fold
from sandboxfs.errors import CannotExecute, NotRunnable, UserError
from sandboxfs.run import confine

# Top-level directories of the host that are shown as they are (read-only, links as links).
SYSTEM_TOP = frozenset({*confine.SYSTEM, "etc"})

# Names that are secret wherever they are (compared case-insensitively, as globs).
SECRET_NAMES = (
    ".ssh",
    ".aws",
    ".gnupg",
    ".docker",
    ".kube",
    ".password-store",
    ".pki",
    ".azure",
    ".terraform.d",
    ".netrc",
    ".git-credentials",
    ".npmrc",
    ".pypirc",
    ".pgpass",
    ".my.cnf",
    ".vault-token",
    ".env",
    ".env.*",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "*.pem",
    "*.key",
)
# Secrets at a place in the home, by their path relative to it.
HOME_SECRETS = (
    ".config/gh",
    ".config/hub",
    ".config/gcloud",
    ".config/op",
    ".config/rclone",
    ".config/git/credentials",
    ".config/google-chrome",
    ".config/chromium",
    ".mozilla",
    ".local/share/keyrings",
    ".cargo/credentials",
    ".cargo/credentials.toml",
    ".gem/credentials",
    ".m2/settings.xml",
    ".gradle/gradle.properties",
)
# An agent's own login: never shown as it is (the sandbox's home gets a copy: `home seed`).
AGENT_CREDENTIALS = (
    ".claude/.credentials.json",
    ".claude.json",
    ".codex/auth.json",
    ".gemini/oauth_creds.json",
    ".gemini/google_accounts.json",
    ".local/share/opencode/auth.json",
)
# Directories that are the sandbox's own, or hold everyone's data: never shown whole.
NEVER_WHOLE = ("/", "/home", "/root", "/tmp", "/var", "/mnt", "/media", "/boot", "/srv", "/opt")
NEVER_BELOW = ("/proc", "/sys", "/dev", "/run", "/var/run", "/etc", confine.SANDBOX)
# A version manager's shims dir: (its root's environment variable, the version variable, the
# version file looked for from the project up).
VERSION_MANAGERS = {
    ".pyenv": ("PYENV_ROOT", "PYENV_VERSION", ".python-version"),
    ".rbenv": ("RBENV_ROOT", "RBENV_VERSION", ".ruby-version"),
    ".nodenv": ("NODENV_ROOT", "NODENV_VERSION", ".node-version"),
}
# Credentials a bound tree may hold (an nvm prefix's global npmrc, a virtualenv's pip.conf
# with an index token): covered with an empty file inside.
HIDDEN_IN_TREES = (
    "etc/npmrc",
    "etc/pip.conf",
    "pip.conf",
    ".npmrc",
    ".pypirc",
    ".netrc",
    ".git-credentials",
    ".env",
)
# A project's state dir (its sessions, its agents' homes with the logins `home seed` copied):
# never shown, in a tree exposed or as a path.
STATE_DIR_NAME = ".sandbox"
# Entries of an exposed directory looked at for what to cover: past this, it is refused (a
# narrower directory is what the program needs).
MAX_EXPOSED_ENTRIES = 100_000
_MAX_LINKS = 40
_MAX_DEPTH = 8  # interpreters of interpreters
_SHEBANG_MAX = 256  # what the kernel reads of a `#!` line


@dataclass
class Toolchain:
    """What `run` adds to the sandbox's view and PATH for CMD and the exposed paths."""

    binds: list[str] = field(default_factory=list)  # host paths, read-only at the same path
    links: dict[str, str] = field(default_factory=dict)  # path inside -> the link's text
    path: list[str] = field(default_factory=list)  # before the system's on the PATH inside
    shown: list[str] = field(default_factory=list)  # what was exposed, for the user
    # Inside exposed trees: (path, is a directory) covered with an empty one (see covered)
    covers: list[tuple[str, bool]] = field(default_factory=list)

    def bind(self, path: str) -> None:
        if any(_within(path, other) for other in self.binds):
            return
        self.binds = [other for other in self.binds if not _within(other, path)]
        self.binds.append(path)

    def bwrap_args(self) -> list[str]:
        """bubblewrap options: the trees (bound read-only, credentials in them covered: see
        HIDDEN_IN_TREES and `covered`), then the links on the way to them (a link inside a
        bound tree is there already). bubblewrap makes the directories above each, in the
        sandbox's own root."""
        args: list[str] = []
        for path in self.binds:
            args += ["--ro-bind", path, path]
            for rel in HIDDEN_IN_TREES:
                if os.path.isfile(os.path.join(path, rel)):
                    args += ["--ro-bind", "/dev/null", os.path.join(path, rel)]
        for path, is_dir in self.covers:  # after the trees they are in
            if is_dir:
                args += ["--tmpfs", path, "--remount-ro", path]
            else:
                args += ["--ro-bind", "/dev/null", path]
        for location, target in self.links.items():
            if not any(_within(location, tree) for tree in self.binds):
                args += ["--symlink", target, location]
        return args

    def env_path(self, system: str = confine.PATH) -> str:
        dirs = list(dict.fromkeys(self.path))
        return ":".join([*dirs, *(d for d in system.split(":") if d not in dirs)])


def _within(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def _tilde(path: str, home: str) -> str:
    return "~" + path[len(home) :] if home != "/" and _within(path, home) else path


@dataclass(frozen=True)
class Limits:
    """What is never shown inside, and why (see the module doc)."""

    home: str
    project: str
    state_dirs: tuple[str, ...]  # the project's state dir, sandboxfs's own state dir

    @classmethod
    def of(cls, project: Path, state_dirs: Iterable[Path], home: str | None = None) -> Limits:
        return cls(
            os.path.realpath(home if home is not None else caller_home()),
            os.path.realpath(project),
            tuple(os.path.realpath(p) for p in state_dirs),
        )

    def refusal(self, path: str, *, credentials: bool = True) -> str | None:
        """Why `path` (absolute, without links) may not be shown inside; None when it may.
        `credentials`: an agent's own login counts as a secret (for `home seed`, not)."""
        show = _tilde(path, self.home)
        return (
            _system_refusal(path, show)
            or self._secret_refusal(path, show, credentials)
            or self._state_refusal(path, show)
        )

    def _secret_refusal(self, path: str, show: str, credentials: bool) -> str | None:
        """(refusal) A secret by its name, a secret of the home's, the home itself, or what
        holds any of them."""
        for part in path.split("/"):
            folded = part.casefold()
            if any(fnmatch.fnmatchcase(folded, pattern) for pattern in SECRET_NAMES):
                return f"{show} is secret ({part})"
        secrets = [*HOME_SECRETS, *(AGENT_CREDENTIALS if credentials else ())]
        for rel in secrets:
            secret = f"{self.home}/{rel}"
            if _within(path, secret):
                return f"{show} is secret (~/{rel})"
        if _within(self.home, path):
            return f"{show} is your home" if path == self.home else f"{show} holds your home"
        for rel in secrets:
            if _within(f"{self.home}/{rel}", path):
                return f"{show} holds ~/{rel}, a secret"
        return None

    def _state_refusal(self, path: str, show: str) -> str | None:
        """(refusal) The project, sandboxfs's state, a project's state dir: in them or
        holding them (each is shown inside its own way, or not at all)."""
        if _within(path, self.project):
            return (
                f"{show} is in the project, which the sandbox sees only through the mount, "
                f"at {confine.SANDBOX}/repo"
            )
        if _within(self.project, path):
            return f"{show} holds the project"
        for state in self.state_dirs:
            if _within(path, state) or _within(state, path):
                return f"{show} {'is in' if _within(path, state) else 'holds'} sandboxfs's state"
        for part in path.split("/"):
            if fold(part) == STATE_DIR_NAME:
                return f"{show} is in a project's state dir ({part})"
        return None


def _system_refusal(path: str, show: str) -> str | None:
    """(Limits.refusal) A whole system directory, or what is under one the sandbox has its own
    of."""
    if path in NEVER_WHOLE:
        return f"{show} is a whole system directory"
    for top in NEVER_BELOW:
        if _within(path, top):
            return f"{show} is under {top}, which the sandbox has its own of"
    return None


def caller_home() -> str:
    home = os.environ.get("HOME", "")
    if not os.path.isabs(home):
        import pwd

        home = pwd.getpwuid(os.getuid()).pw_dir
    return home


# ----- following paths ---------------------------------------------------------------------------


def _shown_as_is(path: str) -> bool:
    """Whether the host's `path` is there inside already (the system, read-only)."""
    top = path.split("/", 2)[1] if path.count("/") >= 1 else ""
    return top in SYSTEM_TOP


def follow(path: str, links: dict[str, str]) -> str:
    """`path` (absolute) with every link resolved, as the kernel does; each link met outside
    the system is added to `links` (where it is -> its text). OSError when a component is
    missing or the chain is too long."""
    pending = [p for p in reversed(path.split("/")) if p]
    cur = "/"
    hops = 0
    while pending:
        part = pending.pop()
        if part == ".":
            continue
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, part)
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > _MAX_LINKS:
                raise OSError(40, "too many levels of symbolic links", nxt)  # ELOOP
            target = os.readlink(nxt)
            if not _shown_as_is(nxt):
                links[nxt] = target
            if target.startswith("/"):
                cur = "/"
            pending.extend(reversed([p for p in target.split("/") if p]))
            continue
        cur = nxt
    return cur


def _executable(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and os.access(path, os.X_OK)


def tree_of(real: str) -> list[str]:
    """Where the file at `real` is shown from, largest first: its package or prefix, then
    the file alone (see the module doc)."""
    parts = real.split("/")
    candidates: list[str] = []
    if "node_modules" in parts:
        i = parts.index("node_modules")
        take = 3 if i + 1 < len(parts) and parts[i + 1].startswith("@") else 2
        if i + take < len(parts):  # the file is inside the package, not the package itself
            candidates.append("/".join(parts[: i + take]))
    parent = os.path.dirname(real)
    if os.path.basename(parent) in ("bin", "sbin"):
        prefix = os.path.dirname(parent)
        if prefix.count("/") >= 2 and (
            os.path.isdir(os.path.join(prefix, "lib"))
            or os.path.isfile(os.path.join(prefix, "pyvenv.cfg"))
        ):
            candidates.append(prefix)
    if len(parts) > 3 and parts[1] == "opt":
        candidates.append("/".join(parts[:3]))
    candidates.append(real)
    return list(dict.fromkeys(candidates))


# ----- resolving CMD -----------------------------------------------------------------------------


class _Resolver:
    def __init__(
        self,
        caller_path: str,
        limits: Limits,
        project: Path,
        env: Mapping[str, str],
        tools: Toolchain,
    ) -> None:
        self.dirs = [d for d in caller_path.split(":") if d.startswith("/")]
        self.system = confine.PATH.split(":")
        self.limits = limits
        self.project = project
        self.env = env
        self.tools = tools

    def locate(self, name: str) -> tuple[str, str] | None:
        """(the directory to put on the sandbox's PATH, the program) for `name` on the
        caller's PATH; a version manager's shim stands for the version it would run."""
        for directory in self.dirs:
            candidate = os.path.join(directory, name)
            if not _executable(candidate):
                continue
            versioned = self._unshim(directory, name)
            if versioned == "system":
                continue  # pyenv's `system`: whatever comes after the shims
            if versioned is not None:
                return os.path.dirname(versioned), versioned
            return directory, candidate
        return None

    def _unshim(self, directory: str, name: str) -> str | None:
        """The program a pyenv/rbenv/nodenv shim at `directory`/`name` runs, "system" for the
        system's, None when `directory` holds no shims."""
        root = os.path.dirname(directory)
        if os.path.basename(directory) != "shims" or not os.path.isdir(f"{root}/versions"):
            return None
        manager = next(
            (
                spec
                for key, spec in VERSION_MANAGERS.items()
                if self.env.get(spec[0]) == root or os.path.basename(root) == key
            ),
            None,
        )
        if manager is None:
            return None
        for version in self._versions(root, manager[1], manager[2]):
            if version == "system":
                return "system"
            candidate = f"{root}/versions/{version}/bin/{name}"
            if _executable(candidate):
                return candidate
        return None

    def _versions(self, root: str, variable: str, file_name: str) -> list[str]:
        if self.env.get(variable):
            return self.env[variable].replace(":", " ").split()
        for directory in (self.project, *self.project.parents):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                return (directory / file_name).read_text().split()
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return Path(root, "version").read_text().split()
        return ["system"]

    def first_inside(self, name: str) -> str | None:
        for directory in self.system:
            candidate = os.path.join(directory, name)
            if _executable(candidate):
                return os.path.realpath(candidate)
        return None

    def add_program(self, shown_as: str, program: str, depth: int = 0) -> None:
        """Show `program` (a host path) and whatever its `#!` line needs; NotRunnable when
        it cannot be. `shown_as`: the name it is known by, for messages."""
        if depth > _MAX_DEPTH:
            raise CannotExecute(f"{shown_as}: too many levels of #! interpreters")
        links: dict[str, str] = {}
        try:
            real = follow(program, links)
        except OSError as exc:
            raise NotRunnable(f"{shown_as}: {program}: {exc.strerror}") from None
        self._bind_program(shown_as, program, real, links)
        interpreter = _shebang(real)
        if interpreter is not None:
            self._add_interpreter(shown_as, interpreter, depth)

    def _bind_program(self, shown_as: str, program: str, real: str, links: dict[str, str]) -> None:
        """(add_program) Bind the largest of the program's trees that may be shown, and the links
        on the way to it; NotRunnable when any of them may not be shown."""
        for location in links:
            why = self.limits.refusal(location)
            if why is not None:
                raise NotRunnable(self._unshowable(shown_as, program, why))
        if not _shown_as_is(real):
            why = None
            for candidate in tree_of(real):
                why = self.limits.refusal(candidate)
                if why is None:
                    self.tools.bind(candidate)
                    break
            if why is not None:
                raise NotRunnable(self._unshowable(shown_as, program, why))
        self.tools.links.update(links)

    def _add_interpreter(
        self, shown_as: str, interpreter: tuple[str, str | None], depth: int
    ) -> None:
        """(add_program) What a script's `#!` line runs: shown too, and on the sandbox's PATH
        for `#!/usr/bin/env NAME`."""
        command, name = interpreter
        if name is None:  # an absolute interpreter: #!/home/u/venv/bin/python
            if not command.startswith("/"):
                return  # relative: the kernel resolves it against the cwd; not ours to show
            self.add_program(f"{shown_as}'s interpreter {command}", command, depth + 1)
            return
        found = self.locate(name)
        what = f"{shown_as}'s interpreter {name} (#!{command} {name})"
        if found is None:
            if self.first_inside(name) is not None:
                return
            raise NotRunnable(
                f"{what} is not found on your PATH nor on the sandbox's; install {name}"
            )
        directory, path = found
        self._put_on_path(name, directory, path)
        self.add_program(what, path, depth + 1)

    def _put_on_path(self, name: str, directory: str, program: str) -> None:
        """Have the sandbox's PATH find `program` for `name`, as the caller's does."""
        if self.first_inside(name) != os.path.realpath(program):
            self.tools.path.append(directory)

    def _unshowable(self, shown_as: str, program: str, why: str) -> str:
        where = _tilde(program, self.limits.home)
        hint = ""
        if _within(os.path.realpath(program), self.limits.project):
            rel = os.path.relpath(os.path.realpath(program), self.limits.project)
            hint = f"; run it as {confine.SANDBOX}/repo/{rel} (a trust level that reads /repo)"
        which = f"which {why[len(where) + 1 :]}" if why.startswith(f"{where} ") else why
        if which is why:
            which = f"which is not shown inside: {why}"
        return f"{shown_as}: not found on the sandbox's PATH (it is {where} outside, {which}){hint}"


def _shebang(path: str) -> tuple[str, str | None] | None:
    """A script's interpreter: (its path, None), or for `#!/usr/bin/env [-S] NAME` (env's
    path, NAME); None for anything else (a binary, no `#!`, unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SHEBANG_MAX)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode("utf-8", "surrogateescape").strip()
    interpreter, _, rest = line.partition(" ")
    interpreter = interpreter.split("\t", 1)[0]
    if not interpreter:
        return None
    if os.path.basename(interpreter) != "env":
        return interpreter, None
    name = _env_program(rest.split())
    return None if name is None else (interpreter, name)


def _env_program(words: list[str]) -> str | None:
    """(_shebang) The program `env` runs, past its options and NAME=VALUE settings; None for
    none."""
    while words:
        word = words[0]
        if word in ("-i", "--ignore-environment", "-", "-0", "--null", "-v", "--debug"):
            words.pop(0)
        elif word in ("-S", "--split-string") or word.startswith(("-S", "--split-string=")):
            words.pop(0)
            tail = word.partition("=")[2] if word.startswith("--") else word[2:]
            if tail:
                words.insert(0, tail)
        elif word in ("-u", "--unset", "-C", "--chdir"):
            del words[:2]
        elif word.startswith("-") or "=" in word:
            words.pop(0)
        else:
            return word
    return None


def resolve(
    command: Sequence[str],
    *,
    caller_env: Mapping[str, str],
    limits: Limits,
    project: Path,
    tools: Toolchain | None = None,
    strict: bool = True,
) -> Toolchain:
    """What CMD (`command[0]`) needs inside, added to `tools`. NotRunnable when it is found
    nowhere (strict; without `strict` — the user set PATH — only what can be found is
    shown) or where it cannot be shown."""
    tools = tools if tools is not None else Toolchain()
    name = command[0]
    resolver = _Resolver(caller_env.get("PATH", ""), limits, project, caller_env, tools)
    if "/" in name:
        if not name.startswith("/") or any(
            _within(name, own) for own in (confine.SANDBOX, "/proc", "/dev")
        ):
            return tools  # relative to the working directory inside, or a path inside
        if not os.path.lexists(name):
            if strict:
                raise NotRunnable(f"{name}: no such file")
            return tools
        resolver.add_program(name, name)
        return tools
    found = resolver.locate(name)
    if found is None:
        if resolver.first_inside(name) is not None or not strict:
            return tools
        for directory in resolver.dirs:
            if os.path.isfile(os.path.join(directory, name)):
                raise CannotExecute(
                    f"{name}: {os.path.join(directory, name)} is not executable (chmod +x it)"
                )
        raise NotRunnable(
            f"{name}: not found on your PATH nor on the sandbox's ({confine.PATH}); install "
            f"it, or name it by its path"
        )
    directory, program = found
    resolver._put_on_path(name, directory, program)
    resolver.add_program(name, program)
    return tools


def covered(tree: str, deny: Patterns) -> list[tuple[str, bool]]:
    """What of the directory `tree` an exposure covers, at every depth: entries the deny list
    (`deny`, the project's) or SECRET_NAMES name, and every project's state dir; a link so
    named covers what it leads to in the tree. UserError past MAX_EXPOSED_ENTRIES."""
    found: list[tuple[str, bool]] = []
    pending = [tree]
    seen = 0
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue  # unreadable to the caller: unreadable inside too
        for entry in entries:
            seen += 1
            if seen > MAX_EXPOSED_ENTRIES:
                raise UserError(
                    f"{tree} holds more than {MAX_EXPOSED_ENTRIES} entries to check for "
                    f"secrets; expose the directories the program needs"
                )
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
                is_link = entry.is_symlink()
            except OSError:
                continue
            rel = os.path.relpath(entry.path, tree)
            folded = fold(entry.name)
            secret = (
                folded == STATE_DIR_NAME
                or deny.match(entry.name, rel, is_dir or entry.is_dir()) is not None
                or any(fnmatch.fnmatchcase(entry.name.casefold(), p) for p in SECRET_NAMES)
            )
            if secret and is_link:
                target = os.path.realpath(entry.path)
                if _within(target, tree) and target != tree and os.path.lexists(target):
                    found.append((target, os.path.isdir(target)))
            elif secret:
                found.append((entry.path, is_dir))
            elif is_dir:
                pending.append(entry.path)
    return found


def expose(
    paths: Iterable[tuple[str, str]],
    *,
    caller_env: Mapping[str, str],
    limits: Limits,
    tools: Toolchain | None = None,
    deny: Sequence[str] = (),
) -> Toolchain:
    """Show each of `paths` ((the path as written, where it was written)) read-only at the
    same path, with the links on the way, the deny list (`deny`) holding at every depth
    (`covered`); the caller's PATH directories inside them go on the sandbox's PATH.
    UserError (exit 2, run's 125) naming the path and why not."""
    patterns = Patterns(list(deny))
    tools = tools if tools is not None else Toolchain()
    for written, source in paths:
        _expose_one(written, source, limits, tools, patterns)
    for directory in caller_env.get("PATH", "").split(":"):
        if directory.startswith("/") and any(
            _within(directory, p) or os.path.dirname(p) == directory for p in tools.shown
        ):
            tools.path.append(directory)  # in what is shown, or holds it (~/.local/bin/tool)
    return tools


def _expose_one(
    written: str, source: str, limits: Limits, tools: Toolchain, patterns: Patterns
) -> None:
    """(expose) One path, into `tools`: refused as written, on the way, and where it leads."""
    path = os.path.abspath(os.path.expanduser(written))
    why = limits.refusal(path)  # as written first: ~/.ssh is refused, there or not
    if why is not None:
        raise UserError(f"{source} {written}: refused: {why}")
    links: dict[str, str] = {}
    try:
        real = follow(path, links)
    except OSError as exc:
        raise UserError(f"{source} {written}: {exc.strerror}") from None
    for place in [*links, real]:
        why = limits.refusal(place)
        if why is not None:
            raise UserError(f"{source} {written}: refused: {why}")
    if _shown_as_is(real):
        return  # the system: there already
    if os.path.isdir(real):
        try:
            tools.covers += covered(real, patterns)
        except UserError as exc:
            raise UserError(f"{source} {written}: refused: {exc.message}") from None
    tools.bind(real)
    tools.links.update(links)
    tools.shown.append(path)
