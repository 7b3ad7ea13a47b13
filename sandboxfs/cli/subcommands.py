"""A command whose subcommands have a default: `sandboxfs audit` is `audit show`, `sandboxfs
sessions` is `sessions list`.

argparse has no default subcommand, so arguments that name none are given to the default one,
and options written before the subcommand (`audit --project P verify`) are moved after it;
options that the subcommand does not take are refused by the subcommand, naming its own --help
(one line, exit 2, like every usage error).

A subcommand that deletes (`audit prune`, `sessions prune`, `staged prune`) asks first
(`ask_first`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

from sandboxfs.core.policy import Trust
from sandboxfs.errors import UserError
from sandboxfs.project.state import parse_duration

DURATION_HELP = "a whole number and a unit: s, m, h, d or w (30m, 12h, 7d)"


class _DefaultSubcommand(argparse.ArgumentParser):
    subcommands: dict[str, argparse.ArgumentParser]
    default: str
    value_options: frozenset[str]  # options that take a value, which may look like a subcommand

    def parse_known_args(  # Any: as all of ArgumentParser's overloads at once
        self, args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        argv = self._subcommand_first(list(sys.argv[1:] if args is None else args))
        parsed, extras = super().parse_known_args(argv, namespace)
        if extras:
            self.subcommands[argv[0]].error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def _subcommand_first(self, args: list[str]) -> list[str]:
        if args[:1] and args[0] in (*self.subcommands, "-h", "--help"):
            return args
        is_value = False
        for i, arg in enumerate(args):
            if arg == "--":
                break
            if arg in self.subcommands and not is_value:  # not `--op prune` or `--session show`
                return [arg, *args[:i], *args[i + 1 :]]
            is_value = arg in self.value_options
        return [self.default, *args]


def with_default(
    parser: argparse.ArgumentParser,
    subcommands: Mapping[str, argparse.ArgumentParser],
    default: str,
) -> None:
    """Make `default` the subcommand of `parser` when its arguments name none.

    `parser` was made by a subparsers action (of the caller's class, with its one-line usage
    errors); the default-subcommand parsing is added to that class, since argparse offers no
    other way to give one subcommand's parser a default subcommand."""
    parser.__class__ = type(
        f"DefaultSubcommand{type(parser).__name__}", (_DefaultSubcommand, type(parser)), {}
    )
    strict = cast(_DefaultSubcommand, parser)
    strict.subcommands = dict(subcommands)
    strict.default = default
    strict.value_options = frozenset(
        name
        for sub in subcommands.values()
        for action in sub._actions
        if action.nargs != 0
        for name in action.option_strings
    )


def ask_first(command: str, what: str, yes: bool) -> bool:
    """Whether a subcommand that deletes may go on and `what` ("drop 3 entries older than T
    from LOG"): yes with --yes; else it is asked on the terminal (only y or yes is yes, end of
    input is no); with no terminal to ask on, a usage error (one line, exit 2) naming --yes."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UserError(f"{command} would {what}: pass --yes, there is no terminal to ask on")
    print(f"{what}? [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    if not answer:
        print(file=sys.stderr)
    return answer.strip().lower() in ("y", "yes")


def duration(text: str) -> timedelta:
    """The argparse type of a prune's --older-than (a bad one is a usage error: one line,
    exit 2)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def trust_level(text: str) -> Trust:
    """A trust level as an argparse type: its name, or one line naming those accepted."""
    try:
        return Trust(text)
    except ValueError:
        accepted = ", ".join(t.value for t in Trust)
        raise argparse.ArgumentTypeError(
            f"unknown trust level {text!r}; accepted: {accepted}"
        ) from None


def project_option(parser: argparse.ArgumentParser) -> None:
    """`--project DIR` (default: the current directory), as every project command takes it."""
    parser.add_argument(
        "--project",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="project directory (default: .)",
    )
