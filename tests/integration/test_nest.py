"""Nested workers under `sandboxfs run` against a hostile parent: a child's level is the daemon's
current one, never what a file read through the mount says; nesting is bounded in depth and in runs
alive per top-level run; a child's command is one its parent could run; idle connections to the nest
socket are bounded."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.cli import SANDBOXFS
from tests.support.mounts import make_project
from tests.support.run import (
    NOBODY,
    TIMEOUT,
    needs_bwrap,
    nobody_env,
    nobody_home,
    nothing_left_behind,
    sbx,
)

__all__ = ["nobody_home", "nothing_left_behind"]  # fixtures, used by name

pytestmark = needs_bwrap


def _worker(project: Path, name: str, zones: str) -> None:
    (project / ".workers" / f"{name}.worker").write_text(
        f"---\nname: {name}\nsandbox:\n  zones:\n{zones}---\n"
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    proj = make_project(tmp_path)
    (proj / ".workers" / "review.worker").unlink()  # not in the .worker format
    _worker(proj, "repo-reader", "    - {name: repo, mode: ro}\n")
    _worker(proj, "nester", "    - {name: repo, mode: ro}\n    - {name: session, mode: rw}\n")
    return proj


class Parent:
    """A `sandboxfs run` whose program is driven line by line on its stdin."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []

    def line_until(self, wanted: str) -> list[str]:
        assert self.proc.stdout is not None
        while wanted not in self.seen:
            line = self.proc.stdout.readline()
            assert line, f"{wanted!r} not seen before EOF: {self.seen}"
            self.seen.append(line.rstrip("\n"))
        return self.seen

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def finish(self) -> tuple[str, str]:
        out, err = self.proc.communicate(timeout=TIMEOUT)
        self.seen += out.splitlines()
        return out, err


@contextmanager
def parent_run(
    *args: str | Path, prefix: list[str] | None = None, env: dict[str, str] | None = None
) -> Iterator[Parent]:
    proc = subprocess.Popen(
        [*(prefix or []), *SANDBOXFS, "run", *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        yield Parent(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()


def _run_dir_of(state: Path, pid: int) -> Path:
    [run_dir] = (state / "run").glob(f"*-{pid}")
    return run_dir


def _sbx_as(prefix: list[str], env: dict[str, str] | None, *args: str | Path) -> str:
    result = subprocess.run(
        [*prefix, *SANDBOXFS, *map(str, args)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# ----- 11: a demoted run's child is at the daemon's current level ------------------------------

DEMOTED = """
echo ready; read go
sandboxfs run --worker repo-reader -- cat /sandbox/repo/README.md
echo child=$?
echo done; read go
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts over the run's context, which needs root")
def test_a_demoted_run_never_nests_at_its_first_level_when_its_context_is_unreadable(
    project: Path,
) -> None:
    """The program makes /sandbox/.sandboxfs/context.json unreadable to the supervisor (the
    issue filled the disk until the audit log failed closed; here a tmpfs covers the file,
    which needs no race): the child's level still comes from the daemon, the demoted one."""
    state = Path(os.environ["SANDBOXFS_STATE_DIR"])
    args: list[str | Path] = [
        "--project",
        project,
        "--trust",
        "full",
        "--quiet",
        "--",
        "sh",
        "-c",
        DEMOTED,
    ]
    with parent_run(*args) as parent:
        parent.line_until("ready")
        mnt = _run_dir_of(state, parent.proc.pid) / "mnt"
        assert "full -> untrusted" in _sbx_as([], None, "demote", mnt, "--trust", "untrusted")
        cover = mnt / ".sandboxfs"
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "cover", cover], check=True)
        try:
            assert not (cover / "context.json").exists()
            parent.send("go\n")
            parent.line_until("done")
        finally:
            subprocess.run(["umount", "-l", cover], check=True)
        parent.send("go\n")
        _, err = parent.finish()
    assert "# demo project" not in parent.seen, parent.seen  # the child never read the repo
    assert "child=125" in parent.seen, (parent.seen, err)
    assert "worker repo-reader: Child requests 'ro' on 'repo'" in err, err
    assert "trust level untrusted" in err, err


def test_an_ordinary_users_demoted_run_nests_at_the_demoted_level(nobody_home: Path) -> None:
    """The supervisor (undumpable, an ordinary user's) asks its daemon for the level."""
    project = nobody_home / "project"
    (project / ".workers" / "review.worker").unlink()
    _worker(project, "repo-reader", "    - {name: repo, mode: ro}\n")
    subprocess.run(["chown", "-R", "65534:65534", str(project / ".workers")], check=True)
    env = nobody_env(nobody_home)
    state = Path(env["SANDBOXFS_STATE_DIR"])
    args: list[str | Path] = [
        "--project",
        project,
        "--trust",
        "full",
        "--quiet",
        "--",
        "sh",
        "-c",
        DEMOTED,
    ]
    with parent_run(*args, prefix=NOBODY, env=env) as parent:
        parent.line_until("ready")
        mnt = _run_dir_of(state, parent.proc.pid) / "mnt"
        demoted = _sbx_as(NOBODY, env, "demote", mnt, "--trust", "untrusted")
        assert "full -> untrusted" in demoted
        parent.send("go\n")
        parent.line_until("done")
        parent.send("go\n")
        _, err = parent.finish()
    assert "the project readme" not in parent.seen and "child=125" in parent.seen, parent.seen
    assert "Child requests 'ro' on 'repo'" in err and "trust level untrusted" in err, err


# ----- 28: idle connections to the nest socket are bounded ---------------------------------------

IDLE = """
import os, socket, subprocess, sys
held = []
for _ in range(200):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/sandboxfs/nest.sock")
    held.append(s)
print("held", flush=True)
sys.stdin.readline()
for s in held:  # each is closed by the supervisor: at once past the bound, else once idle
    s.settimeout(30)
    assert s.recv(1) in (b"", b"{"), "answered"
print("closed", flush=True)
child = subprocess.run(["sandboxfs", "run", "--worker", "repo-reader", "--", "echo", "child-ran"])
print("child", child.returncode, flush=True)
"""


def test_idle_nest_connections_are_bounded_and_a_child_still_runs(project: Path) -> None:
    args: list[str | Path] = [
        "--project",
        project,
        "--trust",
        "full",
        "--quiet",
        "--",
        "/usr/bin/python3",
        "-c",
    ]
    with parent_run(*args, IDLE) as parent:
        parent.line_until("held")
        status = Path(f"/proc/{parent.proc.pid}/status").read_text()
        threads = int(status.split("Threads:")[1].split()[0])
        descriptors = len(os.listdir(f"/proc/{parent.proc.pid}/fd"))
        parent.send("go\n")
        parent.line_until("closed")
        _, err = parent.finish()
    assert threads < 64 and descriptors < 128, (threads, descriptors)
    assert parent.seen[-2:] == ["child-ran", "child 0"], (parent.seen, err)


# ----- 12: nesting is bounded in depth and in runs alive per top-level run ---------------------

DEEPER = """depth=$1
echo "depth $depth"
[ "$depth" -ge 4 ] && exit 0
sandboxfs run --worker nester -- sh /sandbox/repo/deeper.sh $((depth + 1))
echo "status $depth $?"
"""


def test_nesting_stops_at_two_levels(project: Path) -> None:
    (project / "deeper.sh").write_text(DEEPER)
    result = sbx("run", "--project", project, "--trust", "full", "--quiet", "--",
                 "sh", "/sandbox/repo/deeper.sh", "0")  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out == ["depth 0", "depth 1", "depth 2", "status 2 125", "status 1 0", "status 0 0"]
    assert "child workers nest at most 2 deep" in result.stderr, result.stderr


FAN = """case $1 in
top) sandboxfs run --worker nester -- sh /sandbox/repo/fan.sh middle; echo "middle $?" ;;
middle)
    for i in 1 2 3 4 5 6 7 8; do
        (sandboxfs run --worker nester -- sh /sandbox/repo/fan.sh leaf; echo "leaf $?") &
    done
    wait ;;
leaf)
    echo holding
    while ! ls /sandbox/repo | grep -qx release; do sleep 0.1; done ;;
esac
"""


def test_nested_runs_alive_per_top_level_run_are_bounded(project: Path) -> None:
    """One child starting 8 of its own: 9 nested runs would be alive, one more than a
    top-level run's tree may hold; the last is refused, each of its own run under 8."""
    (project / "fan.sh").write_text(FAN)
    args: list[str | Path] = [
        "--project",
        project,
        "--trust",
        "full",
        "--quiet",
        "--",
        "sh",
        "/sandbox/repo/fan.sh",
    ]
    try:
        with parent_run(*args, "top") as parent:
            assert parent.proc.stdout is not None
            while parent.seen.count("holding") + parent.seen.count("leaf 125") < 8:
                line = parent.proc.stdout.readline()
                assert line, parent.seen
                parent.seen.append(line.rstrip("\n"))
            (project / "release").touch()
            _, err = parent.finish()
    finally:
        (project / "release").touch()
    assert parent.seen.count("holding") == 7 and parent.seen.count("leaf 125") == 1, parent.seen
    assert parent.seen.count("leaf 0") == 7 and parent.seen[-1] == "middle 0", parent.seen
    assert "8 nested runs are alive already in this top-level run" in err, err


# ----- 13: a child's command is one its parent could run -----------------------------------------


def _tool(prefix: Path, name: str, secret: str) -> None:
    """A program in a prefix of its own (bin/, lib/: as a virtualenv), reading a file there."""
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib").mkdir()
    (prefix / "secret.txt").write_text(f"{secret}\n")
    tool = prefix / "bin" / name
    tool.write_text(f"#!/bin/sh\necho {name}-ran; cat {prefix}/secret.txt\n")
    tool.chmod(0o755)


def test_a_childs_command_is_looked_up_in_its_parents_view(project: Path, tmp_path: Path) -> None:
    hidden, shown = tmp_path / "hostonly", tmp_path / "shown"
    _tool(hidden, "show", "host-only secret")
    _tool(shown, "tool", "exposed to the parent")
    script = f"""
        ls {hidden} 2>/dev/null || echo parent-cannot-see
        sandboxfs run --worker repo-reader -- {hidden}/bin/show; echo by-path=$?
        sandboxfs run --worker repo-reader -- show; echo by-name=$?
        sandboxfs run --worker repo-reader -- {shown}/bin/tool; echo shown=$?
    """
    env = {**os.environ, "PATH": f"{hidden / 'bin'}:{os.environ['PATH']}"}
    result = sbx("run", "--project", project, "--trust", "full", "--quiet", "--expose", shown,
                 "--", "sh", "-c", script, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert "host-only secret" not in result.stdout and "show-ran" not in out, out
    assert out[:3] == ["parent-cannot-see", "by-path=127", "by-name=127"], (out, result.stderr)
    # What the parent sees, its child may run: the parent's toolchain is the child's.
    assert out[3:] == ["tool-ran", "exposed to the parent", "shown=0"], (out, result.stderr)


def test_a_child_keeps_what_its_parents_exposed_trees_hide(project: Path, tmp_path: Path) -> None:
    """The parent's view handed to a child carries its covers: a `.env` deep in an exposed
    tree, hidden from the parent, is hidden from the child too."""
    shown = tmp_path / "shown"
    (shown / "sub" / "deep").mkdir(parents=True)
    (shown / "sub" / "deep" / ".env").write_text("TOKEN=exposed-secret\n")
    (shown / "sub" / "notes.txt").write_text("notes\n")
    child = f"cat {shown}/sub/notes.txt; cat {shown}/sub/deep/.env; echo child=$?"
    script = f"""
        cat {shown}/sub/deep/.env; echo parent=$?
        sandboxfs run --worker repo-reader -- sh -c '{child}'
    """
    result = sbx("run", "--project", project, "--trust", "full", "--quiet", "--expose", shown,
                 "--", "sh", "-c", script)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "exposed-secret" not in result.stdout, result.stdout
    out = result.stdout.splitlines()
    assert "notes" in out and "child=1" in out, (out, result.stderr)


def test_an_ordinary_users_child_finds_no_host_program_its_parent_cannot_see(
    nobody_home: Path,
) -> None:
    project = nobody_home / "project"
    (project / ".workers" / "review.worker").unlink()
    _worker(project, "repo-reader", "    - {name: repo, mode: ro}\n")
    hidden = nobody_home / "home" / "venv"
    _tool(hidden, "show", "host-only secret")
    subprocess.run(["chown", "-R", "65534:65534", str(nobody_home)], check=True)
    env = nobody_env(nobody_home)
    env["PATH"] = f"{hidden / 'bin'}:{env['PATH']}"
    script = f"""
        sandboxfs run --worker repo-reader -- {hidden}/bin/show; echo by-path=$?
        sandboxfs run --worker repo-reader -- show; echo by-name=$?
    """
    result = sbx("run", "--project", project, "--trust", "full", "--quiet", "--",
                 "sh", "-c", script, prefix=NOBODY, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["by-path=127", "by-name=127"], result.stdout
