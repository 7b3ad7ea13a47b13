"""Consent: approval rules, pending requests, grants, grouping and a rate limit.

What the trust level permits may still need the user's consent (docs/approvals.md). Each
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


def parent_of(path: str, kind: Kind | None = None) -> str:
    if kind is Kind.CONNECT:
        return path
    head = path.rstrip("/").rpartition("/")[0]
    return head or "/"


def _under(path: str, directory: str) -> bool:
    return directory == "/" or path == directory or path.startswith(directory.rstrip("/") + "/")


def ancestors(path: str) -> list[str]:
    """`path` and each directory above it, up to "/" (a host:port is its own only one): what
    a lookup walks, so it costs the path's depth, not the number of grants."""
    found = [path]
    while path != "/" and "/" in path:
        path = path.rstrip("/").rpartition("/")[0] or "/"
        found.append(path)
    return found


def shown_as(path: str, dest: str | None) -> str:
    """One operation as a grant names it: a rename or link with its other end."""
    return path if dest is None else f"{path} -> {dest}"


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
    # The other end of each path's operation (a rename's destination, a link's source), in
    # the order of `paths`; and the bytes the two hold (bounded: Broker.MAX_REQUEST_BYTES).
    dests: list[str | None] = field(default_factory=list)
    size: int = 0

    @property
    def key(self) -> tuple[str, Kind, int, str]:
        return (self.rule.id, self.kind, self.pid, self.directory)

    @property
    def pairs(self) -> list[tuple[str, str | None]]:
        return list(zip(self.paths, self.dests, strict=True))

    def describe(self, now: float, shown_paths: int = 5) -> dict[str, Any]:
        """What front ends show (raw strings: each front end escapes them). `shown` is the
        request's version: the number of paths it holds now. An answer that carries it
        covers those paths and no path that joined after (the first `shown` of `paths`,
        which only grows); the rest of them are listed by `describe(now, MAX_PATHS)`."""
        return {
            "id": self.id,
            "op": self.kind.value,
            "zone": self.zone,
            "path": self.path,
            "dest": self.dest,
            "directory": self.directory,
            "count": self.count,
            "shown": len(self.paths),
            "paths": self.paths[:shown_paths],
            "dests": self.dests[:shown_paths],
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
    # ONCE and DENY: each (path, other end) the user was shown, used once; a rename or link
    # is covered only with the other end it was shown with.
    pairs: set[tuple[str, str | None]] = field(default_factory=set)
    # DIR: entries moved into the directory after the grant from where it did not cover
    # them (Broker.moved): the grant covers what is made there, never what is moved in.
    moved_in: set[str] = field(default_factory=set)

    @property
    def paths(self) -> list[str]:
        return sorted(shown_as(path, dest) for path, dest in self.pairs)

    def covers(self, kind: Kind, path: str, dest: str | None = None) -> bool:
        """Whether this grant decides `kind` of `path` (`dest`: the other end of a rename or
        link, which a directory grant needs under its directory too)."""
        if kind is not self.kind:
            return False
        if self.scope in (Answer.ONCE, Answer.DENY):
            return (path, dest) in self.pairs
        if self.scope is Answer.EVERYWHERE:
            return True
        if self.directory is None or not _under(path, self.directory):
            return False
        if dest is not None and not _under(dest, self.directory):
            return False
        return self.moved_in.isdisjoint(ancestors(path))

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
            "paths": self.paths[:5],
            "count": len(self.pairs),
            "moved_in": len(self.moved_in),
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
    both = " (from and to it)" if kind is Kind.RENAME else ""
    return (
        f"{verb} {kind.value} under {directory}/{both}{stop}, for this session "
        f"(until unmount, or `sandboxfs grants revoke`)"
    ).replace("//", "/")


def preview(request: Request, answer: Answer) -> str:
    directory = request.directory if answer in (Answer.DIR, Answer.NEVER) else None
    shown = [shown_as(path, dest) for path, dest in request.pairs]
    return grant_text(answer in ALLOWS, answer, request.kind, directory, shown)


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


def _size(path: str, dest: str | None) -> int:
    """What one path of a request holds, about (bounded: Broker.MAX_REQUEST_BYTES)."""
    return len(path) + len(dest or "") + 64


class ApprovalError(Exception):
    """An answer the broker cannot take (unknown or stale id, unknown answer)."""


class Broker:
    """Pending requests and grants of one mount or sandbox, for its session."""

    # Per request: the paths it holds (what a ONCE or DENY answer can cover) and their bytes;
    # a path past either is refused without asking, until the request is answered.
    MAX_PATHS = 1_000
    MAX_REQUEST_BYTES = 128 << 10
    # Per session: the grants, and the paths the ONCE and DENY ones hold, all together; an
    # answer past either is refused (the user revokes some first).
    MAX_GRANTS = 10_000
    MAX_GRANT_PATHS = 50_000
    MAX_MOVED_IN = 10_000  # per directory grant: past it the grant is withdrawn

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
        # A retry, by any process: by kind, path and the other end.
        self._by_path: dict[tuple[Kind, str, str | None], Request] = {}
        self._grants: dict[int, Grant] = {}
        # The grants indexed, so a lookup walks the path's depth, never every grant: ONCE and
        # DENY by path, DIR and NEVER by directory, EVERYWHERE by kind; and, for each
        # directory, how many of the first two are below it (Broker.moved looks there only
        # then).
        self._by_once_path: dict[str, list[Grant]] = {}
        self._by_directory: dict[str, list[Grant]] = {}
        self._everywhere: dict[Kind, list[Grant]] = {}
        self._below: dict[str, int] = {}
        self._once_paths = 0
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
        grant = self._grant_for(kind, path, dest)
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
        """Whether the operation may go ahead now (`dest`: a rename's destination, a link's
        source). An ask with no grant becomes (or joins) a pending request and is refused
        with a reason naming it. `exclusions` False: the rules' exclude patterns do not
        apply (a file with other names, which may be the user's)."""
        rule, kind = self.rule_for(trust, zone, kinds, path if exclusions else "", dest)
        if rule.verdict is Verdict.PRE_APPROVED:
            return Outcome(True, rule)
        what = f"{kind.value} of {shown_as(path, dest)}"
        if rule.verdict is Verdict.BLOCKED:
            return Outcome(False, rule, f"{what} is blocked by approval rule {rule.id}")
        if self.mode is Mode.OFF:
            return Outcome(True, rule, f"{what}: rule {rule.id} asks; --no-approvals", unasked=True)
        grant = self._grant_for(kind, path, dest)
        if grant is not None:
            if grant.once:
                self._use_once(grant, (path, dest))
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
        joined = self._by_path.get((kind, path, dest)) or self._by_key.get(key)
        if joined is not None:
            if (kind, path, dest) not in self._by_path:
                size = _size(path, dest)
                if len(joined.paths) >= self.MAX_PATHS or (
                    joined.size + size > self.MAX_REQUEST_BYTES
                ):
                    reason = (
                        f"{what} needs the user's approval (rule {rule.id}), but request "
                        f"{joined.id} already holds {len(joined.paths)} paths (at most "
                        f"{self.MAX_PATHS}, {self.MAX_REQUEST_BYTES >> 10} KiB): refused "
                        f"without asking until it is answered"
                    )
                    return Outcome(False, rule, reason, limited=True)
                self._join(joined, path, dest)
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
        request = self._request(kind, zone, path, dest, pid, comm, cmdline(), rule, now)
        self._join(request, path, dest)
        return Outcome(False, rule, self._waiting(what, request), request=request, new=True)

    def _request(
        self,
        kind: Kind,
        zone: str,
        path: str,
        dest: str | None,
        pid: int,
        comm: str,
        cmdline: str,
        rule: Rule,
        now: float,
    ) -> Request:
        """A new pending request, holding no path yet (see _join)."""
        directory = parent_of(path, kind)
        request = Request(
            self._next_request,
            kind,
            zone,
            path,
            dest,
            directory,
            pid,
            comm,
            cmdline,
            rule,
            now,
            now + self.timeout,
            count=0,
        )
        self._next_request += 1
        self._pending[request.id] = request
        self._by_key[request.key] = request
        return request

    def _join(self, request: Request, path: str, dest: str | None) -> None:
        request.paths.append(path)
        request.dests.append(dest)
        request.count = len(request.paths)
        request.size += _size(path, dest)
        self._by_path[(request.kind, path, dest)] = request

    @staticmethod
    def _waiting(what: str, request: Request) -> str:
        return (
            f"{what} waits for approval {request.id} (rule {request.rule.id}); the user "
            f"answers outside the sandbox (sandboxfs approve {request.id}); try again then"
        )

    def _grant_for(self, kind: Kind, path: str, dest: str | None = None) -> Grant | None:
        """The grant that decides kind of path: a refusal before an allowance (the oldest
        of either). It walks the path's directories, so it costs the path's depth."""
        found = [g for g in self._by_once_path.get(path, ()) if g.covers(kind, path, dest)]
        for directory in ancestors(path):
            found += [
                g for g in self._by_directory.get(directory, ()) if g.covers(kind, path, dest)
            ]
        found += self._everywhere.get(kind, [])
        refusals = [grant for grant in found if not grant.allow]
        chosen = refusals or found
        return min(chosen, key=lambda g: g.id) if chosen else None

    def _index(self, grant: Grant) -> None:
        self._grants[grant.id] = grant
        if grant.once:
            for path in {path for path, _ in grant.pairs}:
                self._by_once_path.setdefault(path, []).append(grant)
                self._count_below(path, 1)
            self._once_paths += len(grant.pairs)
        elif grant.scope is Answer.EVERYWHERE:
            self._everywhere.setdefault(grant.kind, []).append(grant)
        else:
            assert grant.directory is not None
            self._by_directory.setdefault(grant.directory, []).append(grant)
            self._count_below(grant.directory, 1)

    def _unindex(self, grant: Grant) -> None:
        self._grants.pop(grant.id, None)
        if grant.once:
            for path in {path for path, _ in grant.pairs}:
                self._unlist(self._by_once_path, path, grant)
                self._count_below(path, -1)
            self._once_paths -= len(grant.pairs)
        elif grant.scope is Answer.EVERYWHERE:
            self._unlist(self._everywhere, grant.kind, grant)
        else:
            assert grant.directory is not None
            self._unlist(self._by_directory, grant.directory, grant)
            self._count_below(grant.directory, -1)

    @staticmethod
    def _unlist(index: dict[Any, list[Grant]], key: Any, grant: Grant) -> None:
        listed = index.get(key, [])
        if grant in listed:
            listed.remove(grant)
        if not listed:
            index.pop(key, None)

    def _count_below(self, path: str, step: int) -> None:
        for directory in ancestors(path)[1:]:
            left = self._below.get(directory, 0) + step
            if left:
                self._below[directory] = left
            else:
                self._below.pop(directory, None)

    def _use_once(self, grant: Grant, pair: tuple[str, str | None]) -> None:
        """One path of a ONCE or DENY grant is used (or no longer means what was shown)."""
        if pair not in grant.pairs:
            return
        grant.pairs.discard(pair)
        self._once_paths -= 1
        path = pair[0]
        # The same path with another other end: only a rename's, link's or overwrite's.
        two_ended = grant.kind in (Kind.RENAME, Kind.CREATE, Kind.OVERWRITE)
        if not (two_ended and any(other == path for other, _ in grant.pairs)):
            self._unlist(self._by_once_path, path, grant)
            self._count_below(path, -1)
        if not grant.pairs:
            self._grants.pop(grant.id, None)

    def moved(self, src: str, dst: str) -> list[Grant]:
        """An allowed rename moved `src` (and what is below it) to `dst`: what a grant covered
        there before is gone, and what was moved in is not what the user allowed. Each
        directory grant that covers `dst` but did not cover `src` leaves it out; a once-grant
        at or below `dst` is dropped; a directory grant whose directory is below `dst` (its
        directory is what was moved in) is withdrawn. The grants withdrawn (a directory grant
        past MAX_MOVED_IN is too), for the audit log."""
        withdrawn: list[Grant] = []
        for directory in ancestors(dst):
            for grant in list(self._by_directory.get(directory, ())):
                if not grant.allow or grant.covers(grant.kind, src):
                    continue
                if grant.covers(grant.kind, dst):
                    grant.moved_in.add(dst)
                    if len(grant.moved_in) > self.MAX_MOVED_IN:
                        self._unindex(grant)
                        withdrawn.append(grant)
        if not self._below.get(dst) and dst not in self._by_once_path:
            return withdrawn
        for path in [p for p in self._by_once_path if _under(p, dst)]:
            for grant in list(self._by_once_path.get(path, ())):
                for pair in [pair for pair in grant.pairs if pair[0] == path]:
                    self._use_once(grant, pair)
        for directory in [d for d in self._by_directory if d != dst and _under(d, dst)]:
            for grant in list(self._by_directory[directory]):
                if grant.allow:
                    self._unindex(grant)
                    withdrawn.append(grant)
        return withdrawn

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
        for path, dest in request.pairs:
            if self._by_path.get((request.kind, path, dest)) is request:
                del self._by_path[(request.kind, path, dest)]

    def pending(self) -> list[Request]:
        return sorted(self._pending.values(), key=lambda r: r.id)

    def grants(self) -> list[Grant]:
        return sorted(self._grants.values(), key=lambda g: g.id)

    def answer(
        self, request_id: int, answer: Answer, who: str, shown: int | None = None
    ) -> tuple[Request, Grant, Request | None]:
        """Answer a pending request; the request as answered (the paths its grant covers),
        the grant it makes (consulted by the retries), and the request the rest of its paths
        stay pending in (None: none). `shown` is the version the user saw (Request.describe):
        the grant covers those first paths only, never one that joined after. An allow-once
        needs it; a refusal without it covers every path the request holds."""
        request = self._pending.get(request_id)
        if request is None:
            raise ApprovalError(
                f"no pending request {request_id} (answered, timed out or never made)"
            )
        if shown is None and answer is Answer.ONCE:
            raise ApprovalError(
                f"an allow-once answer to request {request_id} names how many of its paths "
                f'were shown (its "shown"; `sandboxfs approvals --list {request_id}`)'
            )
        held = len(request.paths)
        if shown is not None and not 0 < shown <= held:
            raise ApprovalError(
                f"request {request_id} held {held} paths, not {shown}: answer what "
                f"`sandboxfs approvals --list {request_id}` shows"
            )
        covered = held if shown is None or answer not in (Answer.ONCE, Answer.DENY) else shown
        if len(self._grants) >= self.MAX_GRANTS or (
            answer in (Answer.ONCE, Answer.DENY)
            and self._once_paths + covered > self.MAX_GRANT_PATHS
        ):
            raise ApprovalError(
                f"this session holds {len(self._grants)} grants for {self._once_paths} paths "
                f"(at most {self.MAX_GRANTS}, {self.MAX_GRANT_PATHS} paths): revoke some "
                f"first (sandboxfs grants --revoke ID)"
            )
        self._drop(request)
        rest = request.pairs[covered:]
        del request.paths[covered:], request.dests[covered:]
        request.count = covered
        remainder = None
        if rest:  # joined after the user looked: still the user's to answer
            first, dest = rest[0]
            remainder = self._request(
                request.kind,
                request.zone,
                first,
                dest,
                request.pid,
                request.comm,
                request.cmdline,
                request.rule,
                self._clock(),
            )
            for path, other in rest:
                self._join(remainder, path, other)
        directory = request.directory if answer in (Answer.DIR, Answer.NEVER) else None
        pairs = set(request.pairs) if answer in (Answer.ONCE, Answer.DENY) else set()
        grant = Grant(
            self._next_grant,
            answer in ALLOWS,
            request.kind,
            answer,
            request.rule.id,
            request.id,
            who,
            directory,
            pairs,
        )
        self._next_grant += 1
        self._index(grant)
        return request, grant, remainder

    def settled(self, grant: Grant) -> list[Request]:
        """Drop the other pending requests that `grant` answers whole (a directory grant
        covers the requests of its subdirectories); those dropped."""
        if grant.once:
            return []
        covered = [
            r
            for r in self._pending.values()
            if all(grant.covers(r.kind, path, dest) for path, dest in r.pairs)
        ]
        for request in covered:
            self._drop(request)
        return covered

    def revoke(self, grant_id: int) -> Grant:
        grant = self._grants.get(grant_id)
        if grant is None:
            raise ApprovalError(f"no grant {grant_id} (see `sandboxfs grants`)")
        self._unindex(grant)
        return grant

    def listing(self, request_id: int) -> dict[str, Any]:
        """One pending request with every path it holds (its version among them), for the
        user to read before answering."""
        request = self._pending.get(request_id)
        if request is None:
            raise ApprovalError(
                f"no pending request {request_id} (answered, timed out or never made)"
            )
        return request.describe(self._clock(), self.MAX_PATHS)

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
