"""git's config judged by content, on a live mount at `full`: git's own changes to `.git/config`
(written to `config.lock`, renamed onto `config`) are judged by the settings they change. Everyday
commands work and leave the user's config as git meant; each change that makes git run code or reach
elsewhere fails (git exits non-zero), is audited with the setting refused, and leaves the user's
config byte for byte as it was, also through `git config --file`, a hand-written `config.lock`, a
handle kept open across the rename, config.worktree and a submodule's config.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import sh
from tests.support.git import GIT_ENV, READ_ONLY, fsmonitor, git, user_repo
from tests.support.mounts import Mount

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def inside(cwd: Path, command: str) -> subprocess.CompletedProcess[str]:
    """A shell command line through the mount, with the suite's git identity and no global
    config (so nothing but the repository's own config is read)."""
    result = sh(command, cwd=cwd, env=GIT_ENV)
    assert "Input/output error" not in result.stderr, result.stderr
    return result


def with_origin(project: Path, tmp_path: Path) -> None:
    """The user's repository with a remote `origin` (a local bare repository) it pushed to."""
    user_repo(project)
    origin = tmp_path / "origin.git"
    assert git(tmp_path, "init", "-q", "--bare", str(origin)).returncode == 0
    for cmd in (["remote", "add", "origin", str(origin)], ["push", "-q", "-u", "origin", "main"]):
        result = git(project, *cmd)
        assert result.returncode == 0, result.stderr


def config_rename_denials(m: Mount, dest: str = "/repo/.git/config") -> list[dict[str, Any]]:
    return [e for e in m.audit("--denied") if e["op"] == "rename" and e.get("dest") == dest]


def test_everyday_commands_write_config_at_full(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    with_origin(project, tmp_path)
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        checkout = inside(repo, "git checkout -b feat origin/main")
        assert checkout.returncode == 0, checkout.stderr
        assert "could not write config" not in checkout.stderr, checkout.stderr
        assert "set up to track 'origin/main'" in checkout.stdout + checkout.stderr
        assert inside(repo, "git config branch.feat.merge").stdout == "refs/heads/main\n"
        upstream = inside(repo, "git rev-parse --abbrev-ref feat@{upstream}")
        assert upstream.stdout == "origin/main\n", upstream.stderr
        delete = inside(repo, "git checkout -q main && git branch -D feat")
        assert delete.returncode == 0, delete.stderr
        assert "Update of config-file failed" not in delete.stderr, delete.stderr
        for command in (
            "git remote add upstream https://example.invalid/upstream.git",
            "git remote add mirror git@example.invalid:team/project.git",
            "git remote set-url --push upstream ssh://git@example.invalid/upstream.git",
            "git config user.name 'Agent Smith'",
            "git config user.email agent@example.invalid",
            "git config --file .git/config pull.rebase true",
            "git branch --set-upstream-to origin/main main",
            "git remote rename mirror backup",
            "git remote remove backup",
            # a hand-written config.lock, renamed as git would
            "cp .git/config .git/config.lock && printf '[init]\\n\\tdefaultBranch = trunk\\n'"
            " >> .git/config.lock && mv .git/config.lock .git/config",
        ):
            result = inside(repo, command)
            assert result.returncode == 0, (command, result.stderr)
        assert config_rename_denials(m) == []
        m.wait_audit(lambda e: e["op"] == "rename" and e.get("dest") == "/repo/.git/config")
    listed = git(project, "config", "--list", "--local").stdout
    for line in (
        "remote.upstream.url=https://example.invalid/upstream.git",
        "remote.upstream.pushurl=ssh://git@example.invalid/upstream.git",
        "user.name=Agent Smith",
        "pull.rebase=true",
        "branch.main.remote=origin",
        "init.defaultbranch=trunk",
    ):
        assert line in listed.splitlines(), (line, listed)
    assert "branch.feat" not in listed and "remote.backup" not in listed, listed
    assert not (project / ".git" / "config.lock").exists()
    assert git(project, "status").returncode == 0


# Each refused: (what the agent runs, the setting the audit names).
REFUSED = [
    ("git config core.fsmonitor x", "core.fsmonitor"),
    ("git config alias.x '!sh'", "alias.x"),
    ("git config core.hooksPath /tmp/x", "core.hookspath"),
    ("git config include.path ../evil", "include.path"),
    ("git config includeIf.gitdir:/.path ../evil", "includeif.gitdir:/.path"),
    ("git config remote.o.url 'ext::sh -c id'", "remote.o.url"),
    ("git config remote.origin.url 'fd::17'", "remote.origin.url"),
    # A repository on this machine: the user's `git push` would run its hooks.
    ("git remote add local ../../agent.git", "remote.local.url"),
    ("git config remote.origin.pushurl file:///tmp/agent.git", "remote.origin.pushurl"),
    ("git config remote.origin.uploadpack 'sh -c id'", "remote.origin.uploadpack"),
    ("git config branch.main.remote 'ext::sh -c id'", "branch.main.remote"),
    ("git config filter.x.clean cmd", "filter.x.clean"),
    ("git config diff.x.textconv cmd", "diff.x.textconv"),
    ("git config merge.x.driver cmd", "merge.x.driver"),
    ("git config credential.helper '!cmd'", "credential.helper"),
    ("git config core.sshCommand 'sh -c id'", "core.sshcommand"),
    ("git config core.editor vi", "core.editor"),
    ("git config core.pager cat", "core.pager"),
    ("git config gpg.program sh", "gpg.program"),
    ("git config protocol.ext.allow always", "protocol.ext.allow"),
    ("git config url.ext::sh.insteadOf https://", "url.ext::sh.insteadof"),
    ("git config submodule.lib.update '!sh'", "submodule.lib.update"),
    ("git config --file .git/config core.fsmonitor x", "core.fsmonitor"),
    (
        "printf '[core]\\n\\tfsmonitor = x\\n' > .git/config.lock && mv .git/config.lock "
        ".git/config; s=$?; rm -f .git/config.lock; exit $s",
        "core.fsmonitor",
    ),
    (
        "cp .git/config c.lock && printf '[alias]\\n\\tst = !sh\\n' >> c.lock && "
        "mv c.lock .git/config; s=$?; rm -f c.lock; exit $s",
        "alias.st",
    ),
]


def test_code_running_settings_are_refused_and_audited(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    with_origin(project, tmp_path)
    before = (project / ".git" / "config").read_bytes()
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        for command, _key in REFUSED:
            result = inside(repo, command)
            assert result.returncode != 0, (command, result.stdout, result.stderr)
            assert READ_ONLY in result.stderr, (command, result.stderr)
        denied = config_rename_denials(m)
        for command, key in REFUSED:
            assert any(f"{key} " in e["reason"] for e in denied), (command, key, denied)
        for entry in denied:
            assert entry["errno"] == "EROFS" and entry["path"] != "/repo/.git/config", entry
            assert "refused (.git/config may change only" in entry["reason"], entry
        reason = next(e["reason"] for e in denied if "core.fsmonitor" in e["reason"])
        assert "core.fsmonitor would make git run a program" in reason, reason
        # git still works inside, and still writes what it may.
        assert inside(repo, "git config user.name Agent").returncode == 0
    after = (project / ".git" / "config").read_bytes()
    assert after.replace(b"[user]\n\tname = Agent\n", b"") == before
    assert not (project / ".git" / "config.lock").exists()


def test_what_is_judged_is_what_stays(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    """A file judged at its rename can no longer change: a handle kept open across the rename
    (and a shared mapping) stops writing, a file with a second name is refused, and the config
    can still not be written in place."""
    user_repo(project)
    marker = tmp_path / "PWNED"
    evil = fsmonitor(marker).encode()
    script = f"""
import mmap, os, sys
os.chdir(sys.argv[1])
config = open(".git/config", "rb").read()
fd = os.open(".git/config.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, config + b"[user]\\n\\tname = Agent\\n")
mapped = mmap.mmap(fd, 0)
os.rename(".git/config.lock", ".git/config")
try:
    os.pwrite(fd, {evil!r}, 0)
    print("pwrite: written")
except OSError as exc:
    print("pwrite:", exc.strerror)
mapped[0:1] = b"#"
try:
    mapped.flush()
    print("mmap: written")
except OSError as exc:
    print("mmap:", exc.strerror)
mapped.close()
os.close(fd)
"""
    (tmp_path / "hold.py").write_text(script)
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        held = inside(repo, f"python3 {tmp_path / 'hold.py'} {repo}")
        assert held.returncode == 0, held.stderr
        assert "pwrite: Bad file descriptor" in held.stdout, held.stdout
        linked = inside(
            repo,
            "cp .git/config .git/x && ln .git/x .git/y && mv .git/x .git/config",
        )
        assert linked.returncode != 0 and READ_ONLY in linked.stderr, linked.stderr
        entry = config_rename_denials(m)[-1]
        assert "has other names" in entry["reason"], entry
        in_place = inside(repo, "echo '[core]' >> .git/config")
        assert READ_ONLY in in_place.stderr, in_place.stderr
        big = inside(
            repo,
            "cp .git/config .git/big && head -c 1100000 /dev/zero | tr '\\0' '#' >> .git/big"
            " && mv .git/big .git/config",
        )
        assert READ_ONLY in big.stderr, big.stderr
        assert "larger than" in config_rename_denials(m)[-1]["reason"]
        broken = inside(repo, "printf '[core\\n' > .git/c && mv .git/c .git/config")
        assert READ_ONLY in broken.stderr, broken.stderr
        assert "git could not read" in config_rename_denials(m)[-1]["reason"]
    config = (project / ".git" / "config").read_text()
    assert "name = Agent" in config and "fsmonitor" not in config, config
    assert not config.startswith("#"), config
    assert git(project, "status").returncode == 0
    assert not marker.exists(), marker.read_text()


def test_config_worktree_and_submodule_config_are_judged_too(
    mount_at: Callable[..., Any], project: Path, tmp_path: Path
) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "lib.py").write_text("x = 1\n")
    for cmd in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-qm", "lib"]):
        assert git(sub, *cmd).returncode == 0
    user_repo(project)
    added = git(
        project, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "src/lib"
    )
    assert added.returncode == 0, added.stderr
    assert git(project, "config", "extensions.worktreeConfig", "true").returncode == 0
    module_config = project / ".git" / "modules" / "src" / "lib" / "config"
    module_before = module_config.read_bytes()
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        for command in (
            "git config --worktree user.name Tree",
            "git -C src/lib config user.name Module",
            "git -C src/lib checkout -q -b topic origin/main",
        ):
            result = inside(repo, command)
            assert result.returncode == 0, (command, result.stderr)
        for command, dest in (
            ("git config --worktree core.fsmonitor x", "/repo/.git/config.worktree"),
            ("git -C src/lib config core.fsmonitor x", "/repo/.git/modules/src/lib/config"),
            ("git -C src/lib config alias.x '!sh'", "/repo/.git/modules/src/lib/config"),
        ):
            result = inside(repo, command)
            assert result.returncode != 0 and READ_ONLY in result.stderr, (command, result)
            assert config_rename_denials(m, dest), (command, dest)
    worktree = (project / ".git" / "config.worktree").read_text()
    assert "name = Tree" in worktree and "fsmonitor" not in worktree, worktree
    module = module_config.read_text()
    assert "name = Module" in module and "fsmonitor" not in module and "alias" not in module
    assert module_config.read_bytes() != module_before
    assert git(project, "status").returncode == 0
