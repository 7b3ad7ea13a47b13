"""Secrets, the state dir, protected files and other mounts stay out of reach on storage that
folds case, whatever the spelling.

The storage is `casefold_fs.py`, a case-insensitive, case-preserving passthrough FUSE filesystem
(this kernel cannot mount an ext4 casefold image): the project lives inside it, the sandboxfs
mountpoint outside it (except for the mount that is inside the project on purpose). Every access
runs in a child process with a timeout, and every mount is undone in `finally`, the sandboxfs
mounts before the storage under them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.core.syscalls import lstat_at
from tests.support.bounded import (
    EACCES_TEXT,
    ENOENT_TEXT,
    Hang,
    Live,
    is_mountpoint,
    run,
    sandbox_mount,
    wait_or_kill,
)
from tests.support.cli import SANDBOXFS

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (FUSE mounts of the test's own)"),
    pytest.mark.skipif(shutil.which("fusermount3") is None, reason="fusermount3 is not installed"),
]

CASEFOLD_FS = Path(__file__).with_name("casefold_fs.py")
EROFS_TEXT = "Read-only file system"
SECRET = "API_KEY=secret\n"
CONFIG = "deny:\n  - config/production.yaml\n"
# What the private key holds (assembled here, so no scanner mistakes the test for a leak).
KEY_TEXT = "-----BEGIN " + "OPENSSH PRIVATE KEY-----\nprivate\n"
# Spellings of names that exist (as .env, id_rsa, .ssh/, config/production.yaml) whose contents
# must be refused through a mount at every trust level, `full` included...
REFUSED = (".ENV", ".Env", "ID_RSA", ".SSH/config", "CONFIG/Production.YAML")
# ... and of the state dir, which must look absent.
SPELLINGS = (".SANDBOX/audit.jsonl", ".Sandbox")
SHOWN = {".env", "id_rsa", ".ssh"}  # case-folded names `ls -a /repo` shows
HIDDEN = {".sandbox"}  # and must not show


@pytest.fixture
def casefold(tmp_path: Path) -> Iterator[Path]:
    """A casefold_fs mount over an empty directory; ended with SIGTERM (then SIGKILL) and a
    lazy unmount in `finally`."""
    source, top = tmp_path / "source", tmp_path / "casefold"
    source.mkdir()
    top.mkdir()
    log = tmp_path / "casefold.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(CASEFOLD_FS), str(source), str(top)],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 10
        while not is_mountpoint(top):
            assert proc.poll() is None, f"casefold_fs exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"casefold_fs did not mount: {log.read_text()}"
            time.sleep(0.02)
        yield top
    finally:
        proc.send_signal(signal.SIGTERM)
        wait_or_kill(proc)
        if is_mountpoint(top):
            with suppress(Hang):
                run(["fusermount3", "-u", "-z", top])
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture
def project(casefold: Path) -> Path:
    """The project, written through the case-folding storage."""
    p = casefold / "p"
    (p / ".ssh").mkdir(parents=True)
    (p / "config").mkdir()
    (p / "README.md").write_text("# p\n")
    (p / ".env").write_text(SECRET)
    (p / "id_rsa").write_text(KEY_TEXT)
    (p / ".ssh" / "config").write_text("Host *\n")
    (p / "config" / "production.yaml").write_text("password: hunter2\n")
    (p / "config" / "staging.yaml").write_text("fine: yes\n")
    (p / "sandboxfs.yaml").write_text(CONFIG)
    return p


def fails_with(result: subprocess.CompletedProcess[str], text: str) -> str | None:
    """None when the command failed with `text` on stderr, else what happened instead."""
    if result.returncode != 0 and text in result.stderr:
        return None
    return (
        f"{' '.join(map(str, result.args))}: expected {text!r}, got rc={result.returncode} "
        f"stdout={result.stdout[:200]!r} stderr={result.stderr.strip()[:300]!r}"
    )


@contextmanager
def respelled(mountpoint: Path) -> Iterator[None]:
    """On the way out, look `mountpoint` up by its own spelling again.

    The kernel keeps one dentry per directory inode: a lookup of another spelling (`MNT`) on
    storage that folds case in its FUSE server moves the mountpoint's dentry to that name, and
    the mount table then names the mount `.../MNT` until `mnt` is looked up again (ext4 casefold
    and vfat fold case in the dentry cache too, so there the name stays). Unmounting, by
    `sandboxfs umount` and here alike, finds a mount by its name in the mount table. The lookup
    is a statx(AT_STATX_DONT_SYNC), which sends nothing to the mount itself.
    """
    try:
        yield
    finally:
        fd = os.open(mountpoint.parent, os.O_PATH | os.O_DIRECTORY)
        try:
            with suppress(OSError):
                lstat_at(fd, os.fsencode(mountpoint.name))
        finally:
            os.close(fd)


def assert_none(problems: list[str | None]) -> None:
    found = [p for p in problems if p is not None]
    assert not found, "\n".join(found)


def folded_names(directory: Path) -> list[str]:
    return sorted(name.casefold() for name in os.listdir(directory))


def denied(m: Live) -> list[dict[str, Any]]:
    result = run([*SANDBOXFS, "audit", "--project", m.project, "--denied", "--json"], 30)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_the_storage_folds_case(project: Path) -> None:
    """What the other tests rely on: every spelling reaches the one entry, by one inode; names
    keep their case; creating another spelling of an existing name creates nothing."""
    assert run(["cat", project / ".ENV"]).stdout == SECRET
    assert (project / "CONFIG" / "Production.YAML").read_text() == "password: hunter2\n"
    assert os.stat(project / "ID_RSA").st_ino == os.stat(project / "id_rsa").st_ino
    assert os.stat(project / ".SSH").st_ino == os.stat(project / ".ssh").st_ino
    assert {".env", "id_rsa", ".ssh", "README.md", "config"} <= set(os.listdir(project))
    with pytest.raises(FileExistsError):
        os.open(project / ".Env", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with pytest.raises(FileExistsError):
        (project / "CONFIG").mkdir()
    (project / "Readme.MD").write_text("# p!\n")  # opens README.md
    assert (project / "README.md").read_text() == "# p!\n"
    assert folded_names(project).count("readme.md") == 1


def test_secrets_stay_unreadable_whatever_the_case(tmp_path: Path, project: Path) -> None:
    """At trust `full`: every spelling of a deny-listed name, of a private key and of a `deny:`
    path is shown but its contents refused (EACCES), and each read is audited; the state dir
    looks absent and is left out of listings."""
    assert run(["cat", project / ".ENV"]).stdout == SECRET, "the storage does not fold case"
    problems: list[str | None] = []
    with sandbox_mount(tmp_path / "mnt", project, "full") as m:
        repo = m.mnt / "repo"
        for rel in REFUSED:
            problems.append(fails_with(run(["cat", repo / rel]), EACCES_TEXT))
        for rel in SPELLINGS:
            problems.append(fails_with(run(["cat", repo / rel]), ENOENT_TEXT))
        problems.append(fails_with(run(["stat", repo / ".Sandbox"]), ENOENT_TEXT))
        listed = run(["ls", "-a", repo])
        assert listed.returncode == 0, listed.stderr
        names = {n.casefold() for n in listed.stdout.split()}
        if "readme.md" not in names or HIDDEN & names or not names >= SHOWN:
            problems.append(f"ls -a /repo: {sorted(names)}")
        config = run(["ls", "-a", repo / "CONFIG"]).stdout.split()
        if config.count("staging.yaml") != 1 or config.count("production.yaml") != 1:
            problems.append(f"ls -a /repo/CONFIG: {config}")
        assert run(["cat", repo / "Readme.MD"]).stdout == "# p\n"  # the storage, through it
        entries = denied(m)
    for rel, err in [*((r, "EACCES") for r in REFUSED), *((r, "ENOENT") for r in SPELLINGS)]:
        refused = {e["path"] for e in entries if e["op"] == "read" and e["errno"] == err}
        parts = rel.split("/")
        reached = {"/repo/" + "/".join(parts[: i + 1]) for i in range(len(parts))}
        if not reached & refused:
            problems.append(f"no read/{err} audit entry for /repo/{rel}: {sorted(refused)}")
    assert_none(problems)


def test_no_spelling_creates_or_changes_what_is_refused(tmp_path: Path, project: Path) -> None:
    """Another spelling neither creates a deny-listed name nor the state dir (EACCES), nor
    changes the protected /sandboxfs.yaml (EROFS); the project is left as it was."""
    problems: list[str | None] = []
    with sandbox_mount(tmp_path / "mnt", project, "full") as m:
        repo = m.mnt / "repo"
        before = folded_names(project)  # with the state dir the mount made
        problems.append(fails_with(run(f"echo x > {repo}/.NETRC"), EACCES_TEXT))
        problems.append(fails_with(run(f"echo x > {repo}/Id_Rsa"), EACCES_TEXT))  # a key
        problems.append(fails_with(run(["mkdir", repo / ".SANDBOX"]), EACCES_TEXT))
        problems.append(fails_with(run(f"echo x >> {repo}/SANDBOXFS.YAML"), EROFS_TEXT))
        problems.append(fails_with(run(f"echo x > {repo}/Sandboxfs.Yaml"), EROFS_TEXT))
        denials = [(e["op"], e["path"], e["errno"]) for e in denied(m)]
    for expected in [
        ("write", "/repo/.NETRC", "EACCES"),
        ("write", "/repo/Id_Rsa", "EACCES"),
        ("write", "/repo/.SANDBOX", "EACCES"),
    ]:
        if expected not in denials:
            problems.append(f"not audited: {expected}: {denials}")
    if not any(d[1:] == ("/repo/SANDBOXFS.YAML", "EROFS") for d in denials):
        problems.append(f"not audited: the append to /repo/SANDBOXFS.YAML: {denials}")
    if folded_names(project) != before:
        problems.append(f"the project changed: {before} -> {folded_names(project)}")
    if (project / "sandboxfs.yaml").read_text() != CONFIG:
        problems.append(f"sandboxfs.yaml changed: {(project / 'sandboxfs.yaml').read_text()!r}")
    assert_none(problems)


def test_a_mount_inside_the_project_is_absent_whatever_the_case(
    tmp_path: Path, project: Path
) -> None:
    """A second mount whose mountpoint is in the project: absent through the first mount (a
    mount root) and through itself (its own mountpoint, by identity), in every spelling."""
    problems: list[str | None] = []
    with sandbox_mount(tmp_path / "mnt", project, "full") as outer:
        (project / "mnt").mkdir()
        try:
            with (
                sandbox_mount(project / "mnt", project, "full") as inner,
                respelled(project / "mnt"),
            ):
                # The storage leads every spelling into the mount ...
                assert "repo" in run(["ls", project / "MNT"]).stdout.split()
                # ... which sandboxfs never enters.
                for m in (outer, inner):
                    for name in ("mnt", "MNT", "Mnt"):
                        result = run(["ls", m.mnt / "repo" / name])
                        problems.append(fails_with(result, ENOENT_TEXT))
                    names = run(["ls", "-a", m.mnt / "repo"]).stdout.split()
                    if "README.md" not in names or "mnt" in {n.casefold() for n in names}:
                        problems.append(f"ls -a {m.mnt}/repo: {names}")
                assert outer.context()["session"] == outer.session
                assert inner.context()["session"] == inner.session
        finally:
            with suppress(OSError):
                (project / "mnt").rmdir()
    assert_none(problems)
