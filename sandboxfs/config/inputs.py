"""Reading the files a user hands sandboxfs, so that bad input gets one line.

A config file is read only when it is a regular file of at most MAX_FILE_BYTES (a FIFO, a
device such as /dev/zero or a directory is refused without reading or waiting), parsed with a
YAML loader that refuses duplicate keys (which would otherwise silently keep the last value)
and nesting deeper than MAX_DEPTH (which would otherwise end in a RecursionError), and any value
quoted back in a message is cut to MAX_SHOWN characters by `shown`.
"""

from __future__ import annotations

import os
import re
import reprlib
import stat
from pathlib import Path
from typing import Any

import yaml

from sandboxfs.errors import ConfigError

# What an environment variable may be named (`--env`, agent profiles).
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

MAX_FILE_BYTES = 1 << 20  # 1 MiB: a config is a few kilobytes
MAX_DEPTH = 64  # mappings and lists inside each other; a config needs four or five
MAX_NODES = 50_000  # values (scalars, lists, mappings); a config has a few hundred
MAX_SHOWN = 80  # characters of a value quoted in a message

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def read_file(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file at `path` (symlinks followed), at most `limit` bytes.

    FileNotFoundError passes through (callers decide what a missing file means); anything else
    is ConfigError "cannot read {what} {path}: why". Opened non-blocking, so that a FIFO never
    hangs the open, and checked with fstat before a byte is read.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"cannot read {what} {path}: {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise ConfigError(
                f"cannot read {what} {path}: {_size(st.st_size)}, more than the "
                f"{_size(limit)} a config may be"
            )
        data = _read_at_most(fd, limit + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while read
        raise ConfigError(
            f"cannot read {what} {path}: more than the {_size(limit)} a config may be"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {what} {path}: not UTF-8 text") from None


def _read_at_most(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


class _Loader(yaml.SafeLoader):
    """yaml's safe loader, refusing a duplicate key, nesting deeper than MAX_DEPTH and more
    than MAX_NODES values, aliases (`*name`) expanded: a few lines of aliases to aliases
    would otherwise stand for billions of values, and a message quoting one never end."""

    _depth = 0
    _nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH or self._nodes > MAX_NODES:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested more than {MAX_DEPTH} levels deep"
                    if self._depth > MAX_DEPTH
                    else f"more than {MAX_NODES} values",
                    self.peek_event().start_mark,  # type: ignore[no-untyped-call]
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        sizes: dict[int, tuple[int, int]] = {}  # id(node): (values, levels) it stands for

        def measure(node: Any, level: int) -> tuple[int, int]:
            known = sizes.get(id(node))
            if known is None:
                if level > MAX_DEPTH:
                    raise _expanded(f"nested more than {MAX_DEPTH} levels deep", node)
                children: list[Any] = []
                if isinstance(node, yaml.SequenceNode):
                    children = node.value
                elif isinstance(node, yaml.MappingNode):
                    children = [child for pair in node.value for child in pair]
                values, levels = 1, 1
                for child in children:
                    size, height = measure(child, level + 1)
                    values += size
                    levels = max(levels, height + 1)
                known = sizes[id(node)] = (values, levels)
            if level + known[1] - 1 > MAX_DEPTH:
                raise _expanded(f"nested more than {MAX_DEPTH} levels deep", node)
            return known

        if node is not None and measure(node, 1)[0] > MAX_NODES:
            raise _expanded(f"more than {MAX_NODES} values", node)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<:` merges: a key of the mapping's own overrides them
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class refuses it
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {shown(key)}", key_node.start_mark
                    )
        return super().construct_mapping(node, deep=deep)


def _expanded(problem: str, node: Any) -> yaml.YAMLError:
    return yaml.composer.ComposerError(
        None, None, f"{problem}, with aliases expanded", node.start_mark
    )


def load_yaml(text: str, source: str) -> Any:
    """The YAML document in `text`; ConfigError "{source}: not valid YAML (line N): problem"."""
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["?"])[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {cut(problem)}") from None
    except RecursionError:  # bounded above; a safety net all the same
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None


_repr = reprlib.Repr()
_repr.maxstring = MAX_SHOWN
_repr.maxother = MAX_SHOWN
_repr.maxlevel = 2
_repr.maxdict = _repr.maxlist = _repr.maxtuple = _repr.maxset = 4


def shown(value: Any) -> str:
    """`repr(value)` for a message: at most about MAX_SHOWN characters, whatever its size or
    depth (reprlib never renders what it leaves out)."""
    return cut(_repr.repr(value))


def cut(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` cut to `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
