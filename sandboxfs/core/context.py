"""The security context a mount shows at /.sandboxfs/context.json (and the API returns)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .limits import ZoneLimits
from .policy import Op, Policy, Zone
from .rulebase import MountInfo


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
        **({"worker": info.worker} if info.worker is not None else {}),
        "zones": zones,
        "deny": list(policy.deny_patterns),
        "deny_private_keys": list(policy.private_key_patterns),
        "deny_credentials": list(policy.credential_patterns),
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


# ----- the guide: /.sandboxfs/README, plain text for the program inside --------------------------

GUIDE_NAME = "README"
# What each built-in zone is for, as the guide says it (a project zone: its name).
_ZONE_PURPOSE = {
    "session": "this session's scratch space (working/ inputs/ outputs/), yours alone",
    "home": "your $HOME, kept across sessions of this workspace at this trust level",
    "workspace": "kept across sessions of this workspace (cache/, data/)",
    "repo": "the project's files",
    "staged": "changes you propose to the repository, for the user to review",
    "workers": "worker definitions",
}
_OP_WORDS = ((Op.READ, "read"), (Op.WRITE, "write"), (Op.LIST, "list"), (Op.DELETE, "delete"))


def _can(policy: Policy, zone: Zone) -> str:
    access = policy.access(zone)
    if access.create_only:
        return (
            "create new files only (each written once, by the handle that made it); "
            "you can read back and list what you created in this mount, nothing else"
        )
    words = [word for op, word in _OP_WORDS if op in access.ops]
    return ", ".join(words) if words else "nothing (its names look absent)"


def guide(policy: Policy, info: MountInfo, mountpoint: str = CONFINED_MOUNTPOINT) -> bytes:
    """The short plain-text guide a mount serves at /.sandboxfs/README: what the program may do
    at this trust level, where to write, and how to propose a change. Generated from the policy
    (so it is true at every level, and regenerated when the level changes)."""
    root = mountpoint.rstrip("/")
    trust = policy.trust.value
    lines = [
        f"You are running inside sandboxfs, at trust level {trust} "
        f"(session {info.session}, workspace {info.workspace}).",
        f"This guide is generated from the sandbox's policy; {root}/.sandboxfs/context.json says "
        "the same as JSON. The user can change the level while you run (sandboxfs promote or "
        "demote): read this file again if something is refused that it says you may do.",
        "",
        "What you may do, by directory:",
    ]
    if info.worker is not None:
        lines[1:1] = [
            f"You run as worker {info.worker}: only the directories its declaration names "
            "are here, at most as it declared them."
        ]
    if not policy.zones:
        lines.append("  nothing: this worker declared no directories (no file access at all)")
    width = max((len(f"{root}/{zone.value}") for zone in policy.zones), default=0)
    for zone in policy.zones:
        purpose = _ZONE_PURPOSE.get(zone.value, "a zone the project declares")
        lines.append(f"  {f'{root}/{zone.value}':<{width}}  {_can(policy, zone)}: {purpose}")
    writable = [z for z in policy.zones if Op.WRITE in policy.access(z).ops]
    where = ", ".join(f"{root}/{z.value}" for z in writable) or (
        "nowhere but new files" if policy.zones else "nowhere but /tmp"
    )
    lines += [
        "",
        f"Write your work in: {where}. /tmp is private and gone when you exit; everything "
        "else outside the sandbox's directories is read-only or absent.",
        "Every access is recorded for the user. Refused at every level: names on the deny "
        f"list ({_some(policy.deny_patterns)}) and files that hold private keys or credentials.",
    ]
    if policy.protect_patterns:
        lines.append(
            f"Read-only at every level (they run code on the user's machine): "
            f"{_some(policy.protect_patterns)}."
        )
    staged = Zone.STAGED
    if staged in policy.zones and policy.decide_create(staged).allowed:
        repo_writable = Zone.REPO in policy.zones and Op.WRITE in policy.access(Zone.REPO).ops
        base = f"{root}/staged"
        lines += [""]
        if repo_writable:
            lines.append(
                f"You may change {root}/repo directly. You can also propose a change for the "
                f"user to review, in {base}:"
            )
        else:
            lines.append(
                f"You cannot change {root}/repo. To propose a change, write it to "
                f"{base}/<id>/; the user reviews it (sandboxfs staged diff <id>) and lands it "
                "as one git commit (sandboxfs staged commit <id>):"
            )
        repo_readable = Zone.REPO in policy.zones and Op.READ in policy.access(Zone.REPO).ops
        # The example starts from the repository's file where the level may read it, and
        # writes the whole new content where it may not (a copy from /repo would be refused).
        start = (
            f"  cp {root}/repo/src/parse.py {base}/fix-parser/files/src/parse.py"
            if repo_readable
            else f"  printf 'def parse(text):\\n    return text or None\\n' > "
            f"{base}/fix-parser/files/src/parse.py"
        )
        lines += [
            f"  {base}/<id>/files/<repo path>  the full new content of each file to create or "
            "change (an x bit makes it executable)",
            f"  {base}/<id>/message.txt        the commit message (first line: the subject)",
            f"  {base}/<id>/deletions.txt      optional: repository paths to delete, one a line",
            "  <id>: 1-64 of A-Z a-z 0-9 . _ -, not starting with '.'; a new one for each change.",
            "For example:",
            f"  mkdir -p {base}/fix-parser/files/src",
            start,
            f"  echo 'Fix the parser on empty input' > {base}/fix-parser/message.txt",
        ]
        if policy.access(staged).create_only:
            lines += [
                f"  ls -R {base}/fix-parser     # reading back and listing your own works",
                "Each file is written once: to change a proposal, stage it again under a new id.",
            ]
    elif staged in policy.zones:
        lines += ["", f"You cannot propose changes ({root}/staged is closed at this level)."]
    return ("\n".join(lines) + "\n").encode()


def _some(patterns: tuple[str, ...] | list[str], shown: int = 8) -> str:
    """The first patterns of a list (not its exceptions, `!...`), and how many more."""
    names = [p for p in patterns if not p.startswith("!")]
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
