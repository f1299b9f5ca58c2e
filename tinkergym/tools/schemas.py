"""Tool schemas from typed Python functions with Google-style docstrings.

:func:`function_schema` gives the shape OpenAI-style APIs and Hugging Face chat templates take (that of
``transformers.utils.get_json_schema``)::

    {"type": "function", "function": {"name": ..., "description": ...,
     "parameters": {"type": "object", "properties": {...}, "required": [...]}}}

Standard library only.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from typing import Any, Literal, Union
from collections.abc import Callable

from tinkergym.errors import ConfigError

__all__ = ["function_schema"]

_JSON_TYPES: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}
_LITERAL_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}



# ----- schemas ------------------------------------------------------------------------------------
def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if hint in _JSON_TYPES:
            return dict(_JSON_TYPES[hint])
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [member.value for member in hint]
            return _literal_schema(tuple(values), where)
        raise ConfigError(
            f"{where}: cannot describe type {hint!r} in a tool schema; use str, int, float, bool, "
            "list[X], dict[str, X], Optional[X] or Literal[...]."
        )
    if origin is Union or origin is getattr(types, "UnionType", Union):
        return _union_schema(args, where)
    if origin is Literal:
        return _literal_schema(args, where)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0], where)}
        return {"type": "array", "prefixItems": [_type_schema(a, where) for a in args]}
    if origin is dict:
        schema: dict[str, Any] = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = _type_schema(args[1], where)
        return schema
    raise ConfigError(f"{where}: cannot describe type {hint!r} in a tool schema; use str, int, float, bool, list, dict.")


def _union_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    subtypes = [_type_schema(a, where) for a in args if a is not type(None)]
    if len(subtypes) == 1:
        schema = subtypes[0]
    elif all(isinstance(s.get("type"), str) and len(s) == 1 for s in subtypes):
        schema = {"type": sorted(s["type"] for s in subtypes)}
    else:
        schema = {"anyOf": subtypes}
    if type(None) in args:
        schema["nullable"] = True
    return schema


def _literal_schema(values: tuple[Any, ...], where: str) -> dict[str, Any]:
    names: list[str] = []
    for value in values:
        name = _LITERAL_TYPES.get(type(value))
        if name is None:
            raise ConfigError(f"{where}: Literal values must be str, int, float, bool or None, not {value!r}.")
        if name not in names:
            names.append(name)
    return {"type": names[0] if len(names) == 1 else names, "enum": list(values)}


_SECTION_RE = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?)\s*:\s*$", re.IGNORECASE)
_ARG_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its summary and the ``Args:`` descriptions."""
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    params: dict[str, list[str]] = {}
    section, current, indent = None, None, None
    for line in lines:
        heading = _SECTION_RE.match(line)
        if heading:
            section, current, indent = heading.group(1).lower(), None, None
            continue
        if section is None:
            summary.append(line)
            continue
        if section not in ("args", "arguments", "parameters") or not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        match = _ARG_RE.match(line.strip())
        if match and (indent is None or width <= indent):
            indent, current = width, match.group(1).lstrip("*")
            params[current] = [match.group(2).strip()]
        elif current is not None:
            params[current].append(line.strip())
    description = " ".join(" ".join(summary).split())
    return description, {name: " ".join(" ".join(parts).split()) for name, parts in params.items()}


def function_schema(fn: Callable[..., Any], *, name: str | None = None) -> dict[str, Any]:
    """Describe a typed function as a tool schema, from its type hints and Google-style docstring.

    Args:
        fn: A function whose parameters all have type hints (``str``, ``int``, ``float``, ``bool``,
            ``list[X]``, ``dict[str, X]``, ``Optional[X]``, ``Literal[...]``, an ``Enum``). The docstring
            summary becomes the description; the ``Args:`` section describes each parameter.
        name: The tool name (default: the function's ``__name__``).

    Returns:
        ``{"type": "function", "function": {"name", "description", "parameters"}}``. Parameters
        without a default are listed in ``parameters["required"]``.

    Raises:
        ConfigError: a parameter has no type hint, or a hint that JSON schema cannot express.
    """
    tool_name = name or getattr(fn, "__name__", None)
    if not tool_name or not isinstance(tool_name, str):
        raise ConfigError(f"cannot tell the name of tool {fn!r}; pass name=...")
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as exc:
        raise ConfigError(f"cannot read the signature of tool {tool_name!r}: {exc}") from exc
    description, docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        where = f"tool {tool_name!r}, parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ConfigError(f"{where}: tools take named arguments only; *args, **kwargs and positional-only parameters cannot be described.")
        if param.name not in hints:
            raise ConfigError(f"{where} has no type hint; annotate it, e.g. `def {tool_name}({param.name}: str, ...)`.")
        schema = _type_schema(hints[param.name], where)
        if param.name in docs and docs[param.name]:
            schema["description"] = docs[param.name]
        properties[param.name] = schema
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": tool_name, "description": description, "parameters": parameters}}
