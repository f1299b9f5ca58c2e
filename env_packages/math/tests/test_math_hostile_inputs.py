"""Hostile inputs to the math package: the calculator stays bounded, data files fail with clear errors.

The calculator runs in a child process with a generous time limit, so work that grows with the size
of a number (a literal with a huge exponent, a power, printing a long integer) fails the test by
timing out rather than through a timing assertion; the assertions are on the text it answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import gymnasium as gym
import pytest

import tinkergym  # noqa: F401  (registers tinker/MathTool-v0)
from tinkergym.errors import ConfigError
from tinkergym_math import MathEnv
from tinkergym_math.calculator import MAX_EXACT_DIGITS, calculate, evaluate

#: Expressions that must be refused with a short ``Error: ...`` text.
REFUSED = [
    "1e100000000",
    "1e999999999",
    "1.5E+999999999",
    "1e-999999999",
    "0.5e" + "9" * 480,
    "1e6100",
    "10**10**10",
    "9**9**9**9",
    "2**19999",
    "0.5**20000",
    "(2/3)**-100000",
    "10**5000 * 10**5000",
    "factorial(100000)",
    "factorial(10**100)",
    "perm(10000, 10000)",
    "comb(10**400, 3)",
    "lcm(2**19000, 3**12000)",
    "exp(10**400)",
    "sqrt(1e6000) ** 3",
    "2 ** 1e999999999",
    "round(1e6000, 10**400)",
    "(" * 249 + "1" + ")" * 249 + "**" + "9" * 240,
]
#: Expressions whose exact value is too long to print: a short ``about ...`` approximation instead.
APPROXIMATED = {
    "0.5**10000": "about 5.012372749e-3011",
    "factorial(1000) * factorial(1000)": "about 1.619155071e+5135",
    "1e6000": "about 1e+6000",
    "1/3**5000": "about 2.475861814e-2386",
    "-(2**10000)": "about -1.995063117e+3010",
    "1/factorial(1000)**2": "about 6.1760607e-5136",
}
#: Ordinary expressions keep their exact answers.
EXACT = {
    "2**100": "1267650600228229401496703205376",
    "1.5e3": "1500",
    "123.456e-2": "1.23456",
    "1e-3 * 3": "0.003",
    "0e999999999": "0",
    "0**100000": "0",
    "(-1)**(10**4000 + 1)": "-1",
    "2**-3": "0.125",
    "0.5**100": "1/1267650600228229401496703205376 (about 7.888609052e-31)",
    "factorial(20)": "2432902008176640000",
    "10**999": "1" + "0" * 999,
    "(-sqrt(2))**2": "2",
    "(-sqrt(2))**3": "-2.82842712475",
}

_CHILD = """
import json, sys
from tinkergym_math.calculator import calculate
for expression in json.loads(sys.stdin.read()):
    print(json.dumps([expression, calculate(expression)]), flush=True)
"""


@pytest.fixture(scope="module")
def answers() -> dict[str, str]:
    """``calculate`` of every expression above, computed in a child process stopped after 120 s."""
    expressions = [*REFUSED, *APPROXIMATED, *EXACT]
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(expressions), capture_output=True, text=True, timeout=120)
        output, error = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:  # the answers so far still count; the missing one hung
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        error = "timed out"
    found = dict(json.loads(line) for line in output.splitlines() if line.strip())
    found["__error__"] = error
    return found


def _answer(answers: dict[str, str], expression: str) -> str:
    assert expression in answers, f"calculate({expression[:60]!r}) gave no answer within the child's 120 s ({answers['__error__'][-300:]})"
    return answers[expression]


@pytest.mark.parametrize("expression", REFUSED)
def test_hostile_expressions_are_refused_with_a_short_error(answers, expression):
    answer = _answer(answers, expression)
    assert answer.startswith("Error: ") and len(answer) < 200, answer


@pytest.mark.parametrize("expression", APPROXIMATED)
def test_results_too_long_to_print_are_approximated(answers, expression):
    answer = _answer(answers, expression)
    assert answer.startswith(APPROXIMATED[expression] + " (") and len(answer) < 120, answer


@pytest.mark.parametrize("expression", EXACT)
def test_ordinary_results_stay_exact(answers, expression):
    assert _answer(answers, expression) == EXACT[expression]


def test_exact_digits_end_at_the_documented_limit():
    assert calculate(f"10**{MAX_EXACT_DIGITS - 1}") == "1" + "0" * (MAX_EXACT_DIGITS - 1)
    assert calculate(f"10**{MAX_EXACT_DIGITS}").startswith(f"about 1e+{MAX_EXACT_DIGITS} (a whole number with {MAX_EXACT_DIGITS + 1:,} digits")
    assert evaluate("10**5000") == Fraction(10**5000), "only the printing is approximate: the value stays exact"


def test_calculator_never_raises_even_past_python_int_digit_limit():
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        assert calculate("10**700").startswith("about 1e+700 (")
    finally:
        sys.set_int_max_str_digits(before)


# ----- deeply nested tool calls -------------------------------------------------------------------
NESTED_ACTIONS = [
    '<tool_call>{"name": "calculator", "arguments": ' + "[" * 986 + "]" * 986 + "}</tool_call>",
    '<tool_call>{"name": "calculator", "arguments": {"expression": ' + "[" * 980 + "]" * 980 + "}}</tool_call>",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1", "a": ' + '{"a":' * 2500 + "1" + "}" * 2500 + "}}</tool_call>",
    '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": ' + "[" * 986 + "]" * 986 + '}"}</tool_call>',
    '{"name": "calculator", "arguments": {"expression": ' + "[" * 984 + "]" * 984 + "}}",
    "<tool_call>" + "[" * 5000 + "</tool_call>",
]


@pytest.mark.parametrize("action", NESTED_ACTIONS, ids=range(len(NESTED_ACTIONS)))
def test_deeply_nested_tool_call_is_an_invalid_call_observation(action):
    env = gym.make("tinker/MathTool-v0", tools=("calculator",))
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated) == (0.0, False, False), "a malformed call is a tool turn with reward 0"
    assert observation.startswith("<tool_response>\nError: ") and "Expected: <tool_call>" in observation
    assert info["tool_calls_used"] == 0 and len(info["tool_errors"]) == 1
    json.dumps(info)
    observation, reward, terminated, _, _ = env.step("\\boxed{0}")
    assert terminated, "the episode goes on normally after the bad call"


def test_nesting_near_the_interpreter_limit_never_raises():
    """Depths that ``json`` can still decode but a later walk of the value (``json.dumps``, validation) cannot."""
    env = gym.make("tinker/MathTool-v0", tools=("calculator",))
    limit = sys.getrecursionlimit()
    for depth in range(max(limit - 150, 1), limit + 5):
        for action in (
            '<tool_call>{"name": "calculator", "arguments": {"expression": ' + "[" * depth + "]" * depth + "}}</tool_call>",
            '{"name": "calculator", "arguments": {"x": ' + "[" * depth + "]" * depth + "}}",
        ):
            env.reset(seed=0)
            observation, reward, terminated, _, info = env.step(action)
            assert not terminated and reward == 0.0 and "Error: " in observation, f"depth {depth}: {observation[:200]}"


# ----- data files ---------------------------------------------------------------------------------
GOOD_LINE = b'{"question": "What is 1 + 1?", "answer": "2"}\n'


@pytest.mark.parametrize(
    "content, message",
    [
        (GOOD_LINE + b"[" * 100_000 + b"\n", r"bad\.jsonl, line 2: the JSON nests arrays or objects too deeply"),
        (GOOD_LINE + b'{"a":' * 5_000 + b"1" + b"}" * 5_000 + b"\n", r"bad\.jsonl, line 2: the JSON nests arrays or objects too deeply"),
        (GOOD_LINE + b'{"question": ' + b"[" * 900 + b"]" * 900 + b', "answer": "1"}\n', r"line 2: 'question' must be non-empty text"),
        (GOOD_LINE + b'{"question": "q", "answer": "1", "id": ' + b"[" * 900 + b"]" * 900 + b"}\n", r"line 2: 'id' must be text or a number"),
        (GOOD_LINE + b'{"question": "q", "answer": "1", "topic": {"a": {"a": 1}}}\n', r"line 2: 'topic' must be text or a number"),
        (GOOD_LINE + b'{"question": "caf\xe9", "answer": "1"}\n', r"bad\.jsonl, line 2: not UTF-8 text"),
        (b"\xff\xfe" + "{}".encode("utf-16-le") + b"\n", r"bad\.jsonl, line 1: not UTF-8 text"),
        (b'{"question": "q", "answer": ' + b"9" * 5_000 + b"}\n", r"bad\.jsonl, line 1: cannot read the JSON"),
    ],
    ids=["deep-array", "deep-object", "deep-question", "deep-id", "nested-topic", "latin-1", "utf-16", "huge-int"],
)
def test_hostile_jsonl_is_a_config_error_naming_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        MathEnv(data_files=path)
    with pytest.raises(ConfigError, match=message):
        gym.make("tinker/MathTool-v0", data_files=str(path), tools=("calculator",))


def test_deep_in_memory_records_are_config_errors():
    deep: list = []
    for _ in range(5_000):
        deep = [deep]
    with pytest.raises(ConfigError, match="data_files record 0: 'answer' must be text or a number"):
        MathEnv(data_files=[{"question": "q", "answer": deep}])


def test_utf8_with_byte_order_mark_and_crlf_lines_load(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE.replace(b"\n", b"\r\n") + b"\r\n" + GOOD_LINE.replace(b"1 + 1", b"2 + 2"))
    assert [p.question for p in MathEnv(data_files=path).problems] == ["What is 1 + 1?", "What is 2 + 2?"]


@pytest.mark.parametrize("name", ["x" * 5000 + ".jsonl", "a\0b.jsonl"])
def test_unusable_data_file_names_are_config_errors(name):
    with pytest.raises(ConfigError, match="data file") as caught:
        MathEnv(data_files=name)
    assert len(str(caught.value)) < 500  # the name is shortened in the message
