"""Scripted agents that speak the text-env protocol: ``agent(observation, info) -> action``.

Env packages ship a baseline agent class built as ``Agent(seed=None)``; a fresh instance plays each
episode. :class:`RandomTextAgent` is the env-agnostic fallback (and the fuzzer's voice).
"""

from __future__ import annotations

import random
import string
from typing import Any, Protocol
from collections.abc import Callable


class Agent(Protocol):
    """Anything that maps an observation (and its info) to an action string."""

    def __call__(self, observation: str, info: dict[str, Any]) -> str: ...


AgentFactory = Callable[..., Agent]


class RandomTextAgent:
    """Answers with random printable text of up to ``max_length`` characters."""

    def __init__(self, seed: int | None = None, max_length: int = 32) -> None:
        self._rng = random.Random(seed)
        self._max_length = max_length

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        length = self._rng.randint(0, self._max_length)
        return "".join(self._rng.choice(string.printable) for _ in range(length))
