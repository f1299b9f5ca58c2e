"""Procedural homes: rooms, doors, receptacles, objects and a goal, all drawn from one seeded generator.

:func:`generate_home` draws, in order:

1. the goal kind (uniform over the allowed kinds);
2. the rooms: one room type that can host the goal (a kitchen for heating and cooling, a kitchen or a
   bathroom for cleaning, a room with a desklamp for examining in light, any room otherwise), and
   ``rooms - 1`` other distinct types, in a random order;
3. each room's receptacles: the type's fixed ones and each optional one with probability 1/2, numbered
   per type across the home (``cabinet 1`` ... ``cabinet 4``); openable ones start closed;
4. the doors: a random tree (each room joins a room drawn before it), each door open with probability 1/2;
5. a desklamp on a desk, sidetable or dresser of every living room, bedroom and office;
6. the goal's object type and target receptacle type, uniform over the pairs the home allows (the object
   can be kept in the target, and in some other receptacle type to start from; the target is not the
   goal's tool);
7. the goal's objects (1, or 2 for "pick two", plus one more with probability 1/2), each in a receptacle
   that accepts it and is not of the target type, so no goal holds at the start;
8. ``distractors`` objects of other types, each in a receptacle that accepts it;
9. object numbers per type in a random order, and the agent's starting room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from tinkergym_household.catalog import (
    ANCHOR_ROOMS,
    CLEAN_AND_PLACE,
    COOL_AND_PLACE,
    GOAL_ABILITY,
    HEAT_AND_PLACE,
    ITEMS,
    LAMP,
    LAMP_HOSTS,
    LAMP_ROOMS,
    LOOK_IN_LIGHT,
    PICK_AND_PLACE,
    PICK_TWO,
    PLURALS,
    RECEPTACLES,
    ROOMS,
    TRANSFORMS,
    accepts,
    can,
)
from tinkergym_household.world import Goal, Home, Item, Receptacle, Room

T = TypeVar("T")

#: Goal kind -> (steps per door on a path, fixed steps): the longest plan the planner needs is
#: ``per_door * (rooms - 1) + fixed`` (see :func:`longest_plan`).
_PLAN_BOUNDS = {
    PICK_AND_PLACE: (3, 6),
    LOOK_IN_LIGHT: (3, 5),
    CLEAN_AND_PLACE: (4, 8),
    HEAT_AND_PLACE: (4, 8),
    COOL_AND_PLACE: (4, 8),
    PICK_TWO: (5, 11),
}


def longest_plan(rooms: int, goal_kinds: Sequence[str]) -> int:
    """The most commands the planner needs for any home of ``rooms`` rooms and a goal of ``goal_kinds``.

    A path between two rooms crosses at most ``rooms - 1`` doors, and the planner opens each door at
    most once. Putting an object somewhere walks two legs (to the object, to the target), a transform
    three (object, tool, target), "pick two" four; each leg ends with ``go to`` and maybe ``open``,
    then ``take``, ``put``, ``use`` or the transform. So pick and place needs at most
    ``2 (rooms - 1)`` room moves, ``rooms - 1`` door openings and 6 other commands, and so on.
    """
    return max(per_door * (rooms - 1) + fixed for per_door, fixed in (_PLAN_BOUNDS[k] for k in goal_kinds))


def pick(rng: Any, options: Sequence[T]) -> T:
    """One of ``options``, uniformly (``rng`` is a ``numpy.random.Generator``)."""
    return options[int(rng.integers(len(options)))]


def shuffled(rng: Any, options: Sequence[T]) -> list[T]:
    """``options`` in a random order."""
    return [options[int(i)] for i in rng.permutation(len(options))]


def generate_home(rng: Any, rooms: int, distractors: int, goal_kinds: Sequence[str]) -> Home:
    """A new home with a goal of one of ``goal_kinds`` (see the module docstring for the draws)."""
    for _ in range(100):
        home = _try_home(rng, pick(rng, goal_kinds), rooms, distractors)
        if home is not None:
            return home
    raise RuntimeError(f"no home with rooms={rooms} allows a goal of {list(goal_kinds)}")  # not with the shipped catalog


def _try_home(rng: Any, kind: str, rooms: int, distractors: int) -> Home | None:
    anchor = pick(rng, ANCHOR_ROOMS[kind])
    others = shuffled(rng, [name for name in ROOMS if name != anchor])
    names = shuffled(rng, [anchor, *others[: rooms - 1]])
    home = Home(rooms={}, receptacles={}, items={}, goal=Goal(kind, "", None, ""), room=pick(rng, names))
    numbers: dict[str, int] = {}
    for name in names:
        _furnish(rng, home, name, numbers)
    for i, name in enumerate(names[1:], start=1):
        other, is_open = pick(rng, names[:i]), bool(rng.random() < 0.5)
        home.rooms[name].doors[other] = is_open
        home.rooms[other].doors[name] = is_open
    placed: list[tuple[str, str]] = []  # (object type, receptacle) before objects are numbered
    for name in names:
        if name in LAMP_ROOMS:
            hosts = [r for r in home.rooms[name].receptacles if home.receptacles[r].kind in LAMP_HOSTS]
            placed.append((LAMP, pick(rng, hosts)))
    choice = _choose_goal(rng, home, kind)
    if choice is None:
        return None
    item, target, sources = choice
    for _ in range((2 if kind == PICK_TWO else 1) + int(rng.integers(2))):
        placed.append((item, pick(rng, sources)))
    kinds = [k for k in ITEMS if k != item and any(accepts(r.kind, k) for r in home.receptacles.values())]
    for _ in range(distractors):
        kind_ = pick(rng, kinds)
        placed.append((kind_, pick(rng, [r.name for r in home.receptacles.values() if accepts(r.kind, kind_)])))
    _number_items(rng, home, placed)
    home.goal = Goal(kind, item, target, goal_text(home, kind, item, target))
    return home


def _furnish(rng: Any, home: Home, name: str, numbers: dict[str, int]) -> None:
    """Add room ``name`` and its receptacles to ``home``."""
    fixed, optional = ROOMS[name]
    kinds = [*fixed, *(k for k in optional if rng.random() < 0.5)]
    room = home.rooms[name] = Room(name)
    for kind in kinds:
        numbers[kind] = numbers.get(kind, 0) + 1
        openable = RECEPTACLES[kind][0]
        receptacle = Receptacle(f"{kind} {numbers[kind]}", kind, name, openable, is_open=not openable)
        home.receptacles[receptacle.name] = receptacle
        room.receptacles.append(receptacle.name)
    room.receptacles.sort(key=lambda r: (r.split()[0], int(r.split()[1])))


def _choose_goal(rng: Any, home: Home, kind: str) -> tuple[str, str | None, list[str]] | None:
    """``(object type, target receptacle type, receptacles its objects may start in)``; ``None`` if none fits."""
    present = sorted({r.kind for r in home.receptacles.values()})
    tool = TRANSFORMS[kind][2] if kind in TRANSFORMS else None
    options: list[tuple[str, str | None, list[str]]] = []
    for item in ITEMS:
        if kind in GOAL_ABILITY and not can(item, GOAL_ABILITY[kind]):
            continue
        holders = [r.name for r in home.receptacles.values() if accepts(r.kind, item)]
        if kind == LOOK_IN_LIGHT:
            if holders:
                options.append((item, None, holders))
            continue
        for target in present:
            sources = [r for r in holders if home.receptacles[r].kind != target]
            if target != tool and accepts(target, item) and sources:
                options.append((item, target, sources))
    return pick(rng, options) if options else None


def _number_items(rng: Any, home: Home, placed: list[tuple[str, str]]) -> None:
    """Name the objects (numbers per type, in a random order) and put each in its receptacle."""
    numbers: dict[str, int] = {}
    for kind, place in shuffled(rng, placed):
        numbers[kind] = numbers.get(kind, 0) + 1
        item = Item(f"{kind} {numbers[kind]}", kind, place)
        home.items[item.name] = item
        home.receptacles[place].contents.append(item.name)


def goal_text(home: Home, kind: str, item: str, target: str | None) -> str:
    """The task as the agent reads it, e.g. ``"put a clean mug in the coffeemachine."``."""
    def determiner(kind_: str, count: int) -> str:
        return "the" if count == 1 else "an" if kind_[0] in "aeiou" else "a"

    lamps = sum(1 for i in home.items.values() if i.kind == LAMP)
    if kind == LOOK_IN_LIGHT:
        items = sum(1 for i in home.items.values() if i.kind == item)
        return f"examine {determiner(item, items)} {item} with {determiner(LAMP, lamps)} {LAMP}."
    assert target is not None
    targets = sum(1 for r in home.receptacles.values() if r.kind == target)
    where = f"{RECEPTACLES[target][2]} {determiner(target, targets)} {target}"
    if kind == PICK_TWO:
        return f"put two {PLURALS[item]} {where}."
    adjective = f"{TRANSFORMS[kind][0]} " if kind in TRANSFORMS else ""
    return f"put {'an' if (adjective or item)[0] in 'aeiou' else 'a'} {adjective}{item} {where}."
