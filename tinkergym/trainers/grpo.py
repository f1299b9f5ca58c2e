"""GRPO: group-relative policy optimization.

Each step plays ``batch_size`` prompts (env seeds) ``group_size`` times, scores every episode by its total
reward, and uses the reward minus its group's mean (divided by the group's std unless
``trainer_args.scale_by_std`` is false) as the advantage of every sampled token. The loss is the clipped
importance ratio (``clip_low``/``clip_high``), optionally with a KL penalty to the reference policy
(``kl_coef``), aggregated per token or per sequence (``loss_aggregation``).

The update is on-policy (one optimizer step per batch). The old policy of the ratio is the trainer's own
logprobs of the same pass (``old_logprobs: trainer``, the default: no second forward pass, and sampler
numerics never clip a token), or the sampler's (``old_logprobs: sampler``), optionally with the truncated
importance weight ``tis_cap`` that corrects for a sampler whose numerics differ (vLLM, bfloat16). The loss
scores the distribution sampled from (logits divided by the sampling temperature), and the sampler/trainer
mismatch is logged every step (``mismatch/*``).

Degenerate groups (equal rewards) get zero advantages and are not sent to the backend unless a KL term
applies to them, but they still count in the loss normalizer (the whole step's sampled tokens, as TRL's
``num_items_in_batch``), so the size of an update does not depend on how many groups were degenerate.
Failed episodes, and with ``truncation: mask`` episodes a budget ended, take no part in training or in
their group's statistics.

With ``async_steps`` K > 0 the rollouts of the next K steps are sampled from snapshots of the weights while a step
trains (:mod:`tinkergym.trainers.async_rollouts`): a step then trains on samples of a policy up to K updates old,
corrected by the ratio to the sampler's logprobs or ``tis_cap``, and groups older than K versions are dropped.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable, Sequence

from tinkergym.plumbing import timeline
from tinkergym.protocol.types import ForwardBackwardRequest, LossSpec, OptimParams
from tinkergym.rollouts import Trajectory
from tinkergym.trainers.advantages import (
    batch_normalizers,
    episode_reward,
    group_relative_advantages,
    rollout_metrics,
    trainable,
    trajectories_to_data,
)
from tinkergym.trainers.async_rollouts import (
    POLICY,
    RolloutPipeline,
    check_correction,
    check_snapshots,
    dropped_groups,
    fresh_groups,
    policy_version,
    staleness_metrics,
)
from tinkergym.trainers.base import StepOutput, TrainingContext


class GRPOTrainer:
    """Group-relative advantages + clipped policy gradient, one optimizer step per batch."""

    needs_env = True
    supports_async_steps = True
    known_args = frozenset({"scale_by_std"})
    advantage_name = "grpo"

    def __init__(self, ctx: TrainingContext) -> None:
        self.ctx = ctx
        self.scale_by_std = bool(ctx.config.trainer_args.get("scale_by_std", True))
        check_correction(self.loss(), ctx.config.async_steps, ctx.config.trainer)
        check_snapshots({POLICY: ctx.backend}, ctx.config.async_steps)
        self.pipeline: RolloutPipeline | None = None  # the rollouts sampled ahead (async_steps > 0), made at the first step

    def advantages(self, rewards_B: list[float], valid_B: list[bool] | None = None) -> list[float]:
        """Group-relative advantages of a step's rewards (invalid members stay out of the group statistics)."""
        return group_relative_advantages(rewards_B, self.ctx.config.group_size, scale_by_std=self.scale_by_std, valid_B=valid_B)

    def loss(self) -> LossSpec:
        """The clipped-ratio loss with the run's clip range, KL, aggregation, sampling temperature and corrections."""
        c = self.ctx.config
        return LossSpec(
            name="ppo", clip_low=c.clip_low, clip_high=c.clip_high, kl_coef=c.kl_coef, aggregation=c.loss_aggregation,
            temperature=c.temperature, old_logprobs=c.old_logprobs, tis_cap=c.tis_cap,
        )

    def request(self, trajectories: list[Trajectory], advantages: Callable[[list[float], list[bool]], list[float]] | None = None) -> ForwardBackwardRequest:
        """The step's backend request: advantages (``advantages(rewards_B, valid_B)``, by default :meth:`advantages`),
        the data that carries a gradient, the whole step's normalizers."""
        c = self.ctx.config
        valid_B = [trainable(t, c.truncation) for t in trajectories]
        rewards_B = [episode_reward(t, c.truncated_reward) for t in trajectories]
        advantages_B = (advantages or self.advantages)(rewards_B, valid_B)
        data = trajectories_to_data(trajectories, advantages_B, valid_B, keep_zero_advantage=c.kl_coef > 0)
        num_tokens, num_sequences = batch_normalizers(trajectories, valid_B)
        return ForwardBackwardRequest(data=data, loss=self.loss(), num_tokens=num_tokens, num_sequences=num_sequences)

    def train_step(self, step: int) -> StepOutput:
        """Roll out, score, compute advantages, one gradient step."""
        c = self.ctx.config
        if c.async_steps:
            return self.train_step_ahead(step)
        seeds = [s for s in self.ctx.prompt_seeds(step) for _ in range(c.group_size)]
        started = time.perf_counter()
        with timeline.span("rollout"):
            trajectories = self.ctx.rollout(seeds, sampling_seed=c.seed * 100_003 + step)
        rolled_out = time.perf_counter()
        with timeline.span("update"):
            metrics = self.update(self.ctx.backend, trajectories)
        return StepOutput({**metrics, **phase_times(started, rolled_out)}, trajectories)

    def train_step_ahead(self, step: int) -> StepOutput:
        """Take the step's rollout, sampled ahead; drop groups more than ``async_steps`` versions old; one gradient step on the rest."""
        c = self.ctx.config
        if self.pipeline is None:
            self.pipeline = RolloutPipeline.for_run({POLICY: self.ctx.backend}, c, self.plan_rollout)
        with timeline.span("rollout_wait"):
            rollout, waited = self.pipeline.take(step, c.steps - 1)
        trained = time.perf_counter()
        trajectories: list[Trajectory] = rollout.output
        now = policy_version(self.ctx.backend)
        gaps_B = [now - (rollout.versions[POLICY] if t.policy_version is None else t.policy_version) for t in trajectories]
        keep_B = fresh_groups(gaps_B, c.group_size, c.async_steps)
        with timeline.span("update"):
            metrics = self.update(self.ctx.backend, [t for t, keep in zip(trajectories, keep_B) if keep])
        metrics.update(staleness_metrics(gaps_B, keep_B, dropped_groups(keep_B, c.group_size)))
        metrics.update({"time/rollout_wait_s": waited, "time/update_s": time.perf_counter() - trained, "async/rollout_s": rollout.seconds,
                        "async/rollout_retries": float(rollout.retries)})
        return StepOutput(metrics, trajectories)

    def plan_rollout(self, step: int, samplers: dict[str, Any]) -> Callable[[], list[Trajectory]]:
        """Step ``step``'s rollout (its own prompts and sampling seed) with the snapshot ``samplers[POLICY]``, to play later."""
        c = self.ctx.config
        seeds = [s for s in self.ctx.prompt_seeds(step) for _ in range(c.group_size)]
        return lambda: self.ctx.rollout(seeds, sampling_seed=c.seed * 100_003 + step, sampler=samplers[POLICY])

    def close(self) -> None:
        """Stop sampling ahead (rollouts in flight are dropped)."""
        if self.pipeline is not None:
            self.pipeline.close()

    def update(self, backend: Any, trajectories: list[Trajectory], advantages: Callable[[list[float], list[bool]], list[float]] | None = None) -> dict[str, float]:
        """One gradient step of ``backend`` on ``trajectories`` (see :meth:`request`); the rollout and update metrics."""
        return self.update_many([(backend, trajectories, advantages)])[0]

    def update_many(self, jobs: Sequence[tuple[Any, list[Trajectory], Callable[[list[float], list[bool]], list[float]] | None]],
                    learning_rates: Sequence[float] | None = None) -> list[dict[str, float]]:
        """:meth:`update` of each ``(backend, trajectories, advantages)``, in order (each at its ``learning_rates`` entry, or
        the run's ``lr``). The ``forward_backward`` calls of backends with the same ``joint`` (adapters of one shared base:
        ``LoraSession.joint``) run as one mixed-adapter pass (``joint.forward_backward_many``: each adapter's gradient from
        its own rows alone); then each steps."""
        c = self.ctx.config
        requests = [self.request(trajectories, advantages) for _, trajectories, advantages in jobs]
        out = []
        for (_, trajectories, _), request in zip(jobs, requests):
            metrics = rollout_metrics(trajectories)
            metrics["batch/trained_sequences"] = float(len(request.data))
            out.append(metrics)
        training = [i for i, request in enumerate(requests) if request.data]
        results: dict[int, Any] = {}
        together: dict[int, tuple[Any, list[int]]] = {}
        for i in training:
            joint = getattr(jobs[i][0], "joint", None)
            if joint is not None:
                together.setdefault(id(joint), (joint, []))[1].append(i)
        for joint, indexes in together.values():
            if len(indexes) < 2:
                continue
            with timeline.span("forward_backward", "backend", sequences=sum(len(requests[i].data) for i in indexes), adapters=len(indexes)):
                outcomes = joint.forward_backward_many([(jobs[i][0], requests[i]) for i in indexes])
            for i, outcome in zip(indexes, outcomes):
                if isinstance(outcome, BaseException):
                    raise outcome
                results[i] = outcome
        for i in training:
            backend = jobs[i][0]
            params = OptimParams(learning_rate=c.lr if learning_rates is None else learning_rates[i], weight_decay=c.weight_decay,
                                 max_grad_norm=c.max_grad_norm)
            if i not in results:
                with timeline.span("forward_backward", "backend", sequences=len(requests[i].data)):
                    results[i] = backend.forward_backward(requests[i])
            out[i].update(results[i].metrics)
            with timeline.span("optim_step", "backend"):
                out[i].update(backend.optim_step(params))
        return out

    def state_dict(self) -> dict:
        """``{}``: nothing carries over between steps (prompts and sampling follow from the config, the seed and the step)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (see :meth:`state_dict`); rollouts sampled ahead from the weights before the restore are dropped."""
        if self.pipeline is not None:
            self.pipeline.reset()


def phase_times(started: float, rolled_out: float) -> dict[str, float]:
    """``time/rollout_s`` (``started`` to ``rolled_out``) and ``time/update_s`` (from then to now), ``perf_counter`` seconds."""
    return {"time/rollout_s": rolled_out - started, "time/update_s": time.perf_counter() - rolled_out}
