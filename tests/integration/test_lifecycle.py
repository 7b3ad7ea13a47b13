"""The command line and the life of a mount: bad input, status, signals, crashes, isolation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import SANDBOXFS, assert_one_line_error, sandboxfs, sh, wait_until
from tests.support.mounts import force_unmount, make_project, mounted

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
ENOTCONN_TEXT = "Transport endpoint is not connected"


# ----- helpers ------------------------------------------------------------------------------------


def fuse_mounts_under(root: Path) -> list[str]:
    """Mountpoints of FUSE mounts (live or dead) at or below `root`."""
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2].startswith("fuse"):
            mp = fields[1].replace("\\040", " ")
            if mp == str(root) or mp.startswith(str(root) + "/"):
                found.append(mp)
    return found


def process_gone(pid: int) -> bool:
    """True once `pid` and all its threads have exited (a zombie counts: our init may not
    reap orphans; the leader turns zombie before its other threads have closed /dev/fuse)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        threads = os.listdir(f"/proc/{pid}/task")
    except (OSError, IndexError):
        return True
    return state in "ZX" and len(threads) <= 1


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def context_of(mnt: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((mnt / ".sandboxfs" / "context.json").read_text()))
    except (OSError, ValueError):
        return None


def audit_entries(project: Path, *filters: str) -> list[dict[str, Any]]:
    result = sandboxfs("audit", "--project", project, "--json", *filters)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def start_foreground(mnt: Path, project: Path, *extra: str) -> subprocess.Popen[str]:
    """`sandboxfs mount --foreground` as a child process, returned once the mount answers."""
    proc = subprocess.Popen(
        [*SANDBOXFS, "mount", str(mnt), "--project", str(project), "--foreground", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_until(lambda: context_of(mnt) is not None or proc.poll() is not None)
    assert proc.poll() is None, proc.communicate()
    return proc


def stop_foreground(proc: subprocess.Popen[str], mnt: Path) -> None:
    """Cleanup for start_foreground: end the daemon if it still runs, unmount if still mounted."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
    if fuse_mounts_under(mnt):
        force_unmount(mnt)


def kill_daemon(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid), f"daemon {pid} survived SIGKILL"


# ----- bad input: exit 2, one line, nothing mounted -------------------------------------------


def _case_missing(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return [str(tmp / "absent"), "--project", str(project)], ["absent", "does not exist", "mkdir"]


def _case_file(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    (tmp / "afile").write_text("x")
    return [str(tmp / "afile"), "--project", str(project)], ["afile", "not a directory"]


def _case_not_empty(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    (tmp / "full").mkdir()
    (tmp / "full" / "something").write_text("x")
    return [str(tmp / "full"), "--project", str(project)], ["full", "not empty", "empty directory"]


def _case_trust(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return (
        [str(tmp / "m"), "--project", str(project), "--trust", "admin"],
        ["admin", "untrusted, session, workspace, full"],
    )


def _case_no_project(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return [str(tmp / "m"), "--project", str(tmp / "nowhere")], ["nowhere", "does not exist"]


def _config(tmp: Path, project: Path, text: str) -> list[str]:
    path = tmp / "bad.yaml"
    path.write_text(text)
    return [str(tmp / "m"), "--project", str(project), "--config", str(path)]


def _case_unknown_key(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return _config(tmp, project, "bogus: 1\n"), ["bad.yaml", "bogus", "unknown key", "deny"]


def _case_wrong_type(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return (
        _config(tmp, project, "cache:\n  entry_timeout: soon\n"),
        ["bad.yaml", "cache.entry_timeout", "number"],
    )


def _case_bad_enum(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return (
        _config(tmp, project, "default_trust: admin\n"),
        ["bad.yaml", "default_trust", "untrusted"],
    )


def _case_bad_yaml(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return _config(tmp, project, "deny: [a\nfoo: : :\n"), ["bad.yaml", "YAML"]


def _case_project_yaml(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    (project / "sandboxfs.yaml").write_text("permissions: 7\n")
    return [str(tmp / "m"), "--project", str(project)], ["sandboxfs.yaml", "permissions"]


def _case_missing_config(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return (
        [str(tmp / "m"), "--project", str(project), "--config", str(tmp / "nope.yaml")],
        ["nope.yaml", "No such file"],
    )


def _case_unreadable_config(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    (tmp / "cfgdir").mkdir()
    return (
        [str(tmp / "m"), "--project", str(project), "--config", str(tmp / "cfgdir")],
        ["cfgdir", "cannot read config"],
    )


def _case_session_id(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return (
        [str(tmp / "m"), "--project", str(project), "--session", "../x"],
        ["session", "../x", "letters, digits"],
    )


def _case_workspace_id(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    return (
        [str(tmp / "m"), "--project", str(project), "--workspace", "a/../../b"],
        ["workspace", "a/../../b", "letters, digits"],
    )


def _case_project_itself(tmp: Path, project: Path) -> tuple[list[str], list[str]]:
    empty = tmp / "emptyproj"
    empty.mkdir()
    return [str(empty), "--project", str(empty)], ["project directory itself"]


BAD_MOUNTS = {
    "missing-mountpoint": _case_missing,
    "mountpoint-is-file": _case_file,
    "mountpoint-not-empty": _case_not_empty,
    "unknown-trust": _case_trust,
    "missing-project": _case_no_project,
    "config-unknown-key": _case_unknown_key,
    "config-wrong-type": _case_wrong_type,
    "config-bad-enum": _case_bad_enum,
    "config-invalid-yaml": _case_bad_yaml,
    "project-config-invalid": _case_project_yaml,
    "config-missing": _case_missing_config,
    "config-unreadable": _case_unreadable_config,
    "session-id-traversal": _case_session_id,
    "workspace-id-traversal": _case_workspace_id,
    "mountpoint-is-project": _case_project_itself,
}


@pytest.mark.parametrize("case", sorted(BAD_MOUNTS))
def test_bad_mount_input_is_one_line_exit_2(case: str, tmp_path: Path, project: Path) -> None:
    (tmp_path / "m").mkdir()
    args, needles = BAD_MOUNTS[case](tmp_path, project)
    result = sandboxfs("mount", *args)
    try:
        assert_one_line_error(result, *needles)
        assert result.stdout == ""
        assert fuse_mounts_under(tmp_path) == []
    finally:
        for mp in fuse_mounts_under(tmp_path):
            force_unmount(Path(mp))


def test_mount_on_mounted_mountpoint_is_refused(mount_at: Callable[..., Any]) -> None:
    with mount_at("session") as m:
        again = sandboxfs("mount", m.mnt, "--project", m.project, "--trust", "full")
        assert_one_line_error(again, "already mounted", "umount")
        assert fuse_mounts_under(m.mnt) == [str(m.mnt)]
        # The first mount is untouched and still the one answering.
        context = context_of(m.mnt)
        assert context is not None
        assert context["trust"] == "session"
        assert context["session"] == m.session


def test_umount_of_non_mount_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    assert_one_line_error(sandboxfs("umount", tmp_path / "plain"), "plain", "not a sandboxfs mount")
    assert_one_line_error(sandboxfs("umount", tmp_path / "absent"), "absent")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "command"),
        (("frobnicate",), "frobnicate"),
        (("mount",), "mountpoint"),
        (("mount", "/tmp", "--bogus-flag"), "--bogus-flag"),
    ],
    ids=["no-args", "unknown-command", "mount-without-mountpoint", "unknown-flag"],
)
def test_usage_errors_are_one_line_exit_2(args: tuple[str, ...], needle: str) -> None:
    assert_one_line_error(sandboxfs(*args), needle)


# ----- mount, status, umount ----------------------------------------------------------------------


def test_mount_status_umount(tmp_path: Path, project: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = sandboxfs("mount", mnt, "--project", project, "--trust", "workspace")
    try:
        assert result.returncode == 0, result.stderr
        session_lines = [ln for ln in result.stdout.splitlines() if ln.startswith("session: ")]
        assert len(session_lines) == 1
        session = session_lines[0].split(": ", 1)[1]
        assert session and session not in result.stdout.splitlines()[0]  # printed once
        context = context_of(mnt)
        assert context is not None
        pid = int(context["pid"])
        assert not process_gone(pid)

        table = sandboxfs("status")
        assert table.returncode == 0, table.stderr
        row = next(line for line in table.stdout.splitlines() if line.startswith(f"{mnt} "))
        for value in ("running", "workspace", session, "default", str(pid)):
            assert value in row.split(), (value, row)

        listed = sandboxfs("status", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = [r for r in json.loads(listed.stdout) if r["mountpoint"] == str(mnt)]
        sizes = [r.pop("state_dir_bytes") for r in rows]  # what .sandbox/ takes on disk
        assert len(sizes) == 1 and isinstance(sizes[0], int) and sizes[0] > 0, sizes
        assert rows == [
            {
                "mountpoint": str(mnt),
                "state": "running",
                "trust": "workspace",
                "session": session,
                "workspace": "default",
                "project": str(project),
                "pid": pid,
                "pending": 0,  # staged commits waiting for review
            }
        ]
        one = sandboxfs("status", mnt, "--json")
        assert one.returncode == 0, one.stderr
        one_rows = json.loads(one.stdout)
        assert [r.pop("state_dir_bytes") > 0 for r in one_rows] == [True]
        assert one_rows == rows

        down = sandboxfs("umount", mnt)
        assert down.returncode == 0, down.stderr
        assert fuse_mounts_under(mnt) == []
        assert wait_gone(pid), "daemon still running after umount"
        assert not [
            r
            for r in json.loads(sandboxfs("status", "--json").stdout)
            if r["mountpoint"] == str(mnt)
        ]
        assert_one_line_error(sandboxfs("status", mnt), "not a sandboxfs mount")
    finally:
        if fuse_mounts_under(mnt):
            sandboxfs("umount", mnt)
            force_unmount(mnt)


def test_default_trust_is_session(tmp_path: Path, project: Path) -> None:
    mnt = tmp_path / "dflt"
    mnt.mkdir()
    result = sandboxfs("mount", mnt, "--project", project)
    try:
        assert result.returncode == 0, result.stderr
        context = context_of(mnt)
        assert context is not None and context["trust"] == "session"
    finally:
        sandboxfs("umount", mnt)
        if fuse_mounts_under(mnt):
            force_unmount(mnt)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_foreground_unmounts_cleanly_on_signal(
    signum: signal.Signals, tmp_path: Path, project: Path
) -> None:
    mnt = tmp_path / "fg"
    mnt.mkdir()
    proc = start_foreground(mnt, project, "--trust", "session")
    try:
        context = context_of(mnt)
        assert context is not None
        assert context["pid"] == proc.pid
        session = context["session"]
        assert sh(f"echo hi > {mnt}/session/working/fg.txt").returncode == 0
        # The kernel sends RELEASE (which logs the write) after close() returns: wait for it,
        # test_foreground_signal_audits_files_still_open covers the file still open.
        assert wait_until(
            lambda: any(e["path"] == "/session/working/fg.txt" for e in audit_entries(project))
        )

        proc.send_signal(signum)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert f"session: {session}" in out
        assert fuse_mounts_under(mnt) == []
        assert not os.path.ismount(mnt)

        entries = audit_entries(project, "--session", session)
        ops = [e["op"] for e in entries]
        assert "mount" in ops and "unmount" in ops
        mount_entry = next(e for e in entries if e["op"] == "mount")
        unmount_entry = next(e for e in entries if e["op"] == "unmount")
        write_entry = next(e for e in entries if e["path"] == "/session/working/fg.txt")
        assert mount_entry["id"] < write_entry["id"] < unmount_entry["id"]
        assert unmount_entry["pid"] == proc.pid
        assert sandboxfs("audit", "verify", "--project", project).returncode == 0
    finally:
        stop_foreground(proc, mnt)


@pytest.mark.parametrize("spin_us", [0, 100], ids=["no-spin", "spin"])
def test_foreground_stops_on_signal_while_busy(spin_us: int, tmp_path: Path, project: Path) -> None:
    """SIGTERM lands while the daemon is answering a stream of requests (and, with spinning,
    looking for the next one instead of sleeping): it still unmounts promptly and cleanly."""
    (project / "sandboxfs.yaml").write_text(f"daemon:\n  spin_us: {spin_us}\n")
    mnt = tmp_path / "fg"
    mnt.mkdir()
    proc = start_foreground(mnt, project, "--trust", "session")
    target = mnt / "session" / "working" / "busy.txt"
    target.write_text("x")
    stop = threading.Event()
    served = 0

    def hammer() -> None:
        nonlocal served
        while not stop.is_set():
            try:
                os.close(os.open(target, os.O_RDONLY))
            except OSError:
                return  # the mount went away
            served += 1

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        assert wait_until(lambda: served > 200)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert not os.path.ismount(mnt)
    finally:
        stop.set()
        worker.join(timeout=20)
        stop_foreground(proc, mnt)
    assert sandboxfs("audit", "verify", "--project", project).returncode == 0


def test_foreground_signal_audits_files_still_open(tmp_path: Path, project: Path) -> None:
    mnt = tmp_path / "fg"
    mnt.mkdir()
    proc = start_foreground(mnt, project, "--trust", "session")
    target = mnt / "session/working/still-open.txt"
    writer = subprocess.Popen(
        ["sh", "-c", f"exec 3> {target}; printf hello >&3; echo ready; exec sleep 60"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
        assert proc.returncode == 0
        assert fuse_mounts_under(mnt) == []
        stored = next(
            (project / ".sandbox/workspaces/default/sessions").glob("*/working/still-open.txt")
        )
        assert stored.read_text() == "hello"  # the data reached the storage ...
        writes = [
            e
            for e in audit_entries(project, "--op", "write")
            if e["path"] == "/session/working/still-open.txt"
        ]
        assert writes, "... so the write must be in the audit log"
        assert writes[0]["allowed"] is True and writes[0]["comm"] == "sh"
        assert writes[0]["bytes"] == 5
    finally:
        writer.kill()
        writer.communicate(timeout=10)
        stop_foreground(proc, mnt)


# ----- isolation ----------------------------------------------------------------------------------


def test_concurrent_sessions_are_isolated_but_share_the_workspace(
    mount_at: Callable[..., Any],
) -> None:
    with mount_at("session") as a, mount_at("session") as b:
        assert a.session and b.session and a.session != b.session
        assert sh(f"echo mine > {a.mnt}/session/working/private.txt").returncode == 0
        assert (a.mnt / "session/working/private.txt").read_text() == "mine\n"
        seen = sh(f"cat {b.mnt}/session/working/private.txt")
        assert seen.returncode == 1 and "No such file" in seen.stderr
        assert "private.txt" not in sh(f"ls -a {b.mnt}/session/working").stdout

        assert sh(f"echo shared > {a.mnt}/workspace/data/common.txt").returncode == 0
        assert sh(f"cat {b.mnt}/workspace/data/common.txt").stdout == "shared\n"
        assert sh(f"echo back > {b.mnt}/workspace/data/reply.txt").returncode == 0
        assert sh(f"cat {a.mnt}/workspace/data/reply.txt").stdout == "back\n"


def test_session_resumes_after_unmount(mount_at: Callable[..., Any]) -> None:
    with mount_at("session") as first:
        session = first.session
        wrote = sh(
            f"seq 1 3000 > {first.mnt}/session/outputs/notes.txt && "
            f"sync {first.mnt}/session/outputs/notes.txt"
        )
        assert wrote.returncode == 0, wrote.stderr
    with mount_at("session", "--session", session) as second:
        assert second.session == session
        assert "resumed" in second.stdout
        expected = "".join(f"{i}\n" for i in range(1, 3001))
        assert (second.mnt / "session/outputs/notes.txt").read_text() == expected
        context = context_of(second.mnt)
        assert context is not None and context["session"] == session
    with mount_at("session") as fresh:
        assert fresh.session != session
        assert not (fresh.mnt / "session/outputs/notes.txt").exists()


def test_workspaces_are_isolated(mount_at: Callable[..., Any]) -> None:
    with mount_at("session", "--workspace", "a") as a, mount_at("session", "--workspace", "b") as b:
        assert sh(f"echo a > {a.mnt}/workspace/data/only-a.txt").returncode == 0
        made = sh(f"mkdir {a.mnt}/staged/c1 && echo a > {a.mnt}/staged/c1/change.txt")
        assert made.returncode == 0, made.stderr
        assert sh(f"ls {a.mnt}/staged").stdout.split() == ["c1"]

        assert "only-a.txt" not in sh(f"ls -a {b.mnt}/workspace/data").stdout
        assert sh(f"cat {b.mnt}/workspace/data/only-a.txt").returncode != 0
        listing = sh(f"ls -A {b.mnt}/staged")
        assert listing.returncode == 0 and listing.stdout == ""
        assert sh(f"cat {b.mnt}/staged/c1/change.txt").returncode != 0
        # and the other way round
        assert sh(f"echo b > {b.mnt}/workspace/data/only-b.txt").returncode == 0
        assert "only-b.txt" not in sh(f"ls -a {a.mnt}/workspace/data").stdout


# ----- the state dir and the mountpoint are not part of /repo -------------------------------------


def test_state_dir_is_invisible_in_repo(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        assert (m.project / ".sandbox").is_dir()
        listing = sh(f"ls -a {m.mnt}/repo")
        assert listing.returncode == 0
        assert ".sandbox" not in listing.stdout.split()
        assert "README.md" in listing.stdout.split()

        looked = sh(f"stat {m.mnt}/repo/.sandbox")
        assert looked.returncode != 0
        made = sh(f"mkdir {m.mnt}/repo/.sandbox")
        assert made.returncode != 0
        assert "Permission denied" in made.stderr or "exists" in made.stderr
        peek = sh(f"cat {m.mnt}/repo/.sandbox/audit.jsonl")
        assert peek.returncode != 0
        write = sh(f"echo x > {m.mnt}/repo/.sandbox/audit.jsonl")
        assert write.returncode != 0

        denied = m.audit("--denied", "--zone", "repo")
        paths = {(e["op"], e["path"]) for e in denied}
        assert ("write", "/repo/.sandbox") in paths
        assert any(p == "/repo/.sandbox" and op == "read" for op, p in paths)
        assert all(e["comm"] for e in denied)
    # Nothing was created or written by the attempts above.
    assert not (m.project / ".sandbox" / ".sandbox").exists()
    assert json.loads((m.project / ".sandbox" / "audit.jsonl").read_text().splitlines()[0])


def test_in_project_mountpoint_is_invisible_and_does_not_hang(
    mount_at: Callable[..., Any], project: Path
) -> None:
    with mount_at("full", mnt=project / "mnt") as m:
        listing = sh(f"ls -a {m.mnt}/repo", timeout=20)
        assert listing.returncode == 0
        assert "mnt" not in listing.stdout.split()
        assert ".sandbox" not in listing.stdout.split()
        inner = sh(f"ls {m.mnt}/repo/mnt", timeout=20)
        assert inner.returncode != 0
        deep = sh(f"ls {m.mnt}/repo/mnt/repo/mnt", timeout=20)
        assert deep.returncode != 0
        made = sh(f"mkdir {m.mnt}/repo/mnt/x", timeout=20)
        assert made.returncode != 0
        git_like = sh(f"find {m.mnt}/repo -maxdepth 3 -name .ssh -prune -o -print", timeout=20)
        assert git_like.returncode == 0, git_like.stderr  # .ssh is listed, never opened
        assert f"{m.mnt}/repo/mnt" not in git_like.stdout.split()


# ----- crash: kill -9 of the daemon ---------------------------------------------------------------


def _write_synced(path: Path, lines: int) -> str:
    result = sh(f"seq 1 {lines} > {path} && sync {path}")
    assert result.returncode == 0, result.stderr
    return "".join(f"{i}\n" for i in range(1, lines + 1))


def test_crash_recovery(mount_at: Callable[..., Any]) -> None:
    with mount_at("full") as m:
        session_text = _write_synced(m.mnt / "session/working/survivor.txt", 20000)
        repo_text = _write_synced(m.mnt / "repo/crash-note.txt", 5000)
        kill_daemon(m.daemon_pid())

        broken = sh(f"ls {m.mnt}")
        assert broken.returncode != 0
        assert ENOTCONN_TEXT in broken.stderr
        broken_read = sh(f"cat {m.mnt}/session/working/survivor.txt")
        assert broken_read.returncode != 0 and ENOTCONN_TEXT in broken_read.stderr

        status = sandboxfs("status", "--json")
        assert status.returncode == 0, status.stderr
        row = next(r for r in json.loads(status.stdout) if r["mountpoint"] == str(m.mnt))
        assert row["state"] == "dead"
        table = sandboxfs("status")
        assert any(line.split()[:2] == [str(m.mnt), "dead"] for line in table.stdout.splitlines())

        down = sandboxfs("umount", m.mnt)
        assert down.returncode == 0, down.stderr
        assert fuse_mounts_under(m.mnt) == []

        with mount_at("full", "--session", m.session, mnt=m.mnt) as again:
            assert (again.mnt / "session/working/survivor.txt").read_text() == session_text
            assert (again.mnt / "repo/crash-note.txt").read_text() == repo_text
        assert (m.project / "crash-note.txt").read_text() == repo_text
        verify = sandboxfs("audit", "verify", "--project", m.project)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert verify.stdout.startswith("ok")


def test_mount_cleans_up_a_dead_mountpoint(mount_at: Callable[..., Any]) -> None:
    with mount_at("session") as m:
        text = _write_synced(m.mnt / "session/working/kept.txt", 1000)
        kill_daemon(m.daemon_pid())
        # No umount: `mount` itself must notice the dead mount, clear it and mount again.
        result = sandboxfs("mount", m.mnt, "--project", m.project, "--session", m.session)
        assert result.returncode == 0, result.stderr
        assert (m.mnt / "session/working/kept.txt").read_text() == text
        assert fuse_mounts_under(m.mnt) == [str(m.mnt)]
        context = context_of(m.mnt)
        assert context is not None and not process_gone(int(context["pid"]))


def test_mount_cleans_up_a_dead_mountpoint_once_attributes_expire(
    mount_at: Callable[..., Any],
) -> None:
    with mount_at("session") as m:
        text = _write_synced(m.mnt / "session/working/kept.txt", 1000)
        # Listing the root makes the kernel drop its cached attributes of the mount root.
        assert sh(f"ls {m.mnt}").returncode == 0
        kill_daemon(m.daemon_pid())
        result = sandboxfs("mount", m.mnt, "--project", m.project, "--session", m.session)
        assert result.returncode == 0, result.stderr
        assert (m.mnt / "session/working/kept.txt").read_text() == text
        assert fuse_mounts_under(m.mnt) == [str(m.mnt)]


# ----- --allow-other ------------------------------------------------------------------------------


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A tmp dir every user can traverse (pytest's are 0700), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-lifecycle-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for mp in fuse_mounts_under(root):
            sandboxfs("umount", mp)
            force_unmount(Path(mp))
        shutil.rmtree(root, ignore_errors=True)


def _as_nobody(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NOBODY, "sh", "-c", command], capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_allow_other_lets_another_user_in(open_tmp: Path) -> None:
    project = make_project(open_tmp)
    project.chmod(0o755)
    with mounted(open_tmp / "shared", project, "session", "--allow-other") as m:
        assert sh(f"echo public > {m.mnt}/session/working/pub.txt").returncode == 0
        assert sh(f"chmod 644 {m.mnt}/session/working/pub.txt").returncode == 0
        read = _as_nobody(f"cat {m.mnt}/session/working/pub.txt")
        assert read.returncode == 0, read.stderr
        assert read.stdout == "public\n"
        entry = m.wait_audit(
            lambda e: (
                e["path"] == "/session/working/pub.txt" and e["op"] == "read" and e["uid"] == 65534
            )
        )
        assert entry["allowed"] is True


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_without_allow_other_another_user_is_refused(open_tmp: Path) -> None:
    project = make_project(open_tmp)
    project.chmod(0o755)
    with mounted(open_tmp / "private", project, "session") as m:
        assert sh(f"echo public > {m.mnt}/session/working/pub.txt").returncode == 0
        assert sh(f"chmod 644 {m.mnt}/session/working/pub.txt").returncode == 0
        read = _as_nobody(f"cat {m.mnt}/session/working/pub.txt")
        assert read.returncode != 0
        assert "Permission denied" in read.stderr
        assert read.stdout == ""
        # Root still can; the refusal is the kernel's, for other users only.
        assert sh(f"cat {m.mnt}/session/working/pub.txt").stdout == "public\n"


# ----- the installed package ----------------------------------------------------------------------


def test_installed_package_works_outside_the_repo() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sandboxfs.config.model as c; print(c.defaults().default_trust)",
        ],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "session"
    help_text = subprocess.run(
        [str(Path(sys.executable).parent / "sandboxfs"), "--help"],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert help_text.returncode == 0, help_text.stderr
    for command in ("mount", "umount", "status", "audit"):
        assert command in help_text.stdout


@pytest.mark.timeout(390)  # the wheel build is allowed 300 s
def test_wheel_ships_defaults_and_entry_point(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    # Build from a copy, so that the build leaves nothing (build/, egg-info) in the repository.
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy2(repo / "pyproject.toml", source)
    for extra in ("README.md", "LICENSE", "MANIFEST.in", "setup.cfg", "setup.py"):
        if (repo / extra).exists():
            shutil.copy2(repo / extra, source)
    shutil.copytree(
        repo / "sandboxfs",
        source / "sandboxfs",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    out = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheels = list(out.glob("sandboxfs-*.whl"))
    assert len(wheels) == 1
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
        assert "sandboxfs/defaults.yaml" in names
        assert "sandboxfs/py.typed" in names
        shipped = wheel.read("sandboxfs/defaults.yaml")
        assert shipped == (repo / "sandboxfs/defaults.yaml").read_bytes()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        text = wheel.read(entry_points).decode()
        assert "[console_scripts]" in text
        assert "sandboxfs = sandboxfs.cli.main:entry" in text
        assert not [n for n in names if n.startswith("tests/")]
