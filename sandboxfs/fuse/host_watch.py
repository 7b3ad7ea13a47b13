"""Kernel caches held for as long as they stay true: inotify watches on the backing directories.

The kernel keeps the names and attributes it was given for as long as the daemon says, and a
fixed time is wrong both ways: a change made outside the mount shows only when it runs out, and
once it has run out every `stat` is a request again (a `git status` after a pause looks up
every tracked file). So the daemon watches each backing directory whose entries the kernel
holds. A change made there, by anyone, is reported; the daemon then has the kernel forget the
names and attributes it touched, and the entries of a watched directory can be held for
`cache.watched_timeout` (an hour by default) instead of `cache.attr_timeout`.

Short timeouts stay where a watch would miss a change: the workers zone (a union of
directories), filesystems on which inotify does not see every change (network and FUSE storage,
overlayfs; see syscalls.reports_changes), files with more than one link (a change through a
name in another directory is reported there), directories past the watch budget, and a
directory's first reply (its lstat came before its watch).

inotify does not report mounts: a directory the kernel holds may become the root of another
mount (which the daemon never enters; it is absent through sandboxfs) or stop being one. So the
daemon also follows its mount table (MountTable), and when a mount point below a zone's directory
comes or goes, the kernel forgets everything it cached for the mount.

Changes made through the mount are reported too. The kernel knows them already, so a name
created, removed or renamed here whose backing entry is still what this daemon made of it is
not invalidated (its dentry stays), nor are attributes that are what the kernel was last given
(a file written, then chmod-ed or touched through the mount); other data and attribute changes
are (the attributes are fetched once more).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import select
import struct
import time
from collections.abc import Callable
from pathlib import Path

from sandboxfs.core.errors import SandboxError
from sandboxfs.core.inodes import Node, StatLike
from sandboxfs.core.policy import Zone
from sandboxfs.core.store import Store
from sandboxfs.core.syscalls import (
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_EXCL_UNLINK,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    inotify_add_watch,
    inotify_init,
    inotify_rm_watch,
    reports_changes,
)

log = logging.getLogger(__name__)

UNWATCHED = -1  # Node.watch: no watch asked for yet
UNWATCHABLE = -2  # Node.watch: a watch cannot cover this directory; short timeouts stay

_NAME_EVENTS = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
_MASK = _NAME_EVENTS | IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_ONLYDIR | IN_EXCL_UNLINK
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
# A name changed through the mount is checked against what the daemon made of it for this long.
_MADE_HERE_FOR = 2.0
_MADE_HERE_LIMIT = 1 << 16
# At most this many watches, and at most half of the user's inotify budget, which the user's
# editors and build tools share.
_MAX_WATCHES = 1 << 16


def _watch_budget() -> int:
    try:
        with open("/proc/sys/fs/inotify/max_user_watches", "rb") as f:
            system = int(f.read())
    except (OSError, ValueError):
        system = 8192
    return max(0, min(_MAX_WATCHES, system // 2))


class HostChanges:
    """What the kernel must forget after a batch of events."""

    __slots__ = ("everything", "inodes", "names", "nodes")

    def __init__(self) -> None:
        self.everything = False  # the event queue overflowed: events were lost
        self.inodes: set[int] = set()
        self.names: set[tuple[int, bytes]] = set()
        self.nodes: list[Node] = []  # whose attributes the daemon last gave are stale

    def __bool__(self) -> bool:
        return self.everything or bool(self.inodes or self.names)


class HostWatch:
    """The inotify watches of one mount: one per backing directory whose entries the kernel may
    hold long, shared by the nodes that stand for that directory."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.fd = inotify_init()
        self.budget = _watch_budget()
        self.watchable = {
            zone: reports_changes(root.fd)
            for zone, root in store.zone_roots.items()
            if zone is not Zone.WORKERS and root.fd >= 0
        }
        self._nodes: dict[int, list[Node]] = {}  # watch -> the directory nodes it covers
        # (watch, name) -> (when, backing (inode, birth) or None for absent): names created,
        # removed or renamed through the mount, and what the daemon left there.
        self._made_here: dict[tuple[int, bytes], tuple[float, tuple[int, int] | None]] = {}
        self._next_prune = 0.0
        self._told_spent = False  # the budget's end is logged once per mount
        # Whether the kernel holds no attributes of an inode but these (Replies.told): then a
        # change event (most often of a change made through the mount) needs no invalidation.
        self.told: Callable[[int, StatLike], bool] = lambda ino, st: False
        dirs = [store.project, *store.zone_paths.values(), *store.layer_paths]
        try:
            self.mounts = MountTable(dirs)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        self.mounts.close()
        os.close(self.fd)

    # ----- watches ----------------------------------------------------------------------------

    def cover(self, node: Node) -> None:
        """Watch a directory node's backing directory from now on, where that can be done."""
        if node.watch != UNWATCHED:
            return
        if (
            not node.is_dir or node.key is None or not self.watchable.get(node.zone)  # type: ignore[arg-type]
        ):
            node.watch = UNWATCHABLE
            return
        if len(self._nodes) >= self.budget:
            node.watch = UNWATCHABLE
            self._spent(f"sandboxfs's share of it ({self.budget} watches) is in use")
            return
        try:
            wd = inotify_add_watch(self.fd, self.store.dir_fd(node), _MASK)
        except (OSError, SandboxError) as exc:
            node.watch = UNWATCHABLE
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                self._spent(f"the kernel refused more ({len(self._nodes)} held here)")
            return
        node.watch = wd
        self._nodes.setdefault(wd, []).append(node)

    def _spent(self, why: str) -> None:
        """Say once that the watch budget ran out: past it, directories keep the short cache
        timeouts (more requests, never a stale view), which a user may want to know."""
        if self._told_spent:
            return
        self._told_spent = True
        log.warning(
            "inotify watch budget spent: %s; directories past it keep the short cache timeouts "
            "(raise fs.inotify.max_user_watches for more: sysctl -w fs.inotify.max_user_watches=N)",
            why,
        )

    def dropped(self, node: Node) -> None:
        """A directory node the kernel forgot: its watch goes with the last node on it."""
        wd, node.watch = node.watch, UNWATCHED
        nodes = self._nodes.get(wd)
        if nodes is None:
            return
        nodes[:] = [other for other in nodes if other is not node]
        if not nodes:
            del self._nodes[wd]
            inotify_rm_watch(self.fd, wd)

    # ----- changes made through the mount ------------------------------------------------------

    def made_here(self, parent: Node, name: bytes, st: StatLike | None) -> None:
        """Record that the daemon just made parent/name the backing entry `st` (None: removed
        it), so that the event this causes does not evict what the kernel was told."""
        wd = parent.watch
        if wd < 0:
            return
        made = self._made_here
        if len(made) >= _MADE_HERE_LIMIT:
            made.clear()
        made[(wd, name)] = (time.monotonic() + _MADE_HERE_FOR, _ident(st))

    def _as_made(self, wd: int, parent: Node, name: bytes) -> bool:
        """Whether parent/name is what the daemon made of it (and the kernel was told)."""
        made = self._made_here.get((wd, name))
        if made is None or made[0] < time.monotonic():
            return False
        try:
            st = self.store.stat_child(parent, name)
        except (OSError, SandboxError):
            return False
        return _ident(st) == made[1]

    # ----- events -------------------------------------------------------------------------------

    def changes(self) -> HostChanges:
        """Read the events queued so far: what the kernel must forget."""
        out = HostChanges()
        # Each name once per batch, with every kind of change it had (a file written through
        # the mount brings a create, writes and a close).
        pending: dict[tuple[int, bytes], int] = {}
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            pos = 0
            while pos < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0")
                pos += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    out.everything = True
                elif mask & IN_IGNORED:  # the directory is gone, or its watch was removed
                    for node in self._nodes.pop(wd, ()):
                        node.watch = UNWATCHED
                else:
                    pending[(wd, name)] = pending.get((wd, name), 0) | mask
        for (wd, name), mask in pending.items():
            for parent in self._nodes.get(wd, ()):
                self._changed(out, wd, parent, name, mask)
        now = time.monotonic()
        if now >= self._next_prune and self._made_here:  # at most once per period: O(n) each
            self._next_prune = now + _MADE_HERE_FOR
            self._made_here = {k: v for k, v in self._made_here.items() if v[0] >= now}
        return out

    def _changed(self, out: HostChanges, wd: int, parent: Node, name: bytes, mask: int) -> None:
        if not name:  # the watched directory itself
            out.inodes.add(parent.ino)
            out.nodes.append(parent)
            return
        if mask & _NAME_EVENTS:
            if self._as_made(wd, parent, name):
                return
            out.names.add((parent.ino, name))
            out.inodes.add(parent.ino)
            out.nodes.append(parent)
        with contextlib.suppress(OSError, SandboxError):
            st = self.store.stat_child(parent, name)
            if st is not None and parent.zone is not None:
                child = self.store.by_key.get((parent.zone, st.st_dev, st.st_ino))
                if child is not None and not self.told(child.ino, st):
                    out.inodes.add(child.ino)
                    out.nodes.append(child)


class MountTable:
    """The mount points below the zones' directories, from /proc/self/mountinfo. `fd` is an
    epoll descriptor that turns readable when the mount table changed (mountinfo itself always
    polls readable; a change is signalled as POLLPRI)."""

    def __init__(self, dirs: list[Path]) -> None:
        self._roots = tuple(os.fsencode(os.path.realpath(d)).rstrip(b"/") for d in dirs)
        self._file = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._file, select.EPOLLPRI)
        self.fd = self._epoll.fileno()
        self._points = self._below()

    def close(self) -> None:
        self._epoll.close()
        os.close(self._file)

    def changed(self) -> bool:
        """Whether a mount point below a zone's directory came or went since the last call."""
        self._epoll.poll(0)  # takes the change notice
        points = self._below()
        changed, self._points = points != self._points, points
        return changed

    def _below(self) -> frozenset[bytes]:
        os.lseek(self._file, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(self._file, 1 << 16):
            chunks.append(chunk)
        points = set()
        for line in b"".join(chunks).splitlines():
            fields = line.split(b" ", 5)
            if len(fields) < 5:
                continue
            point = _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])
            if any(point == root or point.startswith(root + b"/") for root in self._roots):
                points.add(point)
        return frozenset(points)


_OCTAL = re.compile(rb"\\([0-7]{3})")  # mountinfo's escapes of space, tab, newline, backslash


def _ident(st: StatLike | None) -> tuple[int, int] | None:
    """A backing entry's identity: inode number and birth time (0 where there is none)."""
    return None if st is None else (st.st_ino, getattr(st, "st_birthtime_ns", 0))
