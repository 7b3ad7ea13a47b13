"""The FUSE adapter without a mount: a real store, policy and audit log, a fake request context."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyfuse3
import pytest

from sandboxfs.audit.reader import read_entries
from sandboxfs.audit.writer import AuditLog
from sandboxfs.config.model import defaults
from sandboxfs.core.context import context_document
from sandboxfs.core.guard import Guard
from sandboxfs.core.inodes import ROOT_INO
from sandboxfs.core.policy import Policy, Trust, Zone
from sandboxfs.core.rulebase import MountInfo
from sandboxfs.core.secrets import KeyScanner, StoreContents
from sandboxfs.core.store import Store
from sandboxfs.fuse.handles import FileHandle
from sandboxfs.fuse.operations import SandboxOperations
from tests.support.mounts import make_project

COMM = Path("/proc/self/comm").read_text().strip()
SESSION_ID = "s1"
WORKSPACE_ID = "default"


@dataclass(frozen=True)
class Ctx:
    """Stand-in for pyfuse3.RequestContext."""

    uid: int
    gid: int
    pid: int
    umask: int = 0o022


CTX = Ctx(uid=os.getuid(), gid=os.getgid(), pid=os.getpid())


class Replies:
    """Fake pyfuse3.readdir_reply: records (name, st_ino, next_id); full after `limit` entries."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.got: list[tuple[bytes, int, int]] = []

    def __call__(self, token: Any, name: bytes, attrs: Any, next_id: int) -> bool:
        if self.limit is not None and len(self.got) >= self.limit:
            return False
        self.got.append((name, attrs.st_ino, next_id))
        return True

    @property
    def names(self) -> list[bytes]:
        return [name for name, _, _ in self.got]


class Harness:
    """One SandboxOperations over a fresh project, with helpers to drive it."""

    def __init__(self, root: Path, trust: Trust, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        root.mkdir()
        self.project = make_project(root)
        self.mountpoint = self.project / "mnt"
        self.mountpoint.mkdir()
        (self.project / ".workers" / "only1.worker").write_text("layer 1 only\n")
        state = self.project / ".sandbox"
        ws = state / "workspaces" / WORKSPACE_ID
        session = ws / "sessions" / SESSION_ID
        for sub in ("inputs", "working", "outputs"):
            (session / sub).mkdir(parents=True)
        (session / "working" / "notes.txt").write_text("session notes\n")
        workspace = ws / "workspace"
        for sub in ("cache/web", "cache/pdfs", "cache/attachments", "data"):
            (workspace / sub).mkdir(parents=True)
        (workspace / "data" / "table.csv").write_text("a,b\n")
        staged = ws / "staged"
        (staged / "c0").mkdir(parents=True)
        (staged / "c0" / "old.txt").write_text("staged before this mount\n")
        self.layer2 = root / "layer2"
        self.layer2.mkdir()
        (self.layer2 / "review.worker").write_text("layer 2 review\n")
        (self.layer2 / "only2.worker").write_text("layer 2 only\n")
        self.dirs = {
            Zone.SESSION: session,
            Zone.WORKSPACE: workspace,
            Zone.REPO: self.project,
            Zone.STAGED: staged,
        }
        hidden = {(st.st_dev, st.st_ino) for st in map(os.stat, (state, self.mountpoint))}
        self.store = Store(self.dirs, [self.project / ".workers", self.layer2], hidden)
        config = defaults()
        self.policy = Policy(
            config.matrix(), config.deny, trust, config.protect, config.deny_private_keys
        )
        self.log_path = state / "audit.jsonl"
        self.audit = AuditLog(self.log_path, fold=False)  # every entry in full
        info = MountInfo(SESSION_ID, WORKSPACE_ID, str(self.project), str(self.mountpoint))
        self.guard = Guard(self.policy, self.audit, info, moves=lambda: self.store.moves)
        self.guard.inspect_contents(KeyScanner(StoreContents(self.store)))
        self.ops = SandboxOperations(
            self.store,
            self.guard,
            entry_timeout=1.0,
            attr_timeout=1.0,
            context_json=context_document(self.policy, info, os.getpid()),
        )

    def close(self) -> None:
        for handle in list(self.ops._handles.values()):
            if isinstance(handle, FileHandle):
                os.close(handle.fd)
        self.ops._handles.clear()
        self.store.close()
        self.audit.close()

    # ----- audit ---------------------------------------------------------------------------------

    def entries(self, **match: Any) -> list[dict[str, Any]]:
        """Audit entries (after a flush) whose fields equal every `match` value."""
        self.audit.flush()
        return [
            e for e in read_entries(self.log_path) if all(e.get(k) == v for k, v in match.items())
        ]

    def one(self, **match: Any) -> dict[str, Any]:
        found = self.entries(**match)
        assert len(found) == 1, (match, found)
        return found[0]

    def denial(
        self, op: str, path: str, zone: str | None, err: str, reason: str | None = None
    ) -> dict[str, Any]:
        """The single denial of op on path, checked for the fields every denial carries."""
        entry = self.one(op=op, path=path, allowed=False)
        assert entry["zone"] == zone
        assert entry["errno"] == err
        assert entry["pid"] == os.getpid()
        assert entry["uid"] == CTX.uid
        assert entry["comm"] == COMM
        assert entry["trust"] == self.policy.trust.value
        assert entry["session"] == SESSION_ID
        assert entry["workspace"] == WORKSPACE_ID
        assert entry["reason"]
        if reason is not None:
            assert reason in entry["reason"], entry["reason"]
        return entry

    def allowed(self, op: str, path: str, zone: str, **more: Any) -> dict[str, Any]:
        entry = self.one(op=op, path=path, allowed=True, **more)
        assert entry["zone"] == zone
        assert entry["errno"] is None
        assert entry["reason"] is None
        assert entry["pid"] == os.getpid()
        assert entry["comm"] == COMM
        return entry

    # ----- driving -------------------------------------------------------------------------------

    async def ino(self, vpath: str) -> int:
        """Resolve a virtual path one lookup at a time, as the kernel does."""
        inode = ROOT_INO
        for part in vpath.strip("/").split("/"):
            if part:
                attrs = await self.ops.lookup(inode, part.encode(), CTX)
                assert attrs.st_ino != 0, f"{vpath}: {part} does not exist"
                inode = attrs.st_ino
        return inode

    async def listdir(self, inode: int, limit: int | None = None) -> Replies:
        fh = await self.ops.opendir(inode, CTX)
        try:
            return await self.readdir(fh, 0, limit)
        finally:
            await self.ops.releasedir(fh)

    async def readdir(self, fh: int, start: int, limit: int | None = None) -> Replies:
        replies = Replies(limit)
        self.monkeypatch.setattr(pyfuse3, "readdir_reply", replies)  # = dir_ops.pyfuse3
        await self.ops.readdir(fh, start, cast(pyfuse3.ReaddirToken, object()))
        return replies

    async def read_file(self, inode: int) -> bytes:
        fi = await self.ops.open(inode, os.O_RDONLY, CTX)
        try:
            return await self.ops.read(fi.fh, 0, 1 << 16)
        finally:
            await self.ops.release(fi.fh)

    async def write_new(self, parent: int, name: bytes, data: bytes) -> int:
        fi, attrs = await self.ops.create(parent, name, 0o644, os.O_WRONLY, CTX)
        assert await self.ops.write(fi.fh, 0, data) == len(data)
        await self.ops.release(fi.fh)
        return int(attrs.st_ino)


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Harness]]:
    made: list[Harness] = []

    def factory(trust: str) -> Harness:
        harness = Harness(tmp_path / f"h{len(made)}", Trust(trust), monkeypatch)
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.close()


@pytest.fixture(scope="session", autouse=True)
def no_mounts_left_behind() -> Iterator[None]:
    """The adapter modules that import this mount nothing: shadow conftest's session-wide check,
    which would otherwise fail them (and force-unmount them) because of other test sessions'
    live mounts."""
    yield


async def fails(call: Awaitable[Any], err: int) -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await call
    got = info.value.errno
    assert got == err, f"expected {errno.errorcode[err]}, got {errno.errorcode.get(got, got)}"
