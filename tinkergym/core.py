"""The single-agent text-environment contract: :class:`TextEnv`.

A :class:`TextEnv` is a ``gymnasium.Env[str, str]``. Subclasses write the game as two small hooks,
:meth:`TextEnv._reset` and :meth:`TextEnv._step`, and raise :class:`~tinkergym.errors.InvalidAction` for a
bad action; the public :meth:`TextEnv.reset` and :meth:`TextEnv.step` add the system prompt and tool
schemas to ``info`` and turn every bad action (wrong type, too long, malformed, illegal) into an
observation that says what was wrong, with the env's documented penalty. ``step`` never raises for an
action.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

import gymnasium as gym

from tinkergym.errors import ConfigError, InvalidAction
from tinkergym.spaces import DEFAULT_MAX_LENGTH, PrintableText

StepResult = tuple[str, float, bool, bool, dict[str, Any]]

EPISODE_OVER = "The episode is over; call reset() to start a new one."


def coerce_action(action: Any, max_length: int) -> tuple[str, str | None]:
    """Return ``(text, error)``: the action as text, and a message when it cannot be used as given."""
    if isinstance(action, str):
        if len(action) > max_length:
            return "", f"the action is {len(action):,} characters long; the limit is {max_length:,}."
        return action, None
    if isinstance(action, (bytes, bytearray)):
        return coerce_action(bytes(action).decode("utf-8", errors="replace"), max_length)
    return "", f"the action must be text (str), not {type(action).__name__}."


def reset_options(env: Any, options: Any) -> dict[str, Any]:
    """A copy of the ``options`` given to ``env.reset`` (``None``: empty); anything but a mapping is a :class:`ConfigError`."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{type(env).__name__}.reset(options=...) takes a dict (see the env's docstring) or None, not {type(options).__name__} {reprlib.repr(options)}.")
    return dict(options)


class TextEnv(gym.Env[str, str]):
    """Base class of single-agent text environments.

    Class attributes a subclass sets (and documents in its docstring):

    - ``system_prompt``: the instructions shown to the agent (``info["system_prompt"]`` on reset).
    - ``invalid_action_penalty``: the reward of a bad action.
    - ``max_invalid_actions``: bad actions after which the episode ends (``None``: never).
    - ``forfeit_reward``: the reward of the bad action that ends the episode (``None``: the penalty).
    - ``max_observation_length`` / ``max_action_length``: the bounds of the two text spaces.

    ``metadata["tinkergym"]`` holds facts about the env that tools read, such as
    ``{"data": "free", "turns": "multi", "agents": 1}`` and ``"checker_skip"``: a tuple of named
    conformance checks that do not apply to it, with the reason in the env's docstring.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi", "human"], "render_fps": 4, "tinkergym": {}}  # a class attribute, typed as gymnasium.Env types it

    system_prompt: str = ""
    invalid_action_penalty: float = -0.1
    max_invalid_actions: int | None = None
    forfeit_reward: float | None = None
    max_observation_length: int = DEFAULT_MAX_LENGTH
    max_action_length: int = DEFAULT_MAX_LENGTH

    def __init__(self, render_mode: str | None = None) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ConfigError(
                f"render_mode={render_mode!r} is not supported; use one of {self.metadata['render_modes']} or None."
            )
        self.render_mode = render_mode
        self.observation_space = PrintableText(self.max_observation_length)
        self.action_space = PrintableText(self.max_action_length)
        self.invalid_actions = 0
        self._last_observation = ""
        self._episode_over = True

    # ----- hooks for subclasses -------------------------------------------------------------------
    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Start a new episode from ``self.np_random``; return the first observation and info."""
        raise NotImplementedError

    def _step(self, action: str) -> StepResult:
        """Apply a text action; raise :class:`InvalidAction` when it is malformed or illegal."""
        raise NotImplementedError

    def tool_schemas(self) -> list[dict[str, Any]]:
        """JSON schemas of the tools the agent may call (empty for envs without tools)."""
        return []

    def get_system_prompt(self) -> str:
        """The system prompt for the episode that was just reset."""
        return self.system_prompt

    # ----- the Gymnasium API ----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; ``info`` carries ``system_prompt`` and, for tool envs, ``tools``."""
        settings = reset_options(self, options)
        super().reset(seed=seed)
        self.invalid_actions = 0
        observation, extra = self._reset(settings)
        info: dict[str, Any] = {"system_prompt": self.get_system_prompt()}
        tools = self.tool_schemas()
        if tools:
            info["tools"] = tools
        info.update(extra)
        self._episode_over = False
        self._last_observation = observation
        return observation, info

    def step(self, action: Any) -> StepResult:
        """Apply ``action``; a bad action yields feedback and the penalty, never an exception."""
        if self._episode_over:
            return EPISODE_OVER, 0.0, True, False, {"invalid_action": True, "error": EPISODE_OVER}
        text, error = coerce_action(action, self.max_action_length)
        if error is None:
            try:
                result = self._step(text)
            except InvalidAction as exc:
                error = str(exc)
        if error is not None:
            result = self._invalid_action(error)
        if result[2] or result[3]:
            self._episode_over = True
        self._last_observation = result[0]
        return result

    def _invalid_action(self, message: str) -> StepResult:
        """Feedback for a bad action: the penalty, or the forfeit once the limit of bad actions is hit."""
        self.invalid_actions += 1
        info = {"invalid_action": True, "error": message, "invalid_actions": self.invalid_actions}
        limit = self.max_invalid_actions
        if limit is not None and self.invalid_actions >= limit:
            reward = self.invalid_action_penalty if self.forfeit_reward is None else self.forfeit_reward
            text = f"Invalid action: {message}\nThat was invalid action {self.invalid_actions} of {limit}; the episode is over."
            return text, float(reward), True, False, info
        return f"Invalid action: {message}\n{self.invalid_action_hint()}", float(self.invalid_action_penalty), False, False, info

    def invalid_action_hint(self) -> str:
        """A line appended to invalid-action feedback that says what a valid action looks like."""
        return "Try again."

    def render(self) -> str | None:
        """``ansi``: return the latest observation; ``human``: print it."""
        if self.render_mode == "ansi":
            return self._last_observation
        if self.render_mode == "human":
            print(self._last_observation)
        return None
