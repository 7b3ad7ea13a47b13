"""The Python API (`sandboxfs.api.Sandbox`), one suite over both backends.

Every test takes `make`, a factory of sandboxes over the same tree of files, once on disk (a
project in tmp_path, `Sandbox.open`) and once in memory (`Sandbox.memory`): the two must refuse
the same things with the same exception types and audit the same entries. Expectations of the
trust matrix are derived from sandboxfs.config.model.DEFAULT_PERMISSIONS. A few tests only make
sense on disk (symlinks planted in the project, the state dir, the audit log file, workers layers).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path

import pytest

from sandboxfs.api import (
    AlreadyExists,
    CrossZone,
    DenyListed,
    DirectoryNotEmpty,
    FileTooLarge,
    InvalidPath,
    IsADirectory,
    NotADirectory,
    NotFound,
    OutsideSandbox,
    PermissionDenied,
    Protected,
    QuotaExceeded,
    ReadOnlyZone,
    Sandbox,
    SandboxAPIError,
    SandboxIOError,
    SandboxSetupError,
    StagedCommit,
    SuffixNotAllowed,
)
from sandboxfs.audit.verify import verify
from sandboxfs.audit.writer import AuditLog
from sandboxfs.config.model import DEFAULT_PERMISSIONS, load
from sandboxfs.core.gatebase import GateBase, Request
from sandboxfs.core.policy import BUILTIN_ZONES, Trust
from sandboxfs.layout import audit_path

ROOT = Path(__file__).resolve().parents[2]
ZONES = [zone.value for zone in BUILTIN_ZONES]
SESSION = "t1"

# Two files in every zone (a: read and written, b: deleted), and the project's usual suspects.
TREE: dict[str, str] = {
    **{f"/{zone}/a.txt": f"a of {zone}\n" for zone in ZONES},
    **{f"/{zone}/b.txt": f"b of {zone}\n" for zone in ZONES},
    "/repo/README.md": "# demo project\n",
    "/repo/src/main.py": "print('hello')\n",
    "/repo/src/util/helpers.py": "def helper(): ...\n",
    "/repo/.env": "API_KEY=secret\n",
    "/repo/server.pem": "-----BEGIN PRIVATE KEY-----\n",
    "/repo/.ssh/id_rsa": "private\n",
    "/repo/.git/config": "[core]\n",
    "/repo/.git/hooks/pre-commit": "#!/bin/sh\n",
    "/repo/docs/guide.md": "guide\n",
    "/workers/review.worker": "name: review\n",
}

LIMITS = """
limits:
  session:
    max_file_bytes: 10
    suffixes: [.md]
    quota: {bytes: 100, files: 5}
"""


def backing(project: Path, vpath: str, session: str = SESSION) -> Path:
    """Where a virtual path of a disk sandbox lives."""
    zone, _, rest = vpath.lstrip("/").partition("/")
    workspace = project / ".sandbox" / "workspaces" / "default"
    base = {
        "repo": project,
        "workers": project / ".workers",
        "session": workspace / "sessions" / session,
        "workspace": workspace / "workspace",
        "staged": workspace / "staged",
    }[zone]
    return base / rest


class Maker:
    """make(trust, files=None, config_text=None, session=...) -> an open Sandbox, closed at
    teardown. `files` (virtual path -> text; None: TREE) are planted before the first sandbox
    of a test; on disk, later sandboxes of the test share that project."""

    def __init__(self, backend: str, tmp_path: Path) -> None:
        self.backend = backend
        self.disk = backend == "disk"
        self.tmp_path = tmp_path
        self.project = tmp_path / "project"
        self.opened: list[Sandbox] = []

    def __call__(
        self,
        trust: str = "session",
        files: Mapping[str, str | bytes] | None = None,
        config_text: str | None = None,
        session: str = SESSION,
    ) -> Sandbox:
        tree: dict[str, str | bytes] = dict(TREE if files is None else files)
        if config_text is not None:
            tree["/repo/sandboxfs.yaml"] = config_text
        if self.disk:
            if not self.project.exists():
                self.project.mkdir()
                for vpath, content in tree.items():
                    path = backing(self.project, vpath, session)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    data = content.encode() if isinstance(content, str) else content
                    path.write_bytes(data)
            sb = Sandbox.open(self.project, trust=trust, session=session)
        else:
            config = None
            if config_text is not None:
                directory = self.tmp_path / "config"
                directory.mkdir(exist_ok=True)
                (directory / "sandboxfs.yaml").write_text(config_text)
                config = load(directory)
            sb = Sandbox.memory(trust=trust, files=tree, config=config, session=session)
        self.opened.append(sb)
        return sb

    def close(self) -> None:
        for sb in self.opened:
            sb.close()


@pytest.fixture(params=["disk", "memory"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Maker]:
    maker = Maker(request.param, tmp_path)
    yield maker
    maker.close()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Maker]:
    """`make` for the disk backend alone."""
    maker = Maker("disk", tmp_path)
    yield maker
    maker.close()


def raises(cls: type[SandboxAPIError], fn: Callable[[], object], *needles: str) -> SandboxAPIError:
    """fn() raises exactly `cls`, whose message contains every needle."""
    with pytest.raises(SandboxAPIError) as caught:
        fn()
    exc = caught.value
    assert type(exc) is cls, (type(exc).__name__, str(exc))
    message = str(exc)
    assert message.startswith("Cannot "), message
    assert exc.reason and exc.reason in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return exc


# ----- the trust matrix -----------------------------------------------------------------------


def _expected(spec: str, op: str) -> type[SandboxAPIError] | None:
    """What DEFAULT_PERMISSIONS says an operation gets (None: allowed)."""
    create_only = spec == "create-only"
    letters = "" if create_only else spec
    readable = "r" in letters or "l" in letters
    refused_change = ReadOnlyZone if readable else PermissionDenied
    closed = not letters and not create_only  # the whole zone is refused: no name is told
    if op == "read":
        return None if "r" in letters else PermissionDenied if closed else NotFound
    if op == "list":
        return None if "l" in letters else PermissionDenied
    if op == "write-new":
        return None if "w" in letters or create_only else refused_change
    if op == "write":
        return None if "w" in letters else refused_change
    assert op == "delete"  # the name is looked up first: hidden ones are absent
    if closed:
        return PermissionDenied
    return None if "d" in letters else refused_change if readable else NotFound


@pytest.mark.parametrize("trust", list(Trust))
def test_trust_matrix(make: Maker, trust: Trust) -> None:
    """Every trust level x built-in zone x operation, against DEFAULT_PERMISSIONS; the
    permission checks agree with what the operation then does."""
    sb = make(trust.value)
    wrong: list[str] = []
    for zone in BUILTIN_ZONES:
        spec = DEFAULT_PERMISSIONS[trust][zone]
        operations: list[tuple[str, str, str, Callable[[], object]]] = [
            ("read", "read", f"/{zone}/a.txt", partial(sb.read_text, f"/{zone}/a.txt")),
            ("list", "list", f"/{zone}", partial(sb.list, f"/{zone}")),
            (
                "write-new",
                "write",
                f"/{zone}/new.txt",
                partial(sb.write, f"/{zone}/new.txt", "n"),
            ),
            ("write", "write", f"/{zone}/a.txt", partial(sb.write, f"/{zone}/a.txt", "w")),
            ("delete", "delete", f"/{zone}/b.txt", partial(sb.delete, f"/{zone}/b.txt")),
        ]
        for label, op, path, run in operations:
            want = _expected(spec, label)
            permission = sb.check_permission(op, path)
            got: type[SandboxAPIError] | None = None
            try:
                run()
            except SandboxAPIError as exc:
                got = type(exc)
                assert path in str(exc) and exc.path == path, str(exc)
            if got is not want:
                wrong.append(f"{zone} {label} ({spec!r}): {got} instead of {want}")
            if permission.allowed != (want is None) or permission.error != (
                want.__name__ if want else ""
            ):
                wrong.append(f"{zone} {label}: check_permission said {permission}")
    assert not wrong, "\n".join(wrong)


def test_reads_and_writes_return_what_was_written(make: Maker) -> None:
    sb = make("workspace")
    assert sb.read_text("/repo/README.md") == "# demo project\n"
    assert sb.write("/session/notes.txt", "héllo") == len("héllo".encode())
    assert sb.read_bytes("/session/notes.txt") == "héllo".encode()
    assert sb.write("/session/notes.txt", b"\x00\x01") == 2  # replaces
    assert sb.read_bytes("/session/notes.txt") == b"\x00\x01"
    assert sb.can_read("/repo/README.md") and not sb.can_write("/repo/README.md")
    assert sb.can_write("/session/anything.txt") and not sb.can_read("/session/missing.txt")


def test_append(make: Maker) -> None:
    sb = make("session")
    assert sb.append("/session/log.txt", "one\n") == 4  # created
    assert sb.append("/session/log.txt", b"two\n") == 4
    assert sb.read_text("/session/log.txt") == "one\ntwo\n"
    writes = [
        e for e in sb.audit_entries() if e["op"] == "write" and e["path"] == "/session/log.txt"
    ]
    assert [(e["bytes"], e.get("detail")) for e in writes] == [(4, "create"), (4, None)]


def test_max_chars_and_max_bytes_truncate(make: Maker) -> None:
    sb = make("session")
    sb.write("/session/u.txt", "héllo wörld")
    assert sb.read_text("/session/u.txt", max_chars=3) == "hél"
    assert sb.read_text("/session/u.txt", max_chars=0) == ""
    assert sb.read_text("/session/u.txt", max_chars=100) == "héllo wörld"
    assert sb.read_bytes("/session/u.txt", max_bytes=2) == b"h\xc3"
    sb.write("/session/bad.txt", b"ok\xff\xfe")
    assert sb.read_text("/session/bad.txt") == "ok\ufffd\ufffd"
    assert sb.read_text("/session/bad.txt", encoding="latin-1") == "ok\xff\xfe"
    with pytest.raises(ValueError):
        sb.read_text("/session/u.txt", max_chars=-1)
    with pytest.raises(ValueError):
        sb.read_text("/session/u.txt", encoding="no-such-codec")
    with pytest.raises(TypeError):
        sb.read_bytes("/session/u.txt", max_bytes="2")  # type: ignore[arg-type]


# ----- a zone closed to the trust level ---------------------------------------------------------


@pytest.mark.parametrize("trust", ["untrusted", "session"])
def test_a_closed_zone_is_refused_as_a_zone_for_any_name(make: Maker, trust: str) -> None:
    """/repo below workspace: every name in it, existing or not, gets the same refusal
    (PermissionDenied, naming the zone), so nothing is told about what exists; a change says
    `not writable` (never `not readable`, even below a directory) and points to stage."""
    sb = make(trust)
    for path in ("/repo/README.md", "/repo/missing.txt", "/repo/src/main.py", "/repo/no/such"):
        read = raises(PermissionDenied, partial(sb.read_text, path), "repo is not readable")
        assert read.errno == errno.EACCES and read.path == path
        raises(PermissionDenied, partial(sb.stat, path), "repo is not readable")
        raises(PermissionDenied, partial(sb.delete, path), "repo is not deletable")
        assert sb.check_permission("read", path).error == "PermissionDenied"
    raises(PermissionDenied, lambda: sb.list("/repo/src"), "repo is not listable")
    for path in ("/repo/new.txt", "/repo/src/new.py", "/repo/no/such/dir.py"):
        for change in (sb.write, sb.append):
            exc = raises(
                PermissionDenied,
                partial(change, path, "x"),
                f"repo is not writable at trust level {trust}",
                "propose the change with stage",
            )
            assert "not readable" not in str(exc)
        permission = sb.check_permission("write", path)
        assert permission.error == "PermissionDenied" and "stage" in permission.reason
    raises(PermissionDenied, lambda: sb.mkdir("/repo/src/new", parents=True), "not writable")
    raises(PermissionDenied, lambda: sb.rename("/session/a.txt", "/repo/x"), "not writable")
    assert sb.read_text("/session/a.txt") == "a of session\n"
    refused = [
        (e["op"], e["path"], e["errno"]) for e in sb.audit_entries() if e["allowed"] is False
    ]
    assert ("read", "/repo/missing.txt", "EACCES") in refused  # a missing name, as any other
    assert ("write", "/repo/src/new.py", "EACCES") in refused
    assert ("rename", "/repo/x", "EACCES") in refused


def test_a_change_in_a_readable_repo_points_to_stage(make: Maker) -> None:
    sb = make("workspace")
    hint = "propose the change with stage"
    raises(ReadOnlyZone, lambda: sb.write("/repo/src/main.py", "x"), "not writable", hint)
    raises(ReadOnlyZone, lambda: sb.mkdir("/repo/new"), "not writable", hint)
    raises(NotFound, lambda: sb.read_text("/repo/missing.txt"), "does not exist")
    # a refusal that staging cannot get round says nothing of it
    assert hint not in str(raises(DenyListed, lambda: sb.write("/repo/.env", "x")))
    assert hint not in str(raises(ReadOnlyZone, lambda: sb.write("/workers/a.txt", "x")))


# ----- create-only staging --------------------------------------------------------------------


def test_create_only_staged_at_untrusted(make: Maker) -> None:
    """New names are created and written; existing entries are neither read, listed, replaced
    nor deleted. What this sandbox created stays visible (stat) and can be read back, but, as
    through the mount, only its creating write may fill it: rewriting it later is refused."""
    sb = make("untrusted")
    assert sb.write("/staged/new.txt", "proposal") == 8
    info = sb.stat("/staged/new.txt")
    assert (info.kind, info.size, info.created_here) == ("file", 8, True)
    assert sb.read_text("/staged/new.txt") == "proposal"  # its own, read back
    raises(PermissionDenied, lambda: sb.write("/staged/new.txt", "again"), "create-only")
    raises(PermissionDenied, lambda: sb.append("/staged/new.txt", "more"), "create-only")
    raises(PermissionDenied, lambda: sb.delete("/staged/new.txt"), "create-only")
    raises(
        PermissionDenied,
        lambda: sb.write("/staged/a.txt", "overwrite"),
        "/staged/a.txt exists, and staged is create-only",
    )
    raises(NotFound, lambda: sb.read_text("/staged/a.txt"), "create-only")
    raises(NotFound, lambda: sb.stat("/staged/a.txt"), "create-only")
    raises(PermissionDenied, lambda: sb.list("/staged"), "staged is create-only")
    sb.mkdir("/staged/proposal/src", parents=True)
    sb.write("/staged/proposal/src/a.py", "x = 1\n")
    assert sb.stat("/staged/proposal/src/a.py").created_here
    assert sb.check_permission("write", "/staged/other.txt").allowed
    assert not sb.check_permission("write", "/staged/a.txt").allowed
    assert sb.check_permission("write", "/staged/new.txt").error == "PermissionDenied"
    assert sb.list("/", recursive=True) == sorted(
        ["/repo", "/session", "/staged", "/workers", "/workspace"]
        + ["/session/a.txt", "/session/b.txt"]
        + [f"/session/{d}" for d in ("home", "inputs", "outputs", "working")]
        + ["/workers/a.txt", "/workers/b.txt", "/workers/review.worker"]
    )


def test_created_here_is_per_sandbox(disk: Maker) -> None:
    first = disk("untrusted")
    first.write("/staged/mine.txt", "x")
    second = disk("untrusted", session="t2")
    raises(NotFound, lambda: second.stat("/staged/mine.txt"), "create-only")
    assert first.stat("/staged/mine.txt").created_here


def test_stage_at_untrusted(make: Maker) -> None:
    sb = make("untrusted")
    commit = sb.stage(
        {"src/a.py": "print(1)\n", "/repo/docs/new.md": b"# new\n", "./b.txt": "b"}, "Fix it"
    )
    assert isinstance(commit, StagedCommit)
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", commit.id), commit.id
    assert commit.path == f"/staged/{commit.id}"
    assert commit.files == ("src/a.py", "docs/new.md", "b.txt")
    assert commit.message == "Fix it"
    assert sb.stat(f"{commit.path}/files/src/a.py").size == len("print(1)\n")
    assert sb.stat(f"{commit.path}/message.txt").created_here
    if make.disk:
        base = backing(make.project, commit.path)
        assert (base / "files" / "docs" / "new.md").read_bytes() == b"# new\n"
        assert (base / "message.txt").read_text() == "Fix it"
    else:
        assert len({e["path"] for e in sb.audit_entries() if e["op"] == "write"}) == 8


def test_stage_refuses_bad_keys_and_checks_everything_first(make: Maker) -> None:
    sb = make("session")
    before = sb.list("/staged")
    for key in ("../x.py", "/repo/../x", "/etc/passwd", "/repo", "", "a\0b"):
        raises(InvalidPath, partial(sb.stage, {key: "x"}, "m"))
    raises(InvalidPath, lambda: sb.stage({"a.py": "1", "/repo/a.py": "2"}, "m"), "twice")
    raises(DenyListed, lambda: sb.stage({"ok.py": "1", "config/.env": "x"}, "m"), ".env")
    denial = sb.audit_entries()[-1]
    assert sb.list("/staged") == before  # nothing was created
    assert denial["allowed"] is False and denial["path"].endswith("/files/config/.env")
    with pytest.raises(ValueError):
        sb.stage({}, "m")
    with pytest.raises(TypeError):
        sb.stage({"a.py": "1"}, b"m")  # type: ignore[arg-type]


# ----- deny list, protected paths, limits ---------------------------------------------------


def test_deny_list(make: Maker) -> None:
    """The mount's rule: deny-listed entries are listed and stat-able where the level may list
    the zone; their contents are refused, and they are never created, changed, renamed or
    deleted (a file that exists never looks deleted)."""
    sb = make("full")
    for path in ("/repo/.env", "/repo/.ssh/id_rsa"):
        raises(DenyListed, partial(sb.read_text, path), "deny pattern", "every trust level")
    raises(DenyListed, lambda: sb.list("/repo/.ssh"), "'.ssh/'")
    raises(DenyListed, lambda: sb.write("/repo/.env", "x"), "'.env'")
    raises(DenyListed, lambda: sb.write("/session/.env", "x"), "'.env'")
    raises(DenyListed, lambda: sb.write("/repo/.ssh/config", "x"), "'.ssh/'")
    raises(NotFound, lambda: sb.read_text("/session/.env.local"), "does not exist")
    raises(DenyListed, lambda: sb.mkdir("/session/.aws"), "'.aws/'")
    raises(DenyListed, lambda: sb.delete("/repo/.env"))
    sb.write("/session/x.txt", "x")
    raises(DenyListed, lambda: sb.rename("/session/x.txt", "/session/.env"))
    raises(DenyListed, lambda: sb.rename("/repo/.env", "/repo/env.txt"))
    listed = sb.list("/repo", recursive=True)
    assert {"/repo/README.md", "/repo/.env", "/repo/server.pem", "/repo/.ssh"} <= set(listed)
    assert "/repo/.ssh/id_rsa" not in listed  # a deny-listed directory is not listed
    assert sb.stat("/repo/.env").size == len("API_KEY=secret\n")
    assert sb.stat("/repo/.ssh/id_rsa").kind == "file"
    assert sb.check_permission("read", "/repo/.env").error == "DenyListed"
    assert sb.check_permission("read", "/repo/README.md").allowed
    # Templates are ordinary files.
    sb.write("/session/.env.example", "API_KEY=\n")
    assert sb.read_text("/session/.env.example") == "API_KEY=\n"
    if make.disk:
        assert (make.project / ".env").read_text() == "API_KEY=secret\n"


def test_private_keys_by_contents(make: Maker) -> None:
    """`*.pem`, `*.key`, `id_rsa*`...: refused only when the contents hold a private key."""
    sb = make("full")
    raises(DenyListed, lambda: sb.read_text("/repo/server.pem"), "holds a private key", "'*.pem'")
    raises(DenyListed, lambda: sb.write("/repo/server.pem", "x"), "holds a private key")
    raises(DenyListed, lambda: sb.delete("/repo/server.pem"), "holds a private key")
    raises(DenyListed, lambda: sb.rename("/repo/server.pem", "/repo/s.txt"), "private key")
    raises(DenyListed, lambda: sb.rename("/repo/README.md", "/repo/server.pem"), "private key")
    assert sb.check_permission("read", "/repo/server.pem").error == "DenyListed"
    cert = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    sb.write("/session/ca.pem", cert)
    assert sb.read_text("/session/ca.pem") == cert
    sb.write("/session/id_rsa.pub", "ssh-rsa AAAA user@host\n")
    assert sb.read_text("/session/id_rsa.pub").startswith("ssh-rsa")
    sb.write("/session/new.key", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n")
    raises(DenyListed, lambda: sb.read_text("/session/new.key"), "OPENSSH PRIVATE KEY")
    assert sb.check_permission("read", "/session/ca.pem").allowed
    staged = sb.stage({"certs/ca.pem": cert, "certs/new.key": "not a key\n"}, "certs")
    assert sb.read_text(f"{staged.path}/files/certs/ca.pem") == cert
    denial = [e for e in sb.audit_entries() if e["path"] == "/session/new.key" and not e["allowed"]]
    assert denial and denial[-1]["op"] == "read" and denial[-1]["errno"] == "EACCES"
    if make.disk:
        assert (make.project / "server.pem").read_text() == "-----BEGIN PRIVATE KEY-----\n"


def test_protected_paths(make: Maker) -> None:
    sb = make("full", config_text="default_trust: session\n")
    assert "default_trust" in sb.read_text("/repo/sandboxfs.yaml")  # readable
    assert sb.read_text("/repo/.git/config") == "[core]\n"
    raises(Protected, lambda: sb.write("/repo/sandboxfs.yaml", "x"), "protected", "never")
    raises(Protected, lambda: sb.append("/repo/.git/config", "x"), "(.git/config)")
    raises(Protected, lambda: sb.write("/repo/.git/hooks/post-checkout", "x"), "'.git/hooks/'")
    raises(Protected, lambda: sb.delete("/repo/.git/hooks/pre-commit"))
    raises(Protected, lambda: sb.rename("/repo/.git/hooks", "/repo/hooks"))
    raises(Protected, lambda: sb.rename("/repo/README.md", "/repo/sandboxfs.yaml"))
    assert sb.check_permission("write", "/repo/.git/config").error == "Protected"
    assert sb.check_permission("delete", "/repo/sandboxfs.yaml").error == "Protected"


def test_limits(make: Maker) -> None:
    """max_file_bytes, suffixes and the quota of entries; /session starts with its four
    directories, so one more entry fits in a quota of five."""
    sb = make("session", files={}, config_text=LIMITS)
    raises(
        FileTooLarge,
        lambda: sb.write("/session/a.md", "x" * 11),
        "would be 11 bytes",
        "at most 10 bytes",
    )
    raises(SuffixNotAllowed, lambda: sb.write("/session/run.sh", "x"), "allowed suffixes: .md")
    assert sb.check_permission("write", "/session/run.sh").error == "SuffixNotAllowed"
    assert sb.write("/session/a.md", "hello") == 5
    raises(QuotaExceeded, lambda: sb.write("/session/b.md", "x"), "5 of 5 entries", "delete")
    raises(FileTooLarge, lambda: sb.append("/session/a.md", "123456"), "would be 11 bytes")
    assert sb.read_text("/session/a.md") == "hello"  # a refused write changes nothing
    assert sb.write("/session/a.md", "0123456789") == 10  # replacing is judged by the new size
    sb.delete("/session/a.md")
    assert sb.write("/session/b.md", "x") == 1  # the entry was given back
    context = sb.security_context()
    assert context["zones"]["session"]["limits"]["max_file_bytes"] == 10


def test_quota_of_bytes(make: Maker) -> None:
    sb = make("session", files={}, config_text="limits: {session: {quota: {bytes: 12}}}\n")
    sb.write("/session/a.txt", "x" * 10)
    raises(QuotaExceeded, lambda: sb.write("/session/b.txt", "12345"), "10 of 12 bytes", "add 5")
    sb.write("/session/a.txt", "y" * 12)  # replacing gives the old bytes back first
    raises(QuotaExceeded, lambda: sb.append("/session/a.txt", "z"), "12 of 12 bytes")
    sb.write("/session/a.txt", "")
    sb.write("/session/b.txt", "12345")


# ----- paths and errors -----------------------------------------------------------------------


def test_resolve(make: Maker) -> None:
    sb = make("session")
    assert sb.resolve("/repo/a/../b") == "/repo/b"
    assert sb.resolve("repo/x") == "/repo/x"
    assert sb.resolve("./repo//x/./y/") == "/repo/x/y"
    assert sb.resolve("/") == sb.resolve("") == sb.resolve("/repo/..") == "/"
    raises(InvalidPath, lambda: sb.resolve("/.."), "'..'")
    raises(InvalidPath, lambda: sb.resolve("repo/../../etc"), "above '/'")
    raises(InvalidPath, lambda: sb.resolve("/repo/a\0b"), "NUL")
    exc = raises(OutsideSandbox, lambda: sb.resolve("/etc/passwd"), "/etc is not a zone")
    assert "/session, /workspace, /repo, /staged, /workers" in str(exc)
    raises(OutsideSandbox, lambda: sb.read_text("/.sandboxfs/context.json"))
    raises(OutsideSandbox, lambda: sb.read_text("home/user/.bashrc"))
    with pytest.raises(TypeError):
        sb.resolve(42)  # type: ignore[arg-type]
    assert not sb.can_read("/etc/passwd")
    assert sb.check_permission("write", "/etc/x").error == "OutsideSandbox"
    with pytest.raises(ValueError):
        sb.check_permission("execute", "/session/a.txt")


def test_every_error_type(make: Maker) -> None:
    sb = make("workspace")
    sb.mkdir("/session/dir")
    sb.write("/session/dir/f.txt", "f")
    cases: list[tuple[type[SandboxAPIError], Callable[[], object], int, str]] = [
        (NotFound, lambda: sb.read_text("/session/nope.txt"), errno.ENOENT, "does not exist"),
        (NotFound, lambda: sb.write("/session/no/dir.txt", "x"), errno.ENOENT, "/session/no"),
        (AlreadyExists, lambda: sb.mkdir("/session/dir"), errno.EEXIST, "already exists"),
        (IsADirectory, lambda: sb.read_text("/session/dir"), errno.EISDIR, "list()"),
        (IsADirectory, lambda: sb.write("/session/dir", "x"), errno.EISDIR, "directory"),
        (NotADirectory, lambda: sb.list("/session/dir/f.txt"), errno.ENOTDIR, "not a dir"),
        (NotADirectory, lambda: sb.read_text("/session/dir/f.txt/x"), errno.ENOTDIR, "f.txt"),
        (DirectoryNotEmpty, lambda: sb.delete("/session/dir"), errno.ENOTEMPTY, "not empty"),
        (CrossZone, lambda: sb.rename("/session/dir", "/workspace/d"), errno.EXDEV, "copy"),
        (ReadOnlyZone, lambda: sb.write("/repo/a.txt", "x"), errno.EROFS, "writable zones"),
        (PermissionDenied, lambda: sb.delete("/repo"), errno.EACCES, "zone roots"),
        (OutsideSandbox, lambda: sb.write("/x.txt", "x"), errno.ENOENT, "paths start with"),
        (DenyListed, lambda: sb.read_text("/repo/.env"), errno.EACCES, "deny pattern"),
        (Protected, lambda: sb.write("/repo/.git/config", "x"), errno.EROFS, "protected"),
        (InvalidPath, lambda: sb.stat("/../x"), errno.EINVAL, "'..'"),
    ]
    for cls, run, err, needle in cases:
        exc = raises(cls, run, needle)
        assert exc.errno == err, (cls, exc.errno)
        assert exc.path is not None and exc.path in str(exc)
    rename = raises(CrossZone, lambda: sb.rename("/session/dir", "/workspace/d"))
    assert rename.dest == "/workspace/d" and "to '/workspace/d'" in str(rename)
    sb.close()
    raises(SandboxIOError, lambda: sb.read_text("/session/dir/f.txt"), "closed")
    sb.close()  # twice is fine


def test_wrong_argument_types(make: Maker) -> None:
    sb = make("session")
    with pytest.raises(TypeError):
        sb.write("/session/x.txt", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sb.list("/session", pattern=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown trust level"):
        make("root")


# ----- directories, listing, stat, delete, rename --------------------------------------------


def test_mkdir(make: Maker) -> None:
    sb = make("session")
    sb.mkdir("/session/a/b/c", parents=True)
    sb.mkdir("/session/a/b/c", parents=True)  # exists: fine with parents
    sb.mkdir("/session/a/b/d")
    raises(NotFound, lambda: sb.mkdir("/session/x/y"), "/session/x does not exist")
    raises(AlreadyExists, lambda: sb.mkdir("/session/a.txt", parents=True), "not a directory")
    raises(NotADirectory, lambda: sb.mkdir("/session/a.txt/x", parents=True))
    raises(AlreadyExists, lambda: sb.mkdir("/session"))
    sb.mkdir("/session", parents=True)
    assert sb.stat("/session/a/b/c").kind == "dir"
    mkdirs = [e for e in sb.audit_entries() if e.get("detail") == "mkdir"]
    assert [e["path"] for e in mkdirs] == [
        "/session/a",
        "/session/a/b",
        "/session/a/b/c",
        "/session/a/b/d",
    ]


def test_list(make: Maker) -> None:
    sb = make("workspace")
    assert sb.list("/") == ["/repo", "/session", "/staged", "/workers", "/workspace"]
    assert sb.list("/repo", pattern="*.py", recursive=True) == [
        "/repo/src/main.py",
        "/repo/src/util/helpers.py",
    ]
    assert sb.list("/repo/src") == ["/repo/src/main.py", "/repo/src/util"]
    assert sb.list("repo/src/", pattern="util") == ["/repo/src/util"]
    assert sb.list("/", pattern="repo/docs/*", recursive=True) == ["/repo/docs/guide.md"]
    lists = [e for e in sb.audit_entries() if e["op"] == "list"]
    # Each listing is an entry at its path, or counted in one at or above it (`below`).
    for listed in ("/repo", "/repo/src", "/repo/src/util"):
        assert any(
            e["path"] == listed or (e.get("below") and listed.startswith(e["path"] + "/"))
            for e in lists
        ), (listed, lists)


def test_stat(make: Maker) -> None:
    sb = make("workspace")
    info = sb.stat("/repo/README.md")
    assert (info.path, info.zone, info.kind, info.size) == ("/repo/README.md", "repo", "file", 15)
    assert info.mtime > 0 and not info.created_here
    assert sb.stat("repo/src").kind == "dir"
    assert sb.stat("/").zone is None and sb.stat("/").kind == "dir"
    assert sb.stat("/workers").kind == "dir"
    sb.write("/session/new.txt", "n")
    assert sb.stat("/session/new.txt").created_here


def test_delete(make: Maker) -> None:
    sb = make("session")
    sb.delete("/session/a.txt")
    raises(NotFound, lambda: sb.read_text("/session/a.txt"))
    raises(NotFound, lambda: sb.delete("/session/a.txt"), "does not exist")
    sb.mkdir("/session/empty")
    sb.delete("/session/empty")
    raises(PermissionDenied, lambda: sb.delete("/session"), "zone roots")
    raises(PermissionDenied, lambda: sb.delete("/"))
    deletes = [e for e in sb.audit_entries() if e["op"] == "delete" and e["allowed"]]
    assert [(e["path"], e.get("detail")) for e in deletes] == [
        ("/session/a.txt", None),
        ("/session/empty", "rmdir"),
    ]


def test_rename(make: Maker) -> None:
    sb = make("session")
    sb.rename("/session/a.txt", "/session/working/moved.txt")
    assert sb.read_text("/session/working/moved.txt") == "a of session\n"
    raises(NotFound, lambda: sb.stat("/session/a.txt"))
    sb.rename("/session/b.txt", "/session/working/moved.txt")  # replaces
    assert sb.read_text("/session/working/moved.txt") == "b of session\n"
    sb.rename("/session/working", "/session/work")
    assert sb.list("/session/work") == ["/session/work/moved.txt"]
    raises(CrossZone, lambda: sb.rename("/session/work/moved.txt", "/workspace/m.txt"), "copy")
    raises(PermissionDenied, lambda: sb.rename("/session", "/session/x"), "zone roots")
    raises(PermissionDenied, lambda: sb.rename("/session/work", "/"), "nothing can be created")
    raises(SandboxIOError, lambda: sb.rename("/session/work", "/session/work/inner"))
    raises(NotFound, lambda: sb.rename("/session/nope", "/session/x"))
    renames = [e for e in sb.audit_entries() if e["op"] == "rename" and e["allowed"]]
    assert renames[0]["dest"] == "/session/working/moved.txt"
    crossed = [e for e in sb.audit_entries() if e["errno"] == "EXDEV"]
    assert crossed and crossed[0]["allowed"] is None  # not a refusal: mv copies instead


# ----- audit and context ----------------------------------------------------------------------


def test_audit_entries(make: Maker) -> None:
    sb = make("session")
    sb.read_text("/session/a.txt")
    sb.write("/session/c.txt", "abc")
    sb.list("/session")
    sb.delete("/session/b.txt")
    sb.rename("/session/c.txt", "/session/d.txt")
    raises(PermissionDenied, lambda: sb.write("/repo/x.txt", "x"))
    count = len(sb.audit_entries())
    assert sb.can_write("/session/e.txt") and not sb.can_write("/repo/x.txt")
    sb.check_permission("delete", "/repo/a.txt")
    assert len(sb.audit_entries()) == count  # permission questions are not audited
    entries = sb.audit_entries()
    seen = [(e["op"], e["path"], e["zone"], e["allowed"], e["errno"]) for e in entries]
    assert seen == [
        ("read", "/session/a.txt", "session", True, None),
        ("write", "/session/c.txt", "session", True, None),
        ("list", "/session", "session", True, None),
        ("delete", "/session/b.txt", "session", True, None),
        ("rename", "/session/c.txt", "session", True, None),
        ("write", "/repo/x.txt", "repo", False, "EACCES"),
    ]
    for entry in entries:
        assert entry["via"] == "api" and entry["pid"] == os.getpid(), entry
        assert entry["trust"] == "session" and entry["session"] == SESSION
        assert entry["comm"] and entry["ts"].endswith("Z")
    assert entries[1]["bytes"] == 3 and entries[4]["dest"] == "/session/d.txt"
    assert "repo is not writable" in entries[-1]["reason"]


def test_a_step_of_the_gate_joins_every_operation_and_the_probe(make: Maker) -> None:
    """A rule added to the gate (as approvals will be: Gate.steps) runs after the built-in
    rules of each operation, for the operation and for check_permission alike; its refusal
    is audited by the operation only, before anything is charged or changed."""
    sb = make("session")
    asked: list[tuple[str, str]] = []

    def no_b(gate: GateBase, request: Request) -> None:
        asked.append((str(request.op), request.path))
        if request.path.startswith("/session/b"):
            raise gate.refuse(request, errno.EACCES, f"{request.path}: the user said no")

    sb._gate.steps.append(no_b)
    assert sb.check_permission("write", "/session/a.txt").allowed
    count = len(sb.audit_entries())
    for op, path in (
        ("read", "/session/b.txt"),
        ("write", "/session/b.txt"),
        ("delete", "/session/b.txt"),
        ("write", "/session/blocked.txt"),
    ):
        permission = sb.check_permission(op, path)
        assert (permission.allowed, permission.error) == (False, "PermissionDenied"), op
        assert "the user said no" in permission.reason
    assert len(sb.audit_entries()) == count  # the probe audits nothing
    raises(PermissionDenied, lambda: sb.read_text("/session/b.txt"), "the user said no")
    raises(PermissionDenied, lambda: sb.write("/session/b.txt", "x"), "the user said no")
    raises(PermissionDenied, lambda: sb.delete("/session/b.txt"), "the user said no")
    raises(PermissionDenied, lambda: sb.write("/session/blocked.txt", "x"), "the user said no")
    raises(PermissionDenied, lambda: sb.mkdir("/session/bdir"), "the user said no")
    assert sb.read_text("/session/a.txt") == "a of session\n"
    assert sb.list("/session", pattern="b*") == ["/session/b.txt"]  # untouched
    refused = [e for e in sb.audit_entries()[count:] if e["allowed"] is False]
    assert [(e["op"], e["path"]) for e in refused] == [
        ("read", "/session/b.txt"),
        ("write", "/session/b.txt"),
        ("delete", "/session/b.txt"),
        ("write", "/session/blocked.txt"),
        ("write", "/session/bdir"),
    ]
    assert ("list", "/session") in asked and ("read", "/session/a.txt") in asked


def test_security_context(make: Maker) -> None:
    sb = make("untrusted")
    context = sb.security_context()
    assert list(context["zones"]) == ZONES
    assert context["trust"] == "untrusted" and context["via"] == "api"
    assert context["session"] == sb.session == SESSION and context["pid"] == os.getpid()
    assert context["zones"]["staged"]["create_only"] is True
    assert context["zones"]["repo"] == {
        "read": False,
        "write": False,
        "list": False,
        "delete": False,
        "create_only": False,
    }
    assert ".env" in context["deny"]
    assert sb.zones == ZONES and sb.trust is Trust.UNTRUSTED


def test_project_zone(make: Maker) -> None:
    if make.disk:
        (make.tmp_path / "datasets").mkdir()
        (make.tmp_path / "datasets" / "d.csv").write_text("a,b\n")
    config = "zones:\n  data:\n    path: ../datasets\n    permissions: {session: rl}\n"
    files = {**TREE, "/data/d.csv": "a,b\n"} if not make.disk else None
    sb = make("session", files=files, config_text=config)
    assert sb.zones == [*ZONES, "data"]
    assert sb.read_text("/data/d.csv") == "a,b\n"
    raises(ReadOnlyZone, lambda: sb.write("/data/d.csv", "x"))


# ----- the disk backend only ------------------------------------------------------------------


def test_symlinks_are_never_followed(disk: Maker, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    sb = disk("full")
    (disk.project / "link.txt").symlink_to(outside / "secret.txt")
    (disk.project / "linkdir").symlink_to(outside)
    exc = raises(SandboxIOError, lambda: sb.read_text("/repo/link.txt"), "symbolic link")
    assert exc.errno == errno.ELOOP
    raises(SandboxIOError, lambda: sb.write("/repo/link.txt", "overwritten"), "symbolic link")
    raises(NotADirectory, lambda: sb.list("/repo/linkdir"), "symbolic link")
    raises(NotADirectory, lambda: sb.read_text("/repo/linkdir/secret.txt"), "symbolic link")
    raises(NotADirectory, lambda: sb.write("/repo/linkdir/new.txt", "x"), "symbolic link")
    assert sb.stat("/repo/link.txt").kind == "symlink"
    assert not sb.can_read("/repo/link.txt")
    assert (outside / "secret.txt").read_text() == "secret\n"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    sb.delete("/repo/link.txt")  # the link itself, not its target
    assert (outside / "secret.txt").exists()


def test_state_dir_is_invisible(disk: Maker) -> None:
    sb = disk("full")
    assert not [p for p in sb.list("/repo", recursive=True) if ".sandbox" in p]
    raises(NotFound, lambda: sb.read_text("/repo/.sandbox/audit.jsonl"), "sandboxfs's own state")
    raises(PermissionDenied, lambda: sb.write("/repo/.sandbox", "x"), "sandboxfs's own state")
    raises(NotFound, lambda: sb.delete("/repo/.sandbox"), "sandboxfs's own state")
    raises(PermissionDenied, lambda: sb.rename("/repo/a.txt", "/repo/.sandbox"), "own state")


def test_entries_land_in_the_project_log(disk: Maker) -> None:
    sb = disk("untrusted")
    sb.write("/session/a.txt", "x")
    raises(PermissionDenied, lambda: sb.read_text("/repo/README.md"), "repo is not readable")
    sb.close()
    log = audit_path(disk.project)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    api = [e for e in lines if e.get("via") == "api"]
    assert [(e["op"], e["path"], e["allowed"]) for e in api] == [
        ("write", "/session/a.txt", True),
        ("read", "/repo/README.md", False),
    ]
    assert verify(log).ok, verify(log).message
    assert api == sb.audit_entries()


def test_sessions_and_setup_errors(disk: Maker, tmp_path: Path) -> None:
    sb = disk("session", session="resumed")
    sb.write("/session/kept.txt", "k")
    sb.close()
    again = Sandbox.open(disk.project, session="resumed")
    assert again.read_text("/session/kept.txt") == "k" and again.trust is Trust.SESSION
    again.close()
    fresh = Sandbox.open(disk.project)
    assert fresh.session != "resumed" and re.fullmatch(r"[0-9a-f]{8}", fresh.session)
    fresh.close()
    with pytest.raises(SandboxSetupError, match="does not exist"):
        Sandbox.open(tmp_path / "missing")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trust_levels: 3\n")
    with pytest.raises(SandboxSetupError, match="unknown key"):
        Sandbox.open(disk.project, config=bad)
    with pytest.raises(ValueError, match="invalid session id"):
        Sandbox.open(disk.project, session="../x")


def test_workers_layers(disk: Maker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared-workers"
    shared.mkdir()
    (shared / "lint.worker").write_text("name: lint\n")
    monkeypatch.setenv("SANDBOXFS_WORKERS_PATH", str(shared))
    sb = disk("full")
    assert "/workers/lint.worker" in sb.list("/workers")
    assert sb.read_text("/workers/lint.worker") == "name: lint\n"
    raises(ReadOnlyZone, lambda: sb.write("/workers/lint.worker", "x"), "SANDBOXFS_WORKERS_PATH")
    raises(ReadOnlyZone, lambda: sb.delete("/workers/lint.worker"), "read-only")
    sb.write("/workers/mine.worker", "name: mine\n")
    assert (disk.project / ".workers" / "mine.worker").exists()


def test_workers_layers_below_their_top(
    disk: Maker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subdirectory of the second layer is read from that layer, not looked for in the first."""
    shared = tmp_path / "shared-workers"
    (shared / "sub" / "deep").mkdir(parents=True)
    (shared / "sub" / "f.txt").write_text("from the shared layer\n")
    (shared / "sub" / "deep" / "g.txt").write_text("deeper\n")
    monkeypatch.setenv("SANDBOXFS_WORKERS_PATH", str(shared))
    sb = disk("full")
    assert sb.list("/workers/sub") == ["/workers/sub/deep", "/workers/sub/f.txt"]
    assert sb.read_text("/workers/sub/f.txt") == "from the shared layer\n"
    assert sb.read_text("/workers/sub/deep/g.txt") == "deeper\n"
    raises(ReadOnlyZone, lambda: sb.write("/workers/sub/deep/new", "x"), "SANDBOXFS_WORKERS_PATH")


def test_fails_closed_while_the_audit_log_cannot_be_written(
    disk: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the mount refuses audited operations while its log is failing (a full disk)."""
    sb = disk("session")
    monkeypatch.setattr(AuditLog, "failing", property(lambda self: True))
    monkeypatch.setattr(AuditLog, "try_flush", lambda self: False)
    exc = raises(SandboxIOError, lambda: sb.write("/session/x.txt", "x"), "audit log")
    assert exc.errno == errno.ENOSPC
    raises(SandboxIOError, lambda: sb.read_text("/session/a.txt"), "audit log")
    assert sb.stat("/session/a.txt").size == len("a of session\n")  # not audited: answered
    monkeypatch.undo()
    assert sb.write("/session/x.txt", "x") == 1


def test_memory_arguments() -> None:
    raises(OutsideSandbox, lambda: Sandbox.memory(files={"/etc/passwd": "x"}), "/etc")
    raises(InvalidPath, lambda: Sandbox.memory(files={"/repo": "x"}), "inside a zone")
    with pytest.raises(TypeError):
        Sandbox.memory(config="sandboxfs.yaml")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Sandbox.memory(files={"/repo/a": 1})  # type: ignore[dict-item]
    with Sandbox.memory(files={"/session/a/b.txt": b"\xff"}) as sb:
        assert sb.read_bytes("session/a/b.txt") == b"\xff"
        assert sb.session == "memory" and sb.workspace == "default"
        assert sb.audit_entries()[0]["path"] == "/session/a/b.txt"  # the read, not the seed


def test_works_without_pyfuse3_and_trio(tmp_path: Path) -> None:
    """The API imports neither pyfuse3 nor trio: both backends work with them unimportable."""
    program = f"""
import sys
sys.modules["pyfuse3"] = None
sys.modules["trio"] = None
from pathlib import Path
from sandboxfs.api import PermissionDenied, Sandbox

project = Path({str(tmp_path)!r})
(project / "README.md").write_text("hi")
memory = Sandbox.memory(files={{"/repo/README.md": "hi"}}, trust="workspace")
for sb in (Sandbox.open(project, trust="workspace"), memory):
    with sb:
        assert sb.read_text("/repo/README.md") == "hi"
        sb.write("/session/x.txt", "x")
        try:
            sb.write("/repo/y.txt", "y")
        except PermissionDenied:
            pass
        else:
            raise SystemExit("not refused")
        assert sb.audit_entries()[-1]["allowed"] is False
assert sys.modules["pyfuse3"] is None and sys.modules["trio"] is None
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
