"""Size-based rotation of the audit log: the chain goes on across segment files, every reader
(verify, query, follow, prune) reads them all in order, and verify names a segment that was
deleted, truncated or edited."""

from __future__ import annotations

import io
import json
import multiprocessing
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from itertools import pairwise
from pathlib import Path

import pytest

from sandboxfs.audit.anchor import Anchor, anchor_path
from sandboxfs.audit.common import GENESIS, log_files, segments
from sandboxfs.audit.prune import prune
from sandboxfs.audit.reader import AuditQuery, follow, iter_query, json_line, read_entries
from sandboxfs.audit.verify import verify
from sandboxfs.audit.writer import MIN_ROTATE_BYTES, AuditLog
from sandboxfs.config.model import AuditConfig
from tests.support.audit import T0, _entry, _ts

ROTATE = MIN_ROTATE_BYTES  # about ten entries a file


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Anchors go to a directory of this test's own, never to the real ~/.local/state."""
    directory = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(directory))
    return directory


def _write(path: Path, count: int, *, start: int = 0, per_flush: int = 3) -> None:
    log = AuditLog(path, rotate=ROTATE)
    for i in range(start, start + count):
        log.record(_entry(path=f"/session/f{i + 1}", ts=_ts(i), allowed=i % 7 != 3))
        if (i + 1) % per_flush == 0:
            log.flush()
    log.close()


def _rotated(tmp_path: Path, count: int = 100) -> Path:
    path = tmp_path / "audit.jsonl"
    _write(path, count)
    assert len(segments(path)) >= 3
    return path


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_the_chain_goes_on_across_segments(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    files = log_files(path)
    assert files[-1] == path and all(f.name.startswith("audit.0") for f in files[:-1])
    entries = list(read_entries(path))
    assert [e["id"] for e in entries] == list(range(1, 101))
    assert all(b["prev"] == a["hash"] for a, b in pairwise(entries))
    for seg in segments(path):  # named by the ids it holds; none past the size by much
        held = [json.loads(line)["id"] for line in seg.path.read_bytes().splitlines()]
        assert (held[0], held[-1]) == (seg.first, seg.last)
        assert seg.path.stat().st_size < ROTATE + 2048
        assert seg.path.stat().st_mode & 0o777 == 0o600
    first_of_log = json.loads(path.read_bytes().splitlines()[0])
    assert first_of_log["prev"] == entries[first_of_log["id"] - 2]["hash"]
    anchor = Anchor.parse(anchor_path(path).read_bytes())
    assert (anchor.head_id, anchor.head_hash) == (100, entries[-1]["hash"])
    result = verify(path)
    assert result.ok, result.message
    assert result.message.startswith(f"ok: 100 entries in {len(files)} files, chain intact")
    assert "keyed, and complete up to its anchor's head (id 100)" in result.message


def test_a_new_writer_continues_the_chain_and_two_writers_agree(tmp_path: Path) -> None:
    path = _rotated(tmp_path, 40)
    one, two = AuditLog(path, rotate=ROTATE), AuditLog(path, rotate=ROTATE)
    for i in range(60):
        (one if i % 2 else two).record(_entry(path=f"/x{i}", ts=_ts(40 + i)))
        (one if i % 3 else two).flush()
    one.close()
    two.close()
    assert [e["id"] for e in read_entries(path)] == list(range(1, 101))
    ranges = [(s.first, s.last) for s in segments(path)]
    assert all(a[1] + 1 == b[0] for a, b in pairwise(ranges)), ranges
    assert verify(path).ok, verify(path).message


def _rotating_writer(path: str, name: str, count: int) -> None:
    log = AuditLog(Path(path), batch_size=7, rotate=ROTATE)
    for i in range(count):
        log.record(_entry(comm=name, path=f"/{name}/{i}", allowed=i % 50 != 0))
    log.close()


def test_four_processes_rotate_one_log_and_agree(tmp_path: Path) -> None:
    """Processes sharing the log under its lock: one rotates at a time, none writes into a
    segment, and the ids stay consecutive across every file."""
    path = tmp_path / "audit.jsonl"
    ctx = multiprocessing.get_context("fork")
    workers = [
        ctx.Process(target=_rotating_writer, args=(str(path), f"mount{n}", 300)) for n in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    result = verify(path)
    assert result.ok, result.message
    assert result.entries == 1200 and len(segments(path)) > 20
    entries = list(read_entries(path))
    assert [e["id"] for e in entries] == list(range(1, 1201))
    for n in range(4):
        mine = [e["path"] for e in entries if e["comm"] == f"mount{n}"]
        assert mine == [f"/mount{n}/{i}" for i in range(300)]


def test_rotation_right_before_a_crash_leaves_an_empty_log_the_next_writer_chains_from(
    tmp_path: Path,
) -> None:
    path = _rotated(tmp_path, 30)
    last = list(read_entries(path))[-1]
    # As if a writer had renamed the log and died before writing into the new one.
    path.rename(path.with_name(f"audit.{_first_id(path):012d}-{last['id']:012d}.jsonl"))
    path.touch(mode=0o600)
    assert verify(path).ok, verify(path).message
    _write(path, 5, start=30)
    entries = list(read_entries(path))
    assert [e["id"] for e in entries] == list(range(1, 36))
    assert verify(path).ok, verify(path).message


def _first_id(path: Path) -> int:
    return int(json.loads(path.read_bytes().splitlines()[0])["id"])


def test_verify_names_a_deleted_middle_segment(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    middle = segments(path)[1]
    middle.path.unlink()
    result = verify(path)
    assert not result.ok
    after = segments(path)[1]
    assert result.message == (
        f"{after.path.name} line 1: ids {middle.first} to {middle.last} are in no file:"
        f" a segment was deleted (the file before this one ends at id {middle.first - 1})"
    )


def test_verify_names_a_deleted_first_segment(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    first = segments(path)[0]
    first.path.unlink()
    result = verify(path)
    assert not result.ok
    assert result.message.startswith(
        f"{segments(path)[0].path.name} line 1: the first entry is id {first.last + 1},"
        f" not id 1 chained to GENESIS (ids 1 to {first.last} are in no file"
    )


def test_verify_names_a_deleted_newest_segment_and_log(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    path.unlink()
    result = verify(path)
    assert not result.ok
    assert "the log ends at id" in result.message and "anchor says id 100" in result.message


def test_verify_names_a_truncated_segment(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    seg = segments(path)[1]
    lines = seg.path.read_bytes().splitlines(keepends=True)
    seg.path.write_bytes(b"".join(lines[:-2]))
    result = verify(path)
    assert not result.ok
    assert result.message == (
        f"{seg.path.name} ends at id {seg.last - 2} but its name says id {seg.last}:"
        " entries were removed from its end (truncated)"
    )


def test_verify_names_a_segment_cut_at_its_start_and_an_edited_one(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    seg = segments(path)[2]
    original = seg.path.read_bytes()
    lines = original.splitlines(keepends=True)
    seg.path.write_bytes(b"".join(lines[1:]))
    result = verify(path)
    assert not result.ok
    assert result.message == (
        f"{seg.path.name} line 1: begins at id {seg.first + 1} but its name says id"
        f" {seg.first}: lines were removed from its start"
    )
    seg.path.write_bytes(original.replace(b"/session/f", b"/session/g", 1))
    result = verify(path)
    assert result.message == f"{seg.path.name} line 1: hash mismatch (entry edited)"


def test_query_show_and_limit_read_every_segment(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    denied = list(iter_query(path, AuditQuery(allowed=False)))
    assert [e["path"] for e in denied] == [f"/session/f{i + 1}" for i in range(100) if i % 7 == 3]
    last = list(iter_query(path, AuditQuery(allowed=False, limit=3)))
    assert [e["path"] for e in last] == [e["path"] for e in denied[-3:]]
    since = list(iter_query(path, AuditQuery(since=T0 + timedelta(minutes=95))))
    assert [e["id"] for e in since] == [96, 97, 98, 99, 100]


def test_prune_deletes_whole_segments_and_keeps_the_chain(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    before = segments(path)
    cut = before[1].first + 2  # the first kept entry, inside the second segment
    assert prune(path, T0 + timedelta(minutes=cut - 1), dry_run=True) == cut - 1
    assert prune(path, T0 + timedelta(minutes=cut - 1)) == cut - 1
    after = segments(path)
    assert after[0] == before[1] and after[1:] == before[2:]  # the first one is gone
    header, *kept = read_entries(path)
    assert (header["op"], header["id"], header["dropped"]) == ("prune", cut - 1, cut - 1)
    assert [e["id"] for e in kept] == list(range(cut, 101))
    result = verify(path)
    assert result.ok, result.message
    assert f"from the prune header (entries up to id {cut - 1} pruned)" in result.message
    _write(path, 20, start=100)  # and writing goes on
    assert verify(path).ok, verify(path).message
    assert prune(path, T0 + timedelta(minutes=1000)) == 120 - cut + 1
    assert segments(path) == [] or all(not list(read_entries(s.path)) for s in segments(path))
    assert verify(path).ok, verify(path).message


def test_an_interrupted_prune_is_named_and_finished_by_the_next(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    kept = segments(path)[1:]
    copy = {s.path: s.path.read_bytes() for s in segments(path)[:1]}
    prune(path, T0 + timedelta(minutes=kept[0].first + 1))
    for name, data in copy.items():  # as if prune had stopped before deleting the old file
        name.write_bytes(data)
    result = verify(path)
    assert not result.ok and "an interrupted prune?" in result.message
    prune(path, T0 + timedelta(minutes=kept[0].first + 1))
    assert verify(path).ok, verify(path).message


def test_follow_goes_on_across_rotations(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, rotate=ROTATE)
    log.record(_entry(path="/old"))
    log.flush()
    out = io.StringIO()
    started, done = threading.Event(), threading.Event()

    def stop() -> bool:
        started.set()
        return done.is_set()

    thread = threading.Thread(
        target=follow,
        args=(path, AuditQuery(), out),
        kwargs={"render": json_line, "poll": 0.05, "stop": stop},
    )
    thread.start()
    try:
        assert started.wait(10)
        for i in range(80):  # several rotations, some between two polls
            log.record(_entry(path=f"/new{i}"))
            log.flush()
        _wait_for(lambda: "/new79" in out.getvalue())
    finally:
        done.set()
        thread.join(10)
    log.close()
    assert len(segments(path)) >= 3
    shown = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["path"] for e in shown] == [f"/new{i}" for i in range(80)]
    assert [e["id"] for e in shown] == list(range(2, 82))


def test_follow_with_last_n_reads_back_into_segments(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    out = io.StringIO()
    follow(path, AuditQuery(allowed=False), out, render=json_line, last=20, stop=lambda: True)
    shown = [json.loads(line)["id"] for line in out.getvalue().splitlines()]
    assert len(shown) == 14 and shown[0] < segments(path)[-1].first  # all 14 refusals
    assert shown == sorted(shown)


def test_rotation_size_is_configurable_and_checked() -> None:
    assert AuditConfig().rotate_bytes == 64 << 20
    assert AuditConfig(rotate_bytes=0).rotate_bytes == 0  # never
    with pytest.raises(ValueError, match="at least 4096"):
        AuditConfig(rotate_bytes=100)


def test_genesis_is_only_the_first_files(tmp_path: Path) -> None:
    path = _rotated(tmp_path)
    firsts = [json.loads(f.read_bytes().splitlines()[0])["prev"] for f in log_files(path)]
    assert firsts[0] == GENESIS and GENESIS not in firsts[1:]
