"""Shell completion scripts for bash and zsh, generated from the argument parser by shtab.

shtab turns an argparse parser into a static script, so completing costs no Python start-up,
and the script follows the parser: a new subcommand or flag completes without touching this
module. What shtab cannot see in the parser (that --project wants a directory, that --trust
takes a level although it is parsed by a function, not by `choices`) `annotate` adds, by
destination name.

Install (bash): `sandboxfs completion bash > ~/.local/share/bash-completion/completions/sandboxfs`
or `eval "$(sandboxfs completion bash)"` in ~/.bashrc. zsh: `sandboxfs completion zsh >
~/.zfunc/_sandboxfs` with ~/.zfunc in $fpath before compinit, or `eval "$(sandboxfs completion
zsh)"` after compinit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import shlex
from collections.abc import Iterator, Sequence

from sandboxfs.cli.manpage import walk
from sandboxfs.core.policy import BUILTIN_ZONES, Trust

SHELLS = ("bash", "zsh")

_Complete = dict[str, str | dict[str, str]]


def words(values: Sequence[str]) -> _Complete:
    """A shtab `.complete` value offering fixed words, for an option whose values a `type`
    function checks (argparse `choices` would do, but would change its help and errors)."""
    name = "_sandboxfs_words_" + hashlib.sha256(" ".join(values).encode()).hexdigest()[:8]
    listed = shlex.quote(" ".join(values))
    return {
        "bash": name,
        "zsh": "(" + " ".join(shlex.quote(v) for v in values) + ")",
        "preamble": {"bash": f'{name}() {{\n  compgen -W {listed} -- "$1"\n}}\n'},
    }


@functools.cache
def complete_by_dest() -> dict[str, _Complete]:
    """What an argument completes to, by its `dest`: for every subcommand that has one, present
    or added later, since the same name means the same thing everywhere in sandboxfs."""
    import shtab  # here, not at the top: this module is imported at every start of sandboxfs

    return {
        "project": shtab.DIRECTORY,
        "mountpoint": shtab.DIRECTORY,
        "config": shtab.FILE,
        "trust": words([t.value for t in Trust]),
        "zone": words([z.value for z in BUILTIN_ZONES]),  # a project's own zones are typed out
    }


def annotate(parser: argparse.ArgumentParser) -> None:
    """Set shtab's `.complete` on every argument named in complete_by_dest(), unless it has
    `choices` (shtab completes those already) or a `.complete` of its own (the parser knows
    better)."""
    for _, node, _ in walk(parser):
        for action in node._actions:
            wanted = complete_by_dest().get(action.dest)
            if wanted is not None and not action.choices and not hasattr(action, "complete"):
                action.complete = wanted  # type: ignore[attr-defined]


@contextlib.contextmanager
def _zsh_safe_metavars(parser: argparse.ArgumentParser) -> Iterator[None]:
    """shtab writes a metavar unescaped into a zsh `_arguments` spec, where a colon ends the
    message: `HOST[:PORT]` would make zsh run `PORT]` as a completion function. Escape it
    while the script is made, then put the parser back as it was."""
    changed: list[tuple[argparse.Action, str]] = []
    try:
        for _, node, _ in walk(parser):
            for action in node._actions:
                if isinstance(action.metavar, str) and ":" in action.metavar:
                    changed.append((action, action.metavar))
                    action.metavar = action.metavar.replace(":", "\\:")
        yield
    finally:
        for action, metavar in changed:
            action.metavar = metavar


_HEADER = {
    "bash": """\
# bash completion for {prog}, made from its argument parser by `{prog} completion bash`
# (with shtab {shtab}). Install it for bash-completion to load on demand:
#   {prog} completion bash > ~/.local/share/bash-completion/completions/{prog}
# or load it in ~/.bashrc:  eval "$({prog} completion bash)"
""",
    "zsh": """\
#compdef {prog}
# zsh completion for {prog}, made from its argument parser by `{prog} completion zsh`
# (with shtab {shtab}). Install it as _{prog} in a directory of $fpath, before compinit runs:
#   mkdir -p ~/.zfunc && {prog} completion zsh > ~/.zfunc/_{prog}
#   (in ~/.zshrc: fpath=(~/.zfunc $fpath); autoload -Uz compinit; compinit)
# or load it in ~/.zshrc, after compinit:  eval "$({prog} completion zsh)"
""",
}


def _replace_header(text: str, header: str) -> str:
    """Put our header (how to install it, as docs/commands.md says) in place of shtab's, whose
    advice (a file sourced from ~/.bashrc, a zsh_completion directory) differs."""
    lines = text.splitlines(keepends=True)
    start = 1 if lines[:1] and lines[0].startswith("#compdef") else 0
    while start < len(lines) and not lines[start].strip():
        start += 1
    end = start
    if end < len(lines) and lines[end].startswith("# AUTOMATICALLY GENERATED"):
        while end < len(lines) and lines[end].startswith("#"):
            end += 1
    return header + "".join(lines[end:])


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for `shell` ("bash" or "zsh") of the command `parser` parses.

    Adds `.complete` hints to the parser (see `annotate`); otherwise leaves it as it was."""
    import shtab

    if shell not in SHELLS:
        raise ValueError(f"unsupported shell {shell!r}; supported: {', '.join(SHELLS)}")
    annotate(parser)
    with _zsh_safe_metavars(parser) if shell == "zsh" else contextlib.nullcontext():
        text = shtab.complete(parser, shell)
    header = _HEADER[shell].format(prog=parser.prog, shtab=shtab.__version__)
    return _replace_header(text, header).rstrip("\n") + "\n"
