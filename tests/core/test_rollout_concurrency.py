"""Env calls of a rollout run on a thread pool without changing a single trajectory.

The same seeds give the same trajectories with one worker or many, even when env steps finish in a
different order than they started; an env failure still ends only its own episode; no env is called from
two threads at once; and no pool thread outlives the rollout, even when the sampler fails.
"""

from __future__ import annotations

import random
import threading
import time
import zlib

import pytest

pytest.importorskip("transformers")

from tinkergym.backends.models import build_tiny_model
from tinkergym.protocol.types import SampledSequence, SampleRequest, SampleResponse
from tinkergym.chat import ChatTemplateRenderer
from tinkergym.errors import ConfigError
from tinkergym.rollouts import RolloutConfig, rollout

import tinkergym

PYTHON_CALL = '<tool_call>{"name": "python", "arguments": {"code": "x = 6 * 7\\nx"}}</tool_call>'
CALCULATOR_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>'


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> ChatTemplateRenderer:
    return ChatTemplateRenderer(build_tiny_model(tmp_path_factory.mktemp("tiny")))


class PromptHashSampler:
    """Answers each prompt with a text picked by a hash of the prompt, so every answer depends on its episode so far."""

    def __init__(self, renderer: ChatTemplateRenderer, texts: list[str], fail_on_call: int | None = None) -> None:
        self.renderer, self.texts, self.fail_on_call = renderer, texts, fail_on_call
        self.calls = 0

    def sample(self, request: SampleRequest) -> SampleResponse:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("sampler down")
        out = []
        for prompt in request.prompts:
            text = self.texts[zlib.crc32(repr(prompt).encode()) % len(self.texts)]
            ids = self.renderer.tokenizer.encode(text, add_special_tokens=False)[: request.params.max_new_tokens - 1]
            ids.append(self.renderer.tokenizer.eos_token_id)
            out.append([SampledSequence(tokens=ids, logprobs=[-0.25] * len(ids), finish_reason="stop")])
        return SampleResponse(sequences=out)


class CallLog:
    """Counts env calls in flight, overall and per env, from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: dict[int, int] = {}
        self.most_at_once = 0
        self.most_per_env = 0
        self.threads: set[str] = set()
        self.calls = 0

    def enter(self, env: object) -> None:
        with self.lock:
            self.in_flight[id(env)] = self.in_flight.get(id(env), 0) + 1
            self.most_per_env = max(self.most_per_env, self.in_flight[id(env)])
            self.most_at_once = max(self.most_at_once, sum(self.in_flight.values()))
            self.threads.add(threading.current_thread().name)
            self.calls += 1

    def leave(self, env: object) -> None:
        with self.lock:
            self.in_flight[id(env)] -= 1


class Jittery:
    """Wraps an env: each call sleeps a random few milliseconds, so calls finish out of order; may fail on a step."""

    def __init__(self, env, log: CallLog, fail_at_step: int | None = None, fail_reset: bool = False) -> None:
        self.env, self.log, self.fail_at_step, self.fail_reset = env, log, fail_at_step, fail_reset
        self.jitter = random.Random()  # unseeded on purpose: timing must not matter
        self.steps = 0

    def _call(self, fn, *args, **kwargs):
        self.log.enter(self)
        try:
            time.sleep(self.jitter.uniform(0, 0.004))
            return fn(*args, **kwargs)
        finally:
            self.log.leave(self)

    def reset(self, seed=None, options=None):
        if self.fail_reset:
            raise RuntimeError("reset bug")
        self.steps = 0
        return self._call(self.env.reset, seed=seed, options=options)

    def step(self, action):
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("step bug")
        return self._call(self.env.step, action)


CASES = {
    "gomoku": (lambda: tinkergym.make("tinker/Gomoku-v0", size=7), ["D4", "C3", "E5", "B2", "zz", "F6 please"], 5),
    "bandit": (lambda: tinkergym.make("tinker/Bandit-v0"), ["red", "blue", "green", "??"], 2),
    "math-tool": (lambda: tinkergym.make("tinker/MathTool-v0"), [PYTHON_CALL, PYTHON_CALL, CALCULATOR_CALL, "\\boxed{42}"], 4),
}


def _play(renderer, case: str, workers: int, seeds: list[int], **wrap) -> tuple[list, CallLog]:
    make_env, texts, max_turns = CASES[case]
    log = CallLog()
    envs = [Jittery(make_env(), log, **(wrap if i == 1 else {})) for i in range(len(seeds))]
    config = RolloutConfig(max_turns=max_turns, max_new_tokens=48, env_workers=workers)
    return rollout(envs, PromptHashSampler(renderer, texts), renderer, config, seeds=seeds), log


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_concurrent_env_calls_give_the_serial_trajectories(renderer, case) -> None:
    seeds = [0, 0, 1, 2, 3, 4]
    serial, serial_log = _play(renderer, case, 1, seeds)
    concurrent, log = _play(renderer, case, 4, seeds)
    assert concurrent == serial
    assert serial_log.threads == {threading.main_thread().name} and serial_log.most_at_once == 1
    assert log.most_at_once > 1 and log.most_per_env == 1, "calls overlap, but never two on one env"
    assert all(name.startswith("tinkergym-env") for name in log.threads)
    if case == "math-tool":
        responses = [m["content"] for t in serial for m in t.messages[2:] if m["role"] == "user"]
        assert any("<tool_response>\n42\n</tool_response>" in r for r in responses), "the python tool ran"


def test_an_env_failure_ends_only_its_episode_with_any_pool(renderer) -> None:
    seeds = [0, 1, 2, 3]
    serial, _ = _play(renderer, "gomoku", 1, seeds, fail_at_step=2)
    concurrent, _ = _play(renderer, "gomoku", 4, seeds, fail_at_step=2)
    assert concurrent == serial
    failed = concurrent[1]
    assert failed.failed and "step bug" in failed.error and sum(failed.loss_mask) == 0 and len(failed.rewards) == 1
    assert not any(t.failed for i, t in enumerate(concurrent) if i != 1)
    broken, _ = _play(renderer, "gomoku", 4, seeds, fail_reset=True)
    assert broken[1].failed and "reset bug" in broken[1].error and broken[1].tokens == []
    assert [t for i, t in enumerate(broken) if i != 1] == [t for i, t in enumerate(serial) if i != 1]


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tinkergym-env")]


def test_no_pool_thread_outlives_a_rollout_even_when_the_sampler_fails(renderer) -> None:
    log = CallLog()
    envs = [Jittery(tinkergym.make("tinker/Gomoku-v0", size=7), log) for _ in range(4)]
    rollout(envs, PromptHashSampler(renderer, ["D4"]), renderer, RolloutConfig(max_turns=3, env_workers=4), seeds=[0, 1, 2, 3])
    assert _pool_threads() == []
    sampler = PromptHashSampler(renderer, ["D4", "C3"], fail_on_call=2)
    with pytest.raises(RuntimeError, match="sampler down"):
        rollout(envs, sampler, renderer, RolloutConfig(max_turns=3, env_workers=4), seeds=[0, 1, 2, 3])
    assert _pool_threads() == []
    calls = log.calls
    time.sleep(0.02)
    assert log.calls == calls and not any(log.in_flight.values()), "no env is called after the rollout returns"


def test_one_env_passed_twice_is_never_called_from_two_threads(renderer) -> None:
    log = CallLog()
    env = Jittery(tinkergym.make("tinker/Bandit-v0"), log)
    trajectories = rollout([env, env], PromptHashSampler(renderer, ["red"]), renderer, RolloutConfig(env_workers=8), seeds=[0, 1])
    assert log.threads == {threading.main_thread().name} and len(trajectories) == 2


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_env_workers_must_be_a_positive_whole_number(workers) -> None:
    with pytest.raises(ConfigError, match="env_workers"):
        RolloutConfig(env_workers=workers)
