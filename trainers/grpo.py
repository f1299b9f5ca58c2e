"""GRPO: group-relative policy optimization.

Each step plays ``batch_size`` prompts (env seeds) ``group_size`` times, scores every episode by its total
reward, and uses the reward minus its group's mean (divided by the group's std unless
``trainer_args.scale_by_std`` is false) as the advantage of every sampled token. The loss is the clipped
importance ratio (``clip_low``/``clip_high``), optionally with a KL penalty to the reference policy
(``kl_coef``), aggregated per token or per sequence (``loss_aggregation``).

The update is on-policy (one optimizer step per batch), so the sampler's own logprobs serve as the old
policy: no second forward pass is spent on them.
"""

from __future__ import annotations

from tinkergym.backends.types import ForwardBackwardRequest, LossSpec, OptimParams
from tinkergym.trainers.advantages import group_relative_advantages, rollout_metrics, trajectories_to_data
from tinkergym.trainers.base import StepOutput, TrainingContext


class GRPOTrainer:
    """Group-relative advantages + clipped policy gradient, one optimizer step per batch."""

    needs_env = True
    advantage_name = "grpo"

    def __init__(self, ctx: TrainingContext) -> None:
        self.ctx = ctx
        self.scale_by_std = bool(ctx.config.trainer_args.get("scale_by_std", True))

    def advantages(self, rewards_B: list[float]) -> list[float]:
        """Group-relative advantages of a step's rewards."""
        return group_relative_advantages(rewards_B, self.ctx.config.group_size, scale_by_std=self.scale_by_std)

    def loss(self) -> LossSpec:
        """The clipped-ratio loss with the run's clip range, KL coefficient and aggregation."""
        c = self.ctx.config
        return LossSpec(name="ppo", clip_low=c.clip_low, clip_high=c.clip_high, kl_coef=c.kl_coef, aggregation=c.loss_aggregation)

    def train_step(self, step: int) -> StepOutput:
        """Roll out, score, compute advantages, one gradient step."""
        c = self.ctx.config
        seeds = [s for s in self.ctx.prompt_seeds(step) for _ in range(c.group_size)]
        trajectories = self.ctx.rollout(seeds, sampling_seed=c.seed * 100_003 + step)
        rewards_B = [t.total_reward for t in trajectories]
        advantages_B = self.advantages(rewards_B)
        data = trajectories_to_data(trajectories, advantages_B)
        metrics = rollout_metrics(trajectories)
        metrics["batch/trained_sequences"] = float(len(data))
        if data:
            result = self.ctx.backend.forward_backward(ForwardBackwardRequest(data=data, loss=self.loss()))
            metrics.update(result.metrics)
            params = OptimParams(learning_rate=c.lr, weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm)
            metrics.update(self.ctx.backend.optim_step(params))
        return StepOutput(metrics, trajectories)
