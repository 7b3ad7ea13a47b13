"""The agent profile on a real mount and a real run: what counts as an overwrite, how requests
of one process are grouped, and the everyday tools it must not break (docs/approvals.md)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import SANDBOXFS, sandboxfs
from tests.support.mounts import Mount, mounted
from tests.support.run import PY, needs_bwrap

AGENT = "approvals: {profile: agent}\n"


def pending(m: Mount) -> list[dict[str, Any]]:
    result = sandboxfs("approvals", "--json", "--mount", m.mnt)
    assert result.returncode == 0, result.stderr
    requests: list[dict[str, Any]] = json.loads(result.stdout)["pending"]
    return requests


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
AS = pytest.mark.parametrize(
    "prefix",
    [
        pytest.param([], id="root"),
        pytest.param(
            NOBODY,
            id="nobody",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setpriv)"),
        ),
    ],
)


def python(
    code: str, *args: str | Path, prefix: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, PY, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# Each destroys what the file held without O_TRUNC: truncate(2); ftruncate then a write; an
# in-place rewrite (O_WRONLY, no O_APPEND); an O_APPEND handle cut by ftruncate; an O_APPEND
# handle whose flag was cleared with fcntl, writing at offset 0.
OVERWRITES = {
    "truncate": "import os, sys; os.truncate(sys.argv[1], 0)",
    "ftruncate": (
        "import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); os.ftruncate(fd, 0); "
        "os.write(fd, b'new')"
    ),
    "rewrite": "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY); os.write(fd, b'NEW')",
    "append-cut": (
        "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND); os.ftruncate(fd, 0)"
    ),
    "append-cleared": (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND); "
        "fcntl.fcntl(fd, fcntl.F_SETFL, 0); os.pwrite(fd, b'NEW', 0)"
    ),
}


def _open_to_all(project: Path) -> None:
    """The project's files writable by anyone (the ordinary user's runs need that)."""
    for path in [project, *project.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)


@pytest.fixture
def mnt() -> Iterator[Path]:
    """A mountpoint the ordinary user can reach (pytest's own directories are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="sandboxfs-kinds-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        path.rmdir()


@AS
def test_every_change_that_destroys_a_files_content_asks_overwrite(
    mnt: Path, project: Path, prefix: list[str]
) -> None:
    (project / "sandboxfs.yaml").write_text(AGENT)
    for name in OVERWRITES:
        (project / name).write_text("the user's work\n")
    (project / "log").write_text("line 1\n")
    _open_to_all(project)
    with mounted(mnt, project, "full", "--allow-other") as m:
        repo = m.mnt / "repo"
        for name, code in OVERWRITES.items():
            result = python(code, repo / name, prefix=prefix)
            assert result.returncode != 0 and "Permission denied" in result.stderr, name
            assert (project / name).read_text() == "the user's work\n", name
        asked = {r["path"]: (r["op"], r["rule"]) for r in pending(m)}
        assert asked == {
            f"/repo/{name}": ("overwrite", "agent:repo-overwrite") for name in OVERWRITES
        }
        # appending keeps what was there: no ask
        appended = python(
            "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND); "
            "os.write(fd, b'line 2\\n')",
            repo / "log",
            prefix=prefix,
        )
        assert appended.returncode == 0, appended.stderr
        assert (project / "log").read_text() == "line 1\nline 2\n"
        # what this session created is not the user's: truncated and rewritten without asking
        made = python(
            "import os, sys; open(sys.argv[1], 'w').write('draft'); os.truncate(sys.argv[1], 1); "
            "fd = os.open(sys.argv[1], os.O_RDWR); os.ftruncate(fd, 0); os.write(fd, b'final')",
            repo / "src" / "made",  # (the zone root is root's: no one else creates there)
            prefix=prefix,
        )
        assert made.returncode == 0, made.stderr
        assert (project / "src" / "made").read_text() == "final"
        assert len(pending(m)) == len(OVERWRITES)


THREADED_DELETES = """
import os, sys, threading
names = [os.path.join(sys.argv[1], f"f{i}") for i in range(20)]
start = threading.Barrier(20)
refused = []
def remove(path):
    start.wait()
    try:
        os.unlink(path)
    except PermissionError:
        refused.append(path)
threads = [threading.Thread(target=remove, args=(p,)) for p in names]
for t in threads: t.start()
for t in threads: t.join()
print(len(refused))
"""


@AS
def test_twenty_threads_of_one_process_make_one_request(
    mnt: Path, project: Path, prefix: list[str]
) -> None:
    (project / "sandboxfs.yaml").write_text(AGENT)
    (project / "many").mkdir()
    for i in range(20):
        (project / "many" / f"f{i}").write_text("x")
    _open_to_all(project)
    with mounted(mnt, project, "full", "--allow-other") as m:
        result = python(THREADED_DELETES, m.mnt / "repo" / "many", prefix=prefix)
        assert result.returncode == 0 and result.stdout.strip() == "20", result.stderr
        requests = pending(m)
        assert len(requests) == 1, [(r["id"], r["pid"], r["count"]) for r in requests]
        [request] = requests
        assert (request["op"], request["directory"], request["count"]) == (
            "delete",
            "/repo/many",
            20,
        )
        assert request["comm"].startswith("python")


def test_what_the_session_made_is_never_asked_and_never_a_way_to_the_users_files(
    tmp_path: Path, project: Path
) -> None:
    """Its own files (an editor's swap file, a temp file renamed into place) and the excluded
    directories need no answer; a hard link to the user's file in `build/`, a move into
    `build/` and a move from there onto the user's file still ask."""
    (project / "sandboxfs.yaml").write_text(AGENT)
    (project / "build").mkdir()
    (project / "build" / "old.o").write_text("o")
    with mounted(tmp_path / "mnt", project, "full") as m:
        repo = m.mnt / "repo"
        own = python(
            "import os, sys; r = sys.argv[1]; open(r + '/.main.py.swp', 'w').write('s'); "
            "os.unlink(r + '/.main.py.swp'); open(r + '/new.tmp', 'w').write('n'); "
            "os.rename(r + '/new.tmp', r + '/new.py'); os.unlink(r + '/build/old.o'); "
            "os.mkdir(r + '/build/lib'); os.rename(r + '/build/lib', r + '/build/lib2')",
            repo,
        )
        assert own.returncode == 0, own.stderr
        assert pending(m) == []
        attempts = {
            "/repo/build/m": (
                f"ln {repo}/src/main.py {repo}/build/m && : > {repo}/build/m",
                "overwrite",
            ),
            "/repo/README.md": (f"mv {repo}/README.md {repo}/build/README.md", "rename"),
            "/repo/build/gen.py": (
                f"echo x > {repo}/build/gen.py && mv {repo}/build/gen.py {repo}/src/main.py",
                "overwrite",
            ),
        }
        for command, _ in attempts.values():
            result = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
            assert result.returncode != 0 and "ermission denied" in result.stderr, command
        assert {r["path"]: r["op"] for r in pending(m)} == {
            path: op for path, (_, op) in attempts.items()
        }
        assert (project / "src" / "main.py").read_text() == "print('hello')\n"


def _wheel(directory: Path) -> Path:
    """A tiny pure-Python wheel, built by hand (no build backend, no network)."""
    wheel = directory / "tinypkg-1.0-py3-none-any.whl"
    dist = "tinypkg-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tinypkg/__init__.py", "VALUE = 42\n")
        zf.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        zf.writestr(
            f"{dist}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(
            f"{dist}/RECORD",
            f"tinypkg/__init__.py,,\n{dist}/METADATA,,\n{dist}/WHEEL,,\n{dist}/RECORD,,\n",
        )
    return wheel


PIP = (
    "cd /sandbox/repo && {py} -m venv .venv && "
    ".venv/bin/pip install -q --no-index --disable-pip-version-check {wheel} && "
    ".venv/bin/pip install -q --no-index --disable-pip-version-check --force-reinstall {wheel} && "
    ".venv/bin/python -c 'import tinypkg; print(\"imported\", tinypkg.VALUE)' && "
    "mkdir -p build node_modules/pad && echo x > build/o && echo y > node_modules/pad/i && "
    "rm -r build node_modules && echo tools-ok; rm src/main.py; mkdir build; mv src build/src; "
    "echo done"
)


@needs_bwrap
@pytest.mark.timeout(330)  # the pip install run is allowed 240 s
def test_the_agent_profile_lets_pip_install_into_a_venv_in_the_repo(project: Path) -> None:
    (project / "sandboxfs.yaml").write_text(AGENT)
    (project / "src" / "main.py").write_text("print('the user')\n")
    wheel = _wheel(project)
    result = subprocess.run(
        [
            *SANDBOXFS,
            "run",
            "--project",
            str(project),
            "--trust",
            "full",
            "--quiet",
            "--",
            "sh",
            "-c",
            PIP.format(py=PY, wheel=f"/sandbox/repo/{wheel.name}"),
        ],
        stdin=subprocess.DEVNULL,  # nobody can answer: any ask is refused at once
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = result.stdout
    assert "imported 42" in out and "tools-ok" in out and "done" in out, (out, result.stderr)
    site = next((project / ".venv" / "lib").glob("python3*/site-packages"))
    assert [p.name for p in site.iterdir() if p.name.startswith("~")] == []
    # the user's files still ask: deleting one, and moving one into a build directory
    assert (project / "src" / "main.py").read_text() == "print('the user')\n"
    assert not (project / "build" / "src").exists()
    entries = sandboxfs("audit", "--project", project, "--json", "--denied").stdout
    refused = [json.loads(line) for line in entries.splitlines()]
    asked = [e for e in refused if "needs the user's approval" in e.get("reason", "")]
    assert {(e["op"], e["path"]) for e in asked} == {
        ("delete", "/repo/src/main.py"),
        ("rename", "/repo/src"),
    }, asked
