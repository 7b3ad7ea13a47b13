"""sandboxfs.staging without git: the staged-commit format, digests, escaping, path checks,
flags, commit messages."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandboxfs import staging
from sandboxfs.config.model import DEFAULT_DENY, DEFAULT_PROTECT
from sandboxfs.core.policy import Patterns
from sandboxfs.errors import Failure
from sandboxfs.staging import (
    MODE_EXEC,
    MODE_FILE,
    Refused,
    RepoState,
    StagedTree,
    TooLarge,
    Workspace,
    commit_message,
    escape_name,
    escape_text,
    flag_patterns,
    make_plan,
    parse_deletions,
    path_problem,
    pending,
    read_tree,
    review_order,
    runs_code,
    write_tree,
)
from sandboxfs.staging import format as staged_format

DENY = Patterns(DEFAULT_DENY)
PROTECT = Patterns(DEFAULT_PROTECT)


@contextmanager
def opened(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def read(path: Path, commit_id: str = "c1") -> StagedTree:
    with opened(path) as fd:
        return read_tree(fd, commit_id)


def make(root: Path, files: dict[str, bytes], **top: bytes) -> Path:
    for rel, data in {**{f"files/{k}": v for k, v in files.items()}, **top}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


# ----- the format ------------------------------------------------------------------------------


def test_reads_message_files_modes_deletions_and_unknown_entries(tmp_path: Path) -> None:
    root = make(
        tmp_path / "c1",
        {"src/a.py": b"a\n", "bin/run": b"#!/bin/sh\n"},
        **{
            "message.txt": b"Subject\n\nBody\n",
            "deletions.txt": b"old.py\r\n\n  \nold.py\ndir/x\n",
            "NOTES": b"?",
        },
    )
    (root / "files/bin/run").chmod(0o744)  # any x bit proposes 100755
    (root / "files/empty-dir").mkdir()
    tree = read(root)
    assert tree.message == b"Subject\n\nBody\n"
    assert sorted(tree.files) == ["bin/run", "src/a.py"]
    assert tree.files["src/a.py"].mode == MODE_FILE
    assert tree.files["bin/run"].mode == MODE_EXEC
    assert tree.files["src/a.py"].data == b"a\n"
    assert tree.deletions == ["old.py", "dir/x"]
    assert tree.unknown == ["NOTES"]
    assert tree.refused == []


def test_non_regular_entries_are_refused_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret\n")
    root = make(tmp_path / "c1", {"ok": b"ok\n"}, **{"message.txt": b"m\n"})
    (root / "files/link").symlink_to(outside / "secret")
    (root / "files/dirlink").symlink_to(outside)
    os.mkfifo(root / "files/pipe")
    tree = read(root)
    assert sorted(tree.files) == ["ok"]
    assert sorted(tree.refused) == [
        Refused("files/dirlink", "symlink"),
        Refused("files/link", "symlink"),
        Refused("files/pipe", "fifo"),
    ]


def test_top_level_entries_that_are_not_files_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "c1"
    root.mkdir()
    (root / "message.txt").symlink_to("/etc/hostname")
    (root / "files").symlink_to("/etc")
    tree = read(root)
    assert tree.message is None and tree.files == {}
    assert sorted(tree.refused) == [Refused("files", "symlink"), Refused("message.txt", "symlink")]


def test_parse_deletions() -> None:
    assert parse_deletions(b"a\n\nb\r\nc") == ["a", "b", "c"]
    assert parse_deletions(b"a\na\n") == ["a"]
    assert parse_deletions(b"") == []
    assert parse_deletions(b"caf\xe9\n") == ["caf\udce9"]  # bytes that are not UTF-8 survive


def test_absurd_sizes_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make(tmp_path / "c1", {f"f{n}": b"x" * 10 for n in range(20)})
    monkeypatch.setattr(staged_format, "MAX_ENTRIES", 10)
    with pytest.raises(TooLarge, match="more than 10 files"):
        read(root)
    monkeypatch.setattr(staged_format, "MAX_ENTRIES", 1000)
    monkeypatch.setattr(staged_format, "MAX_TOTAL_BYTES", 100)
    with pytest.raises(TooLarge, match="too large to review") as caught:
        read(root)
    assert isinstance(caught.value, Failure)  # exit 1, not a user error's 2


# ----- the digest ------------------------------------------------------------------------------


def test_digest_is_stable_and_survives_the_snapshot(tmp_path: Path) -> None:
    files = {"b/x": b"x\n", "a": b"a\n", "c/d/e": b"\0binary"}
    one = make(tmp_path / "one", files, **{"message.txt": b"m\n", "deletions.txt": b"z\ny\n"})
    # Same content, created in the other order, plus an ignored unknown entry.
    reordered = dict(reversed(list(files.items())))
    two = make(tmp_path / "two", reordered, **{"deletions.txt": b"z\ny\n", "message.txt": b"m\n"})
    (two / "README").write_text("ignored")
    digest = read(one).digest()
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert read(two).digest() == digest
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    with opened(snapshot) as fd:
        write_tree(read(one), fd)
    assert read(snapshot).digest() == digest


@pytest.mark.parametrize(
    "change",
    ["content", "mode", "message", "no message", "deletion", "rename", "refused"],
)
def test_digest_changes_with_any_change(tmp_path: Path, change: str) -> None:
    root = make(tmp_path / "c1", {"a": b"a\n"}, **{"message.txt": b"m\n"})
    before = read(root).digest()
    if change == "content":
        (root / "files/a").write_bytes(b"A\n")
    elif change == "mode":
        (root / "files/a").chmod(0o755)
    elif change == "message":
        (root / "message.txt").write_bytes(b"m.\n")
    elif change == "no message":
        (root / "message.txt").unlink()
    elif change == "deletion":
        (root / "deletions.txt").write_bytes(b"b\n")
    elif change == "rename":
        (root / "files/a").rename(root / "files/b")
    else:
        (root / "files/l").symlink_to("a")
    assert read(root).digest() != before


# ----- escaping --------------------------------------------------------------------------------


def test_escape_name() -> None:
    assert escape_name("evil\x1b[31mred") == "evil\\x1b[31mred"
    assert escape_name("a\nb\tc\rd\x7f") == "a\\x0ab\\x09c\\x0dd\\x7f"
    assert escape_name("c1\x9b31m") == "c1\\x9b31m"  # C1 CSI
    assert escape_name("caf\udce9") == "caf\\xe9"  # a byte that is not UTF-8
    assert escape_name("abc\u202etxt.exe") == "abc\\u202etxt.exe"  # bidi override
    assert escape_name("a\\x1b") == "a\\\\x1b"  # a literal backslash cannot pass for an escape
    assert escape_name("plain/naïve ünïcode.py") == "plain/naïve ünïcode.py"


def test_escape_text_keeps_newlines_tabs_and_backslashes() -> None:
    assert escape_text("a\tb\nc\\n") == "a\tb\nc\\n"
    assert escape_text("\x1b]0;title\x07\x1b[2J\r\n") == "\\x1b]0;title\\x07\\x1b[2J\\x0d\n"
    assert escape_text("\x00\x85") == "\\x00\\x85"


# ----- path checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("../x", "leaves the repository"),
        ("a/../../x", "leaves the repository"),
        ("/etc/passwd", "leaves the repository (it is absolute)"),
        ("a\0b", "NUL"),
        (".git/x", "inside .git"),
        (".git/hooks/pre-commit", "inside .git"),
        ("sub/.GIT/config", "inside .git"),
        (".env", "is deny-listed (.env)"),
        ("config/.env.production", "is deny-listed (.env.*)"),
        ("home/.ssh/authorized_keys", "is deny-listed (.ssh/)"),
        ("sandboxfs.yaml", "is protected (/sandboxfs.yaml)"),
        (".sandbox/audit.jsonl", "state directory"),
        (".SANDBOX/x", "state directory"),
        ("a//b", "not a normalized path"),
        ("./a", "not a normalized path"),
        ("a/", "not a normalized path"),
        ("", "empty path"),
    ],
)
def test_paths_a_staged_commit_may_not_write(path: str, problem: str) -> None:
    found = path_problem(path, DENY, PROTECT)
    assert found is not None and problem in found


def test_protected_git_paths_are_refused_by_the_protect_list_too() -> None:
    assert PROTECT.match_within(".git/hooks/pre-commit", False) == ".git/hooks/"


@pytest.mark.parametrize(
    "path", ["src/a.py", "docs/sandboxfs.yaml", ".github/workflows/ci.yml", "a.git", "x/.gitx"]
)
def test_ordinary_paths_pass(path: str) -> None:
    assert path_problem(path, DENY, PROTECT) is None


# ----- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "mode", "flagged"),
    [
        (".github/workflows/ci.yml", MODE_FILE, True),
        (".gitlab-ci.yml", MODE_FILE, True),
        ("Makefile", MODE_FILE, True),
        ("lib/rules.mk", MODE_FILE, True),
        ("web/package.json", MODE_FILE, True),
        ("setup.py", MODE_FILE, True),
        ("pyproject.toml", MODE_FILE, True),
        (".envrc", MODE_FILE, True),
        (".vscode/tasks.json", MODE_FILE, True),
        (".idea/workspace.xml", MODE_FILE, True),
        (".pre-commit-config.yaml", MODE_FILE, True),
        ("docker/Dockerfile", MODE_FILE, True),
        ("scripts/run.sh", MODE_EXEC, True),
        ("scripts/run.sh", MODE_FILE, False),
        ("src/main.py", MODE_EXEC, False),
        ("docs/github/workflows.md", MODE_FILE, False),
    ],
)
def test_paths_that_run_code(path: str, mode: int, flagged: bool) -> None:
    assert runs_code(path, mode, flag_patterns({})) is flagged


def test_more_flags_from_the_environment() -> None:
    flags = flag_patterns({"SANDBOXFS_STAGED_FLAG": "*.nix:ci/"})
    assert runs_code("default.nix", MODE_FILE, flags)
    assert runs_code("ci/deploy.yml", MODE_FILE, flags)
    assert not runs_code("ci.txt", MODE_FILE, flags)


def test_flagged_paths_come_first() -> None:
    paths = ["b.py", "Makefile", "a.py", ".github/workflows/x.yml", "z/setup.py"]
    flagged = [p for p in paths if runs_code(p, MODE_FILE, flag_patterns({}))]
    assert review_order(paths, flagged) == [
        ".github/workflows/x.yml",
        "Makefile",
        "z/setup.py",
        "a.py",
        "b.py",
    ]


def test_a_plan_outside_git_lists_every_change_and_refuses(tmp_path: Path) -> None:
    tree = StagedTree(message=None, deletions=[f"d{n}" for n in range(300)])
    tree.files["Makefile"] = staging.StagedFile("Makefile", MODE_FILE, b"all:\n")
    repo = RepoState(tmp_path, None, DENY, PROTECT, flag_patterns({}))
    plan = make_plan(tree, repo, None, worktree=True)
    assert [c.path for c in plan.changes][:2] == ["Makefile", "d0"]
    assert len(plan.changes) == 301
    assert plan.applies == "no"
    assert plan.reasons()[:2] == [
        "the project is not in a git repository",
        "there is no message.txt (give the message with -m)",
    ]


# ----- commit messages -------------------------------------------------------------------------


def test_commit_message_gets_both_trailers() -> None:
    assert commit_message("\n\nFix it  \n\nBecause.\n\n\n", "ab12", "c1") == (
        b"Fix it\n\nBecause.\n\nSandboxfs-Session: ab12\nSandboxfs-Staged: c1\n"
    )


def test_commit_message_joins_an_existing_trailer_block() -> None:
    text = "Fix it\n\nSigned-off-by: A <a@x>\n"
    assert commit_message(text, None, "c1") == (
        b"Fix it\n\nSigned-off-by: A <a@x>\nSandboxfs-Session: unknown\nSandboxfs-Staged: c1\n"
    )
    assert commit_message("Subject: only a subject\n", "s", "c1").startswith(
        b"Subject: only a subject\n\nSandboxfs-Session: s\n"
    )


def test_commit_ids() -> None:
    for good in ["c1", "20261123T054400Z-ab12cd", "_x", "-x", "a" * 64]:
        assert staging.valid_id(good)
    for bad in ["", ".x", "..", "a/b", "a b", "a" * 65, "é"]:
        assert not staging.valid_id(bad)


# ----- pending ---------------------------------------------------------------------------------


def test_pending_lists_what_waits_skips_the_unreadable_and_freezes_nothing(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    assert pending(project, "default") == []  # nothing staged: not even a staged directory
    ws = Workspace(project, "default")
    ws.staged.mkdir(parents=True)
    assert pending(project, "default") == []
    for commit_id in ("a1", "b2", "c3", "d4", "e5", "g7"):
        make(ws.staged / commit_id, {"x": b"x\n"}, **{"message.txt": b"m\n"})
    (ws.staged / "h8").write_text("a file, not a staged commit")
    (ws.staged / ".dot").mkdir()  # not a staged commit id
    for commit_id, status in (("b2", "committed"), ("c3", "discarded"), ("d4", "pending")):
        ws.write_state(commit_id, {"id": commit_id, "status": status})
    ws.write_state("f6", {"id": "f6", "status": "pending", "digest": "sha256:0"})  # staged/ gone
    (ws.review / "e5" / "state.json").parent.mkdir()
    (ws.review / "e5" / "state.json").write_text("{not json")
    with pytest.raises(Failure, match="not valid JSON"):
        ws.listing()  # a review still says so
    (ws.review / "g7" / "state.json").mkdir(parents=True)  # not a file
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert pending(project, "default") == ["a1", "d4", "f6"]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    assert not (ws.review / "a1").exists()  # read, not frozen
