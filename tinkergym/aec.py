"""The multi-agent text-environment contract: :class:`TextAECEnv`, a PettingZoo ``AECEnv``.

Turn-based games write three hooks: :meth:`TextAECEnv._reset_game`, :meth:`TextAECEnv._observe` and
:meth:`TextAECEnv._play`. The base keeps PettingZoo's bookkeeping (cumulative rewards, dead steps, the
agent order) and the same rules as :class:`~tinkergym.TextEnv` per agent: a bad action never raises, it
costs the acting agent the documented penalty, the agent keeps the turn and sees what was wrong; after
``max_invalid_actions`` bad actions in a row the agent forfeits.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gymnasium.utils import seeding
from pettingzoo import AECEnv

from tinkergym.core import coerce_action, reset_options
from tinkergym.errors import ConfigError, InvalidAction
from tinkergym.spaces import DEFAULT_MAX_LENGTH, PrintableText


class TextAECEnv(AECEnv):
    """Base class of turn-based multi-agent text environments (agents named ``player_0``, ``player_1``...).

    Subclasses set ``possible_agents`` (class attribute or before calling ``super().__init__``) and the
    same class attributes as :class:`~tinkergym.TextEnv`: ``system_prompt``, ``invalid_action_penalty``,
    ``max_invalid_actions``, ``forfeit_reward``, ``max_observation_length``, ``max_action_length``.
    """

    metadata: ClassVar[dict[str, Any]] = {
        "render_modes": ["ansi", "human"],
        "name": "text_aec_v0",
        "is_parallelizable": False,
        "tinkergym": {},
    }

    possible_agents: list[str] = ["player_0", "player_1"]
    system_prompt: str = ""
    invalid_action_penalty: float = -0.1
    max_invalid_actions: int | None = None
    forfeit_reward: float = -1.0
    max_observation_length: int = DEFAULT_MAX_LENGTH
    max_action_length: int = DEFAULT_MAX_LENGTH

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__()
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ConfigError(
                f"render_mode={render_mode!r} is not supported; use one of {self.metadata['render_modes']} or None."
            )
        self.render_mode = render_mode
        self.possible_agents = list(self.possible_agents)
        self.observation_spaces = {a: PrintableText(self.max_observation_length) for a in self.possible_agents}
        self.action_spaces = {a: PrintableText(self.max_action_length) for a in self.possible_agents}
        self.np_random, self.np_random_seed = seeding.np_random()
        self.agents: list[str] = []
        self._feedback: dict[str, str] = {}
        self._invalid_streak: dict[str, int] = {}

    # ----- hooks for subclasses -------------------------------------------------------------------
    def _reset_game(self, options: dict[str, Any]) -> str:
        """Set up a new game from ``self.np_random``; return the agent that moves first."""
        raise NotImplementedError

    def _observe(self, agent: str) -> str:
        """The game as ``agent`` sees it now."""
        raise NotImplementedError

    def _play(self, agent: str, action: str) -> dict[str, float] | None:
        """Apply ``agent``'s move; raise :class:`InvalidAction` for a bad one.

        Return ``None`` while the game goes on, or the final rewards of every agent when it ends.
        """
        raise NotImplementedError

    def system_prompt_for(self, agent: str) -> str:
        """The system prompt of ``agent`` (the same for all by default)."""
        return self.system_prompt

    def invalid_action_hint(self, agent: str) -> str:
        """A line appended to invalid-action feedback that says what a valid action looks like."""
        return "Try again."

    def _next_agent(self, agent: str) -> str:
        """Who moves after ``agent`` (round robin by default)."""
        order = self.possible_agents
        return order[(order.index(agent) + 1) % len(order)]

    # ----- the PettingZoo API ---------------------------------------------------------------------
    def observation_space(self, agent: str) -> PrintableText:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> PrintableText:
        return self.action_spaces[agent]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start a game; ``infos[agent]["system_prompt"]`` holds each agent's instructions."""
        settings = reset_options(self, options)
        if seed is not None:
            self.np_random, self.np_random_seed = seeding.np_random(seed)
        self.agents = list(self.possible_agents)
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {"system_prompt": self.system_prompt_for(a)} for a in self.agents}
        self._feedback = {}
        self._invalid_streak = {a: 0 for a in self.agents}
        self.agent_selection = self._reset_game(settings)

    def observe(self, agent: str) -> str:
        """``agent``'s view, led by feedback on its last bad action if it made one."""
        view = self._observe(agent)
        feedback = self._feedback.get(agent)
        return f"{feedback}\n\n{view}" if feedback else view

    def step(self, action: Any) -> None:
        """Apply the selected agent's action; a bad action yields feedback and the penalty, never an exception."""
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        self._cumulative_rewards[agent] = 0.0
        self.rewards = {a: 0.0 for a in self.agents}
        self._feedback.pop(agent, None)
        self.infos[agent].pop("error", None)
        text, error = coerce_action(action, self.max_action_length)
        final: dict[str, float] | None = None
        if error is None:
            try:
                final = self._play(agent, text)
            except InvalidAction as exc:
                error = str(exc)
        if error is not None:
            final = self._invalid_action(agent, error)
        else:
            self._invalid_streak[agent] = 0
        if final is not None:
            self.rewards.update({a: float(r) for a, r in final.items()})
            self.terminations = {a: True for a in self.agents}
            self.agent_selection = self._next_agent(agent)
        elif error is None:
            self.agent_selection = self._next_agent(agent)
        self._accumulate_rewards()

    def _invalid_action(self, agent: str, message: str) -> dict[str, float] | None:
        """Charge the penalty and keep the turn, or end the game with a forfeit after too many."""
        self._invalid_streak[agent] += 1
        streak, limit = self._invalid_streak[agent], self.max_invalid_actions
        self.infos[agent]["error"] = message
        if limit is not None and streak >= limit:
            self._feedback[agent] = f"Invalid action: {message}\nThat was invalid action {streak} of {limit}; you forfeit."
            return self._forfeit_rewards(agent)
        self._feedback[agent] = f"Invalid action: {message}\n{self.invalid_action_hint(agent)}"
        self.rewards[agent] = float(self.invalid_action_penalty)
        return None

    def _forfeit_rewards(self, agent: str) -> dict[str, float]:
        """Final rewards when ``agent`` forfeits: ``forfeit_reward`` to it, the opposite to the others."""
        return {a: (self.forfeit_reward if a == agent else -self.forfeit_reward) for a in self.agents}

    def render(self) -> str | None:
        """``ansi``: return the selected agent's view; ``human``: print it."""
        if not self.agents:
            return None
        view = self._observe(self.agent_selection)
        if self.render_mode == "human":
            print(view)
            return None
        return view if self.render_mode == "ansi" else None

    def close(self) -> None:
        """Nothing to release."""
