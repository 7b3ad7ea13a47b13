"""The nest server on its own (sandboxfs.run.nest): what it refuses before starting anything."""

from __future__ import annotations

import array
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.config.model import Config
from sandboxfs.core.entry import AuditOp
from sandboxfs.core.policy import Trust
from sandboxfs.run import nest
from sandboxfs.run.toolchain import Toolchain
from tests.support.mounts import make_project


class Recorded:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def __call__(self, op: AuditOp, **fields: Any) -> None:
        self.entries.append({"op": op, **fields})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[nest.NestServer, Recorded, list[list[str]]]]:
    project = make_project(tmp_path)
    (project / ".workers" / "pure.worker").write_text("---\nname: pure\n---\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started: list[list[str]] = []

    def build(name: str, trust: Trust, argv: list[str], *_: Any) -> list[str]:
        started.append([name, trust.value, *argv])
        return ["/bin/true"]

    record = Recorded()
    srv = nest.NestServer(
        run_dir, project, Config(), Trust.FULL, build, record, nest.Nesting(), Toolchain()
    )
    try:
        yield srv, record, started
    finally:
        srv.close()


def ask(srv: nest.NestServer, request: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(srv.host_dir / nest.SOCKET_NAME))
        r, w = os.pipe()
        try:
            fds = array.array("i", [r, w, w])
            sock.sendmsg(
                [json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
            )
        finally:
            os.close(r)
            os.close(w)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    reply: dict[str, Any] = json.loads(data)
    return reply


def test_no_level_from_the_daemon_refuses_the_child(
    server: tuple[nest.NestServer, Recorded, list[list[str]]], tmp_path: Path
) -> None:
    """Not ready yet, or a daemon that does not answer: refused and audited, never started
    at the run's first level."""
    srv, record, started = server
    request = {"worker": "pure", "argv": ["true"]}
    for control in (None, tmp_path / "gone.sock"):
        srv.control = control
        reply = ask(srv, request)
        assert reply["status"] == 125, reply
        assert "no child worker" in reply["error"], reply
    assert started == []
    assert [e["allowed"] for e in record.entries] == [False, False]
    assert all(e["op"] == AuditOp.RUN and e["err"] == "EACCES" for e in record.entries)
