"""Reading an action's text as a command, and saying why a command that is not admissible is not.

The reader is forgiving about form, not about content: case, surrounding quotes, a leading ``>`` or
``Action:``, a final full stop, the word ``the`` and the preposition of ``put`` (``in``, ``on``,
``in/on``, ``into``, ``onto``) do not matter, and when the whole text is not a command its last line,
then its first line, is tried (a model may think aloud before it answers). What is read must then be
one of the admissible commands, exactly.
"""

from __future__ import annotations

import re

from tinkergym.errors import InvalidAction
from tinkergym.spaces import describe_text
from tinkergym_household.world import VERBS, Command, Home

_PREFIX = re.compile(r"^(?:>\s*|(?:action|command|answer)\s*:\s*)+")
_PUT = re.compile(r"^put (.+?) (?:in/on|into|onto|inside|in|on) (.+)$")
_THE = re.compile(r"\bthe\b")
_SPACES = re.compile(r"\s+")
_NAME = re.compile(r"\b[a-z]+ \d+\b")
_TOOLS = {"clean": "sinkbasin", "heat": "microwave", "cool": "fridge"}
_ALIASES = {"i": "inventory", "inv": "inventory", "commands": "help", "admissible commands": "help", "look around": "look"}


def normalize(text: str) -> str:
    """The comparable form of a command: lower case, no ``the``, one space, ``put X in Y``."""
    text = text.strip().lower().strip("`'\"*")
    text = _PREFIX.sub("", text).strip().strip("`'\"*").rstrip(".!").strip()
    text = _SPACES.sub(" ", _THE.sub(" ", text)).strip()
    text = _PUT.sub(r"put \1 in \2", text)
    return _ALIASES.get(text, text)


def read_command(home: Home, action: str, commands: dict[str, Command]) -> tuple[str, Command]:
    """The admissible command ``action`` names, as ``(canonical text, command)``; else :class:`InvalidAction`."""
    lookup = {normalize(text): text for text in commands}
    lines = [line for line in action.splitlines() if line.strip()]
    for candidate in (action, *lines[-1:], *lines[:1]):
        text = lookup.get(normalize(candidate))
        if text is not None:
            return text, commands[text]
    raise InvalidAction(explain(home, action, lines[-1] if lines else ""))


def explain(home: Home, action: str, line: str) -> str:
    """Why ``action`` is not an admissible command (the environment appends the admissible ones)."""
    shown = describe_text(action)
    if not line.strip():
        return "the action is empty; answer with one command"
    key = normalize(line)
    verb = next((v for v in VERBS if key == v or key.startswith(v + " ")), None)
    if verb is None:
        return f"{shown} is not a command; a command starts with one of: {', '.join(VERBS)}"
    reason = _reason(home, verb, key)
    return f"{shown} is not possible now" + (f": {reason}" if reason else "")


def _reason(home: Home, verb: str, key: str) -> str:
    """A short reason for the common mistakes; empty when none applies."""
    held = home.holding
    names = _NAME.findall(key)
    if verb == "take" and held:
        return f"you are already carrying the {held}; put it somewhere first (you carry one object at a time)"
    if verb in ("put", "clean", "heat", "cool"):
        if not held:
            return "you are not carrying anything"
        if names and names[0] != held:
            return f"you are carrying the {held}, not the {names[0]}"
    if verb == "go to" or key.startswith(("open door to ", "close door to ")):
        return _move_reason(home, key)
    room = home.rooms[home.room]
    receptacle = next((n for n in names if n in home.receptacles and home.receptacles[n].room == room.name), None)
    if receptacle is None:
        return f"there is no {names[-1]} in view" if names else ""
    if home.at != receptacle:
        return f"you are not at the {receptacle}; go to it first"
    found = home.receptacles[receptacle]
    if verb in ("open", "close") and not found.openable:
        return f"the {receptacle} does not open or close"
    if verb in ("open", "close"):
        return f"the {receptacle} is already {'open' if found.is_open else 'closed'}"
    if verb in ("take", "put") and not found.is_open:
        return f"the {receptacle} is closed; open it first"
    if verb == "take" and names[0] not in found.contents:
        return f"there is no {names[0]} {found.preposition} the {receptacle}"
    if verb in _TOOLS and found.kind != _TOOLS[verb]:
        return f"you {verb} things with a {_TOOLS[verb]}, not a {found.kind}"
    if verb in _TOOLS:
        return f"the {held} cannot be {verb}ed"
    return ""


def _move_reason(home: Home, key: str) -> str:
    """Why a ``go to``, ``open door to`` or ``close door to`` command cannot be carried out."""
    target = key.split(" to ", 1)[1] if " to " in key else ""
    doors = home.rooms[home.room].doors
    if key.startswith(("open door", "close door")):
        if target not in doors:
            return f"no door leads from the {home.room} to {target or 'there'}"
        return f"the door to the {target} is already {'open' if doors[target] else 'closed'}"
    if target == home.room:
        return f"you are already in the {home.room}"
    if target in doors:
        return f"the door to the {target} is closed; open it first"
    if target == home.at:
        return f"you are already at the {target}"
    if target in home.rooms:
        return f"no door leads from the {home.room} to the {target}"
    return f"there is no {target or 'such place'} in the {home.room}"
