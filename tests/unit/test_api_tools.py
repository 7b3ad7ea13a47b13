"""LLM tools over the Sandbox API: the definitions are valid JSON Schema, survive JSON, and
every tool, called with good and bad arguments (as a dict and as JSON text), answers with text
and never raises."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from sandboxfs import Sandbox
from sandboxfs.api import tools as tool_defs

FILES = {
    "/repo/README.md": "# Project\n",
    "/workers/guide.md": "x" * 50,
    "/session/working/old.md": "old\n",
}
NAMES = [
    "read_file",
    "write_file",
    "list_files",
    "stat",
    "delete",
    "move",
    "stage",
    "check_permission",
    "security_context",
]


@pytest.fixture
def sb() -> Iterator[Sandbox]:
    with Sandbox.memory(trust="workspace", files=FILES) as sandbox:
        yield sandbox


def _schemas(sandbox: Sandbox) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in sandbox.tools()}


def test_definitions_are_json_schema_and_round_trip_through_json(sb: Sandbox) -> None:
    defined = sb.tools()
    assert [t["function"]["name"] for t in defined] == NAMES
    assert json.loads(json.dumps(defined)) == defined
    for tool in defined:
        assert tool["type"] == "function"
        assert set(tool["function"]) == {"name", "description", "parameters"}
        schema = tool["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert set(schema["required"]) <= set(schema["properties"])
        assert all(p.get("description") for p in schema["properties"].values())
    anthropic = sb.anthropic_tools()
    assert [t["name"] for t in anthropic] == NAMES
    assert all(set(t) == {"name", "description", "input_schema"} for t in anthropic)


def test_descriptions_name_the_zones_of_the_trust_level() -> None:
    def described(trust: str) -> str:
        with Sandbox.memory(trust=trust) as sandbox:
            return next(
                t["function"]["description"]
                for t in sandbox.tools()
                if t["function"]["name"] == "write_file"
            )

    assert "Writable zones now: /session (new files only: /staged)" in described("untrusted")
    assert "Writable zones now: /session, /workspace, /repo, /staged, /workers." in described(
        "full"
    )


GOOD: list[tuple[str, dict[str, Any], str]] = [
    ("read_file", {"path": "/repo/README.md"}, "# Project\n"),
    ("read_file", {"path": "/workers/guide.md", "max_chars": 10}, "[truncated at 10 characters]"),
    ("write_file", {"path": "/session/working/n.md", "content": "hi"}, "Wrote 2 bytes"),
    (
        "write_file",
        {"path": "/session/working/old.md", "content": "more", "append": True},
        "Appended 4 bytes",
    ),
    ("list_files", {"path": "/session/working"}, "/session/working/old.md"),
    ("list_files", {"path": "/", "pattern": "*/*.md", "recursive": True}, "/repo/README.md"),
    ("list_files", {}, "/repo"),
    ("stat", {"path": "/repo/README.md"}, '"kind": "file"'),
    ("delete", {"path": "/session/working/old.md"}, "Deleted /session/working/old.md"),
    (
        "move",
        {"source": "/session/working/old.md", "destination": "/session/working/new.md"},
        "Moved /session/working/old.md to /session/working/new.md",
    ),
    ("stage", {"files": {"src/a.py": "print(1)\n"}, "message": "Add a"}, "Staged 1 file(s)"),
    ("check_permission", {"operation": "write", "path": "/repo/README.md"}, '"allowed": false'),
    ("security_context", {}, '"trust": "workspace"'),
]


@pytest.mark.parametrize(("name", "arguments", "expected"), GOOD)
@pytest.mark.parametrize("as_json", [False, True])
def test_each_tool_with_good_arguments(
    sb: Sandbox, name: str, arguments: dict[str, Any], expected: str, as_json: bool
) -> None:
    jsonschema.validate(arguments, _schemas(sb)[name])
    result = sb.call_tool(name, json.dumps(arguments) if as_json else arguments)
    assert isinstance(result, str)
    assert not result.startswith("Error"), result
    assert expected in result, result


BAD: list[tuple[str, Any, str]] = [
    ("read_file", {}, "'path' is required"),
    ("read_file", {"path": 3}, "'path' must be a string"),
    ("read_file", {"path": "/x", "max_chars": 0}, "'max_chars' must be at least 1"),
    ("read_file", {"path": "/x", "max_chars": "9"}, "'max_chars' must be an integer"),
    ("read_file", {"path": "/x", "mode": "r"}, "unknown argument 'mode'"),
    ("write_file", {"path": "/x"}, "'content' is required"),
    ("write_file", {"path": "/x", "content": "y", "append": "yes"}, "must be true or false"),
    ("list_files", {"recursive": 1}, "must be true or false"),
    ("move", {"source": "/a"}, "'destination' is required"),
    ("stage", {"files": {"a": 1}, "message": "m"}, "'files.a' must be a string"),
    ("stage", {"files": [], "message": "m"}, "'files' must be an object"),
    ("check_permission", {"operation": "chmod", "path": "/x"}, "must be one of"),
    ("security_context", {"x": 1}, "unknown argument 'x'"),
    ("read_file", [], "the arguments must be an object"),
]


@pytest.mark.parametrize(("name", "arguments", "expected"), BAD)
def test_bad_arguments_are_described_and_agree_with_json_schema(
    sb: Sandbox, name: str, arguments: Any, expected: str
) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(arguments, _schemas(sb)[name])
    result = sb.call_tool(name, arguments)
    assert result.startswith(f"Error: invalid arguments for {name}: "), result
    assert expected in result, result


def test_text_that_is_not_json(sb: Sandbox) -> None:
    assert sb.call_tool("read_file", "{path").startswith(
        "Error: invalid arguments for read_file: not JSON"
    )


def test_unknown_tool_lists_the_known_ones(sb: Sandbox) -> None:
    assert sb.call_tool("rm_rf", {}) == f"Error: unknown tool 'rm_rf'; tools: {', '.join(NAMES)}"


def test_refusals_say_what_is_allowed_instead(sb: Sandbox) -> None:
    result = sb.call_tool("write_file", {"path": "/repo/README.md", "content": "x"})
    assert result.startswith("Error: Cannot write '/repo/README.md'")
    assert "writable zones: session, workspace, staged" in result
    result = sb.call_tool("read_file", {"path": "/session/working/missing.md"})
    assert result.startswith("Error:") and "/session/working/missing.md" in result


def test_an_internal_error_is_text_too(sb: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Sandbox, path: str) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Sandbox, "delete", broken)
    with pytest.raises(RuntimeError):
        Sandbox.delete(sb, "/x")
    assert sb.call_tool("delete", {"path": "/x"}) == (
        "Error: internal error in delete: RuntimeError: boom"
    )
    assert tool_defs.DEFAULT_MAX_CHARS == 200_000
