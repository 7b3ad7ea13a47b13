"""Configuration: pydantic models, the built-in defaults shipped as YAML, and project overrides.

A project's `sandboxfs.yaml` may override any field. Its `deny:` list adds to the built-in
deny list unless it also sets `inherit_deny: false`, so that listing one more secret never
silently drops the protection of the others (`deny_private_keys:` and `deny_credentials:` too,
under the same switch);
`protect:` and `inherit_protect` work the same
way, except that the config file itself stays protected whatever the file says (an agent that
could write it would choose its own policy for the next mount).
"""

from __future__ import annotations

import glob
import os
import re
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sandboxfs.audit.writer import MIN_ROTATE_BYTES, ROTATE_BYTES
from sandboxfs.config import inputs
from sandboxfs.config.inputs import cut, shown
from sandboxfs.core import approval_rules, approvals
from sandboxfs.core.limits import Quota, ZoneLimits
from sandboxfs.core.policy import BUILTIN_ZONES, Matrix, Op, Trust, Zone, ZoneAccess, in_git_dir
from sandboxfs.errors import ConfigError
from sandboxfs.gitquery import rev_parse

PROJECT_CONFIG_NAME = "sandboxfs.yaml"
# Protected at every trust level whatever a config says: the project's own config file.
ALWAYS_PROTECTED = "/" + PROJECT_CONFIG_NAME

M = TypeVar("M", bound=BaseModel)

DEFAULT_DENY = [
    ".env",
    ".env.*",
    "!.env.example",
    "!.env.sample",
    "!.env.template",
    "!.env.dist",
    ".netrc",
    ".git-credentials",
    ".ssh/",
    ".aws/",
    ".gnupg/",
]

# Refused as deny-listed only when the file holds a credential: the package managers' config
# files their tools must read in a project (sandboxfs.core.credentials).
DEFAULT_CREDENTIALS = [".npmrc", ".yarnrc", ".yarnrc.yml", ".pypirc", "pip.conf", "pip.ini"]

# Refused as deny-listed only when the file holds a private key (sandboxfs.core.secrets).
DEFAULT_PRIVATE_KEYS = [
    "*.pem",
    "*.key",
    "*.crt",
    "*.cer",
    "*.der",
    "*.p8",
    "*.pk8",
    "*.p12",
    "*.pfx",
    "*.ppk",
    "*.asc",
    "*.jks",
    "*.keystore",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
]

# .git/config is not here: git's rules protect it at every level, and judge the changes git
# makes to it through config.lock (sandboxfs.core.gitconfig); a project that lists it here keeps
# it unchangeable.
DEFAULT_PROTECT = [ALWAYS_PROTECTED, ".git/hooks/"]

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
    Trust.FULL: {zone: "rwld" for zone in BUILTIN_ZONES},
}
# What a project zone grants where its declaration says nothing: like /repo, nothing below
# `workspace`.
PROJECT_ZONE_DEFAULTS: dict[Trust, str] = {
    Trust.UNTRUSTED: "",
    Trust.SESSION: "",
    Trust.WORKSPACE: "rl",
    Trust.FULL: "rwld",
}
MAX_PROJECT_ZONES = 32
_ZONE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
BUILTIN_NAMES = [z.value for z in BUILTIN_ZONES]


def _check_permission(value: str) -> str:
    ZoneAccess.parse(value)
    return value


Permission = Annotated[str, AfterValidator(_check_permission)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CacheConfig(_Strict):
    """How long the kernel may cache names and attributes, in seconds: `watched_timeout` where
    the daemon watches the backing directory for changes (`watch`; see
    sandboxfs.fuse.host_watch), the two others elsewhere."""

    entry_timeout: float = Field(default=10.0, ge=0)
    attr_timeout: float = Field(default=10.0, ge=0)
    watch: bool = True
    watched_timeout: float = Field(default=3600.0, ge=0)
    # Entries the daemon lists at mount time to warm the kernel's cache (0: none; see
    # sandboxfs.fuse.warm).
    warm_entries: int = Field(default=50_000, ge=0)


class AuditConfig(_Strict):
    """`rotate_bytes`: past this size the log goes on in a new file (0: never; see
    sandboxfs.audit.common.Segment)."""

    sync: bool = False
    flush_interval: float = Field(default=0.05, gt=0)
    rotate_bytes: int = Field(default=ROTATE_BYTES, ge=0)

    @field_validator("rotate_bytes")
    @classmethod
    def _rotate_size(cls, value: int) -> int:
        if 0 < value < MIN_ROTATE_BYTES:
            raise ValueError(f"must be 0 (never rotate) or at least {MIN_ROTATE_BYTES} bytes")
        return value


class DaemonConfig(_Strict):
    """How the daemon waits for requests (see sandboxfs.fuse.request_wait)."""

    spin_us: float = Field(default=100.0, ge=0, le=10_000)


class RunConfig(_Strict):
    """Defaults of `sandboxfs run`: its network mode and, for `allow`, the hosts it may reach
    (None: not said; see sandboxfs.config.user.network_choice for who may widen it).

    Deliberately nothing else: no setting of a project file can switch confinement off.
    """

    network: Literal["none", "allow", "host"] | None = None
    allow_hosts: list[str] = Field(default_factory=list)


class QuotaConfig(_Strict):
    """A zone's quota: total bytes of its files and number of its entries (either optional)."""

    bytes: int | None = Field(default=None, ge=0)
    files: int | None = Field(default=None, ge=0)


class LimitsConfig(_Strict):
    """Limits of one zone (see sandboxfs.core.limits for what each means)."""

    max_file_bytes: int | None = Field(default=None, ge=0)
    suffixes: list[str] | None = None
    quota: QuotaConfig | None = None

    @field_validator("suffixes")
    @classmethod
    def _valid_suffixes(cls, value: list[str] | None) -> list[str] | None:
        for suffix in value or ():
            if not suffix.startswith(".") or len(suffix) < 2 or "/" in suffix or "\0" in suffix:
                raise ValueError(
                    f"invalid suffix {shown(suffix)}: a suffix starts with '.' and names no "
                    f"directory, e.g. '.md' or '.tar.gz'"
                )
        return value

    def limits(self) -> ZoneLimits:
        quota = Quota(self.quota.bytes, self.quota.files) if self.quota is not None else None
        return ZoneLimits.make(self.max_file_bytes, self.suffixes, quota)


class ZoneConfig(_Strict):
    """A project-defined zone: its backing directory and what each trust level may do there
    (levels not given get PROJECT_ZONE_DEFAULTS)."""

    path: str
    permissions: dict[Trust, Permission] = Field(default_factory=dict)

    @field_validator("path")
    @classmethod
    def _valid_path(cls, value: str) -> str:
        if not value.strip() or "\0" in value:
            raise ValueError("a zone path must name a directory")
        return value


# What a worker's `mode: ro|rw` grants, at most, wherever the trust level grants it.
WORKER_MODE_OPS: dict[str, frozenset[Op]] = {
    "ro": frozenset({Op.READ, Op.LIST}),
    "rw": frozenset(Op),
}
WorkerMode = Literal["ro", "rw"]


class WorkerScope(_Strict):
    """The zones a worker's declaration leaves a mount (sandboxfs.project.workers.narrow), each with
    its mode: every trust level's row is cut down to these, so no promotion widens them.
    Never read from a project file (ProjectConfig has no such key)."""

    name: str
    zones: dict[str, WorkerMode] = Field(default_factory=dict)
    # The worker's consent rules per zone and operation (`write`/`delete`: `preApproved`, `ask`
    # or `blocked`), for approvals to apply on top of the project's; validated in its file.
    approval: dict[str, dict[str, str]] = Field(default_factory=dict)


def narrowed(access: ZoneAccess, mode: str) -> ZoneAccess:
    """What is left of `access` under a worker's `mode`: create-only survives only `rw`."""
    return ZoneAccess(access.ops & WORKER_MODE_OPS[mode], access.create_only and mode == "rw")


_RULE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


class ApprovalRuleConfig(_Strict):
    """One approval rule (docs/approvals.md): zones and trust left out mean all of them."""

    id: str | None = None
    ops: list[approval_rules.Kind] = Field(min_length=1)
    zones: list[str] = Field(default_factory=list)
    trust: list[Trust] = Field(default_factory=list)
    decision: approval_rules.Verdict
    # Paths the rule leaves out: a name anywhere (`node_modules`, `*.egg-info`) or, with a
    # `/`, a path from the zone's root (`docs/generated`).
    exclude: list[str] = Field(default_factory=list)

    @field_validator("exclude")
    @classmethod
    def _valid_excludes(cls, value: list[str]) -> list[str]:
        for pattern in value:
            parts = pattern.split("/")
            if not pattern or pattern.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(
                    f"exclude pattern {shown(pattern)} is not a relative path pattern: name an "
                    f"entry (node_modules, *.egg-info) or a path below the zone (docs/generated)"
                )
        return value

    @field_validator("id")
    @classmethod
    def _valid_id(cls, value: str | None) -> str | None:
        if value is not None and not _RULE_ID_RE.match(value):
            raise ValueError(
                f"rule id {shown(value)} is not a plain name: use 1-64 letters, digits, "
                f"'_', '.', ':' or '-'"
            )
        return value


class ApprovalsConfig(_Strict):
    """`approvals:` of sandboxfs.yaml and of the user's own config."""

    profile: str | None = None  # one of approval_rules.PROFILES
    rules: list[ApprovalRuleConfig] = Field(default_factory=list)
    timeout: float = Field(default=60.0, gt=0, le=3600)  # seconds a request stays pending
    rate_limit: int = Field(default=30, ge=1, le=10_000)  # new requests a minute

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str | None) -> str | None:
        if value is not None and value not in approval_rules.PROFILES:
            raise ValueError(
                f"unknown approvals profile {shown(value)}; profiles: "
                f"{', '.join(approval_rules.PROFILES)}"
            )
        return value

    def rule_list(self, source: str) -> list[approval_rules.Rule]:
        """The rules this config says, the profile's first; ids default to source#N."""
        found = list(approval_rules.PROFILES[self.profile]) if self.profile else []
        for number, rule in enumerate(self.rules, 1):
            found.append(
                approval_rules.Rule(
                    rule.id or f"{source}#{number}",
                    rule.decision,
                    frozenset(rule.ops),
                    frozenset(rule.zones),
                    frozenset(t.value for t in rule.trust),
                    tuple(rule.exclude),
                )
            )
        return found


# What a worker's `approval: {write: ..., delete: ...}` covers (sandboxfs.project.workers).
WORKER_APPROVAL_KINDS: dict[str, frozenset[approval_rules.Kind]] = {
    "write": frozenset(
        {approval_rules.Kind.WRITE, approval_rules.Kind.CREATE, approval_rules.Kind.OVERWRITE}
    ),
    "delete": frozenset({approval_rules.Kind.DELETE}),
}


def worker_rules(worker: WorkerScope | None) -> list[approval_rules.Rule]:
    """A worker's own approval rules, per zone it declared: added to the mount's, where the
    strictest matching rule decides, so they can only ask more, never less."""
    if worker is None:
        return []
    return [
        approval_rules.Rule(
            f"worker:{worker.name}:{zone}:{op}",
            approval_rules.Verdict(decision),
            WORKER_APPROVAL_KINDS[op],
            frozenset({zone}),
        )
        for zone, ops in sorted(worker.approval.items())
        for op, decision in sorted(ops.items())
    ]


def make_broker(
    project: ApprovalsConfig,
    user: ApprovalsConfig,
    mode: approvals.Mode,
    worker: WorkerScope | None = None,
) -> approvals.Broker:
    """The approvals of one mount: the user's rules, the project's and a worker's together,
    where the strictest matching rule decides, so a project (or a worker) can add consent and
    never remove it; the shorter timeout and the lower rate limit."""
    return approvals.Broker(
        [*user.rule_list("user"), *project.rule_list(PROJECT_CONFIG_NAME), *worker_rules(worker)],
        mode=mode,
        timeout=min(project.timeout, user.timeout),
        per_minute=min(project.rate_limit, user.rate_limit),
    )


class Config(_Strict):
    """The complete, validated configuration of one mount."""

    default_trust: Trust = Trust.SESSION
    deny: list[str] = Field(default_factory=lambda: list(DEFAULT_DENY))
    deny_private_keys: list[str] = Field(default_factory=lambda: list(DEFAULT_PRIVATE_KEYS))
    deny_credentials: list[str] = Field(default_factory=lambda: list(DEFAULT_CREDENTIALS))
    protect: list[str] = Field(default_factory=lambda: list(DEFAULT_PROTECT))
    permissions: dict[Trust, dict[str, Permission]] = Field(
        default_factory=lambda: {
            t: {z.value: spec for z, spec in row.items()} for t, row in DEFAULT_PERMISSIONS.items()
        }
    )
    zones: dict[str, ZoneConfig] = Field(default_factory=dict)
    limits: dict[str, LimitsConfig] = Field(default_factory=dict)
    cache: CacheConfig = CacheConfig()
    audit: AuditConfig = AuditConfig()
    daemon: DaemonConfig = DaemonConfig()
    run: RunConfig = RunConfig()
    worker: WorkerScope | None = None
    approvals: ApprovalsConfig = ApprovalsConfig()

    @field_validator("permissions")
    @classmethod
    def _complete_matrix(cls, value: dict[Trust, dict[str, str]]) -> dict[Trust, dict[str, str]]:
        for trust in Trust:
            row = value.get(trust)
            if row is None:
                raise ValueError(f"missing trust level {trust.value!r}")
            for name in BUILTIN_NAMES:
                if name not in row:
                    raise ValueError(f"{trust.value}: missing zone {name!r}")
            for name in row:
                if name not in BUILTIN_NAMES:
                    raise ValueError(
                        f"unknown zone {shown(name)} under permissions.{trust.value}; accepted: "
                        f"{', '.join(BUILTIN_NAMES)} (a project zone's permissions go in its "
                        f"zones: entry)"
                    )
        return value

    @field_validator("zones")
    @classmethod
    def _valid_zone_names(cls, value: dict[str, ZoneConfig]) -> dict[str, ZoneConfig]:
        if len(value) > MAX_PROJECT_ZONES:
            raise ValueError(f"at most {MAX_PROJECT_ZONES} project zones")
        for name in value:
            if name in BUILTIN_NAMES:
                raise ValueError(
                    f"zone {shown(name)} clashes with a built-in zone "
                    f"({', '.join(BUILTIN_NAMES)}); choose another name"
                )
            if not _ZONE_NAME_RE.match(name):
                raise ValueError(
                    f"zone name {shown(name)} is not a plain name: use 1-32 lowercase letters, "
                    f"digits, '_' or '-', starting with a letter or digit"
                )
        return value

    @model_validator(mode="after")
    def _limits_name_zones(self) -> Config:
        known = [*BUILTIN_NAMES, *self.zones]
        for name, limits in self.limits.items():
            if name not in known:
                raise ValueError(f"limits: unknown zone {shown(name)}; zones: {', '.join(known)}")
            if name == Zone.WORKERS.value and limits.quota is not None:
                raise ValueError(
                    "limits: workers is a union of directories; a quota is not supported there"
                )
        for rule in self.approvals.rules:
            for name in rule.zones:
                if name not in known:
                    raise ValueError(
                        f"approvals: unknown zone {shown(name)}; zones: {', '.join(known)}"
                    )
        return self

    def zone_list(self) -> list[Zone]:
        """The mount's zones in the order `/` lists them: the built-in ones, then the project's."""
        return [*BUILTIN_ZONES, *(Zone(name) for name in self.zones)]

    def worker_label(self) -> tuple[str, dict[str, str]] | None:
        """The worker this config is narrowed to, as the policy names it in refusals."""
        return (self.worker.name, dict(self.worker.zones)) if self.worker is not None else None

    def zone_limits(self) -> dict[Zone, ZoneLimits]:
        return {Zone(name): limits.limits() for name, limits in self.limits.items()}

    @field_validator("deny", "deny_private_keys", "deny_credentials", "protect")
    @classmethod
    def _valid_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern.removeprefix("!").strip("/") or "\0" in pattern:
                raise ValueError(f"invalid pattern {shown(pattern)}")
        return value

    @field_validator("protect")
    @classmethod
    def _no_protect_exceptions(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if pattern.startswith("!"):
                raise ValueError(
                    f"invalid pattern {shown(pattern)}: protect patterns have no exceptions "
                    f"('!' is for deny:); use inherit_protect: false to drop a default"
                )
        return value

    @field_validator("protect")
    @classmethod
    def _config_stays_protected(cls, value: list[str]) -> list[str]:
        return value if ALWAYS_PROTECTED in value else [ALWAYS_PROTECTED, *value]

    def matrix(self) -> Matrix:
        matrix: dict[Trust, dict[Zone, ZoneAccess]] = {}
        for trust in Trust:
            row = self.permissions[trust]
            matrix[trust] = {zone: ZoneAccess.parse(row[zone.value]) for zone in BUILTIN_ZONES}
            for name, zone in self.zones.items():
                spec = zone.permissions.get(trust, PROJECT_ZONE_DEFAULTS[trust])
                matrix[trust][Zone(name)] = ZoneAccess.parse(spec)
        if self.worker is not None:  # a worker's mount: only its zones, never beyond its modes
            scope = self.worker.zones
            for trust, levels in matrix.items():
                matrix[trust] = {
                    zone: narrowed(access, scope[zone.value])
                    for zone, access in levels.items()
                    if zone.value in scope
                }
        return matrix


class ProjectConfig(_Strict):
    """What a project file may say: every field optional, matrix rows may be partial."""

    default_trust: Trust | None = None
    deny: list[str] = Field(default_factory=list)
    deny_private_keys: list[str] = Field(default_factory=list)
    deny_credentials: list[str] = Field(default_factory=list)
    inherit_deny: bool = True
    protect: list[str] = Field(default_factory=list)
    inherit_protect: bool = True
    permissions: dict[Trust, dict[str, Permission]] = Field(default_factory=dict)
    zones: dict[str, Any] = Field(default_factory=dict)
    limits: dict[str, Any] = Field(default_factory=dict)
    cache: dict[str, Any] = Field(default_factory=dict)
    audit: dict[str, Any] = Field(default_factory=dict)
    daemon: dict[str, Any] = Field(default_factory=dict)
    run: dict[str, Any] = Field(default_factory=dict)
    approvals: dict[str, Any] = Field(default_factory=dict)


# The package's own defaults are trusted text: libyaml's parser reads them in a tenth of the
# pure-Python one's time (start-up of every command). Users' files go through inputs._Loader.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def defaults() -> Config:
    """The built-in defaults, read from the YAML that ships inside the package."""
    text = resources.files("sandboxfs").joinpath("defaults.yaml").read_text(encoding="utf-8")
    return _validate(Config, yaml.load(text, Loader=_FAST_LOADER), "built-in defaults.yaml")


def load(project: Path, config_file: Path | None = None) -> Config:
    """The defaults with the project's config (or `config_file`) applied on top."""
    base = defaults()
    path = config_file if config_file is not None else project / PROJECT_CONFIG_NAME
    try:
        text = inputs.read_file(path, "config file")
    except FileNotFoundError:
        if config_file is None:
            return base
        raise ConfigError(f"cannot read config file {path}: No such file or directory") from None
    raw = inputs.load_yaml(text, str(path))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level")
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
    for field in ("deny_private_keys", "deny_credentials"):
        inherited = list(getattr(base, field)) if override.inherit_deny else []
        added = [pattern for pattern in getattr(override, field) if pattern not in inherited]
        merged[field] = inherited + added
    protect = list(base.protect) if override.inherit_protect else [ALWAYS_PROTECTED]
    protect += [pattern for pattern in override.protect if pattern not in protect]
    merged["protect"] = protect
    for trust, row in override.permissions.items():
        for zone, spec in row.items():
            merged["permissions"][trust.value][zone] = spec
    merged["zones"].update(override.zones)
    merged["limits"].update(override.limits)
    merged["cache"].update(override.cache)
    merged["audit"].update(override.audit)
    merged["daemon"].update(override.daemon)
    merged["run"].update(override.run)
    merged["approvals"].update(override.approvals)
    return merged


def _validate(model: type[M], raw: Any, source: str) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, model, source)) from None


def _describe(exc: ValidationError, model: type[BaseModel], source: str) -> str:
    """One line naming the file, the field path and what is accepted."""
    err = exc.errors()[0]
    parts = [cut(str(part)) if str(part).isprintable() else shown(part) for part in err["loc"]]
    if "[key]" in parts:  # a mapping key was rejected: name it, not pydantic's path to it
        parent = ".".join(parts[: parts.index("[key]") - 1])
        kind = {"permissions": "trust level"}.get(
            parent, "zone" if "permissions." in parent + "." else "key"
        )
        expected = err.get("ctx", {}).get("expected", "")
        choices = f"; accepted: {expected}" if expected else ""
        return f"{source}: unknown {kind} {shown(err['input'])} under {parent}{choices}"
    loc = ".".join(parts)
    if not loc and err["type"] == "value_error":  # a check of the whole file names its field
        return f"{source}: {err['msg'].removeprefix('Value error, ')}"
    loc = loc or "(top level)"
    if err["type"] == "extra_forbidden":
        accepted = _accepted_keys(model, err["loc"][:-1])
        hint = f"; accepted keys: {', '.join(accepted)}" if accepted else ""
        return f"{source}: {loc}: unknown key{hint}"
    if err["type"] == "enum":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{source}: {loc}: {shown(err['input'])} is not one of {expected}"
    message = err["msg"].removeprefix("Value error, ")
    if isinstance(err["input"], dict | list):  # the whole section: the message names the part
        return f"{source}: {loc}: {message}"
    return f"{source}: {loc}: {message} (got {shown(err['input'])})"


def _accepted_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at `loc` accepts (through `dict[str, Model]` and `Model | None`)."""
    current: type[BaseModel] | None = model
    parts = list(loc)
    while parts:
        if current is None:
            return []
        field = current.model_fields.get(str(parts.pop(0)))
        annotation = field.annotation if field else None
        if typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
            if parts:
                parts.pop(0)  # the mapping's key (a zone's name)
        current = _model_in(annotation)
    return list(current.model_fields) if current is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation names, directly or as `Model | None`."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


# Variables that would point the probe below at another repository than the user's git finds.
_GIT_WHERE = ("--git-dir", "--git-common-dir", "--git-path", "hooks")
# What sandboxfs.core.policy.git_rule protects in a git directory, as protect globs below one
# that is not named .git ("*" spans "/", as submodules' names do).
_GIT_DIR_GLOBS = (
    "config",
    "config.worktree",
    "commondir",
    "hooks/",
    "branches/",
    "remotes/",
    "objects/info/alternates",
    "modules/*/config",
    "modules/*/config.worktree",
    "modules/*/commondir",
    "modules/*/hooks/",
    "worktrees/*/commondir",
    "worktrees/*/config.worktree",
    "worktrees/*/gitdir",
)


def git_surface_protect(project: Path) -> list[str]:
    """Protect patterns for the parts of git's code-running surface that sandboxfs's built-in
    rules (sandboxfs.core.policy.git_rule, which work by the name `.git`) cannot see, found by
    asking the user's git where they are:

    - the directory git runs hooks from, where core.hooksPath (in any of the user's config
      files) or a symbolic link `.git/hooks -> ../githooks` puts it inside the project, as
      husky and `.githooks` setups do (husky keeps the hooks its `.husky/_` runs one level up:
      that directory is protected);
    - the git directory and common directory themselves, where `.git` is a symbolic link to a
      directory inside the project under another name.

    Empty when git is missing or the project is in no work tree."""
    # Paths relative to the project, core.hooksPath applied (in any of the user's config files).
    lines = rev_parse(project, *_GIT_WHERE)
    if lines is None or len(lines) != 3:
        return []
    git_dir, common_dir, hooks = (os.path.join(project, line) for line in lines)
    real_project = os.path.realpath(project)
    patterns: list[str] = []

    def add(rel: str | None, *globs: str) -> None:
        if rel is None or in_git_dir(rel):
            return  # outside the project, or git_rule's already
        for pattern in (f"/{glob.escape(rel)}/{g}" for g in globs):
            if pattern not in patterns:
                patterns.append(pattern)

    for directory in (git_dir, common_dir):
        add(_inside(os.path.realpath(directory), real_project), *_GIT_DIR_GLOBS)
    for rel in (
        _inside(os.path.normpath(hooks), os.path.normpath(project)),
        _inside(os.path.realpath(hooks), real_project),
    ):
        if rel is not None and os.path.basename(rel) == "_" and os.path.dirname(rel):
            rel = os.path.dirname(rel)
        add(rel, "")
    return patterns


def _inside(path: str, root: str) -> str | None:
    """`path` relative to `root` if it lies strictly inside it, else None."""
    rel = os.path.relpath(path, root)
    return None if rel == "." or rel == ".." or rel.startswith("../") else rel
