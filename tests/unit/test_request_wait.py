"""The daemon's wait for the next request (sandboxfs/fuse/request_wait.py), on a pipe instead of
/dev/fuse: ready at once, caught while spinning, caught after sleeping in trio, and stopped."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import trio

from sandboxfs.fuse.request_wait import RequestWait


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


async def test_ready_request_returns_at_once(pipe: tuple[int, int]) -> None:
    r, w = pipe
    wait = RequestWait(r, spin=0.0)
    os.write(w, b"x")
    assert await wait() is True


async def test_request_during_spin_is_caught_without_sleeping(pipe: tuple[int, int]) -> None:
    r, w = pipe
    wait = RequestWait(r, spin=5.0)  # long enough that only the write can end it
    # A thread, since the spin does not let trio run anything: that is its point.
    writer = threading.Timer(0.05, os.write, (w, b"x"))
    slept = trio.Event()

    async def runs_if_the_wait_sleeps() -> None:
        slept.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(runs_if_the_wait_sleeps)
        writer.start()
        started = time.monotonic()
        assert await wait() is True
        assert time.monotonic() - started < 4.0
        assert not slept.is_set()  # caught by polling, not by going back to trio
    writer.join()


async def test_request_after_spin_wakes_the_sleeping_wait(pipe: tuple[int, int]) -> None:
    r, w = pipe
    wait = RequestWait(r, spin=0.001)

    async def late_writer() -> None:
        await trio.sleep(0.1)  # runs only because the wait went to sleep in trio
        os.write(w, b"x")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(late_writer)
        assert await wait() is True


async def test_other_tasks_run_during_a_stream_of_requests(pipe: tuple[int, int]) -> None:
    r, w = pipe
    wait = RequestWait(r, spin=0.0)
    os.write(w, b"x")  # never drained: every wait finds a request ready
    ran = trio.Event()

    async def other_task() -> None:
        ran.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        for _ in range(200):
            assert await wait() is True
        assert ran.is_set()


async def test_stop_ends_the_wait(pipe: tuple[int, int]) -> None:
    r, w = pipe
    wait = RequestWait(r, spin=0.0)
    os.write(w, b"x")
    wait.stop()
    assert await wait() is False
