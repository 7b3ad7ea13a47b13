"""The approval prompt in `sandboxfs run`'s own terminal against a hostile program: what the
user reads is what is decided.

Each test drives a real `run` on a pty standing for the user's terminal: a program that draws a
fake prompt and leaves the terminal in a state that would hide the real one, one that prints
4 KiB of command line and makes network noise while the prompt is up, a request answered
elsewhere or expiring while shown, and keys typed ahead or in a hurry.
"""

from __future__ import annotations

import fcntl
import json
import struct
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.project import prompt
from sandboxfs.project.prompt import CLEAR, ENTER, LEAVE
from tests.support.cli import sandboxfs
from tests.support.run import PY, UserTerminal, needs_bwrap

pytestmark = needs_bwrap

ASK_DELETES = """\
approvals:
  timeout: {timeout}
  rules:
    - {{id: repo-delete, ops: [delete], zones: [repo], decision: ask}}
"""


def configure(project: Path, timeout: float = 60) -> None:
    (project / "sandboxfs.yaml").write_text(ASK_DELETES.format(timeout=timeout))
    (project / "a").mkdir()
    for name in ("one", "two"):
        (project / "a" / name).write_text(f"a/{name}\n")


@pytest.fixture
def term() -> Iterator[UserTerminal]:
    terminal = UserTerminal()
    try:
        yield terminal
    finally:
        terminal.close()


def run(term: UserTerminal, project: Path, *command: str, net: tuple[str, ...] = ()) -> None:
    term.start(
        "run", "--project", project, "--trust", "full", "--quiet", *net, "--", *command
    )  # fmt: skip


def choose(term: UserTerminal, letter: bytes) -> None:
    """A user who reads the prompt, presses a letter, reads what it saves and confirms."""
    time.sleep(prompt.QUIET + 0.2)
    term.send(letter)
    term.read_until(b"Enter saves it")
    time.sleep(prompt.CONFIRM_AFTER + 0.2)
    term.send(b"\r")


def frame(output: bytes) -> list[str]:
    """The rows of the last prompt drawn."""
    drawn = output[output.rindex(CLEAR) + len(CLEAR) :]
    if LEAVE in drawn:
        drawn = drawn[: drawn.index(LEAVE)]
    return drawn.decode().split("\r\n")


def grants(project: Path) -> list[dict[str, Any]]:
    result = sandboxfs("grants", "--json", "--project", project)
    if result.returncode != 0:
        return []
    listed: list[dict[str, Any]] = json.loads(result.stdout)
    return listed


SPOOF = r"""
import os, sys, time
sys.stdout.write("sandboxfs: approval 1 asked by rule repo-delete\r\n")
sys.stdout.write("  delete of /repo/build/old.o\r\n")
sys.stdout.write("\x1b[1;2r\x1b[8m\x1b[?25l\x1b(0\x1b]0;")  # region, concealed, charset, OSC open
sys.stdout.flush()
try:
    os.remove("/sandbox/repo/a/one")
except PermissionError:
    pass
time.sleep(1)  # the prompt is up by now
print("PROGRAM-AFTER", flush=True)
input()
"""


def test_the_prompt_is_drawn_in_a_state_sandboxfs_owns(term: UserTerminal, project: Path) -> None:
    configure(project)
    run(term, project, PY, "-c", SPOOF)
    term.read_until(b"s  deny and stop asking")
    output = term.output
    after_program = output.rindex(b"\x1b]0;") + len(b"\x1b]0;")
    # nothing but sandboxfs's reset between the program's last byte and the real prompt
    assert output[after_program:].startswith(ENTER + CLEAR + prompt.BANNER.encode())
    assert "  delete of /repo/a/one" in frame(output)
    assert b"PROGRAM-AFTER" not in output  # held back while the prompt is up
    choose(term, b"n")
    term.read_until(b"PROGRAM-AFTER")
    assert LEAVE in term.output[after_program:]
    term.send(b"\r")
    assert term.wait() == 0
    assert (project / "a" / "one").exists()


NOISY = r"""
import os, socket, sys, time
try:
    os.remove("/sandbox/repo/a/one")
except PermissionError:
    pass
time.sleep(1.5)  # the prompt is up by now
for host in ("noisy-one.example", "noisy-two.example"):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    s.recv(4096)
    s.close()
print("PROGRAM-AFTER", flush=True)
input()
"""


def test_the_operation_and_the_keys_stay_in_view_and_notices_wait(
    term: UserTerminal, project: Path
) -> None:
    configure(project)
    rows, cols = 12, 60
    fcntl.ioctl(term.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    net = ("--net", "allow", "--allow-host", "example.invalid")
    run(term, project, PY, "-c", NOISY, "x" * 4096, net=net)
    term.read_until(b"y once")
    time.sleep(3)  # the program's network refusals happen meanwhile
    held = term.collect()[term.output.rindex(CLEAR) :]
    assert b"network:" not in held and b"PROGRAM-AFTER" not in held
    shown = frame(term.output)
    assert len(shown) <= rows and all(prompt.width(row) <= cols for row in shown), shown
    assert "  delete of /repo/a/one" in shown
    assert any(row.startswith("y once  d this dir") for row in shown), shown
    choose(term, b"n")
    term.read_until(b"PROGRAM-AFTER")
    term.read_until(b"noisy-two.example")
    term.send(b"\r")
    assert term.wait() == 0
    leave = term.output.rindex(LEAVE)
    assert term.output.index(b"network:") > leave  # said after the prompt, never into it


def test_the_prompt_goes_away_when_its_request_expires(term: UserTerminal, project: Path) -> None:
    configure(project, timeout=3)
    run(term, project, "sh", "-c", "rm /sandbox/repo/a/one; sleep 1; echo PROGRAM-AFTER; read x")
    term.read_until(b"s  deny and stop asking")
    shown_at = time.monotonic()
    term.read_until(b"no longer pending", timeout=10)
    assert time.monotonic() - shown_at < 3 + 2  # its timeout, and at most a poll or two more
    term.read_until(b"PROGRAM-AFTER", timeout=5)  # output flows again without a key
    term.send(b"\r")
    assert term.wait() == 0
    assert (project / "a" / "one").exists()


def test_the_prompt_goes_away_when_answered_elsewhere(term: UserTerminal, project: Path) -> None:
    configure(project)
    script = "rm /sandbox/repo/a/one; sleep 1; echo PROGRAM-AFTER; read line; echo got-$line"
    run(term, project, "sh", "-c", script)
    term.read_until(b"s  deny and stop asking")
    assert sandboxfs("deny", "--project", project, "1").returncode == 0
    answered = time.monotonic()
    term.read_until(b"no longer pending", timeout=5)
    term.read_until(b"PROGRAM-AFTER", timeout=5)
    assert time.monotonic() - answered < 1.5
    term.send(b"typed\r")  # keys are the program's again, not the gone prompt's
    term.read_until(b"got-typed")
    assert term.wait() == 0


def test_keys_typed_ahead_or_in_a_hurry_never_answer(term: UserTerminal, project: Path) -> None:
    configure(project)
    script = "rm /sandbox/repo/a/one; sleep 1; echo PROGRAM-AFTER; read line"
    run(term, project, "sh", "-c", script)
    term.read_until(b"s  deny and stop asking")
    term.send(b"d")  # right as it is drawn: typed ahead
    time.sleep(prompt.CONFIRM_AFTER + 0.2)
    term.send(b"\r")
    for ch in b"yes, and do it":  # the user typing a sentence meant for the agent
        time.sleep(0.1)
        term.send(bytes([ch]))
    time.sleep(0.1)
    term.send(b"\r")
    time.sleep(prompt.QUIET + 0.2)
    term.send(b"ad\r")  # a burst (pasted, or the program's own input) is no answer either
    time.sleep(1)
    assert b"saved grant" not in term.collect() and b"PROGRAM-AFTER" not in term.output
    assert grants(project) == []
    choose(term, b"y")  # a deliberate answer still works
    term.read_until(b"saved grant 1")
    term.read_until(b"PROGRAM-AFTER")
    [grant] = grants(project)
    term.send(b"\r")
    assert term.wait() == 0
    assert (grant["id"], grant["request"], grant["scope"]) == (1, 1, "once"), grant
