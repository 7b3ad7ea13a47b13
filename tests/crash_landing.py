"""A longer crash loop for `sandboxfs staged commit` (killed anywhere, it lands all or nothing), not
in the default run: each round lands a staged commit of FILES changed files, kills it with SIGKILL
at a random moment, runs `sandboxfs staged list` (which recovers), and checks that the repository is
all old (HEAD, index and files; the review pending) or all new (the review committed), with no
temporary file or index.lock left and `git status` clean.

    .venv/bin/python tests/crash_landing.py [ROUNDS] [FILES]

Prints one line per round and a summary; exits 1 if any round left the repository
inconsistent.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "Crash Loop",
    "GIT_AUTHOR_EMAIL": "crash@example.invalid",
    "GIT_COMMITTER_NAME": "Crash Loop",
    "GIT_COMMITTER_EMAIL": "crash@example.invalid",
}


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", *args],
        cwd=repo,
        env={**os.environ, **GIT_ENV, "GIT_COMMITTER_DATE": "@1000000000 +0000"},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"git {args[0]} failed: {result.stderr.strip()}")
    return result.stdout


def staged(repo: Path, *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "sandboxfs", "staged", *args, "--project", str(repo)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prepare(root: Path, files: int) -> tuple[Path, str]:
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for n in range(files):
        path = repo / "src" / f"d{n % 20}" / f"f{n}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"old {n}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "initial", "--date=@1000000000")
    (repo / ".sandbox").mkdir()
    (repo / ".sandbox" / ".gitignore").write_text("*\n")
    staged_files = repo / ".sandbox/workspaces/default/staged/c1/files"
    for n in range(files):
        path = staged_files / "src" / f"d{n % 20}" / f"f{n}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"new {n}\n")
    (staged_files.parent / "message.txt").write_text("Crash loop change\n")
    os.utime(staged_files.parent, (1500000000, 1500000000))
    return repo, git(repo, "rev-parse", "HEAD").strip()


def check(repo: Path, old_head: str, files: int) -> str | None:
    """None if the repository is consistent, else what is wrong."""
    leftovers = [str(p) for p in repo.rglob(".sandboxfs-*.tmp")]
    leftovers += [str(p) for p in repo.rglob("landing.json")]
    if (repo / ".git/index.lock").exists():
        leftovers.append(".git/index.lock")
    if leftovers:
        return f"{len(leftovers)} files left, e.g. {leftovers[0]}"
    if git(repo, "status", "--porcelain"):
        return "git status is not clean"
    state_file = repo / ".sandbox/workspaces/default/review/c1/state.json"
    status = json.loads(state_file.read_text())["status"] if state_file.exists() else "pending"
    moved = git(repo, "rev-parse", "HEAD").strip() != old_head
    if moved != (status == "committed"):
        return f"HEAD {'moved' if moved else 'did not move'} but the review is {status}"
    want = "new" if moved else "old"
    for n in range(0, files, max(1, files // 10)):
        text = (repo / "src" / f"d{n % 20}" / f"f{n}.txt").read_text()
        if text != f"{want} {n}\n":
            return f"f{n}.txt holds {text!r}, not the {want} content"
    return None


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    files = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    root = Path(tempfile.mkdtemp(prefix="sandboxfs-crash-"))
    try:
        calibrate = root / "calibrate"
        calibrate.mkdir()
        repo, _ = prepare(calibrate, files)
        start = time.monotonic()
        staged(repo, "commit", "c1").wait()
        full = time.monotonic() - start
        bad = 0
        for number in range(rounds):
            where = root / f"round{number}"
            where.mkdir()
            repo, old_head = prepare(where, files)
            delay = random.uniform(0, full)
            landing = staged(repo, "commit", "c1")
            time.sleep(delay)
            landing.send_signal(signal.SIGKILL)
            landing.wait()
            staged(repo, "list").wait()
            problem = check(repo, old_head, files)
            bad += problem is not None
            print(
                f"round {number}: killed after {delay:.2f}s of {full:.2f}s: {problem or 'ok'}",
                flush=True,
            )
            shutil.rmtree(where)
        print(f"{rounds - bad} of {rounds} rounds consistent")
        return 1 if bad else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
