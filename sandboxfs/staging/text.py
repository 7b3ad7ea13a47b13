"""Names and content as they may be printed to a terminal (escape_name, escape_text), and
bytes as text with undecodable bytes kept (decode)."""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, undecodable bytes (surrogateescape) and any other lone surrogate, and
# the bidirectional overrides that make text read differently from what it is ("trojan source").
_UNSAFE = "\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_TEXT_RE = re.compile(f"[{_UNSAFE}]")
_NAME_RE = re.compile(f"[{_UNSAFE}\t\n\\\\]")


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    code = ord(ch)
    if ch == "\\":
        return "\\\\"
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as os.fsdecode keeps it
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def escape_name(name: str) -> str:
    """A path as it may be printed to a terminal: every control character (newline and tab
    too), undecodable byte and bidi override as a `\\x1b`-style escape, and `\\` doubled, so
    two different names never print alike."""
    return _NAME_RE.sub(_escape_char, name)


def escape_text(text: str) -> str:
    """File content or a message as it may be printed to a terminal: as escape_name, but
    newlines, tabs and backslashes are kept."""
    return _TEXT_RE.sub(_escape_char, text)


def decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")
