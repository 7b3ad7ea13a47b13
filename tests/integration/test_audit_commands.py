"""`sandboxfs audit show|verify|prune` as subcommands: their own help and options, prune's
question, times that name their zone, --follow from the end, and one answer for "no log".

The logs are written with `AuditLog` itself (keyed, with an anchor in the suite's state dir), not
by mounts, so that entries can carry chosen times; every check runs the real CLI.
"""

from __future__ import annotations

import json
import os
import pty
import select
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.audit.writer import AuditLog
from tests.support.audit import Follower, audit, follow
from tests.support.cli import SANDBOXFS, assert_one_line_error

__all__ = ["follow"]  # a fixture of tests.support.audit, used here

OLD = ("2020-01-01T00:00:00.000000Z", "2020-06-01T12:00:00.000000Z")
RECENT = "2026-01-15T08:00:00.000000Z"  # 17:00 in Tokyo
CUTOFF = "2021-01-01T00:00:00Z"
NO_LOG = "sandboxfs: no audit log at {} (nothing has been mounted in this project yet)"


def _log(project: Path) -> Path:
    return project / ".sandbox" / "audit.jsonl"


def append(project: Path, *entries: dict[str, Any]) -> None:
    log = AuditLog(_log(project), reserve=0)
    try:
        for entry in entries:
            log.record(entry)
    finally:
        log.close()


def entry(path: str, ts: str | None = None, allowed: bool = True) -> dict[str, Any]:
    made = {"op": "read", "path": path, "zone": "repo", "allowed": allowed, "pid": 7, "comm": "cat"}
    return made | ({"ts": ts} if ts else {})


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with two old entries (one a refusal) and two recent ones."""
    project = tmp_path / "project"
    project.mkdir()
    append(
        project,
        entry("/repo/old-1", OLD[0]),
        entry("/repo/old-2", OLD[1], allowed=False),
        entry("/repo/recent", RECENT),
        entry("/repo/now"),
    )
    return project


# ----- subcommands, help and options -------------------------------------------------------------


@pytest.mark.parametrize(
    ("subcommand", "wanted", "unwanted"),
    [
        ("", ("{show,verify,prune}", "default: show"), ("--denied",)),
        ("show", ("--follow", "--local", "-n N, --lines N, --limit N", "--denied"), ("--yes",)),
        ("verify", ("--project DIR",), ("--denied", "--follow", "--before")),
        ("prune", ("--before T", "--yes", "--project DIR"), ("--denied", "--follow")),
    ],
)
def test_each_subcommand_has_its_own_help(
    subcommand: str, wanted: tuple[str, ...], unwanted: tuple[str, ...]
) -> None:
    result = audit(*subcommand.split(), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: sandboxfs audit {subcommand}".rstrip() + " [-h]")
    for text in wanted:
        assert text in result.stdout, text
    for text in unwanted:
        assert text not in result.stdout, text


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (("verify", "--denied"), "--denied"),
        (("verify", "--follow"), "--follow"),
        (("prune", "--before", CUTOFF, "--json"), "--json"),
        (("prune", "--before", CUTOFF, "--yes", "--since", "1d"), "--since 1d"),
        (("show", "--yes"), "--yes"),
        (("show", "--before", CUTOFF), f"--before {CUTOFF}"),
    ],
)
def test_options_of_another_subcommand_are_refused(
    project: Path, args: tuple[str, ...], refused: str
) -> None:
    before = _log(project).read_bytes()
    result = audit(*args, "--project", project)
    assert_one_line_error(
        result, f"unrecognized arguments: {refused} (see 'sandboxfs audit {args[0]} --help')"
    )
    assert _log(project).read_bytes() == before


def test_no_subcommand_is_show_and_options_may_come_first(project: Path) -> None:
    denied = audit("--project", project, "--denied", "--json")
    assert denied.returncode == 0, denied.stderr
    assert [json.loads(line)["path"] for line in denied.stdout.splitlines()] == ["/repo/old-2"]
    verified = audit("--project", project, "verify")  # written so before the subcommands
    assert verified.returncode == 0 and verified.stdout.startswith("ok: 4 entries")
    # A filter's value that is a subcommand's name is a value: no prune happens here.
    prune_op = audit("--project", project, "--op", "prune")
    assert (prune_op.returncode, prune_op.stdout) == (0, "no matching audit entries\n")
    limits = [
        audit("show", "--project", project, flag, "2", "--json") for flag in ("-n", "--limit")
    ]
    assert limits[0].stdout == limits[1].stdout and len(limits[0].stdout.splitlines()) == 2
    assert "/repo/recent" in limits[0].stdout and "/repo/now" in limits[0].stdout


# ----- prune asks first --------------------------------------------------------------------------


def test_prune_without_a_terminal_needs_yes(project: Path) -> None:
    before = _log(project).read_bytes()
    result = audit("prune", "--project", project, "--before", CUTOFF)
    line = assert_one_line_error(result, "--yes", f"would drop 2 entries older than {CUTOFF}")
    assert str(_log(project)) in line
    assert _log(project).read_bytes() == before

    confirmed = audit("prune", "--project", project, "--before", CUTOFF, "--yes")
    assert confirmed.returncode == 0, confirmed.stderr
    assert confirmed.stdout == f"pruned 2 entries older than {CUTOFF} from {_log(project)}\n"
    left = audit("--project", project, "--json")
    assert "old-" not in left.stdout and "/repo/recent" in left.stdout
    assert audit("verify", "--project", project).returncode == 0


def test_prune_with_nothing_to_drop_does_not_ask(project: Path) -> None:
    result = audit("prune", "--project", project, "--before", "2000-01-01")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("nothing to prune: no entries older than 2000-01-01T00:00:00Z")


def _on_a_terminal(args: list[str], answer: bytes) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal, answer its question, return (exit code, all output)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the terminal
        os.execv(sys.executable, [*SANDBOXFS, *args])
    output = b""
    answered = False
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            if not select.select([fd], [], [], 0.1)[0]:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child has closed the terminal
                break
            if not chunk:
                break
            output += chunk
            if not answered and b"[y/N] " in output:
                os.write(fd, answer + b"\n")
                answered = True
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode()


@pytest.mark.parametrize("answer", [b"n", b"y"])
def test_prune_on_a_terminal_asks(project: Path, answer: bytes) -> None:
    log = _log(project)
    before = log.read_bytes()
    code, output = _on_a_terminal(
        ["audit", "prune", "--project", str(project), "--before", CUTOFF], answer
    )
    assert f"drop 2 entries older than {CUTOFF} from {log}? [y/N] " in output
    if answer == b"n":
        assert code == 1, output
        assert "nothing pruned" in output
        assert log.read_bytes() == before
    else:
        assert code == 0, output
        assert f"pruned 2 entries older than {CUTOFF}" in output
        assert b"/repo/old-1" not in log.read_bytes()


# ----- times name their zone ---------------------------------------------------------------------


def test_table_times_name_their_zone(project: Path) -> None:
    utc = audit("--project", project, TZ="Asia/Tokyo")
    assert utc.returncode == 0, utc.stderr
    lines = utc.stdout.splitlines()
    assert lines[0].startswith("TIME (UTC)  ") and lines[0].split()[2:4] == ["OP", "RESULT"]
    assert next(row for row in lines if "/repo/recent" in row).startswith("2026-01-15 08:00:00")

    tokyo = audit("--project", project, "--local", TZ="Asia/Tokyo")
    assert tokyo.returncode == 0, tokyo.stderr
    lines = tokyo.stdout.splitlines()
    assert lines[0].startswith("TIME (JST)  ")
    assert next(row for row in lines if "/repo/recent" in row).startswith("2026-01-15 17:00:00")
    assert next(row for row in lines if "/repo/old-1" in row).startswith("2020-01-01 09:00:00")

    as_json = audit("--project", project, "--local", "--json", TZ="Asia/Tokyo")
    assert f'"ts": "{RECENT}"' in as_json.stdout


# ----- follow ------------------------------------------------------------------------------------


def test_follow_starts_at_the_end(project: Path, follow: Callable[..., Follower]) -> None:
    follower = follow(project)
    assert follower.line(follower.stdout).startswith("TIME (UTC)")
    time.sleep(0.5)  # the header is printed just before it opens the log
    append(project, entry("/repo/after-start", allowed=False))
    row = follower.line(follower.stdout)
    assert "/repo/after-start" in row and "DENIED" in row  # and no older entry before it
    assert follower.stdout.empty()


def test_follow_prints_the_last_n_first(project: Path, follow: Callable[..., Follower]) -> None:
    follower = follow(project, "-n", "2", "--json")
    first = [follower.line(follower.stdout) for _ in range(2)]
    assert "/repo/recent" in first[0] and "/repo/now" in first[1]
    append(project, entry("/repo/after-start"))
    assert "/repo/after-start" in follower.line(follower.stdout)


def test_follow_waits_for_a_log(tmp_path: Path, follow: Callable[..., Follower]) -> None:
    follower = follow(tmp_path, "--json")
    assert follower.line(follower.stderr) == (
        f"sandboxfs: no audit log yet at {_log(tmp_path)}; waiting for entries\n"
    )
    append(tmp_path, entry("/repo/first"))
    assert "/repo/first" in follower.line(follower.stdout)


# ----- no log ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code"),
    [((), 0), (("show", "--json"), 0), (("verify",), 1), (("prune", "--before", "1d"), 0)],
)
def test_no_log_is_one_line_everywhere(tmp_path: Path, args: tuple[str, ...], code: int) -> None:
    outside = tmp_path / "not-a-project"
    outside.mkdir()
    result = audit(*args, cwd=outside)
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    assert result.stderr == NO_LOG.format(_log(outside.resolve())) + "\n"
    assert not (outside / ".sandbox").exists()
