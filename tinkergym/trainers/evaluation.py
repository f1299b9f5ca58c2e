"""Evaluation: the same rollout loop as training, on held-out seeds (or a test split), with transcripts."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from tinkergym.protocol.backend import Backend
from tinkergym.chat import ChatRenderer
from tinkergym.rollouts import RolloutConfig, Trajectory, rollout


#: Env seeds split in two: training draws its prompts below this (:meth:`TrainingContext.prompt_seeds`), evaluation at or
#: above it, so that no evaluation episode ever replays a training episode's seed. Both halves fit NumPy's seeding.
TRAIN_SEEDS = 2**31


def eval_seeds(run_seed: int, episodes: int) -> list[int]:
    """Held-out env seeds: from a stream of their own, in the half of the seed range training never draws from."""
    rng = random.Random(f"eval:{run_seed}")
    return [TRAIN_SEEDS + rng.randrange(TRAIN_SEEDS) for _ in range(episodes)]


def train_seed(rng: random.Random) -> int:
    """One training env seed from ``rng``: below :data:`TRAIN_SEEDS`, so never an evaluation seed."""
    return rng.randrange(TRAIN_SEEDS)


def eval_rollout_config(config: Any) -> RolloutConfig:
    """How a run of ``config`` (a :class:`~tinkergym.config.TrainConfig`) plays its evaluations: greedy, within its budgets."""
    return RolloutConfig(max_turns=config.max_turns, max_new_tokens=config.max_new_tokens, max_context=config.max_context,
                         temperature=0.0, seed=config.seed)


def evaluate(
    make_env: Callable[[], Any],
    backend: Backend,
    renderer: ChatRenderer,
    config: RolloutConfig,
    seeds: list[int],
    batch_size: int = 64,
    progress: bool = False,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Play one episode per seed; return (success rate, mean reward, ...) and the trajectories.

    ``progress`` shows a bar on stderr: episodes done of the total and the mean reward so far.
    """
    trajectories = [t for chunk in play(make_env, backend, renderer, config, seeds, batch_size, progress) for t in chunk]
    return summarize(trajectories), trajectories


def play(
    make_env: Callable[[], Any],
    backend: Backend,
    renderer: ChatRenderer,
    config: RolloutConfig,
    seeds: list[int],
    batch_size: int = 64,
    progress: bool = False,
) -> Iterator[list[Trajectory]]:
    """:func:`evaluate`'s episodes, ``batch_size`` at a time, each batch yielded as it ends: a caller that is interrupted
    keeps the batches it has (``tinkergym eval`` writes them)."""
    envs = [make_env() for _ in range(min(batch_size, len(seeds)))]
    reward, finished = 0.0, 0  # over the episodes that did not fail, for the bar's mean
    bar = _progress_bar(len(seeds)) if progress else None
    try:
        for start in range(0, len(seeds), len(envs)):
            chunk = seeds[start : start + len(envs)]
            batch = rollout(envs[: len(chunk)], backend, renderer, config, seeds=chunk)
            if bar is not None:
                done = [t for t in batch if not t.failed]
                reward, finished = reward + sum(t.total_reward for t in done), finished + len(done)
                bar.set_postfix({"reward": f"{reward / max(finished, 1):.3g}"}, refresh=False)
                bar.update(len(chunk))
            yield batch
    finally:
        if bar is not None:
            bar.close()


def summarize(trajectories: list[Trajectory]) -> dict[str, float]:
    """An evaluation's metrics over its episodes (a failed episode, one whose env or sampler raised, counts apart)."""
    ok = [t for t in trajectories if not t.failed]
    n = max(len(ok), 1)
    return {
        "eval/reward_mean": sum(t.total_reward for t in ok) / n,
        "eval/success_rate": sum(succeeded(t) for t in ok) / n,
        "eval/episodes": float(len(trajectories)),
        "eval/failed": float(len(trajectories) - len(ok)),
        "eval/tokens_per_episode": sum(t.num_sampled_tokens for t in trajectories) / max(len(trajectories), 1),
    }


def _progress_bar(total: int) -> Any:
    """The evaluation's progress bar on stderr, as the train command's: episodes done of ``total``, mean reward so far."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval", unit="episode")


def succeeded(trajectory: Trajectory) -> bool:
    """The env's own verdict (``info["is_success"]`` of the last step, the Gymnasium convention), else a positive total reward."""
    verdict = trajectory.info.get("is_success")
    return bool(verdict) if verdict is not None else trajectory.total_reward > 0


def transcript_record(trajectory: Trajectory, **extra: Any) -> dict[str, Any]:
    """One JSON line of a transcript: the conversation, rewards and how it ended."""
    return {
        **extra,
        "messages": trajectory.messages,
        "rewards": trajectory.rewards,
        "total_reward": trajectory.total_reward,
        "finish_reason": trajectory.finish_reason,
        "error": trajectory.error,
        "sampled_tokens": trajectory.num_sampled_tokens,
        "success": succeeded(trajectory),
        **({} if trajectory.policy_version is None else {"policy_version": trajectory.policy_version}),
    }


def write_transcripts(path: Path, trajectories: list[Trajectory], **extra: Any) -> None:
    """Write trajectories as JSONL transcripts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for i, trajectory in enumerate(trajectories):
            handle.write(json.dumps(transcript_record(trajectory, episode=i, **extra), ensure_ascii=False) + "\n")
