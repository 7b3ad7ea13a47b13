"""The errors sandboxfs reports to the user as one line (the core's is core.errors.SandboxError).

Each kind says what went wrong, not how the process exits: the exit code is decided in one
place, `sandboxfs.cli.main.exit_code`, from the kind and the command (`run` answers as
`docker run` does).
"""

from __future__ import annotations


class SandboxfsError(Exception):
    """Something sandboxfs reports as one line and stops."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UserError(SandboxfsError):
    """Bad input from the user: an argument, a path, an id (exit 2; `run`: 125)."""


class ConfigError(UserError):
    """A config file that cannot be used: unreadable, malformed, or asking for what is not
    allowed (exit 2; `run`: 125)."""


class Failure(SandboxfsError):
    """The request was fine; doing it failed: the daemon refused or did not answer, a mount
    could not be unmounted, the audit log could not be written (exit 1)."""


class SetupError(Failure):
    """The sandbox could not be set up around the program; it never ran (exit 125)."""


class NotRunnable(UserError):
    """The program `run` was asked to start cannot be found inside (exit 127)."""


class CannotExecute(NotRunnable):
    """The program is there but cannot be executed inside (exit 126)."""


# How a kind crosses the daemon's readiness pipe (by name) and comes back as itself.
KINDS: dict[str, type[SandboxfsError]] = {
    kind.__name__: kind
    for kind in (
        SandboxfsError,
        UserError,
        ConfigError,
        Failure,
        SetupError,
        NotRunnable,
        CannotExecute,
    )
}
