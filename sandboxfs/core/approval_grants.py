"""Grants: what the user's answers leave behind for the session, and the index that finds the
one deciding an operation.

An answer allows or refuses one kind of operation: once for the paths the user was shown
(ONCE, DENY), under the request's directory (DIR, NEVER) or wherever a rule asks
(EVERYWHERE). A refusal decides before an allowance. Lookups walk the path's directories, so
they cost the path's depth, never the number of grants.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .approval_rules import Kind


class Answer(StrEnum):
    ONCE = "once"  # allow this request (each path it groups) once
    DIR = "dir"  # allow this kind under the request's directory, for the session
    EVERYWHERE = "everywhere"  # allow this kind wherever a rule asks, for the session
    DENY = "deny"  # refuse this request (each path's next try)
    NEVER = "never"  # deny, and refuse this kind under the directory without asking again


ALLOWS = frozenset({Answer.ONCE, Answer.DIR, Answer.EVERYWHERE})


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


class GrantIndex:
    """The grants of one session, indexed so a lookup walks the path's depth, never every
    grant: ONCE and DENY by path, DIR and NEVER by directory, EVERYWHERE by kind; and, for
    each directory, how many of the first two are below it (`moved` looks there only then)."""

    def __init__(self) -> None:
        self._grants: dict[int, Grant] = {}
        self._by_once_path: dict[str, list[Grant]] = {}
        self._by_directory: dict[str, list[Grant]] = {}
        self._everywhere: dict[Kind, list[Grant]] = {}
        self._below: dict[str, int] = {}
        self._once_paths = 0
        self._next_grant = 1

    def __len__(self) -> int:
        return len(self._grants)

    @property
    def once_paths(self) -> int:
        """The paths the ONCE and DENY grants hold, all together."""
        return self._once_paths

    def get(self, grant_id: int) -> Grant | None:
        return self._grants.get(grant_id)

    def listed(self) -> list[Grant]:
        return sorted(self._grants.values(), key=lambda g: g.id)

    def add(
        self,
        answer: Answer,
        kind: Kind,
        rule: str,
        request: int,
        who: str,
        directory: str | None,
        pairs: set[tuple[str, str | None]],
    ) -> Grant:
        """A new grant, the next number, indexed."""
        grant = Grant(
            self._next_grant, answer in ALLOWS, kind, answer, rule, request, who, directory, pairs
        )
        self._next_grant += 1
        self._index(grant)
        return grant

    def remove(self, grant: Grant) -> None:
        """A revoked grant decides nothing from now on."""
        self._unindex(grant)

    def find(self, kind: Kind, path: str, dest: str | None = None) -> Grant | None:
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

    def use_once(self, grant: Grant, pair: tuple[str, str | None]) -> None:
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

    def moved(self, src: str, dst: str, max_moved_in: int) -> list[Grant]:
        """An allowed rename moved `src` (and what is below it) to `dst`: what a grant covered
        there before is gone, and what was moved in is not what the user allowed. Each
        directory grant that covers `dst` but did not cover `src` leaves it out; a once-grant
        at or below `dst` is dropped; a directory grant whose directory is below `dst` (its
        directory is what was moved in) is withdrawn. The grants withdrawn (a directory grant
        past `max_moved_in` is too), for the audit log."""
        withdrawn = self._leave_out(src, dst, max_moved_in)
        if not self._below.get(dst) and dst not in self._by_once_path:
            return withdrawn
        self._drop_once_below(dst)
        return withdrawn + self._withdraw_below(dst)

    def _leave_out(self, src: str, dst: str, max_moved_in: int) -> list[Grant]:
        """Each directory grant over `dst` that did not cover `src` leaves `dst` out; those
        past `max_moved_in` are withdrawn (returned)."""
        withdrawn: list[Grant] = []
        for directory in ancestors(dst):
            for grant in list(self._by_directory.get(directory, ())):
                if not grant.allow or grant.covers(grant.kind, src):
                    continue
                if grant.covers(grant.kind, dst):
                    grant.moved_in.add(dst)
                    if len(grant.moved_in) > max_moved_in:
                        self._unindex(grant)
                        withdrawn.append(grant)
        return withdrawn

    def _drop_once_below(self, dst: str) -> None:
        """Each once-grant's path at or below `dst` is used up: it is not what was shown."""
        for path in [p for p in self._by_once_path if _under(p, dst)]:
            for grant in list(self._by_once_path.get(path, ())):
                for pair in [pair for pair in grant.pairs if pair[0] == path]:
                    self.use_once(grant, pair)

    def _withdraw_below(self, dst: str) -> list[Grant]:
        """Withdraw the directory allowances whose directory is below `dst` (moved in)."""
        withdrawn: list[Grant] = []
        for directory in [d for d in self._by_directory if d != dst and _under(d, dst)]:
            for grant in list(self._by_directory[directory]):
                if grant.allow:
                    self._unindex(grant)
                    withdrawn.append(grant)
        return withdrawn
