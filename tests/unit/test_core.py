"""The enforcement core (sandboxfs/core): its layering, and the limits it enforces.

The core imports neither pyfuse3 nor trio and nothing of sandboxfs outside itself, so every
front end (the FUSE adapter, the Python API) can use it; the limits are tested as tables and
the quota tally with real files shared by two tallies, as two mounts share it.
"""

from __future__ import annotations

import ast
import errno
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from sandboxfs.core.gate import Gate
from sandboxfs.core.gatebase import Storage
from sandboxfs.core.guard import Guard
from sandboxfs.core.inodes import Node
from sandboxfs.core.limits import Quota, Tally, ZoneLimits
from sandboxfs.core.policy import Policy, Trust, Zone
from sandboxfs.core.rulebase import MountInfo

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "sandboxfs" / "core"


def test_core_imports_nothing_outside_itself() -> None:
    for module in sorted(CORE.glob("*.py")):
        tree = ast.parse(module.read_text(), str(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1), (module.name, node.module)
                if node.level == 0:
                    assert node.module is not None
                    top = node.module.split(".")[0]
                    assert top not in ("sandboxfs", "pyfuse3", "trio"), (module.name, node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    assert top not in ("sandboxfs", "pyfuse3", "trio"), (module.name, alias.name)


# What each part of the package may import: a layer sees only those below it, and nothing below
# `cli` imports it. `fuse` is the only part that imports pyfuse3 or trio (`run` reaches the
# daemon through it, in the forked child only).
LAYERS: dict[str, set[str]] = {
    "core": set(),
    "errors": set(),
    "gitquery": set(),
    "layout": {"core"},
    "audit": {"core", "errors", "layout"},
    "config": {"core", "errors", "layout", "audit", "gitquery"},
    "project": {"core", "errors", "layout", "gitquery", "audit", "config"},
    "staging": {"core", "errors", "layout", "audit", "project"},
    "api": {"core", "errors", "layout", "audit", "config", "project", "staging"},
    "fuse": {"core", "errors", "layout", "audit", "config", "project"},
    "run": {"core", "errors", "layout", "audit", "config", "project", "fuse"},
    "cli": {
        "core",
        "errors",
        "layout",
        "audit",
        "config",
        "project",
        "staging",
        "api",
        "fuse",
        "run",
    },
    "__init__": {"api", "core", "errors"},
    "__main__": {"cli"},
}


def _imports(module: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_each_layer_imports_only_those_below_it() -> None:
    package = ROOT / "sandboxfs"
    parts = {p.name.removesuffix(".py") for p in package.iterdir() if p.name != "__pycache__"}
    parts.discard("defaults.yaml")
    parts.discard("py.typed")
    assert parts == set(LAYERS), "a new part of the package needs its line in LAYERS"
    for module in sorted(package.rglob("*.py")):
        part = module.relative_to(package).parts[0].removesuffix(".py")
        for name in _imports(module):
            top, _, rest = name.partition(".")
            if top in ("pyfuse3", "trio"):
                assert part == "fuse", (str(module), name)
            elif top == "sandboxfs" and rest:
                below = rest.split(".")[0]
                assert below == part or below in LAYERS[part], (str(module), name)


def test_core_works_with_pyfuse3_and_trio_unavailable(tmp_path: Path) -> None:
    """Import the core, the config and the project layer with pyfuse3 and trio made
    unimportable, and enforce a rule end to end: a refusal audited by the guard."""
    program = f"""
import sys
sys.modules["pyfuse3"] = None
sys.modules["trio"] = None
import errno, os
from pathlib import Path
from sandboxfs.config.model import defaults
from sandboxfs.core.errors import SandboxError
from sandboxfs.core.guard import Guard
from sandboxfs.core.rulebase import MountInfo
from sandboxfs.core.policy import Trust, Zone
from sandboxfs.core.gate import Gate
from sandboxfs.core.store import Store
from sandboxfs.project.zones import make_guard, prepare_zones

project = Path({str(tmp_path)!r})
config = defaults()
dirs = prepare_zones(project, "default", "s1", config, "test")
store = Store(dirs, [project / ".workers"], set())
entries = []

class Sink:
    failing = False
    def record(self, entry): entries.append(entry)
    def try_flush(self): return True

info = MountInfo("s1", "default", str(project), "", via="test")
guard = make_guard(project, config, None, Trust.UNTRUSTED, info, store, Sink())

class Caller:
    pid, uid, gid = os.getpid(), os.getuid(), os.getgid()

try:
    Gate(guard, store).check_create(Caller(), store.zone_roots[Zone.REPO], b"x.txt")
except SandboxError as exc:
    assert exc.errno == errno.EACCES, exc
else:
    raise SystemExit("not refused")
assert entries[0]["allowed"] is False and entries[0]["via"] == "test", entries
assert "pyfuse3" not in sys.modules or sys.modules["pyfuse3"] is None
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ----- limits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffixes", "name", "allowed"),
    [
        ((".md",), "notes.md", True),
        ((".md",), "NOTES.MD", True),  # compared case-folded, like the deny list
        ((".md",), "notes.txt", False),
        ((".md",), ".md", False),  # a bare suffix is no name with that suffix
        ((".md",), "notes.md.sh", False),
        ((".tar.gz", ".md"), "a.tar.gz", True),
        ((".tar.gz",), "a.gz", False),
        (None, "anything", True),
    ],
)
def test_suffix_allowed(suffixes: tuple[str, ...] | None, name: str, allowed: bool) -> None:
    assert ZoneLimits.make(suffixes=suffixes).suffix_allowed(name) is allowed


def test_limit_reasons_name_the_limit_and_the_size() -> None:
    limits = ZoneLimits.make(max_file_bytes=10, suffixes=[".md"])
    size = limits.size_decision("/session/a", "session", 25)
    assert (size.errno, size.rule) == (errno.EFBIG, "size")
    assert "25 bytes" in size.reason and "at most 10 bytes" in size.reason
    suffix = limits.suffix_decision("/docs/a.sh", "docs", "creating")
    assert (suffix.errno, suffix.rule) == (errno.EACCES, "suffix")
    assert "allowed suffixes: .md" in suffix.reason


def _tally(path: Path | None, quota: Quota, used: tuple[int, int] = (0, 0)) -> Tally:
    return Tally("session", quota, path, lambda: used)


def test_tally_refuses_past_the_quota_and_gives_back(tmp_path: Path) -> None:
    tally = _tally(tmp_path / "t", Quota(bytes=100, files=2))
    assert tally.charge(60, 1, "/session/a") is None
    refused = tally.charge(50, 0, "/session/a")
    assert refused is not None and refused.errno == errno.EDQUOT and refused.rule == "quota"
    assert "60 of 100 bytes are used and this would add 50" in refused.reason
    assert tally.charge(0, 1, "/session/b") is None
    assert tally.charge(0, 1, "/session/c") is not None  # a third entry
    tally.credit(60, 1)
    assert tally.usage() == (0, 1)
    assert tally.charge(100, 0, "/session/b") is None
    tally.close()


def test_tallies_of_one_zone_share_the_file(tmp_path: Path) -> None:
    """Two mounts of one zone: what one charges, the other sees before its next write."""
    path = tmp_path / "t"
    first = _tally(path, Quota(bytes=100))
    second = Tally("session", Quota(bytes=100), path, lambda: first.usage())
    assert first.charge(70, 0, "/session/a") is None
    assert second.charge(40, 0, "/session/b") is not None
    assert second.charge(30, 0, "/session/b") is None
    assert first.usage() == (100, 0)
    first.close()
    second.close()


def test_tally_recounts_before_refusing(tmp_path: Path) -> None:
    """Files the user deleted outside the mount are given back when a change would be refused
    (at most once a second)."""
    backing = [90]
    tally = Tally("session", Quota(bytes=100), tmp_path / "t", lambda: (backing[0], 0))
    backing[0] = 0  # deleted outside the mount
    tally._recounted = 0.0  # the last recount is long ago
    assert tally.charge(50, 0, "/session/a") is None
    assert tally.usage() == (50, 0)
    tally.close()


def test_memory_tally() -> None:
    tally = _tally(None, Quota(files=1), used=(0, 1))
    assert tally.charge(0, 1, "/session/x") is not None
    tally.credit(0, 1)
    assert tally.charge(0, 1, "/session/x") is None


# ----- the guard with limits, without a store -----------------------------------------------


class _Sink:
    failing = False

    def __init__(self) -> None:
        self.entries: list[dict[str, object]] = []

    def record(self, entry: dict[str, object]) -> None:
        self.entries.append(entry)

    def try_flush(self) -> bool:
        return True


class _Caller:
    pid, uid, gid = 4242, 1000, 1000


def test_guard_refusals_are_audited_with_the_limit(tmp_path: Path) -> None:
    from sandboxfs.config.model import defaults

    config = defaults()
    policy = Policy(config.matrix(), config.deny, Trust.SESSION, config.protect)
    limits = {Zone.SESSION: ZoneLimits.make(max_file_bytes=10, suffixes=[".md"])}
    sink = _Sink()
    guard = Guard(policy, sink, MountInfo("s", "w", "/p", "/m"), limits=limits)
    root = Node(4, Zone.SESSION, None, b"session", True)
    gate = Gate(guard, cast(Storage, None))
    with pytest.raises(Exception) as raised:
        gate.check_create(_Caller(), root, b"run.sh")
    assert getattr(raised.value, "errno", None) == errno.EACCES
    node = Node(99, Zone.SESSION, root, b"a.md", False)
    with pytest.raises(Exception) as raised:
        gate.write(_Caller(), node, 5, 6, lambda: 6, size=lambda: 5)
    assert getattr(raised.value, "errno", None) == errno.EFBIG
    # Writing inside an oversized file (not growing it) is always fine.
    assert gate.write(_Caller(), node, 0, 3, lambda: 3, size=lambda: 11) == 3
    assert [(e["path"], e["errno"], e["allowed"]) for e in sink.entries] == [
        ("/session/run.sh", "EACCES", False),
        ("/session/a.md", "EFBIG", False),
    ]
    assert all("via" not in e for e in sink.entries)  # the mount's entries are unchanged
    guard.close()
