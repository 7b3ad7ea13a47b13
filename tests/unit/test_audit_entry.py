"""Audit entries as a contract: every op is an AuditOp, built by one builder, in the shapes the
log has always had (old logs verify, readers see the same keys)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sandboxfs.api import PermissionDenied, Sandbox
from sandboxfs.audit.reader import read_entries
from sandboxfs.audit.writer import AuditLog, record_now
from sandboxfs.cli.audit import OPS
from sandboxfs.core.entry import AuditOp, audit_entry, errno_name
from sandboxfs.core.policy import Op
from tests.support.mounts import make_project

ROOT = Path(__file__).resolve().parents[2]

# The keys each kind of entry has had, written out so that a change of shape fails here.
GUARD_KEYS = {
    "op", "path", "dest", "zone", "session", "workspace", "trust", "allowed", "reason", "errno",
    "pid", "uid", "comm", "bytes", "via",
}  # fmt: skip
COMMAND_KEYS = {
    "op", "path", "zone", "session", "workspace", "trust", "allowed", "reason", "errno", "pid",
    "uid", "comm", "bytes", "detail",
}  # fmt: skip
SEALS = {"id", "prev", "hash", "mac", "ts"}


def test_the_matrix_ops_are_audited_under_their_own_spelling() -> None:
    for op in Op:
        assert AuditOp(op.value).value == op.value
        assert audit_entry(op, True)["op"] == op.value


def test_audit_op_choices_are_the_enum() -> None:
    assert tuple(op.value for op in AuditOp) == OPS
    assert len(set(OPS)) == len(OPS)


def test_every_op_the_manual_names_is_a_member() -> None:
    text = (ROOT / "docs" / "audit.md").read_text()
    listed = re.search(r"`op`\n?\s*\((.*?)\), `path` and `dest`", text, re.S)
    assert listed is not None, "the audit log's list of ops moved in docs/audit.md"
    named = set(re.findall(r"`([a-z-]+)`", listed.group(1)))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    everything = "\n".join(page.read_text() for page in pages)
    named |= set(re.findall(r"audit --op ([a-z-]+)", everything))
    named |= set(re.findall(r"as op `([a-z-]+)`", everything))
    assert named and named <= set(OPS), named - set(OPS)


def test_the_builder_writes_what_it_is_given_and_nothing_else() -> None:
    entry = audit_entry(AuditOp.RUN, None, path=None, reason=None, detail=None, worker=None)
    assert entry == {"op": "run", "path": None, "allowed": None, "reason": None}
    assert type(entry["op"]) is str  # plain JSON data, for the API's entries too
    entry = audit_entry(
        AuditOp.WRITE, False, err=errno_name(13), nbytes=3, worker="w", via="api", detail="d"
    )
    assert entry == {
        "op": "write",
        "allowed": False,
        "errno": "EACCES",
        "bytes": 3,
        "worker": "w",
        "via": "api",
        "detail": "d",
    }
    assert errno_name(None) is None and errno_name(0) is None
    with pytest.raises(ValueError, match="replace common ones"):
        audit_entry(AuditOp.NET, True, reason="r", extra={"reason": "forged"})


def test_guard_and_command_entries_keep_their_keys(tmp_path: Path) -> None:
    """An API sandbox's entries (Guard.record) and a command's (record_now), as written to
    the log: the same keys as before there was a builder."""
    project = make_project(tmp_path / "p")
    sb = Sandbox.open(project, trust="session")
    try:
        sb.write("/session/working/a.txt", b"abc")
        with pytest.raises(PermissionDenied):
            sb.write("/repo/b.txt", b"x")
    finally:
        sb.close()
    log = project / ".sandbox" / "audit.jsonl"
    record_now(log, AuditOp.HOME, zone="home", workspace="default", detail="seed")
    entries = list(read_entries(log))
    for entry in entries[:-1]:
        assert set(entry) - SEALS - {"detail"} == GUARD_KEYS, entry
    assert set(entries[-1]) - SEALS == COMMAND_KEYS
    assert {e["op"] for e in entries} <= set(OPS)


def test_the_logs_own_entries_keep_their_keys(tmp_path: Path) -> None:
    """The entries the log writes about itself: a torn line recovered."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record(audit_entry(AuditOp.READ, True, path="/session/x"))
    log.close()
    with path.open("ab") as stream:
        stream.write(b'{"torn')
    log = AuditLog(path)
    log.record(audit_entry(AuditOp.READ, True, path="/session/y"))
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    recover = [e for e in lines if e["op"] == AuditOp.RECOVER]
    assert len(recover) == 1 and set(recover[0]) - SEALS == {"op", "allowed", "torn_line"}
