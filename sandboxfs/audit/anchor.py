"""The audit log's anchor: a secret key and the chain's head, kept in the user's own state
directory outside every project, so a program that sees only the project cannot rebuild the
chain or cut its end unnoticed (see sandboxfs.audit.common).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandboxfs.core.syscalls import write_all
from sandboxfs.layout import anchors_dir


class Key:
    """The anchor's secret key, ready to MAC entry hashes (the HMAC state is set up once)."""

    def __init__(self, key: bytes) -> None:
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def mac(self, digest: str) -> str:
        keyed = self._base.copy()
        keyed.update(digest.encode("ascii"))
        return keyed.hexdigest()

    def valid(self, digest: str, mac: object) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.mac(digest), mac)


def make_private_dirs(directory: Path) -> None:
    """Like `mkdir -p`, but every directory it creates is 0o700, not just the last."""
    if directory.is_dir():
        return
    make_private_dirs(directory.parent)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)


_ANCHOR_RE = re.compile(
    rb"sandboxfs audit anchor 1\n"
    rb"key ([0-9a-f]{64})\n"
    rb"keyed-from ([0-9]{20})\n"
    rb"head ([0-9]{20}) ([0-9a-f]{64})\n"
)
# The head line has a fixed offset and width, so a flush rewrites it with one pwrite.
_HEAD_OFFSET = len(b"sandboxfs audit anchor 1\nkey \nkeyed-from \n") + 64 + 20
_HEAD_RE = re.compile(rb"head ([0-9]{20}) ([0-9a-f]{64})\n")
_HEAD_SIZE = len(b"head  \n") + 20 + 64


def anchor_path(log_path: Path) -> Path:
    """Where the anchor of the log at `log_path` is kept: named by the SHA-256 of the log's
    resolved absolute path, so every mount of a project finds the same one."""
    name = hashlib.sha256(os.fsencode(log_path.resolve())).hexdigest()
    return anchors_dir() / name


def locate_anchor(log_path: Path) -> tuple[Path | None, str]:
    """`anchor_path`, or None and why there is none (no home directory to find it in)."""
    try:
        return anchor_path(log_path), ""
    except (RuntimeError, KeyError, OSError) as exc:
        return None, f"no state directory for anchors: {exc}"


def _head_line(head_id: int, head_hash: str) -> bytes:
    return b"head %020d %s\n" % (head_id, head_hash.encode("ascii"))


@dataclass(frozen=True, slots=True)
class Anchor:
    """What a log's anchor holds.

    `key` MACs entry hashes; `keyed_from` is the first id sealed with it (entries before it were
    written before the anchor existed); `head_id` and `head_hash` are the last entry written
    (for a log pruned to its header: the header's id and anchor).
    """

    key: bytes
    keyed_from: int
    head_id: int
    head_hash: str

    @classmethod
    def parse(cls, data: bytes) -> Anchor:
        found = _ANCHOR_RE.match(data)
        if found is None:
            raise ValueError("malformed anchor")
        key, keyed_from, head_id, head_hash = found.groups()
        return cls(bytes.fromhex(key.decode()), int(keyed_from), int(head_id), head_hash.decode())

    def record(self, log_path: Path) -> bytes:
        """The anchor file's content; the log's path at the end is only for people to read."""
        return (
            b"sandboxfs audit anchor 1\n"
            + b"key %s\n" % self.key.hex().encode("ascii")
            + b"keyed-from %020d\n" % self.keyed_from
            + _head_line(self.head_id, self.head_hash)
            + b"log %s\n" % json.dumps(str(log_path)).encode("ascii")
        )


def read_anchor(path: Path | None, why_none: str) -> tuple[Anchor | None, str]:
    """The anchor at `path`, or None and why not, in words fit for verify's message."""
    if path is None:
        return None, why_none
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"no anchor at {path}"
    except OSError as exc:
        return None, f"cannot read the anchor {path}: {exc.strerror}"
    try:
        return Anchor.parse(data), ""
    except ValueError:
        return None, f"the anchor {path} is malformed"


def fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _create_anchor(path: Path, log_path: Path, last_id: int, last_hash: str) -> None:
    """Make a new anchor with a new key, keyed from the id after `last_id`, appearing whole
    (written aside, then linked in; a concurrent creator's anchor wins)."""
    make_private_dirs(path.parent)
    anchor = Anchor(secrets.token_bytes(32), last_id + 1, last_id, last_hash)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".new-", suffix=".tmp")  # mode 0600
    try:
        try:
            write_all(fd, anchor.record(log_path))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)


class AnchorFile:
    """A writer's open anchor: the key kept in memory, the head rewritten in place."""

    def __init__(self, path: Path, fd: int, anchor: Anchor) -> None:
        self.path = path
        self.fd = fd
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)
        self.key = Key(anchor.key)
        self.keyed_from = anchor.keyed_from

    @classmethod
    def open(cls, path: Path, log_path: Path, tail: Callable[[], tuple[int, str]]) -> AnchorFile:
        """Open the anchor, creating it first (from the log's `tail()`: last id and hash) if
        there is none. Only under the log's lock: that keeps two writers from making two keys."""
        for _ in range(2):
            try:
                anchor_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                _create_anchor(path, log_path, *tail())
                continue
            try:
                return cls(path, anchor_fd, Anchor.parse(os.pread(anchor_fd, 4096, 0)))
            except BaseException:
                os.close(anchor_fd)
                raise
        raise FileNotFoundError(errno.ENOENT, "the anchor vanished as it was made", str(path))

    def is_current(self) -> bool:
        """False once the anchor's path names another file (or none): it was replaced."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def head(self) -> tuple[int, str]:
        found = _HEAD_RE.fullmatch(os.pread(self.fd, _HEAD_SIZE, _HEAD_OFFSET))
        if found is None:
            raise ValueError(f"malformed anchor {self.path}")
        return int(found[1]), found[2].decode()

    def set_head(self, head_id: int, head_hash: str) -> None:
        os.pwrite(self.fd, _head_line(head_id, head_hash), _HEAD_OFFSET)

    def close(self) -> None:
        os.close(self.fd)
