"""Any Gymnasium env with a discrete action space, played in text: :class:`DiscreteTextEnv`.

The wrapped env keeps its own rules, rewards and episode ends; the adapter turns its actions into names a
model can type (``"left"``, ``"pickup"``; the action numbers by default) and its observations into text
(``render()`` in ``render_mode="ansi"`` with terminal colour codes removed, or a ``describe`` function of the
package's own). Text that names no action, or several, is a bad action: the env's documented penalty, the
wrapped env does not move, and the observation says what the valid actions are (see :class:`~tinkergym.TextEnv`).

This module imports only Gymnasium's core: the wrapped env's module is imported when the adapter is made.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from tinkergym.core import StepResult, TextEnv
from tinkergym.errors import ConfigError, InvalidAction
from tinkergym.spaces import describe_text, is_printable_text

#: Terminal control sequences (colours, cursor moves) that ``render_mode="ansi"`` output may hold.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
_NOT_WORD = re.compile(r"[^0-9a-z]+")

Describe = Callable[[gym.Env, Any, dict[str, Any]], str]


def plain_text(text: str) -> str:
    """``text`` without terminal control sequences, every other non-printable character as ``?``."""
    text = _ANSI.sub("", text)
    if is_printable_text(text):
        return text
    return "".join(c if c in "\n\t" or c.isprintable() else "?" for c in text)


def jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data: numpy arrays and scalars become lists and numbers, tuples and sets lists,
    non-finite floats and anything else their ``str``."""
    if depth > 20:
        return str(value)
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist(), depth + 1)
    if isinstance(value, np.generic):
        return jsonable(value.item(), depth + 1)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v, depth + 1) for v in items]
    return str(value)


def _key(name: str) -> str:
    """An action name as it is matched: lower case, runs of anything but letters and digits as one space."""
    return " ".join(_NOT_WORD.sub(" ", name.lower()).split())


class DiscreteTextEnv(TextEnv):
    """A Gymnasium env with a ``Discrete`` action space as a text env: actions are typed by name.

    Observation: the wrapped env's ``render()`` (``render_mode="ansi"``; terminal colour codes removed) or,
    where a ``describe`` function is given, its text; after a step it is led by ``"<action>: reward R."``.
    The list of action names closes every observation.
    Action: one action's name (``"left"``), in any case, alone or inside a sentence as long as exactly one
    action is named (``"I go left."`` works; ``"left or right"`` does not). Aliases name actions too.
    Reward, termination, truncation: the wrapped env's. A bad action (no action named, several, not text,
    too long) costs ``invalid_action_penalty`` and the wrapped env does not move; after
    ``max_invalid_actions`` of them in an episode it ends with ``forfeit_reward`` (``None``: the penalty).
    Info: the wrapped env's info as JSON data, ``state`` (its observation as JSON data), ``action`` (the
    name played) and, where the wrapped env's info has an ``action_mask``, ``legal_actions`` (names).

    Args:
        env: The env to wrap: an instance, a Gymnasium id (made with ``render_mode="ansi"``, or with no
            render mode when ``describe`` is given) or a function that returns one. Subclasses may leave
            it out and override :meth:`make_env` instead.
        action_names: One name per action, in action order (``Discrete(n, start)``: ``n`` names). Default:
            the class attribute ``action_names`` or, where that is empty, the action numbers (``"0"``, ``"1"``).
        aliases: Extra names, ``{"pick up": "pickup"}`` (alias to action name).
        describe: ``describe(env, observation, info) -> str``, the text of the wrapped env's state;
            default: the class's :meth:`describe`, which returns ``env.render()``.
        system_prompt: The instructions (default: the class attribute, or a line naming the actions).
        invalid_action_penalty, max_invalid_actions, forfeit_reward: as on :class:`~tinkergym.TextEnv`;
            ``None`` keeps the class attribute.
        render_mode: ``"ansi"``, ``"human"`` or ``None`` (this env's render: the latest observation).
    """

    metadata = {**TextEnv.metadata, "tinkergym": {"data": "free", "turns": "multi", "agents": 1}}
    action_names: tuple[str, ...] = ()
    action_aliases: Mapping[str, str] = {}
    invalid_action_penalty = -0.1
    max_invalid_actions: int | None = 3
    max_action_length = 4_096

    def __init__(
        self,
        env: gym.Env | str | Callable[[], gym.Env] | None = None,
        *,
        action_names: Sequence[str] | None = None,
        aliases: Mapping[str, str] | None = None,
        describe: Describe | None = None,
        system_prompt: str | None = None,
        invalid_action_penalty: float | None = None,
        max_invalid_actions: int | None = None,
        forfeit_reward: float | None = None,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(render_mode=render_mode)
        self._set_rules(invalid_action_penalty, max_invalid_actions, forfeit_reward)
        self._describe = describe
        self.env = self._wrapped(env, describe)
        space = self.env.action_space
        if not isinstance(space, spaces.Discrete):
            raise ConfigError(f"{type(self).__name__} wraps envs with a Discrete action space; {self.env} has {space}.")
        self._start, count = int(space.start), int(space.n)
        names = tuple(action_names if action_names is not None else self.action_names or [str(self._start + i) for i in range(count)])
        self.names = self._checked_names(names, count)
        self._lookup = self._name_table(self.names, {**self.action_aliases, **(aliases or {})})
        if system_prompt is not None:
            self.system_prompt = system_prompt
        elif not self.system_prompt:
            self.system_prompt = f"You act in a text game. Each turn, answer with one action's name: {self.action_list()}."
        self._inner_observation: Any = None

    # ----- construction ---------------------------------------------------------------------------
    def make_env(self) -> gym.Env:
        """The env to wrap when none is passed to the constructor (subclasses override it)."""
        raise ConfigError(f"{type(self).__name__} needs an env to wrap: pass env=<an env, a Gymnasium id or a function>.")

    def _wrapped(self, env: Any, describe: Describe | None) -> gym.Env:
        if env is None:
            made = self.make_env()
        elif isinstance(env, str):
            try:
                made = gym.make(env, render_mode=None if describe is not None else "ansi")
            except gym.error.Error as exc:
                raise ConfigError(f"cannot make {env!r}: {exc}") from exc
        elif isinstance(env, gym.Env):
            made = env
        elif callable(env):
            made = env()
        else:
            raise ConfigError(f"env={env!r}: pass a Gymnasium env, its id or a function that makes one.")
        if not isinstance(made, gym.Env):
            raise ConfigError(f"{type(self).__name__}: the env to wrap must be a gymnasium.Env, got {type(made).__name__}.")
        has_text = describe is not None or type(self).describe is not DiscreteTextEnv.describe
        if not has_text and made.render_mode != "ansi":
            raise ConfigError(
                f"{made} renders as {made.render_mode!r}; make it with render_mode='ansi' or pass describe=<a function "
                "that writes its state as text>."
            )
        return made

    def _set_rules(self, penalty: float | None, max_invalid: int | None, forfeit: float | None) -> None:
        for name, value in (("invalid_action_penalty", penalty), ("forfeit_reward", forfeit)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name}={value!r}: choose a finite number.")
            setattr(self, name, float(value))
        if max_invalid is not None:
            if isinstance(max_invalid, bool) or not isinstance(max_invalid, int) or max_invalid < 1:
                raise ConfigError(f"max_invalid_actions={max_invalid!r}: choose a whole number of at least 1.")
            self.max_invalid_actions = max_invalid

    @staticmethod
    def _checked_names(names: tuple[str, ...], count: int) -> tuple[str, ...]:
        if len(names) != count or not all(isinstance(n, str) and _key(n) for n in names):
            raise ConfigError(f"action_names={list(names)!r}: give {count} names (one per action), each with a letter or digit.")
        keys = [_key(n) for n in names]
        if len(set(keys)) != count:
            raise ConfigError(f"action_names={list(names)!r}: two names read the same; make each distinct.")
        return names

    def _name_table(self, names: tuple[str, ...], aliases: Mapping[str, str]) -> dict[str, int]:
        table = {_key(name): i for i, name in enumerate(names)}
        for alias, target in aliases.items():
            if _key(target) not in table or not _key(alias):
                raise ConfigError(f"aliases: {alias!r} -> {target!r} names no action; the actions are {self.action_list(names)}.")
            if table.setdefault(_key(alias), table[_key(target)]) != table[_key(target)]:
                raise ConfigError(f"aliases: {alias!r} already names another action.")
        return table

    def action_list(self, names: Sequence[str] | None = None) -> str:
        """The action names as a readable list."""
        return ", ".join(names if names is not None else self.names)

    # ----- what a package may override ------------------------------------------------------------
    def describe(self, observation: Any, info: dict[str, Any]) -> str:
        """The wrapped env's state as text: the ``describe`` function, else ``render()``."""
        if self._describe is not None:
            return self._describe(self.env, observation, info)
        rendered = self.env.render()
        return rendered if isinstance(rendered, str) else str(rendered)

    def success(self, reward: float, terminated: bool, truncated: bool, info: dict[str, Any]) -> bool | None:
        """``info["is_success"]`` after a step of the wrapped env (``None``: not set; the episode's return decides)."""
        return None

    # ----- the game -------------------------------------------------------------------------------
    def parse_action(self, text: str) -> int:
        """The action ``text`` names; :class:`InvalidAction` when it names none or several."""
        key = _key(text)
        if key in self._lookup:
            return self._lookup[key]
        padded = f" {key} "
        named = {index for name, index in self._lookup.items() if f" {name} " in padded}
        if len(named) == 1:
            return named.pop()
        if not named:
            raise InvalidAction(f"{describe_text(text)} names no action; answer with one of: {self.action_list()}.")
        listed = ", ".join(self.names[i] for i in sorted(named))
        raise InvalidAction(f"{describe_text(text)} names {len(named)} actions ({listed}); name exactly one.")

    def invalid_action_hint(self) -> str:
        """The state the bad action left unchanged, and the actions."""
        return f"\n{self._view({})}"

    def _view(self, info: dict[str, Any], closing: str | None = None) -> str:
        text = plain_text(self.describe(self._inner_observation, info)).strip("\n")
        return f"{text}\n\n{closing or f'Actions: {self.action_list()}.'}"

    def _info(self, observation: Any, info: dict[str, Any]) -> dict[str, Any]:
        out = jsonable(dict(info))
        out["state"] = jsonable(observation)
        mask = info.get("action_mask")
        if mask is not None:
            out["legal_actions"] = [self.names[i] for i, allowed in enumerate(np.asarray(mask).tolist()) if allowed and i < len(self.names)]
        return out

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        seed = int(self.np_random.integers(2**31 - 1))  # the wrapped env's episode follows this env's seed
        observation, info = self.env.reset(seed=seed, options=options or None)
        self._inner_observation = observation
        return self._view(info), self._info(observation, info)

    def _step(self, action: str) -> StepResult:
        index = self.parse_action(action)
        observation, reward, terminated, truncated, info = self.env.step(self._start + index)
        self._inner_observation = observation
        out = self._info(observation, info)
        out["action"] = self.names[index]
        success = self.success(float(reward), bool(terminated), bool(truncated), info)
        if success is not None:
            out["is_success"] = bool(success)
        closing = "The episode is over." if terminated else "The episode ran out of steps." if truncated else None
        text = f"{self.names[index]}: reward {float(reward):g}.\n\n{self._view(info, closing)}"
        return text, float(reward), bool(terminated), bool(truncated), out

    def close(self) -> None:
        """Close the wrapped env."""
        self.env.close()
        super().close()
