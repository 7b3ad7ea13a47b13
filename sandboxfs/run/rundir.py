"""The run directory: where `run`'s private mount lives, and how a dead run's is cleaned.

Each run has one in the user's 0700 state dir: its mountpoint `mnt`, and `owner` and `daemon`
files naming its processes (PID and start time), which is all the sweep reads to tell a live
run from a dead one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from sandboxfs import layout
from sandboxfs.project.mounts import lazy_unmount, sandboxfs_mounts
from sandboxfs.run.nest import NEST_HOST_DIR, NEST_SLOTS_DIR


def runtime_root() -> Path:
    """Private mountpoints of `run`, in the user's own 0700 state dir (never in a project)."""
    return layout.run_dir()


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(record: Path) -> bool | None:
    """Whether the process a `PID START-TIME` file names still runs (a zombie does not); None
    when there is no such file (yet, or any more) or it is still being written."""
    try:
        pid_text, _, started = record.read_text().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in ("Z", "X") and fields[19] == started.strip()


def record_process(record: Path, pid: int) -> None:
    """`PID START-TIME`: the start time tells the sweep a live process from a reused PID."""
    with contextlib.suppress(OSError):  # the daemon may have removed the directory already
        record.write_text(f"{pid} {_start_time(pid)}\n")


def sweep_dead_runs() -> None:
    """Clear at once what a killed `run` or daemon left.

    A mount whose daemon is gone (ENOTCONN for ever after) is detached, even while its `run`
    still lives; a directory whose `run` is gone is removed once nothing is mounted on it. A
    directory with no `owner` and nothing mounted is one being created (for a minute); with a
    mount it is a dead one (`owner` is written before the mount is made, and removed after).
    Only /proc and the run directories are read: never the mounts, whose daemon may be hung.
    """
    root = runtime_root()
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    mounted = set(sandboxfs_mounts())
    for run_dir in entries:
        mnt = run_dir / "mnt"
        owner = _alive(run_dir / "owner")
        if str(mnt) in mounted:
            if owner and _alive(run_dir / "daemon") is not False:
                continue  # in use (or its daemon is being started)
            lazy_unmount(mnt)
        elif owner:
            continue
        elif owner is None:
            with contextlib.suppress(OSError):
                if time.time() - run_dir.stat().st_mtime < 60:
                    continue  # being created right now
        if not owner:
            remove_run_dir(run_dir)


def make_run_dir(session: str) -> Path:
    root = runtime_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    run_dir = root / f"{session}-{os.getpid()}"
    run_dir.mkdir(mode=0o700)
    record_process(run_dir / "owner", os.getpid())
    (run_dir / "mnt").mkdir(mode=0o700)
    return run_dir


def remove_run_dir(run_dir: Path) -> None:
    """Once unmounted (by the daemon, by `run`, or by the sweep for a daemon that died too).

    While `mnt` is still mounted (rmdir fails: EBUSY) nothing is removed, so that the sweep
    still finds whose mount it is and clears it when its `run` is gone.
    """
    try:
        (run_dir / "mnt").rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return
    for name in ("daemon", "owner"):
        with contextlib.suppress(OSError):
            (run_dir / name).unlink()
    shutil.rmtree(run_dir / NEST_HOST_DIR, ignore_errors=True)  # a run that died: its socket
    shutil.rmtree(run_dir / NEST_SLOTS_DIR, ignore_errors=True)  # and its tree's slot files
    with contextlib.suppress(OSError):
        run_dir.rmdir()
