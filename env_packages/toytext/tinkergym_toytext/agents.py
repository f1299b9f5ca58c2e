"""The scripted agent of the toy-text envs."""

from __future__ import annotations

import random
import re
from typing import Any

_ACTIONS = re.compile(r"^Actions: (.+)\.$", re.MULTILINE)


class RandomActionAgent:
    """Plays one of the actions the observation's last ``Actions: a, b, c.`` line lists, uniformly at random."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        listed = _ACTIONS.findall(observation)
        names = info.get("legal_actions") or (listed[-1].split(", ") if listed else ["wait"])
        return self._rng.choice(names)
