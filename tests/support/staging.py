"""Staged commits: a git repository, a staged commit's directory, `sandboxfs staged` in-process."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandboxfs.cli import staged as staged_cli
from sandboxfs.cli import staged_parser
from sandboxfs.cli.main import exit_code
from sandboxfs.errors import SandboxfsError

NOW = int(time.time())
BEFORE_STAGING = NOW - 7200  # commits the agent saw
STAGED_AT = NOW - 3600  # when the agent staged (its directory's mtime)
AFTER_STAGING = NOW - 1800  # commits the user made meanwhile
GIT_ENV = {
    "GIT_AUTHOR_NAME": "Ursula User",
    "GIT_AUTHOR_EMAIL": "ursula@example.com",
    "GIT_COMMITTER_NAME": "Ursula User",
    "GIT_COMMITTER_EMAIL": "ursula@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}
SOURCE = "".join(f"line {n}\n" for n in range(1, 21))


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def git(repo: Path, *args: str, date: int | None = None) -> str:
    env = {**os.environ, **GIT_ENV}
    if date is not None:
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = f"@{date} +0000"
    result = subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def make_repo(root: Path, files: Mapping[str, str] | None = None) -> Path:
    """A git repository with one commit from before staging, and .sandbox ignored as a mount
    leaves it."""
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.name", "Rita Repo")  # what sandboxfs commits as
    git(repo, "config", "user.email", "rita@example.com")
    for path, text in (files if files is not None else {"src/a.py": SOURCE}).items():
        write(repo / path, text)
    if files != {}:
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "initial", date=BEFORE_STAGING)
    (repo / ".sandbox").mkdir()
    (repo / ".sandbox" / ".gitignore").write_text("*\n")
    return repo


def write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)


def staged_dir(repo: Path, commit_id: str, workspace: str = "default") -> Path:
    return repo / ".sandbox" / "workspaces" / workspace / "staged" / commit_id


def staged(repo: Path, *args: str) -> Result:
    """`sandboxfs staged ARGS --project REPO`, in-process, as cli.main would run it."""
    parser = argparse.ArgumentParser(prog="sandboxfs")
    sub = parser.add_subparsers(dest="command", required=True)
    staged_parser.add_parser(sub)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = staged_cli.main(parser.parse_args(["staged", *args, "--project", str(repo)]))
        except SandboxfsError as exc:
            print(f"sandboxfs: {exc.message}", file=sys.stderr)
            code = exit_code(exc, run=False)
    return Result(code, out.getvalue(), err.getvalue())


def audit_entries(repo: Path) -> list[dict[str, Any]]:
    path = repo / ".sandbox" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
