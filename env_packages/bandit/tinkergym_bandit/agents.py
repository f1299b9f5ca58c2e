"""The scripted baseline for ``tinker/Bandit-v0``."""

from __future__ import annotations

import random
import re
from typing import Any

_ARM_LINE = re.compile(r"^- the (\w+) arm$", re.MULTILINE)


class RandomArmAgent:
    """Pulls an arm chosen uniformly at random from those the observation lists: the bar a learner must beat."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        arms = _ARM_LINE.findall(observation)
        return self._rng.choice(arms) if arms else "red"
