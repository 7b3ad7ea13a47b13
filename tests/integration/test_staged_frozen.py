"""A frozen staged commit does not change, through handles opened before it froze either.

`sandboxfs staged show` (and diff, commit, discard) writes `review/<id>/state.json`; from then on
the mount refuses every change below /staged/<id>. A descriptor the agent opened for writing before
that keeps no right to write: write(2), O_APPEND, ftruncate, fallocate, copy_file_range, sendfile
and the writeback of a shared mapping are refused through it with the same errno as the rule at open
(EACCES), each denial audited before the errno is returned, and the backing files keep their bytes.
Also the family: links and renames into or out of a frozen commit, hard links between staged
commits, and handles still open after `discard` or `commit`.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.api import PermissionDenied, Sandbox
from sandboxfs.core.policy import Trust, Zone
from tests.support.adapter import CTX, Harness, fails
from tests.support.cli import wait_until
from tests.support.mounts import Mount, mounted
from tests.support.staging import SOURCE, audit_entries, git, make_repo, staged, staged_dir

ORIGINAL = b"original\n"
MESSAGE = b"Agent change\n"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path)


@pytest.fixture
def mount(tmp_path: Path, repo: Path, request: pytest.FixtureRequest) -> Iterator[Mount]:
    trust = getattr(request, "param", "workspace")
    with mounted(tmp_path / "mnt", repo, trust) as m:
        yield m


def freeze(repo: Path, commit_id: str) -> None:
    """What `sandboxfs staged show ID` does (in-process): review/<id>/state.json, the snapshot."""
    shown = staged(repo, "show", commit_id)
    assert shown.code == 0, shown
    assert (repo / f".sandbox/workspaces/default/review/{commit_id}/state.json").exists()


def denials(repo: Path, path: str) -> list[dict[str, Any]]:
    return [e for e in audit_entries(repo) if e["path"] == path and e["allowed"] is False]


def refused(repo: Path, path: str, call: Callable[[], object], op: str = "write") -> None:
    """call fails with EACCES, and the refusal is in the audit log: a first one by the time it
    returns (the log is read at once, without waiting for a flush); one identical to a refusal
    already written is counted, and its count written when the one-second window ends."""

    def total() -> int:
        return sum(int(e.get("count", 1)) for e in denials(repo, path))

    before = total()
    with pytest.raises(OSError) as info:
        call()
    assert info.value.errno == errno.EACCES, info.value
    if before == 0:
        assert total() > 0, f"no audit entry for the refusal of {path}"
    else:
        assert wait_until(lambda: total() > before, timeout=5), f"refusal of {path} not counted"
    entries = denials(repo, path)
    entry = entries[-1]
    assert entry["op"] == op and entry["zone"] == "staged" and entry["errno"] == "EACCES"
    assert "under review" in entry["reason"], entry


def agent_stages(mnt: Path, commit_id: str, flags: int) -> tuple[int, int]:
    """The agent creates /staged/ID/files/a.txt and /staged/ID/message.txt through the mount and
    keeps a descriptor of each open for writing (the second with O_APPEND): (a.txt, message)."""
    base = mnt / "staged" / commit_id
    (base / "files").mkdir(parents=True)
    create = os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    data = os.open(base / "files/a.txt", create | flags, 0o644)
    message = os.open(base / "message.txt", create | os.O_WRONLY | os.O_APPEND, 0o644)
    assert os.write(data, ORIGINAL) == len(ORIGINAL)
    assert os.write(message, MESSAGE) == len(MESSAGE)
    return data, message


def backing(repo: Path, commit_id: str) -> dict[str, bytes]:
    base = staged_dir(repo, commit_id)
    return {
        str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()
    }


# ----- through the mount ------------------------------------------------------------------------


@pytest.mark.parametrize("mount", ["untrusted", "workspace"], indirect=True)
def test_handles_opened_before_the_freeze_write_nothing(repo: Path, mount: Mount) -> None:
    """untrusted (create-only /staged) writes through the handles that created its files;
    workspace may also open them again: both keep nothing once the commit is frozen."""
    data, message = agent_stages(mount.mnt, "c1", os.O_WRONLY)
    try:
        freeze(repo, "c1")
        before = backing(repo, "c1")
        assert before == {"files/a.txt": ORIGINAL, "message.txt": MESSAGE}
        a, msg = "/staged/c1/files/a.txt", "/staged/c1/message.txt"
        refused(repo, a, lambda: os.pwrite(data, b"X", 0))
        refused(repo, a, lambda: os.write(data, b"more"))
        refused(repo, msg, lambda: os.write(message, b"appended\n"))  # O_APPEND
        refused(repo, a, lambda: os.ftruncate(data, 1))
        refused(repo, a, lambda: os.ftruncate(data, 1 << 20))
        # FUSE here has no fallocate: glibc falls back to writing a byte per block, refused.
        with pytest.raises(OSError) as info:
            os.posix_fallocate(data, 0, 1 << 16)
        assert info.value.errno in (errno.EACCES, errno.EOPNOTSUPP)
        assert backing(repo, "c1") == before
        # A new name in it, as before this change.
        refused(repo, "/staged/c1/late.txt", lambda: (mount.mnt / "staged/c1/late.txt").touch())
    finally:
        os.close(data)
        os.close(message)
    assert backing(repo, "c1") == before
    # What lands is what was reviewed.
    committed = staged(repo, "commit", "c1")
    assert committed.code == 0, committed
    assert git(repo, "show", "HEAD:a.txt").encode() == ORIGINAL


def test_copy_file_range_sendfile_and_reopened_handles(repo: Path, mount: Mount) -> None:
    data, message = agent_stages(mount.mnt, "c1", os.O_RDWR)
    os.close(message)
    source = mount.mnt / "session/working/src.txt"
    source.write_bytes(b"SOURCE" * 100)
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    again = os.open(mount.mnt / "staged/c1/files/a.txt", os.O_RDWR | os.O_CLOEXEC)
    try:
        freeze(repo, "c1")
        before = backing(repo, "c1")
        a = "/staged/c1/files/a.txt"
        # Neither is implemented by the mount: the kernel falls back to WRITE requests.
        refused(repo, a, lambda: os.copy_file_range(src, data, 10, 0, 0))
        refused(repo, a, lambda: os.sendfile(data, src, 0, 10))
        refused(repo, a, lambda: os.pwrite(again, b"Y", 3))
        refused(repo, a, lambda: os.fchmod(again, 0o600), op="write")
        refused(repo, a, lambda: os.setxattr(again, "user.note", b"x"), op="write")
        assert backing(repo, "c1") == before
        # Reading still works, and shows what is on disk.
        assert os.pread(again, 100, 0) == ORIGINAL
    finally:
        for fd in (data, src, again):
            os.close(fd)


def test_shared_mapping_written_after_the_freeze_is_not_written_back(
    repo: Path, mount: Mount
) -> None:
    """The mount runs without the writeback cache: a shared mapping's dirty pages reach the
    daemon as WRITE requests, refused like any other; the next open drops the pages the kernel
    kept as the program changed them."""
    data, message = agent_stages(mount.mnt, "c1", os.O_RDWR)
    os.close(message)
    path = mount.mnt / "staged/c1/files/a.txt"
    try:
        mapping = mmap.mmap(data, 0)
        freeze(repo, "c1")
        before = len(denials(repo, "/staged/c1/files/a.txt"))
        mapping[0:1] = b"M"
        with pytest.raises(OSError) as info:
            mapping.flush()  # msync: the writeback's error
        assert info.value.errno in (errno.EACCES, errno.EIO), info.value
        mapping.close()
    finally:
        os.close(data)
    assert len(denials(repo, "/staged/c1/files/a.txt")) > before
    assert backing(repo, "c1")["files/a.txt"] == ORIGINAL
    assert path.read_bytes() == ORIGINAL  # not the page the kernel kept


def test_links_and_renames_around_a_frozen_commit(repo: Path, mount: Mount) -> None:
    st = mount.mnt / "staged"
    for commit_id in ("c1", "c2", "c3"):
        (st / commit_id / "files").mkdir(parents=True)
        (st / commit_id / "files/a.txt").write_bytes(ORIGINAL)
        (st / commit_id / "message.txt").write_bytes(MESSAGE)
    freeze(repo, "c1")
    before = backing(repo, "c1")
    # A second name for a file of a frozen commit, in a pending one, would let it be written.
    for op, call, src, dst in (
        ("link", os.link, "c1/files/a.txt", "c2/b"),
        ("link", os.link, "c2/files/a.txt", "c1/b"),
        ("rename", os.rename, "c2/files/a.txt", "c1/b"),
        ("rename", os.rename, "c1/message.txt", "c2/m"),
        ("rename", os.rename, "c3", "c1"),
        ("rename", os.rename, "c1", "c4"),
    ):
        refused(repo, f"/staged/{src}", lambda: call(st / src, st / dst), op)  # noqa: B023
        assert denials(repo, f"/staged/{src}")[-1]["dest"] == f"/staged/{dst}"
    # Between two pending commits: a hard link is refused (one would change the other once
    # frozen); within one, allowed.
    with pytest.raises(OSError) as info:
        os.link(st / "c2/files/a.txt", st / "c3/b")
    assert info.value.errno == errno.EXDEV
    entry = denials(repo, "/staged/c2/files/a.txt")[-1]
    assert entry["op"] == "link" and entry["dest"] == "/staged/c3/b" and entry["errno"] == "EXDEV"
    os.link(st / "c2/files/a.txt", st / "c2/files/b.txt")
    os.rename(st / "c2/files/b.txt", st / "c3/files/b.txt")  # a move shares nothing
    assert backing(repo, "c1") == before


def test_handles_after_discard_and_commit(repo: Path, mount: Mount) -> None:
    """discard removes /staged/ID behind the mount's back and commit lands the snapshot: a
    descriptor still open then writes nothing (before, it wrote into the removed file, or
    into the live directory after what was committed)."""
    (mount.mnt / "staged/c1/files/src").mkdir(parents=True)
    kept = os.open(mount.mnt / "staged/c1/files/src/a.py", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(kept, SOURCE.replace("line 3\n", "line three\n").encode())
    (mount.mnt / "staged/c1/message.txt").write_bytes(MESSAGE)
    (mount.mnt / "staged/c2").mkdir()
    dropped = os.open(mount.mnt / "staged/c2/x.txt", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        committed = staged(repo, "commit", "c1")
        assert committed.code == 0, committed
        head = git(repo, "rev-parse", "HEAD")
        refused(repo, "/staged/c1/files/src/a.py", lambda: os.write(kept, b"late\n"))
        assert b"late" not in (staged_dir(repo, "c1") / "files/src/a.py").read_bytes()

        discarded = staged(repo, "discard", "c2")
        assert discarded.code == 0, discarded
        assert not staged_dir(repo, "c2").exists()
        refused(repo, "/staged/c2/x.txt", lambda: os.write(dropped, b"late\n"))
        # Nor can the discarded id be staged again (the kernel was told it is gone).
        assert wait_until(lambda: not (mount.mnt / "staged/c2").exists(), timeout=5)
        refused(repo, "/staged/c2", lambda: (mount.mnt / "staged/c2").mkdir())
    finally:
        os.close(kept)
        os.close(dropped)
    assert git(repo, "rev-parse", "HEAD") == head


# ----- the Python API ----------------------------------------------------------------------------


def test_the_api_probe_answers_as_the_operation_does(repo: Path) -> None:
    """check_permission is each operation's own checks in the gate, run without effect: once a
    staged commit is under review it answers "refused" for a write, a new file and a delete
    there, as write() and delete() then refuse (it used to answer "allowed": its second guard
    had no frozen-commit rule). The probe itself audits nothing; the operations audit their
    refusals."""
    with Sandbox.open(repo, trust="workspace") as sb:
        commit = sb.stage({"src/a.py": SOURCE.replace("line 3\n", "line three\n")}, "Change")
        changed, new = f"{commit.path}/files/src/a.py", f"{commit.path}/files/src/new.py"
        assert sb.check_permission("write", changed).allowed
        assert sb.check_permission("write", new).allowed
        assert sb.check_permission("delete", changed).allowed
        freeze(repo, commit.id)
        before = len(audit_entries(repo))
        for op, path in (("write", changed), ("write", new), ("delete", changed)):
            permission = sb.check_permission(op, path)
            assert not permission.allowed, (op, path)
            assert permission.error == "PermissionDenied", permission
            assert "under review" in permission.reason, permission
        sb.audit_entries()  # flushes the log
        assert len(audit_entries(repo)) == before, "the probe wrote audit entries"
        with pytest.raises(PermissionDenied, match="under review"):
            sb.write(changed, "late\n")
        with pytest.raises(PermissionDenied, match="under review"):
            sb.write(new, "late\n")
        with pytest.raises(PermissionDenied, match="under review"):
            sb.delete(changed)
    for path, op in ((changed, "write"), (new, "write"), (changed, "delete")):
        assert any(
            e["op"] == op and e["reason"] and "under review" in e["reason"]
            for e in denials(repo, path)
        ), (op, path)
    assert b"late" not in (staged_dir(repo, commit.id) / "files/src/a.py").read_bytes()


# ----- the adapter, without a mount -------------------------------------------------------------


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    h = Harness(tmp_path / "h", Trust.WORKSPACE, monkeypatch)
    yield h
    h.close()


def freeze_in(h: Harness, monkeypatch: pytest.MonkeyPatch, *ids: str) -> None:
    monkeypatch.setattr(h.guard, "_frozen", lambda top: top in ids)


async def open_for_writing(h: Harness, parent: str, name: bytes) -> tuple[int, int]:
    fi, attrs = await h.ops.create(await h.ino(parent), name, 0o644, os.O_WRONLY, CTX)
    assert await h.ops.write(fi.fh, 0, ORIGINAL) == len(ORIGINAL)
    return fi.fh, attrs.st_ino


async def test_only_writes_in_staged_ask_about_review(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write to any other zone costs nothing more than before: not even a call."""
    asked: list[int] = []
    real = harness.guard.reject_frozen_node

    def spy(caller: Any, op: Any, node: Any) -> None:
        asked.append(node.ino)
        real(caller, op, node)

    monkeypatch.setattr(harness.guard, "reject_frozen_node", spy)
    session_fh, _ = await open_for_writing(harness, "/session/working", b"n.txt")
    staged_fh, staged_ino = await open_for_writing(harness, "/staged/c0", b"n.txt")
    asked.clear()
    for _ in range(3):
        await harness.ops.write(session_fh, 0, b"x")
    assert asked == []
    await harness.ops.write(staged_fh, 0, b"x")
    assert asked == [staged_ino]
    for fh in (session_fh, staged_fh):
        await harness.ops.release(fh)


async def test_a_file_known_by_no_name_is_judged_by_its_last_one(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second name the mount never looked up (made before it started) keeps the inode in the
    commit after the known name is removed: the write is still refused."""
    fh, ino = await open_for_writing(harness, "/staged/c0", b"n.txt")
    base = harness.dirs[Zone.STAGED] / "c0"
    os.link(base / "n.txt", base / "other.txt")
    await harness.ops.unlink(await harness.ino("/staged/c0"), b"n.txt", CTX)
    node = harness.store.nodes[ino]
    assert node.parent is None and not node.links
    freeze_in(harness, monkeypatch, "c0")
    await fails(harness.ops.write(fh, 0, b"X"), errno.EACCES)
    harness.denial("write", "/staged/c0/n.txt", "staged", "EACCES", "under review")
    assert (base / "other.txt").read_bytes() == ORIGINAL
    await harness.ops.release(fh)


async def test_a_refused_write_drops_the_kernels_copy_at_next_open(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    fh, ino = await open_for_writing(harness, "/staged/c0", b"n.txt")
    harness.store.nodes[ino].cache_stamp = (1, 1)
    freeze_in(harness, monkeypatch, "c0")
    await fails(harness.ops.write(fh, 0, b"X"), errno.EACCES)
    assert harness.store.nodes[ino].cache_stamp is None
    await harness.ops.release(fh)
    # Nothing to store it with here (no mount): the next open drops the kernel's pages.
    assert harness.store.nodes[ino].cache_stamp is None
