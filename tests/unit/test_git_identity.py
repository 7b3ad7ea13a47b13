"""The user's git identity, as run reads it outside (sandboxfs.project.identity): git's own
choice among the config files, one `git config` per file, and nothing but plain values."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.project import identity
from sandboxfs.run.home import DIR_FLAGS, give_identity

ADA = "[user]\n\tname = Ada Lovelace\n\temail = ada@example.org\n"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, str]]]:
    """Every `git config` identity runs: its argv and environment."""
    seen: list[tuple[list[str], dict[str, str]]] = []
    real = subprocess.run

    def spy(argv: list[str], **kwargs: Any) -> Any:
        seen.append((argv, kwargs["env"]))
        return real(argv, **kwargs)

    monkeypatch.setattr("sandboxfs.project.identity.subprocess.run", spy)
    return seen


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_one_git_process_per_file_and_no_system_or_global_config(
    tmp_path: Path, calls: list[tuple[list[str], dict[str, str]]]
) -> None:
    repo = write(tmp_path / "repo-config", "[user]\n\tname = Repo Name\n")
    home = tmp_path / "home"
    home.mkdir()
    write(home / ".gitconfig", ADA)
    found = identity.identity([repo], {"HOME": str(home)})
    assert found == {
        "GIT_AUTHOR_NAME": "Repo Name",  # the repository's config first
        "GIT_COMMITTER_NAME": "Repo Name",
        "GIT_AUTHOR_EMAIL": "ada@example.org",  # then the user's
        "GIT_COMMITTER_EMAIL": "ada@example.org",
    }
    assert [argv[3] for argv, _ in calls] == [str(repo), str(home / ".gitconfig")]
    for argv, env in calls:  # the XDG config does not exist: not asked about
        assert argv[:3] == ["git", "config", "--file"]
        assert env["GIT_CONFIG_NOSYSTEM"] == "1" and env["GIT_CONFIG_GLOBAL"] == "/dev/null"
        assert "HOME" not in env


def test_the_environment_wins_and_asks_nothing(
    tmp_path: Path, calls: list[tuple[list[str], dict[str, str]]]
) -> None:
    config = write(tmp_path / "config", ADA)
    environ = {
        "HOME": str(tmp_path),
        "GIT_AUTHOR_NAME": "Env Author",
        "GIT_AUTHOR_EMAIL": "env@example.org",
        "GIT_COMMITTER_NAME": "Env Committer",
    }
    assert identity.identity([config], environ) == {
        "GIT_AUTHOR_NAME": "Env Author",
        "GIT_COMMITTER_NAME": "Env Committer",
        "GIT_AUTHOR_EMAIL": "env@example.org",
        "GIT_COMMITTER_EMAIL": "env@example.org",
    }
    assert calls == []


@pytest.mark.parametrize(
    ("text", "name", "email"),
    [
        (ADA, "Ada Lovelace", "ada@example.org"),
        ("[User]\n\tNAME = Ada\n\tEmail = a@b\n", "Ada", "a@b"),  # names are case-blind
        ("[user]\n\tname = First\n\tname = Second\n", "Second", None),  # the last one, as git
        ("[user]\n\tname = First\n\tname\n", None, None),  # the last one has no value
        ("[user]\n\tname\n\temail =\n", None, None),  # no value, an empty one
        ('[user]\n\tname = "Ada\\nLovelace"\n\temail = x@y\n', None, "x@y"),  # two lines
        ('[user]\n\tname = "  Ada  "\n', "Ada", None),
        ('[user "work"]\n\tname = Sub\n[user]\n\temail = e@f\n', None, "e@f"),
        ("[user\n\tname = Ada\n", None, None),  # not a config file git reads
        ("[username]\n\tname = no\n[core]\n\tbare = false\n", None, None),
        ("[user]\n\tname = Zoë Ström\n", "Zoë Ström", None),
    ],
)
def test_values_as_git_picks_them(tmp_path: Path, text: str, name: str, email: str) -> None:
    config = write(tmp_path / "config", text)
    assert identity.configured([config], "user.name") == name
    assert identity.configured([config], "user.email") == email


def test_a_refused_value_falls_through_to_the_next_file(tmp_path: Path) -> None:
    first = write(tmp_path / "first", '[user]\n\tname = "two\\nlines"\n')
    second = write(tmp_path / "second", ADA)
    assert identity.configured([first, second], "user.name") == "Ada Lovelace"


def test_includes_are_not_followed(tmp_path: Path) -> None:
    included = write(tmp_path / "included", ADA)
    config = write(tmp_path / "config", f"[include]\n\tpath = {included}\n")
    assert identity.configured([config], "user.name") is None


def test_a_git_that_hangs_or_is_missing_gives_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path / "config", ADA)
    timeouts: list[float] = []

    def hangs(argv: list[str], **kwargs: Any) -> Any:
        timeouts.append(kwargs["timeout"])
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    monkeypatch.setattr("sandboxfs.project.identity.subprocess.run", hangs)
    assert identity.identity([config], {"HOME": str(tmp_path / "none")}) == {}
    assert timeouts == [identity._TIMEOUT]  # asked once, for both keys
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert identity.configured([config], "user.name") is None  # no git: nothing, no error


def test_only_identity_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        identity.configured([tmp_path / "config"], "core.editor")


# ----- the identity in a sandbox home's ~/.gitconfig (sandboxfs.run.home.give_identity) ---------

FOUND = {"GIT_AUTHOR_NAME": 'Ada "A" Lovelace', "GIT_AUTHOR_EMAIL": "-ada@example.org"}


def home_identity(home: Path) -> list[str]:
    out = subprocess.run(
        ["git", "config", "--file", str(home / ".gitconfig"), "--list"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def give(home: Path, found: dict[str, str] = FOUND) -> bool:
    fd = os.open(home, DIR_FLAGS)
    try:
        return give_identity(fd, found)
    finally:
        os.close(fd)


def test_a_new_home_gets_the_name_and_email_quoted_as_git_would(tmp_path: Path) -> None:
    assert give(tmp_path)
    assert home_identity(tmp_path) == [
        'user.name=Ada "A" Lovelace',
        "user.email=-ada@example.org",
    ]
    assert not give(tmp_path)  # already so: not written again


def test_the_programs_own_settings_stay_and_its_identity_is_replaced(tmp_path: Path) -> None:
    write(tmp_path / ".gitconfig", "[user]\n\tname = a\n\tname = b\n[core]\n\tpager = cat\n")
    assert give(tmp_path)
    assert home_identity(tmp_path) == [
        'user.name=Ada "A" Lovelace',
        "user.email=-ada@example.org",
        "core.pager=cat",
    ]


def test_a_link_is_replaced_never_followed(tmp_path: Path) -> None:
    outside = write(tmp_path / "outside", "[core]\n\tpager = cat\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").symlink_to(outside)
    assert give(home)
    assert not (home / ".gitconfig").is_symlink()
    assert outside.read_text() == "[core]\n\tpager = cat\n"
    assert home_identity(home) == ['user.name=Ada "A" Lovelace', "user.email=-ada@example.org"]


def test_what_git_cannot_change_is_left_alone(tmp_path: Path) -> None:
    write(tmp_path / ".gitconfig", "[broken\n")
    assert not give(tmp_path)
    assert (tmp_path / ".gitconfig").read_text() == "[broken\n"
    assert not give(tmp_path, {})  # no identity known: nothing to set
    (tmp_path / ".gitconfig").unlink()
    (tmp_path / ".gitconfig").mkdir()
    assert not give(tmp_path)
