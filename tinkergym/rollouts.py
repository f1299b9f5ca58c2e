"""The rollout loop: many text envs at once, batched sampling, token-faithful trajectories.

One loop serves training, evaluation and inference. Each episode moves through explicit states::

    PENDING -> GENERATING <-> INTERACTING -> TERMINATED

- PENDING: the env is reset; its system prompt, tools and first observation are rendered with the model's
  chat template into the prompt (mask 0).
- GENERATING: the episode waits for the next batched ``sample`` call. Sampled ids are appended exactly as
  sampled (mask 1, sampler logprobs kept); they are never re-tokenized.
- INTERACTING: the decoded text goes to ``env.step``; the observation is appended as the template renders
  it (:meth:`tinkergym.chat.ChatTemplateRenderer.bridge_tokens`, mask 0).
- TERMINATED: termination, truncation, the turn limit, the token budget, the context length, or a failure.
  A failed episode (an env or template error) keeps its error, is fully masked and counted; it never stops
  the batch.

Nothing here imports torch: the sampler is anything with ``sample(SampleRequest) -> SampleResponse``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from tinkergym.backends.types import SampleRequest, SampleResponse, SamplingParams
from tinkergym.chat import ChatRenderer, Message


class Sampler(Protocol):
    """Anything that samples completions for token prompts (every Backend does)."""

    def sample(self, request: SampleRequest) -> SampleResponse: ...


class EpisodeState(enum.Enum):
    """Where an episode is in the rollout loop."""

    PENDING = "pending"
    GENERATING = "generating"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class RolloutConfig:
    """Budgets of one rollout: turns, new tokens per turn and in all, context length, and sampling."""

    max_turns: int = 8
    max_new_tokens: int = 128
    max_episode_tokens: int | None = None
    max_context: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class Trajectory:
    """One episode as the policy saw it: ids, per-token loss mask and sampler logprobs, per-turn rewards."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    prompt_length: int = 0
    finish_reason: str = ""
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        """Sum of the per-turn rewards."""
        return float(sum(self.rewards))

    @property
    def failed(self) -> bool:
        """Whether the episode ended in an error (it is then fully masked)."""
        return self.error is not None

    @property
    def num_sampled_tokens(self) -> int:
        """How many ids the policy produced."""
        return int(sum(self.loss_mask))

    def append(self, tokens: list[int], mask: float, logprobs: list[float] | None = None) -> None:
        """Append ids with one mask value and (for sampled ids) their logprobs."""
        self.tokens.extend(tokens)
        self.loss_mask.extend([mask] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))


@dataclass
class _Episode:
    env: Any
    seed: int | None
    state: EpisodeState = EpisodeState.PENDING
    trajectory: Trajectory = field(default_factory=Trajectory)
    tools: list[dict] | None = None
    turns: int = 0

    def finish(self, reason: str, error: str | None = None) -> None:
        self.state = EpisodeState.TERMINATED
        self.trajectory.finish_reason = reason
        if error is not None:
            self.trajectory.error = error
            self.trajectory.loss_mask = [0.0] * len(self.trajectory.tokens)


def _start(episode: _Episode, renderer: ChatRenderer) -> None:
    """PENDING -> GENERATING: reset the env and render the first prompt."""
    observation, info = episode.env.reset(seed=episode.seed)
    messages: list[Message] = []
    if info.get("system_prompt"):
        messages.append({"role": "system", "content": info["system_prompt"]})
    messages.append({"role": "user", "content": observation})
    episode.tools = info.get("tools") or None
    trajectory = episode.trajectory
    trajectory.messages = messages
    trajectory.append(renderer.prompt_tokens(messages, episode.tools), 0.0)
    trajectory.prompt_length = len(trajectory.tokens)
    episode.state = EpisodeState.GENERATING


def _turn_budget(episode: _Episode, config: RolloutConfig) -> int:
    budget = min(config.max_new_tokens, config.max_context - len(episode.trajectory.tokens))
    if config.max_episode_tokens is not None:
        budget = min(budget, config.max_episode_tokens - episode.trajectory.num_sampled_tokens)
    return budget


def _interact(episode: _Episode, tokens: list[int], logprobs: list[float], stopped: bool, renderer: ChatRenderer, config: RolloutConfig) -> None:
    """INTERACTING: append the sample, step the env, and append the observation or finish."""
    trajectory = episode.trajectory
    trajectory.append(tokens, 1.0, logprobs)
    text = renderer.decode(tokens)
    trajectory.messages.append({"role": "assistant", "content": text})
    observation, reward, terminated, truncated, info = episode.env.step(text)
    trajectory.rewards.append(float(reward))
    trajectory.info = {k: v for k, v in info.items() if k != "tools"}
    episode.turns += 1
    if terminated or truncated:
        episode.finish("terminated" if terminated else "truncated")
        return
    if episode.turns >= config.max_turns:
        episode.finish("max_turns")
        return
    message = {"role": "user", "content": observation}
    trajectory.append(renderer.bridge_tokens(trajectory.messages, message, episode.tools, stopped), 0.0)
    trajectory.messages.append(message)
    episode.state = EpisodeState.GENERATING


def _sample_round(waiting: list[_Episode], sampler: Sampler, renderer: ChatRenderer, config: RolloutConfig, round_index: int) -> None:
    """One batched ``sample`` call per distinct token budget among the waiting episodes."""
    by_budget: dict[int, list[_Episode]] = {}
    for episode in waiting:
        budget = _turn_budget(episode, config)
        if budget <= 0:
            context_left = config.max_context - len(episode.trajectory.tokens)
            episode.finish("context" if context_left <= 0 else "max_episode_tokens")
        else:
            by_budget.setdefault(budget, []).append(episode)
    for budget, group in by_budget.items():
        params = SamplingParams(
            max_new_tokens=budget,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            stop_token_ids=list(renderer.stop_token_ids),
            seed=None if config.seed is None else config.seed * 1_000_003 + round_index * 1009 + budget,
        )
        response = sampler.sample(SampleRequest(prompts=[e.trajectory.tokens for e in group], params=params))
        for episode, (sequence, *_) in zip(group, response.sequences):
            episode.state = EpisodeState.INTERACTING
            try:
                _interact(episode, list(sequence.tokens), list(sequence.logprobs), sequence.finish_reason == "stop", renderer, config)
            except Exception as exc:  # an env or template failure ends this episode only
                episode.finish("error", f"{type(exc).__name__}: {exc}")


def rollout(
    envs: list[Any],
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    seeds: list[int | None] | None = None,
    on_round: Callable[[int, int], None] | None = None,
) -> list[Trajectory]:
    """Play one episode in each env, all at once, and return their trajectories in order.

    Args:
        envs: Text envs (one episode each; for groups, pass G envs with the same seed).
        sampler: The policy (a Backend or a sampler with the same ``sample``).
        renderer: The model's chat template (:class:`tinkergym.chat.ChatTemplateRenderer`).
        config: Budgets and sampling settings.
        seeds: Reset seed per env (``None``: unseeded).
        on_round: Called after each sampling round with (round, episodes still running).
    """
    seeds = list(seeds) if seeds is not None else [None] * len(envs)
    episodes = [_Episode(env, seed) for env, seed in zip(envs, seeds, strict=True)]
    for episode in episodes:
        try:
            _start(episode, renderer)
        except Exception as exc:
            episode.finish("error", f"{type(exc).__name__}: {exc}")
    round_index = 0
    while True:
        waiting = [e for e in episodes if e.state is EpisodeState.GENERATING]
        if not waiting:
            break
        _sample_round(waiting, sampler, renderer, config, round_index)
        round_index += 1
        if on_round is not None:
            on_round(round_index, sum(e.state is not EpisodeState.TERMINATED for e in episodes))
    return [e.trajectory for e in episodes]
