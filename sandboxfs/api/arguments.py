"""Checking and normalizing what callers pass: virtual paths, data, limits, trust levels.

Paths are virtual ("/repo/src/a.py", or "repo/src/a.py" relative to "/"); `..` is applied
and may not climb above "/"; NUL is refused.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..core.policy import Trust, Zone
from .errors import InvalidPath, OutsideSandbox, make_error


@dataclass(frozen=True, slots=True)
class VirtualPath:
    text: str  # normalized: "/", "/repo", "/repo/a/b"
    zone: Zone | None  # None for "/"
    parts: tuple[bytes, ...]  # below the zone root


class Call:
    """The operation under way, for error messages: its verb and (normalized) paths."""

    __slots__ = ("action", "dest", "path")

    def __init__(self, action: str, path: str | None, dest: str | None) -> None:
        self.action, self.path, self.dest = action, path, dest


def shown(path: object) -> str | None:
    return path if isinstance(path, str) else None


def components(path: object, action: str) -> tuple[str, list[str]]:
    """The shown path and its components, `..` applied; InvalidPath for NUL or `..` above /."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"a path must be a str, not {type(path).__name__}")
    if "\0" in path:
        raise make_error(
            InvalidPath, action, path, "a path cannot contain NUL characters", errno.EINVAL
        )
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if not parts:
                reason = "'..' would climb above '/', the top of the sandbox"
                raise make_error(InvalidPath, action, path, reason, errno.EINVAL)
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return path, parts


def parse_path(path: object, zones: Mapping[str, Zone], action: str) -> VirtualPath:
    """A virtual path ("/repo/x", or "repo/x" relative to "/"), normalized and split."""
    shown, parts = components(path, action)
    text = "/" + "/".join(parts)
    if not parts:
        return VirtualPath(text, None, ())
    zone = zones.get(parts[0])
    if zone is None:
        listed = ", ".join(f"/{name}" for name in zones)
        reason = f"/{parts[0]} is not a zone of this sandbox; paths start with one of: {listed}"
        raise make_error(OutsideSandbox, action, text, reason, errno.ENOENT)
    try:
        encoded = tuple(p.encode("utf-8", "surrogateescape") for p in parts[1:])
    except UnicodeEncodeError:
        reason = "the path is not valid text (it has unpaired surrogates)"
        raise make_error(InvalidPath, action, shown, reason, errno.EINVAL) from None
    return VirtualPath(text, zone, encoded)


def as_bytes(data: object) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"data must be str or bytes, not {type(data).__name__}")


def repo_parts(key: object) -> tuple[bytes, ...]:
    """A stage() key ("src/a.py" or "/repo/src/a.py") as components below /repo."""
    if not isinstance(key, str):
        raise TypeError(f"a file's path must be a str, not {type(key).__name__}")
    _, parts = components(key if key.startswith("/") else f"/repo/{key}", "stage")
    if len(parts) < 2 or parts[0] != Zone.REPO.value:
        reason = "keys name files in the repository, like 'src/a.py' or '/repo/src/a.py'"
        raise make_error(InvalidPath, "stage", key, reason, errno.EINVAL)
    try:
        return tuple(part.encode("utf-8", "surrogateescape") for part in parts[1:])
    except UnicodeEncodeError:
        reason = "the path is not valid text (it has unpaired surrogates)"
        raise make_error(InvalidPath, "stage", key, reason, errno.EINVAL) from None


def as_limit(value: object, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must not be negative")
    return value


def as_trust(value: object, default: Trust) -> Trust:
    if value is None:
        return default
    if isinstance(value, Trust):
        return value
    if not isinstance(value, str):
        raise TypeError(f"trust must be a str or Trust, not {type(value).__name__}")
    try:
        return Trust(value)
    except ValueError:
        levels = ", ".join(t.value for t in Trust)
        raise ValueError(f"unknown trust level {value!r}; one of: {levels}") from None
