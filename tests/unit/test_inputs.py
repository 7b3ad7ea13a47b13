"""sandboxfs.config.inputs: the bounded reader and YAML loader of every config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxfs.config.inputs import MAX_SHOWN, load_yaml, read_file, shown
from sandboxfs.errors import UserError


def test_ordinary_yaml_still_loads() -> None:
    text = "base: &b {a: 1, b: 2}\nother:\n  <<: *b\n  b: 3\nlist: [1, [2, [3]]]\n"
    assert load_yaml(text, "f") == {
        "base": {"a": 1, "b": 2},
        "other": {"a": 1, "b": 3},  # a merge is overridden, not a duplicate
        "list": [1, [2, [3]]],
    }


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a: 1\nb: 2\na: 3\n", "f: not valid YAML (line 3): duplicate key 'a'"),
        ("x:\n  y: 1\n  y: 1\n", "duplicate key 'y'"),
        ("[" * 65 + "]" * 65, "nested more than 64 levels deep"),
        ("a: &a [*a]\n", "with aliases expanded"),
    ],
)
def test_refused_in_one_line(text: str, needle: str) -> None:
    with pytest.raises(UserError) as caught:
        load_yaml(text, "f")
    assert needle in caught.value.message and "\n" not in caught.value.message


def test_read_file_refuses_what_is_not_a_small_regular_file(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(UserError, match=r"more than the 1\.0 MiB"):
        read_file(big, "config file")
    with pytest.raises(UserError, match="a directory, not a regular file"):
        read_file(tmp_path, "config file")
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "missing", "config file")
    (tmp_path / "bad.yaml").write_bytes(b"\xff\xfe")
    with pytest.raises(UserError, match="not UTF-8 text"):
        read_file(tmp_path / "bad.yaml", "config file")


def test_shown_is_short_whatever_the_value() -> None:
    deep: list[object] = [1]
    for _ in range(10_000):
        deep = [deep] * 10
    assert len(shown("x" * 10_000_000)) < MAX_SHOWN + 40
    assert len(shown(deep)) < MAX_SHOWN + 40
    assert shown("full") == "'full'"
