"""The daemon warms the kernel's cache after mounting (sandboxfs.fuse.warm): the repository's
names and attributes are listed once, so that the first `git status` sends no LOOKUP per file;
the walk is nobody's operation (nothing audited, nobody asked) and lists only what the level lets
every caller list. Requests are counted in the daemon's --debug log, never timed.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from tests.support.cli import sandboxfs, wait_until
from tests.support.mounts import Mount, mounted

FILES = 200


def make_tree(project: Path) -> None:
    for i in range(FILES):
        path = project / f"pkg{i % 8}" / f"sub{i % 3}" / f"mod{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE = {i}\n")
    (project / "secrets").mkdir()
    (project / "secrets" / "token.txt").write_text("hunter2\n")
    (project / "sandboxfs.yaml").write_text("deny:\n  - secrets/\n")


def daemon_log(m: Mount) -> Path:
    return m.project / ".sandbox" / "logs" / f"{m.session}.log"


def warmed(m: Mount) -> str | None:
    found = re.search(r"warmed the kernel's cache: .*", daemon_log(m).read_text(errors="replace"))
    return found.group(0) if found else None


def lookups(m: Mount) -> list[str]:
    text = daemon_log(m).read_text(errors="replace")
    return re.findall(r"request lookup \d+ b'mod\d+\.py'", text)


def test_the_first_stat_of_every_file_is_cached(tmp_path: Path, project: Path) -> None:
    make_tree(project)
    with mounted(tmp_path / "mnt", project, "full", "--debug") as m:
        assert wait_until(lambda: warmed(m) is not None, timeout=20), daemon_log(m).read_text()
        # src/, pkg0-7/, their sub0-2/ and the root; not secrets/ (deny-listed) nor dot-dirs.
        assert f"entries in 34 directories of {m.mnt}/repo" in (warmed(m) or ""), warmed(m)
        # The walk is nobody's operation: no `list` entry, no refusal of secrets/.
        entries = m.audit()
        assert not [e for e in entries if e.get("op") == "list"], entries
        assert not [e for e in entries if e.get("allowed") is False], entries
        for i in range(FILES):
            os.lstat(m.mnt / "repo" / f"pkg{i % 8}" / f"sub{i % 3}" / f"mod{i:03d}.py")
        assert lookups(m) == [], lookups(m)[:5]
        assert sandboxfs("umount", m.mnt).returncode == 0


def test_no_walk_where_the_level_may_not_list_the_repo(tmp_path: Path, project: Path) -> None:
    make_tree(project)
    with mounted(tmp_path / "mnt", project, "session", "--debug") as m:
        os.stat(m.mnt / "session")
        assert "request opendir" not in daemon_log(m).read_text()
        assert warmed(m) is None


def test_umount_waits_for_a_mount_busy_for_a_moment(tmp_path: Path, project: Path) -> None:
    """A program that is about to exit (or a walk past WARM_WAIT) holds the mount for a moment:
    umount tries again instead of calling it busy; one that stays is still reported busy."""
    make_tree(project)
    with mounted(tmp_path / "mnt", project, "full") as m:
        brief = subprocess.Popen(["sleep", "0.7"], cwd=m.mnt / "repo")
        try:
            time.sleep(0.1)  # it is in the mount now
            result = sandboxfs("umount", m.mnt)
            assert result.returncode == 0, result.stderr
        finally:
            brief.wait(timeout=10)
    with mounted(tmp_path / "mnt", project, "full") as m:
        staying = subprocess.Popen(["sleep", "30"], cwd=m.mnt / "repo")
        try:
            time.sleep(0.1)
            result = sandboxfs("umount", m.mnt)
            assert result.returncode != 0 and "is busy" in result.stderr, result
        finally:
            staying.kill()
            staying.wait(timeout=10)
