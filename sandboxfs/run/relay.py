"""The relay of a connection the proxy admitted: bytes copied both ways between two
non-blocking sockets, each direction a `Pipe` with a bounded buffer, a half-close passed on.

The proxy's own loop polls the sockets (and its wake-up socket, which only it knows) for what
`wanted_events` asks and steps each pipe; kept apart so that the copying reads on its own,
without the proxy's policy and threads.
"""

from __future__ import annotations

import contextlib
import select
import socket

RELAY_BUFFER = 64 * 1024  # bytes one direction holds before it stops reading


def wanted_events(pipes: tuple[Pipe, Pipe]) -> dict[int, int]:
    """(relay) What to poll each socket for: reading while its pipe has room, writing while
    the other way has bytes waiting."""
    wanted: dict[int, int] = {pipes[0].src.fileno(): 0, pipes[0].dst.fileno(): 0}
    for pipe in pipes:
        if not pipe.eof and len(pipe.buf) < RELAY_BUFFER:
            wanted[pipe.src.fileno()] |= select.POLLIN
        if pipe.buf:
            wanted[pipe.dst.fileno()] |= select.POLLOUT
    return wanted


def update_poller(poller: select.poll, registered: dict[int, int], wanted: dict[int, int]) -> None:
    """Register what is wanted now with `poller`, where it changed (`registered`: what it has)."""
    for fd, events in wanted.items():
        if registered.get(fd, 0) == events:
            continue
        if events:
            poller.register(fd, events)
        else:
            poller.unregister(fd)
        registered[fd] = events


class Pipe:
    """One direction of a relay: bytes read from `src`, waiting in `buf`, written to `dst`."""

    def __init__(self, src: socket.socket, dst: socket.socket, buf: bytearray) -> None:
        self.src = src
        self.dst = dst
        self.buf = buf
        self.eof = False  # src has ended
        self.done = False  # ... and that end was passed on to dst

    def step(self, src_events: int, dst_events: int) -> None:
        readable = select.POLLIN | select.POLLHUP | select.POLLERR
        if src_events & readable and not self.eof and len(self.buf) < RELAY_BUFFER:
            try:
                data = self.src.recv(RELAY_BUFFER - len(self.buf))
            except (BlockingIOError, InterruptedError):
                data = None
            if data is not None:
                if data:
                    self.buf += data
                else:
                    self.eof = True
        if dst_events & (select.POLLOUT | select.POLLHUP | select.POLLERR) and self.buf:
            try:
                sent = self.dst.send(self.buf)
            except (BlockingIOError, InterruptedError):
                sent = 0
            del self.buf[:sent]
        if self.eof and not self.buf and not self.done:
            self.done = True
            with contextlib.suppress(OSError):
                self.dst.shutdown(socket.SHUT_WR)
