r"""Baseline agents: plumbing baselines that solve every episode, not models.

:class:`BaselineGeometryAgent` solves from the generator's state that ``info`` carries on reset (the
figure's ``kind`` and ``given`` values, exactly what the figure and ``figure_description`` show) and
answers ``\boxed{...}``; :class:`BaselineGeometryToolAgent` does it through the ``calculator`` tool.
:class:`BaselineColourAgent` reads the pixels: the square's mean colour, matched to the nearer of the
two colours asked about. A text model gets what these agents read as ``info["figure_description"]``.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any

import numpy as np

from tinkergym_geometry.env import COLOURS
from tinkergym_geometry.figures import solve

_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def answer_text(exact: Fraction | None, value: float) -> str:
    """An answer as the env asks for it: exact (``45/2``) or rounded to two decimals."""
    if exact is not None:
        return str(exact.numerator) if exact.denominator == 1 else f"{exact.numerator}/{exact.denominator}"
    return f"{value:.2f}"


def expression(kind: str, given: dict[str, Any]) -> str:
    """A calculator expression whose value is the answer."""
    if kind == "triangle_angle":
        return f"180 - {given['angle_A']} - {given['angle_B']}"
    if kind == "right_triangle":
        return f"sqrt({given['leg_a']}^2 + {given['leg_b']}^2)"
    if kind == "triangle_area":
        return f"{given['base']} * {given['height']} / 2"
    if kind == "circle":
        return f"pi * {given['radius']}^2" if given["asked"] == "area" else f"2 * pi * {given['radius']}"
    exact, _ = solve(kind, given)
    return str(exact)


class BaselineGeometryAgent:
    r"""``tinker/Geometry-v0`` baseline: computes the answer from ``info["kind"]`` and ``info["given"]``.

    Args:
        seed: Unused (the agent is deterministic); accepted for the agent protocol.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def __call__(self, observation: Any, info: dict[str, Any]) -> str:
        if "kind" not in info or "given" not in info:
            return "\\boxed{0}"
        exact, value = solve(info["kind"], info["given"])
        return f"{info.get('figure_description', '')}\nSo the answer is \\boxed{{{answer_text(exact, value)}}}"


class BaselineGeometryToolAgent:
    r"""``tinker/GeometryTool-v0`` baseline: one ``calculator`` call, then its result (rounded as asked) boxed.

    Args:
        seed: Unused (the agent is deterministic); accepted for the agent protocol.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self.exact: bool | None = None

    def __call__(self, observation: Any, info: dict[str, Any]) -> str:
        if self.exact is None:
            if "kind" not in info or "given" not in info:
                self.exact = True
                return "\\boxed{0}"
            self.exact = solve(info["kind"], info["given"])[0] is not None
            call = {"name": "calculator", "arguments": {"expression": expression(info["kind"], info["given"])}}
            return f"Let me compute this.\n<tool_call>{json.dumps(call)}</tool_call>"
        text = observation.get("text", "") if isinstance(observation, dict) else str(observation)
        responses = _TOOL_RESPONSE.findall(text)
        result = responses[0].split(" (", 1)[0].strip() if responses else "0"
        if not self.exact:
            try:
                result = f"{float(result):.2f}"
            except ValueError:
                result = "0"
        return f"The calculator gives {result}.\n\\boxed{{{result}}}"


class BaselineColourAgent:
    """``tinker/ColourSquare-v0`` baseline: the nearer of the two colours to the mean non-white pixel.

    Args:
        seed: Unused (the agent is deterministic); accepted for the agent protocol.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def __call__(self, observation: Any, info: dict[str, Any]) -> str:
        images = observation.get("images", ()) if isinstance(observation, dict) else ()
        names = [c for c in info.get("colours", ()) if c in COLOURS]
        if not images or not names:
            return "red"
        pixels = np.asarray(images[0], dtype=np.float64).reshape(-1, 3)
        coloured = pixels[(np.abs(pixels - 255).sum(axis=1) > 30) & (pixels.sum(axis=1) > 100)]
        mean = coloured.mean(axis=0) if len(coloured) else pixels.mean(axis=0)
        return min(names, key=lambda c: float(np.sum((mean - np.array(COLOURS[c])) ** 2)))
