"""Pure training functions: advantages, data building, config and trainer lookup."""

from __future__ import annotations

import json

import pytest

from tinkergym.errors import ConfigError
from tinkergym.rollouts import Trajectory
from tinkergym.trainers.advantages import (
    group_relative_advantages,
    leave_one_out_advantages,
    rollout_metrics,
    trajectories_to_data,
)
from tinkergym.trainers.base import available_trainers, load_trainer
from tinkergym.trainers.config import TrainConfig


def test_group_relative_advantages() -> None:
    adv = group_relative_advantages([1.0, 0.0, 0.0, 1.0, 2.0, 2.0], group_size=2)
    assert adv[:2] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert adv[2:4] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert adv[4:] == [0.0, 0.0], "a group with equal rewards carries no signal"
    assert group_relative_advantages([3.0, 1.0], 2, scale_by_std=False) == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError):
        group_relative_advantages([1.0, 2.0, 3.0], 2)


def test_leave_one_out_advantages() -> None:
    assert leave_one_out_advantages([1.0, 0.0, 0.0], 3) == pytest.approx([1.0, -0.5, -0.5])
    assert sum(leave_one_out_advantages([0.3, 0.9, 0.1, 0.5], 4)) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        leave_one_out_advantages([1.0], 1)


def _trajectory(reward: float, error: str | None = None) -> Trajectory:
    t = Trajectory(rewards=[reward], finish_reason="terminated", error=error)
    t.append([1, 2, 3], 0.0)
    t.append([4, 5], 1.0, [-0.1, -0.2])
    return t


def test_trajectories_to_data_skips_failed_and_zero_advantage() -> None:
    trajectories = [_trajectory(1.0), _trajectory(0.0), _trajectory(1.0, error="boom")]
    data = trajectories_to_data(trajectories, [0.5, 0.0, 0.7])
    assert len(data) == 1
    assert data[0].advantages == [0.0, 0.0, 0.0, 0.5, 0.5]
    assert data[0].sampling_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]
    metrics = rollout_metrics(trajectories)
    assert metrics["episodes/failed"] == 1.0 and metrics["reward/mean"] == 0.5 and metrics["finish/terminated"] == 1.0


def test_config_round_trip_and_errors(tmp_path) -> None:
    config = TrainConfig(env="tinker/Bandit-v0", steps=3, env_kwargs={"arms": 3})
    config.save(tmp_path / "c.json")
    assert TrainConfig.load(tmp_path / "c.json") == config
    (tmp_path / "c.yaml").write_text("env: tinker/Bandit-v0\nlora-rank: 0\nsteps: 2\n")
    assert TrainConfig.load(tmp_path / "c.yaml").lora_rank == 0
    (tmp_path / "bad.yaml").write_text("env: x\nlearning_rate: 1\n")
    with pytest.raises(ConfigError, match="unknown config keys \\['learning_rate'\\]"):
        TrainConfig.load(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="steps must be at least 1"):
        TrainConfig(env="tinker/Bandit-v0", steps=0).validate()
    with pytest.raises(ConfigError, match="--env is required"):
        TrainConfig().validate()
    json.dumps(config.to_dict())


def test_trainer_plugins_are_found_by_name() -> None:
    assert {"grpo", "rloo", "sft"} <= set(available_trainers())
    assert load_trainer("grpo").__name__ == "GRPOTrainer"
    with pytest.raises(ConfigError, match="Did you mean: grpo"):
        load_trainer("grpoo")


def test_success_is_the_envs_verdict_else_a_positive_reward() -> None:
    from tinkergym.trainers.evaluation import succeeded

    assert succeeded(Trajectory(rewards=[0.5], info={"is_success": False})) is False  # e.g. a format bonus alone
    assert succeeded(Trajectory(rewards=[-0.1, 0.0], info={"is_success": True})) is True
    assert succeeded(Trajectory(rewards=[0.0, 1.0])) is True
    assert succeeded(Trajectory(rewards=[0.0])) is False
