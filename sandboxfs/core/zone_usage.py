"""What a zone's backing tree holds, counted for its quota (limits.Tally's recount)."""

from __future__ import annotations

import contextlib
import os
import stat

from .inodes import Identity, InodeTable
from .resolve import CONFINED_RESOLVE
from .syscalls import openat2


def tree_usage(table: InodeTable, root_fd: int, hidden: set[Identity]) -> tuple[int, int]:
    """(bytes of regular files, entries) below a zone's root, each inode once, never
    crossing into another mount or sandboxfs's own state (for quotas).

    Depth first, holding the descriptors of the directories on the current path only
    (not of every directory found: a wide tree would use up the descriptor table)."""
    seen: set[tuple[int, int]] = set()
    nbytes = 0
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    path: list[tuple[int, list[bytes]]] = []

    def enter(fd: int) -> None:
        nonlocal nbytes
        below: list[bytes] = []
        path.append((fd, below))
        with contextlib.suppress(OSError):
            dev = os.fstat(fd).st_dev
            with table.allocating(os.scandir, b"/proc/self/fd/%d" % fd) as entries:
                for entry in entries:
                    st = entry.stat(follow_symlinks=False)
                    key = (st.st_dev, st.st_ino)
                    if st.st_dev != dev or key in hidden or key in seen:
                        continue
                    seen.add(key)
                    if stat.S_ISREG(st.st_mode):
                        nbytes += st.st_size
                    elif stat.S_ISDIR(st.st_mode):
                        below.append(entry.name)

    try:
        enter(table.allocating(os.open, b".", flags, dir_fd=root_fd))
        while path:
            fd, below = path[-1]
            if not below:
                os.close(fd)
                path.pop()
                continue
            with contextlib.suppress(OSError):
                enter(table.allocating(openat2, fd, below.pop(), flags, 0, CONFINED_RESOLVE))
    finally:
        for fd, _ in path:
            os.close(fd)
    return nbytes, len(seen)
