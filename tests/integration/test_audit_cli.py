"""`sandboxfs audit` on real mounts: the table, JSON, every filter, verify (with the anchor that
finds a cut end or a rebuilt chain), prune, follow."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.audit.anchor import anchor_path
from tests.support.cli import SANDBOXFS, assert_one_line_error, sandboxfs, sh
from tests.support.mounts import make_project, mounted

ENTRY_FIELDS = (
    "id",
    "ts",
    "op",
    "path",
    "dest",
    "zone",
    "session",
    "workspace",
    "trust",
    "allowed",
    "reason",
    "errno",
    "pid",
    "uid",
    "comm",
    "bytes",
    "prev",
    "hash",
)

Entry = dict[str, Any]


def audit_json(project: Path, *filters: str) -> list[Entry]:
    result = sandboxfs("audit", "--project", project, "--json", *filters)
    assert result.returncode == 0, (filters, result.stderr)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def audit_many(project: Path, queries: list[tuple[str, ...]]) -> list[list[Entry]]:
    """Run several `sandboxfs audit --json` queries at once (each a real CLI process)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda q: audit_json(project, *q), queries))


@pytest.fixture(scope="module", autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Anchors go to a directory of this module's own, never to the real ~/.local/state: the
    mount daemons and CLI runs started here inherit the environment."""
    directory = tmp_path_factory.mktemp("state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SANDBOXFS_STATE_DIR", str(directory))
        yield directory


# ----- a project with a varied log ----------------------------------------------------------------


@dataclass
class History:
    project: Path
    s1: str  # session trust, workspace default
    s2: str  # untrusted, workspace "other"
    cat_pid: int  # the cat refused /repo/README.md in s1
    entries: list[Entry]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> History:
    """Two mounts (different sessions, workspaces and trust levels) with allowed and denied
    operations, both unmounted again so that every entry is on disk. Made once per module."""
    root = tmp_path_factory.mktemp("history")
    project = make_project(root)
    with (
        mounted(root / "m1", project, "session") as m1,
        mounted(root / "m2", project, "untrusted", "--workspace", "other") as m2,
    ):
        ok = sh(
            f"printf 'hello world' > {m1.mnt}/session/working/a.txt && "
            f"cat {m1.mnt}/session/working/a.txt >/dev/null && "
            f"printf abc >> {m1.mnt}/session/working/a.txt && "
            f"head -c 300000 /dev/zero > {m1.mnt}/workspace/data/big.bin && "
            f"ls {m1.mnt}/session/working >/dev/null && "
            f"mkdir {m1.mnt}/session/outputs/d && rmdir {m1.mnt}/session/outputs/d && "
            f"echo u > {m2.mnt}/session/working/u.txt"
        )
        assert ok.returncode == 0, ok.stderr
        refused = sh(f"cat {m1.mnt}/repo/README.md")
        # The repo looks empty at trust session: absent, audited as the read it was.
        assert refused.returncode == 1 and "No such file or directory" in refused.stderr
        assert sh(f"ls {m2.mnt}/workspace").returncode != 0
        assert sh(f"cat {m2.mnt}/repo/src/main.py").returncode != 0
        assert sh(f"echo x > {m1.mnt}/repo/new.txt").returncode != 0
        denial = next(e for e in m1.audit("--denied") if e["path"] == "/repo/README.md")
        s1, s2 = m1.session, m2.session
    entries = audit_json(project)
    return History(project, s1, s2, int(denial["pid"]), entries)


@pytest.fixture
def history(recorded: History, tmp_path: Path) -> History:
    """A private copy of the recorded project, free to be tampered with."""
    copy = tmp_path / "recorded-project"
    shutil.copytree(recorded.project, copy, symlinks=True)
    # The anchor is kept per log path: the copy gets one of its own, as a mount would have made.
    shutil.copy2(anchor_path(_log(recorded.project)), anchor_path(_log(copy)))
    return History(copy, recorded.s1, recorded.s2, recorded.cat_pid, recorded.entries)


def ids(entries: list[Entry]) -> list[int]:
    return [e["id"] for e in entries]


# ----- table and JSON -----------------------------------------------------------------------------


def test_table_shows_denials_with_path_and_process(history: History) -> None:
    result = sandboxfs("audit", "--project", history.project)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["TIME", "(UTC)", "OP", "RESULT"]
    row = next(line for line in lines if "/repo/README.md" in line)
    assert "DENIED" in row
    assert f"cat[{history.cat_pid}]" in row
    assert "ENOENT" in row
    assert "not readable at trust level session" in row
    assert any(" ok " in line and "/session/working/a.txt" in line for line in lines)
    assert len(lines) == len(history.entries) + 1

    denied = sandboxfs("audit", "--project", history.project, "--denied")
    assert denied.returncode == 0
    rows = denied.stdout.splitlines()[1:]
    assert rows and all("DENIED" in row for row in rows)


def test_json_entries_carry_every_spec_field(history: History) -> None:
    ops = [e for e in history.entries if e["op"] not in ("mount", "unmount")]
    assert ops
    for entry in ops:
        missing = [f for f in ENTRY_FIELDS if f not in entry]
        assert not missing, (missing, entry)
        assert entry["ts"].endswith("Z") and len(entry["ts"]) == len("2026-01-01T00:00:00.000000Z")
        assert len(entry["hash"]) == 64 and len(entry["prev"]) == 64
    denial = next(e for e in history.entries if e["path"] == "/repo/README.md")
    assert denial == denial | {
        "op": "read",
        "zone": "repo",
        "session": history.s1,
        "workspace": "default",
        "trust": "session",
        "allowed": False,
        "errno": "ENOENT",
        "pid": history.cat_pid,
        "uid": os.getuid(),
        "comm": "cat",
        "bytes": None,
        "dest": None,
    }
    assert "readable zones" in denial["reason"]
    refused_write = [e for e in history.entries if e["path"] == "/repo/new.txt"]
    assert refused_write and all(e["allowed"] is False for e in refused_write)
    listed = next(
        e for e in history.entries if e["op"] == "list" and e["path"] == "/session/working"
    )
    assert listed["allowed"] is True and listed["comm"] == "ls" and listed["reason"] is None


def test_lifecycle_entries_carry_every_spec_field(history: History) -> None:
    lifecycle = [e for e in history.entries if e["op"] in ("mount", "unmount")]
    assert len(lifecycle) == 4
    for entry in lifecycle:
        missing = [f for f in ENTRY_FIELDS if f not in entry]
        assert not missing, (missing, entry)


def test_write_entries_carry_bytes_written(history: History) -> None:
    writes = [e for e in history.entries if e["op"] == "write" and e["allowed"]]
    a_txt = [e for e in writes if e["path"] == "/session/working/a.txt"]
    assert sorted(e["bytes"] for e in a_txt) == [3, 11]
    big = next(e for e in writes if e["path"] == "/workspace/data/big.bin")
    assert big["bytes"] == 300000
    assert big["zone"] == "workspace" and big["comm"] == "sh"  # the shell opens the file
    reads = [
        e for e in history.entries if e["op"] == "read" and e["path"] == "/session/working/a.txt"
    ]
    assert len(reads) == 1 and reads[0]["comm"] == "cat" and reads[0]["bytes"] is None


# ----- filters ------------------------------------------------------------------------------------


def _iso(ts: str, naive: bool = False) -> str:
    return ts.removesuffix("Z") if naive else ts


def test_every_filter(history: History) -> None:
    every = history.entries
    assert ids(every) == sorted(
        ids(every), key=lambda i: next(e["ts"] for e in every if e["id"] == i)
    )
    middle = every[len(every) // 2]["ts"]
    distinct = sorted({e["ts"] for e in every})
    assert len(distinct) > 3
    cases: list[tuple[tuple[str, ...], Callable[[Entry], bool]]] = [
        (("--session", history.s1), lambda e: e.get("session") == history.s1),
        (("--session", history.s2), lambda e: e.get("session") == history.s2),
        (("--workspace", "other"), lambda e: e.get("workspace") == "other"),
        (("--workspace", "default"), lambda e: e.get("workspace") == "default"),
        (("--op", "read"), lambda e: e["op"] == "read"),
        (("--op", "write"), lambda e: e["op"] == "write"),
        (("--op", "delete"), lambda e: e["op"] == "delete"),
        (("--op", "mount"), lambda e: e["op"] == "mount"),
        (("--zone", "repo"), lambda e: e.get("zone") == "repo"),
        (("--zone", "workspace"), lambda e: e.get("zone") == "workspace"),
        (("--trust", "untrusted"), lambda e: e.get("trust") == "untrusted"),
        (("--denied",), lambda e: e["allowed"] is False),
        (("--allowed",), lambda e: e["allowed"] is True),
        (("--pid", str(history.cat_pid)), lambda e: e.get("pid") == history.cat_pid),
        (("--since", middle), lambda e: e["ts"] >= middle),
        (("--until", middle), lambda e: e["ts"] < middle),
        (
            ("--since", _iso(distinct[1], naive=True), "--until", _iso(distinct[-2])),
            lambda e: distinct[1] <= e["ts"] < distinct[-2],
        ),
        (("--since", "1h"), lambda e: True),
        (("--until", "1h"), lambda e: False),
        (("--since", "10m"), lambda e: True),
        (
            ("--session", history.s1, "--zone", "repo", "--denied"),
            lambda e: (
                e.get("session") == history.s1 and e.get("zone") == "repo" and e["allowed"] is False
            ),
        ),
    ]
    results = audit_many(history.project, [args for args, _ in cases])
    for (args, predicate), got in zip(cases, results, strict=True):
        expected = [e for e in every if predicate(e)]
        assert ids(got) == ids(expected), args
        if args not in (("--since", "1h"), ("--since", "10m"), ("--until", "1h")):
            assert got, f"{args} matched nothing: a weak case"
            assert len(got) < len(every), f"{args} filtered nothing: a weak case"

    limited, limited_denied = audit_many(
        history.project, [("--limit", "3"), ("--denied", "--limit", "2")]
    )
    assert ids(limited) == ids(every[-3:])
    assert ids(limited_denied) == ids([e for e in every if not e["allowed"]][-2:])


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--since", "yesterday"), ("yesterday", "ISO 8601", "10m")),
        (("--until", "3 days"), ("3 days", "ISO 8601")),
        (("--limit", "0"), ("--limit", "positive")),
        (("--op", "frob"), ("frob", "read")),
        (("--trust", "admin"), ("admin", "untrusted, session, workspace, full")),
        (("--denied", "--allowed"), ("--allowed",)),
        (("prune",), ("--before",)),
    ],
    ids=[
        "since-word",
        "until-words",
        "limit-0",
        "unknown-op",
        "unknown-trust",
        "denied-and-allowed",
        "prune-without-before",
    ],
)
def test_bad_audit_input_is_assert_one_line_error(
    args: tuple[str, ...], needles: tuple[str, ...], project: Path
) -> None:
    assert_one_line_error(sandboxfs("audit", "--project", project, *args), *needles)


# ----- verify and prune ---------------------------------------------------------------------------


def _log(project: Path) -> Path:
    return project / ".sandbox" / "audit.jsonl"


def _verify(project: Path) -> subprocess.CompletedProcess[str]:
    return sandboxfs("audit", "verify", "--project", project)


def test_verify_detects_an_edited_field(history: History) -> None:
    log = _log(history.project)
    intact = _verify(history.project)
    assert intact.returncode == 0, intact.stdout + intact.stderr
    assert intact.stdout.startswith("ok")
    lines = log.read_bytes().splitlines(keepends=True)
    index = next(
        i
        for i, line in enumerate(lines)
        if b'"allowed":false' in line and b"/repo/README.md" in line
    )
    assert 0 < index < len(lines) - 1
    lines[index] = lines[index].replace(b'"allowed":false', b'"allowed":true')
    log.write_bytes(b"".join(lines))
    edited = _verify(history.project)
    assert edited.returncode == 1
    assert f"line {index + 1}:" in edited.stdout
    assert "Traceback" not in edited.stderr


def test_verify_detects_a_removed_line(history: History) -> None:
    log = _log(history.project)
    lines = log.read_bytes().splitlines(keepends=True)
    middle = len(lines) // 2
    assert 0 < middle < len(lines) - 1
    del lines[middle]
    log.write_bytes(b"".join(lines))
    removed = _verify(history.project)
    assert removed.returncode == 1
    assert f"line {middle + 1}:" in removed.stdout


def test_verify_detects_a_removed_first_line(history: History) -> None:
    log = _log(history.project)
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[1:]))
    result = _verify(history.project)
    assert result.returncode == 1
    assert "line 1:" in result.stdout


@pytest.fixture
def small_log(project: Path, mount_at: Callable[..., Any]) -> Path:
    """A project whose log a mount wrote: allowed writes and a listing, then unmounted."""
    with mount_at("session") as m:
        made = sh(
            f"for i in 1 2 3 4 5 6; do echo $i > {m.mnt}/session/working/f$i; done"
            f" && ls {m.mnt}/session/working >/dev/null"
        )
        assert made.returncode == 0, made.stderr
    return project


def test_verify_finds_a_cut_end(small_log: Path, mount_at: Callable[..., Any]) -> None:
    intact = _verify(small_log)
    assert intact.returncode == 0, intact.stdout + intact.stderr
    last = max(ids(audit_json(small_log)))
    assert intact.stdout.startswith("ok: ")
    assert f"chain intact; keyed, and complete up to its anchor's head (id {last})" in intact.stdout

    cut = sh("head -n -3 audit.jsonl > x && mv x audit.jsonl", cwd=_log(small_log).parent)
    assert cut.returncode == 0, cut.stderr
    result = _verify(small_log)
    assert result.returncode == 1, result.stdout
    assert result.stdout == (
        f"the log ends at id {last - 3} but its anchor says id {last} was written:"
        " entries were removed from the end\n"
    )
    assert "Traceback" not in result.stderr

    # The next mount appends after the cut, but does not paper over it.
    with mount_at("session", proj=small_log):
        pass
    again = _verify(small_log)
    assert again.returncode == 1, again.stdout
    assert f"a writer found the log tampered with: the log ended at id {last - 3}" in again.stdout


def test_verify_finds_a_rebuilt_chain(small_log: Path) -> None:
    log = _log(small_log)
    rebuilt, prev = [], "0" * 64
    for line in log.read_bytes().splitlines():
        entry = json.loads(line)
        for seal in ("hash", "mac"):
            entry.pop(seal, None)
        if entry["op"] == "list":
            entry["path"] = "/session/elsewhere"
        entry["prev"] = prev
        body = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()
        entry["hash"] = prev = hashlib.sha256(body).hexdigest()
        rebuilt.append(json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n")
    log.write_text("".join(rebuilt))
    result = _verify(small_log)
    assert result.returncode == 1, result.stdout
    assert result.stdout == "line 1: mac missing (the chain was rebuilt without the key)\n"


def test_verify_without_the_anchor_says_what_it_did_not_check(
    small_log: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "another-users-state"
    result = subprocess.run(
        [*SANDBOXFS, "audit", "verify", "--project", str(small_log)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "SANDBOXFS_STATE_DIR": str(elsewhere)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "chain intact; unkeyed check only (no anchor at " + str(elsewhere) in result.stdout
    assert result.stdout.rstrip().endswith("a cut end or a rebuilt chain would not show")
    assert not elsewhere.exists()  # verify only reads


def test_prune_keeps_the_chain_verifiable(history: History, mount_at: Callable[..., Any]) -> None:
    every = history.entries
    cut = every[len(every) // 2]["ts"]
    pruned = sandboxfs("audit", "prune", "--project", history.project, "--before", cut, "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned ")
    assert _verify(history.project).returncode == 0
    left = audit_json(history.project)
    assert left and {e["id"] for e in every if e["ts"] >= cut} <= set(ids(left))
    assert len(left) < len(every) + 1

    future = "2999-01-01T00:00:00Z"
    gone = sandboxfs("audit", "prune", "--project", history.project, "--before", future, "--yes")
    assert gone.returncode == 0, gone.stderr
    after = _verify(history.project)
    assert after.returncode == 0, after.stdout
    assert [e for e in audit_json(history.project) if e["op"] not in ("prune",)] == []

    # New entries continue the pruned chain.
    with mount_at("untrusted", proj=history.project) as m:
        assert sh(f"cat {m.mnt}/repo/README.md").returncode != 0
    assert _verify(history.project).returncode == 0
    newest = audit_json(history.project, "--denied")
    assert [e["path"] for e in newest] == ["/repo/README.md"]
    assert newest[0]["id"] > max(ids(every))


# ----- follow -------------------------------------------------------------------------------------


@pytest.fixture
def follower(project: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*_SIGINT_DEFAULT, *SANDBOXFS, "audit", "--project", str(project), "--follow", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


# The follower is stopped as Ctrl-C stops it. A program started in the background by a
# non-interactive shell (`.ci/run &`) inherits SIGINT ignored, and Python then leaves it ignored:
# this resets it to the default before exec'ing the command (same process, same pid).
_SIGINT_DEFAULT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execvp(sys.argv[1], sys.argv[1:])",
]


def _reader(stream: Any) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next_line(lines: queue.Queue[str], wanted: Callable[[str], bool], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError("follow printed no matching line in time")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if wanted(line):
            return line


def test_follow_prints_new_denials(
    mount_at: Callable[..., Any], follower: Callable[..., subprocess.Popen[str]]
) -> None:
    with mount_at("untrusted") as m:
        assert sh(f"echo x > {m.mnt}/repo/before.txt").returncode != 0
        proc = follower("--json", "--denied", "-n", "1")  # the last one, then new ones
        lines = _reader(proc.stdout)
        first = json.loads(_next_line(lines, lambda line: bool(line.strip()), 20))
        assert first["path"] == "/repo/before.txt"
        time.sleep(0.5)  # let it reach the tail of the log (see the report on a startup gap)
        assert sh(f"echo x > {m.mnt}/repo/after-start.txt").returncode != 0
        line = _next_line(lines, lambda text: "after-start.txt" in text, 20)
        entry = json.loads(line)
        assert entry["allowed"] is False and entry["comm"] == "sh" and entry["op"] == "write"
        # An allowed operation does not pass the --denied filter.
        assert sh(f"echo ok > {m.mnt}/session/working/fine.txt").returncode == 0
        assert sh(f"echo x > {m.mnt}/repo/third.txt").returncode != 0
        third = _next_line(lines, lambda text: bool(text.strip()), 20)
        assert "third.txt" in third
        _interrupt(proc)
        assert proc.returncode == 0


def _interrupt(proc: subprocess.Popen[str], timeout: float = 20) -> None:
    """Ctrl-C's signal, then the exit; if it does not come, fail with what the process was
    doing (its state, signal masks and kernel wait channel), so that a rare hang says why."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        facts = []
        for name in ("status", "wchan", "stack"):
            try:
                text = Path(f"/proc/{proc.pid}/{name}").read_text()
            except OSError as exc:
                text = f"unreadable ({exc.strerror})"
            if name == "status":
                keep = ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
                text = ", ".join(line for line in text.splitlines() if line.startswith(keep))
            facts.append(f"{name}: {text.strip()}")
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {timeout:.0f} s after SIGINT: " + "; ".join(facts))


def test_follow_table_rows(
    mount_at: Callable[..., Any], follower: Callable[..., subprocess.Popen[str]]
) -> None:
    with mount_at("untrusted") as m:
        proc = follower()
        lines = _reader(proc.stdout)
        _next_line(
            lines,
            lambda line: line.startswith("TIME") or "no matching" in line or "mount" in line,
            20,
        )
        time.sleep(0.5)
        assert sh(f"cat {m.mnt}/repo/README.md").returncode != 0
        row = _next_line(lines, lambda text: "/repo/README.md" in text, 20)
        assert "DENIED" in row and "cat[" in row
        proc.terminate()
        proc.communicate(timeout=20)


def test_refusals_are_counted_per_refused_system_call(tmp_path: Path) -> None:
    """docs/audit.md: one `rm` of a name the level may not see is two refusals, its `newfstatat` and
    its `unlinkat`, as each looks the name up and is refused."""
    project = make_project(tmp_path)
    with mounted(tmp_path / "mnt", project, "untrusted") as m:
        removed = subprocess.run(["rm", str(m.mnt / "repo/.env")], capture_output=True, timeout=30)
        assert removed.returncode == 1
    assert (project / ".env").exists()
    shown = sandboxfs("audit", "--project", project, "--denied", "--json")
    entries = [json.loads(line) for line in shown.stdout.splitlines()]
    refusals = [e for e in entries if e["path"] == "/repo/.env"]
    assert sum(e.get("count", 1) for e in refusals) == 2, refusals
    manual = (Path(__file__).parents[2] / "docs" / "audit.md").read_text()
    assert "the number of refusals is the number of refused system calls" in " ".join(
        manual.split()
    )
