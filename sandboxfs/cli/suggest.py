"""What a mistyped flag or command was probably meant to be, for a usage error's one line."""

from __future__ import annotations

import argparse
import difflib
import re

_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (.*)$")
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)'")


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _parsers(sub)
    return found


def _options(parser: argparse.ArgumentParser) -> list[str]:
    names = {s for p in _parsers(parser) for a in p._actions for s in a.option_strings}
    return sorted(names)


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(
        str(choice)
        for p in _parsers(parser)
        for action in p._actions
        if action.choices is not None
        for choice in action.choices
    )


def _closest(word: str, candidates: list[str]) -> str | None:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.7)
    return match[0] if match else None


def suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """`; did you mean X?` for the first unknown flag or choice in argparse's `message` that
    is close to one `parser` (the one that refused it) or its subcommands accept, else ''."""
    unknown = _UNRECOGNIZED.match(message)
    if unknown is not None:
        options = _options(parser)
        for word in unknown.group(1).split():
            flag = word.split("=", 1)[0]
            if flag in options:  # a flag of another subcommand: no spelling to fix
                continue
            if flag.startswith("-") and (close := _closest(flag, options)) is not None:
                return f"; did you mean {close}?"
        return ""
    invalid = _INVALID_CHOICE.search(message)
    if invalid is not None and (close := _closest(invalid.group(1), _choices(parser))):
        return f"; did you mean {close!r}?"
    return ""
