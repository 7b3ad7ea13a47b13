"""Commits carry the user's identity: `git commit` inside `run`, and a landed staged commit.

The user's name lives in their global git config, which the program never sees (its HOME is
the session's); run reads it once outside and passes GIT_AUTHOR_*/GIT_COMMITTER_*.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import SANDBOXFS
from tests.support.run import nothing_left_behind, sbx

__all__ = ["nothing_left_behind"]  # the run tests' check that no mount is left, used here too

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)


def git(cwd: Path, *args: str, env: dict[str, str]) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def user(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A user whose identity is only in ~/.gitconfig, and their repository."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[user]\n\tname = Ada Lovelace\n\temail = ada@example.org\n")
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1"}
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main", env=env)
    (repo / "README.md").write_text("readme\n")
    (repo / ".gitignore").write_text(".sandbox/\n")
    git(repo, "add", ".", env=env)
    git(repo, "commit", "-qm", "first", env=env)
    return repo, env


def test_commit_inside_carries_the_callers_identity(user: tuple[Path, dict[str, str]]) -> None:
    repo, env = user
    script = "echo more >> README.md && git commit -qam inside && git log -1 --format=%an/%ae/%cn"
    result = sbx(
        "run", "--quiet", "--project", repo, "--trust", "full", "--", "sh", "-c", script, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Ada Lovelace/ada@example.org/Ada Lovelace"
    assert git(repo, "log", "-1", "--format=%s %an", env=env).strip() == "inside Ada Lovelace"


def test_staged_commit_lands_with_the_user_as_committer(
    user: tuple[Path, dict[str, str]],
) -> None:
    repo, env = user
    script = (
        "mkdir -p /sandbox/staged/fix/files && echo fixed > /sandbox/staged/fix/files/README.md"
    )
    result = sbx(
        "run",
        "--quiet",
        "--project",
        repo,
        "--trust",
        "untrusted",
        "--",
        "sh",
        "-c",
        script,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    landed = subprocess.run(
        [*SANDBOXFS, "staged", "commit", "fix", "-m", "fix", "--project", str(repo)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert landed.returncode == 0, landed.stderr
    who = git(repo, "log", "-1", "--format=%an <%ae>|%cn <%ce>", env=env).strip()
    assert who == "Ada Lovelace <ada@example.org>|Ada Lovelace <ada@example.org>"
