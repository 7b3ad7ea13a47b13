"""sandboxfs: a FUSE filesystem that confines what AI agents may do to a project's files.

`sandboxfs.Sandbox` is the same enforcement in-process, for agent frameworks (sandboxfs.api).
It is imported on first use, not with the package: the command line (`sandboxfs run`, `mount`)
does not need the API, and every import is start-up time of each command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.errors import SandboxError
from .core.policy import Decision, Op, Policy, Trust, Zone, ZoneAccess
from .errors import UserError

if TYPE_CHECKING:
    from .api import Sandbox, SandboxAPIError

__all__ = [
    "Decision",
    "Op",
    "Policy",
    "Sandbox",
    "SandboxAPIError",
    "SandboxError",
    "Trust",
    "UserError",
    "Zone",
    "ZoneAccess",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`Sandbox` and `SandboxAPIError`, from sandboxfs.api on first use (PEP 562)."""
    if name in ("Sandbox", "SandboxAPIError"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
