"""The audit log against real files: chaining, tamper detection, concurrent writers, torn
writes, prune, queries, the table, follow and the trio flush task."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import re
import stat
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

from sandboxfs.audit import (
    GENESIS,
    AuditLog,
    AuditQuery,
    follow,
    format_table,
    prune,
    query,
    read_entries,
    verify,
)

T0 = datetime(2026, 11, 22, 8, 0, tzinfo=UTC)


def _ts(minutes: float) -> str:
    moment = T0 + timedelta(minutes=minutes)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _entry(**fields: Any) -> dict[str, Any]:
    """An entry shaped like the ones the FUSE adapter records."""
    base: dict[str, Any] = {
        "op": "read",
        "path": "/session/working/a.txt",
        "dest": None,
        "zone": "session",
        "session": "s1",
        "workspace": "default",
        "trust": "untrusted",
        "allowed": True,
        "reason": None,
        "errno": None,
        "pid": 4242,
        "uid": 1000,
        "comm": "cat",
        "bytes": None,
    }
    return base | fields


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
    for line, entry in zip(_lines(path), entries, strict=True):
        without_hash = {k: v for k, v in entry.items() if k != "hash"}
        assert entry["hash"] == hashlib.sha256(_canonical(without_hash)).hexdigest()
        # written once: the hashed canonical form, with "hash" appended as the last key
        assert line == _canonical(without_hash)[:-1] + f',"hash":"{entry["hash"]}"}}\n'.encode()
    result = verify(path)
    assert result.ok
    assert (result.entries, result.first_bad_line, result.torn_lines) == (9, None, ())
    assert result.message == "ok: 9 entries, chain intact"


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
    log = AuditLog(path, batch_size=3)
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
    """Change line 4's id and recompute its hash, as someone hiding a gap would."""
    entry = json.loads(lines[3])
    entry["id"] = 40
    del entry["hash"]
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
    "forged id": (_forge_id, 4, "line 4: id 40 does not follow id 3"),
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
    log = AuditLog(path, batch_size=10_000)
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
        kwargs={"as_json": as_json, "poll": 0.01, "stop": stop},
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

    follow(path, AuditQuery(), out, as_json=True, poll=0.001, stop=stop)
    assert json.loads(out.getvalue())["path"] == "/first"


# ----- the trio flush task -------------------------------------------------------------------


@pytest.mark.trio
async def test_run_flushes_periodically_and_when_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.run, 0.01)
        log.record(_entry(path="/periodic"))
        with trio.fail_after(10):
            while b"/periodic" not in path.read_bytes():
                await trio.sleep(0.01)
        log.record(_entry(path="/at-cancel"))
        nursery.cancel_scope.cancel()
    assert [e["path"] for e in read_entries(path)] == ["/periodic", "/at-cancel"]
    log.close()
    assert verify(path).ok
