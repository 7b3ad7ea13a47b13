"""The two kinds of error sandboxfs raises itself.

`SandboxError` is a refused or failed filesystem operation and carries the errno the caller
will see; the FUSE adapter turns it into `FUSEError` in one place. `UserError` is bad input on
the command line and becomes one line on stderr and exit code 2.
"""

from __future__ import annotations


class SandboxError(Exception):
    """An operation refused by policy or failed in the store, with its errno and reason."""

    def __init__(self, errno: int, reason: str = "") -> None:
        super().__init__(errno, reason)
        self.errno = errno
        self.reason = reason


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
