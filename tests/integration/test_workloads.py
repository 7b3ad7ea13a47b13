"""Real workloads at trust `full` must behave exactly as on a native directory.

Each test runs real programs (git, tar, rsync, cp, vim, python -m venv + pip, sqlite, make, and a
pool of concurrent writers) inside a live mount, checks exit codes and results, and where it makes
sense runs the same workload in a native directory and compares the outcomes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh

VIM = shutil.which("vim") or shutil.which("vim.tiny") or shutil.which("vi") or "vi"

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Work Load",
    "GIT_AUTHOR_EMAIL": "workload@example.invalid",
    "GIT_COMMITTER_NAME": "Work Load",
    "GIT_COMMITTER_EMAIL": "workload@example.invalid",
    "GIT_AUTHOR_DATE": "2024-01-02T03:04:05Z",
    "GIT_COMMITTER_DATE": "2024-01-02T03:04:05Z",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def run(
    cmd: str,
    cwd: Path | None = None,
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`sh` that fails the test with the full output when the command fails."""
    result = sh(cmd, cwd=cwd, timeout=timeout, env=env)
    assert result.returncode == 0, (
        f"{cmd!r} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """Wait for every process and collect its output; kill (by its own PID) and reap whatever
    is still running if anything goes wrong, so no process or pipe outlives the test."""
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    return outputs


# ----- comparing trees ---------------------------------------------------------------------------


def snapshot(
    root: Path, *, mtimes: bool = True, xattrs: bool = False
) -> dict[str, tuple[Any, ...]]:
    """Everything observable about a tree, keyed by relative path (directory sizes excluded)."""
    result: dict[str, tuple[Any, ...]] = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            extra: tuple[Any, ...] = ()
            if stat.S_ISLNK(st.st_mode):
                extra = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                extra = ("file", st.st_size, hashlib.sha256(path.read_bytes()).hexdigest())
                inodes.setdefault(st.st_ino, []).append(rel)
            else:
                extra = ("dir",)
            attrs: tuple[Any, ...] = ()
            if xattrs and not stat.S_ISLNK(st.st_mode):
                attrs = tuple(
                    sorted(
                        (n, os.getxattr(path, n))
                        for n in os.listxattr(path)
                        if n.startswith("user.")
                    )
                )
            mtime = st.st_mtime_ns if mtimes else None
            result[rel] = (
                kind,
                stat.S_IMODE(st.st_mode),
                st.st_nlink if kind != stat.S_IFDIR else None,
                mtime,
                attrs,
                *extra,
            )
    for names in inodes.values():
        for name in names:
            result[name] = (*result[name], "links", tuple(sorted(names)))
    return result


def build_tree(root: Path) -> None:
    """A tree with private and executable modes, a symlink, a hard link, an empty dir, a
    user xattr and nanosecond mtimes."""
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "private.txt").write_text("only me\n")
    (root / "private.txt").chmod(0o600)
    (root / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (root / "run.sh").chmod(0o755)
    (root / "sub" / "data.bin").write_bytes(bytes(range(256)) * 64)
    (root / "sub" / "deeper" / "note.md").write_text("# note\n" * 100)
    os.link(root / "sub" / "data.bin", root / "hardlink.bin")
    os.symlink("run.sh", root / "link-to-run")
    os.symlink("sub/deeper", root / "link-to-dir")
    os.symlink("does-not-exist", root / "dangling")
    os.setxattr(root / "sub" / "deeper" / "note.md", "user.origin", b"workload-test")
    stamp = 1_600_000_000_123_456_789
    for i, path in enumerate(sorted(root.rglob("*"), key=lambda p: -len(p.parts))):
        when = stamp + i * 1_000_000_007
        os.utime(path, ns=(when, when), follow_symlinks=False)


# ----- git ---------------------------------------------------------------------------------------

# `git init` writes .git/config and .git/hooks/, which are protected: never created or changed
# through the mount at any level. The user's repo exists before the agent runs, so it is made
# natively; everything after it runs through the mount.
GIT_INIT = "git -c init.defaultBranch=main init -q"

GIT_WORKFLOW = """
set -e
git add -A
git commit -qm initial
git switch -qc feature
mkdir -p lib/pkg
printf 'def f():\\n    return 1\\n' > lib/pkg/mod.py
printf 'x\\n' > lib/pkg/data.txt
git add -A
git commit -qm 'add lib'
git mv lib vendor
git commit -qm 'move lib to vendor'
printf 'def g():\\n    return 2\\n' >> vendor/pkg/mod.py
printf 'new\\n' > vendor/pkg/new.txt
git rm -q vendor/pkg/data.txt
git add -A
git commit -qm 'edit in vendor'
printf 'more\\n' >> vendor/pkg/new.txt
git commit -qam 'edit in moved dir'
git switch -q main
git switch -q feature
git gc -q
git fsck --full --strict
git status --porcelain
git rev-parse main feature
git ls-files -s
"""


def test_git_workflow_in_repo_matches_native(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    # The user's project ignores its secrets, as real ones do: inside, deny-listed files are
    # shown but unreadable, so `git add -A` would stop at one that is neither tracked nor
    # ignored (docs/concepts.md, "Deny list").
    (project / ".gitignore").write_text(".env\n.ssh/\n*.pem\n")
    native = tmp_path / "native-project"
    shutil.copytree(project, native, symlinks=True)
    run(GIT_INIT, cwd=native, env=GIT_ENV)
    expected = run(GIT_WORKFLOW, cwd=native, env=GIT_ENV)
    run(GIT_INIT, cwd=project, env=GIT_ENV)  # the user's repo, before mounting
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        result = run(GIT_WORKFLOW, cwd=repo, env=GIT_ENV)
        assert result.stdout == expected.stdout  # same commits, same tree, status clean
        assert "vendor/pkg/new.txt" in result.stdout
        assert ".env" not in result.stdout and "id_rsa" not in result.stdout
        assert run("git log --format=%s", cwd=repo).stdout.splitlines() == [
            "edit in moved dir",
            "edit in vendor",
            "move lib to vendor",
            "add lib",
            "initial",
        ]
        assert run("git status --porcelain", cwd=repo).stdout == ""
    # the objects written through the mount are sound when read natively
    run("git fsck --full --strict", cwd=project, env=GIT_ENV)
    assert (
        run("git rev-parse HEAD", cwd=project).stdout
        == run("git rev-parse HEAD", cwd=native).stdout
    )


def test_git_clone_of_native_bare_repo(mount_at: Callable[..., Any], tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (origin / "tool.sh").chmod(0o755)
    (origin / "docs").mkdir()
    (origin / "docs" / "guide.md").write_text("guide\n" * 500)
    os.symlink("docs/guide.md", origin / "GUIDE")
    run(
        "git -c init.defaultBranch=main init -q && git add -A && git commit -qm one && "
        "echo two >> docs/guide.md && git commit -qam two",
        cwd=origin,
        env=GIT_ENV,
    )
    bare = tmp_path / "origin.git"
    run(f"git clone -q --bare {origin} {bare}", env=GIT_ENV)
    native_clone = tmp_path / "native-clone"
    run(f"git clone -q {bare} {native_clone}", env=GIT_ENV)
    with mount_at("full") as m:
        target = m.mnt / "repo" / "third_party" / "origin"
        target.parent.mkdir()
        # A new .git below the repo would choose what the user's git runs there:
        # `git clone` into /repo is refused; into the workspace, the agent's own, it works.
        cloned = sh(f"git clone -q {bare} {target}", env=GIT_ENV)
        assert cloned.returncode != 0 and "Read-only file system" in cloned.stderr, cloned
        target = m.mnt / "workspace" / "third_party" / "origin"
        target.parent.mkdir()
        run(f"git clone -q {bare} {target}", env=GIT_ENV)
        assert run("git status --porcelain", cwd=target).stdout == ""
        run("git fsck --full --strict", cwd=target, env=GIT_ENV)
        for cmd in ("git rev-parse HEAD", "git ls-files -s", "git log --format=%H%s"):
            assert run(cmd, cwd=target).stdout == run(cmd, cwd=native_clone).stdout

        def worktree(root: Path) -> dict[str, tuple[Any, ...]]:
            return {
                k: v
                for k, v in snapshot(root, mtimes=False).items()
                if k != ".git" and not k.startswith(".git/")
            }

        assert worktree(target) == worktree(native_clone)
        assert os.readlink(target / "GUIDE") == "docs/guide.md"
        assert os.access(target / "tool.sh", os.X_OK)
        assert run("./tool.sh", cwd=target).stdout == "tool\n"


# ----- tar ---------------------------------------------------------------------------------------


def test_tar_round_trip(mount_at: Callable[..., Any], tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_tree(src / "t")
    archive = tmp_path / "native.tar"
    run(f"tar -C {src} -cpf {archive} t")
    native_x = tmp_path / "native-x"
    native_x.mkdir()
    run(f"tar -C {native_x} -xpf {archive}")
    with mount_at("full") as m:
        dest = m.mnt / "session" / "working" / "x"
        dest.mkdir()
        run(f"tar -C {dest} -xpf {archive}")
        diff = sh(f"tar -C {dest} -df {archive}")
        assert (diff.returncode, diff.stdout, diff.stderr) == (0, "", "")
        assert snapshot(dest) == snapshot(native_x)
        t = dest / "t"
        assert stat.S_IMODE((t / "private.txt").stat().st_mode) == 0o600
        assert stat.S_IMODE((t / "run.sh").stat().st_mode) == 0o755
        assert os.readlink(t / "link-to-run") == "run.sh"
        assert list((t / "empty").iterdir()) == []
        a, b = (t / "hardlink.bin").stat(), (t / "sub" / "data.bin").stat()
        assert a.st_ino == b.st_ino and a.st_nlink == b.st_nlink == 2
        # and back out: archives made from the mount and natively are byte-identical
        out_mnt, out_native = tmp_path / "from-mount.tar", tmp_path / "from-native.tar"
        run(f"tar --sort=name -C {dest} -cpf {out_mnt} t")
        run(f"tar --sort=name -C {native_x} -cpf {out_native} t")
        assert out_mnt.read_bytes() == out_native.read_bytes()
    back = tmp_path / "back"
    back.mkdir()
    run(f"tar -C {back} -xpf {out_mnt}")
    assert snapshot(back) == snapshot(native_x)


# ----- rsync -------------------------------------------------------------------------------------


def test_rsync_archive_then_dry_run_is_empty(mount_at: Callable[..., Any], tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_tree(src)
    with mount_at("full") as m:
        dest = m.mnt / "workspace" / "data" / "mirror"
        first = sh(f"rsync -aHAX {src}/ {dest}/")
        assert (first.returncode, first.stderr) == (0, "")
        again = sh(f"rsync -anciHAX {src}/ {dest}/")
        assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
        assert snapshot(dest, xattrs=True) == snapshot(src, xattrs=True)
        # a change is picked up, and only that change
        (src / "sub" / "deeper" / "note.md").write_text("changed\n")
        changed = run(f"rsync -anciHAX {src}/ {dest}/")
        assert [line.split()[-1] for line in changed.stdout.splitlines()] == ["sub/deeper/note.md"]


def test_rsync_keeps_acls_and_refuses_non_user_xattrs(
    mount_at: Callable[..., Any], tmp_path: Path
) -> None:
    """POSIX ACLs pass through to the backing files (rsync -A and cp -a keep them); of the
    other namespaces only user.* can be set, so a trusted.* xattr is reported by rsync (exit
    23) while the data and the ACL still arrive. Natively (root) it is clean."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "acl.txt").write_text("acl\n")
    (src / "trusted.txt").write_text("trusted\n")
    run(f"setfacl -m u:nobody:r {src}/acl.txt")
    as_root = os.geteuid() == 0  # only root can set trusted.* (on the source, too)
    if as_root:
        os.setxattr(src / "trusted.txt", "trusted.marker", b"1")
    native = sh(f"rsync -aHAX {src}/ {tmp_path}/native/")
    assert (native.returncode, native.stderr) == (0, "")
    with mount_at("full") as m:
        dest = m.mnt / "session" / "working" / "acl"
        result = sh(f"rsync -aHAX {src}/ {dest}/")
        assert "set_acl" not in result.stderr
        if as_root:
            assert result.returncode == 23
            assert '"trusted.marker") failed: Operation not permitted (1)' in result.stderr
        else:
            assert (result.returncode, result.stderr) == (0, "")
        assert (dest / "acl.txt").read_text() == "acl\n"
        assert (dest / "trusted.txt").read_text() == "trusted\n"
        assert "user:nobody:r--" in sh(f"getfacl {dest}/acl.txt").stdout
        copied = sh(f"cp -a {src}/acl.txt {dest}/by-cp.txt")
        assert (copied.returncode, copied.stderr) == (0, "")
        assert "user:nobody:r--" in sh(f"getfacl {dest}/by-cp.txt").stdout
        assert sh(f"rsync -anciAX {src}/acl.txt {dest}/acl.txt").stdout == ""


# ----- cp -a -------------------------------------------------------------------------------------


def test_cp_archive_in_and_back_out(mount_at: Callable[..., Any], tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_tree(src)
    with mount_at("full") as m:
        inside = m.mnt / "repo" / "copied"
        run(f"cp -a {src} {inside}")
        assert snapshot(inside, xattrs=True) == snapshot(src, xattrs=True)
        back = tmp_path / "back"
        run(f"cp -a {inside} {back}")
    assert snapshot(back, xattrs=True) == snapshot(src, xattrs=True)


# ----- vim ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backupcopy", ["yes", "no"])
def test_vim_saves_with_swap_and_backup(
    mount_at: Callable[..., Any], tmp_path: Path, backupcopy: str
) -> None:
    # backupskip= : the default skips backups for anything under /tmp, where pytest works
    script = (
        f"{VIM} -Es -u NONE -c 'set nocompatible backup writebackup swapfile backupskip= "
        f"backupcopy={backupcopy}' -c 'normal Gonew line' -c 'wq' notes.txt"
    )

    def edit(where: Path) -> dict[str, str]:
        where.mkdir(parents=True, exist_ok=True)
        (where / "notes.txt").write_text("first\nsecond\n")
        (where / "notes.txt").chmod(0o640)
        result = sh(script, cwd=where, timeout=30)
        assert (result.returncode, result.stderr) == (0, ""), result.stdout
        assert stat.S_IMODE((where / "notes.txt").stat().st_mode) == 0o640
        return {p.name: p.read_text() for p in where.iterdir()}

    native = edit(tmp_path / "native")
    assert native == {"notes.txt": "first\nsecond\nnew line\n", "notes.txt~": "first\nsecond\n"}
    with mount_at("full") as m:
        assert edit(m.mnt / "repo" / "docs") == native
        assert edit(m.mnt / "session" / "working") == native


# ----- python -m venv + pip ----------------------------------------------------------------------

TINY_BACKEND = '''
"""A minimal in-tree PEP 517 backend: stdlib only, so it builds offline in a bare venv."""
import base64
import hashlib
import os
import zipfile

NAME, VERSION = "tinypkg", "0.1"
DIST = f"{NAME}-{VERSION}.dist-info"


def _record(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    filename = f"{NAME}-{VERSION}-py3-none-any.whl"
    files = {}
    for root, _dirs, names in os.walk(NAME):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    files[path.replace(os.sep, "/")] = f.read()
    meta = f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n"
    files[f"{DIST}/METADATA"] = meta.encode()
    files[f"{DIST}/WHEEL"] = (
        b"Wheel-Version: 1.0\\nGenerator: tiny\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    )
    record = [_record(p, d) for p, d in files.items()] + [f"{DIST}/RECORD,,"]
    files[f"{DIST}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return filename
'''


def test_venv_and_offline_pip_install(mount_at: Callable[..., Any]) -> None:
    pip = Path(sys.executable).parent / "pip"
    base_python = getattr(sys, "_base_executable", None) or shutil.which("python3") or "python3"
    with mount_at("full") as m:
        work = m.mnt / "session" / "working"
        pkg = work / "pkg"
        (pkg / "tinypkg").mkdir(parents=True)
        (pkg / "pyproject.toml").write_text(
            '[build-system]\nrequires = []\nbuild-backend = "tinybackend"\nbackend-path = ["."]\n'
        )
        (pkg / "tinybackend.py").write_text(TINY_BACKEND)
        (pkg / "tinypkg" / "__init__.py").write_text("VALUE = 42\n")
        tmp = m.mnt / "workspace" / "cache" / "tmp"
        tmp.mkdir()
        run(f"{base_python} -m venv --without-pip {work}/venv", timeout=60)
        env = {
            "TMPDIR": str(tmp),  # pip's build and unpack directories go through the mount too
            "PIP_CONFIG_FILE": "/dev/null",
            "PIP_NO_CACHE_DIR": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_FIND_LINKS": "",
        }
        install = run(
            f"{pip} --python {work}/venv/bin/python install --no-index --no-build-isolation ./pkg",
            cwd=work,
            timeout=120,
            env=env,
        )
        assert "Successfully installed tinypkg-0.1" in install.stdout
        used = run(
            f"{work}/venv/bin/python -c 'import sys, tinypkg; "
            f"print(tinypkg.VALUE, sys.prefix, tinypkg.__file__)'"
        )
        value, prefix, module = used.stdout.split()
        assert value == "42"
        assert prefix == f"{work}/venv"
        assert module == f"{work}/venv/lib/python3.11/site-packages/tinypkg/__init__.py"
        listed = run(f"{pip} --python {work}/venv/bin/python list --format=json", env=env)
        assert {"name": "tinypkg", "version": "0.1"} in json.loads(listed.stdout)
        uninstall = run(f"{pip} --python {work}/venv/bin/python uninstall -y tinypkg", env=env)
        assert "Successfully uninstalled tinypkg-0.1" in uninstall.stdout
        gone = sh(f"{work}/venv/bin/python -c 'import tinypkg'")
        assert gone.returncode == 1 and "No module named 'tinypkg'" in gone.stderr


# ----- sqlite in WAL mode ------------------------------------------------------------------------

SQLITE_CLIENT = """
import sqlite3, sys, time
db, role = sys.argv[1], sys.argv[2]
con = sqlite3.connect(db, timeout=60, isolation_level=None)
con.execute("PRAGMA busy_timeout=60000")
if role == "writer":
    for i in range(500):
        con.execute("BEGIN IMMEDIATE")
        con.execute("INSERT INTO t(v, check_v) VALUES (?, ?)", (f"row{i}", i * 7))
        con.execute("COMMIT")
    print("wrote 500")
else:
    last = rounds = 0
    while last < 500:
        time.sleep(0.002)
        count, total = con.execute("SELECT count(*), coalesce(sum(check_v), 0) FROM t").fetchone()
        assert count >= last, (count, last)
        assert total == 7 * count * (count - 1) // 2, (count, total)  # a consistent snapshot
        last, rounds = count, rounds + 1
    print("read", last)
"""


def test_sqlite_wal_with_concurrent_readers(mount_at: Callable[..., Any], tmp_path: Path) -> None:
    client = tmp_path / "client.py"
    client.write_text(SQLITE_CLIENT)
    with mount_at("full") as m:
        db = m.mnt / "workspace" / "data" / "app.db"
        mode = run(
            f"sqlite3 {db} 'PRAGMA journal_mode=WAL; "
            f"CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT, check_v INTEGER);'"
        )
        assert mode.stdout.strip() == "wal"
        readers = [
            subprocess.Popen(
                [sys.executable, str(client), str(db), "reader"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        try:
            writer = subprocess.run(
                [sys.executable, str(client), str(db), "writer"],
                capture_output=True,
                text=True,
                timeout=90,
                check=False,
            )
        finally:
            outs = finish(readers, timeout=90)
        assert (writer.returncode, writer.stdout, writer.stderr) == (0, "wrote 500\n", "")
        for r, (out, err) in zip(readers, outs, strict=True):
            assert (r.returncode, out, err) == (0, "read 500\n", "")
        final = run(
            f"sqlite3 {db} 'SELECT count(*) FROM t; PRAGMA integrity_check; PRAGMA journal_mode;'"
        )
        assert final.stdout.split() == ["500", "ok", "wal"]
    backing = m.project / ".sandbox" / "workspaces" / "default" / "workspace" / "data" / "app.db"
    assert run(f"sqlite3 {backing} 'SELECT count(*) FROM t'").stdout == "500\n"


# ----- make --------------------------------------------------------------------------------------

MAKEFILE = """\
prog: main.o helper.o
\tcc -o prog main.o helper.o

%.o: %.c helper.h
\tcc -Wall -c -o $@ $<

clean:
\trm -f prog *.o
"""


def test_make_builds_and_rebuilds_only_what_changed(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        src = m.mnt / "repo" / "csrc"
        src.mkdir()
        (src / "helper.h").write_text("int helper(int x);\n")
        (src / "main.c").write_text(
            '#include <stdio.h>\n#include "helper.h"\n'
            'int main(void) { printf("result=%d\\n", helper(20)); return 0; }\n'
        )
        (src / "helper.c").write_text(
            '#include "helper.h"\nint helper(int x) { return x * 2 + 2; }\n'
        )
        (src / "Makefile").write_text(MAKEFILE)
        first = run("make", cwd=src)
        assert first.stdout.splitlines() == [
            "cc -Wall -c -o main.o main.c",
            "cc -Wall -c -o helper.o helper.c",
            "cc -o prog main.o helper.o",
        ]
        assert run("./prog", cwd=src).stdout == "result=42\n"
        again = run("make", cwd=src)
        assert "'prog' is up to date." in again.stdout
        assert "cc " not in again.stdout
        # helper.c newer than everything built, with explicit past times: no sleeping and no
        # clock-skew warnings; the rebuilt objects get the current time, newer than all
        past = time.time_ns() - 100 * 10**9
        for path in src.iterdir():
            os.utime(path, ns=(past, past))
        (src / "helper.c").write_text('#include "helper.h"\nint helper(int x) { return x + 1; }\n')
        os.utime(src / "helper.c", ns=(past + 10**9, past + 10**9))
        rebuilt = run("make", cwd=src)
        assert rebuilt.stdout.splitlines() == [
            "cc -Wall -c -o helper.o helper.c",
            "cc -o prog main.o helper.o",
        ]
        assert run("./prog", cwd=src).stdout == "result=21\n"
        assert "'prog' is up to date." in run("make", cwd=src).stdout
        run("make clean", cwd=src)
        assert sorted(p.name for p in src.iterdir()) == [
            "Makefile",
            "helper.c",
            "helper.h",
            "main.c",
        ]


# ----- concurrent mixed writers ------------------------------------------------------------------

STRESS_WORKER = r"""
import hashlib, json, os, random, sys, time, zlib

base, wid, duration, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
hard_links = sys.argv[5] == "links"
rng = random.Random(seed)
own = f"own{wid}"
os.mkdir(os.path.join(base, own))
files = {}          # path relative to base -> bytearray content (hard links share one object)
dirs = {own}        # own directories (relative to base)
ops = {}
counter = 0
log_seq = 0
log_fd = None


def p(rel):
    return os.path.join(base, rel)


def fresh_name(where):
    global counter
    counter += 1
    return f"{where}/f{counter}" if where != "shared" else f"shared/p{wid}_{counter}"


def write_all(fd, data):
    view = memoryview(bytes(data))
    while view:
        chunk = view[: rng.choice([1, 7, 100, 4096, 70000])]
        n = os.write(fd, chunk)
        view = view[n:]


def place():
    choices = sorted(dirs) + ["shared"]
    return rng.choice(choices)


def verify(rel):
    with open(p(rel), "rb") as f:
        got = f.read()
    if got != files[rel]:
        raise AssertionError(f"{rel}: content differs ({len(got)} vs {len(files[rel])} bytes)")


def log_record():
    global log_seq, log_fd
    body = rng.randbytes(rng.randint(1, 200)).hex()
    line = f"{wid:02d} {log_seq:08d} {body} {zlib.crc32(body.encode()):08x}\n".encode()
    if log_fd is None or rng.random() < 0.3:
        if log_fd is not None:
            os.close(log_fd)
        log_fd = os.open(p("shared/log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if os.write(log_fd, line) != len(line):
        raise AssertionError("short append")
    log_seq += 1


deadline = time.monotonic() + duration
while time.monotonic() < deadline:
    names = sorted(files)
    op = rng.choice(["create"] * 4 + ["overwrite", "append", "append", "pwrite", "truncate",
                     "rename", "rename", "replace", "unlink", "verify", "verify", "mkdir",
                     "rename_dir", "rmdir", "latest", "listdir", "held"]
                    + (["link", "link", "link_dance"] if hard_links else []))
    if not names and op not in ("create", "mkdir", "latest", "listdir"):
        op = "create"
    ops[op] = ops.get(op, 0) + 1
    if op == "create":
        rel = fresh_name(place())
        data = bytearray(rng.randbytes(rng.choice([0, 1, 100, 5000, 200000])))
        fd = os.open(p(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        write_all(fd, data)
        os.close(fd)
        files[rel] = data
    elif op == "overwrite":
        rel = rng.choice(names)
        data = bytearray(rng.randbytes(rng.choice([0, 10, 3000, 100000])))
        fd = os.open(p(rel), os.O_WRONLY | os.O_TRUNC)
        write_all(fd, data)
        os.close(fd)
        files[rel][:] = data
    elif op == "append":
        rel = rng.choice(names)
        data = rng.randbytes(rng.choice([1, 50, 9000]))
        fd = os.open(p(rel), os.O_WRONLY | os.O_APPEND)
        write_all(fd, data)
        os.close(fd)
        files[rel] += data
    elif op == "pwrite":
        rel = rng.choice(names)
        data = rng.randbytes(rng.randint(1, 5000))
        off = rng.randint(0, len(files[rel]) + 100)
        fd = os.open(p(rel), os.O_RDWR)
        if os.pwrite(fd, data, off) != len(data):
            raise AssertionError("short pwrite")
        os.close(fd)
        content = files[rel]
        if off > len(content):
            content += bytes(off - len(content))
        content[off : off + len(data)] = data
    elif op == "truncate":
        rel = rng.choice(names)
        size = rng.randint(0, len(files[rel]) + 1000)
        os.truncate(p(rel), size)
        content = files[rel]
        if size < len(content):
            del content[size:]
        else:
            content += bytes(size - len(content))
    elif op == "rename":
        rel = rng.choice(names)
        new = fresh_name(place())
        os.rename(p(rel), p(new))
        files[new] = files.pop(rel)
    elif op == "replace" and len(names) >= 2:
        src, dst = rng.sample(names, 2)
        os.rename(p(src), p(dst))
        if files[src] is not files[dst]:  # two names of one inode: rename does nothing
            files[dst] = files.pop(src)
    elif op == "unlink":
        rel = rng.choice(names)
        os.unlink(p(rel))
        del files[rel]
    elif op == "link_dance":
        # a second name, a listing of its directory, a rename and an unlink of that name:
        # the first name must still lead to the same bytes
        rel = rng.choice(names)
        second = fresh_name(os.path.dirname(rel))
        os.link(p(rel), p(second))
        os.listdir(p(os.path.dirname(rel)))
        third = fresh_name(place())
        os.rename(p(second), p(third))
        os.unlink(p(third))
        verify(rel)
    elif op == "link":
        rel = rng.choice(names)
        new = fresh_name(place())
        os.link(p(rel), p(new))
        files[new] = files[rel]
    elif op == "held":
        # write, fchmod and ftruncate through a descriptor while its name moves away
        rel = rng.choice(names)
        fd = os.open(p(rel), os.O_RDWR)
        new = fresh_name(place())
        os.rename(p(rel), p(new))
        files[new] = files.pop(rel)
        content = files[new]
        data = rng.randbytes(rng.randint(1, 3000))
        os.pwrite(fd, data, len(content))
        content += data
        os.fchmod(fd, rng.choice([0o600, 0o644, 0o640]))
        size = rng.randint(0, len(content))
        os.ftruncate(fd, size)
        del content[size:]
        if os.fstat(fd).st_size != size:
            raise AssertionError("fstat size after ftruncate")
        os.close(fd)
        verify(new)
        os.chmod(p(new), 0o644)
    elif op == "verify":
        verify(rng.choice(names))
    elif op == "mkdir":
        counter += 1
        rel = f"{rng.choice(sorted(dirs))}/d{counter}"
        os.mkdir(p(rel))
        dirs.add(rel)
    elif op == "rename_dir" and len(dirs) > 1:
        old = rng.choice(sorted(d for d in dirs if d != own))
        counter += 1
        parent = rng.choice(sorted(d for d in dirs if d != old and not d.startswith(old + "/")))
        new = f"{parent}/d{counter}"
        os.rename(p(old), p(new))
        moved = lambda r: new + r[len(old):] if r == old or r.startswith(old + "/") else r
        dirs = {moved(d) for d in dirs}
        files = {moved(r): c for r, c in files.items()}
        for r in rng.sample(sorted(files), min(3, len(files))):
            verify(r)  # the moved children are still reachable under the new names
    elif op == "rmdir":
        empty = [d for d in dirs if d != own
                 and not any(r.startswith(d + "/") for r in files)
                 and not any(x.startswith(d + "/") for x in dirs)]
        if empty:
            rel = rng.choice(sorted(empty))
            os.rmdir(p(rel))
            dirs.discard(rel)
    elif op == "latest":
        body = rng.randbytes(rng.randint(1, 100000))
        record = f"{wid} {len(body)} {zlib.crc32(body):08x}\n".encode() + body
        tmp = p(f"shared/.tmp{wid}")
        with open(tmp, "wb") as f:
            f.write(record)
        os.rename(tmp, p("shared/latest"))
    elif op == "listdir":
        listed = set(os.listdir(p("shared")))
        mine = {r.split("/", 1)[1] for r in files if r.startswith("shared/")}
        if not mine <= listed:
            raise AssertionError(f"listing misses {sorted(mine - listed)[:5]}")
    log_record()

if log_fd is not None:
    os.close(log_fd)
for rel in sorted(files):
    verify(rel)
json.dump({
    "files": {r: hashlib.sha256(c).hexdigest() for r, c in files.items()},
    "nlink": {r: sum(1 for c in files.values() if c is content) for r, content in files.items()},
    "sizes": {r: len(c) for r, c in files.items()},
    "dirs": sorted(dirs),
    "log_records": log_seq,
    "ops": ops,
}, sys.stdout)
"""


def run_stress(
    base: Path, script: Path, workers: int, duration: float, links: bool
) -> list[dict[str, Any]]:
    """Run the workers concurrently in base; return their manifests."""
    (base / "shared").mkdir(parents=True)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(base),
                str(i),
                str(duration),
                str(1000 + i),
                "links" if links else "no-links",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    outputs = finish(procs, timeout=duration + 90)
    for i, (proc, (_out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"worker {i} failed:\n{err}"
    return [json.loads(out) for out, _err in outputs]


def verify_stress(base: Path, manifests: list[dict[str, Any]]) -> None:
    """Every byte that exists is what some manifest says, and nothing else exists."""
    found_files: dict[str, str] = {}
    found_dirs: set[str] = set()
    found_nlink: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for d in dirnames:
            found_dirs.add(str((Path(dirpath) / d).relative_to(base)))
        for f in filenames:
            path = Path(dirpath) / f
            rel = str(path.relative_to(base))
            found_files[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            found_nlink[rel] = path.stat().st_nlink
    expected_files: dict[str, str] = {}
    expected_nlink: dict[str, int] = {}
    expected_dirs = {"shared"}
    for manifest in manifests:
        assert not set(manifest["files"]) & set(expected_files)
        expected_files.update(manifest["files"])
        expected_nlink.update(manifest["nlink"])
        expected_dirs.update(manifest["dirs"])
    log = (base / "shared" / "log").read_bytes()
    latest = (base / "shared" / "latest").read_bytes() if "shared/latest" in found_files else None
    found_files.pop("shared/log")
    found_files.pop("shared/latest", None)
    assert found_dirs == expected_dirs
    assert sorted(found_files) == sorted(expected_files)
    wrong = [rel for rel, digest in expected_files.items() if found_files[rel] != digest]
    assert wrong == [], f"content differs in {len(wrong)} files, e.g. {wrong[:5]}"
    wrong = [rel for rel, n in expected_nlink.items() if found_nlink[rel] != n]
    assert wrong == [], f"link count differs for {wrong[:5]}"
    # the shared O_APPEND log: every record of every process, intact and in its own order
    seqs: dict[int, list[int]] = {}
    for line in log.split(b"\n")[:-1]:
        wid, seq, body, crc = line.decode().split(" ")
        assert int(crc, 16) == zlib.crc32(body.encode()), f"torn record: {line[:60]!r}"
        seqs.setdefault(int(wid), []).append(int(seq))
    assert log.endswith(b"\n")
    for worker, manifest in enumerate(manifests):
        assert seqs.get(worker, []) == list(range(manifest["log_records"])), f"worker {worker}"
    if latest is not None:
        header, content = latest.split(b"\n", 1)
        _wid, size, crc = header.decode().split(" ")
        assert len(content) == int(size) and zlib.crc32(content) == int(crc, 16)


@pytest.mark.parametrize(
    "links",
    [
        pytest.param(False, id="no-hard-links"),
        pytest.param(True, id="hard-links"),
    ],
)
def test_eight_mixed_writers_keep_every_byte(
    mount_at: Callable[..., Any], tmp_path: Path, links: bool
) -> None:
    script = tmp_path / "stress_worker.py"
    script.write_text(STRESS_WORKER)
    # the checker itself, on a native directory (short run)
    native = tmp_path / "native"
    verify_stress(native, run_stress(native, script, workers=8, duration=1.0, links=links))
    with mount_at("full") as m:
        base = m.mnt / "session" / "working" / "stress"
        manifests = run_stress(base, script, workers=8, duration=5.0, links=links)
        wanted = ["rename_dir", "held", "replace", "rmdir", "listdir"]
        for op in wanted + (["link", "link_dance"] if links else []):
            assert sum(mf["ops"].get(op, 0) for mf in manifests) > 0, op
        verify_stress(base, manifests)
        backing = m.project / ".sandbox" / "workspaces" / "default" / "sessions" / m.session
    # and the backing store holds the same bytes
    verify_stress(backing / "working" / "stress", manifests)


def test_hard_link_name_survives_listing_rename_and_unlink(
    mount_at: Callable[..., Any], tmp_path: Path
) -> None:
    script = (
        "echo original > a && ln a b && ls > /dev/null && mv b c && rm c && cat a && "
        "echo other > b && echo appended >> a && cat a && cat b"
    )
    native = tmp_path / "native"
    native.mkdir()
    expected = run(script, cwd=native)
    assert expected.stdout == "original\noriginal\nappended\nother\n"
    with mount_at("full") as m:
        where = m.mnt / "session" / "working"
        result = sh(script, cwd=where)
        assert (result.returncode, result.stdout, result.stderr) == (0, expected.stdout, "")
        assert (where / "b").read_text() == "other\n"
