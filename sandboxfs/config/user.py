"""The user's own config (`$XDG_CONFIG_HOME/sandboxfs/config.yaml`, else
`~/.config/sandboxfs/config.yaml`) and the agent profiles of `sandboxfs run --agent NAME`.

What may widen a sandbox lives here, outside every project and every sandbox's view: the
paths always exposed read-only (`expose:`), `run`'s network by default (`run:`), and the agent
profiles (`agents:`): the hosts an agent reaches with `--net allow`, the environment variables
it is given, paths it needs exposed, and what `sandboxfs home seed --agent NAME` copies into
the sandbox's home. A project's `sandboxfs.yaml` has none of these keys but `run:`, which may
only narrow the network (`network_choice`): a project never widens confinement.

    expose: [~/tools/bin]
    run: {network: allow, allow_hosts: [pypi.org]}
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
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandboxfs.config import inputs
from sandboxfs.config.inputs import shown
from sandboxfs.config.model import PROJECT_CONFIG_NAME, ApprovalsConfig, RunConfig, _validate
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
    # `run`'s network where the command line says nothing (a project's file may only narrow it).
    run: RunConfig = RunConfig()
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


# The agents' own hosts, credentials and settings: see docs/run-and-agents.md, "Running an agent".
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


# How much of the network each mode gives: a project's file may only move down this order.
NETWORK_WIDTH = {"none": 0, "allow": 1, "host": 2}


@dataclass(frozen=True)
class NetworkChoice:
    """`run`'s network: its mode, the hosts of `allow`, and what the project's file asked
    beyond the user's choice, ignored (in words, for one line and the audit log)."""

    mode: str
    hosts: list[str]
    ignored: str | None = None


def network_choice(
    net: str | None,
    allow_host: list[str],
    profile: AgentProfile | None,
    user: UserConfig,
    project: RunConfig,
    source: str = PROJECT_CONFIG_NAME,
) -> NetworkChoice:
    """The network of a run. Only the user widens it: the command line (`net`, `allow_host`),
    the agent profile they name, their own config. The project's file (`project`, the run:
    of sandboxfs.yaml, which a repository's author writes) may only narrow what the user's
    config and profile chose: a narrower mode, or fewer of the user's hosts; what it asks
    beyond them is ignored. The command line wins over both. `source`: the file's name."""
    mode = net or ("allow" if profile and profile.allow_hosts else user.run.network or "none")
    wider: list[str] = []
    if net is None and project.network is not None and project.network != mode:
        if NETWORK_WIDTH[project.network] < NETWORK_WIDTH[mode]:
            mode = project.network
        else:
            wider.append(f"run.network: {project.network}")
    hosts = allow_host or ([] if net not in (None, "allow") else user.run.allow_hosts)
    if profile is not None:
        hosts = list(dict.fromkeys([*profile.allow_hosts, *hosts]))
    if project.allow_hosts and not allow_host and mode == "allow":
        kept = [h for h in hosts if h in project.allow_hosts]
        beyond = [h for h in project.allow_hosts if h not in hosts]
        if beyond:
            wider.append(f"run.allow_hosts: {', '.join(beyond)}")
        hosts = kept or hosts
    elif project.allow_hosts and not allow_host and wider:
        wider.append(f"run.allow_hosts: {', '.join(project.allow_hosts)}")
    if not wider:
        return NetworkChoice(mode, hosts)
    return NetworkChoice(
        mode,
        hosts,
        f"{source} asks for {'; '.join(wider)}: ignored, a project's file may "
        f"only narrow the network (this run's: {mode}); --net, --allow-host or {path()} "
        f"widen it",
    )
