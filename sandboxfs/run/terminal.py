"""The terminal relay: the user's terminal, never handed to the program, and what the wait loop
does with it (keys, the pty's output, raw mode, holding output while an approval prompt is up).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import struct
import termios
import time
import tty

from sandboxfs.project import prompt
from sandboxfs.run import signals
from sandboxfs.run.screen import FullScreen, Hold


class Terminal:
    """The user's terminal, relayed: the program never holds a descriptor of it.

    Wherever 0, 1 or 2 is the terminal, the program gets the slave of a pty of run's own
    instead (`run -- agent < task.txt`: 1 and 2; `run -- agent | tee log`: 0 and 2), and what
    is not a terminal as it is. TIOCSTI, mode changes and every other ioctl reach only that
    pty; what the program writes there is copied to the terminal. When 0 is the terminal,
    keystrokes are the program's: the terminal is raw, they are relayed, the pty does the line
    discipline (Ctrl-C, job control, full-screen programs) and is the program's controlling
    terminal. When 0 is not, they are not: the terminal keeps its modes, Ctrl-C reaches `run`
    as a signal (forwarded), and the program has no controlling terminal. A descriptor on a
    second terminal (`2>/dev/pts/5`) gets a pipe, copied there. Every terminal of 0, 1 and 2
    is left with the modes it had at the start (`restore`).
    """

    def __init__(self, ttys: list[int]) -> None:
        self.saved = {fd: termios.tcgetattr(fd) for fd in ttys}
        device = {fd: os.fstat(fd).st_rdev for fd in ttys}
        self.home = ttys[0]  # 0, when 0 is the terminal
        on_home = [fd for fd in ttys if device[fd] == device[self.home]]
        self.keyboard = 0 in on_home
        self.stderr_here = 2 in on_home  # run's own lines land on the program's screen
        self.full_screen = FullScreen()
        # Where the pty's output goes; with 1 and 2 elsewhere (`run -- CMD > log`), the
        # terminal itself, for the echo of what is typed.
        self.screen: int | None = next((fd for fd in (1, 2) if fd in on_home), None)
        self.own_screen = False
        if self.screen is None and self.keyboard:
            with contextlib.suppress(OSError):
                flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC
                self.screen, self.own_screen = os.open("/proc/self/fd/0", flags), True
        self.master, slave = os.openpty()
        self.ends = [slave]  # the program's ends, closed here once it holds them
        program = [0, 1, 2]
        for fd in on_home:
            program[fd] = slave
        self.copies: dict[int, int] = {}  # read end of a pipe -> the terminal it is copied to
        for other in sorted({device[fd] for fd in ttys} - {device[self.home]}):
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            fds = [fd for fd in ttys if device[fd] == other]
            self.copies[read_end] = fds[0]
            for fd in fds:
                program[fd] = write_end
            self.ends.append(write_end)
        self.program = (program[0], program[1], program[2])
        self.is_raw = False
        termios.tcsetattr(slave, termios.TCSANOW, self.saved[self.home])
        self.resize()
        os.set_blocking(self.master, False)
        self.pending = b""  # keyboard input the program has not taken yet

    @classmethod
    def of_stdio(cls) -> Terminal | None:
        """The relay for whichever of 0, 1 and 2 is a terminal; None when none is."""
        ttys = [fd for fd in (0, 1, 2) if os.isatty(fd)]
        return cls(ttys) if ttys else None

    @property
    def controlling(self) -> bool:
        """The pty is the program's 0, so the launcher makes it its controlling terminal."""
        return self.keyboard

    def started(self) -> None:
        """The program holds its ends now; run keeps the master and the pipes' read ends."""
        for fd in self.ends:
            os.close(fd)
        self.ends = []

    def size(self) -> tuple[int, int]:
        """Rows and columns of the user's terminal (24 x 80 when it does not say)."""
        with contextlib.suppress(OSError):
            rows, cols, _, _ = struct.unpack(
                "HHHH", fcntl.ioctl(self.home, termios.TIOCGWINSZ, b"\0" * 8)
            )
            if rows and cols:
                return rows, cols
        return 24, 80

    def discard_typed(self) -> None:
        """Drop what was typed on the keyboard and not yet read (before a prompt is drawn)."""
        if self.keyboard:
            with contextlib.suppress(termios.error, OSError):
                termios.tcflush(0, termios.TCIFLUSH)

    def resize(self) -> None:
        with contextlib.suppress(OSError):
            size = fcntl.ioctl(self.home, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, size)

    def raw(self) -> None:
        if self.keyboard:
            self.is_raw = True
            tty.setraw(0, termios.TCSANOW)

    def restore(self) -> None:
        """Each terminal of 0, 1 and 2 as it was at the start: the one made raw here always;
        any other whose modes changed all the same only while `run` is in its foreground (in
        the background, they are the shell's line editor's by now)."""
        for fd, saved in self.saved.items():
            with contextlib.suppress(termios.error, OSError):
                if termios.tcgetattr(fd) != saved and (
                    (self.is_raw and fd == 0) or os.tcgetpgrp(fd) == os.getpgrp()
                ):
                    termios.tcsetattr(fd, termios.TCSANOW, saved)
        self.is_raw = False

    def close(self) -> None:
        self.restore()
        mine = [*self.ends, self.master, *self.copies]
        if self.own_screen and self.screen is not None:
            mine.append(self.screen)
        for fd in mine:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.ends, self.copies, self.own_screen = [], {}, False

    def foreground(self) -> int | None:
        try:
            return os.tcgetpgrp(self.master)
        except OSError:
            return None


class TerminalRelay:
    """The wait loop's terminal side: keys to the program's pty, or to the approval prompt while
    it is up; the pty's output to the screen, or held back (the pty not read) while the prompt
    is up; what a second terminal's pipe carries, copied there."""

    def __init__(self, terminal: Terminal, sel: selectors.BaseSelector, hold: Hold) -> None:
        self.terminal = terminal
        self.sel = sel
        self.hold = hold  # run's own lines, held while the prompt or a full screen is up
        # The approval prompt in this terminal (prompt.RelayPrompt), and whether it is
        # shown now (the program's output then waits, and keys are the prompt's).
        self.prompt: prompt.RelayPrompt | None = None
        self.prompting = False

    def start(self) -> None:
        """Watch the keyboard, the pty and the pipes; the terminal is raw from here on."""
        term = self.terminal
        if term.keyboard:
            self.sel.register(0, selectors.EVENT_READ, "stdin")
        self.sel.register(term.master, selectors.EVENT_READ, "master")
        for fd in term.copies:
            self.sel.register(fd, selectors.EVENT_READ, "copy")
        term.raw()  # only now: from here on a signal is handled, and undone

    def handle(self, what: str, fd: int, events: int) -> None:
        """One of the descriptors `start` watches is ready."""
        if what == "stdin":
            self._keys()
        elif what == "master":
            self._pump_master(events)
        elif what == "copy":
            self._copy(fd)

    def resized(self) -> None:
        """SIGWINCH: the pty takes the terminal's new size, and a prompt up is drawn again."""
        self.terminal.resize()
        if self.prompting and self.prompt is not None:
            self.prompt.redraw()

    def finish(self) -> None:
        """The program ended: the prompt goes, and what it wrote last is shown."""
        if self.prompting and self.prompt is not None:
            self.prompt.close("the program ended")
            self.prompting = False
        self._drain()

    def _keys(self) -> None:
        data = b""
        with contextlib.suppress(OSError):
            data = os.read(0, 65536)
        if not data:
            self.sel.unregister(0)
            return
        if self.prompting and self.prompt is not None:  # the user's keys, for the prompt
            if self.prompt.key(data):
                self._resume_relay()
            return
        self.terminal.pending += data
        self.sel.modify(
            self.terminal.master, selectors.EVENT_READ | selectors.EVENT_WRITE, "master"
        )

    def _copy(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(fd)
        else:
            write_out(self.terminal.copies[fd], data)

    def ask_user(self) -> None:
        """Show a pending approval request in this terminal: the program's output (its pty
        is not read) and run's own lines are held back until it is answered, here or
        elsewhere, or expires."""
        if self.prompt is None:
            return
        if self.prompting:
            if not self.prompt.poll(time.monotonic()):  # answered elsewhere, or expired
                self._resume_relay()
            return
        self.hold.hold("prompt")  # before it is drawn: no notice lands in it
        if self.prompt.poll(time.monotonic()):
            self.prompting = True
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(self.terminal.master)
        else:
            self.hold.release("prompt")

    def _resume_relay(self) -> None:
        term = self.terminal
        self.prompting = False
        self.hold.release("prompt")
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if term.pending else 0)
        self.sel.register(term.master, events, "master")
        if (group := term.foreground()) is not None:  # a full-screen program draws again
            signals.send_to_groups([group], signal.SIGWINCH)

    def _pump_master(self, events: int) -> None:
        term = self.terminal
        if events & selectors.EVENT_READ:
            try:
                data = os.read(term.master, 65536)
            except BlockingIOError:
                data = b"-"
            except OSError:  # EIO: nobody holds the pty any more
                data = b""
            if not data:
                self.sel.unregister(term.master)
                return
            if data != b"-" and term.screen is not None:
                write_out(term.screen, data)
                full = term.full_screen.feed(data)
                if full is True:
                    self.hold.hold("full screen")
                elif full is False:
                    self.hold.release("full screen")
        if events & selectors.EVENT_WRITE and term.pending:
            with contextlib.suppress(BlockingIOError):
                term.pending = term.pending[os.write(term.master, term.pending) :]
            if not term.pending:
                self.sel.modify(term.master, selectors.EVENT_READ, "master")

    def _drain(self) -> None:
        """What the program wrote just before it ended is still in its pty or pipes."""
        deadline = time.monotonic() + 1.0
        copies: list[tuple[int, int | None]] = [*self.terminal.copies.items()]
        for source, target in [(self.terminal.master, self.terminal.screen), *copies]:
            while time.monotonic() < deadline:
                try:
                    data = os.read(source, 65536)
                except OSError:  # nothing more (EAGAIN), or nobody holds the pty (EIO)
                    break
                if not data:
                    break
                if target is not None:
                    write_out(target, data)


def write_out(fd: int, data: bytes) -> None:
    """All of `data`, waiting (a second at a time) while `fd` does not take more; given up once
    a write fails: a terminal or pipe gone must not end the run."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select_wait = selectors.DefaultSelector()
            select_wait.register(fd, selectors.EVENT_WRITE)
            select_wait.select(1.0)
            select_wait.close()
        except OSError:
            return
