"""Workers: `.worker` declarations, found by name in the workers layers, and the narrowing of a
sandbox's config to what one declares.

A `.worker` file is YAML front matter between `---` lines, then free text (the worker's
instructions, which sandboxfs does not read):

    ---
    name: formatter
    description: Formats data files
    sandbox:
      zones:
        - name: data
          mode: rw
          approval: {write: preApproved, delete: blocked}
    ---
    Format every file in /data.

Narrowing happens on the config, before a guard is built (`narrow`): the worker's zones keep at
most their declared mode, every other zone leaves the tree, and a declaration asking more than
the parent has is refused as a whole. No `sandbox:` key means no zone at all (a pure function).
The per-zone `approval:` rules become approval rules of the worker's mount
(config.model.worker_rules).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sandboxfs.config import inputs
from sandboxfs.config.inputs import shown
from sandboxfs.config.model import WORKER_MODE_OPS, Config, WorkerMode, WorkerScope
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.policy import Op, Trust, ZoneAccess
from sandboxfs.core.resolve import ensure_dirs
from sandboxfs.errors import UserError
from sandboxfs.layout import attachments_parts
from sandboxfs.project.gitdir import GIT_DIR_ZONE
from sandboxfs.project.zones import (
    ATTACHMENTS_ZONE,
    HOME_ZONE,
    AttachmentsZoneConfig,
    worker_layers,
)

SUFFIX = ".worker"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_FENCE = "---"
ApprovalDecision = Literal["preApproved", "ask", "blocked"]


class WiderThanParent(UserError):
    """A declaration asking more than the parent has (the API's WorkerRefused, EACCES)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ZoneApproval(_Strict):
    """A worker's consent rules for one zone (seed 001, level 3); a rule left out is the
    project's. Applied by approvals on top of the project's: they may only ask more."""

    write: ApprovalDecision | None = None
    delete: ApprovalDecision | None = None


class WorkerZone(_Strict):
    name: str
    mode: WorkerMode
    approval: ZoneApproval | None = None


class WorkerSandbox(_Strict):
    zones: list[WorkerZone] = Field(default_factory=list)

    @field_validator("zones")
    @classmethod
    def _once_each(cls, value: list[WorkerZone]) -> list[WorkerZone]:
        seen: set[str] = set()
        for zone in value:
            if zone.name in seen:
                raise ValueError(f"zone {shown(zone.name)} is declared twice")
            seen.add(zone.name)
        return value


class WorkerFile(_Strict):
    """The front matter of a `.worker` file."""

    name: str
    description: str = ""
    sandbox: WorkerSandbox | None = None

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(
                "a worker name is 1-64 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit"
            )
        return value


@dataclass(frozen=True)
class Worker:
    """A worker's declaration: the zones it needs and how (None: no `sandbox:` key, so no
    zone at all), its approval rules per zone, and where it was read from."""

    name: str
    zones: Mapping[str, WorkerMode] | None
    description: str = ""
    approval: Mapping[str, ZoneApproval] = field(default_factory=dict)
    body: str = ""
    source: str = ""

    @classmethod
    def declare(cls, name: str, zones: Mapping[str, str] | None) -> Worker:
        """A declaration made in code (`Sandbox.restrict({"data": "ro"})`), checked as a
        file's is."""
        declared = None
        if zones is not None:
            declared = [{"name": zone, "mode": mode} for zone, mode in zones.items()]
        raw = {"name": name, "sandbox": {"zones": declared} if declared is not None else None}
        try:
            front = WorkerFile.model_validate(raw)
        except ValidationError as exc:
            raise UserError(f"worker {shown(name)}: {_describe(exc.errors()[0], None)}") from None
        return _worker(front, "", f"worker {name}")


def parse(text: str, source: str, zones: Sequence[str]) -> Worker:
    """The worker declared in `text` (a `.worker` file's contents, `source` naming it), whose
    zones must be among `zones`; UserError with one line naming the file, the line and the
    field for anything else."""
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].rstrip("\r\n") != _FENCE:
        raise UserError(
            f"{source}, line 1: expected YAML front matter: a '---' line, then name, "
            f"description and sandbox, then a closing '---' line"
        )
    end = next((i for i in range(1, len(lines)) if lines[i].rstrip("\r\n") in ("---", "...")), 0)
    if not end:
        raise UserError(f"{source}: the front matter has no closing '---' line")
    # One empty line for the opening fence, so that YAML's line numbers are the file's.
    front_text = "\n" + "".join(lines[1:end])
    raw = inputs.load_yaml(front_text, source)
    if not isinstance(raw, dict):
        raise UserError(f"{source}, line 2: expected a mapping with name, description and sandbox")
    try:
        front = WorkerFile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        line = _line_of(front_text, err["loc"])
        raise UserError(f"{source}, line {line}: {_describe(err, WorkerFile)}") from None
    known = [*zones, HOME_ZONE]
    for index, zone in enumerate(front.sandbox.zones if front.sandbox is not None else ()):
        if zone.name not in known:
            line = _line_of(front_text, ("sandbox", "zones", index, "name"))
            raise UserError(
                f"{source}, line {line}: sandbox.zones[{index}].name: unknown zone "
                f"{shown(zone.name)}; zones: {', '.join(known)}"
            )
    return _worker(front, "".join(lines[end + 1 :]), source)


def _worker(front: WorkerFile, body: str, source: str) -> Worker:
    zones = None
    approval: dict[str, ZoneApproval] = {}
    if front.sandbox is not None:
        zones = {zone.name: zone.mode for zone in front.sandbox.zones}
        approval = {z.name: z.approval for z in front.sandbox.zones if z.approval is not None}
    return Worker(front.name, zones, front.description, approval, body, source)


def _describe(err: Any, model: type[BaseModel] | None) -> str:
    """One pydantic error as `field: what is wrong; what is accepted`."""
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    loc = loc or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        accepted = _accepted(model, err["loc"][:-1]) if model is not None else []
        hint = f"; accepted keys: {', '.join(accepted)}" if accepted else ""
        return f"{loc}: unknown key{hint}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{loc}: {shown(err['input'])} is not one of {expected}"
    if kind == "missing":
        return f"{loc}: missing"
    message = err["msg"].removeprefix("Value error, ")
    if isinstance(err["input"], dict | list):
        return f"{loc}: {message}"
    return f"{loc}: {message} (got {shown(err['input'])})"


_MODELS: dict[str, type[BaseModel]] = {
    "sandbox": WorkerSandbox,
    "zones": WorkerZone,
    "approval": ZoneApproval,
}


def _accepted(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The keys accepted where an unknown one was found (the model at `loc`)."""
    names = [part for part in loc if isinstance(part, str)]
    found = _MODELS.get(names[-1], model) if names else model
    return list(found.model_fields)


def _line_of(text: str, loc: Sequence[Any]) -> int:
    """The line (1-based) where the field at `loc` is written in the YAML `text` (its key's
    line; a list item's own line), or the nearest enclosing one found."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return 1
    line = node.start_mark.line + 1 if node is not None else 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if k.value == part), None)
            if pair is None:
                break
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


# ----- finding workers -------------------------------------------------------------------------

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | os.O_NOFOLLOW


def _read(layer: Path, name: str) -> str | None:
    """`<layer>/<name>` as text, None when absent; never through a symbolic link (the layer
    inside the project may be written by a sandbox)."""
    try:
        dir_fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the layer is a link: nothing of it is read
            return None
        raise UserError(f"cannot read the workers directory {layer}: {exc.strerror}") from None
    try:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise UserError(f"cannot read {layer / name}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > inputs.MAX_FILE_BYTES:
            raise UserError(f"cannot read {layer / name}: not a regular file of at most 1 MiB")
        data = os.read(fd, inputs.MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"cannot read {layer / name}: not UTF-8 text") from None


def _names(layer: Path) -> list[str]:
    try:
        dir_fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        return sorted(n[: -len(SUFFIX)] for n in os.listdir(dir_fd) if n.endswith(SUFFIX))
    finally:
        os.close(dir_fd)


def zone_names(config: Config) -> list[str]:
    """The zones a worker may name in `config`: the built-in and project ones (the git
    directory zone of a worktree project follows `repo`, and is not named)."""
    return [z.value for z in config.zone_list() if z.value not in (GIT_DIR_ZONE, HOME_ZONE)]


def find(project: Path, name: str, config: Config) -> Worker:
    """The worker `name`, from `<name>.worker` in the first workers layer holding it."""
    if not _NAME_RE.match(name):
        raise UserError(
            f"invalid worker name {shown(name)}: use 1-64 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )
    layers = worker_layers(project)
    for layer in layers:
        text = _read(layer, name + SUFFIX)
        if text is not None:
            worker = parse(text, str(layer / (name + SUFFIX)), zone_names(config))
            if worker.name != name:
                raise UserError(
                    f"{layer / (name + SUFFIX)}: declares name {shown(worker.name)}; a worker's "
                    f"name is its file's name without {SUFFIX}"
                )
            return worker
    where = ", ".join(str(layer) for layer in layers)
    raise UserError(f"no worker named {shown(name)}: no {name}{SUFFIX} in {where}")


def names(project: Path) -> list[str]:
    """Every worker's name in the union of the workers layers, sorted."""
    found: set[str] = set()
    for layer in worker_layers(project):
        found.update(n for n in _names(layer) if _NAME_RE.match(n))
    return sorted(found)


# ----- narrowing -------------------------------------------------------------------------------


def has_mode(access: ZoneAccess) -> str:
    """How a parent's access to a zone is named in a refusal: 'rw', 'ro', 'create-only',
    'none' or its letters."""
    if access.create_only:
        return "create-only"
    if Op.READ in access.ops and Op.WRITE in access.ops:
        return "rw"
    if Op.READ in access.ops and Op.WRITE not in access.ops:
        return "ro"
    return access.spelling() or "none"


def _covers(access: ZoneAccess, mode: str) -> bool:
    """Whether a parent with `access` has everything a child asking `mode` needs: `ro` needs
    read, `rw` read and write."""
    needed = {Op.READ} if mode == "ro" else {Op.READ, Op.WRITE}
    return not access.create_only and needed <= access.ops


def narrow(config: Config, trust: Trust, worker: Worker) -> Config:
    """`config` cut down to `worker`'s declaration under a parent at `trust` (with `config`'s
    own worker scope, if it is a worker's already): its zones, at most their modes, and nothing
    else. UserError naming the zone, the mode asked and the mode the parent has for a
    declaration wider than the parent."""
    parent = config.matrix()[trust]
    by_name = {zone.value: access for zone, access in parent.items()}
    declared = dict(worker.zones or {})
    if HOME_ZONE in declared and HOME_ZONE not in config.zones:
        del declared[HOME_ZONE]  # the home exists under `sandboxfs run` only
    known = [*(z.value for z in config.zone_list() if z.value != GIT_DIR_ZONE)]
    for name, mode in declared.items():
        if mode not in WORKER_MODE_OPS:
            raise UserError(f"worker {worker.name}: zone {name!r}: mode {mode!r} is not ro or rw")
        if name not in known:
            raise UserError(
                f"worker {worker.name}: unknown zone {shown(name)}; zones: {', '.join(known)}"
            )
        has = by_name.get(name, ZoneAccess())
        if not _covers(has, mode):
            raise WiderThanParent(
                f"worker {worker.name}: Child requests {mode!r} on {name!r} but parent only "
                f"has {has_mode(has)!r} (trust level {trust.value}"
                f"{', worker ' + config.worker.name if config.worker is not None else ''})"
            )
    if "repo" in declared and GIT_DIR_ZONE in config.zones:
        declared[GIT_DIR_ZONE] = declared["repo"]  # a worktree's git directory goes with /repo
    zones = {name: zone for name, zone in config.zones.items() if name in declared}
    approval = {
        zone: rules.model_dump(exclude_none=True)
        for zone, rules in worker.approval.items()
        if zone in declared
    }
    scope = WorkerScope(name=worker.name, zones=declared, approval=approval)
    return config.model_copy(update={"zones": zones, "worker": scope})


# ----- attachments -----------------------------------------------------------------------------


def attachment_names(paths: Sequence[str]) -> dict[str, str]:
    """Each attached virtual path by the name it gets in /attachments (its last component);
    UserError for a path without one, or two with the same."""
    named: dict[str, str] = {}
    for path in paths:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name in ("", ".", ".."):
            raise UserError(f"--attach {shown(path)}: name a file, e.g. /workspace/data/a.csv")
        if name in named:
            raise UserError(
                f"--attach {shown(path)} and {shown(named[name])}: both would be "
                f"/{ATTACHMENTS_ZONE}/{name}; attach one of them"
            )
        named[name] = path
    return named


def attach(config: Config, project: Path, workspace: str, files: Mapping[str, bytes]) -> Config:
    """A worker's `config` with the zone /attachments holding `files` (name: contents, read
    by the parent, which the caller checked and audited), read-only at every trust level.
    They are copies in the state dir: the child sees what was checked, and nothing the parent
    changes later."""
    if config.worker is None:
        raise UserError("attachments are given to a worker: --attach needs --worker NAME")
    if ATTACHMENTS_ZONE in config.zones:
        raise UserError(
            f"the zone {ATTACHMENTS_ZONE!r} exists already (attachments are given once, or the "
            f"project's config declares a zone of that name: rename it)"
        )
    ws = (*attachments_parts(workspace), secrets.token_hex(8))
    try:
        directory = ensure_dirs(project, *ws)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (SandboxError, OSError) as exc:
        raise UserError(f"cannot create the attachments' directory: {exc}") from None
    try:
        for name, data in files.items():
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            # 0644: the policy, not the mode bits, refuses a change, so it is audited.
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    zone = AttachmentsZoneConfig(path=str(directory), permissions={t: "rl" for t in Trust})
    scope = config.worker.model_copy(
        update={"zones": {**config.worker.zones, ATTACHMENTS_ZONE: "ro"}}
    )
    return config.model_copy(
        update={"zones": {**config.zones, ATTACHMENTS_ZONE: zone}, "worker": scope}
    )


def discard_attachments(config: Config) -> None:
    """Remove the copies `attach` made for `config`, once no mount shows them (after `run`)."""
    zone = config.zones.get(ATTACHMENTS_ZONE)
    if isinstance(zone, AttachmentsZoneConfig):
        shutil.rmtree(zone.path, ignore_errors=True)


def access_text(access: ZoneAccess) -> str:
    """A zone's access as the trust table spells it ("r l", "create-only", "—")."""
    if access.create_only:
        return "create-only"
    return " ".join(access.spelling()) or "—"


def effective(config: Config, trust: Trust, worker: Worker) -> dict[str, Any]:
    """What `worker` gets under a parent at `trust`: each declared zone with its mode and
    permissions, or the refusal (for `workers list` / `show`)."""
    try:
        narrowed = narrow(config, trust, worker)
    except UserError as exc:
        return {"allowed": False, "error": exc.message, "zones": {}}
    row = narrowed.matrix()[trust]
    return {
        "allowed": True,
        "error": None,
        "zones": {
            zone.value: {
                "mode": narrowed.worker.zones.get(zone.value) if narrowed.worker else None,
                "access": access.spelling(),
            }
            for zone, access in row.items()
        },
    }


def describe_zones(zones: Mapping[str, Any]) -> str:
    """`data ro (r l), session rw (r w l d)` for a table cell."""
    parts = []
    for name, got in zones.items():
        parts.append(f"{name} {got['mode']} ({' '.join(got['access']) or '—'})")
    return ", ".join(parts) or "no zones"
