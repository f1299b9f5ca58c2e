"""The scripted agent of the TextArena envs."""

from __future__ import annotations

import random
import re
from typing import Any

_BRACKETED = re.compile(r"\[([^\[\]\n]{1,40})\]")
_NOT_MOVES = re.compile(r"^(GAME|Player \d+|Player|\w+ \d+)$")


class BracketMoveAgent:
    """Plays one of the bracketed tokens of the latest messages (``[4]``, ``[e2e4]``) at random, else ``[0]``.

    TextArena's games list the moves they accept in that form, so this is a random player that is mostly
    legal: the baseline to beat and the self-play league's ``random`` opponent.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        tail = observation[-3_000:]
        moves = [m for m in _BRACKETED.findall(tail) if not _NOT_MOVES.match(m.strip())]
        return f"[{self._rng.choice(moves)}]" if moves else f"[{self._rng.randrange(10)}]"
