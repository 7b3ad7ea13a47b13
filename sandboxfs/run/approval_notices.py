"""A run without a prompt of its own (stdin or stderr not its terminal) tells on its stderr, one
line each, what the approval rules did that the program cannot say: a request waiting for the
user (refused meanwhile, and the command that answers it), and a refusal that asked nobody
(blocked, or `--approvals none`, the default without a terminal). Without it, the program
shows only "Permission denied"."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxfs.errors import SandboxfsError
from sandboxfs.project import control
from sandboxfs.project.prompt import POLL, clip, safe

PATH_SHOWN = 300  # characters of a path (the program chose it) a notice shows at most
MAX_TOLD = 10_000  # requests remembered as told; past it, no more notices (memory is bounded)
REFUSALS_TOLD = 20  # refusals told one by one; the rest are counted in one last line


def notice(request: dict[str, Any]) -> str:
    """One request as one line (everything the program chose escaped and bounded)."""
    rid = request.get("id")
    what = f"{safe(request.get('op'))} of {clip(safe(request.get('path')), PATH_SHOWN)}"
    if request.get("dest"):
        what += f" -> {clip(safe(request['dest']), PATH_SHOWN)}"
    count = request.get("count")
    if isinstance(count, int) and count > 1:
        what += f" and {count - 1} more"
    who = f"{clip(safe(request.get('comm')), 64)}[{safe(request.get('pid'))}]"
    return (
        f"approval {rid} needed: {what} by {who} (rule {clip(safe(request.get('rule')), 64)}); "
        f"it was refused meanwhile: answer with 'sandboxfs approve {rid}' or "
        f"'sandboxfs deny {rid}' from another terminal within {safe(request.get('expires_in'))} s,"
        f" then try again"
    )


def refusal_notice(refusal: dict[str, Any]) -> str:
    """A refusal that asked nobody, as one line (the reason names the rule and why)."""
    who = f"{clip(safe(refusal.get('comm')), 64)}[{safe(refusal.get('pid'))}]"
    return f"refused {who}: {clip(safe(refusal.get('reason')), 2 * PATH_SHOWN)}"


class ApprovalNotices:
    """Looks at the run's daemon every POLL seconds, in a thread, and tells each new pending
    request once through `line` (run's held stderr lines)."""

    def __init__(self, path: Path, line: Callable[[str], None]) -> None:
        self._path = path
        self._line = line
        self._told: set[object] = set()
        self._refused_seen = 0  # the number of the last refusal looked at
        self._refusals_told = 0
        self._refused_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="sandboxfs-approval-notices", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL):
            self.poll()

    def poll(self) -> None:
        try:
            reply = control.request(self._path, {"op": "approvals"}, timeout=2.0)
        except SandboxfsError:
            return  # the daemon is gone or busy: the next look tells what is still pending
        if not reply.get("ok"):
            return
        for request in reply.get("pending") or []:
            rid = request.get("id")
            if rid in self._told or len(self._told) >= MAX_TOLD:
                continue
            self._told.add(rid)
            self._line(notice(request))
        for refusal in reply.get("refused") or []:
            seq = refusal.get("seq")
            if not isinstance(seq, int) or seq <= self._refused_seen:
                continue
            self._refused_seen = seq
            if self._refusals_told < REFUSALS_TOLD:
                self._refusals_told += 1
                self._line(refusal_notice(refusal))
        total = reply.get("refused_total")
        if isinstance(total, int):
            self._refused_total = total

    def close(self) -> None:
        """Stop looking, after one last look (a request made just before the program ended)."""
        self._stop.set()
        self._thread.join(timeout=3)
        if not self._thread.is_alive():
            self.poll()
        untold = self._refused_total - self._refusals_told
        if untold > 0 and self._refusals_told >= REFUSALS_TOLD:
            self._line(
                f"{untold} more operations refused by approval rules: "
                f"'sandboxfs audit --denied' lists them"
            )
