"""Commits carry the user's identity: `git commit` inside `run`, and a landed staged commit.

The user's name lives in their global git config, which the program never sees (its HOME is
the session's); run reads it once outside and passes GIT_AUTHOR_*/GIT_COMMITTER_*, and sets
user.name and user.email (only those) in the sandbox home's ~/.gitconfig, for what reads the
config instead (`git config user.name`, GitPython and aider).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import SANDBOXFS
from tests.support.run import NOBODY, NOBODY_UID, nobody_env, nobody_home, nothing_left_behind, sbx

__all__ = ["nobody_home", "nothing_left_behind"]  # fixtures, used by name

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


# What a program reads of git's config: the identity as git picks it, the global file as
# GitPython reads it (~/.gitconfig itself), and every setting git sees, with its origin.
CONFIG_PROBE = (
    "git config user.name; git config user.email; echo ---; cat ~/.gitconfig; echo ---; "
    "git config --global --list --show-origin; echo ---; git config --list --show-origin"
)


@pytest.mark.parametrize("level", ["untrusted", "session", "workspace", "full"])
def test_every_home_has_the_users_identity_as_git_config(
    user: tuple[Path, dict[str, str]], level: str
) -> None:
    repo, env = user
    result = sbx(
        "run",
        "--quiet",
        "--project",
        repo,
        "--trust",
        level,
        "--",
        "sh",
        "-c",
        CONFIG_PROBE,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    identity, home_file, global_list, _ = result.stdout.split("---\n")
    assert identity == "Ada Lovelace\nada@example.org\n"
    assert "Ada Lovelace" in home_file  # the file GitPython reads
    assert global_list.splitlines() == [
        "file:/sandbox/home/.gitconfig\tuser.name=Ada Lovelace",
        "file:/sandbox/home/.gitconfig\tuser.email=ada@example.org",
    ]


def test_only_the_name_and_email_of_the_users_config_reach_the_home(
    user: tuple[Path, dict[str, str]],
) -> None:
    """A token in a url rewrite, a credential helper and an include stay outside; what the
    program itself keeps in its ~/.gitconfig stays from one run to the next."""
    repo, env = user
    home = Path(env["HOME"])
    (home / "included").write_text("[core]\n\tsshCommand = ssh -i /outside/included-key\n")
    (home / ".gitconfig").write_text(
        "[user]\n\tname = Ada Lovelace\n\temail = ada@example.org\n"
        "[credential]\n\thelper = store --file /outside/tok-creds\n"
        '[url "https://ghp_TOKEN123@github.com/"]\n\tinsteadOf = https://github.com/\n'
        f"[include]\n\tpath = {home / 'included'}\n"
        f'[includeIf "gitdir:/"]\n\tpath = {home / "included"}\n'
    )
    mine = "git config --global core.pager cat && git config --global user.name Someone"
    first = sbx(
        "run", "-q", "--project", repo, "--trust", "workspace", "--", "sh", "-c", mine, env=env
    )
    assert first.returncode == 0, first.stderr
    result = sbx(
        "run",
        "-q",
        "--project",
        repo,
        "--trust",
        "workspace",
        "--",
        "sh",
        "-c",
        CONFIG_PROBE,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    # the machine's own /etc/gitconfig is seen inside as it is outside: not the user's
    seen = "\n".join(x for x in result.stdout.lower().splitlines() if "/etc/gitconfig" not in x)
    for leaked in ("token123", "tok-creds", "credential", "insteadof", "include", "sshcommand"):
        assert leaked not in seen, result.stdout
    assert result.stdout.startswith("Ada Lovelace\nada@example.org\n"), result.stdout
    assert "core.pager=cat" in result.stdout  # the program's own setting is kept


def test_an_ordinary_users_home_has_their_identity(nobody_home: Path) -> None:
    (nobody_home / "home" / ".gitconfig").write_text(
        "[user]\n\tname = Nobody Here\n\temail = nobody@example.org\n"
        "[credential]\n\thelper = store\n"
    )
    os.chown(nobody_home / "home" / ".gitconfig", NOBODY_UID, NOBODY_UID)
    result = sbx(
        "run",
        "-q",
        "--project",
        nobody_home / "project",
        "--trust",
        "workspace",
        "--",
        "sh",
        "-c",
        "git config user.name; git config --global --list",
        prefix=NOBODY,
        env=nobody_env(nobody_home),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "Nobody Here",
        "user.name=Nobody Here",
        "user.email=nobody@example.org",
    ]
