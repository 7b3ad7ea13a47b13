"""Project zones and per-zone limits (docs/configuration.md, "Project zones and limits"), on
real mounts, with real programs: `ls`, `cat`, `sh -c 'echo > ...'`, `cp`, `dd`, `truncate`, `mv`,
`ln`, `touch`, `mkdir`, `rm`, checking exit codes, the tools' error text, the backing storage and
the audit log.

Two projects, mounted once per module (mounts are shared between tests; every test works on
names of its own so that the order of the tests does not matter):

- `zoned`: a project zone `docs` inside the project (untrusted rl, session rwld, suffixes .md
  and .txt, max_file_bytes 1500), a zone `private` with no permissions given (readable only from
  `workspace` on), a zone `ext` at an absolute path outside the project, and max_file_bytes 1000
  on /session; mounted at untrusted, session and workspace.
- `quotas`: a 5000-byte, 20-entry quota on /session and a quota on a project zone `data` whose
  backing directory holds files before the mount; mounted at session.

Bad configurations run `sandboxfs mount` (and `sandboxfs run`) against fresh projects.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import SANDBOXFS, assert_one_line_error, sandboxfs, sh
from tests.support.mounts import Mount, make_project, mounted
from tests.support.zones import denial, failed, is_mounted, ok

BUILTIN = ["session", "workspace", "repo", "staged", "workers"]

ZONED_CONFIG = """\
zones:
  docs:
    path: docs
    permissions:
      untrusted: rl
      session: rwld
  private:
    path: private
  ext:
    path: {ext}
    permissions:
      untrusted: rl
limits:
  session:
    max_file_bytes: 1000
  docs:
    suffixes: [.md, .txt]
    max_file_bytes: 1500
"""

QUOTA_CONFIG = """\
zones:
  data:
    path: data
    permissions:
      session: rwld
limits:
  session:
    quota: {bytes: 5000, files: 20}
  data:
    quota: {bytes: 5000, files: 10}
"""


# ----- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    """Outside pytest's tmp dirs: a concurrent pytest session's sweep of "pytest-of-" mounts
    must not unmount the module's mounts under its feet (see test_posix)."""
    with tempfile.TemporaryDirectory(prefix="sandboxfs-zones-") as tmp:
        yield Path(tmp)


@pytest.fixture(scope="module")
def zoned(root: Path) -> Path:
    project = make_project(root / "zoned")
    docs = project / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# chapter a\n")
    (docs / "guide.txt").write_text("the guide\n")
    (docs / "notes.bin").write_text("binary notes\n")  # another suffix: listed, never opened
    (docs / "old.bin").write_text("old\n")  # another suffix, to be deleted at session
    (docs / "secret.bin").write_text("not for reading\n")  # another suffix, hard-linked
    (docs / "move-me.md").write_text("moved across zones\n")
    (docs / "big.md").write_bytes(b"b" * 2000)  # larger than docs' max_file_bytes already
    (project / "private").mkdir()
    (project / "private" / "p.txt").write_text("private text\n")
    ext = root / "external"
    ext.mkdir()
    (ext / "e.txt").write_text("from outside the project\n")
    (project / "sandboxfs.yaml").write_text(ZONED_CONFIG.format(ext=ext))
    return project


@pytest.fixture(scope="module")
def untrusted(root: Path, zoned: Path) -> Iterator[Mount]:
    with mounted(root / "mnt-untrusted", zoned, "untrusted") as m:
        yield m


@pytest.fixture(scope="module")
def session(root: Path, zoned: Path) -> Iterator[Mount]:
    with mounted(root / "mnt-session", zoned, "session") as m:
        yield m


@pytest.fixture(scope="module")
def workspace(root: Path, zoned: Path) -> Iterator[Mount]:
    with mounted(root / "mnt-workspace", zoned, "workspace") as m:
        yield m


@pytest.fixture(scope="module")
def quotas(root: Path) -> Iterator[Mount]:
    project = make_project(root / "quotas")
    data = project / "data"
    (data / "sub").mkdir(parents=True)
    (data / "pre.bin").write_bytes(b"p" * 3000)  # counted at mount: 3000 bytes, 3 entries
    (data / "sub" / "one").write_bytes(b"")
    (project / "sandboxfs.yaml").write_text(QUOTA_CONFIG)
    with mounted(root / "mnt-quotas", project, "session") as m:
        yield m


def working(m: Mount) -> Path:
    return m.mnt / "session" / "working"


def session_dir(m: Mount) -> Path:
    return m.project / ".sandbox" / "workspaces" / m.workspace / "sessions" / m.session


def context(m: Mount) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((m.mnt / ".sandboxfs" / "context.json").read_text())
    return result


def entries_below(path: Path) -> int:
    """Files, directories and links below `path`, each inode once (what a quota counts)."""
    seen: set[int] = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            seen.add(os.lstat(os.path.join(dirpath, name)).st_ino)
    return len(seen)


# ----- project zones: visible, readable, writable as declared -----------------------------------


def test_root_lists_project_zones_after_the_builtin_ones(untrusted: Mount) -> None:
    # -U: in the order the mount lists them, not sorted.
    assert ok(sh(f"ls -U {untrusted.mnt}")).split() == [*BUILTIN, "docs", "private", "ext"]
    # The files made before the mount (other tests add and remove their own names).
    listed = set(ok(sh(f"ls {untrusted.mnt}/docs")).split())
    assert {"a.md", "big.md", "guide.txt", "notes.bin", "secret.bin"} <= listed, listed


def test_untrusted_reads_docs_but_cannot_write_there(untrusted: Mount) -> None:
    m = untrusted
    assert ok(sh(f"cat {m.mnt}/docs/a.md")) == "# chapter a\n"
    assert ok(sh(f"cat {m.mnt}/docs/guide.txt")) == "the guide\n"
    # The same files through /repo stay under repo's rules: nothing at untrusted.
    failed(sh(f"cat {m.mnt}/repo/docs/a.md"), "No such file or directory")
    # A refused change in a zone the level can read: EROFS.
    refused = sh(f"echo x > {m.mnt}/docs/new.md")
    failed(refused, "Read-only file system")
    assert not (m.project / "docs" / "new.md").exists()
    entry = denial(m, "/docs/new.md", "EROFS")
    assert entry["op"] == "write"
    assert entry["zone"] == "docs"
    assert entry["trust"] == "untrusted"
    assert "docs is not writable at trust level untrusted" in entry["reason"]
    failed(sh(f"rm {m.mnt}/docs/guide.txt"), "Read-only file system")
    assert (m.project / "docs" / "guide.txt").exists()


def test_session_writes_docs_into_its_backing_dir(session: Mount) -> None:
    m = session
    ok(sh(f"echo written > {m.mnt}/docs/new-at-session.md"))
    assert (m.project / "docs" / "new-at-session.md").read_text() == "written\n"
    assert "new-at-session.md" in ok(sh(f"ls {m.mnt}/docs")).split()
    entry = m.wait_audit(
        lambda e: (
            e["session"] == m.session
            and e["path"] == "/docs/new-at-session.md"
            and e["op"] == "write"
        )
    )
    assert entry["allowed"] is True
    assert entry["zone"] == "docs"


def test_context_json_shows_project_zones_and_limits(untrusted: Mount, session: Mount) -> None:
    zones = context(untrusted)["zones"]
    assert list(zones) == [*BUILTIN, "docs", "private", "ext"]
    assert zones["docs"] == {
        "read": True,
        "write": False,
        "list": True,
        "delete": False,
        "create_only": False,
        "limits": {"suffixes": [".md", ".txt"], "max_file_bytes": 1500},
    }
    assert zones["private"] == {
        "read": False,
        "write": False,
        "list": False,
        "delete": False,
        "create_only": False,
    }
    assert zones["ext"]["read"] is True and zones["ext"]["write"] is False
    assert zones["session"]["limits"] == {"max_file_bytes": 1000}
    docs = context(session)["zones"]["docs"]
    assert (docs["read"], docs["write"], docs["list"], docs["delete"]) == (True,) * 4


def test_zone_without_permissions_is_invisible_below_workspace(
    untrusted: Mount, session: Mount, workspace: Mount
) -> None:
    for m in (untrusted, session):
        failed(sh(f"ls {m.mnt}/private"), "Permission denied")
        failed(sh(f"cat {m.mnt}/private/p.txt"), "No such file or directory")
        entry = denial(m, "/private/p.txt", "ENOENT")
        assert entry["zone"] == "private"
        assert f"not readable at trust level {m.trust}" in entry["reason"]
    # workspace: the defaults of a project zone give rl.
    assert ok(sh(f"ls {workspace.mnt}/private")).split() == ["p.txt"]
    assert ok(sh(f"cat {workspace.mnt}/private/p.txt")) == "private text\n"
    failed(sh(f"echo x > {workspace.mnt}/private/new.txt"), "Read-only file system")
    assert not (workspace.project / "private" / "new.txt").exists()


def test_zone_at_an_absolute_path_outside_the_project(
    untrusted: Mount, session: Mount, root: Path
) -> None:
    assert ok(sh(f"ls {untrusted.mnt}/ext")).split() == ["e.txt"]
    assert ok(sh(f"cat {untrusted.mnt}/ext/e.txt")) == "from outside the project\n"
    failed(sh(f"echo x > {untrusted.mnt}/ext/new.txt"), "Read-only file system")
    assert not (root / "external" / "new.txt").exists()
    # At session nothing was declared: the default, no access.
    failed(sh(f"cat {session.mnt}/ext/e.txt"), "No such file or directory")


def test_audit_zone_filter_returns_only_that_zone(untrusted: Mount) -> None:
    m = untrusted
    ok(sh(f"cat {m.mnt}/docs/guide.txt"))
    sh(f"cat {m.mnt}/ext/e.txt")
    m.wait_audit(lambda e: e["session"] == m.session and e["path"] == "/ext/e.txt")
    docs = m.audit("--zone", "docs")
    assert docs, "no docs entries"
    assert {e["zone"] for e in docs} == {"docs"}
    assert any(e["path"] == "/docs/guide.txt" and e["op"] == "read" for e in docs)
    ext = m.audit("--zone", "ext")
    assert ext and {e["zone"] for e in ext} == {"ext"}


# ----- across zones: EXDEV ----------------------------------------------------------------------


def test_mv_across_zones_copies_and_ln_is_exdev(session: Mount) -> None:
    m = session
    ok(sh(f"mv {m.mnt}/docs/move-me.md {m.mnt}/session/working/"))
    assert not (m.project / "docs" / "move-me.md").exists()
    assert (session_dir(m) / "working" / "move-me.md").read_text() == "moved across zones\n"
    entry = m.wait_audit(
        lambda e: (
            e["session"] == m.session and e["op"] == "rename" and e["path"] == "/docs/move-me.md"
        )
    )
    assert entry["errno"] == "EXDEV"
    assert entry["allowed"] is None
    assert entry["dest"] == "/session/working/move-me.md"

    linked = sh(f"ln {m.mnt}/docs/a.md {m.mnt}/session/working/x")
    assert linked.returncode == 1, linked
    assert "Invalid cross-device link" in linked.stderr
    assert not (session_dir(m) / "working" / "x").exists()

    # The table says it was not done (not `ok`), and why.
    for op, path in (("rename", "/docs/move-me.md"), ("link", "/docs/a.md")):
        table = ok(sandboxfs("audit", "--project", m.project, "--session", m.session, "--op", op))
        rows = [row for row in table.splitlines()[1:] if f"{path} -> /session/working/" in row]
        assert rows, table
        assert all(row.split()[3] == "failed" and "EXDEV: " in row for row in rows), rows


def test_failed_move_across_zones_keeps_the_source(session: Mount) -> None:
    """docs/big.md (2000 bytes) does not fit session's max_file_bytes (1000): mv's copy fails,
    and the source is not deleted."""
    m = session
    failed(sh(f"mv {m.mnt}/docs/big.md {m.mnt}/session/working/"), "File too large")
    assert (m.project / "docs" / "big.md").read_bytes() == b"b" * 2000


# ----- max_file_bytes -----------------------------------------------------------------------------


def test_max_file_bytes_refuses_large_files(session: Mount, root: Path) -> None:
    m = session
    big, small = root / "big-1500", root / "small-500"
    big.write_bytes(b"x" * 1500)
    small.write_bytes(b"y" * 500)
    target = f"{m.mnt}/session/working"
    copied = sh(f"cp {big} {target}/big")
    assert copied.returncode == 1, copied
    assert "File too large" in copied.stderr
    entry = denial(m, "/session/working/big", "EFBIG")
    assert entry["op"] == "write"
    assert entry["zone"] == "session"
    assert "1000 bytes" in entry["reason"]  # the limit
    assert "1500 bytes" in entry["reason"]  # the size it would have had
    assert "max_file_bytes" in entry["reason"]

    ok(sh(f"cp {small} {target}/small"))
    assert (session_dir(m) / "working" / "small").read_bytes() == b"y" * 500
    failed(sh(f"truncate -s 2000 {target}/small"), "File too large")
    entry = denial(m, "/session/working/small", "EFBIG")
    assert "would be 2000 bytes" in entry["reason"]
    assert "1000 bytes" in entry["reason"]
    assert os.path.getsize(session_dir(m) / "working" / "small") == 500
    # Writing past the limit at an offset, and appending past it.
    failed(
        sh(f"dd if=/dev/zero of={target}/small bs=1 seek=1500 count=1 conv=notrunc"),
        "File too large",
    )
    failed(sh(f"head -c 600 /dev/zero >> {target}/small"), "File too large")
    # Up to the limit exactly, and shrinking, are fine.
    ok(sh(f"truncate -s 1000 {target}/small"))
    ok(sh(f"truncate -s 10 {target}/small"))
    assert os.path.getsize(session_dir(m) / "working" / "small") == 10


def test_existing_larger_file_stays_readable(untrusted: Mount, session: Mount) -> None:
    assert ok(sh(f"cat {untrusted.mnt}/docs/big.md")) == "b" * 2000
    # (head, not dash's echo: dash reports every failed write of its builtin as "I/O error")
    failed(sh(f"head -c 5 /dev/zero >> {session.mnt}/docs/big.md"), "File too large")
    assert (session.project / "docs" / "big.md").read_bytes() == b"b" * 2000


# ----- quota --------------------------------------------------------------------------------------


def test_quota_bytes_refuse_and_are_given_back(quotas: Mount) -> None:
    m = quotas
    big = working(m) / "big"
    result = sh(f"dd if=/dev/zero of={big} bs=1000 count=10")
    assert result.returncode == 1, result
    assert "Disk quota exceeded" in result.stderr
    assert os.path.getsize(session_dir(m) / "working" / "big") <= 5000
    entry = denial(m, "/session/working/big", "EDQUOT")
    assert entry["op"] == "write"
    assert entry["zone"] == "session"
    assert "5000" in entry["reason"] and "quota" in entry["reason"]
    # Given back on rm: a file within the quota fits again.
    ok(sh(f"rm {big}"))
    ok(sh(f"dd if=/dev/zero of={working(m)}/fits bs=1000 count=4"))
    # Rewriting a file in place (O_TRUNC) does not count it twice.
    ok(sh(f"dd if=/dev/zero of={working(m)}/fits bs=1000 count=4"))
    assert os.path.getsize(session_dir(m) / "working" / "fits") == 4000
    failed(sh(f"truncate -s 6000 {working(m)}/fits"), "Disk quota exceeded")
    ok(sh(f"rm {working(m)}/fits"))


def test_quota_files_refuse_new_entries(quotas: Mount) -> None:
    m = quotas
    existing = entries_below(session_dir(m))  # inputs, working, outputs, home, ...
    room = 20 - existing
    assert room > 0, existing
    d = working(m)
    made = sh(
        f"i=0; while touch {d}/f$i 2>/dev/null; do i=$((i+1)); [ $i -gt 40 ] && break; done; "
        f"echo $i"
    )
    assert int(made.stdout) == room, (made.stdout, existing)
    failed(sh(f"touch {d}/one-more"), "Disk quota exceeded")
    failed(sh(f"mkdir {d}/dir"), "Disk quota exceeded")
    failed(sh(f"ln -s f0 {d}/link"), "Disk quota exceeded")
    entry = denial(m, "/session/working/dir", "EDQUOT")
    assert "20 of 20 entries" in entry["reason"], entry["reason"]
    ok(sh(f"rm {d}/f*"))
    ok(sh(f"mkdir {d}/dir && touch {d}/dir/inside"))
    ok(sh(f"rm -r {d}/dir"))


def test_quota_counts_files_that_existed_before_the_mount(quotas: Mount) -> None:
    """data/ held pre.bin (3000 bytes), sub/ and sub/one before the mount: 3000 of 5000 bytes
    and 3 of 10 entries are used from the start."""
    m = quotas
    data = m.mnt / "data"
    failed(sh(f"dd if=/dev/zero of={data}/x bs=1000 count=3"), "Disk quota exceeded")
    assert os.path.getsize(m.project / "data" / "x") <= 2000
    entry = denial(m, "/data/x", "EDQUOT")
    assert entry["zone"] == "data"
    ok(sh(f"rm {data}/x"))
    ok(sh(f"dd if=/dev/zero of={data}/y bs=1000 count=2"))
    ok(sh(f"rm {data}/y"))
    # 7 more entries fit, the 8th does not.
    ok(sh(f"touch {data}/n1 {data}/n2 {data}/n3 {data}/n4 {data}/n5 {data}/n6 {data}/n7"))
    failed(sh(f"touch {data}/n8"), "Disk quota exceeded")
    ok(sh(f"rm {data}/n*"))


# ----- suffixes -----------------------------------------------------------------------------------


def test_suffixes_refuse_other_names(session: Mount) -> None:
    m = session
    docs = m.mnt / "docs"
    backing = m.project / "docs"
    failed(sh(f"echo x > {docs}/a.sh"), "Permission denied")
    assert not (backing / "a.sh").exists()
    entry = denial(m, "/docs/a.sh", "EACCES")
    assert entry["op"] == "write"
    assert entry["zone"] == "docs"
    assert ".md, .txt" in entry["reason"]

    ok(sh(f"echo x > {docs}/s.md"))
    ok(sh(f"echo x > {docs}/UPPER.MD"))  # compared case-folded
    failed(sh(f"echo x > {docs}/.md"), "Permission denied")  # only a suffix: no name
    failed(sh(f"mv {docs}/s.md {docs}/s.sh"), "Permission denied")
    assert (backing / "s.md").exists() and not (backing / "s.sh").exists()
    entry = denial(m, "/docs/s.md", "EACCES", op="rename")
    assert entry["dest"] == "/docs/s.sh"
    ok(sh(f"mv {docs}/s.md {docs}/s.txt"))
    failed(sh(f"ln {docs}/s.txt {docs}/s.sh"), "Permission denied")
    failed(sh(f"ln -s s.txt {docs}/l.sh"), "Permission denied")
    failed(sh(f"mkfifo {docs}/fifo"), "Permission denied")
    # Directories have no suffix.
    ok(sh(f"mkdir {docs}/chapter && mv {docs}/chapter {docs}/chapter-2"))
    ok(sh(f"echo x > {docs}/chapter-2/inner.md"))
    assert (backing / "chapter-2" / "inner.md").exists()


def test_existing_file_with_another_suffix_is_listed_not_opened(
    untrusted: Mount, session: Mount
) -> None:
    for m in (untrusted, session):
        assert "notes.bin" in ok(sh(f"ls {m.mnt}/docs")).split()
        assert ok(sh(f"stat -c %s {m.mnt}/docs/notes.bin")).strip() == "13"
        failed(sh(f"cat {m.mnt}/docs/notes.bin"), "Permission denied")
        entry = denial(m, "/docs/notes.bin", "EACCES", op="read")
        assert "allowed suffixes" in entry["reason"]
    failed(sh(f"echo x >> {session.mnt}/docs/notes.bin"), "Permission denied")
    failed(sh(f"mv {session.mnt}/docs/notes.bin {session.mnt}/docs/notes.md"), "Permission denied")
    assert (session.project / "docs" / "notes.bin").read_text() == "binary notes\n"
    # Deleted where the matrix allows: at session, not at untrusted.
    failed(sh(f"rm {untrusted.mnt}/docs/old.bin"), "Read-only file system")
    ok(sh(f"rm {session.mnt}/docs/old.bin"))
    assert not (session.project / "docs" / "old.bin").exists()


def test_hard_link_does_not_open_a_file_with_another_suffix(session: Mount) -> None:
    """A second name with an allowed suffix must not make a file with another suffix readable
    (renaming it is refused for that reason; linking it must be too)."""
    m = session
    docs = m.mnt / "docs"
    linked = sh(f"ln {docs}/secret.bin {docs}/secret.md")
    read = sh(f"cat {docs}/secret.md")
    direct = sh(f"cat {docs}/secret.bin")
    sh(f"rm -f {docs}/secret.md")
    assert "not for reading" not in read.stdout, "the hard link opened secret.bin"
    assert "not for reading" not in direct.stdout, "secret.bin opened after the hard link"
    failed(linked, "Permission denied")


# ----- /workers: layers of SANDBOXFS_WORKERS_PATH ------------------------------------------------


def test_workers_layers_show_their_subdirectories(
    tmp_path: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory in the second or a later layer is listed and read below its top, as one in
    <project>/.workers is (each name below /workers comes whole from the first layer that has
    it), and stays read-only at every depth."""
    trees = {
        project / ".workers": "own",
        tmp_path / "layer1": "one",
        tmp_path / "layer2": "two",
    }
    for base, name in trees.items():
        (base / name / "deep").mkdir(parents=True)
        (base / name / "f.txt").write_text(f"{name} f\n")
        (base / name / "deep" / "g.txt").write_text(f"{name} g\n")
        (base / "shared").mkdir(exist_ok=True)
        (base / "shared" / f"{name}.txt").write_text(f"{name}\n")
    monkeypatch.setenv("SANDBOXFS_WORKERS_PATH", f"{tmp_path / 'layer1'}:{tmp_path / 'layer2'}")
    with mounted(tmp_path / "mnt", project, "full") as m:
        workers = m.mnt / "workers"
        assert ok(sh(f"ls {workers}")).split() == ["one", "own", "review.worker", "shared", "two"]
        for name in trees.values():
            assert ok(sh(f"ls {workers}/{name}")).split() == ["deep", "f.txt"]
            assert ok(sh(f"ls {workers}/{name}/deep")).split() == ["g.txt"]
            assert ok(sh(f"cat {workers}/{name}/f.txt {workers}/{name}/deep/g.txt")) == (
                f"{name} f\n{name} g\n"
            )
            found = ok(sh(f"cd {workers}/{name} && find . | sort")).split()
            assert found == [".", "./deep", "./deep/g.txt", "./f.txt"]
        # `shared` is in every layer: the first one's directory is shown, whole
        assert ok(sh(f"ls {workers}/shared")).split() == ["own.txt"]
        # layer 0 is writable at full; the others are read-only below their top too
        ok(sh(f"touch {workers}/own/deep/new.txt"))
        assert (project / ".workers" / "own" / "deep" / "new.txt").exists()
        for name in ("one", "two"):
            failed(sh(f"touch {workers}/{name}/deep/new.txt"), "Read-only file system")
            failed(sh(f"rm {workers}/{name}/deep/g.txt"), "Read-only file system")
        assert not (tmp_path / "layer1" / "one" / "deep" / "new.txt").exists()
        assert (tmp_path / "layer2" / "two" / "deep" / "g.txt").exists()


# ----- the user's state dir is never a zone -----------------------------------------------------


def test_zone_cannot_expose_the_users_state_dir(tmp_path: Path, project: Path) -> None:
    """The audit anchors (keys) live in the user's state dir; docs/audit.md: a program confined to
    the mount cannot read the key. A zone at (or inside) it must be refused, or hide it."""
    state = Path(os.environ["SANDBOXFS_STATE_DIR"])
    anchors = state / "anchors"
    anchors.mkdir(parents=True, exist_ok=True)
    (project / "sandboxfs.yaml").write_text(
        f"zones:\n  st:\n    path: {anchors}\n    permissions: {{session: rwld}}\n"
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = sandboxfs("mount", mnt, "--project", project, "--trust", "session")
    try:
        if result.returncode == 0:
            listing = sh(f"ls -A {mnt}/st")
            keys = sorted(p.name for p in anchors.iterdir())
            assert not set(listing.stdout.split()) & set(keys), (
                f"the anchors are visible through the mount: {listing.stdout.split()}"
            )
        else:
            assert_one_line_error(result, "zones.st.path")
    finally:
        if is_mounted(mnt):
            sandboxfs("umount", mnt)


# ----- bad configurations -------------------------------------------------------------------------

BAD_CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "builtin-name": ("zones: {repo: {path: docs}}", ("zones", "'repo'", "built-in")),
    "not-plain-name": ("zones: {'Bad/Name': {path: docs}}", ("zones", "'Bad/Name'", "lowercase")),
    "path-missing": ("zones: {docs: {path: nosuch}}", ("zones.docs.path", "does not exist")),
    "path-is-a-file": ("zones: {docs: {path: README.md}}", ("zones.docs.path", "not a directory")),
    "path-is-the-project": ("zones: {docs: {path: .}}", ("zones.docs.path", "project")),
    "path-contains-the-project": (
        "zones: {docs: {path: ..}}",
        ("zones.docs.path", "contains the project"),
    ),
    "path-in-state-dir": (
        "zones: {docs: {path: .sandbox/workspaces}}",
        ("zones.docs.path", "state dir"),
    ),
    "path-is-workers": ("zones: {docs: {path: .workers}}", ("zones.docs.path", "/workers")),
    "zones-overlap": (
        "zones: {docs: {path: docs}, parts: {path: docs/part}}",
        ("zones.parts.path", "overlaps zone docs"),
    ),
    "zones-same-path": (
        "zones: {docs: {path: docs}, again: {path: docs}}",
        ("zones.again.path", "overlaps zone docs"),
    ),
    "limits-unknown-zone": (
        "limits: {nosuch: {max_file_bytes: 1}}",
        ("limits", "'nosuch'", "session, workspace, repo, staged, workers"),
    ),
    "limits-workers-quota": (
        "limits: {workers: {quota: {bytes: 1}}}",
        ("limits", "workers", "quota"),
    ),
    "suffix-without-dot": ("limits: {session: {suffixes: [md]}}", ("suffixes", "'md'", "'.md'")),
    "negative-max-file-bytes": (
        "limits: {session: {max_file_bytes: -1}}",
        ("limits.session.max_file_bytes", "greater than or equal to 0"),
    ),
    "negative-quota": (
        "limits: {session: {quota: {files: -5}}}",
        ("limits.session.quota.files", "greater than or equal to 0"),
    ),
    "bad-zone-permission": (
        "zones: {docs: {path: docs, permissions: {untrusted: rx}}}",
        ("zones.docs.permissions.untrusted", "rwld"),
    ),
    "unknown-limit-key": (
        "limits: {session: {max_bytes: 1}}",
        ("limits.session.max_bytes", "max_file_bytes", "suffixes", "quota"),
    ),
    "unknown-quota-key": (
        "limits: {session: {quota: {byte: 1}}}",
        ("limits.session.quota.byte", "bytes", "files"),
    ),
    "unknown-zone-key": (
        "zones: {docs: {path: docs, perms: {}}}",
        ("zones.docs.perms", "path", "permissions"),
    ),
}


def write_bad_config(project: Path, text: str) -> None:
    (project / "docs" / "part").mkdir(parents=True)
    (project / ".sandbox" / "workspaces").mkdir(parents=True)  # as after an earlier mount
    (project / "sandboxfs.yaml").write_text(text + "\n")


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_stops_mount(case: str, tmp_path: Path, project: Path) -> None:
    text, needles = BAD_CONFIGS[case]
    write_bad_config(project, text)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = sandboxfs("mount", mnt, "--project", project, "--trust", "session")
    try:
        assert_one_line_error(result, f"{project}/sandboxfs.yaml", *needles)
        assert not is_mounted(mnt)
        assert not any(mnt.iterdir())
    finally:
        if is_mounted(mnt):
            sandboxfs("umount", mnt)


@pytest.mark.skipif(not os.path.exists("/usr/bin/bwrap"), reason="run needs bubblewrap")
@pytest.mark.parametrize("case", ["path-missing", "suffix-without-dot", "zones-overlap"])
def test_bad_config_stops_run_with_125(case: str, tmp_path: Path, project: Path) -> None:
    """docs/configuration.md: a bad zone or limit stops `run` too, with one line, exit 125
    (`mount`: 2)."""
    text, needles = BAD_CONFIGS[case]
    write_bad_config(project, text)
    marker = tmp_path / "ran"
    result = sandboxfs("run", "--project", project, "--trust", "session", "--", "touch", marker)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 125, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in (f"{project}/sandboxfs.yaml", *needles):
        assert needle in lines[0], (needle, lines[0])
    assert not marker.exists()
    state = os.environ["SANDBOXFS_STATE_DIR"]
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    assert not [line for line in mounts if "fuse.sandboxfs" in line and state in line]


def test_a_project_file_shows_no_zone_the_user_would_not_expose(tmp_path: Path) -> None:
    """A repository's own sandboxfs.yaml naming the user's logins, home, a system directory
    or another project (with its state dir and the logins `home seed` copied there) as a
    zone: `mount` and `run` refuse it in one line, nothing mounted."""
    home = tmp_path / "home"
    (home / ".config" / "gh").mkdir(parents=True)
    (home / ".claude").mkdir()
    (home / ".claude" / ".credentials.json").write_text("{}\n")
    (home / "other" / ".sandbox" / "workspaces").mkdir(parents=True)
    project = make_project(tmp_path)
    (tmp_path / "mnt").mkdir()
    env = {**os.environ, "HOME": str(home)}
    for path, why in [
        (home / ".config" / "gh", "refused: ~/.config/gh is secret"),
        (home / ".claude", "~/.claude/.credentials.json"),
        (home, "refused: ~ is your home"),
        (home / "other", "holds a project's state dir"),
        (home / "other" / ".sandbox", "a project's state dir"),
        (Path("/etc"), "refused: /etc is under /etc"),
    ]:
        (project / "sandboxfs.yaml").write_text(f"zones: {{z: {{path: {str(path)!r}}}}}\n")
        for command, status in (["mount", str(tmp_path / "mnt")], 2), (["run", "--", "true"], 125):
            try:
                result = subprocess.run(
                    [*SANDBOXFS, command[0], "--project", str(project), *command[1:]],
                    capture_output=True, text=True, env=env, timeout=60,
                )  # fmt: skip
            finally:
                if is_mounted(tmp_path / "mnt"):
                    sandboxfs("umount", tmp_path / "mnt")
            lines = result.stderr.splitlines()
            assert result.returncode == status and len(lines) == 1, (path, result.stderr)
            assert "sandboxfs.yaml: zones.z.path: " in lines[0] and why in lines[0], lines
        assert not is_mounted(tmp_path / "mnt")
