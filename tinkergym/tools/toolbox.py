"""Tool calling for text environments: schemas, a tool box, and a tolerant tool-call parser.

- :func:`function_schema` (from :mod:`tinkergym.tools.schemas`) turns a typed Python function with a
  Google-style docstring into the tool schema OpenAI-style APIs and chat templates take.

- :class:`ToolBox` holds :class:`Tool` objects; :meth:`ToolBox.call` validates a call's arguments
  against the schema and runs the tool. Every problem (unknown tool, missing, unknown or mistyped
  argument, an exception inside the tool) comes back as an ``"Error: ..."`` string for the model to
  read: it never raises.
- :func:`parse_tool_calls` reads the calls out of a model message: ``<tool_call>...</tool_call>``
  blocks (Qwen/Hermes chat templates), plain JSON objects or lists (optionally in a fenced
  ``json`` code block), ``"arguments"`` given as a JSON string (OpenAI style) and ``"parameters"``
  as an alias of ``"arguments"`` (Llama 3.1). Malformed calls become ``errors`` entries; it never
  raises, whatever the input. JSON nested deeper than :data:`MAX_JSON_DEPTH` is malformed too, so
  the recursive walks that follow (validation, ``json.dumps``, the tool itself) stay shallow.

Standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable

from tinkergym.plumbing import timeline
from tinkergym.errors import ConfigError
from tinkergym.tools.schemas import function_schema

__all__ = [
    "EXPECTED_FORM",
    "MAX_JSON_DEPTH",
    "ParsedToolCalls",
    "Tool",
    "ToolBox",
    "ToolCall",
    "parse_tool_calls",
]

#: How a tool call should look; quoted in parse errors.
EXPECTED_FORM = '<tool_call>{"name": "<tool name>", "arguments": {"<argument>": <value>}}</tool_call>'
#: Deepest nesting of arrays and objects accepted in a tool call (the call object itself is level 1).
MAX_JSON_DEPTH = 64

# ----- calls and tools ----------------------------------------------------------------------------
@dataclass
class ToolCall:
    """One call of a tool: its name and its arguments (a dict of JSON values)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., "arguments": {...}}``, the payload of a ``<tool_call>`` block."""
        return {"name": self.name, "arguments": dict(self.arguments)}


@dataclass
class ParsedToolCalls:
    """What :func:`parse_tool_calls` found in a message.

    Attributes:
        calls: The well-formed tool calls, in order.
        content: The message text outside the calls, stripped.
        errors: One message per malformed call: what was wrong and the expected form.
    """

    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    errors: list[str] = field(default_factory=list)


@dataclass
class Tool:
    """A named function the model may call, with the schema the model sees."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        """Build a tool from a typed, documented function (see :func:`function_schema`)."""
        schema = function_schema(fn, name=name)
        return cls(name=schema["function"]["name"], fn=fn, schema=schema)

    @property
    def parameters(self) -> dict[str, Any]:
        """The ``parameters`` object of the schema."""
        return self.schema.get("function", {}).get("parameters", {"type": "object", "properties": {}})


def _json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _matches(value: Any, schema: dict[str, Any]) -> str | None:
    """``None`` when ``value`` fits ``schema``, else what is wrong."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if any(_matches(value, sub) is None for sub in schema["anyOf"]):
            return None
        return f"got {_json_type_name(value)}, which matches none of the allowed types"
    expected = schema.get("type")
    if expected is not None:
        allowed = expected if isinstance(expected, list) else [expected]
        actual = _json_type_name(value)
        if not (actual in allowed or (actual == "integer" and "number" in allowed)):
            return f"expected {' or '.join(map(str, allowed))}, got {actual} {_short(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"expected one of {schema['enum']}, got {_short(value)}"
    if isinstance(value, (list, tuple)) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = _matches(item, schema["items"])
            if problem:
                return f"item {i}: {problem}"
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            problem = _matches(item, schema["additionalProperties"])
            if problem:
                return f"key {_short(key)}: {problem}"
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, str) else _json_text(value, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + "..."


def _json_text(value: Any, **options: Any) -> str:
    """``json.dumps(value)``; ``str(value)`` or the type's name when the value cannot be encoded (too deep, say)."""
    try:
        return json.dumps(value, default=str, **options)
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return str(value)
    except (TypeError, ValueError, RecursionError):
        return f"<{type(value).__name__}>"


def _too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is not None:
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in children)
    return False


def _describe_parameters(parameters: dict[str, Any]) -> str:
    required = set(parameters.get("required", []))
    parts = []
    for name, schema in parameters.get("properties", {}).items():
        kind = schema.get("type", "any")
        kind = " or ".join(kind) if isinstance(kind, list) else kind
        parts.append(f"{name} ({kind}, {'required' if name in required else 'optional'})")
    return ", ".join(parts) or "none"


class ToolBox:
    """A set of tools the model may call by name.

    Args:
        tools: :class:`Tool` objects or typed, documented functions (turned into tools with
            :meth:`Tool.from_function`).
        max_result_length: Results longer than this many characters are cut, with a note (``None``: no limit).

    Raises:
        ConfigError: two tools share a name, or a function cannot be described.
    """

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = (), *, max_result_length: int | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        self.max_result_length = max_result_length
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool | Callable[..., Any]) -> Tool:
        """Add a tool (or a function, described with :func:`function_schema`); return it."""
        if not isinstance(tool, Tool):
            tool = Tool.from_function(tool)
        if tool.name in self._tools:
            raise ConfigError(f"two tools are named {tool.name!r}; give each tool a unique name.")
        self._tools[tool.name] = tool
        return tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        """The tool names, in the order they were added."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The schemas of all tools (for ``info["tools"]`` or a chat template's ``tools=``)."""
        return [json.loads(json.dumps(tool.schema)) for tool in self._tools.values()]

    def validate(self, call: ToolCall) -> str | None:
        """``None`` when ``call`` names a known tool with well-typed arguments, else an error message."""
        if not isinstance(call, ToolCall):
            return f"Error: expected a ToolCall, got {type(call).__name__}."
        tool = self._tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {_short(call.name)}. Available tools: {', '.join(self._tools) or 'none'}."
        if not isinstance(call.arguments, dict):
            return f"Error: the arguments of tool {call.name!r} must be a JSON object, got {_json_type_name(call.arguments)}."
        if _too_deep(call.arguments):
            return f"Error: the arguments of tool {call.name!r} are nested more than {MAX_JSON_DEPTH} levels deep."
        parameters = tool.parameters
        properties = parameters.get("properties", {})
        problems = [f"missing required argument {name!r}" for name in parameters.get("required", []) if name not in call.arguments]
        problems += [f"unknown argument {_short(name)}" for name in call.arguments if name not in properties]
        for name, value in call.arguments.items():
            if name in properties:
                problem = _matches(value, properties[name])
                if problem:
                    problems.append(f"argument {name!r}: {problem}")
        if problems:
            return (
                f"Error: invalid arguments for tool {call.name!r}: {'; '.join(problems)}. "
                f"Expected arguments: {_describe_parameters(parameters)}."
            )
        return None

    def call(self, call: ToolCall) -> str:
        """Run one call and return its result as text; every problem comes back as ``"Error: ..."``."""
        problem = self.validate(call)
        if problem is not None:
            return problem
        try:
            with timeline.span("tool", "tool", tool=call.name):
                result = self._tools[call.name].fn(**call.arguments)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a tool's failure is feedback for the model
            message = str(exc).strip()
            return f"Error: {type(exc).__name__}{': ' + message if message else ''}"
        return self._format_result(result)

    def _format_result(self, result: Any) -> str:
        if result is None:
            text = ""
        elif isinstance(result, str):
            text = result
        elif isinstance(result, (dict, list, tuple, bool, int, float)):
            text = _json_text(result, ensure_ascii=False)
        else:
            text = str(result)
        limit = self.max_result_length
        if limit is not None and len(text) > limit:
            text = text[:limit] + f"\n... [result truncated: {len(text) - limit:,} more characters]"
        return text


# ----- parsing ------------------------------------------------------------------------------------
_TAG_OPEN, _TAG_CLOSE = "<tool_call>", "</tool_call>"
_FENCE_RE = re.compile(r"```[ \t]*(json|JSON|tool_call)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CANDIDATE_RE = re.compile(r'\[\s*\{\s*"|\{\s*"')
_CALL_START_RE = re.compile(r'\[?\s*\{\s*"(?:name|function)"\s*:')
_CALL_KEYS = {"name", "arguments", "parameters", "id", "type", "function"}
_MAX_CANDIDATES = 200


def _call_from_object(obj: Any, where: str) -> tuple[ToolCall | None, str | None]:
    """Turn one decoded JSON value into a call, or say what is wrong with it."""
    if not isinstance(obj, dict):
        return None, f"{where} is a JSON {_json_type_name(obj)}, not an object. Expected: {EXPECTED_FORM}"
    if isinstance(obj.get("function"), dict) and "name" not in obj:  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f'{where} has no "name" string. Expected: {EXPECTED_FORM}'
    if "arguments" in obj:
        arguments = obj["arguments"]
    else:
        arguments = obj.get("parameters", {})
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        if not arguments.strip():
            arguments = {}
        else:
            try:
                arguments = _shallow(json.loads(arguments))
            except (ValueError, RecursionError) as exc:
                return None, f'{where} (tool {_short(name)}): "arguments" is a string that {_json_problem(exc)}. Expected: {EXPECTED_FORM}'
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f'{where} (tool {_short(name)}): "arguments" must be a JSON object, got {_json_type_name(arguments)}. Expected: {EXPECTED_FORM}'
    return ToolCall(name=name.strip(), arguments=arguments), None


def _calls_from_value(value: Any, where: str) -> tuple[list[ToolCall], list[str]]:
    items = value if isinstance(value, list) else [value]
    calls, errors = [], []
    for i, item in enumerate(items):
        label = f"{where}, item {i + 1}" if isinstance(value, list) else where
        call, error = _call_from_object(item, label)
        if call is not None:
            calls.append(call)
        if error is not None:
            errors.append(error)
    return calls, errors


class _TooDeep(ValueError):
    """A JSON value nested deeper than :data:`MAX_JSON_DEPTH`."""


def _shallow(value: Any) -> Any:
    """``value``, decoded JSON, if it nests at most :data:`MAX_JSON_DEPTH` levels; else raise :class:`_TooDeep`."""
    if _too_deep(value):
        raise _TooDeep()
    return value


def _decode(text: str) -> tuple[Any, int]:
    """Decode the JSON value at the start of ``text``; return it and where it ends (ValueError, RecursionError)."""
    value, end = json.JSONDecoder().raw_decode(text)
    return _shallow(value), end


def _parse_tagged(text: str, result: ParsedToolCalls) -> None:
    """Fill ``result`` from ``<tool_call>`` blocks (the last may be unclosed)."""
    outside, pos, block = [], 0, 0
    while True:
        start = text.find(_TAG_OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(_TAG_OPEN)
        end = text.find(_TAG_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        pos = len(text) if end < 0 else end + len(_TAG_CLOSE)
        block += 1
        _parse_block(body, f"<tool_call> block {block}", result)
    result.content = "".join(outside).replace(_TAG_CLOSE, "").strip()


def _parse_block(body: str, where: str, result: ParsedToolCalls) -> None:
    payload = body.strip()
    fence = _FENCE_RE.match(payload)
    if fence:
        payload = fence.group(2).strip()
    if not payload:
        result.errors.append(f"{where} is empty. Expected: {EXPECTED_FORM}")
        return
    try:
        value, end = _decode(payload)
    except (ValueError, RecursionError) as exc:
        result.errors.append(f"{where} {_json_problem(exc)}. Expected: {EXPECTED_FORM}")
        return
    rest = payload[end:].strip()
    if rest.strip("}] \n\t`"):
        result.errors.append(f"{where} has text after the JSON value: {_short(rest[:40])}. Expected: {EXPECTED_FORM}")
        return
    calls, errors = _calls_from_value(value, where)
    result.calls.extend(calls)
    result.errors.extend(errors)


def _json_problem(exc: BaseException) -> str:
    """What is wrong with a JSON text that failed to decode, as the end of a sentence."""
    if isinstance(exc, (_TooDeep, RecursionError)):
        return f"nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    text = str(exc)
    return f"is not valid JSON ({text if len(text) <= 120 else text[:120] + '...'})"


def _looks_like_call(value: Any) -> bool:
    items = value if isinstance(value, list) and value else [value]
    for item in items:
        if not isinstance(item, dict):
            return False
        if isinstance(item.get("function"), dict) and "name" not in item:
            item = item["function"]
        if not isinstance(item.get("name"), str) or not set(item) <= _CALL_KEYS:
            return False
    return True


def _parse_untagged(text: str, result: ParsedToolCalls) -> None:
    """Fill ``result`` from JSON calls in fenced blocks or in the open text."""
    spans: list[tuple[int, int]] = []
    fenced_errors = 0
    for number, fence in enumerate(_FENCE_RE.finditer(text), 1):
        if fence.group(1) is None and not _CALL_START_RE.match(fence.group(2).lstrip()):
            continue
        errors_before = len(result.errors)
        if _scan_json(fence.group(2).strip(), f"```json block {number}", result, whole=True):
            spans.append(fence.span())
        fenced_errors += len(result.errors) - errors_before
    if not spans and not fenced_errors:
        spans = _scan_json(text, "JSON tool call", result, whole=False)
    pieces, pos = [], 0
    for start, end in sorted(spans):
        pieces.append(text[pos:start])
        pos = end
    pieces.append(text[pos:])
    result.content = "".join(pieces).strip()


def _scan_json(text: str, where: str, result: ParsedToolCalls, *, whole: bool) -> list[tuple[int, int]]:
    """Find call-shaped JSON values in ``text``; return their spans (``whole``: one value fills it)."""
    spans: list[tuple[int, int]] = []
    pos, tries, count = 0, 0, 0
    while tries < _MAX_CANDIDATES:
        match = _CANDIDATE_RE.search(text, pos)
        if match is None:
            break
        tries += 1
        start = match.start()
        try:
            value, end = _decode(text[start:])
        except (ValueError, RecursionError) as exc:
            if _CALL_START_RE.match(text, start):
                result.errors.append(f"{where} at character {start} {_json_problem(exc)}. Expected: {EXPECTED_FORM}")
                return spans
            pos = start + 1
            continue
        if _looks_like_call(value) or (whole and isinstance(value, (dict, list)) and _CALL_START_RE.match(text, start)):
            count += 1
            calls, errors = _calls_from_value(value, where if count == 1 else f"{where} {count}")
            result.calls.extend(calls)
            result.errors.extend(errors)
            spans.append((start, start + end))
            pos = start + end
        else:
            pos = start + 1
    return spans


def parse_tool_calls(text: Any) -> ParsedToolCalls:
    """Read the tool calls out of a model message; never raises.

    Accepted forms:

    - ``<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>`` blocks, any number of them;
      a last block without its closing tag is read to the end of the message.
    - Plain JSON: an object ``{"name": ..., "arguments": {...}}`` or a list of them, in the open text
      or in a fenced code block marked ``json`` (or unmarked).
    - ``"arguments"`` as a JSON-encoded string (OpenAI style), ``"parameters"`` instead of
      ``"arguments"`` (Llama 3.1), and ``{"type": "function", "function": {...}}`` wrappers.

    Args:
        text: The message (anything: a non-string input yields an error entry).

    Returns:
        A :class:`ParsedToolCalls`: the well-formed calls, the text outside them, and one error
        message per malformed call (what was wrong and the expected form).
    """
    result = ParsedToolCalls()
    if not isinstance(text, str):
        result.errors.append(f"expected the message as text, got {type(text).__name__}. Expected: {EXPECTED_FORM}")
        return result
    try:
        if _TAG_OPEN in text:
            _parse_tagged(text, result)
        else:
            _parse_untagged(text.replace("<|python_tag|>", ""), result)
    except (ValueError, TypeError, RecursionError, MemoryError) as exc:  # pragma: no cover - last-resort guard
        result.errors.append(f"could not read tool calls ({type(exc).__name__}). Expected: {EXPECTED_FORM}")
    return result
