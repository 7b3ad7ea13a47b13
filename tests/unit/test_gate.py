"""The gate holds each operation's rule list and audits every refusal as it leaves; the guard
is a library of rule checks that only the gate sequences."""

from __future__ import annotations

import ast
import errno
import inspect
from pathlib import Path
from typing import Any, cast

import pytest

from sandboxfs.config.model import defaults
from sandboxfs.core.errors import Refusal, SandboxError
from sandboxfs.core.gate import Gate
from sandboxfs.core.gatebase import Storage
from sandboxfs.core.guard import Guard
from sandboxfs.core.inodes import Node
from sandboxfs.core.policy import Policy, Trust, Zone
from sandboxfs.core.rulebase import MountInfo

ROOT = Path(__file__).resolve().parents[2]

# What the guard offers that refuses or answers for an operation: only the gate calls these.
RULE_PREFIXES = ("reject_", "judge_", "check", "may_", "refuse", "hidden", "cross_zone")


# The gate's modules and the guard's, which call each other's checks.
CORE_RULES = (
    "gate.py",
    "gatebase.py",
    "gate_names.py",
    "guard.py",
    "rulebase.py",
    "protect.py",
    "effects.py",
    "consent.py",
)


class _Sink:
    failing = False

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def record(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)

    def try_flush(self) -> bool:
        return True


class _Caller:
    pid, uid, gid = 1, 1000, 1000


def _gate() -> tuple[Gate, _Sink]:
    config = defaults()
    policy = Policy(config.matrix(), config.deny, Trust.UNTRUSTED, config.protect)
    sink = _Sink()
    guard = Guard(policy, sink, MountInfo("s", "w", "/p", "/m"))
    return Gate(guard, cast(Storage, None)), sink


def test_every_public_gate_method_audits_the_refusals_of_its_rules() -> None:
    public = [name for name, _ in inspect.getmembers(Gate, inspect.isfunction) if name[0] != "_"]
    assert "rename" in public and "check_open" in public
    unwrapped = [n for n in public if not getattr(getattr(Gate, n), "audits_refusals", False)]
    assert unwrapped == []


def test_a_refusal_is_audited_once_and_a_probe_audits_none() -> None:
    gate, sink = _gate()
    root = Node(4, Zone.REPO, None, b"repo", True)
    with pytest.raises(SandboxError) as raised:
        gate.check_create(_Caller(), root, b"x.txt")  # /repo is read-only when untrusted
    assert isinstance(raised.value, Refusal) and raised.value.recorded
    assert raised.value.errno == errno.EACCES
    assert [(e["op"], e["path"], e["allowed"]) for e in sink.entries] == [
        ("write", "/repo/x.txt", False)
    ]
    with pytest.raises(SandboxError):
        gate.without_effect().check_create(_Caller(), root, b"y.txt")
    assert len(sink.entries) == 1


def test_only_the_gate_calls_the_guards_rule_checks() -> None:
    """A rule check called from anywhere else would run outside an operation's list, and its
    refusal would leave without its audit entry."""
    offenders = []
    for path in sorted((ROOT / "sandboxfs").rglob("*.py")):
        if path.parent.name == "core" and path.name in CORE_RULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            owner_name = getattr(owner, "attr", getattr(owner, "id", ""))
            if owner_name in ("guard", "_guard") and node.func.attr.startswith(RULE_PREFIXES):
                rel = path.relative_to(ROOT)
                offenders.append(f"{rel}:{node.lineno}: guard.{node.func.attr}")
    assert offenders == []
