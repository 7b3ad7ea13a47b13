"""The mount and the Python API are two front ends of one gate (sandboxfs.core.gate): the same
table of operations, driven through a real mount and through `Sandbox.open` on two copies of
the same project, gets the same decisions (allowed, or the same errno) and the same audit
entries (op, zone, path, dest, allowed, errno, reason, detail) at every trust level.

Each row touches paths no other row touches, so its entries are told apart by path. Only the
paths of a zone the level can access are compared: in a zone it cannot, the mount answers at
the kernel's lookup (ENOENT) and the API refuses the path as the zone is refused, by design.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sandboxfs.api import Sandbox, SandboxAPIError
from sandboxfs.core.effects import FAIL_CLOSED
from sandboxfs.layout import audit_path
from tests.support.cli import sh
from tests.support.mounts import make_project, mounted, mounted_fs

Compared = tuple[Any, ...]
T = TypeVar("T")


@dataclass(frozen=True)
class Row:
    """One operation: `mount(root)` through the mount at root, `api(sb)` through the API; both
    take virtual paths. `paths`: whose audit entries belong to the row."""

    name: str
    mount: Callable[[Path], object]
    api: Callable[[Sandbox], object]
    paths: tuple[str, ...]


def at(root: Path, vpath: str) -> Path:
    return root / vpath.lstrip("/")


def write_file(root: Path, vpath: str, data: bytes) -> None:
    with open(at(root, vpath), "wb") as f:
        f.write(data)


def append_file(root: Path, vpath: str, data: bytes) -> None:
    with open(at(root, vpath), "ab") as f:
        f.write(data)


def remove(root: Path, vpath: str) -> None:
    path = at(root, vpath)
    (os.rmdir if path.is_dir() and not path.is_symlink() else os.unlink)(path)


def row_read(vpath: str) -> Row:
    return Row(
        f"read {vpath}",
        lambda r: at(r, vpath).read_bytes(),
        lambda s: s.read_bytes(vpath),
        (vpath,),
    )


def row_write(vpath: str, data: bytes = b"new\n") -> Row:
    return Row(
        f"write {vpath}",
        lambda r: write_file(r, vpath, data),
        lambda s: s.write(vpath, data),
        (vpath,),
    )


def row_append(vpath: str, data: bytes = b"more\n") -> Row:
    return Row(
        f"append {vpath}",
        lambda r: append_file(r, vpath, data),
        lambda s: s.append(vpath, data),
        (vpath,),
    )


def row_mkdir(vpath: str) -> Row:
    return Row(f"mkdir {vpath}", lambda r: at(r, vpath).mkdir(), lambda s: s.mkdir(vpath), (vpath,))


def row_delete(vpath: str) -> Row:
    return Row(f"delete {vpath}", lambda r: remove(r, vpath), lambda s: s.delete(vpath), (vpath,))


def row_rename(src: str, dst: str) -> Row:
    return Row(
        f"rename {src} {dst}",
        lambda r: os.rename(at(r, src), at(r, dst)),
        lambda s: s.rename(src, dst),
        (src, dst),
    )


def row_list(vpath: str) -> Row:
    return Row(
        f"list {vpath}", lambda r: os.listdir(at(r, vpath)), lambda s: s.list(vpath), (vpath,)
    )


def table(base: str) -> list[Row]:
    """The operations on the directory `base` of one zone: on its seeded files (see seed) and on
    new names."""
    rows = [
        row_read(f"{base}/a.txt"),
        row_write(f"{base}/b.txt"),
        row_append(f"{base}/c.txt"),
        row_write(f"{base}/new.txt"),
        row_write(f"{base}/key.pem"),  # a name of the default deny list (refused in /repo)
        row_mkdir(f"{base}/newdir"),
        row_delete(f"{base}/gone.txt"),
        row_rename(f"{base}/r.txt", f"{base}/r2.txt"),
        row_list(f"{base}/listed"),
    ]
    if base == "/repo":  # the rules beyond the matrix
        rows += [
            row_read("/repo/.env"),  # the deny list
            row_write("/repo/.env"),
            row_read("/repo/.ssh/id_rsa"),
            row_write("/repo/.git/config"),  # git's code-running surface
            row_write("/repo/.git/hooks/pre-commit"),
        ]
    return rows


def seed(directory: Path) -> None:
    """The files the table expects in a zone's directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("a.txt", "b.txt", "c.txt", "gone.txt", "r.txt"):
        (directory / name).write_text(f"{name}\n")
    (directory / "listed").mkdir()
    (directory / "listed" / "x.txt").write_text("x\n")


def make(root: Path) -> Path:
    """A project, with the zones that live in its state dir seeded through a mount at full
    (session s1: /session is per session)."""
    project = make_project(root)
    seed(project)
    seed(project / ".workers")
    (project / ".git" / "hooks").mkdir(parents=True)
    (project / ".git" / "config").write_text("[core]\n")
    (project / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    with mounted(root / "seed", project, "full", "--new-session", SESSION) as m:
        for base in ("session/working", "workspace/data", "staged"):
            seed(m.mnt / base)
    return project


def decision_of(call: Callable[[T], object], front_end: T) -> int | None:
    """None when call(front_end) is allowed, else the errno it was refused with."""
    try:
        call(front_end)
    except SandboxAPIError as exc:
        return exc.errno
    except OSError as exc:
        return exc.errno
    return None


def entries_of(log: Path, skip: int, paths: set[str]) -> dict[str, set[Compared]]:
    """Each path's entries in the project's log after its first `skip` lines, as compared (a
    set: the kernel may look a name up more than once, and identical refusals are counted)."""
    found: dict[str, set[Compared]] = {path: set() for path in paths}
    for line in log.read_text().splitlines()[skip:]:
        entry = json.loads(line)
        if entry.get("path") in paths:
            found[entry["path"]].add(
                (
                    entry["op"],
                    entry["zone"],
                    entry["path"],
                    entry.get("dest"),
                    entry["allowed"],
                    entry["errno"],
                    entry["reason"],
                    entry.get("detail"),
                    entry.get("bytes"),
                )
            )
    return found


SESSION = "s1"
# The zones each level may access (a closed zone's paths are answered differently: see above).
BASES = {
    "untrusted": ["/session/working", "/staged", "/workers"],
    "session": ["/session/working", "/workspace/data", "/staged", "/workers"],
    "workspace": ["/session/working", "/workspace/data", "/staged", "/workers", "/repo"],
    "full": ["/session/working", "/workspace/data", "/staged", "/workers", "/repo"],
}


@pytest.mark.parametrize("trust", list(BASES))
def test_mount_and_api_decide_and_audit_alike(tmp_path: Path, trust: str) -> None:
    rows = [row for base in BASES[trust] for row in table(base)]
    projects = {side: make(tmp_path / side) for side in ("mount", "api")}
    logs = {side: audit_path(project) for side, project in projects.items()}
    skip = {side: len(log.read_text().splitlines()) for side, log in logs.items()}
    decided: dict[str, dict[str, int | None]] = {"mount": {}, "api": {}}
    with mounted(tmp_path / "mnt", projects["mount"], trust, "--session", SESSION) as m:
        for row in rows:
            decided["mount"][row.name] = decision_of(row.mount, m.mnt)
    with Sandbox.open(projects["api"], trust=trust, session=SESSION) as sb:
        for row in rows:
            decided["api"][row.name] = decision_of(row.api, sb)
    assert decided["mount"] == decided["api"]
    paths = {path for row in rows for path in row.paths}
    logged = {side: entries_of(logs[side], skip[side], paths) for side in logs}
    for row in rows:
        for path in row.paths:
            assert logged["mount"][path] == logged["api"][path], (row.name, path)
        assert logged["api"][row.paths[0]], f"{row.name}: nothing audited"
    # The table means something at every level: some operations allowed, some refused.
    assert None in decided["api"].values()
    assert any(d is not None for d in decided["api"].values())


def _fail_closed_mkdirs(project: Path) -> list[tuple[Any, ...]]:
    """The mkdirs the fail-closed rule refused, as logged: op, allowed, errno, reason."""
    entries = [json.loads(line) for line in audit_path(project).read_text().splitlines()]
    return sorted(
        {
            (e["op"], e["allowed"], e["errno"], e["reason"])
            for e in entries
            if e["op"] == "mkdir" and "(fail closed)" in (e.get("reason") or "")
        }
    )


def _fill(disk: Path) -> None:
    """The disk under the state dir filled up, from outside (as root: to the last block)."""
    with open(disk / "fill", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)


def _soon(attempt: Callable[[], bool], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not attempt():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _api_tries(call: Callable[[], object]) -> bool:
    try:
        call()
    except SandboxAPIError:
        return False
    return True


def test_both_front_ends_fail_closed_alike_while_the_audit_log_cannot_be_written(
    tmp_path: Path,
) -> None:
    """A full disk under the state dir: the mount and the API both refuse what they would
    audit (ENOSPC) and both record the refusal, which reaches the log once there is room."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    small = ("-t", "tmpfs", "-o", "size=1m", "tmpfs")
    with (
        mounted_fs(tmp_path / "m-small", *small) as m_fs,
        mounted_fs(tmp_path / "a-small", *small) as a_fs,
    ):
        projects = {"mount": make(m_fs / "p"), "api": make(a_fs / "p")}
        with mounted(tmp_path / "mnt", projects["mount"], "session", "--session", SESSION) as m:
            work = m.mnt / "session" / "working"
            _fill(m_fs)
            # Audited changes (never folded) until the log's reserve is used up and the
            # next one is refused.
            made = sh(f"for i in $(seq 400); do mkdir {work}/d$i || exit 1; done", timeout=60)
            assert made.returncode != 0 and "No space left" in made.stderr, made
            (m_fs / "fill").unlink()
            assert _soon(lambda: sh(f"mkdir {work}/after", timeout=10).returncode == 0)
        with Sandbox.open(projects["api"], trust="session", session=SESSION) as sb:
            _fill(a_fs)
            with pytest.raises(SandboxAPIError) as raised:
                for i in range(400):
                    sb.mkdir(f"/session/working/d{i}")
            assert raised.value.errno == errno.ENOSPC
            (a_fs / "fill").unlink()
            assert _soon(lambda: _api_tries(lambda: sb.mkdir("/session/working/after")))
        logged = {side: _fail_closed_mkdirs(project) for side, project in projects.items()}
    assert logged["mount"] == logged["api"] == [("mkdir", False, "ENOSPC", FAIL_CLOSED)], logged
