"""The store's directory descriptors: sized from the descriptor limit, given back under
pressure, never jamming. The mounts themselves: tests/integration/test_descriptors.py.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxfs.core import inodes
from sandboxfs.core.inodes import Node
from sandboxfs.core.policy import Zone
from sandboxfs.core.store import Store

ZONES = (Zone.SESSION, Zone.WORKSPACE, Zone.REPO, Zone.STAGED)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    zones = {z: tmp_path / z.value for z in ZONES}
    for path in zones.values():
        path.mkdir()
    for i in range(40):
        (zones[Zone.REPO] / f"d{i:02}").mkdir()
    made = Store(zones, [], set())
    try:
        yield made
    finally:
        made.close()


def directories(store: Store, count: int) -> list[Node]:
    repo = store.zone_roots[Zone.REPO]
    nodes = []
    for i in range(count):
        name = f"d{i:02}".encode()
        st = store.lstat(store.dir_fd(repo), name)
        assert st is not None
        nodes.append(store.remember(repo, name, st))
    return nodes


@pytest.mark.parametrize(
    ("soft", "size"),
    [(20, 16), (256, 64), (1024, 256), (20000, 4096), (resource.RLIM_INFINITY, 4096)],
)
def test_the_cache_is_sized_from_the_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch, soft: int, size: int
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, soft))
    assert inodes.fd_cache_size() == size


def test_the_cache_keeps_no_more_than_its_size(store: Store) -> None:
    store.fd_cache_size = 30
    nodes = directories(store, 40)
    for node in nodes:
        store.dir_fd(node)
    assert sum(node.fd >= 0 for node in nodes) == 30
    assert all(node.fd >= 0 for node in nodes[-30:])


def test_make_room_gives_back_all_but_the_most_recently_used(store: Store) -> None:
    nodes = directories(store, 40)
    for node in nodes:
        store.dir_fd(node)
    store.dir_fd(nodes[0])  # used again: among the most recent now
    kept = [nodes[0], *nodes[-7:]]
    assert store.make_room() == 32
    assert [n for n in nodes if n.fd >= 0] == sorted(kept, key=nodes.index)
    for node in kept:  # still the right directories
        assert node.key is not None
        assert os.stat(node.fd).st_ino == node.key[2]
    assert store.make_room() == 0
    assert store.dir_fd(nodes[20]) >= 0  # opened again when needed


def test_allocating_retries_once_after_making_room(store: Store) -> None:
    nodes = directories(store, 20)
    for node in nodes:
        store.dir_fd(node)
    calls = []

    def opening(value: int) -> int:
        calls.append(value)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return value

    assert store.allocating(opening, 7) == 7
    assert calls == [7, 7]
    assert sum(n.fd >= 0 for n in nodes) == 8
    calls.clear()  # nothing left to give back: the error stands
    with pytest.raises(OSError) as failed:
        store.allocating(opening, 7)
    assert failed.value.errno == errno.EMFILE
    calls.clear()
    for node in nodes:
        store.dir_fd(node)

    def refused(value: int) -> int:
        calls.append(value)
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):  # other errors are never retried
        store.allocating(refused, 1)
    assert calls == [1]
    assert all(n.fd >= 0 for n in nodes)


FULL_TABLE = r"""
import os, resource, sys
from pathlib import Path
from sandboxfs.core.policy import Zone
from sandboxfs.core.store import Store

base = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
zones = {z: base / z.value for z in (Zone.SESSION, Zone.WORKSPACE, Zone.REPO, Zone.STAGED)}
store = Store(zones, [], set())
assert store.fd_cache_size == 16
repo = store.zone_roots[Zone.REPO]
nodes = []
for i in range(300):
    name = b"d%03d" % i
    nodes.append(store.remember(repo, name, store.lstat(store.dir_fd(repo), name)))
for node in nodes:  # a find: every directory listed once
    store.list_entries(node)
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
# The table is full: the store gives back what it cached, and every call still works.
assert len(store.list_entries(nodes[3])) == 1
fd = store.create_file(store.checked_dir_fd(nodes[5]), b"new", os.O_WRONLY, 0o644)
os.close(fd)
for _ in range(3):
    os.close(held.pop())
print(*store.usage(Zone.REPO))
"""


def test_a_full_table_never_jams_the_store(tmp_path: Path) -> None:
    """Under a limit of 64 descriptors: a walk over 300 directories, then a full table; the
    store still lists and creates, and counts usage over 300 directories in a few
    descriptors (it opened every subdirectory at once, and skipped those that failed)."""
    for z in ZONES:
        (tmp_path / z.value).mkdir()
    for i in range(300):
        (tmp_path / "repo" / f"d{i:03}").mkdir()
        (tmp_path / "repo" / f"d{i:03}" / "f").write_bytes(b"x" * 10)
    result = subprocess.run(
        [sys.executable, "-c", FULL_TABLE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(3000), str(300 * 2 + 1)]
