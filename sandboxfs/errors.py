"""Bad input from the user: the CLI's one error type (the core's is core.errors.SandboxError)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
