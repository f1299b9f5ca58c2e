"""The scripted planner: the next command toward the goal, from a home or from a belief about one.

:func:`next_command` takes an env (or its :class:`~tinkergym_household.world.Home`) and, knowing the
whole home, returns the next command of a shortest-path plan; it solves every generated task within
:func:`~tinkergym_household.generate.longest_plan` commands. :func:`plan` is the same planner over any
``Home``, including the partial one :class:`~tinkergym_household.agents.PlannerAgent` builds from what
it has read: there, receptacles with unknown contents and rooms not yet entered are searched, nearest
first, before the plan goes on.

The plan, each step re-decided from the current state:

1. carrying an object the goal does not want: put it down in the nearest receptacle;
2. not carrying a goal object: go to the nearest known one (not one already counted in the target),
   open its receptacle if closed, take it; none known: search;
3. carrying one: for clean/heat/cool, go to the nearest sinkbasin/microwave/fridge and transform it;
   for "examine in light", go to the nearest desklamp and switch it on; else go to the target
   receptacle (for "pick two", the one that already holds one), open it if closed, put the object in.

Moving to a receptacle in another room follows the shortest path over the doors (a closed door costs
one more command: ``open door to ROOM``). Distances count commands, so "nearest" is the cheapest.
"""

from __future__ import annotations

import heapq
from typing import Any

from tinkergym_household.catalog import LAMP, LAMP_HOSTS, LOOK_IN_LIGHT, PICK_TWO, TRANSFORMS, accepts
from tinkergym_household.world import Home, Receptacle, placed_count


def next_command(source: Any) -> str:
    """The planner's next command for an env (wrapped or not) or a :class:`Home` it is given whole."""
    home = source if isinstance(source, Home) else getattr(getattr(source, "unwrapped", source), "home", None)
    if not isinstance(home, Home):
        raise TypeError(f"next_command takes a HouseholdEnv after reset() or a Home, not {type(source).__name__}")
    return plan(home)


def plan(home: Home) -> str:
    """The next command toward ``home.goal`` (``"look"`` when nothing better is known)."""
    goal, held = home.goal, home.held()
    if held is not None and held.kind != goal.item:
        return _put_down(home)
    if held is None:
        skip = _destination(home) if goal.kind == PICK_TWO else None
        return _fetch(home, goal.item, skip)
    if goal.kind == LOOK_IN_LIGHT:
        return _light(home)
    if goal.state is not None and not getattr(held, goal.state):
        _, verb, tool_kind = TRANSFORMS[goal.kind]
        tool = _nearest(home, [r for r in home.receptacles.values() if r.kind == tool_kind])
        if tool is None:
            return _search(home)
        return _walk(home, tool, open_it=False) or f"{verb} {held.name} with {tool.name}"
    target = _destination(home)
    if target is None:
        return _search(home)
    return _walk(home, target, open_it=True) or f"put {held.name} {target.preposition} {target.name}"


def _light(home: Home) -> str:
    """Carrying the goal's object: go to the nearest known desklamp and switch it on."""
    hosts = [r for r in home.receptacles.values() if any(home.items[i].kind == LAMP for i in r.contents)]
    host = _nearest(home, hosts)
    if host is None:
        return _search(home, LAMP)
    step = _walk(home, host, open_it=True)
    if step:
        return step
    lamp = next(i for i in host.contents if home.items[i].kind == LAMP)
    return "look" if home.items[lamp].lit else f"use {lamp}"


def _fetch(home: Home, kind: str, skip: Receptacle | None) -> str:
    """Go to the nearest known object of ``kind`` (not in ``skip``) and take it; search when none is known."""
    options = []
    for item in home.items.values():
        if item.kind == kind and item.place is not None and (skip is None or item.place != skip.name):
            receptacle = home.receptacles[item.place]
            options.append((_cost(home, receptacle), receptacle.name, item.name))
    if not options:
        return _search(home, kind)
    _, place, name = min(options)
    receptacle = home.receptacles[place]
    return _walk(home, receptacle, open_it=True) or f"take {name} from {place}"


def _destination(home: Home) -> Receptacle | None:
    """The target receptacle: the one holding most goal objects already, then the nearest."""
    goal = home.goal
    options = [r for r in home.receptacles.values() if r.kind == goal.target]
    if not options:
        return None
    distances = _room_distances(home)
    return min(options, key=lambda r: (-placed_count(home, r), _cost(home, r, distances), r.name))


def _put_down(home: Home) -> str:
    """Put the carried object into the nearest receptacle of this room."""
    held = home.held()
    assert held is not None
    options = [home.receptacles[r] for r in home.rooms[home.room].receptacles]
    here = _nearest(home, options)
    if here is None:
        return "look"
    return _walk(home, here, open_it=True) or f"put {held.name} {here.preposition} {here.name}"


def _search(home: Home, kind: str | None = None) -> str:
    """Go toward the nearest place that may show what is missing: a receptacle with unknown contents
    that could hold an object of ``kind``, else a room not yet entered, else any unknown receptacle."""
    distances = _room_distances(home)
    options: list[tuple[int, int, str]] = []
    for receptacle in home.receptacles.values():
        if not receptacle.known and kind is not None:
            fits = receptacle.kind in LAMP_HOSTS if kind == LAMP else accepts(receptacle.kind, kind)
            options.append((_cost(home, receptacle, distances), 0 if fits else 2, receptacle.name))
    for room in home.rooms.values():
        if not room.explored and room.name in distances:
            options.append((distances[room.name], 1, room.name))
    preferred = [o for o in options if o[1] < 2] or options
    if not preferred:
        return "look"
    _, what, name = min(preferred)
    if what == 1:
        return _toward(home, name)
    return _walk(home, home.receptacles[name], open_it=True) or "look"


def _walk(home: Home, receptacle: Receptacle, open_it: bool) -> str | None:
    """The next command on the way to standing at ``receptacle`` (opened, with ``open_it``); ``None`` once there."""
    if receptacle.room != home.room:
        return _toward(home, receptacle.room)
    if home.at != receptacle.name:
        return f"go to {receptacle.name}"
    if open_it and receptacle.openable and not receptacle.is_open:
        return f"open {receptacle.name}"
    return None


def _toward(home: Home, room: str) -> str:
    """The next command on the shortest path to ``room``: open the next door, or go through it."""
    path = _room_path(home, room)
    if not path:
        return "look"
    door_open = home.rooms[home.room].doors[path[0]]
    return f"go to {path[0]}" if door_open else f"open door to {path[0]}"


def _nearest(home: Home, options: list[Receptacle]) -> Receptacle | None:
    distances = _room_distances(home)
    reachable = [r for r in options if r.room in distances]
    return min(reachable, key=lambda r: (_cost(home, r, distances), r.name)) if reachable else None


def _cost(home: Home, receptacle: Receptacle, distances: dict[str, int] | None = None) -> int:
    """Commands to stand at ``receptacle`` with it open."""
    distances = distances if distances is not None else _room_distances(home)
    cost = distances.get(receptacle.room, 10_000) + (0 if home.at == receptacle.name else 1)
    return cost + (1 if receptacle.openable and not receptacle.is_open else 0)


def _room_distances(home: Home) -> dict[str, int]:
    """Commands from the agent's room to every reachable room (a closed door costs 2, an open one 1)."""
    return _dijkstra(home)[0]


def _room_path(home: Home, room: str) -> list[str]:
    """The rooms to go through from the agent's room to ``room`` (``room`` last); empty when unreachable."""
    _, previous = _dijkstra(home)
    if room not in previous:
        return []
    path = [room]
    while previous[path[-1]] != home.room:
        path.append(previous[path[-1]])
    return path[::-1]


def _dijkstra(home: Home) -> tuple[dict[str, int], dict[str, str]]:
    distances, previous = {home.room: 0}, {}
    queue = [(0, home.room)]
    while queue:
        distance, name = heapq.heappop(queue)
        if distance > distances[name] or name not in home.rooms:
            continue
        for other, is_open in sorted(home.rooms[name].doors.items()):
            step = distance + (1 if is_open else 2)
            if step < distances.get(other, 10_000):
                distances[other], previous[other] = step, name
                heapq.heappush(queue, (step, other))
    return distances, previous
