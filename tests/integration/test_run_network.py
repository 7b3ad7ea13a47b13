"""`sandboxfs run`: refusals on the network explain themselves, and a lost mount is reported.

With the real command: a host refused by `--net allow` is named once on run's stderr with why
and the one flag that would allow it, in the proxy's answer (what clients show) and in the exit
summary; a host admitted but not reached is audited as a failure with its reason, not `ok`; a
name that resolves to a non-global address is allowed by one flag, `NAME=ADDRESS`; under
`--net none` the first lookup of a name says that the network is off; a daemon killed while the
program runs gives a summary that says so, and a non-zero exit. Only 127.0.0.1 (and the names
of this machine's own resolver for `localhost`) is ever connected to; names such as pypi.org are
looked up only inside the sandbox, where nothing resolves them.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sandboxfs.run import registries
from tests.support.cli import SANDBOXFS, wait_until
from tests.support.run import (
    NOBODY,
    PY,
    TIMEOUT,
    audit,
    http_server,
    lines,
    nobody_env,
    nobody_home,
    nothing_left_behind,
    on_pty,
    project,
    sbx,
)

__all__ = ["nobody_home", "nothing_left_behind", "project"]  # fixtures, used by name

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)
needs_curl = pytest.mark.skipif(
    not os.path.exists("/usr/bin/curl"), reason="curl is installed by .ci/setup"
)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def notices(stderr: str) -> list[str]:
    """run's own lines about the network, as printed."""
    return [line for line in stderr.splitlines() if line.startswith("sandboxfs: network: ")]


def summary(stderr: str) -> str:
    [line] = [line for line in stderr.splitlines() if " ended (exit " in line]
    return line


# ----- --net allow: refused, and not reached ------------------------------------------------------

# Each request twice: the line on stderr comes once per host. urllib as pip's stack uses it: the
# reason phrase of the proxy's answer is what it shows (`Tunnel connection failed: 403 ...`).
REFUSED_PROBE = r"""
code() {
  curl -sS -m 10 -o /dev/null -w '%{http_code}' --noproxy '' "$@" 2>/dev/null || echo "fail-$?"
}
for i in 1 2; do echo "plain-$i: $(code http://pypi.org/simple/)"; done
echo "other-port: $(code http://127.0.0.1:$1/)"
echo "not-reached: $(code http://127.0.0.1:$2/)"
python3 - <<'EOF'
import urllib.request, urllib.error
for url in ("https://files.pythonhosted.org/x", "http://pypi.org/simple/"):
    try:
        urllib.request.urlopen(url, timeout=10)
    except urllib.error.HTTPError as exc:
        print(f"urllib-http: {exc.code} {exc.reason}")
    except urllib.error.URLError as exc:
        print(f"urllib-https: {exc.reason}")
EOF
"""


@needs_curl
def test_a_refused_host_is_named_once_with_the_flag(project: Path) -> None:
    with http_server("server A\n") as allowed:
        other, closed = closed_port(), closed_port()
        result = sbx(
            "run",
            "--project",
            project,
            "--net",
            "allow",
            "--allow-host",
            f"127.0.0.1:{allowed}",
            "--allow-host",
            f"127.0.0.1:{closed}",
            "--",
            "sh",
            "-c",
            REFUSED_PROBE,
            "probe",
            str(other),
            str(closed),
        )
    assert result.returncode == 0, result.stderr
    found = lines(result)
    assert (found["plain-1"], found["plain-2"], found["other-port"]) == ("403", "403", "403")
    assert found["not-reached"] == "502"
    pypi = "sandboxfs: network: refused pypi.org:80 (not in --allow-host); to allow it: "
    assert notices(result.stderr) == [
        f"{pypi}--allow pypi",
        f"sandboxfs: network: refused 127.0.0.1:{other} (not in --allow-host); to allow it: "
        f"--allow-host 127.0.0.1:{other}",
        f"sandboxfs: network: could not reach 127.0.0.1:{closed}: Connection refused",
        "sandboxfs: network: refused files.pythonhosted.org:443 (not in --allow-host); to allow "
        "it: --allow pypi",
    ], result.stderr
    # What the program's HTTP client shows says the same (pip: "Tunnel connection failed: ...").
    assert found["urllib-https"] == (
        "Tunnel connection failed: 403 sandboxfs refused files.pythonhosted.org:443 (not in "
        "--allow-host); to allow it: --allow pypi"
    )
    assert found["urllib-http"] == (
        "403 sandboxfs refused pypi.org:80 (not in --allow-host); to allow it: --allow pypi"
    )
    assert (
        f"network: refused pypi.org:80, 127.0.0.1:{other}, files.pythonhosted.org:443; "
        f"not reached 127.0.0.1:{closed};" in summary(result.stderr)
    )
    # and one line that admits them all, with what was allowed already
    assert result.stderr.splitlines()[-1] == (
        "sandboxfs: to allow every host refused as well, run again with: --net allow "
        f"--allow-host 127.0.0.1:{allowed} --allow-host 127.0.0.1:{closed} --allow pypi "
        f"--allow-host 127.0.0.1:{other}"
    )
    net = audit(project, "--op", "net")
    refused = [e for e in net if e["host"] == "pypi.org"]
    assert len(refused) == 3 and all(e["allowed"] is False for e in refused), net  # each audited
    assert "to allow it, start sandboxfs run with --allow pypi" in refused[0]["reason"]


@needs_curl
def test_an_admitted_host_not_reached_is_a_failure(project: Path) -> None:
    """A closed port listed exactly: admitted by the policy, refused by the upstream. Audited as
    failed with its error and reason: not `ok`, and not a refusal of sandboxfs's either."""
    closed = closed_port()
    probe = f"curl -sS -m 10 --noproxy '' --proxytunnel http://127.0.0.1:{closed}/; echo rc=$?"
    result = sbx(
        "run",
        "--project",
        project,
        "--net",
        "allow",
        "--allow-host",
        f"127.0.0.1:{closed}",
        "--",
        "sh",
        "-c",
        probe,
    )
    assert result.returncode == 0, result.stderr
    assert "rc=56" in result.stdout  # curl: the tunnel failed (502)
    assert notices(result.stderr) == [
        f"sandboxfs: network: could not reach 127.0.0.1:{closed}: Connection refused"
    ]
    [entry] = audit(project, "--op", "net")
    assert entry["allowed"] is None and entry["errno"] == "ECONNREFUSED", entry
    assert entry["reason"] == f"connect failed: 127.0.0.1:{closed}: Connection refused"
    assert entry["comm"] == "curl" and entry["port"] == closed
    assert audit(project, "--op", "net", "--denied") == []  # not a refusal
    assert audit(project, "--op", "net", "--allowed") == []  # and not a connection made
    table = subprocess.run(
        [*SANDBOXFS, "audit", "--project", str(project), "--op", "net"],
        capture_output=True,
        text=True,
        check=True,
    )
    [row] = table.stdout.splitlines()[1:]
    assert " failed " in row and "ECONNREFUSED: connect failed" in row, table.stdout
    assert f"not reached 127.0.0.1:{closed};" in summary(result.stderr)


@contextmanager
def server_at(address: str) -> Iterator[int]:
    """An HTTP server answering "pinned" on `address` (IPv4 or IPv6 loopback)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"pinned\n")

        def log_message(self, *args: Any) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in address else socket.AF_INET

    server = Server((address, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@needs_curl
def test_a_name_at_a_non_global_address_is_allowed_by_the_flag_it_names(project: Path) -> None:
    """`localhost` is an allowed name whose address is loopback: refused, with the one flag
    that allows it (the name, pinned to the address it resolves to); that flag then works."""
    first = str(socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)[0][4][0])
    with server_at(first) as port:
        probe = f"curl -sS -m 10 --noproxy '' http://localhost:{port}/"
        base: list[str | Path] = ["run", "--project", project, "--net", "allow"]
        refused = sbx(*base, "--allow-host", f"localhost:{port}", "--", "sh", "-c", probe)
        [line] = notices(refused.stderr)
        match = re.fullmatch(
            rf"sandboxfs: network: refused localhost:{port} \(localhost resolves to (.*), which "
            rf"(is|are) refused unless listed exactly\); to allow it: (--allow-host \S+)",
            line,
        )
        assert match, line
        assert match[3] == f"--allow-host localhost:{port}={first}"
        flag = match[3].split(" ")[1]
        allowed = sbx(*base, "--allow-host", flag, "--", "sh", "-c", probe)
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout == "pinned\n"
    assert notices(allowed.stderr) == []
    start = [e for e in audit(project, "--op", "run") if e["detail"].startswith("start")][-1]
    assert start["allow_hosts"] == [flag]


# ----- lookups: --net none, and programs that do not use the proxy --------------------------------

LOOKUP_PROBE = r"""
import socket, time
started = time.monotonic()
for name in ("pypi.org", "PyPI.org", "pypi.org", "sandboxfs", "files.pythonhosted.org"):
    try:
        socket.getaddrinfo(name, 443)
        print(f"{name}: resolved")
    except socket.gaierror as exc:
        print(f"{name}: {exc.strerror}")
print(f"seconds: {time.monotonic() - started:.1f}")
print("nameserver: " + " ".join(
    l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")))
"""


def test_net_none_says_the_network_is_off_at_the_first_lookup(project: Path) -> None:
    result = sbx("run", "--project", project, "--", PY, "-c", LOOKUP_PROBE)
    assert result.returncode == 0, result.stderr
    found = lines(result)
    assert found["pypi.org"] == "Temporary failure in name resolution"
    assert found["nameserver"] == "127.0.0.1"  # the stub: never the host's resolver
    assert float(found["seconds"]) < 10  # answered at once, not timed out
    off = "the network is off (--net none)"
    said = [line for line in result.stderr.splitlines() if off in line]
    assert said == [
        f"sandboxfs: {off}: pypi.org was not looked up; to let the program reach it: "
        "--net allow --allow-host pypi.org",
        f"sandboxfs: {off}: files.pythonhosted.org was not looked up; to let the program reach "
        "it: --net allow --allow-host files.pythonhosted.org",
    ], result.stderr  # once each; not the sandbox's own host name
    assert "network: refused pypi.org (lookup), files.pythonhosted.org (lookup);" in summary(
        result.stderr
    )
    denied = audit(project, "--op", "net", "--denied")
    assert [(e["host"], e["comm"], e["detail"]) for e in denied] == [
        ("pypi.org", "python3", "lookup pypi.org"),
        ("files.pythonhosted.org", "python3", "lookup files.pythonhosted.org"),
    ], denied
    assert denied[0]["reason"].startswith(off)


@needs_curl
def test_net_none_curl_and_quiet(project: Path) -> None:
    """What a user runs first, with --quiet: no summary, but the line that says why."""
    result = sbx("run", "-q", "--project", project, "--", "curl", "-sS", "https://pypi.org/")
    assert result.returncode == 6, result.stderr  # curl: could not resolve host
    assert result.stderr.splitlines()[0] == (
        "sandboxfs: the network is off (--net none): pypi.org was not looked up; to let the "
        "program reach it: --net allow --allow-host pypi.org"
    ), result.stderr
    assert " ended (exit " not in result.stderr


def test_net_allow_says_names_go_through_the_proxy(project: Path) -> None:
    """A program that resolves names itself instead of using the proxy is told so."""
    result = sbx(
        "run",
        "--project",
        project,
        "--net",
        "allow",
        "--allow-host",
        "pypi.org",
        "--",
        PY,
        "-c",
        LOOKUP_PROBE,
    )
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "looked up" in line]
    no_dns = (
        "was looked up inside the sandbox, which has no DNS (--net allow): programs reach hosts "
        "through the proxy, HTTPS_PROXY=http://127.0.0.1:3128, which resolves names itself"
    )
    assert said == [
        f"sandboxfs: pypi.org {no_dns}",
        f"sandboxfs: files.pythonhosted.org {no_dns}; files.pythonhosted.org is not allowed "
        "either: --allow-host files.pythonhosted.org",
    ], result.stderr


def test_a_lookup_on_a_raw_terminal_starts_its_own_line(project: Path) -> None:
    """With the keyboard relayed, the terminal is raw: run's line ends with CR LF."""
    lookup = 'import socket\ntry: socket.getaddrinfo("pypi.org", 443)\nexcept OSError: pass'
    probe = f"python3 -c '{lookup}'"
    with on_pty("run", "-q", "--project", project, "--", "sh", "-c", probe) as term:
        assert term.wait() == 0
    assert b"--net allow --allow-host pypi.org\r\n" in term.output, term.output


def test_ordinary_user_net_none_lookup(nobody_home: Path) -> None:
    """The stub's port 53 is bound in a namespace the ordinary user made: no privilege."""
    result = sbx(
        "run",
        "--project",
        nobody_home / "project",
        "--",
        PY,
        "-c",
        LOOKUP_PROBE,
        prefix=NOBODY,
        env=nobody_env(nobody_home),
    )
    assert result.returncode == 0, result.stderr
    assert "the network is off (--net none): pypi.org was not looked up" in result.stderr


# ----- a mount lost while the program runs --------------------------------------------------------

# Prints the daemon's pid (outside), waits to be told that it was killed, then uses the mount.
LOST_PROBE = r"""
python3 -c 'import json; print(json.load(open("/sandbox/.sandboxfs/context.json"))["pid"])'
read -r _
ls /sandbox/session/working >/dev/null 2>&1 || echo "ls: failed"
exit "$1"
"""


@pytest.mark.parametrize(("status", "expected"), [(0, 1), (3, 3)])
def test_a_daemon_killed_mid_run_is_reported(project: Path, status: int, expected: int) -> None:
    """kill -9 the daemon while the program waits: the program sees its mount gone (ENOTCONN),
    one line says what happened, the summary says the mount was lost and why, and run exits
    non-zero: CMD's status when it failed, else 1."""
    argv = ["run", "--project", str(project), "--", "sh", "-c", LOST_PROBE, "probe", str(status)]
    with subprocess.Popen(
        [*SANDBOXFS, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            daemon = int(proc.stdout.readline())
            os.kill(daemon, signal.SIGKILL)
            assert wait_until(lambda: not Path(f"/proc/{daemon}/cmdline").read_bytes())
            time.sleep(0.2)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == expected, err
    assert out == "ls: failed\n"
    assert (
        f"sandboxfs: mount lost: the daemon (pid {daemon}) was killed by signal 9 (SIGKILL) "
        in (err)
    )
    assert (
        f"ended (exit {status}; mount lost: the daemon was killed by signal 9 (SIGKILL); "
        f"run exits {expected}):" in summary(err)
    ), err
    end = [e for e in audit(project, "--op", "run") if e["detail"].startswith("exit")][-1]
    assert end["mount_lost"] == "was killed by signal 9 (SIGKILL)", end
    assert (end["status"], end["exit"]) == (status, expected)
    assert json.dumps(end)  # a plain entry


# ----- only the user widens the network ----------------------------------------------------------

REACH_PROBE = (
    "via_proxy=$(curl -sS -m 5 --noproxy '' http://127.0.0.1:$1/ 2>/dev/null || echo no); "
    "direct=$(curl -sS -m 5 --noproxy '*' http://127.0.0.1:$1/ 2>/dev/null || echo no); "
    'echo "proxy: $via_proxy"; echo "direct: $direct"'
)


@needs_curl
@pytest.mark.parametrize("mode", ["allow", "host"])
def test_a_project_file_never_widens_the_network(project: Path, tmp_path: Path, mode: str) -> None:
    """A repository's sandboxfs.yaml asking for the network and the host's 127.0.0.1 services:
    ignored with one line and an audit entry; the same in the user's own config is honoured."""
    with http_server("host service\n") as port:
        (project / "sandboxfs.yaml").write_text(
            f"run: {{network: {mode}, allow_hosts: ['127.0.0.1:{port}']}}\n"
        )
        env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
        result = sbx("run", "-q", "--project", project, "--", "sh", "-c", REACH_PROBE, "p",
                     str(port), env=env)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ["proxy: no", "direct: no"], result.stderr
        [line] = [ln for ln in result.stderr.splitlines() if "sandboxfs.yaml asks" in ln]
        assert line.startswith(f"sandboxfs: sandboxfs.yaml asks for run.network: {mode}; "), line
        assert f"run.allow_hosts: 127.0.0.1:{port}: ignored" in line, line
        [entry] = audit(project, "--op", "net", "--denied")
        assert entry["reason"] == line.removeprefix("sandboxfs: "), entry

        mine = tmp_path / "config" / "sandboxfs" / "config.yaml"
        mine.parent.mkdir(parents=True)
        mine.write_text(f"run: {{network: allow, allow_hosts: ['127.0.0.1:{port}']}}\n")
        (project / "sandboxfs.yaml").write_text("run: {network: host}\n")
        widened = sbx("run", "-q", "--project", project, "--", "sh", "-c", REACH_PROBE, "p",
                      str(port), env=env)  # fmt: skip
        assert widened.returncode == 0, widened.stderr
        assert widened.stdout.splitlines() == ["proxy: host service", "direct: no"], widened
        assert "sandboxfs.yaml asks for run.network: host: ignored" in widened.stderr

        (project / "sandboxfs.yaml").write_text("run: {network: none}\n")  # narrowing holds
        narrowed = sbx("run", "-q", "--project", project, "--", "sh", "-c", REACH_PROBE, "p",
                       str(port), env=env)  # fmt: skip
        assert narrowed.stdout.splitlines() == ["proxy: no", "direct: no"], narrowed
        assert "asks for" not in narrowed.stderr


def test_a_registry_is_allowed_by_its_name_as_this_machine_resolves_it(project: Path) -> None:
    """`--allow pypi`: its hosts, each pinned to the non-global addresses it resolves to here
    (a mirror), or by name where it resolves to global ones or not at all."""
    expected = registries.hosts(["pypi"])
    assert {h.partition("=")[0] for h in expected} == {"pypi.org", "files.pythonhosted.org"}
    result = sbx("run", "--project", project, "--net", "allow", "--allow", "pypi", "--", "true")
    assert result.returncode == 0, result.stderr
    assert f"network: allow ({', '.join(expected)}; through sandboxfs's proxy)" in result.stderr
    wrong = sbx("run", "--project", project, "--net", "allow", "--allow", "pipy", "--", "true")
    assert wrong.returncode == 125 and "invalid choice: 'pipy'" in wrong.stderr, wrong.stderr
    off = sbx("run", "--project", project, "--allow", "npm", "--", "true")
    assert off.returncode == 125 and "--allow needs --net allow" in off.stderr, off.stderr
