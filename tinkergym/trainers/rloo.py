"""RLOO: REINFORCE with a leave-one-out baseline.

Each sampled episode's advantage is its reward minus the mean reward of the *other* samples of its group
(an unbiased baseline, no learned critic). The loss is the plain policy gradient (``reinforce``: logprob
times advantage), optionally with a KL penalty (``kl_coef``). Everything else (rollouts, grouping, data)
is shared with GRPO through the pure functions of :mod:`tinkergym.trainers.advantages`.
"""

from __future__ import annotations

from tinkergym.protocol.types import LossSpec
from tinkergym.trainers.advantages import leave_one_out_advantages
from tinkergym.trainers.grpo import GRPOTrainer


class RLOOTrainer(GRPOTrainer):
    """Leave-one-out advantages with the REINFORCE loss."""

    advantage_name = "rloo"
    known_args: frozenset[str] = frozenset()  # leave-one-out baselines are never scaled

    def advantages(self, rewards_B: list[float], valid_B: list[bool] | None = None) -> list[float]:
        """Leave-one-out advantages of a step's rewards (invalid members are nobody's baseline)."""
        return leave_one_out_advantages(rewards_B, self.ctx.config.group_size, valid_B=valid_B)

    def loss(self) -> LossSpec:
        """The REINFORCE loss with the run's KL coefficient, aggregation, sampling temperature and ``tis_cap``."""
        c = self.ctx.config
        return LossSpec(name="reinforce", kl_coef=c.kl_coef, aggregation=c.loss_aggregation, temperature=c.temperature, tis_cap=c.tis_cap)
