"""Showing approval requests on the user's terminal and reading the answer: the prompt of
`sandboxfs approvals` and the one `sandboxfs run` shows in its own terminal.

Requests come over a mount's control socket (sandboxfs.project.control), which only the mount's
owner outside every sandbox may use: a program inside cannot answer its own requests.
Everything a request shows that the program chose (paths, its name and command line) is printed
escaped, so no name can draw a fake prompt or hide part of itself.
"""

from __future__ import annotations

import os
import select
import termios
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from sandboxfs.core.approvals import Answer
from sandboxfs.errors import Failure, SandboxfsError
from sandboxfs.project import control

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


def ask(path: Path, message: dict[str, Any]) -> dict[str, Any]:
    answer = control.request(path, message)
    if not answer.get("ok"):
        raise Failure(f"the daemon refused: {answer.get('error')}")
    return answer


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
        pending = ask(path, {"op": "approvals"})["pending"]
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
                    "shown": request["shown"],
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

    def __init__(
        self,
        path: Path,
        write: Callable[[bytes], None],
        children: Callable[[], list[tuple[Path, str]]] = list,
    ) -> None:
        self.path = path
        self.write = write
        # The control sockets of child workers started inside this run (sandboxfs.run.nest),
        # each with its label: their requests are asked here too, labelled.
        self.children = children
        self.source: tuple[Path, str] = (path, "")  # where the shown request came from
        self.request: dict[str, Any] | None = None
        self.choice: Answer | None = None
        self.next_poll = 0.0
        self.skipped: set[tuple[str, int]] = set()  # left with Ctrl-C: not shown here again

    def _say(self, *lines: str) -> None:
        self.write(("\r\n" + "\r\n".join(lines) + "\r\n").encode("utf-8", "replace"))

    def poll(self, now: float) -> bool:
        """Whether a request is shown now (one more look at the daemon every POLL seconds)."""
        if self.request is not None:
            return True
        if now < self.next_poll:
            return False
        self.next_poll = now + POLL
        for source in [(self.path, ""), *self.children()]:
            path = source[0]
            try:
                reply = control.request(path, {"op": "approvals"}, timeout=2.0)
            except SandboxfsError:
                continue
            pending = reply.get("pending") if reply.get("ok") else None
            pending = [r for r in pending or [] if (str(path), r["id"]) not in self.skipped]
            if pending:
                break
        else:
            return False
        self.request, self.source = pending[0], source
        label = source[1]
        self._say(
            *([f"sandboxfs: from {safe(label)}"] if label else []),
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
                self.skipped.add((str(self.source[0]), self.request["id"]))
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
            message = {
                "op": "answer",
                "id": self.request["id"],
                "answer": self.choice.value,
                "shown": self.request["shown"],
            }
            try:
                reply = control.request(self.source[0], {**message, "channel": "run"}, timeout=5.0)
            except SandboxfsError as exc:
                reply = {"ok": False, "error": exc.message}
            if reply.get("ok"):
                self._say(f"  saved: grant {reply['grant']['id']}")
            else:
                self._say(f"  not saved: {safe(reply.get('error'))}")
            self.request, self.choice = None, None
            return True
        return False
