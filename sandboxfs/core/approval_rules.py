"""Approval rules: what kind an operation is, and which rule decides it (docs/approvals.md).

Each operation the guard has already allowed is one of six kinds (read, write, create, delete,
rename, overwrite; connect under `run --net allow`); the rules of the mount say, per trust
level and zone, whether that kind is `preApproved` (the default where nothing is said), `ask`
or `blocked`. The strictest matching rule decides, so a project's rules can add consent, never
take the user's away.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase


class Kind(StrEnum):
    """What an operation does, for approval rules."""

    READ = "read"  # opening an existing file to read
    WRITE = "write"  # changing an existing file
    CREATE = "create"  # a new file, directory, link or node
    DELETE = "delete"  # unlink, rmdir
    RENAME = "rename"
    OVERWRITE = "overwrite"  # replacing an existing file: O_TRUNC, or a rename onto it
    CONNECT = "connect"  # under `run --net allow`: a host not on the allowlist (zone NET)


# The pseudo-zone of CONNECT requests; their path is HOST:PORT, their directory the same (so
# "this directory" is "this host").
NET = "net"


class Verdict(StrEnum):
    PRE_APPROVED = "preApproved"
    ASK = "ask"
    BLOCKED = "blocked"


_STRICTNESS = {Verdict.PRE_APPROVED: 0, Verdict.ASK: 1, Verdict.BLOCKED: 2}


@dataclass(frozen=True, slots=True)
class Rule:
    """One approval rule: for these trust levels and zones (empty: all), these kinds, except on
    the paths `exclude` names (see `excludes`)."""

    id: str
    verdict: Verdict
    kinds: frozenset[Kind]
    zones: frozenset[str] = frozenset()
    trust: frozenset[str] = frozenset()
    exclude: tuple[str, ...] = ()

    def matches(
        self,
        trust: str,
        zone: str,
        kind: Kind,
        path: str = "",
        dest: str | None = None,
    ) -> bool:
        return (
            kind in self.kinds
            and (not self.zones or zone in self.zones)
            and (not self.trust or trust in self.trust)
            and not (self.exclude and self.excludes(path, dest))
        )

    def excludes(self, path: str, dest: str | None = None) -> bool:
        """Whether the rule leaves out `path` (a virtual path, /ZONE/...) and, for a rename or
        link, `dest` too: moving a path that is not excluded into one that is still counts
        (else renaming `src` to `build/src` would make it deletable without asking)."""
        return excluded(self.exclude, path) and (dest is None or excluded(self.exclude, dest))

    def describe(self) -> str:
        zones = ", ".join(sorted(self.zones)) or "every zone"
        levels = ", ".join(sorted(self.trust)) or "every trust level"
        kinds = ", ".join(k.value for k in Kind if k in self.kinds)
        more = f" and {len(self.exclude) - 3} more" if len(self.exclude) > 3 else ""
        but = f" (except {', '.join(self.exclude[:3])}{more})" if self.exclude else ""
        return f"{self.id}: {kinds} in {zones}{but} at {levels}: {self.verdict.value}"


def excluded(patterns: Iterable[str], path: str) -> bool:
    """Whether an exclude pattern covers `path` (/ZONE/rel/...): a pattern without `/` names
    an entry anywhere (`node_modules`, `*.egg-info`: that entry and all below it), one with
    `/` a path from the zone's root (`docs/generated`); shell wildcards, case counts."""
    if not path.startswith("/"):
        return False  # a host:port (connect)
    parts = path.strip("/").split("/")[1:]
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for pattern in patterns:
        if "/" in pattern:
            if any(fnmatchcase(prefix, pattern) for prefix in prefixes):
                return True
        elif any(fnmatchcase(part, pattern) for part in parts):
            return True
    return False


DEFAULT_RULE = Rule("default", Verdict.PRE_APPROVED, frozenset(Kind))

# What the agent profile never asks about: what the everyday tools it is meant for make and
# remake on their own (a virtualenv, node_modules, build output, caches, byte code), each by
# its name anywhere in the repository (docs/approvals.md).
AGENT_EXCLUDE = (
    ".venv",
    "venv",
    "node_modules",
    "__pycache__",
    "build",
    "dist",
    "target",
    "*.egg-info",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".tox",
    ".nox",
    ".cache",
)

# The documented profiles a project (or the user) turns on with one line (`approvals:
# {profile: agent}`): what an agent does that is hard to undo in the repository asks first.
PROFILES: dict[str, tuple[Rule, ...]] = {
    "agent": tuple(
        Rule(
            f"agent:repo-{kind.value}",
            Verdict.ASK,
            frozenset({kind}),
            frozenset({"repo"}),
            exclude=AGENT_EXCLUDE,
        )
        for kind in (Kind.DELETE, Kind.RENAME, Kind.OVERWRITE)
    ),
}


def strictest(
    rules: Iterable[Rule],
    trust: str,
    zone: str,
    kind: Kind,
    path: str = "",
    dest: str | None = None,
) -> Rule:
    """The rule that decides `kind` of `path` (-> `dest`) in `zone` at `trust`: the strictest
    that matches (the first of equals), else DEFAULT_RULE."""
    found = DEFAULT_RULE
    for rule in rules:
        if (
            rule.matches(trust, zone, kind, path, dest)
            and _STRICTNESS[rule.verdict] > _STRICTNESS[found.verdict]
        ):
            found = rule
    return found


def strictest_kind(
    rules: Sequence[Rule],
    trust: str,
    zone: str,
    kinds: Sequence[Kind],
    path: str = "",
    dest: str | None = None,
) -> tuple[Rule, Kind]:
    """The strictest rule over `kinds` (a rename that replaces a file is also an
    overwrite) and the kind it decides; rules' exclusions apply to `path` (-> `dest`),
    none to an empty path."""
    best, best_kind = DEFAULT_RULE, kinds[0]
    for kind in kinds:
        rule = strictest(rules, trust, zone, kind, path, dest)
        if _STRICTNESS[rule.verdict] > _STRICTNESS[best.verdict]:
            best, best_kind = rule, kind
    return best, best_kind
