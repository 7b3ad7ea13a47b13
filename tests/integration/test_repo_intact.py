"""On live mounts: a real project stays intact inside, and virtualenvs work.

A repository that tracks a public certificate (`*.pem`), a real private key (`*.key`, made by
openssl) and a `.env.example`: inside at `full`, `git status` is clean and `git commit -am`
after an unrelated edit commits that edit only (nothing looks deleted, nothing is staged for
deletion); the private key and the untracked `.env` stay unreadable and audited; where git would
have to read the key again (its stat data changed outside), it stops with `Permission denied`
and stages nothing. `python3 -m venv` + `pip install` of a local wheel (carrying a certificate)
works in /repo at full, in /workspace at session and in /session at untrusted: the lowest level
that may write each zone.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh
from tests.support.git import GIT_ENV, git
from tests.support.mounts import Mount

OPENSSL = shutil.which("openssl")
pytestmark = [
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
    pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed"),
]

FIXTURES = ("tests/certs/server.pem", "tests/certs/client.key", ".env.example")


def fixture_repo(root: Path) -> Path:
    """A committed repository with a public certificate, a real private key, a template and
    an ignored `.env`, as a user's project would have them; its index is clean and not racy
    (the files are older than the index, as in any checkout that is not brand new)."""
    assert OPENSSL is not None
    project = root / "fixture"
    certs = project / "tests" / "certs"
    certs.mkdir(parents=True)
    subprocess.run(
        [
            OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", "client.key", "-out", "server.pem", "-days", "1", "-subj", "/CN=t",
        ],
        cwd=certs, check=True, capture_output=True,
    )  # fmt: skip
    (project / "README.md").write_text("# fixture\n")
    (project / "src").mkdir()
    (project / "src" / "app.py").write_text("print('app')\n")
    (project / ".env.example").write_text("API_KEY=\n")
    (project / ".env").write_text("API_KEY=real-secret\n")
    (project / ".gitignore").write_text(".env\n.sandbox/\n")
    old = time.time() - 3600
    for path in project.rglob("*"):
        os.utime(path, (old, old))
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "fixtures"]):
        result = git(project, *cmd)
        assert result.returncode == 0, result.stderr
    assert git(project, "status", "--porcelain").stdout == ""
    return project


def inside(m: Mount, command: str) -> subprocess.CompletedProcess[str]:
    return sh(command, cwd=m.mnt / "repo", env=GIT_ENV)


def tracked(project: Path) -> list[str]:
    return git(project, "ls-files").stdout.split()


def test_git_at_full_sees_deny_listed_files_unchanged(
    mount_at: Callable[..., Any], tmp_path: Path
) -> None:
    project = fixture_repo(tmp_path)
    before = tracked(project)
    assert set(FIXTURES) <= set(before)
    with mount_at("full", proj=project) as m:
        repo = m.mnt / "repo"
        status = inside(m, "git status --porcelain")
        assert (status.returncode, status.stdout, status.stderr) == (0, "", "")
        # Listed, with their real attributes; the contents of the key only are refused.
        assert (
            os.stat(repo / "tests/certs/client.key").st_ino
            == os.stat(project / "tests/certs/client.key").st_ino
        )
        assert "BEGIN CERTIFICATE" in (repo / "tests/certs/server.pem").read_text()
        assert (repo / ".env.example").read_text() == "API_KEY=\n"
        for secret in ("tests/certs/client.key", ".env"):
            read = inside(m, f"cat {secret}")
            assert read.returncode != 0 and "Permission denied" in read.stderr, read
        # An unrelated edit, committed with -a: only the edit is committed.
        (repo / "README.md").write_text("# fixture, edited\n")
        commit = inside(m, "git commit -qam edit")
        assert commit.returncode == 0, commit.stderr
        changed = inside(m, "git show --name-status --format= HEAD").stdout.split()
        assert changed == ["M", "README.md"]
        for command in ("git add -A", "git add -u", "git commit -qam again"):
            inside(m, command)
        assert inside(m, "git diff --cached --name-status HEAD").stdout == ""
        assert inside(m, "git status --porcelain").stdout == ""
        key_denials = [
            e
            for e in m.audit("--denied")
            if e["path"] == "/repo/tests/certs/client.key" and e["op"] == "read"
        ]
        assert key_denials and "holds a private key" in key_denials[0]["reason"]
        assert key_denials[0]["errno"] == "EACCES"
        env = [e for e in m.audit("--denied") if e["path"] == "/repo/.env"]
        assert env and "deny pattern '.env'" in env[0]["reason"]
    # Outside: nothing deleted, nothing untracked, two commits.
    assert tracked(project) == before
    assert git(project, "status", "--porcelain").stdout == ""
    assert len(git(project, "log", "--format=%H").stdout.split()) == 2
    assert "BEGIN PRIVATE KEY" in (project / "tests/certs/client.key").read_text()


def test_git_cannot_stage_a_key_it_may_not_read(
    mount_at: Callable[..., Any], tmp_path: Path
) -> None:
    """When the key's stat data no longer match the index (touched outside), git inside would
    have to read it: it shows the file modified (never deleted), and `add`/`commit -a` stop
    with `Permission denied`, staging nothing. A `git status` outside refreshes the index."""
    project = fixture_repo(tmp_path)
    # Touched outside: git must hash it again. (An older time than the index's: git without
    # USE_NSEC, as Debian builds it, also hashes again a file written in the same second as
    # the index, until a later `git status` outside writes the index again.)
    touched = time.time() - 1800
    os.utime(project / "tests/certs/client.key", (touched, touched))
    head = git(project, "rev-parse", "HEAD").stdout
    with mount_at("full", proj=project) as m:
        status = inside(m, "git status --porcelain")
        assert status.stdout == " M tests/certs/client.key\n", status
        (m.mnt / "repo" / "README.md").write_text("# edited\n")
        for command in ("git add -A", "git add tests/certs", "git commit -qam edit"):
            result = inside(m, command)
            assert result.returncode != 0, (command, result)
            assert "Permission denied" in result.stderr, (command, result.stderr)
        assert inside(m, "git diff --cached --name-status").stdout == ""
        assert git(project, "rev-parse", "HEAD").stdout == head
        (m.mnt / "repo" / "README.md").write_text("# fixture\n")
        os.utime(project / "README.md", (time.time() - 3600,) * 2)
        assert git(project, "status", "--porcelain").stdout == ""  # refreshed outside
        assert inside(m, "git status --porcelain").stdout == ""
    assert git(project, "ls-files").stdout.split() == tracked(project)
    assert "BEGIN PRIVATE KEY" in (project / "tests/certs/client.key").read_text()


# ----- virtualenvs and pip ------------------------------------------------------------------------


def make_wheel(directory: Path, cert: bytes) -> Path:
    """A pure-Python wheel whose package carries a certificate (`ca.pem`), built by hand."""
    name, version = "demo_pkg", "0.1"
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{name}/ca.pem": cert,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


@pytest.mark.parametrize(
    ("trust", "where"),
    [("full", "repo"), ("session", "workspace/data"), ("untrusted", "session/working")],
)
@pytest.mark.timeout(480)  # venv and pip install may take 180 s each
def test_venv_and_pip_install_of_a_local_wheel(
    mount_at: Callable[..., Any], tmp_path: Path, trust: str, where: str
) -> None:
    """ensurepip installs pip's vendored certifi/cacert.pem (a public CA bundle, refused by
    name before), and pip reads it; a wheel with a certificate installs and is importable."""
    try:
        import ensurepip  # noqa: F401
    except ImportError:
        pytest.skip("this Python has no ensurepip")
    project = fixture_repo(tmp_path)
    wheel = make_wheel(tmp_path, (project / "tests/certs/server.pem").read_bytes())
    with mount_at(trust, proj=project) as m:
        venv = m.mnt / where / "venv"
        made = sh(f"{sys.executable} -m venv {venv}", timeout=180)
        assert made.returncode == 0, made.stderr
        python = venv / "bin" / "python"
        bundle = sh(
            f"{python} -c 'import pip._vendor.certifi as c; print(len(open(c.where()).read()))'"
        )
        assert bundle.returncode == 0 and int(bundle.stdout) > 10_000, bundle
        install = sh(
            f"{python} -m pip install -q --no-index --no-cache-dir --disable-pip-version-check "
            f"{wheel}",
            timeout=180,
        )
        assert install.returncode == 0, install.stderr
        use = sh(
            f'{python} -c "import demo_pkg, importlib.resources as r; '
            f"print(demo_pkg.VALUE, 'BEGIN CERTIFICATE' in "
            f"r.files('demo_pkg').joinpath('ca.pem').read_text())\""
        )
        assert use.stdout.split() == ["42", "True"], use
        refused = [e for e in m.audit("--denied") if "/venv/" in (e["path"] or "")]
        assert refused == [], refused


NPM = shutil.which("npm")


def test_a_fresh_clone_tracking_package_manager_configs_looks_unchanged(
    mount_at: Callable[..., Any], tmp_path: Path
) -> None:
    """`.npmrc` and `pip.conf` without a credential are config the project's tools read: in a
    brand-new clone (its index racy, so git must read every file) they are not shown modified,
    `git stash` works and npm reads the project's settings; a token written into one is
    refused, and the refusal names its key, never its value."""
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / ".npmrc").write_text("package-lock=false\n//registry.example/:_authToken=${TOK}\n")
    (origin / "pip.conf").write_text("[global]\nindex-url = https://pypi.example/simple\n")
    (origin / "package.json").write_text('{"name": "x", "version": "1.0.0"}\n')
    (origin / "README.md").write_text("# x\n")
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "configs"]):
        assert git(origin, *cmd).returncode == 0
    project = tmp_path / "clone"
    assert git(tmp_path, "clone", "-q", str(origin), str(project)).returncode == 0
    token = "npm_s3cretTokenValue0123456789"
    (project / "app").mkdir()
    (project / "app" / ".npmrc").write_text(f"//registry.npmjs.org/:_authToken={token}\n")
    with mount_at("full", proj=project) as m:
        repo = m.mnt / "repo"
        status = inside(m, "git status --porcelain")
        assert (status.returncode, status.stdout, status.stderr) == (0, "?? app/\n", "")
        assert (repo / ".npmrc").read_text().startswith("package-lock=false\n")
        assert "index-url" in (repo / "pip.conf").read_text()
        (repo / "README.md").write_text("# x, edited\n")
        stash = inside(m, "git stash -q && git stash pop -q && git status --porcelain")
        assert (stash.returncode, stash.stdout) == (0, " M README.md\n?? app/\n"), stash
        if NPM is not None:
            npm = sh("npm config get package-lock", cwd=repo, env={"HOME": str(tmp_path)})
            assert (npm.returncode, npm.stdout.strip()) == (0, "false"), npm
        read = inside(m, "cat app/.npmrc")
        assert read.returncode != 0 and "Permission denied" in read.stderr, read
        denied = [e for e in m.audit("--denied") if e["path"] == "/repo/app/.npmrc"]
        assert denied and "a credential (a value for '_authToken')" in denied[0]["reason"]
        assert "refused when their contents hold a credential" in denied[0]["reason"]
        assert all(token not in str(entry) for entry in m.audit())
    assert git(project, "status", "--porcelain").stdout == " M README.md\n?? app/\n"
