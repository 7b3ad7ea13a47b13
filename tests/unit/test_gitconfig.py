"""git's config changes judged by content (sandboxfs.core.gitconfig): the parser as a table (and
against git itself where it is installed), the judge as a table, ordinary URLs, the bounded read,
and the guard through the operations adapter: a rename onto `.git/config` (or any git directory's
config and config.worktree) is allowed when it changes only allowed settings, otherwise refused with
EROFS and audited with the setting."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxfs.config.model import defaults
from sandboxfs.core.gitconfig import (
    MAX_CONFIG_BYTES,
    ConfigSyntaxError,
    judge,
    ordinary_url,
    parse,
    read_bounded,
)
from sandboxfs.core.inodes import ZONE_INO
from sandboxfs.core.policy import Policy, Trust, Zone
from tests.support.adapter import CTX, Harness, fails, make, no_mounts_left_behind

__all__ = ["make", "no_mounts_left_behind"]

Setting = tuple[str, str | None]


def settings(text: str | bytes) -> list[Setting]:
    data = text.encode() if isinstance(text, str) else text
    return [(e.name, e.value) for e in parse(data)]


# ===== the parser ================================================================================


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("[core]\n\tbare = false\n", [("core.bare", "false")]),
        ("[Core]\n\tBare = false", [("core.bare", "false")]),  # no final newline
        ("[core]\n\tfsmonitor\n", [("core.fsmonitor", None)]),  # a boolean without "="
        ("[core]\n\tfsmonitor", [("core.fsmonitor", None)]),
        ("[core]\n\tfsmonitor =\n", [("core.fsmonitor", "")]),
        ("[core] fsmonitor = x", [("core.fsmonitor", "x")]),  # a key on the header's line
        ('[remote "Origin"]\n\turl = u\n', [("remote.Origin.url", "u")]),  # subsection as written
        ("[remote.Origin]\n\turl = u\n", [("remote.origin.url", "u")]),  # legacy: lower-cased
        ('[a.b "C"]\nk = v\n', [("a.b.C.k", "v")]),
        ('[remote  "a\\"b\\\\c\\d"]\nk = v\n', [('remote.a"b\\cd.k', "v")]),
        ('[ "s"]\nk = v\n', [(".s.k", "v")]),
        ("k = v\n", [("k", "v")]),  # before any section
        ("[core]\n\tk = a b  c  \n", [("core.k", "a b  c")]),
        ("[core]\n\tk = a b\t\n", [("core.k", "a b")]),
        ('[core]\n\tk = " a "\n', [("core.k", " a ")]),
        ('[core]\n\tk = a"b ;c"d ; comment\n', [("core.k", "ab ;cd")]),
        ("[core]\n\tk = a # comment\n", [("core.k", "a")]),
        ("[core]\n\tk = a \\\n  b\n", [("core.k", "a   b")]),  # continuation keeps spaces
        ("[core]\n\tk = a\\\nb\n", [("core.k", "ab")]),
        ('[core]\n\tk = \\t\\n\\b\\\\\\"\n', [("core.k", '\t\n\b\\"')]),
        ("[core]\r\n\tk = v\r\n", [("core.k", "v")]),
        ("\ufeff[core]\nk = v\n", [("core.k", "v")]),  # a byte order mark at the start
        ("# c\n; c\n[core] ; c\n\tk = v\n", [("core.k", "v")]),
        ("[core]\n\tK-1 = v\n", [("core.k-1", "v")]),
        ("[core]\n\tk = v\\", [("core.k", "v")]),  # a backslash at the end of the file
        ("[core]\n\tk = \u00e9\n", [("core.k", "\u00e9")]),
    ],
)
def test_parse(text: str, expected: list[Setting]) -> None:
    assert settings(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "[core\n",
        "[core",
        "[]\n",
        "[co re]\n",  # a space must introduce "subsection"
        '[core "x"\n',
        '[core "x" ]\n',
        '[core "x\n"]\n',
        "[core_x]\n",
        "[core]\n\t1k = v\n",
        "[core]\n\tk # c\n",  # a boolean cannot have a comment on its line
        "[core]\n\tk v\n",
        "[core]\n\tk_x = v\n",
        '[core]\n\tk = "v\n',
        '[core]\n\tk = "v\n"\n',
        "[core]\n\tk = \\x\n",
        "[core]\n\tk = \\r\n",
        "[core]\n\tk = v\x00evil\n",  # NUL: git would stop reading the value there
        "\ufeff\ufeff[core]\n",
        "=v\n",
        "-k = v\n",
    ],
)
def test_parse_refuses_what_git_cannot_read(text: str) -> None:
    with pytest.raises(ConfigSyntaxError):
        parse(text.encode())


def test_parse_reads_bytes_git_would() -> None:
    assert settings(b"\xef\xbb\xbf[user]\nname = \xff\n") == [("user.name", "\udcff")]
    with pytest.raises(ConfigSyntaxError):
        parse(b"\xef\xbb[core]\n")  # a partial byte order mark
    entry = parse(b"[a]\n\n[b]\nk = v\n")[0]
    assert entry.line == 4 and entry.parts == ("b", None, "k")
    assert parse(b'[remote "x.y"]\nurl = u\n')[0].parts == ("remote", "x.y", "url")


_PIECES = [
    b"[core]\n",
    b'[remote "o\\"x\\\\y"]\n',
    b"[Remote.Origin]\n",
    b'[a.b "c"]\n',
    b'[ "s"]\n',
    b"\turl = https://x\n",
    b"fsmonitor\n",
    b'k="a;b" # c\n',
    b"k = a\\\n  b\n",
    b'K-1 = "  q " \\t\\n\\b\n',
    b"x=  \n",
    b"; comment\n",
    b"\r\n",
    b"k = v\\",
    b"[s] k = v\n",
    b'k="\n',
    b"k = \\x\n",
    b"[core]k\n",
    b"k \t= v\n",
    b"k #c\n",
    b"\xef\xbb\xbf",
    b'[x "y" ]\n',
    b"[x.y.z]\n",
    b'v = a"b"c\n',
    b"\xc3\xa9",
    b"\x0b",
]


def _git_list(path: Path) -> list[Setting] | None:
    result = subprocess.run(
        ["git", "config", "--no-includes", "--file", str(path), "--list", "-z"],
        capture_output=True,
        check=False,
        env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"},
    )
    if result.returncode != 0:
        return None
    found: list[Setting] = []
    for item in result.stdout.split(b"\0")[:-1]:
        name, newline, value = item.partition(b"\n")
        found.append(
            (os.fsdecode(name), value.decode("utf-8", "surrogateescape") if newline else None)
        )
    return found


def _spaces(found: list[Setting] | None) -> list[Setting] | None:
    """Before git 2.45, white space inside an unquoted value reads as spaces; since, as
    written. The parser keeps it as written (finer: equal for it means equal for both)."""
    if found is None:
        return None
    return [(n, v if v is None else v.replace("\t", " ").replace("\r", " ")) for n, v in found]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_parse_agrees_with_git(tmp_path: Path) -> None:
    """Configs built from pieces (some broken by a stray character): each is read by git and
    by the parser alike, settings or failure."""
    rng = random.Random(20)
    path = tmp_path / "config"
    for _ in range(300):
        data = b"".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 8)))
        if data and rng.random() < 0.3:
            at = rng.randrange(len(data))
            data = data[:at] + bytes([rng.choice(b' \t\r\n\\"#;=[]')]) + data[at + 1 :]
        path.write_bytes(data)
        try:
            mine: list[Setting] | None = settings(data)
        except ConfigSyntaxError:
            mine = None
        assert _spaces(mine) == _spaces(_git_list(path)), data


# ===== the judge =================================================================================

BASE = """[core]
\trepositoryformatversion = 0
\tfilemode = true
\tbare = false
\tlogallrefupdates = true
\tfsmonitor = user-own-monitor
[remote "origin"]
\turl = https://example.invalid/project.git
\tfetch = +refs/heads/*:refs/remotes/origin/*
[branch "main"]
\tremote = origin
\tmerge = refs/heads/main
[alias]
\tst = status
\tco = checkout
"""


def _without(text: str, part: str) -> str:
    assert part in text
    return text.replace(part, "")


# (new content, None when allowed, else the setting refused)
JUDGED: list[tuple[str, str | None]] = [
    (BASE, None),
    (BASE + '[branch "feat"]\n\tremote = origin\n\tmerge = refs/heads/main\n', None),
    (_without(BASE, '[branch "main"]\n\tremote = origin\n\tmerge = refs/heads/main\n'), None),
    (
        BASE
        + '[remote "up"]\n\turl = git@example.invalid:a/b.git\n\tfetch = +a:refs/remotes/up/a\n',
        None,
    ),
    (BASE + '[remote "up"]\n\turl = https://h/p\n\tfetch = main\n\tfetch = ^refs/heads/x\n', None),
    (
        BASE + '[remote "up"]\n\turl = https://h/up\n\tpushurl = ssh://h/p\n\ttagOpt = --tags\n',
        None,
    ),
    (BASE + '[branch "x"]\n\tremote = .\n\tmerge = refs/heads/main\n', None),
    (BASE + '[branch "x"]\n\tremote = up-stream\n\tpushRemote = https://h/p\n', None),
    (BASE + '[submodule "lib"]\n\turl = ../lib.git\n', None),
    (BASE + "[user]\n\tname = Agent\n\temail = a@example.invalid\n", None),
    (
        BASE + "[pull]\n\trebase\n[init]\n\tdefaultBranch = trunk\n[advice]\n\tdetachedHead = 0\n",
        None,
    ),
    (BASE + '[submodule "lib"]\n\turl = https://h/lib\n\tactive = true\n\tupdate = rebase\n', None),
    (BASE + "[extensions]\n\tworktreeConfig = true\n", None),
    (BASE.replace("\tfsmonitor = user-own-monitor\n", ""), None),  # removing is fine
    (BASE.replace("\tst = status\n", ""), None),
    (BASE.replace("bare = false", "bare = true"), None),
    (BASE.replace("origin.git", "origin2.git"), None),
    # The user's own settings stay as they are, even those the sandbox could not add.
    (BASE.replace("[alias]", "# a comment\n[alias]"), None),
    (BASE.replace("\tst = status\n", '\tst = "status"\n'), None),
    # What makes git run code or reach elsewhere: refused when added or changed.
    (BASE + "[core]\n\tfsmonitor = x\n", "core.fsmonitor"),
    (BASE.replace("user-own-monitor", "evil"), "core.fsmonitor"),
    (BASE + "[core]\n\thooksPath = /tmp/x\n", "core.hookspath"),
    (BASE + "[core]\n\tsshCommand = sh -c id\n", "core.sshcommand"),
    (BASE + "[core]\n\teditor = vi\n", "core.editor"),
    (BASE + "[core]\n\tpager = less\n", "core.pager"),
    (BASE + "[core]\n\taskPass = x\n", "core.askpass"),
    (BASE + "[core]\n\tworktree = /\n", "core.worktree"),
    (BASE + "[alias]\n\tx = !sh\n", "alias.x"),
    (BASE.replace("co = checkout", "co = !sh"), "alias.co"),
    (BASE + '[filter "x"]\n\tclean = cmd\n', "filter.x.clean"),
    (BASE + '[diff "x"]\n\ttextconv = cmd\n', "diff.x.textconv"),
    (BASE + '[diff "x"]\n\tcommand = cmd\n', "diff.x.command"),
    (BASE + "[diff]\n\texternal = cmd\n", "diff.external"),
    (BASE + '[merge "x"]\n\tdriver = cmd\n', "merge.x.driver"),
    (BASE + "[credential]\n\thelper = !cmd\n", "credential.helper"),
    (BASE + '[credential "https://h"]\n\thelper = x\n', "credential.https://h.helper"),
    (BASE + "[include]\n\tpath = ../evil\n", "include.path"),
    (BASE + '[includeIf "gitdir:/"]\n\tpath = ../evil\n', "includeif.gitdir:/.path"),
    (BASE + "[gpg]\n\tprogram = sh\n", "gpg.program"),
    (BASE + '[gpg "ssh"]\n\tprogram = sh\n', "gpg.ssh.program"),
    (BASE + '[protocol "ext"]\n\tallow = always\n', "protocol.ext.allow"),
    (BASE + '[url "ext::sh"]\n\tinsteadOf = https://\n', "url.ext::sh.insteadof"),
    (BASE + "[http]\n\tproxy = http://h\n", "http.proxy"),
    (BASE + '[remote "origin"]\n\tuploadpack = sh -c id\n', "remote.origin.uploadpack"),
    (BASE + '[remote "origin"]\n\treceivepack = sh -c id\n', "remote.origin.receivepack"),
    (BASE + '[remote "origin"]\n\tvcs = x\n', "remote.origin.vcs"),
    (BASE + '[remote "o"]\n\turl = ext::sh -c id\n', "remote.o.url"),
    (BASE + '[remote "o"]\n\tpushurl = fd::17\n', "remote.o.pushurl"),
    (BASE + '[remote "o"]\n\turl = -oProxyCommand=x\n', "remote.o.url"),
    (BASE + '[remote "o"]\n\turl = evil://h/p\n', "remote.o.url"),
    (BASE + '[remote "o"]\n\turl = ../agent.git\n', "remote.o.url"),
    (BASE + '[remote "o"]\n\tpushurl = file:///srv/agent.git\n', "remote.o.pushurl"),
    (BASE + '[remote "o"]\n\turl = localhost:/srv/agent.git\n', "remote.o.url"),
    (BASE.replace("remote = origin", "remote = ../agent.git"), "branch.main.remote"),
    (BASE + "[remote]\n\tpushDefault = /srv/agent.git\n", "remote.pushdefault"),
    (BASE + '[remote "o"]\n\ttagOpt = --upload-pack=x\n', "remote.o.tagopt"),
    (BASE + '[remote "origin"]\n\tfetch = +refs/heads/*:refs/heads/*\n', "remote.origin.fetch"),
    (BASE + '[remote "origin"]\n\tfetch = refs/tags/*:refs/tags/*\n', "remote.origin.fetch"),
    (BASE + '[remote "origin"]\n\tpush = :refs/heads/main\n', "remote.origin.push"),
    (BASE + '[remote "origin"]\n\tmirror = true\n', "remote.origin.mirror"),
    (BASE + "[status]\n\tshowUntrackedFiles = no\n", "status.showuntrackedfiles"),
    (BASE + '[submodule "lib"]\n\tignore = all\n', "submodule.lib.ignore"),
    (BASE + "[rerere]\n\tenabled = true\n", "rerere.enabled"),
    (BASE.replace("remote = origin", "remote = ext::sh"), "branch.main.remote"),
    (BASE + '[branch "main"]\n\tmergeOptions = -s evil\n', "branch.main.mergeoptions"),
    (BASE + '[submodule "lib"]\n\tupdate = !sh\n', "submodule.lib.update"),
    (BASE + '[submodule "lib"]\n\turl = ext::sh\n', "submodule.lib.url"),
    (BASE + "[sequence]\n\teditor = x\n", "sequence.editor"),
    (BASE + "[pager]\n\tlog = x\n", "pager.log"),
    (BASE + '[mergetool "x"]\n\tcmd = x\n', "mergetool.x.cmd"),
    (BASE + "[core]\n\trepositoryformatversion = 2\n", "core.repositoryformatversion"),
    (BASE + "[extensions]\n\tpartialClone = origin\n", "extensions.partialclone"),
    (BASE + '[user "x"]\n\tname = y\n', "user.x.name"),  # allowed without a subsection only
    (BASE + "fsmonitor = x\n", "alias.fsmonitor"),  # a key goes to the section above it
    ("top = x\n" + BASE, "top"),
    # The user's own settings keep their order: git takes the last value of a key.
    (
        BASE.replace("\tst = status\n\tco = checkout\n", "\tco = checkout\n\tst = status\n"),
        "alias.st",
    ),
    # What git could not read is refused whole.
    (BASE + "[core\n", ""),
    (BASE + "[core]\n\tk = \\x\n", ""),
]


@pytest.mark.parametrize(("new", "refused"), JUDGED)
def test_judge(new: str, refused: str | None) -> None:
    verdict = judge(BASE.encode(), new.encode())
    if refused is None:
        assert verdict is None
        return
    assert verdict is not None and verdict.key == refused, verdict
    assert verdict.reason.startswith(refused)


def test_judge_reasons_say_why() -> None:
    def reason(new: str) -> str:
        verdict = judge(b"", new.encode())
        assert verdict is not None
        return verdict.reason

    assert reason("[core]\nfsmonitor = x\n") == "core.fsmonitor would make git run a program"
    assert "read settings from another file" in reason("[include]\npath = x\n")
    assert "not among the settings" in reason("[color]\nui = auto\n")
    assert "git-remote-<transport>" in reason('[remote "o"]\nurl = ext::sh -c id\n')
    assert "'ext::sh -c id'" in reason('[remote "o"]\nurl = ext::sh -c id\n')
    assert "= 'a\\nb' " in reason('[remote "o"]\nurl = "a\\nb"\n')  # shown escaped
    assert "is not one of" in reason('[submodule "x"]\nupdate = !sh\n')
    assert "could not read" in reason("[core\n")


def test_judge_new_files_unreadable_old_ones_and_sizes() -> None:
    assert judge(b"", b"[core]\n\tbare = false\n[user]\n\tname = x\n") is None
    assert judge(b"", b"") is None
    refused = judge(b"[core\n\tfsmonitor = x\n", b"[core]\n\tfsmonitor = x\n")
    assert refused is not None and refused.key == "core.fsmonitor"  # an unreadable old: empty
    big = b"[user]\n\tname = x\n" + b"#" * MAX_CONFIG_BYTES
    refused = judge(b"", big)
    assert refused is not None and "larger than" in refused.reason
    # Duplicates are counted: a second copy of the user's own setting is a change.
    old = b"[alias]\n\tx = !a\n"
    refused = judge(old, old + b"[alias]\n\tx = !a\n")
    assert refused is not None and refused.key == "alias.x"
    assert judge(old + old, old) is None


@pytest.mark.parametrize(
    ("url", "remote", "submodule"),
    [
        ("https://github.com/a/b.git", True, True),
        ("http://h/p", True, True),
        ("ssh://git@h:22/p", True, True),
        ("git+ssh://h/p", True, True),
        ("git://h/p", True, True),
        ("git@github.com:a/b.git", True, True),
        ("h:p", True, True),
        ("db1:repo", True, True),
        ("ssh://10.0.0.5/p", True, True),
        ("https://localhost/p", True, True),  # no hook of yours runs over http
        # A repository on this machine: `git push` there runs its hooks (the agent's, if it
        # made it). Cloning a submodule from one runs none.
        ("/srv/repo.git", False, True),
        ("../sibling", False, True),
        ("origin", False, True),  # a path, where a URL must stand
        ("file:///srv/repo.git", False, True),
        ("ssh://localhost/srv/r", False, True),
        ("localhost:/srv/r", False, True),
        ("git@127.0.0.1:r", False, True),
        ("ssh://127.1/r", False, True),
        ("ssh://2130706433/r", False, True),
        ("ssh://0x7f.1/r", False, True),
        ("ssh://LOCALHOST./r", False, True),
        ("ssh://0.0.0.0/r", False, True),
        # What makes git run a program, or takes an option for a host.
        ("ext::sh -c id", False, False),
        ("EXT::sh", False, False),
        ("fd::17", False, False),
        ("x::y", False, False),
        ("/path::with", False, False),
        ("ssh://[::1]/r", False, False),
        ("-oProxyCommand=x", False, False),
        ("ssh://-oProxyCommand=x/p", False, False),
        ("ssh://user@-host/p", False, False),
        ("git@-host:p", False, False),
        ("-host:p", False, False),
        ("evil://h/p", False, False),
        ("testing://h", False, False),
        ("https://h/\np", False, False),
        ("https://h/\tp", False, False),
        ("", False, False),
    ],
)
def test_ordinary_url(url: str, remote: bool, submodule: bool) -> None:
    assert (ordinary_url(url) is None) is remote
    assert (ordinary_url(url, local=True) is None) is submodule
    assert ordinary_url(None) is not None


def test_read_bounded(tmp_path: Path) -> None:
    (tmp_path / "config").write_bytes(b"[core]\n")
    (tmp_path / "big").write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    (tmp_path / "link").symlink_to("config")
    os.mkfifo(tmp_path / "fifo")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.stat(tmp_path / "config")
        assert read_bounded(fd, b"config", None) == b"[core]\n"
        assert read_bounded(fd, b"config", (st.st_dev, st.st_ino)) == b"[core]\n"
        assert read_bounded(fd, b"config", (st.st_dev, st.st_ino + 1)) is None
        for name in (b"big", b"link", b"fifo", b"absent"):
            assert read_bounded(fd, name, None) is None, name
    finally:
        os.close(fd)


# ===== through the operations adapter ============================================================

CONFIG = b'[core]\n\tbare = false\n[remote "origin"]\n\turl = https://h/p\n'


def _repo(h: Harness) -> None:
    git = h.project / ".git"
    for sub in ("hooks", "objects", "refs/heads", "modules/lib", "worktrees/wt"):
        (git / sub).mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "config").write_bytes(CONFIG)
    (git / "modules" / "lib" / "config").write_bytes(CONFIG)


def _refused(h: Harness, vpath: str, needle: str) -> dict[str, object]:
    """The last refused rename onto vpath: EROFS, audited with the reason's `needle`."""
    entries = h.entries(op="rename", dest=vpath, allowed=False)
    assert entries, vpath
    entry = entries[-1]
    assert entry["errno"] == "EROFS" and entry["zone"] == "repo"
    assert needle in entry["reason"], entry["reason"]
    assert str(entry["reason"]).startswith((f"{vpath}: ", f"{vpath} is protected"))
    return entry


async def _lock(h: Harness, where: str, content: bytes, name: bytes = b"config.lock") -> int:
    """Write `content` to where/name as git does (O_EXCL create, write, close); the dir's ino."""
    parent = await h.ino(where)
    info, _attrs = await h.ops.create(parent, name, 0o644, os.O_WRONLY | os.O_EXCL, CTX)
    await h.ops.write(info.fh, 0, content)
    await h.ops.release(info.fh)
    return parent


async def test_git_writes_config_through_its_lock(make: Callable[[str], Harness]) -> None:
    h = make("full")
    _repo(h)
    new = CONFIG + b'[branch "feat"]\n\tremote = origin\n\tmerge = refs/heads/main\n'
    git = await _lock(h, "/repo/.git", new)
    await h.ops.rename(git, b"config.lock", git, b"config", 0, CTX)
    assert (h.project / ".git" / "config").read_bytes() == new
    assert not (h.project / ".git" / "config.lock").exists()
    # config.worktree, and the config of a submodule's and a linked worktree's git directory.
    for where, name in (
        ("/repo/.git", b"config.worktree"),
        ("/repo/.git/modules/lib", b"config"),
        ("/repo/.git/worktrees/wt", b"config.worktree"),
    ):
        parent = await _lock(h, where, CONFIG + b"[user]\n\tname = Agent\n", name + b".lock")
        await h.ops.rename(parent, name + b".lock", parent, name, 0, CTX)
    assert b"name = Agent" in (h.project / ".git" / "modules" / "lib" / "config").read_bytes()
    assert h.entries(allowed=False) == []
    renames = h.entries(op="rename", dest="/repo/.git/config")
    assert renames and renames[0]["path"] == "/repo/.git/config.lock"


async def test_code_running_settings_refused_and_audited(make: Callable[[str], Harness]) -> None:
    h = make("full")
    _repo(h)
    for where, name, setting in (
        ("/repo/.git", b"config", "core.fsmonitor"),
        ("/repo/.git", b"config.worktree", "core.fsmonitor"),
        ("/repo/.git/modules/lib", b"config", "core.fsmonitor"),
        ("/repo/.git/worktrees/wt", b"config.worktree", "core.fsmonitor"),
    ):
        parent = await _lock(h, where, CONFIG + b"[core]\n\tfsmonitor = x\n", b"c.lock")
        await fails(h.ops.rename(parent, b"c.lock", parent, name, 0, CTX), errno.EROFS)
        vpath = f"{where}/{name.decode()}"
        entry = _refused(h, vpath, f"{setting} would make git run")
        assert "may change only branch tracking" in str(entry["reason"])
        await h.ops.unlink(parent, b"c.lock", CTX)
    assert (h.project / ".git" / "config").read_bytes() == CONFIG
    assert not (h.project / ".git" / "config.worktree").exists()
    # From the working tree too: what is judged is the content, wherever it was written.
    repo = ZONE_INO[Zone.REPO]
    await _lock(h, "/repo", CONFIG + b"[alias]\n\tx = !sh\n", b"evil")
    git = await h.ino("/repo/.git")
    await fails(h.ops.rename(repo, b"evil", git, b"config", 0, CTX), errno.EROFS)
    _refused(h, "/repo/.git/config", "alias.x would make git run")


async def test_what_is_judged_is_what_stays(make: Callable[[str], Harness]) -> None:
    h = make("full")
    _repo(h)
    git = await h.ino("/repo/.git")
    # A handle kept open across the rename stops writing.
    info, _attrs = await h.ops.create(git, b"config.lock", 0o644, os.O_RDWR | os.O_EXCL, CTX)
    await h.ops.write(info.fh, 0, CONFIG + b"[user]\n\tname = x\n")
    await h.ops.rename(git, b"config.lock", git, b"config", 0, CTX)
    await fails(h.ops.write(info.fh, 0, b"[core]\n\tfsmonitor = x\n"), errno.EBADF)
    await h.ops.release(info.fh)
    assert (h.project / ".git" / "config").read_bytes() == CONFIG + b"[user]\n\tname = x\n"
    # A file with a second name could change through it.
    await _lock(h, "/repo/.git", CONFIG, b"x")
    await h.ops.link(await h.ino("/repo/.git/x"), git, b"y", CTX)
    await fails(h.ops.rename(git, b"x", git, b"config", 0, CTX), errno.EROFS)
    _refused(h, "/repo/.git/config", "has other names")
    await h.ops.unlink(git, b"y", CTX)
    # Too large, or unreadable to git.
    await _lock(h, "/repo/.git", CONFIG + b"#" * MAX_CONFIG_BYTES, b"big")
    await fails(h.ops.rename(git, b"big", git, b"config", 0, CTX), errno.EROFS)
    _refused(h, "/repo/.git/config", "larger than")
    await _lock(h, "/repo/.git", b"[core\n", b"broken")
    await fails(h.ops.rename(git, b"broken", git, b"config", 0, CTX), errno.EROFS)
    _refused(h, "/repo/.git/config", "git could not read")
    # Neither a symbolic link nor a directory is renamed onto config; nor is it swapped away,
    # written in place or removed.
    repo = ZONE_INO[Zone.REPO]
    await h.ops.symlink(repo, b"s", b".git/x", CTX)
    await fails(h.ops.rename(repo, b"s", git, b"config", 0, CTX), errno.EROFS)
    await h.ops.mkdir(git, b"d", 0o755, CTX)
    await fails(h.ops.rename(git, b"d", git, b"config", 0, CTX), errno.EROFS)
    exchange = 2  # RENAME_EXCHANGE
    await fails(h.ops.rename(git, b"x", git, b"config", exchange, CTX), errno.EROFS)
    await fails(h.ops.rename(git, b"config", git, b"config.old", 0, CTX), errno.EROFS)
    await fails(h.ops.open(await h.ino("/repo/.git/config"), os.O_WRONLY, CTX), errno.EROFS)
    await fails(h.ops.unlink(git, b"config", CTX), errno.EROFS)
    assert (h.project / ".git" / "config").read_bytes() == CONFIG + b"[user]\n\tname = x\n"


async def test_a_protect_pattern_still_refuses_every_change(
    make: Callable[[str], Harness],
) -> None:
    """A project that lists .git/config in its protect list keeps it unchangeable."""
    h = make("full")
    _repo(h)
    config = defaults()
    h.guard.policy = Policy(
        config.matrix(), config.deny, Trust.FULL, [*config.protect, ".git/config"]
    )
    git = await _lock(h, "/repo/.git", CONFIG + b"[user]\n\tname = x\n")
    await fails(h.ops.rename(git, b"config.lock", git, b"config", 0, CTX), errno.EROFS)
    _refused(h, "/repo/.git/config", "'.git/config'")
    assert ".git/config" not in config.protect  # the defaults leave it to git's rules
