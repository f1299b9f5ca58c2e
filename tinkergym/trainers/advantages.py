"""Pure functions shared by the trainers: advantages, and trajectories turned into backend data.

No torch here: these run on the client, the backend receives plain :class:`~tinkergym.protocol.types.Datum`.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Sequence

from tinkergym.protocol.types import Datum
from tinkergym.rollouts import Trajectory


def _groups(values_B: Sequence, group_size: int) -> list[list]:
    if group_size < 1 or len(values_B) % group_size:
        raise ValueError(f"{len(values_B)} rewards do not split into groups of {group_size}")
    return [list(values_B[i : i + group_size]) for i in range(0, len(values_B), group_size)]


def _valid_groups(rewards_B: Sequence[float], group_size: int, valid_B: Sequence[bool] | None) -> list[tuple[list[float], list[bool]]]:
    valid = [True] * len(rewards_B) if valid_B is None else list(valid_B)
    if len(valid) != len(rewards_B):
        raise ValueError(f"{len(valid)} validity flags for {len(rewards_B)} rewards")
    return list(zip(_groups(rewards_B, group_size), _groups(valid, group_size)))


def group_relative_advantages(
    rewards_B: Sequence[float],
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    valid_B: Sequence[bool] | None = None,
) -> list[float]:
    """GRPO: each reward minus its group's mean, divided by the group's standard deviation if ``scale_by_std``.

    Members with ``valid_B`` false (failed or masked episodes) get 0 and stay out of their group's mean and
    std, so ``[1, 1, 1, failed]`` is a constant group. A group whose valid rewards are equal (std below
    ``eps``), or that has fewer than two, gets zero advantages (no signal, no update).
    """
    _valid_groups(rewards_B, group_size, valid_B)  # whole groups, one flag per reward
    return keyed_advantages(rewards_B, [i // group_size for i in range(len(rewards_B))], scale_by_std, eps, valid_B)


def leave_one_out_advantages(
    rewards_B: Sequence[float], group_size: int, eps: float = 1e-6, valid_B: Sequence[bool] | None = None
) -> list[float]:
    """RLOO: each reward minus the mean of the other valid rewards of its group (unbiased baseline).

    Invalid members get 0 and are nobody's baseline; a group whose valid rewards are equal (the same ``eps``
    tolerance as GRPO), or that has fewer than two, gets exact zeros instead of rounding noise.
    """
    if group_size < 2:
        raise ValueError("RLOO needs a group size of at least 2")
    advantages_B: list[float] = []
    for group, valid in _valid_groups(rewards_B, group_size, valid_B):
        kept = [r for r, ok in zip(group, valid) if ok]
        if len(kept) < 2 or max(kept) - min(kept) < eps:
            advantages_B.extend([0.0] * len(group))
            continue
        total = sum(kept)
        advantages_B.extend(r - (total - r) / (len(kept) - 1) if ok else 0.0 for r, ok in zip(group, valid))
    return advantages_B


def keyed_advantages(
    rewards_B: Sequence[float], keys_B: Sequence[Any], scale_by_std: bool = True, eps: float = 1e-6, valid_B: Sequence[bool] | None = None
) -> list[float]:
    """Each reward minus the mean of the rewards with the same key, over that key's std if ``scale_by_std``.

    Self-play keys rewards by seat (role-conditioned baselines): the first mover's edge is each seat's own
    baseline, not skill. Invalid members get 0 and stay out of the statistics; a key with fewer than two valid
    rewards, or equal ones (std below ``eps``), gives zeros.
    """
    valid = [True] * len(rewards_B) if valid_B is None else list(valid_B)
    if not len(rewards_B) == len(keys_B) == len(valid):
        raise ValueError(f"{len(rewards_B)} rewards, {len(keys_B)} keys and {len(valid)} validity flags must match")
    buckets: dict[Any, list[float]] = {}
    for reward, key, ok in zip(rewards_B, keys_B, valid):
        if ok:
            buckets.setdefault(key, []).append(float(reward))
    stats: dict[Any, tuple[float, float] | None] = {}
    for key, kept in buckets.items():
        mean = sum(kept) / len(kept)
        std = math.sqrt(sum((r - mean) ** 2 for r in kept) / len(kept))
        stats[key] = None if len(kept) < 2 or std < eps else (mean, (std + eps) if scale_by_std else 1.0)
    out = []
    for reward, key, ok in zip(rewards_B, keys_B, valid):
        stat = stats.get(key) if ok else None
        out.append(0.0 if stat is None else (float(reward) - stat[0]) / stat[1])
    return out


def trainable(trajectory: Trajectory, truncation: str = "keep") -> bool:
    """Whether an episode takes part in training: not failed, with sampled tokens, and not a budget-ended
    episode when ``truncation`` is ``"mask"``. Others carry no gradient and stay out of group statistics."""
    if trajectory.failed or not trajectory.num_sampled_tokens:
        return False
    return not (truncation == "mask" and trajectory.budget_truncated)


def episode_reward(trajectory: Trajectory, truncated_reward: float | None = None) -> float:
    """The reward an episode is trained on: its total, or ``truncated_reward`` when a budget ended it and one is set."""
    if truncated_reward is not None and trajectory.budget_truncated:
        return float(truncated_reward)
    return trajectory.total_reward


def batch_normalizers(trajectories: Sequence[Trajectory], valid_B: Sequence[bool]) -> tuple[float, int]:
    """The loss normalizers of a whole step: sampled tokens and sequences of every trainable episode.

    Sequences left out of the backend request (zero advantage, no KL) still count, as TRL's
    ``num_items_in_batch`` counts them, so a step's size does not depend on how many groups were degenerate.
    """
    kept = [t for t, ok in zip(trajectories, valid_B, strict=True) if ok]
    return float(sum(sum(t.loss_mask[1:]) for t in kept)), len(kept)


def trajectories_to_data(
    trajectories: Sequence[Trajectory],
    advantages_B: Sequence[float],
    valid_B: Sequence[bool] | None = None,
    keep_zero_advantage: bool = False,
) -> list[Datum]:
    """One Datum per trajectory: its advantage on every sampled token, the sampler's logprobs kept.

    Trajectories that ``valid_B`` marks false (by default those that are not :func:`trainable`: failed, or
    with nothing sampled) carry no gradient and are left out; so are those with zero advantage unless
    ``keep_zero_advantage`` (a KL term still applies to them).
    """
    valid = [trainable(t) for t in trajectories] if valid_B is None else list(valid_B)
    data = []
    for trajectory, advantage, ok in zip(trajectories, advantages_B, valid, strict=True):
        if not ok:
            continue
        if advantage == 0.0 and not keep_zero_advantage:
            continue
        data.append(
            Datum(
                tokens=list(trajectory.tokens),
                loss_mask=list(trajectory.loss_mask),
                advantages=[advantage * m for m in trajectory.loss_mask],
                sampling_logprobs=list(trajectory.logprobs),
                images=list(trajectory.images),
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
        "episodes/budget_truncated": float(sum(t.budget_truncated for t in trajectories)),
        "tokens/sampled": float(sum(t.num_sampled_tokens for t in trajectories)),
        "tokens/per_episode": sum(t.num_sampled_tokens for t in trajectories) / n,
        "turns/mean": sum(len(t.rewards) for t in trajectories) / n,
    }
    for reason in sorted({t.finish_reason for t in trajectories}):
        metrics[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    return metrics
