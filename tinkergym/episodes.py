"""Play whole episodes with scripted agents and keep readable transcripts.

Used by ``tinkergym play``, the conformance checkers and the throughput benchmark. (The token-level
rollout loop of training builds on the same env API; this module is the text-level one.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Mapping

from tinkergym.agents import Agent


@dataclass
class Turn:
    """One action and what came back."""

    actor: str
    action: str
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@dataclass
class Transcript:
    """A whole episode: the system prompt, the first observation and every turn."""

    system_prompt: str
    first_observation: str
    turns: list[Turn] = field(default_factory=list)
    returns: dict[str, float] = field(default_factory=dict)
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy (an observation with images: its text and an ``[image HxW]`` mark per image)."""
        data = asdict(self)
        data["first_observation"] = shown(self.first_observation)
        for turn in data["turns"]:
            turn["observation"] = shown(turn["observation"])
        return data

    def format(self) -> str:
        """The episode as text, the way a person reads it."""
        parts = [f"[system]\n{self.system_prompt}", f"[observation]\n{shown(self.first_observation)}"]
        for turn in self.turns:
            flags = " (terminated)" if turn.terminated else " (truncated)" if turn.truncated else ""
            parts.append(f"[{turn.actor}] {turn.action}")
            parts.append(f"[observation] reward {turn.reward:+g}{flags}\n{shown(turn.observation)}")
        parts.append("[returns] " + ", ".join(f"{k}: {v:+g}" for k, v in self.returns.items()))
        return "\n\n".join(parts)


def shown(observation: Any) -> Any:
    """An observation as a person reads it: text as it is; text with images (:class:`tinkergym.spaces.TextWithImages`) as
    its text and an ``[image HxW]`` mark per image, never the pixels."""
    if not isinstance(observation, Mapping) or "images" not in observation:
        return observation
    marks = " ".join(f"[image {getattr(image, 'shape', ('?', '?'))[0]}x{getattr(image, 'shape', ('?', '?'))[1]}]" for image in observation["images"])
    return f"{marks}\n{observation.get('text', '')}" if marks else str(observation.get("text", ""))


def run_episode(env: Any, agent: Agent, *, seed: int | None = None, options: dict | None = None, max_steps: int = 10_000) -> Transcript:
    """Play one episode of a single-agent text env with ``agent``."""
    observation, info = env.reset(seed=seed, options=options)
    transcript = Transcript(str(info.get("system_prompt", "")), observation, seed=seed, tools=info.get("tools"))
    total = 0.0
    for _ in range(max_steps):
        action = agent(observation, info)
        observation, reward, terminated, truncated, info = env.step(action)
        total += float(reward)
        transcript.turns.append(Turn("agent", action, observation, float(reward), bool(terminated), bool(truncated), info))
        if terminated or truncated:
            break
    transcript.returns = {"agent": total}
    return transcript


def run_aec_episode(env: Any, agents: Mapping[str, Agent], *, seed: int | None = None, max_steps: int = 10_000) -> Transcript:
    """Play one game of a multi-agent AEC text env; ``agents`` maps every agent name to its player."""
    env.reset(seed=seed)
    first = env.agent_selection
    transcript = Transcript(str(env.infos[first].get("system_prompt", "")), env.observe(first), seed=seed)
    returns = {a: 0.0 for a in env.agents}
    for _ in range(max_steps):
        if not env.agents:
            break
        name = env.agent_selection
        observation, _, terminated, truncated, info = env.last()
        if terminated or truncated:
            env.step(None)
            continue
        action = agents[name](observation, info)
        env.step(action)
        for a, r in env.rewards.items():
            returns[a] += float(r)
        done = all(env.terminations.get(a, True) or env.truncations.get(a, False) for a in env.agents)
        shown = env.observe(name) if name in env.agents else ""
        transcript.turns.append(
            Turn(name, action, shown, float(env.rewards.get(name, 0.0)), done, False, dict(env.infos.get(name, {})))
        )
    transcript.returns = returns
    return transcript
