"""Bad input gets one line: never a traceback, a hang, a huge message or a leak.

Each row of the table is a bad input handed to `mount` and to `run` as a user would: the
command must answer with exactly one line on stderr, the documented exit code (2; `run`: 125),
within a few seconds, with nothing mounted and nothing created in the project. The CLI's
catch-all, the lazy import of the daemon and the cleanup of a new session that never served
are tested below the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandboxfs.cli import main as cli
from sandboxfs.errors import Failure
from sandboxfs.layout import session_dir
from tests.support.cli import SANDBOXFS
from tests.support.mounts import force_unmount, make_project

TIME_LIMIT = 10.0  # seconds: each answer comes in well under one


def _nested(project: Path) -> Path:
    (project / "sandboxfs.yaml").write_text("deny: " + "[" * 20_000 + "]" * 20_000 + "\n")
    return project


def _dev_zero(project: Path) -> Path:
    (project / "sandboxfs.yaml").symlink_to("/dev/zero")
    return project


def _fifo(project: Path) -> Path:
    os.mkfifo(project / "sandboxfs.yaml")
    return project


def _huge(project: Path) -> Path:
    with (project / "sandboxfs.yaml").open("w") as f:
        f.write("deny:\n")
        f.truncate(100 << 20)  # 100 MB, sparse
    return project


def _long_value(project: Path) -> Path:
    (project / "sandboxfs.yaml").write_text("default_trust: " + "x" * 900_000 + "\n")
    return project


def _duplicate_key(project: Path) -> Path:
    (project / "sandboxfs.yaml").write_text("default_trust: full\ndefault_trust: untrusted\n")
    return project


def _alias_bomb(project: Path) -> Path:
    lines = ["  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 30)]
    text = "zones:\n" + "\n".join(lines) + "\ndefault_trust: *a29\n"
    (project / "sandboxfs.yaml").write_text(text)
    return project


def _many_values(project: Path) -> Path:
    (project / "sandboxfs.yaml").write_text("deny: [" + "[]," * 300_000 + "]\n")
    return project


def _config_dir(project: Path) -> Path:
    (project / "sandboxfs.yaml").mkdir()
    return project


def _long_key(project: Path) -> Path:
    (project / "sandboxfs.yaml").write_text("? " + "k" * 500_000 + "\n: 1\n")  # explicit key
    return project


def _root(project: Path) -> Path:
    return Path("/")


def _state_root(project: Path) -> Path:
    return project.parent / "state"  # the test's own: SANDBOXFS_STATE_DIR


def _inside_state_root(project: Path) -> Path:
    inside = project.parent / "state" / "project"
    inside.mkdir(parents=True, exist_ok=True)
    return inside


def _user_config(content: str | None, kind: str = "file") -> Callable[[Path], Path]:
    def make(project: Path) -> Path:
        where = project.parent / "xdg" / "sandboxfs" / "config.yaml"
        where.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(where)
        elif kind == "zero":
            where.symlink_to("/dev/zero")
        else:
            assert content is not None
            where.write_text(content)
        return project

    return make


# (name, what to make of a fresh project: the --project to use, needle in the line, for run only)
CASES: list[tuple[str, Callable[[Path], Path], str, bool]] = [
    ("nested 20,000 lists deep", _nested, "nested more than 64 levels deep", False),
    ("config linked to /dev/zero", _dev_zero, "a character device, not a regular file", False),
    ("config is a FIFO", _fifo, "a FIFO, not a regular file", False),
    ("100 MB config", _huge, "more than the 1.0 MiB a config may be", False),
    ("900 kB string value", _long_value, "is not one of", False),
    ("duplicate key", _duplicate_key, "duplicate key 'default_trust'", False),
    ("aliases to aliases", _alias_bomb, "with aliases expanded", False),
    ("300,000 values", _many_values, "more than 50000 values", False),
    ("config is a directory", _config_dir, "a directory, not a regular file", False),
    ("500 kB key", _long_key, "unknown key", False),
    ("--project /", _root, "is the root directory", False),
    ("--project the state dir", _state_root, "inside your sandboxfs state dir", False),
    ("--project inside the state dir", _inside_state_root, "inside your sandboxfs state", False),
    ("user config linked to /dev/zero", _user_config(None, "zero"), "a character device", True),
    ("user config is a FIFO", _user_config(None, "fifo"), "a FIFO, not a regular file", True),
    ("user config duplicate key", _user_config("expose: []\nexpose: [/x]\n"), "duplicate", True),
    ("user config nested deep", _user_config("expose: " + "[" * 5000 + "]" * 5000), "64", True),
]


def _mounts(under: Path) -> set[str]:
    """Mounts below `under` (other tests may mount elsewhere meanwhile)."""
    lines = Path("/proc/self/mounts").read_text().splitlines()
    return {line.split()[1] for line in lines if line.split()[1].startswith(f"{under}/")}


def _tree(path: Path) -> set[str]:
    if path == Path("/"):
        return set(os.listdir(path))  # a /.sandbox would show
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.is_dir() else set()


@pytest.mark.parametrize(
    ("command", "make", "needle"),
    [
        pytest.param(command, make, needle, id=f"{name}-{command}")
        for name, make, needle, run_only in CASES
        for command in (("run",) if run_only else ("mount", "run"))  # run reads the user config
    ],
)
def test_bad_input_gets_one_line(
    tmp_path: Path, command: str, make: Callable[[Path], Path], needle: str
) -> None:
    (tmp_path / "state").mkdir()
    project = make(make_project(tmp_path))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    before_tree = _tree(project)
    root_state = Path("/.sandbox").exists()
    argv = (
        ["mount", str(mnt), "--project", str(project)]
        if command == "mount"
        else ["run", "--project", str(project), "--", "true"]
    )
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        "SANDBOXFS_STATE_DIR": str(tmp_path / "state"),
    }
    started = time.monotonic()
    result = subprocess.run(
        [*SANDBOXFS, *argv], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    took = time.monotonic() - started
    try:
        lines = result.stderr.splitlines()
        assert result.returncode == (2 if command == "mount" else 125), result.stderr[-2000:]
        assert len(lines) == 1, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        assert needle in lines[0], lines[0]
        bounded = lines[0].replace(str(project), "<project>")  # the path is the caller's
        assert lines[0].startswith("sandboxfs: ") and len(bounded) < 400, lines[0][:1000]
        assert took < TIME_LIMIT, took
        assert _mounts(tmp_path) == set()  # the mountpoint, run's own under its state dir
        assert _tree(project) == before_tree  # no .sandbox, no session
        assert Path("/.sandbox").exists() == root_state
    finally:
        if os.path.ismount(mnt):
            force_unmount(mnt)


# ----- a mountpoint a non-root user may not mount on ---------------------------------------------

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switches to nobody, needs root")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-bad-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            if line.split()[1].startswith(str(root)):
                force_unmount(Path(line.split()[1]))
        subprocess.run(["rm", "-rf", str(root)], check=False)


@needs_root
@pytest.mark.parametrize(
    ("mode", "needle"),
    [(0o700, "cannot be listed (Permission denied; owner root)"), (0o755, "is not writable")],
)
def test_root_owned_mountpoint_refused_in_one_line(open_dir: Path, mode: int, needle: str) -> None:
    for name in ("project", "home"):
        (open_dir / name).mkdir()
    subprocess.run(["chown", "-R", "65534:65534", str(open_dir)], check=True)
    mnt = open_dir / "mnt"
    mnt.mkdir(mode=mode)
    mnt.chmod(mode)
    env = {
        "HOME": str(open_dir / "home"),
        "PATH": "/usr/bin:/bin",
        "SANDBOXFS_STATE_DIR": str(open_dir / "state"),
    }
    result = subprocess.run(
        [*NOBODY, *SANDBOXFS, "mount", str(mnt), "--project", str(open_dir / "project")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert needle in lines[0], lines[0]
    assert list((open_dir / "project").iterdir()) == []  # no state dir, no session
    assert not os.path.ismount(mnt)


# ----- a mountpoint inside the project's state dir -----------------------------------------------


def test_mountpoint_inside_state_dir_refused(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    inside = project / ".sandbox" / "mnt"
    inside.mkdir(parents=True)
    result = subprocess.run(
        [*SANDBOXFS, "mount", str(inside), "--project", str(project)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "is inside the project's state dir" in lines[0]
    assert not os.path.ismount(inside)
    assert sorted(p.name for p in (project / ".sandbox").iterdir()) == ["mnt"]


# ----- a mount that fails leaves no session behind -----------------------------------------------


def test_failed_mount_leaves_no_new_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon lays out the session, then fusermount3 refuses: the session goes again."""
    from sandboxfs.fuse import daemon
    from sandboxfs.project import zones as project_mod
    from sandboxfs.project.mounts import MountRequest

    project = make_project(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    made: list[Path] = []

    def failing(req: MountRequest, *args: object, **kwargs: object) -> int:
        project_mod.prepare_zones(req.project, req.workspace, req.session, req.config, "")
        made.append(session_dir(req.project, req.workspace, req.session))
        assert made[0].is_dir()
        raise Failure(f"cannot mount {req.mountpoint}: fuse_session_mount failed")

    monkeypatch.setattr(daemon, "spawn_daemon", failing)
    code = cli.main(["mount", str(mnt), "--project", str(project), "--new-session", "gone"])
    assert code == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert made and not made[0].exists()
    assert made[0].parent.is_dir()  # the workspace's other sessions' directory stays


# ----- the catch-all, and commands that never load the daemon ------------------------------------


@pytest.mark.parametrize(("command", "code"), [("status", 1), ("run", 125)])
def test_unexpected_error_is_one_line_and_a_crash_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    code: int,
) -> None:
    monkeypatch.setenv("SANDBOXFS_STATE_DIR", str(tmp_path / "state"))

    def boom(args: object) -> int:
        raise RecursionError("maximum recursion depth exceeded\n" + "x" * 100_000)

    monkeypatch.setitem(cli.COMMANDS, command, boom)
    argv = [command] if command == "status" else [command, "--", "true"]
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 400, err[:1000]
    assert err.startswith("sandboxfs: internal error: RecursionError: maximum recursion depth")
    crash = next((tmp_path / "state").glob("crash-*.txt"))
    assert str(crash) in err
    assert crash.stat().st_mode & 0o777 == 0o600
    assert "Traceback (most recent call last)" in crash.read_text()


def test_cli_never_imports_the_daemon() -> None:
    probe = "import sys, sandboxfs.cli.main; print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyfuse3', 'trio') or m == 'sandboxfs.fuse.daemon'))"  # noqa: E501
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_doctor_runs_without_pyfuse3() -> None:
    """libfuse3 missing at run time: doctor says so in its own check instead of crashing."""
    probe = (
        "import sys; sys.modules['pyfuse3'] = None\n"  # import pyfuse3 now raises ImportError
        "from sandboxfs.cli.main import main\n"
        "sys.exit(main(['doctor', '--json']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert '"pyfuse3"' in result.stdout
    assert result.returncode != 0  # pyfuse3 is a failed check


def test_doctor_imports_pyfuse3_rather_than_locating_it(tmp_path: Path) -> None:
    """A pyfuse3 that is found but fails to import (its libfuse3 gone) is a failed check."""
    broken = tmp_path / "pyfuse3"
    broken.mkdir()
    message = "libfuse3.so.3: cannot open shared object file: No such file or directory"
    (broken / "__init__.py").write_text(f"raise ImportError({message!r})\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [*SANDBOXFS, "doctor", "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert "Traceback" not in result.stderr, result.stderr
    check = next(c for c in json.loads(result.stdout) if c["name"] == "pyfuse3")
    assert not check["ok"], check
    assert message in check["detail"] and "\n" not in check["detail"]
    assert result.returncode == 1


# ----- a state dir that cannot be used -----------------------------------------------------------


def _unusable_state(root: Path, kind: str) -> Path:
    if kind == "/dev/null":
        return Path("/dev/null")
    if kind == "a regular file":
        (root / "state-file").write_text("")
        return root / "state-file"
    (root / "state-ro").mkdir(mode=0o555)
    return root / "state-ro"


@needs_root
@pytest.mark.parametrize(
    ("who", "kind"),
    [
        ("root", "/dev/null"),
        ("root", "a regular file"),
        ("nobody", "/dev/null"),
        ("nobody", "a regular file"),
        ("nobody", "a read-only directory"),
    ],
)
def test_unusable_state_dir_is_one_line_and_leaves_the_log_keyed(
    open_dir: Path, who: str, kind: str
) -> None:
    """`mount` and `run` check the state dir before anything is written: one line (exit 2;
    run's 125), twice in a row, and the project's keyed log still verifies."""
    for name in ("project", "home", "mnt"):
        (open_dir / name).mkdir()
    (open_dir / "project" / "README.md").write_text("readme\n")
    prefix = NOBODY if who == "nobody" else []
    if who == "nobody":
        subprocess.run(["chown", "-R", "65534:65534", str(open_dir)], check=True)
    bad = _unusable_state(open_dir, kind)
    project, mnt = open_dir / "project", open_dir / "mnt"

    def sandboxfs_as(state: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
        env = {"HOME": str(open_dir / "home"), "PATH": "/usr/bin:/bin"}
        env["SANDBOXFS_STATE_DIR"] = str(state)
        return subprocess.run(
            [*prefix, *SANDBOXFS, *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )

    good = open_dir / "state"
    made = sandboxfs_as(good, "mount", mnt, "--project", project)
    assert made.returncode == 0, made.stderr
    assert sandboxfs_as(good, "umount", mnt).returncode == 0
    for command in (["mount", mnt], ["run"], ["mount", mnt], ["run"]):
        tail = ["--", "true"] if command == ["run"] else []
        result = sandboxfs_as(bad, *command, "--project", project, *tail)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == (125 if command == ["run"] else 2), result.stderr
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"state directory {bad}" in lines[0] and "SANDBOXFS_STATE_DIR" in lines[0]
        assert not os.path.ismount(mnt)
    verified = sandboxfs_as(good, "audit", "verify", "--project", project)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "keyed" in verified.stdout and "unkeyed" not in verified.stdout, verified.stdout


@pytest.mark.parametrize("name", ["", "cla\nude", "x\x1b[2Jy"])
@pytest.mark.parametrize("command", ["run", "home seed"])
def test_agent_name_empty_or_unprintable_is_one_escaped_line(
    tmp_path: Path, name: str, command: str
) -> None:
    """`--agent ''` is not taken for no profile, and the name is escaped in the one line."""
    project = make_project(tmp_path)
    args = [*command.split(), "--project", str(project), "--agent", name]
    if command == "run":
        args += ["--", "true"]
    result = subprocess.run(
        [*SANDBOXFS, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert result.returncode == (125 if command == "run" else 2), result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "\x1b" not in result.stderr, result.stderr
    assert f"--agent {name!r}:" in lines[0]
    assert "claude" in lines[0]  # the profiles there are
