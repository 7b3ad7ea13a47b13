"""sandboxfs.project.state: durations, sizes, the sessions of a state dir, the mark of a session
in use, and removing trees an agent left (read-only directories, symlinks). Real mounts, runs
and the CLI are in tests/integration/test_sessions.py."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from sandboxfs.api import Sandbox, SandboxSetupError
from sandboxfs.errors import Failure
from sandboxfs.layout import session_dir
from sandboxfs.project import state


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0s", 0), ("45s", 45), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("2w", 1209600)],
)
def test_durations(text: str, seconds: int) -> None:
    assert state.parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "7", "d", "7x", "-1d", "1.5h", " 7d", "7d ", "7 d", "7D"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid duration .*\(30m, 12h, 7d\)"):
        state.parse_duration(text)


def test_formats() -> None:
    assert [state.format_duration(s) for s in (0, 59, 60, 7199, 86400 * 3 + 5)] == [
        "0s",
        "59s",
        "1m",
        "1h",
        "3d",
    ]
    assert [state.format_size(n) for n in (0, 1023, 1024, 5 << 20, 3 << 30, 5000 << 30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 MiB",
        "3.0 GiB",
        "5000.0 GiB",
    ]


def test_usage_counts_each_inode_once_and_follows_no_link(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "data").write_bytes(b"x" * 100_000)
    os.link(tree / "sub" / "data", tree / "again")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"y" * 1_000_000)
    (tree / "link").symlink_to(outside, target_is_directory=True)
    found = state.usage(tree)
    assert found.entries == 4  # tree, sub, data (once), link; not what the link points at
    assert 100_000 <= found.bytes < 1_000_000
    assert found.newest >= os.lstat(tree / "link").st_ctime
    assert state.usage(tmp_path / "missing") == state.Usage()


def test_remove_tree_with_read_only_directories_and_links(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "locked" / "deeper").mkdir(parents=True)
    (tree / "locked" / "deeper" / "f").write_text("f")
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("p")
    (tree / "locked" / "to-keep").symlink_to(keep)
    os.chmod(tree / "locked" / "deeper", 0o500)
    os.chmod(tree / "locked", 0o500)
    assert state.remove_tree(tree) is None
    assert not tree.exists()
    assert (keep / "precious").read_text() == "p"  # the link went, not what it pointed at


def _session(**fields: object) -> state.Session:
    base: dict[str, object] = {
        "workspace": "default",
        "id": "s",
        "path": Path("/nowhere"),
        "bytes": 1,
        "entries": 1,
        "created": None,
        "last_used": 1000.0,
        "in_use": False,
    }
    return state.Session(**(base | fields))  # type: ignore[arg-type]


def test_stale_sessions_never_include_one_in_use() -> None:
    found = [
        _session(id="old", last_used=1000.0),
        _session(id="busy", last_used=1000.0, in_use=True),
        _session(id="recent", last_used=9000.0),
    ]
    stale, busy = state.stale_sessions(found, timedelta(seconds=3600), now=10_000.0)
    assert [s.id for s in stale] == ["old"]
    assert [s.id for s in busy] == ["busy"]


def test_an_api_sandbox_holds_its_session(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    sb = Sandbox.open(project, trust="session", session="api1")
    path = session_dir(project, "default", "api1")
    try:
        sb.write("/session/working/notes.txt", "n" * 50_000)
        assert state.locked_by_someone(path)
        [found] = state.sessions(project, [])
        assert (found.id, found.in_use, found.mounts) == ("api1", True, [])
        assert found.bytes >= 50_000 and found.created is not None
        result = state.prune_sessions(project, [found], timedelta(0), [])
        assert result.removed == [] and [why for _, why in result.kept] == ["it is in use"]
        assert path.is_dir()
    finally:
        sb.close()
    assert not state.locked_by_someone(path)
    [found] = state.sessions(project, [])
    assert not found.in_use
    result = state.prune_sessions(project, [found], timedelta(0), [])
    assert [s.id for s in result.removed] == ["api1"] and not result.failed
    assert not path.exists()
    assert state.sessions(project, []) == []


def test_hold_refuses_a_directory_pruned_meanwhile(tmp_path: Path) -> None:
    path = tmp_path / "session"
    path.mkdir()
    st = os.stat(path)
    fd = state.hold(path, (st.st_dev, st.st_ino))
    os.close(fd)
    with pytest.raises(Failure, match="was pruned while it was being opened"):
        state.hold(path, (st.st_dev, st.st_ino + 1))
    with pytest.raises(Failure, match="was pruned"):
        state.hold(tmp_path / "gone")


def test_a_sandbox_on_a_session_being_pruned_fails_to_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()

    def pruned(path: Path, expected: tuple[int, int] | None = None) -> int:
        raise Failure(f"session directory {path} was pruned while it was being opened")

    monkeypatch.setattr("sandboxfs.api.disk.hold", pruned)
    with pytest.raises(SandboxSetupError, match="was pruned"):
        Sandbox.open(project, session="s1")
