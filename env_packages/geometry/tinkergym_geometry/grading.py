r"""Grading of numeric answers to a stated rounding.

The answer is extracted as in ``tinker/Math-v0`` (the LAST ``\boxed{}``, else a last ``Answer:`` line;
:func:`tinkergym_math.grading.extract_answer`). Exact answers compare exactly as numbers (``45/2``,
``22.5`` and ``\frac{45}{2}`` are equal). Answers asked to ``d`` decimal places accept any number within
half a unit of the ``d``-th decimal of the true value: every correct rounding, and more precise values.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from tinkergym_math.grading import extract_answer, parse_number


@dataclass(frozen=True)
class NumericGrade:
    """The grading of one reply: ``correct``, the ``extracted`` text and its ``source`` (``"boxed"``, ``"answer_line"``, ``None``)."""

    correct: bool
    extracted: str | None
    source: str | None


def matches(value: Fraction | None, exact: Fraction | None, truth: float, decimals: int | None) -> bool:
    """Whether ``value`` is the answer: equal to ``exact``, or within the rounding of ``decimals`` places of ``truth``."""
    if value is None:
        return False
    if exact is not None:
        return value == exact
    tolerance = Fraction(1, 2 * 10 ** (decimals or 0)) + Fraction(1, 10**9)
    return abs(value - Fraction(truth)) <= tolerance


def grade_number(reply: str, exact: Fraction | None, truth: float, decimals: int | None) -> NumericGrade:
    """Extract the answer of ``reply`` and compare it with the expected one."""
    extracted, source = extract_answer(reply)
    value = parse_number(extracted) if extracted is not None else None
    return NumericGrade(matches(value, exact, truth, decimals), extracted, source)
