"""`sandboxfs approvals`, `approve`, `deny` and `grants`: the user's side of consent.

Each talks to one live mount (or run) over its control socket (sandboxfs.project.control),
which only the mount's owner outside every sandbox may use: a program inside cannot answer its own
requests. Everything a request shows that the program chose (paths, its name and command
line) is printed escaped, so no name can draw a fake prompt or hide part of itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxfs.core.approval_grants import Answer
from sandboxfs.errors import UserError
from sandboxfs.project.prompt import POLL, ask, prompt, safe


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
    approvals.add_argument(
        "--list",
        type=_request_id,
        metavar="ID",
        help="print every path request ID holds, and how to allow exactly those",
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
    approve.add_argument(
        "--shown",
        type=_request_id,
        metavar="N",
        help="the number of paths you saw listed (`approvals --list ID`): the answer covers "
        "those, never one that joined after; needed with once when the request holds more "
        "than one",
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


def main(args: argparse.Namespace, path: Path) -> int:
    if args.command == "approve":
        return _answer(args, path, Answer(args.scope), args.shown)
    if args.command == "deny":
        return _answer(args, path, Answer.NEVER if args.stop else Answer.DENY, None)
    if args.command == "grants":
        return _grants(args, path)
    if args.follow and not args.json:
        raise UserError("--follow goes with --json (the prompt follows by itself)")
    if args.list is not None:
        return _list(path, args.list, args.json)
    if args.json:
        return _json(path, args.follow)
    if not sys.stdin.isatty():
        raise UserError(
            "approvals needs a terminal to prompt on; use --json [--follow] to read the "
            "requests, and sandboxfs approve ID / deny ID to answer"
        )
    return prompt(path, sys.stdin.fileno(), sys.stdout)


def _list(path: Path, request_id: int, as_json: bool) -> int:
    """Every path of one request, and the command that allows exactly those."""
    request = ask(path, {"op": "approvals", "id": request_id})["request"]
    if as_json:
        print(json.dumps(request))
        return 0
    print(f"request {request_id}: {request['op']} of {request['shown']} paths:")
    for one, dest in zip(request["paths"], request["dests"], strict=True):
        print(f"  {safe(one)}" + (f" -> {safe(dest)}" if dest is not None else ""))
    print(f"allow exactly these once: sandboxfs approve {request_id} --shown {request['shown']}")
    return 0


def _answer(args: argparse.Namespace, path: Path, answer: Answer, shown: int | None) -> int:
    """An answer from the command line: an allow-once covers the paths the user saw, which
    is the one path a request shows when it holds one, else the --shown of its listing."""
    if answer is Answer.ONCE and shown is None:
        request = ask(path, {"op": "approvals", "id": args.id})["request"]
        if request["shown"] != 1:
            raise UserError(
                f"request {args.id} holds {request['shown']} paths: list them with "
                f"`sandboxfs approvals --list {args.id}`, then allow exactly those with "
                f"`sandboxfs approve {args.id} --shown {request['shown']}`"
            )
        shown = 1
    message = {"op": "answer", "id": args.id, "answer": answer.value, "shown": shown}
    reply = ask(path, message)
    if args.json:
        print(json.dumps(reply))
    else:
        print(f"request {args.id}: {safe(reply['grant']['text'])} (grant {reply['grant']['id']})")
    return 0


def _grants(args: argparse.Namespace, path: Path) -> int:
    if args.revoke is not None:
        reply = ask(path, {"op": "revoke", "grant": args.revoke})
        if args.json:
            print(json.dumps(reply))
        else:
            print(f"revoked grant {args.revoke}: {safe(reply['grant']['text'])}")
        return 0
    grants = ask(path, {"op": "approvals"})["grants"]
    if args.json:
        print(json.dumps(grants))
        return 0
    if not grants:
        print("no grants")
    for grant in grants:
        moved = grant.get("moved_in", 0)
        left_out = f"; not the {moved} entries moved in since" if moved else ""
        print(
            f"{grant['id']}: {safe(grant['text'])} (rule {safe(grant['rule'])}, "
            f"request {grant['request']}, by {safe(grant['answered_by'])}{left_out})"
        )
    return 0


def _json(path: Path, follow: bool) -> int:
    state = ask(path, {"op": "approvals"})
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
        state = ask(path, {"op": "approvals"})
