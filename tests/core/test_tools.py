"""Tests of tinkergym.tools: schemas from typed functions, the tool box, and the tool-call parser."""

from __future__ import annotations

import enum
import json
import random
from typing import Literal

import pytest

from tinkergym.errors import ConfigError
from tinkergym.tools import EXPECTED_FORM, MAX_JSON_DEPTH, ParsedToolCalls, Tool, ToolBox, ToolCall, function_schema, parse_tool_calls


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: int | None = None) -> str:
    """Get the weather forecast for a city.

    Looks the city up in a made-up table.

    Args:
        city: The city to look up,
            for example "Paris".
        unit (str): The temperature unit.
        days: How many days to forecast.

    Returns:
        The forecast as text.
    """
    return f"{city}: 20 {unit} for {days or 1} day(s)"


def add(a: int, b: float, tags: list[str], extra: dict[str, int], flag: bool = False) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
        tags: Labels.
        extra: Extra counts.
        flag: Unused switch.
    """
    return a + b


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"boom: {reason}")


class Color(enum.Enum):
    """A color."""

    RED = "red"
    BLUE = "blue"


def paint(color: Color, sizes: tuple[int, ...] = (), mode: int | str = 1) -> str:
    """Paint.

    Args:
        color: The color.
    """
    return str(color)


# ----- schemas ------------------------------------------------------------------------------------
def test_schema_shape_descriptions_required_and_enum():
    schema = function_schema(get_weather)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "get_weather"
    assert fn["description"] == "Get the weather forecast for a city. Looks the city up in a made-up table."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["city"]
    assert params["properties"]["city"] == {"type": "string", "description": 'The city to look up, for example "Paris".'}
    assert params["properties"]["unit"] == {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The temperature unit."}
    assert params["properties"]["days"] == {"type": "integer", "nullable": True, "description": "How many days to forecast."}
    json.dumps(schema)


def test_schema_types():
    props = function_schema(add)["function"]["parameters"]["properties"]
    assert props["a"]["type"] == "integer"
    assert props["b"]["type"] == "number"
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "description": "Labels."}
    assert props["extra"]["type"] == "object" and props["extra"]["additionalProperties"] == {"type": "integer"}
    assert props["flag"]["type"] == "boolean"
    assert function_schema(add)["function"]["parameters"]["required"] == ["a", "b", "tags", "extra"]


def test_schema_enum_tuple_union_and_missing_description():
    props = function_schema(paint)["function"]["parameters"]["properties"]
    assert props["color"]["enum"] == ["red", "blue"]
    assert props["sizes"] == {"type": "array", "items": {"type": "integer"}}
    assert props["mode"] == {"type": ["integer", "string"]}


def test_schema_untyped_parameter_is_a_config_error():
    def untyped(x, y: int) -> int:
        """Untyped.

        Args:
            x: A thing.
            y: Another.
        """
        return y

    with pytest.raises(ConfigError, match="'x' has no type hint"):
        function_schema(untyped)


def test_schema_rejects_var_args_and_odd_types():
    def star(*args: int) -> int:
        """Star."""
        return 0

    def odd(x: set) -> int:
        """Odd."""
        return 0

    with pytest.raises(ConfigError, match="named arguments"):
        function_schema(star)
    with pytest.raises(ConfigError, match="cannot describe type"):
        function_schema(odd)


def test_schema_of_bound_method_and_custom_name():
    class Calc:
        def double(self, x: int) -> int:
            """Double a number.

            Args:
                x: The number.
            """
            return 2 * x

    schema = function_schema(Calc().double, name="twice")
    assert schema["function"]["name"] == "twice"
    assert list(schema["function"]["parameters"]["properties"]) == ["x"]


# ----- tool box -----------------------------------------------------------------------------------
@pytest.fixture
def box() -> ToolBox:
    return ToolBox([get_weather, add, explode])


def test_toolbox_schemas_and_names(box):
    assert box.names == ["get_weather", "add", "explode"]
    assert [s["function"]["name"] for s in box.schemas()] == box.names
    assert "add" in box and "nope" not in box and len(box) == 3


def test_toolbox_duplicate_names():
    with pytest.raises(ConfigError, match="unique name"):
        ToolBox([add, Tool.from_function(get_weather, name="add")])


def test_toolbox_calls(box):
    assert box.call(ToolCall("get_weather", {"city": "Oslo"})) == "Oslo: 20 celsius for 1 day(s)"
    assert box.call(ToolCall("add", {"a": 1, "b": 2.5, "tags": [], "extra": {}})) == "3.5"
    assert box.call(ToolCall("add", {"a": 1, "b": 2, "tags": ["x"], "extra": {"k": 1}})) == "3"


def test_toolbox_unknown_tool(box):
    out = box.call(ToolCall("search", {}))
    assert out.startswith("Error: unknown tool 'search'") and "get_weather, add, explode" in out


@pytest.mark.parametrize(
    "arguments, needle",
    [
        ({}, "missing required argument 'city'"),
        ({"city": "Oslo", "country": "NO"}, "unknown argument 'country'"),
        ({"city": 3}, "argument 'city': expected string, got integer"),
        ({"city": "Oslo", "unit": "kelvin"}, "expected one of ['celsius', 'fahrenheit']"),
        ({"city": "Oslo", "days": "two"}, "argument 'days': expected integer"),
        ({"city": "Oslo", "days": True}, "got boolean"),
    ],
)
def test_toolbox_bad_arguments_are_error_strings(box, arguments, needle):
    out = box.call(ToolCall("get_weather", arguments))
    assert out.startswith("Error: invalid arguments for tool 'get_weather'")
    assert needle in out
    assert "Expected arguments: city (string, required)" in out


def test_toolbox_nested_types(box):
    out = box.call(ToolCall("add", {"a": 1, "b": 2, "tags": ["x", 3], "extra": {}}))
    assert "item 1: expected string" in out
    out = box.call(ToolCall("add", {"a": 1, "b": 2, "tags": [], "extra": {"k": "v"}}))
    assert "key 'k': expected integer" in out
    assert box.call(ToolCall("get_weather", {"city": "Oslo", "days": None})).startswith("Oslo")


def test_toolbox_tool_exception_becomes_text(box):
    assert box.call(ToolCall("explode", {"reason": "why"})) == "Error: RuntimeError: boom: why"


def test_toolbox_non_dict_arguments_and_non_call(box):
    assert box.call(ToolCall("add", [1, 2])).startswith("Error: the arguments")  # type: ignore[arg-type]
    assert box.call("add").startswith("Error: expected a ToolCall")  # type: ignore[arg-type]


def test_toolbox_truncates_long_results():
    def shout(text: str) -> str:
        """Repeat.

        Args:
            text: What.
        """
        return text * 100

    box = ToolBox([shout], max_result_length=50)
    out = box.call(ToolCall("shout", {"text": "ab"}))
    assert out.startswith("ab" * 25) and "truncated: 150 more characters" in out


def test_toolcall_to_dict():
    call = ToolCall("f", {"x": 1})
    assert call.to_dict() == {"name": "f", "arguments": {"x": 1}}


# ----- parsing ------------------------------------------------------------------------------------
def _names(parsed: ParsedToolCalls) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in parsed.calls]


def test_parse_qwen_tags_several_and_content():
    text = (
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n"
        "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}</tool_call> done"
    )
    parsed = parse_tool_calls(text)
    assert _names(parsed) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert parsed.errors == []
    assert parsed.content == "Let me check.\n\n done"


def test_parse_unclosed_last_tag():
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}')
    assert _names(parsed) == [("a", {}), ("b", {"x": 1})]
    assert parsed.errors == []


def test_parse_plain_json_object_and_list():
    assert _names(parse_tool_calls('{"name": "add", "arguments": {"a": 1}}')) == [("add", {"a": 1})]
    parsed = parse_tool_calls('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": [1]}}]')
    assert _names(parsed) == [("a", {}), ("b", {"y": [1]})]
    assert parsed.content == ""


def test_parse_json_fence():
    text = 'I will call it.\n```json\n{"name": "add", "arguments": {"a": 2}}\n```\nThanks.'
    parsed = parse_tool_calls(text)
    assert _names(parsed) == [("add", {"a": 2})]
    assert parsed.content == "I will call it.\n\nThanks."


def test_parse_arguments_as_json_string_and_parameters_alias():
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>')
    assert _names(parsed) == [("add", {"a": 3})]
    parsed = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 4}}')
    assert _names(parsed) == [("add", {"a": 4})]
    parsed = parse_tool_calls('{"type": "function", "function": {"name": "add", "arguments": "{\\"a\\": 5}"}}')
    assert _names(parsed) == [("add", {"a": 5})]


def test_parse_json_in_prose():
    parsed = parse_tool_calls('First I compute. {"name": "calc", "arguments": {"expression": "1+1"}} Then I answer.')
    assert _names(parsed) == [("calc", {"expression": "1+1"})]
    assert parsed.content == "First I compute.  Then I answer."


def test_parse_plain_text_is_not_a_call():
    for text in ["The answer is \\boxed{42}.", '{"answer": 5}', 'Alice is {"name": "Alice", "age": 3}', "", "{x | x > 0}"]:
        parsed = parse_tool_calls(text)
        assert parsed.calls == [] and parsed.errors == [], text
        assert parsed.content == text.strip()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("<tool_call>not json</tool_call>", "<tool_call> block 1 is not valid JSON"),
        ("<tool_call></tool_call>", "<tool_call> block 1 is empty"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name" string'),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object, got array'),
        ('<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>', '"arguments" is a string that is not valid JSON'),
        ('<tool_call>[1, 2]</tool_call>', "item 1 is a JSON integer, not an object"),
        ('<tool_call>{"name": "a"} and more</tool_call>', "has text after the JSON value"),
        ('{"name": "python", "arguments": {"code": "while True: pass"', "JSON tool call at character 0 is not valid JSON"),
        ('```json\n{"name": "a", "arguments": {"x": }\n```', "is not valid JSON"),
    ],
)
def test_parse_malformed_calls_give_errors(text, needle):
    parsed = parse_tool_calls(text)
    assert parsed.calls == []
    assert parsed.errors and needle in parsed.errors[0], parsed.errors
    assert len(parsed.errors) == (2 if text.startswith("<tool_call>[") else 1)
    assert EXPECTED_FORM in parsed.errors[0]


def test_parse_good_and_bad_blocks_together():
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>')
    assert _names(parsed) == [("a", {})]
    assert len(parsed.errors) == 1 and "block 2" in parsed.errors[0]


def test_parse_non_string_input():
    for value in (None, 12, b"<tool_call>", ["x"]):
        parsed = parse_tool_calls(value)
        assert parsed.calls == [] and parsed.errors and "expected the message as text" in parsed.errors[0]


def test_parse_then_call_round_trip(box):
    parsed = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "fahrenheit"}}</tool_call>')
    assert [box.call(c) for c in parsed.calls] == ["Rome: 20 fahrenheit for 1 day(s)"]


_FUZZ_PIECES = [
    "<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",", '"',
    "\\", "```json\n", "```", "\n", " ", "null", "true", "1e999", "-0", '"add"', "\ud800", "\x00", "🙂", "<|python_tag|>",
    '{"name": "a", "arguments": ', '"{\\"a\\": 1}"', "[[[[", "]]]]", "\\boxed{",
]


def test_parse_fuzz_never_raises():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(_FUZZ_PIECES) for _ in range(rng.randint(0, 30)))
        parsed = parse_tool_calls(text)
        assert isinstance(parsed, ParsedToolCalls)
        assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in parsed.calls)
        assert all(isinstance(e, str) for e in parsed.errors)
    for _ in range(300):
        text = "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randint(0, 200)))
        parse_tool_calls(text)


def test_parse_hostile_sizes_never_raise():
    for text in ["[" * 100_000, "{" * 100_000, '{"a":' * 20_000, '<tool_call>' * 5_000, '{"name": ' * 10_000, "A" * 100_000]:
        parsed = parse_tool_calls(text)
        assert parsed.calls == []


def _nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": ' + "[" * 986 + "]" * 986 + "}</tool_call>",
        '<tool_call>{"name": "add", "arguments": {"tags": ' + "[" * 980 + "]" * 980 + "}}</tool_call>",
        '<tool_call>{"name": "add", "arguments": {"a": ' + '{"a":' * 5_000 + "1" + "}" * 5_000 + "}}</tool_call>",
        '<tool_call>{"name": "add", "arguments": "{\\"tags\\": ' + "[" * 500 + "]" * 500 + '}"}</tool_call>',
        '{"name": "add", "arguments": {"tags": ' + "[" * 200 + "]" * 200 + "}}",
        '```json\n{"name": "add", "arguments": {"tags": ' + "[" * 200 + "]" * 200 + "}}\n```",
    ],
    ids=["arguments-array", "argument-array", "argument-object", "arguments-string", "plain-json", "fenced-json"],
)
def test_parse_deeply_nested_calls_are_errors(text):
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and len(parsed.errors) == 1
    assert f"more than {MAX_JSON_DEPTH} levels deep" in parsed.errors[0] and EXPECTED_FORM in parsed.errors[0]


def test_parse_accepts_nesting_up_to_the_limit():
    arguments = {"tags": _nested(MAX_JSON_DEPTH - 3, "x")}  # the call object and "arguments" are two levels
    parsed = parse_tool_calls(f"<tool_call>{json.dumps({'name': 'add', 'arguments': arguments})}</tool_call>")
    assert parsed.errors == [] and parsed.calls[0].arguments == arguments
    arguments = {"tags": _nested(MAX_JSON_DEPTH - 1, "x")}
    parsed = parse_tool_calls(f"<tool_call>{json.dumps({'name': 'add', 'arguments': arguments})}</tool_call>")
    assert parsed.calls == [] and "levels deep" in parsed.errors[0]


def test_toolbox_refuses_deep_arguments_built_by_hand(box):
    call = ToolCall("add", {"a": 1, "b": 2.0, "tags": _nested(100_000), "extra": {}})
    assert box.call(call) == f"Error: the arguments of tool 'add' are nested more than {MAX_JSON_DEPTH} levels deep."
    assert box.validate(ToolCall("nope", {"x": _nested(100_000)})).startswith("Error: unknown tool 'nope'")


def test_toolbox_deep_tool_result_is_text():
    def deep() -> list:
        """Return something no encoder can walk."""
        return _nested(100_000)

    result = ToolBox([deep]).call(ToolCall("deep"))
    assert isinstance(result, str) and result


def test_parse_hostile_numbers_never_raise():
    for text in ['<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5_000 + "}}</tool_call>", '{"name": "add", "arguments": {"a": 1e999999999}}']:
        parsed = parse_tool_calls(text)
        assert isinstance(parsed, ParsedToolCalls)
