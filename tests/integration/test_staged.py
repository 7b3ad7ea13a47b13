"""`sandboxfs staged`: an agent's staged commits reviewed and landed in real git repositories.

Staged commits are written into the backing directory of /staged as an agent would (one test
writes one through a real mount at `untrusted`); real `git` inspects the result. The CLI runs
in-process except in that end-to-end test.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from sandboxfs.cli.main import main as cli_main
from tests.support.cli import sh
from tests.support.mounts import mounted
from tests.support.staging import (
    AFTER_STAGING,
    BEFORE_STAGING,
    SOURCE,
    STAGED_AT,
    Result,
    audit_entries,
    git,
    make_repo,
    staged,
    staged_dir,
    write,
)


def stage(
    repo: Path,
    commit_id: str,
    files: Mapping[str, str | bytes],
    message: str | None = "Agent change\n\nWhy it is needed.\n",
    deletions: list[str] | None = None,
) -> Path:
    """Write a staged commit into the backing directory of /staged, as an agent would."""
    base = staged_dir(repo, commit_id)
    base.mkdir(parents=True)
    for path, data in files.items():
        write(base / "files" / path, data)
    if message is not None:
        write(base / "message.txt", message)
    if deletions is not None:
        write(base / "deletions.txt", "".join(f"{d}\n" for d in deletions))
    os.utime(base, (STAGED_AT, STAGED_AT))
    return base


def snapshot_of_repo(repo: Path) -> tuple[str, str, str, dict[str, bytes]]:
    """HEAD, `git status`, the index and every file's bytes: what a refusal must not change."""
    files = {
        str(p.relative_to(repo)): p.read_bytes()
        for p in repo.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and ".git" not in p.parts
        and ".sandbox" not in p.parts
    }
    return (
        git(repo, "rev-parse", "HEAD"),
        git(repo, "status", "--porcelain"),
        git(repo, "ls-files", "-s"),
        files,
    )


def refused(result: Result, commit_id: str, *needles: str) -> None:
    assert result.code == 1, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert lines, result
    for line in lines:
        assert line.startswith(f"sandboxfs: staged commit {commit_id} not committed: "), line
    for needle in needles:
        assert needle in result.err, (needle, result.err)


# ----- review ------------------------------------------------------------------------------------


def test_list_show_diff_show_a_new_and_a_changed_file(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    changed = SOURCE.replace("line 3\n", "line three\n")
    stage(repo, "c1", {"src/new.py": "print('new')\n", "src/a.py": changed})

    listed = staged(repo, "list")
    assert listed.code == 0, listed
    header, row = listed.out.splitlines()
    assert header.split()[:3] == ["ID", "SESSION", "CREATED"]
    assert row.split()[:7] == ["c1", "-", *row.split()[2:4], "+1", "~1", "-0"]
    assert "pending" in row and " yes " in row and row.endswith("Agent change")
    review_state = repo / ".sandbox/workspaces/default/review/c1/state.json"
    assert not review_state.exists()  # list does not freeze

    shown = staged(repo, "show", "c1")
    assert shown.code == 0, shown
    assert review_state.exists()  # show does: the mount now refuses changes to /staged/c1
    lines = shown.out.splitlines()
    assert any(line.split()[:2] == ["create", "100644"] and "src/new.py" in line for line in lines)
    assert any(line.split()[:2] == ["update", "100644"] and "src/a.py" in line for line in lines)
    digest = next(line.split()[1] for line in lines if line.startswith("digest"))
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert "applies   yes" in shown.out
    doc = staged(repo, "show", "c1", "--json").json()
    assert doc["digest"] == digest
    assert {c["path"]: c["action"] for c in doc["changes"]} == {
        "src/new.py": "create",
        "src/a.py": "update",
    }

    diff = staged(repo, "diff", "c1")
    assert diff.code == 0, diff
    assert digest in diff.out
    assert "diff --git a/src/new.py b/src/new.py\nnew file mode 100644\n" in diff.out
    assert "--- /dev/null\n+++ b/src/new.py\n@@ -0,0 +1 @@\n+print('new')\n" in diff.out
    assert "--- a/src/a.py\n+++ b/src/a.py\n@@ -1,6 +1,6 @@\n" in diff.out
    assert "\n-line 3\n+line three\n" in diff.out
    assert "\x1b[" not in diff.out  # not a terminal: no color
    colored = staged(repo, "diff", "c1", "--color", "always")
    assert "\x1b[32m+line three\x1b[m" in colored.out


def test_commit_lands_one_commit_with_both_trailers(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    old_head = git(repo, "rev-parse", "HEAD").strip()
    changed = SOURCE.replace("line 3\n", "line three\n")
    stage(
        repo,
        "c1",
        {"src/new.py": "print('new')\n", "src/a.py": changed, "bin/run.sh": "#!/bin/sh\n"},
        message="Add new.py\n\nAnd change line 3.\n",
    )
    os.chmod(staged_dir(repo, "c1") / "files/bin/run.sh", 0o755)

    result = staged(repo, "commit", "c1")
    assert result.code == 0, result
    head = git(repo, "rev-parse", "HEAD").strip()
    assert head in result.out and "on main (+2 ~1 -0)" in result.out
    assert git(repo, "rev-list", "--count", f"{old_head}..HEAD").strip() == "1"
    assert git(repo, "rev-parse", "HEAD~1").strip() == old_head
    message = git(repo, "log", "-1", "--format=%B")
    assert message.startswith("Add new.py\n\nAnd change line 3.\n\n")
    assert "Sandboxfs-Session: unknown\n" in message
    assert "Sandboxfs-Staged: c1\n" in message
    assert git(repo, "log", "-1", "--format=%an <%ae>").strip() == "Rita Repo <rita@example.com>"
    assert git(repo, "show", "HEAD:src/new.py") == "print('new')\n"
    assert git(repo, "show", "HEAD:src/a.py") == changed
    assert "100755 blob" in git(repo, "ls-tree", "HEAD", "bin/run.sh")
    assert (repo / "src/new.py").read_text() == "print('new')\n"
    assert (repo / "src/a.py").read_text() == changed
    assert (repo / "bin/run.sh").stat().st_mode & 0o100
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "diff", "--cached", "--name-only") == ""

    state = json.loads((repo / ".sandbox/workspaces/default/review/c1/state.json").read_text())
    assert state["status"] == "committed" and state["commit"] == head and state["branch"] == "main"
    assert staged_dir(repo, "c1").is_dir()  # the staged files stay until discarded
    listed = staged(repo, "list", "--json")
    [row] = json.loads(listed.out)  # a list is one JSON array
    assert (row["status"], row["applies"], row["commit"]) == ("committed", "-", head)
    again = staged(repo, "commit", "c1")
    refused(again, "c1", "committed as")
    assert git(repo, "rev-parse", "HEAD").strip() == head

    details = [e["detail"] for e in audit_entries(repo) if e.get("op") == "stage"]
    assert details[0] == f"commit {head}"
    assert details[1].startswith("commit refused: it was committed")
    entry = next(e for e in audit_entries(repo) if e.get("op") == "stage")
    assert (entry["path"], entry["zone"], entry["allowed"], entry["comm"]) == (
        "/staged/c1",
        "staged",
        True,
        "sandboxfs",
    )


def test_a_conflict_with_head_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"src/a.py": SOURCE.replace("line 10\n", "agent's line 10\n")})
    write(repo / "src/a.py", SOURCE.replace("line 10\n", "user's line 10\n"))
    git(repo, "commit", "-q", "-am", "user edit", date=AFTER_STAGING)
    before = snapshot_of_repo(repo)

    listed = staged(repo, "list")
    assert " conflict " in listed.out
    result = staged(repo, "commit", "c1")
    refused(result, "c1", "src/a.py conflicts with changes made in HEAD since it was staged")
    assert snapshot_of_repo(repo) == before
    assert "CONFLICT" in staged(repo, "show", "c1").out


def test_a_base_that_moved_without_conflict_is_merged(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"src/a.py": SOURCE.replace("line 2\n", "agent's line 2\n")})
    write(repo / "src/a.py", SOURCE.replace("line 18\n", "user's line 18\n"))
    git(repo, "commit", "-q", "-am", "user edit", date=AFTER_STAGING)

    assert "merged with changes made in HEAD" in staged(repo, "show", "c1").out
    result = staged(repo, "commit", "c1")
    assert result.code == 0, result
    merged = SOURCE.replace("line 2\n", "agent's line 2\n").replace("line 18\n", "user's line 18\n")
    assert git(repo, "show", "HEAD:src/a.py") == merged
    assert (repo / "src/a.py").read_text() == merged
    assert git(repo, "status", "--porcelain") == ""


@pytest.mark.parametrize("how", ["unstaged", "in the index", "untracked"])
def test_a_target_with_uncommitted_changes_is_refused(tmp_path: Path, how: str) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"src/a.py": SOURCE + "more\n", "src/new.py": "new\n"})
    if how == "untracked":
        write(repo / "src/new.py", "mine\n")
        path = "src/new.py"
    else:
        write(repo / "src/a.py", SOURCE + "my own edit\n")
        if how == "in the index":
            git(repo, "add", "src/a.py")
        path = "src/a.py"
    before = snapshot_of_repo(repo)
    result = staged(repo, "commit", "c1")
    refused(result, "c1", path)
    assert "untracked" in result.err if how == "untracked" else "uncommitted" in result.err
    assert snapshot_of_repo(repo) == before


@pytest.mark.parametrize(
    ("files", "deletions", "needle"),
    [
        ({}, ["../x"], "../x leaves the repository"),
        ({}, ["/etc/passwd"], "/etc/passwd leaves the repository"),
        ({".env": "SECRET=1\n"}, None, ".env is deny-listed (.env)"),
        ({"config/.netrc": "key\n"}, None, "config/.netrc is deny-listed (.netrc)"),
        ({".git/hooks/pre-commit": "#!/bin/sh\n"}, None, ".git/hooks/pre-commit is inside .git"),
        ({"sandboxfs.yaml": "deny: []\n"}, None, "sandboxfs.yaml is protected"),
        ({".sandbox/audit.jsonl": "{}\n"}, None, "sandboxfs's state directory"),
    ],
)
def test_paths_that_must_not_be_written_are_refused(
    tmp_path: Path, files: dict[str, str], deletions: list[str] | None, needle: str
) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"src/ok.py": "ok\n", **files}, deletions=deletions)
    before = snapshot_of_repo(repo)
    result = staged(repo, "commit", "c1")
    refused(result, "c1", needle)
    assert snapshot_of_repo(repo) == before
    assert not (repo / "src/ok.py").exists()
    assert not (tmp_path / "x").exists()


def test_a_symlink_on_the_way_in_the_repository_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    repo = make_repo(tmp_path)
    (repo / "src").rename(repo / "real-src")
    (repo / "src").symlink_to(elsewhere)  # committed as a symlink
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "src is a link", date=BEFORE_STAGING + 1)
    (repo / "lib").symlink_to(elsewhere)  # only in the working tree
    stage(repo, "c1", {"src/evil.py": "x\n"})
    stage(repo, "c2", {"lib/evil.py": "x\n"})
    stage(repo, "c3", {"ok.py": "x\n", "lib": "a file where the link is\n"})
    before = snapshot_of_repo(repo)

    refused(staged(repo, "commit", "c1"), "c1", "src/evil.py goes through src, which is a symlink")
    refused(staged(repo, "commit", "c2"), "c2", "lib/evil.py goes through a symlink")
    refused(staged(repo, "commit", "c3"), "c3", "lib is a symlink in the working tree")
    assert (repo / "lib").is_symlink()
    assert list(elsewhere.iterdir()) == []
    assert snapshot_of_repo(repo) == before
    # Deleting the tracked symlink itself is fine: it is unlinked, never followed.
    (elsewhere / "kept").write_text("k\n")
    stage(repo, "c4", {}, deletions=["src"])
    result = staged(repo, "commit", "c4")
    assert result.code == 0, result
    assert not (repo / "src").is_symlink() and (elsewhere / "kept").read_text() == "k\n"
    assert "src" not in git(repo, "ls-files").split()


def test_branch_leaves_head_index_and_working_tree_alone(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    write(repo / "src/a.py", SOURCE + "an unrelated uncommitted edit\n")
    stage(repo, "c1", {"src/new.py": "new\n", "src/a.py": SOURCE.replace("line 1\n", "LINE 1\n")})
    before = snapshot_of_repo(repo)
    index_bytes = (repo / ".git/index").read_bytes()

    result = staged(repo, "commit", "c1", "--branch", "agent/c1")
    assert result.code == 0, result
    assert "new branch agent/c1" in result.out
    assert snapshot_of_repo(repo) == before
    assert (repo / ".git/index").read_bytes() == index_bytes
    assert git(repo, "symbolic-ref", "HEAD").strip() == "refs/heads/main"
    assert git(repo, "rev-parse", "agent/c1~1").strip() == before[0].strip()
    assert git(repo, "show", "agent/c1:src/new.py") == "new\n"
    assert git(repo, "show", "agent/c1:src/a.py") == SOURCE.replace("line 1\n", "LINE 1\n")
    assert "Sandboxfs-Staged: c1" in git(repo, "log", "-1", "--format=%B", "agent/c1")

    stage(repo, "c2", {"src/other.py": "o\n"})
    refused(staged(repo, "commit", "c2", "--branch", "agent/c1"), "c2", "exists already")
    assert git(repo, "rev-parse", "agent/c1").strip() == result.out.split(" as ")[1].split()[0]


def test_no_repository_code_runs(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    hooks = repo / ".git/hooks"
    for hook in ("pre-commit", "post-commit", "reference-transaction", "post-index-change"):
        (hooks / hook).write_text(f"#!/bin/sh\ntouch {markers}/{hook}\n")
        (hooks / hook).chmod(0o755)
    git(repo, "config", "core.fsmonitor", f"touch {markers}/fsmonitor")
    git(repo, "config", "filter.x.clean", f"touch {markers}/clean; cat")
    git(repo, "config", "filter.x.smudge", f"touch {markers}/smudge; cat")
    git(repo, "config", "diff.x.textconv", f"touch {markers}/textconv; cat")
    write(repo / ".git/info/attributes", "* filter=x diff=x\n")
    stage(repo, "c1", {"src/a.py": SOURCE + "more\n", "src/new.py": "new\n"})

    for args in (["list"], ["show", "c1"], ["diff", "c1"], ["commit", "c1"]):
        result = staged(repo, *args)
        assert result.code == 0, (args, result)
    assert list(markers.iterdir()) == []
    assert git(repo, "show", "HEAD:src/new.py") == "new\n"
    # The traps are real: the user's own git runs them.
    git(repo, "status", "--porcelain")
    assert {p.name for p in markers.iterdir()} >= {"fsmonitor", "clean"}


def test_what_was_reviewed_is_what_lands(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    base = stage(repo, "c1", {"src/new.py": "reviewed\n"})
    shown = staged(repo, "diff", "c1")
    assert "+reviewed" in shown.out
    write(base / "files/src/new.py", "changed by the agent after the review\n")
    write(base / "files/src/sneaky.py", "added after the review\n")
    assert "+reviewed" in staged(repo, "diff", "c1").out
    result = staged(repo, "commit", "c1")
    assert result.code == 0, result
    assert git(repo, "show", "HEAD:src/new.py") == "reviewed\n"
    assert "sneaky" not in git(repo, "ls-tree", "-r", "--name-only", "HEAD")


def test_expect_compares_the_digest(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"src/new.py": "new\n"})
    digest = staged(repo, "show", "c1", "--json").json()["digest"]
    before = snapshot_of_repo(repo)
    wrong = "sha256:" + "0" * 64
    refused(staged(repo, "commit", "c1", "--expect", wrong), "c1", f"not the expected {wrong}")
    assert snapshot_of_repo(repo) == before
    result = staged(repo, "commit", "c1", "--expect", digest.removeprefix("sha256:"))
    assert result.code == 0, result


def test_every_deletion_is_shown_and_lands(tmp_path: Path) -> None:
    names = [f"old/file{n:03}.txt" for n in range(300)]
    repo = make_repo(tmp_path, {**{n: f"{n}\n" for n in names}, "keep.txt": "k\n"})
    stage(repo, "c1", {}, deletions=names)
    shown = staged(repo, "show", "c1")
    assert shown.code == 0, shown
    assert all(f"delete   100644          -  {n}\n" in shown.out for n in names)
    assert "+0 ~0 -300" in shown.out
    doc = staged(repo, "show", "c1", "--json").json()
    assert doc["deletions"] == names
    assert sorted(c["path"] for c in doc["changes"] if c["action"] == "delete") == names
    assert staged(repo, "commit", "c1").code == 0
    assert git(repo, "ls-files") == "keep.txt\n"
    assert not (repo / "old").exists()
    assert git(repo, "status", "--porcelain") == ""


def test_names_and_content_are_printed_escaped(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    evil = "evil\x1b[31mred.txt"
    stage(
        repo,
        "c1",
        {evil: "text \x1b]0;title\x07 and \x9b\u202e\n", "two\nlines.txt": "x\n"},
        message="Subject \x1b[2J\n",
        deletions=["gone\x1b[31m"],
    )
    outputs = {}
    for args in (["list"], ["show", "c1"], ["diff", "c1"], ["commit", "c1"]):
        result = staged(repo, *args)
        outputs[args[0]] = result.out
        assert "\x1b" not in result.out + result.err, (args, result)
        assert "\x9b" not in result.out + result.err
    assert "evil\\x1b[31mred.txt" in outputs["show"]
    assert "gone\\x1b[31m" in outputs["show"]
    assert "+text \\x1b]0;title\\x07 and \\x9b\\u202e\n" in outputs["diff"]
    assert "Subject \\x1b[2J" in outputs["list"]
    assert "two\\x0alines.txt" in outputs["show"]
    tracked = set(git(repo, "ls-files", "-z").split("\0"))
    assert tracked == {"", "src/a.py", "two\nlines.txt", evil}
    doc = staged(repo, "show", "c1", "--json").json()
    assert evil in [c["path"] for c in doc["changes"]]  # JSON keeps the name, escaped by JSON


def test_refused_entries_are_listed_and_refuse_the_commit(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    base = stage(repo, "c1", {"src/ok.py": "ok\n"})
    (base / "files/src/link").symlink_to("/etc/passwd")
    os.mkfifo(base / "files/src/pipe")
    write(base / "NOTES.md", "not part of the format\n")
    shown = staged(repo, "show", "c1")
    assert "symlink           files/src/link" in shown.out
    assert "fifo              files/src/pipe" in shown.out
    assert "unknown entries (ignored)\n    NOTES.md" in shown.out
    before = snapshot_of_repo(repo)
    refused(
        staged(repo, "commit", "c1"),
        "c1",
        "files/src/link is a symlink, not a regular file",
        "files/src/pipe is a fifo",
    )
    assert snapshot_of_repo(repo) == before
    snapshot = repo / ".sandbox/workspaces/default/review/c1/snapshot/files/src"
    assert sorted(p.name for p in snapshot.iterdir()) == ["ok.py"]


def test_discard(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"src/new.py": "new\n"})
    result = staged(repo, "discard", "c1")
    assert result.code == 0, result
    assert not staged_dir(repo, "c1").exists()
    review = repo / ".sandbox/workspaces/default/review/c1"
    assert (review / "snapshot/files/src/new.py").read_text() == "new\n"
    assert json.loads((review / "state.json").read_text())["status"] == "discarded"
    [row] = json.loads(staged(repo, "list", "--json").out)
    assert (row["id"], row["status"], row["applies"]) == ("c1", "discarded", "-")
    refused(staged(repo, "commit", "c1"), "c1", "discarded")
    assert not (repo / "src/new.py").exists()
    assert audit_entries(repo)[-2]["detail"] == "discard"


def review_dir(repo: Path, commit_id: str) -> Path:
    return repo / ".sandbox" / "workspaces" / "default" / "review" / commit_id


def test_prune_removes_what_committed_and_discarded_ones_leave(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "landed", {"src/one.py": "one\n"})
    stage(repo, "dropped", {"src/two.py": "two\n"})
    stage(repo, "waiting", {"src/three.py": "three\n"})
    assert staged(repo, "commit", "landed").code == 0
    assert staged(repo, "discard", "dropped").code == 0
    assert staged_dir(repo, "landed").is_dir() and review_dir(repo, "dropped").is_dir()

    # Finished less than an hour ago: nothing to prune yet.
    recent = staged(repo, "prune", "--older-than", "1h", "--yes")
    assert recent.code == 0 and recent.out.startswith("nothing to prune"), recent
    # No terminal and no --yes: it says what it would remove, and removes nothing.
    unasked = staged(repo, "prune", "--older-than", "0s")
    assert unasked.code == 2 and len(unasked.err.strip().splitlines()) == 1, unasked
    assert "would remove 2 staged commits" in unasked.err and "--yes" in unasked.err
    assert sorted(line.split()[0] for line in unasked.out.splitlines()[1:]) == [
        "dropped",
        "landed",
    ]
    dry = staged(repo, "prune", "--older-than", "0s", "--dry-run", "--json")
    assert dry.code == 0 and sorted(p["id"] for p in dry.json()["would_remove"]) == [
        "dropped",
        "landed",
    ]
    assert [p["id"] for p in dry.json()["kept_pending"]] == ["waiting"]
    assert review_dir(repo, "landed").is_dir()

    pruned = staged(repo, "prune", "--older-than", "0s", "--yes")
    assert pruned.code == 0, pruned
    assert "pruned 2 staged commits" in pruned.out
    assert "kept 1 pending staged commit" in pruned.err and "--pending" in pruned.err
    for commit_id in ("landed", "dropped"):
        assert not staged_dir(repo, commit_id).exists()
        assert not review_dir(repo, commit_id).exists()
    assert staged_dir(repo, "waiting").is_dir()  # pending: never without --pending
    assert [row["id"] for row in staged(repo, "list", "--json").json()] == ["waiting"]
    assert git(repo, "show", "HEAD:src/one.py") == "one\n"  # the commit itself stays
    details = [e["detail"] for e in audit_entries(repo) if e.get("op") == "stage"]
    assert sum(1 for d in details if d.startswith("prune (committed ")) == 1
    assert sum(1 for d in details if d.startswith("prune (discarded ")) == 1

    everything = staged(repo, "prune", "--older-than", "0s", "--pending", "--yes", "--json")
    assert everything.code == 0, everything
    assert [p["id"] for p in everything.json()["removed"]] == ["waiting"]
    assert everything.json()["freed_bytes"] > 0
    assert not staged_dir(repo, "waiting").exists() and not review_dir(repo, "waiting").exists()
    assert staged(repo, "list", "--json").json() == []  # an empty list is still one array
    assert not any((repo / ".sandbox" / ".pruning").iterdir())


def test_prune_goes_by_when_it_was_committed_or_discarded(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    for commit_id in ("old", "new"):
        stage(repo, commit_id, {f"src/{commit_id}.py": "x\n"})
        assert staged(repo, "discard", commit_id).code == 0
    state_file = review_dir(repo, "old") / "state.json"
    state = json.loads(state_file.read_text())
    state["discarded_at"] = "2020-01-01T00:00:00Z"
    state_file.write_text(json.dumps(state))
    result = staged(repo, "prune", "--older-than", "7d", "--yes", "--json")
    assert result.code == 0, result
    assert [p["id"] for p in result.json()["removed"]] == ["old"]
    assert not review_dir(repo, "old").exists() and review_dir(repo, "new").is_dir()


@pytest.mark.parametrize("value", ["7x", "", "-1d", "1.5h", "7", "d", "7 d", "1D"])
def test_prune_refuses_a_bad_duration(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"a.py": "a\n"})
    argv = ["staged", "prune", "--older-than", value, "--pending", "--yes", "--project", str(repo)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--older-than" in err and ("invalid duration" in err or "expected one" in err), err
    assert staged_dir(repo, "c1").is_dir()


def test_a_repository_without_commits(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, {})
    stage(repo, "c1", {"README.md": "hello\n"})
    result = staged(repo, "commit", "c1")
    assert result.code == 0, result
    assert git(repo, "ls-files") == "README.md\n"
    assert git(repo, "rev-list", "--count", "HEAD").strip() == "1"
    assert git(repo, "status", "--porcelain") == ""


def test_mode_changes_are_shown_and_land(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, {"tool.sh": "#!/bin/sh\n", "src/a.py": SOURCE})
    base = stage(repo, "c1", {"tool.sh": "#!/bin/sh\n"})
    (base / "files/tool.sh").chmod(0o755)
    shown = staged(repo, "show", "c1")
    line = next(line for line in shown.out.splitlines() if "tool.sh" in line)
    assert line.split()[:3] == ["!", "mode", "100755"] and "mode 100644 -> 100755" in line
    assert staged(repo, "commit", "c1").code == 0
    assert "100755 blob" in git(repo, "ls-tree", "HEAD", "tool.sh")
    assert stat.S_IMODE((repo / "tool.sh").stat().st_mode) & 0o100


def test_flagged_paths_are_listed_first(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    stage(repo, "c1", {"a.py": "a\n", "Makefile": "all:\n", ".github/workflows/ci.yml": "on:\n"})
    names = [".github/workflows/ci.yml", "Makefile", "a.py"]
    out = staged(repo, "show", "c1").out
    lines = [line for line in out.splitlines() if "create" in line.split()[:2]]
    assert [next(n for n in names if f"  {n}" in line) for line in lines] == names
    assert [line.lstrip()[0] for line in lines] == ["!", "!", "c"]


def test_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    for args, needle in [
        (["show", "nope"], "no staged commit nope"),
        (["show", ".hidden"], "invalid staged commit id"),
        (["list", "--workspace", "../x"], "invalid workspace id"),
    ]:
        result = staged(repo, *args)
        assert result.code == 2, result
        assert len(result.err.strip().splitlines()) == 1 and needle in result.err
    plain = tmp_path / "plain"
    plain.mkdir()
    stage(plain, "c1", {"a": "a\n"})
    result = staged(plain, "show", "c1")
    assert result.code == 2 and "not in a git repository" in result.err


def test_project_in_a_subdirectory_of_the_repository(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, {"top.txt": "t\n", "sub/proj/a.txt": "a\n"})
    project = repo / "sub/proj"
    stage(project, "c1", {"a.txt": "A\n", "new.txt": "n\n"})
    assert staged(project, "commit", "c1").code == 0
    assert git(repo, "show", "HEAD:sub/proj/a.txt") == "A\n"
    assert git(repo, "show", "HEAD:sub/proj/new.txt") == "n\n"
    assert git(repo, "status", "--porcelain") == "?? sub/proj/.sandbox/\n"


# ----- end to end: an untrusted agent stages through a real mount -------------------------------


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The real command line: `sandboxfs staged ...`."""
    return subprocess.run(
        [sys.executable, "-m", "sandboxfs", "staged", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_end_to_end_through_an_untrusted_mount(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write(repo / "src/a.py", SOURCE)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "initial", date=BEFORE_STAGING)
    with mounted(tmp_path / "mnt", repo, "untrusted") as m:
        agent = sh(
            "mkdir -p staged/fix1/files/src && "
            "printf 'print(1)\\n' > staged/fix1/files/src/new.py && "
            "printf 'Add new.py\\n' > staged/fix1/message.txt",
            cwd=m.mnt,
        )
        assert agent.returncode == 0, agent.stderr
        m.wait_audit(lambda e: e.get("path") == "/staged/fix1/message.txt")

        listed = cli("list", "--project", repo)
        assert listed.returncode == 0, listed.stderr
        assert f"fix1  {m.session}" in listed.stdout and "+1 ~0 -0" in listed.stdout
        shown = cli("show", "fix1", "--project", repo)
        assert shown.returncode == 0, shown.stderr
        assert "create" in shown.stdout and "src/new.py" in shown.stdout
        # Frozen: the agent can no longer change what was reviewed.
        late = sh("printf x > staged/fix1/files/src/late.py", cwd=m.mnt)
        assert "Permission denied" in late.stderr
        denial = m.wait_audit(lambda e: e.get("path") == "/staged/fix1/files/src/late.py")
        assert denial["allowed"] is False and "under review" in denial["reason"]
        committed = cli("commit", "fix1", "--project", repo)
        assert committed.returncode == 0, committed.stderr
    assert git(repo, "show", "HEAD:src/new.py") == "print(1)\n"
    message = git(repo, "log", "-1", "--format=%B")
    assert f"Sandboxfs-Session: {m.session}\nSandboxfs-Staged: fix1\n" in message
    assert git(repo, "status", "--porcelain") == ""
    assert "src/late.py" not in git(repo, "ls-tree", "-r", "--name-only", "HEAD")
