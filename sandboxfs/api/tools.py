"""LLM tools over a `Sandbox`: definitions in the common function-calling shape, and one
function that runs a call and always answers with text a model can read.

    tools = sb.tools()                                   # OpenAI-style {"type": "function", ...}
    result = sb.call_tool("read_file", {"path": "/repo/README.md"})

Descriptions name the zones this sandbox has and what its trust level may do in each, so a
model knows where to look before it is refused. `call_tool` never raises: bad arguments,
refusals and even internal errors come back as a line starting with "Error:".
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .errors import NotFound, SandboxAPIError

if TYPE_CHECKING:
    from .sandbox import Sandbox

log = logging.getLogger(__name__)

DEFAULT_MAX_CHARS = 200_000

# What each built-in zone is for, in a model's terms; a project's zones are "a project zone".
_ZONE_ROLES = {
    "session": "your own scratch space: working/, inputs/, outputs/, home/",
    "workspace": "kept across the sessions of this workspace: cache/, data/",
    "repo": "the project's repository",
    "staged": "changes proposed for the repository, for the user to review",
    "workers": "worker definitions",
}

Schema = dict[str, Any]


def _string(description: str) -> Schema:
    return {"type": "string", "description": description}


def _boolean(description: str) -> Schema:
    return {"type": "boolean", "description": description}


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
    # "{paths}" (the zones and what each is for), "{zones}" (their names), "{access}",
    # "{lists}" and "{deletes}" are filled in per sandbox when the definitions are made
    description: str
    parameters: Schema
    run: Callable[[Sandbox, dict[str, Any]], str]


def _read_file(sb: Sandbox, args: dict[str, Any]) -> str:
    limit = int(args.get("max_chars", DEFAULT_MAX_CHARS))  # 5.0 is an integer to JSON Schema
    text = sb.read_text(args["path"], max_chars=limit + 1)  # one more: was anything cut?
    if len(text) > limit:
        return text[:limit] + f"\n[truncated at {limit} characters]"
    return text


def _write_file(sb: Sandbox, args: dict[str, Any]) -> str:
    path, content = args["path"], args["content"]
    append = bool(args.get("append", False))
    put = sb.append if append else sb.write
    created: list[str] = []
    try:
        written = put(path, content)
    except NotFound:
        created = _make_parents(sb, posixpath.dirname(sb.resolve(path)))
        if not created:  # nothing was missing, or a zone that hides what it holds
            raise
        try:
            written = put(path, content)
        except SandboxAPIError:
            for directory in reversed(created):  # leave the tree as it was, where allowed
                with contextlib.suppress(SandboxAPIError):
                    sb.delete(directory)
            raise
    verb = "Appended" if append else "Wrote"
    made = f" (created {', '.join(created)})" if created else ""
    return f"{verb} {written} bytes to {sb.resolve(path)}{made}"


def _make_parents(sb: Sandbox, directory: str) -> list[str]:
    """Create the missing directories down to `directory` (not a zone root); those created,
    top first. [] if none was missing, or if the zone may not be written at all: an unreadable
    zone says "not found" for what it hides, and its own error says more than mkdir's would.
    A refusal to create raises the error that names its cause."""
    zone = sb.security_context()["zones"].get(directory.split("/")[1], {})
    if not (zone.get("write") or zone.get("create_only")):
        return []
    missing: list[str] = []
    while directory.count("/") > 1:  # below a zone root
        try:
            sb.stat(directory)
            break
        except NotFound:
            missing.append(directory)
            directory = posixpath.dirname(directory)
    missing.reverse()
    created: list[str] = []
    try:
        for directory in missing:
            sb.mkdir(directory)
            created.append(directory)
    except SandboxAPIError:
        for directory in reversed(created):
            with contextlib.suppress(SandboxAPIError):
                sb.delete(directory)
        raise
    return created


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
        f"Staged {len(staged.files)} file(s) as {staged.id} in {staged.path} "
        f"({', '.join(staged.files)}); the user reviews it before it lands in the repository"
    )


def _check_permission(sb: Sandbox, args: dict[str, Any]) -> str:
    permission = sb.check_permission(args["operation"], args["path"])
    shown = ("allowed", "op", "path", "zone", "trust", "reason")
    return json.dumps({key: getattr(permission, key) for key in shown})


def _security_context(sb: Sandbox, args: dict[str, Any]) -> str:
    return json.dumps(sb.security_context())


_TOOLS = (
    _Tool(
        "read_file",
        "Read a text file and return its contents (bytes that are not UTF-8 become U+FFFD; "
        "a long file is cut at max_chars, with a note saying so). {paths} {access}",
        _object(
            {
                "path": _string("Virtual path of the file, e.g. /session/working/notes.md"),
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
        "Create a file or replace its contents, or append to it; missing parent directories "
        "are created. {zones} {access}",
        _object(
            {
                "path": _string("Virtual path of the file, e.g. /session/working/notes.md"),
                "content": _string("The text to write"),
                "append": _boolean("Append to the file instead of replacing it (default false)"),
            },
            ["path", "content"],
        ),
        _write_file,
    ),
    _Tool(
        "list_files",
        "List the entries of a directory, one virtual path per line, sorted; listing / gives "
        "the zones. Deny-listed entries are listed but their contents cannot be read, and a "
        "recursive listing skips directories that may not be listed. {paths} {access} {lists}",
        _object(
            {
                "path": _string('Virtual path of the directory (default "/")'),
                "pattern": _string(
                    'Only entries whose path relative to `path` matches this glob ("*" also '
                    'matches "/"), e.g. "*.py"'
                ),
                "recursive": _boolean("Also list everything below (default false)"),
            },
            [],
        ),
        _list_files,
    ),
    _Tool(
        "stat",
        "Describe one file or directory as JSON: path, zone, kind (file, dir, symlink, other), "
        "size in bytes, mtime (seconds since the epoch), created_here (made by this "
        "sandbox). {zones}",
        _object({"path": _string("Virtual path of the file or directory")}, ["path"]),
        _stat,
    ),
    _Tool(
        "delete",
        "Delete a file or an empty directory. {zones} {access} {deletes}",
        _object({"path": _string("Virtual path of the file or directory")}, ["path"]),
        _delete,
    ),
    _Tool(
        "move",
        "Rename or move a file or directory within one zone, replacing a file (or an empty "
        "directory) at the destination. Between zones, read, write and delete instead. "
        "{zones} {access}",
        _object(
            {
                "source": _string("Virtual path of what to move"),
                "destination": _string("Virtual path it gets, in the same zone"),
            },
            ["source", "destination"],
        ),
        _move,
    ),
    _Tool(
        "stage",
        "Propose changes to the repository as one staged commit, written to /staged/<id>/, "
        "which the user reviews and lands; this works even where /repo cannot be written. "
        "Give each changed file's full new content, not a diff.",
        _object(
            {
                "files": {
                    "type": "object",
                    "description": "Repository path (relative to the repository root, or "
                    'starting with /repo/) -> the file\'s full new content, e.g. {"src/a.py": '
                    '"print(1)\\n"}',
                    "additionalProperties": {"type": "string"},
                    "minProperties": 1,
                },
                "message": _string("The commit message; its first line is the subject"),
            },
            ["files", "message"],
        ),
        _stage,
    ),
    _Tool(
        "check_permission",
        "Ask, without doing it, whether an operation on a path would be allowed; answers with "
        "JSON: allowed, op, path, zone, trust and the reason it would be refused. Sizes and "
        "quotas are not judged. {zones}",
        _object(
            {
                "operation": {
                    "type": "string",
                    "enum": ["read", "write", "list", "delete"],
                    "description": "The operation to ask about",
                },
                "path": _string("Virtual path"),
            },
            ["operation", "path"],
        ),
        _check_permission,
    ),
    _Tool(
        "security_context",
        "Describe this sandbox as JSON: its trust level, its zones and what each allows "
        "(read, write, list, delete, create_only), limits, and the deny-listed names.",
        _object({}, []),
        _security_context,
    ),
)
_BY_NAME = {tool.name: tool for tool in _TOOLS}


def _fill(sb: Sandbox) -> dict[str, str]:
    """The per-sandbox parts of the descriptions, from its security context."""
    context = sb.security_context()
    zones: Mapping[str, Mapping[str, Any]] = context["zones"]

    def allowing(key: str) -> str:
        return ", ".join(f"/{name}" for name, z in zones.items() if z.get(key)) or "none"

    roles = "; ".join(f"/{name} ({_ZONE_ROLES.get(name, 'a project zone')})" for name in zones)
    names = ", ".join(f"/{name}" for name in zones)
    writes = allowing("write")
    create_only = [f"/{name}" for name, z in zones.items() if z.get("create_only")]
    if create_only:
        writes += f"; new files only: {', '.join(create_only)}"
    trust = context.get("trust", "?")
    return {
        "paths": f"Paths are virtual and start with a zone: {roles}.",
        "zones": f"Paths are virtual and start with a zone: {names}.",
        "access": f"At trust level {trust} you may read: {allowing('read')}; write: {writes}.",
        "lists": f"List: {allowing('list')}.",
        "deletes": f"Delete: {allowing('delete')}.",
    }


def tools(sb: Sandbox) -> list[dict[str, Any]]:
    """The tool definitions, OpenAI-style: {"type": "function", "function": {name,
    description, parameters}}; the descriptions reflect the sandbox as it is now."""
    fill = _fill(sb)
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description.format(**fill),
                "parameters": json.loads(json.dumps(tool.parameters)),  # a copy of its own
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


def call_tool(sb: Sandbox, name: str, arguments: Mapping[str, Any] | str | None = None) -> str:
    """Run one tool; its result, or a line starting with "Error:" a model can act on.
    `arguments` is a mapping or its JSON text ("" and None mean no arguments)."""
    try:
        return _call(sb, name, arguments)
    except Exception as exc:  # a model loop must never see a traceback
        log.exception("tool %r failed", name)
        shown = name if isinstance(name, str) else repr(name)
        return f"Error: internal error in {shown}: {type(exc).__name__}: {exc}"


def _call(sb: Sandbox, name: str, arguments: object) -> str:
    tool = _BY_NAME.get(name) if isinstance(name, str) else None
    if tool is None:
        return f"Error: unknown tool {name!r}; tools: {', '.join(_BY_NAME)}"
    if isinstance(arguments, str | bytes | bytearray):
        try:
            arguments = json.loads(arguments or "{}")
        except (ValueError, RecursionError) as exc:
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


def _problem(value: object, schema: Schema, where: str) -> str | None:
    """Why `value` does not match `schema` (the subset of JSON Schema the tools use), or None."""
    kind = schema.get("type")
    label = f"'{where}'" if where else "the arguments"
    if kind == "object":
        return _object_problem(value, schema, where, label)
    if kind == "string":
        return _string_problem(value, schema, label)
    if kind == "integer":
        return _integer_problem(value, schema, label)
    if kind == "boolean":
        return None if isinstance(value, bool) else f"{label} must be true or false"
    return None


def _object_problem(value: object, schema: Schema, where: str, label: str) -> str | None:
    """An object's problem: a required key missing, too few entries, an unknown key, or the
    first of its values' own problems."""
    if not isinstance(value, Mapping):
        return f"{label} must be an object"
    properties: Mapping[str, Schema] = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in value:
            return f"'{key}' is required"
    least = schema.get("minProperties", 0)
    if len(value) < least:
        return f"{label} must have at least {least} entr{'y' if least == 1 else 'ies'}"
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


def _string_problem(value: object, schema: Schema, label: str) -> str | None:
    if not isinstance(value, str):
        return f"{label} must be a string"
    if "enum" in schema and value not in schema["enum"]:
        return f"{label} must be one of: {', '.join(schema['enum'])}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON may carry half of a surrogate pair: "\ud83d"
        return f"{label} is not valid Unicode text (it has an unpaired surrogate)"
    return None


def _integer_problem(value: object, schema: Schema, label: str) -> str | None:
    # As in JSON Schema, 5.0 is an integer; True is not.
    whole = isinstance(value, float) and value.is_integer()
    if not (isinstance(value, int) and not isinstance(value, bool)) and not whole:
        return f"{label} must be an integer"
    assert isinstance(value, int | float)
    if "minimum" in schema and value < schema["minimum"]:
        return f"{label} must be at least {schema['minimum']}"
    return None
