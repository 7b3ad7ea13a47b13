"""The in-process Python API: `Sandbox`, the mount's rules and audit without a mount.

    from sandboxfs.api import Sandbox

    with Sandbox.open("/path/to/project", trust="untrusted") as sb:
        sb.write("/session/working/notes.md", "hello")
        sb.stage({"src/fix.py": "..."}, "Fix the bug")

`Sandbox.memory()` gives the same API over zones kept in memory. Every error is a
`SandboxAPIError` whose message says what was refused and what is allowed instead.
"""

from .errors import (
    AlreadyExists,
    ApprovalRequired,
    CrossZone,
    DenyListed,
    DirectoryNotEmpty,
    FileTooLarge,
    InvalidPath,
    IsADirectory,
    NotADirectory,
    NotFound,
    OutsideSandbox,
    PermissionDenied,
    Protected,
    QuotaExceeded,
    ReadOnlyZone,
    SandboxAPIError,
    SandboxIOError,
    SandboxSetupError,
    SuffixNotAllowed,
    WorkerRefused,
)
from .sandbox import Sandbox
from .types import FileInfo, Permission, StagedCommit

__all__ = [
    "AlreadyExists",
    "ApprovalRequired",
    "CrossZone",
    "DenyListed",
    "DirectoryNotEmpty",
    "FileInfo",
    "FileTooLarge",
    "InvalidPath",
    "IsADirectory",
    "NotADirectory",
    "NotFound",
    "OutsideSandbox",
    "Permission",
    "PermissionDenied",
    "Protected",
    "QuotaExceeded",
    "ReadOnlyZone",
    "Sandbox",
    "SandboxAPIError",
    "SandboxIOError",
    "SandboxSetupError",
    "StagedCommit",
    "SuffixNotAllowed",
    "WorkerRefused",
]
