"""`sandboxfs sessions [list]|prune` and `status`'s state dir size, on real mounts: sizes and
last use as the state dir holds them, a session in use (mounted, or held by a daemon that does
not answer) never pruned, what a prune removes and audits, and how it asks first."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.cli import assert_one_line_error, sandboxfs
from tests.support.mounts import Mount


def session_path(m: Mount) -> Path:
    return m.project / ".sandbox" / "workspaces" / m.workspace / "sessions" / m.session


def listed(project: Path, *extra: str) -> dict[str, dict[str, Any]]:
    result = sandboxfs("sessions", "list", "--project", project, "--json", *extra)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list)  # a list: one JSON array
    return {row["id"]: row for row in rows}


def prune(project: Path, *extra: str) -> Any:
    return sandboxfs("sessions", "prune", "--project", project, *extra)


def test_list_and_prune_never_a_session_in_use(project: Path, mount_at: Callable[..., Any]) -> None:
    with mount_at("session") as old:
        (old.mnt / "session" / "working" / "data.bin").write_bytes(b"d" * 300_000)
    old_log = project / ".sandbox" / "logs" / f"{old.session}.log"
    assert old_log.exists()
    with mount_at("session") as live:
        rows = listed(project)
        assert set(rows) == {old.session, live.session}
        mine, other = rows[live.session], rows[old.session]
        assert (mine["in_use"], mine["mounts"]) == (True, [str(live.mnt)])
        assert (other["in_use"], other["mounts"]) == (False, [])
        assert other["bytes"] >= 300_000 and other["workspace"] == "default"
        assert other["created"] and other["last_used"] and other["idle_seconds"] >= 0
        assert list(listed(project, "--workspace", "elsewhere")) == []

        table = sandboxfs("sessions", "--project", project)  # `list` is the default
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].startswith("WORKSPACE  SESSION   SIZE") and "LAST USE  IN USE" in lines[0]
        row = next(line for line in lines if live.session in line)
        assert row.endswith(f"yes: {live.mnt}")
        assert lines[-1].startswith("2 sessions, 1 in use, ") and "the state dir" in lines[-1]

        status = json.loads(sandboxfs("status", live.mnt, "--json").stdout)
        assert status[0]["state_dir_bytes"] > 300_000
        header = sandboxfs("status", live.mnt).stdout.splitlines()[0]
        assert "STATE DIR" in header

        recent = prune(project, "--older-than", "1h", "--yes")
        assert recent.returncode == 0 and recent.stdout.startswith("nothing to prune"), recent
        unasked = prune(project, "--older-than", "0s")  # no terminal, no --yes
        assert_one_line_error(unasked, "would remove 1 session", "pass --yes")
        assert old.session in unasked.stdout and session_path(old).is_dir()
        dry = prune(project, "--older-than", "0s", "--dry-run")
        assert dry.returncode == 0 and "would remove 1 session" in dry.stdout
        assert session_path(old).is_dir()

        done = prune(project, "--older-than", "0s", "--yes")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("pruned 1 session ("), done.stdout
        assert f"kept session {live.session} of workspace default: in use" in done.stderr
        assert not session_path(old).exists() and not old_log.exists()
        assert session_path(live).is_dir()
        assert (live.mnt / "session" / "working").is_dir()
        entry = next(e for e in live.audit("--op", "prune") if e["session"] == old.session)
        assert entry["allowed"] is True and "pruned session" in entry["detail"]
    after = prune(project, "--older-than", "0s", "--yes", "--json")
    assert after.returncode == 0, after.stderr
    assert [s["id"] for s in json.loads(after.stdout)["removed"]] == [live.session]
    assert listed(project) == {}


def test_a_daemon_that_does_not_answer_keeps_its_session(
    project: Path, mount_at: Callable[..., Any]
) -> None:
    """Its context.json cannot be read (status says unresponsive), but it holds its session."""
    with mount_at("session") as m:
        pid = m.daemon_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            row = listed(project)[m.session]
            assert (row["in_use"], row["mounts"]) == (True, [])
            kept = prune(project, "--older-than", "0s", "--yes")
            assert kept.returncode == 0 and "nothing to prune" in kept.stdout, kept
            assert session_path(m).is_dir()
        finally:
            os.kill(pid, signal.SIGCONT)


def test_bad_input_is_one_line_exit_2(project: Path) -> None:
    for args, needles in [
        (["prune"], ["--older-than"]),
        (["prune", "--older-than", "7x"], ["invalid duration '7x'", "30m, 12h, 7d"]),
        (["prune", "--older-than", "1.5h"], ["invalid duration"]),
        (["list", "--workspace", "../x"], ["invalid workspace id"]),
        (["list", "--older-than", "1d"], ["unrecognized arguments", "sessions list --help"]),
    ]:
        assert_one_line_error(sandboxfs("sessions", *args, "--project", project), *needles)
    missing = sandboxfs("sessions", "--project", project / "nope")
    assert_one_line_error(missing, "does not exist")
