"""Every op a real `sandboxfs run` session writes into the audit log is an AuditOp member
(sandboxfs.core.entry), and the log it writes verifies."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sandboxfs.core.entry import AuditOp
from tests.support.cli import SANDBOXFS
from tests.support.mounts import make_project

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)

SCRIPT = """
cd /sandbox/session/working || exit 9
echo a > f && cat f >/dev/null && ls >/dev/null
mv f g && ln g h && rm h && chmod 600 g && mkdir d && rmdir d
mv g /sandbox/workspace/data/g 2>/dev/null
cat /sandbox/repo/README.md 2>/dev/null
echo x > /sandbox/repo/new.txt 2>/dev/null
exit 0
"""


def test_a_run_writes_only_enum_ops(tmp_path: Path) -> None:
    project = make_project(tmp_path / "p")
    (project / "README.md").write_text("readme\n")
    run = subprocess.run(
        [*SANDBOXFS, "run", "--project", str(project), "--quiet", "--", "sh", "-c", SCRIPT],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    shown = subprocess.run(
        [*SANDBOXFS, "audit", "--project", str(project), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    entries = [json.loads(line) for line in shown.stdout.splitlines()]
    ops = [entry["op"] for entry in entries]
    members = {op.value for op in AuditOp}
    assert set(ops) <= members, set(ops) - members
    expected = {"run", "mount", "unmount", "read", "write", "list", "delete", "rename", "link"}
    assert expected <= set(ops), expected - set(ops)
    assert any(e["op"] == "write" and e["allowed"] is False for e in entries)
    assert any(e["op"] == "rename" and e["errno"] == "EXDEV" for e in entries)
    verify = subprocess.run(
        [*SANDBOXFS, "audit", "verify", "--project", str(project)], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
