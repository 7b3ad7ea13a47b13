"""The user's git identity, read once outside: what commits made inside `run` and landed
staged commits carry.

Inside, git sees no global config (the program's HOME is the session's), so without this every
`git commit` stops with "Author identity unknown". The identity is read from the config files
as data (`git config --file`, which follows no include and runs nothing; one per file): the
repository's own config first, then the user's global ones, as git itself would pick it.
GIT_AUTHOR_* and GIT_COMMITTER_* in the caller's environment win, as they do for git.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from sandboxfs.gitquery import rev_parse

IDENTITY_VARIABLES = (
    "GIT_AUTHOR_NAME",
    "GIT_AUTHOR_EMAIL",
    "GIT_COMMITTER_NAME",
    "GIT_COMMITTER_EMAIL",
)
_TIMEOUT = 5.0  # seconds for one `git config`
_KEYS = ("user.name", "user.email")  # what git commits take an identity from
_KEYS_PATTERN = r"^user\.(name|email)$"


def global_configs(environ: Mapping[str, str]) -> list[Path]:
    """The user's global git config files, in git's order of precedence (strongest first)."""
    home = environ.get("HOME") or os.path.expanduser("~")
    xdg = environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return [Path(home) / ".gitconfig", Path(xdg) / "git" / "config"]


def _read(config: Path) -> dict[str, str]:
    """user.name and user.email as `config` sets them, from one `git config`: for each, the
    last value (as `--get` picks it), and only when it is one non-empty line."""
    if not config.is_file():
        return {}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1"}
    env["GIT_CONFIG_GLOBAL"] = "/dev/null"
    try:
        result = subprocess.run(
            ["git", "config", "--file", str(config), "-z", "--get-regexp", _KEYS_PATTERN],
            capture_output=True,
            env=env,
            timeout=_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if result.returncode != 0:  # 1: neither is set; more: not a config file git can read
        return {}
    last: dict[str, str] = {}
    # -z: each entry is "key\nvalue\0", or "key\0" for a key without a value
    for entry in result.stdout.decode("utf-8", "replace").split("\0")[:-1]:
        key, _, value = entry.partition("\n")
        last[key] = value.strip()
    return {key: value for key, value in last.items() if value and "\n" not in value}


def configured(
    configs: Sequence[Path], key: str, read: dict[Path, dict[str, str]] | None = None
) -> str | None:
    """`key` (user.name or user.email) from the first of `configs` that sets it; `read` keeps
    what each file set, so that the other key costs no second `git config`."""
    if key not in _KEYS:
        raise ValueError(f"not an identity key: {key}")
    read = {} if read is None else read
    for config in configs:
        if config not in read:
            read[config] = _read(config)
        value = read[config].get(key)
        if value is not None:
            return value
    return None


def identity(
    repo_configs: Sequence[Path], environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """GIT_AUTHOR_* and GIT_COMMITTER_* for the user, as far as known (possibly empty)."""
    configs = [*repo_configs, *global_configs(environ)]
    read: dict[Path, dict[str, str]] = {}  # each config file is read once, for both keys
    name = environ.get("GIT_AUTHOR_NAME") or configured(configs, "user.name", read)
    email = environ.get("GIT_AUTHOR_EMAIL") or configured(configs, "user.email", read)
    found: dict[str, str] = {}
    if name:
        found["GIT_AUTHOR_NAME"] = name
        found["GIT_COMMITTER_NAME"] = environ.get("GIT_COMMITTER_NAME") or name
    if email:
        found["GIT_AUTHOR_EMAIL"] = email
        found["GIT_COMMITTER_EMAIL"] = environ.get("GIT_COMMITTER_EMAIL") or email
    return found


def project_identity(project: Path, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """identity() for a project: its repository's config (`.git/config`, or the common dir a
    worktree's .git file leads to) and then the user's."""
    return identity(_repo_configs(project), environ)


def _repo_configs(project: Path) -> list[Path]:
    lines = rev_parse(project, "--git-common-dir")
    if lines is None or len(lines) != 1:
        return []
    common = Path(lines[0])
    return [(common if common.is_absolute() else project / common) / "config"]


def home_config(existing: bytes, found: Mapping[str, str]) -> bytes | None:
    """A sandbox home's ~/.gitconfig holding the user's identity (`found`, as identity()
    gives it): `existing` (what the home's file held, b"" for none) with user.name and
    user.email set to the user's and nothing else changed. Only those two values come from
    outside: never the user's config itself (tokens, credential helpers, url rewrites,
    includes stay there). None where there is nothing to set, or `existing` is not a config
    file git can change (it is then left as the program made it)."""
    values = {
        "user.name": found.get("GIT_AUTHOR_NAME"),
        "user.email": found.get("GIT_AUTHOR_EMAIL"),
    }
    if not any(values.values()):
        return None
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1"}
    env["GIT_CONFIG_GLOBAL"] = "/dev/null"
    with tempfile.TemporaryDirectory(prefix="sandboxfs-gitconfig-") as private:
        config = Path(private) / "config"
        config.write_bytes(existing)
        for key, value in values.items():
            if not value or "\n" in value or "\0" in value:
                continue
            try:  # --replace-all: one value however many the program left
                done = subprocess.run(
                    ["git", "config", "--file", str(config), "--replace-all", key, value],
                    capture_output=True,
                    cwd=private,
                    env=env,
                    timeout=_TIMEOUT,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired):
                return None
            if done.returncode != 0:
                return None
        return config.read_bytes()
