#!/usr/bin/env python3
"""sandboxfs benchmark: the same workloads on native, sandboxfs and bindfs, in one run.

Creates a native directory and a sandboxfs project side by side on one filesystem, mounts
sandboxfs over the project (`python -m sandboxfs mount MNT --project P --trust full`; workloads
run in MNT/repo) and, when installed, `bindfs NATIVE2 BINDMNT`; runs each workload's repetitions
interleaved across the targets (the order rotates every repetition) and prints the medians, the
ratio of each to native and their geometric mean. Everything is unmounted, and the loop image
(--loop) removed, in `finally`.

Workloads (names and sizes follow the reference instrument /work/shared/bench/fsbench.py):
  meta   create 5,000 files of 1 KiB in 50 dirs (python), lstat them all, `ls -lR`, `rm -rf`
  tree   `tar -xf` of a source tree (~2,400 files: the running Python's stdlib, or a synthetic
         deterministic tree when that is too small), `grep -r -c`, `git init` (outside the
         mount: sandboxfs makes no .git) `&& add -A && commit`, `git status --porcelain`, `rm -rf`
  data   `dd` 512 MiB bs=1M conv=fsync (--size), global `sync`, cold read (after
         drop_caches, root only), warm read
  rand   4 KiB random reads of a cached 256 MiB file: fio (psync) if installed, else a
         python pread loop, in IOPS
  micro  python loop in a subprocess, us per op: os.stat, os.fstat, open+close

Not a test: pytest never collects this file. Run as root for cold reads and --loop.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandboxfs.config.model import DEFAULT_DENY, DEFAULT_PRIVATE_KEYS

REPO_ROOT = Path(__file__).resolve().parents[2]
CMD_TIMEOUT = 900

# key, unit, higher_is_better, description
METRICS: list[tuple[str, str, bool, str]] = [
    ("meta.create", "s", False, "create {files} files x {file_size} B in {dirs} dirs (python)"),
    ("meta.stat", "s", False, "lstat all {files} files (python loop)"),
    ("meta.ls_lR", "s", False, "ls -lR > /dev/null"),
    ("meta.rm", "s", False, "rm -rf the {files} files"),
    (
        "tree.untar",
        "s",
        False,
        "tar -xf source tree ({tree_files} files, {tree_mb} MB, {tree_kind})",
    ),
    ("tree.grep", "s", False, "grep -r -c -F import (reads every file)"),
    ("tree.git_commit", "s", False, "git init (outside) && git add -A && git commit"),
    ("tree.git_status", "s", False, "git status --porcelain"),
    ("tree.rm", "s", False, "rm -rf tree incl. .git (but its config and hooks)"),
    ("data.write", "s", False, "dd {size} MiB bs=1M conv=fsync"),
    ("data.sync", "s", False, "global `sync` right after the dd write"),
    ("data.read_cold", "s", False, "dd read {size} MiB after drop_caches"),
    ("data.read_warm", "s", False, "dd read {size} MiB again (warm)"),
    (
        "rand.read4k",
        "IOPS",
        True,
        "4k random read, {rand_engine}, {rand_mib} MiB, {rand_runtime}s, warm",
    ),
    ("micro.stat", "us", False, "os.stat one file, us/op ({micro_n} ops)"),
    ("micro.fstat", "us", False, "os.fstat of an open fd, us/op ({micro_n} ops)"),
    ("micro.open_close", "us", False, "open+close one file, us/op ({micro_open_n} ops)"),
]
METRIC_INFO = {m[0]: m for m in METRICS}
WORKLOADS = ["meta", "tree", "data", "rand", "micro"]

# sandboxfs's default deny list (config/defaults.yaml): files matching it cannot be created
# through the mount, and those matching its private-key patterns may hold keys that cannot be
# read back, so both are left out of the source tree (same tree for every target).
DENY_GLOBS = [
    pattern.rstrip("/")
    for pattern in (*DEFAULT_DENY, *DEFAULT_PRIVATE_KEYS)
    if not pattern.startswith("!")
]

MICRO_SCRIPT = r"""
import json, os, sys, time
p, n, n_open = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
st, fst, op, cl, rd = os.stat, os.fstat, os.open, os.close, os.O_RDONLY
for _ in range(100):
    st(p)
t0 = time.perf_counter()
for _ in range(n):
    st(p)
t_stat = (time.perf_counter() - t0) / n * 1e6
fd = op(p, rd)
t0 = time.perf_counter()
for _ in range(n):
    fst(fd)
t_fstat = (time.perf_counter() - t0) / n * 1e6
cl(fd)
for _ in range(20):
    cl(op(p, rd))
t0 = time.perf_counter()
for _ in range(n_open):
    cl(op(p, rd))
t_oc = (time.perf_counter() - t0) / n_open * 1e6
print(json.dumps({"micro.stat": t_stat, "micro.fstat": t_fstat, "micro.open_close": t_oc}))
"""

PREAD_SCRIPT = r"""
import os, random, sys, time
p, runtime = sys.argv[1], float(sys.argv[2])
fd = os.open(p, os.O_RDONLY)
blocks = os.fstat(fd).st_size // 4096
rng, pr, n = random.Random(1234), os.pread, 0
t0 = time.perf_counter()
deadline = t0 + runtime
while True:
    for _ in range(256):
        pr(fd, 4096, rng.randrange(blocks) * 4096)
    n += 256
    if time.perf_counter() >= deadline:
        break
print(n / (time.perf_counter() - t0))
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class StepError(Exception):
    pass


def run_cmd(
    argv: list[str],
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    ok: tuple[int, ...] = (0,),
    capture: bool = False,
    timeout: float = CMD_TIMEOUT,
) -> tuple[float, str]:
    """Run a command; return (seconds, stdout). Raise StepError on failure."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise StepError(f"timeout after {timeout}s: {' '.join(argv)}") from None
    dt = time.perf_counter() - t0
    if p.returncode not in ok:
        err = p.stderr.decode(errors="replace")[-600:]
        raise StepError(f"rc={p.returncode}: {' '.join(argv)}: {err}")
    return dt, (p.stdout.decode(errors="replace") if capture else "")


def quiet(argv: list[str]) -> int:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, check=False
    ).returncode


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def settle() -> None:
    """Untimed: flush dirty data so one step's writeback does not leak into the next."""
    os.sync()
    time.sleep(0.2)


def mount_info(path: str) -> tuple[str, str, str]:
    """(fstype, source, options) of the mount containing path."""
    path = os.path.realpath(path)
    best: tuple[str, str, str, str] | None = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            mnt = parts[4].replace("\\040", " ")
            inside = path == mnt or path.startswith(mnt.rstrip("/") + "/") or mnt == "/"
            if inside and (best is None or len(mnt) >= len(best[0])):
                best = (mnt, parts[sep + 1], parts[sep + 2], parts[5] + "," + parts[sep + 3])
    return (best[1], best[2], best[3]) if best else ("?", "?", "?")


def proc_cpu(pid: int | None) -> float | None:
    """utime+stime of a process in seconds (all threads), or None."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# source tree tarball (built once into --cache-dir, deterministic)


def _denied(rel: str) -> bool:
    return any(fnmatch.fnmatchcase(part, g) for part in rel.split("/") for g in DENY_GLOBS)


def _stdlib_files(stdlib: str) -> list[str]:
    skip = {"site-packages", "__pycache__", "lib-dynload", "dist-packages"}
    out = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("config-"))
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, stdlib)
            if os.path.isfile(full) and not os.path.islink(full) and not _denied(rel):
                out.append(full)
    return out


def _python3_stdlib() -> str | None:
    exe = shutil.which("python3")
    if not exe:
        return None
    p = subprocess.run(
        [exe, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True,
        text=True,
        check=False,
    )
    return p.stdout.strip() or None


def _synthetic_files(n_files: int = 2400) -> list[tuple[str, bytes]]:
    """A deterministic python-like tree: ~2,400 files, ~40 MB, in nested packages."""
    rng = random.Random(20240601)
    words = [
        "import",
        "def",
        "class",
        "return",
        "self",
        "value",
        "result",
        "data",
        "path",
        "config",
        "from",
        "yield",
        "async",
        "await",
        "lambda",
        "None",
        "True",
        "False",
    ]
    dirs = ["Lib"]
    for i in range(24):
        top = f"Lib/pkg{i:02d}"
        dirs.append(top)
        for j in range(rng.randint(2, 7)):
            dirs.append(f"{top}/sub{j}")
    out = []
    for k in range(n_files):
        d = dirs[rng.randrange(len(dirs))]
        size = min(int(rng.lognormvariate(9.2, 1.1)), 600_000)
        lines = []
        total = 0
        while total < size:
            line = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) + "\n"
            lines.append(line)
            total += len(line)
        out.append((f"{d}/mod{k:04d}.py", "".join(lines).encode()))
    return out


def _thin(items: list[Any], limit: int | None) -> list[Any]:
    """Every k-th item so that at most `limit` remain (keeps the tree's breadth)."""
    if not limit or len(items) <= limit:
        return items
    step = -(-len(items) // limit)
    return items[::step]


def build_tree_tar(
    cache_dir: str, source: str, limit: int | None = None
) -> tuple[str, dict[str, Any]]:
    """source: 'auto', 'stdlib', 'synthetic' or a directory. Returns (tar path, info)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    if source == "auto":
        # this Python's stdlib, else python3's on PATH (what fsbench.py packs), else synthetic
        source = "synthetic"
        for cand in (stdlib, _python3_stdlib()):
            if cand and len(_stdlib_files(cand)) >= 2000:
                source = cand
                break
    src_dir = stdlib if source == "stdlib" else source
    key = (
        "synthetic"
        if source == "synthetic"
        else ("dir-" + os.path.realpath(src_dir).strip("/").replace("/", "_"))
    )
    tar_path = os.path.join(cache_dir, f"tree-{key}{f'-max{limit}' if limit else ''}.tar")
    info_path = tar_path + ".json"
    if os.path.exists(tar_path) and os.path.exists(info_path):
        with open(info_path) as f:
            return tar_path, json.load(f)
    tmp = tar_path + ".tmp"
    nbytes = nfiles = 0
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tf:
        if source == "synthetic":
            import io

            for rel, data in _thin(_synthetic_files(), limit):
                ti = tarfile.TarInfo(rel)
                ti.size, ti.mode, ti.mtime = len(data), 0o644, 1700000000
                tf.addfile(ti, io.BytesIO(data))
                nbytes += len(data)
                nfiles += 1
            kind = "synthetic"
        else:
            if not os.path.isdir(src_dir):
                raise SystemExit(f"--tree: not a directory: {src_dir}")
            for full in _thin(_stdlib_files(src_dir), limit):
                arcname = os.path.join("Lib", os.path.relpath(full, src_dir))
                ti = tf.gettarinfo(full, arcname=arcname)
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = "root"
                ti.mtime = 1700000000
                with open(full, "rb") as fh:
                    tf.addfile(ti, fh)
                nbytes += ti.size
                nfiles += 1
            kind = f"from {src_dir}, deny-list names left out"
    os.replace(tmp, tar_path)
    info = {"kind": kind, "files": nfiles, "bytes": nbytes}
    with open(info_path, "w") as f:
        json.dump(info, f)
    return tar_path, info


# --------------------------------------------------------------------------------------------
# targets and workloads


class Target:
    def __init__(
        self, label: str, directory: str, args: argparse.Namespace, pid: int | None = None
    ) -> None:
        self.label = label
        self.dir = directory
        self.work = os.path.join(directory, f"bench.{label}.{os.getpid()}")
        # The directory behind `directory` when it is a sandboxfs zone (what the user sees
        # outside), else None.
        self.backing: str | None = None
        self.args = args
        self.pid = pid  # daemon whose CPU time is reported
        self.values: dict[str, list[float]] = {}
        self.cpu: dict[str, float] = {}
        self.errors: list[str] = []
        self.fstype, self.source, self.mountopts = mount_info(directory)

    def add(self, metric: str, value: float) -> None:
        self.values.setdefault(metric, []).append(value)

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def native(self, path: str) -> str:
        """`path` (under self.dir) as the user reaches it outside the mount."""
        if self.backing is None:
            return path
        return os.path.join(self.backing, os.path.relpath(path, self.dir))


def git_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    home = os.path.join(args.cache_dir, "home")
    os.makedirs(home, exist_ok=True)
    env.update(
        {
            "HOME": home,
            "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "bench",
            "GIT_AUTHOR_EMAIL": "bench@localhost",
            "GIT_COMMITTER_NAME": "bench",
            "GIT_COMMITTER_EMAIL": "bench@localhost",
            "GIT_AUTHOR_DATE": "1700000000 +0000",
            "GIT_COMMITTER_DATE": "1700000000 +0000",
        }
    )
    return env


def meta_rep(t: Target, i: int) -> dict[str, float]:
    a = t.args
    base = t.path(f"meta{i}")
    payload = (b"x" * 63 + b"\n") * (a.file_size // 64) + b"y" * (a.file_size % 64)
    per_dir = a.files // a.dirs
    paths = []
    os.mkdir(base)
    t0 = time.perf_counter()
    for d in range(a.dirs):
        dp = os.path.join(base, f"d{d:03d}")
        os.mkdir(dp)
        for k in range(per_dir):
            p = os.path.join(dp, f"f{k:05d}.txt")
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, payload)
            os.close(fd)
            paths.append(p)
    t_create = time.perf_counter() - t0
    settle()
    t0 = time.perf_counter()
    total = sum(os.lstat(p).st_size for p in paths)
    t_stat = time.perf_counter() - t0
    if total != len(paths) * len(payload):
        raise StepError(f"stat: size mismatch {total}")
    t_ls, _ = run_cmd(["ls", "-lR", base])
    t_rm, _ = run_cmd(["rm", "-rf", base])
    settle()
    return {"meta.create": t_create, "meta.stat": t_stat, "meta.ls_lR": t_ls, "meta.rm": t_rm}


def tree_rep(t: Target, i: int) -> dict[str, float]:
    a = t.args
    env = git_env(a)
    dest = t.path(f"tree{i}")
    os.mkdir(dest)
    r: dict[str, float] = {}
    r["tree.untar"], _ = run_cmd(["tar", "--no-same-owner", "-xf", a.tree_tar, "-C", dest])
    settle()
    src = os.path.join(dest, "Lib")
    r["tree.grep"], _ = run_cmd(["grep", "-r", "-c", "-F", "import", "."], cwd=src, ok=(0, 1))
    t0 = time.perf_counter()
    # The user's repository exists before the agent runs: sandboxfs refuses a new .git below a
    # zone root, so `git init` runs outside; add and commit write through the mount.
    run_cmd(["git", "init", "-q", "-b", "main"], cwd=t.native(src), env=env)
    run_cmd(["git", "add", "-A"], cwd=src, env=env)
    run_cmd(["git", "commit", "-q", "-m", "import"], cwd=src, env=env)
    r["tree.git_commit"] = time.perf_counter() - t0
    settle()
    r["tree.git_status"], out = run_cmd(
        ["git", "status", "--porcelain"], cwd=src, env=env, capture=True
    )
    if out.strip():
        raise StepError(f"git status not clean: {out[:200]!r}")
    # Through sandboxfs, rm removes everything but the .git entry itself with its config and
    # hooks, which never change through the mount: rm says so (exit 1); the user removes them.
    r["tree.rm"], _ = run_cmd(["rm", "-rf", dest], ok=(0, 1) if t.backing else (0,))
    if t.backing is not None:
        left = t.native(dest)
        for dirpath, _dirs, files in os.walk(left):
            if files and "/.git" not in dirpath[len(left) :]:
                raise StepError(f"rm -rf left {dirpath}: {files[:3]}")
        shutil.rmtree(left)
    settle()
    return r


def data_rep(t: Target, i: int) -> dict[str, float]:
    a = t.args
    f = t.path("data.bin")
    if os.path.exists(f):
        os.unlink(f)
    settle()
    r: dict[str, float] = {}
    r["data.write"], _ = run_cmd(
        ["dd", "if=/dev/zero", "of=" + f, "bs=1M", f"count={a.size}", "conv=fsync", "status=none"]
    )
    t0 = time.perf_counter()
    os.sync()
    r["data.sync"] = time.perf_counter() - t0
    if os.path.getsize(f) != a.size << 20:
        raise StepError("data file has the wrong size")
    if a.drop_caches and drop_caches():
        r["data.read_cold"], _ = run_cmd(["dd", "if=" + f, "of=/dev/null", "bs=1M", "status=none"])
    r["data.read_warm"], _ = run_cmd(["dd", "if=" + f, "of=/dev/null", "bs=1M", "status=none"])
    return r


def data_teardown(t: Target) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(t.path("data.bin"))
    settle()


def rand_setup(t: Target) -> None:
    a = t.args
    f = t.path("rand.bin")
    if a.rand_engine == "fio":
        run_cmd(
            [
                "fio",
                "--name=layout",
                "--filename=" + f,
                "--rw=write",
                "--bs=1M",
                f"--size={a.rand_mib}M",
                "--ioengine=psync",
                "--end_fsync=1",
                "--refill_buffers",
                "--output=/dev/null",
            ]
        )
    else:
        rng = random.Random(7)
        with open(f, "wb") as fh:
            for _ in range(a.rand_mib):
                fh.write(rng.randbytes(1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
    settle()


def rand_rep(t: Target, i: int) -> dict[str, float]:
    a = t.args
    f = t.path("rand.bin")
    run_cmd(["dd", "if=" + f, "of=/dev/null", "bs=1M", "status=none"])  # prime the cache
    if a.rand_engine == "fio":
        _, out = run_cmd(
            [
                "fio",
                "--name=randread",
                "--filename=" + f,
                "--rw=randread",
                "--bs=4k",
                f"--size={a.rand_mib}M",
                "--ioengine=psync",
                "--numjobs=1",
                "--invalidate=0",
                "--time_based",
                f"--runtime={a.rand_runtime}",
                "--output-format=json",
            ],
            capture=True,
            timeout=a.rand_runtime + 120,
        )
        iops = json.loads(out[out.index("{") :])["jobs"][0]["read"]["iops"]
    else:
        _, out = run_cmd(
            [sys.executable, "-c", PREAD_SCRIPT, f, str(a.rand_runtime)],
            capture=True,
            timeout=a.rand_runtime + 120,
        )
        iops = float(out.strip())
    return {"rand.read4k": iops}


def rand_teardown(t: Target) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(t.path("rand.bin"))
    settle()


def micro_setup(t: Target) -> None:
    with open(t.path("micro.txt"), "wb") as f:  # depth 2 below the target, as in fsbench
        f.write(b"m" * 4096)
    settle()


def micro_rep(t: Target, i: int) -> dict[str, float]:
    a = t.args
    _, out = run_cmd(
        [
            sys.executable,
            "-c",
            MICRO_SCRIPT,
            t.path("micro.txt"),
            str(a.micro_n),
            str(a.micro_open_n),
        ],
        capture=True,
    )
    return {k: float(v) for k, v in json.loads(out).items()}


def micro_teardown(t: Target) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(t.path("micro.txt"))


Step = Callable[[Target], None] | None
WL: dict[str, tuple[Step, Callable[[Target, int], dict[str, float]], Step]] = {
    "meta": (None, meta_rep, None),
    "tree": (None, tree_rep, None),
    "data": (None, data_rep, data_teardown),
    "rand": (rand_setup, rand_rep, rand_teardown),
    "micro": (micro_setup, micro_rep, micro_teardown),
}


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "IOPS":
        return f"{round(v)}"
    if unit == "us":
        return f"{v:.1f}" if v < 1000 else f"{round(v)}"
    for limit, spec in ((100, ".0f"), (10, ".1f"), (1, ".2f")):
        if v >= limit:
            return format(v, spec)
    return f"{v:.3f}"


def run_all(targets: list[Target], args: argparse.Namespace) -> None:
    for t in targets:
        os.makedirs(t.work)
    try:
        for wl in args.workloads:
            setup, rep, teardown = WL[wl]
            active = []
            for t in targets:
                try:
                    if setup:
                        setup(t)
                    active.append(t)
                except (StepError, OSError) as e:
                    t.errors.append(f"{wl} setup: {e}")
                    log(f"  !! {t.label} {wl} setup failed: {e}")
            for i in range(args.reps):
                k = i % max(1, len(active))  # rotate the order: drift hits every target alike
                for t in active[k:] + active[:k]:
                    cpu0 = proc_cpu(t.pid)
                    t0 = time.perf_counter()
                    try:
                        res = rep(t, i)
                    except (StepError, OSError, ValueError, KeyError) as e:
                        t.errors.append(f"{wl} rep {i}: {e}")
                        log(f"  !! {t.label} {wl} rep {i} failed: {e}")
                        continue
                    cpu1 = proc_cpu(t.pid)
                    if cpu0 is not None and cpu1 is not None:
                        t.cpu[wl] = t.cpu.get(wl, 0.0) + cpu1 - cpu0
                    for key, v in res.items():
                        t.add(key, v)
                    shown = " ".join(
                        f"{key.split('.', 1)[1]}={fmt(v, METRIC_INFO[key][1])}"
                        for key, v in res.items()
                    )
                    log(
                        f"[{wl} {i + 1}/{args.reps}] {t.label:<10} {shown}  "
                        f"({time.perf_counter() - t0:.1f}s)"
                    )
            for t in active:
                if teardown:
                    try:
                        teardown(t)
                    except (StepError, OSError) as e:
                        t.errors.append(f"{wl} teardown: {e}")
    finally:
        for t in targets:
            shutil.rmtree(t.work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# reporting (same JSON layout as fsbench.py, so `fsbench.py --report` can render it too)


def render(results: dict[str, Any], baseline: str = "native") -> str:
    targets = results["targets"]
    labels = list(targets)
    cfg = results.get("config", {})
    if baseline not in targets:
        baseline = labels[0]
    lines = ["| metric | unit | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    ratios: dict[str, list[float]] = {lb: [] for lb in labels}
    for key, unit, hib, _ in METRICS:
        meds = {lb: targets[lb]["metrics"].get(key, {}).get("median") for lb in labels}
        if all(m is None for m in meds.values()):
            continue
        base = meds.get(baseline)
        cells = []
        for lb in labels:
            m = meds[lb]
            cell = fmt(m, unit)
            if m and base:
                r = base / m if hib else m / base
                ratios[lb].append(r)
                cell += f" ({r:.2f}x)"
                vals = targets[lb]["metrics"][key]["values"]
                if len(vals) > 1:
                    cell += f" ±{round(50 * (max(vals) - min(vals)) / m)}%"
            cells.append(cell)
        lines.append(f"| {key} | {unit} | " + " | ".join(cells) + " |")
    geo = []
    for lb in labels:
        rs = [r for r in ratios[lb] if r > 0]
        geo.append(f"{math.exp(sum(map(math.log, rs)) / len(rs)):.2f}x" if rs else "n/a")
    lines.append("| geomean ratio | | " + " | ".join(geo) + " |")
    e = results.get("env", {})
    notes = [
        "",
        f"run: {e.get('date')}, kernel {e.get('kernel')}, {e.get('nproc')} cpus, "
        f"{e.get('duration_s')}s, loadavg {e.get('loadavg_start')} -> {e.get('loadavg_end')}, "
        f"base {e.get('base')} ({e.get('base_fs')})",
        f"ratio = time / time({baseline}); for IOPS = IOPS({baseline}) / IOPS; 1.00x = "
        f"{baseline}, higher = slower. Median of {cfg.get('reps', '?')} repetitions; "
        "±N% = half the max-min range in percent of the median.",
        "",
    ]
    for key, *_ in METRICS:
        if any(key in targets[lb]["metrics"] for lb in labels):
            try:
                desc = METRIC_INFO[key][3].format(**cfg)
            except (KeyError, IndexError):
                desc = METRIC_INFO[key][3]
            notes.append(f"  {key:<17} {desc}")
    notes.append("")
    for lb in labels:
        t = targets[lb]
        notes.append(
            f"  {lb:<10} {t.get('dir')}  fstype={t.get('fstype')} opts={t.get('mountopts')}"
        )
        if t.get("daemon_cpu_s"):
            cpu = ", ".join(f"{w} {s:.1f}s" for w, s in t["daemon_cpu_s"].items())
            notes.append(f"  {lb:<10} daemon CPU time (all reps): {cpu}")
        for err in t.get("errors", []):
            notes.append(f"  {lb:<10} ERROR {err}")
    return "\n".join(lines) + "\n" + "\n".join(notes)


# --------------------------------------------------------------------------------------------
# environment: loop filesystem, mounts, profiler


class Bench:
    """Owns everything that must be undone: loop fs, mounts, profiler, directories."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = ""
        self.made_base = False
        self.image = ""
        self.loopdev = ""
        self.loop_mounted = False
        self.sfs_mnt = ""
        self.sfs_backing = ""
        self.bind_mnt = ""
        self.floor_mnt = ""
        self.floor: subprocess.Popen[bytes] | None = None
        self.profiler: subprocess.Popen[bytes] | None = None
        self.daemon_pid: int | None = None

    # -- setup
    def make_base(self) -> None:
        a = self.args
        if a.loop:
            if os.geteuid() != 0:
                raise SystemExit("--loop needs root")
            self.base = tempfile.mkdtemp(prefix="sandboxfs-bench.", dir=a.base or "/tmp")
            self.made_base = True
            self.image = self.base + ".img"
            with open(self.image, "wb") as f:
                f.truncate(a.loop_size << 30)
            _, out = run_cmd(
                ["losetup", "--direct-io=on", "-f", "--show", self.image], capture=True
            )
            self.loopdev = out.strip()
            run_cmd(["mkfs.ext4", "-q", "-F", self.loopdev])
            run_cmd(["mount", self.loopdev, self.base])
            self.loop_mounted = True
            log(f"loop fs: {self.image} ({a.loop_size} GiB) on {self.loopdev} at {self.base}")
        elif a.base:
            os.makedirs(a.base, exist_ok=True)
            self.base = tempfile.mkdtemp(prefix="sandboxfs-bench.", dir=a.base)
            self.made_base = True
        else:
            self.base = tempfile.mkdtemp(prefix="sandboxfs-bench.", dir="/tmp")
            self.made_base = True
        for d in ("native", "project", "mnt", "bindfs.src", "bindfs.mnt", "floor.src", "floor.mnt"):
            os.makedirs(os.path.join(self.base, d), exist_ok=True)
        with open(os.path.join(self.base, "project", "README.md"), "w") as f:
            f.write("sandboxfs benchmark project\n")

    def mount_sandboxfs(self) -> str:
        a = self.args
        mnt = os.path.join(self.base, "mnt")
        cmd = [
            a.python,
            "-m",
            "sandboxfs",
            "mount",
            mnt,
            "--project",
            os.path.join(self.base, "project"),
            "--trust",
            a.trust,
        ]
        if a.audit_sync:
            cmd.append("--audit-sync")
        if a.config:
            cmd += ["--config", os.path.abspath(a.config)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")])
        )
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
        if p.returncode != 0:
            raise SystemExit(f"sandboxfs mount failed ({p.returncode}): {p.stderr.strip()}")
        self.sfs_mnt = mnt
        with open(os.path.join(mnt, ".sandboxfs", "context.json")) as f:
            self.daemon_pid = json.load(f).get("pid")
        log(f"sandboxfs: {' '.join(cmd)}  (daemon pid {self.daemon_pid})")
        work = (
            os.path.join(mnt, "repo")
            if a.zone == "repo"
            else os.path.join(mnt, "session", "working")
        )
        if not os.path.isdir(work):
            raise SystemExit(f"{work} is not a directory")
        project = os.path.join(self.base, "project")
        session = next(
            (
                line.split(": ", 1)[1].strip()
                for line in p.stdout.splitlines()
                if line.startswith("session: ")
            ),
            "",
        )
        self.sfs_backing = (
            project
            if a.zone == "repo"
            else os.path.join(
                project, ".sandbox", "workspaces", "default", "sessions", session, "working"
            )
        )
        if not os.path.isdir(self.sfs_backing):
            raise SystemExit(f"{self.sfs_backing} (behind {work}) is not a directory")
        return work

    def mount_bindfs(self) -> str | None:
        if self.args.no_bindfs or not shutil.which("bindfs"):
            return None
        mnt = os.path.join(self.base, "bindfs.mnt")
        try:
            run_cmd(["bindfs", os.path.join(self.base, "bindfs.src"), mnt], timeout=30)
        except StepError as e:
            log(f"bindfs mount failed, skipped: {e}")
            return None
        self.bind_mnt = mnt
        return mnt

    def mount_floor(self) -> str | None:
        """The stack's floor (floor.py: a pyfuse3 passthrough with sandboxfs's request wait
        and mount options, and no checks), served by a child until cleanup."""
        if not self.args.floor:
            return None
        mnt = os.path.join(self.base, "floor.mnt")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")])
        )
        script = str(Path(__file__).with_name("floor.py"))
        source = os.path.join(self.base, "floor.src")
        self.floor = subprocess.Popen(
            [self.args.python, script, source, mnt, "--spin", str(self.args.floor_spin)],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        self.floor_mnt = mnt  # unmounted in cleanup, whether it came up in time or not
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if self.floor.poll() is not None or time.monotonic() > deadline:
                log("floor mount failed, skipped")
                return None
            time.sleep(0.05)
        return mnt

    def start_profiler(self) -> None:
        a = self.args
        if not a.profile or not self.daemon_pid:
            return
        pyspy = shutil.which("py-spy") or str(Path(a.python).with_name("py-spy"))
        if not os.path.exists(pyspy):
            log("py-spy not found (pip install py-spy): no profile")
            return
        self.profile_raw = a.profile + ".collapsed"
        self.profiler = subprocess.Popen(
            [
                pyspy,
                "record",
                "--pid",
                str(self.daemon_pid),
                "--format",
                "raw",
                "--function",
                "--rate",
                str(a.profile_rate),
                "-o",
                self.profile_raw,
                # --native needs to pause the process while sampling; otherwise do not
                *(["--native"] if a.profile_native else ["--nonblocking"]),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)
        log(f"py-spy recording daemon pid {self.daemon_pid} -> {self.profile_raw}")

    def stop_profiler(self) -> None:
        if self.profiler is None:
            return
        proc, self.profiler = self.profiler, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not os.path.exists(self.profile_raw):
            log(f"py-spy failed ({proc.returncode}): {err.decode(errors='replace')[-400:]}")

    # -- teardown: everything best effort, in reverse order
    def cleanup(self) -> None:
        self.stop_profiler()
        if self.sfs_mnt:
            rc = quiet([self.args.python, "-m", "sandboxfs", "umount", self.sfs_mnt])
            if rc != 0 or os.path.ismount(self.sfs_mnt):
                quiet(["fusermount3", "-u", "-z", self.sfs_mnt])
        if self.bind_mnt and quiet(["fusermount3", "-u", self.bind_mnt]) != 0:
            quiet(["fusermount3", "-u", "-z", self.bind_mnt])
        if self.floor is not None:
            if quiet(["fusermount3", "-u", self.floor_mnt]) != 0:
                quiet(["fusermount3", "-u", "-z", self.floor_mnt])
            try:
                self.floor.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.floor.kill()
                self.floor.wait()
        if self.loop_mounted and quiet(["umount", self.base]) != 0:
            time.sleep(1)
            quiet(["umount", "-l", self.base])
        if self.loopdev:
            quiet(["losetup", "-d", self.loopdev])
        if self.image:
            with contextlib.suppress(OSError):
                os.unlink(self.image)
        if self.made_base and not self.args.keep:
            if self.sfs_mnt and os.path.ismount(self.sfs_mnt):
                log(f"WARNING: {self.sfs_mnt} still mounted; leaving {self.base}")
            else:
                shutil.rmtree(self.base, ignore_errors=True)


# Stacks whose innermost Python frame is one of these are the daemon waiting, not working.
IDLE_FRAMES = (
    "EpollIOManager.get_events",
    "EpollIOManager._epoll_wait",
    "WorkerThread._work",
    "Condition.wait",
    "Thread._wait_for_tstate_lock",
)
# The call chain above the request loop: in every sample, so left out of the cumulative table.
ROOT_FRAMES = (
    "<module> (",
    "_run_code (",
    "_run_module_as_main (",
    "main (",
    "_run_daemon (",
    "serve (",
    "run (",
    "unrolled_run (",
)


def profile_report(raw: str, top: int = 15) -> str:
    """Top functions by self and cumulative samples from py-spy's collapsed stacks.

    Idle stacks (event loop in epoll_wait, parked worker threads) are left out, and so are the
    root frames (runpy, cli, serve, trio.run) above the request loop.
    """
    self_n: dict[str, int] = {}
    cum_n: dict[str, int] = {}
    total = idle = 0
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [
                fr
                for fr in stack.split(";")
                if fr and not fr.startswith("process ") and not fr.startswith("thread ")
            ]
            py_frames = [fr for fr in frames if ".py:" in fr or ".pyx:" in fr or ".pxi:" in fr]
            if not frames or (py_frames and py_frames[-1].startswith(IDLE_FRAMES)):
                idle += n
                continue
            total += n
            self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
            for fr in set(frames):
                cum_n[fr] = cum_n.get(fr, 0) + n
    if not total:
        return "profile: no busy samples"

    def short(fr: str) -> str:
        for prefix in (str(REPO_ROOT) + "/", sysconfig.get_paths()["purelib"] + "/"):
            fr = fr.replace(prefix, "")
        return fr

    out = [f"profile: {total} busy samples of the daemon ({idle} idle samples left out)"]
    cum = {fr: n for fr, n in cum_n.items() if not fr.startswith(ROOT_FRAMES)}
    for title, table in (("cumulative", cum), ("self", self_n)):
        out.append(f"top {top} by {title} samples (% of busy):")
        for fr, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"  {100 * n / total:5.1f}%  {n:7d}  {short(fr)}")
    return "\n".join(out)


def read_loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (< 1 min): 1 rep, 500 files, 800-file tree, 64 MiB data, "
        "32 MiB/2 s rand, fewer micro ops",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma list from {','.join(WORKLOADS)} (default: all)",
    )
    ap.add_argument("--trust", default="full", help="sandboxfs trust level (default: full)")
    ap.add_argument(
        "--zone",
        choices=["repo", "session"],
        default="repo",
        help="run in MNT/repo (default; needs trust full) or MNT/session/working",
    )
    ap.add_argument("--audit-sync", action="store_true", help="mount sandboxfs with --audit-sync")
    ap.add_argument(
        "--config", help="sandboxfs config file for the mount (e.g. to compare daemon.spin_us)"
    )
    ap.add_argument("--json", help="write the results here (fsbench.py --report can read it)")
    ap.add_argument(
        "--base",
        help="parent of the run's directories (default /tmp); with --loop "
        "the parent of the image and its mount point",
    )
    ap.add_argument(
        "--loop",
        action="store_true",
        help="root: run on a fresh journaled ext4 on a loop image (removed after)",
    )
    ap.add_argument("--loop-size", type=int, default=4, help="loop image size in GiB (default 4)")
    ap.add_argument("--no-bindfs", action="store_true", help="skip the bindfs peer")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also the stack's floor: floor.py, a pyfuse3 passthrough that checks nothing",
    )
    ap.add_argument(
        "--floor-spin", type=float, default=100.0, help="the floor's request-wait spin, µs"
    )
    ap.add_argument("--size", type=int, help="data workload MiB (default 512, quick 64)")
    ap.add_argument("--files", type=int, help="meta: files (default 5000, quick 500)")
    ap.add_argument("--dirs", type=int, help="meta: directories (default 50, quick 10)")
    ap.add_argument("--file-size", type=int, default=1024)
    ap.add_argument("--rand-mib", type=int, help="rand: file MiB (default 256, quick 32)")
    ap.add_argument("--rand-runtime", type=int, help="rand: seconds (default 10, quick 2)")
    ap.add_argument("--micro-n", type=int, help="micro: stat/fstat ops (default 20000)")
    ap.add_argument("--micro-open-n", type=int, help="micro: open+close ops (default 5000)")
    ap.add_argument(
        "--tree",
        default="auto",
        help="source tree: auto (this Python's stdlib if >= 2000 files, else "
        "synthetic), stdlib, synthetic, or a directory to pack",
    )
    ap.add_argument(
        "--tree-max",
        type=int,
        help="keep at most this many files of the tree (default all, quick 800)",
    )
    ap.add_argument(
        "--cache-dir",
        default="/tmp/sandboxfs-bench-cache",
        help="where the tree tarball is built once",
    )
    ap.add_argument(
        "--python",
        default=None,
        help="python that runs sandboxfs (default: the repo's .venv, else this one)",
    )
    ap.add_argument(
        "--profile",
        metavar="PREFIX",
        help="record the sandboxfs daemon with py-spy into PREFIX.collapsed and "
        "print its top functions",
    )
    ap.add_argument("--profile-rate", type=int, default=250)
    ap.add_argument(
        "--profile-native",
        action="store_true",
        help="py-spy --native: also show C/Cython frames (pyfuse3, libfuse)",
    )
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false")
    ap.add_argument("--keep", action="store_true", help="keep the base directory (not the image)")
    a = ap.parse_args()
    quick = a.quick
    defaults = {
        "files": (5000, 500),
        "dirs": (50, 10),
        "size": (512, 64),
        "rand_mib": (256, 32),
        "rand_runtime": (10, 2),
        "micro_n": (20000, 2000),
        "micro_open_n": (5000, 500),
    }
    for k, (full, small) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, small if quick else full)
    if quick:
        a.reps = 1
        if a.tree_max is None:
            a.tree_max = 800
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    for w in a.workloads:
        if w not in WL:
            ap.error(f"unknown workload {w!r}")
    if a.python is None:
        venv = REPO_ROOT / ".venv" / "bin" / "python"
        a.python = str(venv) if venv.exists() else sys.executable
    a.rand_engine = "fio" if shutil.which("fio") else "python pread loop"
    if a.drop_caches and os.geteuid() != 0:
        log("not root: cold-read metric skipped")
        a.drop_caches = False
    return a


def main() -> int:
    a = parse_args()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    os.makedirs(a.cache_dir, exist_ok=True)
    cfg: dict[str, Any] = {
        k: getattr(a, k)
        for k in (
            "reps",
            "files",
            "dirs",
            "file_size",
            "size",
            "rand_mib",
            "rand_runtime",
            "rand_engine",
            "micro_n",
            "micro_open_n",
            "drop_caches",
            "workloads",
            "trust",
            "zone",
            "audit_sync",
        )
    }
    if "tree" in a.workloads:
        a.tree_tar, info = build_tree_tar(a.cache_dir, a.tree, a.tree_max)
        cfg.update(
            tree_files=info["files"], tree_mb=round(info["bytes"] / 1e6), tree_kind=info["kind"]
        )
        log(
            f"tree tarball: {a.tree_tar} ({info['files']} files, {info['bytes'] / 1e6:.1f} MB, "
            f"{info['kind']})"
        )
    bench = Bench(a)
    t_start = time.time()
    env: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nproc": os.cpu_count(),
        "loadavg_start": read_loadavg(),
    }
    targets: list[Target] = []
    try:
        bench.make_base()
        env["base"] = bench.base
        env["base_fs"] = " ".join(mount_info(bench.base)[:2])
        targets.append(Target("native", os.path.join(bench.base, "native"), a))
        work = bench.mount_sandboxfs()
        targets.append(Target("sandboxfs", work, a, pid=bench.daemon_pid))
        targets[-1].backing = bench.sfs_backing
        bmnt = bench.mount_bindfs()
        if bmnt:
            targets.append(Target("bindfs", bmnt, a))
        fmnt = bench.mount_floor()
        if fmnt and bench.floor is not None:
            targets.append(Target("floor", fmnt, a, pid=bench.floor.pid))
        for t in targets:
            log(f"target {t.label:<10} {t.dir}  fstype={t.fstype}")
        bench.start_profiler()
        run_all(targets, a)
        bench.stop_profiler()
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        bench.cleanup()
        log(f"cleaned up ({'loop fs removed, ' if bench.image else ''}mounts gone)")
    env["duration_s"] = round(time.time() - t_start, 1)
    env["loadavg_end"] = read_loadavg()
    results: dict[str, Any] = {"env": env, "config": cfg, "targets": {}}
    for t in targets:
        ms = {
            k: {"values": v, "median": statistics.median(v), "unit": METRIC_INFO[k][1]}
            for k, v in t.values.items()
        }
        results["targets"][t.label] = {
            "dir": t.dir,
            "fstype": t.fstype,
            "source": t.source,
            "mountopts": t.mountopts,
            "metrics": ms,
            "errors": t.errors,
            "daemon_cpu_s": t.cpu,
        }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
        log(f"results written to {a.json}")
    print(render(results))
    if a.profile and os.path.exists(a.profile + ".collapsed"):
        print()
        print(profile_report(a.profile + ".collapsed"))
    log(f"total {env['duration_s']}s")
    return 2 if any(t.errors for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
