"""What every callback of the adapter shares: the guard it runs in and the mount's state.

Handlers do their work synchronously between awaits, so the inode table never changes under
a running callback. One guard (`guarded`) turns `SandboxError` and `OSError` into
`FUSEError`, and anything unexpected into a logged, audited `EIO`: only `FUSEError` may leave
a handler, or pyfuse3 takes the whole mount down.

`OperationsBase` holds the state (store, gate, replies, handle tables) and the helpers more
than one group of callbacks uses; the callback mixins (sandboxfs.fuse.file_ops,
sandboxfs.fuse.dir_ops) and `SandboxOperations` build on it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Concatenate, ParamSpec, TypeVar

import pyfuse3

from sandboxfs.core.context import guide
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.gate import Gate
from sandboxfs.core.guard import Guard
from sandboxfs.core.inodes import CONTEXT_NAME, CONTROL_NAME, GUIDE_NAME, Node, StatLike
from sandboxfs.core.policy import Zone
from sandboxfs.core.store import Store
from sandboxfs.core.syscalls import set_fs_ids
from sandboxfs.fuse.handles import BlobHandle, DirHandle, FileHandle
from sandboxfs.fuse.host_watch import HostWatch
from sandboxfs.fuse.replies import Replies
from sandboxfs.fuse.warm import Warm

__all__ = ["OperationsBase", "guarded"]

log = logging.getLogger("sandboxfs.fuse.operations")  # the name the mount's log has always shown

# Callbacks that write an audit entry when they succeed: refused while the log is failing,
# audited then under the callback's own name.
_AUDITED_CALLBACKS = frozenset(
    {
        AuditOp.OPEN,
        AuditOp.OPENDIR,
        AuditOp.CREATE,
        AuditOp.MKDIR,
        AuditOp.SYMLINK,
        AuditOp.MKNOD,
        AuditOp.LINK,
        AuditOp.UNLINK,
        AuditOp.RMDIR,
        AuditOp.RENAME,
        AuditOp.SETATTR,
        AuditOp.SETXATTR,
        AuditOp.REMOVEXATTR,
    }
)

S = TypeVar("S", bound="OperationsBase")
P = ParamSpec("P")
R = TypeVar("R")


def guarded(
    fn: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], Awaitable[R]]:
    """Run a synchronous handler as the async callback pyfuse3 expects, mapping every error."""

    audited = AuditOp(fn.__name__) if fn.__name__ in _AUDITED_CALLBACKS else None

    async def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if audited is not None:
            ctx = next((a for a in args if isinstance(a, pyfuse3.RequestContext)), None)
            try:
                self.gate.fail_closed(
                    audited,
                    None,
                    pid=ctx.pid if ctx is not None else 0,
                    uid=ctx.uid if ctx is not None else 0,
                )
            except SandboxError as exc:
                raise pyfuse3.FUSEError(exc.errno) from None
        try:
            return fn(self, *args, **kwargs)
        except SandboxError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors outside the store's own retries: give the cached ones
                # back, so that this request fails alone and the next ones are served.
                self.store.make_room()
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            log.exception("internal error in %s", fn.__name__)
            self.gate.effects.internal_error(fn.__name__, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class OperationsBase(pyfuse3.Operations):  # type: ignore[misc]
    """The state and shared helpers of the adapter; the callbacks live in its subclasses."""

    def __init__(
        self,
        store: Store,
        guard: Guard,
        *,
        entry_timeout: float,
        attr_timeout: float,
        context_json: bytes,
        host_watch: HostWatch | None = None,
        watched_timeout: float = 0.0,
    ) -> None:
        super().__init__()
        self.store = store
        self.guard = guard
        self.gate = Gate(guard, store, guard.effects)
        self.context_json = context_json
        self._write_guides()
        self._pid_namespace = os.readlink("/proc/self/ns/pid")
        self.running_as_root = os.geteuid() == 0
        session_root = os.stat(store.zone_roots[Zone.SESSION].fd)
        self.replies = Replies(
            store,
            guard.readable,
            lambda: len(self.context_json),
            entry_timeout=entry_timeout,
            attr_timeout=attr_timeout,
            host_watch=host_watch,
            watched_timeout=watched_timeout,
            owner=(session_root.st_uid, session_root.st_gid),
            guide_size=lambda: len(self.guides[1]) + len(self._pending_text()),
        )
        self._handles: dict[int, FileHandle | BlobHandle] = {}
        self._dirs: dict[int, DirHandle] = {}
        self._next_fh = 1
        # pyfuse3.notify_store once the mount is up: (inode, offset, data) into the page cache.
        self.kernel_store: Callable[[int, int, bytes], None] | None = None
        # The daemon's own walk that warms the kernel's cache (sandboxfs.fuse.warm), if any.
        self.warm: Warm | None = None
        self._zone_names = {zone.value.encode(): zone for zone in guard.policy.zones}

    def _gate(self, pid: int) -> Gate:
        """The gate, or for the daemon's own cache warm the gate without effect: what it may
        list is what every caller may, and it is nobody's operation to audit or ask about."""
        warm = self.warm
        if warm is not None and pid != 0 and pid == warm.tid:
            return self.gate.without_effect()
        return self.gate

    @contextlib.contextmanager
    def _as_caller(self, uid: int, gid: int) -> Iterator[None]:
        """Make backing calls with the caller's filesystem identity, so the kernel charges
        their blocks and inodes to the caller (disk quotas, ext4's reserve for root) rather
        than to a root daemon. The daemon keeps its own identity for everything else."""
        if not self.running_as_root or (uid == 0 and gid == 0):
            yield
            return
        set_fs_ids(uid, gid)
        try:
            yield
        finally:
            set_fs_ids(0, 0)

    def _lookup_root(self, name: bytes) -> Node:
        if name == CONTROL_NAME:
            return self.store.control
        zone = self._zone_names.get(name)
        if zone is None:
            raise SandboxError(errno.ENOENT)
        return self.store.zone_roots[zone]

    def _control_child(self, name: bytes) -> Node:
        if name == CONTEXT_NAME:
            return self.store.context
        if name == GUIDE_NAME:
            return self.store.guide
        raise SandboxError(errno.ENOENT)

    def _pending_text(self) -> bytes:
        """What waits for the user's approval, at the end of the guide (core.approvals)."""
        broker = self.gate.effects.consent.broker
        return broker.pending_text().encode() if broker is not None else b""

    def _write_guides(self) -> None:
        """/.sandboxfs/README as the host side and a program inside `run` read it (the same
        text, with the mount's own path or /sandbox), from the policy of the current level."""
        info = self.guard.info
        self.guides = (
            guide(self.guard.policy, info, info.mountpoint),
            guide(self.guard.policy, info),
        )

    def _made_here(self, parent: Node, name: bytes, st: StatLike | None) -> None:
        """parent/name was just made `st` (None: removed) here; see HostWatch.made_here."""
        if self.replies.host_watch is not None:
            self.replies.host_watch.made_here(parent, name, st)
