"""`sandboxfs run`: real confined programs, as root and as an ordinary user.

Every run here is the real command (daemon, bubblewrap, the program); each asserts the outcome
and, for refusals inside the mount, the audit entry. Escapes are probed from inside by a small
shell or Python script that prints one line per attempt; the test decides. Only local servers on
127.0.0.1 are used, never an outside address. Every run is bounded by a timeout and nothing it
mounted may be left behind (checked after each test).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import SANDBOXFS, wait_until
from tests.support.run import (
    NOBODY,
    NOBODY_UID,
    PY,
    TIMEOUT,
    audit,
    fuse_mounts,
    http_server,
    lines,
    nobody_env,
    nobody_home,
    nothing_left_behind,
    on_pty,
    project,
    run_dirs,
    sbx,
)

__all__ = ["nobody_home", "nothing_left_behind", "project"]  # fixtures, used by name


pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap"), reason="bubblewrap is installed by .ci/setup"
)


# ----- the trust matrix, through run -------------------------------------------------------------

MATRIX_PROBE = r"""
level=$(sed -n 's/^  "trust": "\(.*\)",$/\1/p' /sandbox/.sandboxfs/context.json)
for zone in session/working workspace/data repo staged; do
  f=/sandbox/$zone/probe-$level.txt
  if (echo x > "$f") 2>/dev/null; then w=yes; else w=no; fi
  if ls /sandbox/$zone >/dev/null 2>&1; then l=yes; else l=no; fi
  echo "$zone: w=$w l=$l"
done
if cat /sandbox/repo/README.md >/dev/null 2>&1; then r=yes; else r=no; fi
echo "read-repo: $r"
"""

EXPECTED = {
    # zone: (write, list) per trust level, from the default matrix
    "untrusted": {
        "session/working": "w=yes l=yes",
        "workspace/data": "w=no l=no",
        "repo": "w=no l=no",
        "staged": "w=yes l=no",
        "read-repo": "no",
    },
    "session": {
        "session/working": "w=yes l=yes",
        "workspace/data": "w=yes l=yes",
        "repo": "w=no l=no",
        "staged": "w=yes l=yes",
        "read-repo": "no",
    },
    "workspace": {
        "session/working": "w=yes l=yes",
        "workspace/data": "w=yes l=yes",
        "repo": "w=no l=yes",
        "staged": "w=yes l=yes",
        "read-repo": "yes",
    },
    "full": {
        "session/working": "w=yes l=yes",
        "workspace/data": "w=yes l=yes",
        "repo": "w=yes l=yes",
        "staged": "w=yes l=yes",
        "read-repo": "yes",
    },
}


@pytest.mark.parametrize("trust", list(EXPECTED))
def test_trust_matrix_through_run(project: Path, trust: str) -> None:
    result = sbx("run", "--project", project, "--trust", trust, "--", "sh", "-c", MATRIX_PROBE)
    assert result.returncode == 0, result.stderr
    assert lines(result) == EXPECTED[trust], result.stdout
    assert "ended (exit 0)" in result.stderr
    denied = audit(project, "--denied")
    writes = [e for e in denied if e["op"] == "write" and e["zone"] == "repo"]
    reads = [e for e in denied if e["op"] == "read" and e["path"] == "/repo/README.md"]
    if trust == "full":
        assert not denied, denied
        return
    assert writes and writes[-1]["trust"] == trust and writes[-1]["comm"] == "sh", denied
    assert writes[-1]["errno"] in ("EACCES", "EROFS")
    if trust == "workspace":
        assert not reads, reads
    else:
        assert reads and reads[-1]["comm"] == "cat", denied


# ----- escapes -----------------------------------------------------------------------------------

ESCAPE_PROBE = r"""
import ctypes, errno, fcntl, json, os, socket, subprocess, sys, termios, time
from contextlib import suppress
facts = json.loads(sys.argv[1])
with suppress(OSError), open("/sandbox/.sandboxfs/context.json") as f:
    facts["daemon_pid"] = json.load(f)["pid"]  # the daemon's pid outside
libc = ctypes.CDLL(None, use_errno=True)

def attempt(name, fn):
    try:
        out = fn()
        print(f"{name}: ESCAPED {str(out)[:80]!r}")
    except OSError as exc:
        print(f"{name}: blocked {errno.errorcode.get(exc.errno, exc.errno)}")
    except Exception as exc:
        print(f"{name}: blocked {type(exc).__name__}")

def read(path):
    with open(path, "rb") as f:
        return f.read(200)

def run_ok(*argv):
    done = subprocess.run(argv, capture_output=True)
    if done.returncode != 0:
        raise OSError(errno.EPERM, done.stderr.decode()[-200:])
    return done.stdout

def syscall_ok(name, *args):
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return "succeeded"

def connect_tcp(port):
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        return s.recv(100)

def connect_abstract(name):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect("\0" + name)
        return "connected"

def no_secret_env():
    found = {k: v for k, v in os.environ.items() if k in ("SECRET_TOKEN", "SSH_AUTH_SOCK")}
    if found:
        return found
    raise OSError(errno.ENOENT, "absent")

def proc_environ():
    data = read("/proc/1/environ")
    if b"SECRET_TOKEN" in data or b"sekrit" in data:
        return data
    raise OSError(errno.ENOENT, "no secret in /proc/1/environ")

def inherited_fds():
    extra = {}
    for name in os.listdir("/proc/self/fd"):
        with suppress(OSError):  # the listing's own descriptor is closed by now
            if int(name) > 2:
                extra[name] = os.readlink(f"/proc/self/fd/{name}")
    if extra:
        return extra
    raise OSError(errno.EBADF, "only 0 1 2")

def host_pids_visible():
    pids = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    seen = pids & set(facts["host_pids"])
    if seen or os.path.exists(f"/proc/{facts['daemon_pid']}/fd"):
        return seen
    raise OSError(errno.ESRCH, "not visible")

def kill_outside():
    os.kill(facts["outside_pid"], 0)
    return "signalled"

def ptrace_outside():
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(16, facts["outside_pid"], None, None) != 0:  # PTRACE_ATTACH
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return "attached"

def tiocsti():
    fcntl.ioctl(0, termios.TIOCSTI, b"x")  # on a pty: the program's own terminal
    return "injected"

def nnp():
    status = read("/proc/self/status").decode() + open("/proc/self/status").read()
    if "NoNewPrivs:\t1" not in status or "CapEff:\t0000000000000000" not in status:
        return status
    raise OSError(errno.EPERM, "no_new_privs, no capabilities")

def host_knobs_writable():
    # Every file of /proc that is not a process's own: may it be opened for writing? (Opening
    # changes nothing; a write to /proc/sys or /proc/sysrq-trigger would change the host.)
    opened = []
    for top, dirs, files in os.walk("/proc"):
        if top == "/proc":
            dirs[:] = [d for d in dirs if not d.isdigit() and d not in ("self", "thread-self")]
        for name in files:
            path = os.path.join(top, name)
            with suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
                opened.append(path)
    if opened:
        return opened
    raise OSError(errno.EROFS, "nothing")

def private_etc_readable():
    # A file of /etc that the host lets only its owner (or group) read, read inside.
    found = []
    for top, dirs, files in os.walk("/etc"):
        for name in files:
            path = os.path.join(top, name)
            with suppress(OSError):
                if not os.stat(path).st_mode & 0o004:
                    read(path)
                    found.append(path)
    if found:
        return found
    raise OSError(errno.ENOENT, "none")

def root_only_proc():
    read("/proc/keys")
    return "read"

def setuid_euid():
    # su is setuid root: while it waits for a password, is it running as root?
    su = subprocess.Popen(["/usr/bin/su", "root", "-c", "true"], stdin=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        with open(f"/proc/{su.pid}/status") as f:
            euid = int([ln for ln in f if ln.startswith("Uid:")][0].split()[2])
    finally:
        su.kill()
        su.wait()
    if euid != os.geteuid():
        return f"su ran with euid {euid}"
    raise OSError(errno.EPERM, "no elevation")

attempt("real-project", lambda: read(facts["project"] + "/README.md"))
attempt("state-dir", lambda: os.listdir(facts["project"] + "/.sandbox"))
attempt("audit-via-repo", lambda: read("/sandbox/repo/.sandbox/audit.jsonl"))
attempt("audit-relative", lambda: read("../../.sandbox/audit.jsonl"))
attempt("host-home-ssh", lambda: os.listdir(facts["home"] + "/.ssh"))
attempt("root-home", lambda: os.listdir("/root"))
attempt("homes", lambda: os.listdir("/home"))
attempt("shadow", lambda: read("/etc/shadow"))
attempt("ssh-host-keys", lambda: [n for n in os.listdir("/etc/ssh") if n.endswith("_key")]
        or read("/etc/ssh/ssh_host_ed25519_key"))
attempt("proc-1-environ", proc_environ)
attempt("host-pids", host_pids_visible)
attempt("daemon-fd", lambda: os.listdir(f"/proc/{facts['daemon_pid']}/fd"))
attempt("host-tmp", lambda: read(facts["tmp_marker"]))
attempt("host-run", lambda: os.listdir("/run"))
attempt("inherited-fd", inherited_fds)
attempt("repo-symlink", lambda: read("/sandbox/repo/innocent.txt"))
attempt("secret-env", no_secret_env)
attempt("unshare-user", lambda: run_ok("unshare", "-U", "true"))
attempt("unshare-syscall", lambda: syscall_ok("unshare", 0x10000000))
attempt("remount-rw", lambda: run_ok("mount", "-o", "remount,rw", "/usr"))
attempt("mount-tmpfs", lambda: run_ok("mount", "-t", "tmpfs", "none", "/tmp"))
attempt("write-usr", lambda: open("/usr/bin/sandboxfs-probe", "wb"))
attempt("write-etc", lambda: open("/etc/sandboxfs-probe", "wb"))
attempt("write-etc-copy", lambda: open("/etc/passwd", "ab"))  # a copy (confine.EtcCopies)
attempt("tcp-host-loopback", lambda: connect_tcp(facts["tcp_port"]))
attempt("abstract-socket", lambda: connect_abstract(facts["abstract"]))
attempt("kill-outside", kill_outside)
attempt("ptrace-outside", ptrace_outside)
attempt("tiocsti", tiocsti)
attempt("setuid-elevation", nnp)
attempt("su", lambda: run_ok("su", "-c", "id", "root"))
attempt("setuid-su", setuid_euid)
attempt("host-kernel-knobs", host_knobs_writable)
attempt("core-pattern", lambda: open("/proc/sys/kernel/core_pattern", "w"))
attempt("sysrq-trigger", lambda: open("/proc/sysrq-trigger", "w"))
attempt("private-etc", private_etc_readable)
attempt("proc-keys", root_only_proc)
"""


@contextmanager
def host_services(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A TCP server on the host's loopback, an abstract Unix socket, a marker in /tmp, a
    sleeping process: things outside that nothing inside may reach."""
    tcp = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"sandboxfs-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract.bind("\0" + name)
    abstract.listen()
    marker = Path("/tmp") / f"sandboxfs-marker-{os.getpid()}"
    marker.write_text("host tmp\n")
    outside = subprocess.Popen(["sleep", "300"])

    def serve() -> None:
        with suppress(OSError):
            while True:
                conn, _ = tcp.accept()
                with conn:
                    conn.sendall(b"hello from the host\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield {
            "tcp_port": tcp.getsockname()[1],
            "abstract": name,
            "tmp_marker": str(marker),
            "outside_pid": outside.pid,
            "host_pids": [os.getpid(), outside.pid],
        }
    finally:
        outside.kill()
        outside.wait()
        tcp.close()
        abstract.close()
        marker.unlink()


def escape_facts(project: Path, services: dict[str, Any], home: str) -> dict[str, Any]:
    return {**services, "project": str(project), "home": home}


def run_escape_probe(
    project: Path, services: dict[str, Any], home: str, **options: Any
) -> subprocess.CompletedProcess[str]:
    """ESCAPE_PROBE inside `run` at trust full, the widest view."""
    facts = json.dumps(escape_facts(project, services, home))
    return sbx(
        "run",
        "--project",
        project,
        "--trust",
        "full",
        "--",
        PY,
        "-c",
        ESCAPE_PROBE,
        facts,
        **options,
    )


def check_escapes(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    found = lines(result)
    assert len(found) >= 30, result.stdout + result.stderr
    escaped = {k: v for k, v in found.items() if not v.startswith("blocked")}
    assert not escaped, escaped
    return found


def test_escapes_fail(project: Path, tmp_path: Path) -> None:
    """Run at trust full (the widest view) with a secret in the environment, a descriptor of
    the caller's left open, a repo symlink at a host secret, and host services listening."""
    secret = tmp_path / "host-secret"
    secret.write_text("host secret\n")
    (project / "innocent.txt").symlink_to(secret)
    env = {**os.environ, "SECRET_TOKEN": "sekrit", "SSH_AUTH_SOCK": "/tmp/agent.sock"}
    leaked = os.open(secret, os.O_RDONLY)
    os.set_inheritable(leaked, True)
    # A root-only file of /etc whose name is on no list, as /etc/default/cacerts or
    # /etc/mysql/debian.cnf are: a root caller's program is the host's uid 0.
    private = Path(tempfile.mkdtemp(prefix="sandboxfs-probe-", dir="/etc"))
    private.chmod(0o755)
    (private / "credentials").write_text("root only\n")
    (private / "credentials").chmod(0o600)
    try:
        with host_services(tmp_path) as services:
            result = run_escape_probe(
                project, services, os.path.expanduser("~"), env=env, pass_fds=[leaked]
            )
    finally:
        os.close(leaked)
        shutil.rmtree(private)
    assert result.returncode == 0, result.stderr
    found = check_escapes(result)
    assert found["private-etc"] == "blocked ENOENT"
    assert found["real-project"] == "blocked ENOENT"
    assert found["shadow"] == "blocked ENOENT"
    assert found["tcp-host-loopback"] == "blocked ECONNREFUSED"
    assert found["abstract-socket"] == "blocked ECONNREFUSED"
    assert found["unshare-syscall"] == "blocked EPERM"
    assert found["write-usr"] == "blocked EROFS"
    assert found["write-etc-copy"] == "blocked EROFS"
    assert found["kill-outside"] == "blocked ESRCH"
    assert found["core-pattern"] == "blocked EROFS"


# ----- a terminal: job control, Ctrl-C, TIOCSTI -------------------------------------------------


def test_interactive_bash_with_job_control(project: Path) -> None:
    args: list[str | Path] = ["run", "--project", project, "--trust", "session"]
    args += ["--env", "PS1=sbx> "]
    with on_pty(*args, "--", "bash", "--norc") as t:
        t.read_until(b"sbx> ")
        t.send(b"sleep 30 &\n")
        t.read_until(b"[1] ")
        t.send(b"jobs; echo jobs-$((1+1))\n")
        t.read_until(b"jobs-2")
        assert b"Running" in t.output
        t.send(b"kill %1; sleep 0.2; jobs; echo killed-$((2+1))\n")
        t.read_until(b"killed-3")
        assert b"Terminated" in t.output, t.output
        assert b"no job control" not in t.output
        t.send(b"exit 4\n")
        assert t.wait() == 4
    assert b"ended (exit 4)" in t.output


def test_ctrl_c_reaches_the_program_not_the_sandbox(project: Path) -> None:
    script = "trap 'echo got-INT; exit 5' INT; echo ready-$((3*3)); while :; do sleep 0.1; done"
    with on_pty("run", "--project", project, "--", "sh", "-c", script) as t:
        t.read_until(b"ready-9")
        t.send(b"\x03")
        t.read_until(b"got-INT")
        assert t.wait() == 5


def test_tiocsti_cannot_reach_the_terminal(project: Path, tmp_path: Path) -> None:
    """The same probe on a terminal: TIOCSTI is refused (seccomp), and even the program's own
    terminal is a pty of run's, never the user's."""
    with host_services(tmp_path) as services:
        facts = escape_facts(project, services, os.path.expanduser("~"))
        args: list[str | Path] = ["run", "--project", project, "--trust", "full", "-q", "--"]
        with on_pty(*args, PY, "-c", ESCAPE_PROBE, json.dumps(facts)) as t:
            assert t.wait() == 0, t.output
    result = subprocess.CompletedProcess([], 0, t.output.decode(errors="replace"), "")
    found = check_escapes(result)
    assert found["tiocsti"] == "blocked EPERM"


# ----- exit status, signals, cleanup -------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "status"),
    [
        (["sh", "-c", "exit 7"], 7),
        (["sh", "-c", "kill -TERM $$"], 128 + signal.SIGTERM),
        (["no-such-command-here"], 127),
        (["/etc/passwd"], 126),
    ],
)
def test_exit_status(project: Path, command: list[str], status: int) -> None:
    result = sbx("run", "--project", project, "-q", "--", *command)
    assert result.returncode == status, result.stderr


def test_etc_files_inside_are_the_hosts(project: Path) -> None:
    """/etc's files are copied in at the start (confine.EtcCopies): the same bytes and modes
    as on the host, a root-only one absent, and none of the copies' descriptors left open."""
    files = [p for p in ("/etc/passwd", "/etc/group", "/etc/hosts") if os.path.isfile(p)]
    result = sbx(
        "run", "--project", project, "-q", "--", "sh", "-c",
        'for f in "$@"; do stat -c "%a %s" "$f"; cat "$f"; done; test ! -e /etc/shadow && '
        "echo no-shadow; ls /proc/self/fd",
        "sh", *files,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = "".join(
        f"{os.stat(p).st_mode & 0o777:o} {os.stat(p).st_size}\n{Path(p).read_text()}" for p in files
    )
    assert result.stdout == expected + "no-shadow\n0\n1\n2\n3\n"  # 3: ls's own listing


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by this Python in a process of its own (stdin empty, output captured)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_run_itself_loads_neither_pyfuse3_nor_trio(project: Path) -> None:
    """The daemon is forked first and loads them while `run` prepares the sandbox: `run`'s own
    process, whose imports are start-up time of every run, never does, nor the in-process API,
    nor what only other commands use (staged commits, shell completion)."""
    probe = (
        "import sys\n"
        "from sandboxfs.cli.main import main\n"
        f"code = main(['run', '--project', {str(project)!r}, '-q', '--', 'true'])\n"
        "heavy = ('pyfuse3', 'trio', 'sandboxfs.fuse.daemon', 'sandboxfs.fuse.operations',"
        " 'sandboxfs.api', 'sandboxfs.staging', 'shtab')\n"
        "print(code, sorted(m for m in sys.modules"
        " if m.startswith(heavy) or m == 'sandboxfs.cli.staged'))\n"
    )
    result = _python(probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0 []", result.stdout


@pytest.mark.parametrize(
    ("preparation", "daemon", "message"),
    [
        (True, False, "the preparation failed"),
        (False, True, "cannot mount: the daemon failed"),
        (True, True, "cannot mount: the daemon failed"),  # the daemon's: it came first
    ],
)
def test_a_failure_while_the_daemon_starts_stops_it(
    project: Path, preparation: bool, daemon: bool, message: str
) -> None:
    """run prepares the sandbox while the daemon it forked mounts: when either fails, the
    daemon is stopped and its mount gone before run returns 125 with one line."""
    probe = (
        "import os, sys\n"
        "from sandboxfs.errors import Failure, SetupError\n"
        "from sandboxfs.fuse import daemon\n"
        "from sandboxfs.run import confine\n"
        "from sandboxfs.cli.main import main\n"
        "def broken(**kwargs):\n"
        "    raise SetupError('the preparation failed')\n"
        "def unmountable(*args, **kwargs):\n"
        "    raise Failure('cannot mount: the daemon failed')\n"
        f"if {preparation}:\n"
        "    confine.bwrap_args = broken\n"
        f"if {daemon}:\n"
        "    daemon.serve = unmountable  # in the daemon: it is forked from this process\n"
        f"code = main(['run', '--project', {str(project)!r}, '-q', '--', 'true'])\n"
        "try:\n"
        "    os.waitpid(-1, os.WNOHANG)\n"
        "    children = True  # the daemon, running or not reaped\n"
        "except ChildProcessError:\n"
        "    children = False\n"
        "state = os.environ['SANDBOXFS_STATE_DIR']\n"
        "mounted = any(line.split()[1].startswith(state) and ' fuse.sandboxfs ' in line\n"
        "              for line in open('/proc/self/mounts'))\n"
        "print(code, children, mounted)\n"
    )
    result = _python(probe)
    assert result.stdout.strip() == "125 False False", (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines() == [f"sandboxfs: {message}"], result.stderr


def test_setup_errors_exit_125_with_one_line(project: Path) -> None:
    for args in (
        ["--cwd", "/no/such/dir"],
        ["--cwd", "relative"],
        ["--net", "allow"],
        ["--allow-host", "example.com"],
        ["--env", "1BAD"],
        ["--trust", "root"],
        [],
    ):
        cmd: list[str | Path] = ["run", "--project", project, *args]
        cmd += ["--", "true"] if args else []
        result = sbx(*cmd)
        assert result.returncode == 125, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr


@contextmanager
def running(*args: str | Path) -> Iterator[subprocess.Popen[str]]:
    """`sandboxfs run ARGS` in the background, once CMD has printed "ready"; killed (if still
    there) and its pipes closed on the way out."""
    with subprocess.Popen(
        [*SANDBOXFS, "run", *map(str, args)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def sleeping(marker: str) -> bool:
    """Is a `sleep MARKER` running anywhere on this machine?"""
    for entry in Path("/proc").iterdir():
        with suppress(OSError):
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == (
                b"sleep\0" + marker.encode() + b"\0"
            ):
                return True
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signals_reach_the_program_and_background_children_die(
    project: Path, signum: signal.Signals
) -> None:
    marker = f"{time.monotonic_ns() % 10**6}.5"
    name = signum.name.removeprefix("SIG")
    script = (
        f"sleep {marker} & trap 'echo got-{name}; exit 3' {name}; echo ready; "
        "while :; do sleep 0.1; done"
    )
    with running("--project", project, "--", "sh", "-c", script) as proc:
        assert wait_until(lambda: sleeping(marker)), "the background child should be running"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert f"got-{name}" in out
    assert not sleeping(marker), "a background child outlived the run"


def test_killed_run_leaves_nothing_behind(project: Path) -> None:
    """SIGKILL to run itself: the sandbox dies with it (parent-death signal), and the daemon
    (its lifeline closed) unmounts and removes the run's directory."""
    marker = f"{time.monotonic_ns() % 10**6}.25"
    with running("--project", project, "--", "sh", "-c", f"echo ready; sleep {marker}") as proc:
        mounts = [m for m in fuse_mounts() if "/run/" in m]
        assert mounts and run_dirs() and wait_until(lambda: sleeping(marker))
        proc.kill()
    assert wait_until(lambda: not sleeping(marker) and not set(mounts) & set(fuse_mounts()))
    assert wait_until(lambda: not run_dirs())


def test_a_dead_daemon_is_cleaned_by_the_next_command(project: Path) -> None:
    """run and its daemon both killed: the mount is dead (ENOTCONN) and its directory stays,
    until the next sandboxfs command removes them."""
    args: list[str | Path] = [
        "--project",
        project,
        "--new-session",
        "doomed",
        "--",
        "sh",
        "-c",
        "echo ready; sleep 30",
    ]
    with running(*args) as proc:
        status = subprocess.run([*SANDBOXFS, "status", "--json"], capture_output=True, text=True)
        row = next(r for r in json.loads(status.stdout) if r.get("session") == "doomed")
        os.kill(row["pid"], signal.SIGKILL)  # the daemon first: nothing will unmount
        proc.kill()
    assert row["mountpoint"] in fuse_mounts() and run_dirs()
    result = subprocess.run([*SANDBOXFS, "status"], capture_output=True, text=True, timeout=TIMEOUT)
    assert "dead" in result.stdout, result.stdout
    cleaned = sbx("umount", "/nonexistent-mountpoint")  # any of run, mount, umount sweeps
    assert cleaned.returncode == 2
    assert row["mountpoint"] not in fuse_mounts()
    assert not run_dirs()


def test_two_runs_at_once_and_session_resume(project: Path) -> None:
    who = "/sandbox/session/working/who"
    script = f"echo ready; echo {{0}} > {who}; sleep 1; cat {who}"
    with (
        running(
            "--project", project, "--new-session", "first", "--", "sh", "-c", script.format("first")
        ) as first,
        running(
            "--project",
            project,
            "--new-session",
            "second",
            "--",
            "sh",
            "-c",
            script.format("second"),
        ) as second,
    ):
        for name, proc in (("first", first), ("second", second)):
            out, err = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, err
            assert out.strip() == name
            assert f"session {name} ended (exit 0)" in err
    resumed = sbx(
        "run",
        "--project",
        project,
        "--session",
        "first",
        "--",
        "cat",
        "/sandbox/session/working/who",
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip() == "first"


def test_run_is_audited_and_shown_by_status(project: Path) -> None:
    command = ["sh", "-c", "echo ready; sleep 30"]
    with running("--project", project, "--new-session", "shown", "--", *command) as proc:
        status = subprocess.run(
            [*SANDBOXFS, "status", "--json"], capture_output=True, text=True, check=True
        )
        rows = [r for r in json.loads(status.stdout) if r.get("session") == "shown"]
        assert rows and rows[0]["command"] == command, status.stdout
        table = subprocess.run([*SANDBOXFS, "status"], capture_output=True, text=True, check=True)
        assert "COMMAND" in table.stdout and "sleep 30" in table.stdout
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    runs = [e for e in audit(project, "--op", "run") if e["session"] == "shown"]
    assert [e["detail"].split(":")[0] for e in runs] == ["start (net none)", "exit 130"]
    assert runs[0]["command"] == command
    assert runs[1]["status"] == 130


# ----- the network: --net allow ------------------------------------------------------------------


NET_PROBE = r"""
code() { curl -sS -m 10 -o /dev/null -w '%{http_code}' "$@" 2>/dev/null || echo "fail-$?"; }
echo "allowed: $(curl -sS -m 10 --noproxy '' http://127.0.0.1:$1/)"
echo "allowed-tunnel: $(curl -sS -m 10 --noproxy '' --proxytunnel http://127.0.0.1:$1/)"
echo "refused: $(code --noproxy '' http://127.0.0.1:$2/)"
echo "refused-body: $(curl -sS -m 10 --noproxy '' http://127.0.0.1:$2/)"
echo "direct: $(code --noproxy '*' http://127.0.0.1:$1/)"
echo "metadata: $(code --noproxy '' http://169.254.169.254/latest/meta-data/)"
"""


def run_net_probe(
    project: Path, **options: Any
) -> tuple[subprocess.CompletedProcess[str], int, int]:
    """NET_PROBE with two local servers, only the first of which is allowed."""
    with http_server("server A\n") as allowed, http_server("server B\n") as other:
        result = sbx(
            "run",
            "--project",
            project,
            "--net",
            "allow",
            "--allow-host",
            f"127.0.0.1:{allowed}",
            "--",
            "sh",
            "-c",
            NET_PROBE,
            "probe",
            str(allowed),
            str(other),
            **options,
        )
    return result, allowed, other


@pytest.mark.skipif(not os.path.exists("/usr/bin/curl"), reason="curl is installed by .ci/setup")
def test_net_allow_admits_only_listed_hosts(project: Path) -> None:
    result, allowed, other = run_net_probe(project)
    assert result.returncode == 0, result.stderr
    found = lines(result)
    assert found["allowed"] == "server A"
    assert found["allowed-tunnel"] == "server A"
    assert found["refused"] == "403"
    assert "not in the allowlist" in found["refused-body"]
    assert found["direct"].endswith("fail-7"), found  # curl: could not connect
    assert found["metadata"] == "403"
    net = audit(project, "--op", "net")
    admitted = [e for e in net if e["allowed"] and e["port"] == allowed]
    assert admitted and admitted[0]["comm"] == "curl" and admitted[0]["pid"] > 0, net
    refused = [e for e in net if e["allowed"] is False and e["port"] == other]
    assert refused and "allowlist" in refused[0]["reason"], net
    start = [e for e in audit(project, "--op", "run") if e["detail"].startswith("start")][-1]
    assert start["net"] == "allow" and start["allow_hosts"] == [f"127.0.0.1:{allowed}"]


def test_net_none_is_loopback_only(project: Path) -> None:
    result = sbx("run", "--project", project, "--", "sh", "-c", "cat /proc/net/dev")
    assert result.returncode == 0, result.stderr
    interfaces = [ln.split(":")[0].strip() for ln in result.stdout.splitlines() if ":" in ln]
    assert interfaces == ["lo"], result.stdout


# ----- as an ordinary user -----------------------------------------------------------------------


def test_ordinary_user_matrix_and_escapes(nobody_home: Path) -> None:
    project = nobody_home / "project"
    env = nobody_env(nobody_home)
    result = sbx(
        "run",
        "--project",
        project,
        "--trust",
        "untrusted",
        "--",
        "sh",
        "-c",
        MATRIX_PROBE,
        prefix=NOBODY,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert lines(result) == EXPECTED["untrusted"], result.stdout
    with host_services(nobody_home) as services:
        facts = escape_facts(project, services, env["HOME"])
        result = run_escape_probe(project, services, env["HOME"], prefix=NOBODY, env=env)
    assert result.returncode == 0, result.stderr
    found = check_escapes(result)
    assert found["host-home-ssh"] == "blocked ENOENT"
    assert found["setuid-su"] == "blocked EPERM"
    # The control: outside the sandbox the same su does run as root for nobody.
    probe = ESCAPE_PROBE.split('attempt("real-project"')[0] + "print(setuid_euid())"
    control = subprocess.run(
        [*NOBODY, PY, "-c", probe, json.dumps(facts)], capture_output=True, text=True
    )
    assert "su ran with euid 0" in control.stdout, control
    denied = [
        json.loads(line)
        for line in (project / ".sandbox" / "audit.jsonl").read_text().splitlines()
        if '"allowed":false' in line.replace(" ", "")
    ]
    assert any(e["uid"] == NOBODY_UID and e["zone"] == "repo" for e in denied), denied


def test_ordinary_user_interactive_shell(nobody_home: Path) -> None:
    project = nobody_home / "project"
    env_args = [f"{k}={v}" for k, v in nobody_env(nobody_home).items()]
    prefix = [*NOBODY, "env", "-i", *env_args]
    with on_pty("run", "--project", project, "--env", "PS1=sbx> ", "--", "sh", prefix=prefix) as t:
        t.read_until(b"sbx> ")
        t.send(b"id -u; ls /sandbox; echo done-$((6*7))\n")
        t.read_until(b"done-42")
        assert b"65534" in t.output and b"workspace" in t.output
        t.send(b"exit\n")
        assert t.wait() == 0


# ----- doctor ------------------------------------------------------------------------------------


def test_doctor_reports_a_ready_machine() -> None:
    result = subprocess.run([*SANDBOXFS, "doctor"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert "bubblewrap-trial" in result.stdout
    report = subprocess.run([*SANDBOXFS, "doctor", "--json"], capture_output=True, text=True)
    checks = json.loads(report.stdout)
    assert all(c["ok"] or c["optional"] for c in checks), checks


def test_net_host_is_warned_and_audited(project: Path) -> None:
    with host_services(project.parent) as services:
        probe = f"exec 3<>/dev/tcp/127.0.0.1/{services['tcp_port']} && head -c 5 <&3"
        result = sbx("run", "--project", project, "--net", "host", "--", "bash", "-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello"  # the host's loopback: that is what host means
    assert "warning: --net host" in result.stderr
    start = [e for e in audit(project, "--op", "run") if e["detail"].startswith("start")][-1]
    assert start["net"] == "host" and start["detail"].startswith("start (net host)")


@pytest.mark.skipif(not os.path.exists("/usr/bin/curl"), reason="curl is installed by .ci/setup")
def test_ordinary_user_net_allow(nobody_home: Path) -> None:
    """The proxy's network namespace is made by the ordinary user too (no privilege needed)."""
    project = nobody_home / "project"
    result, _, _ = run_net_probe(project, prefix=NOBODY, env=nobody_env(nobody_home))
    assert result.returncode == 0, result.stderr
    found = lines(result)
    assert (found["allowed"], found["refused"]) == ("server A", "403"), found
    assert found["direct"].endswith("fail-7"), found


def test_without_bubblewrap_nothing_runs(project: Path, tmp_path: Path) -> None:
    """No bwrap on PATH: one line naming the fix, exit 125, and CMD never ran (no fallback)."""
    marker = tmp_path / "ran"
    env = {**os.environ, "PATH": str(tmp_path)}
    result = sbx("run", "--project", project, "--", "/usr/bin/touch", marker, env=env)
    assert result.returncode == 125
    assert result.stderr.strip().splitlines() == [
        "sandboxfs: bubblewrap (bwrap) is not installed; install it: apt-get install bubblewrap"
    ], result.stderr
    assert not marker.exists()
