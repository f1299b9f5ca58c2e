"""The rollout loop: many text envs at once, batched sampling, token-faithful trajectories.

One loop serves training, evaluation and inference. Each episode moves through explicit states::

    PENDING -> GENERATING <-> INTERACTING -> TERMINATED

- PENDING: the env is reset; its system prompt, tools and first observation are rendered with the model's
  chat template into the prompt (mask 0).
- GENERATING: the episode waits for the next batched ``sample`` call. Sampled ids are appended exactly as
  sampled (mask 1, sampler logprobs kept); they are never re-tokenized.
- INTERACTING: the decoded text goes to ``env.step``; the observation is appended as the template renders
  it (:meth:`tinkergym.chat.ChatTemplateRenderer.bridge_tokens`, mask 0).
- TERMINATED: see :class:`Trajectory` for the finish reasons. A failed episode (an env or template error)
  keeps its error, is fully masked and counted; it never stops the batch.

Env calls (``reset`` and ``step``) of one round run concurrently on a bounded thread pool
(:attr:`RolloutConfig.env_workers`), so a slow env (a tool that starts a subprocess, a remote service)
does not hold up the others. Everything else (decoding, rendering, appending, sampling) stays on the
calling thread, in a fixed order, and rounds stay in lockstep: the same seeds give the same trajectories
whatever the pool size and whichever env finishes first. An env is only ever called by one thread at a
time; envs must not share mutable state (the usual Gymnasium contract), or use ``env_workers=1``.

Nothing here imports torch: the sampler is anything with ``sample(SampleRequest) -> SampleResponse``.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable, Sequence

from tinkergym.protocol.types import ImageData, SampleRequest, SampleResponse, SamplingParams
from tinkergym.chat import ChatRenderer, Message, observation_message
from tinkergym.plumbing import timeline
from tinkergym.errors import ConfigError

#: Finish reasons of an episode cut by one of the rollout's budgets rather than ended by its env.
BUDGET_FINISH_REASONS = frozenset({"max_turns", "max_episode_tokens", "context"})


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
    """Budgets of one rollout: turns, new tokens per turn and in all, context length, and sampling.

    ``env_workers`` is how many threads call ``env.reset`` / ``env.step`` at once (capped at the number
    of episodes); 1 calls them one after another on the calling thread. Trajectories do not depend on it.
    """

    max_turns: int = 8
    max_new_tokens: int = 128
    max_episode_tokens: int | None = None
    max_context: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    env_workers: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.env_workers, bool) or not isinstance(self.env_workers, int) or self.env_workers < 1:
            raise ConfigError(f"env_workers={self.env_workers!r}: choose a whole number of threads, at least 1 (1 steps envs one after another).")


@dataclass
class Trajectory:
    """One episode as the policy saw it: ids, per-token loss mask and sampler logprobs, per-turn rewards.

    ``finish_reason`` says how it ended:

    - ``"terminated"``: the env ended the episode (``terminated`` from ``env.step``);
    - ``"truncated"``: the env cut the episode itself (``truncated`` from ``env.step``);
    - ``"max_turns"``: the rollout's turn limit was reached;
    - ``"max_episode_tokens"``: the rollout's budget of sampled tokens per episode was used up;
    - ``"context"``: no room was left in ``max_context`` for another sampled token, the next observation,
      or even the first prompt (then ``tokens`` is empty when the prompt does not fit);
    - ``"error"``: the env or the chat template failed (``error`` says how; the episode is fully masked).

    The three budget reasons are :attr:`budget_truncated`. A trajectory never holds more than
    ``max_context`` ids, and one cut by a budget after a turn ends with that turn's sampled ids.

    ``images``: with a renderer that renders images (``renders_images``, e.g.
    :class:`~tinkergym.chat.ImageChatRenderer`), the images its image tokens show, in order; else empty.

    ``policy_version``: the version (optimizer steps) of the weights that sampled it, where the sampler has one (a
    snapshot sampled ahead of training, ``async_steps``); None where the backend's current weights did.
    """

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    prompt_length: int = 0
    finish_reason: str = ""
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    images: list[ImageData] = field(default_factory=list)
    policy_version: int | None = None

    @property
    def total_reward(self) -> float:
        """Sum of the per-turn rewards."""
        return float(sum(self.rewards))

    @property
    def failed(self) -> bool:
        """Whether the episode ended in an error (it is then fully masked)."""
        return self.error is not None

    @property
    def budget_truncated(self) -> bool:
        """Whether a rollout budget (turns, episode tokens, context) cut the episode, not the env."""
        return self.finish_reason in BUDGET_FINISH_REASONS

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
class Episode:
    """One env's episode in the loop: its state, its trajectory so far, its turns; the game coordinator keeps one per model seat."""

    env: Any
    seed: int | None
    state: EpisodeState = EpisodeState.PENDING
    trajectory: Trajectory = field(default_factory=Trajectory)
    tools: list[dict] | None = None
    turns: int = 0
    #: The conversation's images as the env gave them (what the renderer measures), with a renderer that renders images.
    images: list[Any] = field(default_factory=list)

    def finish(self, reason: str, error: str | None = None) -> None:
        self.state = EpisodeState.TERMINATED
        self.trajectory.finish_reason = reason
        if error is not None:
            self.trajectory.error = error
            self.trajectory.loss_mask = [0.0] * len(self.trajectory.tokens)

    def fail(self, exc: Exception) -> None:
        self.finish("error", f"{type(exc).__name__}: {exc}")


class EnvCalls:
    """Runs env calls on a bounded thread pool (or inline with one worker); results come back as futures.

    An env exception is kept in its future (it is data); the pool is shut down by :meth:`close`.
    """

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tinkergym-env") if workers > 1 else None

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Start ``fn(*args, **kwargs)``; inline, it has already run when this returns."""
        if self._pool is not None:
            return self._pool.submit(fn, *args, **kwargs)
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the future carries any failure to its caller
            future.set_exception(exc)
        return future

    def close(self) -> None:
        """Drop calls not started and wait for running ones, so no env is touched after the rollout returns."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def start_episode(episode: Episode, reset: tuple[str, dict], renderer: ChatRenderer, config: RolloutConfig) -> None:
    """PENDING -> GENERATING: render the first prompt from the env's reset (or finish if it cannot fit)."""
    observation, info = reset
    messages: list[Message] = []
    if info.get("system_prompt"):
        messages.append({"role": "system", "content": info["system_prompt"]})
    message, images = _user_message(observation, renderer)
    messages.append(message)
    episode.tools = info.get("tools") or None
    trajectory = episode.trajectory
    trajectory.messages = messages
    if images:
        prompt = renderer.prompt_tokens(messages, episode.tools, images=images)  # type: ignore[call-arg]  # renders_images
        _keep_images(episode, images)
    else:
        prompt = renderer.prompt_tokens(messages, episode.tools)
    if len(prompt) <= config.max_context:
        trajectory.append(prompt, 0.0)
        trajectory.prompt_length = len(prompt)
    if len(prompt) >= config.max_context:  # not even one token could be sampled
        episode.finish("context")
        return
    episode.state = EpisodeState.GENERATING


def _user_message(observation: Any, renderer: ChatRenderer) -> tuple[Message, list[Any]]:
    """The user message of an observation and the images the renderer renders (none for a text renderer).

    A text observation is the message's content as it is; an observation with images
    (:class:`~tinkergym.spaces.TextWithImages`) becomes a content list with image parts
    (:func:`~tinkergym.chat.observation_message`), which a text renderer shows as placeholders.
    """
    if isinstance(observation, str):
        return {"role": "user", "content": observation}, []
    message, images = observation_message(observation)
    return message, images if getattr(renderer, "renders_images", False) else []


def _keep_images(episode: Episode, images: list[Any]) -> None:
    episode.images.extend(images)
    episode.trajectory.images.extend(ImageData.from_array(_as_uint8(image)) for image in images)


def _as_uint8(image: Any) -> Any:
    import numpy as np

    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8))


def _turn_budget(episode: Episode, config: RolloutConfig) -> int:
    budget = min(config.max_new_tokens, config.max_context - len(episode.trajectory.tokens))
    if config.max_episode_tokens is not None:
        budget = min(budget, config.max_episode_tokens - episode.trajectory.num_sampled_tokens)
    return budget


def take_sample(episode: Episode, tokens: list[int], logprobs: list[float], renderer: ChatRenderer) -> str:
    """GENERATING -> INTERACTING: append the sampled ids and return their text for ``env.step``."""
    episode.state = EpisodeState.INTERACTING
    trajectory = episode.trajectory
    trajectory.append(tokens, 1.0, logprobs)
    text = renderer.decode(tokens)
    trajectory.messages.append({"role": "assistant", "content": text})
    return text


def after_step(episode: Episode, result: tuple, stopped: bool, renderer: ChatRenderer, config: RolloutConfig) -> None:
    """INTERACTING: record the env's step, then append the observation or finish.

    A budget that ends the episode here ends it before the observation is appended, so the trajectory
    ends with the sampled turn and never grows past ``max_context``.
    """
    observation, reward, terminated, truncated, info = result
    trajectory = episode.trajectory
    trajectory.rewards.append(float(reward))
    trajectory.info = {k: v for k, v in info.items() if k != "tools"}
    episode.turns += 1
    if terminated or truncated:
        episode.finish("terminated" if terminated else "truncated")
        return
    if episode.turns >= config.max_turns:
        episode.finish("max_turns")
        return
    if config.max_episode_tokens is not None and trajectory.num_sampled_tokens >= config.max_episode_tokens:
        episode.finish("max_episode_tokens")
        return
    message, images = _user_message(observation, renderer)
    if images or episode.images:
        bridge = renderer.bridge_tokens(trajectory.messages, message, episode.tools, stopped, images=[*episode.images, *images])  # type: ignore[call-arg]
    else:
        bridge = renderer.bridge_tokens(trajectory.messages, message, episode.tools, stopped)
    if len(trajectory.tokens) + len(bridge) >= config.max_context:  # no room left to sample after it
        episode.finish("context")
        return
    trajectory.append(bridge, 0.0)
    trajectory.messages.append(message)
    if images:
        _keep_images(episode, images)
    episode.state = EpisodeState.GENERATING


def group_by_budget(waiting: list[Episode], config: RolloutConfig) -> dict[int, list[Episode]]:
    """Waiting episodes by their token budget for this turn; those with none left are finished."""
    by_budget: dict[int, list[Episode]] = {}
    for episode in waiting:
        budget = _turn_budget(episode, config)
        if budget <= 0:
            context_left = config.max_context - len(episode.trajectory.tokens)
            episode.finish("context" if context_left <= 0 else "max_episode_tokens")
        else:
            by_budget.setdefault(budget, []).append(episode)
    return by_budget


def _sample_round(waiting: list[Episode], sampler: Sampler, renderer: ChatRenderer, config: RolloutConfig, round_index: int, env_calls: EnvCalls) -> None:
    """One batched ``sample`` call per distinct token budget; env steps run while later groups sample."""
    stepping: list[tuple[Episode, Future, bool]] = []
    for budget, group in group_by_budget(waiting, config).items():
        params = SamplingParams(
            max_new_tokens=budget,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            stop_token_ids=list(renderer.stop_token_ids),
            seed=None if config.seed is None else config.seed * 1_000_003 + round_index * 1009 + budget,
        )
        with timeline.span("sample", "sampling", prompts=len(group), max_new_tokens=budget):
            images = [list(e.trajectory.images) for e in group] if any(e.trajectory.images for e in group) else []
            response = sampler.sample(SampleRequest(prompts=[e.trajectory.tokens for e in group], params=params, images=images))
        for episode, (sequence, *_) in zip(group, response.sequences):
            try:
                text = take_sample(episode, list(sequence.tokens), list(sequence.logprobs), renderer)
            except Exception as exc:  # noqa: BLE001 - a template failure ends this episode only
                episode.fail(exc)
                continue
            stepping.append((episode, env_calls.submit(_env_step, episode.env, text), sequence.finish_reason == "stop"))
    for episode, step, stopped in stepping:  # in submission order, whatever order the steps finished in
        try:
            after_step(episode, step.result(), stopped, renderer, config)
        except Exception as exc:  # noqa: BLE001 - an env or template failure ends this episode only
            episode.fail(exc)


def _env_step(env: Any, action: str) -> tuple:
    with timeline.span("env.step", "env"):
        return env.step(action)


def _env_reset(env: Any, seed: int | None) -> tuple:
    with timeline.span("env.reset", "env"):
        return env.reset(seed=seed)


def env_worker_count(envs: list[Any], config: RolloutConfig) -> int:
    """Threads for the env calls: one env is never called from two threads, so a repeated env means one."""
    if len({id(env) for env in envs}) < len(envs):
        return 1
    return max(1, min(config.env_workers, len(envs)))


def rollout(
    envs: list[Any],
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    seeds: Sequence[int | None] | None = None,
    on_round: Callable[[int, int], None] | None = None,
) -> list[Trajectory]:
    """Play one episode in each env, all at once, and return their trajectories in order.

    Args:
        envs: Text envs (one episode each; for groups, pass G envs with the same seed).
        sampler: The policy (a Backend or a sampler with the same ``sample``).
        renderer: The model's chat template (:class:`tinkergym.chat.ChatTemplateRenderer`).
        config: Budgets, sampling settings and the env thread pool size.
        seeds: Reset seed per env (``None``: unseeded).
        on_round: Called after each sampling round with (round, episodes still running).
    """
    seeds = list(seeds) if seeds is not None else [None] * len(envs)
    episodes = [Episode(env, seed) for env, seed in zip(envs, seeds, strict=True)]
    env_calls = EnvCalls(env_worker_count(envs, config))
    try:
        resets = [(e, env_calls.submit(_env_reset, e.env, e.seed)) for e in episodes]
        for episode, reset in resets:
            try:
                start_episode(episode, reset.result(), renderer, config)
            except Exception as exc:  # noqa: BLE001 - an env or template failure ends this episode only
                episode.fail(exc)
        round_index = 0
        while waiting := [e for e in episodes if e.state is EpisodeState.GENERATING]:
            _sample_round(waiting, sampler, renderer, config, round_index, env_calls)
            round_index += 1
            if on_round is not None:
                on_round(round_index, sum(e.state is not EpisodeState.TERMINATED for e in episodes))
    finally:
        env_calls.close()
    version = getattr(sampler, "version", None)  # a snapshot's: every sample of this rollout drew from it
    for episode in episodes:
        episode.trajectory.policy_version = None if version is None else int(version)
    return [e.trajectory for e in episodes]
