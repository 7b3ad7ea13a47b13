"""The whole permission matrix (what each trust level may read, write, list and delete in each
zone), at every trust level, on real mounts, with real tools.

The expected outcomes are written out literally below: the matrix, which callback checks which
operation and which errno a refusal gets, as amended by the hardening rules (absent-looking names):
LOOKUP answers "absent" (ENOENT) for every name the level may not know about (every name in a zone
it has no access to, existing files of a create-only zone this mount did not create), audited as a
refused `read` when the name exists; an operation that creates a name reaches its own callback and
is refused there as the write it is (EACCES); listing a zone without access is still EACCES. They
are deliberately not derived from sandboxfs's own policy code or its defaults.yaml.

Each test mounts once, runs every tool against every zone, collects what went wrong and asserts
once at the end with a readable list, so one run shows the whole picture.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.mounts import Mount

OK = "ok"
EROFS = "EROFS"  # "Read-only file system": a denied write/delete in a zone the level can read
EACCES = "EACCES"  # "Permission denied": every other policy denial
ENOENT = "ENOENT"  # "No such file or directory": a name the level may not know about

MESSAGE = {
    EROFS: "Read-only file system",
    EACCES: "Permission denied",
    ENOENT: "No such file or directory",
}
# dash words ENOENT from the open(O_CREAT) of a redirection as "Directory nonexistent".
SHELL_MESSAGE = {ENOENT: "Directory nonexistent"}

LEVELS = ["untrusted", "session", "workspace", "full"]
ZONES = ["session", "workspace", "repo", "staged", "workers"]

# The matrix, cell by cell: letters of "r w l d", "" for "—", "create-only" for
# "w (create-only)".
MATRIX: dict[str, dict[str, str]] = {
    "untrusted": {
        "session": "rwld",
        "workspace": "",
        "repo": "",
        "staged": "create-only",
        "workers": "rl",
    },
    "session": {
        "session": "rwld",
        "workspace": "rwld",
        "repo": "",
        "staged": "rwld",
        "workers": "rl",
    },
    "workspace": {
        "session": "rwld",
        "workspace": "rwld",
        "repo": "rl",
        "staged": "rwld",
        "workers": "rl",
    },
    "full": {
        "session": "rwld",
        "workspace": "rwld",
        "repo": "rwld",
        "staged": "rwld",
        "workers": "rwld",
    },
}

# The tools, in the order they run in each zone. D is the zone directory under test, M the
# existing file (prepared in backing storage before mounting), m its bare name.
TOOL_OPS: list[str] = [
    "cat",  # cat M                          open read-only            -> read
    "ls",  # ls D                            opendir                   -> list
    "write",  # sh -c 'echo x > D/new.txt'   create                    -> write
    "append",  # sh -c 'echo y >> D/app.txt' open O_WRONLY|O_APPEND    -> write
    "rm",  # rm D/victim.txt                 unlink                    -> delete
    "mkdir",  # mkdir D/newdir               mkdir                     -> write
    "touch-new",  # touch D/touched.txt      create + setattr          -> write
    "touch",  # touch D/stamp.txt (exists)   setattr times             -> write
    "chmod",  # chmod 600 D/mode.txt         setattr mode              -> write
    "cp",  # cp M D/copy.txt                 read M, create copy       -> read + write
    "mv",  # mv D/move.txt D/moved.txt       rename                    -> delete + write
    "ln",  # ln M D/hard.txt                 link                      -> write
    "ln-s",  # ln -s m D/sym                 symlink                   -> write
]

# The matrix as amended (absent-looking names): the outcome of each tool for each kind of cell
# of the matrix. For "" it depends on where D is: see NO_ACCESS_BELOW_ROOT and outcome().
OUTCOME: dict[str, dict[str, str]] = {
    "rwld": {op: OK for op in TOOL_OPS},
    # Readable and listable: every change is a read-only file system.
    "rl": {
        "cat": OK,
        "ls": OK,
        "write": EROFS,
        "append": EROFS,
        "rm": EROFS,
        "mkdir": EROFS,
        "touch-new": EROFS,
        "touch": EROFS,
        "chmod": EROFS,
        "cp": EROFS,
        "mv": EROFS,
        "ln": EROFS,
        "ln-s": EROFS,
    },
    # No permission at all, D the zone root itself (/repo): every name in it looks absent.
    # What first looks a name up gets ENOENT: cat, rm, chmod, and cp, mv and ln, which stat
    # their source first. What creates a name (open O_CREAT, mkdir, symlink) reaches its
    # callback and is refused as the write it is: EACCES. `echo >>` and `touch` open with
    # O_CREAT too, so an existing app.txt or stamp.txt (looking absent) gets a refused CREATE.
    # Listing D is an opendir: EACCES.
    "": {
        "cat": ENOENT,
        "ls": EACCES,
        "write": EACCES,
        "append": EACCES,
        "rm": ENOENT,
        "mkdir": EACCES,
        "touch-new": EACCES,
        "touch": EACCES,
        "chmod": ENOENT,
        "cp": ENOENT,
        "mv": ENOENT,
        "ln": ENOENT,
        "ln-s": EACCES,
    },
    # New files and directories may be created (and written while open); existing files this
    # mount did not create look absent (ENOENT) to whatever looks them up; a CREATE over one
    # (`echo >>`, `touch`) is refused (EACCES), and so is listing (opendir, EACCES).
    "create-only": {
        "cat": ENOENT,
        "ls": EACCES,
        "write": OK,
        "append": EACCES,
        "rm": ENOENT,
        "mkdir": OK,
        "touch-new": OK,
        "touch": EACCES,
        "chmod": ENOENT,
        "cp": ENOENT,
        "mv": ENOENT,
        "ln": ENOENT,
        "ln-s": OK,
    },
}
# No permission at all, D a directory below the zone root (/workspace/data): D itself looks
# absent, so every tool, `ls D` included, gets ENOENT at the first component.
NO_ACCESS_BELOW_ROOT: dict[str, str] = {op: ENOENT for op in TOOL_OPS}

SESSION_ID = "matrix-s1"
OLD_MTIME = 1_000_000_000
MAIN_TEXT = {
    "session": "session file\n",
    "workspace": "workspace file\n",
    "repo": "# demo project\n",
    "staged": "staged file\n",
    "workers": "name: review\n",
}


@dataclass
class Ran:
    """A finished real program: its argv, exit code, output and process id."""

    argv: list[str]
    rc: int
    out: str
    err: str
    pid: int

    @property
    def comm(self) -> str:
        return os.path.basename(self.argv[0])[:15]

    def __str__(self) -> str:
        return f"`{' '.join(self.argv)}` -> rc={self.rc} stderr={self.err.strip()!r}"


def run(*argv: str | Path) -> Ran:
    """Run a real tool directly (not through a shell) so its pid is the one the daemon sees."""
    args = [str(a) for a in argv]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LC_ALL": "C"},
    )
    out, err = proc.communicate(timeout=30)
    return Ran(args, proc.returncode, out, err, proc.pid)


def shell(command: str) -> Ran:
    """`sh -c COMMAND`: for redirections, done by the shell itself (comm "sh")."""
    return run("sh", "-c", command)


def vpath(m: Mount, path: Path | str) -> str:
    """The virtual path (as audited) of a path under the mountpoint."""
    return "/" + str(Path(path).relative_to(m.mnt))


def sandbox_dir(project: Path) -> Path:
    return project / ".sandbox" / "workspaces" / "default"


@dataclass
class ZoneCase:
    zone: str
    vdir: str  # the directory under test, relative to the mountpoint
    main: str  # name of the existing file in it
    backing: Path  # that directory in backing storage

    def mdir(self, m: Mount) -> Path:
        return m.mnt / self.vdir

    @property
    def at_zone_root(self) -> bool:
        return "/" not in self.vdir


def outcome(cell: str, case: ZoneCase) -> dict[str, str]:
    """The expected outcome of each tool in `case` for a cell of the matrix."""
    if cell == "" and not case.at_zone_root:
        return NO_ACCESS_BELOW_ROOT
    return OUTCOME[cell]


def refused_as(ran: Ran, expected: str) -> bool:
    """`ran` failed with the message of errno `expected` (as the tool words it)."""
    messages = [MESSAGE[expected]]
    if ran.comm == "sh" and expected in SHELL_MESSAGE:
        messages.append(SHELL_MESSAGE[expected])
    return ran.rc != 0 and any(message in ran.err for message in messages)


def zone_cases(project: Path) -> list[ZoneCase]:
    ws = sandbox_dir(project)
    return [
        ZoneCase("session", "session/working", "f.txt", ws / "sessions" / SESSION_ID / "working"),
        ZoneCase("workspace", "workspace/data", "f.txt", ws / "workspace" / "data"),
        ZoneCase("repo", "repo", "README.md", project),
        ZoneCase("staged", "staged/c0", "f.txt", ws / "staged" / "c0"),
        ZoneCase("workers", "workers", "review.worker", project / ".workers"),
    ]


def prepare(project: Path) -> list[ZoneCase]:
    """Put the files the tools work on into every zone's backing storage, before mounting."""
    cases = zone_cases(project)
    for case in cases:
        case.backing.mkdir(parents=True, exist_ok=True)
        main = case.backing / case.main
        if not main.exists():
            main.write_text(MAIN_TEXT[case.zone])
        assert main.read_text() == MAIN_TEXT[case.zone]
        (case.backing / "app.txt").write_text("app\n")
        (case.backing / "victim.txt").write_text("victim\n")
        (case.backing / "move.txt").write_text("move\n")
        (case.backing / "mode.txt").write_text("mode\n")
        os.chmod(case.backing / "mode.txt", 0o644)
        (case.backing / "stamp.txt").write_text("stamp\n")
        os.utime(case.backing / "stamp.txt", (OLD_MTIME, OLD_MTIME))
    return cases


def command(op: str, d: Path, main: Path) -> Ran:
    """Run the real tool for one operation kind of TOOL_OPS."""
    if op == "cat":
        return run("cat", main)
    if op == "ls":
        return run("ls", d)
    if op == "write":
        return shell(f"echo x > '{d}/new.txt'")
    if op == "append":
        return shell(f"echo y >> '{d}/app.txt'")
    if op == "rm":
        return run("rm", d / "victim.txt")
    if op == "mkdir":
        return run("mkdir", d / "newdir")
    if op == "touch-new":
        return run("touch", d / "touched.txt")
    if op == "touch":
        return run("touch", d / "stamp.txt")
    if op == "chmod":
        return run("chmod", "600", d / "mode.txt")
    if op == "cp":
        return run("cp", main, d / "copy.txt")
    if op == "mv":
        return run("mv", d / "move.txt", d / "moved.txt")
    if op == "ln":
        return run("ln", main, d / "hard.txt")
    if op == "ln-s":
        return run("ln", "-s", main.name, d / "sym")
    raise AssertionError(op)


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError as exc:
        return f"<{exc.strerror}>"


def effect_problems(
    op: str, case: ZoneCase, d: Path, ran: Ran, done: bool, via_mount: bool
) -> list[str]:
    """What is wrong with the visible effect of `op`: present when done, absent when refused.

    Checked in backing storage always, and through the mount when `via_mount` (the mount's
    view of a zone the level cannot read is not something to look at).
    """
    b = case.backing
    problems: list[str] = []

    def expect(what: str, actual: object, wanted: object) -> None:
        if actual != wanted:
            problems.append(f"{what}: got {actual!r}, expected {wanted!r}")

    places = [("backing", b)] + ([("mount", d)] if via_mount and done else [])
    main_text = MAIN_TEXT[case.zone]
    if op == "cat":
        expect("cat stdout", ran.out, main_text if done else "")
    elif op == "ls":
        if done:
            expect("ls shows the file", case.main in ran.out.split(), True)
        else:
            expect("ls stdout", ran.out, "")
    for where, base in places:
        if op == "write":
            expect(
                f"{where} new.txt",
                _text(base / "new.txt") if done else (base / "new.txt").exists(),
                "x\n" if done else False,
            )
        elif op == "append":
            expect(f"{where} app.txt", _text(base / "app.txt"), "app\ny\n" if done else "app\n")
        elif op == "rm":
            expect(f"{where} victim.txt exists", os.path.lexists(base / "victim.txt"), not done)
        elif op == "mkdir":
            expect(f"{where} newdir is a dir", (base / "newdir").is_dir(), done)
        elif op == "touch-new":
            expect(f"{where} touched.txt exists", (base / "touched.txt").exists(), done)
        elif op == "touch":
            mtime = int(os.stat(base / "stamp.txt").st_mtime)
            expect(f"{where} stamp.txt mtime changed", mtime != OLD_MTIME, done)
        elif op == "chmod":
            mode = stat.S_IMODE(os.stat(base / "mode.txt").st_mode)
            expect(f"{where} mode.txt mode", oct(mode), oct(0o600 if done else 0o644))
        elif op == "cp":
            if done:
                expect(f"{where} copy.txt", _text(base / "copy.txt"), main_text)
            else:
                expect(f"{where} copy.txt exists", (base / "copy.txt").exists(), False)
        elif op == "mv":
            expect(f"{where} move.txt exists", (base / "move.txt").exists(), not done)
            expect(
                f"{where} moved.txt",
                _text(base / "moved.txt") if done else (base / "moved.txt").exists(),
                "move\n" if done else False,
            )
        elif op == "ln":
            if done:
                a, h = os.stat(base / case.main), os.stat(base / "hard.txt")
                expect(f"{where} hard.txt same inode", h.st_ino, a.st_ino)
                expect(f"{where} hard.txt nlink", h.st_nlink, 2)
            else:
                expect(f"{where} hard.txt exists", os.path.lexists(base / "hard.txt"), False)
        elif op == "ln-s":
            if done:
                expect(f"{where} sym target", os.readlink(base / "sym"), case.main)
            else:
                expect(f"{where} sym exists", os.path.lexists(base / "sym"), False)
    return problems


def crossing_entry(
    entries: list[dict[str, Any]], ran: Ran, paths: set[str], dest: str
) -> dict[str, Any] | None:
    """The audit entry of a rename or link of `ran` refused with EXDEV for crossing zones: not a
    policy denial, so recorded with `allowed: null` (and not shown by `audit --denied`)."""
    for e in entries:
        if (
            "allowed" in e
            and e["allowed"] is None
            and e.get("pid") == ran.pid
            and e.get("comm") == ran.comm
            and e.get("errno") == "EXDEV"
            and e.get("path") in paths
            and e.get("dest") == dest
            and "cannot cross zones" in (e.get("reason") or "")
        ):
            return e
    return None


def denial_entry(
    entries: list[dict[str, Any]], ran: Ran, paths: set[str], err: str
) -> dict[str, Any] | None:
    """The audit entry of a refusal of `ran`: same pid and tool, one of its paths, its errno."""
    for e in entries:
        if (
            e.get("allowed") is False
            and e.get("pid") == ran.pid
            and e.get("comm") == ran.comm
            and e.get("errno") == err
            and e.get("path") in paths
            and e.get("reason")
        ):
            return e
    return None


def mount_paths(m: Mount, ran: Ran) -> set[str]:
    """Virtual paths of every mount path named on the command line (also inside sh -c), and
    of their directories below the zone root: a refusal is audited at the first name that
    cannot be resolved, which may be a directory on the way."""
    words: list[str] = []
    for arg in ran.argv[1:]:
        words.extend(w.strip("'") for w in arg.split())
    prefix = str(m.mnt) + "/"
    paths: set[str] = set()
    for word in words:
        if word.startswith(prefix):
            path = Path(vpath(m, word))
            paths.add(str(path))
            paths.update(str(p) for p in path.parents if len(p.parts) > 2)
    return paths


# ----- the matrix ---------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_matrix_at_level(mount_at: Callable[..., Any], project: Path, level: str) -> None:
    """Every zone x every tool at one trust level, as the matrix and the callbacks' rules say."""
    cases = prepare(project)
    failures: list[str] = []
    denials: list[tuple[str, Ran, str]] = []
    allowed: list[tuple[str, Ran]] = []
    with mount_at(level, "--session", SESSION_ID) as m:
        assert m.session == SESSION_ID
        for case in cases:
            cell = MATRIX[level][case.zone]
            d = case.mdir(m)
            main = d / case.main
            for op in TOOL_OPS:
                expected = outcome(cell, case)[op]
                ran = command(op, d, main)
                label = f"[{level}] {case.zone} ({cell or '-'}) {op}: {ran}"
                if expected == OK:
                    if ran.rc != 0:
                        failures.append(f"{label}: expected success")
                        continue
                    allowed.append((label, ran))
                else:
                    if not refused_as(ran, expected):
                        failures.append(f"{label}: expected {MESSAGE[expected]!r}")
                    denials.append((label, ran, expected))
                via_mount = cell != "create-only"
                for problem in effect_problems(op, case, d, ran, expected == OK, via_mount):
                    failures.append(f"{label}: {problem}")
            # Directories resolve in a create-only zone, so the new one is visible there too.
            if cell == "create-only" and not (d / "newdir").is_dir():
                failures.append(f"[{level}] {case.zone}: mkdir'ed newdir not visible")

        # /.sandboxfs/context.json: readable at every level, shows the level, never writable.
        ctx_path = m.mnt / ".sandboxfs" / "context.json"
        ran = run("cat", ctx_path)
        if ran.rc != 0:
            failures.append(f"[{level}] context.json: {ran}")
        else:
            doc = json.loads(ran.out)
            if doc.get("trust") != level or doc.get("session") != SESSION_ID:
                failures.append(
                    f"[{level}] context.json shows {doc.get('trust')!r}/{doc.get('session')!r}"
                )
        ran = shell(f"echo > '{ctx_path}'")
        label = f"[{level}] context.json write: {ran}"
        if ran.rc == 0 or "Permission denied" not in ran.err:
            failures.append(f"{label}: expected 'Permission denied'")
        denials.append((label, ran, EACCES))
        if json.loads(ctx_path.read_text()).get("trust") != level:
            failures.append(f"[{level}] context.json changed after a refused write")

        entries = m.audit("--denied")
        for label, ran, err in denials:
            if denial_entry(entries, ran, mount_paths(m, ran), err) is None:
                mine = [
                    {k: e.get(k) for k in ("op", "path", "errno", "comm", "pid")}
                    for e in entries
                    if e.get("pid") == ran.pid
                ]
                failures.append(f"{label}: no audit entry (pid {ran.pid}); pid's entries: {mine}")
        # What succeeded was not refused anything along the way either.
        for label, ran in allowed:
            mine = [
                {k: e.get(k) for k in ("op", "path", "errno", "reason")}
                for e in entries
                if e.get("pid") == ran.pid
            ]
            if mine:
                failures.append(f"{label}: succeeded but audited as denied: {mine}")
    assert not failures, f"{len(failures)} problem(s):\n" + "\n".join(failures)


# ----- create-only staging ------------------------------------------------------------------------


def test_create_only_staging_at_untrusted(mount_at: Callable[..., Any], project: Path) -> None:
    failures: list[str] = []
    refused: list[Ran] = []
    with mount_at("untrusted") as m:
        c1 = m.mnt / "staged" / "c1"
        backing = sandbox_dir(project) / "staged" / "c1"
        ran = run("mkdir", c1)
        if ran.rc != 0 or not backing.is_dir():
            failures.append(f"mkdir c1: {ran}")
        ran = shell(f"echo x > '{c1}/f'")
        if ran.rc != 0:
            failures.append(f"create c1/f: {ran}")
        # What this mount created reads back (the agent checks its own work, docs/concepts.md); what
        # another party put there does not.
        own = run("cat", c1 / "f"), run("ls", c1)
        if own[0].rc != 0 or own[0].out != "x\n" or own[1].rc != 0 or own[1].out != "f\n":
            failures.append(f"own staged entries should read back: {own}")
        (backing / "other").write_text("someone else's\n")
        for ran in (
            shell(f"echo y > '{c1}/f'"),  # overwrite (O_TRUNC) an existing file
            shell(f"echo y >> '{c1}/f'"),  # append to it
            run("rm", c1 / "f"),
            run("mv", c1 / "f", c1 / "g"),
        ):
            if ran.rc == 0 or "Permission denied" not in ran.err:
                failures.append(f"expected 'Permission denied': {ran}")
            refused.append(ran)
        theirs = run("cat", c1 / "other")
        if theirs.rc == 0 or "No such file" not in theirs.err:
            failures.append(f"another party's staged file should stay absent: {theirs}")
        if (backing / "f").read_bytes() != b"x\n":
            failures.append(
                f"backing c1/f holds {(backing / 'f').read_bytes()!r}, expected b'x\\n'"
            )
        if os.path.lexists(backing / "g"):
            failures.append("c1/g exists in backing storage after a refused mv")
        entries = m.audit("--denied")
        for ran in refused:
            entry = denial_entry(entries, ran, mount_paths(m, ran), "EACCES")
            if entry is None:
                failures.append(f"no audit entry for {ran}")
            elif "create-only" not in entry["reason"]:
                failures.append(f"reason does not say create-only: {entry['reason']!r}")
    assert not failures, "\n".join(failures)


def test_create_only_file_cannot_be_truncated_after_close(
    mount_at: Callable[..., Any], project: Path
) -> None:
    """Create-only staging: new files are written *while open*; existing ones (also the ones this
    mount created, once closed) cannot be truncated, neither through open nor through
    truncate(2)."""
    failures: list[str] = []
    with mount_at("untrusted") as m:
        c1 = m.mnt / "staged" / "c1"
        backing = sandbox_dir(project) / "staged" / "c1" / "f"
        assert run("mkdir", c1).rc == 0
        assert shell(f"echo x > '{c1}/f'").rc == 0
        refused = [
            run("truncate", "-s", "0", c1 / "f"),
            # truncate(2) by path: a setattr of the size without an open handle.
            run("/usr/bin/python3", "-c", f"import os; os.truncate({str(c1 / 'f')!r}, 0)"),
        ]
        for ran in refused:
            if ran.rc == 0 or "Permission denied" not in ran.err:
                failures.append(f"expected 'Permission denied': {ran}")
        if backing.read_bytes() != b"x\n":
            failures.append(f"content changed to {backing.read_bytes()!r}")
        entries = m.audit("--denied")
        for ran in refused:
            if denial_entry(entries, ran, {"/staged/c1/f"}, "EACCES") is None:
                failures.append(f"no audit entry for {ran}")
    assert not failures, "\n".join(failures)


def test_create_only_write_is_not_audited_as_denied(
    mount_at: Callable[..., Any], project: Path
) -> None:
    """A successful `echo x > c1/f` in create-only /staged refuses nothing, so `sandboxfs audit
    --denied` must not show it (it would tell the agent a read of its own file was blocked)."""
    with mount_at("untrusted") as m:
        c1 = m.mnt / "staged" / "c1"
        assert run("mkdir", c1).rc == 0
        ran = shell(f"echo x > '{c1}/f'")
        assert ran.rc == 0, str(ran)
        assert (sandbox_dir(project) / "staged" / "c1" / "f").read_text() == "x\n"
        phantom = [e for e in m.audit("--denied") if e.get("pid") == ran.pid]
        assert phantom == [], phantom


# ----- the deny list ------------------------------------------------------------------------------


def test_deny_list_at_full(mount_at: Callable[..., Any], project: Path) -> None:
    failures: list[str] = []
    with mount_at("full", "--new-session", SESSION_ID) as m:
        repo = m.mnt / "repo"
        # (refused run, deny pattern in its reason, errno): deny-listed entries are listed and
        # stat-able; reading their contents, listing a deny-listed directory, and creating,
        # deleting, renaming or linking onto one is EACCES.
        checks: list[tuple[Ran, str | None, str]] = []

        checks.append((run("cat", repo / ".env"), ".env", EACCES))
        checks.append((run("cat", repo / "server.pem"), "*.pem", EACCES))  # holds a key

        listing = run("ls", "-a", repo)
        names = set(listing.out.split())
        if listing.rc != 0 or "README.md" not in names:
            failures.append(f"ls -a repo: {listing}")
        for shown in (".env", "server.pem", ".ssh"):
            if shown not in names:
                failures.append(f"ls -a repo does not show {shown}: {sorted(names)}")
        if ".sandbox" in names:
            failures.append(f"ls -a repo shows .sandbox: {sorted(names)}")
        size = run("stat", "-c", "%s %i", repo / ".env")
        real = os.stat(project / ".env")
        if size.out.split() != [str(real.st_size), str(real.st_ino)]:
            failures.append(f"stat .env: {size} (outside: {real.st_size} {real.st_ino})")

        checks.append((run("ls", repo / ".ssh"), ".ssh/", EACCES))
        checks.append((run("cat", repo / ".ssh" / "id_rsa"), ".ssh/", EACCES))
        checks.append((shell(f"echo > '{repo}/.netrc'"), ".netrc", EACCES))
        checks.append((run("rm", "-f", repo / ".env"), ".env", EACCES))
        checks.append((run("mv", repo / "README.md", repo / ".env"), ".env", EACCES))
        checks.append(
            (run("ln", repo / "README.md", repo / ".git-credentials"), ".git-credentials", EACCES)
        )
        # Every zone, not only the repo.
        checks.append((shell(f"echo > '{m.mnt}/session/working/.env.local'"), ".env.*", EACCES))

        for ran, _, err in checks:
            if not refused_as(ran, err):
                failures.append(f"expected {MESSAGE[err]!r}: {ran}")

        if (project / "README.md").read_text() != "# demo project\n":
            failures.append("README.md changed")
        if (project / ".env").read_text() != "API_KEY=secret\n":
            failures.append(".env changed")
        for absent in (project / ".netrc", project / ".git-credentials"):
            if os.path.lexists(absent):
                failures.append(f"{absent.name} was created in the repo")
        session_env = sandbox_dir(project) / "sessions" / SESSION_ID / "working" / ".env.local"
        if os.path.lexists(session_env):
            failures.append("session/working/.env.local was created")

        entries = m.audit("--denied")
        for ran, pattern, err in checks:
            entry = denial_entry(entries, ran, mount_paths(m, ran), err)
            if entry is None:
                failures.append(f"no audit entry for {ran}")
            elif pattern is not None and repr(pattern) not in entry["reason"]:
                failures.append(f"pattern {pattern!r} not in reason {entry['reason']!r} ({ran})")
    assert not failures, "\n".join(failures)


# ----- crossing zones -----------------------------------------------------------------------------


def test_cross_zone_at_session(mount_at: Callable[..., Any], project: Path) -> None:
    """`mv` session -> workspace falls back to copy + delete; `ln` across zones is EXDEV."""
    prepare(project)
    ws = sandbox_dir(project)
    with mount_at("session", "--session", SESSION_ID) as m:
        link = run("ln", m.mnt / "session/working/f.txt", m.mnt / "workspace/data/h.txt")
        assert link.rc != 0, str(link)
        assert "Invalid cross-device link" in link.err, str(link)
        assert not os.path.lexists(ws / "workspace" / "data" / "h.txt")
        entry = crossing_entry(m.audit(), link, {"/session/working/f.txt"}, "/workspace/data/h.txt")
        assert entry is not None
        assert entry["op"] == "link"
        # Crossing zones is no policy denial: `audit --denied` does not show it.
        assert [e for e in m.audit("--denied") if e.get("pid") == link.pid] == []

        src = m.mnt / "session" / "working" / "f.txt"
        dst = m.mnt / "workspace" / "data" / "moved.txt"
        ran = run("mv", src, dst)
        assert ran.rc == 0, str(ran)
        assert not (ws / "sessions" / SESSION_ID / "working" / "f.txt").exists()
        assert (ws / "workspace" / "data" / "moved.txt").read_text() == MAIN_TEXT["session"]
        assert not os.path.lexists(src)
        assert dst.read_text() == MAIN_TEXT["session"]

        def by_mv(e: dict[str, Any]) -> bool:
            return e.get("pid") == ran.pid and e.get("comm") == "mv"

        m.wait_audit(lambda e: by_mv(e) and e["op"] == "delete" and e["allowed"])
        entries = [e for e in m.audit() if by_mv(e)]
        renames = [
            i
            for i, e in enumerate(entries)
            if e["op"] == "rename"
            and e["allowed"] is None
            and e["errno"] == "EXDEV"
            and "cannot cross zones" in e["reason"]
            and e["path"] == "/session/working/f.txt"
            and e["dest"] == "/workspace/data/moved.txt"
        ]
        writes = [
            i
            for i, e in enumerate(entries)
            if e["op"] == "write" and e["allowed"] and e["path"] == "/workspace/data/moved.txt"
        ]
        deletes = [
            i
            for i, e in enumerate(entries)
            if e["op"] == "delete" and e["allowed"] and e["path"] == "/session/working/f.txt"
        ]
        summary = [(e["op"], e["path"], e["allowed"], e["errno"]) for e in entries]
        assert renames and writes and deletes, summary
        assert renames[0] < writes[0] < deletes[0], summary


def test_cross_zone_mv_workspace_to_repo_keeps_source(
    mount_at: Callable[..., Any], project: Path
) -> None:
    prepare(project)
    backing_src = sandbox_dir(project) / "workspace" / "data" / "f.txt"
    with mount_at("workspace", "--session", SESSION_ID) as m:
        src = m.mnt / "workspace" / "data" / "f.txt"
        ran = run("mv", src, m.mnt / "repo" / "f.txt")
        assert ran.rc != 0, str(ran)
        assert "Read-only file system" in ran.err, str(ran)
        assert backing_src.read_text() == MAIN_TEXT["workspace"], "the source was lost"
        assert src.read_text() == MAIN_TEXT["workspace"]
        assert not os.path.lexists(project / "f.txt")
        entries = m.audit()
        assert crossing_entry(entries, ran, {"/workspace/data/f.txt"}, "/repo/f.txt"), entries
        assert denial_entry(m.audit("--denied"), ran, {"/repo/f.txt"}, "EROFS"), entries


# ----- zone roots ---------------------------------------------------------------------------------


def test_zone_roots_cannot_be_changed_at_full(mount_at: Callable[..., Any], project: Path) -> None:
    failures: list[str] = []
    with mount_at("full") as m:
        runs = [
            (run("rmdir", m.mnt / "session"), "/session"),
            (run("mv", m.mnt / "repo", m.mnt / "x"), "/repo"),
            (run("touch", m.mnt / "newfile"), "/newfile"),
            (run("mkdir", m.mnt / "x"), "/x"),
            (run("chmod", "700", m.mnt / "repo"), "/repo"),
            (run("touch", m.mnt / "workspace"), "/workspace"),
        ]
        for ran, _ in runs:
            if ran.rc == 0 or "Permission denied" not in ran.err:
                failures.append(f"expected 'Permission denied': {ran}")
        listing = run("ls", m.mnt)
        if listing.out.split() != ["repo", "session", "staged", "workers", "workspace"]:
            failures.append(f"root changed: {listing.out.split()}")
        if not (project / "README.md").exists() or not (sandbox_dir(project) / "sessions").is_dir():
            failures.append("backing storage of a zone root changed")
        entries = m.audit("--denied")
        for ran, path in runs:
            if denial_entry(entries, ran, {path}, "EACCES") is None:
                failures.append(f"no audit entry for {ran}")
    assert not failures, "\n".join(failures)
