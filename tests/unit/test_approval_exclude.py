"""Approval rules' exclusions (what the agent profile leaves to everyday tools) and the process
a request is grouped by: pure units, no mount."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from sandboxfs.config import model as config
from sandboxfs.core.approval_rules import PROFILES, Kind, Rule, Verdict, excluded
from sandboxfs.core.approvals import Broker
from sandboxfs.core.procnames import ProcessNames
from sandboxfs.errors import UserError

AGENT = PROFILES["agent"]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/repo/.venv", True),
        ("/repo/.venv/lib/python3.11/site-packages/~ip", True),
        ("/repo/web/node_modules/left-pad/index.js", True),
        ("/repo/src/__pycache__/main.cpython-311.pyc", True),
        ("/repo/tinypkg.egg-info/PKG-INFO", True),
        ("/repo/build", True),
        ("/repo/.mypy_cache/3.11/x.json", True),
        ("/repo/src/main.py", False),
        ("/repo/src/build.py", False),  # a name, not a prefix
        ("/repo/Build/x", False),  # case counts
        ("/repo", False),
        ("host.test:443", False),
    ],
)
def test_the_agent_profile_excludes_tools_output_by_name(path: str, expected: bool) -> None:
    assert excluded(AGENT[0].exclude, path) is expected


def test_the_rule_text_names_its_first_exclusions() -> None:
    assert AGENT[0].describe() == (
        "agent:repo-delete: delete in repo (except .venv, venv, node_modules and 11 more) "
        "at every trust level: ask"
    )


def test_a_pattern_with_a_slash_is_a_path_from_the_zone_root() -> None:
    patterns = ("docs/generated",)
    assert excluded(patterns, "/repo/docs/generated/a.html")
    assert not excluded(patterns, "/repo/src/docs/generated/a.html")


def test_a_rename_is_excluded_only_when_both_ends_are() -> None:
    rule = Rule("r", Verdict.ASK, frozenset({Kind.RENAME}), exclude=("build",))
    assert rule.excludes("/repo/build/a", "/repo/build/b")
    assert not rule.excludes("/repo/src", "/repo/build/src")  # into: the user's src moves
    assert not rule.excludes("/repo/build/a", "/repo/src/main.py")  # out, onto the user's file


def test_the_profile_still_asks_about_the_users_files_and_a_project_cannot_exclude_yours() -> None:
    b = Broker(AGENT)
    assert b.consult("full", "repo", [Kind.DELETE], "/repo/.venv/bin/pip", pid=1).allowed
    assert not b.consult("full", "repo", [Kind.DELETE], "/repo/src/main.py", pid=1).allowed
    moved = b.consult("full", "repo", [Kind.RENAME], "/repo/src", pid=1, dest="/repo/build/src")
    assert not moved.allowed and moved.rule.id == "agent:repo-rename"
    linked = b.consult("full", "repo", [Kind.OVERWRITE], "/repo/build/m", pid=1, exclusions=False)
    assert not linked.allowed  # a file with other names gets no exclusion
    user = config.ApprovalsConfig.model_validate(
        {"rules": [{"id": "u", "ops": ["delete"], "zones": ["repo"], "decision": "ask"}]}
    )
    project = config.ApprovalsConfig.model_validate({"profile": "agent"})
    out = config.make_broker(project, user, Broker(()).mode).consult(
        "full", "repo", [Kind.DELETE], "/repo/build/x", pid=1
    )
    assert not out.allowed and out.rule.id == "u"


def test_exclude_is_read_from_yaml(tmp_path: Path) -> None:
    (tmp_path / "sandboxfs.yaml").write_text(
        "approvals:\n  rules:\n    - {id: d, ops: [delete], zones: [repo], decision: ask,"
        " exclude: [out, docs/generated]}\n"
    )
    [rule] = config.load(tmp_path).approvals.rule_list("sandboxfs.yaml")
    assert rule.exclude == ("out", "docs/generated")
    assert "(except out, docs/generated)" in rule.describe()


@pytest.mark.parametrize("pattern", ["", "/abs", "a/../b", "a//b", "./x"])
def test_a_bad_exclude_pattern_is_one_line(tmp_path: Path, pattern: str) -> None:
    (tmp_path / "sandboxfs.yaml").write_text(
        f"approvals: {{rules: [{{ops: [delete], decision: ask, exclude: ['{pattern}']}}]}}\n"
    )
    with pytest.raises(UserError) as info:
        config.load(tmp_path)
    assert "exclude pattern" in info.value.message and "\n" not in info.value.message


def test_a_thread_is_grouped_by_its_process() -> None:
    names = ProcessNames()
    tids: list[int] = []
    seen = threading.Event()
    done = threading.Event()

    def worker() -> None:
        tids.append(threading.get_native_id())
        seen.set()
        done.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        seen.wait(10)
        [tid] = tids
        assert tid != os.getpid()
        assert names.process(tid) == os.getpid()
        assert names.process(tid) == os.getpid()  # cached
        assert names.process(os.getpid()) == os.getpid()
    finally:
        done.set()
        thread.join()
        names.close()
    assert ProcessNames().process(2**22 + 1) == 2**22 + 1  # unreadable: the id itself
