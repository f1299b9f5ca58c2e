"""The state of a home and its rules: which commands are admissible, what each one does, and the text it reads as.

A :class:`Home` holds rooms (joined by doors), receptacles (numbered per type: ``cabinet 2``), objects
(``mug 1``), the agent (its room, the receptacle it stands at, what it carries) and the goal. The same
class serves as the planner's belief about a home it has only partly seen: a receptacle whose contents
are not known yet has ``known=False``, a room not entered yet ``explored=False``.

Commands are tuples ``(verb, *names)``; :func:`admissible` maps each admissible command's canonical text
to its tuple, and :func:`apply` carries one out and returns the text the agent reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinkergym_household.catalog import (
    CLEAN_AND_PLACE,
    COOL_AND_PLACE,
    HEAT_AND_PLACE,
    LAMP,
    LOOK_IN_LIGHT,
    PICK_TWO,
    RECEPTACLES,
    TRANSFORMS,
    can,
)

Command = tuple[str, ...]

#: The verbs an action may start with (``open`` and ``close`` also take ``door to ROOM``).
VERBS = ("go to", "open", "close", "take", "put", "clean", "heat", "cool", "use", "examine", "look", "inventory", "help")
#: Transform verb -> (the object state it sets, the state it clears, the receptacle type it needs, its ability letter).
_TRANSFORM_VERBS = {"clean": ("clean", None, "sinkbasin", "c"), "heat": ("hot", "cool", "microwave", "h"), "cool": ("cool", "hot", "fridge", "k")}


@dataclass
class Item:
    """An object: ``mug 1`` of kind ``mug``, in (or on) receptacle ``place`` (``None``: carried by the agent)."""

    name: str
    kind: str
    place: str | None
    clean: bool = False
    hot: bool = False
    cool: bool = False
    lit: bool = False  # lamps only


@dataclass
class Receptacle:
    """A fixed place objects go in or on: ``fridge 1`` of kind ``fridge`` in the kitchen."""

    name: str
    kind: str
    room: str
    openable: bool
    is_open: bool
    contents: list[str] = field(default_factory=list)
    known: bool = True  # False in a belief until its contents have been seen

    @property
    def preposition(self) -> str:
        """``"in"`` or ``"on"``."""
        return RECEPTACLES[self.kind][2]


@dataclass
class Room:
    """A room: its receptacles and its doors (neighbouring room -> whether the door is open)."""

    name: str
    receptacles: list[str] = field(default_factory=list)
    doors: dict[str, bool] = field(default_factory=dict)
    explored: bool = True  # False in a belief until the agent has been inside


@dataclass(frozen=True)
class Goal:
    """What the agent must do: one of the six kinds, for objects of type ``item`` (and receptacles of type ``target``)."""

    kind: str
    item: str
    target: str | None
    text: str

    @property
    def state(self) -> str | None:
        """The object state the goal asks for (``"clean"``, ``"hot"``, ``"cool"``) or ``None``."""
        return TRANSFORMS[self.kind][0] if self.kind in TRANSFORMS else None

    @property
    def count(self) -> int:
        """How many objects must end in one target receptacle."""
        return 2 if self.kind == PICK_TWO else 1

    def subgoals(self) -> tuple[str, ...]:
        """The steps toward the goal, in order; the last, ``"done"``, is the goal itself."""
        middle = {CLEAN_AND_PLACE: ("cleaned",), HEAT_AND_PLACE: ("heated",), COOL_AND_PLACE: ("cooled",), PICK_TWO: ("placed one",)}
        return ("picked up", *middle.get(self.kind, ()), "done")


@dataclass
class Home:
    """A whole home, the agent in it and its goal."""

    rooms: dict[str, Room]
    receptacles: dict[str, Receptacle]
    items: dict[str, Item]
    goal: Goal
    room: str
    at: str | None = None
    holding: str | None = None
    reached: list[str] = field(default_factory=list)  # subgoals reached so far, in order

    def held(self) -> Item | None:
        """The carried object, if any."""
        return self.items[self.holding] if self.holding else None


# ----- text -----------------------------------------------------------------------------------------
def article(name: str) -> str:
    """``"an apple 1"`` / ``"a mug 1"``."""
    return ("an " if name[0] in "aeiou" else "a ") + name


def listing(names: list[str]) -> str:
    """``"a mug 1, an apple 2, and a cd 1"``; ``"nothing"`` for none."""
    if not names:
        return "nothing"
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        return f"{names[0]} and {names[1]}"
    return ", ".join(names[:-1]) + f", and {names[-1]}"


def contents_text(home: Home, name: str) -> str:
    """``"On the countertop 1, you see a mug 1."``, or ``"The fridge 1 is closed."``."""
    receptacle = home.receptacles[name]
    if not receptacle.is_open:
        return f"The {name} is closed."
    things = listing([article(i) for i in receptacle.contents])
    return f"{receptacle.preposition.capitalize()} the {name}, you see {things}."


def describe_room(home: Home) -> str:
    """Where the agent is, the receptacles of its room (closed or open where they open) and its doors."""
    room = home.rooms[home.room]
    seen = []
    for name in room.receptacles:
        receptacle = home.receptacles[name]
        state = (" (open)" if receptacle.is_open else " (closed)") if receptacle.openable else ""
        seen.append(article(name) + state)
    where = f", at the {home.at}" if home.at else ""
    text = f"You are in the {room.name}{where}. Looking quickly around you, you see {listing(seen)}."
    doors = [f"the {other} ({'open' if is_open else 'closed'})" for other, is_open in sorted(room.doors.items())]
    if len(doors) == 1:
        text += f" A door leads to {doors[0]}."
    elif doors:
        text += f" Doors lead to {listing(doors)}."
    return text


def describe_item(item: Item) -> str:
    """What ``examine`` says about an object."""
    if item.kind == LAMP:
        return f"You examine the {item.name}. It is switched {'on' if item.lit else 'off'}."
    states = [s for s in ("clean", "hot", "cool") if getattr(item, s)]
    if not states:
        return f"You examine the {item.name}. There is nothing special about it."
    return f"You examine the {item.name}. It is {' and '.join(states)}."


def inventory_text(home: Home) -> str:
    """What ``inventory`` says."""
    return f"You are carrying {article(home.holding)}." if home.holding else "You are not carrying anything."


def commands_text(home: Home) -> str:
    """The admissible commands as one line (what ``help`` says, and the hint after a bad action)."""
    return "Admissible commands: " + ", ".join(admissible(home)) + "."


# ----- rules ----------------------------------------------------------------------------------------
def admissible(home: Home) -> dict[str, Command]:
    """Every command possible now: canonical text -> command tuple, in a stable order."""
    room = home.rooms[home.room]
    out: dict[str, Command] = {}
    for other, is_open in sorted(room.doors.items()):
        if is_open:
            out[f"go to {other}"] = ("go to room", other)
    for name in room.receptacles:
        if name != home.at:
            out[f"go to {name}"] = ("go to", name)
    for other, is_open in sorted(room.doors.items()):
        verb = "close" if is_open else "open"
        out[f"{verb} door to {other}"] = (f"{verb} door", other)
    here = home.receptacles.get(home.at) if home.at else None
    held = home.held()
    if here is not None:
        _add_receptacle_commands(out, home, here, held)
    if held is not None:
        out[f"examine {held.name}"] = ("examine item", held.name)
    if here is not None:
        out[f"examine {here.name}"] = ("examine receptacle", here.name)
    out["look"] = ("look",)
    out["inventory"] = ("inventory",)
    out["help"] = ("help",)
    return out


def _add_receptacle_commands(out: dict[str, Command], home: Home, here: Receptacle, held: Item | None) -> None:
    """The commands about the receptacle the agent stands at and what is in it."""
    if here.openable:
        verb = "close" if here.is_open else "open"
        out[f"{verb} {here.name}"] = (verb, here.name)
    if here.is_open:
        for name in here.contents:
            kind = home.items[name].kind
            if kind == LAMP:
                out[f"use {name}"] = ("use", name)
            elif held is None:
                out[f"take {name} from {here.name}"] = ("take", name, here.name)
        if held is not None:
            out[f"put {held.name} {here.preposition} {here.name}"] = ("put", held.name, here.name)
    if held is not None:
        for verb, (_, _, tool, ability) in _TRANSFORM_VERBS.items():
            if here.kind == tool and can(held.kind, ability):
                out[f"{verb} {held.name} with {here.name}"] = (verb, held.name, here.name)
    if here.is_open:
        for name in here.contents:
            out[f"examine {name}"] = ("examine item", name)


def apply(home: Home, command: Command) -> str:
    """Carry out an admissible ``command`` and return what the agent reads."""
    verb = command[0]
    if verb == "go to room":
        home.room, home.at = command[1], None
        return f"You walk through the door into the {command[1]}. {describe_room(home)}"
    if verb == "go to":
        home.at = command[1]
        return f"You arrive at the {command[1]}. {contents_text(home, command[1])}"
    if verb in ("open door", "close door"):
        is_open = verb == "open door"
        home.rooms[home.room].doors[command[1]] = is_open
        if command[1] in home.rooms:
            home.rooms[command[1]].doors[home.room] = is_open
        return f"You {verb.split()[0]} the door to the {command[1]}."
    if verb in ("open", "close"):
        home.receptacles[command[1]].is_open = verb == "open"
        if verb == "close":
            return f"You close the {command[1]}."
        return f"You open the {command[1]}. {contents_text(home, command[1])}"
    if verb == "take":
        item, source = home.items[command[1]], home.receptacles[command[2]]
        source.contents.remove(item.name)
        item.place, home.holding = None, item.name
        return f"You pick up the {item.name} from the {source.name}."
    if verb == "put":
        item, target = home.items[command[1]], home.receptacles[command[2]]
        target.contents.append(item.name)
        item.place, home.holding = target.name, None
        return f"You put the {item.name} {target.preposition} the {target.name}."
    if verb in _TRANSFORM_VERBS:
        sets, clears, _, _ = _TRANSFORM_VERBS[verb]
        item = home.items[command[1]]
        setattr(item, sets, True)
        if clears:
            setattr(item, clears, False)
        return f"You {verb} the {item.name} using the {command[2]}."
    return _apply_observation(home, command)


def _apply_observation(home: Home, command: Command) -> str:
    """The commands that change nothing but a lamp: use, examine, look, inventory, help."""
    verb = command[0]
    if verb == "use":
        lamp = home.items[command[1]]
        lamp.lit = not lamp.lit
        return f"You turn {'on' if lamp.lit else 'off'} the {lamp.name}."
    if verb == "examine item":
        return describe_item(home.items[command[1]])
    if verb == "examine receptacle":
        return contents_text(home, command[1])
    if verb == "look":
        return describe_room(home)
    if verb == "inventory":
        return inventory_text(home)
    return commands_text(home)


# ----- the goal -------------------------------------------------------------------------------------
def goal_done(home: Home) -> bool:
    """Whether the goal holds now."""
    goal = home.goal
    if goal.kind == LOOK_IN_LIGHT:
        held = home.held()
        if held is None or held.kind != goal.item or home.at is None:
            return False
        return any(home.items[name].kind == LAMP and home.items[name].lit for name in home.receptacles[home.at].contents)
    return any(placed_count(home, receptacle) >= goal.count for receptacle in home.receptacles.values() if receptacle.kind == goal.target)


def placed_count(home: Home, receptacle: Receptacle) -> int:
    """Objects in ``receptacle`` that count toward the goal (its type and, where asked, state)."""
    goal, state = home.goal, home.goal.state
    return sum(1 for name in receptacle.contents if home.items[name].kind == goal.item and (state is None or getattr(home.items[name], state)))


def subgoal_holds(home: Home, subgoal: str) -> bool:
    """Whether one of :meth:`Goal.subgoals` holds now."""
    goal = home.goal
    if subgoal == "picked up":
        held = home.held()
        return held is not None and held.kind == goal.item
    if subgoal in ("cleaned", "heated", "cooled"):
        return any(item.kind == goal.item and getattr(item, goal.state) for item in home.items.values())
    if subgoal == "placed one":
        return any(placed_count(home, r) >= 1 for r in home.receptacles.values() if r.kind == goal.target)
    return goal_done(home)


def update_progress(home: Home) -> list[str]:
    """Record the subgoals that hold for the first time now, and return them."""
    new = [s for s in home.goal.subgoals() if s not in home.reached and subgoal_holds(home, s)]
    home.reached.extend(new)
    return new
