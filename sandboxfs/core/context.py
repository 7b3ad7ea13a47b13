"""The security context a mount shows at /.sandboxfs/context.json (and the API returns)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .guard import MountInfo
from .limits import ZoneLimits
from .policy import Op, Policy, Zone


def context(
    policy: Policy, info: MountInfo, pid: int, limits: Mapping[Zone, ZoneLimits] | None = None
) -> dict[str, Any]:
    zones: dict[str, Any] = {}
    for zone in policy.zones:
        access = policy.access(zone)
        zones[zone.value] = {
            "read": Op.READ in access.ops,
            "write": Op.WRITE in access.ops,
            "list": Op.LIST in access.ops,
            "delete": Op.DELETE in access.ops,
            "create_only": access.create_only,
        }
        zone_limits = (limits or {}).get(zone)
        if zone_limits is not None and zone_limits.any:
            shown: dict[str, Any] = {}
            if zone_limits.max_file_bytes is not None:
                shown["max_file_bytes"] = zone_limits.max_file_bytes
            if zone_limits.suffixes is not None:
                shown["suffixes"] = list(zone_limits.suffixes)
            if zone_limits.quota is not None:
                shown["quota"] = {
                    "bytes": zone_limits.quota.bytes,
                    "files": zone_limits.quota.files,
                }
            zones[zone.value]["limits"] = shown
    return {
        "trust": policy.trust.value,
        "session": info.session,
        "workspace": info.workspace,
        "project": info.project,
        "mountpoint": info.mountpoint,
        "pid": pid,
        **({"command": list(info.command)} if info.command is not None else {}),
        **({"via": info.via} if info.via is not None else {}),
        **({"control": info.control} if info.control is not None else {}),
        "zones": zones,
        "deny": list(policy.deny_patterns),
        "deny_private_keys": list(policy.private_key_patterns),
    }


def context_document(
    policy: Policy, info: MountInfo, pid: int, limits: Mapping[Zone, ZoneLimits] | None = None
) -> bytes:
    """context() as the JSON file the mount serves."""
    return (json.dumps(context(policy, info, pid, limits), indent=2) + "\n").encode()


# What a confined program is not shown of the context: where things are on the host (the
# user's home is in these paths). The mount is at CONFINED_MOUNTPOINT inside.
HOST_ONLY_FIELDS = ("project", "control")
CONFINED_MOUNTPOINT = "/sandbox"


def confined_context(document: bytes) -> bytes:
    """context_document() as a program inside `run` sees it: no host paths."""
    shown = json.loads(document)
    for name in HOST_ONLY_FIELDS:
        shown.pop(name, None)
    shown["mountpoint"] = CONFINED_MOUNTPOINT
    return (json.dumps(shown, indent=2) + "\n").encode()
