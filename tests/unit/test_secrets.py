"""Private keys found by their contents (sandboxfs/core/secrets.py): what is found, what is
not, and that each version of a file is read once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandboxfs.core.inodes import ZONE_INO, Node, StatLike
from sandboxfs.core.policy import Zone
from sandboxfs.core.secrets import SCAN_BYTES, KeyScanner, StoreContents, private_key_in
from sandboxfs.core.store import Store

# Markers are assembled at run time, so that no scanner of this repository mistakes the test
# for a leaked key.
BEGIN, END = "-----BEGIN ", "-----END "
PEM_LABELS = [
    "PRIVATE KEY",
    "RSA PRIVATE KEY",
    "EC PRIVATE KEY",
    "DSA PRIVATE KEY",
    "ENCRYPTED PRIVATE KEY",
    "OPENSSH PRIVATE KEY",
    "PGP PRIVATE KEY BLOCK",
]


def pem(label: str, body: str = "MIIBVQIBADANBgkqhkiG9w0BAQEFAASCAT8wggE7AgEAAkEA") -> bytes:
    return f"{BEGIN}{label}-----\n{body}\n{END}{label}-----\n".encode()


CERT = pem("CERTIFICATE")


@pytest.mark.parametrize("label", PEM_LABELS)
def test_pem_private_key_blocks_are_found(label: str) -> None:
    found = private_key_in(pem(label))
    assert found == f"a private key (a PEM {label} block)"
    # After certificates too (a chain with its key), and in any case, with CRLF line ends.
    assert private_key_in(CERT * 20 + pem(label).replace(b"\n", b"\r\n")) is not None
    assert private_key_in(pem(label).lower()) is not None


def test_other_private_key_formats_are_found() -> None:
    ssh2 = b"---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----\nComment: x\nP2/56wAAA\n"
    assert private_key_in(ssh2) == "a private key (a PEM SSH2 ENCRYPTED PRIVATE KEY block)"
    putty = b"PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\n"
    assert private_key_in(putty) == "a private key (a PuTTY key file)"
    assert private_key_in(b"\xfe\xed\xfe\xed\x00\x00\x00\x02") is not None  # JKS
    assert private_key_in(b"\xce\xce\xce\xce\x00\x00\x00\x02") is not None  # JCEKS
    # DER: PKCS#1/PKCS#8 (version 0), SEC1 (version 1), PKCS#12 (version 3), encrypted PKCS#8.
    assert private_key_in(b"\x30\x82\x04\xa4\x02\x01\x00\x02\x82\x01\x01") == "a private key (DER)"
    assert private_key_in(b"\x30\x77\x02\x01\x01\x04\x20" + bytes(32)) == "a private key (DER)"
    assert "PKCS#12" in (private_key_in(b"\x30\x80\x02\x01\x03\x30\x80") or "")
    pbes2 = b"\x06\x09\x2a\x86\x48\x86\xf7\x0d\x01\x05\x0d"
    encrypted = b"\x30\x82\x01\x00\x30\x4b" + pbes2 + bytes(8)
    assert private_key_in(encrypted) == "an encrypted private key (DER)"


@pytest.mark.parametrize(
    "data",
    [
        CERT,
        CERT * 3,
        pem("PUBLIC KEY"),
        pem("RSA PUBLIC KEY"),
        pem("CERTIFICATE REQUEST"),
        pem("X509 CRL"),
        b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIP user@host\n",
        b"",
        b"0",
        b"just text mentioning a private key\n",
        b"PK\x03\x04 a Keynote .key file is a zip\x00\x00",
        # DER certificate: SEQUENCE { SEQUENCE { [0] version ... } }
        b"\x30\x82\x03\x00\x30\x82\x02\xe8\xa0\x03\x02\x01\x02",
        # DER SubjectPublicKeyInfo: SEQUENCE { SEQUENCE { OID ecPublicKey } }
        b"\x30\x59\x30\x13\x06\x07\x2a\x86\x48\xce\x3d\x02\x01",
        # DER RSA public key: SEQUENCE { INTEGER n (long), INTEGER e }
        b"\x30\x82\x01\x0a\x02\x82\x01\x01\x00\xc0",
    ],
)
def test_what_is_not_a_private_key(data: bytes) -> None:
    assert private_key_in(data) is None


def test_ca_bundles_in_this_python_are_not_keys() -> None:
    """certifi's cacert.pem (pip's vendored copy; every virtualenv gets one) is readable."""
    bundles = list(Path(sys.prefix).rglob("cacert.pem")) + list(
        Path(sys.base_prefix).rglob("pip/_vendor/certifi/cacert.pem")
    )
    if not bundles:
        pytest.skip("no cacert.pem in this Python")
    for bundle in bundles[:3]:
        assert private_key_in(bundle.read_bytes()[:SCAN_BYTES]) is None, bundle


OPENSSL = shutil.which("openssl")


@pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed")
def test_keys_openssl_writes_are_found(tmp_path: Path) -> None:
    assert OPENSSL is not None

    def ssl(*args: str) -> None:
        subprocess.run([OPENSSL, *args], cwd=tmp_path, check=True, capture_output=True)

    ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "k.pem")
    ssl("pkey", "-in", "k.pem", "-outform", "DER", "-out", "k.der")
    ssl("ec", "-in", "k.pem", "-outform", "DER", "-out", "sec1.der")
    ssl("pkcs8", "-topk8", "-in", "k.pem", "-outform", "DER", "-passout", "pass:x", "-out", "e.der")
    ssl("req", "-x509", "-key", "k.pem", "-subj", "/CN=t", "-days", "1", "-out", "c.pem")
    ssl("x509", "-in", "c.pem", "-outform", "DER", "-out", "c.der")
    ssl("pkey", "-in", "k.pem", "-pubout", "-outform", "DER", "-out", "pub.der")
    ssl(
        "pkcs12", "-export", "-in", "c.pem", "-inkey", "k.pem", "-passout", "pass:", "-out", "b.p12"
    )
    for key in ("k.pem", "k.der", "sec1.der", "e.der", "b.p12"):
        assert private_key_in((tmp_path / key).read_bytes()) is not None, key
    for public in ("c.pem", "c.der", "pub.der"):
        assert private_key_in((tmp_path / public).read_bytes()) is None, public


@dataclass
class _Stat:
    st_mode: int
    st_ino: int
    st_size: int
    st_mtime_ns: int
    st_ctime_ns: int
    st_dev: int = 1
    st_nlink: int = 1
    st_uid: int = 0
    st_gid: int = 0
    st_rdev: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0
    st_atime_ns: int = 0


class CountingContents:
    """Files in a dict; counts the reads."""

    def __init__(self) -> None:
        self.files: dict[bytes, tuple[_Stat, bytes]] = {}
        self.reads = 0

    def put(self, name: bytes, data: bytes, version: int) -> None:
        self.files[name] = (_Stat(0o100644, 7, len(data), version, version), data)

    def stat(self, parent: Node, name: bytes, layer: int) -> StatLike | None:
        found = self.files.get(name)
        return found[0] if found is not None else None

    def head(self, parent: Node, name: bytes, layer: int, limit: int) -> tuple[StatLike, bytes]:
        self.reads += 1
        st, data = self.files[name]
        return st, data[:limit]


def test_each_version_of_a_file_is_read_once() -> None:
    contents = CountingContents()
    scanner = KeyScanner(contents, capacity=2)
    parent = Node(ZONE_INO[Zone.REPO], Zone.REPO, None, b"repo", True)
    contents.put(b"a.pem", CERT, 1)
    for _ in range(3):
        assert scanner.holds_key(parent, b"a.pem", 0) is None
    assert contents.reads == 1
    contents.put(b"a.pem", pem("PRIVATE KEY"), 2)  # rewritten: a new version
    assert scanner.holds_key(parent, b"a.pem", 0) is not None
    assert scanner.holds_key(parent, b"a.pem", 0) is not None
    assert contents.reads == 2
    assert scanner.holds_key(parent, b"missing.pem", 0) is None
    contents.files[b"dir.pem"] = (_Stat(0o040755, 8, 0, 1, 1), b"")
    assert scanner.holds_key(parent, b"dir.pem", 0) is None  # not a regular file: not read
    assert contents.reads == 2


def test_store_contents_reads_the_backing_file(tmp_path: Path) -> None:
    zones = {z: tmp_path / z.value for z in (Zone.SESSION, Zone.WORKSPACE, Zone.REPO, Zone.STAGED)}
    for path in zones.values():
        path.mkdir()
    (zones[Zone.REPO] / "k.key").write_bytes(pem("RSA PRIVATE KEY"))
    (zones[Zone.REPO] / "c.pem").write_bytes(CERT)
    os.symlink("k.key", zones[Zone.REPO] / "link.key")
    store = Store(zones, [], set())
    try:
        scanner = KeyScanner(StoreContents(store))
        repo = store.zone_roots[Zone.REPO]
        assert scanner.holds_key(repo, b"k.key", 0) == "a private key (a PEM RSA PRIVATE KEY block)"
        assert scanner.holds_key(repo, b"c.pem", 0) is None
        assert scanner.holds_key(repo, b"link.key", 0) is None  # a symlink is never followed
        assert scanner.holds_key(repo, b"absent.key", 0) is None
    finally:
        store.close()
