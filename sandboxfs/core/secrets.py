"""Private keys found by their contents: the deny list's `deny_private_keys:` patterns.

A file whose name matches one of those patterns (`*.pem`, `*.key`, `id_rsa*`, ...) is refused
like a deny-listed one only when what it holds is a private key, so that certificates, CA
bundles (certifi's `cacert.pem`, which every virtualenv carries), public keys and other files
that merely share the suffix stay readable. The guard asks at every open, change, rename, link
and deletion of such a file; the answer is decided from its first SCAN_BYTES and remembered per
version of the file (device, inode, mtime, ctime, size), so each version is read once.

What is found (`private_key_in`):

- a PEM or RFC 4716 block whose label ends in PRIVATE KEY: `-----BEGIN PRIVATE KEY-----`,
  `RSA`, `EC`, `DSA`, `ENCRYPTED`, `OPENSSH`, `PGP PRIVATE KEY BLOCK`, `---- BEGIN SSH2
  ENCRYPTED PRIVATE KEY ----`, anywhere in the scanned bytes (a certificate chain with its key
  after the certificates is found too);
- a PuTTY key file (`PuTTY-User-Key-File-2:` / `-3:`);
- DER: a private key (PKCS#1, PKCS#8, SEC1, DSA: a SEQUENCE that starts with the version
  INTEGER 0 or 1), an encrypted PKCS#8 key (a SEQUENCE that starts with a PKCS#5 or PKCS#12
  encryption algorithm), and PKCS#12 bundles (`.p12`/`.pfx`: version INTEGER 3; their keys are
  encrypted, often with an empty password, and cannot be told apart from certificate-only ones
  without decrypting them, so every PKCS#12 file is refused);
- Java keystores (JKS and JCEKS magic numbers).

Not found: a key placed after the first SCAN_BYTES of a file, a key in a format not listed here
(raw base64 without a PEM header, a binary OpenPGP secret key), and any key in a file whose name
matches no pattern (add its name to `deny:`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections import OrderedDict
from typing import Protocol

from .credentials import credential_in
from .errors import SandboxError
from .inodes import Node, StatLike
from .store import HiddenEntry, Store
from .syscalls import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    openat2,
)

# How much of a file is scanned: more than any certificate bundle in use (certifi's is about
# 300 KiB), read once per version of the file.
SCAN_BYTES = 1 << 20

_PEM_KEY = re.compile(rb"-{4,5} ?BEGIN ([A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?)", re.IGNORECASE)
_PUTTY = re.compile(rb"PuTTY-User-Key-File-\d+:")
# DER bytes of the encryption algorithms' OID arcs: PKCS#5 (1.2.840.113549.1.5, PBES2 and
# PBES1) and PKCS#12 PBE (1.2.840.113549.1.12.1).
_PBE_OIDS = (b"\x2a\x86\x48\x86\xf7\x0d\x01\x05", b"\x2a\x86\x48\x86\xf7\x0d\x01\x0c\x01")
_KEYSTORE_MAGIC = (b"\xfe\xed\xfe\xed", b"\xce\xce\xce\xce")


def private_key_in(data: bytes) -> str | None:
    """What private key `data` (a file's first bytes) holds, in words, or None."""
    found = _PEM_KEY.search(data)
    if found is not None:
        label = found.group(1).decode("ascii").upper()
        return f"a private key (a PEM {label} block)"
    if _PUTTY.search(data) is not None:
        return "a private key (a PuTTY key file)"
    if data[:4] in _KEYSTORE_MAGIC:
        return "a Java keystore (which holds private keys)"
    return _der_key(data)


def secret_in(data: bytes) -> str | None:
    """The private key or credential `data` holds, in words, or None."""
    return private_key_in(data) or credential_in(data)


def _after_length(data: bytes, at: int) -> int:
    """Where the contents of a DER (or BER) element start, given where its length starts;
    -1 if the length cannot be read."""
    if at >= len(data):
        return -1
    first = data[at]
    if first <= 0x80:  # the short form, or 0x80: BER's indefinite length
        return at + 1
    count = first & 0x7F
    end = at + 1 + count
    return end if count <= 4 and end <= len(data) else -1


def _der_key(data: bytes) -> str | None:
    if len(data) < 5 or data[0] != 0x30:  # a SEQUENCE
        return None
    at = _after_length(data, 1)
    if at < 0 or at + 3 > len(data):
        return None
    if data[at] == 0x02 and data[at + 1] == 1:  # a one-byte INTEGER: a version
        version = data[at + 2]
        if version in (0, 1):
            return "a private key (DER)"
        if version == 3:
            return "a PKCS#12 bundle (which holds private keys)"
        return None
    if data[at] == 0x30:  # an AlgorithmIdentifier first: EncryptedPrivateKeyInfo?
        oid = _after_length(data, at + 1)
        if 0 <= oid < len(data) - 2 and data[oid] == 0x06:
            value = data[oid + 2 : oid + 2 + data[oid + 1]]
            if value.startswith(_PBE_OIDS):
                return "an encrypted private key (DER)"
    return None


class Contents(Protocol):
    """How the scanner reads a file where a front end keeps it: parent/name (in workers layer
    `layer`), never following a symbolic link."""

    def stat(self, parent: Node, name: bytes, layer: int) -> StatLike | None:
        """lstat of parent/name, or None when it is absent."""
        ...

    def head(self, parent: Node, name: bytes, layer: int, limit: int) -> tuple[StatLike, bytes]:
        """The regular file's stat and first `limit` bytes (SandboxError ESTALE when it is no
        regular file any more)."""
        ...


_Stamp = tuple[int, int, int, int, int]


def _stamp(st: StatLike) -> _Stamp:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


class KeyScanner:
    """Whether files hold private keys, remembered per version of each file."""

    def __init__(self, contents: Contents, capacity: int = 4096) -> None:
        self.contents = contents
        self._capacity = capacity
        self._known: OrderedDict[_Stamp, str | None] = OrderedDict()

    def holds_key(
        self, parent: Node, name: bytes, layer: int, st: StatLike | None = None
    ) -> str | None:
        """What private key the regular file at parent/name holds (in words), or None: also
        for anything that is no regular file or is absent. `st`: its lstat, if known."""
        if st is None:
            st = self.contents.stat(parent, name, layer)
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        stamp = _stamp(st)
        if stamp in self._known:
            self._known.move_to_end(stamp)
            return self._known[stamp]
        read, data = self.contents.head(parent, name, layer, SCAN_BYTES)
        return self._remember(read, secret_in(data))

    def holds_key_open(self, fd: int) -> str | None:
        """What private key the file open at `fd` holds now (in words), or None: for a handle
        opened before the key was written into its file."""
        st = os.fstat(fd)
        stamp = _stamp(st)
        if stamp in self._known:
            self._known.move_to_end(stamp)
            return self._known[stamp]
        return self._remember(st, secret_in(os.pread(fd, SCAN_BYTES, 0)))

    def _remember(self, st: StatLike, found: str | None) -> str | None:
        self._known[_stamp(st)] = found
        if len(self._known) > self._capacity:
            self._known.popitem(last=False)
        return found


_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ESTALE})
_RESOLVE = RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StoreContents:
    """Contents read from the backing directories of a Store (the mount, the API on disk)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def stat(self, parent: Node, name: bytes, layer: int) -> StatLike | None:
        try:
            return self.store.stat_child(parent, name, layer)
        except (HiddenEntry, FileNotFoundError, NotADirectoryError):
            return None
        except SandboxError as exc:  # the directory is gone (or not made yet): nothing there
            if exc.errno in _GONE:
                return None
            raise

    def head(self, parent: Node, name: bytes, layer: int, limit: int) -> tuple[StatLike, bytes]:
        dir_fd = self.store.child_dir_fd(parent, layer, checked=True)
        # Never open anything but a regular file (opening a device can act on it); the fstat
        # below catches a swap after this check.
        found = self.store.lstat(dir_fd, name)
        if found is None or not stat.S_ISREG(found.st_mode):
            raise _stale()
        opening = self.store.allocating
        try:  # leave the user's atime alone where the daemon may (owner or CAP_FOWNER)
            fd = opening(openat2, dir_fd, name, _READ | os.O_NOATIME, 0, _RESOLVE)
        except PermissionError:
            fd = opening(openat2, dir_fd, name, _READ, 0, _RESOLVE)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _stale()
            chunks: list[bytes] = []
            size = 0
            while size < limit:
                chunk = os.pread(fd, limit - size, size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return st, b"".join(chunks)
        finally:
            os.close(fd)


def _stale() -> OSError:
    return OSError(errno.ESTALE, "the file moved or was replaced")
