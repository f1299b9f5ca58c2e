"""Geometry problems drawn from a seeded generator: the figure's primitives, the question and the exact answer.

Pure numpy and the standard library: :mod:`tinkergym_geometry.drawing` turns a :class:`Problem`'s
primitives into pixels. Every kind states its answer's form in the question: whole degrees and exact
lengths and areas (which may be fractions) compare exactly; answers with pi or a square root are asked
"to two decimal places" and accept any value within half a unit of the second decimal of the truth.

Kinds (``KINDS``): ``triangle_angle`` (two angles of a triangle given, find the third),
``right_triangle`` (two legs given, find the hypotenuse), ``triangle_area`` (base and height given),
``circle`` (radius given, find the area or the circumference) and ``parallel_lines`` (two parallel lines
cut by a transversal, one angle given, find another).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

KINDS = ("triangle_angle", "right_triangle", "triangle_area", "circle", "parallel_lines")
#: Pixels between a figure and the image's border.
MARGIN = 36

Point = tuple[float, float]


@dataclass(frozen=True)
class Problem:
    """One geometry question about one figure.

    Attributes:
        kind: One of :data:`KINDS`.
        question: What the agent is asked (the given values are in the figure, not here).
        description: The figure in words, with every given value: the text-only fallback.
        exact: The exact answer (``None`` when the answer involves pi or a root).
        value: The answer as a float.
        decimals: Decimal places the answer is asked to (``None``: exact).
        given: The given values by name (what the figure shows), for solvers and baselines.
        shapes: Drawing primitives in pixel coordinates (see :mod:`tinkergym_geometry.drawing`).
    """

    kind: str
    question: str
    description: str
    exact: Fraction | None
    value: float
    decimals: int | None
    given: dict[str, Any]
    shapes: tuple[tuple[Any, ...], ...] = field(default=())

    @property
    def answer(self) -> str:
        """The expected answer as text: exact (``12``, ``45/2``) or rounded (``78.54``)."""
        if self.exact is not None:
            return str(self.exact.numerator) if self.exact.denominator == 1 else f"{self.exact.numerator}/{self.exact.denominator}"
        return f"{self.value:.{self.decimals}f}"


def solve(kind: str, given: dict[str, Any]) -> tuple[Fraction | None, float]:
    """The exact answer (or ``None``) and its float value, from the given values of a problem."""
    if kind == "triangle_angle":
        exact = Fraction(180 - given["angle_A"] - given["angle_B"])
    elif kind == "right_triangle":
        square = given["leg_a"] ** 2 + given["leg_b"] ** 2
        root = math.isqrt(square)
        return (Fraction(root) if root * root == square else None), math.sqrt(square)
    elif kind == "triangle_area":
        exact = Fraction(given["base"] * given["height"], 2)
    elif kind == "circle":
        r = given["radius"]
        return None, math.pi * r * r if given["asked"] == "area" else 2 * math.pi * r
    elif kind == "parallel_lines":
        same = (given["given_position"] in ("upper right", "lower left")) == (given["asked_position"] in ("upper right", "lower left"))
        exact = Fraction(given["angle"] if same else 180 - given["angle"])
    else:
        raise ValueError(f"unknown kind {kind!r}; choose one of {KINDS}")
    return exact, float(exact)


def _fit(points: list[Point], size: tuple[int, int]) -> list[Point]:
    """Scale and centre points (y up) into the image (y down), keeping proportions."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    height, width = size
    span = max(max(xs) - min(xs), max(ys) - min(ys), 1e-9)
    scale = min(width, height) - 2 * MARGIN
    cx, cy = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
    return [(width / 2 + (x - cx) * scale / span, height / 2 - (y - cy) * scale / span) for x, y in points]


def _away(point: Point, centre: Point, distance: float) -> Point:
    """``point`` moved ``distance`` pixels away from ``centre`` (towards it if negative)."""
    dx, dy = point[0] - centre[0], point[1] - centre[1]
    norm = math.hypot(dx, dy) or 1.0
    return (point[0] + dx / norm * distance, point[1] + dy / norm * distance)


def _mid(a: Point, b: Point) -> Point:
    return ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)


def _triangle_shapes(points: list[Point], names: str = "ABC") -> list[tuple[Any, ...]]:
    centre = (sum(p[0] for p in points) / 3, sum(p[1] for p in points) / 3)
    shapes: list[tuple[Any, ...]] = [("polygon", tuple(points))]
    shapes += [("text", _away(p, centre, 14), name) for p, name in zip(points, names)]
    return shapes


def _triangle_angle(rng: np.random.Generator, size: tuple[int, int]) -> Problem:
    a = int(rng.integers(30, 81))
    b = int(rng.integers(30, min(81, 161 - a)))
    ta, tb = math.radians(a), math.radians(b)
    # C from A=(0,0), B=(1,0): the rays at angle a from A and 180-b from B meet there.
    t = math.sin(tb) / math.sin(ta + tb)
    points = _fit([(0.0, 0.0), (1.0, 0.0), (t * math.cos(ta), t * math.sin(ta))], size)
    centre = (sum(p[0] for p in points) / 3, sum(p[1] for p in points) / 3)
    shapes = _triangle_shapes(points)
    shapes += [("text", _away(points[0], centre, -30), f"{a}°"), ("text", _away(points[1], centre, -30), f"{b}°"), ("text", _away(points[2], centre, -26), "?")]
    given = {"angle_A": a, "angle_B": b}
    return _problem(
        "triangle_angle", given, tuple(shapes), "Find the angle marked ? in triangle ABC, in degrees.",
        f"Triangle ABC. The angle at A is {a} degrees and the angle at B is {b} degrees; the angle at C is marked ?.",
    )


def _right_triangle(rng: np.random.Generator, size: tuple[int, int]) -> Problem:
    leg_a, leg_b = int(rng.integers(3, 13)), int(rng.integers(3, 13))
    points = _fit([(0.0, 0.0), (float(leg_b), 0.0), (0.0, float(leg_a))], size)
    c, b, a = points  # right angle at C (bottom left), B right, A top
    centre = (sum(p[0] for p in points) / 3, sum(p[1] for p in points) / 3)
    shapes = _triangle_shapes([c, b, a], "CBA")
    shapes += [("polyline", ((c[0], c[1] - 12), (c[0] + 12, c[1] - 12), (c[0] + 12, c[1])))]
    shapes += [("text", _away(_mid(c, a), centre, 16), str(leg_a)), ("text", _away(_mid(c, b), centre, 14), str(leg_b)), ("text", _away(_mid(a, b), centre, 14), "?")]
    given = {"leg_a": leg_a, "leg_b": leg_b}
    return _problem(
        "right_triangle", given, tuple(shapes), "Triangle ABC has a right angle at C. Find the length of the side marked ?. Round to two decimal places if it is not a whole number.",
        f"Right triangle ABC with the right angle at C. Leg CA is {leg_a} long and leg CB is {leg_b} long; the hypotenuse AB is marked ?.",
    )


def _triangle_area(rng: np.random.Generator, size: tuple[int, int]) -> Problem:
    base, height = int(rng.integers(4, 16)), int(rng.integers(3, 13))
    apex_x = float(rng.uniform(0.2, 0.8)) * base
    a, b, c, foot = _fit([(0.0, 0.0), (float(base), 0.0), (apex_x, float(height)), (apex_x, 0.0)], size)
    centre = ((a[0] + b[0] + c[0]) / 3, (a[1] + b[1] + c[1]) / 3)
    shapes = _triangle_shapes([a, b, c])
    shapes += [("dashed", c, foot), ("polyline", ((foot[0] - 10, foot[1]), (foot[0] - 10, foot[1] - 10), (foot[0], foot[1] - 10)))]
    shapes += [("text", (foot[0] + 12, (c[1] + foot[1]) / 2), str(height)), ("text", _away(_mid(a, b), centre, 14), str(base))]
    given = {"base": base, "height": height}
    return _problem(
        "triangle_area", given, tuple(shapes), "Find the area of triangle ABC (the dashed line is its height). Give an exact number (a fraction or decimal if needed).",
        f"Triangle ABC with base AB of length {base}; the dashed height from C to AB has length {height}.",
    )


def _circle(rng: np.random.Generator, size: tuple[int, int]) -> Problem:
    radius = int(rng.integers(2, 13))
    asked = "area" if rng.integers(2) == 0 else "circumference"
    angle = float(rng.uniform(0, 2 * math.pi))
    height, width = size
    centre = (width / 2, height / 2)
    pixels = min(width, height) / 2 - MARGIN + 8
    end = (centre[0] + pixels * math.cos(angle), centre[1] - pixels * math.sin(angle))
    middle = _mid(centre, end)
    label = (middle[0] - 26 * math.sin(angle), middle[1] - 26 * math.cos(angle))  # beside the radius, not on it
    shapes = (("circle", centre, pixels), ("line", centre, end), ("dot", centre), ("text", (centre[0] - 14 * math.cos(angle), centre[1] + 14 * math.sin(angle)), "O"), ("text", label, f"r = {radius}"))
    given = {"radius": radius, "asked": asked}
    return _problem(
        "circle", given, shapes, f"Find the {asked} of the circle with centre O. Use pi = 3.14159... and round to two decimal places.",
        f"A circle with centre O and radius {radius} (the radius is drawn and labelled). The question asks for its {asked}.",
    )


_POSITIONS = ("upper right", "upper left", "lower left", "lower right")


def _parallel_lines(rng: np.random.Generator, size: tuple[int, int]) -> Problem:
    angle = int(rng.integers(35, 146))
    while angle == 90:
        angle = int(rng.integers(35, 146))
    given_position, asked_position = (_POSITIONS[int(i)] for i in rng.integers(0, 4, size=2))
    height, width = size
    ys = (height * 0.35, height * 0.68)
    theta = math.radians(angle)
    dx = (ys[1] - ys[0]) / math.tan(theta)
    x_top = width / 2 + dx / 2
    crossings = ((x_top, ys[0]), (x_top - dx, ys[1]))
    reach = (height * 0.3) / math.sin(theta)
    top_end = (crossings[0][0] + reach * math.cos(theta), crossings[0][1] - reach * math.sin(theta))
    bottom_end = (crossings[1][0] - reach * math.cos(theta), crossings[1][1] + reach * math.sin(theta))
    shapes: list[tuple[Any, ...]] = [("line", (12.0, y), (width - 12.0, y)) for y in ys]
    shapes += [("line", top_end, bottom_end), ("text", (width - 20.0, ys[0] - 10), "m"), ("text", (width - 20.0, ys[1] - 10), "n")]
    for (x, y), position, text in ((crossings[0], given_position, f"{angle}°"), (crossings[1], asked_position, "?")):
        # The four angles at a crossing lie between the rays at 0 (right), theta (up the transversal),
        # pi (left) and theta + pi (down it); each label sits on its angle's bisector.
        mid = {"upper right": theta / 2, "upper left": (theta + math.pi) / 2, "lower left": math.pi + theta / 2, "lower right": (theta + 3 * math.pi) / 2}[position]
        shapes.append(("text", (x + 26 * math.cos(mid), y - 26 * math.sin(mid)), text))
    given = {"angle": angle, "given_position": given_position, "asked_position": asked_position}
    return _problem(
        "parallel_lines", given, tuple(shapes), "Lines m and n are parallel and cut by a transversal. Find the angle marked ?, in degrees.",
        f"Parallel lines m (top) and n (bottom) cut by a transversal. At the crossing with m, the {given_position} angle is {angle} degrees; "
        f"at the crossing with n, the {asked_position} angle is marked ?. Angles are measured between the transversal and the line, "
        "named by the sides they lie between: upper/lower part of the transversal and left/right part of the line.",
    )


def _problem(kind: str, given: dict[str, Any], shapes: tuple[tuple[Any, ...], ...], question: str, description: str) -> Problem:
    exact, value = solve(kind, given)
    return Problem(kind=kind, question=question, description=description, exact=exact, value=value, decimals=None if exact is not None else 2, given=given, shapes=shapes)


_GENERATORS = {
    "triangle_angle": _triangle_angle,
    "right_triangle": _right_triangle,
    "triangle_area": _triangle_area,
    "circle": _circle,
    "parallel_lines": _parallel_lines,
}


def generate(rng: np.random.Generator, kinds: tuple[str, ...] = KINDS, size: tuple[int, int] = (256, 256)) -> Problem:
    """A problem of a kind drawn uniformly from ``kinds``, from ``rng`` alone (same state: same problem)."""
    kind = kinds[int(rng.integers(len(kinds)))]
    return _GENERATORS[kind](rng, size)
