"""sandboxfs: a FUSE filesystem that confines what AI agents may do to a project's files.

`sandboxfs.Sandbox` is the same enforcement in-process, for agent frameworks (sandboxfs.api).
"""

from .api import Sandbox, SandboxAPIError
from .core.errors import SandboxError
from .core.policy import Decision, Op, Policy, Trust, Zone, ZoneAccess
from .errors import UserError

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
