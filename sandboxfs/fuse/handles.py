"""The adapter's handles: what an open file, directory or document keeps between requests.

The file and document handles live in `OperationsBase._handles`, the directory handles in
`_dirs`, both keyed by the number the kernel sends back with every request on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandboxfs.core.inodes import Node
from sandboxfs.core.store import Listed

__all__ = ["BlobHandle", "DirHandle", "FileHandle"]


@dataclass(slots=True)
class FileHandle:
    fd: int
    node: Node
    writable: bool
    created: bool
    pid: int
    uid: int
    gid: int
    comm: str | None
    bytes_written: int = 0
    # A write began inside a page: the kernel then holds pages only partly written through
    # this handle, which it never marks up to date and later reads back one page per request.
    partial_pages: bool = False
    # A write ended inside a page (a file's tail): one page the kernel will read back.
    ragged_end: bool = False
    # Writes must check the file's size first (max_file_bytes or a quota in its zone).
    sized: bool = False
    # The guard's generation when the handle was opened, or last checked again for reading
    # and for writing (each right is checked again on its own after a trust change).
    read_generation: int = 0
    write_generation: int = 0
    # The approval grant it was opened under (core.approvals): revoking it ends the handle.
    grant: int | None = None
    # Opened with O_APPEND on an existing file: judged a write, not an overwrite, so a cut
    # (ftruncate) or a write below the end through it is still asked about as one.
    appends: bool = False
    # Its file matches a private-key pattern: each read checks the file again for a key once
    # its (mtime_ns, size, ctime_ns) differ from `key_stamp`, those when it was last checked.
    key_named: bool = False
    key_stamp: tuple[int, int, int] = (0, 0, 0)


@dataclass(slots=True)
class DirHandle:
    node: Node
    entries: list[Listed] | None = None
    generation: int = 0
    caller: tuple[int, int, int] = (0, 0, 0)


@dataclass(slots=True)
class BlobHandle:
    data: bytes
