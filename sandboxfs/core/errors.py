"""The error every refused or failed filesystem operation raises inside the core."""

from __future__ import annotations

from .policy import Rule


class SandboxError(Exception):
    """An operation refused by policy or failed in the store, with its errno and reason.

    The FUSE adapter turns it into `FUSEError` in one place; the Python API into one of its
    typed exceptions (sandboxfs.api.errors).
    """

    def __init__(self, errno: int, reason: str = "", rule: Rule = Rule.MATRIX) -> None:
        super().__init__(errno, reason)
        self.errno = errno
        self.reason = reason
        self.rule = rule  # see Decision.rule
