"""Every discovered env passes the conformance checker that matches its kind, with its package's baseline.

The checker's fuzz sends random printable text; tool envs (those offering ``info["tools"]`` on reset)
also get tool-shaped hostile messages here: calls with random unicode, NUL bytes, bracket soup nested
thousands deep and huge numbers in their arguments.
"""

from __future__ import annotations

import json
import math
import random

import pytest

import tinkergym
from testkit import own_envs  # registered by tests/conftest.py
from tinkergym.registry import load_baseline
from tinkergym.testing import check_text_aec_env, check_text_env

SHIPPED = {"tinker/Gomoku-v0", "tinker/GomokuDuel-v0", "tinker/Math-v0", "tinker/MathTool-v0", "tinker/Bandit-v0", "tinker/Household-v0",
           "tinker/Geometry-v0", "tinker/GeometryTool-v0", "tinker/ColourSquare-v0"}


def test_every_shipped_env_is_discovered() -> None:
    assert SHIPPED <= {s.id for s in tinkergym.list_envs()}


@pytest.mark.parametrize("env_spec", own_envs(), ids=lambda s: s.id)
def test_env_conforms(env_spec) -> None:
    baseline = load_baseline(env_spec)
    if env_spec.kind == "aec":
        check_text_aec_env(tinkergym.make_aec(env_spec.id), baseline=baseline)
    else:
        check_text_env(tinkergym.make(env_spec.id), baseline=baseline)


def _hostile_value(rng: random.Random) -> str:
    """A JSON text for one argument: random unicode, bracket soup, a huge number or a deep nest."""
    kind = rng.randrange(6)
    if kind == 0:
        return json.dumps("".join(chr(rng.randrange(0, 0x10FFFF)) for _ in range(rng.randint(0, 40))), ensure_ascii=False)
    if kind == 1:
        return "".join(rng.choice("[]{}\",:") for _ in range(rng.randint(1, 200)))
    if kind == 2:
        return json.dumps(rng.choice(["1e999999999", "9" * 4_000, "10**10**10", "0.5**10000", "factorial(10**9)", "2**-99999", "-1e-999999999"]))
    if kind == 3:
        depth = rng.choice((50, 65, 500, 990, 3_000))
        return "[" * depth + "]" * depth
    if kind == 4:
        return rng.choice(["1e999999", "-" + "9" * 5_000, "NaN", "Infinity", "null", "true"])
    return json.dumps("\x00" * rng.randint(1, 5) + "1+1")


def _hostile_message(rng: random.Random, tools: list[dict]) -> str:
    """A message with zero or more tool calls, some malformed, around random text."""
    parts = []
    for _ in range(rng.randint(0, 3)):
        function = rng.choice(tools)["function"] if rng.random() < 0.8 else {"name": "no_such_tool", "parameters": {}}
        names = list(function.get("parameters", {}).get("properties", {})) or ["x"]
        arguments = ", ".join(f"{json.dumps(rng.choice(names + ['extra']))}: {_hostile_value(rng)}" for _ in range(rng.randint(0, 2)))
        call = f'{{"name": {json.dumps(function["name"])}, "arguments": {{{arguments}}}}}'
        if rng.random() < 0.2:
            call = call[: rng.randrange(len(call))]
        parts.append(rng.choice(["<tool_call>{}</tool_call>", "<tool_call>{}", "```json\n{}\n```", "{}"]).format(call))
    noise = "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randint(0, 30)))
    return noise + "".join(parts) + rng.choice(["", "\\boxed{1}", "\x00", "[" * 2_000])


@pytest.mark.slow
@pytest.mark.parametrize("env_spec", [s for s in own_envs() if s.kind == "env"], ids=lambda s: s.id)
def test_tool_envs_survive_hostile_tool_calls(env_spec) -> None:
    env = tinkergym.make(env_spec.id)
    observation, info = env.reset(seed=0)
    tools = info.get("tools")
    if not tools:
        pytest.skip(f"{env_spec.id} offers no tools")
    rng = random.Random(0)
    for i in range(300):
        action = _hostile_message(rng, tools)
        try:
            observation, reward, terminated, truncated, info = env.step(action)
        except Exception as exc:  # noqa: BLE001 - the failure names the action that raised
            pytest.fail(f"step {i} raised {type(exc).__name__}: {exc} for the action {action[:200]!r}")
        assert env.observation_space.contains(observation), f"step {i}: {observation[:200]!r}"
        assert math.isfinite(reward)
        json.dumps(info, allow_nan=False)
        if terminated or truncated:
            env.reset()
