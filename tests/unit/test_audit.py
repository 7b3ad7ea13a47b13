"""The audit log against real files: chaining, tamper detection, concurrent writers, torn
writes, prune, queries, the table, follow and the trio flush task; the anchor (key and chain
head) that finds a cut end or a rebuilt chain; the reserve that keeps denials writable on a full
disk."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import json
import multiprocessing
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxfs.audit import reserve as reserve_mod
from sandboxfs.audit import writer as writer_mod
from sandboxfs.audit.anchor import Anchor, anchor_path
from sandboxfs.audit.common import GENESIS
from sandboxfs.audit.prune import prune
from sandboxfs.audit.reader import AuditQuery, follow, json_line, query, read_entries
from sandboxfs.audit.verify import verify
from sandboxfs.audit.writer import TAMPER_OP, AuditLog
from sandboxfs.cli.audit_table import format_row, format_table
from sandboxfs.core.syscalls import write_all
from sandboxfs.errors import Failure
from sandboxfs.fuse import daemon
from sandboxfs.layout import state_root
from tests.support.audit import T0, _entry, _ts


def _write_log(path: Path, count: int, per_flush: int = 2) -> None:
    log = AuditLog(path)
    for i in range(count):
        log.record(_entry(path=f"/session/f{i + 1}", ts=_ts(i)))
        if (i + 1) % per_flush == 0:
            log.flush()
    log.close()


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _canonical(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _anchor(path: Path) -> Anchor:
    return Anchor.parse(anchor_path(path).read_bytes())


def _mac(key: bytes, digest: str) -> str:
    return hmac.new(key, digest.encode(), hashlib.sha256).hexdigest()


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Anchors go to a directory of this test's own, never to the real ~/.local/state."""
    directory = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(directory))
    return directory


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ----- writing and chaining ------------------------------------------------------------------


def test_chain_of_several_flushes_verifies(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 9, per_flush=2)

    entries = list(read_entries(path))
    assert [e["id"] for e in entries] == list(range(1, 10))
    assert entries[0]["prev"] == GENESIS
    for before, after in pairwise(entries):
        assert after["prev"] == before["hash"]
    key = _anchor(path).key
    for line, entry in zip(_lines(path), entries, strict=True):
        unsealed = {k: v for k, v in entry.items() if k not in ("hash", "mac")}
        assert entry["hash"] == hashlib.sha256(_canonical(unsealed)).hexdigest()
        assert entry["mac"] == _mac(key, entry["hash"])
        # written once: the hashed canonical form, with "hash" and "mac" appended as last keys
        seals = f',"hash":"{entry["hash"]}","mac":"{entry["mac"]}"}}\n'
        assert line == _canonical(unsealed)[:-1] + seals.encode()
    result = verify(path)
    assert result.ok and result.keyed
    assert (result.entries, result.first_bad_line, result.torn_lines) == (9, None, ())
    assert result.message == (
        "ok: 9 entries, chain intact; keyed, and complete up to its anchor's head (id 9)"
    )


def test_record_stamps_utc_time_and_keeps_the_callers_dict(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    mine = _entry()
    log.record(mine)
    log.record(_entry(ts="2026-01-01T00:00:00.000000Z", reason=None))
    log.close()

    assert "ts" not in mine
    first, second = read_entries(path)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", first["ts"])
    assert second["ts"] == "2026-01-01T00:00:00.000000Z"
    assert second["reason"] is None and "reason" in second


def test_creates_private_directories_and_file(tmp_path: Path) -> None:
    path = tmp_path / "state" / "deeper" / "audit.jsonl"
    AuditLog(path).close()
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "state" / "deeper").stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_denial_is_in_the_file_when_record_returns(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record(_entry(path="/allowed"))
    assert path.read_bytes() == b""
    log.record(_entry(path="/repo/secret", allowed=False, reason="no", errno="EACCES"))
    # the denial took the allowed entry queued before it along, in order
    assert [e["path"] for e in read_entries(path)] == ["/allowed", "/repo/secret"]
    log.close()


def test_full_batch_is_flushed(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, batch_size=3, fold=False)
    log.record(_entry())
    log.record(_entry())
    assert path.read_bytes() == b""
    log.record(_entry())
    assert len(list(read_entries(path))) == 3
    log.close()


def test_sync_mode_writes_every_entry_before_record_returns(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, sync=True)
    for i in range(3):
        log.record(_entry(path=f"/f{i}"))
        assert len(list(read_entries(path))) == i + 1
    log.close()
    assert verify(path).ok


def test_flush_of_empty_queue_and_close_are_harmless(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.flush()
    log.close()
    log.close()
    log.flush()
    assert path.read_bytes() == b""
    with pytest.raises(ValueError, match="closed"):
        log.record(_entry())


def test_two_instances_on_one_file_interleave(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    first, second = AuditLog(path), AuditLog(path)
    for round_ in range(5):
        first.record(_entry(session="a", path=f"/a{round_}"))
        second.record(_entry(session="b", path=f"/b{round_}"))
        second.record(_entry(session="b", path=f"/b{round_}x"))
        if round_ % 2:
            first.flush()
            second.flush()
        else:
            second.flush()
            first.flush()
    first.close()
    second.close()

    entries = list(read_entries(path))
    assert [e["id"] for e in entries] == list(range(1, 16))
    assert verify(path).ok
    assert verify(path).entries == 15


def _mount_writer(path: str, name: str, count: int) -> None:
    log = AuditLog(Path(path), batch_size=7)
    for i in range(count):
        log.record(_entry(comm=name, path=f"/{name}/{i}", allowed=i % 50 != 0))
    log.close()


def test_four_processes_write_one_verifiable_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    ctx = multiprocessing.get_context("fork")
    workers = [
        ctx.Process(target=_mount_writer, args=(str(path), f"mount{n}", 500)) for n in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0

    result = verify(path)
    assert result.ok, result.message
    assert result.entries == 2000
    entries = list(read_entries(path))
    assert [e["id"] for e in entries] == list(range(1, 2001))
    for n in range(4):
        mine = [e["path"] for e in entries if e["comm"] == f"mount{n}"]
        assert mine == [f"/mount{n}/{i}" for i in range(500)]


# ----- tamper detection ----------------------------------------------------------------------


def _edit_field(lines: list[bytes]) -> list[bytes]:
    lines[2] = lines[2].replace(b'"allowed":true', b'"allowed":false')
    return lines


def _forge_id(lines: list[bytes]) -> list[bytes]:
    """Change line 4's id and recompute its hash, as someone hiding a gap would (without the
    key, so without a mac)."""
    entry = json.loads(lines[3])
    entry["id"] = 40
    del entry["hash"], entry["mac"]
    entry["hash"] = hashlib.sha256(_canonical(entry)).hexdigest()
    lines[3] = _canonical(entry) + b"\n"
    return lines


TAMPERING: dict[str, tuple[Callable[[list[bytes]], list[bytes]], int, str]] = {
    "edited field": (_edit_field, 3, "line 3: hash mismatch (entry edited)"),
    "inserted copy": (
        lambda ls: [*ls[:4], ls[1], *ls[4:]],
        5,
        "line 5: prev does not match line 4's hash (a line was inserted or removed)",
    ),
    "removed middle line": (
        lambda ls: ls[:2] + ls[3:],
        3,
        "line 3: prev does not match line 2's hash (a line was inserted or removed)",
    ),
    "removed first line": (
        lambda ls: ls[1:],
        1,
        "line 1: the first entry is not id 1 chained to GENESIS"
        " (lines were removed from the start)",
    ),
    "swapped lines": (
        lambda ls: [*ls[:2], ls[3], ls[2], *ls[4:]],
        3,
        "line 3: prev does not match line 2's hash (a line was inserted or removed)",
    ),
    "garbage line": (
        lambda ls: [*ls[:3], b"not json\n", *ls[3:]],
        4,
        "line 4: unparsable line that no recover entry names",
    ),
    "forged id": (_forge_id, 4, "line 4: mac missing (the chain was rebuilt without the key)"),
}


@pytest.mark.parametrize("name", list(TAMPERING))
def test_tampering_is_detected_at_the_right_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 6)
    assert verify(path).ok
    tamper, bad_line, message = TAMPERING[name]
    path.write_bytes(b"".join(tamper(_lines(path))))

    result = verify(path)
    assert not result.ok
    assert result.first_bad_line == bad_line
    assert result.message.startswith(message)


@settings(max_examples=30, deadline=None, database=None)
@given(count=st.integers(2, 8), data=st.data())
def test_any_removed_or_swapped_line_is_found(
    tmp_path_factory: pytest.TempPathFactory, count: int, data: st.DataObject
) -> None:
    path = tmp_path_factory.mktemp("chain") / "audit.jsonl"
    _write_log(path, count)
    lines = _lines(path)
    # The last line can only be removed undetected: nothing after it names its hash.
    index = data.draw(st.integers(0, count - 2))
    if data.draw(st.booleans()):
        del lines[index]
    else:
        lines[index], lines[index + 1] = lines[index + 1], lines[index]
    path.write_bytes(b"".join(lines))
    assert verify(path).first_bad_line == index + 1


def test_forged_id_without_the_anchor_is_still_found_by_the_unkeyed_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 6)
    path.write_bytes(b"".join(_forge_id(_lines(path))))
    anchor_path(path).unlink()
    result = verify(path)
    assert not result.ok and not result.keyed
    assert result.message == "line 4: id 40 does not follow id 3 (a line was inserted or removed)"


def test_verify_of_a_missing_or_empty_log(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    missing = verify(path)
    assert not missing.ok and missing.message == f"no audit log at {path}"
    path.write_bytes(b"")
    assert verify(path).ok and verify(path).entries == 0


# ----- torn writes ---------------------------------------------------------------------------


def test_torn_tail_is_tolerated_then_recovered(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    with path.open("ab") as f:
        f.write(b'{"allowed":true,"op":"wri')

    result = verify(path)
    assert result.ok and result.torn_lines == (4,) and result.entries == 3
    assert "torn lines tolerated: 4" in result.message
    assert [e["id"] for e in read_entries(path)] == [1, 2, 3]

    log = AuditLog(path)
    log.record(_entry(path="/after-crash"))
    log.record(_entry(path="/after-crash-2"))
    log.close()

    lines = _lines(path)
    assert lines[3] == b'{"allowed":true,"op":"wri\n'
    recover = json.loads(lines[4])
    assert recover["op"] == "recover" and recover["torn_line"] == 4 and recover["allowed"] is True
    assert recover["id"] == 4 and recover["prev"] == json.loads(lines[2])["hash"]
    assert [e["id"] for e in read_entries(path)] == [1, 2, 3, 4, 5, 6]
    result = verify(path)
    assert result.ok and result.torn_lines == (4,) and result.entries == 6


def test_open_writer_notices_a_torn_tail_left_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record(_entry(path="/one"))
    log.flush()
    with path.open("ab") as f:  # another mount died in the middle of its write
        f.write(b'{"allowed":false,"op":"re')
    log.record(_entry(path="/two"))
    log.close()
    assert [e["op"] for e in read_entries(path)] == ["read", "recover", "read"]
    assert verify(path).torn_lines == (2,)


def test_torn_first_write(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"op":"mou')
    assert verify(path).ok
    log = AuditLog(path)
    log.record(_entry(op="mount"))
    log.close()
    recover = next(read_entries(path))
    assert (recover["op"], recover["torn_line"], recover["id"], recover["prev"]) == (
        "recover",
        1,
        1,
        GENESIS,
    )
    assert verify(path).ok and verify(path).torn_lines == (1,)


def test_crash_while_recovering_leaves_a_run_the_next_writer_names(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 2)
    with path.open("ab") as f:  # a torn line, then a recovery torn in turn
        f.write(b'{"op":"wr\n{"op":"recover","torn_li')
    assert not verify(path).ok  # line 3 is not the last line and nothing names it yet
    log = AuditLog(path)
    log.record(_entry())
    log.close()
    assert json.loads(_lines(path)[4])["torn_line"] == 3
    result = verify(path)
    assert result.ok and result.torn_lines == (3, 4), result.message


def test_lines_longer_than_the_tail_read_are_chained_and_recovered(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record(_entry(reason="r" * 300_000))
    log.record(_entry(reason="s" * 200_000))
    log.close()
    with path.open("ab") as f:
        f.write(b'{"reason":"' + b"t" * 150_000)
    log = AuditLog(path)  # a fresh writer has to find the last entry by reading back
    log.record(_entry(path="/after"))
    log.close()
    assert [(e["id"], e["op"]) for e in read_entries(path)] == [
        (1, "read"),
        (2, "read"),
        (3, "recover"),
        (4, "read"),
    ]
    result = verify(path)
    assert result.ok and result.torn_lines == (3,), result.message


def test_torn_line_in_the_middle_without_recover_entry_is_not_ok(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 4)
    lines = _lines(path)
    lines.insert(2, b'{"allowed":true,"op":"wri\n')
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert not result.ok and result.first_bad_line == 3


def test_removing_a_torn_line_is_found_by_the_next_recover_entry(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 2)
    for _ in range(2):  # two crashes, each recovered by the next writer
        with path.open("ab") as f:
            f.write(b'{"op":"wr')
        log = AuditLog(path)
        log.record(_entry())
        log.close()
    assert verify(path).torn_lines == (3, 6)
    lines = _lines(path)
    del lines[2]  # the chain does not cover torn lines, but the later recover entry names line 6
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert not result.ok and result.first_bad_line == 5


# ----- prune ---------------------------------------------------------------------------------


def test_prune_drops_old_entries_and_keeps_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 10)  # entry i (1-based) has ts T0 + (i - 1) minutes
    writer = AuditLog(path)  # a mount that stays open across the prune
    old_lines = _lines(path)

    assert prune(path, T0 + timedelta(minutes=4)) == 4

    lines = _lines(path)
    assert lines[1:] == old_lines[4:]  # byte for byte
    header = json.loads(lines[0])
    assert header["op"] == "prune" and header["dropped"] == 4 and header["allowed"] is True
    assert header["before"] == "2026-11-22T08:04:00.000000Z"
    assert header["anchor"] == json.loads(old_lines[3])["hash"] and header["id"] == 4
    assert header["prev"] == GENESIS
    result = verify(path)
    assert result.ok and result.entries == 6, result.message
    assert "prune header" in result.message

    writer.record(_entry(path="/after-prune"))
    writer.close()
    assert [e["id"] for e in read_entries(path)] == [4, *range(5, 12)]
    assert verify(path).ok and verify(path).entries == 7


def test_prune_twice_and_prune_everything(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 10)
    assert prune(path, T0 + timedelta(minutes=3)) == 3
    assert prune(path, T0 + timedelta(minutes=7)) == 4
    header = next(read_entries(path))
    assert (header["op"], header["id"], header["dropped"]) == ("prune", 7, 4)
    assert sum(1 for e in read_entries(path) if e["op"] == "prune") == 1
    assert verify(path).ok and verify(path).entries == 3

    assert prune(path, T0 + timedelta(days=1)) == 3
    assert [e["op"] for e in read_entries(path)] == ["prune"]
    assert verify(path).ok and verify(path).entries == 0
    log = AuditLog(path)
    log.record(_entry())
    log.close()
    assert [e["id"] for e in read_entries(path)] == [10, 11]
    assert verify(path).ok and verify(path).entries == 1


def test_prune_stops_at_the_first_newer_entry(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for minutes in (0, 1, 5, 2, 6):  # mounts flush batches late: ts is not file order
        log.record(_entry(ts=_ts(minutes)))
    log.close()
    assert prune(path, T0 + timedelta(minutes=3)) == 2
    assert [e["ts"] for e in read_entries(path)][1:] == [_ts(5), _ts(2), _ts(6)]
    assert verify(path).ok


def test_prune_without_old_entries_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    assert prune(path, T0) == 0
    _write_log(path, 3)
    before = path.read_bytes()
    assert prune(path, T0) == 0
    assert path.read_bytes() == before


def test_prune_drops_torn_lines_and_keeps_recover_entries(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 4)
    with path.open("ab") as f:
        f.write(b'{"op":"wr')
    log = AuditLog(path)
    log.record(_entry(ts=_ts(30)))
    log.close()
    assert prune(path, T0 + timedelta(minutes=2)) == 2
    assert [e["op"] for e in read_entries(path)] == ["prune", "read", "read", "recover", "read"]
    assert b'{"op":"wr' not in path.read_bytes()
    result = verify(path)
    assert result.ok and result.torn_lines == ()


# ----- queries -------------------------------------------------------------------------------


@pytest.fixture
def mixed_log(tmp_path: Path) -> Path:
    """Two mounts whose entries reach the file out of time order."""
    path = tmp_path / "audit.jsonl"
    one, two = AuditLog(path), AuditLog(path)
    one.record(_entry(ts=_ts(0), op="mount", session="s1", pid=1))
    one.record(_entry(ts=_ts(2), op="write", zone="session", pid=1, path="/s/a"))
    two.record(_entry(ts=_ts(1), op="mount", session="s2", workspace="w2", trust="full", pid=2))
    two.record(_entry(ts=_ts(3), session="s2", workspace="w2", trust="full", zone="repo", pid=2))
    two.flush()
    one.record(
        _entry(
            ts=_ts(4),
            zone="repo",
            pid=1,
            path="/repo/.env",
            allowed=False,
            errno="EACCES",
            reason="denied file",
        )
    )
    one.record(_entry(ts=_ts(5), op="list", zone="workers", pid=1, path="/workers"))
    one.close()
    two.close()
    return path


def _times(entries: list[dict[str, Any]]) -> list[float]:
    return [(datetime.fromisoformat(e["ts"]) - T0).total_seconds() / 60 for e in entries]


@pytest.mark.parametrize(
    ("q", "minutes"),
    [
        (AuditQuery(), [0, 1, 2, 3, 4, 5]),
        (AuditQuery(session="s2"), [1, 3]),
        (AuditQuery(workspace="w2"), [1, 3]),
        (AuditQuery(op="mount"), [0, 1]),
        (AuditQuery(zone="repo"), [3, 4]),
        (AuditQuery(trust="full"), [1, 3]),
        (AuditQuery(allowed=False), [4]),
        (AuditQuery(allowed=True), [0, 1, 2, 3, 5]),
        (AuditQuery(pid=2), [1, 3]),
        (AuditQuery(zone="repo", allowed=True), [3]),
        (AuditQuery(since=T0 + timedelta(minutes=2)), [2, 3, 4, 5]),
        (AuditQuery(until=T0 + timedelta(minutes=2)), [0, 1]),
        (AuditQuery(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=3)), [1, 2]),
        (AuditQuery(since=datetime(2026, 11, 22, 8, 4)), [4, 5]),  # naive means UTC
        (AuditQuery(limit=2), [4, 5]),
        (AuditQuery(pid=1, limit=3), [2, 4, 5]),
        (AuditQuery(limit=0), []),
        (AuditQuery(session="nobody"), []),
    ],
)
def test_query_filters(mixed_log: Path, q: AuditQuery, minutes: list[int]) -> None:
    assert _times(query(mixed_log, q)) == minutes


def test_query_merges_in_time_order_and_is_stable(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for name, minutes in [("c", 2), ("a", 1), ("d", 2), ("b", 1)]:
        log.record(_entry(path=name, ts=_ts(minutes)))
    log.close()
    assert [e["path"] for e in query(path, AuditQuery())] == ["a", "b", "c", "d"]


def test_query_of_missing_file_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    assert query(path, AuditQuery()) == []
    assert list(read_entries(path)) == []
    _write_log(path, 2)
    with path.open("ab") as f:
        f.write(b'{"allowed":false,"op":"re')
    assert query(path, AuditQuery(allowed=False)) == []
    assert len(query(path, AuditQuery())) == 2


def test_query_over_200k_lines_counts_right(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, batch_size=10_000, fold=False)
    for i in range(200_000):
        denied = i % 100 == 7
        log.record(
            _entry(
                ts=_ts(i / 1000),
                session=f"s{i % 4}",
                op=("read", "write", "list")[i % 3],
                allowed=not denied,
                reason="repo is not readable at trust level untrusted" if denied else None,
                errno="EACCES" if denied else None,
                pid=1000 + i % 7,
            )
        )
    log.close()
    assert len(query(path, AuditQuery(allowed=False))) == 2000
    assert len(query(path, AuditQuery(allowed=False, session="s3"))) == 2000
    assert len(query(path, AuditQuery(allowed=False, session="s1"))) == 0
    assert len(query(path, AuditQuery(pid=1003, op="list"))) == sum(
        1 for i in range(200_000) if i % 7 == 3 and i % 3 == 2
    )
    last = query(path, AuditQuery(allowed=False, limit=5))
    assert [e["id"] for e in last] == [199_508, 199_608, 199_708, 199_808, 199_908]


# ----- table ---------------------------------------------------------------------------------


def test_format_table(mixed_log: Path) -> None:
    entries = query(mixed_log, AuditQuery())
    entries.append(_entry(op="rename", path="/session/a", dest="/session/b", ts=_ts(6)))
    lines = format_table(entries).splitlines()

    assert lines[0].split() == ["TIME", "OP", "RESULT", "ZONE", "PATH", "PROCESS", "REASON"]
    assert len(lines) == 1 + len(entries)
    denial = lines[5]
    assert denial.startswith("2026-11-22 08:04:00  read")
    assert "DENIED" in denial and "/repo/.env" in denial and "cat[1]" in denial
    assert denial.endswith("EACCES: denied file")
    assert " ok " in lines[1] and "mount" in lines[1]
    assert "/session/a -> /session/b" in lines[-1]
    assert format_table([]) == lines[0]


def test_format_table_shows_a_rename_across_zones_as_failed_not_ok() -> None:
    """EXDEV is no refusal (`allowed` is null: mv copies instead), but nothing was renamed."""
    reason = "renames cannot cross zones (repo -> session); copy the file instead"
    entries = [
        _entry(
            op=op,
            path="/repo/a",
            dest="/session/working/a",
            zone="repo",
            allowed=None,
            errno="EXDEV",
            reason=reason,
            ts=_ts(0),
        )
        for op in ("rename", "link")
    ]
    for row in format_table(entries).splitlines()[1:]:
        cells = row.split()
        assert cells[3] == "failed", row
        assert "ok" not in cells[:4]
        assert row.endswith(f"EXDEV: {reason}")
        assert "/repo/a -> /session/working/a" in row


def test_format_table_keeps_long_paths_and_escapes_control_characters() -> None:
    long_path = "/workspace/" + "d/" * 60 + "file.txt"
    table = format_table(
        [
            _entry(path=long_path, ts=_ts(0)),
            _entry(path="/x\n2026-11-22 08:00:00  read  ok", comm="sh\x1b[2J", ts=_ts(0)),
            _entry(path="/bad-\udcff-name", ts=_ts(0)),
        ]
    )
    lines = table.splitlines()
    assert len(lines) == 4
    assert long_path in lines[1]
    assert "/x\\n2026" in lines[2] and "sh\\x1b[2J[4242]" in lines[2]
    assert "/bad-\\udcff-name" in lines[3]
    table.encode("utf-8")  # printable on any terminal


# ----- follow --------------------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [True, False])
def test_follow_streams_new_entries_across_prune(tmp_path: Path, as_json: bool) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record(_entry(op="write", path="/old", ts=_ts(0)))
    log.flush()
    out = io.StringIO()
    started, done = threading.Event(), threading.Event()

    def stop() -> bool:
        started.set()
        return done.is_set()

    thread = threading.Thread(
        target=follow,
        args=(path, AuditQuery(op="write"), out),
        kwargs={"render": json_line if as_json else format_row, "poll": 0.01, "stop": stop},
    )
    thread.start()
    try:
        assert started.wait(10)
        log.record(_entry(op="write", path="/a", ts=_ts(1)))
        log.record(_entry(op="read", path="/b", ts=_ts(2)))
        log.flush()
        _wait_for(lambda: "/a" in out.getvalue())
        assert prune(path, T0 + timedelta(minutes=1)) == 1
        log.record(_entry(op="write", path="/c", ts=_ts(3), allowed=False))
        _wait_for(lambda: "/c" in out.getvalue())
    finally:
        done.set()
        thread.join(10)
    log.close()

    lines = out.getvalue().splitlines()
    if as_json:
        assert [json.loads(line)["path"] for line in lines] == ["/a", "/c"]
        assert [json.loads(line)["id"] for line in lines] == [2, 4]
    else:
        assert len(lines) == 2
        assert "/a" in lines[0] and "/c" in lines[1] and "DENIED" in lines[1]


def test_follow_waits_for_the_log_to_appear(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    out = io.StringIO()

    def stop() -> bool:  # first called once follow has found no log
        if not path.exists():
            log = AuditLog(path)
            log.record(_entry(path="/first"))
            log.close()
        return "/first" in out.getvalue()

    follow(path, AuditQuery(), out, render=json_line, poll=0.001, stop=stop)
    assert json.loads(out.getvalue())["path"] == "/first"


# ----- the trio flush task -------------------------------------------------------------------


@pytest.mark.trio
async def test_run_flushes_periodically_and_when_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon._flush_audit, log, 0.01)
        log.record(_entry(path="/periodic"))
        with trio.fail_after(10):
            while b"/periodic" not in path.read_bytes():
                await trio.sleep(0.01)
        log.record(_entry(path="/at-cancel"))
        nursery.cancel_scope.cancel()
    assert [e["path"] for e in read_entries(path)] == ["/periodic", "/at-cancel"]
    log.close()
    assert verify(path).ok


# ----- the anchor: key and chain head --------------------------------------------------------


def _cut(path: Path, count: int) -> None:
    """What `head -n -count log > x && mv x log` does."""
    path.write_bytes(b"".join(_lines(path)[:-count]))


def _rebuild(lines: list[bytes], edit: Callable[[dict[str, Any]], None]) -> list[bytes]:
    """The whole chain recomputed after `edit`ing every entry, by someone without the key: every
    hash and prev consistent again, macs dropped (they cannot be made)."""
    rebuilt, prev = [], GENESIS
    for line in lines:
        entry = json.loads(line)
        del entry["hash"]
        entry.pop("mac", None)
        edit(entry)
        entry["prev"] = prev
        entry["hash"] = prev = hashlib.sha256(_canonical(entry)).hexdigest()
        rebuilt.append(_canonical(entry) + b"\n")
    return rebuilt


def _legacy_log(path: Path, count: int) -> None:
    """A log as written before entries were keyed: the chain, no mac, no anchor."""
    prev, out = GENESIS, b""
    for i in range(1, count + 1):
        entry = _entry(path=f"/old{i}", ts=_ts(i)) | {"id": i, "prev": prev}
        entry["hash"] = prev = hashlib.sha256(_canonical(entry)).hexdigest()
        out += _canonical(entry) + b"\n"
    path.write_bytes(out)


def test_anchor_lives_in_the_private_state_dir_and_holds_key_and_head(
    tmp_path: Path, state_dir: Path
) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 5)
    name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()
    assert anchor_path(path) == state_dir / "anchors" / name
    assert [p.name for p in (state_dir / "anchors").iterdir()] == [name]  # no leftovers
    assert stat.S_IMODE((state_dir / "anchors").stat().st_mode) == 0o700
    assert stat.S_IMODE(anchor_path(path).stat().st_mode) == 0o600
    anchor = _anchor(path)
    last = list(read_entries(path))[-1]
    assert len(anchor.key) == 32 and anchor.keyed_from == 1
    assert (anchor.head_id, anchor.head_hash) == (5, last["hash"])
    assert str(path) in anchor_path(path).read_text()  # for people wondering whose it is


def test_state_root_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_root() == tmp_path / "explicit"
    monkeypatch.delenv("SANDBOXFS_STATE_DIR")
    assert state_root() == tmp_path / "xdg" / "sandboxfs"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # ignored, as the XDG spec says
    assert state_root() == tmp_path / "home" / ".local" / "state" / "sandboxfs"
    monkeypatch.delenv("XDG_STATE_HOME")
    AuditLog(tmp_path / "log" / "audit.jsonl").close()
    made = tmp_path / "home" / ".local" / "state" / "sandboxfs" / "anchors"
    for directory in (made, *list(made.parents)[:3]):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


def test_every_flush_moves_the_head(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    assert (_anchor(path).head_id, _anchor(path).head_hash) == (0, GENESIS)
    for i in range(3):
        log.record(_entry(path=f"/{i}"))
        log.flush()
        assert _anchor(path).head_id == i + 1
        assert _anchor(path).head_hash == list(read_entries(path))[-1]["hash"]
    log.close()


@pytest.mark.parametrize("count", [1, 3, 10])
def test_cut_end_is_detected(tmp_path: Path, count: int) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 10)
    _cut(path, count)
    result = verify(path)
    assert not result.ok and result.keyed and result.first_bad_line is None
    assert result.message == (
        f"the log ends at id {10 - count} but its anchor says id 10 was written:"
        " entries were removed from the end"
    )


def test_deleted_log_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 4)
    path.unlink()
    result = verify(path)
    assert not result.ok
    assert result.message == f"no audit log at {path}, but its anchor says id 4 was written"


def test_a_writer_does_not_hide_a_cut_end_it_finds(tmp_path: Path) -> None:
    """Appending after a cut would move the head there; the writer records the cut instead."""
    path = tmp_path / "audit.jsonl"
    _write_log(path, 10)
    _cut(path, 3)
    log = AuditLog(path)  # the next mount
    log.record(_entry(path="/after-the-cut"))
    log.close()
    entries = list(read_entries(path))
    tamper = entries[7]
    assert tamper["op"] == TAMPER_OP and tamper["id"] == 8
    assert (tamper["found_id"], tamper["anchor_id"]) == (7, 10)
    assert entries[8]["path"] == "/after-the-cut"
    result = verify(path)
    assert not result.ok and result.first_bad_line == 8
    assert result.message == (
        "line 8: a writer found the log tampered with: the log ended at id 7 but its anchor"
        " says id 10 was written: entries were removed from the end"
    )
    # A made-up tamper entry (no mac) is a forgery in itself.
    lines = _lines(path)
    forged = json.loads(lines[7])
    forged["mac"] = "0" * 64
    lines[7] = _canonical(forged) + b"\n"
    path.write_bytes(b"".join(lines))
    assert verify(path).message == "line 8: mac mismatch (the chain was rebuilt without the key)"


def test_rebuilt_chain_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for i in range(6):
        log.record(_entry(path=f"/f{i}", allowed=i != 3, ts=_ts(i)))
    log.close()
    lines = _lines(path)

    def hide_the_denial(entry: dict[str, Any]) -> None:
        entry["allowed"] = True

    path.write_bytes(b"".join(_rebuild(lines, hide_the_denial)))
    result = verify(path)
    assert not result.ok and result.first_bad_line == 1
    assert result.message == "line 1: mac missing (the chain was rebuilt without the key)"

    # Keeping the old macs does not help: they are of the old hashes.
    rebuilt = _rebuild(lines, hide_the_denial)
    for i, (old, new) in enumerate(zip(lines, rebuilt, strict=True)):
        entry = json.loads(new)
        entry["mac"] = json.loads(old)["mac"]
        rebuilt[i] = _canonical(entry) + b"\n"
    path.write_bytes(b"".join(rebuilt))
    # The first three entries are unchanged, so their old macs still fit: line 4 is found.
    assert verify(path).message == "line 4: mac mismatch (the chain was rebuilt without the key)"

    # A forged entry appended after the head has no valid mac either.
    extra = json.loads(lines[-1]) | {"id": 7, "prev": json.loads(lines[-1])["hash"]}
    del extra["hash"], extra["mac"]
    extra["hash"] = hashlib.sha256(_canonical(extra)).hexdigest()
    extra["mac"] = "f" * 64
    path.write_bytes(b"".join([*lines, _canonical(extra) + b"\n"]))
    assert verify(path).message == "line 7: mac mismatch (the chain was rebuilt without the key)"


def test_rebuilt_chain_before_the_key_is_found_by_the_head(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _legacy_log(path, 5)
    AuditLog(path).close()  # the anchor is made: keyed from 6, head at 5
    path.write_bytes(b"".join(_rebuild(_lines(path), lambda e: e.update(comm="innocent"))))
    result = verify(path)
    assert not result.ok and result.first_bad_line == 5
    assert (
        result.message == "line 5: id 5 is not the entry its anchor records (the chain was rebuilt)"
    )


def test_two_writers_share_one_key_and_one_head(tmp_path: Path, state_dir: Path) -> None:
    path = tmp_path / "audit.jsonl"
    first, second = AuditLog(path), AuditLog(path)  # both open before either wrote
    for round_ in range(4):
        first.record(_entry(session="a", path=f"/a{round_}"))
        second.record(_entry(session="b", path=f"/b{round_}"))
        (first if round_ % 2 else second).flush()
        (second if round_ % 2 else first).flush()
        entries = list(read_entries(path))
        assert _anchor(path).head_id == entries[-1]["id"] == 2 * round_ + 2
    first.close()
    second.close()
    assert len(list((state_dir / "anchors").iterdir())) == 1
    key = _anchor(path).key
    assert all(e["mac"] == _mac(key, e["hash"]) for e in read_entries(path))
    result = verify(path)
    assert result.ok and result.keyed and result.entries == 8, result.message


def test_four_processes_share_one_anchor(tmp_path: Path, state_dir: Path) -> None:
    path = tmp_path / "audit.jsonl"
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_mount_writer, args=(str(path), f"m{n}", 300)) for n in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert len(list((state_dir / "anchors").iterdir())) == 1
    result = verify(path)
    assert result.ok and result.keyed and result.unkeyed_entries == 0, result.message
    assert _anchor(path).head_id == 1200


def test_writers_follow_an_anchor_made_anew(tmp_path: Path) -> None:
    """The anchor deleted while a mount runs: the next writer makes a new key, keyed from the
    next id, and the running one switches to it instead of writing macs nobody can check."""
    path = tmp_path / "audit.jsonl"
    running = AuditLog(path)
    running.record(_entry(path="/1"))
    running.flush()
    anchor_path(path).unlink()
    newcomer = AuditLog(path)
    running.record(_entry(path="/2"))
    running.flush()
    newcomer.record(_entry(path="/3"))
    newcomer.close()
    running.close()
    anchor = _anchor(path)
    assert (anchor.keyed_from, anchor.head_id) == (2, 3)
    result = verify(path)
    assert result.ok and result.unkeyed_entries == 1, result.message
    assert result.message == (
        "ok: 3 entries, chain intact; keyed, and complete up to its anchor's head (id 3);"
        " the first 1 entries predate keyed entries (written before this anchor existed)"
    )


def test_prune_keeps_the_keyed_chain_and_head(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 10)
    writer = AuditLog(path)  # open across the prune
    assert prune(path, T0 + timedelta(minutes=4)) == 4
    header = json.loads(_lines(path)[0])
    assert header["mac"] == _mac(_anchor(path).key, header["hash"])
    result = verify(path)
    assert result.ok and result.keyed and result.entries == 6, result.message
    assert result.message == (
        "ok: 6 entries, chain intact from the prune header (entries up to id 4 pruned);"
        " keyed, and complete up to its anchor's head (id 10)"
    )
    writer.record(_entry(path="/after-prune"))
    writer.close()
    assert verify(path).ok and _anchor(path).head_id == 11

    # everything, the entry just recorded (stamped now) included: the header takes id 11
    assert prune(path, datetime.now(UTC) + timedelta(days=1)) == 7
    assert [(e["op"], e["id"]) for e in read_entries(path)] == [("prune", 11)]
    result = verify(path)
    assert result.ok and result.entries == 0, result.message
    _cut(path, 1)
    assert verify(path).message == (
        "the log ends at id 0 but its anchor says id 11 was written:"
        " entries were removed from the end"
    )


def test_made_up_prune_header_is_detected(tmp_path: Path) -> None:
    """Dropping the start and writing a header like prune's takes the key."""
    path = tmp_path / "audit.jsonl"
    _write_log(path, 6)
    lines = _lines(path)
    dropped = json.loads(lines[2])
    header = {
        "op": "prune",
        "before": _ts(3),
        "dropped": 3,
        "anchor": dropped["hash"],
        "ts": _ts(9),
        "allowed": True,
        "id": 3,
        "prev": GENESIS,
    }
    header["hash"] = hashlib.sha256(_canonical(header)).hexdigest()
    path.write_bytes(b"".join([_canonical(header) + b"\n", *lines[3:]]))
    result = verify(path)
    assert not result.ok and result.first_bad_line == 1
    assert result.message == (
        "line 1: mac missing on the prune header"
        " (entries were removed from the start without the key)"
    )


def test_legacy_log_verifies_and_is_keyed_from_the_next_entry(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _legacy_log(path, 5)
    before = verify(path)
    assert before.ok and not before.keyed
    assert before.message == (
        f"ok: 5 entries, chain intact; unkeyed check only (no anchor at {anchor_path(path)}):"
        " a cut end or a rebuilt chain would not show"
    )
    log = AuditLog(path)
    for i in range(3):
        log.record(_entry(path=f"/new{i}"))
    log.close()
    entries = list(read_entries(path))
    assert ["mac" in e for e in entries] == [False] * 5 + [True] * 3
    after = verify(path)
    assert after.ok and after.keyed and after.unkeyed_entries == 5
    assert after.message == (
        "ok: 8 entries, chain intact; keyed, and complete up to its anchor's head (id 8);"
        " the first 5 entries predate keyed entries (written before this anchor existed)"
    )
    # The unkeyed entries are still covered by the chain up to the first keyed one...
    lines = _lines(path)
    lines[1] = lines[1].replace(b"/old2", b"/od2x")
    path.write_bytes(b"".join(lines))
    assert verify(path).message == "line 2: hash mismatch (entry edited)"
    # ...and a keyed entry stripped of its mac is not taken for an old one.
    lines = _lines(path)
    lines[1] = lines[1].replace(b"/od2x", b"/old2")
    entry = json.loads(lines[6])
    del entry["mac"]
    lines[6] = _canonical(entry) + b"\n"
    path.write_bytes(b"".join(lines))
    assert verify(path).message == "line 7: mac missing (the chain was rebuilt without the key)"


def test_missing_anchor_is_said_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 5)
    keyed = anchor_path(path)
    # Another user (or root via sudo) has another state directory.
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(tmp_path / "someone-else"))
    other = verify(path)
    assert other.ok and not other.keyed
    assert other.message == (
        f"ok: 5 entries, chain intact; unkeyed check only (no anchor at {anchor_path(path)},"
        " though 5 entries carry a mac: moved project? deleted anchor?):"
        " a cut end or a rebuilt chain would not show"
    )
    monkeypatch.undo()
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(keyed.parent.parent))
    keyed.unlink()
    _cut(path, 2)  # without the anchor, nothing can tell
    result = verify(path)
    assert result.ok and not result.keyed and "unkeyed check only" in result.message


def test_malformed_anchor_is_said_plainly(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 2)
    anchor_path(path).write_bytes(b"garbage\n")
    result = verify(path)
    assert result.ok and not result.keyed
    assert f"unkeyed check only (the anchor {anchor_path(path)} is malformed" in result.message


def test_without_a_usable_state_dir_the_log_is_not_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key, no entry: an unkeyed entry after keyed ones reads as a rebuilt chain forever."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record(_entry(allowed=False))
    log.close()
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(blocker / "state"))
    with pytest.raises(Failure, match=r"Not a directory.*no entry is written without its key"):
        AuditLog(path)
    assert [("mac" in e) for e in read_entries(path)] == [True]


def test_an_anchor_that_cannot_be_made_again_fails_the_log_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The anchor deleted under a live log and its directory unusable: entries stay queued
    (the log is failing, so the mount refuses operations), none is written without a mac."""
    monkeypatch.setattr(writer_mod, "_RETRY_EVERY", 0.0)
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    try:
        log.record(_entry(path="/keyed"))
        log.flush()
        anchors = anchor_path(path).parent
        shutil.rmtree(anchors)
        anchors.write_text("")
        log.record(_entry(path="/queued"))
        assert not log.try_flush()
        assert log.failing
        assert [e["path"] for e in read_entries(path)] == ["/keyed"]
        anchors.unlink()
        assert log.try_flush() and not log.failing
    finally:
        log.close()
    assert [("mac" in e) for e in read_entries(path)] == [True, True]
    assert verify(path).ok


# ----- the reserve: a denial reaches the disk even when it is full ----------------------------

SMALL_RESERVE = 256 << 10


def _size(path: Path) -> int:
    return path.stat().st_size


def test_reserve_is_preallocated_beside_the_log(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    AuditLog(path).close()
    reserve = tmp_path / "audit.reserve"
    st = reserve.stat()
    assert st.st_size == reserve_mod.RESERVE_BYTES
    assert st.st_blocks * 512 >= reserve_mod.RESERVE_BYTES  # allocated, not sparse
    assert stat.S_IMODE(st.st_mode) == 0o600
    AuditLog(path, reserve=SMALL_RESERVE).close()  # never shrunk by a smaller setting
    assert _size(reserve) == reserve_mod.RESERVE_BYTES


class _FullDisk:
    """`_write_all` that fails with ENOSPC until the reserve shrinks below `until` (or for
    ever): a file system that the reserve, given back, makes room on."""

    def __init__(self, reserve: Path, until: int | None) -> None:
        self.reserve = reserve
        self.until = until
        self.refused = 0
        self.real = write_all  # the one audit.writer imports, before the test patches it there

    def __call__(self, fd: int, data: bytes | bytearray) -> None:
        if self.until is None or _size(self.reserve) >= self.until:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real(fd, data)


def test_full_disk_gives_back_reserve_for_a_denial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    reserve = tmp_path / "audit.reserve"
    log = AuditLog(path, reserve=SMALL_RESERVE)
    log.record(_entry(path="/before"))
    full = _FullDisk(reserve, until=SMALL_RESERVE)
    monkeypatch.setattr(writer_mod, "write_all", full)
    log.record(_entry(path="/repo/.env", allowed=False, errno="EACCES"))
    assert [e["path"] for e in read_entries(path)] == ["/before", "/repo/.env"]
    assert full.refused == 1 and _size(reserve) < SMALL_RESERVE
    assert not log.failing
    # Space returns: the next write fills the reserve up again.
    monkeypatch.setattr(writer_mod, "write_all", full.real)
    monkeypatch.setattr(reserve_mod, "_REFILL_EVERY", 0.0)
    log.record(_entry(path="/later", allowed=False))
    assert _size(reserve) == SMALL_RESERVE
    log.close()
    assert verify(path).ok


def test_failing_when_even_the_reserve_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    reserve = tmp_path / "audit.reserve"
    log = AuditLog(path, reserve=SMALL_RESERVE)
    full = _FullDisk(reserve, until=None)
    monkeypatch.setattr(writer_mod, "write_all", full)
    log.record(_entry(path="/denied-1", allowed=False))
    assert log.failing
    assert _size(reserve) == 0 and path.read_bytes() == b""  # no torn line left either
    log.record(_entry(path="/denied-2", allowed=False))
    assert log.failing and not log.try_flush()
    monkeypatch.setattr(writer_mod, "write_all", full.real)
    assert not log.try_flush()  # while failing, at most one attempt every _RETRY_EVERY
    time.sleep(writer_mod._RETRY_EVERY)
    log.record(_entry(path="/denied-2", allowed=False))  # not written again: counted
    assert log.try_flush() and not log.failing
    assert [e["path"] for e in read_entries(path)] == ["/denied-1", "/denied-2"]
    log.close()
    assert [e.get("count") for e in read_entries(path)] == [None, None, 1]
    assert verify(path).ok


@contextlib.contextmanager
def _small_tmpfs(where: Path, size: str) -> Any:
    """A tmpfs of `size` mounted at `where` (root only), unmounted whatever happens."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> Path:
    """A file that takes all the free space of `directory`'s file system."""
    filler = directory / "filler"
    chunk = b"\0" * (64 << 10)
    with filler.open("wb", buffering=0) as f:
        for step in (chunk, b"\0" * 4096, b"\0"):
            with contextlib.suppress(OSError):
                while True:
                    f.write(step)
    assert os.statvfs(directory).f_bavail == 0
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs takes root")
def test_denial_lands_on_a_really_full_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reserve_mod, "_REFILL_EVERY", 0.0)
    monkeypatch.setattr(writer_mod, "_RETRY_EVERY", 0.0)
    with _small_tmpfs(tmp_path / "small", "2m") as fs:
        path = fs / ".sandbox" / "audit.jsonl"
        log = AuditLog(path, reserve=SMALL_RESERVE, fold=False)
        try:
            reserve = path.with_suffix(".reserve")
            assert _size(reserve) == SMALL_RESERVE
            filler = _fill(fs)  # an agent filling its zones: the log shares the file system
            reason = "x" * 1000  # long entries, so that the log needs new pages
            for i in range(50):
                log.record(_entry(op="read", path=f"/repo/.env{i}", allowed=False, reason=reason))
                assert not log.failing
                assert list(read_entries(path))[-1]["path"] == f"/repo/.env{i}"  # on disk
            assert _size(reserve) < SMALL_RESERVE
            # Fail closed once even the reserve is used up; nothing written is lost.
            for i in range(2000):
                log.record(_entry(path=f"/repo/more{i}", allowed=False, reason=reason * 4))
                if log.failing:
                    break
            assert log.failing and _size(reserve) == 0
            queued = i + 1
            filler.unlink()  # space returns
            assert log.try_flush() and not log.failing
            written = [e["path"] for e in read_entries(path)]
            assert written[-queued:] == [f"/repo/more{n}" for n in range(queued)]
            assert _size(reserve) == SMALL_RESERVE  # made again
        finally:
            log.close()
        result = verify(path)
        assert result.ok and result.keyed, result.message


def test_the_table_shows_an_entry_neither_allowed_nor_refused_as_such() -> None:
    """An approval request asking the user is neither allowed nor refused: `-`, with what it
    asked; a cross-zone rename that failed (EXDEV) is `failed`, with the errno."""
    asked = _entry(op="approval", allowed=None, detail="request 1: delete of /x asks the user")
    row = format_row(asked)
    assert "  -  " in row and row.rstrip().endswith("request 1: delete of /x asks the user")
    failed = _entry(op="rename", allowed=None, errno="EXDEV", reason="across zones")
    assert "failed" in format_row(failed)
    assert "EXDEV: across zones" in format_row(failed)
