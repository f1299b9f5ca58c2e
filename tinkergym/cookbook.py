"""tinkergym envs in tinker-cookbook: any hub env as a cookbook ``Env``/``EnvGroupBuilder``, so the cookbook's own
``rl.train`` loop trains on it unchanged (against any Tinker-API endpoint, tinkergym's ``serve tinker`` included).

::

    from tinkergym.cookbook import HubRLDatasetBuilder
    from tinker_cookbook.rl import train

    config = train.Config(
        model_name="Qwen/Qwen3-4B-Instruct-2507", renderer_name="qwen3_instruct", base_url="http://127.0.0.1:8000",
        dataset_builder=HubRLDatasetBuilder(env_id="tinker/Bandit-v0", renderer_name="qwen3_instruct",
                                            model_name="Qwen/Qwen3-4B-Instruct-2507", batch_size=8, group_size=8),
        learning_rate=1e-4, max_tokens=64, log_path="runs/bandit-cookbook",
    )
    asyncio.run(train.main(config))

A single-agent env (a :class:`~tinkergym.core.TextEnv`) becomes a cookbook message env: its system prompt and first
observation are the first messages; each assistant message's text is the env's action, and its observation the next
user message; the episode ends when the env terminates or truncates. A group holds ``group_size`` copies of one
seed, as GRPO wants (``group_size`` envs of one task, rewards centred across them).

A multi-agent (AEC) env becomes a group of its players: one game, one cookbook ``Env`` per agent, each seeing the
game from its seat (its own observations, in turn) and rewarded with what the game gives it; the players' turns
are interleaved as the game's ``agent_selection`` says, so the cookbook's rollout loop plays the whole game with the
policy in every seat (self-play).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.completers import StopCondition
from tinker_cookbook.rl.message_env import EnvFromMessageEnv, MessageEnv, MessageStepResult
from tinker_cookbook.rl.types import Action, Env, EnvGroupBuilder, InitialObservationOverflow, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.tokenizer_utils import get_tokenizer

import tinkergym


def _text(message: Any) -> str:
    return renderers.get_text_content(message) if not isinstance(message.get("content"), str) else message["content"]


class HubMessageEnv(MessageEnv):
    """A single-agent tinkergym env as a cookbook :class:`MessageEnv` (see the module docstring)."""

    def __init__(self, env_id: str, seed: int, env_kwargs: dict[str, Any] | None = None) -> None:
        self.env_id, self.seed = env_id, seed
        self.env = tinkergym.make(env_id, **(env_kwargs or {}))
        self.messages: list[Any] = []
        self.example_id = f"{env_id}/{seed}"

    async def initial_observation(self) -> list[Any]:
        observation, info = self.env.reset(seed=self.seed)
        system = info.get("system_prompt")
        self.messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": observation}]
        return list(self.messages)

    async def step(self, message: Any) -> MessageStepResult:
        action = _text(message)
        observation, reward, terminated, truncated, info = self.env.step(action)
        self.messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        metrics = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return MessageStepResult(reward=float(reward), episode_done=bool(terminated or truncated), next_messages=list(self.messages),
                                 metrics=metrics)


@chz.chz
class HubEnvGroupBuilder(EnvGroupBuilder):
    """``group_size`` copies of one seed of a single-agent env, or the seats of one game of an AEC env."""

    env_id: str
    seed: int
    group_size: int
    renderer_name: str
    model_name: str
    env_kwargs: dict[str, Any] = chz.field(default_factory=dict)
    max_generation_tokens: int | None = None

    def _renderer(self) -> Any:
        return renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))

    async def make_envs(self) -> Sequence[Env]:
        renderer = self._renderer()
        if is_multi_agent(self.env_id):
            return AECGame(self.env_id, self.seed, renderer, self.env_kwargs).seats()
        return [EnvFromMessageEnv(renderer, HubMessageEnv(self.env_id, self.seed, self.env_kwargs), max_generation_tokens=self.max_generation_tokens)
                for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return [self.env_id.split("/")[-1]]


class HubRLDataset(RLDataset):
    """Batches of groups: batch ``i`` holds seeds ``first_seed + i * batch_size`` onward, one group per seed."""

    def __init__(self, builder: HubRLDatasetBuilder) -> None:
        self.builder = builder

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        b = self.builder
        start = b.first_seed + index * b.batch_size
        return [HubEnvGroupBuilder(env_id=b.env_id, seed=seed, group_size=b.group_size, renderer_name=b.renderer_name, model_name=b.model_name,
                                   env_kwargs=dict(b.env_kwargs), max_generation_tokens=b.max_generation_tokens)
                for seed in range(start, start + b.batch_size)]

    def __len__(self) -> int:
        return self.builder.num_batches


@chz.chz
class HubRLDatasetBuilder(RLDatasetBuilder):
    """The cookbook dataset of a hub env: ``num_batches`` batches of ``batch_size`` seeds, ``group_size`` rollouts each."""

    env_id: str
    renderer_name: str
    model_name: str
    batch_size: int = 8
    group_size: int = 8
    num_batches: int = 1000
    first_seed: int = 0
    env_kwargs: dict[str, Any] = chz.field(default_factory=dict)
    max_generation_tokens: int | None = None

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return HubRLDataset(self), None


def is_multi_agent(env_id: str) -> bool:
    """Whether the hub lists ``env_id`` as a multi-agent (AEC) env."""
    return tinkergym.spec(env_id).agents > 1


class AECGame:
    """One game of an AEC env, played by one cookbook :class:`Env` per agent (see the module docstring)."""

    def __init__(self, env_id: str, seed: int, renderer: Any, env_kwargs: dict[str, Any]) -> None:
        self.env = tinkergym.make_aec(env_id, **env_kwargs)
        self.env.reset(seed=seed)
        self.renderer = renderer
        self.agents = list(self.env.possible_agents)
        self.history: dict[str, list[Any]] = {a: [] for a in self.agents}
        self.turn = asyncio.Condition()

    def seats(self) -> list[Env]:
        return [_Seat(self, agent) for agent in self.agents]

    def done(self, agent: str) -> bool:
        return agent not in self.env.agents or self.env.terminations.get(agent, False) or self.env.truncations.get(agent, False)

    def observe(self, agent: str) -> tinker.ModelInput:
        observation = self.env.observe(agent)
        info = self.env.infos.get(agent, {})
        if not self.history[agent] and info.get("system_prompt"):
            self.history[agent].append({"role": "system", "content": info["system_prompt"]})
        self.history[agent].append({"role": "user", "content": str(observation)})
        return self.renderer.build_generation_prompt(self.history[agent])

    async def wait_turn(self, agent: str) -> None:
        async with self.turn:
            await self.turn.wait_for(lambda: self.done(agent) or self.env.agent_selection == agent)

    async def act(self, agent: str, text: str) -> None:
        async with self.turn:
            if self.done(agent):
                return
            self.history[agent].append({"role": "assistant", "content": text})
            self.env.step(text)
            self.turn.notify_all()

    def reward(self, agent: str) -> float:
        """What the game gave ``agent`` since its last move (PettingZoo's cumulative reward of the agent)."""
        return float(self.env._cumulative_rewards.get(agent, 0.0))


class _Seat(Env):
    """One player of an :class:`AECGame`: it observes when its turn comes and ends with the game's reward for it."""

    def __init__(self, game: AECGame, agent: str) -> None:
        self.game, self.agent = game, agent
        self.stop = game.renderer.get_stop_sequences()

    async def initial_observation(self) -> tuple[tinker.ModelInput, StopCondition] | InitialObservationOverflow:
        await self.game.wait_turn(self.agent)
        if self.game.done(self.agent):  # the game ended before this seat's first move (the other seat forfeited)
            return InitialObservationOverflow(reward=self.game.reward(self.agent), metrics={"game/ended_before_first_move": 1.0})
        return self.game.observe(self.agent), self.stop

    async def step(self, action: Action, *, extra: Any = None) -> StepResult:
        message, _ = self.game.renderer.parse_response(action)
        await self.game.act(self.agent, _text(message))
        await self.game.wait_turn(self.agent)
        done = self.game.done(self.agent)
        reward = self.game.reward(self.agent)
        observation = tinker.ModelInput.empty() if done else self.game.observe(self.agent)
        return StepResult(reward=reward, episode_done=done, next_observation=observation, next_stop_condition=self.stop)
