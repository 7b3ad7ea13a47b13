#!/usr/bin/env python3
"""What holding one FUSE request in the server does to other processes (docs/approvals.md).

A tiny pyfuse3 filesystem (no sandboxfs): `/d` holds `f` and `g`, `/e` holds `h`. One request on
`/d/f` (unlink, create, rename to `/e`, or open) waits HOLD seconds in the server, which keeps
serving everything else (eight trio tasks). Meanwhile seven other processes each run one probe
at once; the time each took is printed. Names are never cached (entry_timeout 0).

    python tests/bench/holding.py unlink|create|rename|open MOUNTPOINT

What it shows on Linux 6.x: while an unlink, create or rename is held, every probe in the same
directory waits for it (the kernel holds the directory's lock during the request), and a
rename across directories freezes both; an open of an existing file freezes nothing. So
sandboxfs never holds a namespace operation for an approval: it refuses it at once, naming the
pending request, and the retry passes once it is granted.

Not a test: pytest never collects this file. Run as root (it mounts).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import pyfuse3
import trio

HOLD = 3.0
ROOT, D, E, F, G, H = 1, 2, 3, 4, 5, 6
NAMES = {ROOT: {b"d": D, b"e": E}, D: {b"f": F, b"g": G}, E: {b"h": H}}
DIRS = {ROOT, D, E}


class HoldingFS(pyfuse3.Operations):  # type: ignore[misc]
    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ino
        attr.st_mode = (stat.S_IFDIR | 0o755) if ino in DIRS else (stat.S_IFREG | 0o644)
        attr.st_size = 0 if ino in DIRS else 2
        attr.entry_timeout = attr.attr_timeout = 0
        return attr

    async def _hold(self, op: str) -> None:
        if op == self.held:
            await trio.sleep(HOLD)

    async def getattr(self, ino: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attr(ino)

    async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        ino = NAMES.get(parent, {}).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def opendir(self, ino: int, ctx: Any) -> int:
        return ino

    async def readdir(self, fh: int, off: int, token: Any) -> None:
        items = sorted(NAMES.get(fh, {}).items())
        for i, (name, ino) in enumerate(items[off:], off + 1):
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i):
                break

    async def open(self, ino: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if ino == F:
            await self._hold("open")
        return pyfuse3.FileInfo(fh=ino)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return b"x\n"[off : off + size]

    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        await self._hold("unlink")
        raise pyfuse3.FUSEError(errno.EACCES)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx: Any) -> Any:
        await self._hold("create")
        raise pyfuse3.FUSEError(errno.EACCES)

    async def rename(self, p0: int, n0: bytes, p1: int, n1: bytes, flags: int, ctx: Any) -> None:
        await self._hold("rename")
        raise pyfuse3.FUSEError(errno.EACCES)


def probe(mnt: str, held: str) -> None:
    time.sleep(0.5)
    trigger = {
        "unlink": ["rm", "-f", f"{mnt}/d/f"],
        "create": ["sh", "-c", f": > {mnt}/d/new"],
        "rename": ["mv", f"{mnt}/d/f", f"{mnt}/e/f2"],
        "open": ["cat", f"{mnt}/d/f"],
    }[held]
    first = subprocess.Popen(trigger, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    probes = [
        ("ls d (same dir)", ["ls", f"{mnt}/d"]),
        ("stat d/g (same dir)", ["stat", f"{mnt}/d/g"]),
        ("stat d/zz (same dir, absent)", ["stat", f"{mnt}/d/zz"]),
        ("cat d/g (same dir)", ["cat", f"{mnt}/d/g"]),
        ("ls e (other dir)", ["ls", f"{mnt}/e"]),
        ("cat e/h (other dir)", ["cat", f"{mnt}/e/h"]),
    ]
    took: dict[str, float] = {}

    def one(label: str, cmd: list[str]) -> None:
        start = time.monotonic()
        subprocess.run(cmd, capture_output=True, check=False)
        took[label] = time.monotonic() - start

    threads = [threading.Thread(target=one, args=p) for p in probes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first.wait()
    print(f"{held} held {HOLD:.0f} s in the server; meanwhile:")
    for label, _ in probes:
        print(f"  {label:30s} {took[label]:5.2f} s", flush=True)
    subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)


def main() -> None:
    held, mnt = sys.argv[1], sys.argv[2]
    os.makedirs(mnt, exist_ok=True)
    pyfuse3.init(HoldingFS(held), mnt, {"fsname=holding"})
    threading.Thread(target=probe, args=(mnt, held), daemon=True).start()
    try:
        trio.run(pyfuse3.main, 1, 8)  # min_tasks, max_tasks
    finally:
        pyfuse3.close(unmount=False)


if __name__ == "__main__":
    main()
