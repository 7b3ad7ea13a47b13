"""Live trust changes: `sandboxfs promote` / `demote` on real mounts and runs, and the control
socket they talk to.

Every test drives real programs (cat, ls, stat, sh, python3 holding descriptors open, bubblewrap
through `sandboxfs run`) against a real mount, changes the level from outside while they run,
and checks what they can do next, what the audit log says and what the mount reports. The
control socket is also spoken to directly: from other users, other namespaces, and with
malformed requests. Every mount is unmounted in `finally` (the `mounted` helper); every
background program is bounded by a timeout and killed on the way out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from sandboxfs.layout import control_dir
from tests.support.cli import SANDBOXFS, assert_one_line_error, sandboxfs, sh, wait_until
from tests.support.mounts import Mount
from tests.support.run import needs_bwrap

PY = "/usr/bin/python3"  # the system's: readable by nobody and present inside a run sandbox
TIMEOUT = 30.0
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


# ----- helpers -----------------------------------------------------------------------------------


def context(m: Mount) -> dict[str, Any]:
    facts: dict[str, Any] = json.loads((m.mnt / ".sandboxfs" / "context.json").read_text())
    return facts


def status_row(mountpoint: Path | str) -> dict[str, Any]:
    result = sandboxfs("status", "--json")
    assert result.returncode == 0, result.stderr
    rows = [r for r in json.loads(result.stdout) if r["mountpoint"] == str(mountpoint)]
    assert len(rows) == 1, result.stdout
    row: dict[str, Any] = rows[0]
    return row


def change(verb: str, mountpoint: Path | str, level: str, *extra: str) -> tuple[int, str, str, int]:
    """`sandboxfs promote|demote MOUNTPOINT --trust LEVEL`: (exit, stdout, stderr, its pid)."""
    with subprocess.Popen(
        [*SANDBOXFS, verb, str(mountpoint), "--trust", level, *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"sandboxfs {verb} hung") from None
    return proc.returncode, out, err, proc.pid


def ask(path: str, data: bytes, timeout: float = 15.0) -> dict[str, Any] | None:
    """Send raw bytes on the control socket (then end the stream) and parse the answer; None
    when the daemon answers nothing."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        with suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        with suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        with suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    if not answer:
        return None
    assert answer.endswith(b"\n") and answer.count(b"\n") == 1, answer
    reply = json.loads(answer)
    assert isinstance(reply, dict) and reply.get("v") == 1, reply
    return reply


def trust_of(path: str) -> str:
    reply = ask(path, b'{"v": 1, "op": "status"}\n')
    assert reply is not None and reply["ok"] is True, reply
    return str(reply["trust"])


@contextmanager
def holder(
    script: str, *args: str | Path
) -> Iterator[tuple[dict[str, str], Callable[[], dict[str, str]]]]:
    """A python3 process running `script` (which prints `name: outcome` lines and `done` after
    each round: one at the start, then one per line on its stdin); yields the first round's
    outcomes and `step()`, which asks for another round and returns its outcomes."""
    proc = subprocess.Popen(
        [PY, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    started = time.monotonic()

    def read_round() -> dict[str, str]:
        found: dict[str, str] = {}
        while (line := stdout.readline()) and line.strip() != "done":
            name, _, outcome = line.partition(": ")
            found[name.strip()] = outcome.strip()
            assert time.monotonic() - started < TIMEOUT, "the holder took too long"
        assert line, f"the holder died: {found} {proc.stderr.read() if proc.stderr else ''}"
        return found

    def step() -> dict[str, str]:
        stdin.write("\n")
        stdin.flush()
        return read_round()

    try:
        yield read_round(), step
    finally:
        with suppress(OSError):
            stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


ATTEMPT = r"""
import errno, os, sys
def attempt(name, call):
    try:
        print(f"{name}: ok {call()!r}", flush=True)
    except OSError as exc:
        print(f"{name}: {errno.errorcode[exc.errno]}", flush=True)
"""

# A reader that holds a file and a directory open, and reads both from the start every round.
READER = (
    ATTEMPT
    + r"""
fd = os.open(sys.argv[1], os.O_RDONLY)
dfd = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY)
def round_():
    os.lseek(fd, 0, os.SEEK_SET)
    attempt("read", lambda: os.read(fd, 64))
    attempt("fstat", lambda: os.fstat(fd).st_size)
    attempt("list", lambda: sorted(os.listdir(dfd)))
    print("done", flush=True)
round_()
for _ in sys.stdin:
    round_()
"""
)

# A writer holding two write handles opened at the start: one that created its file, one on an
# existing file (append).
WRITER = (
    ATTEMPT
    + r"""
created = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
existing = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND)
attempt("write-created", lambda: os.write(created, b"first\n"))
attempt("write-existing", lambda: os.write(existing, b"first\n"))
print("done", flush=True)
for _ in sys.stdin:
    attempt("write-created", lambda: os.write(created, b"second\n"))
    attempt("truncate-created", lambda: os.ftruncate(created, 0))
    attempt("write-existing", lambda: os.write(existing, b"second\n"))
    print("done", flush=True)
"""
)

# Connects to the control socket given as argv[1], asks for trust untrusted, prints one line.
CLIENT = r"""
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(15)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connect": exc.errno}))
    sys.exit(0)
try:
    sock.sendall(b'{"v": 1, "op": "trust", "trust": "untrusted"}\n')
except OSError:
    pass  # the daemon may answer a refused peer, and close, before reading
data = b""
try:
    while chunk := sock.recv(65536):
        data += chunk
except ConnectionResetError:
    pass  # it closed without reading our request: the reply came first
print(data.decode().strip() or "{}")
"""


def client(prefix: list[str], path: str) -> dict[str, Any]:
    result = subprocess.run(
        [*prefix, PY, "-c", CLIENT, path],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, (prefix, result.stderr)
    reply: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return reply


# ----- 1. demotion with a reader holding descriptors ---------------------------------------------


def test_demote_full_to_untrusted_cuts_off_names_pages_and_open_descriptors(
    mount_at: Callable[..., Any], project: Path
) -> None:
    content = b"page cached secret\n" * 4096  # 76 KiB: many cached pages
    (project / "file").write_bytes(content)
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        with holder(READER, repo / "file", repo) as (first, step):
            assert first["read"] == f"ok {content[:64]!r}", first
            assert first["fstat"] == f"ok {len(content)}", first
            assert "'file'" in first["list"] and "'README.md'" in first["list"], first
            cached = sh(f"cat {repo}/file")  # every page into the page cache
            assert cached.returncode == 0 and cached.stdout == content.decode()
            assert sh(f"stat {repo}/file && ls {repo}").returncode == 0

            code, out, err, pid = change("demote", m.mnt, "untrusted")
            assert code == 0, err
            assert out.strip() == f"{m.mnt}: trust full -> untrusted"
            # at once, before anything else touches the mount
            assert context(m)["trust"] == "untrusted"
            assert status_row(m.mnt)["trust"] == "untrusted"

            cat = sh(f"cat {repo}/file")
            assert cat.returncode == 1 and "No such file or directory" in cat.stderr, cat
            assert cat.stdout == ""
            stat = sh(f"stat {repo}/file")
            assert stat.returncode == 1 and "No such file or directory" in stat.stderr, stat
            ls = sh(f"ls {repo}")
            assert ls.returncode == 2 and "Permission denied" in ls.stderr, ls

            after = step()  # the descriptors opened at full, used again
            assert not after["read"].startswith("ok"), after  # no old bytes from the cache
            assert after["read"] in ("ENOENT", "EACCES"), after
            assert not after["fstat"].startswith("ok"), after
            assert after["list"] in ("EACCES", "ENOENT"), after

            m.wait_audit(lambda e: e["comm"] == "python3" and e["allowed"] is False)
            denied = m.audit("--denied", "--trust", "untrusted")
            by = {(e["comm"], e["op"]) for e in denied if e["zone"] == "repo"}
            assert {("cat", "read"), ("stat", "read"), ("ls", "list")} <= by, denied
            assert any(e["comm"] == "python3" and e["path"] == "/repo/file" for e in denied)
            assert all(e["trust"] == "untrusted" for e in denied)
            trust = m.audit("--op", "trust")
            assert len(trust) == 1, trust
            assert trust[0]["detail"] == "full -> untrusted"
            assert trust[0]["pid"] == pid and trust[0]["uid"] == os.getuid()
            assert trust[0]["session"] == m.session

            # back to full: the same descriptors read again, with the real bytes
            code, out, err, _ = change("promote", m.mnt, "full")
            assert code == 0, err
            again = step()
            assert again["read"] == f"ok {content[:64]!r}", again
            assert again["fstat"] == f"ok {len(content)}", again
            assert "'file'" in again["list"], again
    details = [e["detail"] for e in m.audit("--op", "trust")]
    assert details == ["full -> untrusted", "untrusted -> full"]


MAPPER = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
pages = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
print("before:", bytes(pages[:20]), flush=True)
sys.stdin.readline()
print("after:", bytes(pages[:20]), flush=True)  # a fault: SIGBUS if the read is refused
"""


def test_demote_reaches_mapped_pages(mount_at: Callable[..., Any], project: Path) -> None:
    """Pages mapped at full are dropped too: touching them again asks the daemon, which
    refuses (SIGBUS), instead of showing the old bytes."""
    (project / "mapped").write_bytes(b"mapped secret bytes\n" * 1000)
    with mount_at("full") as m:
        with subprocess.Popen(
            [PY, "-c", MAPPER, str(m.mnt / "repo" / "mapped")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            try:
                assert proc.stdout is not None and proc.stdin is not None
                assert proc.stdout.readline().strip() == "before: b'mapped secret bytes\\n'"
                code, _, err, _ = change("demote", m.mnt, "untrusted")
                assert code == 0, err
                out, _ = proc.communicate("\n", timeout=TIMEOUT)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert proc.returncode == -signal.SIGBUS, (proc.returncode, out)
        assert "secret" not in out
        denied = m.wait_audit(lambda e: e["path"] == "/repo/mapped" and e["allowed"] is False)
        assert denied["trust"] == "untrusted" and denied["comm"] == "python3"


# ----- 2. promotion without remounting -----------------------------------------------------------


def test_promote_untrusted_to_workspace_without_remounting(
    mount_at: Callable[..., Any], project: Path
) -> None:
    with mount_at("untrusted") as m:
        repo = m.mnt / "repo"
        refused = sh(f"cat {repo}/README.md")
        assert refused.returncode == 1 and "No such file or directory" in refused.stderr
        assert sh(f"ls {repo}").returncode == 2
        assert sh(f"ls {m.mnt}/workspace").returncode == 2

        code, out, err, _ = change("promote", m.mnt, "workspace", "--json")
        assert code == 0, err
        assert json.loads(out) == {"v": 1, "ok": True, "old": "untrusted", "new": "workspace"}
        assert context(m)["trust"] == "workspace"
        assert context(m)["zones"]["repo"] == {
            "read": True,
            "write": False,
            "list": True,
            "delete": False,
            "create_only": False,
        }

        cat = sh(f"cat {repo}/README.md")
        assert cat.returncode == 0, cat.stderr
        assert cat.stdout == "# demo project\n"
        ls = sh(f"ls -a {repo}")
        assert ls.returncode == 0, ls.stderr
        names = ls.stdout.split()
        assert {"README.md", "src", ".env", "server.pem", ".ssh"} <= set(names), names
        assert ".sandbox" not in names, names  # deny-listed entries are shown, the state not
        assert sh(f"ls {m.mnt}/workspace").returncode == 0

        # workspace reads the repo, never writes it
        for command in (f"echo x >> {repo}/README.md", f"echo x > {repo}/new.txt"):
            write = sh(command)
            assert write.returncode != 0 and "Read-only file system" in write.stderr, write
        assert (project / "README.md").read_text() == "# demo project\n"
        assert not (project / "new.txt").exists()
        entry = m.wait_audit(lambda e: e["path"] == "/repo/new.txt" and e["allowed"] is False)
        assert entry["trust"] == "workspace" and entry["errno"] == "EROFS"


# ----- 3. write handles opened at full -----------------------------------------------------------


def test_demote_refuses_writes_through_handles_opened_before(
    mount_at: Callable[..., Any], project: Path
) -> None:
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        with holder(WRITER, repo / "x", repo / "README.md") as (first, step):
            assert first == {"write-created": "ok 6", "write-existing": "ok 6"}, first

            code, _, err, _ = change("demote", m.mnt, "workspace")
            assert code == 0, err
            after = step()
            for name in ("write-created", "truncate-created", "write-existing"):
                assert after[name] in ("EROFS", "EACCES"), after
        assert (project / "x").read_bytes() == b"first\n"  # nothing more written, not truncated
        assert (project / "README.md").read_text() == "# demo project\nfirst\n"
        m.wait_audit(lambda e: e["path"] == "/repo/README.md" and e["allowed"] is False)
        denied = m.audit("--denied", "--trust", "workspace")
        for path in ("/repo/x", "/repo/README.md"):
            entries = [e for e in denied if e["path"] == path and e["comm"] == "python3"]
            assert entries, (path, denied)
            assert all(e["op"] == "write" for e in entries), entries
            assert all(e["errno"] in ("EROFS", "EACCES") for e in entries), entries
            assert "not writable at trust level workspace" in entries[0]["reason"], entries


# ----- 4. the mount of a `sandboxfs run` --------------------------------------------------------


@needs_bwrap
def test_promote_a_running_sandbox(project: Path) -> None:
    session = f"live{os.getpid()}"
    working = project / ".sandbox" / "workspaces" / "default" / "sessions" / session / "working"
    # `ls | grep` rather than `[ -e go ]`: a lookup of an absent name is cached by the kernel
    # (a negative entry, for entry_timeout), a listing is asked again every time.
    script = (
        "cat /sandbox/repo/README.md || echo refused; echo ready; "
        "while ! ls /sandbox/session/working | grep -qx go; do sleep 0.05; done; "
        "cat /sandbox/repo/README.md"
    )
    command = ["sh", "-c", script]
    new = ["--new-session", session, "--"]
    with subprocess.Popen(
        [*SANDBOXFS, "run", "--project", str(project), "--trust", "untrusted", *new, *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "refused"
            assert proc.stdout.readline().strip() == "ready"
            status = sandboxfs("status", "--json")
            rows = [r for r in json.loads(status.stdout) if r.get("session") == session]
            assert len(rows) == 1 and rows[0]["command"] == command, status.stdout
            mountpoint = rows[0]["mountpoint"]
            assert rows[0]["trust"] == "untrusted"

            code, out, err, _ = change("promote", mountpoint, "workspace")
            assert code == 0, err
            assert out.strip() == f"{mountpoint}: trust untrusted -> workspace"
            assert status_row(mountpoint)["trust"] == "workspace"
            (working / "go").touch()
            out, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert proc.returncode == 0, err
    assert out == "# demo project\n", out
    assert f"session {session} ended (exit 0)" in err
    result = sandboxfs("audit", "--project", project, "--json", "--op", "trust")
    entries = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(e["session"], e["detail"]) for e in entries] == [(session, "untrusted -> workspace")]
    assert wait_until(lambda: mountpoint not in Path("/proc/self/mounts").read_text())


REACH = r"""
import json, os, socket, sys
facts = json.load(open("/sandbox/.sandboxfs/context.json"))
print("told:", facts.get("control"))  # the program is not told where the socket is
path = sys.argv[1].format(pid=facts["pid"])  # where it is, from outside
print("trust:", facts["trust"])
print("dir:", os.path.exists(os.path.dirname(path)) if path else "none")
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(path)
    sock.sendall(b'{"v": 1, "op": "trust", "trust": "untrusted"}\n')
    print("connect:", sock.recv(4096).decode().strip())
except OSError as exc:
    print("connect:", exc.errno)
"""


@needs_bwrap
def test_the_control_socket_is_unreachable_from_inside_a_run(project: Path) -> None:
    probe = [PY, "-c", REACH, str(control_dir() / "{pid}.sock")]
    result = subprocess.run(
        [*SANDBOXFS, "run", "--project", str(project), "--trust", "full", "--quiet", "--", *probe],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["told"] == "None", result.stdout
    assert lines["trust"] == "full"  # the program stays where it was put
    assert lines["dir"] == "False", result.stdout
    assert lines["connect"] == "2", result.stdout  # ENOENT: the state root is not in its view
    runs = json.loads(sandboxfs("status", "--json").stdout)
    assert not [r for r in runs if r.get("project") == str(project)], runs  # gone afterwards
    entries = sandboxfs("audit", "--project", project, "--json", "--op", "trust").stdout
    assert entries.strip() == ""


# ----- 5. who may talk to the daemon -------------------------------------------------------------


def test_other_users_and_other_namespaces_cannot_change_the_level(
    mount_at: Callable[..., Any],
) -> None:
    with mount_at("session") as m:
        path = context(m)["control"]
        assert Path(path).stat().st_mode & 0o777 == 0o600
        assert Path(path).parent.stat().st_mode & 0o777 == 0o700

        # nobody cannot even connect (0600 socket in a 0700 directory)
        plain = client(NOBODY, path)
        assert plain.get("connect") in (13, 2), plain  # EACCES (or ENOENT: state root hidden)
        assert trust_of(path) == "session"

        # nobody past the file modes (CAP_DAC_OVERRIDE kept): the daemon's own uid check
        past = client([*NOBODY, "--inh-caps=+dac_override", "--ambient-caps=+dac_override"], path)
        assert past.get("ok") is False, past
        assert "uid 65534" in past["error"], past
        assert trust_of(path) == "session"

        # root, but in another PID namespace, or in another user namespace
        for prefix in (
            ["unshare", "--pid", "--fork", "--mount-proc"],
            ["unshare", "--user", "--map-root-user"],
        ):
            reply = client(prefix, path)
            assert reply.get("ok") is False, (prefix, reply)
            assert "inside a sandbox" in reply["error"] or "namespace" in reply["error"], reply
            assert trust_of(path) == "session"

        assert context(m)["trust"] == "session"
        assert status_row(m.mnt)["trust"] == "session"
        assert m.audit("--op", "trust") == []
        assert sh(f"ls {m.mnt}/session").returncode == 0


# ----- 6. malformed requests ---------------------------------------------------------------------

MALFORMED: list[tuple[str, bytes, str]] = [
    ("not JSON", b"hello daemon\n", "not JSON"),
    ("not UTF-8", b"\xff\xfe\x00{\n", "not JSON"),
    ("empty line", b"\n", "not JSON"),
    ("a JSON list", b'[{"v": 1, "op": "status"}]\n', "JSON object"),
    ("a JSON string", b'"status"\n', "JSON object"),
    ("no version", b'{"op": "status"}\n', "version"),
    ("version 2", b'{"v": 2, "op": "status"}\n', "version"),
    ("version as a string", b'{"v": "1", "op": "status"}\n', "version"),
    ("no op", b'{"v": 1}\n', "unknown op"),
    ("unknown op", b'{"v": 1, "op": "shutdown"}\n', "unknown op"),
    ("unknown level", b'{"v": 1, "op": "trust", "trust": "root"}\n', "unknown trust level"),
    ("no level", b'{"v": 1, "op": "trust"}\n', "unknown trust level"),
    ("level as a list", b'{"v": 1, "op": "trust", "trust": ["full"]}\n', "unknown trust level"),
    ("level in capitals", b'{"v": 1, "op": "trust", "trust": "FULL"}\n', "unknown trust level"),
    ("no newline, then EOF", b'{"v": 1, "op": "trust", "trust": "full"', "not JSON"),
    ("70 KiB line", b'{"v": 1, "op": "status", "pad": "' + b"x" * (70 << 10) + b'"}\n', "larger"),
]


def test_malformed_requests_are_answered_and_the_daemon_stays_up(
    mount_at: Callable[..., Any],
) -> None:
    with mount_at("session") as m:
        path = context(m)["control"]
        for name, data, needle in MALFORMED:
            reply = ask(path, data)
            assert reply is not None, name
            assert reply["ok"] is False and needle in reply["error"], (name, reply)
            assert trust_of(path) == "session", name
        # connects and closes at once; connects and sends half a line, then closes
        for data in (b"", b'{"v": 1, "op"'):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
                sock.sendall(data)
            assert trust_of(path) == "session"
        # several at once, none of them finishing its line: the daemon still answers later ones
        idle = []
        try:
            for _ in range(3):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(path)
                idle.append(sock)
        finally:
            for sock in idle:
                sock.close()
        assert trust_of(path) == "session"
        listing = sh(f"ls {m.mnt}")
        assert listing.stdout.split() == ["repo", "session", "staged", "workers", "workspace"]
        assert context(m)["trust"] == "session"
        assert m.audit("--op", "trust") == []


def test_deeply_nested_json_does_not_kill_the_daemon(mount_at: Callable[..., Any]) -> None:
    """60,000 nested arrays fit in one request; json.loads raises RecursionError on them."""
    with mount_at("session") as m:
        path = context(m)["control"]
        for data in (b"[" * 60000 + b"\n", b'{"a":' * 30000 + b"\n"):
            reply = ask(path, data)
            assert reply is not None and reply["ok"] is False, reply
            assert os.path.ismount(m.mnt), "the daemon died"
            assert trust_of(path) == "session"
        assert sh(f"ls {m.mnt}").returncode == 0


def test_an_idle_client_does_not_hold_up_the_others(mount_at: Callable[..., Any]) -> None:
    """A client that connects and sends nothing (yet keeps the connection) must not delay
    the owner's `promote` or status by the daemon's per-connection deadline."""
    with mount_at("session") as m:
        path = context(m)["control"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.connect(path)
            started = time.monotonic()
            try:
                reply = ask(path, b'{"v": 1, "op": "status"}\n', timeout=3)
            except TimeoutError:
                reply = None
            waited = time.monotonic() - started
        assert reply is not None and reply["ok"] is True, f"no answer in {waited:.1f} s"
        assert waited < 2, waited


# ----- 7. the CLI's own refusals -----------------------------------------------------------------


def test_cli_refusals(mount_at: Callable[..., Any], tmp_path: Path) -> None:
    with mount_at("session") as m:
        lower = sandboxfs("promote", m.mnt, "--trust", "untrusted")
        assert_one_line_error(lower, "below", f"sandboxfs demote {m.mnt} --trust untrusted")
        higher = sandboxfs("demote", m.mnt, "--trust", "full")
        assert_one_line_error(higher, "above", f"sandboxfs promote {m.mnt} --trust full")
        for verb in ("promote", "demote"):
            same = sandboxfs(verb, m.mnt, "--trust", "session")
            assert same.returncode == 1, same
            assert "already" in same.stderr and "Traceback" not in same.stderr
            assert len(same.stderr.strip().splitlines()) == 1
        unknown = sandboxfs("promote", m.mnt, "--trust", "root")
        assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
        assert context(m)["trust"] == "session"
        assert m.audit("--op", "trust") == []
    plain = tmp_path / "plain"
    plain.mkdir()
    for target in (plain, tmp_path / "missing", m.mnt):  # m.mnt: unmounted by now
        result = sandboxfs("promote", target, "--trust", "full")
        assert_one_line_error(result, "not a sandboxfs mount")


# ----- many changes under load -------------------------------------------------------------------

BUSY = r"""
import os, sys, time
repo, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
seen = set()
while time.monotonic() < end:
    for call in (lambda: open(repo + "/README.md").read(), lambda: os.listdir(repo),
                 lambda: os.stat(repo + "/src/main.py")):
        try:
            call()
            seen.add("ok")
        except OSError as exc:
            seen.add(exc.errno)
print(sorted(seen, key=str))
"""


def test_flipping_levels_under_load(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        repo = m.mnt / "repo"
        with subprocess.Popen(
            [PY, "-c", BUSY, str(repo), "4"], stdout=subprocess.PIPE, text=True
        ) as busy:
            try:
                levels = ["untrusted", "workspace", "session", "full"] * 3
                current = "full"
                for level in levels:
                    verb = {
                        ("full", "untrusted"): "demote",
                        ("untrusted", "workspace"): "promote",
                        ("workspace", "session"): "demote",
                        ("session", "full"): "promote",
                    }[(current, level)]
                    code, out, err, _ = change(verb, m.mnt, level)
                    assert code == 0, (verb, level, err)
                    assert out.strip().endswith(f"{current} -> {level}"), out
                    current = level
                out, _ = busy.communicate(timeout=TIMEOUT)
            finally:
                if busy.poll() is None:
                    busy.kill()
                    busy.communicate()
        assert busy.returncode == 0
        assert "'ok'" in out, out  # it worked at times, and nothing hung
        assert context(m)["trust"] == "full"
        assert sh(f"cat {repo}/README.md").stdout == "# demo project\n"
        assert len(m.audit("--op", "trust")) == len(levels)


def test_status_shows_the_current_level_and_pending_staged_commits(
    mount_at: Callable[..., Any],
) -> None:
    with mount_at("untrusted") as m:
        assert status_row(m.mnt)["pending"] == 0
        staged = m.mnt / "staged"
        for commit_id in ("fix1", "fix2"):
            made = sh(
                f"mkdir -p {staged}/{commit_id}/files && echo x > {staged}/{commit_id}/files/a.md"
                f" && echo 'Add a' > {staged}/{commit_id}/message.txt"
            )
            assert made.returncode == 0, made.stderr
        row = status_row(m.mnt)
        assert (row["trust"], row["pending"]) == ("untrusted", 2)
        assert change("promote", m.mnt, "session")[0] == 0
        assert status_row(m.mnt)["trust"] == "session"
        table = sandboxfs("status", str(m.mnt))
        header, line = table.stdout.splitlines()
        assert header.split()[6] == "PENDING" and line.split()[2:7:4] == ["session", "2"]


def test_promote_and_demote_aimed_by_session_id_or_project(
    mount_at: Callable[..., Any], project: Path
) -> None:
    with mount_at("untrusted") as m:
        session = context(m)["session"]
        code, out, err, _ = change("promote", session, "workspace")
        assert code == 0, err
        assert out.strip() == f"{m.mnt}: trust untrusted -> workspace"
        # Named by nothing: the only running session of the project given.
        lowered = subprocess.run(
            [*SANDBOXFS, "demote", "--trust", "session", "--project", str(project)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert lowered.returncode == 0, lowered.stderr
        assert context(m)["trust"] == "session"
        unknown = subprocess.run(
            [*SANDBOXFS, "promote", "no-such-session", "--trust", "full"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert_one_line_error(unknown, "no-such-session is neither a sandboxfs mount nor a")
