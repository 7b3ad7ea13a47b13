"""The new user's first minutes: mount, look around, be refused, find the refusal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.support.cli import sh


def test_untrusted_first_look(mount_at: Callable[..., Any]) -> None:
    with mount_at("untrusted") as m:
        listing = sh(f"ls {m.mnt}")
        assert listing.stdout.split() == ["repo", "session", "staged", "workers", "workspace"]
        # The repo is no zone of untrusted: its names look absent, whether they exist or not.
        refused = sh(f"cat {m.mnt}/repo/README.md")
        assert refused.returncode == 1
        assert "No such file or directory" in refused.stderr
        denials = m.audit("--denied")
        entry = next(e for e in denials if e["path"] == "/repo/README.md")
        assert entry["comm"] == "cat"
        assert entry["op"] == "read"
        assert entry["errno"] == "ENOENT"
        assert entry["zone"] == "repo"
        assert "not readable at trust level untrusted" in entry["reason"]
        assert entry["session"] == m.session
