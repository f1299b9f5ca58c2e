"""Tests of tinkergym-reasoning-gym: the generated catalog, every id, conformance on a sample, scoring, training."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import resource
import subprocess
import sys
import time

import pytest

import tinkergym
from tinkergym.errors import ConfigError
from tinkergym.testing import HOSTILE_ACTIONS, check_text_env
from tinkergym_reasoning_gym import TaggedGuessAgent, catalog

SPECS = [s for s in tinkergym.list_envs() if s.distribution == "tinkergym-reasoning-gym"]


def first_of_each_category() -> list[str]:
    """One id per reasoning-gym category (the first by name), read from the generated metadata."""
    chosen: dict[str, str] = {}
    for spec in SPECS:
        chosen.setdefault(spec.extra["category"], spec.id)
    return sorted(chosen.values())


# ----- the catalog: generated from reasoning-gym's registry and checked against the installed one -----------
def test_the_ids_are_reasoning_gyms_datasets_and_the_files_are_current() -> None:
    from reasoning_gym.factory import DATASETS

    assert catalog.differences() == [], "run: python -m tinkergym_reasoning_gym.catalog --write, then reinstall the package"
    expected = {catalog.env_id(name) for name in DATASETS}
    installed = {ep.name for ep in md.distribution("tinkergym-reasoning-gym").entry_points.select(group="tinkergym.envs")}
    assert installed == expected, "the installed entry points are stale: reinstall the package (pip install -e)"
    assert {s.id for s in SPECS} == expected and len(expected) >= 100
    assert all(s.kind == "env" and s.turns == "single" and s.data == "procedural" and s.summary for s in SPECS)


def test_the_check_fails_when_reasoning_gym_adds_a_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    from reasoning_gym.factory import DATASETS

    monkeypatch.setitem(DATASETS, "zz_new_dataset", DATASETS["leg_counting"])
    assert catalog.differences() == [str(catalog.MANIFEST), str(catalog.PYPROJECT)]
    assert catalog.main(["--check"]) == 1


@pytest.mark.slow
def test_listing_takes_under_a_second_and_imports_no_env_library() -> None:
    code = (
        "import sys, tinkergym; n = sum(s.id.startswith('tinker/rg.') for s in tinkergym.list_envs()); "
        "print(n, sorted(m for m in ('reasoning_gym', 'textarena', 'tinkergym_reasoning_gym', 'torch') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1) == [
        str(len(SPECS)), "[]\n"]
    cli = [sys.executable, "-m", "tinkergym", "envs", "list"]
    # The command's CPU time, the best of three: its wall time on an idle machine, less sensitive to other work on a busy one.
    cli, best = [sys.executable, "-m", "tinkergym", "envs", "list"], math.inf
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        listing = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    assert all(spec.id in listing for spec in SPECS)
    assert best < 1.0, f"tinkergym envs list took {best:.2f} s of CPU time"


# ----- every id, and the checkers on a sample ---------------------------------------------------------------
@pytest.mark.slow
def test_every_dataset_is_made_reset_and_answered() -> None:
    for spec in SPECS:
        env = tinkergym.make(spec.id)
        obs, info = env.reset(seed=0)
        assert env.observation_space.contains(obs) and obs.endswith("Give your final answer as <answer>...</answer>."), spec.id
        assert info["dataset"] == spec.id[len("tinker/rg."):-len("-v0")] and "answer" in info["system_prompt"]
        obs, reward, terminated, truncated, info = env.step(TaggedGuessAgent()(obs, info))
        assert 0.0 <= reward <= 1.0 and terminated and not truncated and env.observation_space.contains(obs), spec.id
        assert "scorer_error" not in info or "failed" in info["scorer_error"], (spec.id, info)
        json.dumps(info)


@pytest.mark.parametrize("env_id", first_of_each_category())
def test_a_dataset_of_each_category_passes_the_checkers(env_id: str) -> None:
    check_text_env(tinkergym.make(env_id), baseline=TaggedGuessAgent, fuzz_count=100)


@pytest.mark.parametrize("env_id", first_of_each_category())
def test_the_expected_answer_scores_one(env_id: str) -> None:
    env = tinkergym.make(env_id)
    env.reset(seed=3)
    expected = env.unwrapped.entry["answer"]
    if expected is None:
        pytest.skip(f"{env_id} has no single expected answer (its scorer verifies)")
    _, reward, terminated, _, info = env.step(f"Let me think.\n<answer>{expected}</answer>")
    assert (reward, terminated, info["is_success"]) == (1.0, True, True)


# ----- the episode ------------------------------------------------------------------------------------------
def test_a_reply_without_an_answer_is_a_bad_action_with_the_penalty() -> None:
    env = tinkergym.make("tinker/rg.leg_counting-v0")
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("It is 42.")
    assert (reward, terminated, info["invalid_action"]) == (-0.1, True, True) and "<answer>" in obs
    env = tinkergym.make("tinker/rg.leg_counting-v0", answer_tag=None, invalid_action_penalty=-0.5)
    env.reset(seed=0)
    expected = env.unwrapped.entry["answer"]
    assert env.step(expected)[1] == 1.0
    env.reset(seed=0)
    assert env.step(None)[1] == -0.5


def test_hostile_answers_never_raise_and_stay_in_range() -> None:
    env = tinkergym.make("tinker/rg.basic_arithmetic-v0")
    for action in [*HOSTILE_ACTIONS, *(f"<answer>{a}</answer>" for a in HOSTILE_ACTIONS if isinstance(a, str) and len(a) < 9000)]:
        env.reset(seed=1)
        obs, reward, terminated, _, info = env.step(action)
        assert env.observation_space.contains(obs) and terminated and (reward == -0.1 or 0.0 <= reward <= 1.0)
        json.dumps(info)


@pytest.mark.slow
def test_a_scorer_that_hangs_is_stopped_and_one_that_raises_scores_zero() -> None:
    env = tinkergym.make("tinker/rg.polynomial_multiplication-v0", score_timeout=1.0)
    env.reset(seed=0)
    env.step("<answer>x</answer>")  # starts the scoring process outside the timed call
    env.reset(seed=0)
    start = time.monotonic()
    _, reward, _, _, info = env.step("<answer>1e999999</answer>")  # sympy parses this for about half a minute
    assert reward == 0.0 and "took more than 1 s" in info["scorer_error"] and time.monotonic() - start < 10
    env.reset(seed=0)
    expected = env.unwrapped.entry["answer"]
    assert env.step(f"<answer>{expected}</answer>")[1] == 1.0, "a new scoring process takes over"
    env = tinkergym.make("tinker/rg.prime_factorization-v0")
    env.reset(seed=0)
    _, reward, _, _, info = env.step("<answer>banana</answer>")
    assert reward == 0.0 and info["scorer_error"].startswith("the scorer failed: ValueError")


# ----- kwargs: seeds, difficulty, config fields ---------------------------------------------------------------
def test_seeds_pick_questions_and_the_dataset_seed_changes_them() -> None:
    env = tinkergym.make("tinker/rg.leg_counting-v0")
    first = env.reset(seed=4)[0]
    assert env.reset(seed=4)[0] == first and len({env.reset(seed=s)[0] for s in range(6)}) > 1
    other = tinkergym.make("tinker/rg.leg_counting-v0", seed=7)
    assert other.reset(seed=4)[0] != first
    assert env.reset(seed=0, options={"index": 3})[1]["index"] == 3


def test_difficulty_and_config_fields_reach_the_dataset() -> None:
    easy = tinkergym.make("tinker/rg.leg_counting-v0", difficulty=0).unwrapped.config
    hard = tinkergym.make("tinker/rg.leg_counting-v0", difficulty=3).unwrapped.config
    assert hard.max_animals > easy.max_animals
    assert tinkergym.make("tinker/rg.leg_counting-v0", difficulty=3, max_animals=4).unwrapped.config.max_animals == 4
    mixed = tinkergym.make("tinker/rg.composite-v0", datasets=[{"name": "chain_sum", "weight": 1, "config": {}}])
    assert mixed.reset(seed=0)[1]["dataset"] == "composite"
    assert "ReasoningGymEnv" in type(mixed.unwrapped).__mro__[1].__name__ and "min_animals" in (
        tinkergym.make("tinker/rg.leg_counting-v0").unwrapped.__doc__ or "")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"difficulty": 99}, "levels 0 to"),
        ({"difficulty": "hard"}, "difficulty='hard'"),
        ({"min_legs": 3}, "min_legs is not a field of LegCountingConfig"),
        ({"min_animals": 0}, "refused"),
        ({"answer_tag": "<a>"}, "answer_tag"),
        ({"score_timeout": 0}, "score_timeout"),
        ({"invalid_action_penalty": float("inf")}, "invalid_action_penalty"),
    ],
)
def test_bad_kwargs_are_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tinkergym.make("tinker/rg.leg_counting-v0", **kwargs)


def test_difficulty_without_a_curriculum_is_refused() -> None:
    spec = next(s for s in SPECS if not s.extra["curriculum"] and s.id != "tinker/rg.composite-v0")
    with pytest.raises(ConfigError, match="has no curriculum"):
        tinkergym.make(spec.id, difficulty=0)


# ----- training ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_model_trains_a_few_steps_on_leg_counting(tmp_path) -> None:
    pytest.importorskip("torch")
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.session import TrainingRun

    # The tiny model's replies carry no answer tag (tied rewards); the KL term makes every sequence train all the same.
    config = TrainConfig(env="tinker/rg.leg_counting-v0", model="tiny", steps=2, batch_size=1, group_size=2, max_turns=1,
                         max_new_tokens=6, lr=1e-3, kl_coef=0.01, dtype="float32", transcripts_every=0, out=str(tmp_path / "run"))
    TrainingRun(config).run(progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["episodes"] == 2 and r["batch/trained_sequences"] == 2 and r["episodes/failed"] == 0 for r in records)
    assert all(-0.1 <= r["reward/mean"] <= 1.0 for r in records)
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
