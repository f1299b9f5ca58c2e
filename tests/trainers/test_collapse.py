"""The self-play collapse detector: fires on degenerate runs, stays quiet on healthy ones, and round-trips."""

from __future__ import annotations

import json
import math
import random

import pytest

from tinkergym.errors import ConfigError
from tinkergym.trainers.collapse import SIGNALS, CollapseDetector

HEALTHY = {
    "selfplay/draw_rate": 0.1,
    "selfplay/illegal_rate": 0.05,
    "selfplay/response_tokens": 20.0,
    "selfplay/reward": 0.0,
    "league/winrate_fixed": 0.7,
}
COLLAPSED = {
    "selfplay/draw_rate": 0.8,
    "selfplay/illegal_rate": 0.6,
    "selfplay/response_tokens": 3.0,
    "selfplay/reward": 0.0,
    "league/winrate_fixed": 0.2,
}


def feed(detector: CollapseDetector, steps: list[dict], start: int = 0) -> list[list[str]]:
    return [detector.update(start + i, metrics) for i, metrics in enumerate(steps)]


def test_a_degenerate_step_fires_every_signal() -> None:
    detector = CollapseDetector()
    assert feed(detector, [HEALTHY] * 10) == [[]] * 10
    assert detector.update(10, COLLAPSED) == list(SIGNALS)
    metrics = detector.metrics()
    assert all(metrics[f"collapse/{s}"] == 1.0 for s in SIGNALS) and metrics["collapse/any"] == 1.0
    assert metrics["collapse/baseline_draw_rate"] == pytest.approx(0.1)
    assert metrics["collapse/baseline_response_tokens"] == pytest.approx(20.0)


@pytest.mark.parametrize(
    "key, value, signal",
    [
        ("selfplay/draw_rate", 0.8, "draw_jump"),
        ("selfplay/illegal_rate", 0.6, "illegal_jump"),
        ("selfplay/response_tokens", 3.0, "length_collapse"),
        ("league/winrate_fixed", 0.2, "winrate_drop"),
    ],
)
def test_each_signal_fires_on_its_own_number(key: str, value: float, signal: str) -> None:
    detector = CollapseDetector()
    feed(detector, [HEALTHY] * 8)
    assert detector.update(8, {**HEALTHY, key: value}) == [signal]
    assert detector.metrics()["collapse/any"] == 1.0
    assert detector.update(9, HEALTHY) == []
    assert detector.metrics()["collapse/any"] == 0.0 and detector.metrics()[f"collapse/{signal}"] == 0.0


def test_winrate_drop_needs_the_self_play_reward_to_hold() -> None:
    detector = CollapseDetector(reward_tolerance=0.1)
    feed(detector, [HEALTHY] * 8)
    assert detector.update(8, {**HEALTHY, "league/winrate_fixed": 0.2, "selfplay/reward": -0.5}) == [], "a general decline, not a self-play collapse"
    assert detector.update(9, {**HEALTHY, "league/winrate_fixed": 0.2, "selfplay/reward": 0.4}) == ["winrate_drop"], "a rising reward holds"
    without_reward = CollapseDetector()
    steps = [{"league/winrate_fixed": 0.7}] * 8 + [{"league/winrate_fixed": 0.2}]
    assert feed(without_reward, steps)[-1] == ["winrate_drop"]


def test_a_sustained_collapse_keeps_firing_and_freezes_its_baseline() -> None:
    detector = CollapseDetector()
    feed(detector, [HEALTHY] * 6)
    before = detector.metrics()
    fired = feed(detector, [COLLAPSED] * 30, start=6)
    assert fired == [list(SIGNALS)] * 30
    after = detector.metrics()
    for name in ("draw_rate", "illegal_rate", "response_tokens", "winrate_fixed"):
        assert after[f"collapse/baseline_{name}"] == before[f"collapse/baseline_{name}"]
    assert detector.update(36, HEALTHY) == [], "back to normal stops the signals"


def test_no_signal_during_warmup() -> None:
    detector = CollapseDetector(warmup=5)
    assert feed(detector, [HEALTHY] * 4 + [COLLAPSED]) == [[]] * 5, "the fifth value is still warm-up"
    assert detector.baseline("draw_rate") == pytest.approx((0.1 * 4 + 0.8) / 5)
    assert detector.baseline("reward") == 0.0


def test_a_healthy_noisy_run_stays_quiet() -> None:
    rng = random.Random(1234)
    steps = [
        {
            "selfplay/draw_rate": min(max(rng.gauss(0.2, 0.05), 0.0), 1.0),
            "selfplay/illegal_rate": min(max(rng.gauss(0.05, 0.02), 0.0), 1.0),
            "selfplay/response_tokens": rng.gauss(30.0, 3.0),
            "selfplay/reward": rng.gauss(0.0, 0.05),
            "league/winrate_fixed": min(max(rng.gauss(0.6, 0.05), 0.0), 1.0),
        }
        for _ in range(300)
    ]
    detector = CollapseDetector()
    assert all(fired == [] for fired in feed(detector, steps))
    assert detector.baseline("response_tokens") == pytest.approx(30.0, abs=3.0)


def test_a_slowly_improving_run_stays_quiet() -> None:
    n = 200
    steps = [
        {
            "selfplay/draw_rate": 0.1 + 0.3 * t / n,
            "selfplay/illegal_rate": 0.3 * (1 - t / n) + 0.01,
            "selfplay/response_tokens": 15.0 + 25.0 * t / n,
            "selfplay/reward": 0.5 * t / n,
            "league/winrate_fixed": 0.3 + 0.6 * t / n,
        }
        for t in range(n)
    ]
    assert all(fired == [] for fired in feed(CollapseDetector(), steps))


def test_missing_and_non_finite_values_are_skipped() -> None:
    detector = CollapseDetector(warmup=2)
    feed(detector, [HEALTHY] * 2)
    assert detector.update(2, {"selfplay/draw_rate": math.nan, "selfplay/response_tokens": None, "other/key": "text"}) == []
    assert detector.baseline("draw_rate") == pytest.approx(0.1)
    assert detector.update(3, {"selfplay/response_tokens": 2.0}) == ["length_collapse"]
    with pytest.raises(ConfigError, match="must be a number"):
        detector.update(4, {"selfplay/draw_rate": "high"})


def test_state_round_trips_through_json_exactly() -> None:
    rng = random.Random(5)
    steps = [{k: v * (1 + rng.uniform(-0.1, 0.1)) for k, v in HEALTHY.items()} for _ in range(12)] + [COLLAPSED] * 3 + [HEALTHY] * 5
    original = CollapseDetector(warmup=3, decay=0.8, draw_jump=0.25)
    feed(original, steps[:13])
    state = original.state_dict()
    restored = CollapseDetector()
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state and restored.metrics() == original.metrics()
    assert feed(restored, steps[13:], 13) == feed(original, steps[13:], 13)
    assert restored.state_dict() == original.state_dict()


def test_bad_arguments_raise_config_errors() -> None:
    for kwargs in ({"warmup": 0}, {"decay": 1.0}, {"draw_jump": 0}, {"illegal_jump": 1.5}, {"length_drop": 1.0}, {"winrate_drop": -0.1}, {"reward_tolerance": -1}, {"decay": math.nan}):
        with pytest.raises(ConfigError):
            CollapseDetector(**kwargs)
    with pytest.raises(ConfigError, match="watched number"):
        CollapseDetector().baseline("loss")
    with pytest.raises(ConfigError):
        CollapseDetector().load_state_dict({"version": 1})
