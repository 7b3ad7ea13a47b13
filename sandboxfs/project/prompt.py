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
import time
import tty
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from sandboxfs.core.approval_grants import Answer
from sandboxfs.errors import Failure, SandboxfsError
from sandboxfs.project import control

POLL = 0.3  # seconds between two looks at what is pending (and whether the shown one still is)
CMDLINE_SHOWN = 300  # characters of the program's command line a prompt shows at most

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


def clip(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, saying how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


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
    lines.append(f"  command line: {clip(safe(request['cmdline']), CMDLINE_SHOWN)}")
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
        answer: Answer | None = None
        while True:
            key = _key(fd, POLL)
            if key is None:  # nothing typed: is what is shown still what is pending?
                if _still_shown(path, request):
                    continue
                print(f"  approval {request['id']}: {GONE}", file=out, flush=True)
                break
            if key == "q":
                return 0
            if answer is None or key not in ("\n", "\r"):
                answer = KEYS.get(key)
                if answer is not None:
                    grant = request["grants"][answer.value]
                    print(
                        f"  -> {safe(grant)}: Enter saves it, another key chooses again",
                        file=out,
                        flush=True,
                    )
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


GONE = "no longer pending (answered elsewhere, expired or withdrawn)"


def _still_shown(path: Path, request: dict[str, Any]) -> bool:
    """Whether `request` is pending still, as it was shown (no path joined it since)."""
    try:
        reply = control.request(path, {"op": "approvals"}, timeout=2.0)
    except SandboxfsError:
        return True  # the daemon is busy or gone: an answer then fails and says so
    if not reply.get("ok"):
        return True
    for pending in reply.get("pending") or []:
        if pending.get("id") == request["id"]:
            return bool(pending.get("shown") == request["shown"])
    return False


# ----- the prompt in `sandboxfs run`'s own terminal ----------------------------------------------

# Drawn on a screen of sandboxfs's own, in a state it sets, whatever the program left: whatever
# string or sequence the program had started is cancelled (CAN, then ST), the alternate screen
# saves the program's cursor and attributes and gives a clean page, and a soft reset plus the
# modes spelled out undo what could hide or move text (attributes such as concealed, colours and
# palette, scrolling region, origin mode, charset, insert mode, reverse video, hidden cursor).
ENTER = (
    b"\x18\x1b\\"  # CAN, ST: any escape sequence or string in progress ends here
    b"\x1b[?1049h"  # the alternate screen (the program's cursor and attributes saved)
    b"\x1b[!p"  # soft reset
    b"\x1b[0m\x1b[r\x1b[?6l\x1b(B\x0f\x1b[4l\x1b[?5l\x1b[?7h\x1b[?25h"
    b"\x1b]104\x07\x1b]110\x07\x1b]111\x07"  # palette and default colours: the terminal's own
)
CLEAR = b"\x1b[H\x1b[2J"
LEAVE = b"\x1b[0m\x1b[2J\x1b[?1049l"  # back to the program's screen, its cursor restored
LEAVE_TO_ALTERNATE = LEAVE + b"\x1b[?1049h"  # a full-screen program's page, redrawn on SIGWINCH
BANNER = "sandboxfs approval (the program is paused; this screen is sandboxfs's own)"
GRACE = 0.5  # seconds after a prompt is drawn in which keys are typed-ahead, not answers
QUIET = 1.0  # a choice key counts only after this long without any key (not mid-sentence)
CONFIRM_AFTER = 0.3  # and its Enter only this long after it


def width(text: str) -> int:
    """Columns `text` takes on a terminal (wide characters two, combining ones none)."""
    return sum(_columns(ch) for ch in text)


def _columns(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def fit(text: str, cols: int, lines: int = 1) -> list[str]:
    """`text` cut into at most `lines` rows of at most `cols` columns; "..." where cut short.
    At most 8 combining characters follow one character (no stack hides a row)."""
    rows: list[str] = []
    row, used, stacked = "", 0, 0
    for ch in text:
        cells = _columns(ch)
        stacked = stacked + 1 if cells == 0 else 0
        if stacked > 8:
            continue
        if used + cells > cols:
            rows.append(row)
            if len(rows) == lines:
                break
            row, used = "", 0
        row, used = row + ch, used + cells
    else:
        rows.append(row)
        return rows
    last = rows[-1]
    while last and width(last) > cols - 3:
        last = last[:-1]
    rows[-1] = last + "..."
    return rows


def layout(
    request: dict[str, Any], rows: int, cols: int, label: str = "", status: str = ""
) -> list[str]:
    """The prompt's rows for a terminal of `rows` x `cols`: everything the program chose
    escaped and clipped, and whatever the size, the operation and the keys always shown (the
    details give way first)."""
    cols = max(cols, 20)
    op = f"{request['op']} of {safe(request['path'])}"
    if request.get("dest"):
        op += f" -> {safe(request['dest'])}"
    head = fit(BANNER, cols)
    if label:
        head += fit(f"from {safe(label)}", cols)
    operation = fit(op, cols - 2, 4)
    details: list[str] = []
    if request["count"] > 1:
        shown = ", ".join(safe(p) for p in request["paths"])
        more = f"and {request['count'] - 1} more in {safe(request['directory'])}: {shown}"
        details += fit(more, cols - 2, 3)
    details += fit(
        f"zone {safe(request['zone'])}; process {request['pid']} {safe(request['comm'])}", cols - 2
    )
    details += fit(f"command line: {clip(safe(request['cmdline']), CMDLINE_SHOWN)}", cols - 2, 3)
    details += fit(f"rule: {safe(request['rule_text'])}", cols - 2, 2)
    details += fit(f"request {request['id']}, expires in {request['expires_in']} s", cols - 2)
    keys = [f"{key}  {_LABELS[answer]}" for key, answer in KEYS.items()]
    how = "a letter, then Enter, saves; keys typed in a hurry are ignored; Ctrl-C leaves it"
    tail = [s for s in (status,) if s]
    full = [
        *head,
        *["  " + r for r in operation],
        "",
        *["  " + r for r in details],
        "",
        *["  " + k for k in keys],
        *fit(how, cols),
        *fit_all(tail, cols),
    ]
    if len(full) <= rows:
        return full
    compact = "y once  d this dir  a everywhere  n deny  s never ask  (a letter, then Enter)"
    keys = [*fit(compact, cols, 2), *fit_all(tail, cols)]
    room = rows - len(operation) - len(keys)
    if room < 0:  # the operation, cut shorter, and the keys, whatever else is lost
        operation = fit(op, cols - 2, max(1, rows - len(keys)))
        return [*["  " + r for r in operation], *keys][: max(rows, 2)]
    operation = ["  " + r for r in operation]
    head = head[:room]
    return [*head, *operation, *["  " + r for r in details][: room - len(head)], *keys]


def fit_all(lines: list[str], cols: int) -> list[str]:
    return [row for line in lines for row in fit(line, cols, 2)]


class RelayPrompt:
    """The prompt inside `sandboxfs run`'s own terminal relay (sandboxfs.run.terminal).

    run polls the daemon's control socket from outside the sandbox. A request is shown on a
    screen of sandboxfs's own (`ENTER`), fitted to the terminal, while the program's output and
    run's own notices wait; every key goes to the prompt, never to the program, which can
    neither see nor answer it. What the user typed before it was drawn, keys in a burst or a
    hurry, and a choice not confirmed with Enter never answer it. The prompt goes away as soon
    as its request is answered (here or elsewhere), expires or is withdrawn; the program's
    screen is then back and the program is sent SIGWINCH, so a full-screen program draws again.
    """

    def __init__(
        self,
        path: Path,
        write: Callable[[bytes], None],
        children: Callable[[], list[tuple[Path, str]]] = list,
        *,
        size: Callable[[], tuple[int, int]] = lambda: (24, 80),
        tell: Callable[[str], None] | None = None,
        discard: Callable[[], None] = lambda: None,
        alternate: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.write = write
        # The control sockets of child workers started inside this run (sandboxfs.run.nest),
        # each with its label: their requests are asked here too, labelled.
        self.children = children
        self.size = size  # rows, columns of the terminal
        self.tell = tell or (lambda line: write(f"sandboxfs: {line}\r\n".encode()))
        self.discard = discard  # drops what was typed ahead on the terminal
        self.alternate = alternate  # whether the program had its own full screen up
        self.clock = clock
        self.source: tuple[Path, str] = (path, "")  # where the shown request came from
        self.request: dict[str, Any] | None = None
        self.choice: Answer | None = None
        self.status = ""
        self.drawn_at = 0.0
        self.chosen_at = 0.0
        self.last_key = 0.0
        self.next_poll = 0.0
        self.skipped: set[tuple[str, int]] = set()  # left with Ctrl-C: not shown here again

    def poll(self, now: float) -> bool:
        """Whether a request is shown now: one more look at the daemon every POLL seconds, for
        a request to show or whether the one shown is still pending as shown."""
        if now < self.next_poll:
            return self.request is not None
        self.next_poll = now + POLL
        if self.request is not None:
            return self._refresh()
        for source in [(self.path, ""), *self.children()]:
            pending = [
                r
                for r in self._pending(source[0]) or []
                if (str(source[0]), r["id"]) not in self.skipped
            ]
            if pending:
                break
        else:
            return False
        self.request, self.source = pending[0], source
        self.write(ENTER)
        self._draw(fresh=True)
        return True

    def _pending(self, path: Path) -> list[dict[str, Any]] | None:
        """The requests pending at `path`; None when its daemon gave no answer."""
        try:
            reply = control.request(path, {"op": "approvals"}, timeout=2.0)
        except SandboxfsError:
            return None
        return list(reply.get("pending") or []) if reply.get("ok") else None

    def _refresh(self) -> bool:
        assert self.request is not None
        pending = self._pending(self.source[0])
        if pending is None:
            return True  # no answer this time: asked again in POLL seconds
        same = [r for r in pending if r["id"] == self.request["id"]]
        if not same:
            self._leave(f"approval {self.request['id']}: {GONE}")
            return False
        if same[0]["shown"] != self.request["shown"]:  # more paths joined: show them first
            self.request, self.choice = same[0], None
            self._draw(fresh=True, status="more paths joined this request: see them first")
        return True

    def redraw(self) -> None:
        """The terminal changed size."""
        if self.request is not None:
            self._draw(fresh=False, status=self.status)

    def _draw(self, *, fresh: bool, status: str = "") -> None:
        assert self.request is not None
        rows, cols = self.size()
        self.status = status
        lines = layout(self.request, rows, cols, self.source[1], status)
        if fresh:  # what was typed before it shows is dropped, never what comes once it does
            self.discard()
        self.write(CLEAR + "\r\n".join(lines).encode("utf-8", "replace"))
        if fresh:
            self.drawn_at = self.clock()
            self.choice = None

    def close(self, why: str) -> None:
        """Taken down unanswered (the program ended): its screen is back."""
        if self.request is not None:
            self._leave(f"approval {self.request['id']} not answered here: {why}")

    def _leave(self, outcome: str) -> None:
        self.write(LEAVE_TO_ALTERNATE if self.alternate() else LEAVE)
        self.request, self.choice, self.status = None, None, ""
        self.tell(outcome)

    def key(self, data: bytes) -> bool:
        """Keys typed while a request is shown; True once it is answered, or left with
        Ctrl-C (pending still, answered elsewhere; the Ctrl-C is not passed on)."""
        assert self.request is not None
        now = self.clock()
        if b"\x03" in data:
            self.skipped.add((str(self.source[0]), self.request["id"]))
            self._leave(
                f"approval {self.request['id']} left pending: "
                f"sandboxfs approve {self.request['id']} answers it"
            )
            return True
        hurried = now - self.last_key < QUIET
        self.last_key = now
        text = data.decode("latin-1")
        if now - self.drawn_at < GRACE or len(text) != 1:
            return self._again("typed ahead or pasted, not an answer: choose a letter")
        if self.choice is not None and text in "\r\n":
            if now - self.chosen_at < CONFIRM_AFTER:
                return self._again("Enter came too fast after the letter: choose again")
            return self._answer(self.choice)
        answer = KEYS.get(text)
        if answer is None:
            return self._again("" if self.choice is None else "nothing chosen: choose a letter")
        if hurried:
            return self._again("typed in a hurry, not an answer: pause, then a letter")
        self.choice, self.chosen_at = answer, now
        grant = safe(self.request["grants"][answer.value])
        self._draw(fresh=False, status=f"-> {grant}: Enter saves it, another key chooses again")
        return False

    def _again(self, status: str) -> bool:
        self.choice = None
        if status != self.status:
            self._draw(fresh=False, status=status)
        return False

    def _answer(self, choice: Answer) -> bool:
        assert self.request is not None
        message = {
            "op": "answer",
            "id": self.request["id"],
            "answer": choice.value,
            "shown": self.request["shown"],
            "channel": "run",
        }
        try:
            reply = control.request(self.source[0], message, timeout=5.0)
        except SandboxfsError as exc:
            reply = {"ok": False, "error": exc.message}
        if reply.get("ok"):
            self._leave(f"approval {self.request['id']}: saved grant {reply['grant']['id']}")
        else:
            self._leave(f"approval {self.request['id']}: not saved: {safe(reply.get('error'))}")
        return True
