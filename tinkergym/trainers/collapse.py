"""Early warning for self-play collapse: watches a few numbers of every step against their own history.

No torch here: the trainer feeds :class:`CollapseDetector` the self-play metrics of each step and reacts to
the signals it returns (e.g. :meth:`tinkergym.trainers.league.League.boost_fixed`).
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Mapping

from tinkergym.errors import ConfigError

#: Short name of each watched number -> the step-metric key it is read from.
WATCHED = {
    "draw_rate": "selfplay/draw_rate",
    "illegal_rate": "selfplay/illegal_rate",
    "response_tokens": "selfplay/response_tokens",
    "reward": "selfplay/reward",
    "winrate_fixed": "league/winrate_fixed",
}

#: Each signal -> the watched number whose baseline it compares against (and freezes when it fires).
SIGNALS = {
    "draw_jump": "draw_rate",
    "illegal_jump": "illegal_rate",
    "length_collapse": "response_tokens",
    "winrate_drop": "winrate_fixed",
}

_STATE_VERSION = 1


class CollapseDetector:
    """Fires named signals when a step's self-play numbers break from their baselines.

    Every key is optional in a step's metrics; a missing, None or non-finite (NaN, inf) value is skipped for
    that step. Each watched number has its own baseline: the mean of its first ``warmup`` values, then an
    exponential moving average ``baseline = decay * baseline + (1 - decay) * value``. A number is checked
    only once its baseline has seen ``warmup`` values, and always against the baseline from before this
    step. With ``x`` a step's value and ``b`` its baseline, the signals are:

    * ``draw_jump``: ``x - b > draw_jump`` for ``selfplay/draw_rate`` (games end in draws far more often);
    * ``illegal_jump``: ``x - b > illegal_jump`` for ``selfplay/illegal_rate`` (illegal moves per move);
    * ``length_collapse``: ``x < length_drop * b`` for ``selfplay/response_tokens`` (mean sampled tokens per move);
    * ``winrate_drop``: ``b - x > winrate_drop`` for ``league/winrate_fixed`` (the win rate against fixed
      opponents) while the self-play reward holds: ``selfplay/reward`` has not fallen more than
      ``reward_tolerance`` below its baseline. A rise of the reward counts as holding (beating its own past
      while losing to fixed opponents is the collapse this looks for); a step without a reward, or whose
      reward baseline is still warming up, counts as holding too.

    A signal that fires leaves its number's baseline where it was that step, so a sustained collapse keeps
    firing until the number comes back; every other number (the reward included) updates as usual.
    """

    def __init__(
        self,
        *,
        warmup: int = 5,
        decay: float = 0.9,
        draw_jump: float = 0.3,
        illegal_jump: float = 0.2,
        length_drop: float = 0.5,
        winrate_drop: float = 0.25,
        reward_tolerance: float = 0.1,
    ) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"warmup must be a whole number of steps >= 1, got {warmup!r}.")
        _check_number("decay", decay, 0.0, 1.0, "a fraction in [0, 1): the weight the baseline keeps each step", high_open=True)
        _check_number("draw_jump", draw_jump, 0.0, 1.0, "a rise of the draw rate in (0, 1]", low_open=True)
        _check_number("illegal_jump", illegal_jump, 0.0, 1.0, "a rise of the illegal-move rate in (0, 1]", low_open=True)
        _check_number("length_drop", length_drop, 0.0, 1.0, "a fraction of the baseline length in (0, 1)", low_open=True, high_open=True)
        _check_number("winrate_drop", winrate_drop, 0.0, 1.0, "a fall of the win rate in (0, 1]", low_open=True)
        _check_number("reward_tolerance", reward_tolerance, 0.0, math.inf, "a reward difference >= 0", high_open=True)
        self.warmup = warmup
        self.decay = float(decay)
        self.draw_jump = float(draw_jump)
        self.illegal_jump = float(illegal_jump)
        self.length_drop = float(length_drop)
        self.winrate_drop = float(winrate_drop)
        self.reward_tolerance = float(reward_tolerance)
        self._baselines: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._fired: list[str] = []
        self._step: int | None = None

    @property
    def fired(self) -> list[str]:
        """The signals that fired at the last :meth:`update`."""
        return list(self._fired)

    def baseline(self, name: str) -> float | None:
        """The baseline of a watched number (a key of :data:`WATCHED`), or None before its first value."""
        if name not in WATCHED:
            raise ConfigError(f"{name!r} is not a watched number; use one of {', '.join(WATCHED)}.")
        return self._baselines.get(name)

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[str]:
        """Read one training step's metrics; returns the signals that fired (in :data:`SIGNALS` order)."""
        values = {name: v for name, key in WATCHED.items() if (v := _finite(key, metrics.get(key))) is not None}
        ready = {name: self._baselines[name] for name in values if self._counts.get(name, 0) >= self.warmup}
        fired = [signal for signal, name in SIGNALS.items() if name in ready and self._breaks(signal, values[name], ready[name], values, ready)]
        frozen = {SIGNALS[signal] for signal in fired}
        for name, value in values.items():
            if name not in frozen:
                self._observe(name, value)
        self._fired = fired
        self._step = step
        return list(fired)

    def _breaks(self, signal: str, x: float, b: float, values: dict[str, float], ready: dict[str, float]) -> bool:
        if signal == "draw_jump":
            return x - b > self.draw_jump
        if signal == "illegal_jump":
            return x - b > self.illegal_jump
        if signal == "length_collapse":
            return x < self.length_drop * b
        reward_holds = "reward" not in ready or values["reward"] >= ready["reward"] - self.reward_tolerance
        return b - x > self.winrate_drop and reward_holds

    def _observe(self, name: str, value: float) -> None:
        count = self._counts.get(name, 0) + 1
        self._counts[name] = count
        if count <= self.warmup:  # the plain mean of the warm-up values
            previous = self._baselines.get(name, 0.0)
            self._baselines[name] = previous + (value - previous) / count
        else:
            self._baselines[name] = self.decay * self._baselines[name] + (1.0 - self.decay) * value

    def metrics(self) -> dict[str, float]:
        """Flat numbers for logging every step: ``collapse/<signal>`` (1 fired at the last update, else 0),
        ``collapse/any``, and ``collapse/baseline_<name>`` of every watched number seen so far."""
        out = {f"collapse/{signal}": float(signal in self._fired) for signal in SIGNALS}
        out["collapse/any"] = float(bool(self._fired))
        out.update({f"collapse/baseline_{name}": self._baselines[name] for name in WATCHED if name in self._baselines})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Settings, baselines, counts and the last step's signals, as JSON data."""
        return {
            "version": _STATE_VERSION,
            "settings": {k: getattr(self, k) for k in ("warmup", "decay", "draw_jump", "illegal_jump", "length_drop", "winrate_drop", "reward_tolerance")},
            "baselines": dict(self._baselines),
            "counts": dict(self._counts),
            "fired": list(self._fired),
            "step": self._step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Become the detector ``state`` describes (settings included)."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ConfigError(f"not a CollapseDetector state of version {_STATE_VERSION}; pass what CollapseDetector.state_dict() returned.")
        try:
            fresh = CollapseDetector(**state["settings"])
            baselines = {str(k): float(v) for k, v in state["baselines"].items()}
            counts = {str(k): int(v) for k, v in state["counts"].items()}
            fired = [str(s) for s in state["fired"]]
            step = None if state["step"] is None else int(state["step"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"the CollapseDetector state is incomplete or malformed ({exc!r}); pass what state_dict() returned.") from exc
        if not set(baselines) <= set(WATCHED) or set(counts) != set(baselines) or not set(fired) <= set(SIGNALS):
            raise ConfigError("the CollapseDetector state names unknown numbers or signals; pass what state_dict() returned.")
        self.__dict__.update(fresh.__dict__)
        self._baselines, self._counts, self._fired, self._step = baselines, counts, fired, step


def _finite(key: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"step metric {key!r} must be a number, got {value!r}; pass the step's aggregated float.") from None
    return number if math.isfinite(number) else None


def _check_number(name: str, value: Any, low: float, high: float, what: str, low_open: bool = False, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        raise ConfigError(f"{name} must be {what}, got {value!r}.")
