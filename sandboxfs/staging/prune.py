"""Pruning a workspace's staged commits (`sandboxfs staged prune`).

What accumulates: each staged commit's files in the /staged zone (`staged/<id>/`, kept after a
commit), and its review (`review/<id>/`: state.json, the frozen snapshot, the lock), kept after
a commit or a discard. Pruning removes both for the committed and discarded ones finished
longer ago than a duration, and, only when asked (`pending=True`), for the pending ones whose
last change is that old. Each is audited (op `stage`, detail `prune ...`) before anything goes.

Order matters: a pending one is marked discarded first (its state.json makes the mount refuse
changes below /staged/<id>), the files in /staged go next, and the review last: a review removed
first would let the files left in /staged look like a new pending commit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sandboxfs.project.state import format_size, move_to_trash, remove_tree, usage

from ..errors import SandboxfsError
from .land import record
from .review import Review, Workspace, iso


@dataclass
class Prunable:
    commit_id: str
    status: str  # committed, discarded, or pending
    when: datetime  # when it was committed or discarded; for a pending one, its last change
    session: str | None
    bytes: int  # its files in /staged and its review, on disk

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.commit_id,
            "status": self.status,
            "when": iso(self.when),
            "session": self.session,
            "bytes": self.bytes,
        }


def candidates(ws: Workspace) -> list[Prunable]:
    """Every staged commit of the workspace, with what pruning it would free."""
    ids, _ = ws.listing(skip_unreadable=True)
    found = []
    for commit_id in ids:
        try:
            state = ws.read_state(commit_id)
        except (OSError, SandboxfsError):
            continue  # unreadable: `staged list` says why; never pruned blindly
        review = Review(commit_id, None, state or {}, False)
        files, kept = usage(ws.staged / commit_id), usage(ws.review / commit_id)
        found.append(
            Prunable(
                commit_id,
                review.status,
                _when(review, max(files.newest, kept.newest)),
                review.session,
                files.bytes + kept.bytes,
            )
        )
    return found


def _when(review: Review, changed: float) -> datetime:
    key = {"committed": "committed_at", "discarded": "discarded_at"}.get(review.status)
    stamp = review.state.get(key) if key else None
    if isinstance(stamp, str):
        try:
            return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            pass
    return datetime.fromtimestamp(changed, UTC)


def select(
    found: list[Prunable], older_than: timedelta, now: datetime, pending: bool
) -> tuple[list[Prunable], list[Prunable]]:
    """(the ones to prune: finished, or with `pending` also pending, before now - older_than;
    the pending ones that old that are kept because `pending` is not set)."""
    old = [p for p in found if p.when < now - older_than]
    chosen = [p for p in old if pending or p.status != "pending"]
    return chosen, [p for p in old if not pending and p.status == "pending"]


def prune(ws: Workspace, item: Prunable, older_than: timedelta) -> str | None:
    """Remove one staged commit's files and review, checked again under its lock (it may have
    changed since it was listed); None when done, else why not (nothing removed, or what could
    not be)."""
    with ws.locked(item.commit_id):
        state = ws.read_state(item.commit_id)
        review = Review(item.commit_id, None, state or {}, False)
        files, kept = usage(ws.staged / item.commit_id), usage(ws.review / item.commit_id)
        when = _when(review, max(files.newest, kept.newest))
        if review.status != item.status or when >= datetime.now(UTC) - older_than:
            return "it changed since it was listed; nothing removed"
        if review.status == "pending":
            marked = dict(state or {"id": item.commit_id})
            marked.update(status="discarded", discarded_at=iso(datetime.now(UTC)))
            ws.write_state(item.commit_id, marked)  # the mount refuses changes from here on
        detail = f"prune ({review.status} {iso(when)}, {format_size(files.bytes + kept.bytes)})"
        record(ws, item.commit_id, review.session, detail)
        # Renamed away first (never following a link), deleted after: the files, then the review
        trash = [
            move_to_trash(ws.project, path)
            for path in (ws.staged / item.commit_id, ws.review / item.commit_id)
            if os.path.lexists(path)
        ]
    problems = [problem for path in trash if (problem := remove_tree(path)) is not None]
    return problems[0] if problems else None
