"""The adapter's hardening rules, called directly (no mount): protected paths, patterns that
survive renames and links, descriptors and grants revalidated after changes made outside the
mount, FIFOs swapped in under a cached name, and zones that say nothing to a level without
access."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from sandboxfs.config.model import ALWAYS_PROTECTED, ProjectConfig, _merge, defaults
from sandboxfs.core.inodes import ZONE_INO
from sandboxfs.core.policy import Patterns, Policy, Trust, Zone, fold
from sandboxfs.errors import Failure
from sandboxfs.project import control
from tests.support.adapter import CTX, Ctx, Harness, fails, make, no_mounts_left_behind

__all__ = ["make", "no_mounts_left_behind"]


# ===== matching ==================================================================================


@pytest.mark.parametrize(
    ("name", "is_dir", "pattern"),
    [
        (".ENV", False, ".env"),
        (".Env.Prod", False, ".env.*"),
        (".ENV.EXAMPLE", False, None),  # the exception folds too
        (".NetRC", False, ".netrc"),
        (".SSH", True, ".ssh/"),
        ("\uff0e\uff45\uff4e\uff56", False, ".env"),  # fullwidth: NFKC folds it to ASCII
        ("ID_RSA", False, "id_rsa*"),
        ("SERVER.PEM", False, "*.pem"),
        ("\uff29\uff24_rsa", False, "id_rsa*"),
        ("Stra\u00dfe.key", False, "*.key"),
    ],
)
def test_deny_patterns_match_folded_names(name: str, is_dir: bool, pattern: str | None) -> None:
    config = defaults()
    policy = Policy(config.matrix(), config.deny, Trust.FULL, (), config.deny_private_keys)
    found = policy.denied_name(name, name, is_dir)
    if found is None:  # the private-key patterns (refused by contents) fold the same way
        found = policy.private_keys.match(name, name, is_dir)
    assert found == pattern


def test_path_patterns_fold_and_see_below_moved_directories() -> None:
    patterns = Patterns(["config/production.yaml", ".git/hooks/", "a*/x"])
    assert patterns.match("Production.YAML", "CONFIG/Production.YAML", False)
    assert patterns.match_within(".git/hooks/pre-commit", False) == ".git/hooks/"
    assert patterns.match_within(".GIT/HOOKS", True) == ".git/hooks/"
    assert patterns.match_within("src/main.py", False) is None
    assert patterns.match_below("config") == "config/production.yaml"
    assert patterns.match_below("Config") == "config/production.yaml"
    assert patterns.match_below(".git") == ".git/hooks/"
    assert patterns.match_below("ab/cd") == "a*/x"  # "*" spans "/" as fnmatch's does
    assert patterns.match_below("cfg") is None
    assert fold("\u212b") == fold("\u00e5")  # Angstrom sign and a-ring normalise alike


def test_config_cannot_unprotect_itself() -> None:
    for override in (
        ProjectConfig(protect=[], inherit_protect=False),
        ProjectConfig(protect=["docs/"], inherit_protect=False),
    ):
        merged = _merge(defaults(), override)
        assert ALWAYS_PROTECTED in merged["protect"]
        assert ".git/hooks/" not in merged["protect"]
    assert "docs/" in _merge(defaults(), ProjectConfig(protect=["docs/"]))["protect"]


# ===== protect ===================================================================================


async def test_protected_paths_are_readable_but_never_changed(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    (h.project / "sandboxfs.yaml").write_text("default_trust: untrusted\n")
    hooks = h.project / ".git" / "hooks"
    hooks.mkdir(parents=True)
    (hooks / "pre-commit.sample").write_text("#!/bin/sh\n")
    (h.project / ".git" / "config").write_text("[core]\n")
    (h.project / ".git" / "index").write_text("index\n")
    repo = ZONE_INO[Zone.REPO]
    config = await h.ino("/repo/sandboxfs.yaml")
    fh = (await h.ops.open(config, os.O_RDONLY, CTX)).fh  # readable
    await h.ops.release(fh)
    for flags in (os.O_WRONLY, os.O_RDWR | os.O_TRUNC):
        await fails(h.ops.open(config, flags, CTX), errno.EROFS)
    entry = h.entries(op="write", path="/repo/sandboxfs.yaml", allowed=False)[0]
    assert entry["errno"] == "EROFS" and "'/sandboxfs.yaml'" in entry["reason"]
    await fails(h.ops.unlink(repo, b"sandboxfs.yaml", CTX), errno.EROFS)
    await fails(h.ops.rename(repo, b"README.md", repo, b"sandboxfs.yaml", 0, CTX), errno.EROFS)
    await fails(h.ops.rename(repo, b"sandboxfs.yaml", repo, b"old.yaml", 0, CTX), errno.EROFS)
    git = await h.ino("/repo/.git")
    hooks_ino = await h.ino("/repo/.git/hooks")
    await fails(h.ops.create(hooks_ino, b"pre-commit", 0o755, os.O_WRONLY, CTX), errno.EROFS)
    await fails(h.ops.symlink(hooks_ino, b"post-checkout", b"/tmp/x", CTX), errno.EROFS)
    await fails(h.ops.rmdir(git, b"hooks", CTX), errno.EROFS)
    await fails(h.ops.create(git, b"config", 0o644, os.O_WRONLY | os.O_TRUNC, CTX), errno.EROFS)
    # The directory above them cannot be moved away (it would carry them out) or replaced.
    await fails(h.ops.rename(repo, b".git", repo, b"git2", 0, CTX), errno.EROFS)
    src = await h.ino("/repo/src")
    await fails(h.ops.rename(repo, b"src", repo, b".git", 0, CTX), errno.EROFS)
    del src
    # A hard link to a protected file is a writable second name: refused too.
    await fails(h.ops.link(config, repo, b"kept.yaml", CTX), errno.EROFS)
    assert h.entries(op="link", allowed=False)[0]["errno"] == "EROFS"
    # What git needs at full still works: a new index through index.lock, objects, refs. The
    # index itself is written only so (each new one is judged at the rename).
    index = await h.ino("/repo/.git/index")
    await fails(h.ops.open(index, os.O_WRONLY | os.O_TRUNC, CTX), errno.EROFS)
    header = b"DIRC" + struct.pack(">II", 2, 0)
    fh = (await h.ops.create(git, b"index.lock", 0o644, os.O_WRONLY, CTX))[0].fh
    await h.ops.write(fh, 0, header + hashlib.sha1(header).digest())
    await h.ops.release(fh)
    await h.ops.rename(git, b"index.lock", git, b"index", 0, CTX)
    assert (h.project / ".git" / "index").read_bytes().startswith(b"DIRC")
    await h.ops.mkdir(git, b"refs", 0o755, CTX)
    assert (h.project / "sandboxfs.yaml").read_text() == "default_trust: untrusted\n"
    assert sorted(os.listdir(hooks)) == ["pre-commit.sample"]


# ===== patterns survive renames and links =======================================================


async def test_path_deny_patterns_survive_renames_and_links(
    make: Callable[[str], Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make("full")
    (h.project / "config").mkdir()
    (h.project / "config" / "production.yaml").write_text("secret: 1\n")
    (h.project / "config" / "dev.yaml").write_text("dev: 1\n")
    config = defaults()
    h.ops.guard.policy = Policy(
        config.matrix(), [*config.deny, "config/production.yaml"], Trust.FULL, config.protect
    )
    repo = ZONE_INO[Zone.REPO]
    cfg_dir = await h.ino("/repo/config")
    production = await h.ops.lookup(cfg_dir, b"production.yaml", CTX)  # shown, not read
    await fails(h.ops.open(production.st_ino, os.O_RDONLY, CTX), errno.EACCES)
    await fails(h.ops.rename(repo, b"config", repo, b"cfg", 0, CTX), errno.EACCES)
    entry = h.entries(op="rename", allowed=False)[0]
    assert "config/production.yaml" in entry["reason"] and entry["dest"] == "/repo/cfg"
    assert (h.project / "config" / "production.yaml").exists()
    # A node the kernel still holds is judged by its current path when linked.
    h.ops.guard.policy = Policy(config.matrix(), config.deny, Trust.FULL, config.protect)
    secret = await h.ino("/repo/config/production.yaml")
    h.ops.guard.policy = Policy(
        config.matrix(), [*config.deny, "config/production.yaml"], Trust.FULL, config.protect
    )
    await fails(h.ops.link(secret, repo, b"kept.yaml", CTX), errno.EACCES)
    assert not (h.project / "kept.yaml").exists()
    dev = await h.ino("/repo/config/dev.yaml")
    await h.ops.link(dev, repo, b"dev-link.yaml", CTX)  # an ordinary file still links


# ===== changes made outside the mount ============================================================


async def test_a_fifo_swapped_in_under_a_cached_name_never_blocks(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    data = h.dirs[Zone.WORKSPACE] / "data"
    node = await h.ino("/workspace/data/table.csv")
    os.unlink(data / "table.csv")
    os.mkfifo(data / "table.csv")
    started = time.monotonic()
    await fails(h.ops.open(node, os.O_RDONLY, CTX), errno.ESTALE)
    await fails(h.ops.open(node, os.O_WRONLY, CTX), errno.ESTALE)
    assert time.monotonic() - started < 2
    # Replaced by another regular file: also stale (the kernel then looks the name up again).
    os.unlink(data / "table.csv")
    (data / "table.csv").write_text("other\n")
    await fails(h.ops.open(node, os.O_RDONLY, CTX), errno.ESTALE)
    fresh = await h.ino("/workspace/data/table.csv")
    fh = (await h.ops.open(fresh, os.O_RDONLY, CTX)).fh
    assert await h.ops.read(fh, 0, 100) == b"other\n"
    await h.ops.release(fh)


async def test_a_directory_moved_out_of_the_zone_is_not_used_again(
    make: Callable[[str], Harness], tmp_path: os.PathLike[str]
) -> None:
    h = make("full")
    (h.project / "d").mkdir()
    (h.project / "d" / "inner").mkdir()
    inner = await h.ino("/repo/d/inner")
    fh = await h.ops.opendir(inner, CTX)  # the daemon now holds a descriptor of it
    await h.ops.releasedir(fh)
    away = h.project.parent / "away"
    os.rename(h.project / "d", away)  # the user moves it out of the project
    await fails(h.ops.create(inner, b"planted", 0o644, os.O_WRONLY, CTX), errno.ESTALE)
    await fails(h.ops.mkdir(inner, b"sub", 0o755, CTX), errno.ESTALE)
    await fails(h.listdir(inner), errno.ESTALE)
    (away / "inner" / "later.txt").write_text("put there later by the user\n")
    await fails(h.ops.unlink(inner, b"later.txt", CTX), errno.ESTALE)
    assert sorted(os.listdir(away / "inner")) == ["later.txt"]


async def test_a_reused_inode_number_does_not_revive_a_creation_grant(
    make: Callable[[str], Harness],
) -> None:
    h = make("untrusted")
    staged = ZONE_INO[Zone.STAGED]
    fi, _ = await h.ops.create(staged, b"mine.txt", 0o644, os.O_WRONLY, CTX)
    await h.ops.release(fi.fh)
    backing = h.dirs[Zone.STAGED]
    ino = os.stat(backing / "mine.txt").st_ino
    os.unlink(backing / "mine.txt")
    # Another party's file gets the same inode number (ext4 reuses freed ones at once).
    for i in range(50):
        (backing / f"other{i}.txt").write_text("not yours\n")
        if os.stat(backing / f"other{i}.txt").st_ino == ino:
            reused = f"other{i}.txt".encode()
            break
    else:
        pytest.skip("the filesystem did not reuse the inode number")
    await fails(h.ops.lookup(staged, reused, CTX), errno.ENOENT)
    h.denial("read", f"/staged/{reused.decode()}", "staged", "ENOENT", "create-only")


# ===== nothing about a zone leaks to a level without access =======================================


async def test_a_zone_without_access_looks_like_an_empty_directory(
    make: Callable[[str], Harness],
) -> None:
    h = make("untrusted")
    os.setxattr(h.project, "user.secret", b"s3cr3t")
    repo = ZONE_INO[Zone.REPO]
    attrs = await h.ops.getattr(repo, CTX)
    assert attrs.st_nlink == 2 and attrs.st_size == 0
    assert attrs.st_mtime_ns == h.ops.replies.mounted_ns
    assert stat.S_IMODE(attrs.st_mode) == 0o755
    assert await h.ops.listxattr(repo, CTX) == []
    await fails(h.ops.getxattr(repo, b"user.secret", CTX), errno.ENODATA)
    # A level that can read it sees the real directory and its attributes.
    full = make("full")
    os.setxattr(full.project, "user.secret", b"s3cr3t")
    assert await full.ops.getxattr(repo, b"user.secret", CTX) == b"s3cr3t"
    assert (await full.ops.getattr(repo, CTX)).st_nlink > 2


async def test_listing_offsets_are_contiguous_after_filtering(
    make: Callable[[str], Harness],
) -> None:
    h = make("full")
    for i in range(5):
        (h.project / f"a{i}.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    replies = await h.listdir(ZONE_INO[Zone.REPO])
    offsets = [next_id for _, _, next_id in replies.got]
    assert offsets == list(range(1, len(offsets) + 1))
    # Deny-listed files are listed; sandboxfs's state and the mountpoint are left out.
    assert sum(name.endswith(b".pem") for name in replies.names) == 6
    assert b".sandbox" not in replies.names and b"mnt" not in replies.names


async def test_context_json_reads_are_not_audited(make: Callable[[str], Harness]) -> None:
    h = make("full")
    context = await h.ino("/.sandboxfs/context.json")
    fh = (await h.ops.open(context, os.O_RDONLY, CTX)).fh
    await h.ops.release(fh)
    assert not h.entries(path="/.sandboxfs/context.json")
    await fails(h.ops.open(context, os.O_WRONLY, CTX), errno.EACCES)
    assert h.entries(path="/.sandboxfs/context.json", allowed=False)


# ===== writes are charged to the caller =========================================================


async def test_allocating_calls_run_with_the_callers_filesystem_identity(
    make: Callable[[str], Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make("full")
    h.ops.running_as_root = True
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr("sandboxfs.fuse.ops_base.set_fs_ids", lambda u, g: calls.append((u, g)))
    caller = Ctx(uid=4242, gid=4343, pid=os.getpid())
    working = await h.ino("/session/working")
    monkeypatch.setattr(os, "fchown", lambda *a: None)
    monkeypatch.setattr(os, "chown", lambda *a, **k: None)
    fi, _ = await h.ops.create(working, b"new.txt", 0o644, os.O_WRONLY, caller)
    assert calls == [(4242, 4343), (0, 0)]
    await h.ops.write(fi.fh, 0, b"data")
    assert calls[2:] == [(4242, 4343), (0, 0)]
    await h.ops.release(fi.fh)
    await h.ops.mkdir(working, b"d", 0o755, caller)
    assert calls[4:] == [(4242, 4343), (0, 0)]
    calls.clear()
    await h.ops.mkdir(working, b"e", 0o755, CTX if CTX.uid == 0 else Ctx(uid=0, gid=0, pid=1))
    assert calls == []  # root callers need no switch


# ===== the audit log fails closed ================================================================


async def test_nothing_audited_happens_while_the_log_cannot_be_written(
    make: Callable[[str], Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make("full")
    working = await h.ino("/session/working")
    monkeypatch.setattr(type(h.audit), "failing", property(lambda self: True))
    monkeypatch.setattr(h.audit, "try_flush", lambda: False)  # and still cannot write
    await fails(h.ops.mkdir(working, b"d", 0o755, CTX), errno.ENOSPC)
    await fails(h.ops.create(working, b"f", 0o644, os.O_WRONLY, CTX), errno.ENOSPC)
    await fails(h.ops.opendir(working, CTX), errno.ENOSPC)
    assert not (h.dirs[Zone.SESSION] / "working" / "d").exists()
    assert (await h.ops.lookup(working, b"notes.txt", CTX)).st_ino  # lookups still answer


async def test_every_creation_over_a_hidden_existing_name_is_a_write_refusal(
    make: Callable[[str], Harness],
) -> None:
    """Create-only: an existing file this mount did not make looks absent, and every way of
    creating that name is refused the same way, as an audited write (not EEXIST)."""
    h = make("untrusted")
    c0 = await h.ino("/staged/c0")
    await fails(h.ops.create(c0, b"old.txt", 0o644, os.O_WRONLY, CTX), errno.EACCES)
    await fails(h.ops.mkdir(c0, b"old.txt", 0o755, CTX), errno.EACCES)
    await fails(h.ops.symlink(c0, b"old.txt", b"x", CTX), errno.EACCES)
    for kind in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFREG):
        await fails(h.ops.mknod(c0, b"old.txt", kind | 0o644, 0, CTX), errno.EACCES)
    refused = h.entries(op="write", path="/staged/c0/old.txt", allowed=False)
    assert len(refused) == 6 and all("cannot be replaced" in e["reason"] for e in refused)
    # Where the zone is writable, EEXIST is the ordinary answer.
    full = make("full")
    working = await full.ino("/session/working")
    await fails(full.ops.mkdir(working, b"notes.txt", 0o755, CTX), errno.EEXIST)


async def test_links_are_refused_and_audited_as_links(make: Callable[[str], Harness]) -> None:
    h = make("full")
    repo = ZONE_INO[Zone.REPO]
    readme = await h.ino("/repo/README.md")
    for hidden in (b".sandbox", b"mnt"):  # onto sandboxfs's state, onto a mount: not EEXIST
        await fails(h.ops.link(readme, repo, hidden, CTX), errno.EACCES)
        entry = h.one(op="link", dest=f"/repo/{hidden.decode()}", allowed=False)
        assert entry["errno"] == "EACCES"
    staged = make("untrusted")
    c1 = (await staged.ops.mkdir(ZONE_INO[Zone.STAGED], b"c1", 0o755, CTX)).st_ino
    fi, attrs = await staged.ops.create(c1, b"f", 0o644, os.O_WRONLY, CTX)
    await staged.ops.release(fi.fh)
    await fails(staged.ops.link(attrs.st_ino, c1, b"g", CTX), errno.EACCES)
    assert staged.one(op="link", path="/staged/c1/f", allowed=False)["dest"] == "/staged/c1/g"


def test_an_undumpable_requester_is_identifiable_while_its_request_is_open() -> None:
    """run's supervisor is undumpable, and a non-root daemon refuses a requester whose
    /proc/<pid>/ns it cannot read: control requests make it dumpable for their duration only
    (nested ones too), then undumpable again."""
    probe = (
        "from sandboxfs.core.syscalls import is_dumpable, make_undumpable\n"
        "from sandboxfs.project import control\n"
        "make_undumpable()\n"
        "seen = []\n"
        "with control._identifiable():\n"
        "    seen.append(is_dumpable())\n"
        "    with control._identifiable():\n"
        "        seen.append(is_dumpable())\n"
        "    seen.append(is_dumpable())\n"
        "seen.append(is_dumpable())\n"
        "print(seen)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.stdout.strip() == "[True, True, True, False]", result.stderr


# ----- the control channel's framing ----------------------------------------------------------


def test_a_control_reply_is_sent_whole_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    class Trickle:
        """A socket whose `send` takes 7 bytes at a time, as a full buffer would."""

        def __init__(self) -> None:
            self.sent = b""

        async def send(self, data: memoryview, /) -> int:
            self.sent += bytes(data[:7])
            return min(7, len(data))

    conn = Trickle()
    answer = control.reply(True, pending=["x" * 1000])
    trio.run(control.send_whole, conn, answer)
    assert conn.sent == answer
    monkeypatch.setattr(control, "MAX_REPLY", 100)
    error = control.reply(True, pending=["x" * 1000])
    assert error.endswith(b"\n") and len(error) <= 100
    assert b'"ok": false' in error and b"larger than 100 bytes" in error


def test_a_cut_control_reply_is_said_plainly(tmp_path: Path) -> None:
    path = tmp_path / "c.sock"
    listener = control.bind(path)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b'{"v": 1, "ok": true, "pending": [')
            conn.shutdown(socket.SHUT_WR)

    server = threading.Thread(target=serve)
    server.start()
    try:
        with pytest.raises(Failure, match="was cut off after 33 bytes"):
            control.request(path, {"op": "status"}, timeout=5)
    finally:
        server.join(5)
        listener.close()
