"""`sandboxfs approvals`, `approve`, `deny` and `grants`: the user's side of consent.

Each talks to one live mount (or run) over its control socket (sandboxfs.control), which only
the mount's owner outside every sandbox may use: a program inside cannot answer its own
requests. Everything a request shows that the program chose (paths, its name and command
line) is printed escaped, so no name can draw a fake prompt or hide part of itself.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from . import control
from .core.approvals import Answer
from .errors import UserError

POLL = 0.3  # seconds between two looks at what is pending

# One key each for the five answers of the prompt.
KEYS: dict[str, Answer] = {
    "y": Answer.ONCE,
    "d": Answer.DIR,
    "a": Answer.EVERYWHERE,
    "n": Answer.DENY,
    "s": Answer.NEVER,
}
_LABELS = {
    Answer.ONCE: "allow once",
    Answer.DIR: "allow this directory for the session",
    Answer.EVERYWHERE: "allow this operation everywhere for the session",
    Answer.DENY: "deny",
    Answer.NEVER: "deny and stop asking (this directory)",
}


def add_parsers(sub: Any, target: Callable[[argparse.ArgumentParser], None]) -> None:
    """The four subcommands; `target` adds the options that choose the mount."""
    approvals = sub.add_parser(
        "approvals",
        help="answer the approval requests of a running mount or run",
        description="Show the operations of a live mount (or run) that wait for your approval, "
        "one at a time, and answer each with one key: y allow once, d allow this directory "
        "for the session, a allow this operation everywhere for the session, n deny, s deny "
        "and stop asking; Enter saves the grant shown, q quits (the request stays pending). "
        "--json prints them as JSON instead; --follow keeps printing new ones.",
    )
    target(approvals)
    approvals.add_argument("--json", action="store_true", help="print JSON, answer nothing")
    approvals.add_argument(
        "--follow", action="store_true", help="with --json: one line per new request, until ^C"
    )
    approve = sub.add_parser("approve", help="allow a pending request (see `approvals`)")
    approve.add_argument("id", type=_request_id, help="the request's number")
    approve.add_argument(
        "--scope",
        choices=["once", "dir", "everywhere"],
        default="once",
        help="once (default); dir: its directory for the session; everywhere: that "
        "operation wherever a rule asks, for the session",
    )
    target(approve)
    approve.add_argument("--json", action="store_true", help="print the daemon's JSON answer")
    deny = sub.add_parser("deny", help="refuse a pending request (see `approvals`)")
    deny.add_argument("id", type=_request_id, help="the request's number")
    deny.add_argument(
        "--stop", action="store_true", help="and refuse it under its directory without asking"
    )
    target(deny)
    deny.add_argument("--json", action="store_true", help="print the daemon's JSON answer")
    grants = sub.add_parser("grants", help="list the session's grants, or revoke one")
    target(grants)
    grants.add_argument("--revoke", type=_request_id, metavar="ID", help="revoke this grant")
    grants.add_argument("--json", action="store_true", help="print JSON")


def _request_id(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 1 << 53:
        raise argparse.ArgumentTypeError(f"expected a request number, got {text!r}")
    return int(text)


def safe(value: Any) -> str:
    """Text the program chose, printable: control, bidi and other unprintable characters and
    backslashes escaped."""
    out = []
    for ch in str(value):
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}")
    return "".join(out)


def _ask(path: Path, message: dict[str, Any]) -> dict[str, Any]:
    answer = control.request(path, message)
    if not answer.get("ok"):
        raise UserError(f"the daemon refused: {answer.get('error')}", exit_code=1)
    return answer


def main(args: argparse.Namespace, path: Path) -> int:
    if args.command == "approve":
        return _answer(args, path, Answer(args.scope))
    if args.command == "deny":
        return _answer(args, path, Answer.NEVER if args.stop else Answer.DENY)
    if args.command == "grants":
        return _grants(args, path)
    if args.follow and not args.json:
        raise UserError("--follow goes with --json (the prompt follows by itself)")
    if args.json:
        return _json(path, args.follow)
    if not sys.stdin.isatty():
        raise UserError(
            "approvals needs a terminal to prompt on; use --json [--follow] to read the "
            "requests, and sandboxfs approve ID / deny ID to answer"
        )
    return prompt(path, sys.stdin.fileno(), sys.stdout)


def _answer(args: argparse.Namespace, path: Path, answer: Answer) -> int:
    reply = _ask(path, {"op": "answer", "id": args.id, "answer": answer.value})
    if args.json:
        print(json.dumps(reply))
    else:
        print(f"request {args.id}: {safe(reply['grant']['text'])} (grant {reply['grant']['id']})")
    return 0


def _grants(args: argparse.Namespace, path: Path) -> int:
    if args.revoke is not None:
        reply = _ask(path, {"op": "revoke", "grant": args.revoke})
        if args.json:
            print(json.dumps(reply))
        else:
            print(f"revoked grant {args.revoke}: {safe(reply['grant']['text'])}")
        return 0
    grants = _ask(path, {"op": "approvals"})["grants"]
    if args.json:
        print(json.dumps(grants))
        return 0
    if not grants:
        print("no grants")
    for grant in grants:
        print(
            f"{grant['id']}: {safe(grant['text'])} (rule {safe(grant['rule'])}, "
            f"request {grant['request']}, by {safe(grant['answered_by'])})"
        )
    return 0


def _json(path: Path, follow: bool) -> int:
    state = _ask(path, {"op": "approvals"})
    if not follow:
        print(json.dumps(state))
        return 0
    seen: set[int] = set()
    while True:
        for request in state["pending"]:
            if request["id"] not in seen:
                seen.add(request["id"])
                print(json.dumps(request), flush=True)
        time.sleep(POLL)
        state = _ask(path, {"op": "approvals"})


def describe(request: dict[str, Any]) -> list[str]:
    """The prompt's lines for one request (everything the program chose escaped)."""
    lines = [
        f"sandboxfs: approval {request['id']} asked by rule {safe(request['rule'])}",
        f"  {request['op']} of {safe(request['path'])}"
        + (f" -> {safe(request['dest'])}" if request.get("dest") else ""),
    ]
    if request["count"] > 1:
        shown = ", ".join(safe(p) for p in request["paths"])
        lines.append(f"  and {request['count'] - 1} more in {safe(request['directory'])} ({shown})")
    lines.append(
        f"  zone {safe(request['zone'])}; process {request['pid']} {safe(request['comm'])}"
    )
    lines.append(f"  command line: {safe(request['cmdline'])}")
    lines.append(f"  rule: {safe(request['rule_text'])}")
    lines.append(f"  expires in {request['expires_in']} s")
    lines.append("  " + "   ".join(f"{key}: {_LABELS[answer]}" for key, answer in KEYS.items()))
    return lines


def prompt(path: Path, fd: int, out: TextIO) -> int:
    """The interactive prompt: one pending request at a time, one key each answer, Enter to
    save the grant shown; q quits."""
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        return _prompt_loop(path, fd, out)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _key(fd: int, timeout: float | None) -> str | None:
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return None
    data = os.read(fd, 1)
    return data.decode("latin-1") if data else "q"


def _prompt_loop(path: Path, fd: int, out: TextIO) -> int:
    waiting_shown = False
    while True:
        pending = _ask(path, {"op": "approvals"})["pending"]
        if not pending:
            if not waiting_shown:
                print("sandboxfs: no request is pending; waiting (q quits)", file=out, flush=True)
                waiting_shown = True
            if _key(fd, POLL) == "q":
                return 0
            continue
        waiting_shown = False
        request = pending[0]
        print("\n".join(describe(request)), file=out, flush=True)
        while True:
            key = _key(fd, None)
            if key == "q":
                return 0
            answer = KEYS.get(key or "")
            if answer is None:
                continue
            grant = request["grants"][answer.value]
            print(
                f"  -> {safe(grant)}: Enter saves it, another key chooses again",
                file=out,
                flush=True,
            )
            if _key(fd, None) not in ("\n", "\r"):
                continue
            reply = control.request(
                path,
                {
                    "op": "answer",
                    "id": request["id"],
                    "answer": answer.value,
                    "channel": "terminal",
                },
            )
            if reply.get("ok"):
                print(f"  saved: grant {reply['grant']['id']}", file=out, flush=True)
            else:
                print(f"  not saved: {safe(reply.get('error'))}", file=out, flush=True)
            break


class RelayPrompt:
    """The prompt inside `sandboxfs run`'s own terminal relay (sandboxfs.run.Supervisor).

    run polls the daemon's control socket from outside the sandbox; while a request is shown,
    the program's output is held back and every key goes to the prompt, never to the program,
    which can neither see nor answer it. Once answered, the relay resumes and the program is
    sent SIGWINCH, so a full-screen program draws its screen again.
    """

    def __init__(self, path: Path, write: Callable[[bytes], None]) -> None:
        self.path = path
        self.write = write
        self.request: dict[str, Any] | None = None
        self.choice: Answer | None = None
        self.next_poll = 0.0
        self.skipped: set[int] = set()  # left with Ctrl-C: not shown here again

    def _say(self, *lines: str) -> None:
        self.write(("\r\n" + "\r\n".join(lines) + "\r\n").encode("utf-8", "replace"))

    def poll(self, now: float) -> bool:
        """Whether a request is shown now (one more look at the daemon every POLL seconds)."""
        if self.request is not None:
            return True
        if now < self.next_poll:
            return False
        self.next_poll = now + POLL
        try:
            reply = control.request(self.path, {"op": "approvals"}, timeout=2.0)
        except UserError:
            return False
        pending = reply.get("pending") if reply.get("ok") else None
        pending = [r for r in pending or [] if r["id"] not in self.skipped]
        if not pending:
            return False
        self.request = pending[0]
        self._say(
            *describe(pending[0]),
            "  (the program waits; its output resumes after this; Ctrl-C leaves it pending)",
        )
        return True

    def key(self, data: bytes) -> bool:
        """Keys typed while a request is shown; True once it is answered, or left with
        Ctrl-C (pending still, answered elsewhere; the Ctrl-C is not passed on)."""
        assert self.request is not None
        for ch in data.decode("latin-1"):
            if ch == "\x03":
                self.skipped.add(self.request["id"])
                self._say(f"  left pending: sandboxfs approve {self.request['id']} answers it")
                self.request, self.choice = None, None
                return True
            if self.choice is None:
                answer = KEYS.get(ch)
                if answer is not None:
                    self.choice = answer
                    grant = self.request["grants"][answer.value]
                    self._say(f"  -> {safe(grant)}: Enter saves it, another key chooses again")
                continue
            if ch not in "\r\n":
                self.choice = None
                keys = "   ".join(f"{k}: {_LABELS[a]}" for k, a in KEYS.items())
                self._say(f"  choose again: {keys}")
                continue
            message = {"op": "answer", "id": self.request["id"], "answer": self.choice.value}
            try:
                reply = control.request(self.path, {**message, "channel": "run"}, timeout=5.0)
            except UserError as exc:
                reply = {"ok": False, "error": exc.message}
            if reply.get("ok"):
                self._say(f"  saved: grant {reply['grant']['id']}")
            else:
                self._say(f"  not saved: {safe(reply.get('error'))}")
            self.request, self.choice = None, None
            return True
        return False
