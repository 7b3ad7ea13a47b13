"""Installing sandboxfs as a user would: pip from a root-owned, read-only checkout by an ordinary
user, and .ci/setup's account of what it changed on the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
ROOT = os.geteuid() == 0
NOBODY = 65534
# As root the installing user is nobody; otherwise it is the (ordinary) user running the tests.
AS_USER = (
    ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if ROOT else []
)
# What pip prints when it cannot reach a package index at all.
OFFLINE = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ProxyError",
)
SHIPS_DEFAULTS = (
    "import sandboxfs, importlib.resources as r; "
    "print(r.files('sandboxfs').joinpath('defaults.yaml').is_file(), sandboxfs.__file__)"
)
UNSHARE = ["unshare", "--mount", "--propagation", "private"]


def run(
    argv: list[str], timeout: float = 120, env: dict[str, str] | None = None, cwd: str = "/"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def tree(root: Path) -> set[str]:
    return {
        str(Path(d, name).relative_to(root))
        for d, dirs, files in os.walk(root)
        for name in dirs + files
    }


@pytest.fixture(scope="module")
def world() -> Iterator[Path]:
    """A directory under /tmp that an ordinary user can traverse (pytest's tmp dirs are 0700)."""
    top = Path(tempfile.mkdtemp(prefix="sandboxfs-install-", dir="/tmp"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        run(["chmod", "-R", "u+w", str(top)])
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def wheelhouse(world: Path) -> Path:
    """Wheels of the build backend and the dependencies, so that the install itself needs no
    network: built once with the ordinary pip client (its cache, else the package index)."""
    wheels = world / "wheelhouse"
    # editables: what hatchling asks for to build an editable install.
    wanted = [
        *PYPROJECT["build-system"]["requires"],
        "editables",
        *PYPROJECT["project"]["dependencies"],
    ]
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check"]
    built = run([*pip_wheel, "--retries", "1", "--timeout", "15", "-w", str(wheels), *wanted], 600)
    if built.returncode != 0:
        output = built.stdout + built.stderr
        if any(marker in output for marker in OFFLINE):
            pytest.skip(
                "the package index is unreachable and pip's cache could not build the wheels of "
                f"{', '.join(wanted)}: {output.strip().splitlines()[-1]}"
            )
        pytest.fail(f"pip wheel {' '.join(wanted)} failed:\n{output[-3000:]}")
    wheels.chmod(0o755)
    return wheels


@pytest.fixture(scope="module")
def checkout(world: Path) -> Path:
    """The repository's files (tracked, and new ones not ignored), copied root-owned and
    read-only; as non-root, owned by the test user but read-only all the same."""
    git = ["git", "-c", f"safe.directory={REPO}", "-C", str(REPO)]
    listed = run([*git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    if listed.returncode == 0:
        names = set(filter(None, listed.stdout.split("\0")))
    else:  # not a git work tree (an unpacked archive): what a build reads
        names = {"pyproject.toml", "README.md", "LICENSE"} | {
            str(p.relative_to(REPO))
            for p in (REPO / "sandboxfs").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
    source = world / "src"
    for name in sorted(names):
        path = REPO / name
        if not path.exists() and not path.is_symlink():
            continue  # deleted in the work tree, not yet in the index
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            target.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, target)
    run(["chmod", "-R", "a+rX,a-w", str(source)])
    if ROOT:
        run(["chown", "-R", "-h", "0:0", str(source)])
    return source


@pytest.fixture(scope="module")
def home(world: Path) -> Path:
    """The installing user's own home, where the venv goes."""
    path = world / "home"
    path.mkdir()
    if ROOT:
        os.chown(path, NOBODY, NOBODY)
    return path


def user_env(home: Path) -> dict[str, str]:
    # No pip configuration of this machine: the install must come from the wheelhouse alone.
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": str(home),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
        "LC_ALL": "C.UTF-8",
    }


def base_python() -> str:
    """The interpreter the repo's venv is made from (the wheelhouse's ABI), if the installing
    user can run it; else the system's."""
    base = getattr(sys, "_base_executable", sys.executable)
    if ROOT and not os.access(base, os.X_OK):
        return "/usr/bin/python3"
    probe = run([*AS_USER, base, "-c", ""])
    return base if probe.returncode == 0 else "/usr/bin/python3"


# The module's wheelhouse (up to 600 s) may be built in this test's set-up, then two 300 s installs.
@pytest.mark.timeout(1500)
def test_ordinary_user_installs_from_a_read_only_checkout(
    checkout: Path, wheelhouse: Path, home: Path
) -> None:
    before = tree(checkout)
    env = user_env(home)
    venv = home / "venv"
    made = run([*AS_USER, base_python(), "-m", "venv", str(venv)], env=env, cwd=str(home))
    assert made.returncode == 0, made.stderr
    pip = [*AS_USER, str(venv / "bin" / "pip"), "install", "-v", "--no-index"]
    pip += ["--find-links", str(wheelhouse)]

    installed = run([*pip, str(checkout)], timeout=300, env=env, cwd=str(home))
    assert installed.returncode == 0, (installed.stdout + installed.stderr)[-3000:]
    output = installed.stdout + installed.stderr
    assert "deprecat" not in output.lower(), [
        line for line in output.splitlines() if "deprecat" in line.lower()
    ]
    assert not [
        line for line in output.splitlines() if "warn" in line.lower() and "licen" in line.lower()
    ]

    version = run([*AS_USER, str(venv / "bin" / "sandboxfs"), "--version"], env=env, cwd=str(home))
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"sandboxfs {VERSION}"
    data = run(
        [*AS_USER, str(venv / "bin" / "python"), "-c", SHIPS_DEFAULTS],
        env=env,
        cwd=str(home),
    )
    assert data.returncode == 0, data.stderr
    shipped, module = data.stdout.split()
    assert shipped == "True"
    assert module.startswith(str(venv)), module  # the installed copy, not the checkout

    # An editable install (what .ci/setup makes in .venv) writes nothing into the checkout either.
    editable = run([*pip, "-e", str(checkout)], timeout=300, env=env, cwd=str(home))
    assert editable.returncode == 0, (editable.stdout + editable.stderr)[-3000:]
    data = run(
        [
            *AS_USER,
            str(venv / "bin" / "python"),
            "-c",
            "import sandboxfs; print(sandboxfs.__file__)",
        ],
        env=env,
        cwd=str(home),
    )
    assert data.returncode == 0, data.stderr
    assert data.stdout.strip() == str(checkout / "sandboxfs" / "__init__.py")
    version = run([*AS_USER, str(venv / "bin" / "sandboxfs"), "--version"], env=env, cwd=str(home))
    assert version.stdout.strip() == f"sandboxfs {VERSION}", version.stderr

    after = tree(checkout)
    assert after == before, sorted(after ^ before)
    assert not [p for p in after if p.endswith(".egg-info") or p.split("/")[0] in {"build", "dist"}]


# ----- .ci/setup ----------------------------------------------------------------------------------

SETUP = ["bash", str(REPO / ".ci" / "setup")]


def report(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The closing report: the lines after the "ready" line."""
    lines = result.stdout.strip().splitlines()
    ready = max(
        i
        for i, line in enumerate(lines)
        if line.startswith("sandboxfs setup: ") and " ready " in line
    )
    return lines[ready + 1 :]


@pytest.mark.timeout(1080)  # its two set-up runs may take 900 s and 120 s
def test_setup_says_what_it_changed_and_a_second_run_changes_nothing() -> None:
    first = run([*SETUP, "--test", "--system-only"], timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    changes = report(first)
    assert changes, first.stdout
    if changes != ["sandboxfs setup: nothing changed on this machine"]:
        assert all(line.startswith("sandboxfs setup: changed: ") for line in changes), changes

    second = run([*SETUP, "--test", "--system-only"], timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert report(second) == ["sandboxfs setup: nothing changed on this machine"], second.stdout
    assert second.stdout.strip().splitlines()[-2].startswith("sandboxfs setup: system ready for ")


@pytest.mark.skipif(not ROOT, reason="needs root (a private mount namespace)")
@pytest.mark.skipif(not Path("/etc/fuse.conf").is_file(), reason="fuse3 is not installed")
@pytest.mark.timeout(2760)  # three set-up runs of up to 900 s each
def test_setup_edits_fuse_conf_only_when_asked(tmp_path: Path) -> None:
    # A stand-in /etc/fuse.conf lacking user_allow_other, bound over the real one in a private
    # mount namespace: the machine's own file is never touched.
    conf = tmp_path / "fuse.conf"
    original = "# mount_max = 1000\n#user_allow_other\n\n# last line\n"
    conf.write_text(original)

    def setup(*flags: str) -> subprocess.CompletedProcess[str]:
        script = 'mount --bind "$1" /etc/fuse.conf && shift && exec "$@"'
        return run(
            [*UNSHARE, "sh", "-c", script, "sh", str(conf), *SETUP, *flags, "--system-only"],
            timeout=900,
        )

    mount_path = setup()
    assert mount_path.returncode == 0, mount_path.stdout + mount_path.stderr
    assert conf.read_text() == original
    assert not [line for line in report(mount_path) if "fuse.conf" in line]

    asked = setup("--allow-other")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    assert conf.read_text() == original.replace("#user_allow_other", "user_allow_other")
    assert (
        "sandboxfs setup: changed: /etc/fuse.conf: enabled user_allow_other "
        "(non-root users may mount with --allow-other)"
    ) in report(asked)

    again = setup("--allow-other")
    assert again.returncode == 0, again.stdout + again.stderr
    assert report(again) == ["sandboxfs setup: nothing changed on this machine"]
    assert conf.read_text().count("user_allow_other") == 1
