"""Staged commits: what an agent proposes in /staged, how the user reviews it, and how it lands.

An agent that may not change the repository writes a *staged commit* into the /staged zone
(`<project>/.sandbox/workspaces/<ws>/staged/<id>/`): `message.txt`, `files/<repo path>` with the
full proposed content of each file, and optionally `deletions.txt` (one repo path a line). The
user, outside the sandbox, reviews it (`sandboxfs staged show|diff`) and lands it as one git
commit (`sandboxfs staged commit`), or throws it away (`discard`).

The first review *freezes* it: a copy (the snapshot) is taken into
`<project>/.sandbox/workspaces/<ws>/review/<id>/`, beside the zone and in no zone, and from then
on every review and the commit read the snapshot, so what was reviewed is exactly what lands;
`review/<id>/state.json`, written before the copy starts, also makes the mount refuse further
changes below /staged/<id> (sandboxfs.core.guard). A SHA-256 *digest* of the snapshot lets a
script check that it commits what it reviewed (`commit --expect DIGEST`).

Nothing here follows a symlink in the staged tree or in the working tree, and the git that runs
here never runs repository code: no hooks, no fsmonitor, no filters, no textconv, no external
diff, no pager, no system or global config; only plumbing, with a private index.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from .audit import AuditLog, AuditQuery, query
from .core.errors import SandboxError
from .core.policy import Patterns, fold
from .core.store import STATE_DIR_NAME, ensure_dirs
from .errors import UserError
from .project import audit_path, check_id, hidden_identities, review_dir, state_dir

MAX_TOTAL_BYTES = 100 * 1024 * 1024  # a staged commit larger than this is refused
MAX_ENTRIES = 10_000  # files, directories, other entries and deletions together
MAX_DEPTH = 200  # directories below files/
MESSAGE_NAME = "message.txt"
FILES_NAME = "files"
DELETIONS_NAME = "deletions.txt"
FLAG_ENV = "SANDBOXFS_STAGED_FLAG"
# Paths that run code on the user's machine once they are in the repository (CI, build files,
# editor settings, direnv, git's own configuration): listed first in reviews and marked `!`.
# The deny-list forms (sandboxfs.core.policy.Patterns): a name glob matches at any depth, a glob
# with a "/" inside matches from the repository root, a trailing "/" everything below that
# directory. SANDBOXFS_STAGED_FLAG adds colon-separated globs. (Executable `*.sh` files are
# flagged too: see `runs_code`.)
FLAG_PATTERNS: tuple[str, ...] = (
    ".git/",
    ".github/workflows/",
    ".gitlab-ci.yml",
    "Makefile",
    "*.mk",
    "package.json",
    "setup.py",
    "pyproject.toml",
    ".envrc",
    ".vscode/",
    ".idea/",
    ".pre-commit-config.yaml",
    "Dockerfile",
    ".gitattributes",
    ".gitmodules",
    ".husky/",
)
STATUSES = ("pending", "committed", "discarded")

_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MODE_FILE = 0o100644
MODE_EXEC = 0o100755
_MODE_LINK = 0o120000
_MODE_GITLINK = 0o160000

# ----- escaping ---------------------------------------------------------------------------------

# C0 and C1 controls, DEL, undecodable bytes (surrogateescape) and any other lone surrogate, and
# the bidirectional overrides that make text read differently from what it is ("trojan source").
_UNSAFE = "\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_TEXT_RE = re.compile(f"[{_UNSAFE}]")
_NAME_RE = re.compile(f"[{_UNSAFE}\t\n\\\\]")


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    code = ord(ch)
    if ch == "\\":
        return "\\\\"
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as os.fsdecode keeps it
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def escape_name(name: str) -> str:
    """A path as it may be printed to a terminal: every control character (newline and tab
    too), undecodable byte and bidi override as a `\\x1b`-style escape, and `\\` doubled, so
    two different names never print alike."""
    return _NAME_RE.sub(_escape_char, name)


def escape_text(text: str) -> str:
    """File content or a message as it may be printed to a terminal: as escape_name, but
    newlines, tabs and backslashes are kept."""
    return _TEXT_RE.sub(_escape_char, text)


def decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


# ----- the staged tree ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StagedFile:
    path: str  # repository-relative, "/"-separated, os.fsdecode'd
    mode: int  # MODE_FILE or MODE_EXEC
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class Refused(NamedTuple):
    """An entry of a staged commit that is no content: a symlink, FIFO, socket, device, or an
    unreadable file. `path` is relative to the staged commit ("files/src/link")."""

    path: str
    kind: str


@dataclass
class StagedTree:
    """The content of one staged commit, read into memory (at most MAX_TOTAL_BYTES)."""

    message: bytes | None = None
    files: dict[str, StagedFile] = field(default_factory=dict)
    deletions: list[str] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def digest(self) -> str:
        """SHA-256 over a canonical listing: the message, every file's path, mode and content
        hash in path order, the deletions in order, and the refused entries. Each field is
        length-prefixed, so no two different listings hash alike."""
        h = hashlib.sha256()

        def put(value: bytes | str) -> None:
            raw = os.fsencode(value) if isinstance(value, str) else value
            h.update(b"%d:" % len(raw) + raw + b",")

        put("sandboxfs staged commit 1")
        put("message" if self.message is not None else "no message")
        put(self.message or b"")
        for path in sorted(self.files, key=os.fsencode):
            f = self.files[path]
            put("file")
            put(path)
            put(f"{f.mode:o}")
            put(f.sha256)
        for path in sorted(set(self.deletions), key=os.fsencode):
            put("delete")
            put(path)
        for entry in sorted(self.refused):
            put("refused")
            put(entry.path)
            put(entry.kind)
        return "sha256:" + h.hexdigest()


class TooLarge(UserError):
    """A staged commit beyond MAX_TOTAL_BYTES, MAX_ENTRIES or MAX_DEPTH: refused (exit 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


class _Budget:
    def __init__(self, commit_id: str) -> None:
        self.commit_id = commit_id
        self.entries = 0
        self.bytes = 0

    def entry(self, count: int = 1) -> None:
        self.entries += count
        if self.entries > MAX_ENTRIES:
            raise TooLarge(
                f"staged commit {escape_name(self.commit_id)} is too large to review: more than "
                f"{MAX_ENTRIES} files, directories and deletions; stage smaller commits"
            )

    def data(self, size: int) -> None:
        self.bytes += size
        if self.bytes > MAX_TOTAL_BYTES:
            raise TooLarge(
                f"staged commit {escape_name(self.commit_id)} is too large to review: more than "
                f"{MAX_TOTAL_BYTES // (1024 * 1024)} MiB; stage smaller commits"
            )

    def remaining(self) -> int:
        return MAX_TOTAL_BYTES - self.bytes


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISCHR, "character device"),
    ):
        if test(mode):
            return name
    return "special file"


def _read_regular(dir_fd: int, name: str, budget: _Budget) -> tuple[bytes, int] | str:
    """(content, git mode) of the regular file `name`, or the kind of entry it is instead.
    Never follows a symlink, never blocks on a FIFO swapped in, reads no more than the budget."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "vanished entry"
    if not stat.S_ISREG(st.st_mode):
        return _kind(st.st_mode)
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "unreadable file"
        if exc.errno == errno.ENOENT:
            return "vanished entry"
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _kind(st.st_mode)
        budget.data(st.st_size)
        chunks = []
        got = 0
        while True:
            chunk = os.read(fd, min(1 << 20, budget.remaining() + 1))
            if not chunk:
                break
            got += len(chunk)
            if got > st.st_size:  # grew while being read
                budget.data(len(chunk))
            chunks.append(chunk)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EIO):
            return "unreadable file"
        raise
    finally:
        os.close(fd)
    return b"".join(chunks), MODE_EXEC if st.st_mode & 0o111 else MODE_FILE


def _walk(dir_fd: int, prefix: str, depth: int, budget: _Budget, tree: StagedTree) -> None:
    for name in sorted(os.listdir(dir_fd), key=os.fsencode):
        budget.entry()
        path = prefix + name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                raise TooLarge(
                    f"staged commit {escape_name(budget.commit_id)} is too large to review: "
                    f"directories nested more than {MAX_DEPTH} deep"
                )
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.ENOENT):
                    raise
                if exc.errno != errno.ENOENT:
                    tree.refused.append(Refused(f"{FILES_NAME}/{path}", "unreadable directory"))
                continue
            try:
                _walk(sub, path + "/", depth + 1, budget, tree)
            finally:
                os.close(sub)
            continue
        got = _read_regular(dir_fd, name, budget)
        if isinstance(got, str):
            if got != "vanished entry":
                tree.refused.append(Refused(f"{FILES_NAME}/{path}", got))
        else:
            tree.files[path] = StagedFile(path, got[1], got[0])


def parse_deletions(data: bytes) -> list[str]:
    """deletions.txt: one path a line; blank lines and a trailing CR are ignored, and a path
    listed twice counts once."""
    seen: dict[str, None] = {}
    for raw in data.split(b"\n"):
        line = raw.removesuffix(b"\r")
        if line.strip():
            seen.setdefault(os.fsdecode(line))
    return list(seen)


def read_tree(dir_fd: int, commit_id: str) -> StagedTree:
    """Read the staged commit whose directory is open as `dir_fd` (see the module doc)."""
    budget = _Budget(commit_id)
    tree = StagedTree()
    for name in sorted(os.listdir(dir_fd), key=os.fsencode):
        budget.entry()
        if name in (MESSAGE_NAME, DELETIONS_NAME):
            got = _read_regular(dir_fd, name, budget)
            if isinstance(got, str):
                if got != "vanished entry":
                    tree.refused.append(Refused(name, got))
            elif name == MESSAGE_NAME:
                tree.message = got[0]
            else:
                tree.deletions = parse_deletions(got[0])
                budget.entry(len(tree.deletions))
        elif name == FILES_NAME:
            try:
                files_fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EACCES):
                    raise
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                tree.refused.append(Refused(name, _kind(st.st_mode)))
                continue
            try:
                _walk(files_fd, "", 0, budget, tree)
            finally:
                os.close(files_fd)
        else:
            tree.unknown.append(name)
    return tree


def write_tree(tree: StagedTree, dir_fd: int) -> None:
    """Write `tree` in the staged-commit format into the empty directory `dir_fd` (the
    snapshot). Refused and unknown entries are not written: state.json keeps them."""

    def create(parent: int, name: str, data: bytes, mode: int) -> None:
        fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=parent)
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    if tree.message is not None:
        create(dir_fd, MESSAGE_NAME, tree.message, 0o644)
    if tree.deletions:
        create(
            dir_fd, DELETIONS_NAME, b"".join(os.fsencode(d) + b"\n" for d in tree.deletions), 0o644
        )
    if not tree.files:
        return
    dirs: dict[str, int] = {}
    try:
        os.mkdir(FILES_NAME, 0o755, dir_fd=dir_fd)
        dirs[""] = os.open(FILES_NAME, _DIR_FLAGS, dir_fd=dir_fd)
        for path in sorted(tree.files, key=os.fsencode):
            parent = ""
            parts = path.split("/")
            for name in parts[:-1]:
                here = f"{parent}/{name}" if parent else name
                if here not in dirs:
                    os.mkdir(name, 0o755, dir_fd=dirs[parent])
                    dirs[here] = os.open(name, _DIR_FLAGS, dir_fd=dirs[parent])
                parent = here
            f = tree.files[path]
            create(dirs[parent], parts[-1], f.data, 0o755 if f.mode == MODE_EXEC else 0o644)
    finally:
        for fd in dirs.values():
            os.close(fd)


# ----- flags and path checks ----------------------------------------------------------------------


def flag_patterns(environ: Mapping[str, str] | None = None) -> Patterns:
    """FLAG_PATTERNS and the globs of $SANDBOXFS_STAGED_FLAG (colon-separated)."""
    extra = (environ if environ is not None else os.environ).get(FLAG_ENV, "")
    return Patterns([*FLAG_PATTERNS, *(g for g in extra.split(":") if g.strip())])


def runs_code(path: str, mode: int | None, flags: Patterns) -> bool:
    """Whether `path` (with git mode `mode`, None for a deletion) runs code on the user's
    machine: it matches a flag pattern, or it is an executable `*.sh`."""
    if flags.match_within(path, False) is not None:
        return True
    return mode == MODE_EXEC and fold(path).endswith(".sh")


def review_order(paths: Iterable[str], flagged: Iterable[str]) -> list[str]:
    """Flagged paths first, then the rest; each group in byte order."""
    marked = set(flagged)
    return sorted(paths, key=lambda p: (p not in marked, os.fsencode(p)))


def path_problem(path: str, deny: Patterns, protect: Patterns) -> str | None:
    """Why `path` (repository-relative) may never be written by a staged commit, as a phrase
    that follows the path ("src/a is deny-listed (.env)"), or None if it may."""
    if not path:
        return "is an empty path"
    if "\0" in path:
        return "leaves the repository (it contains a NUL byte)"
    if path.startswith("/"):
        return "leaves the repository (it is absolute)"
    parts = path.split("/")
    if ".." in parts:
        return "leaves the repository (it has a '..' component)"
    if "" in parts or "." in parts:
        return "is not a normalized path (an empty or '.' component)"
    if any(fold(part) == ".git" for part in parts):
        return "is inside .git, which a staged commit never writes"
    if fold(parts[0]) == fold(STATE_DIR_NAME):
        return f"is inside {STATE_DIR_NAME}, sandboxfs's state directory"
    pattern = deny.match_within(path, False)
    if pattern is not None:
        return f"is deny-listed ({pattern})"
    pattern = protect.match_within(path, False)
    if pattern is not None:
        return f"is protected ({pattern})"
    return None


# ----- git, without running any of the repository's code ----------------------------------------

GIT_CONFIG = (
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.untrackedCache=false",
    "-c",
    "diff.external=",
    "-c",
    "core.pager=cat",
)
_KEEP_ENV = frozenset(
    f"GIT_{who}_{what}" for who in ("AUTHOR", "COMMITTER") for what in ("NAME", "EMAIL", "DATE")
)


def git_env(index: Path | None = None) -> dict[str, str]:
    """The environment of every git that sandboxfs runs: no system or global config, no other
    GIT_* variable of the caller's but the identity and dates, literal pathspecs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in _KEEP_ENV}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL="/dev/null",
        GIT_LITERAL_PATHSPECS="1",
        GIT_TERMINAL_PROMPT="0",
        GIT_OPTIONAL_LOCKS="0",
    )
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return env


class Entry(NamedTuple):
    mode: int
    sha: str


class Git:
    """A git work tree that contains the project, driven with plumbing only."""

    def __init__(
        self, project: Path, toplevel: Path, prefix: str, git_dir: Path, common_dir: Path
    ) -> None:
        self.project = project
        self.toplevel = toplevel
        self.prefix = prefix  # the project's path in the work tree: "" or "sub/dir/"
        self.git_dir = git_dir
        self.common_dir = common_dir
        self._blobs: dict[str, bytes | None] = {}
        self._trees: dict[str, dict[str, Entry]] = {}

    @classmethod
    def find(cls, project: Path) -> Git | None:
        """The git work tree the project is in, or None if it is in none."""
        if shutil.which("git") is None:
            raise UserError("git is not installed: staged commits land in git", exit_code=1)
        args = ["--is-inside-work-tree", "--show-toplevel", "--show-prefix", "--git-dir"]
        result = _git(project, ["rev-parse", *args, "--git-common-dir"], check=False)
        lines = decode(result.stdout).split("\n")
        if result.returncode != 0 or len(lines) < 5 or lines[0] != "true":
            return None
        return cls(project, Path(lines[1]), lines[2], project / lines[3], project / lines[4])

    def run(
        self,
        *args: str,
        data: bytes = b"",
        index: Path | None = None,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[bytes]:
        return _git(cwd or self.project, list(args), data, index, check, env)

    def full(self, path: str) -> str:
        """A project-relative path as git names it, relative to the top of the work tree."""
        return self.prefix + path

    def head(self) -> str | None:
        """The commit HEAD points to, or None on an unborn branch."""
        result = self.run("rev-parse", "-q", "--verify", "HEAD^{commit}", check=False)
        return decode(result.stdout).strip() if result.returncode == 0 else None

    def branch(self) -> str | None:
        """The branch HEAD is on ("main"), or None when HEAD is detached."""
        result = self.run("symbolic-ref", "-q", "HEAD", check=False)
        ref = decode(result.stdout).strip()
        return ref.removeprefix("refs/heads/") if result.returncode == 0 and ref else None

    def base_before(self, epoch: float) -> str | None:
        """The commit HEAD pointed to at `epoch` (the newest one of HEAD's history committed
        no later), or None if there is none."""
        if self.head() is None:
            return None
        result = self.run("rev-list", "-1", f"--before={int(epoch)}", "HEAD", check=False)
        sha = decode(result.stdout).strip()
        return sha if result.returncode == 0 and sha else None

    def tree(self, commit: str | None) -> dict[str, Entry]:
        """Every file of `commit` below the project, by project-relative path."""
        if commit is None:
            return {}
        if commit not in self._trees:
            spec = f"{commit}:{self.prefix.rstrip('/')}" if self.prefix else f"{commit}^{{tree}}"
            result = self.run("ls-tree", "-r", "-z", "--full-tree", spec, check=False)
            entries: dict[str, Entry] = {}
            if result.returncode == 0:
                for record in result.stdout.split(b"\0"):
                    if not record:
                        continue
                    meta, path = record.split(b"\t", 1)
                    mode, _type, sha = meta.split(b" ")
                    entries[os.fsdecode(path)] = Entry(int(mode, 8), sha.decode())
            self._trees[commit] = entries
        return self._trees[commit]

    def fetch(self, shas: Iterable[str]) -> None:
        """Read these blobs in one `git cat-file --batch` (raw: no filters, no textconv)."""
        wanted = sorted({s for s in shas if s not in self._blobs})
        if not wanted:
            return
        out = self.run("cat-file", "--batch", data="".join(f"{s}\n" for s in wanted).encode())
        pos = 0
        for sha in wanted:
            end = out.stdout.index(b"\n", pos)
            header = out.stdout[pos:end].split(b" ")
            pos = end + 1
            if len(header) != 3 or header[1] != b"blob":
                self._blobs[sha] = None
                continue
            size = int(header[2])
            self._blobs[sha] = out.stdout[pos : pos + size]
            pos += size + 1

    def blob(self, sha: str) -> bytes | None:
        if sha not in self._blobs:
            self.fetch([sha])
        return self._blobs[sha]

    def index(self) -> dict[str, list[tuple[int, str, int]]]:
        """The real index's entries below the project: path -> [(mode, sha, stage)]."""
        result = self.run("ls-files", "-s", "-z")
        entries: dict[str, list[tuple[int, str, int]]] = {}
        for record in result.stdout.split(b"\0"):
            if not record:
                continue
            meta, path = record.split(b"\t", 1)
            mode, sha, stage = meta.split(b" ")
            entries.setdefault(os.fsdecode(path), []).append(
                (int(mode, 8), sha.decode(), int(stage))
            )
        return entries

    def merge(self, ours: bytes, base: bytes, theirs: bytes) -> bytes | None:
        """`git merge-file -p` of the three versions: the merged content, or None on a
        conflict (binary content included)."""
        with tempfile.TemporaryDirectory(prefix="sandboxfs-merge-") as tmp:
            names = []
            for name, data in (("head", ours), ("base", base), ("staged", theirs)):
                (Path(tmp) / name).write_bytes(data)
                names.append(str(Path(tmp) / name))
            result = self.run(
                "merge-file", "-p", "-L", "HEAD", "-L", "base", "-L", "staged", *names, check=False
            )
        return result.stdout if result.returncode == 0 else None

    def identity(self) -> dict[str, str]:
        """Author and committer: GIT_AUTHOR_*/GIT_COMMITTER_* if set, else the repository's
        user.name and user.email (its config file read as data), else sandboxfs."""

        def configured(key: str) -> str | None:
            config = self.common_dir / "config"
            result = self.run("config", "--file", str(config), "--get", key, check=False)
            value = decode(result.stdout).strip()
            return value if result.returncode == 0 and value else None

        name = os.environ.get("GIT_AUTHOR_NAME") or configured("user.name") or "sandboxfs"
        email = (
            os.environ.get("GIT_AUTHOR_EMAIL") or configured("user.email") or "sandboxfs@localhost"
        )
        return {
            "GIT_AUTHOR_NAME": name,
            "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_NAME": os.environ.get("GIT_COMMITTER_NAME") or name,
            "GIT_COMMITTER_EMAIL": os.environ.get("GIT_COMMITTER_EMAIL") or email,
        }


def _git(
    cwd: Path,
    args: list[str],
    data: bytes = b"",
    index: Path | None = None,
    check: bool = True,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    full_env = git_env(index)
    if env:
        full_env.update(env)
    try:
        result = subprocess.run(
            ["git", "--no-pager", *GIT_CONFIG, *args],
            input=data,
            capture_output=True,
            cwd=cwd,
            env=full_env,
            check=False,
        )
    except OSError as exc:
        raise UserError(f"cannot run git: {exc.strerror}", exit_code=1) from None
    if check and result.returncode != 0:
        why = decode(result.stderr).strip().splitlines()
        raise UserError(
            f"git {args[0]} failed: {escape_text(why[-1] if why else 'no message')}", exit_code=1
        )
    return result


# ----- reviews: the plan of what a commit would do ---------------------------------------------


class Problem(NamedTuple):
    text: str  # a phrase after the path, or a whole sentence for the commit as a whole
    conflict: bool = False


@dataclass
class Change:
    """What a staged commit does to one path, compared with HEAD."""

    path: str
    action: str  # create | update | mode | delete | same | absent | conflict
    old_mode: int | None = None
    mode: int | None = None
    old: bytes | None = None  # the content at HEAD
    new: bytes | None = None  # the content that would land (staged, or merged)
    runs_code: bool = False
    merged: bool = False
    problems: list[Problem] = field(default_factory=list)

    @property
    def lands(self) -> bool:
        return self.action in ("create", "update", "mode", "delete")

    @property
    def size(self) -> int | None:
        return None if self.new is None else len(self.new)

    @property
    def binary(self) -> bool:
        return any(b"\0" in data[:8000] for data in (self.old, self.new) if data is not None)


@dataclass
class Plan:
    """A staged commit compared with the repository: what would land, and why it would not."""

    changes: list[Change]
    problems: list[Problem]  # the commit's own (refused entries, message, nothing to do)
    head: str | None
    base: str | None

    def reasons(self) -> list[str]:
        """Every reason the commit is refused, one sentence each, names escaped."""
        out = [p.text for p in self.problems]
        out += [f"{escape_name(c.path)} {p.text}" for c in self.changes for p in c.problems]
        return out

    @property
    def applies(self) -> str:
        """yes, conflict (only conflicts stand in the way) or no."""
        every = [*self.problems, *(p for c in self.changes for p in c.problems)]
        if not every:
            return "yes"
        return "conflict" if all(p.conflict for p in every) else "no"

    def counts(self) -> tuple[int, int, int]:
        """(created, updated or mode-changed, deleted) paths."""
        actions = [c.action for c in self.changes]
        return (
            actions.count("create"),
            actions.count("update") + actions.count("mode"),
            actions.count("delete"),
        )


def _parents(path: str) -> Iterator[str]:
    parts = path.split("/")
    for depth in range(1, len(parts)):
        yield "/".join(parts[:depth])


def _dirs_of(paths: Iterable[str]) -> set[str]:
    return {parent for path in paths for parent in _parents(path)}


def message_problem(message: bytes | None) -> Problem | None:
    if message is None:
        return Problem(f"there is no {MESSAGE_NAME} (give the message with -m)")
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        return Problem(f"{MESSAGE_NAME} is not UTF-8 text (give the message with -m)")
    if not text.strip():
        return Problem(f"{MESSAGE_NAME} is empty (give the message with -m)")
    return None


@dataclass
class RepoState:
    """What a plan compares with: the git repository (None if the project is in none), its
    HEAD, the base of the staged commit, and the working tree if it is to be written."""

    project: Path
    git: Git | None
    deny: Patterns
    protect: Patterns
    flags: Patterns
    head: str | None = None
    _index: dict[str, list[tuple[int, str, int]]] | None = None

    @classmethod
    def open(cls, project: Path, deny: Sequence[str], protect: Sequence[str]) -> RepoState:
        git = Git.find(project)
        state = cls(project, git, Patterns(deny), Patterns(protect), flag_patterns())
        state.head = git.head() if git is not None else None
        return state

    def index(self) -> dict[str, list[tuple[int, str, int]]]:
        if self._index is None:
            self._index = self.git.index() if self.git is not None else {}
        return self._index


def make_plan(
    tree: StagedTree,
    repo: RepoState,
    base: str | None,
    *,
    worktree: bool,
    message_given: bool = False,
) -> Plan:
    """Compare `tree` with HEAD, three-way from `base` (the commit HEAD pointed to when it was
    staged; None: none known, so every change made in HEAD since is a conflict). With
    `worktree`, also check that the working tree and index can take the result (the commit
    on the current branch writes them)."""
    git = repo.git
    problems: list[Problem] = []
    if git is None:
        problems.append(Problem("the project is not in a git repository"))
    head_tree = git.tree(repo.head) if git is not None else {}
    base_tree = git.tree(base) if git is not None else {}
    head_dirs = _dirs_of(head_tree)
    if git is not None:
        git.fetch(
            e.sha
            for p in [*tree.files, *tree.deletions]
            for e in (head_tree.get(p), base_tree.get(p))
            if e is not None and e.mode != _MODE_GITLINK
        )
    changes: list[Change] = []
    for path, staged in tree.files.items():
        change = Change(path, "create", mode=staged.mode, new=staged.data)
        _plan_file(change, staged, head_tree, head_dirs, base_tree, git)
        changes.append(change)
    for path in tree.deletions:
        change = Change(path, "delete")
        if path in tree.files:
            change.problems.append(Problem(f"is both in {FILES_NAME}/ and in {DELETIONS_NAME}"))
        _plan_deletion(change, head_tree, head_dirs, base_tree, git)
        changes.append(change)
    for change in changes:
        problem = path_problem(change.path, repo.deny, repo.protect)
        if problem is not None:
            change.problems.insert(0, Problem(problem))
        change.runs_code = runs_code(change.path, change.mode, repo.flags)
    if worktree and git is not None:
        _check_worktree(changes, repo, head_tree)
    for entry in tree.refused:
        problems.append(Problem(f"{escape_name(entry.path)} is a {entry.kind}, not a regular file"))
    if not message_given:
        bad_message = message_problem(tree.message)
        if bad_message is not None:
            problems.append(bad_message)
    if not any(c.lands for c in changes) and not any(c.problems for c in changes):
        what = "its files are all in HEAD already" if changes else "it has no files"
        problems.append(Problem(f"nothing to commit: {what}"))
    order = review_order([c.path for c in changes], [c.path for c in changes if c.runs_code])
    rank = {path: i for i, path in enumerate(order)}
    changes.sort(key=lambda c: (rank[c.path], c.action == "delete"))
    return Plan(changes, problems, repo.head, base)


def _type_problem(path: str, tree: Mapping[str, Entry], dirs: set[str]) -> str | None:
    """Why `path` cannot be a regular file in this tree (beyond it existing as one)."""
    if path in dirs:
        return "is a directory in the repository"
    for parent in _parents(path):
        if parent in tree:
            kind = "a symlink" if tree[parent].mode == _MODE_LINK else "not a directory"
            return f"goes through {escape_name(parent)}, which is {kind} in the repository"
    entry = tree.get(path)
    if entry is not None and entry.mode == _MODE_LINK:
        return "is a symlink in the repository"
    if entry is not None and entry.mode == _MODE_GITLINK:
        return "is a submodule in the repository"
    return None


def _plan_file(
    change: Change,
    staged: StagedFile,
    head_tree: Mapping[str, Entry],
    head_dirs: set[str],
    base_tree: Mapping[str, Entry],
    git: Git | None,
) -> None:
    problem = _type_problem(change.path, head_tree, head_dirs)
    if problem is not None:
        change.problems.append(Problem(problem))
        return
    head, base = head_tree.get(change.path), base_tree.get(change.path)
    if head is None:
        if base is not None:
            change.action = "conflict"
            change.problems.append(
                Problem("was deleted in HEAD since it was staged (modify/delete)", True)
            )
        return
    assert git is not None
    old = git.blob(head.sha) or b""
    change.old, change.old_mode = old, head.mode
    if base is None:  # created by both sides (or no base is known)
        if old != staged.data:
            change.action = "conflict"
            change.problems.append(
                Problem("exists in HEAD with other content than staged (create/create)", True)
            )
            return
        result = old
    else:
        mine = git.blob(base.sha) or b""
        if head.sha == base.sha or old == staged.data:
            result = staged.data
        elif staged.data == mine:
            result = old
        else:
            merged = git.merge(old, mine, staged.data)
            if merged is None:
                change.action = "conflict"
                change.problems.append(
                    Problem("conflicts with changes made in HEAD since it was staged", True)
                )
                return
            result, change.merged = merged, True
        if staged.mode == base.mode:
            change.mode = head.mode
    change.new = result
    if result != old:
        change.action = "update"
    else:
        change.action = "mode" if change.mode != head.mode else "same"


def _plan_deletion(
    change: Change,
    head_tree: Mapping[str, Entry],
    head_dirs: set[str],
    base_tree: Mapping[str, Entry],
    git: Git | None,
) -> None:
    if change.path in head_dirs:
        change.problems.append(
            Problem("is a directory in the repository (list each of its files to delete)")
        )
        return
    head, base = head_tree.get(change.path), base_tree.get(change.path)
    if head is None:
        change.action = "absent"
        return
    change.old_mode = head.mode
    if head.mode == _MODE_GITLINK:
        change.problems.append(Problem("is a submodule in the repository"))
        return
    if git is not None:
        change.old = git.blob(head.sha)  # a symlink's blob is its target
    if base is None or base != head:
        change.action = "conflict"
        why = "was created" if base is None else "changed"
        change.problems.append(Problem(f"{why} in HEAD since it was staged (delete/modify)", True))


def _check_worktree(changes: list[Change], repo: RepoState, head_tree: Mapping[str, Entry]) -> None:
    """Each path that lands must be clean: the working tree and the index hold what HEAD
    holds (or nothing, for a create), and no component of the way is a symlink."""
    index = repo.index()
    index_dirs = _dirs_of(index)
    with WorkTree(repo.project) as wt:
        for change in changes:
            if not change.lands or change.problems:
                continue
            path = change.path
            head = head_tree.get(path)
            staged_in_index = index.get(path, [])
            if any(stage != 0 for _, _, stage in staged_in_index):
                change.problems.append(Problem("has unresolved merge conflicts in the index"))
                continue
            expected = [(head.mode, head.sha, 0)] if head is not None else []
            if staged_in_index != expected or path in index_dirs:
                change.problems.append(Problem("has uncommitted changes (in the index)"))
                continue
            if any(parent in index for parent in _parents(path)):
                change.problems.append(Problem("has uncommitted changes (in the index)"))
                continue
            try:
                clean = wt.holds(path, change.old, change.old_mode)
            except WorkTreeError as exc:
                change.problems.append(Problem(exc.phrase))
                continue
            if clean:
                continue
            if head is None:
                change.problems.append(
                    Problem("exists in the working tree but is not in HEAD (untracked)")
                )
            else:
                change.problems.append(Problem("has uncommitted changes"))


# ----- the working tree, written without following symlinks ------------------------------------


class WorkTreeError(Exception):
    def __init__(self, phrase: str) -> None:
        super().__init__(phrase)
        self.phrase = phrase


class WorkTree:
    """The project directory, walked one component at a time with O_NOFOLLOW: no symlink,
    mount point or sandboxfs state directory is ever gone through."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._fds: dict[str, int] = {}
        self._dev = 0
        self._hidden: set[tuple[int, int]] = set()
        self.created_dirs: list[str] = []

    def __enter__(self) -> WorkTree:
        fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds[""] = fd
        self._dev = os.fstat(fd).st_dev
        self._hidden = hidden_identities(self._root)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def directory(self, rel: str, create: bool = False) -> int | None:
        """The descriptor of the directory `rel` ("" for the root); None if it does not exist
        (and not `create`). Raises WorkTreeError for a symlink or anything not a directory."""
        if rel in self._fds:
            return self._fds[rel]
        parent_rel, _, name = rel.rpartition("/")
        parent = self.directory(parent_rel, create)
        if parent is None:
            return None
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            os.mkdir(name, 0o777, dir_fd=parent)
            self.created_dirs.append(rel)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise WorkTreeError(
                        f"goes through a symlink in the repository ({escape_name(rel)})"
                    ) from None
                raise WorkTreeError(
                    f"goes through {escape_name(rel)}, which is not a directory in the working tree"
                ) from None
            raise
        st = os.fstat(fd)
        if st.st_dev != self._dev:
            os.close(fd)
            raise WorkTreeError(f"goes through a mount point ({escape_name(rel)})")
        if (st.st_dev, st.st_ino) in self._hidden:
            os.close(fd)
            raise WorkTreeError(f"goes through sandboxfs's state directory ({escape_name(rel)})")
        self._fds[rel] = fd
        return fd

    def inspect(self, path: str) -> tuple[bytes, int] | None:
        """(content, git mode) of the regular file at `path`, or None if nothing is there."""
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        if parent is None:
            return None
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise WorkTreeError("is a symlink in the working tree")
        if not stat.S_ISREG(st.st_mode):
            raise WorkTreeError(f"is a {_kind(st.st_mode)} in the working tree")
        fd = os.open(name, _READ_FLAGS, dir_fd=parent)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WorkTreeError(f"is a {_kind(st.st_mode)} in the working tree")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks), MODE_EXEC if st.st_mode & 0o100 else MODE_FILE

    def holds(self, path: str, data: bytes | None, mode: int | None) -> bool:
        """Whether the working tree has exactly this at `path`: a file with this content and
        git mode, a symlink with this target (mode 120000), or nothing (mode None)."""
        if mode != _MODE_LINK:
            return self.inspect(path) == (None if mode is None else (data, mode))
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        if parent is None:
            return False
        try:
            return os.readlink(os.fsencode(name), dir_fd=parent) == data
        except OSError:
            return False

    def write_temp(self, path: str, data: bytes, mode: int) -> str:
        """Write `data` to a new temporary name beside `path` (creating the directories on
        the way); returns that name, for `replace`."""
        parent_rel = path.rpartition("/")[0]
        parent = self.directory(parent_rel, create=True)
        assert parent is not None
        name = f".sandboxfs-{secrets.token_hex(8)}.tmp"
        fd = os.open(name, _CREATE_FLAGS, 0o777 if mode == MODE_EXEC else 0o666, dir_fd=parent)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return name

    def replace(self, path: str, temp: str) -> None:
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        assert parent is not None
        os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)

    def remove_temp(self, path: str, temp: str) -> None:
        parent = self.directory(path.rpartition("/")[0])
        if parent is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=parent)

    def remove_created_dirs(self) -> None:
        for rel in reversed(self.created_dirs):
            parent_rel, _, name = rel.rpartition("/")
            fd = self._fds.pop(rel, None)
            if fd is not None:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=self._fds[parent_rel])
        self.created_dirs.clear()

    def delete(self, path: str) -> None:
        """Remove the file at `path`, then each directory above it that is left empty."""
        parent_rel, _, name = path.rpartition("/")
        parent = self.directory(parent_rel)
        if parent is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        while parent_rel:
            above, _, name = parent_rel.rpartition("/")
            fd = self._fds.pop(parent_rel)
            os.close(fd)
            try:
                os.rmdir(name, dir_fd=self._fds[above])
            except OSError:
                return
            parent_rel = above


# ----- staged commits of a workspace and their review state ----------------------------------


def valid_id(commit_id: str) -> bool:
    return bool(_ID_RE.match(commit_id))


def check_commit_id(commit_id: str) -> str:
    if not valid_id(commit_id):
        raise UserError(
            f"invalid staged commit id {escape_name(commit_id)!s}: use 1-64 letters, digits, "
            "'.', '_' or '-', not starting with '.'"
        )
    return commit_id


def _now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(text: object) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass
class Review:
    """One staged commit as a review sees it: its content (the snapshot once frozen) and its
    recorded state."""

    commit_id: str
    tree: StagedTree | None  # None: its content could not be read (see `error`)
    state: dict[str, Any]
    frozen: bool
    error: str | None = None

    @property
    def status(self) -> str:
        return str(self.state.get("status") or "pending")

    @property
    def session(self) -> str | None:
        session = self.state.get("session")
        return session if isinstance(session, str) else None

    @property
    def created(self) -> datetime | None:
        return _parse_ts(self.state.get("created"))

    @property
    def base(self) -> str | None:
        base = self.state.get("base")
        return base if isinstance(base, str) else None

    @property
    def digest(self) -> str | None:
        if self.frozen:
            digest = self.state.get("digest")
            return digest if isinstance(digest, str) else None
        return self.tree.digest() if self.tree is not None else None

    def subject(self) -> str:
        message = self.tree.message if self.tree is not None else None
        if not message:
            return ""
        return decode(message).strip().split("\n", 1)[0].strip()


class Workspace:
    """The staged commits of one workspace of a project, and their review state."""

    def __init__(self, project: Path, workspace: str) -> None:
        self.project = project
        self.name = check_id("workspace", workspace)
        self.staged = state_dir(project) / "workspaces" / workspace / "staged"
        self.review = review_dir(project, workspace)
        self._sessions: dict[str, tuple[str | None, datetime | None]] | None = None

    # -- finding them

    def listing(self) -> tuple[list[str], list[str]]:
        """(staged commit ids, staged or under review, in name order; names in /staged that
        are none, with why)."""
        ids: set[str] = set()
        ignored: list[str] = []
        fd = self._open_dir(self.staged)
        if fd is not None:
            try:
                for name in os.listdir(fd):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    shown = f"/staged/{escape_name(name)}"
                    if not valid_id(name):
                        ignored.append(f"{shown}: not a staged commit id")
                    elif not stat.S_ISDIR(st.st_mode):
                        ignored.append(f"{shown}: a {_kind(st.st_mode)}, not a directory")
                    else:
                        ids.add(name)
            finally:
                os.close(fd)
        fd = self._open_dir(self.review)
        if fd is not None:
            try:
                ids.update(
                    name
                    for name in os.listdir(fd)
                    if valid_id(name) and self.read_state(name) is not None
                )
            finally:
                os.close(fd)
        return sorted(ids), sorted(ignored)

    @staticmethod
    def _open_dir(path: Path) -> int | None:
        try:
            return os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UserError(f"{path} is not a directory", exit_code=1) from None
            raise

    def open_staged(self, commit_id: str) -> int | None:
        """A descriptor of /staged/<id>'s backing directory, or None if there is none."""
        parent = self._open_dir(self.staged)
        if parent is None:
            return None
        try:
            return os.open(commit_id, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return None
            raise
        finally:
            os.close(parent)

    def exists_staged(self, commit_id: str) -> bool:
        fd = self.open_staged(commit_id)
        if fd is not None:
            os.close(fd)
        return fd is not None

    def exists(self, commit_id: str) -> bool:
        return self.exists_staged(commit_id) or self.read_state(commit_id) is not None

    def require(self, commit_id: str) -> str:
        check_commit_id(commit_id)
        if not self.exists(commit_id):
            raise UserError(
                f"no staged commit {commit_id} in workspace {self.name} of {self.project} "
                "(see 'sandboxfs staged list')"
            )
        return commit_id

    # -- where they came from

    def sessions(self) -> dict[str, tuple[str | None, datetime | None]]:
        """For each staged commit id, the session and time of the first audit entry below
        /staged/<id>."""
        if self._sessions is None:
            found: dict[str, tuple[str | None, datetime | None]] = {}
            for entry in query(
                audit_path(self.project), AuditQuery(workspace=self.name, zone="staged")
            ):
                path = entry.get("path")
                if entry.get("op") == "stage" or not isinstance(path, str):
                    continue
                if not path.startswith("/staged/"):
                    continue
                commit_id = path[len("/staged/") :].split("/", 1)[0]
                if commit_id and commit_id not in found:
                    session = entry.get("session")
                    found[commit_id] = (
                        session if isinstance(session, str) else None,
                        _parse_ts(entry.get("ts")),
                    )
            self._sessions = found
        return self._sessions

    def _origin(self, commit_id: str, dir_fd: int) -> tuple[str | None, datetime]:
        """The session that staged it, and when it was created: the earliest of its
        directory's mtime and ctime and its first audit entry."""
        st = os.fstat(dir_fd)
        session, first = self.sessions().get(commit_id, (None, None))
        created = datetime.fromtimestamp(min(st.st_mtime, st.st_ctime), UTC)
        if first is not None and first < created:
            created = first
        return session, created

    # -- review state

    def _review_dir(self, commit_id: str) -> Path:
        try:
            return ensure_dirs(self.project, STATE_DIR_NAME, *self._review_parts(commit_id))
        except SandboxError as exc:
            raise UserError(f"cannot create the review directory: {exc.reason}", 1) from None

    def _review_parts(self, commit_id: str) -> tuple[str, ...]:
        return ("workspaces", self.name, "review", commit_id)

    def read_state(self, commit_id: str) -> dict[str, Any] | None:
        path = self.review / commit_id / "state.json"
        try:
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            with os.fdopen(fd, "rb") as stream:
                data = json.loads(stream.read())
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"{path} is not valid JSON; move it away", exit_code=1) from None
        return data if isinstance(data, dict) else None

    def write_state(self, commit_id: str, state: Mapping[str, Any]) -> None:
        directory = self._review_dir(commit_id)
        fd = os.open(directory, _DIR_FLAGS)
        try:
            temp = f".state-{secrets.token_hex(6)}.tmp"
            out = os.open(temp, _CREATE_FLAGS, 0o600, dir_fd=fd)
            with os.fdopen(out, "wb") as stream:
                stream.write(json.dumps(dict(state), indent=2, sort_keys=True).encode() + b"\n")
                stream.flush()
                os.fsync(stream.fileno())
            os.rename(temp, "state.json", src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def locked(self, commit_id: str) -> Iterator[None]:
        """One review, freeze, commit or discard of a staged commit at a time."""
        directory = self._review_dir(commit_id)
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- reading, freezing

    def load(self, commit_id: str, git: Git | None) -> Review:
        """The staged commit as it is now: its snapshot if frozen, else its live directory
        (read, not frozen)."""
        state = self.read_state(commit_id)
        if state is not None and state.get("digest"):
            return self._snapshot(commit_id, state)
        fd = self.open_staged(commit_id)
        if fd is None:
            return Review(commit_id, None, state or {}, False, "its files are gone")
        try:
            fresh = state or self._fresh_state(commit_id, fd, git)
            try:
                tree = read_tree(fd, commit_id)
            except TooLarge as exc:
                return Review(commit_id, None, fresh, False, exc.message)
        finally:
            os.close(fd)
        return Review(commit_id, tree, fresh, False)

    def _fresh_state(self, commit_id: str, dir_fd: int, git: Git | None) -> dict[str, Any]:
        session, created = self._origin(commit_id, dir_fd)
        return {
            "id": commit_id,
            "status": "pending",
            "digest": None,
            "session": session,
            "created": iso(created),
            "base": git.base_before(created.timestamp()) if git is not None else None,
            "shown_at": None,
            "committed_at": None,
            "commit": None,
            "branch": None,
            "discarded_at": None,
        }

    def _snapshot(self, commit_id: str, state: dict[str, Any]) -> Review:
        fd = self._open_dir(self.review / commit_id / "snapshot")
        if fd is None:
            return Review(commit_id, None, state, True, "its snapshot is gone")
        try:
            tree = read_tree(fd, commit_id)
        finally:
            os.close(fd)
        tree.refused = [Refused(str(p), str(k)) for p, k in state.get("refused", [])]
        tree.unknown = [str(u) for u in state.get("unknown", [])]
        return Review(commit_id, tree, state, True)

    def freeze(self, commit_id: str, git: Git | None) -> Review:
        """Take the snapshot if it has none yet (see the module doc); the review of it."""
        with self.locked(commit_id):
            state = self.read_state(commit_id)
            if state is not None and state.get("digest"):
                return self._snapshot(commit_id, state)
            fd = self.open_staged(commit_id)
            if fd is None:
                raise UserError(f"staged commit {commit_id} has no files to review", 1)
            try:
                if state is None:
                    state = self._fresh_state(commit_id, fd, git)
                    state["shown_at"] = iso(_now())
                    self.write_state(commit_id, state)  # from here on the mount refuses changes
                tree = read_tree(fd, commit_id)
            finally:
                os.close(fd)
            directory = self._review_dir(commit_id)
            snapshot, temp = directory / "snapshot", directory / "snapshot.tmp"
            for stale in (snapshot, temp):
                if stale.exists() or stale.is_symlink():
                    shutil.rmtree(stale)
            ensure_dirs(directory, "snapshot.tmp", mode=0o700)
            out = os.open(temp, _DIR_FLAGS)
            try:
                write_tree(tree, out)
            finally:
                os.close(out)
            os.rename(temp, snapshot)
            state["digest"] = tree.digest()
            state["refused"] = [list(r) for r in tree.refused]
            state["unknown"] = list(tree.unknown)
            self.write_state(commit_id, state)
            return Review(commit_id, tree, state, True)

    def remove_staged(self, commit_id: str) -> bool:
        """Remove /staged/<id> from the backing directory; never follows a symlink in it."""
        parent = self._open_dir(self.staged)
        if parent is None:
            return False
        try:
            try:
                st = os.stat(commit_id, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(commit_id, dir_fd=parent)
            else:
                os.unlink(commit_id, dir_fd=parent)
            return True
        finally:
            os.close(parent)


# ----- audit --------------------------------------------------------------------------------------


def record(
    ws: Workspace,
    commit_id: str,
    session: str | None,
    detail: str,
    allowed: bool = True,
    reason: str | None = None,
) -> None:
    """Append an entry of op `stage` to the project's audit log, durably."""
    try:
        log = AuditLog(audit_path(ws.project))
        try:
            log.record(
                {
                    "op": "stage",
                    "path": f"/staged/{commit_id}",
                    "zone": "staged",
                    "session": session,
                    "workspace": ws.name,
                    "trust": None,
                    "allowed": allowed,
                    "reason": reason,
                    "errno": None,
                    "pid": os.getpid(),
                    "uid": os.getuid(),
                    "comm": "sandboxfs",
                    "bytes": None,
                    "detail": detail,
                }
            )
            log.flush()
        finally:
            log.close()
    except OSError as exc:
        raise UserError(
            f"cannot write the audit log {audit_path(ws.project)}: {exc.strerror}", exit_code=1
        ) from None


# ----- committing ---------------------------------------------------------------------------------


class CommitRefused(Exception):
    def __init__(self, reasons: Sequence[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = list(reasons)


@dataclass
class Landed:
    commit: str
    branch: str | None  # the branch it is on; None when HEAD is detached
    new_branch: bool
    plan: Plan
    warnings: list[str] = field(default_factory=list)


_TRAILER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*: ")


def commit_message(text: str, session: str | None, commit_id: str) -> bytes:
    """The message, trailing spaces and blank lines trimmed, with the two sandboxfs trailers
    (in the message's own trailer block if it ends with one)."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    paragraph: list[str] = []
    for line in reversed(lines):
        if not line:
            break
        paragraph.append(line)
    has_trailers = len(paragraph) < len(lines) and all(_TRAILER_RE.match(x) for x in paragraph)
    if not has_trailers:
        lines.append("")
    lines += [f"Sandboxfs-Session: {session or 'unknown'}", f"Sandboxfs-Staged: {commit_id}"]
    return ("\n".join(lines) + "\n").encode("utf-8")


def land(
    review: Review,
    repo: RepoState,
    *,
    message: str | None = None,
    branch: str | None = None,
    expect: str | None = None,
) -> Landed:
    """Make ONE git commit of a frozen staged commit: on the current branch (working tree and
    index follow), or on a new `branch` (nothing checked out changes). All or nothing: any
    reason raises CommitRefused before a file, the index or a ref changes."""
    git = repo.git
    if git is None:
        raise CommitRefused(["the project is not in a git repository"])
    tree = review.tree
    if tree is None:
        raise CommitRefused([review.error or "its content cannot be read"])
    if review.status != "pending":
        done = f" as {review.state.get('commit')}" if review.status == "committed" else ""
        raise CommitRefused([f"it was {review.status}{done} already"])
    reasons: list[str] = []
    if review.digest != tree.digest():
        reasons.append("its snapshot changed on disk after it was frozen")
    elif expect is not None and normal_digest(expect) != review.digest:
        reasons.append(f"its digest is {review.digest}, not the expected {escape_name(expect)}")
    ref = None
    if branch is not None:
        ref = _branch_ref(git, branch, reasons)
    elif (git.git_dir / "index.lock").exists():
        reasons.append("another git process is running (.git/index.lock exists)")
    plan = make_plan(
        tree, repo, review.base, worktree=branch is None, message_given=message is not None
    )
    reasons += plan.reasons()
    if reasons:
        raise CommitRefused(reasons)
    text = message if message is not None else (tree.message or b"").decode("utf-8")
    body = commit_message(text, review.session, review.commit_id)
    landing = [c for c in plan.changes if c.lands]
    head = repo.head
    with tempfile.TemporaryDirectory(prefix="sandboxfs-staged-") as tmp:
        new_commit, info = _make_commit(git, Path(tmp), head, landing, body)
    if ref is not None:
        _update_ref(git, ref, new_commit, None, review.commit_id)
        return Landed(new_commit, branch, True, plan)
    warnings = _land_here(git, repo.project, review.commit_id, head, new_commit, landing)
    updated = git.run("update-index", "-z", "--index-info", data=info, check=False)
    if updated.returncode != 0:
        warnings.append("the index was not updated: 'git reset -q' brings it to HEAD")
    return Landed(new_commit, git.branch(), False, plan, warnings)


def normal_digest(text: str) -> str:
    text = text.strip().lower()
    return text if text.startswith("sha256:") else f"sha256:{text}"


def _branch_ref(git: Git, branch: str, reasons: list[str]) -> str | None:
    checked = git.run("check-ref-format", "--branch", branch, check=False)
    if branch.startswith("-") or checked.returncode != 0:
        reasons.append(f"{escape_name(branch)} is not a valid branch name")
        return None
    ref = f"refs/heads/{decode(checked.stdout).strip()}"
    if git.run("rev-parse", "-q", "--verify", ref, check=False).returncode == 0:
        reasons.append(f"branch {escape_name(branch)} exists already")
        return None
    return ref


def _make_commit(
    git: Git, tmp: Path, head: str | None, landing: Sequence[Change], message: bytes
) -> tuple[str, bytes]:
    """Blobs, a tree from a private index, and the commit object; no ref changes. Returns
    the commit and the --index-info lines that bring an index at HEAD to it."""
    blobs = tmp / "blobs"
    blobs.mkdir()
    written = [c for c in landing if c.action != "delete"]
    names = []
    for number, change in enumerate(written):
        (blobs / str(number)).write_bytes(change.new or b"")
        names.append(str(blobs / str(number)))
    shas: dict[str, str] = {}
    if names:
        out = git.run(
            "hash-object", "-w", "--no-filters", "--stdin-paths", data="\n".join(names).encode()
        )
        shas = dict(zip((c.path for c in written), decode(out.stdout).split(), strict=True))
    zero = "0" * len(head or next(iter(shas.values()), "0" * 40))
    lines = []
    for change in landing:
        name = os.fsencode(git.full(change.path))
        if change.action == "delete":
            lines.append(b"0 %s\t%s\0" % (zero.encode(), name))
        else:
            mode = change.mode or MODE_FILE
            lines.append(b"%o %s\t%s\0" % (mode, shas[change.path].encode(), name))
    info = b"".join(lines)
    index = tmp / "index"
    git.run("read-tree", *(["--empty"] if head is None else [head]), index=index)
    git.run("update-index", "-z", "--index-info", data=info, index=index)
    new_tree = decode(git.run("write-tree", index=index).stdout).strip()
    parents = ["-p", head] if head is not None else []
    out = git.run(
        "commit-tree",
        new_tree,
        *parents,
        "--no-gpg-sign",
        "-F",
        "-",
        data=message,
        env=git.identity(),
    )
    return decode(out.stdout).strip(), info


def _update_ref(git: Git, ref: str, new: str, old: str | None, commit_id: str) -> None:
    result = git.run(
        "update-ref",
        "-m",
        f"sandboxfs: staged commit {commit_id}",
        ref,
        new,
        old or "",
        check=False,
    )
    if result.returncode != 0:
        why = decode(result.stderr).strip().splitlines()
        raise CommitRefused(
            [f"{ref} moved meanwhile ({escape_text(why[-1] if why else 'update-ref failed')})"]
        )


def _land_here(
    git: Git,
    project: Path,
    commit_id: str,
    head: str | None,
    new_commit: str,
    landing: Sequence[Change],
) -> list[str]:
    """Write every file beside its target, check that nothing changed meanwhile, move HEAD's
    branch to `new_commit` (compare-and-swap), then rename the files into place and delete
    the deleted ones. Before the ref moves, any failure undoes the temporary files. Returns
    warnings about files that could not be put in place after the ref moved."""
    temps: dict[str, str] = {}
    warnings: list[str] = []
    with WorkTree(project) as wt:
        try:
            for change in landing:
                if change.action != "delete":
                    temps[change.path] = wt.write_temp(
                        change.path, change.new or b"", change.mode or MODE_FILE
                    )
            for change in landing:
                if not wt.holds(change.path, change.old, change.old_mode):
                    raise WorkTreeError(f"{escape_name(change.path)} changed meanwhile")
            _update_ref(git, "HEAD", new_commit, head, commit_id)
        except (OSError, WorkTreeError, CommitRefused) as exc:
            for path, temp in temps.items():
                wt.remove_temp(path, temp)
            wt.remove_created_dirs()
            if isinstance(exc, CommitRefused):
                raise
            why = exc.phrase if isinstance(exc, WorkTreeError) else exc.strerror
            raise CommitRefused([f"the working tree cannot be written: {why}"]) from None
        for change in landing:
            try:
                if change.action == "delete":
                    wt.delete(change.path)
                else:
                    wt.replace(change.path, temps[change.path])
            except (OSError, WorkTreeError) as exc:
                why = exc.phrase if isinstance(exc, WorkTreeError) else exc.strerror
                warnings.append(f"{escape_name(change.path)} was not written ({why})")
    return warnings


def pending(project: Path, workspace: str) -> list[str]:
    """Ids of the workspace's staged commits still waiting for review or commit (freezing
    nothing; an entry whose state cannot be read is left out)."""
    space = Workspace(project, workspace)
    ids, _ = space.listing()
    waiting = []
    for commit_id in ids:
        try:
            state = space.read_state(commit_id)
        except UserError:
            continue
        if state is None or state.get("status", "pending") == "pending":
            waiting.append(commit_id)
    return waiting
