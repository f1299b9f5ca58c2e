"""The scripted baseline of the reasoning-gym envs."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class TaggedGuessAgent:
    """Answers in the asked form with a guess: the question's last number (else ``yes``), inside ``<answer>`` tags.

    Not a solver: the bar of a reply that is well formed and almost always wrong.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def __call__(self, observation: str, info: dict[str, Any]) -> str:
        numbers = _NUMBER.findall(observation)
        tag = info.get("answer_tag") or "answer"
        return f"<{tag}>{numbers[-1] if numbers else 'yes'}</{tag}>"
