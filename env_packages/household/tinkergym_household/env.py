"""``tinker/Household-v0``: ALFWorld-style household tasks in procedurally generated homes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinkergym.core import StepResult, TextEnv
from tinkergym.errors import ConfigError
from tinkergym_household.catalog import GOAL_KINDS
from tinkergym_household.commands import read_command
from tinkergym_household.generate import generate_home, longest_plan
from tinkergym_household.world import Home, admissible, apply, commands_text, describe_room, update_progress

MAX_ROOMS = 6
MAX_DISTRACTORS = 60
MAX_HORIZON = 1_000

SYSTEM_PROMPT = """\
You are a household robot in a home of one or more rooms. Your task is given at the start, for example: \
"Your task is to: put a clean mug in the coffeemachine." Act with one text command per reply:
- go to RECEPTACLE (in this room), or go to ROOM (through an open door)
- open RECEPTACLE, close RECEPTACLE, open door to ROOM, close door to ROOM
- take OBJECT from RECEPTACLE, put OBJECT in/on RECEPTACLE
- clean OBJECT with sinkbasin N, heat OBJECT with microwave N, cool OBJECT with fridge N
- use desklamp N, examine OBJECT or RECEPTACLE, look, inventory
- help: lists the commands possible right now
Objects and receptacles are named with a number, e.g. mug 1 or countertop 2. Go to a receptacle before you \
use it, and open a closed one to see inside, take from it or put into it. You carry one object at a time. \
To examine an object in light, hold it at a desklamp that is switched on. You have {horizon} commands. \
Answer with the command only, for example: go to countertop 1"""


class HouseholdEnv(TextEnv):
    """Household tasks in the manner of ALFWorld, in homes generated from the reset seed (no data, no ALFWorld).

    Each episode draws a home (rooms joined by doors, receptacles numbered per type, objects on and in
    them, containers that open) and one goal of ALFWorld's six kinds: ``pick_and_place`` ("put a cd in
    the safe."), ``look_at_obj_in_light`` ("examine the book with the desklamp."),
    ``pick_clean_then_place`` / ``pick_heat_then_place`` / ``pick_cool_then_place`` ("put a clean
    mug in the coffeemachine.") and ``pick_two_obj_and_place`` ("put two pencils in a drawer.").

    Observation: text. Reset: the room the agent stands in (``"You are in the kitchen. Looking quickly
    around you, you see a cabinet 1, a countertop 1, a fridge 1 (closed), ... A door leads to the hallway
    (closed)."``), then ``"Your task is to: ..."``. Each step: what the command did (``"You arrive at the
    countertop 1. On the countertop 1, you see a mug 1 and an apple 2."``); after the last allowed
    command, a line saying the commands are used up.

    Action: one command (see ``info["system_prompt"]``): go to, open, close, take, put, clean, heat,
    cool, use, examine, look, inventory, help (lists the admissible commands). Case, quotes, a final full
    stop, ``the`` and the preposition of ``put`` do not matter; when the whole text is no command, its
    last line, then its first, is tried. A command must be admissible now (``info["admissible_commands"]``).

    Reward: ``1`` on the step that completes the goal (sparse); every command costs ``step_penalty``
    (default -0.01, added to the step's reward); optional shaping pays ``subgoal_reward`` (default 0:
    off) the first time each intermediate subgoal holds: holding an object of the goal's type; for
    clean/heat/cool, such an object being clean/hot/cool; for "pick two", one of them in a receptacle of
    the target type. A bad action (not text, too long, not a command, not admissible now) is answered
    with what was wrong and the admissible commands, and its reward is ``invalid_action_penalty``
    (default -0.1) alone; it uses up one command of the horizon too.

    Termination: the goal holds (``info["is_success"]``). Truncation: ``horizon`` commands (good or bad)
    without it. ``max_invalid_actions`` bad actions (default ``None``: no limit) end the episode too.

    Info: reset has ``system_prompt``, ``goal`` (the task text), ``goal_kind``, ``admissible_commands``
    and ``horizon``; each step has ``admissible_commands`` (for the next command), ``steps`` (used so
    far), ``goal_progress`` (the fraction of the goal's subgoals reached, as ALFWorld's goal-condition
    success rate), ``is_success``, and ``command`` (the canonical command carried out; after a bad
    action ``invalid_action``, ``error`` and ``invalid_actions`` instead).

    Kwargs:
        rooms: Rooms in a home, 1 to 6 (default 3).
        distractors: Objects beyond the goal's (and the desklamps), 0 to 60 (default 8).
        horizon: Commands per episode (default 50), at least :func:`~tinkergym_household.generate.longest_plan`
            of ``rooms`` and ``goal_kinds`` (so that every task is solvable: 21 for 3 rooms), at most 1000.
        goal_kinds: The goal kinds to draw from (a list, or a comma-separated string; default all six).
        step_penalty: Reward added for every command, at most 0 (default -0.01).
        subgoal_reward: Shaping reward per subgoal reached, at least 0 (default 0).
        invalid_action_penalty: Reward of a bad action, at most 0 (default -0.1).
        max_invalid_actions: Bad actions that end the episode (default ``None``: only the horizon does).
        render_mode: ``"ansi"`` (``render()`` returns the latest observation), ``"human"`` or ``None``.

    Seeding: ``reset(seed=s)`` draws the same home and goal for the same ``s`` and kwargs.
    """

    metadata = {**TextEnv.metadata, "tinkergym": {"data": "free", "turns": "multi", "agents": 1}}
    invalid_action_penalty = -0.1
    max_invalid_actions = None
    max_action_length = 4_096
    max_observation_length = 8_192

    def __init__(
        self,
        rooms: int = 3,
        distractors: int = 8,
        horizon: int = 50,
        goal_kinds: Sequence[str] | str | None = None,
        step_penalty: float = -0.01,
        subgoal_reward: float = 0.0,
        invalid_action_penalty: float = -0.1,
        max_invalid_actions: int | None = None,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(render_mode=render_mode)
        self.rooms = _whole("rooms", rooms, 1, MAX_ROOMS)
        self.distractors = _whole("distractors", distractors, 0, MAX_DISTRACTORS)
        self.goal_kinds = _goal_kinds(goal_kinds)
        needed = longest_plan(self.rooms, self.goal_kinds)
        if not isinstance(horizon, int) or isinstance(horizon, bool) or not needed <= horizon <= MAX_HORIZON:
            raise ConfigError(
                f"horizon={horizon!r}: choose a whole number from {needed} to {MAX_HORIZON}; with rooms={self.rooms} "
                f"the longest task of these goal kinds needs up to {needed} commands."
            )
        self.horizon = horizon
        self.step_penalty = _reward("step_penalty", step_penalty, "at most 0 (e.g. -0.01), or 0 for none", upper=0.0)
        self.subgoal_reward = _reward("subgoal_reward", subgoal_reward, "at least 0 (e.g. 0.1), or 0 for no shaping", lower=0.0)
        self.invalid_action_penalty = _reward("invalid_action_penalty", invalid_action_penalty, "at most 0 (e.g. -0.1)", upper=0.0)
        if max_invalid_actions is not None:
            max_invalid_actions = _whole("max_invalid_actions", max_invalid_actions, 1, MAX_HORIZON)
        self.max_invalid_actions = max_invalid_actions
        self.system_prompt = SYSTEM_PROMPT.format(horizon=horizon)
        self.home: Home | None = None
        self.steps = 0

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if options:
            raise ConfigError(f"HouseholdEnv.reset takes no options (got {sorted(options)}); pass settings as kwargs to gym.make.")
        self.home = generate_home(self.np_random, self.rooms, self.distractors, self.goal_kinds)
        self.steps = 0
        goal = self.home.goal
        observation = f"{describe_room(self.home)}\n\nYour task is to: {goal.text}"
        info = {"goal": goal.text, "goal_kind": goal.kind, "admissible_commands": list(admissible(self.home)), "horizon": self.horizon}
        return observation, info

    def _step(self, action: str) -> StepResult:
        home = self.home
        assert home is not None
        text, command = read_command(home, action, admissible(home))
        self.steps += 1
        observation = apply(home, command)
        reached = update_progress(home)
        done = "done" in home.reached
        reward = self.step_penalty + self.subgoal_reward * sum(1 for s in reached if s != "done") + (1.0 if done else 0.0)
        truncated = not done and self.steps >= self.horizon
        if done:
            observation += "\n\nYou have completed the task."
        elif truncated:
            observation += f"\n\nYou have used all {self.horizon} commands; the task is not done."
        return observation, float(reward), done, truncated, {"command": text, **self._progress(done)}

    def _invalid_action(self, message: str) -> StepResult:
        """The base's feedback and penalty; the bad action also uses up one command of the horizon."""
        self.steps += 1
        observation, reward, terminated, truncated, info = super()._invalid_action(message)
        info.update(self._progress(False))
        if not terminated and self.steps >= self.horizon:
            truncated = True
            observation += f"\n\nYou have used all {self.horizon} commands; the task is not done."
        return observation, reward, terminated, truncated, info

    def _progress(self, done: bool) -> dict[str, Any]:
        home = self.home
        assert home is not None
        progress = len(home.reached) / len(home.goal.subgoals())
        return {"admissible_commands": list(admissible(home)), "steps": self.steps, "goal_progress": round(progress, 4), "is_success": done}

    def invalid_action_hint(self) -> str:
        """The admissible commands, so the feedback says what would have worked."""
        return commands_text(self.home) if self.home is not None else "Try again."


def _whole(name: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: choose a whole number from {low} to {high}.")
    return value


def _reward(name: str, value: Any, what: str, lower: float = float("-inf"), upper: float = float("inf")) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lower <= value <= upper or value != value:
        raise ConfigError(f"{name}={value!r}: use a number {what}.")
    if abs(value) > 100:
        raise ConfigError(f"{name}={value!r}: use a number {what}, no larger than 100 in size.")
    return float(value)


def _goal_kinds(value: Any) -> tuple[str, ...]:
    if value is None:
        return GOAL_KINDS
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n in GOAL_KINDS for n in names):
        raise ConfigError(f"goal_kinds={value!r}: pass a list (or a comma-separated string) of some of {', '.join(GOAL_KINDS)}; or None for all.")
    return tuple(dict.fromkeys(names))
