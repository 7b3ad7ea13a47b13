"""The supervisor's wait for the program: one select loop over bubblewrap's pipes, its exit,
the signals `run` gets (forwarded to the program) and the terminal relay (sandboxfs.run.terminal).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import time
from collections.abc import Callable
from pathlib import Path

from sandboxfs.project import prompt
from sandboxfs.run import signals
from sandboxfs.run.processes import KILL_WAIT, Child
from sandboxfs.run.screen import Hold
from sandboxfs.run.terminal import Terminal, TerminalRelay

STOP_GRACE = 10.0  # seconds between a forwarded SIGTERM/SIGHUP and killing the sandbox
WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGWINCH)


class WaitLoop:
    """Waits for the program, relaying its terminal and forwarding signals to it."""

    def __init__(self, child: Child, terminal: Terminal | None, hold: Hold) -> None:
        self.child = child
        self.hold = hold  # run's own lines, held while the prompt or a full screen is up
        self.terminal = terminal
        self.sel = selectors.DefaultSelector()
        self.relay = None if terminal is None else TerminalRelay(terminal, self.sel, hold)
        self.pidfd = os.pidfd_open(child.pid)
        self.signals: list[int] = []
        self.setup_text = b""
        self.status_text = b""
        self.ready = False
        self.init_pid: int | None = None  # bwrap's PID 1 inside, as seen from here
        self.cmd_pid: int | None = None
        self.kill_at: float | None = None
        self.reap_by: float | None = None  # set once bwrap was killed
        self.status: int | None = None
        self.on_ready: Callable[[], None] | None = None  # once CMD is about to start

    def wait(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        try:
            with signals.noted(WATCHED, wake_w) as self.signals:
                try:
                    self._watch(wake_r)
                    return self._loop(wake_r)
                finally:
                    if self.terminal is not None:
                        self.terminal.restore()  # before the signals are run's own again
                    self.hold.release()  # what waited for the prompt or a full screen: said now
        finally:
            self.sel.close()
            for fd in (wake_r, wake_w, self.pidfd, self.child.sync, self.child.errors):
                os.close(fd)
            os.close(self.child.status)

    def _watch(self, wake_r: int) -> None:
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        self.sel.register(self.child.sync, selectors.EVENT_READ, "sync")
        self.sel.register(self.child.errors, selectors.EVENT_READ, "errors")
        self.sel.register(self.child.status, selectors.EVENT_READ, "status")
        if self.relay is not None:
            self.relay.start()

    def _loop(self, wake_r: int) -> int:
        while self.status is None:
            for key, events in self.sel.select(self._timeout()):
                self._handle(key.data, key.fd, events, wake_r)
            if self.ready and self.relay is not None:
                self.relay.ask_user()
            self._forward_signals()
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                self._kill_sandbox()
            if self.status is None and self.reap_by and time.monotonic() >= self.reap_by:
                self.status = 128 + signal.SIGKILL  # killed, and not waited for any longer
        if self.relay is not None:
            self.relay.finish()
        return self.status

    def _timeout(self) -> float | None:
        """Until the next deadline: the kill after a stop, giving up on bwrap, the prompt's poll."""
        deadlines = [t for t in (self.kill_at, self.reap_by) if t is not None]
        if self.relay is not None and self.relay.prompt is not None:
            deadlines.append(time.monotonic() + prompt.POLL)
        return max(0, min(deadlines) - time.monotonic()) if deadlines else None

    def _handle(self, what: str, fd: int, events: int, wake_r: int) -> None:
        if what == "wake":
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        elif what == "exit":
            _, wait_status = os.waitpid(self.child.pid, 0)
            code = os.waitstatus_to_exitcode(wait_status)
            self.status = code if code >= 0 else 128 - code
        elif what == "sync":
            self._synced()
        elif what == "errors":
            self._bwrap_stderr()
        elif what == "status":
            self._bwrap_status()
        elif self.relay is not None:
            self.relay.handle(what, fd, events)

    def _synced(self) -> None:
        """The launcher runs inside (a byte), or bwrap failed before it did (the end)."""
        if os.read(self.child.sync, 1):
            self.ready = True
            self.cmd_pid = self._find_cmd()
            if self.on_ready is not None:
                self.on_ready()
        self.sel.unregister(self.child.sync)

    def _bwrap_stderr(self) -> None:
        """bwrap's own stderr: kept for the setup error until CMD runs, then run's to show."""
        data = os.read(self.child.errors, 65536)
        if not data:
            self.sel.unregister(self.child.errors)
        elif self.ready:
            self.hold.bytes(data)
        else:
            self.setup_text = (self.setup_text + data)[-65536:]

    def _bwrap_status(self) -> None:
        """bwrap's --json-status-fd: its first line names its PID 1 inside."""
        data = os.read(self.child.status, 4096)
        if not data:
            self.sel.unregister(self.child.status)
        elif self.init_pid is None:
            self.status_text += data
            line, sep, _ = self.status_text.partition(b"\n")
            if sep:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self.init_pid = int(json.loads(line)["child-pid"])

    def _find_cmd(self) -> int | None:
        if self.init_pid is None:
            return None
        children = Path(f"/proc/{self.init_pid}/task/{self.init_pid}/children")
        with contextlib.suppress(OSError, ValueError):
            first = children.read_text().split()
            return int(first[0]) if first else None
        return None

    def _forward_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            if signum == signal.SIGWINCH:
                if self.relay is not None:
                    self.relay.resized()
                continue
            targets = {self.cmd_pid} if self.cmd_pid else set()
            if self.terminal is not None and (group := self.terminal.foreground()):
                targets.add(group)
            if not self.ready or not targets:
                self._kill_sandbox()  # still being set up: nothing to hand the signal to
                continue
            signals.send_to_groups(targets, signum)
            if signum in (signal.SIGTERM, signal.SIGHUP) and self.kill_at is None:
                self.kill_at = time.monotonic() + STOP_GRACE

    def _kill_sandbox(self) -> None:
        """bwrap dies; its PID 1 dies with it (--die-with-parent), and with that all inside."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child.pid, signal.SIGKILL)
        self.kill_at = None
        if self.reap_by is None:
            self.reap_by = time.monotonic() + KILL_WAIT
