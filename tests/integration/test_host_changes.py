"""Changes made outside the mount show inside at once, and what did not change stays cached.

The daemon watches the backing directories whose entries the kernel holds (inotify) and has the
kernel forget what a change made stale; entries of a watched directory are then held for
`cache.watched_timeout`, past the plain timeouts. These mounts set the plain timeouts to 30 s
(so that a change showing within a few seconds was reported, not timed out) or to 1 s (so that
an entry still cached after 2 s was held by the watch); requests are counted in the daemon's
--debug log, never timed.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import sh, wait_until
from tests.support.mounts import mounted

SHORT = 3.0  # seconds within which a change outside must show inside


def configure(project: Path, timeout: float, watch: bool = True, warm: bool = True) -> None:
    (project / "sandboxfs.yaml").write_text(
        f"cache: {{entry_timeout: {timeout}, attr_timeout: {timeout},"
        f" watch: {str(watch).lower()}, warm_entries: {50000 if warm else 0}}}\n"
    )


def shows(predicate: Callable[[], bool]) -> bool:
    return wait_until(predicate, timeout=SHORT)


def size(path: Path) -> int:
    return os.stat(path).st_size


@pytest.mark.parametrize("trust", ["full", "workspace"])
def test_changes_outside_show_inside_at_once(tmp_path: Path, project: Path, trust: str) -> None:
    configure(project, 30)
    with mounted(tmp_path / "mnt", project, trust) as m:
        inside = m.mnt / "repo"
        main = inside / "src" / "main.py"
        # Everything below is first seen (and cached for 30 s) inside, then changed outside.
        assert main.read_text() == "print('hello')\n"
        assert not (inside / "src" / "new.py").exists()
        assert sorted(os.listdir(inside / "src")) == ["main.py"]
        readme_mode = os.stat(inside / "README.md").st_mode

        with open(project / "src" / "main.py", "a") as f:  # data
            f.write("print('more')\n")
        assert shows(lambda: size(main) == 29)
        assert main.read_text() == "print('hello')\nprint('more')\n"

        os.chmod(project / "README.md", 0o600)  # attributes
        assert shows(lambda: os.stat(inside / "README.md").st_mode != readme_mode)
        assert os.stat(inside / "README.md").st_mode & 0o777 == 0o600

        (project / "src" / "new.py").write_text("x = 1\n")  # a name the kernel knew absent
        assert shows(lambda: (inside / "src" / "new.py").exists())
        assert (inside / "src" / "new.py").read_text() == "x = 1\n"

        os.rename(project / "src" / "new.py", project / "src" / "renamed.py")
        assert shows(lambda: not (inside / "src" / "new.py").exists())
        assert (inside / "src" / "renamed.py").read_text() == "x = 1\n"

        os.unlink(project / "src" / "renamed.py")
        assert shows(lambda: not (inside / "src" / "renamed.py").exists())
        assert sorted(os.listdir(inside / "src")) == ["main.py"]

        (project / "pkg" / "sub").mkdir(parents=True)  # a new tree
        (project / "pkg" / "sub" / "mod.py").write_text("y = 2\n")
        assert shows(lambda: (inside / "pkg" / "sub" / "mod.py").exists())
        shutil.rmtree(project / "pkg")
        assert shows(lambda: not (inside / "pkg").exists())

        # Replaced outside right after a change inside: what the daemon did is not mistaken
        # for what the host did after it.
        for round_ in range(5):
            if trust == "full":
                (inside / "src" / "made.py").write_text(f"inside {round_}\n")
                os.unlink(project / "src" / "made.py")
                (project / "src" / "made.py").write_text(f"outside {round_} ...\n")
                assert shows(lambda: size(inside / "src" / "made.py") == 14), round_
                assert (inside / "src" / "made.py").read_text() == f"outside {round_} ...\n"


def test_git_sees_an_edit_outside_at_once(tmp_path: Path, project: Path) -> None:
    """`git status` inside (cached stat data) and an edit outside in between."""
    configure(project, 30)
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    past = time.time_ns() - 60 * 10**9  # older than the index: git trusts the stat data
    for path in (project / "README.md", project / "src" / "main.py"):
        os.utime(path, ns=(past, past))
    for cmd in (
        "git init -q -b main",
        "git add README.md src",
        "git -c user.name=t -c user.email=t@example.invalid commit -qm init",
    ):
        assert sh(cmd, cwd=project, env=env).returncode == 0
    with mounted(tmp_path / "mnt", project, "full") as m:
        inside = m.mnt / "repo"
        status = sh("git status --porcelain --untracked-files=no", cwd=inside, env=env)
        assert status.returncode == 0 and status.stdout == "", status.stderr
        (project / "src" / "main.py").write_text("print('edited outside')\n")

        def modified() -> bool:
            out = sh("git status --porcelain --untracked-files=no", cwd=inside, env=env).stdout
            return out == " M src/main.py\n"

        assert shows(modified)


def requests_for(log: Path, name: bytes, ino: int) -> int:
    """LOOKUPs of `name` and GETATTRs of `ino` in a --debug daemon log."""
    text = log.read_text(errors="replace")
    lookups = re.findall(rf"request lookup \d+ {re.escape(repr(name))}", text)
    getattrs = re.findall(rf"request getattr {ino}\b", text)
    return len(lookups) + len(getattrs)


@pytest.mark.parametrize("watch", [True, False])
def test_watched_entries_outlive_the_plain_timeouts(
    tmp_path: Path, project: Path, watch: bool
) -> None:
    configure(project, 1, watch=watch, warm=False)  # the first stat is a request
    with mounted(tmp_path / "mnt", project, "full", "--debug") as m:
        log = project / ".sandbox" / "logs" / f"{m.session}.log"
        main = m.mnt / "repo" / "src" / "main.py"
        ino = os.stat(main).st_ino  # its directory was looked up (and watched) before it
        assert wait_until(lambda: requests_for(log, b"main.py", ino) >= 1, timeout=5)
        before = requests_for(log, b"main.py", ino)
        time.sleep(2.2)  # past the plain timeouts
        os.stat(main)
        os.stat(main)
        time.sleep(0.3)  # the log is written as requests are answered
        asked = requests_for(log, b"main.py", ino) - before
        assert asked == (0 if watch else 1), log.read_text(errors="replace")[-3000:]


# ----- a key written into a file open inside ------------------------------------------------------

CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIIE" + "A" * 8000 + "\n-----END PRIVATE KEY-----\n"
MMAP_READ = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print(os.pread(fd, 64, 0).decode(), flush=True)
sys.stdin.readline()  # the key is written now
size = os.fstat(fd).st_size
try:
    data = mmap.mmap(fd, size, prot=mmap.PROT_READ)[:size]
    print("read:", "PRIVATE KEY" in data.decode(), flush=True)
except OSError as exc:
    print("refused:", exc.errno, flush=True)
"""


@pytest.mark.parametrize("watch", [True, False])
def test_a_key_written_under_an_open_descriptor_is_refused(
    tmp_path: Path, project: Path, watch: bool
) -> None:
    """A .pem opened while it held a certificate: after the user's own tool writes a key into
    it (in place, outside), reading through that descriptor is refused and audited, as a fresh
    open is; a mapping made after it never shows the key (SIGBUS, or nothing)."""
    import signal
    import subprocess
    import sys

    configure(project, 1, watch=watch)
    (project / "cert.pem").write_text(CERT)
    with mounted(tmp_path / "mnt", project, "workspace") as m:
        inside = m.mnt / "repo" / "cert.pem"
        fd = os.open(inside, os.O_RDONLY)
        try:
            assert os.pread(fd, 64, 0).decode().startswith("-----BEGIN CERTIFICATE")
            with open(project / "cert.pem", "r+") as f:  # in place: the same inode
                f.write(KEY)
            assert shows(lambda: os.fstat(fd).st_size == len(KEY))
            with pytest.raises(PermissionError):
                os.pread(fd, 64, 4096)  # past what the kernel held
            with pytest.raises(PermissionError):
                os.pread(fd, 64, 0)
        finally:
            os.close(fd)
        with pytest.raises(PermissionError):
            inside.read_text()  # a fresh open, as before

        def refusals() -> int:  # repeated refusals are one entry with a count
            entries = [e for e in m.audit("--denied") if e["path"] == "/repo/cert.pem"]
            return sum(int(e.get("count", 1)) for e in entries if e["op"] == "read")

        assert wait_until(lambda: refusals() >= 3, timeout=SHORT), refusals()

        (project / "cert.pem").write_text(CERT)
        reader = subprocess.Popen(
            [sys.executable, "-c", MMAP_READ, str(inside)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reader.stdin is not None and reader.stdout is not None
        assert reader.stdout.readline().startswith("-----BEGIN CERTIFICATE")
        with open(project / "cert.pem", "r+") as f:
            f.write(KEY)
        assert shows(lambda: size(inside) == len(KEY))
        out, _ = reader.communicate("\n", timeout=30)
        assert reader.returncode == -signal.SIGBUS or out.startswith("refused"), out
        assert "read: True" not in out
