"""What `run` shows on the user's terminal besides the program: its own lines held back while
they would damage the screen, and whether the program has a full screen of its own up.

run's notices (a host refused, the start line) and the launcher's errors go to its stderr. When
that is the terminal the program draws on, a line written while the approval prompt is up would
land in the prompt, and one written while a full-screen program (an agent's dialog, an editor)
owns the terminal lands in the middle of its screen, where the next redraw wipes it. Such lines
wait in `Hold` and are written, in order, once nothing holds them; never lost, and bounded.
"""

from __future__ import annotations

import contextlib
import os
import re
import termios
import threading
from collections.abc import Callable

HELD_LINES = 200  # lines held back at most; the audit log has everything run would say
_MODES = re.compile(rb"\x1b\[\?(?:1049|1047|47)([hl])")


class Hold:
    """run's own lines for its stderr, written at once or held while something holds them."""

    def __init__(self, write: Callable[[bytes], None], holds: bool) -> None:
        self._write = write
        self._holds = holds  # stderr is the terminal the program and the prompt draw on
        self._by: set[str] = set()
        self._held: list[bytes] = []
        self._dropped = 0
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        """One line of run's own ("sandboxfs: " is added), from any thread."""
        self.bytes(f"sandboxfs: {text}".encode("utf-8", "replace"), line=True)

    def bytes(self, data: bytes, *, line: bool = False) -> None:
        data += b"\n" if line else b""
        with self._lock:  # written under it: no line slips past a hold taken meanwhile
            if not self._by:
                self._write(_ends(data))
            elif len(self._held) < HELD_LINES:
                self._held.append(data)
            else:
                self._dropped += 1

    def hold(self, reason: str) -> None:
        if self._holds:
            with self._lock:
                self._by.add(reason)

    def release(self, reason: str | None = None) -> None:
        """Nothing holds for `reason` any more (None: for any); what waited is written."""
        with self._lock:
            if reason is None:
                self._by.clear()
            else:
                self._by.discard(reason)
            if self._by:
                return
            for data in self._held:
                self._write(_ends(data))
            if self._dropped:
                more = f"sandboxfs: {self._dropped} more lines were held back; see the audit\n"
                self._write(_ends(more.encode()))
            self._held, self._dropped = [], 0


def _ends(data: bytes) -> bytes:
    """On a terminal in raw mode (the program's keystrokes relayed) a line ends with CR LF."""
    with contextlib.suppress(termios.error, OSError):
        if os.isatty(2) and not termios.tcgetattr(2)[1] & termios.OPOST:
            return data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    return data


class FullScreen:
    """Whether the program's output has switched the terminal to its alternate screen (a
    full-screen program), followed across the chunks of output relayed."""

    def __init__(self) -> None:
        self.on = False
        self._tail = b""

    def feed(self, data: bytes) -> bool | None:
        """The new state when `data` changed it, else None."""
        seen = self._tail + data
        self._tail = seen[-12:]
        modes = _MODES.findall(seen)
        if not modes:
            return None
        now = bool(modes[-1] == b"h")
        if now == self.on:
            return None
        self.on = now
        return now
