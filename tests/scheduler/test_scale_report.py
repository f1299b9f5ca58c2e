"""The arithmetic of the cluster simulator's report (``benchmarks/scale_report.py``): max-min fair shares with quota caps,
each tenant's device-seconds against them, the drain's lower bound, the offline packing, utilisation, percentiles."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scale_report as report  # noqa: E402 - a sibling of the benchmark scripts, not a package


def run(tenant: str, gpus: int, start: float, end: float, seat: bool = False, kind: str = "full") -> dict[str, Any]:
    return {"tenant": tenant, "gpus": gpus, "weight": 1.0 / report.SEATS if seat else float(gpus), "seat": seat, "start": start, "end": end,
            "kind": "lora" if seat else kind}


def test_water_fill_gives_the_small_what_they_want_and_splits_the_rest_within_caps() -> None:
    assert report.water_fill(10.0, {"a": 2.0, "b": 10.0, "c": 10.0}, {"c": 3.0}) == {"a": 2.0, "c": 3.0, "b": 5.0}
    assert report.water_fill(9.0, {"a": 10.0, "b": 10.0, "c": 10.0}, {}) == pytest.approx({"a": 3.0, "b": 3.0, "c": 3.0})
    assert report.water_fill(10.0, {"a": 1.0, "idle": 0.0}, {}) == {"a": 1.0}, "a tenant with no work gets nothing"


def test_fairness_integrates_each_tenants_share_over_time() -> None:
    even = [{"t": float(t), "held": {"a": 4.0, "b": 4.0}, "waiting": {"a": 10.0, "b": 10.0}} for t in range(11)]
    fair = report.fairness(even, 8.0, {"a": 8, "b": 8}, until=10.0)
    assert fair["tenants"] == 2 and fair["within_10pct"] == 2 and fair["worst"] == 0.0
    skewed = [{"t": float(t), "held": {"a": 8.0}, "waiting": {"a": 10.0, "b": 10.0}} for t in range(11)]
    unfair = report.fairness(skewed, 8.0, {"a": 8, "b": 8}, until=10.0)
    assert unfair["within_10pct"] == 0 and unfair["worst"] == 1.0
    assert {r["tenant"]: r["ratio"] for r in unfair["rows"]} == {"a": 2.0, "b": 0.0}
    capped = report.fairness(skewed, 8.0, {"a": 8, "b": 0}, until=10.0)
    assert capped["within_10pct"] == 1, "a tenant whose quota is 0 is owed nothing: the other one's whole cluster is fair"


def test_the_lower_bound_is_the_largest_of_volume_longest_job_and_quota() -> None:
    runs = [run("a", 1, 0.0, 10.0) for _ in range(16)]
    assert report.lower_bound(runs, whole=8, seats=0, longest=10.0) == 20.0, "160 device-seconds on 8 devices"
    assert report.lower_bound(runs, whole=64, seats=0, longest=10.0) == 10.0, "no job ends before its length"
    assert report.lower_bound(runs, whole=64, seats=0, longest=10.0, max_gpus={"a": 2}) == 80.0, "2 at a time by the quota"
    seated = [run("a", 1, 0.0, 10.0, seat=True) for _ in range(8)]
    assert report.lower_bound(seated, whole=0, seats=4, longest=10.0) == 20.0


def test_the_offline_packing_fills_workers_longest_first() -> None:
    ones = [run("a", 1, 0.0, 10.0) for _ in range(16)]
    assert report.packed(ones, workers=2, seat_workers=0) == 10.0
    mixed = [run("a", 8, 0.0, 10.0)] + [run("b", 1, 0.0, 10.0) for _ in range(8)]
    assert report.packed(mixed, workers=1, seat_workers=0) == 20.0, "the 8-device job and 8 single ones cannot overlap on 8 devices"
    assert report.packed(mixed, workers=2, seat_workers=0) == 10.0
    lora = [run("c", 1, 0.0, 10.0, seat=True) for _ in range(4)]
    assert report.packed(lora, workers=1, seat_workers=1) == 10.0, "4 seats of one shared server"


def test_utilisation_and_percentiles() -> None:
    samples = [{"held": {"a": 4.0}, "queued": 100}, {"held": {"a": 8.0}, "queued": 30}, {"held": {}, "queued": 10}]
    assert report.utilization(samples, capacity=8.0, depth=100) == 0.75, "only while a quarter of the queue waited"
    assert report.utilization([], capacity=8.0, depth=100) is None
    assert report.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and report.percentile([], 0.99) is None
    assert report.ms(0.0123) == 12.3 and report.ms(None) is None
