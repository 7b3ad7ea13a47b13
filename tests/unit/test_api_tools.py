"""LLM tools over the Sandbox API: the definitions are valid JSON Schema, survive JSON, and
describe the zones of the trust level; every tool, called with good and bad arguments (as a
dict and as JSON text), answers with text and never raises."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema  # type: ignore[import-untyped,unused-ignore]
import pytest

from sandboxfs import Sandbox
from sandboxfs.api import tools as tool_defs
from sandboxfs.config.model import load

FILES = {
    "/workspace/data/README.md": "# Data\n",
    "/workers/guide.md": "x" * 50,
    "/session/working/old.md": "old\n",
    "/repo/README.md": "# Project\n",
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
    with Sandbox.memory(trust="session", files=FILES) as sandbox:
        yield sandbox


def _schemas(sandbox: Sandbox) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in sandbox.tools()}


def _description(sandbox: Sandbox, name: str) -> str:
    found = [t["function"]["description"] for t in sandbox.tools() if t["function"]["name"] == name]
    assert len(found) == 1
    return str(found[0])


# ----- the definitions --------------------------------------------------------------------------


def test_definitions_are_json_schema_and_round_trip_through_json(sb: Sandbox) -> None:
    defined = sb.tools()
    assert [t["function"]["name"] for t in defined] == NAMES
    assert json.loads(json.dumps(defined)) == defined
    for tool in defined:
        assert tool["type"] == "function"
        assert set(tool["function"]) == {"name", "description", "parameters"}
        assert tool["function"]["description"].strip()
        schema = tool["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert isinstance(schema["required"], list)
        assert set(schema["required"]) <= set(schema["properties"])
        for prop in schema["properties"].values():
            assert prop["description"] and prop["type"] in {
                "string",
                "integer",
                "boolean",
                "object",
            }
    schemas = _schemas(sb)
    assert schemas["read_file"]["required"] == ["path"]
    assert schemas["read_file"]["properties"]["max_chars"]["minimum"] == 1
    assert schemas["check_permission"]["properties"]["operation"]["enum"] == [
        "read",
        "write",
        "list",
        "delete",
    ]
    assert schemas["security_context"]["properties"] == {}


def test_anthropic_tools_are_the_same_table(sb: Sandbox) -> None:
    anthropic = sb.anthropic_tools()
    assert json.loads(json.dumps(anthropic)) == anthropic
    assert all(set(t) == {"name", "description", "input_schema"} for t in anthropic)
    assert [(t["name"], t["description"], t["input_schema"]) for t in anthropic] == [
        (f["name"], f["description"], f["parameters"]) for f in (t["function"] for t in sb.tools())
    ]


def test_each_call_gets_its_own_copy(sb: Sandbox) -> None:
    first = sb.tools()
    first[0]["function"]["parameters"]["properties"].clear()
    assert sb.tools()[0]["function"]["parameters"]["properties"]


def test_descriptions_name_the_zones_of_the_trust_level() -> None:
    with Sandbox.memory(trust="untrusted") as sandbox:
        untrusted = _description(sandbox, "write_file")
        assert (
            "At trust level untrusted you may read: /session, /workers; "
            "write: /session; new files only: /staged." in untrusted
        )
        assert "Delete: /session." in _description(sandbox, "delete")
    with Sandbox.memory(trust="full") as sandbox:
        full = _description(sandbox, "write_file")
        everything = "/session, /workspace, /repo, /staged, /workers"
        assert f"At trust level full you may read: {everything}; write: {everything}." in full
        assert "/repo (the project's repository)" in _description(sandbox, "read_file")
    assert untrusted != full
    for name in ("read_file", "write_file", "list_files", "delete", "move"):
        with Sandbox.memory(trust="session") as sandbox:
            assert "write: /session, /workspace, /staged." in _description(sandbox, name)


def test_descriptions_name_project_zones(tmp_path: Path) -> None:
    config = "zones:\n  data:\n    path: ../datasets\n    permissions: {session: rl}\n"
    (tmp_path / "sandboxfs.yaml").write_text(config)
    files = {"/data/d.csv": "a,b\n"}
    with Sandbox.memory(trust="session", files=files, config=load(tmp_path)) as sandbox:
        assert "/data (a project zone)" in _description(sandbox, "read_file")
        assert "read: /session, /workspace, /staged, /workers, /data;" in _description(
            sandbox, "read_file"
        )
        assert sandbox.call_tool("read_file", {"path": "/data/d.csv"}) == "a,b\n"
        refused = sandbox.call_tool("write_file", {"path": "/data/d.csv", "content": "x"})
        assert refused.startswith("Error: Cannot write '/data/d.csv'"), refused


# ----- good arguments ---------------------------------------------------------------------------

GOOD: list[tuple[str, dict[str, Any], str]] = [
    ("read_file", {"path": "/workspace/data/README.md"}, "# Data\n"),
    ("read_file", {"path": "/workers/guide.md", "max_chars": 50}, "x" * 50),
    ("write_file", {"path": "/session/working/n.md", "content": "hé"}, "Wrote 3 bytes"),
    (
        "write_file",
        {"path": "/session/working/old.md", "content": "more", "append": True},
        "Appended 4 bytes to /session/working/old.md",
    ),
    ("list_files", {"path": "/session/working"}, "/session/working/old.md"),
    ("list_files", {"path": "/", "pattern": "*/*.md", "recursive": True}, "/workers/guide.md"),
    ("list_files", {}, "/repo\n/session\n/staged\n/workers\n/workspace"),
    ("list_files", {"path": "/session/outputs"}, "(empty)"),
    ("stat", {"path": "/workspace/data/README.md"}, '"kind": "file"'),
    ("delete", {"path": "/session/working/old.md"}, "Deleted /session/working/old.md"),
    (
        "move",
        {"source": "/session/working/old.md", "destination": "/session/outputs/new.md"},
        "Moved /session/working/old.md to /session/outputs/new.md",
    ),
    ("stage", {"files": {"src/a.py": "print(1)\n"}, "message": "Add a"}, "Staged 1 file(s) as "),
    ("check_permission", {"operation": "write", "path": "/repo/README.md"}, '"allowed": false'),
    ("check_permission", {"operation": "read", "path": "/workers/guide.md"}, '"allowed": true'),
    ("security_context", {}, '"trust": "session"'),
]


def test_every_tool_has_a_good_case() -> None:
    assert {name for name, _, _ in GOOD} == set(NAMES)


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


def test_results_in_detail(sb: Sandbox) -> None:
    call = sb.call_tool
    assert call("write_file", {"path": "/session/working/n.md", "content": "hé"}) == (
        "Wrote 3 bytes to /session/working/n.md"
    )
    assert call(
        "write_file", {"path": "session/working/../working/n.md", "content": "!", "append": True}
    ) == ("Appended 1 bytes to /session/working/n.md")
    assert call("read_file", {"path": "/session/working/n.md"}) == "hé!"
    assert call("read_file", {"path": "/workers/guide.md", "max_chars": 10}) == (
        "x" * 10 + "\n[truncated at 10 characters]"
    )
    assert call("read_file", {"path": "/workers/guide.md", "max_chars": 50}) == "x" * 50
    assert call("read_file", {"path": "/workers/guide.md", "max_chars": 49.0}).endswith(
        "\n[truncated at 49 characters]"
    )
    assert call("list_files", {"path": "/session", "pattern": "*.md", "recursive": True}) == (
        "/session/working/n.md\n/session/working/old.md"
    )
    info = json.loads(call("stat", {"path": "/session/working/n.md"}))
    assert info["path"] == "/session/working/n.md" and info["zone"] == "session"
    assert (info["kind"], info["size"], info["created_here"]) == ("file", 4, True)
    permission = json.loads(call("check_permission", {"operation": "write", "path": "/repo/a"}))
    assert {k: permission[k] for k in ("allowed", "zone", "trust")} == {
        "allowed": False,
        "zone": "repo",
        "trust": "session",
    }
    assert "writable zones: session, workspace, staged" in permission["reason"]
    assert json.loads(call("security_context", None)) == sb.security_context()
    assert json.loads(call("security_context", "")) == sb.security_context()
    assert json.loads(call("security_context", MappingProxyType({}))) == sb.security_context()


def test_stage_writes_a_staged_commit(sb: Sandbox) -> None:
    result = sb.call_tool(
        "stage", {"files": {"src/a.py": "print(1)\n", "/repo/b.md": "b\n"}, "message": "Add"}
    )
    match = re.fullmatch(
        r"Staged 2 file\(s\) as (\S+) in /staged/(\S+) \(src/a.py, b.md\); the user reviews it "
        r"before it lands in the repository",
        result,
    )
    assert match is not None and match[1] == match[2], result
    assert sb.read_text(f"/staged/{match[1]}/message.txt") == "Add"
    assert sb.read_text(f"/staged/{match[1]}/files/src/a.py") == "print(1)\n"


def test_write_file_creates_missing_parent_directories(tmp_path: Path) -> None:
    (tmp_path / "sandboxfs.yaml").write_text("limits:\n  session:\n    suffixes: [.md]\n")
    with Sandbox.memory(trust="session", config=load(tmp_path)) as sandbox:
        result = sandbox.call_tool(
            "write_file", {"path": "/session/working/a/b/c.md", "content": "x"}
        )
        assert result == (
            "Wrote 1 bytes to /session/working/a/b/c.md "
            "(created /session/working/a, /session/working/a/b)"
        )
        assert sandbox.read_text("/session/working/a/b/c.md") == "x"
        # A refused write leaves no directories behind.
        result = sandbox.call_tool(
            "write_file", {"path": "/session/working/d/e/run.sh", "content": "x"}
        )
        assert result.startswith("Error: Cannot write '/session/working/d/e/run.sh'"), result
        assert "allowed suffixes: .md" in result
        assert sandbox.list("/session/working") == ["/session/working/a"]
    with Sandbox.memory(trust="untrusted", files={"/repo/src/b.py": "b"}) as sandbox:
        # /staged is create-only at untrusted: new directories and files are fine.
        result = sandbox.call_tool(
            "write_file", {"path": "/staged/fix1/files/src/a.py", "content": "x"}
        )
        assert result.endswith("(created /staged/fix1, /staged/fix1/files, /staged/fix1/files/src)")
        # A zone that may not be written keeps its own error (and hides what it holds).
        result = sandbox.call_tool("write_file", {"path": "/repo/src/a.py", "content": "x"})
        assert result.startswith("Error: Cannot write '/repo/src/a.py'"), result
        result = sandbox.call_tool("write_file", {"path": "/workers/a/b.md", "content": "x"})
        assert result == "Error: Cannot write '/workers/a/b.md': /workers/a does not exist"


# ----- bad arguments ----------------------------------------------------------------------------

BAD: list[tuple[str, Any, str]] = [
    ("read_file", {}, "'path' is required"),
    ("read_file", {"path": 3}, "'path' must be a string"),
    ("read_file", {"path": None}, "'path' must be a string"),
    ("read_file", {"path": "/x", "max_chars": 0}, "'max_chars' must be at least 1"),
    ("read_file", {"path": "/x", "max_chars": -5}, "'max_chars' must be at least 1"),
    ("read_file", {"path": "/x", "max_chars": "9"}, "'max_chars' must be an integer"),
    ("read_file", {"path": "/x", "max_chars": 1.5}, "'max_chars' must be an integer"),
    ("read_file", {"path": "/x", "max_chars": True}, "'max_chars' must be an integer"),
    (
        "read_file",
        {"path": "/x", "mode": "r"},
        "unknown argument 'mode'; accepted: path, max_chars",
    ),
    ("write_file", {"path": "/x"}, "'content' is required"),
    ("write_file", {"path": "/x", "content": "y", "append": "yes"}, "must be true or false"),
    ("list_files", {"recursive": 1}, "'recursive' must be true or false"),
    ("list_files", {"pattern": ["*.md"]}, "'pattern' must be a string"),
    ("stat", {"file": "/x"}, "'path' is required"),
    ("delete", {"path": "/x", "force": True}, "unknown argument 'force'"),
    ("move", {"source": "/a"}, "'destination' is required"),
    ("stage", {"files": {"a": 1}, "message": "m"}, "'files.a' must be a string"),
    ("stage", {"files": [], "message": "m"}, "'files' must be an object"),
    ("stage", {"files": {}, "message": "m"}, "'files' must have at least 1 entry"),
    ("stage", {"files": {"a": "b"}}, "'message' is required"),
    ("check_permission", {"operation": "chmod", "path": "/x"}, "must be one of: read, write"),
    ("security_context", {"x": 1}, "unknown argument 'x'; accepted: none"),
    ("read_file", [], "the arguments must be an object"),
    ("read_file", "/repo/README.md", "not JSON"),
]


@pytest.mark.parametrize(("name", "arguments", "expected"), BAD)
def test_bad_arguments_are_described_and_agree_with_json_schema(
    sb: Sandbox, name: str, arguments: Any, expected: str
) -> None:
    if not isinstance(arguments, str):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(arguments, _schemas(sb)[name])
        as_text = sb.call_tool(name, json.dumps(arguments))
        assert as_text.startswith(f"Error: invalid arguments for {name}: "), as_text
        assert expected in as_text, as_text
    result = sb.call_tool(name, arguments)
    assert result.startswith(f"Error: invalid arguments for {name}: "), result
    assert expected in result, result


@pytest.mark.parametrize("text", ["{path", "[1,", "[" * 100_000, "'path'", "{} {}"])
def test_text_that_is_not_json(sb: Sandbox, text: str) -> None:
    assert sb.call_tool("read_file", text).startswith(
        "Error: invalid arguments for read_file: not JSON ("
    )


@pytest.mark.parametrize("text", ["[]", "3", '"path"', "true"])
def test_json_that_is_not_an_object(sb: Sandbox, text: str) -> None:
    assert sb.call_tool("read_file", text) == (
        "Error: invalid arguments for read_file: the arguments must be an object"
    )


def test_text_with_half_a_surrogate_pair(sb: Sandbox) -> None:
    result = sb.call_tool("write_file", '{"path": "/session/a.md", "content": "\\ud83d"}')
    assert result == (
        "Error: invalid arguments for write_file: 'content' is not valid Unicode text "
        "(it has an unpaired surrogate)"
    )
    assert sb.list("/session", pattern="a.md") == []


def test_unknown_tool_lists_the_known_ones(sb: Sandbox) -> None:
    expected = f"Error: unknown tool 'rm_rf'; tools: {', '.join(NAMES)}"
    assert sb.call_tool("rm_rf", {}) == expected
    assert sb.call_tool("rm_rf", "not even JSON") == expected
    odd: Any = ["read_file"]
    assert sb.call_tool(odd, {}).startswith("Error: unknown tool ['read_file']; tools: read_file")


# ----- refusals and failures --------------------------------------------------------------------


def test_refusals_say_what_is_allowed_instead(sb: Sandbox) -> None:
    result = sb.call_tool("write_file", {"path": "/repo/README.md", "content": "x"})
    assert result == (
        "Error: Cannot write '/repo/README.md': repo is not writable at trust level session; "
        "writable zones: session, workspace, staged; to change the repository, propose the "
        "change with stage: it goes to /staged/<id>/ for the user to review and commit"
    )
    result = sb.call_tool("read_file", {"path": "/repo/README.md"})
    assert result.startswith("Error: Cannot read '/repo/README.md'")
    assert "readable zones: session, workspace, staged, workers" in result
    result = sb.call_tool("read_file", {"path": "/session/working/missing.md"})
    assert result.startswith("Error:") and "/session/working/missing.md" in result
    result = sb.call_tool("list_files", {"path": "/elsewhere"})
    assert result.startswith("Error: Cannot list '/elsewhere'") and "/session" in result
    result = sb.call_tool("stage", {"files": {"../x": "y"}, "message": "m"})
    assert result.startswith("Error: Cannot stage '../x'"), result
    result = sb.call_tool(
        "move", {"source": "/session/working/old.md", "destination": "/workspace/old.md"}
    )
    assert result.startswith("Error: Cannot rename '/session/working/old.md'"), result
    assert sb.read_text("/session/working/old.md") == "old\n"


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
