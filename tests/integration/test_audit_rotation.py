"""Rotation of the audit log through a real mount: with a small `audit: {rotate_bytes}`, the
entries of ordinary work go into several files, and `audit verify`, `audit --denied`,
`audit --follow` and `audit prune` treat them as one log."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxfs.audit.common import segments
from tests.support.audit import Follower, audit, follow
from tests.support.cli import sh, wait_until

__all__ = ["follow"]  # the audit commands' --follow fixture, used here too


def test_a_mount_rotates_its_log_and_the_commands_read_every_file(
    project: Path, mount_at: Callable[..., Any], follow: Callable[..., Follower]
) -> None:
    (project / "sandboxfs.yaml").write_text("audit:\n  rotate_bytes: 4096\n")
    log = project / ".sandbox" / "audit.jsonl"
    with mount_at("session") as m:
        follower = follow(project, "--json")
        for attempt in range(100):  # until it follows: it shows only what comes after its start
            (m.mnt / "session" / "working" / f"ready{attempt}").touch()
            if not follower.stdout.empty() or wait_until(lambda: not follower.stdout.empty(), 0.3):
                break
        work = sh(  # pauses longer than the flush interval: several batches, several files
            "for i in $(seq 40); do echo x > session/working/f$i || exit 1;"
            " [ $((i % 10)) = 0 ] && sleep 0.3; done;"
            " cat repo/README.md; ls session/working/f* | wc -l",
            cwd=m.mnt,
        )
        assert work.stdout.strip() == "40", work
        assert "README.md: No such file or directory" in work.stderr
    assert len(segments(log)) >= 3, sorted(p.name for p in log.parent.iterdir())

    # --follow saw every entry written after it started, across the rotations, in id order
    shown: list[dict[str, Any]] = []
    while not any(e.get("op") == "unmount" for e in shown):
        shown.append(json.loads(follower.line(follower.stdout)))
    ids = [e["id"] for e in shown]
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert {f"/session/working/f{i}" for i in range(1, 41)} <= {e.get("path") for e in shown}

    verified = audit("verify", "--project", project)
    assert verified.returncode == 0, verified
    count = len(segments(log)) + 1
    expected = rf"ok: \d+ entries in {count} files, chain intact across them; keyed"
    assert re.match(expected, verified.stdout), verified.stdout

    denied = audit("--denied", "--json", "--project", project)
    assert [json.loads(line)["path"] for line in denied.stdout.splitlines()] == ["/repo/README.md"]
    last = audit("-n", "3", "--json", "--project", project)
    assert [json.loads(line)["id"] for line in last.stdout.splitlines()] == ids[-3:]

    pruned = audit("prune", "--before", "2099-01-01T00:00:00Z", "--yes", "--project", project)
    assert pruned.returncode == 0 and pruned.stdout.startswith("pruned "), pruned
    verified = audit("verify", "--project", project)
    assert verified.returncode == 0 and "from the prune header" in verified.stdout, verified
    assert segments(log) == []  # every segment went; the log holds the prune header alone
    assert [json.loads(line)["op"] for line in log.read_text().splitlines()] == ["prune"]
