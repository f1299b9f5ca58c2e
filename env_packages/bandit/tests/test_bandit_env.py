"""Tests of tinker/Bandit-v0."""

from __future__ import annotations

import gymnasium as gym
import pytest

import tinkergym
from tinkergym.errors import ConfigError
from tinkergym.testing import check_text_env
from tinkergym_bandit import BanditEnv, RandomArmAgent


def test_conformance() -> None:
    check_text_env(BanditEnv(), baseline=RandomArmAgent)
    check_text_env(BanditEnv(arms=3, payoff_seed=None), baseline=RandomArmAgent)


def test_made_through_gymnasium_registry() -> None:
    env = gym.make("tinker/Bandit-v0", arms=4)
    obs, info = env.reset(seed=3)
    assert obs.count("- the ") == 4
    assert sorted(info["arms"]) == ["blue", "green", "red", "yellow"]
    assert "colour name" in info["system_prompt"]
    assert tinkergym.spec("tinker/Bandit-v0").distribution == "tinkergym-bandit"


def test_expected_reward_is_the_hidden_probability_and_fixed_across_episodes() -> None:
    env = BanditEnv(reward_mode="expected")
    rewards = set()
    for seed in range(5):
        env.reset(seed=seed)
        _, reward, terminated, truncated, info = env.step("blue")
        rewards.add(reward)
        assert terminated and not truncated and info["arm"] == "blue"
    assert rewards == {env.probabilities["blue"]}


def test_sampled_rewards_follow_the_odds() -> None:
    env = BanditEnv()
    best = max(env.probabilities, key=env.probabilities.get)
    worst = min(env.probabilities, key=env.probabilities.get)
    mean = {}
    for arm in (best, worst):
        total = 0.0
        for seed in range(400):
            env.reset(seed=seed)
            total += env.step(arm)[1]
        mean[arm] = total / 400
    assert abs(mean[best] - env.probabilities[best]) < 0.08
    assert mean[best] - mean[worst] > 0.2


def test_payoff_seed_none_redraws_odds_per_reset_seed() -> None:
    env = BanditEnv(payoff_seed=None)
    env.reset(seed=1)
    first = dict(env.probabilities)
    env.reset(seed=2)
    assert env.probabilities != first
    env.reset(seed=1)
    assert env.probabilities == first


@pytest.mark.parametrize("action", ["I pull the Red arm!", "RED", "  red\n"])
def test_arm_name_is_found_in_free_text(action: str) -> None:
    env = BanditEnv(reward_mode="expected")
    env.reset(seed=0)
    assert env.step(action)[4]["arm"] == "red"


@pytest.mark.parametrize("action", ["red or blue", "the teal one", "", "\x00", None])
def test_bad_action_is_penalised_and_ends_the_episode(action) -> None:
    env = BanditEnv()
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step(action)
    assert reward == pytest.approx(-0.1) and terminated
    assert obs.startswith("Invalid action:") and info["invalid_action"] is True


def test_stepping_after_the_end_says_to_reset() -> None:
    env = BanditEnv()
    env.reset(seed=0)
    env.step("red")
    obs, reward, terminated, _, _ = env.step("red")
    assert "reset()" in obs and reward == 0.0 and terminated


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arms": 1}, {"arms": 99}, {"arms": True}, {"reward_mode": "mean"}, {"render_mode": "rgb_array"},
        {"payoff_seed": "x"}, {"payoff_seed": -1}, {"payoff_seed": 1.5}, {"payoff_seed": True},
    ],
)
@pytest.mark.filterwarnings("ignore:.*render_mode:UserWarning")
def test_bad_kwargs_raise_config_error(kwargs) -> None:
    (name, value), = kwargs.items()
    with pytest.raises(ConfigError, match=f"{name}={value!r}"):
        BanditEnv(**kwargs)
    with pytest.raises(ConfigError, match=name):
        gym.make("tinker/Bandit-v0", **kwargs)


def test_any_seed_of_numpy_is_a_payoff_seed() -> None:
    assert BanditEnv(payoff_seed=2**100).probabilities != BanditEnv(payoff_seed=0).probabilities


def test_baseline_names_a_listed_arm() -> None:
    env = BanditEnv(arms=7)
    obs, info = env.reset(seed=5)
    assert RandomArmAgent(seed=0)(obs, info) in info["arms"]
