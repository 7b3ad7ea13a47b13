"""Judging a new git index or packed-refs before it replaces `.git/index` or
`.git/packed-refs` (Guard._judge_index): git keeps flags in the index that make the user's own
`git status` and `git diff` skip a tracked file (assume-unchanged, skip-worktree) and caches
that make them skip untracked ones, and a replace ref (refs/replace/) in packed-refs swaps an
object for another in all they show. A new one may keep what the old one had, never add any
(judge, judge_packed_refs)."""

from __future__ import annotations

import contextlib
import struct

MAX_INDEX_BYTES = 64 << 20
INDEX_NAMES = frozenset({"index", "packed-refs"})

_ASSUME_VALID = 0x8000  # flags: `git update-index --assume-unchanged`
_EXTENDED = 0x4000  # flags: extended flags follow (version 3 and later)
_SKIP_WORKTREE = 0x4000  # extended flags: `git update-index --skip-worktree`
_NAME_MASK = 0x0FFF
# Extensions the user's git trusts to skip looking at files: the untracked cache, the
# fsmonitor's answer, and a split index (its entries live in a file judged nowhere).
_HIDING_EXTENSIONS = {b"UNTR": "an untracked cache", b"FSMN": "an fsmonitor cache"}
_SPLIT = b"link"


class UnreadableIndex(Exception):
    """The content is not an index this module can read."""


Flags = dict[tuple[bytes, int], tuple[bool, bool]]  # (path, stage) -> (assume, skip)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """git's offset varint (read-cache.c decode_varint)."""
    if at >= len(data):
        raise UnreadableIndex("truncated")
    byte = data[at]
    at += 1
    value = byte & 0x7F
    while byte & 0x80:
        if at >= len(data):
            raise UnreadableIndex("truncated")
        byte = data[at]
        at += 1
        value = ((value + 1) << 7) | (byte & 0x7F)
    return value, at


def _parse(data: bytes, hash_size: int) -> tuple[Flags, set[bytes]]:
    if len(data) < 12 + hash_size or data[:4] != b"DIRC":
        raise UnreadableIndex("no index header")
    version, count = struct.unpack(">II", data[4:12])
    if version not in (2, 3, 4):
        raise UnreadableIndex(f"index version {version}")
    end = len(data) - hash_size
    fixed = 40 + hash_size + 2
    at = 12
    flags: Flags = {}
    name = b""
    for _ in range(count):
        start = at
        if at + fixed > end:
            raise UnreadableIndex("truncated")
        (bits,) = struct.unpack(">H", data[at + fixed - 2 : at + fixed])
        at += fixed
        extended = 0
        if bits & _EXTENDED:
            if version < 3 or at + 2 > end:
                raise UnreadableIndex("extended flags")
            (extended,) = struct.unpack(">H", data[at : at + 2])
            at += 2
        if version == 4:
            strip, at = _varint(data, at)
            stop = data.find(b"\0", at, end)
            if stop < 0 or strip > len(name):
                raise UnreadableIndex("entry name")
            name = name[: len(name) - strip] + data[at:stop]
            at = stop + 1
        else:
            stop = data.find(b"\0", at, end)
            if stop < 0:
                raise UnreadableIndex("entry name")
            name = data[at:stop]
            at = start + ((at - start + len(name) + 8) & ~7)
        stage = (bits >> 12) & 3
        flags[(name, stage)] = (bool(bits & _ASSUME_VALID), bool(extended & _SKIP_WORKTREE))
    extensions: set[bytes] = set()
    while at < end:
        if at + 8 > end:
            raise UnreadableIndex("extension header")
        signature = data[at : at + 4]
        (size,) = struct.unpack(">I", data[at + 4 : at + 8])
        at += 8 + size
        extensions.add(signature)
    if at != end:
        raise UnreadableIndex("extensions")
    return flags, extensions


def parse(data: bytes) -> tuple[Flags, set[bytes]]:
    """The flags of every entry and the extensions' signatures; SHA-1 or SHA-256 (the one
    whose layout ends exactly at the trailing checksum). Raises UnreadableIndex."""
    for hash_size in (20, 32):
        try:
            return _parse(data, hash_size)
        except (UnreadableIndex, struct.error):
            continue
    raise UnreadableIndex("cannot be read as a git index (version 2 to 4)")


def judge(old: bytes | None, new: bytes) -> str | None:
    """Why `new` may not replace the index `old` (None: absent or unreadable, so nothing it
    had is kept): the problem, or None when it sets no flag and adds no cache the user's git
    would skip files by."""
    if len(new) > MAX_INDEX_BYTES:
        return f"the new index is larger than {MAX_INDEX_BYTES} bytes"
    try:
        flags, extensions = parse(new)
    except UnreadableIndex as exc:
        return f"the new content {exc}"
    before: Flags = {}
    had: set[bytes] = set()
    if old is not None:
        with contextlib.suppress(UnreadableIndex):
            before, had = parse(old)
    if _SPLIT in extensions:
        return "a split index (its entries are in a shared file sandboxfs does not judge)"
    for signature, what in _HIDING_EXTENSIONS.items():
        if signature in extensions and signature not in had:
            return f"it adds {what}, which would let git status skip files"
    for key, (assume, skip) in flags.items():
        was_assume, was_skip = before.get(key, (False, False))
        shown = key[0].decode("utf-8", "backslashreplace")
        if assume and not was_assume:
            return f"it marks {shown!r} assume-unchanged, which hides its changes from git"
        if skip and not was_skip:
            return f"it marks {shown!r} skip-worktree, which hides its changes from git"
    return None


def judge_packed_refs(old: bytes | None, new: bytes) -> str | None:
    """Why `new` may not replace packed-refs `old`: a replace ref it adds or re-points."""
    kept = set((old or b"").splitlines())
    for line in new.splitlines():
        parts = line.split(b" ", 1)
        if len(parts) == 2 and parts[1].startswith(b"refs/replace/") and line not in kept:
            shown = parts[1].decode("utf-8", "backslashreplace")
            return f"it adds the replace ref {shown!r}, which swaps what git shows"
    return None
