#!/usr/bin/env python3
"""`git status` on a large repository, natively and inside sandboxfs, in one run.

Generates a git repository (default 20,000 files in 400 directories), then runs `git status
--porcelain` natively, inside `sandboxfs mount` at each trust level asked for (first call and
steady state), alternately outside and inside (the switching case), once more inside after
the plain cache timeouts ran out (`--idle`), and once on a fresh mount a little after mounting
(`--settle`, as an agent starts), on the same tree. For every call it prints
the wall time, the ratio to the native median, and how many index entries git re-hashed
(`refresh/sum_scan` from GIT_TRACE2_PERF: the entries whose recorded stat data, ctime, mtime,
inode, uid, gid and size, did not match, and whose content git therefore read and hashed
again). It also says whether the call rewrote `.git/index`.

`--compare DIR` runs the same mounts from another sandboxfs source tree too (for before/after
figures in one run). Not a test: pytest never collects it.

    .venv/bin/python tests/bench/git_index.py                 # 20,000 files, full + workspace
    .venv/bin/python tests/bench/git_index.py --files 2000 --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_SCAN = re.compile(rb"refresh/sum_scan:(\d+)")


def git_env(trace: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GIT_TRACE2_PERF=str(trace),
        GIT_AUTHOR_NAME="bench",
        GIT_AUTHOR_EMAIL="bench@example.invalid",
        GIT_COMMITTER_NAME="bench",
        GIT_COMMITTER_EMAIL="bench@example.invalid",
        GIT_CONFIG_NOSYSTEM="1",
        HOME=str(trace.parent),
    )
    return env


def generate(repo: Path, files: int, dirs: int, home: Path) -> None:
    repo.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    per_dir = max(1, files // dirs)
    made = 0
    d = 0
    while made < files:
        sub = repo / f"pkg{d // 20:02d}" / f"mod{d % 20:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        for i in range(min(per_dir, files - made)):
            (sub / f"file{i:04d}.py").write_text(f"# {d}/{i}\nVALUE = {made}\n" + "x = 1\n" * 20)
            made += 1
        d += 1
    (repo / ".gitignore").write_text("*.pyc\n")
    env = git_env(home / "trace")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    subprocess.run(["git", "commit", "-q", "-m", "generated"], cwd=repo, check=True, env=env)
    # Let the files' times fall behind the index's second, so that no entry is racily clean.
    time.sleep(1.1)
    subprocess.run(
        ["git", "status", "--porcelain"], cwd=repo, check=True, env=env, stdout=subprocess.DEVNULL
    )


class Runner:
    def __init__(self, repo: Path, home: Path) -> None:
        self.repo = repo
        self.home = home
        self.rows: list[dict[str, object]] = []
        self.native: list[float] = []

    def index_id(self) -> tuple[int, int]:
        st = os.stat(self.repo / ".git" / "index")
        return st.st_ino, st.st_mtime_ns

    def status(self, label: str, where: Path) -> dict[str, object]:
        trace = self.home / "trace"
        trace.unlink(missing_ok=True)
        before = self.index_id()
        t0 = time.perf_counter()
        p = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=where,
            env=git_env(trace),
            capture_output=True,
            check=False,
        )
        seconds = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{label}: git status failed: {p.stderr.decode(errors='replace')}")
        scans = [int(m) for m in _SCAN.findall(trace.read_bytes())] if trace.exists() else []
        row: dict[str, object] = {
            "label": label,
            "seconds": seconds,
            "rehashed": sum(scans),
            "index_rewritten": self.index_id() != before,
            "dirty_lines": len(p.stdout.splitlines()),
        }
        self.rows.append(row)
        base = statistics.median(self.native) if self.native else None
        ratio = f"{seconds / base:6.1f}x" if base else "   -   "
        print(
            f"{label:<40} {seconds:7.3f} s {ratio}  rehashed={row['rehashed']:<6}"
            f" index_rewritten={row['index_rewritten']!s:<5} dirty={row['dirty_lines']}",
            flush=True,
        )
        return row


def mount(python: str, source: Path, mnt: Path, project: Path, trust: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH", "")]))
    cmd = [
        python,
        "-m",
        "sandboxfs",
        "mount",
        str(mnt),
        "--project",
        str(project),
        "--trust",
        trust,
    ]
    # `python -m` puts the working directory first on sys.path: run from the source tree.
    p = subprocess.run(
        cmd, cwd=source, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    if p.returncode != 0:
        raise SystemExit(f"mount failed: {p.stderr.strip()}")


def umount(python: str, mnt: Path) -> None:
    if subprocess.run(
        [python, "-m", "sandboxfs", "umount", str(mnt)], capture_output=True, check=False
    ).returncode != 0 or os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--dirs", type=int, default=400)
    ap.add_argument("--reps", type=int, default=5, help="steady-state calls per target")
    ap.add_argument("--switches", type=int, default=3, help="outside/inside round trips")
    ap.add_argument(
        "--idle",
        type=float,
        default=11.0,
        help="then wait this long (past cache.attr_timeout, 10 s) and call once more (0: skip)",
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="then mount again, wait this long (an agent starting) and call once (0: skip)",
    )
    ap.add_argument("--trust", default="full,workspace")
    ap.add_argument("--compare", type=Path, help="also mount from this sandboxfs source tree")
    ap.add_argument("--base", type=Path, default=Path("/tmp"))
    ap.add_argument("--python", default=str(REPO_ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    if not os.path.exists(a.python):
        a.python = sys.executable
    base = Path(tempfile.mkdtemp(prefix="git-index.", dir=a.base))
    project, mnt, home = base / "project", base / "mnt", base / "home"
    mnt.mkdir()
    home.mkdir()
    sources = [("", REPO_ROOT)] + ([(f"[{a.compare.name}] ", a.compare)] if a.compare else [])
    try:
        t0 = time.perf_counter()
        generate(project, a.files, a.dirs, home)
        print(f"generated {a.files} files in {time.perf_counter() - t0:.1f} s under {base}")
        r = Runner(project, home)
        for i in range(a.reps):
            seconds = r.status(f"native #{i + 1}", project)["seconds"]
            assert isinstance(seconds, float)
            r.native.append(seconds)
        for tag, source in sources:
            for trust in a.trust.split(","):
                mount(a.python, source, mnt, project, trust)
                try:
                    inside = mnt / "repo"
                    for i in range(a.reps):
                        r.status(f"{tag}{trust}: inside #{i + 1}", inside)
                    for i in range(a.switches):
                        r.status(f"{tag}{trust}: switch {i + 1} outside", project)
                        r.status(f"{tag}{trust}: switch {i + 1} inside", inside)
                    r.status(f"{tag}{trust}: back outside", project)
                    if a.idle > 0:
                        time.sleep(a.idle)
                        r.status(f"{tag}{trust}: inside after {a.idle:g} s idle", inside)
                finally:
                    umount(a.python, mnt)
                if a.settle > 0:
                    mount(a.python, source, mnt, project, trust)
                    try:
                        time.sleep(a.settle)
                        label = f"{tag}{trust}: first call {a.settle:g} s after mounting"
                        r.status(label, mnt / "repo")
                    finally:
                        umount(a.python, mnt)
        print(f"native median {statistics.median(r.native):.3f} s")
        if a.json:
            a.json.write_text(json.dumps({"native": r.native, "rows": r.rows}, indent=1))
    finally:
        with contextlib.suppress(Exception):
            if os.path.ismount(mnt):
                umount(a.python, mnt)
        if not a.keep and not os.path.ismount(mnt):
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
