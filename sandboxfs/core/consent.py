"""The approval step of the guard: every operation the other checks allowed goes through
`Consent.check` last, for the mount and the API alike (rules, requests and grants: see
sandboxfs.core.approvals, which this applies to callers and writes into the audit log).

The guard calls it at one place per kind of operation (open, setattr, create, link, delete,
rename); the control channel answers and revokes through it; the API's approver answers here
directly. Nothing here waits: an `ask` without a grant is refused at once, naming the request.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, TypedDict

from .approval_grants import Answer, Grant
from .approval_requests import Request
from .approval_rules import NET, Kind, Verdict
from .approvals import Broker, Outcome
from .entry import AuditOp
from .errors import SandboxError
from .policy import Decision, Op, Rule, Zone, in_git_dir

if TYPE_CHECKING:
    from .rulebase import Caller

# The Python API's own prompt (Sandbox.open(approver=...)): a pending request's description in,
# an approvals.Answer value out (None: no answer, refused).
Approver = Callable[[dict[str, Any]], str | None]


class Consent:
    """The approvals of one guard: its broker (None: no approvals), the API's approver, and
    the grants handles were opened under."""

    def __init__(
        self,
        record: Callable[Concatenate[AuditOp | Op, ...], None],
        refuse: Callable[..., SandboxError],
        trust: Callable[[], str],
        comm: Callable[[int], str | None],
        revoked: Callable[[], None],
        git_dirs: Callable[[], frozenset[Zone]] = frozenset,
        process: Callable[[int], int] = lambda pid: pid,
    ) -> None:
        self._record = record  # Guard.record
        self._refuse = refuse  # Guard.refuse
        self._trust = trust
        self._comm = comm
        # The process (thread group) of a thread: FUSE names the calling thread, and requests
        # are grouped per process (20 threads of one program deleting make one request).
        self._process = process
        self._revoked = revoked  # open handles are to be checked again
        self.git_dirs = git_dirs  # zones that are git directories (the policy's)
        self.broker: Broker | None = None
        self.approver: Approver | None = None
        # The grant that allowed the last operation `check` judged (None: none did), for a
        # handle to remember; and the grants revoked since, which such handles lose.
        self.last_grant: int | None = None
        self.revoked_grants: set[int] = set()
        self.probing = False  # answering a permission probe: decide, ask nobody, change nothing

    @property
    def active(self) -> bool:
        """Whether any approval rule exists here: callers skip building the arguments of
        `check` (a virtual path is a walk up the tree) on mounts without rules."""
        return self.broker is not None and bool(self.broker.rules)

    def _git_bookkeeping(self, zone: Zone, path: str) -> bool:
        """Whether `path` is inside a git directory (`.git/...`, or a zone that is one: a
        worktree's main git dir). Git's own files are not the user's work, and every git
        command locks, renames and deletes them (index.lock -> index): asking there would
        stop git half-way and leave a stale lock in the user's repository. What in a git
        directory runs code or may not change is judged before this (protected paths, git
        config)."""
        if zone in self.git_dirs():
            return True
        relpath = path.removeprefix(f"/{zone.value}").lstrip("/")
        return in_git_dir(relpath)

    def probe(self, refuse: Callable[..., SandboxError]) -> Consent:
        """This consent as a permission probe sees it (sandboxfs.core.gate.without_effect):
        the same rules and grants, judged without making, joining or answering a request and
        without an audit entry (`refuse`: the probe's own guard's)."""
        copy = Consent(
            lambda *a, **k: None,
            refuse,
            self._trust,
            self._comm,
            lambda: None,
            self.git_dirs,
            self._process,
        )
        copy.broker, copy.revoked_grants, copy.probing = self.broker, self.revoked_grants, True
        return copy

    def check(
        self,
        caller: Caller,
        kinds: list[Kind],
        zone: Zone,
        path: str,
        op: AuditOp | Op,
        dest: str | None = None,
        *,
        exclusions: bool = True,
    ) -> None:
        """The approval rules for an operation every other check allowed: returns (allowed)
        or audits the refusal, or the new pending request and the refusal naming it.
        `exclusions` False: no rule's exclude patterns apply (a file with other names)."""
        self.last_grant = None
        broker = self.broker
        if broker is None or not broker.rules or not kinds or self._git_bookkeeping(zone, path):
            return
        if self.probing:
            outcome = broker.verdict(self._trust(), zone.value, kinds, path, dest, exclusions)
            if outcome.allowed:
                return
            decision = Decision(False, errno.EACCES, outcome.reason, Rule.APPROVAL)
            raise self._refusal(caller, op, path, zone, decision, dest)
        self.tidy()
        outcome = self._consult(broker, caller, kinds, zone, path, dest, exclusions)
        if outcome.request is not None and outcome.new:
            self._entry(outcome.request, "asks the user", None)
            if self.approver is not None:  # the API's own prompt answers at once
                given = outcome.request.describe(0)
                answer = self.approver(given)
                try:
                    choice = Answer(answer) if answer is not None else Answer.DENY
                except ValueError:
                    choice = Answer.DENY
                request = outcome.request.id
                who = "the API's approver"
                self.answer(request, choice, who, caller.pid, caller.uid, given["shown"])
                outcome = self._consult(broker, caller, kinds, zone, path, dest, exclusions)
        if outcome.allowed:
            if outcome.grant is not None or outcome.unasked:
                self._use(caller, outcome, zone, path, dest)
            self.last_grant = outcome.grant.id if outcome.grant is not None else None
            return
        if outcome.limited:
            self._use(caller, outcome, zone, path, dest)
        decision = Decision(False, errno.EACCES, outcome.reason, Rule.APPROVAL)
        raise self._refusal(caller, op, path, zone, decision, dest)

    def _refusal(
        self,
        caller: Caller,
        op: AuditOp | Op,
        path: str,
        zone: Zone,
        decision: Decision,
        dest: str | None,
    ) -> SandboxError:
        """The audited refusal. A link is judged by its new name (`path`) with its source as
        the other end (`dest`), but audited as every other link entry: source, then new name."""
        if op is AuditOp.LINK and dest is not None:
            path, dest = dest, path
        return self._refuse(caller, op, path, zone, decision, dest=dest)

    def _consult(
        self,
        broker: Broker,
        caller: Caller,
        kinds: list[Kind],
        zone: Zone,
        path: str,
        dest: str | None,
        exclusions: bool = True,
    ) -> Outcome:
        pid = self._process(caller.pid)
        return broker.consult(
            self._trust(),
            zone.value,
            kinds,
            path,
            pid=pid,
            comm=self._comm(pid) or "",
            cmdline=lambda: read_cmdline(pid),
            dest=dest,
            exclusions=exclusions,
        )

    def connect(self, target: str, pid: int, uid: int) -> tuple[bool, str, int | None]:
        """A host (HOST:PORT) not on `run`'s allowlist: (allowed, reason, the pending request).
        Only an `ask` rule for connect can admit it, by the user's answer; anything else
        (no rule, preApproved, blocked, --no-approvals) leaves it refused, as without rules:
        approvals never widen what the network allows on their own."""
        broker = self.broker
        if broker is None:
            return False, "", None
        self.tidy()
        caller = _Asker(pid, uid)
        outcome = self._consult(broker, caller, [Kind.CONNECT], Zone(NET), target, None)
        if outcome.rule.verdict is not Verdict.ASK or outcome.unasked:
            return False, "", None
        if outcome.request is not None and outcome.new:
            self._entry(outcome.request, "asks the user", None)
        if outcome.grant is not None or outcome.limited:
            self._use(caller, outcome, Zone(NET), target, None)
        request = outcome.request.id if outcome.request is not None else None
        return outcome.allowed, outcome.reason, request

    def answer(
        self,
        request_id: int,
        answer: Answer,
        who: str,
        pid: int,
        uid: int,
        shown: int | None = None,
    ) -> Grant:
        """The user's answer to a pending request (ApprovalError: none such, or not what was
        shown), audited; the grant it made. `shown`: see Broker.answer; the paths that joined
        after it stay pending as a new request, audited as asking."""
        assert self.broker is not None
        request, grant, remainder = self.broker.answer(request_id, answer, who, shown)
        self._record(
            AuditOp.APPROVAL,
            request.path,
            Zone(request.zone),
            pid=pid,
            uid=uid,
            allowed=grant.allow,
            **_said(
                grant.allow,
                f"request {request.id} answered {answer.value}: {grant.describe()['text']}",
            ),
            dest=request.dest,
            extra={
                "approval": {
                    "request": request.id,
                    "answer": answer.value,
                    "rule": request.rule.id,
                    "scope": answer.value,
                    "grant": grant.id,
                    "by": who,
                    "count": request.count,
                    "shown": shown,
                    "op": request.kind.value,
                    **({"remainder": remainder.id} if remainder is not None else {}),
                }
            },
        )
        if remainder is not None:
            self._entry(remainder, f"joined request {request.id} after it was shown; asks", None)
        for other in self.broker.settled(grant):
            self._entry(other, f"answered by grant {grant.id}", grant.allow)
        return grant

    def revoke(self, grant_id: int, who: str, pid: int, uid: int) -> Grant:
        """Revoke a grant (ApprovalError: none such), audited."""
        assert self.broker is not None
        grant = self.broker.revoke(grant_id)
        self.revoked_grants.add(grant.id)
        self._revoked()  # open handles are checked again (Guard.may_keep)
        self._record(
            AuditOp.APPROVAL,
            grant.directory,
            None,
            pid=pid,
            uid=uid,
            allowed=None,
            detail=f"grant {grant.id} revoked: {grant.describe()['text']}",
            extra={"approval": {"grant": grant.id, "answer": "revoke", "by": who}},
        )
        return grant

    def moved(self, src: str, dst: str, pid: int, uid: int) -> None:
        """An allowed rename moved `src` to `dst`: the grants no longer cover what was moved
        in (Broker.moved); a grant that is withdrawn for it is audited."""
        if self.broker is None or self.probing:
            return
        for grant in self.broker.moved(src, dst):
            self.revoked_grants.add(grant.id)
            self._revoked()
            self._record(
                AuditOp.APPROVAL,
                grant.directory,
                None,
                pid=pid,
                uid=uid,
                allowed=None,
                detail=f"grant {grant.id} withdrawn: {dst} was moved in from {src}, which it "
                f"did not cover: {grant.describe()['text']}",
                extra={"approval": {"grant": grant.id, "answer": "withdrawn"}},
            )

    def tidy(self) -> None:
        """Drop, audited, the requests nobody answered in time. (Not those of processes that
        are gone: the process refused at once is gone by the time the user answers, and its
        retry, often by another process, is what the answer is for.)"""
        if self.broker is None:
            return
        for request in self.broker.expire():
            self._entry(request, "timed out: nobody answered", False)

    def _entry(self, request: Request, what: str, allowed: bool | None) -> None:
        more = f" and {request.count - 1} more" if request.count > 1 else ""
        self._record(
            AuditOp.APPROVAL,
            request.path,
            Zone(request.zone),
            pid=request.pid,
            uid=0,
            comm=request.comm,
            allowed=allowed,
            **_said(
                allowed,
                f"request {request.id}: {request.kind.value} of {request.path}{more} {what} "
                f"(rule {request.rule.id})",
            ),
            dest=request.dest,
            extra={
                "approval": {
                    "request": request.id,
                    "rule": request.rule.id,
                    "op": request.kind.value,
                    "count": request.count,
                    "cmdline": request.cmdline,
                }
            },
        )

    def _use(
        self, caller: Caller, outcome: Outcome, zone: Zone, path: str, dest: str | None
    ) -> None:
        """An operation a grant (or --no-approvals, or the rate limit) decided."""
        fields: dict[str, Any] = {"rule": outcome.rule.id}
        if outcome.grant is not None:
            fields["grant"] = outcome.grant.id
            fields["request"] = outcome.grant.request
        if outcome.unasked:
            fields["answer"] = "no-approvals"
        if outcome.limited:
            fields["answer"] = "rate-limited"
        self._record(
            AuditOp.APPROVAL,
            path,
            zone,
            pid=caller.pid,
            uid=caller.uid,
            allowed=outcome.allowed,
            **_said(outcome.allowed, outcome.reason),
            dest=dest,
            extra={"approval": fields},
        )


@dataclass(frozen=True, slots=True)
class _Asker:
    """A caller known by its pid (the process behind a proxied connection)."""

    pid: int
    uid: int
    gid: int = 0


class _Said(TypedDict, total=False):
    reason: str
    detail: str


def _said(allowed: bool | None, text: str) -> _Said:
    """An approval entry's text: the reason of a refusal, else its detail (what the audit
    table shows of an entry that is not a refusal)."""
    return {"reason": text} if allowed is False else {"detail": text}


def read_cmdline(pid: int) -> str:
    """The command line of pid, for an approval prompt (empty when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return ""
    return " ".join(arg.decode("utf-8", "replace") for arg in raw.rstrip(b"\0").split(b"\0"))
