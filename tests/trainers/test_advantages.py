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
from tinkergym.config import TrainConfig


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
    assert TrainConfig(env="tinker/Bandit-v0", lora_alpha=0.5).validate().lora_alpha == 0.5  # a float, as serve backend takes it
    with pytest.raises(ConfigError, match="lora-alpha must be above 0"):
        TrainConfig(env="tinker/Bandit-v0", lora_alpha=0).validate()
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


def test_failed_members_leave_their_groups_statistics() -> None:
    valid = [True, True, True, False]
    assert group_relative_advantages([1.0, 1.0, 1.0, 0.0], 4, valid_B=valid) == [0.0] * 4, "three equal rewards and a failure carry no signal"
    adv = group_relative_advantages([1.0, 0.0, 1.0, 9.0], 4, valid_B=valid)
    assert adv[3] == 0.0
    assert adv[:3] == pytest.approx(group_relative_advantages([1.0, 0.0, 1.0], 3), abs=1e-6)
    assert sum(adv) == pytest.approx(0.0, abs=1e-6)
    rloo = leave_one_out_advantages([1.0, 0.0, 0.5, 9.0], 4, valid_B=valid)
    assert rloo == pytest.approx([0.75, -0.75, 0.0, 0.0])
    assert group_relative_advantages([1.0, 0.0], 2, valid_B=[True, False]) == [0.0, 0.0], "one valid member is no group"


def test_rloo_skips_constant_groups_with_exact_zeros() -> None:
    assert leave_one_out_advantages([0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7], 7) != [0.0] * 7
    assert leave_one_out_advantages([0.1] * 6, 3) == [0.0] * 6  # not rounding noise such as -1.4e-17
    assert leave_one_out_advantages([0.3, 0.3 + 1e-9], 2) == [0.0, 0.0]


def _step_trajectories() -> list[Trajectory]:
    """Two groups of two: one degenerate (equal rewards), one informative; one budget-ended episode."""
    trajectories = [_trajectory(1.0), _trajectory(1.0), _trajectory(1.0), _trajectory(0.0)]
    trajectories[2].finish_reason = "max_turns"
    return trajectories


def _grpo(**settings) -> object:
    from tinkergym.trainers.base import TrainingContext
    from tinkergym.trainers.grpo import GRPOTrainer

    config = TrainConfig(env="tinker/Bandit-v0", group_size=2, batch_size=2, **settings).validate()
    return GRPOTrainer(TrainingContext(config, backend=None, renderer=None))


def test_grpo_request_normalizes_by_the_whole_step() -> None:
    request = _grpo().request(_step_trajectories())
    assert len(request.data) == 2, "the degenerate group is not sent"
    assert request.num_tokens == 8.0 and request.num_sequences == 4, "but it counts in the normalizers"
    assert request.loss.temperature == 1.0 and request.loss.old_logprobs == "trainer"
    with_kl = _grpo(kl_coef=0.1, temperature=0.7).request(_step_trajectories())
    assert len(with_kl.data) == 4 and with_kl.data[0].advantages == [0.0] * 5, "a KL term still applies to it"
    assert with_kl.loss.temperature == 0.7


def test_budget_ended_episodes_can_be_masked_or_given_a_reward() -> None:
    masked = _grpo(truncation="mask").request(_step_trajectories())
    assert masked.num_sequences == 3 and len(masked.data) == 0, "the second group has one valid member left"
    penalized = _grpo(truncated_reward=-1.0).request(_step_trajectories())
    assert [d.advantages[-1] for d in penalized.data] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert rollout_metrics(_step_trajectories())["episodes/budget_truncated"] == 1.0


def test_rl_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        TrainConfig(env="tinker/Bandit-v0", temperature=0.0).validate()
    TrainConfig(trainer="sft", temperature=0.0).validate()
    with pytest.raises(ConfigError, match="--old-logprobs trainer"):
        TrainConfig(env="tinker/Bandit-v0", tis_cap=2.0, old_logprobs="sampler").validate()
    TrainConfig(env="tinker/Bandit-v0", tis_cap=2.0, old_logprobs="trainer").validate()
    with pytest.raises(ConfigError, match="truncation must be one of"):
        TrainConfig(env="tinker/Bandit-v0", truncation="drop").validate()
