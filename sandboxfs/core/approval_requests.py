"""Pending requests: the operations waiting for the user's answer.

Requests of one rule, process and directory that arrive while one is pending become that one
request (a count and the first paths); a retry of a path already held, by any process, finds
its request by kind, path and other end. A request nobody answers in time is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .approval_grants import ALLOWS, Answer, grant_text, shown_as
from .approval_rules import Kind, Rule


def parent_of(path: str, kind: Kind | None = None) -> str:
    if kind is Kind.CONNECT:
        return path
    head = path.rstrip("/").rpartition("/")[0]
    return head or "/"


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


def preview(request: Request, answer: Answer) -> str:
    directory = request.directory if answer in (Answer.DIR, Answer.NEVER) else None
    shown = [shown_as(path, dest) for path, dest in request.pairs]
    return grant_text(answer in ALLOWS, answer, request.kind, directory, shown)


def request_size(path: str, dest: str | None) -> int:
    """What one path of a request holds, about (bounded: Broker.MAX_REQUEST_BYTES)."""
    return len(path) + len(dest or "") + 64


class PendingRequests:
    """The pending requests of one session, by number, by what groups them (rule, kind,
    process, directory) and by each path they hold (a retry, by any process)."""

    def __init__(self) -> None:
        self._pending: dict[int, Request] = {}
        self._by_key: dict[tuple[str, Kind, int, str], Request] = {}
        # A retry, by any process: by kind, path and the other end.
        self._by_path: dict[tuple[Kind, str, str | None], Request] = {}
        self._next_request = 1

    def get(self, request_id: int) -> Request | None:
        return self._pending.get(request_id)

    def all(self) -> Iterable[Request]:
        """Every pending request, oldest first."""
        return self._pending.values()

    def listed(self) -> list[Request]:
        return sorted(self._pending.values(), key=lambda r: r.id)

    def holding(self, kind: Kind, path: str, dest: str | None) -> Request | None:
        """The request that holds this path already (its retry)."""
        return self._by_path.get((kind, path, dest))

    def grouping(self, key: tuple[str, Kind, int, str]) -> Request | None:
        """The request a new path of this rule, kind, process and directory joins."""
        return self._by_key.get(key)

    def new(
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
        expires: float,
    ) -> Request:
        """A new pending request, holding no path yet (see join)."""
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
            expires,
            count=0,
        )
        self._next_request += 1
        self._pending[request.id] = request
        self._by_key[request.key] = request
        return request

    def join(self, request: Request, path: str, dest: str | None) -> None:
        request.paths.append(path)
        request.dests.append(dest)
        request.count = len(request.paths)
        request.size += request_size(path, dest)
        self._by_path[(request.kind, path, dest)] = request

    def drop(self, request: Request) -> None:
        self._pending.pop(request.id, None)
        if self._by_key.get(request.key) is request:
            del self._by_key[request.key]
        for path, dest in request.pairs:
            if self._by_path.get((request.kind, path, dest)) is request:
                del self._by_path[(request.kind, path, dest)]

    def expire(self, now: float) -> list[Request]:
        """Drop the requests nobody answered by `now`; those dropped."""
        gone = [r for r in self._pending.values() if r.expires <= now]
        for request in gone:
            self.drop(request)
        return gone
