"""Git, without running any of the repository's code: no hooks, no fsmonitor, no filters, no
textconv, no external diff, no pager, no system or global config; only plumbing, with a
private index where one is written. `git_env` is the environment of every git sandboxfs runs,
`Git` the work tree that contains the project.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from sandboxfs.errors import Failure
from sandboxfs.project import identity

from .text import decode, escape_text

MODE_LINK = 0o120000  # git's mode of a symlink
MODE_GITLINK = 0o160000  # and of a submodule

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
            raise Failure("git is not installed: staged commits land in git")
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
        """Author and committer: the user's (sandboxfs.project.identity:
        GIT_AUTHOR_*/GIT_COMMITTER_* if set, else user.name and user.email of the repository's
        config, else of the user's global config, each read as data), else sandboxfs."""
        found = identity.identity([self.common_dir / "config"])
        name = found.get("GIT_AUTHOR_NAME", "sandboxfs")
        email = found.get("GIT_AUTHOR_EMAIL", "sandboxfs@localhost")
        return {
            "GIT_AUTHOR_NAME": name,
            "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_NAME": found.get("GIT_COMMITTER_NAME", name),
            "GIT_COMMITTER_EMAIL": found.get("GIT_COMMITTER_EMAIL", email),
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
        raise Failure(f"cannot run git: {exc.strerror}") from None
    if check and result.returncode != 0:
        why = decode(result.stderr).strip().splitlines()
        raise Failure(f"git {args[0]} failed: {escape_text(why[-1] if why else 'no message')}")
    return result
