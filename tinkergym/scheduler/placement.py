"""Why a queued job waits, computed from the tables on read (the reason column of Slurm's ``squeue``).

A queued job's reason is one of, first match wins:

- ``no_worker``: no worker that may run the tenant's jobs is alive (registered, seen within the worker timeout,
  not quarantined, its credential serving the tenant);
- ``no_model``: none of those workers offers the job's model;
- ``too_few_devices``: none of the workers offering the model has as many devices as the job asks for, nor a seat
  of a shared server that the job fits (:mod:`tinkergym.scheduler.seats`);
- ``too_little_memory``: the workers with enough devices have too little memory on each for what the training job
  keeps there (:mod:`tinkergym.scheduler.memory`: the figures, and what to change);
- ``quota``: the tenant's jobs hold its ``max_gpus`` devices (this job would go past it);
- ``behind``: K queued jobs before it (by priority, then age) can run on the workers that can host it;
- ``memory_held``: a seat it fits is free, but the memory its shared server measured leaves too little room for it
  now (:func:`tinkergym.scheduler.memory.seat_refusal`: the figures); it starts when a job there ends or frees memory;
- ``busy``: a worker could host it, but its devices (and the seats it fits) are held by other jobs;
- ``ready``: a worker has the free devices (or a free seat) for it: it starts at that worker's next lease request.

The first four are *unplaceable*: the job never starts until a worker that can host it registers. Nothing is
stored: the reason follows the tables (workers, devices, allocations, the queue) and the clock, as
:func:`tinkergym.scheduler.granting.grant` reads them. The app's sweeper appends a ``waiting`` event when a queued
job's reason changes (:func:`note_wait_reasons`), keeping the last reason of each job in memory only: after a
restart each queued job gets one ``waiting`` event again.

:func:`refusal` reads what workers have ever offered (registered workers, alive or gone): ``tinkergym scheduler serve
--refuse-unplaceable`` refuses a job that none of them could host.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, TypeVar
from collections.abc import Callable, Iterable, Iterator

from sqlalchemy import select
from sqlalchemy.engine import Connection

from tinkergym.scheduler import fairshare, measured, memory, states
from tinkergym.scheduler.bounds import WorkerBounds, parse_bounds
from tinkergym.scheduler.db import allocations, api_keys, devices, jobs, tenants, workers
from tinkergym.scheduler.seats import league_seats, model_of, parse_shared, players
from tinkergym.scheduler.worker_registry import worker_timeout

NO_WORKER, NO_MODEL, TOO_FEW_DEVICES, TOO_LITTLE_MEMORY = "no_worker", "no_model", "too_few_devices", "too_little_memory"
QUOTA, BEHIND, MEMORY_HELD, BUSY, READY = "quota", "behind", "memory_held", "busy", "ready"
#: Reasons that hold until a worker that can host the job registers: nothing the queue does starts the job.
UNPLACEABLE = (NO_WORKER, NO_MODEL, TOO_FEW_DEVICES, TOO_LITTLE_MEMORY)


@dataclass(frozen=True)
class Host:
    """A registered worker as placement sees it: the models it may offer (within its credential), its active whole
    devices (how many, how many free) and its active seats (each seat's base and whether it is free)."""

    id: str
    models: frozenset[str]
    devices: int
    free: int
    kind: str
    bounds: WorkerBounds
    alive: bool
    seats: tuple[tuple[dict[str, Any], bool, Any], ...] = ()  # (base, free, row with the device's measured memory)
    shared_devices: int = 0
    memory: int | None = None  # bytes of its smallest whole device (None: not said)
    shapes: dict[str, Any] | None = None  # model -> its shape, for the models it counted
    room: measured.SeatRoom | None = None  # whether a free seat's device holds a job now (None: not checked)

    def hosts(self, job: dict[str, Any]) -> bool:
        """Whether it could ever run ``job`` (a row with kind, gpus, config): on whole devices or on a seat."""
        return model_of(job["config"]) in self.models and (self._whole(job, self.devices) or self._seat(job, free_only=False))

    def has_room(self, job: dict[str, Any]) -> bool:
        """Whether it could run ``job`` now: enough free whole devices, or a free seat the job fits."""
        return self._whole(job, self.free) or self._seat(job, free_only=True)

    def memory_refusal(self, job: dict[str, Any]) -> str | None:
        """Why ``job`` on its devices here would not fit their memory (:func:`tinkergym.scheduler.memory.refusal`)."""
        shape = (self.shapes or {}).get(model_of(job["config"]))
        return memory.refusal(job["kind"], job["gpus"], job["config"], shape, self.memory, self.kind)

    def _whole(self, job: dict[str, Any], devices: int) -> bool:
        return players(job["config"]) == 1 and job["gpus"] <= devices and self.memory_refusal(job) is None

    def _seat(self, job: dict[str, Any], free_only: bool) -> bool:
        """Whether a shared server here has the seats ``job`` fits (a league: one a player), free ones and room for it with ``free_only``."""
        need = players(job["config"])
        candidates = [(row, shared) for shared, free, row in self.seats if free or not free_only]
        return any(len(rows) >= need and (not free_only or self.seat_refusal(rows[0], job) is None)
                   for rows in league_seats(candidates, job["kind"], job["gpus"], job["config"]).values())

    def most_seats(self, job: dict[str, Any]) -> int:
        """The most seats ``job`` fits on one shared server here."""
        found = league_seats([(row, shared) for shared, _, row in self.seats], job["kind"], job["gpus"], job["config"])
        return max((len(rows) for rows in found.values()), default=0)

    def seat_refusal(self, row: Any, job: dict[str, Any]) -> str | None:
        """Why a free seat (its ``row``) cannot hold ``job`` now by its device's measured memory; None when it can."""
        return None if self.room is None else self.room.refusal(self.id, row, job)

    def memory_refusals(self, job: dict[str, Any]) -> list[str]:
        """Why each free seat that ``job`` fits by the rule cannot hold it now by memory (empty: none is refused so)."""
        found = []
        need = players(job["config"])
        free = [(row, shared) for shared, is_free, row in self.seats if is_free]
        for rows in league_seats(free, job["kind"], job["gpus"], job["config"]).values():
            if len(rows) >= need and (why := self.seat_refusal(rows[0], job)):
                found.append(why)
        return found

    def kind_of(self) -> tuple[Any, ...]:
        """What placement reads of it that does not change with its free places: hosts alike in it answer every
        question but ``has_room`` alike (so one stands for all, :class:`Placement`)."""
        seats = tuple(sorted((json.dumps(base, sort_keys=True), row.seat_of) for base, _, row in self.seats))
        return (self.models, self.devices, self.kind, self.bounds, seats, self.shared_devices, self.memory,
                json.dumps(self.shapes, sort_keys=True, default=str))

    @property
    def physical(self) -> int:
        """Its devices, whole or shared (a shared one counted once, whatever its seats)."""
        return self.devices + self.shared_devices


def load_hosts(conn: Connection, now: float, timeout: float) -> list[Host]:
    """Every registered worker whose credential stands (not revoked, bounds readable); ``alive`` when seen within
    ``timeout`` and not quarantined."""
    rows = conn.execute(
        select(workers.c.id, workers.c.models, workers.c.model_shapes, workers.c.last_seen_at, workers.c.quarantined_at, api_keys.c.worker_bounds)
        .select_from(workers.join(api_keys, api_keys.c.id == workers.c.key_id)).where(api_keys.c.revoked_at.is_(None))
    ).all()
    counts: dict[str, dict[str, Any]] = {}
    room = measured.SeatRoom(conn)
    for device in conn.execute(
        select(devices.c.worker_id, devices.c.kind, devices.c.seat_of, devices.c.shared, devices.c.memory_bytes,
               devices.c.id.in_(select(allocations.c.device_id)).label("held"), *measured.SEAT_COLUMNS)
        .where(devices.c.active.is_(True))
    ):
        entry = counts.setdefault(device.worker_id, {"devices": 0, "free": 0, "kind": device.kind, "seats": [], "shared": set(), "memory": []})
        if device.seat_of is None:
            entry["devices"] += 1
            entry["free"] += 0 if device.held else 1
            entry["memory"].append(device.memory_bytes)
        else:
            entry["seats"].append((parse_shared(device.shared) or {}, not device.held, device))
            entry["shared"].add(device.seat_of)
    found = []
    for row in rows:
        bounds = parse_bounds(row.worker_bounds)
        if bounds is None:
            continue
        models = bounds.offered(row.models)
        entry = counts.get(row.id, {"devices": 0, "free": 0, "kind": bounds.kind or "device", "seats": [], "shared": set(), "memory": []})
        alive = now - row.last_seen_at <= timeout and row.quarantined_at is None
        found.append(Host(row.id, frozenset(models), entry["devices"], entry["free"], str(entry["kind"]), bounds, alive,
                          tuple(entry["seats"]), len(entry["shared"]), memory.smallest(entry["memory"]), memory.parse_shapes(row.model_shapes), room))
    return found


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _devices(n: int, kind: str) -> str:
    return _plural(n, "GPU") if kind == "gpu" else _plural(n, "slot" if kind == "slot" else "device")


class Placement:
    """One read of the cluster (workers, devices, allocations, tenants' quotas) that says why queued jobs wait."""

    def __init__(self, conn: Connection, settings: Any, now: float, hosts: list[Host] | None = None) -> None:
        self.conn = conn
        self.hosts = hosts if hosts is not None else alive_hosts(conn, settings, now)
        self._quota: dict[str, tuple[int, int]] = {}
        # Hosts alike (Host.kind_of) answer alike: each question is asked of one of them, whatever the cluster's size.
        alike: dict[tuple[Any, ...], list[Host]] = {}
        for host in self.hosts:
            alike.setdefault(host.kind_of(), []).append(host)
        self._kinds = [(members[0], frozenset(h.id for h in members)) for members in alike.values()]
        self._reps = [rep for rep, _ in self._kinds]
        self._capable_of: dict[tuple[int, ...], frozenset[str]] = {}

    def quota(self, tenant: str) -> tuple[int, int]:
        """(devices the tenant's jobs hold, its max_gpus)."""
        if not self._quota:  # every tenant's at the first question: two queries, whatever the number of tenants
            from tinkergym.scheduler.granting import held_by_tenants

            held = held_by_tenants(self.conn)
            self._quota = {t: (held.get(t, 0), int(limit or 0)) for t, limit in self.conn.execute(select(tenants.c.id, tenants.c.max_gpus))}
        return self._quota.get(tenant, (0, 0))

    def _over_quota(self, job: dict[str, Any]) -> bool:
        held, limit = self.quota(job["tenant_id"])
        return held + job["gpus"] > limit

    def _capable(self, job: dict[str, Any]) -> frozenset[str]:
        kinds = tuple(i for i, (rep, _) in enumerate(self._kinds) if rep.bounds.serves(job["tenant_id"]) and rep.hosts(job))
        found = self._capable_of.get(kinds)
        if found is None:
            found = self._capable_of[kinds] = frozenset().union(*(self._kinds[i][1] for i in kinds))
        return found

    def placed(self, job: dict[str, Any]) -> dict[str, str] | None:
        """The reason of ``job`` that does not depend on the jobs ahead of it (all but ``behind``); None when those are clear."""
        model, gpus, tenant = model_of(job["config"]), job["gpus"], job["tenant_id"]
        served = [h for h in self._reps if h.bounds.serves(tenant)]  # one host of each kind: what is asked here is alike in a kind
        if not served:
            return reason(NO_WORKER, f"no worker is alive to run tenant {tenant}'s jobs; start one: tinkergym worker --models {model}")
        offering = [h for h in served if model in h.models]
        if not offering:
            models = sorted({m for h in served for m in h.models})
            return reason(NO_MODEL, f"no worker offers model {model} (alive workers offer: {', '.join(models[:10]) or 'nothing'}); "
                                    f"start one: tinkergym worker --models {model}")
        if not any(h.hosts(job) for h in offering):
            big_enough = [h for h in offering if gpus <= h.devices]
            refusals = [h.memory_refusal(job) for h in big_enough]
            if big_enough and all(refusals):
                largest = max(big_enough, key=lambda h: h.memory or 0)
                return reason(TOO_LITTLE_MEMORY, f"no worker offering {model} has devices with the memory this job needs: on the "
                                                 f"largest, {refusals[big_enough.index(largest)]}")
            need = players(job["config"])
            if need > 1:
                most = max(h.most_seats(job) for h in offering)
                return reason(TOO_FEW_DEVICES, f"a league of {need} players takes {need} seats of one shared server serving {model} "
                                               f"(its players share that server's passes; a league is never split over servers), and the "
                                               f"largest such server has {most}: give fewer players, or start a worker with more seats "
                                               f"(tinkergym worker --shared-devices 0 --seats {need})")
            largest = max(offering, key=lambda h: h.devices)
            seats = "; seats of shared servers take only LoRA train or sft jobs of one device with the server's model, dtype and " \
                    "at most its max_lora_rank" if any(h.seats for h in offering) else ""
            fewer = f": resubmit it with --gpus {largest.devices} or fewer, or start a worker with {_devices(gpus, largest.kind)}" \
                if 0 < largest.devices < gpus else ""
            return reason(TOO_FEW_DEVICES, f"no worker offering {model} has {_devices(gpus, largest.kind)} "
                                           f"(the largest has {_devices(largest.devices, largest.kind)}){fewer}{seats}")
        if self._over_quota(job):
            held, limit = self.quota(tenant)
            return reason(QUOTA, f"tenant {tenant}'s jobs hold {held} of its {limit} devices (max_gpus); this job needs {gpus}")
        return None

    def reasons(self, queue: Iterable[dict[str, Any]], wanted: set[str] | None = None) -> dict[str, dict[str, str]]:
        """The reason of each job of ``queue`` (queued jobs in grant order, from the front) whose id is in ``wanted``
        (None: every one); stops once all wanted jobs are seen."""
        found: dict[str, dict[str, str]] = {}
        ahead: dict[frozenset[str], int] = {}  # the jobs seen so far that may start, by the workers that could host them
        for job in queue:
            if wanted is not None and len(found) == len(wanted):
                break
            early = self.placed(job)
            capable = self._capable(job) if early is None else frozenset()
            if wanted is None or job["id"] in wanted:
                found[job["id"]] = early or self._late(job, capable, ahead)
            if capable:
                ahead[capable] = ahead.get(capable, 0) + 1
        return found

    def _late(self, job: dict[str, Any], capable: frozenset[str], ahead: dict[frozenset[str], int]) -> dict[str, str]:
        k = sum(n for hosts, n in ahead.items() if hosts & capable)
        if k:
            return reason(BEHIND, f"behind {_plural(k, 'queued job')} that go first on the workers that can host it")
        if not any(h.has_room(job) for h in self.hosts if h.id in capable):
            short = [why for h in self.hosts if h.id in capable for why in h.memory_refusals(job)]
            if short:
                return reason(MEMORY_HELD, f"a free seat fits it, but not its memory now: {short[0]}")
            if len(capable) == 1:
                return reason(BUSY, "the 1 worker that can host it has its devices held by other jobs")
            return reason(BUSY, f"the {len(capable)} workers that can host it have their devices held by other jobs")
        return reason(READY, "a worker has free devices for it: it starts at that worker's next lease request")


def reason(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


#: Queued jobs a job's view reads from the front of the grant order to say why the job waits; past them it is "behind at
#: least" that many (the sweeper's pass, which reads :data:`tinkergym.scheduler.leases.MAX_SCAN`, says more).
VIEW_SCAN = 500


def alive_hosts(conn: Connection, settings: Any, now: float) -> list[Host]:
    return [h for h in load_hosts(conn, now, worker_timeout(settings)) if h.alive]


def grant_order(conn: Connection, limit: int, page: int = 200) -> Iterator[dict[str, Any]]:
    """The queued jobs in the order a busy cluster would start them (:func:`tinkergym.scheduler.fairshare.fair_queue` with
    turns), the first ``limit`` at most."""
    share = fairshare.shares(conn, None)
    for i, job in enumerate(fairshare.fair_queue(conn, sorted(share), fairshare.held_devices(conn), share, depth=limit, page=page, turns=True)):
        if i >= limit:
            return
        yield job


def wait_reasons(conn: Connection, settings: Any, now: float, queued: list[dict[str, Any]], app: Any = None) -> dict[str, dict[str, str]]:
    """The reasons of the ``queued`` jobs (rows with id, tenant_id, gpus, config, state): what the sweeper's last pass
    found for them where it is recent (``app``'s), else read now from the front of the grant order, :data:`VIEW_SCAN`
    jobs at most, with the workers read once every ``cache_s`` of the app. A view costs what its jobs do, not the
    cluster's queue."""
    wanted = {j["id"] for j in queued if j["state"] == states.QUEUED}
    if not wanted:
        return {}
    found: dict[str, dict[str, str]] = {}
    passed = getattr(app.state, "wait_pass", None) if app is not None else None
    if passed is not None and getattr(settings, "cache_s", 0.0) > 0 and now - passed["at"] <= passed["every"] * 2:
        found = {job_id: passed["reasons"][job_id] for job_id in wanted if job_id in passed["reasons"]}
        if passed.get("cut"):  # the pass read the front of a longer queue: a job it did not reach, queued before it, is behind that front
            found.update({j["id"]: reason(BEHIND, f"behind at least {passed['cut']} queued jobs that go first") for j in queued
                          if j["id"] in wanted and j["id"] not in found and j.get("created_at", now) <= passed["at"]})
    missing = wanted - set(found)
    if missing:
        if app is not None and getattr(settings, "cache_s", 0.0) > 0:
            front = front_reasons(app, conn, settings, now)
            found.update({job_id: front[job_id] for job_id in missing if job_id in front})
        else:
            hosts = cached_hosts(app, conn, settings, now) if app is not None else None
            found.update(Placement(conn, settings, now, hosts).reasons(grant_order(conn, VIEW_SCAN), missing))
        for job_id in missing - set(found):
            found[job_id] = reason(BEHIND, f"behind at least {VIEW_SCAN} queued jobs that go first")
    return found


def front_reasons(app: Any, conn: Connection, settings: Any, now: float) -> dict[str, dict[str, str]]:
    """The reasons of the first :data:`VIEW_SCAN` jobs of the grant order, read at most every ``settings.cache_s`` (real
    time) for the app, by one view at a time: the views that ask meanwhile wait for it and share what it read (at 20
    views a second, each reading the front itself was half the scheduler's work at 1,000 workers)."""
    with app.state.front_lock:
        return app_cached(app, "front_cache", settings.cache_s,
                          lambda: Placement(conn, settings, now, cached_hosts(app, conn, settings, now)).reasons(grant_order(conn, VIEW_SCAN)))


def cached_hosts(app: Any, conn: Connection, settings: Any, now: float) -> list[Host]:
    """The live workers as placement sees them, read at most every ``settings.cache_s`` (real time) for the app."""
    return app_cached(app, "hosts_cache", getattr(settings, "cache_s", 0.0), lambda: alive_hosts(conn, settings, now))


T = TypeVar("T")


def app_cached(app: Any, name: str, ttl: float, read: Callable[[], T]) -> T:
    """What ``read()`` gives, kept in ``app.state.<name>`` with the time it was read and given again for ``ttl`` seconds
    of real time (0: read every time)."""
    cached = getattr(app.state, name, None)
    if cached is not None and time.monotonic() - cached[0] < ttl:
        return cached[1]
    value = read()
    setattr(app.state, name, (time.monotonic(), value))
    return value


# ----- what workers have ever offered ----------------------------------------------------------------
def refusal(conn: Connection, tenant: str, model: Any, gpus: int, kind: str = "train", config: Any = None) -> str | None:
    """Why no registered worker could ever host a ``kind`` job of ``tenant`` for ``model`` on ``gpus`` devices (its
    ``config``: the memory check); None when one could."""
    hosts = [h for h in load_hosts(conn, 0.0, float("inf")) if h.bounds.serves(tenant)]
    most: dict[str, int] = {}
    for host in hosts:
        for name in host.models:
            most[name] = max(most.get(name, 0), host.physical)
    cluster = "; ".join(f"{m}: up to {n} device(s)" for m, n in sorted(most.items())[:20]) or "no worker has registered"
    if model not in most:
        return f"no worker offers model {model} (the workers offer {cluster}); start one: tinkergym worker --models {model}"
    if gpus > most[model]:
        fewer = f": submit it with --gpus {most[model]} or fewer" if most[model] else ""
        return f"no worker offering {model} has {gpus} devices (the workers offer {cluster}){fewer}"
    job = {"kind": kind, "gpus": gpus, "config": {**(config or {}), "model": model}}
    if not any(h.hosts(job) for h in hosts):
        refusals = [r for h in hosts if model in h.models and gpus <= h.devices and (r := h.memory_refusal(job))]
        if refusals:
            return f"no worker offering {model} has devices with the memory it needs: {refusals[0]}"
    return None


# ----- the sweeper's pass ----------------------------------------------------------------------------
#: The sweeper's pass of wait reasons takes at most this share of its time: after a pass of t seconds, the next waits
#: t / DUTY (and at least a sweep interval), so a large cluster's passes come less often and a small one's every sweep.
DUTY = 0.05
#: Jobs whose ``waiting`` events one transaction of the pass writes: at 10,000 queued jobs one transaction for all of them
#: held thousands of job rows for seconds, and heartbeats, state reports and grants of those jobs waited on it.
NOTE_BATCH = 100


def note_wait_reasons(app: Any) -> int:
    """Append a ``waiting`` event (``code``, ``message``) to each queued job whose reason code changed since the last pass;
    how many. The last reasons live in ``app.state.wait_pass`` (memory only; job views read them, see :func:`wait_reasons`)."""
    from tinkergym.scheduler.leases import MAX_SCAN

    store = app.state.store
    started = time.perf_counter()
    before = getattr(app.state, "wait_pass", None) or {}
    last: dict[str, dict[str, str]] = before.get("reasons", {})
    unnoted: set[str] = before.get("unnoted", set())  # jobs the last pass could not note (held by another transaction)
    with store.read() as conn:
        now = store.clock()
        queue = list(grant_order(conn, MAX_SCAN))
        found = Placement(conn, app.state.settings, now).reasons(queue) if queue else {}
    changed = {job_id: r for job_id, r in found.items() if last.get(job_id, {}).get("code") != r["code"] or job_id in unnoted}
    noted, skipped = 0, set()
    items = list(changed.items())
    for at in range(0, len(items), NOTE_BATCH):  # short transactions: each holds its jobs' rows only while it writes them
        batch = dict(items[at:at + NOTE_BATCH])
        with store.transaction() as conn:
            # the batch's jobs still queued, locked in id order as a worker's heartbeats lock theirs, and not waited for:
            # a job another transaction holds is changing (granted, cancelled); the next pass notes it if it still waits
            query = select(jobs.c.id).where(jobs.c.id.in_(sorted(batch)), jobs.c.state == states.QUEUED).order_by(jobs.c.id)
            if conn.dialect.name != "sqlite":
                query = query.with_for_update(key_share=True, skip_locked=True)
            taken = list(conn.execute(query).scalars())
            for job_id in taken:
                store.append_event(conn, job_id, "waiting", batch[job_id])
                noted += 1
            skipped |= set(batch) - set(taken)
    _end_reservations(app, queue, len(queue) < MAX_SCAN)
    took = time.perf_counter() - started
    app.state.wait_pass = {"at": now, "reasons": found, "took": took, "cut": len(queue) if len(queue) >= MAX_SCAN else 0, "unnoted": skipped,
                           "every": max(app.state.settings.sweep_interval_s, took / DUTY)}
    return noted


def _end_reservations(app: Any, queue: list[dict[str, Any]], whole: bool) -> None:
    """End the reservation of each starving job no longer queued (granted elsewhere, cancelled): ``queue`` says which
    are when it is the ``whole`` queue; past the pass's reach, the reserved jobs' states are read (one query a 500)."""
    reservations = getattr(app.state, "reservations", None)
    if not reservations:
        return
    reserved = sorted(reservations)
    if whole:
        waiting = {job["id"] for job in queue}
    else:
        waiting = set()
        with app.state.store.read() as conn:
            for at in range(0, len(reserved), 500):
                waiting.update(conn.execute(select(jobs.c.id).where(jobs.c.id.in_(reserved[at:at + 500]), jobs.c.state == states.QUEUED)).scalars())
    for job_id in reserved:
        if job_id not in waiting:
            reservations.pop(job_id, None)


def wait_pass_due(app: Any) -> bool:
    """Whether the sweeper's next pass of wait reasons is due (:data:`DUTY`)."""
    passed = getattr(app.state, "wait_pass", None)
    return passed is None or app.state.store.clock() - passed["at"] >= passed["every"] - 1e-9
