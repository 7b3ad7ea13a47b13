"""Project zones' directories: where a zone path leads, walked without following a link once inside
the project, and the guard that keeps the sandbox from removing, renaming or replacing a zone's
directory through /repo. The mount-level attack is in tests/integration/test_zone_roots.py; here the
project layer, the store and the API.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxfs.api import Protected, Sandbox, SandboxSetupError
from sandboxfs.config.model import defaults, load
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.policy import Zone
from sandboxfs.core.store import Store
from sandboxfs.errors import UserError
from sandboxfs.project.zones import (
    project_zone_dirs,
    protected_patterns,
    worker_layers,
    zone_roots_in_repo,
)

ZONED = "zones:\n  docs:\n    path: {path}\n    permissions: {{untrusted: rl}}\n"


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    (project / "docs" / "notes.txt").write_text("inside\n")
    (project / "real" / "b").mkdir(parents=True)
    return project.resolve()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    target = tmp_path / "outside"
    target.mkdir()
    (target / "notes.txt").write_text("a host file outside the project\n")
    return target.resolve()


def zones(project: Path, path: str) -> dict[Zone, Path]:
    (project / "sandboxfs.yaml").write_text(ZONED.format(path=path))
    return project_zone_dirs(project, load(project), "sandboxfs.yaml")


def refused(project: Path, path: str, *needles: str) -> str:
    with pytest.raises(UserError) as info:
        zones(project, path)
    message = info.value.message
    assert "\n" not in message
    for needle in ("sandboxfs.yaml: zones.docs.path", *needles):
        assert needle in message, (needle, message)
    return message


# ----- where a zone path leads ------------------------------------------------------------------


def test_zone_inside_the_project(proj: Path) -> None:
    assert zones(proj, "docs") == {Zone("docs"): proj / "docs"}
    assert zones(proj, "real/b") == {Zone("docs"): proj / "real" / "b"}
    assert zones(proj, str(proj / "real" / "b")) == {Zone("docs"): proj / "real" / "b"}


def test_zone_that_is_a_link_is_refused(proj: Path, outside: Path) -> None:
    """The reproduction's end state: docs replaced by a link to a host directory."""
    (proj / "docs" / "notes.txt").unlink()
    (proj / "docs").rmdir()
    (proj / "docs").symlink_to(outside)
    message = refused(proj, "docs", "'docs' in the project is a symbolic link", str(outside))
    assert "without following links" in message
    # A link to a directory inside the project is refused as well: no link is followed there.
    (proj / "docs").unlink()
    (proj / "docs").symlink_to("real")
    refused(proj, "docs", "'docs' in the project is a symbolic link")


def test_link_in_an_intermediate_component_is_refused(proj: Path, outside: Path) -> None:
    (outside / "b").mkdir()
    (proj / "a").symlink_to(outside)
    refused(proj, "a/b", "'a' in the project is a symbolic link")
    refused(proj, str(proj / "a" / "b"), "'a' in the project is a symbolic link")
    (proj / "a").unlink()
    (proj / "a").symlink_to("real")  # even one that stays inside the project
    refused(proj, "a/b", "'a' in the project is a symbolic link")


def test_dotdot_inside_the_project_is_refused(proj: Path) -> None:
    refused(proj, "real/../docs", "'..'")
    refused(proj, "docs/..", "'..'")


def test_project_entered_through_a_link_outside_is_walked_without_links(
    proj: Path, outside: Path, tmp_path: Path
) -> None:
    """A link of the user's outside the project is followed; once the walk stands in the
    project (here through that link), a link there is refused all the same."""
    alias = tmp_path / "alias"
    alias.symlink_to(proj)
    assert zones(proj, f"{alias}/real/b") == {Zone("docs"): proj / "real" / "b"}
    (outside / "b").mkdir()
    (proj / "a").symlink_to(outside)
    refused(proj, f"{alias}/a/b", "'a' in the project is a symbolic link")


def test_zone_beside_the_project_may_be_reached_through_links(
    proj: Path, outside: Path, tmp_path: Path
) -> None:
    """Outside the project the user's own links are followed, as before."""
    link = tmp_path / "link-to-outside"
    link.symlink_to(outside)
    assert zones(proj, str(link)) == {Zone("docs"): outside}
    assert zones(proj, "../outside") == {Zone("docs"): outside}


def test_existing_checks_keep_their_messages(proj: Path) -> None:
    refused(proj, "nosuch", "does not exist")
    (proj / "file").write_text("x")
    refused(proj, "file", "not a directory")
    refused(proj, ".", "the project itself")
    refused(proj, "..", "contains the project")


def test_zone_passing_through_another_zone_overlaps_it(
    proj: Path, outside: Path, tmp_path: Path
) -> None:
    """A zone beside the project whose path goes through another zone's directory (where the
    sandbox may make links) overlaps that zone, wherever the path then leads."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "sub").symlink_to(outside)
    for first, second in ((shared, shared / "sub"), (shared / "sub", shared)):
        (proj / "sandboxfs.yaml").write_text(
            f"zones:\n  one:\n    path: {first}\n  two:\n    path: {second}\n"
        )
        with pytest.raises(UserError, match="overlaps zone one"):
            project_zone_dirs(proj, load(proj), "sandboxfs.yaml")


def test_workers_path_inside_the_project_follows_no_link(
    proj: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBOXFS_WORKERS_PATH", f"{proj}/real/b:{outside}:{proj}/missing/x")
    assert worker_layers(proj) == [
        proj / ".workers",
        proj / "real" / "b",
        outside,
        proj / "missing" / "x",
    ]
    (proj / "vendor").symlink_to(outside)
    monkeypatch.setenv("SANDBOXFS_WORKERS_PATH", f"{proj}/vendor")
    with pytest.raises(UserError, match="'vendor' in the project is a symbolic link"):
        worker_layers(proj)


def test_config_file_named_through_a_link_protects_both(proj: Path) -> None:
    (proj / "real" / "policy.yaml").write_text("{}\n")
    (proj / "policy.yaml").symlink_to("real/policy.yaml")
    patterns = protected_patterns(proj, defaults(), proj / "policy.yaml")
    assert {"/policy.yaml", "/real/policy.yaml"} <= set(patterns)


# ----- the store opens zones inside the project without following links ------------------------


def test_store_refuses_a_zone_dir_reached_through_a_link(proj: Path, outside: Path) -> None:
    """What project_zone_dirs checked may change before the store opens it (another sandbox
    of the project at work): the store's own open follows no link in the project either."""
    (proj / "a").symlink_to(outside)
    dirs = {
        Zone.SESSION: proj / "real",
        Zone.WORKSPACE: proj / "real",
        Zone.REPO: proj,
        Zone.STAGED: proj / "real",
        Zone("docs"): proj / "a",
    }
    with pytest.raises(SandboxError) as info:
        Store(dirs, [proj / ".workers"], set())
    assert info.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert "zone docs" in info.value.reason
    dirs[Zone("docs")] = proj / "a" / "."
    with pytest.raises(SandboxError):
        Store(dirs, [proj / ".workers"], set())


def test_store_treats_a_workers_layer_through_a_link_as_missing(proj: Path, outside: Path) -> None:
    (proj / "a").symlink_to(outside)
    (proj / ".workers").symlink_to(outside)
    dirs = {z: proj / "real" for z in (Zone.SESSION, Zone.WORKSPACE, Zone.STAGED)}
    store = Store({**dirs, Zone.REPO: proj}, [proj / ".workers", proj / "a"], set())
    try:
        assert store.layer_fds == [-1, -1]
        with pytest.raises(SandboxError) as info:
            store.layer_fd(0, create=True)  # .workers exists (a link): never made through it
        assert info.value.errno == errno.ENOENT
    finally:
        store.close()
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt"]


# ----- the guard: zone directories in /repo are pinned ------------------------------------------


def test_zone_roots_in_repo_lists_each_zone_dir_and_those_above(proj: Path) -> None:
    pinned = zone_roots_in_repo(
        proj,
        {
            Zone.REPO: proj,
            Zone.SESSION: proj / ".sandbox" / "s",
            Zone("docs"): proj / "Docs",
            Zone("deep"): proj / "real" / "b",
            Zone("ext"): proj.parent / "elsewhere",
        },
    )
    assert pinned == {
        "docs": "is the directory of zone docs",
        "real/b": "is the directory of zone deep",
        "real": "holds the directory of zone deep (real/b)",
    }


@pytest.fixture
def sandbox(proj: Path) -> Iterator[Sandbox]:
    (proj / "sandboxfs.yaml").write_text(
        "zones:\n  docs:\n    path: docs\n  deep:\n    path: real/b\n"
    )
    (proj / "real" / "other").mkdir()
    with Sandbox.open(proj, trust="full") as sb:
        yield sb


@pytest.mark.parametrize(
    ("action", "path"),
    [
        ("delete", "/repo/real/b"),
        ("rename", "/repo/docs"),
        ("rename", "/repo/real"),
        ("rename-onto", "/repo/real/b"),
        ("mkdir", "/repo/real/b"),
    ],
)
def test_zone_dir_cannot_be_removed_renamed_or_replaced_through_repo(
    sandbox: Sandbox, proj: Path, action: str, path: str
) -> None:
    if action == "mkdir":  # the directory went missing outside: nothing may take its place
        os.rmdir(proj / "real" / "b")
    with pytest.raises(Protected) as info:
        if action == "delete":
            sandbox.delete(path)
        elif action == "rename":
            sandbox.rename(path, "/repo/moved")
        elif action == "rename-onto":
            sandbox.rename("/repo/real/other", path)
        else:
            sandbox.mkdir(path)
    assert info.value.errno == errno.EBUSY
    assert "directory of zone" in info.value.reason
    assert "at any trust level" in info.value.reason
    entries = [e for e in sandbox.audit_entries() if e["allowed"] is False]
    assert entries[-1]["errno"] == "EBUSY"
    assert entries[-1]["zone"] == "repo"
    assert entries[-1]["path"] in (path, "/repo/real/other")


def test_what_is_inside_a_zone_dir_still_changes_through_repo(sandbox: Sandbox, proj: Path) -> None:
    sandbox.write("/repo/docs/new.txt", "x")
    sandbox.rename("/repo/docs/new.txt", "/repo/docs/renamed.txt")
    sandbox.delete("/repo/docs/renamed.txt")
    sandbox.delete("/repo/docs/notes.txt")
    sandbox.mkdir("/repo/real/sibling")
    sandbox.delete("/repo/real/sibling")
    assert sorted(p.name for p in (proj / "docs").iterdir()) == []


def test_api_refuses_a_zone_that_is_a_link(proj: Path, outside: Path) -> None:
    (proj / "sandboxfs.yaml").write_text(ZONED.format(path="docs"))
    (proj / "docs" / "notes.txt").unlink()
    (proj / "docs").rmdir()
    (proj / "docs").symlink_to(outside)
    with pytest.raises(SandboxSetupError, match="symbolic link"):
        Sandbox.open(proj, trust="untrusted")


def test_default_config_that_is_a_link_protects_its_target(proj: Path) -> None:
    (proj / "docs" / "policy.yaml").write_text("{}\n")
    (proj / "sandboxfs.yaml").symlink_to("docs/policy.yaml")
    patterns = protected_patterns(proj, defaults(), None)
    assert {"/sandboxfs.yaml", "/docs/policy.yaml"} <= set(patterns)
    (proj / "sandboxfs.yaml").unlink()
    assert protected_patterns(proj, defaults(), None) == list(defaults().protect)
