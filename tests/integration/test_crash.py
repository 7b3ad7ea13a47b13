"""kill -9 of the daemon in the middle of heavy writes: nothing fsync'd is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.cli import sandboxfs

WRITER = r"""
import hashlib, os, sys
target, manifest = sys.argv[1], sys.argv[2]
with open(manifest, "a", buffering=1) as log:
    n = 0
    while True:
        data = hashlib.sha256(str(n).encode()).digest() * 2048  # 64 KiB, content known by n
        path = os.path.join(target, f"heavy-{n}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(4):
            os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        log.write(f"{n}\n")  # only after fsync returned
        n += 1
"""


def expected(n: int) -> bytes:
    import hashlib

    return hashlib.sha256(str(n).encode()).digest() * 2048 * 4


def test_kill_9_during_heavy_writes(mount_at: Callable[..., Any], tmp_path: Path) -> None:
    manifest = tmp_path / "manifest"
    with mount_at("full") as m:
        target = m.mnt / "session" / "working"
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(target), str(manifest)],
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if manifest.exists() and len(manifest.read_text().split()) >= 20:
                    break
                time.sleep(0.05)
            os.kill(m.daemon_pid(), signal.SIGKILL)
            writer.wait(timeout=30)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        assert writer.returncode != 0  # it was cut off mid-stream, not finished
        done = [int(n) for n in manifest.read_text().split()]
        assert len(done) >= 20

        result = sandboxfs("umount", m.mnt)
        assert result.returncode == 0, result.stderr
        assert "daemon had died" in result.stdout

    with mount_at("full", "--session", m.session, mnt=m.mnt) as again:
        working = again.mnt / "session" / "working"
        for n in done:
            assert (working / f"heavy-{n}").read_bytes() == expected(n), n
    verify = sandboxfs("audit", "verify", "--project", m.project)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith("ok")
