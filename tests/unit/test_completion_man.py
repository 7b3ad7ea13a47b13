"""Shell completion and the man page: generated from the parser, and working where they are
used, in a real bash (and zsh, when installed) and in man/groff."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxfs.cli import completion, manpage
from sandboxfs.cli.main import build_parser
from sandboxfs.core.policy import Trust

LEVELS = [t.value for t in Trust]
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "HOME": "/nonexistent"}

# Completes the line $2 as bash would on TAB at its end, with the completion function that the
# script $1 registers for `sandboxfs`; prints the candidates, one a line.
BASH_DRIVER = r"""
source <(cat "$1") || exit 97
spec=$(complete -p sandboxfs) || exit 98
fn=${spec##* -F }; fn=${fn%% *}
COMP_LINE=$2; COMP_POINT=${#COMP_LINE}
read -ra COMP_WORDS <<< "$COMP_LINE"
[[ $COMP_LINE == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
COMPREPLY=()
"$fn" sandboxfs "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
"""

# Types each line $3... with TAB at its end into an interactive zsh (in a pty) that loaded the
# script $1 as docs/commands.md says (eval after compinit); appends the candidates offered, then
# "__DONE__", to $2, and the shell's error output to $2.err.
ZSH_DRIVER = r"""
zmodload zsh/zpty
script=$1 out=$2; shift 2
zpty z zsh -f -i
zpty -w z "exec 2>>${(q)out}.err; autoload -Uz compinit; compinit -u -D"
zpty -w z "eval \"\$(<${(q)script})\"; __out=${(q)out}"
zpty -w z 'compadd() { local -a h; builtin compadd -O h "$@"; print -rl -- $h >>$__out;
  builtin compadd "$@"; }'
zpty -w z 'zle -C __complete complete-word _main_complete
  __test() { zle __complete; print -r -- __DONE__ >>$__out; zle kill-whole-line; }
  zle -N __test; bindkey "^T" __test'
for line in "$@"; do zpty -w -n z "$line"$'\C-t'; done
for i in {1..2500}; do
  (( $(grep -c __DONE__ $out 2>/dev/null || print 0) >= $# )) && break
  sleep 0.02
done
zpty -d z
"""


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "sandboxfs.bash"
    path.write_text(completion.script(build_parser(), "bash"))
    return path


@pytest.fixture(scope="module")
def cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where completion runs: one directory and one file, to tell directory from file
    completion."""
    path = tmp_path_factory.mktemp("cwd")
    (path / "projdir").mkdir()
    (path / "notes.yaml").write_text("")
    return path


def bash_complete(script: Path, line: str, cwd: Path) -> list[str]:
    result = subprocess.run(
        ["bash", "-c", BASH_DRIVER, "bash", str(script), line],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=ENV,
        timeout=60,  # compinit scans every completion dir: seconds on a loaded 2-core CI
        check=False,
    )
    assert result.returncode == 0 and not result.stderr, result
    return result.stdout.splitlines()


def commands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for path, node, _ in manpage.walk(parser):
        yield path, node


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings]


def subcommand_names(parser: argparse.ArgumentParser) -> list[str]:
    return [
        sub.dest
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for sub in action._get_subactions()
        if sub.help != argparse.SUPPRESS
    ]


# ----- completion -------------------------------------------------------------------------------


def test_bash_script_registers_a_completion(bash_script: Path) -> None:
    result = subprocess.run(
        ["bash", "-c", 'source <(cat "$1"); complete -p sandboxfs', "bash", str(bash_script)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=10,
        check=False,
    )
    assert result.returncode == 0 and not result.stderr, result
    assert re.fullmatch(r"complete .*-F \S+ sandboxfs\n", result.stdout), result.stdout


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("sandboxfs mo", ["mount"]),
        ("sandboxfs mount --tr", ["--trust"]),
        ("sandboxfs mount --trust ", LEVELS),
        ("sandboxfs mount --trust w", ["workspace"]),
        ("sandboxfs run --trust ", LEVELS),
        ("sandboxfs run --net ", ["none", "allow", "host"]),
        ("sandboxfs audit show --trust ", LEVELS),
        ("sandboxfs audit show --zone ", ["session", "workspace", "repo", "staged", "workers"]),
        ("sandboxfs mount --project ", ["projdir"]),  # directories only
        ("sandboxfs mount ", ["projdir"]),  # the mountpoint
        ("sandboxfs umount ", ["projdir"]),
        ("sandboxfs run --config n", ["notes.yaml"]),  # a file
    ],
)
def test_bash_completes(bash_script: Path, cwd: Path, line: str, expected: list[str]) -> None:
    assert sorted(bash_complete(bash_script, line, cwd)) == sorted(expected)


def test_bash_completes_every_subcommand_and_option_of_the_parser(
    bash_script: Path, cwd: Path
) -> None:
    """Nothing is hard-coded: every subcommand, nested ones too, and each of its options."""
    for path, node in commands(build_parser()):
        prefix = " ".join(("sandboxfs", *path))
        offered = bash_complete(bash_script, prefix + " -", cwd)
        assert set(option_strings(node)) <= set(offered), (prefix, offered)
        if subcommand_names(node):
            offered = bash_complete(bash_script, prefix + " ", cwd)
            assert set(subcommand_names(node)) <= set(offered), (prefix, offered)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_script_parses_and_registers(tmp_path: Path) -> None:
    script = tmp_path / "_sandboxfs"
    script.write_text(completion.script(build_parser(), "zsh"))
    assert script.read_text().startswith("#compdef sandboxfs\n")
    parsed = subprocess.run(["zsh", "-n", str(script)], capture_output=True, text=True, env=ENV)
    assert parsed.returncode == 0 and not parsed.stderr, parsed
    loaded = subprocess.run(
        [
            "zsh",
            "-f",
            "-c",
            'autoload -Uz compinit; compinit -u -D; eval "$(<$1)"; print -r -- $_comps[sandboxfs]',
            "zsh",
            str(script),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=10,
    )
    assert loaded.returncode == 0 and not loaded.stderr, loaded
    assert loaded.stdout.strip(), "no completion function registered for sandboxfs"


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completes(tmp_path: Path, cwd: Path) -> None:
    script = tmp_path / "_sandboxfs"
    script.write_text(completion.script(build_parser(), "zsh"))
    out = tmp_path / "out"
    lines = [
        "sandboxfs mo",
        "sandboxfs mount --trust ",
        "sandboxfs run --net ",
        "sandboxfs run --allow-host ",  # a metavar with a colon: HOST[:PORT]
        "sandboxfs mount --project ",
    ]
    subprocess.run(
        ["zsh", "-f", "-c", ZSH_DRIVER, "zsh", str(script), str(out), *lines],
        env={**ENV, "TERM": "dumb"},
        cwd=cwd,
        timeout=60,
        check=True,
    )
    results = [set(chunk.split()) for chunk in out.read_text().split("__DONE__")[:-1]]
    assert results == [
        {"mount"},
        set(LEVELS),
        {"none", "allow", "host"},
        set(),
        {"projdir"},
    ]
    assert Path(f"{out}.err").read_text() == ""


def test_zsh_metavar_colons_are_escaped_and_the_parser_restored() -> None:
    """shtab puts a metavar unescaped into a zsh `_arguments` spec, where `:` ends the
    message; the script escapes it and leaves the parser's help as it was."""
    parser = argparse.ArgumentParser(prog="sandboxfs")
    action = parser.add_argument("--allow-host", metavar="HOST[:PORT]", help="a host")
    text = completion.script(parser, "zsh")
    assert ":HOST[\\:PORT]:" in text
    assert action.metavar == "HOST[:PORT]"


def test_annotate_keeps_what_the_parser_says() -> None:
    parser = argparse.ArgumentParser(prog="sandboxfs")
    own = parser.add_argument("--project")
    own.complete = {"bash": "_mine", "zsh": "_mine"}  # type: ignore[attr-defined]
    choices = parser.add_argument("--trust", choices=["a", "b"])
    plain = parser.add_argument("--config")
    completion.annotate(parser)
    assert own.complete == {"bash": "_mine", "zsh": "_mine"}  # type: ignore[attr-defined]
    assert not hasattr(choices, "complete")
    assert plain.complete == completion.complete_by_dest()["config"]  # type: ignore[attr-defined]


def test_unsupported_shell_is_refused() -> None:
    with pytest.raises(ValueError, match="fish"):
        completion.script(build_parser(), "fish")


# ----- man page ---------------------------------------------------------------------------------


def sections(page: str) -> dict[str, str]:
    """The page's text by heading: `.SH X` as "X", `.SS "a b"` as "a b" (up to the next
    heading of either kind)."""
    found: dict[str, str] = {}
    name = ""
    for line in page.splitlines():
        match = re.fullmatch(r'\.S[HS] "?(.*?)"?', line)
        if match:
            name = match.group(1)
            found[name] = ""
        elif name:
            found[name] += line + "\n"
    return found


def roff(text: str) -> str:
    return manpage.escape(text, minus=True)


def test_man_page_structure() -> None:
    page = manpage.render(build_parser(), "1.2.3")
    lines = page.splitlines()
    assert lines[0].startswith('.\\"')
    assert lines[1] == '.TH "SANDBOXFS" 1 "" "sandboxfs 1.2.3" "User Commands"'
    headings = [line for line in lines if line.startswith(".SH ")]
    assert headings == [
        ".SH NAME",
        ".SH SYNOPSIS",
        ".SH DESCRIPTION",
        ".SH OPTIONS",
        ".SH COMMANDS",
        '.SH "EXIT STATUS"',
        ".SH ENVIRONMENT",
        ".SH FILES",
        '.SH "SEE ALSO"',
    ]
    assert re.fullmatch(r"sandboxfs \\- \S.*", sections(page)["NAME"].strip())
    for line in lines:
        assert line.isascii(), line
        if line.startswith("."):  # requests and macros only, none made of help text
            assert re.match(r"\.(\\\"|TH|SH|SS|SY|YS|TP|PP|nh|nr HY 0|ad l)( |$)", line), line
        else:
            assert not line.startswith("'") and line == line.strip(), line
            # every option in a text line is written with \- (a minus, not a hyphen)
            assert not re.search(r"(?<![\w\\-])-{1,2}[A-Za-z]", line), line
    exit_status = sections(page)["EXIT STATUS"]
    for code in ("0", "1", "2", "125", "126", "127"):
        assert f"\\fB{code}\\fR" in exit_status
    files = sections(page)["FILES"]
    for path in ("<project>/.sandbox/", "<project>/sandboxfs.yaml", "~/.local/state/sandboxfs"):
        assert roff(path) in files


def test_man_page_has_every_subcommand_and_option_with_its_help() -> None:
    """Walks the parser: a subcommand, option or help the generator dropped fails here."""
    parser = build_parser()
    page = manpage.render(parser, "1.2.3")
    by_heading = sections(page)
    for path, node in commands(parser):
        text = by_heading["OPTIONS" if not path else " ".join(path)]
        formatter = node._get_formatter()
        for action in node._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            for option in action.option_strings:
                assert f"\\fB{roff(option)}\\fR" in text, (path, option)
            if action.help:
                assert manpage.escape(formatter._expand_help(action)) in text, (path, action)
        for name in subcommand_names(node):
            assert f'.SS "{" ".join((*path, name))}"' in page
        usage = f'.SY "{" ".join(("sandboxfs", *path))}"'
        assert usage in (by_heading[" ".join(path)] if path else page)
        if not subcommand_names(node):  # a command one runs: in the SYNOPSIS too
            assert usage in by_heading["SYNOPSIS"]


def rendered_text(page: str) -> str:
    """What a reader sees, with groff's typographic hyphens and minus signs as ASCII."""
    result = subprocess.run(
        ["man", "-l", "-"],
        input=page,
        capture_output=True,
        text=True,
        env={**ENV, "MANWIDTH": "80"},
        timeout=20,
        check=False,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return result.stdout.replace("\u2010", "-").replace("\u2212", "-")


@pytest.mark.skipif(shutil.which("man") is None, reason="man (man-db) is not installed")
def test_man_renders_the_page_without_warnings() -> None:
    parser = build_parser()
    text = rendered_text(manpage.render(parser, "1.2.3"))
    assert text.startswith("SANDBOXFS(1)")
    words = set(re.findall(r"[\w-]+", text))
    for path, node in commands(parser):
        assert " ".join(("sandboxfs", *path)) in text
        assert set(option_strings(node)) <= words, path


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_groff_finds_nothing_to_warn_about() -> None:
    result = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z"],
        input=manpage.render(build_parser(), "1.2.3"),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=20,
        check=False,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr


def tricky_parser() -> argparse.ArgumentParser:
    """Text that roff would misread if it were not escaped, and nesting two levels deep."""
    parser = argparse.ArgumentParser(prog="tool", description=".starts with a dot \u2014 and a \\")
    parser.add_argument("--dry-run", action="store_true", help="'quoted' start; see --dry-run")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--one", metavar="N", type=int, default=3, help="default %(default)s")
    group.add_argument("--two", action="store_true", help="not one")
    sub = parser.add_subparsers(dest="cmd")
    outer = sub.add_parser("outer", help="outer help")
    inner = outer.add_subparsers(dest="inner").add_parser("inner", help="inner help")
    inner.add_argument("paths", nargs="*", help=".hidden files too")
    inner.add_argument("-x", choices=["a", "b"], help="%(choices)s")
    return parser


def test_man_page_escapes_roff() -> None:
    page = manpage.render(tricky_parser(), "0")
    assert "\\&.starts with a dot \\[u2014] and a \\e" in page
    assert "\\&'quoted' start; see \\-\\-dry\\-run" in page
    assert "default 3" in page and "a, b" in page
    assert "hidden" not in page.replace(".hidden files", "")
    assert '.SS "outer inner"' in page
    assert "(\\fB\\-\\-one\\fR\\ \\fIN\\fR\\ |\\ \\fB\\-\\-two\\fR)" in page  # required group
    assert "[\\fIpaths\\fR\\ ...]" in page


@pytest.mark.skipif(shutil.which("man") is None, reason="man (man-db) is not installed")
def test_man_renders_escaped_text_as_written() -> None:
    text = rendered_text(manpage.render(tricky_parser(), "0"))
    assert ".starts with a dot \u2014 and a \\" in text
    assert "'quoted' start; see --dry-run" in text
    assert "tool outer inner" in text


# ----- one subcommand's parser ---------------------------------------------------------------


def test_a_command_line_gets_the_same_parser_for_its_subcommand_alone() -> None:
    """main() builds only the subcommand the command line names: each one, nested ones too,
    must parse and explain exactly as in the whole parser."""
    whole = dict(commands(build_parser()))
    tops = {path[0] for path in whole if path}
    assert len(tops) > 10
    for top in tops:
        alone = dict(commands(build_parser(top)))
        assert {p for p in whole if p[:1] == (top,)} <= set(alone), top
        for path, node in alone.items():
            if path:  # the top level lists fewer commands; each command's own is the same
                assert node.format_help() == whole[path].format_help(), path
