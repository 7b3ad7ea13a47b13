"""The sandboxfs(1) man page, written in roff from the argument parser.

Generated, not kept by hand, so that it cannot drift from `--help`: every subcommand (nested
ones too, such as `audit show`) and every option the parser knows is in it, with its help.
Only what the parser cannot say (exit status, files, environment) is written here.

`sandboxfs man | man -l -` reads it; `sandboxfs man > ~/.local/share/man/man1/sandboxfs.1`
installs it for `man sandboxfs`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

# (tag, text) pairs of the fixed sections; tags and texts are roff-escaped like help text.
EXIT_STATUS = [
    (
        "0",
        "Success (for doctor: every required check passed; for audit verify: the log is intact).",
    ),
    (
        "1",
        "The command failed: a check failed, the audit log is not intact or missing "
        "(audit verify), a mount is busy, hung or another user's (umount), prune was not "
        "confirmed, a staged commit was refused (staged commit), or the daemon refused a trust "
        "change (promote, demote).",
    ),
    (
        "2",
        "Usage error or invalid input (an unknown option, a project that is no directory, a "
        "bad config): one line on standard error, and nothing is left mounted.",
    ),
    ("130", "Interrupted (Ctrl-C)."),
]
RUN_EXIT_STATUS = [
    ("CMD's status", "What CMD exited with; 128+N when a signal N killed it."),
    ("125", "The sandbox could not be set up (also for usage errors): CMD never ran."),
    ("126", "CMD was found but cannot be executed."),
    ("127", "CMD was not found."),
]
FILES = [
    (
        "<project>/sandboxfs.yaml",
        "The project's settings: default trust level, deny and protect lists, permissions, "
        "cache, audit and run (network) settings. --config names another file instead.",
    ),
    (
        "<project>/.sandbox/",
        "Everything sandboxfs keeps for the project: workspaces, sessions, "
        "staged changes, daemon logs, and the audit log .sandbox/audit.jsonl. It ignores itself in "
        "git. Nothing in it is removed by itself: sessions prune, staged prune and audit prune "
        "trim it; sessions lists what the sessions take, status shows its size.",
    ),
    (
        "~/.local/state/sandboxfs/",
        "Per-user state kept out of every project: the anchors that audit verify checks the "
        "audit log against, and control/<pid>.sock, each mount's control socket.",
    ),
]
ENVIRONMENT = [
    ("SANDBOXFS_STATE_DIR", "The per-user state directory, instead of ~/.local/state/sandboxfs."),
    ("XDG_STATE_HOME", "If set (and absolute), the state directory is $XDG_STATE_HOME/sandboxfs."),
    (
        "SANDBOXFS_STAGED_FLAG",
        "Colon-separated globs of more paths that staged reviews flag as running code.",
    ),
]
SEE_ALSO = [("fusermount3", "1"), ("mount.fuse3", "8"), ("bwrap", "1")]

# -f, --trust, and a lone -- (the end of options); not the hyphens of words such as read-only.
_OPTION_WORD = re.compile(r"(?<![\w\\-])(?:--?[A-Za-z0-9][\w-]*|--(?![\w-]))")
# In a metavar: the words (italic), spaces, and the notation around them ([ ] { } | , . ( )).
_METAVAR_PART = re.compile(r"([^\s\[\]{}|,.()]+)|(\s+)|(.)")
_SENTENCE_END = re.compile(r"[.?!][\])'\"*]*$")


def escape(text: str, *, minus: bool = False) -> str:
    """Text for a roff text line: backslashes and non-ASCII as escapes, option-like words
    (-f, --trust; with `minus`, every hyphen) as `\\-` so that they print and search as the
    ASCII hyphen-minus the shell reads, whitespace collapsed (a blank line or a leading space
    would break the paragraph)."""
    text = " ".join(text.split()).replace("\\", "\\e")
    if minus:
        text = text.replace("-", "\\-")
    else:
        text = _OPTION_WORD.sub(lambda m: m.group(0).replace("-", "\\-"), text)
    return "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)


def _line(text: str) -> str:
    """A text line that roff cannot take for a request (a leading `.` or `'`)."""
    return "\\&" + text if text[:1] in (".", "'") else text


def _arg(text: str) -> str:
    """A macro argument: quoted, with its own quotes as `\\(dq`."""
    return '"' + text.replace('"', "\\(dq") + '"'


def _bold(text: str) -> str:
    return f"\\fB{escape(text, minus=True)}\\fR"


def _italic(text: str) -> str:
    return f"\\fI{escape(text, minus=True)}\\fR"


def _metavar_roff(text: str, *, literal: bool = False) -> str:
    """A metavar such as `[ARG ...]` or `OPT[,OPT...]` as one unbreakable item: its words in
    italics (bold if `literal`, as subcommand names, or if they are options, as `--`), the
    brackets and separators of the notation upright."""
    parts = []
    for word, space, other in _METAVAR_PART.findall(text):
        if word:
            parts.append(_bold(word) if literal or word.startswith("-") else _italic(word))
        else:
            parts.append("\\ " if space else escape(other, minus=True))
    return "".join(parts)


def walk(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str | None]]:
    """Every parser under `parser` (itself first), depth first, with its command path and the
    help its parent gives it; each once, under its first name (aliases share the parser)."""
    seen: set[int] = set()

    def visit(
        path: tuple[str, ...], node: argparse.ArgumentParser, help_: str | None
    ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str | None]]:
        seen.add(id(node))
        yield path, node, help_
        for action in _subparsers(node):
            helps = {a.dest: a.help for a in action._get_subactions()}
            for name, child in action.choices.items():
                if id(child) not in seen and helps.get(name) != argparse.SUPPRESS:
                    yield from visit((*path, name), child, helps.get(name))

    yield from visit((), parser, None)


def _subparsers(
    parser: argparse.ArgumentParser,
) -> list[argparse._SubParsersAction[argparse.ArgumentParser]]:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments --help shows, positionals first, as --help lists them."""
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS]
    return [a for a in shown if not a.option_strings] + [a for a in shown if a.option_strings]


def _metavar(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The argument part, as argparse shows it in --help, but a REMAINDER's own metavar
    (`-- CMD [ARG...]`) rather than argparse's `...`."""
    formatter = parser._get_formatter()
    if action.nargs == argparse.REMAINDER and isinstance(action.metavar, str):
        return action.metavar
    if action.option_strings:
        default = formatter._get_default_metavar_for_optional(action)
    else:
        default = formatter._get_default_metavar_for_positional(action)
    return formatter._format_args(action, default)


def _synopsis_item(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One argument of a synopsis, unbreakable: `--trust TRUST`, `-f`, `mountpoint`."""
    if isinstance(action, argparse._SubParsersAction):  # `{a,b,c} ...`: may break before ...
        # ... and after each comma (\: is a break point that prints nothing)
        text = _metavar_roff(_metavar(parser, action), literal=True).replace("\\ ", " ")
        return text.replace(",", ",\\:")
    if not action.option_strings:
        return _metavar_roff(_metavar(parser, action))
    item = _bold(action.option_strings[0])
    if action.nargs != 0:
        item += "\\ " + _metavar_roff(_metavar(parser, action))
    return item


def _synopsis(path: tuple[str, ...], parser: argparse.ArgumentParser, *, brief: bool) -> list[str]:
    """`.SY`/`.YS` lines for one command, in the order of argparse's usage: options (a mutually
    exclusive group as `[a | b]`), then positionals. `brief`: optional options as one
    `[options]`, for the SYNOPSIS section; the full usage is under the command."""
    groups = {
        id(a): group for group in parser._mutually_exclusive_groups for a in group._group_actions
    }
    actions = _visible(parser)
    optionals = [a for a in actions if a.option_strings]
    positionals = [a for a in actions if not a.option_strings]
    done: set[int] = set()
    items: list[str] = []
    for action in optionals:
        if id(action) in done:
            continue
        group = groups.get(id(action))
        members = [a for a in group._group_actions if a in actions] if group else [action]
        done.update(id(a) for a in members)
        required = group.required if group else action.required
        if brief and not required:
            if "[\\fIoptions\\fR]" not in items:
                items.append("[\\fIoptions\\fR]")
            continue
        inner = "\\ |\\ ".join(_synopsis_item(parser, a) for a in members)
        if len(members) > 1:
            inner = f"({inner})" if required else f"[{inner}]"
        elif not required:
            inner = f"[{inner}]"
        items.append(inner)
    items += [_synopsis_item(parser, a) for a in positionals]
    name = " ".join((parser.prog.split()[0], *path))
    # `\&` after an item ending in `.` (`[ARG...]`): not the end of a sentence, one space after.
    items = [item + "\\&" if _SENTENCE_END.search(item) else item for item in items]
    return [".SY " + _arg(escape(name, minus=True)), *map(_line, items), ".YS"]


def _option_entries(parser: argparse.ArgumentParser) -> list[str]:
    """`.TP` entries: each argument's names and metavar, then its help (%(default)s and
    friends expanded, as --help does)."""
    formatter = parser._get_formatter()
    lines: list[str] = []
    for action in _visible(parser):
        if isinstance(action, argparse._SubParsersAction):
            continue  # see _subcommand_entries
        if action.option_strings:
            names = ", ".join(_bold(s) for s in action.option_strings)
            if action.nargs != 0:
                names += " " + _metavar_roff(_metavar(parser, action))
        else:
            names = _metavar_roff(_metavar(parser, action))
        lines += [".TP", _line(names)]
        if action.help:
            lines.append(_line(escape(formatter._expand_help(action))))
    return lines


def _subcommand_entries(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
    """What the subcommands argument of `parser` says, then a `.TP` entry naming each
    subcommand with its help; each has its own subsection too."""
    lines: list[str] = []
    for action in _subparsers(parser):
        if action.help:
            lines += [".PP", _line(escape(parser._get_formatter()._expand_help(action)))]
        for sub in action._get_subactions():
            if sub.help != argparse.SUPPRESS:
                lines += [".TP", _line(_bold(" ".join((*path, sub.dest))))]
                lines += [_line(escape(sub.help))] if sub.help else []
    return lines


def _tagged(entries: list[tuple[str, str]], tag_font: str = "B") -> list[str]:
    lines: list[str] = []
    for tag, text in entries:
        lines += [".TP", _line(f"\\f{tag_font}{escape(tag)}\\fR"), _line(escape(text))]
    return lines


def render(parser: argparse.ArgumentParser, version: str, *, date: str = "") -> str:
    """The roff source of the man page (section 1) of the command `parser` parses.

    `date` goes in the footer; empty by default, so that the same parser always gives the same
    page (a build can pass the release date)."""
    prog = parser.prog.split()[0]
    description = " ".join((parser.description or "").split()).rstrip(".")
    nodes = list(walk(parser))
    commands = [(path, node, help_) for path, node, help_ in nodes if path]
    out = [
        f'.\\" Generated from the argument parser of {escape(prog)} {escape(version)} '
        f"({escape(prog)} man); do not edit.",
        f".TH {_arg(prog.upper())} 1 {_arg(date)} {_arg(f'{prog} {version}')} "
        f"{_arg('User Commands')}",
        # No hyphenation (paths and options are not words): groff's man macros turn it back
        # on at every paragraph from register HY, so that is set too.
        ".nr HY 0",
        ".nh",
        ".ad l",  # ragged right: no wide gaps in lines that hold long paths or times
        ".SH NAME",
        _line(f"{escape(prog, minus=True)} \\- {escape(description)}"),
        ".SH SYNOPSIS",
        *_synopsis((), parser, brief=False),
    ]
    for path, node, _ in commands:
        if not _subparsers(node):  # `audit` is there as `audit show` and the others
            out += _synopsis(path, node, brief=True)
    out += [".SH DESCRIPTION", _line(escape(parser.description or ""))]
    if commands:
        out += [
            ".PP",
            _line(
                f"The commands, each described under {_bold('COMMANDS')} below "
                f"({_bold(prog)} {_italic('COMMAND')} {_bold('--help')} prints the same):"
            ),
            *_subcommand_entries(parser, ()),
        ]
    out += [".SH OPTIONS", *_option_entries(parser)]
    if commands:
        out.append(".SH COMMANDS")
    for path, node, help_ in commands:
        out += [f".SS {_arg(escape(' '.join(path), minus=True))}"]
        out += _synopsis(path, node, brief=False)
        about = node.description or help_
        out += [".PP", _line(escape(about))] if about else []
        out += _option_entries(node)
        out += _subcommand_entries(node, path)
    out += ['.SH "EXIT STATUS"', *_tagged(EXIT_STATUS)]
    if any(path == ("run",) for path, _, _ in commands):
        out += [".PP", _line(f"{_bold(f'{prog} run')} exits as CMD does, like docker run:")]
        out += _tagged(RUN_EXIT_STATUS)
    out += [".SH ENVIRONMENT", *_tagged(ENVIRONMENT), ".SH FILES", *_tagged(FILES, "I")]
    out += [
        '.SH "SEE ALSO"',
        _line(", ".join(f"\\fB{escape(name)}\\fR({section})" for name, section in SEE_ALSO)),
    ]
    return "\n".join(out) + "\n"
