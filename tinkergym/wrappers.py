"""Env wrappers, as ``gymnasium.wrappers``: :class:`LatencyWrapper` adds a delay to every step (:class:`AECLatencyWrapper`
to every move of a multi-agent game).

An agentic env's step is often slow where the env is not the model: a web or search API, a judge model, a remote
simulator. :class:`LatencyWrapper` stands for that time on any env (a fixed delay, or a fixed one plus a uniform random
one), so that a training setting can be measured where the env's time matters (``tinkergym train --env-latency``;
``benchmarks/async_rollouts.py --env-latency``)::

    env = LatencyWrapper(tinkergym.make("tinker/Math-v0"), delay=0.5)             # every step waits 0.5 s
    env = LatencyWrapper(tinkergym.make("tinker/Math-v0"), delay=0.2, jitter=0.6)  # 0.2 to 0.8 s, uniform
    game = AECLatencyWrapper(tinkergym.make_aec("tinker/GomokuDuel-v0"), delay=0.5)  # every move waits 0.5 s

The delay is a sleep on the calling thread, as a blocking API call would be: episodes played on several threads
(rollouts play each round's env steps concurrently) wait at once, as concurrent API calls would. ``reset`` is not
delayed. Observations, rewards and infos are the wrapped env's, unchanged.
"""

from __future__ import annotations

import random
import time
from typing import Any

import gymnasium as gym
from pettingzoo.utils.wrappers import BaseWrapper


class _Waits:
    """What both wrappers share: the delay and jitter, the jitter's own generator, and the seconds waited so far."""

    delay: float
    jitter: float
    #: Seconds this wrapper has waited in all (what a run spent in the stand-in API).
    waited: float

    def _set_latency(self, delay: float, jitter: float, seed: int | None) -> None:
        if not (0 <= delay < float("inf") and 0 <= jitter < float("inf")):
            raise ValueError(f"delay and jitter must be finite seconds, 0 or more, not {delay!r} and {jitter!r}")
        self.delay, self.jitter, self.waited = float(delay), float(jitter), 0.0
        self._rng = random.Random(seed)

    def _wait(self) -> None:
        """Sleep ``delay`` plus a uniform draw below ``jitter`` seconds."""
        seconds = self.delay + (self._rng.uniform(0.0, self.jitter) if self.jitter else 0.0)
        if seconds:
            time.sleep(seconds)
            self.waited += seconds


class LatencyWrapper(_Waits, gym.Wrapper):
    """``env`` whose every ``step`` first waits ``delay`` seconds plus a uniform draw from ``[0, jitter)``.

    Args:
        env: Any single-agent env.
        delay: Seconds every step waits (0 or more).
        jitter: Up to this many seconds more, drawn uniformly per step from the wrapper's own generator (``seed``),
            so the env's own random stream is untouched.
        seed: Seeds the jitter's generator.
    """

    def __init__(self, env: gym.Env, delay: float = 0.5, jitter: float = 0.0, seed: int | None = None) -> None:
        super().__init__(env)
        self._set_latency(delay, jitter, seed)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """Wait, then step the wrapped env."""
        self._wait()
        return self.env.step(action)


class AECLatencyWrapper(_Waits, BaseWrapper):
    """A multi-agent (AEC) ``env`` whose every ``step`` (a move of the agent to act) first waits ``delay`` seconds plus a
    uniform draw from ``[0, jitter)``: :class:`LatencyWrapper` for PettingZoo games (``--env-latency`` with self-play).

    Args: as :class:`LatencyWrapper`'s.
    """

    def __init__(self, env: Any, delay: float = 0.5, jitter: float = 0.0, seed: int | None = None) -> None:
        super().__init__(env)
        self._set_latency(delay, jitter, seed)

    def step(self, action: Any) -> None:
        """Wait, then make the move in the wrapped game."""
        self._wait()
        super().step(action)
