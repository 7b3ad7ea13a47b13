"""The FUSE adapter (sandboxfs/fuse/operations.py and its mixins), driven without a mount.

A real `Store` over temporary zone directories, a `Policy` from the built-in defaults and a real
`AuditLog` are wired into `SandboxOperations`; the async callbacks are awaited with a fake request
context, as pyfuse3 would call them. Each test checks what the caller gets (the FUSEError errno or
the result) and what the audit log says.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pyfuse3
import pytest

from sandboxfs.audit.reader import read_entries
from sandboxfs.core.inodes import (
    CONTEXT_INO,
    CONTROL_INO,
    FIRST_DYNAMIC_INO,
    ROOT_INO,
    SPARE_INO_BASE,
    ZONE_INO,
)
from sandboxfs.core.policy import Zone
from sandboxfs.core.procnames import ProcessNames
from sandboxfs.fuse import file_ops, host_watch
from sandboxfs.fuse.operations import SandboxOperations
from tests.support.adapter import (
    COMM,
    CTX,
    SESSION_ID,
    WORKSPACE_ID,
    Harness,
    fails,
    make,
    no_mounts_left_behind,
)

__all__ = ["make", "no_mounts_left_behind"]  # fixtures, used by name

ZONE_NAMES = ["session", "workspace", "repo", "staged", "workers"]
ZONE_ROOT_REASON = "zone roots and / cannot be removed, renamed or changed"


def fields(**changes: bool) -> SimpleNamespace:
    """Stand-in for pyfuse3.SetattrFields: everything False unless given."""
    names = ("atime", "mtime", "ctime", "mode", "uid", "gid", "size")
    values: dict[str, bool] = {f"update_{n}": False for n in names}
    for key, value in changes.items():
        assert key in values, key
        values[key] = value
    return SimpleNamespace(**values)


def forget(ops: SandboxOperations, inode: int, count: int) -> None:
    # pyfuse3 calls forget without awaiting it; this handler is synchronous.
    ops.forget([(inode, count)])


# ===== lookup and getattr ========================================================================


async def test_root_lookup_and_getattr(make: Callable[[str], Harness]) -> None:
    h = make("untrusted")
    for name in ZONE_NAMES:
        attrs = await h.ops.lookup(ROOT_INO, name.encode(), CTX)
        assert attrs.st_ino == ZONE_INO[Zone(name)]
        assert stat.S_ISDIR(attrs.st_mode)
        assert attrs.st_mode & 0o700 == 0o700  # requests reach the daemon
    control = await h.ops.lookup(ROOT_INO, b".sandboxfs", CTX)
    assert control.st_ino == CONTROL_INO
    await fails(h.ops.lookup(ROOT_INO, b"etc", CTX), errno.ENOENT)
    await fails(h.ops.lookup(CONTROL_INO, b"other.json", CTX), errno.ENOENT)
    root = await h.ops.getattr(ROOT_INO, CTX)
    assert stat.S_ISDIR(root.st_mode)
    await fails(h.ops.getattr(9999, CTX), errno.ESTALE)
    assert h.entries() == []


async def test_lookup_and_getattr_allowed_are_not_audited(make: Callable[[str], Harness]) -> None:
    h = make("session")
    inode = await h.ino("/session/working/notes.txt")
    assert inode >= FIRST_DYNAMIC_INO
    attrs = await h.ops.getattr(inode, CTX)
    assert attrs.st_ino == inode
    assert attrs.st_size == len("session notes\n")
    assert stat.S_ISREG(attrs.st_mode)
    # The same backing file looked up again is the same inode.
    assert await h.ino("/session/working/notes.txt") == inode
    absent = await h.ops.lookup(await h.ino("/session/working"), b"missing.txt", CTX)
    assert absent.st_ino == 0  # a negative entry: "does not exist", cacheable
    assert h.entries() == []


@pytest.mark.parametrize("trust", ["untrusted", "session"])
async def test_repo_without_access_refuses_lookup_and_opendir(
    make: Callable[[str], Harness], trust: str
) -> None:
    h = make(trust)
    repo = await h.ino("/repo")  # zone roots always resolve
    assert repo == ZONE_INO[Zone.REPO]
    assert stat.S_ISDIR((await h.ops.getattr(repo, CTX)).st_mode)
    # A zone the level cannot access looks like an empty directory: every name is absent,
    # existing or not; reaching for an existing one is audited as a read.
    await fails(h.ops.lookup(repo, b"README.md", CTX), errno.ENOENT)
    h.denial(
        "read",
        "/repo/README.md",
        "repo",
        "ENOENT",
        f"repo is not readable at trust level {trust}; readable zones: session, ",
    )
    assert (await h.ops.lookup(repo, b"no-such-file", CTX)).st_ino == 0
    assert not h.entries(path="/repo/no-such-file")
    # Creating there is refused as the write it is.
    await fails(h.ops.create(repo, b"x", 0o644, os.O_WRONLY, CTX), errno.EACCES)
    h.denial("write", "/repo/x", "repo", "EACCES", f"repo is not writable at trust level {trust}")
    await fails(h.ops.opendir(repo, CTX), errno.EACCES)
    h.denial("list", "/repo", "repo", "EACCES", f"repo is not listable at trust level {trust}")


async def test_untrusted_workspace_zone_refuses_lookup(make: Callable[[str], Harness]) -> None:
    h = make("untrusted")
    await fails(h.ops.lookup(ZONE_INO[Zone.WORKSPACE], b"data", CTX), errno.ENOENT)
    h.denial("read", "/workspace/data", "workspace", "ENOENT", "readable zones: session, workers")


# ===== setattr ===================================================================================


async def test_setattr_size_mode_and_times(make: Callable[[str], Harness]) -> None:
    h = make("session")
    inode = await h.ino("/session/working/notes.txt")
    backing = h.dirs[Zone.SESSION] / "working" / "notes.txt"

    attr = pyfuse3.EntryAttributes()
    attr.st_size = 7
    result = await h.ops.setattr(inode, attr, fields(update_size=True), None, CTX)
    assert result.st_size == 7
    assert backing.read_bytes() == b"session"

    attr = pyfuse3.EntryAttributes()
    attr.st_mode = stat.S_IFREG | 0o6751
    result = await h.ops.setattr(inode, attr, fields(update_mode=True), None, CTX)
    assert stat.S_IMODE(result.st_mode) == 0o751  # set-uid and set-gid never stored
    assert stat.S_IMODE(backing.stat().st_mode) == 0o751

    attr = pyfuse3.EntryAttributes()
    attr.st_atime_ns = 1_000_000_000_123
    attr.st_mtime_ns = 2_000_000_000_456
    flags = fields(update_atime=True, update_mtime=True)
    result = await h.ops.setattr(inode, attr, flags, None, CTX)
    st = backing.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000_123, 2_000_000_000_456)
    assert result.st_mtime_ns == 2_000_000_000_456

    path = "/session/working/notes.txt"
    details = [e["detail"] for e in h.entries(op="write", path=path, allowed=True)]
    assert details == ["setattr size=7", "setattr mode=751", "setattr times"]
    h.allowed("write", path, "session", detail="setattr times")


async def test_setattr_size_through_open_handle(make: Callable[[str], Harness]) -> None:
    h = make("session")
    inode = await h.ino("/session/working/notes.txt")
    fi = await h.ops.open(inode, os.O_WRONLY, CTX)
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 0
    result = await h.ops.setattr(inode, attr, fields(update_size=True), fi.fh, CTX)
    assert result.st_size == 0
    await h.ops.release(fi.fh)
    assert (h.dirs[Zone.SESSION] / "working" / "notes.txt").read_bytes() == b""


async def test_setattr_refused(make: Callable[[str], Harness]) -> None:
    h = make("workspace")
    readme = await h.ino("/repo/README.md")
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 0
    await fails(h.ops.setattr(readme, attr, fields(update_size=True), None, CTX), errno.EROFS)
    h.denial("write", "/repo/README.md", "repo", "EROFS", "repo is not writable")
    assert (h.project / "README.md").read_text() == "# demo project\n"

    attr = pyfuse3.EntryAttributes()
    attr.st_mode = stat.S_IFDIR | 0o700
    session = ZONE_INO[Zone.SESSION]
    await fails(h.ops.setattr(session, attr, fields(update_mode=True), None, CTX), errno.EACCES)
    h.denial("write", "/session", "session", "EACCES", ZONE_ROOT_REASON)
    await fails(h.ops.setattr(ROOT_INO, attr, fields(update_mode=True), None, CTX), errno.EACCES)
    h.denial("write", "/", None, "EACCES", ZONE_ROOT_REASON)
    await fails(h.ops.setattr(CONTEXT_INO, attr, fields(update_mode=True), None, CTX), errno.EACCES)
    h.denial("write", "/.sandboxfs/context.json", None, "EACCES", "read-only at every trust level")


# ===== readlink and symlink =======================================================================


async def test_symlink_and_readlink(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    target = b"../../../../etc/passwd"
    attrs = await h.ops.symlink(working, b"link", target, CTX)
    assert stat.S_ISLNK(attrs.st_mode)
    assert await h.ops.readlink(attrs.st_ino, CTX) == target  # unchanged, never resolved
    assert os.readlink(h.dirs[Zone.SESSION] / "working" / "link") == target.decode()
    h.allowed("write", "/session/working/link", "session", detail="symlink")
    notes = await h.ino("/session/working/notes.txt")
    await fails(h.ops.readlink(notes, CTX), errno.EINVAL)  # backing error passes through


async def test_symlink_refused_in_read_only_zone(make: Callable[[str], Harness]) -> None:
    h = make("workspace")
    await fails(h.ops.symlink(ZONE_INO[Zone.REPO], b"l", b"README.md", CTX), errno.EROFS)
    h.denial("write", "/repo/l", "repo", "EROFS", "repo is not writable")
    assert not (h.project / "l").is_symlink()


# ===== directories ==============================================================================


async def test_readdir_root(make: Callable[[str], Harness]) -> None:
    h = make("untrusted")
    replies = await h.listdir(ROOT_INO)
    names = [b".", b"..", *(z.encode() for z in ZONE_NAMES), b".sandboxfs"]
    assert replies.names == names
    assert [next_id for _, _, next_id in replies.got] == list(range(1, len(names) + 1))
    inos = dict((name, ino) for name, ino, _ in replies.got)
    assert inos[b"repo"] == ZONE_INO[Zone.REPO]
    assert inos[b".sandboxfs"] == CONTROL_INO
    assert (await h.listdir(CONTROL_INO)).names == [b".", b"..", b"context.json", b"README"]
    assert h.entries() == []  # / and /.sandboxfs are not zones: nothing to audit


async def test_readdir_zone_audits_once_per_open(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    for name in (b"a", b"b", b"c"):
        await h.write_new(working, name, b"x")
    fh = await h.ops.opendir(working, CTX)
    first = await h.readdir(fh, 0, limit=3)
    assert first.names == [b".", b"..", b"a"]
    rest = await h.readdir(fh, first.got[-1][2])
    assert rest.names == [b"b", b"c", b"notes.txt"]
    assert [i for _, _, i in first.got + rest.got] == [1, 2, 3, 4, 5, 6]
    await h.ops.releasedir(fh)
    h.allowed("list", "/session/working", "session")


async def test_readdir_counts_lookups_only_for_entries_that_fit(
    make: Callable[[str], Harness],
) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    for name in (b"a", b"b"):
        await h.write_new(working, name, b"x")
    # Forget what create counted, so only readdir's counting is left.
    for name in (b"a", b"b"):
        ino = (await h.ops.lookup(working, name, CTX)).st_ino
        forget(h.ops, ino, h.store.nodes[ino].lookups)
        assert ino not in h.store.nodes

    fh = await h.ops.opendir(working, CTX)
    first = await h.readdir(fh, 0, limit=3)  # ".", "..", "a"; "b" does not fit
    ino_a = dict((n, i) for n, i, _ in first.got)[b"a"]
    assert h.store.nodes[ino_a].lookups == 1
    not_sent = [n for n in h.store.nodes.values() if n.name == b"b" and n.parent is not None]
    assert all(node.lookups == 0 for node in not_sent)

    rest = await h.readdir(fh, first.got[-1][2])
    await h.ops.releasedir(fh)
    ino_b = dict((n, i) for n, i, _ in rest.got)[b"b"]
    assert h.store.nodes[ino_b].lookups == 1
    assert h.store.nodes[ino_a].lookups == 1
    forget(h.ops, ino_b, 1)
    assert ino_b not in h.store.nodes


async def test_readdir_root_counts_only_zones_that_fit(make: Callable[[str], Harness]) -> None:
    h = make("session")
    repo = h.store.zone_roots[Zone.REPO]
    before = repo.lookups
    replies = await h.listdir(ROOT_INO, limit=4)  # ".", "..", "session", "workspace"
    assert replies.names[-1] == b"workspace"
    assert repo.lookups == before
    assert h.store.zone_roots[Zone.WORKSPACE].lookups == before + 1


async def test_opendir_of_a_file_is_enotdir(make: Callable[[str], Harness]) -> None:
    h = make("session")
    notes = await h.ino("/session/working/notes.txt")
    await fails(h.ops.opendir(notes, CTX), errno.ENOTDIR)


async def test_readdir_lists_deny_listed_entries_but_not_state_entries(
    make: Callable[[str], Harness],
) -> None:
    """A file that exists never looks deleted: where the level may list the zone, deny-listed
    entries are listed (with their real attributes); only sandboxfs's state and other mounts
    are left out."""
    h = make("full")
    replies = await h.listdir(ZONE_INO[Zone.REPO])
    for hidden in (b".sandbox", b"mnt"):
        assert hidden not in replies.names
    for shown in (b".env", b"server.pem", b".ssh", b"README.md", b"src", b".workers"):
        assert shown in replies.names
    inode = {name: ino for name, ino, _ in replies.got}
    assert inode[b".env"] == os.stat(h.project / ".env").st_ino
    h.allowed("list", "/repo", "repo")


async def listed_attrs(h: Harness, dir_vpath: str) -> dict[bytes, SimpleNamespace]:
    """The attributes one listing of dir_vpath gave, by name (copied as they were sent)."""
    got: dict[bytes, SimpleNamespace] = {}
    keys = ("st_ino", "st_size", "st_mtime_ns", "st_atime_ns", "attr_timeout")

    def reply(token: Any, name: bytes, attrs: Any, next_id: int) -> bool:
        got[name] = SimpleNamespace(**{key: getattr(attrs, key) for key in keys})
        return True

    fh = await h.ops.opendir(await h.ino(dir_vpath), CTX)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pyfuse3, "readdir_reply", reply)
        await h.ops.readdir(fh, 0, cast(pyfuse3.ReaddirToken, object()))
    await h.ops.releasedir(fh)
    return got


def grow(path: Path) -> int:
    """Change a backing file behind the mount's back; returns its new size."""
    with path.open("ab") as f:
        f.write(b"# changed outside the mount\n")
    return path.stat().st_size


async def test_listings_repeat_given_attributes_within_their_validity(
    make: Callable[[str], Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make("full")
    main = await h.ino("/repo/src/main.py")  # the lookup gives the kernel its attributes
    backing = h.project / "src" / "main.py"
    size = backing.stat().st_size
    grow(backing)
    listed = (await listed_attrs(h, "/repo/src"))[b"main.py"]
    # Nothing the kernel does not already hold: same inode, same size, less validity left.
    assert (listed.st_ino, listed.st_size) == (main, size)
    assert 0 < listed.attr_timeout <= h.ops.replies.attr_timeout
    assert h.store.nodes[main].lookups == 2

    later = time.monotonic() + h.ops.replies.attr_timeout + 0.01
    monkeypatch.setattr("sandboxfs.fuse.dir_ops.time.monotonic", lambda: later)
    listed = (await listed_attrs(h, "/repo/src"))[b"main.py"]
    assert listed.st_size == backing.stat().st_size
    assert listed.attr_timeout == h.ops.replies.attr_timeout


async def test_listings_never_repeat_attributes_under_another_name(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    main = await h.ino("/repo/src/main.py")
    os.rename(h.project / "src" / "main.py", h.project / "src" / "moved.py")
    size = grow(h.project / "src" / "moved.py")
    listed = (await listed_attrs(h, "/repo/src"))[b"moved.py"]
    assert (listed.st_ino, listed.st_size) == (main, size)


async def _write_through(h: Harness, main: int, src: int) -> None:
    fi = await h.ops.open(main, os.O_WRONLY, CTX)
    await h.ops.write(fi.fh, 0, b"#")
    await h.ops.release(fi.fh)


async def _read_through(h: Harness, main: int, src: int) -> None:
    await h.read_file(main)


async def _truncate_on_open(h: Harness, main: int, src: int) -> None:
    fi = await h.ops.open(main, os.O_WRONLY | os.O_TRUNC, CTX)
    await h.ops.release(fi.fh)


async def _setxattr(h: Harness, main: int, src: int) -> None:
    await h.ops.setxattr(main, b"user.note", b"x", CTX)


async def _link(h: Harness, main: int, src: int) -> None:
    await h.ops.link(main, src, b"hard.py", CTX)


async def _rename(h: Harness, main: int, src: int) -> None:
    await h.ops.rename(src, b"main.py", src, b"renamed.py", 0, CTX)
    await h.ops.rename(src, b"renamed.py", src, b"main.py", 0, CTX)


async def _unlink_other_link(h: Harness, main: int, src: int) -> None:
    await h.ops.unlink(src, b"other.py", CTX)


@pytest.mark.parametrize(
    "change",
    [
        _write_through,
        _read_through,
        _truncate_on_open,
        _setxattr,
        _link,
        _rename,
        _unlink_other_link,
    ],
)
async def test_changes_through_the_mount_stop_listings_repeating_attributes(
    make: Callable[[str], Harness], change: Callable[[Harness, int, int], Awaitable[None]]
) -> None:
    h = make("full")
    backing = h.project / "src" / "main.py"
    os.link(backing, h.project / "src" / "other.py")
    src = await h.ino("/repo/src")
    await h.ops.lookup(src, b"other.py", CTX)
    main = await h.ino("/repo/src/main.py")
    grow(backing)
    await change(h, main, src)
    st = backing.stat()
    listed = (await listed_attrs(h, "/repo/src"))[b"main.py"]
    assert (listed.st_size, listed.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.mark.parametrize("what", ["create", "mkdir", "symlink", "mknod", "unlink", "rmdir", "list"])
async def test_new_and_removed_names_stop_listings_repeating_their_directory(
    make: Callable[[str], Harness], what: str
) -> None:
    h = make("full")
    src = await h.ino("/repo/src")
    (h.project / "src" / "gone").mkdir()
    (h.project / "src" / "gone.txt").write_text("x")
    await h.ops.lookup(src, b"gone", CTX)
    await h.ops.lookup(src, b"gone.txt", CTX)
    await listed_attrs(h, "/repo")  # src's attributes given by a listing
    os.utime(h.project / "src", ns=(1, 1))  # behind the mount's back
    if what == "create":
        fi, _ = await h.ops.create(src, b"new", 0o644, os.O_WRONLY, CTX)
        await h.ops.release(fi.fh)
    elif what == "mkdir":
        await h.ops.mkdir(src, b"new", 0o755, CTX)
    elif what == "symlink":
        await h.ops.symlink(src, b"new", b"main.py", CTX)
    elif what == "mknod":
        await h.ops.mknod(src, b"new", stat.S_IFIFO | 0o644, 0, CTX)
    elif what == "unlink":
        await h.ops.unlink(src, b"gone.txt", CTX)
    elif what == "list":  # the kernel stops trusting a listed directory's atime
        await listed_attrs(h, "/repo/src")
    else:
        await h.ops.rmdir(src, b"gone", CTX)
    st = (h.project / "src").stat()
    listed = (await listed_attrs(h, "/repo"))[b"src"]
    if what == "list":  # relatime: listing a directory whose atime is not after its mtime
        assert listed.st_atime_ns == st.st_atime_ns != 1
    else:
        assert listed.st_mtime_ns == st.st_mtime_ns != 1


# ===== open, read, write, release ===============================================================


async def test_open_read_audits_one_entry_per_open(make: Callable[[str], Harness]) -> None:
    h = make("session")
    inode = await h.ino("/session/working/notes.txt")
    fi = await h.ops.open(inode, os.O_RDONLY, CTX)
    assert await h.ops.read(fi.fh, 0, 7) == b"session"
    assert await h.ops.read(fi.fh, 8, 100) == b"notes\n"
    await fails(h.ops.write(fi.fh, 0, b"no"), errno.EBADF)
    await h.ops.release(fi.fh)
    entry = h.allowed("read", "/session/working/notes.txt", "session")
    assert entry["bytes"] is None
    assert entry["uid"] == CTX.uid
    assert entry["trust"] == "session"
    assert h.entries(op="write") == []


async def test_open_write_audits_bytes_summed_at_release(make: Callable[[str], Harness]) -> None:
    h = make("session")
    inode = await h.ino("/session/working/notes.txt")
    fi = await h.ops.open(inode, os.O_WRONLY, CTX)
    assert await h.ops.write(fi.fh, 0, b"SESS") == 4
    assert await h.ops.write(fi.fh, 4, b"ION") == 3
    assert h.entries(op="write") == []  # written at release, not per write call
    await h.ops.release(fi.fh)
    entry = h.allowed("write", "/session/working/notes.txt", "session")
    assert entry["bytes"] == 7
    assert h.entries(op="read") == []
    assert (h.dirs[Zone.SESSION] / "working" / "notes.txt").read_text() == "SESSION notes\n"


async def test_kernel_cache_kept_unless_pages_were_written_in_parts(
    make: Callable[[str], Harness],
) -> None:
    """keep_cache on open: yes for a file unchanged since its last open, or written in whole
    pages; no after a write that began inside a page (tar's 10 KiB records), whose partly
    written pages the kernel would otherwise fetch back one request per page."""
    h = make("session")
    working = await h.ino("/session/working")
    page = os.sysconf("SC_PAGE_SIZE")

    async def written_then_reopened(name: bytes, chunk: int) -> bool:
        fi, attrs = await h.ops.create(working, name, 0o644, os.O_WRONLY, CTX)
        for offset in range(0, 3 * chunk, chunk):
            await h.ops.write(fi.fh, offset, b"x" * chunk)
        await h.ops.release(fi.fh)
        fi = await h.ops.open(attrs.st_ino, os.O_RDONLY, CTX)
        await h.ops.release(fi.fh)
        keep = bool(fi.keep_cache)
        fi = await h.ops.open(attrs.st_ino, os.O_RDONLY, CTX)  # unchanged since: kept
        await h.ops.release(fi.fh)
        assert fi.keep_cache
        return keep

    assert await written_then_reopened(b"whole-pages", 2 * page)
    assert not await written_then_reopened(b"tar-records", 10240)


async def test_files_written_in_parts_are_handed_to_the_kernel_whole(
    make: Callable[[str], Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At release, a file whose pages were left partly written goes into the kernel's page
    cache whole, so its next reader sends no READ, and the next open keeps it. Not while
    another handle is open (a write in flight could be overwritten), nor past the size limit.
    An mtime-only setattr (tar sets it after writing) keeps the cache; a truncate does not."""
    h = make("session")
    stored: list[tuple[int, int, bytes]] = []
    h.ops.kernel_store = lambda ino, off, data: stored.append((ino, off, data))
    working = await h.ino("/session/working")
    page = os.sysconf("SC_PAGE_SIZE")

    async def write_file(name: bytes, chunks: list[bytes], other_reader: bool = False) -> int:
        fi, attrs = await h.ops.create(working, name, 0o644, os.O_WRONLY, CTX)
        offset = 0
        for chunk in chunks:
            await h.ops.write(fi.fh, offset, chunk)
            offset += len(chunk)
        reader = await h.ops.open(attrs.st_ino, os.O_RDONLY, CTX) if other_reader else None
        await h.ops.release(fi.fh)
        if reader is not None:
            await h.ops.release(reader.fh)
        return int(attrs.st_ino)

    async def kept(inode: int) -> bool:
        fi = await h.ops.open(inode, os.O_RDONLY, CTX)
        await h.ops.release(fi.fh)
        return bool(fi.keep_cache)

    records = [b"a" * 10240, b"b" * 10240, b"c" * 100]  # tar's 10 KiB records
    inode = await write_file(b"records", records)
    assert stored == [(inode, 0, b"".join(records))]
    assert await kept(inode)

    stored.clear()
    tail = await write_file(b"tail", [b"t" * (page + 100)])  # ends inside a page
    assert stored == [(tail, 0, b"t" * (page + 100))]
    assert await kept(tail)

    stored.clear()
    whole = await write_file(b"pages", [b"p" * 2 * page])
    assert stored == []  # every page complete: nothing to hand over
    assert await kept(whole)

    busy = await write_file(b"busy", records, other_reader=True)
    assert stored == []
    assert not await kept(busy)

    monkeypatch.setattr(file_ops, "_KERNEL_STORE_LIMIT", 8192)
    big = await write_file(b"big", records)
    assert stored == []
    assert not await kept(big)

    attr = pyfuse3.EntryAttributes()
    attr.st_atime_ns = attr.st_mtime_ns = 1_700_000_000_000_000_000
    await h.ops.setattr(inode, attr, fields(update_atime=True, update_mtime=True), None, CTX)
    assert await kept(inode)
    attr.st_size = 5
    await h.ops.setattr(inode, attr, fields(update_size=True), None, CTX)
    assert not await kept(inode)


async def test_open_rdwr_and_trunc(make: Callable[[str], Harness]) -> None:
    h = make("session")
    inode = await h.ino("/session/working/notes.txt")
    fi = await h.ops.open(inode, os.O_RDWR, CTX)
    assert await h.ops.read(fi.fh, 0, 7) == b"session"
    await h.ops.write(fi.fh, 0, b"S")
    await h.ops.release(fi.fh)
    assert h.one(op="write", allowed=True)["bytes"] == 1

    fi = await h.ops.open(inode, os.O_WRONLY | os.O_TRUNC, CTX)
    await h.ops.release(fi.fh)
    assert (h.dirs[Zone.SESSION] / "working" / "notes.txt").read_bytes() == b""
    assert [e["bytes"] for e in h.entries(op="write", allowed=True)] == [1, 0]


async def test_repo_at_workspace_is_read_only(make: Callable[[str], Harness]) -> None:
    h = make("workspace")
    readme = await h.ino("/repo/README.md")
    assert await h.read_file(readme) == b"# demo project\n"
    h.allowed("read", "/repo/README.md", "repo")

    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        await fails(h.ops.open(readme, flags, CTX), errno.EROFS)
    denied = h.entries(op="write", path="/repo/README.md", allowed=False)
    assert len(denied) == 3
    assert all(e["errno"] == "EROFS" for e in denied)
    assert "writable zones: session, workspace, staged" in denied[0]["reason"]

    await fails(h.ops.unlink(ZONE_INO[Zone.REPO], b"README.md", CTX), errno.EROFS)
    h.denial("delete", "/repo/README.md", "repo", "EROFS", "repo is not deletable")
    await fails(h.ops.rmdir(ZONE_INO[Zone.REPO], b"src", CTX), errno.EROFS)
    h.denial("delete", "/repo/src", "repo", "EROFS")
    await fails(h.ops.create(ZONE_INO[Zone.REPO], b"new.txt", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    h.denial("write", "/repo/new.txt", "repo", "EROFS")
    await fails(h.ops.mkdir(ZONE_INO[Zone.REPO], b"newdir", 0o755, CTX), errno.EROFS)
    repo = ZONE_INO[Zone.REPO]
    await fails(h.ops.rename(repo, b"README.md", repo, b"R.md", 0, CTX), errno.EROFS)
    h.denial("rename", "/repo/README.md", "repo", "EROFS")
    await fails(h.ops.link(readme, repo, b"R2.md", CTX), errno.EROFS)
    assert sorted(os.listdir(h.project)) == sorted(
        [".env", ".sandbox", ".ssh", ".workers", "README.md", "mnt", "server.pem", "src"]
    )
    assert (h.project / "README.md").read_text() == "# demo project\n"


async def test_open_directory_is_eisdir(make: Callable[[str], Harness]) -> None:
    h = make("session")
    await fails(h.ops.open(await h.ino("/session/working"), os.O_RDONLY, CTX), errno.EISDIR)
    await fails(h.ops.open(ROOT_INO, os.O_RDONLY, CTX), errno.EISDIR)


# ===== creating entries ==========================================================================


async def test_create_write_release(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    fi, attrs = await h.ops.create(working, b"new.txt", 0o6755, os.O_WRONLY, CTX)
    assert stat.S_ISREG(attrs.st_mode)
    assert not attrs.st_mode & (stat.S_ISUID | stat.S_ISGID)
    await h.ops.write(fi.fh, 0, b"hello ")
    await h.ops.write(fi.fh, 6, b"world")
    await h.ops.release(fi.fh)
    backing = h.dirs[Zone.SESSION] / "working" / "new.txt"
    assert backing.read_bytes() == b"hello world"
    assert not backing.stat().st_mode & (stat.S_ISUID | stat.S_ISGID)
    entry = h.allowed("write", "/session/working/new.txt", "session", detail="create")
    assert entry["bytes"] == 11
    assert (await h.ops.lookup(working, b"new.txt", CTX)).st_ino == attrs.st_ino


async def test_mkdir_and_mknod(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    d = await h.ops.mkdir(working, b"sub", 0o6755, CTX)
    assert stat.S_ISDIR(d.st_mode)
    assert not (h.dirs[Zone.SESSION] / "working" / "sub").stat().st_mode & stat.S_ISUID
    h.allowed("write", "/session/working/sub", "session", detail="mkdir")
    await fails(h.ops.mkdir(working, b"sub", 0o755, CTX), errno.EEXIST)

    reg = await h.ops.mknod(working, b"plain", stat.S_IFREG | 0o644, 0, CTX)
    assert stat.S_ISREG(reg.st_mode)
    fifo = await h.ops.mknod(working, b"pipe", stat.S_IFIFO | 0o644, 0, CTX)
    assert stat.S_ISFIFO(fifo.st_mode)
    assert stat.S_ISFIFO((h.dirs[Zone.SESSION] / "working" / "pipe").lstat().st_mode)
    assert len(h.entries(op="write", detail="mknod", allowed=True)) == 2

    for kind in (stat.S_IFCHR, stat.S_IFBLK):
        await fails(h.ops.mknod(working, b"dev", kind | 0o644, os.makedev(1, 3), CTX), errno.EPERM)
    assert not (h.dirs[Zone.SESSION] / "working" / "dev").exists()
    denied = h.entries(op="write", path="/session/working/dev", allowed=False)
    assert len(denied) == 2
    assert all(e["errno"] == "EPERM" and "device nodes" in e["reason"] for e in denied)


async def test_nothing_can_be_created_at_root_or_in_control_dir(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    await fails(h.ops.create(ROOT_INO, b"x.txt", 0o644, os.O_WRONLY, CTX), errno.EACCES)
    h.denial(
        "write",
        "/x.txt",
        None,
        "EACCES",
        "nothing can be created at /; create inside one of the zones: "
        "session, workspace, repo, staged, workers",
    )
    await fails(h.ops.mkdir(ROOT_INO, b"newzone", 0o755, CTX), errno.EACCES)
    h.denial("write", "/newzone", None, "EACCES", "nothing can be created at /")
    await fails(h.ops.symlink(ROOT_INO, b"l", b"session", CTX), errno.EACCES)
    await fails(h.ops.mknod(ROOT_INO, b"p", stat.S_IFIFO | 0o644, 0, CTX), errno.EACCES)
    await fails(h.ops.create(CONTROL_INO, b"y", 0o644, os.O_WRONLY, CTX), errno.EACCES)
    h.denial("write", "/.sandboxfs/y", None, "EACCES", "read-only at every trust level")


# ===== link ======================================================================================


async def test_link_same_zone(make: Callable[[str], Harness]) -> None:
    h = make("session")
    notes = await h.ino("/session/working/notes.txt")
    outputs = await h.ino("/session/outputs")
    attrs = await h.ops.link(notes, outputs, b"copy.txt", CTX)
    assert attrs.st_ino == notes  # one inode for both names
    assert attrs.st_nlink == 2
    assert (h.dirs[Zone.SESSION] / "outputs" / "copy.txt").read_text() == "session notes\n"
    entry = h.one(op="link", allowed=True)
    assert entry["dest"] == "/session/outputs/copy.txt"
    assert entry["zone"] == "session"
    assert entry["comm"] == COMM
    # Both names now reach the same content.
    assert await h.read_file(await h.ino("/session/outputs/copy.txt")) == b"session notes\n"


async def test_file_names_leave_directory_memos_valid(make: Callable[[str], Harness]) -> None:
    """What is remembered about a directory's path (deny and protect memos) lasts until a
    directory's path changes: a file's new names (git links every object it writes) do not
    change one, a directory's rename does."""
    h = make("session")
    working = await h.ino("/session/working")
    outputs = await h.ino("/session/outputs")
    notes = await h.ino("/session/working/notes.txt")
    moves = h.store.moves
    await h.ops.link(notes, outputs, b"copy.txt", CTX)
    await h.ops.rename(outputs, b"copy.txt", working, b"moved.txt", 0, CTX)
    await h.ops.unlink(working, b"moved.txt", CTX)
    assert h.store.moves == moves
    session = ZONE_INO[Zone.SESSION]
    await h.ops.rename(session, b"outputs", session, b"done", 0, CTX)
    assert h.store.moves > moves


async def test_link_audit_entry_names_source_and_dest(make: Callable[[str], Harness]) -> None:
    h = make("session")
    notes = await h.ino("/session/working/notes.txt")
    outputs = await h.ino("/session/outputs")
    await h.ops.link(notes, outputs, b"copy.txt", CTX)
    entry = h.allowed("link", "/session/working/notes.txt", "session")
    assert entry["dest"] == "/session/outputs/copy.txt"


async def test_link_across_zones_is_exdev(make: Callable[[str], Harness]) -> None:
    h = make("full")
    notes = await h.ino("/session/working/notes.txt")
    data = await h.ino("/workspace/data")
    await fails(h.ops.link(notes, data, b"notes.txt", CTX), errno.EXDEV)
    # Recorded, but not as a policy denial (callers fall back to copying).
    [entry] = h.entries(op="link", path="/session/working/notes.txt")
    assert entry["allowed"] is None and entry["errno"] == "EXDEV", entry
    assert "cannot cross zones" in entry["reason"]
    assert entry["dest"] == "/workspace/data/notes.txt"
    assert not (h.dirs[Zone.WORKSPACE] / "data" / "notes.txt").exists()


async def test_unlinking_one_hard_link_keeps_the_other_usable(
    make: Callable[[str], Harness],
) -> None:
    h = make("session")
    notes = await h.ino("/session/working/notes.txt")
    working = await h.ino("/session/working")
    await h.ops.link(notes, working, b"second.txt", CTX)
    await h.ops.unlink(working, b"second.txt", CTX)
    # notes.txt still exists, and the kernel still holds its inode.
    attrs = await h.ops.getattr(notes, CTX)
    assert attrs.st_nlink == 1
    assert await h.read_file(notes) == b"session notes\n"


async def test_release_after_unlink_audits_the_files_path(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    fi, attrs = await h.ops.create(working, b"tmp.txt", 0o644, os.O_WRONLY, CTX)
    await h.ops.write(fi.fh, 0, b"abc")
    await h.ops.unlink(working, b"tmp.txt", CTX)
    assert (await h.ops.getattr(attrs.st_ino, CTX)).st_size == 3  # still usable while open
    await h.ops.release(fi.fh)
    entry = h.one(op="write", allowed=True)
    assert entry["bytes"] == 3
    assert entry["path"] == "/session/working/tmp.txt"


# ===== unlink and rmdir ===========================================================================


async def test_unlink_and_rmdir(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    notes = await h.ino("/session/working/notes.txt")
    await h.ops.unlink(working, b"notes.txt", CTX)
    assert not (h.dirs[Zone.SESSION] / "working" / "notes.txt").exists()
    entry = h.allowed("delete", "/session/working/notes.txt", "session")
    assert entry.get("detail") is None
    await fails(h.ops.getattr(notes, CTX), errno.ENOENT)  # the kernel's inode is gone too

    await h.ops.mkdir(working, b"empty", 0o755, CTX)
    await h.ops.rmdir(working, b"empty", CTX)
    h.allowed("delete", "/session/working/empty", "session", detail="rmdir")
    assert not (h.dirs[Zone.SESSION] / "working" / "empty").exists()


async def test_backing_errors_pass_through_unaudited(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    session = ZONE_INO[Zone.SESSION]
    await fails(h.ops.unlink(working, b"missing.txt", CTX), errno.ENOENT)
    await fails(h.ops.rmdir(session, b"working", CTX), errno.ENOTEMPTY)
    await fails(h.ops.rmdir(working, b"notes.txt", CTX), errno.ENOTDIR)
    await fails(h.ops.unlink(session, b"inputs", CTX), errno.EISDIR)
    assert (h.dirs[Zone.SESSION] / "working" / "notes.txt").exists()
    assert h.entries() == []  # not denials, and nothing was done


async def test_zone_roots_cannot_be_removed_or_renamed(make: Callable[[str], Harness]) -> None:
    h = make("full")
    await fails(h.ops.rmdir(ROOT_INO, b"session", CTX), errno.EACCES)
    h.denial("delete", "/session", None, "EACCES", ZONE_ROOT_REASON)
    await fails(h.ops.unlink(ROOT_INO, b"repo", CTX), errno.EACCES)
    await fails(h.ops.rename(ROOT_INO, b"repo", ROOT_INO, b"old-repo", 0, CTX), errno.EACCES)
    entry = h.denial("rename", "/repo", None, "EACCES", ZONE_ROOT_REASON)
    assert entry["dest"] == "/old-repo"
    working = await h.ino("/session/working")
    await fails(h.ops.rename(ROOT_INO, b"staged", working, b"s", 0, CTX), errno.EACCES)
    await fails(h.ops.rename(working, b"notes.txt", ROOT_INO, b"n.txt", 0, CTX), errno.EACCES)
    h.denial("rename", "/session/working/notes.txt", "session", "EACCES", "nothing can be created")
    await fails(h.ops.rmdir(CONTROL_INO, b"context.json", CTX), errno.EACCES)
    for zone_dir in h.dirs.values():
        assert zone_dir.is_dir()
    assert (h.dirs[Zone.SESSION] / "working" / "notes.txt").exists()


# ===== rename ====================================================================================


async def test_rename_same_zone_moves_cached_nodes(make: Callable[[str], Harness]) -> None:
    h = make("session")
    session = ZONE_INO[Zone.SESSION]
    notes = await h.ino("/session/working/notes.txt")
    await h.ops.rename(session, b"working", session, b"done", 0, CTX)
    entry = h.allowed("rename", "/session/working", "session")
    assert entry["dest"] == "/session/done"
    assert h.store.nodes[notes].vpath() == "/session/done/notes.txt"
    assert await h.read_file(notes) == b"session notes\n"
    h.allowed("read", "/session/done/notes.txt", "session")


async def test_rename_across_zones_is_exdev(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    data = await h.ino("/workspace/data")
    await fails(h.ops.rename(working, b"notes.txt", data, b"notes.txt", 0, CTX), errno.EXDEV)
    [entry] = h.entries(op="rename", path="/session/working/notes.txt")
    assert entry["allowed"] is None and entry["errno"] == "EXDEV", entry
    assert "session -> workspace" in entry["reason"]
    assert not h.entries(allowed=False)
    assert entry["dest"] == "/workspace/data/notes.txt"
    assert (h.dirs[Zone.SESSION] / "working" / "notes.txt").exists()


async def test_rename_noreplace_and_exchange(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    a = await h.write_new(working, b"a", b"AAA")
    b = await h.write_new(working, b"b", b"BBB")
    backing = h.dirs[Zone.SESSION] / "working"

    noreplace = pyfuse3.RENAME_NOREPLACE
    await fails(h.ops.rename(working, b"a", working, b"b", noreplace, CTX), errno.EEXIST)
    assert (backing / "a").read_bytes() == b"AAA"
    assert (backing / "b").read_bytes() == b"BBB"
    assert h.entries(op="rename") == []

    await h.ops.rename(working, b"a", working, b"b", pyfuse3.RENAME_EXCHANGE, CTX)
    assert (backing / "a").read_bytes() == b"BBB"
    assert (backing / "b").read_bytes() == b"AAA"
    assert h.store.nodes[a].vpath() == "/session/working/b"
    assert h.store.nodes[b].vpath() == "/session/working/a"
    assert await h.read_file(a) == b"AAA"
    entry = h.allowed("rename", "/session/working/a", "session")
    assert entry["dest"] == "/session/working/b"


async def test_rename_replacing_a_file(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    a = await h.write_new(working, b"a", b"AAA")
    b = await h.write_new(working, b"b", b"BBB")
    await h.ops.rename(working, b"a", working, b"b", 0, CTX)
    assert (h.dirs[Zone.SESSION] / "working" / "b").read_bytes() == b"AAA"
    assert not (h.dirs[Zone.SESSION] / "working" / "a").exists()
    assert await h.read_file(a) == b"AAA"
    assert h.store.nodes[a].vpath() == "/session/working/b"
    await fails(h.ops.getattr(b, CTX), errno.ENOENT)  # replaced: no backing name any more


# ===== extended attributes =======================================================================


async def test_user_xattrs(make: Callable[[str], Harness]) -> None:
    h = make("session")
    notes = await h.ino("/session/working/notes.txt")
    path = "/session/working/notes.txt"
    await h.ops.setxattr(notes, b"user.origin", b"web", CTX)
    h.allowed("write", path, "session", detail="setxattr user.origin")
    backing = h.dirs[Zone.SESSION] / "working" / "notes.txt"
    assert os.getxattr(backing, "user.origin") == b"web"
    assert await h.ops.getxattr(notes, b"user.origin", CTX) == b"web"
    assert b"user.origin" in await h.ops.listxattr(notes, CTX)
    await fails(h.ops.getxattr(notes, b"user.missing", CTX), pyfuse3.ENOATTR)
    await h.ops.removexattr(notes, b"user.origin", CTX)
    h.allowed("write", path, "session", detail="removexattr user.origin")
    assert b"user.origin" not in await h.ops.listxattr(notes, CTX)
    await fails(h.ops.removexattr(notes, b"user.origin", CTX), pyfuse3.ENOATTR)
    # A directory carries them too.
    working = await h.ino("/session/working")
    await h.ops.setxattr(working, b"user.tag", b"1", CTX)
    assert await h.ops.getxattr(working, b"user.tag", CTX) == b"1"


def _acl(*entries: tuple[int, int, int]) -> bytes:
    """A POSIX ACL in its xattr form: version 2, then (tag, permissions, id) per entry."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


async def test_acls_and_xattrs_are_read_by_name_without_following_symlinks(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    working = h.dirs[Zone.SESSION] / "working"
    acl = _acl(
        (0x01, 6, 0xFFFFFFFF),
        (0x02, 4, 4242),
        (0x04, 4, 0xFFFFFFFF),
        (0x10, 4, 0xFFFFFFFF),
        (0x20, 0, 0xFFFFFFFF),
    )
    os.setxattr(working / "notes.txt", "system.posix_acl_access", acl)
    notes = await h.ino("/session/working/notes.txt")
    assert await h.ops.getxattr(notes, b"system.posix_acl_access", CTX) == acl
    (working / "plain.txt").write_text("no ACL\n")
    plain = await h.ino("/session/working/plain.txt")
    await fails(h.ops.getxattr(plain, b"system.posix_acl_access", CTX), pyfuse3.ENOATTR)
    # A symlink has no ACL and no user.* attributes, whatever its target carries.
    os.symlink("notes.txt", working / "link")
    os.setxattr(working / "notes.txt", "user.origin", b"web")
    link = await h.ino("/session/working/link")
    await fails(h.ops.getxattr(link, b"system.posix_acl_access", CTX), pyfuse3.ENOATTR)
    await fails(h.ops.getxattr(link, b"user.origin", CTX), pyfuse3.ENOATTR)
    # Read under the node's current name after a rename through the mount.
    session = await h.ino("/session/working")
    await h.ops.rename(session, b"notes.txt", session, b"renamed.txt", 0, CTX)
    assert await h.ops.getxattr(notes, b"user.origin", CTX) == b"web"
    assert h.entries(allowed=False) == []


async def test_security_namespace_is_not_supported(make: Callable[[str], Harness]) -> None:
    """security.* is neither shown nor stored: reads say EOPNOTSUPP (so `ls -l` stops asking
    for labels after one file), listings leave backing labels out, and nothing is audited."""
    h = make("full")
    notes = await h.ino("/session/working/notes.txt")
    await fails(h.ops.getxattr(notes, b"security.selinux", CTX), errno.EOPNOTSUPP)
    await fails(h.ops.getxattr(notes, b"security.capability", CTX), errno.EOPNOTSUPP)
    backing = h.dirs[Zone.SESSION] / "working" / "notes.txt"
    os.setxattr(backing, "user.shown", b"1")
    if os.geteuid() == 0:  # only root can label a backing file
        os.setxattr(backing, "security.sandboxfs-test", b"label")
    assert await h.ops.listxattr(notes, CTX) == [b"user.shown"]
    assert h.entries(allowed=False) == []


async def test_non_user_xattrs_are_refused(make: Callable[[str], Harness]) -> None:
    h = make("full")
    notes = await h.ino("/session/working/notes.txt")
    path = "/session/working/notes.txt"
    await fails(h.ops.setxattr(notes, b"security.capability", b"\0", CTX), errno.EPERM)
    h.denial("write", path, "session", "EPERM", "only user.* extended attributes and POSIX ACLs")
    await fails(h.ops.setxattr(notes, b"trusted.x", b"1", CTX), errno.EPERM)
    await fails(h.ops.removexattr(notes, b"security.selinux", CTX), errno.EPERM)
    await fails(
        h.ops.setxattr(ZONE_INO[Zone.SESSION], b"user.x", b"1", CTX), errno.EACCES
    )  # a zone root cannot be changed
    h.denial("write", "/session", "session", "EACCES", ZONE_ROOT_REASON)
    assert h.entries(allowed=True) == []


async def test_xattrs_refused_by_policy(make: Callable[[str], Harness]) -> None:
    h = make("workspace")
    readme = await h.ino("/repo/README.md")
    os.setxattr(h.project / "README.md", "user.kept", b"v")
    assert await h.ops.getxattr(readme, b"user.kept", CTX) == b"v"  # read is allowed
    await fails(h.ops.setxattr(readme, b"user.x", b"1", CTX), errno.EROFS)
    h.denial("write", "/repo/README.md", "repo", "EROFS")
    await fails(h.ops.removexattr(readme, b"user.kept", CTX), errno.EROFS)
    assert os.getxattr(h.project / "README.md", "user.kept") == b"v"


# ===== statfs and forget ========================================================================


async def test_statfs(make: Callable[[str], Harness]) -> None:
    h = make("untrusted")
    data = await h.ops.statfs(CTX)
    assert data.f_namemax == 255
    assert data.f_bsize > 0
    assert data.f_blocks > 0
    assert h.entries() == []


async def test_forget_drops_node_when_count_reaches_zero(make: Callable[[str], Harness]) -> None:
    h = make("session")
    working = await h.ino("/session/working")
    first = await h.ops.lookup(working, b"notes.txt", CTX)
    second = await h.ops.lookup(working, b"notes.txt", CTX)
    inode = first.st_ino
    assert second.st_ino == inode
    old = h.store.nodes[inode]
    assert old.lookups == 2
    forget(h.ops, inode, 1)
    assert inode in h.store.nodes
    assert (await h.ops.getattr(inode, CTX)).st_ino == inode
    forget(h.ops, inode, 1)
    assert inode not in h.store.nodes
    assert inode not in h.ops.replies.given  # nor the attributes a listing could repeat
    await fails(h.ops.getattr(inode, CTX), errno.ESTALE)
    # Virtual nodes are never dropped; unknown inodes are ignored.
    forget(h.ops, ZONE_INO[Zone.SESSION], 100)
    forget(h.ops, 123456, 1)
    assert ZONE_INO[Zone.SESSION] in h.store.nodes
    again = await h.ops.lookup(working, b"notes.txt", CTX)
    assert again.st_ino == inode  # the backing file's number again, on a fresh node
    assert h.store.nodes[inode] is not old and h.store.nodes[inode].lookups == 1
    assert again.generation != first.generation


async def test_inode_numbers_are_the_backing_files(make: Callable[[str], Harness]) -> None:
    """st_ino (the node id) is the backing file's inode number in a lookup, a listing, a create
    and a mkdir, as bindfs shows it: what git recorded in its index outside matches inside."""
    h = make("full")
    repo = await h.ino("/repo")
    src = await h.ino("/repo/src")
    assert src == os.lstat(h.project / "src").st_ino
    main = await h.ops.lookup(src, b"main.py", CTX)
    assert main.st_ino == os.lstat(h.project / "src" / "main.py").st_ino
    assert main.generation != 0
    listed = {name: ino for name, ino, _ in (await h.listdir(repo)).got}
    assert listed[b"README.md"] == os.lstat(h.project / "README.md").st_ino
    assert listed[b"src"] == src
    created = await h.write_new(src, b"new.py", b"x = 1\n")
    assert created == os.lstat(h.project / "src" / "new.py").st_ino
    made = await h.ops.mkdir(src, b"pkg", 0o755, CTX)
    assert made.st_ino == os.lstat(h.project / "src" / "pkg").st_ino


async def test_inode_number_taken_by_a_live_node_gets_a_spare(
    make: Callable[[str], Harness],
) -> None:
    """A backing number that another node the kernel knows already has is never handed out
    twice: the same file seen through a second zone (<project>/.workers is /repo/.workers and
    /workers), a file that took a deleted one's number while the kernel still knows the old
    one, and numbers below the fixed ones get numbers of sandboxfs's own, given once."""
    h = make("full")
    dot_workers = await h.ino("/repo/.workers")
    in_repo = await h.ops.lookup(dot_workers, b"review.worker", CTX)
    backing = os.lstat(h.project / ".workers" / "review.worker").st_ino
    assert in_repo.st_ino == backing
    workers = await h.ino("/workers")
    in_workers = await h.ops.lookup(workers, b"review.worker", CTX)
    assert in_workers.st_ino >= SPARE_INO_BASE and in_workers.generation == 0
    assert h.store.nodes[in_workers.st_ino] is not h.store.nodes[backing]
    # The listing shows the number the lookup gave.
    assert (b"review.worker", in_workers.st_ino) in {
        (n, i) for n, i, _ in (await h.listdir(workers)).got
    }

    # Outside, notes.txt is deleted and a directory takes its inode number, while the kernel
    # still holds the file's node.
    working = await h.ino("/session/working")
    parent = h.store.get(working)
    notes = await h.ops.lookup(working, b"notes.txt", CTX)
    st = h.store.lstat(h.store.dir_fd(parent), b"notes.txt")
    assert st is not None and st.st_ino == notes.st_ino
    st.st_mode = stat.S_IFDIR | 0o755
    reused = h.store.remember(parent, b"newdir", st)
    assert reused.ino >= SPARE_INO_BASE and reused is not h.store.nodes[notes.st_ino]
    # Once the kernel forgot the old node, the number is the backing file's again.
    forget(h.ops, notes.st_ino, 1)
    forget(h.ops, reused.ino, 1)
    st.st_mode = stat.S_IFREG | 0o644
    again = h.store.remember(parent, b"notes.txt", st)
    assert again.ino == notes.st_ino and again.generation not in (0, notes.generation)

    # Numbers the fixed nodes use, and those at or above SPARE_INO_BASE, are never passed on.
    for number in (ROOT_INO, CONTEXT_INO, FIRST_DYNAMIC_INO - 1, SPARE_INO_BASE + 10**6):
        st.st_ino, st.st_dev = number, st.st_dev + 1
        node = h.store.remember(parent, b"x%d" % number, st)
        assert SPARE_INO_BASE <= node.ino < SPARE_INO_BASE + 10**6 and node.generation == 0
    spares = [n.ino for n in h.store.nodes.values() if n.ino >= SPARE_INO_BASE]
    assert len(spares) == len(set(spares))


# ===== create-only /staged at untrusted ==========================================================


async def test_staged_create_only_at_untrusted(make: Callable[[str], Harness]) -> None:
    h = make("untrusted")
    staged = ZONE_INO[Zone.STAGED]
    backing = h.dirs[Zone.STAGED]

    c0 = await h.ino("/staged/c0")  # existing directories resolve
    await fails(h.ops.lookup(c0, b"old.txt", CTX), errno.ENOENT)
    h.denial("read", "/staged/c0/old.txt", "staged", "ENOENT", "staged is create-only")
    # A create over it (after lookup said absent) is refused as a write, not EEXIST.
    await fails(h.ops.create(c0, b"old.txt", 0o644, os.O_WRONLY, CTX), errno.EACCES)
    h.denial("write", "/staged/c0/old.txt", "staged", "EACCES", "existing entries cannot be")
    assert (await h.ops.lookup(c0, b"absent.txt", CTX)).st_ino == 0
    await fails(h.ops.opendir(staged, CTX), errno.EACCES)
    h.denial("list", "/staged", "staged", "EACCES", "create-only")
    await fails(h.ops.opendir(c0, CTX), errno.EACCES)
    await fails(h.ops.unlink(c0, b"old.txt", CTX), errno.EACCES)
    h.denial("delete", "/staged/c0/old.txt", "staged", "EACCES", "create-only")
    await fails(h.ops.rmdir(staged, b"c0", CTX), errno.EACCES)
    await fails(h.ops.rename(c0, b"old.txt", c0, b"new.txt", 0, CTX), errno.EACCES)
    h.denial("rename", "/staged/c0/old.txt", "staged", "EACCES")
    assert (backing / "c0" / "old.txt").read_text() == "staged before this mount\n"

    c1 = (await h.ops.mkdir(staged, b"c1", 0o755, CTX)).st_ino
    h.allowed("write", "/staged/c1", "staged", detail="mkdir")
    stored: list[bytes] = []
    h.ops.kernel_store = lambda ino, off, data: stored.append(data)
    fi, attrs = await h.ops.create(c1, b"f.txt", 0o644, os.O_WRONLY, CTX)
    assert await h.ops.write(fi.fh, 0, b"proposed") == 8
    await h.ops.release(fi.fh)
    assert (backing / "c1" / "f.txt").read_bytes() == b"proposed"
    assert stored == []  # unreadable here, so never put in the kernel's page cache
    entry = h.allowed("write", "/staged/c1/f.txt", "staged", detail="create")
    assert entry["bytes"] == 8

    # The file it made resolves for this mount and can be read back (audited), and its
    # directory listed, showing only what this mount made; it cannot be rewritten or deleted.
    assert (await h.ops.lookup(c1, b"f.txt", CTX)).st_ino == attrs.st_ino
    fi = await h.ops.open(attrs.st_ino, os.O_RDONLY, CTX)
    assert await h.ops.read(fi.fh, 0, 100) == b"proposed"
    await h.ops.release(fi.fh)
    h.allowed("read", "/staged/c1/f.txt", "staged")
    (backing / "c1" / "other.txt").write_text("someone else's\n")
    assert (await h.listdir(c1)).names == [b".", b"..", b"f.txt"]
    await fails(h.ops.lookup(c1, b"other.txt", CTX), errno.ENOENT)
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
        await fails(h.ops.open(attrs.st_ino, flags, CTX), errno.EACCES)
    refused = h.entries(path="/staged/c1/f.txt", allowed=False)  # repeats may be counted
    assert refused and all(e["op"] == "write" for e in refused), refused
    await fails(h.ops.getxattr(attrs.st_ino, b"user.x", CTX), errno.EACCES)
    await fails(h.ops.listxattr(attrs.st_ino, CTX), errno.EACCES)
    await fails(h.ops.unlink(c1, b"f.txt", CTX), errno.EACCES)
    await fails(h.ops.create(c1, b"f.txt", 0o644, os.O_WRONLY, CTX), errno.EACCES)
    assert (backing / "c1" / "f.txt").read_bytes() == b"proposed"
    await fails(h.ops.link(attrs.st_ino, c1, b"g.txt", CTX), errno.EACCES)

    # New entries inside a directory that existed before: allowed.
    nested = await h.ops.mkdir(c0, b"more", 0o755, CTX)
    await h.write_new(nested.st_ino, b"n.txt", b"n")
    assert (backing / "c0" / "more" / "n.txt").read_bytes() == b"n"
    link = await h.ops.symlink(c1, b"l", b"f.txt", CTX)
    assert await h.ops.readlink(link.st_ino, CTX) == b"f.txt"  # its own
    fifo = await h.ops.mknod(c1, b"p", stat.S_IFIFO | 0o644, 0, CTX)
    assert stat.S_ISFIFO(fifo.st_mode)


async def test_staged_create_only_truncate_through_creating_handle(
    make: Callable[[str], Harness],
) -> None:
    h = make("untrusted")
    fi, attrs = await h.ops.create(ZONE_INO[Zone.STAGED], b"f.txt", 0o644, os.O_WRONLY, CTX)
    await h.ops.write(fi.fh, 0, b"first draft")
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 5
    flags = fields(update_size=True)
    assert (await h.ops.setattr(attrs.st_ino, attr, flags, fi.fh, CTX)).st_size == 5
    await h.ops.release(fi.fh)
    assert (h.dirs[Zone.STAGED] / "f.txt").read_bytes() == b"first"


async def test_staged_create_only_no_truncate_after_release(
    make: Callable[[str], Harness],
) -> None:
    h = make("untrusted")
    inode = await h.write_new(ZONE_INO[Zone.STAGED], b"f.txt", b"proposed")
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 0
    # Create-only: an existing file is never truncated. Reopening with O_TRUNC is refused;
    # truncating by path must be too.
    await fails(h.ops.open(inode, os.O_WRONLY | os.O_TRUNC, CTX), errno.EACCES)
    await fails(h.ops.setattr(inode, attr, fields(update_size=True), None, CTX), errno.EACCES)
    assert (h.dirs[Zone.STAGED] / "f.txt").read_bytes() == b"proposed"


# ===== deny list and state dir ==================================================================


async def test_deny_list_at_full(make: Callable[[str], Harness]) -> None:
    """Deny-listed entries resolve with their real attributes; their contents are refused,
    and they are never created, changed, renamed or deleted (EACCES, audited)."""
    h = make("full")
    repo = ZONE_INO[Zone.REPO]
    env = await h.ops.lookup(repo, b".env", CTX)
    real = os.stat(h.project / ".env")
    assert (env.st_ino, env.st_size, env.st_mtime_ns) == (real.st_ino, 15, real.st_mtime_ns)
    assert not h.entries(path="/repo/.env")  # a lookup is no read
    assert (await h.ops.lookup(repo, b".env.local", CTX)).st_ino == 0  # absent
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
        await fails(h.ops.open(env.st_ino, flags, CTX), errno.EACCES)
    reads = h.entries(op="read", path="/repo/.env", allowed=False)
    assert len(reads) == 1 and "matches the deny pattern '.env'" in reads[0]["reason"]
    assert len(h.entries(op="write", path="/repo/.env", allowed=False)) == 3
    await fails(h.ops.setattr(env.st_ino, env, fields(update_size=True), None, CTX), errno.EACCES)
    await fails(h.ops.setattr(env.st_ino, env, fields(update_mode=True), None, CTX), errno.EACCES)
    await fails(h.ops.setxattr(env.st_ino, b"user.x", b"1", CTX), errno.EACCES)
    await fails(h.ops.getxattr(env.st_ino, b"user.x", CTX), pyfuse3.ENOATTR)  # none shown
    assert await h.ops.listxattr(env.st_ino, CTX) == []
    await fails(h.ops.unlink(repo, b".env", CTX), errno.EACCES)
    h.denial("delete", "/repo/.env", "repo", "EACCES", "'.env'")
    await fails(h.ops.rename(repo, b".env", repo, b"env.txt", 0, CTX), errno.EACCES)
    await fails(h.ops.link(env.st_ino, repo, b"env.txt", CTX), errno.EACCES)
    await fails(h.ops.create(repo, b".env", 0o600, os.O_WRONLY | os.O_TRUNC, CTX), errno.EACCES)
    assert (h.project / ".env").read_text() == "API_KEY=secret\n"
    assert os.stat(h.project / ".env").st_mtime_ns == real.st_mtime_ns

    # A deny-listed directory: resolved, never listed; what is inside resolves and is refused.
    ssh = await h.ops.lookup(repo, b".ssh", CTX)
    await fails(h.ops.opendir(ssh.st_ino, CTX), errno.EACCES)
    h.denial("list", "/repo/.ssh", "repo", "EACCES", "'.ssh/'")
    key = await h.ops.lookup(ssh.st_ino, b"id_rsa", CTX)
    assert key.st_size == len("private\n")
    await fails(h.ops.open(key.st_ino, os.O_RDONLY, CTX), errno.EACCES)
    h.denial("read", "/repo/.ssh/id_rsa", "repo", "EACCES", "'.ssh/'")
    await fails(h.ops.create(ssh.st_ino, b"config", 0o600, os.O_WRONLY, CTX), errno.EACCES)
    await fails(h.ops.unlink(ssh.st_ino, b"id_rsa", CTX), errno.EACCES)
    await fails(h.ops.rmdir(repo, b".ssh", CTX), errno.EACCES)
    await fails(h.ops.rename(repo, b".ssh", repo, b"ssh", 0, CTX), errno.EACCES)
    assert sorted(os.listdir(h.project / ".ssh")) == ["id_rsa"]

    # Names the deny list refuses are not created, nor renamed or linked onto.
    working = await h.ino("/session/working")
    notes = await h.ino("/session/working/notes.txt")
    await fails(h.ops.create(working, b".netrc", 0o600, os.O_WRONLY, CTX), errno.EACCES)
    await fails(h.ops.mkdir(working, b".aws", 0o700, CTX), errno.EACCES)
    await fails(h.ops.rename(working, b"notes.txt", working, b".env.prod", 0, CTX), errno.EACCES)
    await fails(h.ops.link(notes, working, b".git-credentials", CTX), errno.EACCES)
    await fails(h.ops.symlink(working, b".env.local", b"notes.txt", CTX), errno.EACCES)
    assert sorted(os.listdir(h.dirs[Zone.SESSION] / "working")) == ["notes.txt"]
    # Templates meant to be committed are ordinary files.
    await h.write_new(working, b".env.example", b"API_KEY=\n")
    assert await h.read_file(await h.ino("/session/working/.env.example")) == b"API_KEY=\n"


async def test_deny_listed_symlink_target_is_refused(make: Callable[[str], Harness]) -> None:
    h = make("full")
    (h.project / ".netrc").symlink_to("README.md")
    link = await h.ops.lookup(ZONE_INO[Zone.REPO], b".netrc", CTX)
    assert stat.S_ISLNK(link.st_mode)
    await fails(h.ops.readlink(link.st_ino, CTX), errno.EACCES)
    h.denial("read", "/repo/.netrc", "repo", "EACCES", "'.netrc'")


async def test_deny_listed_names_look_absent_where_the_zone_cannot_be_listed(
    make: Callable[[str], Harness],
) -> None:
    """At levels that may not know a zone's names (create-only /staged at untrusted), an
    existing deny-listed name still looks absent, as every existing name there does."""
    h = make("untrusted")
    (h.dirs[Zone.STAGED] / "c0" / ".env").write_text("SECRET=1\n")
    c0 = await h.ino("/staged/c0")
    await fails(h.ops.lookup(c0, b".env", CTX), errno.ENOENT)
    h.denial("read", "/staged/c0/.env", "staged", "ENOENT", "'.env'")
    assert (await h.ops.lookup(c0, b".env.local", CTX)).st_ino == 0
    await fails(h.ops.create(c0, b".env.local", 0o600, os.O_WRONLY, CTX), errno.EACCES)


async def test_private_keys_are_refused_by_their_contents(make: Callable[[str], Harness]) -> None:
    """`*.pem`, `*.key`, `id_rsa*`...: refused like deny-listed files only when the file holds
    a private key; certificates, public keys and other files with those names are ordinary."""
    h = make("full")
    repo = ZONE_INO[Zone.REPO]
    (h.project / "ca.pem").write_text(
        "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    )
    (h.project / "id_rsa.pub").write_text("ssh-rsa AAAAB3Nza user@host\n")
    for name in (b"ca.pem", b"id_rsa.pub"):
        assert await h.read_file((await h.ops.lookup(repo, name, CTX)).st_ino)
    server = await h.ops.lookup(repo, b"server.pem", CTX)  # a PEM PRIVATE KEY block
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY | os.O_TRUNC):
        await fails(h.ops.open(server.st_ino, flags, CTX), errno.EACCES)
    entry = h.entries(op="read", path="/repo/server.pem", allowed=False)[0]
    assert "holds a private key (a PEM PRIVATE KEY block)" in entry["reason"]
    assert "'*.pem'" in entry["reason"] and entry["errno"] == "EACCES"
    await fails(
        h.ops.setattr(server.st_ino, server, fields(update_size=True), None, CTX), errno.EACCES
    )
    await fails(h.ops.unlink(repo, b"server.pem", CTX), errno.EACCES)
    await fails(h.ops.rename(repo, b"server.pem", repo, b"server.txt", 0, CTX), errno.EACCES)
    await fails(h.ops.rename(repo, b"README.md", repo, b"server.pem", 0, CTX), errno.EACCES)
    await fails(h.ops.link(server.st_ino, repo, b"copy.txt", CTX), errno.EACCES)
    # A CREATE without O_EXCL (after a lookup the kernel still caches as negative) would open it.
    await fails(h.ops.create(repo, b"server.pem", 0o644, os.O_RDWR, CTX), errno.EACCES)
    assert (h.project / "server.pem").read_text() == "-----BEGIN PRIVATE KEY-----\n"
    assert not (h.project / "server.txt").exists() and not (h.project / "copy.txt").exists()

    # A new key file may be created and written; once it holds a key, it is refused.
    working = await h.ino("/session/working")
    ino = await h.write_new(working, b"deploy.key", b"-----BEGIN EC PRIVATE KEY-----\nMHc\n")
    await fails(h.ops.open(ino, os.O_RDONLY, CTX), errno.EACCES)
    # The same name without a key is readable again: the answer follows the contents.
    (h.dirs[Zone.SESSION] / "working" / "deploy.key").write_text("not a key\n")
    assert await h.read_file(ino) == b"not a key\n"


async def test_state_dir_and_mountpoint_are_invisible_in_repo(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    repo = ZONE_INO[Zone.REPO]
    for name in (b".sandbox", b"mnt"):
        await fails(h.ops.lookup(repo, name, CTX), errno.ENOENT)
        await fails(h.ops.mkdir(repo, name, 0o755, CTX), errno.EACCES)
        await fails(h.ops.create(repo, name, 0o644, os.O_WRONLY, CTX), errno.EACCES)
    denied = h.entries(op="write", path="/repo/.sandbox", allowed=False)
    assert len(denied) == 2  # mkdir and create
    assert all(e["errno"] == "EACCES" and "sandboxfs's own state" in e["reason"] for e in denied)
    looked = h.entries(op="read", path="/repo/.sandbox", allowed=False)
    assert [e["errno"] for e in looked] == ["ENOENT"]
    await fails(h.ops.rmdir(repo, b".sandbox", CTX), errno.EACCES)
    await fails(h.ops.rename(repo, b"src", repo, b".sandbox", 0, CTX), errno.EACCES)
    assert (h.project / ".sandbox" / "audit.jsonl").exists()
    assert (h.project / "src").is_dir()
    # Only the project root's .sandbox is the state dir; elsewhere the name is ordinary.
    src = await h.ino("/repo/src")
    made = await h.ops.mkdir(src, b".sandbox", 0o755, CTX)
    assert (await h.ops.lookup(src, b".sandbox", CTX)).st_ino == made.st_ino


async def test_symlinks_in_backing_storage_are_never_followed(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    outside = h.project.parent / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside the zone\n")
    os.symlink(outside, h.project / "dir-escape")
    os.symlink(outside / "secret.txt", h.project / "file-escape")
    repo = ZONE_INO[Zone.REPO]
    to_dir = await h.ops.lookup(repo, b"dir-escape", CTX)
    assert stat.S_ISLNK(to_dir.st_mode)
    assert await h.ops.readlink(to_dir.st_ino, CTX) == os.fsencode(outside)
    assert (await h.ops.lookup(to_dir.st_ino, b"secret.txt", CTX)).st_ino == 0
    await fails(h.ops.opendir(to_dir.st_ino, CTX), errno.ENOTDIR)
    to_file = await h.ops.lookup(repo, b"file-escape", CTX)
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR | os.O_TRUNC):
        await fails(h.ops.open(to_file.st_ino, flags, CTX), errno.ELOOP)
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 0
    await fails(
        h.ops.setattr(to_file.st_ino, attr, fields(update_size=True), None, CTX), errno.ELOOP
    )
    await fails(h.ops.setxattr(to_file.st_ino, b"user.x", b"1", CTX), errno.EPERM)
    await fails(h.ops.getxattr(to_file.st_ino, b"user.x", CTX), pyfuse3.ENOATTR)
    assert (outside / "secret.txt").read_text() == "outside the zone\n"
    assert os.listxattr(outside / "secret.txt") == []


async def test_denials_are_on_disk_before_the_error_returns(
    make: Callable[[str], Harness],
) -> None:
    h = make("untrusted")
    await fails(h.ops.lookup(ZONE_INO[Zone.REPO], b"README.md", CTX), errno.ENOENT)
    on_disk = list(read_entries(h.log_path))  # no flush
    assert [(e["op"], e["path"], e["allowed"]) for e in on_disk] == [
        ("read", "/repo/README.md", False)
    ]


# ===== /.sandboxfs/context.json ==================================================================


@pytest.mark.parametrize("trust", ["untrusted", "full"])
async def test_context_json(make: Callable[[str], Harness], trust: str) -> None:
    h = make(trust)
    inode = await h.ino("/.sandboxfs/context.json")
    assert inode == CONTEXT_INO
    attrs = await h.ops.getattr(inode, CTX)
    assert stat.S_ISREG(attrs.st_mode)
    assert stat.S_IMODE(attrs.st_mode) == 0o644
    fi = await h.ops.open(inode, os.O_RDONLY, CTX)
    data = await h.ops.read(fi.fh, 0, 1 << 20)
    assert len(data) == attrs.st_size
    assert await h.ops.read(fi.fh, 2, 3) == data[2:5]
    await h.ops.release(fi.fh)
    doc = json.loads(data)
    assert doc["trust"] == trust
    assert doc["session"] == SESSION_ID
    assert doc["workspace"] == WORKSPACE_ID
    assert doc["zones"]["session"]["write"] is True
    assert doc["zones"]["repo"]["read"] is (trust == "full")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        await fails(h.ops.open(inode, flags, CTX), errno.EACCES)
    entries = h.entries(path="/.sandboxfs/context.json", allowed=False)
    assert len(entries) == 3
    assert all(e["op"] == "write" and e["errno"] == "EACCES" for e in entries)
    assert "read-only at every trust level" in entries[0]["reason"]
    assert entries[0]["comm"] == COMM


# ===== /workers union ===========================================================================


async def test_workers_union(make: Callable[[str], Harness]) -> None:
    h = make("untrusted")
    workers = ZONE_INO[Zone.WORKERS]
    names = (await h.listdir(workers)).names
    assert names == [b".", b"..", b"only1.worker", b"review.worker", b"only2.worker"]
    h.allowed("list", "/workers", "workers")
    assert await h.read_file(await h.ino("/workers/review.worker")) == b"name: review\n"
    assert await h.read_file(await h.ino("/workers/only2.worker")) == b"layer 2 only\n"
    assert await h.read_file(await h.ino("/workers/only1.worker")) == b"layer 1 only\n"
    assert (await h.ops.lookup(workers, b"absent.worker", CTX)).st_ino == 0
    await fails(h.ops.create(workers, b"new.worker", 0o644, os.O_WRONLY, CTX), errno.EROFS)
    h.denial("write", "/workers/new.worker", "workers", "EROFS", "workers is not writable")


async def test_workers_second_layer_is_read_only_at_full(make: Callable[[str], Harness]) -> None:
    h = make("full")
    workers = ZONE_INO[Zone.WORKERS]
    only2 = await h.ino("/workers/only2.worker")
    await fails(h.ops.open(only2, os.O_WRONLY, CTX), errno.EROFS)
    h.denial("write", "/workers/only2.worker", "workers", "EROFS", "SANDBOXFS_WORKERS_PATH")
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 0
    await fails(h.ops.setattr(only2, attr, fields(update_size=True), None, CTX), errno.EROFS)
    await fails(h.ops.unlink(workers, b"only2.worker", CTX), errno.EROFS)
    h.denial("delete", "/workers/only2.worker", "workers", "EROFS", "SANDBOXFS_WORKERS_PATH")
    await fails(h.ops.rename(workers, b"only2.worker", workers, b"x.worker", 0, CTX), errno.EROFS)
    assert (h.layer2 / "only2.worker").read_text() == "layer 2 only\n"

    # The first layer, <project>/.workers, is writable at full.
    review = await h.ino("/workers/review.worker")
    fi = await h.ops.open(review, os.O_WRONLY | os.O_TRUNC, CTX)
    await h.ops.write(fi.fh, 0, b"edited\n")
    await h.ops.release(fi.fh)
    assert (h.project / ".workers" / "review.worker").read_text() == "edited\n"
    assert (h.layer2 / "review.worker").read_text() == "layer 2 review\n"
    await h.write_new(workers, b"new.worker", b"n")
    assert (h.project / ".workers" / "new.worker").read_bytes() == b"n"


# ===== the guard ================================================================================


async def test_unexpected_error_becomes_eio_and_is_audited(
    make: Callable[[str], Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make("session")
    working = await h.ino("/session/working")

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(h.store, "stat_child", boom)
        await fails(h.ops.lookup(working, b"notes.txt", CTX), errno.EIO)
    entry = h.one(op="error")
    assert entry["allowed"] is False
    assert entry["errno"] == "EIO"
    assert entry["reason"] == "internal error in lookup: RuntimeError: boom"
    assert entry["trust"] == "session"
    assert entry["session"] == SESSION_ID

    with monkeypatch.context() as patch:
        patch.setattr(h.store, "list_entries", boom)
        fh = await h.ops.opendir(working, CTX)
        await fails(h.readdir(fh, 0), errno.EIO)
        await h.ops.releasedir(fh)
    assert len(h.entries(op="error")) == 2
    assert "internal error in readdir" in h.entries(op="error")[1]["reason"]

    # The operations object carries on as before.
    notes = await h.ino("/session/working/notes.txt")
    assert await h.read_file(notes) == b"session notes\n"
    assert b"notes.txt" in (await h.listdir(working)).names
    await h.write_new(working, b"after.txt", b"ok")
    assert (h.dirs[Zone.SESSION] / "working" / "after.txt").read_bytes() == b"ok"


# ----- process names ------------------------------------------------------------------------------


def eventually_named(names: ProcessNames, pid: int, name: str) -> bool:
    """Whether `pid` shows `name` within 10 s (a child's comm changes only once exec is done)."""
    deadline = time.monotonic() + 10
    while names.get(pid) != name:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_process_names_follow_exec_and_forget_dead_processes() -> None:
    names = ProcessNames(capacity=2)
    proc = subprocess.Popen(["sh", "-c", "read line; exec sleep 30"], stdin=subprocess.PIPE)
    try:
        assert eventually_named(names, proc.pid, "sh")  # once the child has exec'd
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert eventually_named(names, proc.pid, "sleep")  # read afresh, same descriptor
    finally:
        proc.kill()
        proc.communicate()
    assert names.get(proc.pid) is None  # gone (and reaped): no stale name
    assert names.get(os.getpid()) == COMM
    assert names.get(0) is None
    others = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        assert all(eventually_named(names, p.pid, "sleep") for p in others)
        assert len(names._fds) == 2  # bounded: the oldest descriptor was closed
    finally:
        for p in others:
            p.kill()
            p.wait()
        names.close()
    assert names._fds == {}


# ----- the inotify watch budget --------------------------------------------------------------


@pytest.mark.parametrize("spent", ["sandboxfs's share", "the kernel's"])
def test_a_spent_watch_budget_is_logged_once(
    make: Callable[[str], Harness],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    spent: str,
) -> None:
    """Past the budget, directories keep short timeouts (slower, still right): the daemon's
    log says so once, not on every directory."""
    h = make("full")
    root = h.store.zone_roots[Zone.REPO]
    for n in range(5):
        (h.project / f"d{n}").mkdir()
    nodes = []
    for n in range(5):
        st = h.store.stat_child(root, f"d{n}".encode())
        assert st is not None
        nodes.append(h.store.remember(root, f"d{n}".encode(), st))
    watch = host_watch.HostWatch(h.store)
    try:
        if spent == "the kernel's":

            def full(fd: int, dir_fd: int, mask: int) -> int:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(host_watch, "inotify_add_watch", full)
        else:
            watch.budget = 2
        with caplog.at_level("INFO", logger="sandboxfs.fuse.host_watch"):
            for node in nodes:
                watch.cover(node)
        assert [n.watch >= 0 for n in nodes].count(True) == (2 if watch.budget == 2 else 0)
        warnings = [r for r in caplog.records if r.name == "sandboxfs.fuse.host_watch"]
        assert len(warnings) == 1, caplog.text
        assert warnings[0].levelname == "WARNING"
        assert "max_user_watches" in warnings[0].getMessage()
    finally:
        watch.close()
