"""Workers through real mounts: `mount --worker` and `run --worker` show exactly the zones a worker
declares, at most at their modes; a declaration wider than the trust level is refused and nothing is
mounted; every entry the worker causes carries its name."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import SANDBOXFS, assert_one_line_error, sandboxfs, wait_until
from tests.support.mounts import make_project, mounted
from tests.support.run import audit, fuse_mounts, run_dirs, sbx

WORKERS = {
    "formatter": (
        "sandbox:\n  zones:\n    - {name: data, mode: ro}\n    - {name: session, mode: rw}\n"
    ),
    "writer": "sandbox:\n  zones:\n    - {name: data, mode: rw}\n",
    "greedy": "sandbox:\n  zones:\n    - {name: repo, mode: rw}\n",
    "pure": "",
}


@pytest.fixture(autouse=True)
def nothing_left_here(tmp_path: Path) -> Iterator[None]:
    """No mount of this test's, and no `run` directory, outlives it. Only this test's own
    mounts are looked at: other suites may be mounting beside it."""
    yield
    ours = str(tmp_path) + "/"
    assert wait_until(lambda: not run_dirs(), 10), run_dirs()
    left = [mnt for mnt in fuse_mounts() if mnt.startswith(ours)]
    assert not left, f"mounts left behind: {left}"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with two zones of its own (data, reports) and four workers."""
    proj = make_project(tmp_path)
    for zone in ("data", "reports"):
        (tmp_path / zone).mkdir()
    (tmp_path / "data" / "input.csv").write_text("1,2\n")
    (proj / "sandboxfs.yaml").write_text(
        "zones:\n"
        "  data: {path: ../data, permissions: {session: rwld, workspace: rl}}\n"
        "  reports: {path: ../reports, permissions: {session: rwld}}\n"
    )
    for name, sandbox in WORKERS.items():
        text = f"---\nname: {name}\ndescription: the {name}\n{sandbox}---\nDo the {name}'s work.\n"
        (proj / ".workers" / f"{name}.worker").write_text(text)
    (proj / ".workers" / "review.worker").unlink()  # conftest's, not in the .worker format
    return proj


def _not_mounted(mnt: Path) -> bool:
    return not os.path.ismount(mnt) and not any(mnt.iterdir())


def test_mount_shows_only_the_declared_zones(tmp_path: Path, project: Path) -> None:
    with mounted(tmp_path / "mnt", project, "session", "--worker", "formatter") as m:
        assert "worker formatter" in m.stdout
        assert sorted(os.listdir(m.mnt)) == [".sandboxfs", "data", "session"]
        for absent in ("workspace", "staged", "workers", "reports", "repo"):
            assert not (m.mnt / absent).exists()
        context = json.loads((m.mnt / ".sandboxfs" / "context.json").read_text())
        assert list(context["zones"]) == ["session", "data"]
        assert context["worker"] == "formatter"
        assert (m.mnt / "data" / "input.csv").read_text() == "1,2\n"
        # ro on a zone the trust level has rw: no write, the parent's rw notwithstanding
        result = subprocess.run(
            ["sh", "-c", f"echo x > {m.mnt}/data/new.csv"], capture_output=True, text=True
        )
        assert result.returncode != 0 and "Read-only file system" in result.stderr
        (m.mnt / "session" / "working" / "notes.txt").write_text("mine")
        denied = m.wait_audit(lambda e: e["allowed"] is False and e["path"] == "/data/new.csv")
        assert denied["worker"] == "formatter"
    entries = m.audit("--worker", "formatter")
    assert {e["op"] for e in entries} >= {"mount", "read", "write", "unmount"}
    assert all(e["worker"] == "formatter" for e in entries)
    assert not m.audit("--worker", "writer")


def test_mount_wider_than_the_trust_level_is_refused(tmp_path: Path, project: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = sandboxfs(
        "mount", mnt, "--project", project, "--trust", "workspace", "--worker", "writer"
    )
    assert_one_line_error(result, "Child requests 'rw' on 'data' but parent only has 'ro'")
    assert _not_mounted(mnt)
    result = sandboxfs("mount", mnt, "--project", project, "--worker", "greedy")
    assert_one_line_error(result, "Child requests 'rw' on 'repo' but parent only has 'none'")
    assert _not_mounted(mnt)


def test_mount_of_a_worker_without_declaration_has_no_zones(tmp_path: Path, project: Path) -> None:
    with mounted(tmp_path / "mnt", project, "full", "--worker", "pure") as m:
        assert os.listdir(m.mnt) == [".sandboxfs"]
        context = json.loads((m.mnt / ".sandboxfs" / "context.json").read_text())
        assert context["zones"] == {}
        assert not (m.mnt / "repo").exists()


def test_run_with_a_worker(project: Path) -> None:
    script = (
        "ls /sandbox; cat /sandbox/data/input.csv; "
        "echo x > /sandbox/data/new.csv || echo refused; "
        "ls /sandbox/repo || echo no-repo"
    )
    result = sbx("run", "--project", project, "--worker", "formatter", "--", "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["data", "session", "1,2", "refused", "no-repo"]
    assert "worker formatter" in result.stderr
    assert "Read-only file system" in result.stderr
    entries = audit(project, "--worker", "formatter")
    assert {"run", "mount", "read", "write"} <= {e["op"] for e in entries}
    refused = [e for e in entries if e["allowed"] is False]
    assert refused and refused[0]["path"] == "/data/new.csv"
    assert all(e["worker"] == "formatter" for e in entries)


def test_run_wider_than_the_trust_level_is_refused(project: Path) -> None:
    result = sbx(
        "run", "--project", project, "--trust", "workspace", "--worker", "writer", "--", "true"
    )
    assert result.returncode == 125
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "Child requests 'rw' on 'data' but parent only has 'ro'" in lines[0]
    assert not audit(project, "--worker", "writer")  # nothing was mounted or run


def test_workers_list_and_show(project: Path) -> None:
    listed = sandboxfs("workers", "list", "--project", project, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert sorted(rows) == ["formatter", "greedy", "pure", "writer"]
    assert rows["formatter"]["zones"] == {
        "session": {"mode": "rw", "access": "rwld"},
        "data": {"mode": "ro", "access": "rl"},
    }
    assert rows["greedy"]["allowed"] is False
    assert rows["pure"]["declared"] is None and rows["pure"]["zones"] == {}
    at_workspace = sandboxfs("workers", "--project", project, "--trust", "workspace")
    assert "Child requests 'rw' on 'data' but parent only has 'ro'" in at_workspace.stdout
    shown = sandboxfs("workers", "show", "writer", "--project", project)
    assert shown.returncode == 0, shown.stderr
    assert "/data: rw (r w l d)" in shown.stdout
    assert "Do the writer's work." in shown.stdout


@pytest.mark.parametrize(
    ("front", "needles"),
    [
        ("name: bad\nsandbox: [\n", ["bad.worker", "not valid YAML"]),
        ("name: bad\ncolour: red\n", ["bad.worker, line 3", "colour: unknown key"]),
        (
            "name: bad\nsandbox:\n  zones:\n    - {name: dta, mode: ro}\n",
            ["line 5", "unknown zone 'dta'"],
        ),
        (
            "name: bad\nsandbox:\n  zones:\n    - name: data\n      mode: rx\n",
            ["line 6", "'rx' is not one of"],
        ),
    ],
    ids=["bad-yaml", "unknown-key", "unknown-zone", "bad-mode"],
)
def test_bad_worker_files_one_line(
    tmp_path: Path, project: Path, front: str, needles: list[str]
) -> None:
    (project / ".workers" / "bad.worker").write_text(f"---\n{front}---\n")
    assert_one_line_error(sandboxfs("workers", "show", "bad", "--project", project), *needles)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = sandboxfs("mount", mnt, "--project", project, "--worker", "bad")
    assert_one_line_error(result, *needles)
    assert _not_mounted(mnt)
    listed = sandboxfs("workers", "--project", project)
    assert listed.returncode == 1 and "invalid:" in listed.stdout


def test_run_with_attachments(project: Path) -> None:
    script = (
        "ls /sandbox/attachments; cat /sandbox/attachments/README.md; "
        "echo x >> /sandbox/attachments/README.md || echo refused"
    )
    result = sbx(
        "run", "--project", project, "--trust", "workspace", "--worker", "pure",
        "--attach", "/repo/README.md", "--", "sh", "-c", script,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["README.md", "# demo project", "refused"]
    refused = audit(project, "--worker", "pure", "--denied")
    assert refused and refused[0]["path"] == "/attachments/README.md"
    copies = project / ".sandbox" / "workspaces" / "default" / "attachments"
    assert list(copies.iterdir()) == []  # removed once the run ended
    # Only what the parent may read: /repo is not readable at session.
    result = sbx(
        "run", "--project", project, "--worker", "pure", "--attach", "/repo/README.md",
        "--", "true",
    )  # fmt: skip
    assert result.returncode == 125
    assert "--attach: Cannot read '/repo/README.md': repo is not readable" in result.stderr


# ----- nesting: a child worker started from inside `sandboxfs run` ------------------------------

RAW_REQUEST = """
import array, json, os, socket
data = os.open("/sandbox/data", os.O_RDONLY | os.O_DIRECTORY)
for request, stdin in (
    ({"worker": "reader", "argv": ["true"], "trust": "full"}, 0),
    ({"worker": "reader", "argv": ["sh", "-c", "echo x >&0"]}, data),
):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/sandboxfs/nest.sock")
    fds = array.array("i", [stdin, 1, 2])
    s.sendmsg([json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    s.shutdown(socket.SHUT_WR)
    print(s.recv(65536).decode())
"""

FORGED = "---\\nname: forged\\nsandbox:\\n  zones:\\n    - {name: data, mode: rw}\\n---\\n"


def test_nested_worker_from_inside_run(project: Path) -> None:
    (project / ".workers" / "keeper.worker").write_text(
        "---\nname: keeper\nsandbox:\n  zones:\n"
        "    - {name: data, mode: ro}\n    - {name: workers, mode: rw}\n---\n"
    )
    (project / ".workers" / "reader.worker").write_text(
        "---\nname: reader\nsandbox:\n  zones:\n    - {name: data, mode: ro}\n---\n"
    )
    script = f"""
        sandboxfs run --worker reader -- sh -c 'ls /sandbox; cat /sandbox/data/input.csv;
            echo x > /sandbox/data/child.csv || echo child-refused'
        echo child=$?
        printf -- '{FORGED}' > /sandbox/workers/forged.worker
        sandboxfs run --worker forged -- sh -c 'echo forged-ran'
        echo forged=$?
        /usr/bin/python3 -c '{RAW_REQUEST}'
        sandboxfs run --worker reader --attach /repo/README.md -- true
        echo attach=$?
        echo x > /sandbox/data/parent.csv || echo parent-refused
    """
    result = sbx(
        "run", "--project", project, "--trust", "full", "--worker", "keeper",
        "--", "sh", "-c", script,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    # The child sees only its zone, read-only; it runs and ends inside the parent's run.
    assert out[:4] == ["data", "1,2", "child-refused", "child=0"]
    # A declaration wider than the parent (written inside, in /workers) is refused.
    assert "forged-ran" not in result.stdout and "forged=125" in out
    assert "worker forged: Child requests 'rw' on 'data' but parent only has 'ro'" in (
        result.stderr
    )
    # A request naming a trust level is refused whole; the parent's own access is unchanged.
    assert "unknown fields ['trust']" in result.stdout
    assert "stdin, stdout and stderr must be pipes, terminals or files" in result.stdout
    # Attachments come from the parent worker's view: /repo is readable at full, not by keeper.
    assert "attach=125" in out
    assert "--attach: Cannot read '/repo/README.md': /repo is not a zone" in result.stderr
    assert out[-1] == "parent-refused"
    assert not (project.parent / "data" / "child.csv").exists()
    child = audit(project, "--worker", "reader")
    assert {"run", "mount", "read", "write"} <= {e["op"] for e in child}
    assert all(e["worker"] == "reader" for e in child)
    assert [e["path"] for e in child if e["allowed"] is False] == ["/data/child.csv"]
    assert child[0]["trust"] == "full" and "forged" not in {e.get("worker") for e in child}
    refused = [e for e in audit(project, "--worker", "keeper", "--denied") if e["op"] == "run"]
    assert len(refused) == 1
    assert "Child requests 'rw' on 'data'" in refused[0]["reason"]
    assert not audit(project, "--worker", "forged")  # nothing was mounted for it


def _children_of_run(marker: str, program: bool = False) -> list[int]:
    """The nested child runs (`--parent-pid`) whose command line holds `marker`; with
    `program`, the program they started instead (`sh -c ... marker`, running)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = marker.encode() in argv and (argv[0] == b"sh") == program
        if ours and (program or b"--parent-pid" in argv):
            found.append(int(entry.name))
    return found


def test_a_nested_child_ends_with_its_parent_even_killed(project: Path) -> None:
    """A child worker started inside run never outlives the run: killed with SIGKILL, the
    parent cannot stop it, and the kernel tells the child (it ends and unmounts)."""
    marker = f"sleep-{os.getpid()}"
    (project / ".workers" / "reader.worker").write_text(
        "---\nname: reader\nsandbox:\n  zones:\n    - {name: data, mode: ro}\n---\n"
    )
    parent = subprocess.Popen(
        [
            *SANDBOXFS, "run", "--project", str(project), "--quiet", "--",
            "sh", "-c", f"sandboxfs run --worker reader -- sh -c 'sleep 300; :' {marker}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert wait_until(lambda: bool(_children_of_run(marker, program=True)), 30)
        assert _children_of_run(marker)
        parent.kill()  # the supervisor: no chance to stop its children itself
        parent.wait(10)
        assert wait_until(lambda: not _children_of_run(marker), 20), _children_of_run(marker)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for pid in _children_of_run(marker):
            os.kill(pid, 9)
        # The killed parent's run directory goes with the next run's sweep, as after a crash.
        assert sbx("run", "--project", project, "--quiet", "--", "true").returncode == 0
