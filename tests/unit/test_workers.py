"""Workers: `.worker` files, and a worker's declaration narrowing a sandbox to what it asks, never
more than its parent has, through the Python API (the mount and `run` are in
tests/integration/test_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxfs.api import (
    ApprovalRequired,
    DenyListed,
    OutsideSandbox,
    PermissionDenied,
    ReadOnlyZone,
    Sandbox,
    WorkerRefused,
)
from sandboxfs.config import model as config_mod
from sandboxfs.core.policy import Op, Trust, Zone
from sandboxfs.errors import UserError
from sandboxfs.project import workers

ZONES = ["session", "workspace", "repo", "staged", "workers", "data"]

FORMATTER = """\
---
name: formatter
description: Formats data files
sandbox:
  zones:
    - name: data
      mode: rw
      approval:
        write: preApproved
        delete: blocked
---
Format every file in /data.
"""


def test_a_worker_file_is_front_matter_and_instructions() -> None:
    worker = workers.parse(FORMATTER, "formatter.worker", ZONES)
    assert worker.name == "formatter"
    assert worker.description == "Formats data files"
    assert worker.zones == {"data": "rw"}
    assert worker.body == "Format every file in /data.\n"
    # Parsed and kept for approvals to apply.
    assert worker.approval["data"].write == "preApproved"
    assert worker.approval["data"].delete == "blocked"
    # ... and carried into the narrowed config, where a mount's guard is built.
    narrowed = workers.narrow(_data_config(), Trust.SESSION, worker)
    assert narrowed.worker is not None
    assert narrowed.worker.approval == {"data": {"write": "preApproved", "delete": "blocked"}}


def test_no_sandbox_key_declares_no_zones() -> None:
    worker = workers.parse("---\nname: pure\n---\n", "pure.worker", ZONES)
    assert worker.zones is None


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            "---\nname: f\nsandbox:\n  zones: [\n---\n",
            ["bad.worker", "not valid YAML", "line 5"],
        ),
        (
            "---\nname: f\ncolour: red\n---\n",
            ["bad.worker, line 3", "colour: unknown key", "accepted keys: name, description"],
        ),
        (
            "---\nname: f\nsandbox:\n  zones:\n    - name: dta\n      mode: ro\n---\n",
            ["bad.worker, line 5", "sandbox.zones[0].name", "unknown zone 'dta'", "data"],
        ),
        (
            "---\nname: f\nsandbox:\n  zones:\n    - name: data\n      mode: rx\n---\n",
            ["bad.worker, line 6", "sandbox.zones[0].mode", "'rx' is not one of 'ro' or 'rw'"],
        ),
        (
            "---\nname: f\nsandbox:\n  zones:\n    - name: data\n      mode: ro\n"
            "      approval: {write: maybe}\n---\n",
            ["bad.worker, line 7", "approval.write", "'maybe'", "'preApproved', 'ask'"],
        ),
        ("name: f\n", ["bad.worker, line 1", "front matter"]),
        ("---\nname: f\n", ["bad.worker", "no closing '---'"]),
    ],
    ids=["bad-yaml", "unknown-key", "unknown-zone", "bad-mode", "bad-approval", "no-fence", "open"],
)
def test_bad_worker_files_get_one_line(text: str, needles: list[str]) -> None:
    with pytest.raises(UserError) as caught:
        workers.parse(text, "bad.worker", ZONES)
    message = caught.value.message
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


# ----- narrowing: the seed's four cases ---------------------------------------------------------


def _data_config() -> config_mod.Config:
    base = config_mod.defaults().model_dump(mode="json")
    base["zones"] = {"data": {"path": "unused", "permissions": {"session": "rwld"}}}
    return config_mod.Config.model_validate(base)


def _memory(trust: str = "session") -> Sandbox:
    files = {"/workspace/data/a.txt": "A", "/session/working/n.txt": "N"}
    return Sandbox.memory(trust=trust, files=files)


def test_child_gets_only_what_it_declared() -> None:
    with _memory() as parent:
        child = parent.restrict({"workspace": "rw"}, name="writer")
        assert child.zones == ["workspace"]
        assert child.worker == "writer"
        child.write("/workspace/data/b.txt", "B")
        assert parent.read_text("/workspace/data/b.txt") == "B"  # the same files
        with pytest.raises(OutsideSandbox):
            child.read_text("/session/working/n.txt")
        context = child.security_context()
        assert list(context["zones"]) == ["workspace"]
        assert context["worker"] == "writer"
        child.close()
        assert parent.read_text("/session/working/n.txt") == "N"  # the parent stays open


def test_wider_than_parent_is_refused_naming_zone_and_modes() -> None:
    with _memory() as parent:
        reader = parent.restrict({"workspace": "ro"}, name="reader")
        with pytest.raises(WorkerRefused) as caught:
            reader.restrict({"workspace": "rw"}, name="grandchild")
        assert "Child requests 'rw' on 'workspace' but parent only has 'ro'" in str(caught.value)
        assert caught.value.errno == 13
        with pytest.raises(WorkerRefused, match="Child requests 'ro' on 'repo' but parent"):
            parent.restrict({"repo": "ro"})
    config = _data_config()
    for trust, has in ((Trust.SESSION, None), (Trust.WORKSPACE, "ro")):
        if has is None:
            workers.narrow(config, trust, workers.Worker.declare("w", {"data": "rw"}))
            continue
        with pytest.raises(workers.WiderThanParent) as refused:
            workers.narrow(config, trust, workers.Worker.declare("w", {"data": "rw"}))
        assert "Child requests 'rw' on 'data' but parent only has 'ro'" in refused.value.message


def test_no_declaration_means_no_zones() -> None:
    with _memory() as parent:
        pure = parent.restrict(None, name="pure")
        assert pure.zones == []
        assert pure.security_context()["zones"] == {}
        with pytest.raises(OutsideSandbox):
            pure.read_text("/workspace/data/a.txt")


def test_child_with_ro_cannot_write_where_the_parent_can() -> None:
    with _memory() as parent:
        child = parent.restrict({"workspace": "ro"}, name="reader")
        assert child.read_text("/workspace/data/a.txt") == "A"
        with pytest.raises(ReadOnlyZone) as refused:
            child.write("/workspace/data/a.txt", "changed")
        assert "for worker reader, which declared it ro" in refused.value.reason
        with pytest.raises(ReadOnlyZone):
            child.delete("/workspace/data/a.txt")
        parent.write("/workspace/data/a.txt", "parent")  # the parent still may
        denied = [e for e in parent.audit_entries() if e["allowed"] is False]
        assert denied and all(e["worker"] == "reader" for e in denied)


def test_no_trust_level_widens_a_worker() -> None:
    """The narrowing is in every row of the matrix: a promoted worker mount stays within its
    declaration."""
    narrowed = workers.narrow(
        _data_config(), Trust.SESSION, workers.Worker.declare("w", {"data": "ro"})
    )
    for trust, row in narrowed.matrix().items():
        assert list(row) == [Zone("data")], trust
        assert row[Zone("data")].ops <= {Op.READ, Op.LIST}


def test_create_only_is_not_rw() -> None:
    """An untrusted parent only creates in /staged: a child asking rw there is refused."""
    with (
        pytest.raises(WorkerRefused, match="'rw' on 'staged' but parent only has 'create-only'"),
        _memory("untrusted") as parent,
    ):
        parent.restrict({"staged": "rw"})


# ----- on disk: a project's workers layers --------------------------------------------------------


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / ".workers").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "input.csv").write_text("1,2\n")
    (project / "sandboxfs.yaml").write_text(
        "zones:\n  data:\n    path: ../data\n    permissions: {session: rwld}\n"
    )
    (project / ".workers" / "formatter.worker").write_text(FORMATTER.replace("rw", "ro", 1))
    (project / ".workers" / "greedy.worker").write_text(
        "---\nname: greedy\nsandbox:\n  zones:\n    - {name: repo, mode: rw}\n---\n"
    )
    return project


def test_open_with_a_worker_of_the_project(tmp_path: Path) -> None:
    project = _project(tmp_path)
    with Sandbox.open(project, trust="session", worker="formatter") as sb:
        assert sb.zones == ["data"]
        assert sb.read_text("/data/input.csv") == "1,2\n"
        with pytest.raises(ReadOnlyZone):
            sb.write("/data/input.csv", "x")
        entries = sb.audit_entries()
        assert entries and {e["worker"] for e in entries} == {"formatter"}
        by_name = sb.restrict("formatter")  # by name, from the workers layers
        assert by_name.zones == ["data"]
        by_name.close()
    with pytest.raises(WorkerRefused, match="Child requests 'rw' on 'repo' but parent only"):
        Sandbox.open(project, trust="session", worker="greedy")
    with pytest.raises(WorkerRefused, match="no worker named 'nosuch'"):
        Sandbox.open(project, trust="session", worker="nosuch")


def test_a_worker_file_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    """The project's .workers may be written by a sandbox at full trust: a link there is not
    followed (nothing of its target is parsed, or quoted in an error)."""
    project = _project(tmp_path)
    (tmp_path / "elsewhere.worker").write_text(FORMATTER)
    (project / ".workers" / "linked.worker").symlink_to(tmp_path / "elsewhere.worker")
    with pytest.raises(UserError, match=r"linked\.worker"):
        workers.find(project, "linked", config_mod.load(project))


# ----- attachments ------------------------------------------------------------------------------


def test_attachments_are_readable_in_the_parent_and_read_only_in_the_child(
    tmp_path: Path,
) -> None:
    project = _project(tmp_path)
    (project / "notes.md").write_text("notes\n")
    with Sandbox.open(project, trust="workspace") as parent:
        child = parent.restrict({"session": "rw"}, name="reader", attachments=["/repo/notes.md"])
        assert child.zones == ["session", "attachments"]
        assert child.list("/attachments") == ["/attachments/notes.md"]
        assert child.read_text("/attachments/notes.md") == "notes\n"
        with pytest.raises(ReadOnlyZone):
            child.write("/attachments/notes.md", "changed")
        with pytest.raises(OutsideSandbox):
            child.read_text("/repo/notes.md")  # the rest of /repo stays the parent's
        copies = project / ".sandbox" / "workspaces" / "default" / "attachments"
        assert len(list(copies.iterdir())) == 1
        child.close()
        assert list(copies.iterdir()) == []  # the copies go with the child
        reads = [e for e in parent.audit_entries() if e["path"] == "/repo/notes.md"]
        assert reads and reads[0]["allowed"] is True and "worker" not in reads[0]


def test_attachments_only_from_what_the_parent_may_read(tmp_path: Path) -> None:
    project = _project(tmp_path)
    (project / "notes.md").write_text("notes\n")
    (project / ".env").write_text("SECRET=1\n")
    with Sandbox.open(project, trust="session") as parent, pytest.raises(PermissionDenied):
        parent.restrict({"data": "ro"}, attachments=["/repo/notes.md"])
    with Sandbox.open(project, trust="full") as parent:
        with pytest.raises(DenyListed):
            parent.restrict({"data": "ro"}, attachments=["/repo/.env"])
        with pytest.raises(WorkerRefused, match=r"both would be /attachments/input\.csv"):
            parent.restrict({}, attachments=["/data/input.csv", "/data/../data/input.csv"])
    copies = project / ".sandbox" / "workspaces" / "default" / "attachments"
    assert not copies.exists() or list(copies.iterdir()) == []


def test_a_workers_approval_rules_only_ask_more(tmp_path: Path) -> None:
    """FORMATTER (rw on data) says delete: blocked and write: preApproved. The block holds;
    its preApproved write cannot undo what the project asks, which decides as strictest."""
    project = _project(tmp_path)
    (project / ".workers" / "formatter.worker").write_text(FORMATTER)
    (project / "sandboxfs.yaml").write_text(
        "zones:\n  data:\n    path: ../data\n    permissions: {session: rwld}\n"
        "approvals:\n  rules:\n    - {id: ask-writes, ops: [write], zones: [data], decision: ask}\n"
    )
    with Sandbox.open(project, trust="session", worker="formatter") as sb:
        with pytest.raises(PermissionDenied, match="worker:formatter:data:delete"):
            sb.delete("/data/input.csv")
        with pytest.raises(ApprovalRequired, match="ask-writes"):
            sb.write("/data/input.csv", "3,4\n")
        assert sb.read_text("/data/input.csv") == "1,2\n"
    assert (tmp_path / "data" / "input.csv").read_text() == "1,2\n"
