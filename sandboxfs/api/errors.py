"""The exceptions of the Python API, and the one function that maps the core's errors to them.

Every refusal carries the core's reason, which already says what was refused and what is
allowed instead; `str(exc)` puts the operation and the path in front of it, as a message fit
to show a model: "Cannot write '/repo/x': repo is not writable at trust level untrusted; ...".
"""

from __future__ import annotations

import errno as errnos
import os

from ..core.errors import SandboxError
from ..core.policy import Rule

__all__ = [
    "AlreadyExists",
    "CrossZone",
    "DenyListed",
    "DirectoryNotEmpty",
    "FileTooLarge",
    "InvalidPath",
    "IsADirectory",
    "NotADirectory",
    "NotFound",
    "OutsideSandbox",
    "PermissionDenied",
    "Protected",
    "QuotaExceeded",
    "ReadOnlyZone",
    "SandboxAPIError",
    "SandboxIOError",
    "SandboxSetupError",
    "SuffixNotAllowed",
    "api_error",
]


class SandboxAPIError(Exception):
    """Base of every error the API raises (besides TypeError/ValueError for wrong arguments).

    `path` is the virtual path the operation was about (None when there is none), `errno` the
    errno the mount would have answered, `reason` the core's explanation, `rule` the rule that
    refused ("deny", "protect", "suffix", "size", "quota", or "" for the matrix and the rest),
    `dest` the destination of a rename.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        errno: int = errnos.EIO,
        reason: str = "",
        rule: str = "",
        dest: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.errno = errno
        self.reason = reason
        self.rule = rule
        self.dest = dest

    def __str__(self) -> str:
        return self.message


class PermissionDenied(SandboxAPIError):
    """The trust level may not do this here (EACCES/EPERM)."""


class ApprovalRequired(PermissionDenied):
    """An approval rule asks the user about this operation, and nobody answered yes: no
    approver was given to Sandbox.open, it refused, or it did not answer in time. The message
    says which rule asked and how to get an answer."""


class ReadOnlyZone(PermissionDenied):
    """A change in a zone the trust level may only read, or in a read-only workers layer."""


class DenyListed(PermissionDenied):
    """The name matches the deny list, or the file holds a private key: its contents are
    refused at every trust level."""


class Protected(PermissionDenied):
    """A protected path (the config file, git hooks...): readable, never changed."""


class SuffixNotAllowed(PermissionDenied):
    """The zone allows only files with certain suffixes."""


class FileTooLarge(SandboxAPIError):
    """The file would be larger than the zone's max_file_bytes (EFBIG)."""


class QuotaExceeded(SandboxAPIError):
    """The zone's quota of bytes or entries is used up (EDQUOT)."""


class NotFound(SandboxAPIError):
    """No such entry, or one this trust level may not know about (ENOENT, with the reason)."""


class AlreadyExists(SandboxAPIError):
    """The entry exists already (EEXIST)."""


class IsADirectory(SandboxAPIError):
    """A file operation on a directory (EISDIR)."""


class NotADirectory(SandboxAPIError):
    """A directory operation on a file, or a path through a file (ENOTDIR)."""


class DirectoryNotEmpty(SandboxAPIError):
    """Deleting a directory that still has entries (ENOTEMPTY)."""


class CrossZone(SandboxAPIError):
    """A rename from one zone into another (EXDEV): copy the file instead."""


class InvalidPath(SandboxAPIError):
    """A path that is not one: NUL bytes, or `..` above `/` (EINVAL)."""


class OutsideSandbox(SandboxAPIError):
    """A path whose first component is no zone of this sandbox (ENOENT)."""


class SandboxIOError(SandboxAPIError):
    """Any other failure: of the backing storage, of the audit log, or of the API itself."""


class SandboxSetupError(SandboxAPIError):
    """The sandbox could not be opened: no such project, a bad config file, no state dir."""


class WorkerRefused(SandboxSetupError):
    """A worker's declaration asks more than its parent has, names an unknown zone, or its
    `.worker` file is invalid (EACCES for wider than the parent, EINVAL otherwise)."""


_BY_RULE: dict[str, type[SandboxAPIError]] = {
    Rule.DENY: DenyListed,
    Rule.PROTECT: Protected,
    Rule.SUFFIX: SuffixNotAllowed,
    Rule.SIZE: FileTooLarge,
    Rule.QUOTA: QuotaExceeded,
    Rule.APPROVAL: ApprovalRequired,
}

_BY_ERRNO: dict[int, type[SandboxAPIError]] = {
    errnos.EACCES: PermissionDenied,
    errnos.EPERM: PermissionDenied,
    errnos.EROFS: ReadOnlyZone,
    errnos.EFBIG: FileTooLarge,
    errnos.EDQUOT: QuotaExceeded,
    errnos.ENOENT: NotFound,
    errnos.EEXIST: AlreadyExists,
    errnos.EISDIR: IsADirectory,
    errnos.ENOTDIR: NotADirectory,
    errnos.ENOTEMPTY: DirectoryNotEmpty,
    errnos.EXDEV: CrossZone,
}

# Reasons for errors that come without one (from the backing storage).
_DEFAULT_REASONS = {
    errnos.EACCES: "the backing file system refuses it (its file permissions), not the policy",
    errnos.EPERM: "the backing file system does not permit it, not the policy",
    errnos.ENOENT: "no such file or directory",
    errnos.EEXIST: "it already exists",
    errnos.EISDIR: "it is a directory",
    errnos.ENOTDIR: "a component of the path is not a directory",
    errnos.ENOTEMPTY: "the directory is not empty; delete its entries first",
    errnos.ESTALE: "the entry changed on disk while it was being used; try again",
    errnos.ELOOP: "it is a symbolic link, and the API never follows symbolic links",
    errnos.ENOSPC: "no space is left on the backing storage",
    errnos.EINVAL: "invalid argument (a directory cannot be moved into itself)",
}


def error_class(err: int, rule: str = "") -> type[SandboxAPIError]:
    """The exception type for a refusal: by the rule that refused first, then by errno."""
    return _BY_RULE.get(rule) or _BY_ERRNO.get(err, SandboxIOError)


def api_error(
    exc: SandboxError | OSError, action: str, path: str | None, dest: str | None = None
) -> SandboxAPIError:
    """The API's exception for a SandboxError (refused or failed) or an OSError of the storage.

    `action` is the verb of the message ("read", "write", "rename"...), `path` the virtual
    path the caller gave (normalized), `dest` a rename's destination.
    """
    if isinstance(exc, SandboxError):
        err, reason, rule = exc.errno, exc.reason, exc.rule
    else:
        err, reason, rule = exc.errno or errnos.EIO, "", Rule.MATRIX
        if err not in _DEFAULT_REASONS and exc.strerror:
            reason = exc.strerror[:1].lower() + exc.strerror[1:]
    if not reason:
        reason = _DEFAULT_REASONS.get(err) or os.strerror(err).lower()
    return make_error(error_class(err, rule), action, path, reason, err, rule, dest)


def make_error(
    cls: type[SandboxAPIError],
    action: str,
    path: str | None,
    reason: str,
    err: int,
    rule: str = "",
    dest: str | None = None,
) -> SandboxAPIError:
    """An exception of `cls` with the message "Cannot <action> '<path>' [to '<dest>']: <reason>"."""
    what = f"Cannot {action}"
    if path is not None:
        what += f" {path!r}"
    if dest is not None:
        what += f" to {dest!r}"
    return cls(f"{what}: {reason}", path=path, errno=err, reason=reason, rule=rule, dest=dest)
