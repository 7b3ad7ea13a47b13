"""What a program inside `sandboxfs run` is told of its trust level: nothing that a promotion or
demotion leaves stale; /sandbox/.sandboxfs/context.json has the level."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.support.cli import SANDBOXFS, sandboxfs
from tests.support.mounts import make_project
from tests.support.run import TIMEOUT, needs_bwrap, nothing_left_behind

__all__ = ["nothing_left_behind"]  # a fixture, used by name

pytestmark = needs_bwrap

ASKED = """
CONTEXT=/sandbox/.sandboxfs/context.json
echo ready; read go
sh -c 'echo "env=${SANDBOXFS_TRUST-unset}"'
/usr/bin/python3 -c 'import json; print("context=" + json.load(open("'$CONTEXT'"))["trust"])'
"""


def test_no_variable_names_a_level_the_program_no_longer_has(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    session = f"level{os.getpid()}"
    proc = subprocess.Popen(
        [*SANDBOXFS, "run", "--project", str(project), "--trust", "untrusted", "--quiet",
         "--new-session", session, "--", "sh", "-c", ASKED],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "ready\n"
        promoted = sandboxfs("promote", session, "--trust", "workspace")
        assert promoted.returncode == 0, promoted.stderr
        out, err = proc.communicate("go\n", timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["env=unset", "context=workspace"], out
    status = [r for r in json.loads(sandboxfs("status", "--json").stdout) if r.get("session")]
    assert not [r for r in status if r["session"] == session]  # gone once the run ended
