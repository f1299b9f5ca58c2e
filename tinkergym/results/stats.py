"""The intervals a results table states: Wilson's for a success rate, a paired bootstrap for a change measured on the
same episodes before and after training, a percentile bootstrap for a mean reward. Pure Python (no numpy, no torch).

All intervals are two-sided at 95% unless asked otherwise; the bootstraps are seeded, so the table repeats exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

#: The normal quantile of a two-sided 95% interval.
Z95 = 1.959963984540054
#: Resamples of each bootstrap: the percentile ends move by under 0.005 between seeds at 64 episodes.
RESAMPLES = 10_000


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a success rate of ``successes`` in ``n`` trials (``(0, 1)`` for ``n = 0``).

    Unlike the normal ("Wald") interval it stays inside [0, 1] and keeps its coverage at 0 or n successes, where a
    small model's rate before training often is.
    """
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within 0..n, got {successes} of {n}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends, where rounding would leave 1e-17
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _percentiles(values: list[float], level: float) -> tuple[float, float]:
    values.sort()
    tail = (1 - level) / 2
    last = len(values) - 1
    return values[int(math.floor(tail * last))], values[int(math.ceil((1 - tail) * last))]


def bootstrap_mean(values: Sequence[float], level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (episodes resampled with replacement)."""
    if not values:
        return 0.0, 0.0
    rng, n = random.Random(seed), len(values)
    means = [sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples)]
    return _percentiles(means, level)


def paired_bootstrap_difference(
    before: Sequence[float], after: Sequence[float], level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0,
) -> tuple[float, float, float]:
    """The mean of ``after - before`` over paired episodes (the same env seeds, in the same order) and its percentile
    bootstrap interval: the pairs are resampled together, so what the seeds share (an easy problem is easy before and
    after) does not widen the interval as two independent intervals would."""
    if len(before) != len(after):
        raise ValueError(f"paired samples differ in length: {len(before)} before, {len(after)} after")
    differences = [a - b for a, b in zip(after, before)]
    if not differences:
        return 0.0, 0.0, 0.0
    low, high = bootstrap_mean(differences, level, resamples, seed)
    return sum(differences) / len(differences), low, high
