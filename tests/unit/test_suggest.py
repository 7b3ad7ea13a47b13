"""A mistyped flag or subcommand gets the one it was probably meant to be, in its one line."""

from __future__ import annotations

import pytest

from sandboxfs.cli.main import build_parser
from sandboxfs.errors import UserError


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["run", "--trsut", "full", "--", "true"], "; did you mean --trust?"),
        (["mount", "--tust", "full"], "; did you mean --trust?"),
        (["stauts"], "; did you mean 'status'?"),
        (["audit", "show", "--denid"], "; did you mean --denied?"),
        (["staged", "shwo", "x"], "; did you mean 'show'?"),
    ],
)
def test_a_near_miss_names_the_real_one(argv: list[str], hint: str) -> None:
    with pytest.raises(UserError) as raised:
        build_parser().parse_args(argv)
    message = str(raised.value.message)
    assert hint in message and "\n" not in message and message.endswith("--help')")


@pytest.mark.parametrize(
    "argv",
    [["run", "--xyz", "--", "true"], ["audit", "verify", "--follow"], ["zzzzzz"]],
)
def test_nothing_close_or_a_flag_of_another_subcommand_gets_no_guess(argv: list[str]) -> None:
    with pytest.raises(UserError) as raised:
        build_parser().parse_args(argv)
    assert "did you mean" not in str(raised.value.message)
