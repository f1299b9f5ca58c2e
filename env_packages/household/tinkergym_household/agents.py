"""Agents for ``tinker/Household-v0``: :class:`PlannerAgent` (the baseline) and :class:`RandomCommandAgent`.

Both play from what an agent is shown: the observation text and ``info["admissible_commands"]``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from tinkergym_household.catalog import (
    CLEAN_AND_PLACE,
    COOL_AND_PLACE,
    HEAT_AND_PLACE,
    ITEMS,
    LAMP,
    LOOK_IN_LIGHT,
    PICK_AND_PLACE,
    PICK_TWO,
    PLURALS,
    RECEPTACLES,
)
from tinkergym_household.planner import plan
from tinkergym_household.world import Goal, Home, Item, Receptacle, Room, admissible, apply

_ROOM = re.compile(
    r"You are in the ([a-z ]+?)(?:, at the ([a-z]+ \d+))?\. Looking quickly around you, you see ([^.]*)\."
    r"(?: (?:A door leads|Doors lead) to ([^.]*)\.)?"
)
_RECEPTACLE = re.compile(r"\ban? ([a-z]+) (\d+)(?: \((open|closed)\))?")
_DOOR = re.compile(r"the ([a-z ]+?) \((open|closed)\)")
_CONTENTS = re.compile(r"(?:On|In) the ([a-z]+ \d+), you see ([^.]*)\.")
_CLOSED = re.compile(r"The ([a-z]+ \d+) is closed\.")
_ITEM = re.compile(r"\ban? ([a-z]+) (\d+)")
_TASK = re.compile(r"Your task is to: (.+?)\s*$", re.MULTILINE)
_PUT_GOAL = re.compile(r"^put (?:a|an|two) (?:(clean|hot|cool) )?(.+?) (?:in|on) (?:the|a|an) ([a-z]+)\.$")
_LIGHT_GOAL = re.compile(r"^examine (?:the|a|an) ([a-z]+) with (?:the|a|an) desklamp\.$")
_STATE_KINDS = {"clean": CLEAN_AND_PLACE, "hot": HEAT_AND_PLACE, "cool": COOL_AND_PLACE}
_SINGULAR = {plural: name for name, plural in PLURALS.items()}


class PlannerAgent:
    """The scripted planner playing from text: it searches the home like a person who has never seen it.

    It builds a belief (a :class:`~tinkergym_household.world.Home` with unknown contents) from the first
    observation (room, doors, task), applies its own commands to the belief, and reads what each
    observation reveals (a room's receptacles and doors, a receptacle's contents); then it asks
    :func:`~tinkergym_household.planner.plan` for the next command, which searches the nearest places
    that may hold what it still needs. A command its belief allows but ``info["admissible_commands"]``
    does not (a belief out of step) becomes ``look``. With the default difficulty it solves nearly every
    task within the horizon (see the package README); :func:`~tinkergym_household.planner.next_command`,
    which sees the whole home, solves every one.

    Args:
        seed: Unused (the agent is deterministic); accepted as every baseline's factory is ``Agent(seed=...)``.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.belief: Home | None = None
        self._last: str | None = None

    def __call__(self, observation: str, info: dict[str, Any] | None = None) -> str:
        """The next command."""
        if not isinstance(observation, str):
            return "look"
        if _TASK.search(observation):
            self.belief = belief_from_start(observation)
        elif self.belief is not None:
            self._follow(observation)
        if self.belief is None:
            return "help"
        command = plan(self.belief)
        allowed = (info or {}).get("admissible_commands")
        if isinstance(allowed, list) and command not in allowed:
            command = "look"
        self._last = command
        return command

    def _follow(self, observation: str) -> None:
        """Apply the last command to the belief if the env carried it out, then read what it revealed."""
        belief, last = self.belief, self._last
        assert belief is not None
        if last is None or observation.startswith(("Invalid action", "The episode is over")):
            return
        command = admissible(belief).get(last)
        if command is not None:
            apply(belief, command)
        read_observation(belief, observation)


def belief_from_start(observation: str) -> Home | None:
    """A belief from the first observation (its room and task); ``None`` when it cannot be read."""
    task, room = _TASK.search(observation), _ROOM.search(observation)
    goal = parse_goal(task.group(1)) if task else None
    if goal is None or room is None:
        return None
    belief = Home(rooms={}, receptacles={}, items={}, goal=goal, room=room.group(1))
    read_observation(belief, observation)
    return belief


def parse_goal(text: str) -> Goal | None:
    """The :class:`Goal` a task text states (the target type only, as the text names no number)."""
    light = _LIGHT_GOAL.match(text)
    if light and light.group(1) in ITEMS:
        return Goal(LOOK_IN_LIGHT, light.group(1), None, text)
    put = _PUT_GOAL.match(text)
    if put is None or put.group(3) not in RECEPTACLES:
        return None
    state, noun, target = put.groups()
    two = text.startswith("put two ")
    item = _SINGULAR.get(noun) if two else noun
    if item not in ITEMS:
        return None
    kind = PICK_TWO if two else _STATE_KINDS[state] if state else PICK_AND_PLACE
    return Goal(kind, item, target, text)


def read_observation(belief: Home, observation: str) -> None:
    """Update ``belief`` with the rooms, doors and contents ``observation`` describes."""
    for match in _ROOM.finditer(observation):
        _read_room(belief, match)
    for name in _CLOSED.findall(observation):
        if name in belief.receptacles:
            belief.receptacles[name].is_open = False
    for name, things in _CONTENTS.findall(observation):
        if name in belief.receptacles:
            _read_contents(belief, belief.receptacles[name], things)


def _read_room(belief: Home, match: re.Match) -> None:
    name, at, seen, doors = match.groups()
    room = belief.rooms.setdefault(name, Room(name, explored=False))
    room.explored = True
    belief.room, belief.at = name, at
    room.receptacles = []
    for kind, number, state in _RECEPTACLE.findall(seen):
        if kind not in RECEPTACLES:
            continue
        receptacle_name = f"{kind} {number}"
        openable = RECEPTACLES[kind][0]
        receptacle = belief.receptacles.get(receptacle_name)
        if receptacle is None:
            receptacle = Receptacle(receptacle_name, kind, name, openable, is_open=not openable, known=False)
            belief.receptacles[receptacle_name] = receptacle
        if state:
            receptacle.is_open = state == "open"
        room.receptacles.append(receptacle_name)
    room.doors = {other: state == "open" for other, state in _DOOR.findall(doors or "")}
    for other, is_open in room.doors.items():
        belief.rooms.setdefault(other, Room(other, explored=False)).doors[name] = is_open


def _read_contents(belief: Home, receptacle: Receptacle, things: str) -> None:
    receptacle.is_open, receptacle.known = True, True
    names = [f"{kind} {number}" for kind, number in _ITEM.findall(things) if kind in ITEMS or kind == LAMP]
    for gone in [n for n in receptacle.contents if n not in names]:
        belief.items.pop(gone, None)
    for name in names:
        item = belief.items.get(name)
        if item is None:
            item = belief.items[name] = Item(name, name.split()[0], receptacle.name)
        elif item.place is not None and item.place != receptacle.name and item.name in belief.receptacles[item.place].contents:
            belief.receptacles[item.place].contents.remove(item.name)
        item.place = receptacle.name
    receptacle.contents = names


class RandomCommandAgent:
    """Plays a uniformly random admissible command (``info["admissible_commands"]``): legal, aimless.

    Args:
        seed: Seeds the choice (``None``: random).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, observation: str, info: dict[str, Any] | None = None) -> str:
        """A random admissible command; ``"look"`` when the info lists none."""
        commands = (info or {}).get("admissible_commands")
        if not isinstance(commands, list) or not commands:
            return "look"
        return self._rng.choice(commands)


__all__ = ["PlannerAgent", "RandomCommandAgent", "belief_from_start", "parse_goal", "read_observation"]
