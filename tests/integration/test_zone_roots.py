"""A project zone cannot be pointed at a host directory, on real mounts.

The attack: at trust full, `rm -rf /sandbox/repo/docs && ln -s /tmp/outside /sandbox/repo/docs`,
after which the next sandbox's zone `docs` showed a host directory (the zone's path was resolved
following links). Now a zone's directory (and each directory above it) cannot be removed,
renamed or replaced through /repo at any trust level, audited; and a zone inside the project is
opened without following any link, so a link there, made by anyone, stops `mount` and `run` with
one line naming the zone and the component.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxfs.core.syscalls import renameat2
from tests.support.cli import assert_one_line_error, sandboxfs, sh
from tests.support.mounts import make_project, mounted
from tests.support.zones import denial, failed, is_mounted, ok

CONFIG = """\
zones:
  docs:
    path: docs
    permissions:
      untrusted: rl
  deep:
    path: a/b
    permissions:
      untrusted: rl
"""
SECRET = "a host file outside the project\n"
RENAME_EXCHANGE = 2
needs_bwrap = pytest.mark.skipif(not os.path.exists("/usr/bin/bwrap"), reason="run needs bwrap")


@pytest.fixture
def place() -> Iterator[Path]:
    """Outside pytest's tmp dirs, as test_zones_limits: a concurrent pytest session's sweep of
    old "pytest-of-" directories must not remove a live mount's project."""
    with tempfile.TemporaryDirectory(prefix="sandboxfs-zone-roots-") as tmp:
        yield Path(tmp)


@pytest.fixture
def project(place: Path) -> Path:
    project = make_project(place)
    (project / "docs").mkdir()
    (project / "docs" / "notes.txt").write_text("the project's notes\n")
    (project / "a" / "b").mkdir(parents=True)
    (project / "a" / "b" / "deep.txt").write_text("deep\n")
    (project / "sandboxfs.yaml").write_text(CONFIG)
    return project


@pytest.fixture
def outside(place: Path) -> Path:
    target = place / "outside"
    (target / "b").mkdir(parents=True)
    (target / "notes.txt").write_text(SECRET)
    (target / "b" / "deep.txt").write_text(SECRET)
    return target


def sandboxfs_mounts() -> list[str]:
    state = os.environ["SANDBOXFS_STATE_DIR"]
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    return [line for line in mounts if "fuse.sandboxfs" in line and state in line]


# ----- (a) the sandbox cannot remove, rename or replace a zone's directory through /repo ---------


def test_zone_dir_cannot_be_removed_renamed_or_replaced_through_repo(
    place: Path, project: Path, outside: Path
) -> None:
    with mounted(place / "mnt", project, "full") as m:
        repo = m.mnt / "repo"
        # The reproduction, as the agent typed it: the zone's contents go, its directory stays.
        failed(
            sh(f"rm -rf {repo}/docs && ln -s {outside} {repo}/docs"),
            "cannot remove '" + f"{repo}/docs': Device or resource busy",
        )
        denial(m, "/repo/docs", "EBUSY", "delete")
        failed(sh(f"rmdir {repo}/a/b"), "Device or resource busy")
        denial(m, "/repo/a/b", "EBUSY", "delete")
        # Renamed away, or a directory above it renamed away.
        failed(sh(f"mv {repo}/docs {repo}/moved"), "Device or resource busy")
        denial(m, "/repo/docs", "EBUSY", "rename")
        failed(sh(f"mv {repo}/a {repo}/a2"), "Device or resource busy")
        denial(m, "/repo/a", "EBUSY", "rename")
        # Replaced: an empty directory renamed onto it (docs is empty now), or exchanged with it.
        ok(sh(f"mkdir {repo}/empty {repo}/swap"))
        failed(sh(f"mv -T {repo}/empty {repo}/docs"), "Device or resource busy")
        fd = os.open(repo, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(OSError) as info:
                renameat2(fd, b"swap", fd, b"a", RENAME_EXCHANGE)
            assert info.value.errno == errno.EBUSY
        finally:
            os.close(fd)
        denial(m, "/repo/a", "EBUSY", "rename")
        entry = denial(m, "/repo/docs", "EBUSY", "rename")
        assert "is the directory of zone docs" in entry["reason"], entry
        assert "at any trust level" in entry["reason"], entry
        # What is inside still changes where the level allows, through /repo and the zone.
        ok(sh(f"echo new > {repo}/docs/new.txt && mv {repo}/docs/new.txt {repo}/docs/n.txt"))
        assert ok(sh(f"cat {m.mnt}/docs/n.txt")) == "new\n"
        ok(sh(f"rm {repo}/a/b/deep.txt"))
    assert (project / "docs").is_dir() and not (project / "docs").is_symlink()
    assert (project / "a" / "b").is_dir() and not (project / "a").is_symlink()
    assert sorted(p.name for p in (project / "docs").iterdir()) == ["n.txt"]
    assert sorted(p.name for p in outside.iterdir()) == ["b", "notes.txt"]


@needs_bwrap
def test_run_at_full_cannot_repoint_the_zone_for_the_next_run(project: Path, outside: Path) -> None:
    """The issue's reproduction with `run`, end to end."""
    attack = sandboxfs(
        "run", "--quiet", "--project", project, "--trust", "full", "--",
        "sh", "-c", f"rm -rf /sandbox/repo/docs; ln -sfn {outside} /sandbox/repo/docs; "
        f"mv /sandbox/repo/a /sandbox/repo/a2 || true",
    )  # fmt: skip
    assert "Device or resource busy" in attack.stderr, attack.stderr
    assert not (project / "docs").is_symlink()
    read = sandboxfs(
        "run", "--quiet", "--project", project, "--trust", "untrusted", "--",
        "sh", "-c", "cat /sandbox/docs/notes.txt /sandbox/deep/deep.txt",
    )  # fmt: skip
    assert SECRET not in read.stdout, read.stdout
    assert read.stdout == "deep\n", (read.stdout, read.stderr)
    assert not sandboxfs_mounts()


# ----- (b) and (c): a link on the way to a zone inside the project stops mount and run ---------


@pytest.mark.parametrize(
    ("zone", "link", "needle"),
    [
        ("docs", "docs", "'docs' in the project is a symbolic link"),  # (b) the zone itself
        ("deep", "a", "'a' in the project is a symbolic link"),  # (c) a directory above it
    ],
)
def test_link_on_the_way_to_a_zone_stops_mount_and_run(
    place: Path, project: Path, outside: Path, zone: str, link: str, needle: str
) -> None:
    """Whoever made the link (the user, a tool, an earlier sandbox before this fix)."""
    moved = place / "moved"
    (project / link).rename(moved)
    (project / link).symlink_to(outside)
    mnt = place / "mnt"
    mnt.mkdir()
    result = sandboxfs("mount", mnt, "--project", project, "--trust", "untrusted")
    try:
        line = assert_one_line_error(
            result, f"{project}/sandboxfs.yaml", f"zones.{zone}.path", needle, str(outside)
        )
        assert "without following links" in line
        assert not is_mounted(mnt)
        assert not any(mnt.iterdir())
    finally:
        if is_mounted(mnt):
            sandboxfs("umount", mnt)
    if os.path.exists("/usr/bin/bwrap"):
        marker = place / "ran"
        result = sandboxfs(
            "run", "--project", project, "--trust", "untrusted", "--", "touch", marker
        )
        lines = result.stderr.strip().splitlines()
        # docs/concepts.md: exit 2, `run`: 125
        assert result.returncode == 125, (result.returncode, result.stderr)
        assert len(lines) == 1 and needle in lines[0], result.stderr
        assert "Traceback" not in result.stderr
        assert not marker.exists()
        assert not sandboxfs_mounts()
    # A link to a directory inside the project is refused too: none is followed there.
    (project / link).unlink()
    (project / link).symlink_to(moved if link == "docs" else project / "src")
    result = sandboxfs("mount", mnt, "--project", project, "--trust", "untrusted")
    try:
        assert_one_line_error(result, f"zones.{zone}.path", needle)
        assert not is_mounted(mnt)
    finally:
        if is_mounted(mnt):
            sandboxfs("umount", mnt)
    assert sorted(p.name for p in outside.iterdir()) == ["b", "notes.txt"]
