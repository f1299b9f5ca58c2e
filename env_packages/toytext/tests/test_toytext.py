"""Tests of tinkergym-toytext and the generic adapter it uses (tinkergym.adapters.DiscreteTextEnv)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import gymnasium as gym
import pytest

import tinkergym
from tinkergym.adapters import DiscreteTextEnv, jsonable, plain_text
from tinkergym.errors import ConfigError
from tinkergym.testing import HOSTILE_ACTIONS, check_text_env
from tinkergym_toytext import BlackjackTextEnv, CliffWalkingTextEnv, FrozenLakeTextEnv, RandomActionAgent, TaxiTextEnv

IDS = {
    "tinker/FrozenLake-v0": FrozenLakeTextEnv,
    "tinker/Taxi-v0": TaxiTextEnv,
    "tinker/CliffWalking-v0": CliffWalkingTextEnv,
    "tinker/Blackjack-v0": BlackjackTextEnv,
}


# ----- conformance: Gymnasium's check_env, our checker, the hostile fuzz -------------------------------------
@pytest.mark.parametrize("env_id", sorted(IDS))
def test_every_id_conforms_through_the_hub(env_id: str) -> None:
    spec = tinkergym.spec(env_id)
    assert spec.distribution == "tinkergym-toytext" and spec.kind == "env"
    check_text_env(tinkergym.make(env_id), baseline=RandomActionAgent, fuzz_count=100)


@pytest.mark.parametrize("env_id", sorted(IDS))
def test_random_text_never_raises_and_bad_actions_cost_the_penalty(env_id: str) -> None:
    env = tinkergym.make(env_id)
    penalty, forfeit = env.unwrapped.invalid_action_penalty, env.unwrapped.forfeit_reward
    env.reset(seed=0)
    rng = random.Random(0)
    junk = [*HOSTILE_ACTIONS, *("".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(30))) for _ in range(150))]
    for action in junk:
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs) and json.dumps(info)
        if info.get("invalid_action"):
            assert obs.startswith("Invalid action:") and reward in (penalty, forfeit)
            assert "names" in info["error"] or "text" in info["error"] or "long" in info["error"]
        if terminated or truncated:
            env.reset()


# ----- action names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, text, name",
    [
        (FrozenLakeTextEnv, "LEFT", "left"),
        (FrozenLakeTextEnv, "I move down.", "down"),
        (TaxiTextEnv, "pick up", "pickup"),
        (TaxiTextEnv, "Time to drop-off the passenger", "dropoff"),
        (TaxiTextEnv, "west", "west"),
        (CliffWalkingTextEnv, " right\n", "right"),
        (BlackjackTextEnv, "I stand", "stick"),
        (BlackjackTextEnv, "Hit me!", "hit"),
    ],
)
def test_actions_are_typed_names(cls, text: str, name: str) -> None:
    env = cls()
    env.reset(seed=1)
    assert env.names[env.parse_action(text)] == name


def test_several_actions_or_none_are_refused_and_the_game_does_not_move() -> None:
    env = CliffWalkingTextEnv()
    first, info = env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("up or left")
    assert (reward, terminated) == (-1.0, False) and "names 2 actions (up, left)" in info["error"]
    assert env.env.unwrapped.s == 36 and "You (x) are at row 4, column 1" in obs and obs.endswith("Actions: up, right, down, left.")
    obs, reward, terminated, _, info = env.step("jump")
    assert "names no action" in info["error"]
    obs, reward, terminated, _, _ = env.step("fly")
    assert (reward, terminated) == (-100.0, True) and "invalid action 3 of 3" in obs


# ----- each game's text and rewards --------------------------------------------------------------------------
def test_frozen_lake_marks_you_and_pays_the_goal() -> None:
    env = FrozenLakeTextEnv(is_slippery=False)
    obs, _ = env.reset(seed=0)
    assert obs.startswith("@FFF\nFHFH") and "row 1, column 1 of 4x4" in obs
    for move in ("right", "right", "down", "down", "down"):
        obs, reward, terminated, _, info = env.step(move)
        assert reward == 0.0 and not terminated
    obs, reward, terminated, _, info = env.step("right")
    assert (reward, terminated, info["is_success"]) == (1.0, True, True) and "on the goal" in obs and "The episode is over." in obs


def test_frozen_lake_hole_ends_without_success() -> None:
    env = FrozenLakeTextEnv(is_slippery=False)
    env.reset(seed=0)
    env.step("down")
    obs, reward, terminated, _, info = env.step("right")
    assert (reward, terminated, info["is_success"]) == (0.0, True, False) and "on a hole" in obs


def test_taxi_text_tells_where_everyone_is_and_masks_moves() -> None:
    env = TaxiTextEnv()
    obs, info = env.reset(seed=0)
    assert "\x1b" not in obs and obs.count("T") >= 1 and "The passenger waits at stand" in obs
    assert set(info["legal_actions"]) <= set(env.names) and isinstance(info["action_mask"], list)
    obs, reward, terminated, _, info = env.step("pickup")  # not at the passenger: Gymnasium's -10
    assert reward == -10.0 and not terminated and info["action"] == "pickup"


def test_blackjack_has_its_own_table_and_reveals_the_dealer_at_the_end() -> None:
    env = BlackjackTextEnv()
    obs, info = env.reset(seed=3)
    assert obs.startswith("Your cards: ") and "The dealer shows:" in obs and env.env.render_mode is None
    obs, reward, terminated, _, info = env.step("stick")
    assert terminated and reward in (-1.0, 0.0, 1.0) and "The dealer's cards:" in obs
    assert info["is_success"] == (reward > 0)


def test_seeded_resets_are_identical_and_seeds_differ() -> None:
    env = TaxiTextEnv()
    assert env.reset(seed=5) == env.reset(seed=5)
    assert len({env.reset(seed=s)[0] for s in range(8)}) > 1


def test_gymnasium_kwargs_pass_through_and_bad_ones_are_config_errors() -> None:
    assert FrozenLakeTextEnv(map_name="8x8").reset(seed=0)[0].count("\n") >= 8
    with pytest.raises(ConfigError, match="FrozenLake-v1"):
        FrozenLakeTextEnv(map_name="9x9")
    with pytest.raises(ConfigError, match="max_invalid_actions"):
        TaxiTextEnv(max_invalid_actions=0)
    with pytest.raises(ConfigError, match="invalid_action_penalty"):
        TaxiTextEnv(invalid_action_penalty=float("nan"))


# ----- the generic adapter -----------------------------------------------------------------------------------
def test_adapter_wraps_any_discrete_ansi_env_with_default_or_given_names() -> None:
    env = DiscreteTextEnv("CliffWalking-v1")
    assert env.names == ("0", "1", "2", "3") and "0, 1, 2, 3" in env.system_prompt
    env.reset(seed=0)
    assert env.step("1")[1:3] == (-100.0, False) and env.step("0")[4]["state"] == 24  # onto the cliff and back; then up
    named = DiscreteTextEnv(gym.make("FrozenLake-v1", render_mode="ansi", is_slippery=False), action_names=["W", "S", "E", "N"],
                            aliases={"south": "S"})
    obs, _ = named.reset(seed=0)
    assert "\x1b" not in obs and obs.endswith("Actions: W, S, E, N.")
    assert named.step("go south")[4]["state"] == 4
    check_text_env(named, fuzz_count=50)


def test_adapter_refuses_what_it_cannot_play() -> None:
    with pytest.raises(ConfigError, match="Discrete action space"):
        DiscreteTextEnv(gym.make("MountainCarContinuous-v0", render_mode=None), describe=lambda e, o, i: "x")
    with pytest.raises(ConfigError, match="render_mode='ansi'"):
        DiscreteTextEnv(gym.make("FrozenLake-v1"))
    with pytest.raises(ConfigError, match="give 4 names"):
        DiscreteTextEnv("FrozenLake-v1", action_names=["a", "b"])
    with pytest.raises(ConfigError, match="two names read the same"):
        DiscreteTextEnv("FrozenLake-v1", action_names=["Up", "up", "x", "y"])
    with pytest.raises(ConfigError, match="names no action"):
        DiscreteTextEnv("FrozenLake-v1", aliases={"jump": "fly"})
    with pytest.raises(ConfigError, match="needs an env"):
        DiscreteTextEnv()


def test_adapter_text_and_info_helpers() -> None:
    import numpy as np

    assert plain_text("\x1b[41mS\x1b[0mFF\x07") == "SFF?"
    assert jsonable({"m": np.array([1, 0], dtype=np.int8), "p": np.float32(0.5), 3: (1, {2}), "x": float("inf")}) == {
        "m": [1, 0], "p": 0.5, "3": [1, [2]], "x": "inf"}


# ----- the hub and training ----------------------------------------------------------------------------------
def test_listing_and_importing_stay_light() -> None:
    code = (
        "import sys, tinkergym; ids = {s.id for s in tinkergym.list_envs()}; "
        "print(sorted(m for m in sys.modules if 'toy_text' in m or m.startswith('tinkergym_toytext') or m == 'torch'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_tiny_model_trains_a_few_steps_on_frozen_lake(tmp_path) -> None:
    pytest.importorskip("torch")
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.session import TrainingRun

    # The tiny model's random text is mostly invalid (tied rewards); the KL term makes every sequence train all the same.
    config = TrainConfig(env="tinker/FrozenLake-v0", env_kwargs={"is_slippery": False}, model="tiny", steps=2, batch_size=1,
                         group_size=2, max_turns=2, max_new_tokens=4, lr=1e-3, kl_coef=0.01, dtype="float32",
                         transcripts_every=0, out=str(tmp_path / "run"))
    TrainingRun(config).run(progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["episodes"] == 2 and r["batch/trained_sequences"] == 2 and r["episodes/failed"] == 0 for r in records)
    assert all(-1.3 <= r["reward/mean"] <= 1.0 for r in records)
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
