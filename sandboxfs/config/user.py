"""The user's own config (`$XDG_CONFIG_HOME/sandboxfs/config.yaml`, else
`~/.config/sandboxfs/config.yaml`) and the agent profiles of `sandboxfs run --agent NAME`.

What may widen a sandbox lives here, outside every project and every sandbox's view: the
paths always exposed read-only (`expose:`) and the agent profiles (`agents:`): the hosts an
agent reaches with `--net allow`, the environment variables it is given, paths it needs
exposed, and what `sandboxfs home seed --agent NAME` copies into the sandbox's home. A
project's `sandboxfs.yaml` has none of these keys: a project never widens confinement.

    expose: [~/tools/bin]
    agents:
      claude:                       # adds to the built-in profile of that name
        allow_hosts: [mcp.example.com]
      mine:
        allow_hosts: [api.example.com]
        env: [EXAMPLE_API_KEY, EXAMPLE_MODE=sandboxed]
        seed: [.mine/config.toml]

Unknown keys are refused with one line naming the file and the keys accepted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandboxfs.config import inputs
from sandboxfs.config.inputs import shown
from sandboxfs.config.model import ApprovalsConfig, _validate
from sandboxfs.errors import ConfigError, UserError

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AgentProfile(_Strict):
    """What `run --agent NAME` sets at once."""

    description: str = ""
    allow_hosts: list[str] = Field(default_factory=list)
    # NAME: passed when set in your environment; NAME=VALUE: set inside. --env wins.
    env: list[str] = Field(default_factory=list)
    expose: list[str] = Field(default_factory=list)
    # Commands found on your PATH and shown inside with their trees, whatever CMD is (so that
    # `run --agent claude -- bash` has claude too), as CMD itself is.
    programs: list[str] = Field(default_factory=list)
    # Paths relative to your home that `home seed --agent NAME` copies (those that exist).
    seed: list[str] = Field(default_factory=list)

    @field_validator("env")
    @classmethod
    def _valid_env(cls, value: list[str]) -> list[str]:
        for item in value:
            if not inputs.ENV_NAME.match(item.partition("=")[0]):
                raise ValueError(f"invalid entry {shown(item)}: expected NAME or NAME=VALUE")
        return value

    @field_validator("programs")
    @classmethod
    def _valid_programs(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item or "/" in item or item in (".", ".."):
                raise ValueError(
                    f"invalid program {shown(item)}: a command name, found on your PATH"
                )
        return value

    @field_validator("seed")
    @classmethod
    def _valid_seed(cls, value: list[str]) -> list[str]:
        for item in value:
            if item.startswith("/") or ".." in item.split("/") or not item.strip("/"):
                raise ValueError(f"invalid path {shown(item)}: a path relative to your home")
        return value

    def merged(self, other: AgentProfile) -> AgentProfile:
        """This profile with `other`'s additions (a user's profile over a built-in one)."""

        def union(a: list[str], b: list[str]) -> list[str]:
            return list(dict.fromkeys([*a, *b]))

        return AgentProfile(
            description=other.description or self.description,
            allow_hosts=union(self.allow_hosts, other.allow_hosts),
            env=union(self.env, other.env),
            expose=union(self.expose, other.expose),
            programs=union(self.programs, other.programs),
            seed=union(self.seed, other.seed),
        )

    def environment(self, caller: Mapping[str, str]) -> dict[str, str]:
        """The variables the profile gives the program: NAME when set here, NAME=VALUE."""
        env: dict[str, str] = {}
        for item in self.env:
            name, sep, value = item.partition("=")
            if sep:
                env[name] = value
            elif name in caller:
                env[name] = caller[name]
        return env


class UserConfig(_Strict):
    expose: list[str] = Field(default_factory=list)
    agents: dict[str, AgentProfile] = Field(default_factory=dict)
    # Approval rules for every project; a project's own can only add to them.
    approvals: ApprovalsConfig = ApprovalsConfig()

    @field_validator("agents")
    @classmethod
    def _valid_names(cls, value: dict[str, AgentProfile]) -> dict[str, AgentProfile]:
        for name in value:
            if not _NAME_RE.match(name):
                raise ValueError(
                    f"agent name {shown(name)} is not a plain name: use 1-32 lowercase letters, "
                    f"digits, '_' or '-'"
                )
        return value


# The agents' own hosts, credentials and settings: see the README's "Running an agent".
BUILTIN_AGENTS: dict[str, AgentProfile] = {
    "claude": AgentProfile(
        programs=["claude"],
        description="Claude Code (npm: @anthropic-ai/claude-code, or the native installer)",
        allow_hosts=["api.anthropic.com", "claude.ai", "platform.claude.com"],
        env=[
            "ANTHROPIC_API_KEY",
            "ANTHROPIC_AUTH_TOKEN",
            "ANTHROPIC_BASE_URL",
            "CLAUDE_CODE_OAUTH_TOKEN",
            "DISABLE_AUTOUPDATER=1",
        ],
        seed=[
            ".claude/.credentials.json",
            ".claude/settings.json",
            ".claude/CLAUDE.md",
            ".claude.json",
        ],
    ),
    "codex": AgentProfile(
        programs=["codex"],
        description="OpenAI Codex CLI (npm: @openai/codex)",
        allow_hosts=["api.openai.com", "chatgpt.com", "auth.openai.com"],
        env=["OPENAI_API_KEY", "OPENAI_BASE_URL"],
        seed=[".codex/auth.json", ".codex/config.toml", ".codex/AGENTS.md"],
    ),
    "gemini": AgentProfile(
        programs=["gemini"],
        description="Gemini CLI (npm: @google/gemini-cli)",
        allow_hosts=[
            "generativelanguage.googleapis.com",
            "cloudcode-pa.googleapis.com",
            "oauth2.googleapis.com",
            "accounts.google.com",
        ],
        env=[
            "GEMINI_API_KEY",
            "GOOGLE_API_KEY",
            "GOOGLE_CLOUD_PROJECT",
            "GOOGLE_GENAI_USE_VERTEXAI",
            "GEMINI_SANDBOX=false",
        ],
        seed=[
            ".gemini/settings.json",
            ".gemini/oauth_creds.json",
            ".gemini/google_accounts.json",
            ".gemini/GEMINI.md",
        ],
    ),
    "aider": AgentProfile(
        programs=["aider"],
        description="aider (pipx or a virtualenv: aider-chat), with OpenAI or Anthropic models",
        allow_hosts=["api.openai.com", "api.anthropic.com"],
        env=[
            "OPENAI_API_KEY",
            "ANTHROPIC_API_KEY",
            "AIDER_CHECK_UPDATE=false",
            "AIDER_ANALYTICS=false",
        ],
        seed=[".aider.conf.yml", ".aider.model.settings.yml"],
    ),
    "opencode": AgentProfile(
        programs=["opencode"],
        description="opencode (npm: opencode-ai), with Anthropic or OpenAI models",
        allow_hosts=["api.anthropic.com", "api.openai.com", "models.opencode.ai"],
        env=["ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENCODE_DISABLE_AUTOUPDATE=true"],
        seed=[".local/share/opencode/auth.json", ".config/opencode"],
    ),
}


def path() -> Path:
    """Where the user config is: $XDG_CONFIG_HOME/sandboxfs/config.yaml, else
    ~/.config/sandboxfs/config.yaml."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".config"
    return base / "sandboxfs" / "config.yaml"


def load(source: Path | None = None) -> UserConfig:
    """The user config; empty when there is none. ConfigError (one line) when it is invalid."""
    where = source if source is not None else path()
    try:
        text = inputs.read_file(where, "your config")
    except FileNotFoundError:
        return UserConfig()
    raw = inputs.load_yaml(text, str(where))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of settings at the top level")
    return _validate(UserConfig, raw, str(where))


def agent(name: str, user: UserConfig) -> AgentProfile:
    """The profile `--agent NAME` names: a built-in one with the user's additions, or the
    user's own. UserError naming the profiles there are."""
    builtin = BUILTIN_AGENTS.get(name) if name else None
    mine = user.agents.get(name) if name else None
    if builtin is None and mine is None:
        known = sorted({*BUILTIN_AGENTS, *user.agents})
        written = name if name.isprintable() and name.split() == [name] else shown(name)
        raise UserError(
            f"--agent {written}: no such agent profile; profiles: {', '.join(known)} "
            f"(add your own under agents: in {path()})"
        )
    if builtin is None:
        assert mine is not None
        return mine
    return builtin if mine is None else builtin.merged(mine)


def profiles(user: UserConfig) -> dict[str, AgentProfile]:
    return {name: agent(name, user) for name in sorted({*BUILTIN_AGENTS, *user.agents})}
