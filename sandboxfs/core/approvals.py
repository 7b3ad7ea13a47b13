"""Consent: approval rules, pending requests, grants, grouping and a rate limit.

What the trust level permits may still need the user's consent (README, "Approvals"). Each
operation the guard has already allowed is one of six kinds (read, write, create, delete,
rename, overwrite); the rules of the mount say, per trust level and zone, whether that kind is
`preApproved` (the default where nothing is said), `ask` or `blocked`. The strictest matching
rule decides, so a project's rules can add consent, never take the user's away.

An `ask` is never held in a FUSE callback: during create, unlink, rmdir and rename the kernel
holds the parent directory's lock, so holding them would freeze that directory for every
process (the tests measure it). The operation is refused at once with a reason naming the
pending request; the user answers over the control channel; the retry then passes (or is
refused) by the grant the answer made. Requests of one rule, process and directory that
arrive while one is pending become that one request (a count and the first paths), and past a
rate limit new requests are refused without a prompt.

Pure: no trio, pyfuse3 or os. The guard calls `Broker.consult` last in every check, after the
matrix, deny list and protected paths have allowed the operation, so no grant ever widens what
the trust level permits, and a deny-listed or protected path is never offered for approval.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Any


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


class Mode(StrEnum):
    """How `ask` is answered on this mount: `ask` (over the control channel), `none` (nobody
    can answer: refused at once) or `off` (--no-approvals: every ask passes, audited)."""

    ASK = "ask"
    NONE = "none"
    OFF = "off"


class Answer(StrEnum):
    ONCE = "once"  # allow this request (each path it groups) once
    DIR = "dir"  # allow this kind under the request's directory, for the session
    EVERYWHERE = "everywhere"  # allow this kind wherever a rule asks, for the session
    DENY = "deny"  # refuse this request (each path's next try)
    NEVER = "never"  # deny, and refuse this kind under the directory without asking again


ALLOWS = frozenset({Answer.ONCE, Answer.DIR, Answer.EVERYWHERE})


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
# its name anywhere in the repository (README, "Approvals").
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


def parent_of(path: str, kind: Kind | None = None) -> str:
    if kind is Kind.CONNECT:
        return path
    head = path.rstrip("/").rpartition("/")[0]
    return head or "/"


def _under(path: str, directory: str) -> bool:
    return directory == "/" or path == directory or path.startswith(directory.rstrip("/") + "/")


@dataclass(slots=True)
class Request:
    """An operation waiting for the user's answer, with the ones grouped into it."""

    id: int
    kind: Kind
    zone: str
    path: str
    dest: str | None
    directory: str
    pid: int
    comm: str
    cmdline: str
    rule: Rule
    created: float
    expires: float
    paths: list[str] = field(default_factory=list)
    count: int = 1

    @property
    def key(self) -> tuple[str, Kind, int, str]:
        return (self.rule.id, self.kind, self.pid, self.directory)

    def describe(self, now: float, shown_paths: int = 5) -> dict[str, Any]:
        """What front ends show (raw strings: each front end escapes them)."""
        return {
            "id": self.id,
            "op": self.kind.value,
            "zone": self.zone,
            "path": self.path,
            "dest": self.dest,
            "directory": self.directory,
            "count": self.count,
            "paths": self.paths[:shown_paths],
            "pid": self.pid,
            "comm": self.comm,
            "cmdline": self.cmdline,
            "rule": self.rule.id,
            "rule_text": self.rule.describe(),
            "expires_in": max(0, round(self.expires - now)),
            "grants": {answer.value: preview(self, answer) for answer in Answer},
        }


@dataclass(slots=True)
class Grant:
    """What an answer leaves behind: allow or refuse `kind` for some paths, for the session."""

    id: int
    allow: bool
    kind: Kind
    scope: Answer
    rule: str
    request: int
    answered_by: str
    directory: str | None = None  # DIR and NEVER: this subtree
    paths: set[str] = field(default_factory=set)  # ONCE and DENY: each used once

    def covers(self, kind: Kind, path: str) -> bool:
        if kind is not self.kind:
            return False
        if self.scope in (Answer.ONCE, Answer.DENY):
            return path in self.paths
        if self.scope is Answer.EVERYWHERE:
            return True
        return self.directory is not None and _under(path, self.directory)

    @property
    def once(self) -> bool:
        return self.scope in (Answer.ONCE, Answer.DENY)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "allow": self.allow,
            "op": self.kind.value,
            "scope": self.scope.value,
            "directory": self.directory,
            "paths": sorted(self.paths)[:5],
            "count": len(self.paths),
            "rule": self.rule,
            "request": self.request,
            "answered_by": self.answered_by,
            "text": grant_text(self.allow, self.scope, self.kind, self.directory, self.paths),
        }


def grant_text(
    allow: bool, scope: Answer, kind: Kind, directory: str | None, paths: Iterable[str]
) -> str:
    """The exact rule a grant becomes, its scope and its lifetime, in one line."""
    verb = "allow" if allow else "refuse"
    session = "for this session (until unmount, or `sandboxfs grants revoke`)"
    if kind is Kind.CONNECT and scope in (Answer.DIR, Answer.NEVER):
        stop = " without asking again" if scope is Answer.NEVER else ""
        return f"{verb} connections to {directory}{stop}, {session}"
    if scope in (Answer.ONCE, Answer.DENY):
        listed = sorted(paths)
        what = listed[0] if len(listed) == 1 else f"{len(listed)} paths ({', '.join(listed[:3])}"
        what += "" if len(listed) == 1 else (", ...)" if len(listed) > 3 else ")")
        return f"{verb} {kind.value} of {what}, once (the next try of each)"
    if scope is Answer.EVERYWHERE:
        return (
            f"{verb} {kind.value} wherever an approval rule asks, for this session "
            f"(until unmount, or `sandboxfs grants revoke`)"
        )
    stop = " without asking again" if scope is Answer.NEVER else ""
    return (
        f"{verb} {kind.value} under {directory}/{stop}, for this session "
        f"(until unmount, or `sandboxfs grants revoke`)"
    ).replace("//", "/")


def preview(request: Request, answer: Answer) -> str:
    directory = request.directory if answer in (Answer.DIR, Answer.NEVER) else None
    return grant_text(answer in ALLOWS, answer, request.kind, directory, request.paths)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the broker says of one operation: allowed (by `rule`, maybe by `grant`), or
    refused with `reason`; `request` is the pending request it waits for (new: just made)."""

    allowed: bool
    rule: Rule
    reason: str = ""
    grant: Grant | None = None
    request: Request | None = None
    new: bool = False
    unasked: bool = False  # an ask passed under --no-approvals
    limited: bool = False  # refused by the rate limit


class ApprovalError(Exception):
    """An answer the broker cannot take (unknown or stale id, unknown answer)."""


class Broker:
    """Pending requests and grants of one mount or sandbox, for its session."""

    MAX_PATHS = 10_000  # per request: what a ONCE or DENY answer covers

    def __init__(
        self,
        rules: Sequence[Rule],
        *,
        mode: Mode = Mode.ASK,
        timeout: float = 60.0,
        per_minute: int = 30,
        clock: Callable[[], float] = time.monotonic,
        nobody: str = "approvals are off for this run (--approvals none)",
    ) -> None:
        self.rules = tuple(rules)
        self.mode = mode
        self.nobody = nobody  # why nobody can answer, under Mode.NONE
        self.timeout = timeout
        self.per_minute = per_minute
        self._clock = clock
        self._pending: dict[int, Request] = {}
        self._by_key: dict[tuple[str, Kind, int, str], Request] = {}
        self._by_path: dict[tuple[Kind, str], Request] = {}  # a retry, by any process
        self._grants: dict[int, Grant] = {}
        self._recent: deque[float] = deque()  # when the last requests were made (rate limit)
        self._next_request = 1
        self._next_grant = 1

    @property
    def asks(self) -> bool:
        """Whether any rule asks or blocks (else consult is never needed)."""
        return any(rule.verdict is not Verdict.PRE_APPROVED for rule in self.rules)

    def rule_for(
        self,
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
            rule = strictest(self.rules, trust, zone, kind, path, dest)
            if _STRICTNESS[rule.verdict] > _STRICTNESS[best.verdict]:
                best, best_kind = rule, kind
        return best, best_kind

    def verdict(
        self,
        trust: str,
        zone: str,
        kinds: Sequence[Kind],
        path: str,
        dest: str | None = None,
        exclusions: bool = True,
    ) -> Outcome:
        """What consult would answer now, changing nothing: no request made or joined, no
        once-grant used (a permission probe's answer)."""
        rule, kind = self.rule_for(trust, zone, kinds, path if exclusions else "", dest)
        what = f"{kind.value} of {path}"
        if rule.verdict is Verdict.PRE_APPROVED or self.mode is Mode.OFF:
            return Outcome(True, rule)
        if rule.verdict is Verdict.BLOCKED:
            return Outcome(False, rule, f"{what} is blocked by approval rule {rule.id}")
        grant = self._grant_for(kind, path)
        if grant is not None and grant.allow:
            return Outcome(True, rule, f"{what}: allowed by grant {grant.id}", grant=grant)
        if grant is not None:
            return Outcome(False, rule, f"{what} was refused by the user (rule {rule.id})")
        return Outcome(False, rule, f"{what} needs the user's approval (rule {rule.id})")

    def consult(
        self,
        trust: str,
        zone: str,
        kinds: Sequence[Kind],
        path: str,
        *,
        pid: int,
        comm: str = "",
        cmdline: Callable[[], str] = lambda: "",
        dest: str | None = None,
        exclusions: bool = True,
    ) -> Outcome:
        """Whether the operation may go ahead now. An ask with no grant becomes (or joins) a
        pending request and is refused with a reason naming it. `exclusions` False: the
        rules' exclude patterns do not apply (a file with other names, which may be the
        user's)."""
        rule, kind = self.rule_for(trust, zone, kinds, path if exclusions else "", dest)
        if rule.verdict is Verdict.PRE_APPROVED:
            return Outcome(True, rule)
        what = f"{kind.value} of {path}"
        if rule.verdict is Verdict.BLOCKED:
            return Outcome(False, rule, f"{what} is blocked by approval rule {rule.id}")
        if self.mode is Mode.OFF:
            return Outcome(True, rule, f"{what}: rule {rule.id} asks; --no-approvals", unasked=True)
        grant = self._grant_for(kind, path)
        if grant is not None:
            if grant.once:
                grant.paths.discard(path)
                if not grant.paths:
                    del self._grants[grant.id]
            if grant.allow:
                return Outcome(True, rule, f"{what}: allowed by grant {grant.id}", grant=grant)
            return Outcome(
                False,
                rule,
                f"{what} was refused by the user (request {grant.request}, rule {rule.id})",
                grant=grant,
            )
        if self.mode is Mode.NONE:
            return Outcome(
                False,
                rule,
                f"{what} needs the user's approval (rule {rule.id}), and nobody can answer: "
                f"{self.nobody}",
            )
        now = self._clock()
        self.expire()
        key = (rule.id, kind, pid, parent_of(path, kind))
        joined = self._by_path.get((kind, path)) or self._by_key.get(key)
        if joined is not None:
            if (kind, path) not in self._by_path and len(joined.paths) < self.MAX_PATHS:
                joined.paths.append(path)
                joined.count += 1
                self._by_path[(kind, path)] = joined
            return Outcome(False, rule, self._waiting(what, joined), request=joined)
        while self._recent and self._recent[0] <= now - 60:
            self._recent.popleft()
        if len(self._recent) >= self.per_minute:
            reason = (
                f"{what} needs the user's approval (rule {rule.id}), but more than "
                f"{self.per_minute} requests came in a minute: refused without asking"
            )
            return Outcome(False, rule, reason, limited=True)
        self._recent.append(now)
        request = Request(
            self._next_request,
            kind,
            zone,
            path,
            dest,
            parent_of(path, kind),
            pid,
            comm,
            cmdline(),
            rule,
            now,
            now + self.timeout,
            [path],
        )
        self._next_request += 1
        self._pending[request.id] = request
        self._by_key[key] = request
        self._by_path[(kind, path)] = request
        return Outcome(False, rule, self._waiting(what, request), request=request, new=True)

    @staticmethod
    def _waiting(what: str, request: Request) -> str:
        return (
            f"{what} waits for approval {request.id} (rule {request.rule.id}); the user "
            f"answers outside the sandbox (sandboxfs approve {request.id}); try again then"
        )

    def _grant_for(self, kind: Kind, path: str) -> Grant | None:
        """The grant that decides kind of path: a refusal before an allowance."""
        found = [grant for grant in self._grants.values() if grant.covers(kind, path)]
        refusals = [grant for grant in found if not grant.allow]
        chosen = refusals or found
        return chosen[0] if chosen else None

    def expire(self) -> list[Request]:
        """Drop the requests nobody answered in time; those dropped."""
        now = self._clock()
        gone = [r for r in self._pending.values() if r.expires <= now]
        for request in gone:
            self._drop(request)
        return gone

    def _drop(self, request: Request) -> None:
        self._pending.pop(request.id, None)
        if self._by_key.get(request.key) is request:
            del self._by_key[request.key]
        for path in request.paths:
            if self._by_path.get((request.kind, path)) is request:
                del self._by_path[(request.kind, path)]

    def pending(self) -> list[Request]:
        return sorted(self._pending.values(), key=lambda r: r.id)

    def grants(self) -> list[Grant]:
        return sorted(self._grants.values(), key=lambda g: g.id)

    def answer(self, request_id: int, answer: Answer, who: str) -> tuple[Request, Grant]:
        """Answer a pending request; the grant it makes (consulted by the retries)."""
        request = self._pending.get(request_id)
        if request is None:
            raise ApprovalError(
                f"no pending request {request_id} (answered, timed out or never made)"
            )
        self._drop(request)
        directory = request.directory if answer in (Answer.DIR, Answer.NEVER) else None
        paths = set(request.paths) if answer in (Answer.ONCE, Answer.DENY) else set()
        grant = Grant(
            self._next_grant,
            answer in ALLOWS,
            request.kind,
            answer,
            request.rule.id,
            request.id,
            who,
            directory,
            paths,
        )
        self._next_grant += 1
        self._grants[grant.id] = grant
        return request, grant

    def settled(self, grant: Grant) -> list[Request]:
        """Drop the other pending requests that `grant` answers whole (a directory grant
        covers the requests of its subdirectories); those dropped."""
        if grant.once:
            return []
        covered = [
            r for r in self._pending.values() if all(grant.covers(r.kind, path) for path in r.paths)
        ]
        for request in covered:
            self._drop(request)
        return covered

    def revoke(self, grant_id: int) -> Grant:
        grant = self._grants.pop(grant_id, None)
        if grant is None:
            raise ApprovalError(f"no grant {grant_id} (see `sandboxfs grants`)")
        return grant

    def snapshot(self) -> dict[str, Any]:
        """Pending requests and grants, for the control channel."""
        now = self._clock()
        return {
            "mode": self.mode.value,
            "pending": [r.describe(now) for r in self.pending()],
            "grants": [g.describe() for g in self.grants()],
        }

    def pending_text(self) -> str:
        """The lines the program reads in its guide: what waits for the user."""
        requests = self.pending()
        if not requests:
            return ""
        lines = ["", "Waiting for the user's approval (try again once answered):"]
        for r in requests:
            more = f" and {r.count - 1} more in {r.directory}" if r.count > 1 else ""
            lines.append(f"  {r.id}: {r.kind.value} of {r.path}{more} (rule {r.rule.id})")
        return "\n".join(lines) + "\n"
