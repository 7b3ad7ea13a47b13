"""sandboxfs: a FUSE filesystem that confines what AI agents may do to a project's files."""

from .errors import SandboxError, UserError
from .policy import Decision, Op, Policy, Trust, Zone, ZoneAccess

__all__ = ["Decision", "Op", "Policy", "SandboxError", "Trust", "UserError", "Zone", "ZoneAccess"]
__version__ = "0.1.0"
