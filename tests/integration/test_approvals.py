"""Approvals on real mounts and runs: `ask`, `blocked`, grants, grouping, the prompt, and who
can answer.

Real programs (rm, cat, mv, sh, python3 inside `sandboxfs run`) work on a mounted project
whose sandboxfs.yaml has approval rules; the user's side is the real CLI (`approvals`,
`approve`, `deny`, `grants`), the interactive prompt is driven through a pty. Every mount is
unmounted in `finally` (the `mounted` helper).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.project import control, prompt
from tests.support.cli import SANDBOXFS, sandboxfs, sh, wait_until
from tests.support.mounts import Mount, mounted
from tests.support.run import PY, UserTerminal, needs_bwrap

ASK_DELETES = """\
approvals:
  timeout: {timeout}
  rules:
    - {{id: repo-delete, ops: [delete], zones: [repo], decision: ask}}
    - {{id: no-overwrite, ops: [overwrite], zones: [repo], decision: blocked}}
"""


def configure(project: Path, timeout: float = 60) -> None:
    (project / "sandboxfs.yaml").write_text(ASK_DELETES.format(timeout=timeout))
    for directory in ("a", "b"):
        (project / directory).mkdir()
        for name in ("one", "two", "three"):
            (project / directory / name).write_text(f"{directory}/{name}\n")


def pending(m: Mount) -> list[dict[str, Any]]:
    result = sandboxfs("approvals", "--json", "--mount", m.mnt)
    assert result.returncode == 0, result.stderr
    requests: list[dict[str, Any]] = json.loads(result.stdout)["pending"]
    return requests


def approvals_entries(m: Mount) -> list[dict[str, Any]]:
    return [e for e in m.audit("--op", "approval")]


@pytest.fixture
def asking(tmp_path: Path, project: Path) -> Any:
    configure(project)
    with mounted(tmp_path / "mnt", project, "full") as m:
        yield m


def test_a_delete_under_ask_is_refused_as_pending_while_other_files_are_served(
    asking: Mount,
) -> None:
    repo = asking.mnt / "repo"
    rm = subprocess.Popen(
        ["rm", str(repo / "a" / "one")], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    cat = sh(f"cat {repo / 'b' / 'one'}; ls {repo / 'a'}")
    assert cat.returncode == 0 and cat.stdout.startswith("b/one\n"), cat.stderr
    _, err = rm.communicate(timeout=30)
    assert rm.returncode == 1 and "Permission denied" in err
    assert (asking.project / "a" / "one").exists()
    [request] = pending(asking)
    assert (request["op"], request["path"], request["rule"]) == (
        "delete",
        "/repo/a/one",
        "repo-delete",
    )
    assert request["comm"] == "rm" and request["cmdline"] == f"rm {repo / 'a' / 'one'}"
    denial = asking.wait_audit(lambda e: e["op"] == "delete" and e["allowed"] is False)
    assert (
        denial["reason"].startswith(
            f"EACCES: delete of /repo/a/one waits for approval {request['id']} (rule repo-delete)"
        )
        or f"waits for approval {request['id']}" in denial["reason"]
    )
    # the program reads what waits in its guide
    assert (
        f"{request['id']}: delete of /repo/a/one (rule repo-delete)"
        in (asking.mnt / ".sandboxfs" / "README").read_text()
    )


def test_approve_lets_the_retry_pass_and_the_audit_names_rule_and_answer(asking: Mount) -> None:
    one = asking.mnt / "repo" / "a" / "one"
    assert sh(f"rm {one}").returncode == 1
    [request] = pending(asking)
    approved = sandboxfs("approve", str(request["id"]), "--mount", asking.mnt)
    assert approved.returncode == 0, approved.stderr
    assert f"request {request['id']}: allow delete of /repo/a/one, once" in approved.stdout
    assert sh(f"rm {one}").returncode == 0
    assert not (asking.project / "a" / "one").exists()
    assert not pending(asking)
    entries = approvals_entries(asking)
    asked = [e for e in entries if e["approval"].get("request") == request["id"]]
    kinds = [(e["approval"].get("answer"), e["approval"].get("rule")) for e in asked]
    assert kinds[0] == (None, "repo-delete")  # the request
    assert ("once", "repo-delete") in kinds  # the answer, with who gave it
    answer = next(e for e in asked if e["approval"].get("answer") == "once")
    assert answer["approval"]["by"].startswith("command (pid ")
    assert any(e["approval"].get("grant") for e in entries if e["allowed"] is True)


def test_deny_gives_permission_denied_and_blocked_never_asks(asking: Mount) -> None:
    two = asking.mnt / "repo" / "a" / "two"
    assert sh(f"rm {two}").returncode == 1
    [request] = pending(asking)
    assert sandboxfs("deny", str(request["id"]), "--mount", asking.mnt).returncode == 0
    retry = sh(f"rm {two}")
    assert retry.returncode == 1 and "Permission denied" in retry.stderr
    assert (asking.project / "a" / "two").exists()
    # blocked: refused at once, no request
    write = sh(f"echo x > {asking.mnt / 'repo' / 'b' / 'two'}")
    assert write.returncode != 0 and "Permission denied" in write.stderr
    assert not pending(asking)
    refusal = asking.wait_audit(lambda e: e["op"] == "write" and e["allowed"] is False)
    assert "blocked by approval rule no-overwrite" in refusal["reason"]
    assert (asking.project / "b" / "two").read_text() == "b/two\n"


def test_allow_directory_covers_its_files_not_a_sibling_directory(asking: Mount) -> None:
    repo = asking.mnt / "repo"
    assert sh(f"rm {repo / 'a' / 'one'}").returncode == 1
    [request] = pending(asking)
    result = sandboxfs("approve", str(request["id"]), "--scope", "dir", "--mount", asking.mnt)
    assert "allow delete under /repo/a/, for this session" in result.stdout
    assert sh(f"rm {repo / 'a' / 'one'} {repo / 'a' / 'two'}").returncode == 0
    sibling = sh(f"rm {repo / 'b' / 'one'}")
    assert sibling.returncode == 1 and (asking.project / "b" / "one").exists()
    grants = json.loads(sandboxfs("grants", "--json", "--mount", asking.mnt).stdout)
    assert [g["scope"] for g in grants] == ["dir"]
    revoked = sandboxfs("grants", "--revoke", str(grants[0]["id"]), "--mount", asking.mnt)
    assert revoked.returncode == 0, revoked.stderr
    assert sh(f"rm {repo / 'a' / 'three'}").returncode == 1


def test_five_hundred_deletes_make_one_grouped_request(asking: Mount) -> None:
    many = asking.project / "many"
    many.mkdir()
    for n in range(500):
        (many / f"f{n:03}").write_text("x")
    result = sh(f"rm {asking.mnt / 'repo' / 'many'}/*")
    assert result.returncode == 1
    assert result.stderr.count("Permission denied") == 500
    [request] = pending(asking)
    assert request["count"] == 500 and request["directory"] == "/repo/many"
    assert request["paths"] == [f"/repo/many/f{n:03}" for n in range(5)]
    assert request["shown"] == 500  # all of them, listed by `approvals --list ID`
    counted = ("--shown", "500", "--mount", str(asking.mnt))
    assert sandboxfs("approve", str(request["id"]), *counted).returncode == 0
    assert sh(f"rm {asking.mnt / 'repo' / 'many'}/*").returncode == 0
    assert list(many.iterdir()) == []


def test_a_request_nobody_answers_times_out(tmp_path: Path, project: Path) -> None:
    # Long enough for the CLI that lists it to start on a loaded machine (about a second).
    configure(project, timeout=4)
    with mounted(tmp_path / "mnt", project, "full") as m:
        asked = time.monotonic()
        assert sh(f"rm {m.mnt / 'repo' / 'a' / 'one'}").returncode == 1
        assert len(pending(m)) == 1
        time.sleep(max(0.0, asked + 4.3 - time.monotonic()))
        assert pending(m) == []
        late = sandboxfs("approve", "1", "--mount", m.mnt)
        assert late.returncode == 1 and "no pending request 1" in late.stderr
        entry = m.wait_audit(lambda e: "timed out" in (e.get("reason") or ""))
        assert entry["op"] == "approval" and entry["allowed"] is False
        assert (project / "a" / "one").exists()


def test_approvals_none_refuses_at_once_and_no_approvals_lets_asks_pass(
    tmp_path: Path, project: Path
) -> None:
    configure(project)
    with mounted(tmp_path / "m1", project, "full", "--approvals", "none") as m:
        result = sh(f"rm {m.mnt / 'repo' / 'a' / 'one'}")
        assert result.returncode == 1 and "Permission denied" in result.stderr
        assert pending(m) == []
        refusal = m.wait_audit(lambda e: e["op"] == "delete" and e["allowed"] is False)
        assert "nobody can answer" in refusal["reason"] and "--approvals none" in refusal["reason"]
    with mounted(tmp_path / "m2", project, "full", "--no-approvals") as m:
        assert sh(f"rm {m.mnt / 'repo' / 'a' / 'one'}").returncode == 0
        blocked = sh(f"echo x > {m.mnt / 'repo' / 'b' / 'one'}")  # blocked stays blocked
        assert blocked.returncode != 0
        entry = m.wait_audit(lambda e: e["op"] == "approval" and e["path"] == "/repo/a/one")
        assert entry["approval"]["answer"] == "no-approvals" and entry["allowed"] is True
        assert m.wait_audit(lambda e: e["op"] == "approval" and e["path"] == "/")


def test_the_prompt_answers_with_one_key_each(asking: Mount) -> None:
    repo = asking.mnt / "repo"
    for directory in ("c", "d", "e", "f", "g"):
        (asking.project / directory).mkdir()
        (asking.project / directory / "x").write_text("x")
        (asking.project / directory / "y").write_text("y")
        assert sh(f"rm {repo / directory / 'x'}").returncode == 1
    term = UserTerminal()
    term.start("approvals", "--mount", asking.mnt)
    try:
        for n, (key, shown) in enumerate(
            [
                (b"y", b"allow delete of /repo/c/x, once"),
                (b"d", b"allow delete under /repo/d/, for this session"),
                (b"n", b"refuse delete of /repo/e/x, once"),
                (b"s", b"refuse delete under /repo/f/ without asking again"),
                (b"a", b"allow delete wherever an approval rule asks, for this session"),
            ],
            1,
        ):
            term.read_until(f"sandboxfs: approval {n} asked by rule repo-delete".encode())
            term.read_until(b"s: deny and stop asking")
            term.send(key)
            term.read_until(shown)
            term.send(b"\r")
            term.read_until(f"saved: grant {n}".encode())
        term.read_until(b"no request is pending")
        term.send(b"q")
        assert term.wait() == 0
    finally:
        term.close()  # killed and waited for if it is still running
    assert b"command line: rm " in term.output
    grants = json.loads(sandboxfs("grants", "--json", "--mount", asking.mnt).stdout)
    # the once grants were for paths not tried again; "a" covers every delete now
    assert [g["scope"] for g in grants] == ["once", "dir", "deny", "never", "everywhere"]
    assert all(g["answered_by"].startswith("terminal (pid ") for g in grants)
    assert sh(f"rm {repo / 'f' / 'y'}").returncode == 1  # never: refusal before allowance
    assert sh(f"rm {repo / 'g' / 'y'}").returncode == 0


def test_names_the_program_chose_are_shown_escaped(asking: Mount) -> None:
    name = "evil\x1b[2J\u202eexe"
    (asking.project / "a" / name).write_text("x")
    assert sh(f"rm '{asking.mnt / 'repo' / 'a' / name}'").returncode == 1
    term = UserTerminal()
    term.start("approvals", "--mount", asking.mnt)
    try:
        term.read_until(b"s: deny and stop asking")
        term.send(b"q")
        assert term.wait() == 0
    finally:
        term.close()  # killed and waited for if it is still running
    assert b"\x1b[2J" not in term.output and "\u202e".encode() not in term.output
    assert b"evil\\x1b[2J\\u202eexe" in term.output


ANSWER_OWN = r"""
import json, socket, sys
facts = json.load(open("/sandbox/.sandboxfs/context.json"))
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(sys.argv[1].format(pid=facts["pid"]))
    sock.sendall(b'{"v": 1, "op": "answer", "id": 1, "answer": "everywhere"}\n')
    print("connect:", sock.recv(4096).decode().strip())
except OSError as exc:
    print("connect:", exc.errno)
"""


@needs_bwrap
def test_the_program_cannot_answer_its_own_request(project: Path) -> None:
    configure(project)
    script = 'rm /sandbox/repo/a/one; "$0" -c "$1" "$2"; sleep 30'
    socket_path = f"{control.control_dir()}/{{pid}}.sock"
    proc = subprocess.Popen(
        [
            *SANDBOXFS,
            "run",
            "--project",
            str(project),
            "--trust",
            "full",
            "--approvals",
            "ask",
            "--quiet",
            "--",
            "sh",
            "-c",
            script,
            PY,
            ANSWER_OWN,
            socket_path,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert wait_until(lambda: bool(_run_pending(project)), timeout=30)
        [request] = _run_pending(project)
        assert request["path"] == "/repo/a/one"
        time.sleep(1)  # its try to answer is over
        [still] = _run_pending(project)
        assert still["id"] == request["id"]
    finally:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate(timeout=30)
    assert "connect: 2" in out, (out, err)  # ENOENT: no socket in its view
    assert "Permission denied" in err
    assert (project / "a" / "one").exists()


def _run_pending(project: Path) -> list[dict[str, Any]]:
    result = sandboxfs("approvals", "--json", "--project", project)
    if result.returncode != 0:
        return []
    requests: list[dict[str, Any]] = json.loads(result.stdout)["pending"]
    return requests


@needs_bwrap
def test_a_run_without_a_terminal_refuses_asks_at_once(project: Path) -> None:
    configure(project)
    result = subprocess.run(
        [
            *SANDBOXFS,
            "run",
            "--project",
            str(project),
            "--trust",
            "full",
            "--quiet",
            "--",
            "rm",
            "/sandbox/repo/a/one",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and "Permission denied" in result.stderr
    entries = sandboxfs("audit", "--project", project, "--json", "--op", "delete").stdout
    reasons = [json.loads(line)["reason"] for line in entries.splitlines()]
    assert any("--approvals none" in r for r in reasons), reasons


FULL_SCREEN = r"""
import os, signal, sys, time
redrawn = []
signal.signal(signal.SIGWINCH, lambda *_: redrawn.append(1))
sys.stdout.write("\x1b[?1049hFULL-SCREEN\r\n"); sys.stdout.flush()
while True:
    try:
        os.unlink("/sandbox/repo/a/one")
        break
    except PermissionError:
        time.sleep(0.2)
time.sleep(0.5)
sys.stdout.write("RETRY-OK redrawn=%d\x1b[?1049l\r\n" % len(redrawn)); sys.stdout.flush()
"""


@needs_bwrap
def test_the_prompt_in_runs_own_terminal_with_a_full_screen_program(project: Path) -> None:
    configure(project)
    term = UserTerminal()
    term.start(
        "run", "--project", project, "--trust", "full", "--quiet", "--", PY, "-c", FULL_SCREEN
    )
    try:
        term.read_until(b"FULL-SCREEN")
        term.read_until(b"delete of /repo/a/one")
        term.read_until(b"s  deny and stop asking")
        shown = len(term.output)
        time.sleep(prompt.QUIET + 0.2)
        term.send(b"d")  # the key goes to the prompt, not to the program
        term.read_until(b"allow delete under /repo/a/, for this session")
        time.sleep(prompt.CONFIRM_AFTER + 0.2)
        term.send(b"\r")
        term.read_until(b"RETRY-OK redrawn=1")
        # said once the program's full screen is down, not into it
        term.read_until(b"approval 1: saved grant 1")
        assert term.wait() == 0
        assert term.output.index(b"saved grant 1") > term.output.index(b"RETRY-OK")
    finally:
        term.close()  # killed and waited for if it is still running
    assert not (project / "a" / "one").exists()
    # the program drew nothing meanwhile (its source is in the prompt's command line, escaped)
    assert b"FULL-SCREEN\r\n" not in term.output[shown:]
    entries = sandboxfs("audit", "--project", project, "--json", "--op", "approval").stdout
    answers = [json.loads(line)["approval"] for line in entries.splitlines()]
    assert any(a.get("answer") == "dir" and a["by"].startswith("run (pid ") for a in answers)


def test_truncate_and_chmod_are_writes_too(tmp_path: Path, project: Path) -> None:
    configure(project)
    (project / "sandboxfs.yaml").write_text(
        "approvals:\n  rules:\n    - {id: repo-write, ops: [write], zones: [repo], decision: ask}\n"
    )
    with mounted(tmp_path / "mnt", project, "full") as m:
        one = m.mnt / "repo" / "a" / "one"
        for command in (f"truncate -s 0 {one}", f"chmod 600 {one}", f"echo more >> {one}"):
            result = sh(command)
            assert result.returncode != 0 and "Permission denied" in result.stderr, command
        assert (project / "a" / "one").read_text() == "a/one\n"
        [request] = pending(m)
        assert (request["op"], request["rule"]) == ("write", "repo-write")
        assert (
            sh(
                f"echo new > {m.mnt / 'repo' / 'a' / 'new'} && chmod 600 {m.mnt}/repo/a/new"
            ).returncode
            == 0
        )


def test_the_rate_limit_refuses_without_asking(tmp_path: Path, project: Path) -> None:
    configure(project)
    text = (project / "sandboxfs.yaml").read_text().replace("timeout: 60", "rate_limit: 2")
    (project / "sandboxfs.yaml").write_text(text)
    with mounted(tmp_path / "mnt", project, "full") as m:
        for name in ("p", "q", "r", "s"):
            (project / name).mkdir()
            (project / name / "x").write_text("x")
            assert sh(f"rm {m.mnt / 'repo' / name / 'x'}").returncode == 1
        assert [r["path"] for r in pending(m)] == ["/repo/p/x", "/repo/q/x"]
        entry = m.wait_audit(
            lambda e: (
                e["op"] == "approval" and e.get("approval", {}).get("answer") == "rate-limited"
            )
        )
        assert "requests came in a minute: refused without asking" in entry["reason"]


def test_follow_prints_each_new_request_once(asking: Mount) -> None:
    follow = subprocess.Popen(
        [*SANDBOXFS, "approvals", "--json", "--follow", "--mount", str(asking.mnt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        a = asking.mnt / "repo" / "a"
        assert sh(f"rm {a / 'one'} {a / 'two'}").returncode == 1  # one request
        assert sh(f"rm {a / 'one'}").returncode == 1  # a retry joins it
        assert sh(f"rm {asking.mnt / 'repo' / 'b' / 'one'}").returncode == 1
        assert follow.stdout is not None
        first = json.loads(follow.stdout.readline())
        second = json.loads(follow.stdout.readline())
    finally:
        follow.kill()
        follow.communicate()
    assert (first["id"], first["path"]) == (1, "/repo/a/one")
    assert (second["id"], second["path"]) == (2, "/repo/b/one")


def test_grants_never_widen_the_level_and_secrets_are_never_offered(asking: Mount) -> None:
    repo = asking.mnt / "repo"
    secret = sh(f"rm {repo / '.env'}")  # deny-listed: refused as such, never asked about
    assert secret.returncode == 1 and (asking.project / ".env").exists()
    assert not pending(asking)
    assert sh(f"rm {repo / 'a' / 'one'}").returncode == 1
    [request] = pending(asking)
    scope = ("--scope", "everywhere", "--mount", str(asking.mnt))
    assert sandboxfs("approve", str(request["id"]), *scope).returncode == 0
    demoted = sandboxfs("demote", asking.mnt, "--trust", "workspace")
    assert demoted.returncode == 0, demoted.stderr
    refused = sh(f"rm {repo / 'a' / 'two'}")
    assert refused.returncode == 1 and (asking.project / "a" / "two").exists()
    entry = asking.wait_audit(
        lambda e: e["op"] == "delete" and e["path"] == "/repo/a/two" and e["allowed"] is False
    )
    assert "not deletable at trust level workspace" in entry["reason"], entry


TUNNEL = r"""
import socket, sys
for target in sys.argv[1:]:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=120)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    print(target, s.recv(4096).split(b"\r\n")[0].decode(), flush=True)
"""


def asking_for_hosts(project: Path) -> list[str]:
    """`sandboxfs run --net allow` on `project` with a connect rule that asks (written to its
    sandboxfs.yaml), up to and with `--`: a host not on the list becomes a request."""
    (project / "sandboxfs.yaml").write_text(
        "approvals:\n  rules:\n    - {id: hosts, ops: [connect], decision: ask}\n"
    )
    return [
        *SANDBOXFS, "run", "--project", str(project), "--trust", "full", "--approvals", "ask",
        "--net", "allow", "--allow-host", "example.invalid", "--quiet", "--",
    ]  # fmt: skip


@needs_bwrap
def test_a_host_not_on_the_list_can_be_asked_about(project: Path) -> None:
    """`--net allow` with a connect rule that asks: the connection waits (in the proxy, which
    holds no kernel lock) for the user's answer; an allowed host is then admitted like a name
    rule (here localhost, whose loopback address the proxy still refuses: never a way to the
    host's own services), a denied one is refused as before."""
    proc = subprocess.Popen(
        [
            *asking_for_hosts(project),
            PY,
            "-c",
            TUNNEL,
            "localhost:80",
            "denied.example:443",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for target, verb in (("localhost:80", "approve"), ("denied.example:443", "deny")):
            assert wait_until(lambda: bool(_run_pending(project)), timeout=30)
            [request] = _run_pending(project)
            assert (request["op"], request["path"], request["rule"]) == ("connect", target, "hosts")
            assert request["grants"]["dir"].startswith(f"allow connections to {target}, ")
            extra = ("--scope", "dir") if verb == "approve" else ()
            answered = sandboxfs(verb, str(request["id"]), *extra, "--project", project)
            assert answered.returncode == 0, answered.stderr
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert "403" in lines["localhost:80"] and "loopback" in lines["localhost:80"], out
    assert "403 sandboxfs refused denied.example:443 (not in --allow-host)" in out
    entries = sandboxfs("audit", "--project", project, "--json", "--op", "approval").stdout
    answers = [json.loads(line)["approval"] for line in entries.splitlines()]
    assert [a.get("answer") for a in answers if a.get("answer")] == ["dir", "deny"]


HOLD_OPEN = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
print("opened", flush=True)
sys.stdin.readline()
try:
    os.write(fd, b"more\n")
    print("wrote", flush=True)
except OSError as exc:
    print("refused", exc.errno, flush=True)
"""


def test_revoking_a_grant_ends_the_handles_opened_under_it(tmp_path: Path, project: Path) -> None:
    configure(project)
    (project / "sandboxfs.yaml").write_text(
        "approvals:\n  rules:\n    - {id: repo-write, ops: [write], zones: [repo], decision: ask}\n"
    )
    with mounted(tmp_path / "mnt", project, "full") as m:
        one = m.mnt / "repo" / "a" / "one"
        assert sh(f"echo x >> {one}").returncode != 0
        [request] = pending(m)
        assert (
            sandboxfs("approve", str(request["id"]), "--scope", "dir", "--mount", m.mnt).returncode
            == 0
        )
        holder = subprocess.Popen(
            [PY, "-c", HOLD_OPEN, str(one)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdin is not None
            assert holder.stdout.readline() == "opened\n"
            revoked = sandboxfs("grants", "--revoke", "1", "--mount", m.mnt)
            assert revoked.returncode == 0, revoked.stderr
            out, _ = holder.communicate("go\n", timeout=30)
        finally:
            if holder.poll() is None:
                holder.kill()
        assert out == "refused 13\n", out
        assert (project / "a" / "one").read_text() == "a/one\n"
        entry = m.wait_audit(lambda e: "since revoked" in (e.get("reason") or ""))
        assert "opened under approval grant 1, since revoked" in entry["reason"]


@needs_bwrap
def test_ctrl_c_leaves_the_prompt_in_runs_terminal(project: Path) -> None:
    configure(project)
    term = UserTerminal()
    script = "rm /sandbox/repo/a/one; read line; echo after-$line"
    term.start("run", "--project", project, "--trust", "full", "--quiet", "--", "sh", "-c", script)
    try:
        term.read_until(b"Ctrl-C leaves it")
        term.send(b"\x03")
        term.read_until(b"left pending: sandboxfs approve 1 answers it")
        assert [r["id"] for r in _run_pending(project)] == [1]
        term.send(b"go\r")  # the relay is the program's again
        term.read_until(b"after-go")
        assert term.wait() == 0
    finally:
        term.close()  # killed and waited for if it is still running
    assert (project / "a" / "one").exists()


GIVE_UP = r"""
import socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=2)
s.sendall(b"CONNECT gone.example:443 HTTP/1.1\r\nHost: gone.example:443\r\n\r\n")
try:
    s.recv(4096)
except TimeoutError:
    print("gave up", flush=True)
s.close()
import time; time.sleep(3)
"""


@needs_bwrap
def test_a_client_that_goes_away_ends_its_wait(project: Path) -> None:
    result = subprocess.run(
        [
            *asking_for_hosts(project),
            PY,
            "-c",
            GIVE_UP,
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout == "gave up\n", (result.stdout, result.stderr)
    entries = sandboxfs("audit", "--project", project, "--json", "--op", "net").stdout
    refused = [json.loads(line) for line in entries.splitlines()]
    assert [(e["host"], e["allowed"]) for e in refused] == [("gone.example", False)]


CLEANER = """\
---
name: cleaner
sandbox:
  zones:
    - name: repo
      mode: rw
      approval: {delete: ask}
---
Removes what is not needed.
"""


@needs_bwrap
def test_a_child_workers_request_is_asked_in_the_parents_terminal(project: Path) -> None:
    """A worker started inside `run` asks through the parent's prompt, labelled with the
    worker and the run it was started in; the answer lets the child's retry pass."""
    configure(project)
    (project / ".workers").mkdir(exist_ok=True)
    (project / ".workers" / "cleaner.worker").write_text(CLEANER)
    child = "until rm /sandbox/repo/a/one 2>/dev/null; do sleep 0.2; done; echo CHILD-OK"
    term = UserTerminal()
    term.start(
        "run", "--project", project, "--trust", "full", "--quiet", "--",
        "sh", "-c", f"sandboxfs run --worker cleaner -- sh -c '{child}'",
    )  # fmt: skip
    try:
        term.read_until(b"from worker cleaner, started inside this run")
        term.read_until(b"delete of /repo/a/one")
        term.read_until(b"s  deny and stop asking")
        time.sleep(prompt.QUIET + 0.2)
        term.send(b"y")
        term.read_until(b"allow delete of /repo/a/one, once")
        time.sleep(prompt.CONFIRM_AFTER + 0.2)
        term.send(b"\r")
        term.read_until(b"saved grant")
        term.read_until(b"CHILD-OK")
        assert term.wait() == 0
    finally:
        term.close()  # killed and waited for if it is still running
    assert not (project / "a" / "one").exists()
    entries = sandboxfs("audit", "--project", project, "--json", "--op", "approval").stdout
    answers = [json.loads(line) for line in entries.splitlines()]
    assert any(
        e["approval"].get("answer") == "once" and e.get("worker") == "cleaner" for e in answers
    ), answers


def test_git_works_under_the_agent_profile_and_its_own_files_are_never_asked(
    tmp_path: Path, project: Path
) -> None:
    """git locks, renames and deletes its own files (index.lock -> index) in every command
    that writes: those are not the user's work, so no rule asks there, and no stale lock is
    left in the repository; deleting a tracked file still asks."""
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    configure(project)
    (project / "sandboxfs.yaml").write_text("approvals: {profile: agent}\n")
    with mounted(tmp_path / "mnt", project, "full") as m:
        repo = m.mnt / "repo"
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org"}
        env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
        for args in (["add", "a", "b"], ["commit", "-q", "-m", "one"], ["status", "--short"]):
            result = subprocess.run(
                ["git", "-C", str(repo), *args], env=env, capture_output=True, text=True
            )
            assert result.returncode == 0, (args, result.stderr)
        assert not (project / ".git" / "index.lock").exists()
        assert pending(m) == []
        refused = sh(f"rm {repo}/a/one")
        assert refused.returncode != 0 and "Permission denied" in refused.stderr
        assert [r["path"] for r in pending(m)] == ["/repo/a/one"]


def test_replies_of_any_size_arrive_whole(tmp_path: Path, project: Path) -> None:
    """30 pending deletes of long paths make an `approvals` reply far past what one `send`
    takes (about 210 KB): `approvals` and `grants` still read it whole."""
    (project / "sandboxfs.yaml").write_text(
        "approvals:\n  timeout: 120\n  rules:\n"
        "    - {id: repo-delete, ops: [delete], zones: [repo], decision: ask}\n"
    )
    long = "/".join(f"{i:02d}" + "d" * 198 for i in range(16))
    for n in range(30):
        (project / f"t{n:02d}" / long).mkdir(parents=True)
        (project / f"t{n:02d}" / long / "f").write_text("x\n")
    with mounted(tmp_path / "mnt", project, "full") as m:
        for n in range(30):
            rm = subprocess.run(
                ["rm", str(m.mnt / "repo" / f"t{n:02d}" / long / "f")],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert rm.returncode == 1 and "Permission denied" in rm.stderr, rm.stderr
        listed = sandboxfs("approvals", "--json", "--mount", m.mnt)
        assert listed.returncode == 0, listed.stderr
        assert len(listed.stdout) > 512 << 10
        assert len(json.loads(listed.stdout)["pending"]) == 30
        grants = sandboxfs("grants", "--json", "--mount", m.mnt)
        assert grants.returncode == 0 and json.loads(grants.stdout) == [], grants.stderr
        assert all((project / f"t{n:02d}" / long / "f").exists() for n in range(30))


# ----- a grant is exactly what was shown ----------------------------------------------------------


def answer_as_shown(m: Mount, request: dict[str, Any], answer: str) -> dict[str, Any]:
    """What the prompts send: the answer and the version of the request they showed."""
    shown = request.get("shown")
    message = {"op": "answer", "id": request["id"], "answer": answer, "shown": shown}
    reply: dict[str, Any] = control.request(control.socket_path(m.daemon_pid()), message)
    return reply


@pytest.fixture
def agent(tmp_path: Path, project: Path) -> Any:
    configure(project)
    (project / "sandboxfs.yaml").write_text("approvals: {profile: agent}\n")
    (project / "src" / "main.py").write_text("main\n")
    (project / "notes.txt").write_text("notes\n")
    with mounted(tmp_path / "mnt", project, "full") as m:
        yield m


JOIN_LATER = r"""
import os, sys, time
first, flag, later = sys.argv[1:]
for path in (first, later):
    try:
        os.unlink(path)
        print("deleted", flush=True)
    except PermissionError:
        print("refused", flush=True)
    while path == first and not os.path.exists(flag):
        time.sleep(0.05)
"""


def test_a_path_that_joins_after_the_request_was_shown_is_not_covered(agent: Mount) -> None:
    """Case 5: the user saw one path; a second joins before the answer; `once` lets the first
    go and the second stays pending, refused; `approve ID` of a request of several paths asks
    for the count the user listed."""
    a = agent.mnt / "repo" / "a"
    flag = agent.mnt.parent / "go"
    program = subprocess.Popen(  # one process: its later deletes join its request
        [PY, "-c", JOIN_LATER, str(a / "one"), str(flag), str(a / "two")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert program.stdout is not None and program.stdout.readline() == "refused\n"
        [shown] = pending(agent)
        assert shown["count"] == 1
        flag.touch()
        assert program.stdout.readline() == "refused\n"  # joined request 1 after it was shown
    finally:
        flag.touch()
        program.communicate(timeout=30)
    [joined] = pending(agent)
    assert joined["id"] == shown["id"] and joined["count"] == 2
    reply = answer_as_shown(agent, shown, "once")
    assert reply["ok"], reply
    assert sh(f"rm {a / 'one'}").returncode == 0
    refused = sh(f"rm {a / 'two'}")
    assert refused.returncode == 1 and (agent.project / "a" / "two").exists()
    [rest] = pending(agent)
    assert rest["paths"] == ["/repo/a/two"] and rest["id"] != shown["id"]
    b = agent.mnt / "repo" / "b"
    assert sh(f"rm {b / 'one'} {b / 'two'}").returncode == 1  # one request of two paths
    [two] = [r for r in pending(agent) if r["directory"] == "/repo/b"]
    bare = sandboxfs("approve", str(two["id"]), "--mount", agent.mnt)
    assert bare.returncode == 2 and "holds 2 paths" in bare.stderr, bare.stderr
    listed = sandboxfs("approvals", "--list", str(two["id"]), "--mount", agent.mnt)
    assert "  /repo/b/one\n  /repo/b/two\n" in listed.stdout, listed.stdout
    assert f"sandboxfs approve {two['id']} --shown 2" in listed.stdout
    counted = ("--shown", "2", "--mount", str(agent.mnt))
    assert sandboxfs("approve", str(two["id"]), *counted).returncode == 0
    assert sh(f"rm {b / 'one'} {b / 'two'}").returncode == 0
    entry = next(
        e
        for e in approvals_entries(agent)
        if e["approval"].get("request") == shown["id"] and e["approval"].get("answer") == "once"
    )
    assert entry["approval"]["count"] == 1 and entry["approval"]["remainder"] == rest["id"]


def test_a_rename_grant_does_not_allow_another_destination(agent: Mount) -> None:
    """Case 6: allowing notes.txt -> notes.old does not let notes.txt go over src/main.py."""
    repo = agent.mnt / "repo"
    assert sh(f"mv {repo / 'notes.txt'} {repo / 'notes.old'}").returncode == 1
    [request] = pending(agent)
    assert (request["path"], request["dest"]) == ("/repo/notes.txt", "/repo/notes.old")
    assert answer_as_shown(agent, request, "once")["ok"]
    over = sh(f"mv {repo / 'notes.txt'} {repo / 'src' / 'main.py'}")
    assert over.returncode == 1 and "Permission denied" in over.stderr
    assert (agent.project / "src" / "main.py").read_text() == "main\n"
    assert sh(f"mv {repo / 'notes.txt'} {repo / 'notes.old'}").returncode == 0
    assert (agent.project / "notes.old").read_text() == "notes\n"


def test_a_directory_grant_does_not_cover_what_is_moved_into_it(
    tmp_path: Path, project: Path
) -> None:
    """Case 7: deletes under build/ are allowed for the session; src/ is then moved into
    build/ (no rule asks about renames here) and deleting it there asks again."""
    configure(project)  # deletes ask, renames do not
    (project / "build").mkdir()
    (project / "build" / "old.o").write_text("o\n")
    (project / "src" / "main.py").write_text("main\n")
    with mounted(tmp_path / "mnt", project, "full") as m:
        repo = m.mnt / "repo"
        assert sh(f"rm {repo / 'build' / 'old.o'}").returncode == 1
        [request] = pending(m)
        assert answer_as_shown(m, request, "dir")["ok"]
        assert sh(f"mv {repo / 'src'} {repo / 'build' / 'src'}").returncode == 0
        refused = sh(f"rm -r {repo / 'build' / 'src'}")
        assert refused.returncode == 1 and "Permission denied" in refused.stderr
        assert (project / "build" / "src" / "main.py").read_text() == "main\n"
        listed = sandboxfs("grants", "--mount", m.mnt).stdout
        assert "not the 1 entries moved in since" in listed, listed
        made = sh(f"echo x > {repo / 'build' / 'new.o'} && rm {repo / 'build' / 'new.o'}")
        assert made.returncode == 0, made.stderr  # what is made there is still covered


def test_a_link_refused_by_approvals_is_audited_source_first(tmp_path: Path, project: Path) -> None:
    """A link asks as a create of its new name, with its source as the other end; its refusal
    is audited as every other link entry is: the source as path, the new name as dest."""
    (project / "sandboxfs.yaml").write_text(
        "approvals:\n  rules:\n"
        "    - {id: repo-create, ops: [create], zones: [repo], decision: ask}\n"
    )
    (project / "notes.txt").write_text("notes\n")
    with mounted(tmp_path / "mnt", project, "full") as m:
        repo = m.mnt / "repo"
        refused = sh(f"ln {repo / 'notes.txt'} {repo / 'second'}")
        assert refused.returncode == 1 and "Permission denied" in refused.stderr
        [entry] = [e for e in m.audit("--op", "link") if e.get("allowed") is False]
        assert (entry["path"], entry["dest"]) == ("/repo/notes.txt", "/repo/second"), entry


@needs_bwrap
@pytest.mark.parametrize("approvals", ["none", "ask"])
def test_a_run_without_a_terminal_says_why_an_approval_rule_refused(
    project: Path, approvals: str
) -> None:
    """Redirected (no prompt here), the program sees only "Permission denied": run's stderr
    says, in one line, which rule refused and why, or which request waits and how to answer."""
    configure(project)
    extra = ["--approvals", "ask"] if approvals == "ask" else []  # none: the default here
    argv = [*SANDBOXFS, "run", "--project", str(project), "--trust", "full", "--quiet", *extra]
    argv += ["--", "rm", "/sandbox/repo/a/one"]
    result = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "Permission denied" in result.stderr, result
    told = [line for line in result.stderr.splitlines() if line.startswith("sandboxfs: ")]
    assert len(told) == 1, result.stderr
    if approvals == "none":
        assert told[0].startswith("sandboxfs: refused rm["), told
        assert told[0].endswith(
            "]: delete of /repo/a/one needs the user's approval (rule repo-delete), and nobody"
            " can answer: approvals are off for this run (--approvals none, the default without"
            " a terminal; with --approvals ask, 'sandboxfs approve' answers from another one)"
        ), told
    else:
        assert told[0].startswith("sandboxfs: approval 1 needed: delete of /repo/a/one by rm["), (
            told
        )
        assert "'sandboxfs approve 1' or 'sandboxfs deny 1'" in told[0], told
    assert (project / "a" / "one").exists()
