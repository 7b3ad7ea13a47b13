"""Unix sockets on a live mount: they can be bound (MKNOD S_IFSOCK) where the trust level lets
the caller create files, and serve clients; device nodes stay refused.

Servers are bound in this process; clients are separate python processes, as a real client
would be.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh
from tests.support.mounts import Mount

# A client process: connect to argv[1], send a line, print what comes back.
_CLIENT = """
import socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.settimeout(10)
    s.connect(sys.argv[1])
    s.sendall(b"ping\\n")
    print(s.recv(64).decode().strip())
"""


def session_dir(m: Mount) -> Path:
    return m.project / ".sandbox" / "workspaces" / m.workspace / "sessions" / m.session


def bind_errno(path: Path) -> int | None:
    """Bind an AF_UNIX socket at path: None if it worked, else the errno."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.bind(str(path))
        except OSError as exc:
            return exc.errno
    return None


def test_socket_in_session_serves_a_client(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        path = m.mnt / "session" / "working" / "s"
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            server.listen(1)
            server.settimeout(10)
            client = subprocess.Popen(
                [sys.executable, "-c", _CLIENT, str(path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(10)
                    assert conn.recv(64) == b"ping\n"
                    conn.sendall(b"pong\n")
                out, err = client.communicate(timeout=10)
            finally:
                if client.poll() is None:
                    client.kill()
                    client.wait()
            assert client.returncode == 0, err
            assert out.strip() == "pong"

            listing = sh(f"ls -l {path}")
            assert listing.returncode == 0, listing.stderr
            assert listing.stdout.startswith("s"), listing.stdout
            assert stat.S_ISSOCK(os.lstat(path).st_mode)
            stored = session_dir(m) / "working" / "s"
            assert stat.S_ISSOCK(os.lstat(stored).st_mode)

        removed = sh(f"rm {path}")
        assert removed.returncode == 0, removed.stderr
        assert not os.path.lexists(path)
        assert not os.path.lexists(stored)


def test_socket_in_repo_at_workspace_is_read_only(mount_at: Callable[..., Any]) -> None:
    with mount_at("workspace") as m:
        assert bind_errno(m.mnt / "repo" / "s") == errno.EROFS
        assert not os.path.lexists(m.project / "s")
        entry = m.wait_audit(lambda e: e["path"] == "/repo/s" and e["op"] == "write")
        assert entry["allowed"] is False
        assert entry["zone"] == "repo"
        assert entry["errno"] == "EROFS"
        assert entry["reason"], entry


def test_socket_in_staged_at_untrusted(mount_at: Callable[..., Any]) -> None:
    with mount_at("untrusted") as m:
        assert bind_errno(m.mnt / "staged" / "s") is None
        stored = m.project / ".sandbox" / "workspaces" / m.workspace / "staged" / "s"
        assert stat.S_ISSOCK(os.lstat(stored).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="without CAP_MKNOD the kernel refuses first")
def test_device_node_is_still_refused(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        path = m.mnt / "session" / "working" / "null"
        with pytest.raises(PermissionError) as caught:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        assert caught.value.errno == errno.EPERM
        assert not os.path.lexists(session_dir(m) / "working" / "null")
        entry = m.wait_audit(lambda e: e["path"] == "/session/working/null" and e["op"] == "write")
        assert entry["allowed"] is False
        assert entry["errno"] == "EPERM"
        assert "device nodes" in entry["reason"], entry
