"""`sandboxfs staged commit` killed (SIGKILL) at any step of landing on the checked-out branch is
all or nothing. The next `sandboxfs staged` command (or `mount`, `run`) finds the landing's journal
and rolls it back (nothing the user sees had changed: the review is still pending and commits) or
finishes it (files, index, then HEAD; the review committed), audited either way; no temporary file
or index.lock is left. The real command line runs, killed at a named step
(sandboxfs.staging.land.KILL_AT_ENV); tests/crash_landing.py kills it at random times.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxfs.staging.land import KILL_AT_ENV
from tests.support.mounts import mounted
from tests.support.run import needs_bwrap, sbx
from tests.support.staging import SOURCE, audit_entries, git, make_repo, staged, staged_dir, write

# The module, not the function `land` the package exports under its name.
land_module = importlib.import_module("sandboxfs.staging.land")
ROLLED_BACK = ["objects", "prepared", "temp", "index.lock"]
FINISHED = ["placing", "placed", "ref"]
NEW = {"src/a.py": SOURCE.replace("line 3\n", "line three\n"), "pkg/deep/new.py": "x = 1\n"}


def cli(repo: Path, *args: str, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != KILL_AT_ENV}
    if kill_at is not None:
        env[KILL_AT_ENV] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "sandboxfs", "staged", *args, "--project", str(repo)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def prepare(tmp_path: Path) -> tuple[Path, str]:
    """A repository at one commit and a staged commit c1 that changes, creates (in new
    directories) and deletes files; returns the repository and its HEAD."""
    repo = make_repo(tmp_path, {"src/a.py": SOURCE, "old.txt": "old\n", "keep.txt": "k\n"})
    base = staged_dir(repo, "c1")
    for path, text in NEW.items():
        write(base / "files" / path, text)
    write(base / "deletions.txt", "old.txt\n")
    write(base / "message.txt", "Agent change\n")
    return repo, git(repo, "rev-parse", "HEAD").strip()


def leftovers(repo: Path) -> list[str]:
    """Temporary files of a landing, its index.lock and its journal."""
    found = [str(p) for p in repo.rglob(".sandboxfs-*.tmp")]
    found += [str(p) for p in repo.rglob("landing.json")]
    return found + ([".git/index.lock"] if (repo / ".git/index.lock").exists() else [])


def details(repo: Path) -> list[str]:
    """The details of the audit's `stage` entries (none before the first)."""
    if not (repo / ".sandbox/audit.jsonl").exists():
        return []
    return [str(e["detail"]) for e in audit_entries(repo) if e.get("op") == "stage"]


def status_of(repo: Path) -> str:
    state = json.loads((repo / ".sandbox/workspaces/default/review/c1/state.json").read_text())
    return str(state["status"])


@pytest.mark.parametrize("step", ROLLED_BACK + FINISHED)
def test_a_landing_killed_at_any_step_is_rolled_back_or_finished(tmp_path: Path, step: str) -> None:
    repo, old_head = prepare(tmp_path)
    killed = cli(repo, "commit", "c1", kill_at=step)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)

    listed = cli(repo, "list")  # any staged command recovers
    assert listed.returncode == 0, listed.stderr
    assert leftovers(repo) == []
    assert git(repo, "status", "--porcelain") == ""
    recovered = details(repo)
    if step in ROLLED_BACK:
        assert git(repo, "rev-parse", "HEAD").strip() == old_head
        assert (repo / "old.txt").read_text() == "old\n"
        assert (repo / "src/a.py").read_text() == SOURCE
        assert not (repo / "pkg").exists()
        assert status_of(repo) == "pending"
        if step != "objects":  # killed before anything was written: nothing to recover
            assert any("rolled back, still pending" in d for d in recovered), recovered
            assert "rolled back" in listed.stderr
        again = cli(repo, "commit", "c1")
        assert again.returncode == 0, again.stderr
    else:
        assert any(d.startswith("landing interrupted, finished: commit") for d in recovered)
        assert "finished" in listed.stderr
        again = cli(repo, "commit", "c1")
        assert again.returncode == 1 and "committed as" in again.stderr, again.stderr
    head = git(repo, "rev-parse", "HEAD").strip()
    assert git(repo, "rev-parse", "HEAD~1").strip() == old_head
    assert status_of(repo) == "committed"
    assert not (repo / "old.txt").exists()
    for path, text in NEW.items():
        assert (repo / path).read_text() == text
        assert git(repo, "show", f"HEAD:{path}") == text
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "diff", "HEAD", "--name-only") == ""
    assert leftovers(repo) == []
    assert any(d.endswith(f"commit {head}") for d in details(repo)), details(repo)


def test_head_moved_after_the_files_were_placed_puts_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program moves the branch after the last check: the compare-and-swap of HEAD
    fails, and the working tree and index are put back as they were."""
    repo, old_head = prepare(tmp_path)
    git(repo, "commit", "-q", "--allow-empty", "-m", "elsewhere")
    elsewhere = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "reset", "-q", "--soft", old_head)
    index_before = (repo / ".git/index").read_bytes()

    def race(step: str) -> None:
        if step == "placed":
            git(repo, "update-ref", "refs/heads/main", elsewhere)

    monkeypatch.setattr(land_module, "_reached", race)
    result = staged(repo, "commit", "c1")
    assert result.code == 1 and "moved meanwhile" in result.err, result
    assert git(repo, "rev-parse", "HEAD").strip() == elsewhere
    assert (repo / ".git/index").read_bytes() == index_before
    assert (repo / "src/a.py").read_text() == SOURCE
    assert (repo / "old.txt").read_text() == "old\n"
    assert not (repo / "pkg").exists()
    assert leftovers(repo) == []
    assert status_of(repo) == "pending"


def test_a_journal_that_is_not_one_is_one_line(tmp_path: Path) -> None:
    repo, _ = prepare(tmp_path)
    assert cli(repo, "list").returncode == 0
    journal = repo / ".sandbox/workspaces/default/review/c1/landing.json"
    journal.parent.mkdir(parents=True, exist_ok=True)
    for junk in ("{", '{"commit_id": "c1"}', "[]"):
        journal.write_text(junk)
        listed = cli(repo, "list")
        assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
        assert "is not a landing journal; move it away" in listed.stderr, listed.stderr


@pytest.mark.parametrize("step", ["temp", "placed"])
def test_mount_finds_an_interrupted_landing_too(tmp_path: Path, step: str) -> None:
    """Not only `staged` commands: a mount of the project first rolls back or finishes a
    landing a kill left, so no session starts over a half-landed commit."""
    repo, old_head = prepare(tmp_path)
    killed = cli(repo, "commit", "c1", kill_at=step)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    assert leftovers(repo) != []
    with mounted(tmp_path / "mnt", repo, "session"):
        assert leftovers(repo) == []
    assert git(repo, "status", "--porcelain") == ""
    head = git(repo, "rev-parse", "HEAD").strip()
    assert (head == old_head) is (step == "temp")
    assert status_of(repo) == ("pending" if step == "temp" else "committed")
    assert any("landing interrupted" in d for d in details(repo)), details(repo)


@needs_bwrap
def test_run_finds_an_interrupted_landing_too(tmp_path: Path) -> None:
    repo, _ = prepare(tmp_path)
    killed = cli(repo, "commit", "c1", kill_at="placing")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    result = sbx("run", "--project", repo, "--trust", "session", "--quiet", "--", "true")
    assert result.returncode == 0, result.stderr
    assert "landing interrupted" in result.stderr and "finished" in result.stderr
    assert leftovers(repo) == [] and status_of(repo) == "committed"
    assert git(repo, "status", "--porcelain") == ""
