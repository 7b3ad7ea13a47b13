"""sandboxfs: a FUSE filesystem that confines what AI agents may do to a project's files."""

from .core.errors import SandboxError
from .core.policy import Decision, Op, Policy, Trust, Zone, ZoneAccess
from .errors import UserError

__all__ = ["Decision", "Op", "Policy", "SandboxError", "Trust", "UserError", "Zone", "ZoneAccess"]
__version__ = "0.1.0"
