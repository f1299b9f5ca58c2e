"""Env wrappers, as ``gymnasium.wrappers``: :class:`LatencyWrapper` adds a delay to every step.

An agentic env's step is often slow where the env is not the model: a web or search API, a judge model, a remote
simulator. :class:`LatencyWrapper` stands for that time on any env (a fixed delay, or a fixed one plus a uniform random
one), so that a training setting can be measured where the env's time matters (``tinkergym train --env-latency``;
``benchmarks/async_rollouts.py --env-latency``)::

    env = LatencyWrapper(tinkergym.make("tinker/Math-v0"), delay=0.5)             # every step waits 0.5 s
    env = LatencyWrapper(tinkergym.make("tinker/Math-v0"), delay=0.2, jitter=0.6)  # 0.2 to 0.8 s, uniform

The delay is a sleep on the calling thread, as a blocking API call would be: episodes played on several threads
(rollouts play each round's env steps concurrently) wait at once, as concurrent API calls would. ``reset`` is not
delayed. Observations, rewards and infos are the wrapped env's, unchanged.
"""

from __future__ import annotations

import random
import time
from typing import Any

import gymnasium as gym


class LatencyWrapper(gym.Wrapper):
    """``env`` whose every ``step`` first waits ``delay`` seconds plus a uniform draw from ``[0, jitter)``.

    Args:
        env: Any single-agent env.
        delay: Seconds every step waits (0 or more).
        jitter: Up to this many seconds more, drawn uniformly per step from the wrapper's own generator (``seed``),
            so the env's own random stream is untouched.
        seed: Seeds the jitter's generator.
    """

    def __init__(self, env: gym.Env, delay: float = 0.5, jitter: float = 0.0, seed: int | None = None) -> None:
        if not (0 <= delay < float("inf") and 0 <= jitter < float("inf")):
            raise ValueError(f"delay and jitter must be finite seconds, 0 or more, not {delay!r} and {jitter!r}")
        super().__init__(env)
        self.delay, self.jitter = float(delay), float(jitter)
        self._rng = random.Random(seed)
        #: Seconds this wrapper has waited in all (what a run spent in the stand-in API).
        self.waited = 0.0

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """Wait, then step the wrapped env."""
        seconds = self.delay + (self._rng.uniform(0.0, self.jitter) if self.jitter else 0.0)
        if seconds:
            time.sleep(seconds)
            self.waited += seconds
        return self.env.step(action)
