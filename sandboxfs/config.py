"""Configuration: pydantic models, the built-in defaults shipped as YAML, and project overrides.

A project's `sandboxfs.yaml` may override any field. Its `deny:` list adds to the built-in
deny list unless it also sets `inherit_deny: false`, so that listing one more secret never
silently drops the protection of the others; `protect:` and `inherit_protect` work the same
way, except that the config file itself stays protected whatever the file says (an agent that
could write it would choose its own policy for the next mount).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import UserError
from .policy import Matrix, Trust, Zone, ZoneAccess

PROJECT_CONFIG_NAME = "sandboxfs.yaml"
# Protected at every trust level whatever a config says: the project's own config file.
ALWAYS_PROTECTED = "/" + PROJECT_CONFIG_NAME

M = TypeVar("M", bound=BaseModel)

DEFAULT_DENY = [
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "id_rsa*",
    "id_ed25519*",
    "id_ecdsa*",
    ".netrc",
    ".git-credentials",
    ".npmrc",
    ".pypirc",
    ".ssh/",
    ".aws/",
    ".gnupg/",
]

DEFAULT_PROTECT = [ALWAYS_PROTECTED, ".git/hooks/", ".git/config"]

DEFAULT_PERMISSIONS: dict[Trust, dict[Zone, str]] = {
    Trust.UNTRUSTED: {
        Zone.SESSION: "rwld",
        Zone.WORKSPACE: "",
        Zone.REPO: "",
        Zone.STAGED: "create-only",
        Zone.WORKERS: "rl",
    },
    Trust.SESSION: {
        Zone.SESSION: "rwld",
        Zone.WORKSPACE: "rwld",
        Zone.REPO: "",
        Zone.STAGED: "rwld",
        Zone.WORKERS: "rl",
    },
    Trust.WORKSPACE: {
        Zone.SESSION: "rwld",
        Zone.WORKSPACE: "rwld",
        Zone.REPO: "rl",
        Zone.STAGED: "rwld",
        Zone.WORKERS: "rl",
    },
    Trust.FULL: {zone: "rwld" for zone in Zone},
}


def _check_permission(value: str) -> str:
    ZoneAccess.parse(value)
    return value


Permission = Annotated[str, AfterValidator(_check_permission)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CacheConfig(_Strict):
    """How long the kernel may cache names and attributes, in seconds."""

    entry_timeout: float = Field(default=10.0, ge=0)
    attr_timeout: float = Field(default=10.0, ge=0)


class AuditConfig(_Strict):
    sync: bool = False
    flush_interval: float = Field(default=0.05, gt=0)


class DaemonConfig(_Strict):
    """How the daemon waits for requests (see sandboxfs.request_wait)."""

    spin_us: float = Field(default=100.0, ge=0, le=10_000)


class RunConfig(_Strict):
    """Defaults of `sandboxfs run`: its network mode and, for `allow`, the hosts it may reach.

    Deliberately nothing else: no setting of a project file can switch confinement off.
    """

    network: Literal["none", "allow", "host"] = "none"
    allow_hosts: list[str] = Field(default_factory=list)


class Config(_Strict):
    """The complete, validated configuration of one mount."""

    default_trust: Trust = Trust.SESSION
    deny: list[str] = Field(default_factory=lambda: list(DEFAULT_DENY))
    protect: list[str] = Field(default_factory=lambda: list(DEFAULT_PROTECT))
    permissions: dict[Trust, dict[Zone, Permission]] = Field(
        default_factory=lambda: {t: dict(row) for t, row in DEFAULT_PERMISSIONS.items()}
    )
    cache: CacheConfig = CacheConfig()
    audit: AuditConfig = AuditConfig()
    daemon: DaemonConfig = DaemonConfig()
    run: RunConfig = RunConfig()

    @field_validator("permissions")
    @classmethod
    def _complete_matrix(cls, value: dict[Trust, dict[Zone, str]]) -> dict[Trust, dict[Zone, str]]:
        for trust in Trust:
            row = value.get(trust)
            if row is None:
                raise ValueError(f"missing trust level {trust.value!r}")
            for zone in Zone:
                if zone not in row:
                    raise ValueError(f"{trust.value}: missing zone {zone.value!r}")
        return value

    @field_validator("deny", "protect")
    @classmethod
    def _valid_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern.strip("/") or "\0" in pattern:
                raise ValueError(f"invalid pattern {pattern!r}")
        return value

    @field_validator("protect")
    @classmethod
    def _config_stays_protected(cls, value: list[str]) -> list[str]:
        return value if ALWAYS_PROTECTED in value else [ALWAYS_PROTECTED, *value]

    def matrix(self) -> Matrix:
        return {
            trust: {zone: ZoneAccess.parse(spec) for zone, spec in row.items()}
            for trust, row in self.permissions.items()
        }


class ProjectConfig(_Strict):
    """What a project file may say: every field optional, matrix rows may be partial."""

    default_trust: Trust | None = None
    deny: list[str] = Field(default_factory=list)
    inherit_deny: bool = True
    protect: list[str] = Field(default_factory=list)
    inherit_protect: bool = True
    permissions: dict[Trust, dict[Zone, Permission]] = Field(default_factory=dict)
    cache: dict[str, Any] = Field(default_factory=dict)
    audit: dict[str, Any] = Field(default_factory=dict)
    daemon: dict[str, Any] = Field(default_factory=dict)
    run: dict[str, Any] = Field(default_factory=dict)


def defaults() -> Config:
    """The built-in defaults, read from the YAML that ships inside the package."""
    text = resources.files("sandboxfs").joinpath("defaults.yaml").read_text(encoding="utf-8")
    return _validate(Config, yaml.safe_load(text), "built-in defaults.yaml")


def load(project: Path, config_file: Path | None = None) -> Config:
    """The defaults with the project's config (or `config_file`) applied on top."""
    base = defaults()
    path = config_file if config_file is not None else project / PROJECT_CONFIG_NAME
    if config_file is None and not path.exists():
        return base
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UserError(f"cannot read config file {path}: {reason}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path}: not valid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of settings at the top level")
    project_config = _validate(ProjectConfig, raw, str(path))
    return _validate(Config, _merge(base, project_config), str(path))


def _merge(base: Config, override: ProjectConfig) -> dict[str, Any]:
    merged = base.model_dump(mode="json")
    if override.default_trust is not None:
        merged["default_trust"] = override.default_trust.value
    deny = list(base.deny) if override.inherit_deny else []
    for pattern in override.deny:
        if pattern not in deny:
            deny.append(pattern)
    merged["deny"] = deny
    protect = list(base.protect) if override.inherit_protect else [ALWAYS_PROTECTED]
    protect += [pattern for pattern in override.protect if pattern not in protect]
    merged["protect"] = protect
    for trust, row in override.permissions.items():
        for zone, spec in row.items():
            merged["permissions"][trust.value][zone.value] = spec
    merged["cache"].update(override.cache)
    merged["audit"].update(override.audit)
    merged["daemon"].update(override.daemon)
    merged["run"].update(override.run)
    return merged


def _validate(model: type[M], raw: Any, source: str) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_describe(exc, model, source)) from None


def _describe(exc: ValidationError, model: type[BaseModel], source: str) -> str:
    """One line naming the file, the field path and what is accepted."""
    err = exc.errors()[0]
    parts = [str(part) for part in err["loc"]]
    if "[key]" in parts:  # a mapping key was rejected: name it, not pydantic's path to it
        parent = ".".join(parts[: parts.index("[key]") - 1])
        kind = {"permissions": "trust level"}.get(
            parent, "zone" if "permissions." in parent + "." else "key"
        )
        expected = err.get("ctx", {}).get("expected", "")
        choices = f"; accepted: {expected}" if expected else ""
        return f"{source}: unknown {kind} {err['input']!r} under {parent}{choices}"
    loc = ".".join(parts) or "(top level)"
    if err["type"] == "extra_forbidden":
        accepted = _accepted_keys(model, err["loc"][:-1])
        hint = f"; accepted keys: {', '.join(accepted)}" if accepted else ""
        return f"{source}: {loc}: unknown key{hint}"
    if err["type"] == "enum":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{source}: {loc}: {err['input']!r} is not one of {expected}"
    message = err["msg"].removeprefix("Value error, ")
    return f"{source}: {loc}: {message} (got {err['input']!r})"


def _accepted_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return []
        field = current.model_fields.get(str(part))
        annotation = field.annotation if field else None
        current = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return list(current.model_fields) if current is not None else []
