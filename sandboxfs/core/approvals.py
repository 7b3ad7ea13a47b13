"""Consent: the broker that decides each operation by the approval rules, the user's grants and
the pending requests of its session, with a rate limit (rules: approval_rules; requests:
approval_requests; grants: approval_grants).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .approval_grants import Answer, Grant, GrantIndex, shown_as
from .approval_requests import PendingRequests, Request, parent_of, request_size
from .approval_rules import Kind, Rule, Verdict, strictest_kind


class Mode(StrEnum):
    """How `ask` is answered on this mount: `ask` (over the control channel), `none` (nobody
    can answer: refused at once) or `off` (--no-approvals: every ask passes, audited)."""

    ASK = "ask"
    NONE = "none"
    OFF = "off"


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


# Refusals that asked nobody, kept for the control channel (the newest).
REFUSALS_KEPT = 100


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
        nobody: str = (
            "approvals are off for this run (--approvals none, the default without a "
            "terminal; with --approvals ask, 'sandboxfs approve' answers from another one)"
        ),
    ) -> None:
        self.rules = tuple(rules)
        self.mode = mode
        self.nobody = nobody  # why nobody can answer, under Mode.NONE
        self.timeout = timeout
        self.per_minute = per_minute
        self._clock = clock
        self._pending = PendingRequests()
        self._grants = GrantIndex()
        self._recent: deque[float] = deque()  # when the last requests were made (rate limit)
        # The last refusals that asked nobody (blocked, or nobody to answer), numbered, for a
        # run without a prompt to tell on its stderr (sandboxfs.run.approval_notices).
        self.refused: deque[dict[str, Any]] = deque(maxlen=REFUSALS_KEPT)
        self.refused_total = 0

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
        return strictest_kind(self.rules, trust, zone, kinds, path, dest)

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
        grant = self._grants.find(kind, path, dest)
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
            reason = f"{what} is blocked by approval rule {rule.id}"
            self._refused(kind, reason, pid, comm)
            return Outcome(False, rule, reason)
        if self.mode is Mode.OFF:
            return Outcome(True, rule, f"{what}: rule {rule.id} asks; --no-approvals", unasked=True)
        grant = self._grants.find(kind, path, dest)
        if grant is not None:
            return self._granted(grant, rule, what, path, dest)
        if self.mode is Mode.NONE:
            reason = (
                f"{what} needs the user's approval (rule {rule.id}), and nobody can answer: "
                f"{self.nobody}"
            )
            self._refused(kind, reason, pid, comm)
            return Outcome(False, rule, reason)
        return self._ask(rule, kind, what, zone, path, dest, pid, comm, cmdline)

    def _granted(self, grant: Grant, rule: Rule, what: str, path: str, dest: str | None) -> Outcome:
        """The operation a grant decides (a once-grant's path is used up by it)."""
        if grant.once:
            self._grants.use_once(grant, (path, dest))
        if grant.allow:
            return Outcome(True, rule, f"{what}: allowed by grant {grant.id}", grant=grant)
        return Outcome(
            False,
            rule,
            f"{what} was refused by the user (request {grant.request}, rule {rule.id})",
            grant=grant,
        )

    def _ask(
        self,
        rule: Rule,
        kind: Kind,
        what: str,
        zone: str,
        path: str,
        dest: str | None,
        pid: int,
        comm: str,
        cmdline: Callable[[], str],
    ) -> Outcome:
        """An ask with no grant: it joins the pending request that holds or groups it, else
        makes a new one (past the rate limit: refused without asking)."""
        now = self._clock()
        self.expire()
        key = (rule.id, kind, pid, parent_of(path, kind))
        joined = self._pending.holding(kind, path, dest) or self._pending.grouping(key)
        if joined is not None:
            return self._join(joined, rule, kind, what, path, dest)
        while self._recent and self._recent[0] <= now - 60:
            self._recent.popleft()
        if len(self._recent) >= self.per_minute:
            reason = (
                f"{what} needs the user's approval (rule {rule.id}), but more than "
                f"{self.per_minute} requests came in a minute: refused without asking"
            )
            return Outcome(False, rule, reason, limited=True)
        self._recent.append(now)
        request = self._pending.new(
            kind, zone, path, dest, pid, comm, cmdline(), rule, now, now + self.timeout
        )
        self._pending.join(request, path, dest)
        return Outcome(False, rule, self._waiting(what, request), request=request, new=True)

    def _join(
        self, joined: Request, rule: Rule, kind: Kind, what: str, path: str, dest: str | None
    ) -> Outcome:
        """A retry, or a path that joins a pending request (past its bounds: refused
        without asking until it is answered)."""
        if self._pending.holding(kind, path, dest) is None:
            size = request_size(path, dest)
            if len(joined.paths) >= self.MAX_PATHS or (joined.size + size > self.MAX_REQUEST_BYTES):
                reason = (
                    f"{what} needs the user's approval (rule {rule.id}), but request "
                    f"{joined.id} already holds {len(joined.paths)} paths (at most "
                    f"{self.MAX_PATHS}, {self.MAX_REQUEST_BYTES >> 10} KiB): refused "
                    f"without asking until it is answered"
                )
                return Outcome(False, rule, reason, limited=True)
            self._pending.join(joined, path, dest)
        return Outcome(False, rule, self._waiting(what, joined), request=joined)

    @staticmethod
    def _waiting(what: str, request: Request) -> str:
        return (
            f"{what} waits for approval {request.id} (rule {request.rule.id}); the user "
            f"answers outside the sandbox (sandboxfs approve {request.id}); try again then"
        )

    def moved(self, src: str, dst: str) -> list[Grant]:
        """An allowed rename moved `src` (and what is below it) to `dst`: the grants it
        withdrew, for the audit log (see GrantIndex.moved; past MAX_MOVED_IN entries moved
        into it, a directory grant is withdrawn)."""
        return self._grants.moved(src, dst, self.MAX_MOVED_IN)

    def expire(self) -> list[Request]:
        """Drop the requests nobody answered in time; those dropped."""
        return self._pending.expire(self._clock())

    def pending(self) -> list[Request]:
        return self._pending.listed()

    def grants(self) -> list[Grant]:
        return self._grants.listed()

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
            and self._grants.once_paths + covered > self.MAX_GRANT_PATHS
        ):
            raise ApprovalError(
                f"this session holds {len(self._grants)} grants for {self._grants.once_paths} "
                f"paths (at most {self.MAX_GRANTS}, {self.MAX_GRANT_PATHS} paths): revoke "
                f"some first (sandboxfs grants --revoke ID)"
            )
        self._pending.drop(request)
        remainder = self._split(request, covered)
        directory = request.directory if answer in (Answer.DIR, Answer.NEVER) else None
        pairs = set(request.pairs) if answer in (Answer.ONCE, Answer.DENY) else set()
        grant = self._grants.add(
            answer, request.kind, request.rule.id, request.id, who, directory, pairs
        )
        return request, grant, remainder

    def _split(self, request: Request, covered: int) -> Request | None:
        """Keep the first `covered` paths in the (dropped) request answered; the paths that
        joined after the user looked stay the user's to answer, in a new pending request."""
        rest = request.pairs[covered:]
        del request.paths[covered:], request.dests[covered:]
        request.count = covered
        if not rest:
            return None
        first, dest = rest[0]
        now = self._clock()
        remainder = self._pending.new(
            request.kind,
            request.zone,
            first,
            dest,
            request.pid,
            request.comm,
            request.cmdline,
            request.rule,
            now,
            now + self.timeout,
        )
        for path, other in rest:
            self._pending.join(remainder, path, other)
        return remainder

    def settled(self, grant: Grant) -> list[Request]:
        """Drop the other pending requests that `grant` answers whole (a directory grant
        covers the requests of its subdirectories); those dropped."""
        if grant.once:
            return []
        covered = [
            r
            for r in self._pending.all()
            if all(grant.covers(r.kind, path, dest) for path, dest in r.pairs)
        ]
        for request in covered:
            self._pending.drop(request)
        return covered

    def revoke(self, grant_id: int) -> Grant:
        grant = self._grants.get(grant_id)
        if grant is None:
            raise ApprovalError(f"no grant {grant_id} (see `sandboxfs grants`)")
        self._grants.remove(grant)
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

    def _refused(self, kind: Kind, reason: str, pid: int, comm: str) -> None:
        if kind is Kind.CONNECT:
            return  # run's proxy tells its own refusals
        self.refused_total += 1
        self.refused.append({"seq": self.refused_total, "reason": reason, "pid": pid, "comm": comm})

    def snapshot(self) -> dict[str, Any]:
        """Pending requests and grants, and the last refusals that asked nobody, for the
        control channel."""
        now = self._clock()
        return {
            "mode": self.mode.value,
            "pending": [r.describe(now) for r in self.pending()],
            "grants": [g.describe() for g in self.grants()],
            "refused": list(self.refused),
            "refused_total": self.refused_total,
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
