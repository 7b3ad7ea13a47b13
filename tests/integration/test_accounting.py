"""Writes through the mount are charged to the caller, not to a root daemon: an ordinary user
cannot fill the blocks ext4 reserves for root (nor pass disk quotas) by writing through it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.mounts import mounted

UID = 4242

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
    reason="needs root to make an ext4 image with reserved blocks",
)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory uid 4242 can traverse (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="sandboxfs-accounting-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_ext4(base: Path) -> Iterator[Path]:
    """A 32 MiB ext4 with 10% reserved for root, mounted at base/fs."""
    image, fs = base / "fs.img", base / "fs"
    fs.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-m", "10", str(image)], check=True, timeout=60)
    subprocess.run(["mount", "-o", "loop", str(image), str(fs)], check=True, timeout=60)
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False, timeout=60)


def test_an_ordinary_caller_cannot_use_roots_reserve(small_ext4: Path, base: Path) -> None:
    project = small_ext4 / "project"
    (project / "out").mkdir(parents=True)
    os.chown(project / "out", UID, UID)
    st = os.statvfs(small_ext4)
    available = st.f_bavail * st.f_frsize  # what uid 4242 may use natively
    reserve = (st.f_bfree - st.f_bavail) * st.f_frsize
    assert reserve > 2 << 20
    with mounted(base / "mnt", project, "full", "--allow-other") as m:
        target = m.mnt / "repo" / "out" / "fill"
        result = subprocess.run(
            [
                "setpriv",
                f"--reuid={UID}",
                f"--regid={UID}",
                "--clear-groups",
                "dd",
                "if=/dev/zero",
                f"of={target}",
                "bs=64k",
                "status=none",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode != 0
        assert "No space left on device" in result.stderr, result.stderr
        written = os.stat(project / "out" / "fill").st_size
        assert os.stat(project / "out" / "fill").st_uid == UID
        # Natively uid 4242 gets at most `available`; before, the root daemon wrote on into
        # the reserve. A little slack for metadata blocks.
        assert written <= available, (written, available, reserve)
        left = os.statvfs(small_ext4)
        assert (left.f_bfree - left.f_bavail) * left.f_frsize >= reserve - (1 << 20)
        # The daemon cannot override the reserve or quotas: CAP_SYS_RESOURCE is not effective.
        status = Path(f"/proc/{m.daemon_pid()}/status").read_text()
        cap_eff = int(
            next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16
        )
        assert not cap_eff & (1 << 24), hex(cap_eff)
        # The reserve is still there for root, and so for the audit log.
        denied = subprocess.run(
            ["sh", "-c", f"cat {m.mnt}/repo/.env"], capture_output=True, text=True, timeout=30
        )
        assert denied.returncode != 0
