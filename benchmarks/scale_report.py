"""The arithmetic of a ``scheduler_scale.py`` report: percentiles, utilisation, max-min fair shares (water filling with
quota caps), the drain's lower bound, an offline packing of the same runs, and the markdown table of saved reports.

Pure functions of the simulation's records (each run: ``tenant, kind, gpus, weight, seat, start, end``; each sample:
``t, held, waiting, queued``), so they are tested apart from any scheduler (``tests/scheduler/test_scale_report.py``).
"""

from __future__ import annotations

import heapq
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

#: The seats of a simulated shared server.
SEATS = 4


def utilization(samples: list[dict[str, Any]], capacity: float, depth: int) -> float | None:
    """The mean share of the cluster's places held while a quarter of the queue or more still waited."""
    busy = [sum(s["held"].values()) / capacity for s in samples if s["queued"] >= depth / 4]
    return round(sum(busy) / len(busy), 3) if busy else None


def water_fill(capacity: float, demand: dict[str, float], cap: dict[str, float]) -> dict[str, float]:
    """Max-min fair shares of ``capacity`` among tenants, each at most its demand and its cap."""
    want = {t: min(d, cap.get(t, math.inf)) for t, d in demand.items() if d > 0}
    share: dict[str, float] = {}
    left = capacity
    while want and left > 1e-9:
        level = left / len(want)
        small = {t: w for t, w in want.items() if w <= level}
        if not small:
            for t in want:
                share[t] = share.get(t, 0.0) + level
            break
        for t, w in small.items():
            share[t] = share.get(t, 0.0) + w
            left -= w
            del want[t]
    return share


def fairness(samples: list[dict[str, Any]], capacity: float, max_gpus: dict[str, int], until: float) -> dict[str, Any]:
    """Each tenant's device-seconds against its max-min fair share, integrated over the samples up to ``until``."""
    got: defaultdict[str, float] = defaultdict(float)
    fair: defaultdict[str, float] = defaultdict(float)
    for a, b in zip(samples, samples[1:]):
        if a["t"] >= until:
            break
        dt = b["t"] - a["t"]
        demand = {t: a["held"].get(t, 0.0) + a["waiting"].get(t, 0.0) for t in set(a["held"]) | set(a["waiting"])}
        for t, s in water_fill(capacity, demand, {t: float(q) for t, q in max_gpus.items()}).items():
            fair[t] += s * dt
        for t, h in a["held"].items():
            got[t] += h * dt
    rows = [{"tenant": t, "device_s": round(got[t], 1), "fair_s": round(fair[t], 1), "ratio": round(got[t] / fair[t], 3)}
            for t in sorted(fair) if fair[t] > 0]
    errors = sorted(abs(r["ratio"] - 1) for r in rows)
    within = sum(1 for e in errors if e <= 0.10)
    return {"tenants": len(rows), "within_10pct": within, "worst": round(errors[-1], 3) if errors else None,
            "median_error": round(statistics.median(errors), 3) if errors else None,
            "rows": sorted(rows, key=lambda r: abs(r["ratio"] - 1), reverse=True)[:10]}


def lower_bound(runs: list[dict[str, Any]], whole: int, seats: int, longest: float, max_gpus: dict[str, int] | None = None) -> float:
    """A lower bound of the time to run ``runs`` (their place-time as they ran) on ``whole`` devices and ``seats`` seats:
    every second of a run needs a place (whole-device runs a whole device each), no job finishes before its length, and
    no tenant runs more at once than its quota (``max_gpus``: a seat counts one)."""
    full = sum((r["end"] - r["start"]) * r["weight"] for r in runs if not r["seat"])
    seated = sum(r["end"] - r["start"] for r in runs if r["seat"])
    # seat runs may move to whole devices and back: the second term counts places of both kinds together
    tenant_work: defaultdict[str, float] = defaultdict(float)
    for r in runs:
        tenant_work[r["tenant"]] += (r["end"] - r["start"]) * (1 if r["seat"] else r["gpus"])
    by_quota = max((work / max_gpus[t] for t, work in tenant_work.items()), default=0.0) if max_gpus else 0.0
    return max(full / max(1, whole), (full + seated) / max(1, whole + seats), longest, by_quota)


def packed(runs: list[dict[str, Any]], workers: int, seat_workers: int) -> float:
    """The makespan of an offline packing of ``runs`` (as they ran: their lengths and sizes) onto the same places, knowing
    every length in advance: longest first (by device-seconds), each onto the place where it can start soonest (a
    multi-device run on the devices of one worker, a LoRA run on a seat or a whole device). Not a lower bound (packing is
    NP-hard) but a schedule an offline planner reaches, which an online scheduler that knows no lengths is held to."""
    devices = [[0.0] * (7 if w < seat_workers else 8) for w in range(workers)]  # each worker's devices' free times, sorted
    seats = [0.0] * (SEATS * seat_workers)
    heapq.heapify(seats)
    end = 0.0
    for run in sorted(runs, key=lambda r: -(r["end"] - r["start"]) * (r["gpus"] if not r["seat"] else 1.0 / SEATS)):
        length, gpus = run["end"] - run["start"], run["gpus"]
        if run["seat"] or run["kind"] == "lora":
            best = min(range(workers), key=lambda w: devices[w][0])
            if seats and seats[0] <= devices[best][0]:
                at = heapq.heappop(seats)
                heapq.heappush(seats, at + length)
                end = max(end, at + length)
                continue
            gpus = 1
        fits = [w for w in range(workers) if len(devices[w]) >= gpus]
        best = min(fits, key=lambda w: devices[w][gpus - 1])
        at = devices[best][gpus - 1]
        devices[best] = sorted([at + length] * gpus + devices[best][gpus:])
        end = max(end, at + length)
    return end


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def table(paths: list[Path]) -> str:
    """The reports saved by ``--json`` (one file each) as one markdown table: a row per run."""
    head = ("| code | N workers | J jobs | drained | drain / ideal | grant p50 / p99 ms | empty polls | heartbeat calls, renewals / s "
            "| scheduler CPU s / 1000 renewals | scheduler cores (full), PG cores | statements / grant | view p99 ms | tenants within 10% |")
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for path in paths:
        report = json.loads(path.read_text().strip().splitlines()[-1])
        for run in report["runs"]:
            beat = run.get("heartbeat_window") or {}
            probe, fair = run.get("grant_probe") or {}, run.get("fairness") or {}
            span = beat.get("seconds") or 0
            rows.append("| " + " | ".join(str(x) for x in (
                Path(report["code"]).name, run["workers"], run["jobs"], "yes" if run["drained"] else f"no ({run['drain_s']} s)",
                run["drain_vs_ideal"], f"{run['grant_ms']['p50']} / {run['grant_ms']['p99']}", run["empty_polls"],
                f"{round(beat['calls'] / span, 1)}, {beat['renewals_per_s']}" if span else "-",
                beat.get("scheduler_cpu_s_per_1000", "-"), f"{beat.get('scheduler_cores', '-')}, {beat.get('postgres_cores', '-')}",
                probe.get("calls", "-"), run["view_ms"]["p99"], f"{fair.get('within_10pct')} of {fair.get('tenants')}")) + " |")
    return "\n".join(rows)
