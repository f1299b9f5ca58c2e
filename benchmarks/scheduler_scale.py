"""The scheduler at cluster scale, simulated: N workers of 8 devices, J queued jobs, T tenants, against the real scheduler.

    python benchmarks/scheduler_scale.py --workers 1000 --jobs 10000 --tenants 100 --db postgresql
    python benchmarks/scheduler_scale.py --workers 10,100,1000 --db postgresql --json      # a table, one run per N
    python benchmarks/scheduler_scale.py --code /tmp/before --workers 100        # the scheduler of another source tree
    python benchmarks/scheduler_scale.py --quick                                 # SQLite, 6 workers, churn (a smoke test)

What runs: ``tinkergym scheduler serve`` as its own process on 127.0.0.1 (from this tree, or from ``--code``'s tree), on a
SQLite file or on a private PostgreSQL cluster (:mod:`tinkergym.scheduler.devdb`, with ``pg_stat_statements``). This
process plays the cluster over HTTP: N simulated workers (asyncio tasks, each with its own worker credential) register 8
devices each (a ``--seat-share`` of them run their last device as a shared server of 4 LoRA seats), take leases, report
``starting`` and ``running``, heartbeat at the documented interval (a third of the lease TTL; one call per worker for all
its leases where the scheduler offers ``POST /v1/workers/{id}/heartbeats``, one call per lease otherwise), then finish,
fail, or vanish (stop calling; they come back later and register again). T simulated tenants (each with its own key and
quotas, their sizes skewed) submit J jobs, a mix of LoRA (packable onto seats), full fine-tuning and multi-device jobs,
then page their job lists, look at queued jobs, stream a job's events and cancel a few while the queue drains.

The run, in phases: (1) every tenant submits its jobs (submissions per second, latency p50/p99 as clients saw them);
(2) the workers register and drain the queue. Reported: lease grant latency (p50, p99) from a place's freeing to the
worker's next grant, counted while a quarter of the queue is still waiting (any freed place then has a job that fits it);
heartbeat cost, from the window in which every place is held and no job has ended yet (only heartbeats arrive): the
scheduler's CPU seconds per 1,000 lease renewals and the cores it and PostgreSQL spent; PostgreSQL's statements and rows
read per grant (``pg_stat_statements``, over the drain); the drain time against a lower bound of the ideal packing of the
same jobs computed offline (the place-time the runs took, whole devices and seats, over the cluster's places; never less
than the longest job); each tenant's device-seconds against its fair share (max-min fair: at each second the places are
water-filled among the tenants with work, each capped by its demand and its ``max_gpus``); the latency of tenants' views
(list pages, one queued job). And the checks the CI test asserts: no lease granted twice, no place over-committed, every
vanished worker's leases queued again within the TTL, no quota exceeded, no job waiting past the stated bound.

Job durations are seconds of real time (``--duration``), so the load on the scheduler is a real cluster's at the same N
(heartbeats and registrations) with far more grants per second than hours-long jobs make. The machine's facts (cores,
load of other processes) are in the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scale_db import Database, cpu_seconds, postgres_cpu, requeue_delays, with_statements
from scale_http import Http
from scale_setup import LEASE_TTL, run_setup, start_scheduler
from scale_report import SEATS, fairness, lower_bound, ms, packed, percentile, table, utilization  # a sibling module: benchmarks/ is on sys.path

MODEL = "tiny"


# ----- the workload -------------------------------------------------------------------------------------------------
@dataclass
class Spec:
    """A job a tenant submits and how the simulated worker runs it."""

    tenant: str
    kind: str  # lora (packable onto a seat), full, multi
    gpus: int
    duration: float
    fail_at: float | None = None  # the fraction of its duration at which it fails (None: it succeeds)
    cancel: bool = False

    def body(self) -> dict[str, Any]:
        config: dict[str, Any] = {"model": MODEL, "lora_rank": 8 if self.kind == "lora" else 0, "sim_duration": self.duration}
        if self.fail_at is not None:
            config["sim_fail_at"] = self.fail_at
        return {"kind": "train", "gpus": self.gpus, "config": config}


def tenant_sizes(tenants: int, jobs: int, rng: random.Random) -> list[int]:
    """Jobs per tenant, skewed (Zipf-like: a few large tenants, a long tail), every tenant at least one, summing to ``jobs``."""
    weights = [1.0 / (i + 1) ** 0.8 for i in range(tenants)]
    rng.shuffle(weights)
    total = sum(weights)
    sizes = [max(1, int(jobs * w / total)) for w in weights]
    i = 0
    while sum(sizes) < jobs:
        sizes[i % tenants] += 1
        i += 1
    while sum(sizes) > jobs:
        j = max(range(tenants), key=lambda k: sizes[k])
        sizes[j] -= 1
    return sizes


def workload(tenants: int, jobs: int, duration: tuple[float, float], rng: random.Random, churn: float, max_gpus: list[int]) -> list[Spec]:
    """Each tenant's jobs: its own mix of LoRA, full and multi-device jobs (some tenants mostly one kind; none larger than
    its quota), interleaved as submissions from many clients arrive."""
    specs: list[Spec] = []
    for t, size in enumerate(tenant_sizes(tenants, jobs, rng)):
        lora, full = [(0.7, 0.25), (0.3, 0.6), (0.5, 0.3), (0.2, 0.3)][t % 4]
        for _ in range(size):
            u = rng.random()
            kind, gpus = ("lora", 1) if u < lora else ("full", 1) if u < lora + full else ("multi", min(max_gpus[t], rng.choice((2, 2, 4, 8))))
            spec = Spec(f"t{t:03d}", kind, gpus, rng.uniform(*duration))
            if rng.random() < churn:
                spec.fail_at = rng.uniform(0.1, 0.9)
            elif rng.random() < churn:
                spec.cancel = True
            specs.append(spec)
    rng.shuffle(specs)
    return specs


def quotas(tenants: int, places: int) -> list[int]:
    """Each tenant's ``max_gpus``: most may take a fifth of the cluster, every fifth tenant a small fixed quota."""
    return [max(2, places // 50) if t % 5 == 4 else max(8, places // 5) for t in range(tenants)]


# ----- setup (run with the scheduler's own source tree on sys.path) -------------------------------------------------
# ----- the simulated cluster ------------------------------------------------------------------------------------------
@dataclass
class Run:
    job_id: str
    epoch: int
    places: tuple[int, ...]  # device indexes, or the seat's index
    spec: Spec | None
    granted: float
    task: asyncio.Task | None = None
    released: bool = False
    proven: bool = False  # a heartbeat after "running" was answered: the scheduler knows the job runs here


@dataclass
class Stats:
    submit_latency: list[float] = field(default_factory=list)
    grant_latency: list[float] = field(default_factory=list)
    view_latency: list[float] = field(default_factory=list)
    heartbeats: int = 0  # leases renewed
    heartbeat_calls: int = 0
    grants: int = 0
    grant_requests: int = 0  # lease requests that were granted something (one or more leases)
    empty_polls: int = 0
    violations: list[str] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # every run: job, tenant, weight, start, end, outcome
    first_wait: dict[str, float] = field(default_factory=dict)  # job -> seconds from submission to its first grant
    vanished: list[dict[str, Any]] = field(default_factory=list)
    requeue_delays: list[float] = field(default_factory=list)
    failures: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))

    def fail(self, what: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(what)


class Cluster:
    """The simulated workers and tenants, and what they saw."""

    def __init__(self, http: Http, keys: dict[str, Any], specs: list[Spec], args: argparse.Namespace, rng: random.Random) -> None:
        self.http, self.keys, self.args, self.rng = http, keys, args, rng
        self.polls = http  # the connections lease polls take (drive gives them a pool of their own)
        self.specs = specs
        self.by_job: dict[str, Spec] = {}
        self.submitted_at: dict[str, float] = {}
        self.stats = Stats()
        self.queued = 0  # jobs waiting, as the simulation counts them (submitted, requeued, not yet granted)
        self.places = 0
        self.running = 0
        self.held: defaultdict[str, float] = defaultdict(float)  # tenant -> devices held now (a seat: 1/SEATS)
        self.quota_held: defaultdict[str, int] = defaultdict(int)  # tenant -> devices counted against max_gpus now
        self.max_gpus: dict[str, int] = {}
        self.holder: dict[str, tuple[str, int]] = {}  # job -> (worker, epoch) holding it now
        self.expires: dict[str, float] = {}  # job -> its holder's lease end, as last granted or renewed
        self.seated: dict[str, bool] = {}  # job -> whether its latest lease is on a seat (one device toward its quota)
        self.epochs: dict[str, int] = {}
        self.done: set[str] = set()
        self.stopping = False
        self.batched = False  # heartbeats in one call per worker
        self.agent = False  # the worker agent of a scheduler with batched heartbeats: idle backoff, a lease asked at once when a job ends
        self.last_grant: float | None = None  # when the last lease was granted
        self.first_end: float | None = None
        self.depth = 0  # queued jobs at the start of the drain
        self.last_end = 0.0  # when the last job ended

    # -- tenants --
    async def submit_all(self, clients: int) -> float:
        pending = list(self.specs)
        started = time.perf_counter()

        async def client() -> None:
            while pending:
                spec = pending.pop()
                key = self.keys["tenants"][spec.tenant]
                t0 = time.perf_counter()
                status, body = await self.http.request("POST", "/v1/jobs", key, spec.body(), {"Idempotency-Key": uuid.uuid4().hex})
                self.stats.submit_latency.append(time.perf_counter() - t0)
                if status != 201:
                    self.stats.failures[f"submit {status}"] += 1
                    continue
                self.by_job[body["id"]] = spec
                self.submitted_at[body["id"]] = time.time()

        await asyncio.gather(*(client() for _ in range(clients)))
        self.queued = len(self.by_job)
        return time.perf_counter() - started

    async def tenant_views(self, tenant: str) -> None:
        """A tenant while the queue drains: pages its jobs, looks at one queued job, streams a job's events, cancels some."""
        key = self.keys["tenants"][tenant]
        mine = [j for j, s in self.by_job.items() if s.tenant == tenant]
        to_cancel = [j for j in mine if self.by_job[j].cancel]
        await asyncio.sleep(self.rng.uniform(0, self.args.view_every))
        while not self.stopping:
            t0 = time.perf_counter()
            status, page = await self.http.request("GET", "/v1/jobs?limit=50", key)
            self.stats.view_latency.append(time.perf_counter() - t0)
            if status != 200:
                self.stats.failures[f"list {status}"] += 1
            waiting = [j for j in mine if j not in self.holder and j not in self.done]
            if waiting:
                t0 = time.perf_counter()
                status, _ = await self.http.request("GET", f"/v1/jobs/{self.rng.choice(waiting)}", key)
                self.stats.view_latency.append(time.perf_counter() - t0)
            if to_cancel:
                job = to_cancel.pop()
                if job not in self.done:
                    status, body = await self.http.request("POST", f"/v1/jobs/{job}/cancel", key, {})
                    if status == 200 and body.get("state") == "cancelled":
                        self._ended(job, "cancelled")
            await asyncio.sleep(self.args.view_every)

    def _ended(self, job: str, outcome: str) -> None:
        if job not in self.done:
            self.done.add(job)
            self.last_end = time.time()
            if job not in self.holder:
                self.queued -= 1

    async def reconcile(self, most: int = 50) -> None:
        """When few jobs are left: ask the scheduler the state of each, and count those that ended unseen (a cancel answered
        while its lease ended, a refused final report) as done."""
        left = [j for j in self.by_job if j not in self.done]
        if len(left) > most:
            return
        for job in left:
            state = await self._state_of(job)
            if state != "lost" and job not in self.done:  # ended at the scheduler; a simulated run still on it stops by itself
                self._ended(job, state)

    # -- workers --
    async def worker(self, index: int) -> None:
        key = self.keys["workers"][index]
        seats = index < round(self.args.seat_share * len(self.keys["workers"]))
        devices = [{"index": i, "kind": "gpu", "name": "sim"} for i in range(8)]
        if seats:
            devices[7]["shared"] = {"seats": SEATS, "model": MODEL, "dtype": "auto", "max_lora_rank": 64}
        wid = await self._register(key, f"sim-{index}", devices)
        places = 7 + SEATS if seats else 8
        self.places += places
        held: dict[str, Run] = {}
        busy: set[int] = set()  # places held by this worker's runs
        freed = asyncio.Event()
        free_times: list[tuple[float, bool]] = []
        vanish = asyncio.Event()
        beats = asyncio.create_task(self._batched_heartbeats(wid, key, held, vanish)) if self.batched else None
        delay = self.args.poll
        vanished, checked = False, time.time()
        while not self.stopping:
            if vanish.is_set():
                await self._vanish(wid, held, busy, beats)
                wid = await self._register(key, f"sim-{index}", devices)
                vanish.clear()
                if self.batched:
                    beats = asyncio.create_task(self._batched_heartbeats(wid, key, held, vanish))
                continue
            if len(busy) < places:
                most = places - len(busy) if self.args.lease_max == 0 else self.args.lease_max
                try:
                    status, body = await self.polls.request("POST", f"/v1/workers/{wid}/lease", key, {"max": most})
                except (OSError, asyncio.IncompleteReadError):  # dropped three times: a failed poll, backed off
                    status, body = 0, {}
                granted = (body.get("leases") or ([body["lease"]] if body.get("lease") else [])) if status == 200 else []
                if granted:  # a scheduler that grants one a request ignores "max" and answers "lease"
                    self.stats.grant_requests += 1
                    for lease in granted:
                        run = self._granted(wid, lease, busy, free_times)
                        held[run.job_id] = run
                        run.task = asyncio.create_task(self._run(wid, key, run, held, busy, freed, free_times, vanish))
                    delay = self.args.poll
                    continue
                if status != 200:
                    self.stats.failures[f"lease {status}"] += 1
                    delay = min(delay * 2, 30.0)
                else:
                    self.stats.empty_polls += 1
                    if self.agent:  # the worker agent of the same code backs off while idle (tinkergym.scheduler.worker.pool)
                        delay = min(delay * 2, self.args.poll * 8)
            # a worker vanishes (its machine dies) at most once, mid-run: holding leases that all ran (a worker that dies
            # with leases it never ran is a strike against it, and quarantined at the second: not what is simulated)
            elapsed, checked = time.time() - checked, time.time()
            if self.args.vanish and not vanished and held and all(r.proven for r in held.values()) \
                    and self.rng.random() < self.args.vanish * elapsed / 60:
                vanish.set()
                vanished = True
                continue
            freed.clear()
            if self.agent:  # the agent asks again as soon as a place frees, else at its poll interval
                try:
                    await asyncio.wait_for(freed.wait(), delay)
                    delay = self.args.poll
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(delay)
        if beats is not None:
            beats.cancel()

    async def _register(self, key: str, name: str, devices: list[dict[str, Any]]) -> str:
        while True:
            status, body = await self.http.request("POST", "/v1/workers", key,
                                                   {"name": name, "host": "127.0.0.1", "devices": devices, "models": [MODEL]})
            if status == 200:
                return body["id"]
            self.stats.failures[f"register {status}"] += 1
            await asyncio.sleep(1.0)

    def _granted(self, wid: str, lease: dict[str, Any], busy: set[int], free_times: list[tuple[float, bool]]) -> Run:
        """A lease taken: checked against every lease seen (none granted twice, no place over-committed), counted, its run."""
        now = time.time()
        self.stats.grants += 1
        if free_times:  # the latency from the oldest place freed here to this grant
            t_free, deep = free_times.pop(0)
            if deep:
                self.stats.grant_latency.append(now - t_free)
        job, epoch = lease["job_id"], lease["epoch"]
        places = (lease["seat"],) if lease.get("seat") is not None else tuple(lease["devices"])
        spec = self.by_job.get(job)
        if job in self.holder and now < self.expires.get(job, 0.0) - 0.5:  # its holder's lease, as last renewed, still runs
            self.stats.fail(f"job {job} granted to {wid} at epoch {epoch} while {self.holder[job]} holds it until {self.expires[job]:.1f}")
        elif job in self.holder:
            self.stats.failures["lease expired before its holder knew"] += 1
        if epoch <= self.epochs.get(job, 0):
            self.stats.fail(f"job {job} granted at epoch {epoch} after epoch {self.epochs[job]}")
        if busy & set(places):
            self.stats.fail(f"worker {wid}: places {sorted(busy & set(places))} granted to job {job} while held")
        busy.update(places)
        self.holder[job] = (wid, epoch)
        self.expires[job] = float(lease.get("expires_at") or now)
        self.epochs[job] = epoch
        self.queued -= 1
        self.running += 1
        self.last_grant = time.time()
        if spec is not None:
            self.held[spec.tenant] += 1.0 / SEATS if lease.get("seat") is not None else spec.gpus
            self.quota_held[spec.tenant] += 1 if lease.get("seat") is not None else spec.gpus
            self.seated[job] = lease.get("seat") is not None
            if self.quota_held[spec.tenant] > self.max_gpus[spec.tenant] and self._holding(spec.tenant, now) > self.max_gpus[spec.tenant]:
                self.stats.fail(f"tenant {spec.tenant} holds {self._holding(spec.tenant, now)} devices, over its max_gpus {self.max_gpus[spec.tenant]}")
            self.stats.first_wait.setdefault(job, now - self.submitted_at[job])
        return Run(job, epoch, places, spec, now)

    def _holding(self, tenant: str, now: float) -> int:
        """The devices ``tenant`` holds as the scheduler counts them toward its quota: each job once, at its latest lease,
        and not a lease past its last renewal's end (it expired unseen by its holder: the scheduler requeued the job, and
        the holder's count of it, not yet ended, would count it twice)."""
        return sum(1 if self.seated.get(job) else self.by_job[job].gpus for job in self.holder
                   if job in self.by_job and self.by_job[job].tenant == tenant and self.expires.get(job, now) >= now - 1.0)

    def _released(self, run: Run, busy: set[int], outcome: str, now: float) -> None:
        if run.released:
            return
        run.released = True
        busy.difference_update(run.places)
        if self.holder.get(run.job_id, ("", -1))[1] == run.epoch:
            del self.holder[run.job_id]
        self.running -= 1
        if run.spec is not None:
            seat = run.places[0] >= 1024
            self.held[run.spec.tenant] -= 1.0 / SEATS if seat else run.spec.gpus
            self.quota_held[run.spec.tenant] -= 1 if seat else run.spec.gpus
            self.stats.runs.append({"job": run.job_id, "tenant": run.spec.tenant, "weight": 1.0 / SEATS if seat else run.spec.gpus,
                                    "gpus": run.spec.gpus, "kind": run.spec.kind,
                                    "seat": seat, "start": run.granted, "end": now, "outcome": outcome})
        if outcome in ("succeeded", "failed", "cancelled"):
            if run.job_id not in self.done:
                self.last_end = now
            self.done.add(run.job_id)
        else:  # lost: queued again
            self.queued += 1

    async def _run(self, wid: str, key: str, run: Run, held: dict[str, Run], busy: set[int], freed: asyncio.Event,
                   free_times: list, vanish: asyncio.Event) -> None:
        base = f"/v1/workers/{wid}/jobs/{run.job_id}"
        spec = run.spec
        duration = spec.duration if spec is not None else 1.0
        ends = run.granted + duration * (spec.fail_at if spec is not None and spec.fail_at is not None else 1.0)
        outcome = "failed" if spec is not None and spec.fail_at is not None else "succeeded"
        try:
            for state in ("starting", "running"):
                body = {"epoch": run.epoch, "state": state, **({"server_url": "http://127.0.0.1:9/"} if state == "running" else {})}
                status, _ = await self.http.request("POST", f"{base}/state", key, body)
                if status != 200:
                    raise LookupError(f"state {status}")
            # a heartbeat at once after "running" proves the lease runs (what the worker agent does)
            if self.batched:
                status, _ = await self.http.request("POST", f"/v1/workers/{wid}/heartbeats", key, {"leases": [{"job_id": run.job_id, "epoch": run.epoch}]})
            else:
                status, _ = await self.http.request("POST", f"{base}/heartbeat", key, {"epoch": run.epoch})
            self.stats.heartbeats += 1
            self.stats.heartbeat_calls += 1
            run.proven = status == 200
            interval = LEASE_TTL / 3
            while time.time() < ends and not self.stopping:
                await asyncio.sleep(min(interval, max(0.0, ends - time.time())))
                if time.time() >= ends:
                    break
                if not self.batched and await self._heartbeat(wid, key, run):
                    outcome = "cancelled"
                    break
                elif self.batched and getattr(run, "cancelling", False):
                    outcome = "cancelled"
                    break
                elif self.batched and getattr(run, "lost", False):
                    raise LookupError("lost")
            status, _ = await self.http.request("POST", f"{base}/state", key, {"epoch": run.epoch, "state": outcome})
            if status != 200:
                raise LookupError(f"final state {status}")
        except (LookupError, OSError, asyncio.IncompleteReadError) as exc:  # OSError: the connection dropped three times
            self.stats.failures[f"run: {exc}" if isinstance(exc, LookupError) else f"run: {type(exc).__name__}"] += 1
            outcome = await self._state_of(run.job_id)  # refused: the lease is gone (lost, or the job was cancelled meanwhile)
        except asyncio.CancelledError:  # the worker vanished: nothing more is said
            held.pop(run.job_id, None)
            raise
        now = time.time()
        if self.first_end is None:
            self.first_end = now
        held.pop(run.job_id, None)
        self._released(run, busy, outcome, now)
        free_times.append((now, self.queued >= self.depth // 4))
        freed.set()

    async def _heartbeat(self, wid: str, key: str, run: Run) -> bool:
        """One heartbeat of one lease (a scheduler without batched heartbeats); whether the job is cancelling."""
        status, body = await self.http.request("POST", f"/v1/workers/{wid}/jobs/{run.job_id}/heartbeat", key, {"epoch": run.epoch})
        self.stats.heartbeats += 1
        self.stats.heartbeat_calls += 1
        if status != 200:
            raise LookupError(f"heartbeat {status}")
        run.proven = True
        if body.get("expires_at") and self.holder.get(run.job_id) == (wid, run.epoch):
            self.expires[run.job_id] = float(body["expires_at"])
        return bool(body.get("cancelling"))

    async def probe(self, db: Database, grants: int = 8) -> dict[str, Any]:
        """Before the drain, with the whole queue waiting: one more worker (8 whole devices) takes ``grants`` leases while
        nothing else runs; the database's statements, rows and blocks per lease request, and each request's latency."""
        key = self.keys["probe"]
        wid = await self._register(key, "probe", [{"index": i, "kind": "gpu", "name": "probe"} for i in range(8)])
        db.reset_statements()
        latencies, leases = [], []
        for _ in range(grants):
            t0 = time.perf_counter()
            status, body = await self.http.request("POST", f"/v1/workers/{wid}/lease", key, {})
            latencies.append(time.perf_counter() - t0)
            if status == 200 and body.get("lease"):
                leases.append(body["lease"])
        counted = db.statements()
        await self._end_at_once(wid, key, leases)
        found: dict[str, Any] = {"requests": grants, "granted": len(leases), "ms": [round(x * 1000, 1) for x in latencies]}
        if counted is not None:
            found.update({k: round(v / grants, 1) for k, v in counted.items()})
        # the same places filled by one request (a scheduler that grants one a request answers one)
        db.reset_statements()
        t0 = time.perf_counter()
        status, body = await self.http.request("POST", f"/v1/workers/{wid}/lease", key, {"max": grants})
        elapsed = time.perf_counter() - t0
        filled = (body.get("leases") or ([body["lease"]] if body.get("lease") else [])) if status == 200 else []
        counted = db.statements()
        await self._end_at_once(wid, key, filled)
        found["one_request"] = {"granted": len(filled), "ms": round(elapsed * 1000, 1)}
        if counted is not None and filled:
            found["one_request"].update({f"{k}_per_lease": round(v / len(filled), 1) for k, v in counted.items()})
        return found

    async def _end_at_once(self, wid: str, key: str, leases: list[dict[str, Any]]) -> None:
        """The probe's jobs end at once: starting, running, succeeded."""
        for lease in leases:
            base = f"/v1/workers/{wid}/jobs/{lease['job_id']}/state"
            for state in ("starting", "running", "succeeded"):
                await self.http.request("POST", base, key, {"epoch": lease["epoch"], "state": state,
                                                            **({"server_url": "http://127.0.0.1:9/"} if state == "running" else {})})
            self.done.add(lease["job_id"])
            self.queued -= 1

    async def _state_of(self, job: str) -> str:
        """The job's state as its tenant sees it: an ended one's, or ``lost`` (it is queued again, or will be)."""
        spec = self.by_job.get(job)
        if spec is None:
            return "lost"
        try:
            status, body = await self.http.request("GET", f"/v1/jobs/{job}", self.keys["tenants"][spec.tenant])
        except (OSError, asyncio.IncompleteReadError):  # dropped three times: the reconcile of held jobs settles it later
            return "lost"
        state = body.get("state") if status == 200 else None
        return state if state in ("succeeded", "failed", "cancelled") else "lost"

    async def _batched_heartbeats(self, wid: str, key: str, held: dict[str, Run], vanish: asyncio.Event) -> None:
        interval = LEASE_TTL / 3
        await asyncio.sleep(self.rng.uniform(0, interval))
        while not self.stopping:
            runs = [r for r in held.values() if r.task is not None]
            if runs:
                body = {"leases": [{"job_id": r.job_id, "epoch": r.epoch} for r in runs]}
                try:
                    status, answer = await self.http.request("POST", f"/v1/workers/{wid}/heartbeats", key, body)
                except (ConnectionError, asyncio.IncompleteReadError, OSError, asyncio.TimeoutError):
                    status, answer = 0, None  # the next interval tries again, as the worker agent does
                self.stats.heartbeat_calls += 1
                if status == 200:
                    self.stats.heartbeats += len(runs)
                    for item in answer["leases"]:
                        run = held.get(item["job_id"])
                        if run is not None and item.get("expires_at") and self.holder.get(run.job_id) == (wid, run.epoch):
                            self.expires[run.job_id] = float(item["expires_at"])
                        if run is not None and item.get("cancelling"):
                            run.cancelling = True  # type: ignore[attr-defined]
                        if run is not None and item.get("lost"):
                            run.lost = True  # type: ignore[attr-defined]
                else:
                    self.stats.failures[f"heartbeats {status}"] += 1
            await asyncio.sleep(interval)

    async def _vanish(self, wid: str, held: dict[str, Run], busy: set[int], beats: asyncio.Task | None) -> None:
        """The worker stops calling with its leases held; it comes back (registers again) after the lease TTL and more."""
        now = time.time()
        if beats is not None:
            beats.cancel()
        runs = list(held.values())
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        for run in runs:
            self._released(run, busy, "lost", now)
            self.stats.vanished.append({"job": run.job_id, "epoch": run.epoch, "at": now})
        held.clear()
        await asyncio.sleep(LEASE_TTL * self.rng.uniform(2.0, 3.0))  # back after its leases expired and were swept

    # -- drain --
    async def left(self, looked: int = 40) -> dict[str, Any]:
        """What an undrained run left: the jobs not ended by kind and size, and the wait reasons of up to ``looked`` of them."""
        waiting = [j for j in self.by_job if j not in self.done and j not in self.holder]
        kinds = Counter(f"{self.by_job[j].kind}x{self.by_job[j].gpus}" for j in waiting)
        reasons: Counter[str] = Counter()
        for job in waiting[:looked]:
            status, body = await self.http.request("GET", f"/v1/jobs/{job}", self.keys["tenants"][self.by_job[job].tenant])
            reasons[(body.get("wait_reason") or {}).get("code", f"state {body.get('state')}") if status == 200 else f"http {status}"] += 1
        return {"waiting": len(waiting), "running": len(self.holder), "kinds": dict(kinds), "reasons": dict(reasons),
                "tenants": len({self.by_job[j].tenant for j in waiting})}

    async def sample_shares(self, samples: list[dict[str, Any]]) -> None:
        """Every second: each tenant's held devices and its demand (held and queued)."""
        while not self.stopping:
            waiting: defaultdict[str, float] = defaultdict(float)
            for job, spec in self.by_job.items():
                if job not in self.done and job not in self.holder:
                    waiting[spec.tenant] += spec.gpus if spec.kind != "lora" else 1.0
            samples.append({"t": time.time(), "held": dict(self.held), "waiting": dict(waiting), "queued": self.queued})
            await asyncio.sleep(1.0)


def wait_past_quota(cluster: Cluster) -> float | None:
    """The longest wait for a first lease less what the job's own tenant's quota forced on it: the device-seconds of the
    tenant's jobs submitted before it over its ``max_gpus`` (a tenant at its quota waits for its own jobs, not starved)."""
    ahead: defaultdict[str, float] = defaultdict(float)
    worst = None
    for job in sorted(cluster.submitted_at, key=cluster.submitted_at.get):
        spec = cluster.by_job[job]
        if job in cluster.stats.first_wait:
            past = cluster.stats.first_wait[job] - ahead[spec.tenant] / cluster.max_gpus[spec.tenant]
            worst = past if worst is None else max(worst, past)
        ahead[spec.tenant] += spec.gpus * spec.duration
    return round(worst, 1) if worst is not None else None


async def drive(port: int, keys: dict[str, Any], args: argparse.Namespace, specs: list[Spec], db: Database,
                scheduler_pid: int, rng: random.Random) -> dict[str, Any]:
    http = Http(port, args.connections)
    cluster = Cluster(http, keys, specs, args, rng)
    # lease polls on connections of their own: a worker's poll waiting for its turn does not hold up its heartbeats and
    # state reports (a real worker's heartbeat threads have their own connections)
    cluster.polls = Http(port, args.connections)
    cluster.max_gpus = dict(zip(sorted(keys["tenants"]), args.max_gpus))
    # Does this scheduler take a worker's heartbeats in one call? A malformed body is refused (400) by a route that exists;
    # a scheduler without it answers 404 (then one call per lease).
    status, _ = await http.request("POST", "/v1/workers/none/heartbeats", keys["workers"][0], {"leases": "probe"})
    cluster.agent = status in (400, 422)
    cluster.batched = cluster.agent and not args.per_lease_heartbeats
    submit_s = await cluster.submit_all(args.clients)
    report: dict[str, Any] = {"batched_heartbeats": cluster.batched, "jobs": len(cluster.by_job),
                              "submissions_per_s": round(len(cluster.by_job) / submit_s, 1),
                              "submit_ms": {"p50": ms(percentile(cluster.stats.submit_latency, 0.5)),
                                            "p99": ms(percentile(cluster.stats.submit_latency, 0.99))}}
    report["grant_probe"] = await cluster.probe(db)
    report["plans"] = db.plans()
    cluster.depth = cluster.queued
    db.reset_statements()
    pg0, cpu0, t0 = postgres_cpu(), cpu_seconds(scheduler_pid), time.time()
    samples: list[dict[str, Any]] = []
    tasks = [asyncio.create_task(cluster.worker(i)) for i in range(len(keys["workers"]))]
    tasks += [asyncio.create_task(cluster.tenant_views(t)) for t in sorted(keys["tenants"])]
    tasks.append(asyncio.create_task(cluster.sample_shares(samples)))
    window: dict[str, Any] = {}
    deadline = time.time() + args.max_drain
    checked = time.time()
    while len(cluster.done) < len(cluster.by_job) and time.time() < deadline:
        await asyncio.sleep(0.25)
        if time.time() - checked > 5.0:
            checked = time.time()
            await cluster.reconcile()
        # the heartbeat window: the cluster as full as the first wave fills it (no grant for 3 s, half its places held or
        # more: a pause of grants in a cluster still filling is not it), until the first job ends
        if cluster.last_grant is not None and time.time() - cluster.last_grant > 3.0 and "start" not in window and cluster.first_end is None \
                and cluster.running >= cluster.places / 2:
            window = {"start": time.time(), "cpu": cpu_seconds(scheduler_pid), "pg": postgres_cpu(), "beats": cluster.stats.heartbeats,
                      "calls": cluster.stats.heartbeat_calls, "requests": http.requests, "held": round(cluster.running / max(1, cluster.places), 3)}
        if "start" in window and "end" not in window and cluster.first_end is not None:
            window.update(end=time.time(), cpu_end=cpu_seconds(scheduler_pid), pg_end=postgres_cpu(), beats_end=cluster.stats.heartbeats,
                          calls_end=cluster.stats.heartbeat_calls, requests_end=http.requests)
    if "start" in window and "end" not in window:  # no job ended since the cluster filled (jobs longer than the run)
        window.update(end=time.time(), cpu_end=cpu_seconds(scheduler_pid), pg_end=postgres_cpu(), beats_end=cluster.stats.heartbeats,
                      calls_end=cluster.stats.heartbeat_calls, requests_end=http.requests)
    drained = len(cluster.done) >= len(cluster.by_job)
    end = cluster.last_end if drained else time.time()
    left = await cluster.left() if not drained else None
    cluster.stopping = True
    cpu1, pg1 = cpu_seconds(scheduler_pid), postgres_cpu()
    statements = db.statements()
    tasks += [task for task in asyncio.all_tasks() if task is not asyncio.current_task() and task not in tasks]  # the runs too
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await http.close()
    await cluster.polls.close()
    stats = cluster.stats
    first = min((r["start"] for r in stats.runs), default=t0)
    whole = sum(1 for _ in keys["workers"]) * 8 - round(args.seat_share * len(keys["workers"]))
    seat_places = round(args.seat_share * len(keys["workers"])) * SEATS
    longest = max((s.duration for s in specs), default=0.0)
    bound = lower_bound([r for r in stats.runs if r["outcome"] != "lost"], whole, seat_places, longest, cluster.max_gpus)
    pack = packed([r for r in stats.runs if r["outcome"] != "lost"], len(keys["workers"]), round(args.seat_share * len(keys["workers"])))
    report.update({
        "drained": drained, "drain_s": round(end - first, 1), "ideal_s": round(bound, 1), "drain_vs_ideal": round((end - first) / bound, 3) if bound else None,
        "packed_s": round(pack, 1), "drain_vs_packed": round((end - first) / pack, 3) if pack else None,
        "grants": stats.grants, "grant_ms": {"p50": ms(percentile(stats.grant_latency, 0.5)), "p99": ms(percentile(stats.grant_latency, 0.99)),
                                             "n": len(stats.grant_latency)},
        "empty_polls": stats.empty_polls, "leases_per_request": round(stats.grants / stats.grant_requests, 2) if stats.grant_requests else None,
        "view_ms": {"p50": ms(percentile(stats.view_latency, 0.5)), "p99": ms(percentile(stats.view_latency, 0.99)), "n": len(stats.view_latency)},
        "scheduler_cores_drain": round((cpu1 - cpu0) / max(1e-9, end - t0), 3),
        "postgres_cores_drain": round((pg1 - pg0) / max(1e-9, end - t0), 3) if db.kind == "postgresql" else None,
        "fairness": fairness(samples, whole + seat_places / SEATS, cluster.max_gpus, until=max((r["end"] for r in stats.runs), default=end)),
        "failures": dict(stats.failures), "violations": stats.violations,
        "max_first_wait_s": round(max(stats.first_wait.values()), 1) if stats.first_wait else None,
        "max_wait_past_quota_s": wait_past_quota(cluster),
        "vanished_leases": len(stats.vanished), "left": left,
        "utilization": utilization(samples, whole + seat_places / SEATS, cluster.depth),
    })
    if "end" in window:
        span = window["end"] - window["start"]
        beats = window["beats_end"] - window["beats"]
        report["heartbeat_window"] = {
            "seconds": round(span, 1), "renewals": beats, "calls": window["calls_end"] - window["calls"],
            "renewals_per_s": round(beats / span, 1), "leases_held_of_places": window["held"],
            "other_requests": window["requests_end"] - window["requests"] - (window["calls_end"] - window["calls"]),
            "scheduler_cpu_s_per_1000": round(1000 * (window["cpu_end"] - window["cpu"]) / max(1, beats), 3),
            "scheduler_cores": round((window["cpu_end"] - window["cpu"]) / span, 3),
            "postgres_cores": round((window["pg_end"] - window["pg"]) / span, 3) if db.kind == "postgresql" else None,
        }
    else:
        report["heartbeat_window"] = None
    if statements is not None and stats.grants:
        report["postgres_drain_per_grant"] = {k: round(v / stats.grants, 1) for k, v in statements.items()}  # all traffic over grants
        report["top_statements"] = db.top_statements()
    report["_samples_checks"] = {"runs": stats.runs, "vanished": stats.vanished}
    return report


# ----- checks done after the run (the CI test asserts them) ---------------------------------------------------------------
def one_run(args: argparse.Namespace, workers: int, db_kind: str, scratch: Path, server: Any = None) -> dict[str, Any]:
    rng = random.Random(args.seed)
    jobs = args.jobs if args.jobs else workers * 10
    tenants = min(args.tenants, jobs)
    places = workers * 8 + round(args.seat_share * workers) * (SEATS - 1)
    max_gpus = quotas(tenants, places)
    specs = workload(tenants, jobs, (args.duration[0], args.duration[1]), rng, args.churn, max_gpus)
    per_tenant = defaultdict(int)
    for s in specs:
        per_tenant[s.tenant] += 1
    max_queued = [per_tenant[f"t{t:03d}"] + 10 for t in range(tenants)]
    db = Database(db_kind, scratch, server)
    data_dir = (args.log_dir or scratch) / f"data-{db_kind}-{workers}"
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = ["--backfill-age", str(args.backfill_age), "--max-connections", str(max(2000, args.connections * 2 + 200))]
    started = time.time()
    keys = run_setup(args.code, db.url, tenants, workers, max_gpus, max_queued)
    process, port = start_scheduler(args.code, db.url, data_dir, settings, LEASE_TTL)
    args.max_gpus = max_gpus
    try:
        report = asyncio.run(drive(port, keys, args, specs, db, process.pid, rng))
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    checks = report.pop("_samples_checks")
    delays = requeue_delays(db.url, checks["vanished"])
    report.update({
        "db": db_kind, "workers": workers, "devices": workers * 8, "places": places, "tenants": tenants,
        "requeue_s_max": round(max(delays), 1) if delays else None, "lease_ttl_s": LEASE_TTL,
        # the stated bound on a job's wait for its first lease: the backfill age, two of the longest jobs, a TTL, 5 s of polls
        "wait_bound_s": round(args.backfill_age + 2 * args.duration[1] + LEASE_TTL + 5.0, 1),
        "total_s": round(time.time() - started, 1),
    })
    return report


def main() -> None:
    global LEASE_TTL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="100", help="simulated workers of 8 devices (a comma list: one run each)")
    parser.add_argument("--jobs", type=int, default=0, help="jobs queued (default: 10 per worker)")
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--db", choices=("sqlite", "postgresql", "both"), default=None, help="default: postgresql (--quick: sqlite)")
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1], help="the source tree whose scheduler runs")
    parser.add_argument("--duration", type=float, nargs=2, default=(60.0, 90.0), metavar=("MIN", "MAX"), help="job lengths in seconds")
    parser.add_argument("--seat-share", type=float, default=0.25, help="workers whose last device is a shared server of 4 seats")
    parser.add_argument("--churn", type=float, default=0.02, help="the share of jobs that fail, and of jobs cancelled")
    parser.add_argument("--vanish", type=float, default=0.0,
                        help="chance a minute that a worker running jobs vanishes (once; it comes back after 2-3 lease TTLs)")
    parser.add_argument("--per-lease-heartbeats", action="store_true",
                        help="one heartbeat call per lease even where the scheduler takes a worker's in one (what the worker agent sends)")
    parser.add_argument("--lease-max", type=int, default=0,
                        help="leases a worker asks for in one request (0: as many as it has free places, as the worker agent does; "
                             "1: one a request)")
    parser.add_argument("--poll", type=float, default=1.0, help="a worker's seconds between lease requests while nothing is granted")
    parser.add_argument("--view-every", type=float, default=5.0, help="seconds between a tenant's looks at its jobs")
    parser.add_argument("--clients", type=int, default=16, help="concurrent submitters")
    parser.add_argument("--connections", type=int, default=64, help="HTTP connections the simulation keeps open")
    parser.add_argument("--backfill-age", type=float, default=600.0)
    parser.add_argument("--lease-ttl", type=float, default=LEASE_TTL, help="the scheduler's lease TTL (heartbeats every third of it)")
    parser.add_argument("--max-drain", type=float, default=1800.0, help="give up draining after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="SQLite, 6 workers, 60 jobs of 3-6 s, churn and vanishing workers")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument("--log-dir", type=Path, help="keep the scheduler's data folder (its log) here")
    parser.add_argument("--table", type=Path, nargs="+", metavar="REPORT", help="print saved --json reports as a markdown table, and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    if args.quick:
        args.workers, args.jobs, args.tenants, args.db = "6", 60, 6, args.db or "sqlite"
        args.duration, args.churn, args.vanish, args.view_every, args.backfill_age = (3.0, 6.0), 0.05, 6.0, 1.0, 5.0
        args.lease_ttl, args.max_drain = 4.0, 240.0
    LEASE_TTL = args.lease_ttl
    args.db = args.db or "postgresql"
    from bench_machine import machine_facts  # noqa: PLC0415

    results = []
    counts = [int(n) for n in str(args.workers).split(",")]
    with tempfile.TemporaryDirectory(prefix="sched-scale-") as scratch_dir:
        scratch = Path(scratch_dir)
        for db_kind in (("sqlite", "postgresql") if args.db == "both" else (args.db,)):
            for n in counts:
                if db_kind == "postgresql":
                    from tinkergym.scheduler.devdb import private_postgres

                    (scratch / f"{db_kind}-{n}").mkdir()
                    with private_postgres({"shared_preload_libraries": "pg_stat_statements"}) as server:
                        with_statements(server)
                        results.append(one_run(args, n, db_kind, scratch / f"{db_kind}-{n}", server))
                else:
                    (scratch / f"{db_kind}-{n}").mkdir()
                    results.append(one_run(args, n, db_kind, scratch / f"{db_kind}-{n}"))
                if not args.json:
                    print(json.dumps(results[-1], indent=1), flush=True)
    report = {"runs": results, "code": str(args.code), "machine": machine_facts("cpu") if not args.quick else {"cpus": os.cpu_count()}}
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
