"""Pure functions shared by the trainers: advantages, and trajectories turned into backend data.

No torch here: these run on the client, the backend receives plain :class:`~tinkergym.backends.types.Datum`.
"""

from __future__ import annotations

import math
from typing import Sequence

from tinkergym.backends.types import Datum
from tinkergym.rollouts import Trajectory


def _groups(rewards_B: Sequence[float], group_size: int) -> list[list[float]]:
    if group_size < 1 or len(rewards_B) % group_size:
        raise ValueError(f"{len(rewards_B)} rewards do not split into groups of {group_size}")
    return [list(rewards_B[i : i + group_size]) for i in range(0, len(rewards_B), group_size)]


def group_relative_advantages(rewards_B: Sequence[float], group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO: each reward minus its group's mean, divided by the group's standard deviation if ``scale_by_std``.

    A group whose rewards are all equal gets zero advantages (no signal, no update).
    """
    advantages_B: list[float] = []
    for group in _groups(rewards_B, group_size):
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        scale = (std + eps) if scale_by_std else 1.0
        advantages_B.extend(0.0 if std < eps else (r - mean) / scale for r in group)
    return advantages_B


def leave_one_out_advantages(rewards_B: Sequence[float], group_size: int) -> list[float]:
    """RLOO: each reward minus the mean of the other rewards of its group (unbiased baseline)."""
    if group_size < 2:
        raise ValueError("RLOO needs a group size of at least 2")
    advantages_B: list[float] = []
    for group in _groups(rewards_B, group_size):
        total = sum(group)
        advantages_B.extend(r - (total - r) / (len(group) - 1) for r in group)
    return advantages_B


def trajectories_to_data(trajectories: Sequence[Trajectory], advantages_B: Sequence[float]) -> list[Datum]:
    """One Datum per trajectory: its advantage on every sampled token, the sampler's logprobs kept.

    Failed trajectories and those with zero advantage carry no gradient and are left out.
    """
    data = []
    for trajectory, advantage in zip(trajectories, advantages_B, strict=True):
        if trajectory.failed or advantage == 0.0 or not trajectory.num_sampled_tokens:
            continue
        data.append(
            Datum(
                tokens=list(trajectory.tokens),
                loss_mask=list(trajectory.loss_mask),
                advantages=[advantage * m for m in trajectory.loss_mask],
                sampling_logprobs=list(trajectory.logprobs),
            )
        )
    return data


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Aggregated numbers of a batch of trajectories (reward, length, failures, finish reasons)."""
    n = max(len(trajectories), 1)
    ok = [t for t in trajectories if not t.failed]
    metrics = {
        "reward/mean": sum(t.total_reward for t in ok) / max(len(ok), 1),
        "episodes": float(len(trajectories)),
        "episodes/failed": float(len(trajectories) - len(ok)),
        "tokens/sampled": float(sum(t.num_sampled_tokens for t in trajectories)),
        "tokens/per_episode": sum(t.num_sampled_tokens for t in trajectories) / n,
        "turns/mean": sum(len(t.rewards) for t in trajectories) / n,
    }
    for reason in sorted({t.finish_reason for t in trajectories}):
        metrics[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    return metrics
