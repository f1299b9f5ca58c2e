"""Conformance checkers for text environments: :func:`check_text_env` and :func:`check_text_aec_env`.

Each runs the peer suite (Gymnasium's ``check_env``; PettingZoo's ``api_test``) and then tinkergym's
own checks: whole episodes are identical under the same seed and actions; every observation is inside
its space; rewards are finite; ``info`` is JSON-serializable; a fuzz of random and hostile action
strings never raises. Env-specific exemptions come from the env's ``metadata["tinkergym"]["checker_skip"]``
(names from :data:`CHECKS`), never from name lists in here.

PettingZoo's ``api_test`` assumes numpy observations in one comparison,
``_test_observation_space_compatibility``, which compares ``space.dtype`` with ``observation.dtype``; a
``str`` has no dtype. :func:`check_text_aec_env` runs ``api_test`` with only that comparison skipped,
and covers its intent (every observation is inside its space) with its own check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import random
import warnings
from typing import Any
from collections.abc import Callable
from unittest import mock

from tinkergym.agents import AgentFactory, RandomTextAgent
from tinkergym.episodes import Transcript, run_aec_episode, run_episode
from tinkergym.errors import CheckFailed

#: The checks an env may opt out of, by name, in ``metadata["tinkergym"]["checker_skip"]``.
CHECKS = ("peer", "determinism", "fuzz")

#: Hostile actions every env must survive: empty, whitespace, huge, control characters, unicode edge cases.
HOSTILE_ACTIONS: tuple[Any, ...] = (
    "",
    " ",
    "\n\n\n",
    "\x00",
    "\x1b[31mred\x1b[0m",
    "A" * 100_000,
    "9" * 5_000,
    "-1,-1",
    "99999999999999999999999999,1",
    "NaN",
    "inf",
    "{",
    '{"name": "python", "arguments": {"code": "while True: pass"',
    "<tool_call>not json</tool_call>",
    "\\boxed{",
    "\ud800",  # lone surrogate
    "\u202e\u200b\ufeff",
    "🙂" * 50,
    "日本語のテキスト",
    "Ω≈ç√∫",
    "None",
    "' OR 1=1; --",
    "%s%s%s%n",
    None,
    b"bytes action",
    12,
    3.5,
    ["list"],
)


def _skipped(env: Any) -> set[str]:
    skip = set(getattr(env, "metadata", {}).get("tinkergym", {}).get("checker_skip", ()))
    unknown = skip - set(CHECKS)
    if unknown:
        raise CheckFailed(f"metadata['tinkergym']['checker_skip'] names unknown checks {sorted(unknown)}; known: {CHECKS}")
    return skip


def _check_value(where: str, space: Any, observation: Any, reward: Any, info: Any, flags: tuple[Any, ...] = ()) -> None:
    """One step's output obeys the contract."""
    if not space.contains(observation):
        shown = repr(observation)[:200]
        raise CheckFailed(f"{where}: observation is not inside {space} (printable text within the length bound): {shown}")
    try:
        ok = math.isfinite(float(reward))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckFailed(f"{where}: reward {reward!r} is not a finite number")
    for flag in flags:
        if not isinstance(flag, bool):
            raise CheckFailed(f"{where}: terminated/truncated must be bool, got {type(flag).__name__}")
    try:
        json.dumps(info, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckFailed(f"{where}: info is not JSON-serializable ({exc}): {repr(info)[:200]}") from exc


def _fuzz_actions(count: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    randoms = [RandomTextAgent(seed=rng.randrange(2**31), max_length=rng.choice((8, 64, 512)))("", {}) for _ in range(count)]
    return [*HOSTILE_ACTIONS, *randoms]


def _agent_factory(baseline: AgentFactory | None) -> Callable[[int], Any]:
    return (lambda s: baseline(seed=s)) if baseline is not None else (lambda s: RandomTextAgent(seed=s))


def _comparable(value: Any) -> Any:
    """``value`` with arrays (the images of :class:`~tinkergym.spaces.TextWithImages` observations) as digests, so ``==`` applies."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_comparable(v) for v in value)
    if hasattr(value, "tobytes") and hasattr(value, "shape"):
        return ("array", tuple(value.shape), str(value.dtype), hashlib.sha256(value.tobytes()).hexdigest())
    return value


def _compare_runs(first: Transcript, second: Transcript, what: str) -> None:
    a, b = _comparable(dataclasses.asdict(first)), _comparable(dataclasses.asdict(second))  # the pixels, not to_dict's marks
    if a != b:
        for i, (x, y) in enumerate(zip(a["turns"], b["turns"])):
            if x != y:
                raise CheckFailed(f"{what}: two runs with the same seed and actions differ at turn {i}: {x} != {y}")
        raise CheckFailed(f"{what}: two runs with the same seed and actions differ: {str(a)[:300]} != {str(b)[:300]}")


def check_text_env(
    env: Any,
    *,
    baseline: AgentFactory | None = None,
    seeds: tuple[int, ...] = (0, 1),
    fuzz_count: int = 200,
    max_steps: int = 2_000,
) -> None:
    """Check a single-agent text env against Gymnasium's ``check_env`` and the text-env contract.

    Args:
        env: The env (wrapped or not; the unwrapped env goes to ``check_env``).
        baseline: The package's agent factory ``Agent(seed=...)``; random text if ``None``.
        seeds: Seeds of the episodes played twice for the determinism check.
        fuzz_count: Random action strings tried on top of :data:`HOSTILE_ACTIONS`.
        max_steps: Bound on the length of each played episode.

    Raises:
        CheckFailed: with a message that names the broken rule.
    """
    from gymnasium.utils.env_checker import check_env

    from tinkergym.core import TextEnv

    skip = _skipped(env.unwrapped)
    if not isinstance(env.unwrapped, TextEnv):
        warnings.warn(f"{type(env.unwrapped).__name__} is not a tinkergym.TextEnv; checking the contract anyway", stacklevel=2)
    if "peer" not in skip:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # render_mode="human" prints
                check_env(env.unwrapped, skip_render_check=env.unwrapped.spec is None)
        except (AssertionError, TypeError, ValueError, AttributeError, NotImplementedError) as exc:
            raise CheckFailed(f"gymnasium check_env failed: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # the env itself raised on the peer suite's (random) actions
            raise CheckFailed(f"gymnasium check_env: the env raised {type(exc).__name__}: {exc}") from exc
    make_agent = _agent_factory(baseline)
    for seed in seeds:
        first = run_episode(env, make_agent(seed), seed=seed, max_steps=max_steps)
        _check_transcript(env.observation_space, first, f"episode with seed {seed}")
        if "determinism" not in skip:
            _compare_runs(first, run_episode(env, make_agent(seed), seed=seed, max_steps=max_steps), f"seed {seed}")
    if "fuzz" not in skip:
        _fuzz_single(env, _fuzz_actions(fuzz_count, seeds[0]))


def _check_transcript(space: Any, transcript: Transcript, what: str) -> None:
    if not space.contains(transcript.first_observation):
        raise CheckFailed(f"{what}: the reset observation is not inside {space}")
    for i, turn in enumerate(transcript.turns):
        _check_value(f"{what}, turn {i}", space, turn.observation, turn.reward, turn.info, (turn.terminated, turn.truncated))


def _fuzz_single(env: Any, actions: list[Any]) -> None:
    observation, info = env.reset(seed=12345)
    _check_value("fuzz reset", env.observation_space, observation, 0.0, info)
    for action in actions:
        try:
            observation, reward, terminated, truncated, info = env.step(action)
        except Exception as exc:
            raise CheckFailed(f"step({repr(action)[:80]}) raised {type(exc).__name__}: {exc}; a bad action must become an observation") from exc
        _check_value(f"fuzz step({repr(action)[:40]})", env.observation_space, observation, reward, info, (terminated, truncated))
        if terminated or truncated:
            env.reset()


def check_text_aec_env(
    env: Any,
    *,
    baseline: AgentFactory | None = None,
    seeds: tuple[int, ...] = (0, 1),
    fuzz_count: int = 200,
    api_cycles: int = 200,
    max_steps: int = 2_000,
) -> None:
    """Check a multi-agent AEC text env against PettingZoo's ``api_test`` and the text-env contract.

    ``api_test`` runs with ``_test_observation_space_compatibility`` skipped (it compares numpy dtypes,
    and a ``str`` observation has none); every observation is checked against its space here instead.

    Raises:
        CheckFailed: with a message that names the broken rule.
    """
    from pettingzoo.test import api_test

    skip = _skipped(env.unwrapped)
    if "peer" not in skip:
        printed = io.StringIO()  # api_test prints "Starting API test" and "Passed API test" on stdout, every call
        with mock.patch("pettingzoo.test.api_test._test_observation_space_compatibility", lambda *a, **k: None):
            try:
                with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
                    warnings.simplefilter("ignore")  # api_test warns that text spaces are not Box/Discrete
                    api_test(env, num_cycles=api_cycles)
            except (AssertionError, TypeError, ValueError, AttributeError, KeyError) as exc:
                raise CheckFailed(f"pettingzoo api_test failed: {type(exc).__name__}: {exc}{_printed(printed)}") from exc
            except Exception as exc:  # the env itself raised on the peer suite's (random) actions
                raise CheckFailed(f"pettingzoo api_test: the env raised {type(exc).__name__}: {exc}{_printed(printed)}") from exc
    make_agent = _agent_factory(baseline)
    for seed in seeds:
        def seats(s: int = seed) -> dict[str, Any]:
            return {a: make_agent(s + i) for i, a in enumerate(env.possible_agents)}

        first = run_aec_episode(env, seats(), seed=seed, max_steps=max_steps)
        _check_transcript(env.observation_space(env.possible_agents[0]), first, f"game with seed {seed}")
        if "determinism" not in skip:
            _compare_runs(first, run_aec_episode(env, seats(), seed=seed, max_steps=max_steps), f"seed {seed}")
    if "fuzz" not in skip:
        _fuzz_aec(env, _fuzz_actions(fuzz_count, seeds[0]))


#: What ``api_test`` itself prints on every call: left out of a failure's message.
_API_TEST_LINES = ("Starting API test", "Passed API test")


def _printed(captured: io.StringIO, limit: int = 500) -> str:
    """What the env printed during a failed peer check, for its message (the end of it, where it failed); "" for nothing."""
    lines = [line for line in captured.getvalue().splitlines() if line.strip() and line.strip() not in _API_TEST_LINES]
    text = "\n".join(lines)
    return f" (it printed: {'...' + text[-limit:] if len(text) > limit else text})" if text else ""


def _fuzz_aec(env: Any, actions: list[Any]) -> None:
    env.reset(seed=12345)
    for action in actions:
        if not env.agents:
            env.reset()
        agent = env.agent_selection
        observation, _, terminated, truncated, _ = env.last()
        try:
            env.step(None if terminated or truncated else action)
        except Exception as exc:
            raise CheckFailed(f"step({repr(action)[:80]}) raised {type(exc).__name__}: {exc}; a bad action must become an observation") from exc
        if agent in env.agents:
            _check_value(f"fuzz step({repr(action)[:40]})", env.observation_space(agent), env.observe(agent), env.rewards[agent], env.infos[agent])
