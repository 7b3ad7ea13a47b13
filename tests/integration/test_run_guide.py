"""The program knows where it is: `run`'s start line, the project found from a subdirectory as git
finds it, the guide at /sandbox/.sandboxfs/README at every trust level, an untrusted agent reading
back what it staged (and nothing of anyone else's), and the exit summary counting files."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sandboxfs.api import Sandbox, SandboxAPIError
from sandboxfs.layout import state_dir
from sandboxfs.project.zones import find_project
from tests.support.cli import SANDBOXFS
from tests.support.run import TIMEOUT, nothing_left_behind, sbx  # noqa: F401

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)

GUIDE = "/sandbox/.sandboxfs/README"
# What the guide says of /sandbox/repo at each level of the default matrix.
REPO_LINE = {
    "untrusted": "nothing (its names look absent)",
    "session": "nothing (its names look absent)",
    "workspace": "read, list:",
    "full": "read, write, list, delete:",
}


def _repo(tmp_path: Path) -> Path:
    project = tmp_path / "proj"
    (project / "src" / "pkg").mkdir(parents=True)
    (project / "README.md").write_text("top readme\n")
    (project / "src" / "main.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    return project


@pytest.mark.parametrize("trust", list(REPO_LINE))
def test_guide_at_every_level_tells_the_truth(tmp_path: Path, trust: str) -> None:
    project = _repo(tmp_path)
    script = 'echo "guide=$SANDBOXFS_GUIDE"; ls /sandbox/.sandboxfs; cat "$SANDBOXFS_GUIDE"'
    result = sbx("run", "--project", project, "--trust", trust, "--", "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"guide={GUIDE}" in out
    assert "README" in out and "context.json" in out
    assert f"at trust level {trust} " in out
    repo_line = next(line for line in out.splitlines() if line.startswith("  /sandbox/repo "))
    assert REPO_LINE[trust] in repo_line, repo_line
    staged = next(line for line in out.splitlines() if line.startswith("  /sandbox/staged "))
    if trust == "untrusted":
        assert "create new files only" in staged and "read back" in staged
        assert "You cannot change /sandbox/repo" in out and "message.txt" in out
    elif trust == "full":
        assert "You may change /sandbox/repo directly" in out
    else:
        assert "You cannot change /sandbox/repo" in out
    assert str(project) not in out  # no host path inside
    # The start line: trust, project, what is visible and writable, the network.
    start = result.stderr.splitlines()[0]
    assert start.startswith("sandboxfs: session ") and f"trust {trust}:" in start, start
    assert f"project {project} at /sandbox/repo" in start and "network: none" in start
    shown = {"untrusted": "not visible", "session": "not visible"}.get(trust, "")
    assert (shown or ("read-only" if trust == "workspace" else "read-write")) in start


@pytest.mark.parametrize("trust", ["untrusted", "workspace"])
def test_the_guides_example_runs_as_written(tmp_path: Path, trust: str) -> None:
    """The staging example works verbatim at the level it is shown to: where /sandbox/repo
    cannot be read it writes the file whole instead of copying it from there."""
    project = _repo(tmp_path)
    (project / "src" / "parse.py").write_text("def parse(text):\n    return text\n")
    shown = sbx("run", "--project", project, "--trust", trust, "-q", "--", "cat", GUIDE)
    assert shown.returncode == 0, shown.stderr
    after = shown.stdout.split("For example:\n", 1)[1].splitlines()
    example = [line.split("  #")[0].strip() for line in after if line.startswith("  ")]
    assert len(example) >= 3 and ("cp /sandbox/repo/" in example[1]) is (trust == "workspace")
    script = " && ".join(example)
    result = sbx("run", "--project", project, "--trust", trust, "-q", "--", "sh", "-c", script)
    assert result.returncode == 0, (example, result.stderr)
    listed = sbx("staged", "show", "--project", project, "fix-parser")
    assert listed.returncode == 0 and "src/parse.py" in listed.stdout, listed


def test_quiet_prints_no_start_line(tmp_path: Path) -> None:
    project = _repo(tmp_path)
    result = sbx("run", "--quiet", "--project", project, "--", "true")
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_guide_follows_promote(tmp_path: Path) -> None:
    """The guide is regenerated on a live trust change, as context.json is."""
    project = _repo(tmp_path)
    script = (
        f"grep -c 'trust level untrusted' {GUIDE}; "
        "i=0; while ! grep -q 'trust level workspace' " + GUIDE + " && [ $i -lt 200 ]; "
        "do sleep 0.05; i=$((i+1)); done; "
        f"grep 'trust level' {GUIDE}; grep '^  /sandbox/repo ' {GUIDE}"
    )
    proc = subprocess.Popen(
        [*SANDBOXFS, "run", "--project", str(project), "--trust", "untrusted",
         "--new-session", "live1", "--", "sh", "-c", script],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        promoted = None
        while time.monotonic() < deadline:
            promoted = subprocess.run(
                [*SANDBOXFS, "promote", "live1", "--trust", "workspace"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if promoted.returncode == 0:
                break
            time.sleep(0.2)
        assert promoted is not None and promoted.returncode == 0, promoted
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    assert "trust level workspace" in out and "read, list:" in out, out


def test_run_from_a_subdirectory_uses_the_git_top_level(tmp_path: Path) -> None:
    project = _repo(tmp_path)
    sub = project / "src" / "pkg"
    proc = subprocess.run(
        [*SANDBOXFS, "run", "--trust", "workspace", "--", "cat", "/sandbox/repo/README.md"],
        cwd=sub, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "top readme\n"
    assert f"project {project} at /sandbox/repo" in proc.stderr.splitlines()[0]
    assert (project / ".sandbox").is_dir()
    assert not (sub / ".sandbox").exists() and not (project / "src" / ".sandbox").exists()
    # The other subcommands find the same project (here: its audit log).
    listed = subprocess.run(
        [*SANDBOXFS, "audit", "--json"], cwd=sub, capture_output=True, text=True, check=True
    )
    assert '"op": "run"' in listed.stdout or '"op":"run"' in listed.stdout


def test_find_project_rules(tmp_path: Path) -> None:
    project = _repo(tmp_path)
    sub = project / "src" / "pkg"
    assert find_project(sub) == project
    # A directory in the work tree that already has sandboxfs's state dir is preferred.
    (project / "src" / ".sandbox" / "workspaces").mkdir(parents=True)
    assert find_project(sub) == project / "src"
    # A `.sandbox` that is not sandboxfs's (no workspaces/, no audit log) is not.
    (project / "src" / ".sandbox" / "workspaces").rmdir()
    assert find_project(sub) == project
    # Outside a git work tree: the directory itself, whatever is above it.
    plain = tmp_path / "plain" / "deep"
    plain.mkdir(parents=True)
    (tmp_path / "plain" / ".sandbox" / "workspaces").mkdir(parents=True)
    assert find_project(plain) == plain
    # A worktree or submodule: `.git` is a file.
    linked = tmp_path / "linked"
    (linked / "a").mkdir(parents=True)
    (linked / ".git").write_text("gitdir: /elsewhere\n")
    assert find_project(linked / "a") == linked


STAGE_AND_READ = r"""
mkdir -p /sandbox/staged/c1/files/src
echo 'fixed' > /sandbox/staged/c1/files/src/a.py
echo 'Fix a' > /sandbox/staged/c1/message.txt
echo "read: $(cat /sandbox/staged/c1/files/src/a.py)"
echo "list: $(ls /sandbox/staged/c1 | tr '\n' ' ')"
echo "list2: $(ls /sandbox/staged/c1/files/src)"
if ls /sandbox/staged >/dev/null 2>&1; then echo "root: listed"; else echo "root: refused"; fi
if (echo again > /sandbox/staged/c1/files/src/a.py) 2>/dev/null
then echo "rewrite: yes"; else echo "rewrite: no"; fi
"""

OTHER_SESSION = r"""
if cat /sandbox/staged/c1/files/src/a.py 2>/dev/null
then echo "other-read: yes"; else echo "other-read: no"; fi
if ls /sandbox/staged/c1 >/dev/null 2>&1
then echo "other-list: yes"; else echo "other-list: no"; fi
"""


def test_untrusted_reads_back_its_own_staged_files_only(tmp_path: Path) -> None:
    project = _repo(tmp_path)
    first = sbx("run", "--project", project, "--trust", "untrusted", "--", "sh", "-c",
                STAGE_AND_READ)  # fmt: skip
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "read: fixed" in out and "list: files message.txt" in out and "list2: a.py" in out
    assert "root: refused" in out and "rewrite: no" in out
    assert "2 files staged" in first.stderr, first.stderr  # a.py and message.txt, no directory
    second = sbx("run", "--project", project, "--trust", "untrusted", "--", "sh", "-c",
                 OTHER_SESSION)  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert "other-read: no" in second.stdout and "other-list: no" in second.stdout
    entries = subprocess.run(
        [*SANDBOXFS, "audit", "--project", str(project), "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert '"/staged/c1/files/src/a.py"' in entries  # the read back is audited


OTHER_PARTY = r"""
mkdir -p /sandbox/staged/c2/files && echo mine > /sandbox/staged/c2/files/mine.txt
i=0; while [ ! -e /sandbox/session/working/go ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
echo "list: $(ls /sandbox/staged/c2/files | tr '\n' ' ')"
if cat /sandbox/staged/c2/files/other.txt 2>/dev/null
then echo "other: read"; else echo "other: refused"; fi
"""


def test_another_partys_file_in_an_own_directory_stays_hidden(tmp_path: Path) -> None:
    project = _repo(tmp_path)
    proc = subprocess.Popen(
        [*SANDBOXFS, "run", "--project", str(project), "--trust", "untrusted",
         "--new-session", "own1", "--", "sh", "-c", OTHER_PARTY],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        backing = state_dir(project) / "workspaces" / "default"
        mine = backing / "staged" / "c2" / "files" / "mine.txt"
        deadline = time.monotonic() + TIMEOUT
        while not mine.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (mine.parent / "other.txt").write_text("someone else's\n")
        (backing / "sessions" / "own1" / "working" / "go").write_text("")
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    assert "list: mine.txt " in out and "other: refused" in out, out


def test_api_reads_back_its_own_staged_files_only(tmp_path: Path) -> None:
    """The rule lives in the guard: the Python API gets it too."""
    project = _repo(tmp_path)
    with Sandbox.open(project, trust="untrusted") as sb:
        sb.mkdir("/staged/c3/files", parents=True)
        sb.write("/staged/c3/files/a.txt", "mine\n")
        backing = state_dir(project) / "workspaces" / "default" / "staged" / "c3" / "files"
        (backing / "b.txt").write_text("not mine\n")
        assert sb.read_text("/staged/c3/files/a.txt") == "mine\n"
        assert sb.list("/staged/c3/files") == ["/staged/c3/files/a.txt"]
        with pytest.raises(SandboxAPIError):
            sb.read_text("/staged/c3/files/b.txt")
