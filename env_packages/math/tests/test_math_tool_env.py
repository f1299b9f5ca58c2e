"""Tests of tinker/MathTool-v0, its calculator and the tool baseline."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import gymnasium as gym
import pytest

import tinkergym
from tinkergym.errors import ConfigError
from tinkergym.spaces import is_printable_text
from tinkergym.testing import HOSTILE_ACTIONS, check_text_env
from tinkergym_math import BaselineMathToolAgent, MathToolEnv
from tinkergym_math.agents import find_expression
from tinkergym_math.calculator import CalculatorError, calculate, evaluate

RECORDS = [{"question": "What is 3/4 + 1/6?", "answer": "11/12"}, {"question": "What is 2 ** 10?", "answer": "1024"}]


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def env():
    env = MathToolEnv(data_files=RECORDS)
    env.reset(seed=0, options={"index": 0})
    return env


# ----- calculator ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expression, value",
    [("1/3 + 1/6", Fraction(1, 2)), ("12 + 3 × (4 − 1)", 21), ("2^10", 1024), ("0.1 + 0.2", Fraction(3, 10)),
     ("sqrt(9/4)", Fraction(3, 2)), ("7 // 2 + 7 % 2", 4), ("factorial(5) / comb(5, 2)", 12), ("-(2 ** -2)", Fraction(-1, 4))],
)
def test_calculator_is_exact(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [("__import__('os').system('ls')", "unsupported syntax"), ("x + 1", "unknown name 'x'"), ("9 ** 9 ** 9", "too large"),
     ("1/0", "division by zero"), ("1,234", "commas"), ("(" * 600, "characters long"), ("", "empty"),
     ("factorial(10000)", "factorial"), ("sqrt(-1)", "negative"), ("open('f')", "unsupported syntax"), ("2 +", "cannot parse")],
)
def test_calculator_refuses_safely(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)
    assert calculate(expression).startswith("Error: ")


def test_calculator_formatting():
    assert calculate("1/3") == "1/3 (about 0.3333333333)"
    assert calculate("7/4") == "1.75"
    assert calculate("sqrt(2)") == "1.41421356237"
    assert calculate("123456789.123456789 * 1") == "123456789.123456789"
    assert calculate("(" * 200 + "1" + ")" * 200) == "1"
    assert calculate("-" * 400 + "1") == "1"


# ----- episodes -----------------------------------------------------------------------------------
def test_reset_offers_tool_schemas():
    env = MathToolEnv(data_files=RECORDS)
    obs, info = env.reset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["python", "calculator"]
    python_schema = info["tools"][0]["function"]
    assert python_schema["parameters"]["required"] == ["code"] and python_schema["description"]
    assert "<tool_call>" in info["system_prompt"] and "at most 4 tool calls" in info["system_prompt"]
    assert "up to 4 calls" in obs
    json.dumps(info)


def test_calculator_turn_then_final_answer(env):
    obs, reward, terminated, truncated, info = env.step("Let me add.\n" + call("calculator", expression="3/4 + 1/6"))
    assert obs.startswith("<tool_response>\n11/12 (about 0.9166666667)\n</tool_response>")
    assert "Tool calls left: 3" in obs
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_calls"] == [{"name": "calculator", "arguments": '{"expression": "3/4 + 1/6"}'}]
    assert info["tool_results"] == [{"name": "calculator", "content": "11/12 (about 0.9166666667)"}]
    assert info["tool_calls_used"] == 1 and info["tool_calls_left"] == 3 and info["turn"] == 1
    obs, reward, terminated, truncated, info = env.step("So the answer is \\boxed{11/12}.")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["correct"] and info["is_success"] and info["tool_calls_used"] == 1 and info["turn"] == 2
    assert obs == "Correct. The answer is 11/12."


def test_python_tool_and_several_calls_in_one_message(env):
    message = call("python", code="from fractions import Fraction\nFraction(3, 4) + Fraction(1, 6)") + call("calculator", expression="2*3")
    obs, reward, terminated, _, info = env.step(message)
    assert not terminated and reward == 0.0
    assert [r["content"] for r in info["tool_results"]] == ["Fraction(11, 12)", "6"]
    assert obs.count("<tool_response>") == 2


def test_tool_errors_are_feedback(env):
    obs, _, terminated, _, info = env.step(call("search", query="x") + call("calculator", expr="1") + call("python", code="1/0"))
    assert not terminated
    contents = [r["content"] for r in info["tool_results"]]
    assert contents[0].startswith("Error: unknown tool 'search'")
    assert "missing required argument 'expression'" in contents[1] and "unknown argument 'expr'" in contents[1]
    assert "ZeroDivisionError" in contents[2]


def test_malformed_call_does_not_use_the_budget(env):
    obs, reward, terminated, _, info = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>')
    assert not terminated and reward == 0.0
    assert "not valid JSON" in obs and '<tool_call>{"name": "<tool name>"' in obs
    assert info["tool_calls_used"] == 0 and len(info["tool_errors"]) == 1


def test_tool_call_limit(env):
    env = MathToolEnv(data_files=RECORDS, max_tool_calls=2)
    env.reset(seed=0, options={"index": 1})
    obs, _, terminated, _, info = env.step(call("calculator", expression="2") * 3)
    assert not terminated and info["tool_calls_used"] == 2 and info["tool_calls_left"] == 0
    assert "limit (2) reached; this call was not run" in info["tool_results"][2]["content"]
    assert "No tool calls are left" in obs
    obs, reward, terminated, _, info = env.step(call("calculator", expression="2**10") + " \\boxed{1024}")
    assert terminated and reward == 1.0 and info["tool_calls_used"] == 2
    assert obs.startswith("No tool calls were left, so this message was graded as the final answer.")


def test_turn_limit():
    env = MathToolEnv(data_files=RECORDS, max_turns=2)
    env.reset(seed=0, options={"index": 1})
    obs, _, terminated, _, _ = env.step(call("calculator", expression="2**10"))
    assert not terminated and "This is your last turn" in obs
    obs, reward, terminated, truncated, _ = env.step(call("calculator", expression="1"))
    assert terminated and not truncated and reward == 0.0
    assert "That was the last turn" in obs and "No final answer found" in obs


def test_zero_tool_calls_means_answer_at_once():
    env = MathToolEnv(data_files=RECORDS, max_tool_calls=0)
    env.reset(seed=0, options={"index": 1})
    _, reward, terminated, _, _ = env.step(call("calculator", expression="1") + "\\boxed{1024}")
    assert terminated and reward == 1.0


def test_only_the_calculator():
    env = MathToolEnv(data_files=RECORDS, tools=["calculator"])
    _, info = env.reset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["calculator"]
    _, _, _, _, info = env.step(call("python", code="print(1)"))
    assert info["tool_results"][0]["content"].startswith("Error: unknown tool 'python'. Available tools: calculator")


def test_python_output_is_made_printable_and_cut():
    env = MathToolEnv(data_files=RECORDS, max_tool_output=200)
    env.reset(seed=0)
    obs, *_ = env.step(call("python", code="print('\\x00\\x1b[31m' + 'z' * 1000)"))
    assert is_printable_text(obs) and "truncated" in obs and len(obs) < 600


def test_python_tool_timeout_is_configurable():
    env = MathToolEnv(data_files=RECORDS, python_timeout=0.5)
    env.reset(seed=0)
    _, _, terminated, _, info = env.step(call("python", code="while True: pass"))
    assert not terminated and "timed out" in info["tool_results"][0]["content"]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tool_calls": -1}, {"max_tool_calls": 2.5}, {"max_turns": 0}, {"tools": ["python", "shell"]}, {"tools": []},
     {"python_timeout": 0}, {"python_timeout": 100}, {"python_memory_mb": 1}, {"max_tool_output": 5}, {"format_reward": 3}],
)
def test_bad_kwargs(kwargs):
    with pytest.raises(ConfigError):
        MathToolEnv(data_files=RECORDS, **kwargs)


def test_seeded_episodes_are_deterministic():
    def play(seed):
        env = MathToolEnv()
        obs, info = env.reset(seed=seed)
        steps = [env.step(call("calculator", expression="6*7")), env.step("\\boxed{42}")]
        return obs, info, [(o, r, t, tr, i) for o, r, t, tr, i in steps]

    assert play(5) == play(5)
    assert play(5)[0] != play(6)[0]


def test_hostile_actions_never_raise():
    env = MathToolEnv(data_files=RECORDS, python_timeout=1.0)
    env.reset(seed=0)
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", '{"name": "calculator", "arguments": {"expression": "', '"}}', "NaN", "Infinity", "\\boxed{", "}", "\x00", "\ud800", "🙂", "[", "]"]
    actions = list(HOSTILE_ACTIONS) + ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(300)]
    actions.append(call("calculator", expression="9**9**9") + '<tool_call>{"name": "calculator", "arguments": {"expression": NaN}}</tool_call>')
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert isinstance(obs, str) and is_printable_text(obs) and len(obs) <= env.max_observation_length
        json.dumps(info, allow_nan=False)
        if terminated or truncated:
            env.reset()


def test_finds_expressions():
    assert find_expression("Evaluate 12 + 3 × (4 − 1).") == "12 + 3 × (4 − 1)"
    assert find_expression("Ava has 3 apples.") is None


@pytest.mark.parametrize("tools", [("python", "calculator"), ("python",)], ids=["calculator", "python-alone"])
def test_the_baseline_solves_every_written_out_expression_through_the_tool_offered(tools):
    """With a calculator it calls that; with python alone (sandboxed) it prints the expression written in Python, and
    the prompt's call example and the invalid-action hint name python."""
    tool = "calculator" if "calculator" in tools else "python"
    env = MathToolEnv(split="test", shuffle=False, tools=tools)
    assert f'"name": "{tool}"' in env.get_system_prompt() and f'"name": "{tool}"' in env.invalid_action_hint()
    assert ("calculator" in env.get_system_prompt()) == (tool == "calculator")
    solved = 0
    for i, problem in enumerate(env.problems):
        if problem.topic != "order_of_operations":
            continue
        obs, info = env.reset(options={"index": i})
        agent = BaselineMathToolAgent(seed=0)
        obs, _, terminated, _, step_info = env.step(agent(obs, info))
        assert not terminated and step_info["tool_calls"][0]["name"] == tool, step_info
        answer = agent(obs, step_info)
        assert not answer.split("\\boxed{")[1].rstrip("}").endswith(".0")  # a whole quotient reads as a whole number
        _, reward, terminated, _, _ = env.step(answer)
        assert terminated
        solved += reward
    assert solved == 25


def test_made_through_the_hub():
    env = gym.make("tinker/MathTool-v0", max_tool_calls=2, tools=("calculator",))
    obs, info = env.reset(seed=0)
    assert len(info["tools"]) == 1 and "up to 2 calls" in obs
    spec = tinkergym.spec("tinker/MathTool-v0")
    assert spec.turns == "multi" and spec.data == "dataset" and spec.baseline == "tinkergym_math.agents:BaselineMathToolAgent"


def test_conformance():
    check_text_env(MathToolEnv(), baseline=BaselineMathToolAgent)
    check_text_env(gym.make("tinker/MathTool-v0", split="test", max_tool_calls=1, max_turns=2), baseline=BaselineMathToolAgent)
