"""LLM tools over a `Sandbox`: definitions in the common function-calling shape, and one
function that runs a call and always answers with text a model can read.

    tools = sb.tools()                                   # OpenAI-style {"type": "function", ...}
    result = sb.call_tool("read_file", {"path": "/repo/README.md"})

Descriptions name the zones this trust level may read and write, so a model knows where to
look before it is refused. `call_tool` never raises: bad arguments, refusals and even internal
errors come back as a line starting with "Error:".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .errors import SandboxAPIError

if TYPE_CHECKING:
    from .sandbox import Sandbox

log = logging.getLogger(__name__)

DEFAULT_MAX_CHARS = 200_000
_PATHS = (
    "Paths are virtual: /session (your scratch space), /workspace, /repo (the project), "
    "/staged (proposed changes), /workers, and any zone the project adds"
)

Schema = dict[str, Any]


def _string(description: str) -> Schema:
    return {"type": "string", "description": description}


def _object(properties: Mapping[str, Schema], required: list[str]) -> Schema:
    return {
        "type": "object",
        "properties": dict(properties),
        "required": required,
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str  # "{reads}", "{writes}" and "{paths}" are filled in per sandbox
    parameters: Schema
    run: Callable[[Sandbox, dict[str, Any]], str]


def _read_file(sb: Sandbox, args: dict[str, Any]) -> str:
    limit = args.get("max_chars", DEFAULT_MAX_CHARS)
    text = sb.read_text(args["path"], max_chars=limit + 1)
    if len(text) > limit:
        return text[:limit] + f"\n[truncated at {limit} characters]"
    return text


def _write_file(sb: Sandbox, args: dict[str, Any]) -> str:
    if args.get("append", False):
        written = sb.append(args["path"], args["content"])
        return f"Appended {written} bytes to {sb.resolve(args['path'])}"
    written = sb.write(args["path"], args["content"])
    return f"Wrote {written} bytes to {sb.resolve(args['path'])}"


def _list_files(sb: Sandbox, args: dict[str, Any]) -> str:
    found = sb.list(args.get("path", "/"), args.get("pattern"), args.get("recursive", False))
    return "\n".join(found) if found else "(empty)"


def _stat(sb: Sandbox, args: dict[str, Any]) -> str:
    return json.dumps(asdict(sb.stat(args["path"])))


def _delete(sb: Sandbox, args: dict[str, Any]) -> str:
    sb.delete(args["path"])
    return f"Deleted {sb.resolve(args['path'])}"


def _move(sb: Sandbox, args: dict[str, Any]) -> str:
    sb.rename(args["source"], args["destination"])
    return f"Moved {sb.resolve(args['source'])} to {sb.resolve(args['destination'])}"


def _stage(sb: Sandbox, args: dict[str, Any]) -> str:
    staged = sb.stage(args["files"], args["message"])
    return (
        f"Staged {len(staged.files)} file(s) as {staged.id} in {staged.path}; "
        f"the user reviews it before it lands in the repository"
    )


def _check_permission(sb: Sandbox, args: dict[str, Any]) -> str:
    permission = sb.check_permission(args["operation"], args["path"])
    shown = {k: getattr(permission, k) for k in ("allowed", "op", "path", "zone", "trust")}
    return json.dumps({**shown, "reason": permission.reason})


def _security_context(sb: Sandbox, args: dict[str, Any]) -> str:
    return json.dumps(sb.security_context())


_TOOLS = (
    _Tool(
        "read_file",
        "Read a text file from the sandbox. {paths}. Readable zones now: {reads}.",
        _object(
            {
                "path": _string("Virtual path of the file, e.g. /repo/README.md"),
                "max_chars": {
                    "type": "integer",
                    "minimum": 1,
                    "description": f"Return at most this many characters "
                    f"(default {DEFAULT_MAX_CHARS})",
                },
            },
            ["path"],
        ),
        _read_file,
    ),
    _Tool(
        "write_file",
        "Create or replace a file (or append to it). {paths}. Writable zones now: {writes}.",
        _object(
            {
                "path": _string("Virtual path of the file, e.g. /session/working/notes.md"),
                "content": _string("The text to write"),
                "append": {
                    "type": "boolean",
                    "description": "Append instead of replacing (default false)",
                },
            },
            ["path", "content"],
        ),
        _write_file,
    ),
    _Tool(
        "list_files",
        "List files and directories, one virtual path per line. {paths}. "
        "Listable zones now: {lists}.",
        _object(
            {
                "path": _string('Directory to list (default "/": the zones)'),
                "pattern": _string("Only paths (relative to `path`) matching this glob"),
                "recursive": {
                    "type": "boolean",
                    "description": "Also list subdirectories (default false)",
                },
            },
            [],
        ),
        _list_files,
    ),
    _Tool(
        "stat",
        "Describe one file or directory (kind, size, modification time) as JSON. {paths}.",
        _object({"path": _string("Virtual path")}, ["path"]),
        _stat,
    ),
    _Tool(
        "delete",
        "Delete a file or an empty directory. {paths}. Zones where deleting is allowed now: "
        "{deletes}.",
        _object({"path": _string("Virtual path")}, ["path"]),
        _delete,
    ),
    _Tool(
        "move",
        "Rename or move a file or directory within one zone (across zones: read, write and "
        "delete instead). {paths}.",
        _object(
            {"source": _string("Virtual path now"), "destination": _string("Virtual path after")},
            ["source", "destination"],
        ),
        _move,
    ),
    _Tool(
        "stage",
        "Propose changes to the repository as one staged commit that the user reviews and "
        "lands; works even where /repo cannot be written.",
        _object(
            {
                "files": {
                    "type": "object",
                    "description": 'Repository path -> full new content, e.g. {"src/a.py": "..."}',
                    "additionalProperties": {"type": "string"},
                },
                "message": _string("The commit message; the first line is its subject"),
            },
            ["files", "message"],
        ),
        _stage,
    ),
    _Tool(
        "check_permission",
        "Ask whether an operation on a path would be allowed, and why not, without doing it.",
        _object(
            {
                "operation": {
                    "type": "string",
                    "enum": ["read", "write", "list", "delete"],
                    "description": "The operation",
                },
                "path": _string("Virtual path"),
            },
            ["operation", "path"],
        ),
        _check_permission,
    ),
    _Tool(
        "security_context",
        "Describe this sandbox as JSON: trust level, zones and what each allows, limits, "
        "deny-listed names.",
        _object({}, []),
        _security_context,
    ),
)
_BY_NAME = {tool.name: tool for tool in _TOOLS}


def _zones_allowing(sb: Sandbox) -> dict[str, str]:
    zones: Mapping[str, Mapping[str, Any]] = sb.security_context()["zones"]

    def named(key: str) -> str:
        found = [f"/{name}" for name, z in zones.items() if z.get(key)]
        return ", ".join(found) or "none"

    writes = named("write")
    create_only = [f"/{name}" for name, z in zones.items() if z.get("create_only")]
    if create_only:
        writes += f" (new files only: {', '.join(create_only)})"
    return {
        "paths": _PATHS,
        "reads": named("read"),
        "writes": writes,
        "lists": named("list"),
        "deletes": named("delete"),
    }


def tools(sb: Sandbox) -> list[dict[str, Any]]:
    """The tool definitions, OpenAI-style: {"type": "function", "function": {name,
    description, parameters}}."""
    fill = _zones_allowing(sb)
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description.format(**fill),
                "parameters": json.loads(json.dumps(tool.parameters)),
            },
        }
        for tool in _TOOLS
    ]


def anthropic_tools(sb: Sandbox) -> list[dict[str, Any]]:
    """The same tools in Anthropic's shape: {name, description, input_schema}."""
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in tools(sb)
    ]


def call_tool(sb: Sandbox, name: str, arguments: Mapping[str, Any] | str | None) -> str:
    """Run one tool; the result, or a line starting with "Error:" a model can act on."""
    tool = _BY_NAME.get(name) if isinstance(name, str) else None
    if tool is None:
        return f"Error: unknown tool {name!r}; tools: {', '.join(_BY_NAME)}"
    if isinstance(arguments, str | bytes):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as exc:
            return f"Error: invalid arguments for {name}: not JSON ({exc})"
    if arguments is None:
        arguments = {}
    problem = _problem(arguments, tool.parameters, "")
    if problem is not None:
        return f"Error: invalid arguments for {name}: {problem}"
    assert isinstance(arguments, Mapping)
    try:
        return tool.run(sb, dict(arguments))
    except SandboxAPIError as exc:
        return f"Error: {exc}"
    except Exception as exc:  # a model loop must never see a traceback
        log.exception("tool %s failed", name)
        return f"Error: internal error in {name}: {type(exc).__name__}: {exc}"


def _problem(value: object, schema: Schema, where: str) -> str | None:
    """Why `value` does not match `schema` (the subset of JSON Schema the tools use)."""
    kind = schema.get("type")
    label = f"'{where}'" if where else "the arguments"
    if kind == "object":
        if not isinstance(value, Mapping):
            return f"{label} must be an object"
        properties: Mapping[str, Schema] = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"'{key}' is required"
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if key in properties:
                sub: Schema | None = properties[key]
            elif isinstance(extra, dict):
                sub = extra
            elif extra is False:
                accepted = ", ".join(properties) or "none"
                return f"unknown argument {inner!r}; accepted: {accepted}"
            else:
                sub = None
            if sub is not None and (found := _problem(item, sub, inner)) is not None:
                return found
        return None
    if kind == "string":
        if not isinstance(value, str):
            return f"{label} must be a string"
        if "enum" in schema and value not in schema["enum"]:
            return f"{label} must be one of: {', '.join(schema['enum'])}"
        return None
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{label} must be an integer"
        if "minimum" in schema and value < schema["minimum"]:
            return f"{label} must be at least {schema['minimum']}"
        return None
    if kind == "boolean":
        return None if isinstance(value, bool) else f"{label} must be true or false"
    return None
