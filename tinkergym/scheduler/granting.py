"""Granting: a worker asks for leases and gets the queued jobs that fit its free places, in the cluster's order.

A grant (:func:`grant`, :func:`grant_many`) is pull: a worker asks, and gets at most one job that fits its free devices. A job
gets all its devices or none: one ``allocations`` row per device is inserted in the transaction that moves
the job ``queued -> leased``, and ``allocations.device_id`` is the primary key, so a device granted twice
fails the transaction (all or none) whatever the code does. The queue order is the fair-share order of
:mod:`tinkergym.scheduler.fairshare` (the tenant furthest below its share; within a tenant, priority then age). A job that
cannot start here does not block smaller jobs behind it (backfill), except a job that has waited longer than
``backfill_age_s``: one worker that could host it (it serves the model and has enough devices; the first to meet it)
takes no job after it in the order, so that worker's devices drain to it while the rest of the cluster backfills, and
large jobs are not starved (Slurm's backfill reserves for its top job alike). A job whose tenant holds ``tenants.max_gpus`` devices already waits
without blocking anyone. A LoRA job that fits a free seat of a shared training server takes that seat before a whole
device (:mod:`tinkergym.scheduler.seats`: the placement rule); a seat is a row of ``devices`` like any device, so
the same constraint holds it, and it counts as one device toward the tenant's quota. A LoRA job resumes on either kind
of place, whichever wrote its checkpoints: a session of a shared base and a whole server start an adapter from the
same draws and load each other's states (:mod:`tinkergym.backends.torch.lora_states`).

A lease itself (its epoch, token, renewals and expiry) is :mod:`tinkergym.scheduler.leases`'s.
"""

from __future__ import annotations

import json
import math
from typing import Any

from sqlalchemy import and_, case, func, insert, or_, select
from sqlalchemy.engine import Connection

from tinkergym.scheduler import fairshare, measured, memory, states
from tinkergym.scheduler.bounds import WorkerBounds
from tinkergym.scheduler.db import allocations, checkpoints, devices, jobs, tenants, workers
from tinkergym.scheduler.leases import server_token, token_digest
from tinkergym.scheduler.repository import JobStore
from tinkergym.scheduler.seats import fits, league_seats, model_of, parse_shared, players
from tinkergym.scheduler.worker_registry import locked, touch, worker_timeout

#: The PostgreSQL advisory lock every grant takes for its transaction: grants run one at a time, whatever the number of
#: scheduler processes. Concurrent grants would contend for the same jobs at the head of the queue and lock tenants' rows
#: in different orders (each grant checks the quota of each job it tries under its tenant's row lock), which deadlocks
#: under load; one at a time, a grant takes a few milliseconds and none waits on another's row locks.
GRANT_LOCK = 0x7467_6772_616E_7400  # "tggrant\0"
#: Free seats of other workers one lease request looks at (for a packable job it would put on a whole device), at most.
OTHER_SEATS = 64


def held_by_tenant(conn: Connection, tenant_id: str) -> int:
    """Devices held now by the tenant's jobs: each whole device, and each job on seats once (a league's N seats are one job)."""
    return held_by_tenants(conn, [tenant_id]).get(tenant_id, 0)


def held_by_tenants(conn: Connection, tenant_ids: list[str] | None = None) -> dict[str, int]:
    """:func:`held_by_tenant` of each of ``tenant_ids`` (None: every tenant holding something), in one query that reads the
    tenants' holding jobs alone (``ix_jobs_tenant_state``), not every allocation."""
    held = jobs.join(allocations, allocations.c.job_id == jobs.c.id).join(devices, devices.c.id == allocations.c.device_id)
    whole = func.sum(case((devices.c.seat_of.is_(None), 1), else_=0))
    seated = func.count(func.distinct(case((devices.c.seat_of.is_not(None), jobs.c.id), else_=None)))
    query = select(jobs.c.tenant_id, whole, seated).select_from(held).where(jobs.c.state.in_(sorted(states.HOLDING))).group_by(jobs.c.tenant_id)
    if tenant_ids is not None:
        query = query.where(jobs.c.tenant_id.in_(tenant_ids))
    return {tenant: int(w or 0) + int(n or 0) for tenant, w, n in conn.execute(query)}


def _over_quota(conn: Connection, job: dict[str, Any], held: dict[str, int], quota: dict[str, int]) -> bool:
    """Whether ``job`` would take its tenant past its ``max_gpus`` (each tenant's figures read once a grant, into ``held``
    and ``quota``)."""
    tenant = job["tenant_id"]
    if tenant not in quota:
        quota[tenant] = conn.execute(select(tenants.c.max_gpus).where(tenants.c.id == tenant)).scalar_one()
        held[tenant] = held_by_tenant(conn, tenant)
    return held[tenant] + job["gpus"] > quota[tenant]


class _SeatsElsewhere:
    """The free seats of the other live workers (:func:`free_seats_of_others`), read at a grant's first question."""

    def __init__(self, conn: Connection, worker_id: str, seen_since: float, room: measured.SeatRoom) -> None:
        self.conn, self.worker_id, self.seen_since, self.room = conn, worker_id, seen_since, room
        self._seats: list[tuple[dict[str, Any], frozenset[str] | None, WorkerBounds, Any]] | None = None

    def fit(self, job: dict[str, Any]) -> bool:
        """Whether a free seat of another live worker that may run ``job`` (its tenant, its model) fits it, its memory included."""
        if self._seats is None:
            self._seats = free_seats_of_others(self.conn, self.worker_id, self.seen_since)
        model = model_of(job["config"])
        return any(others.serves(job["tenant_id"]) and (offered is None or model in offered) and fits(shared, job["kind"], job["gpus"], job["config"])
                   and self.room.refusal(row.worker_id, row, job) is None
                   for shared, offered, others, row in self._seats)


def free_seats_of_others(conn: Connection, worker_id: str, seen_since: float) -> list[tuple[dict[str, Any], frozenset[str] | None, WorkerBounds, Any]]:
    """Every free seat of a worker other than ``worker_id`` that is alive (seen since ``seen_since``, not quarantined, its
    credential standing): the seat's base, the models its worker offers within its credential, the credential's bounds
    and the seat's row (its device's measured memory: :data:`tinkergym.scheduler.measured.SEAT_COLUMNS`). A packable
    job prefers such a seat to a whole device here: placement is the cluster's, not the first poller's."""
    from tinkergym.scheduler.bounds import parse_bounds
    from tinkergym.scheduler.db import api_keys

    rows = conn.execute(
        select(devices.c.shared, workers.c.models, api_keys.c.worker_bounds, devices.c.worker_id, devices.c.seat_of, devices.c.kind,
               devices.c.memory_bytes, *measured.SEAT_COLUMNS)
        .select_from(devices.join(workers, workers.c.id == devices.c.worker_id).join(api_keys, api_keys.c.id == workers.c.key_id))
        .where(devices.c.seat_of.is_not(None), devices.c.active.is_(True), devices.c.worker_id != worker_id,
               devices.c.id.not_in(select(allocations.c.device_id)), workers.c.last_seen_at >= seen_since,
               workers.c.quarantined_at.is_(None), api_keys.c.revoked_at.is_(None)).limit(OTHER_SEATS)
    ).all()
    found: list[tuple[dict[str, Any], frozenset[str] | None, WorkerBounds, Any]] = []
    for row in rows:
        parsed = parse_bounds(row.worker_bounds)
        if parsed is None:
            continue
        found.append((parse_shared(row.shared) or {}, frozenset(parsed.offered(row.models)), parsed, row))
    return found


class Quarantined(PermissionError):
    """The worker is quarantined (HTTP 403): too many of its leases expired before their job's server came up."""


def grant(
    conn: Connection, store: JobStore, settings: Any, worker_id: str, secret: bytes, bounds: WorkerBounds | None = None,
    usage: fairshare.Usage | None = None, reservations: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    """Lease at most one queued job to ``worker_id``: :func:`grant_many` with ``limit`` 1; the lease, or None."""
    granted = grant_many(conn, store, settings, worker_id, secret, bounds, usage, reservations, limit=1)
    return granted[0] if granted else None


#: Leases one request takes at most (:func:`grant_many`): a worker's devices and seats are fewer.
MAX_GRANTS = 64


def grant_many(
    conn: Connection, store: JobStore, settings: Any, worker_id: str, secret: bytes, bounds: WorkerBounds | None = None,
    usage: fairshare.Usage | None = None, reservations: dict[str, str] | None = None, limit: int = 1,
) -> list[dict[str, Any]]:
    """Lease up to ``limit`` queued jobs to ``worker_id`` in the caller's transaction, each on free places of its own; the
    leases (empty when nothing fits).

    One pass over the queue fills the worker's free places: the jobs are taken in the order one grant after another would
    take them (each grant counts its tenant's devices up before the next job is chosen), and the worker's row, devices,
    the tenants' shares and the queues' heads are read once, not once a job: the scheduler's work per lease falls with
    the places a request fills (a worker of 8 devices that frees them together asks once).

    Jobs are looked at in the fair-share order (:mod:`tinkergym.scheduler.fairshare`: the tenant furthest below its share,
    then priority and age within a tenant), a few deep in each tenant's queue; ``usage`` is the app's cache of the tenants' held
    devices for that order (None: read now). Only jobs within the worker credential's ``bounds`` are considered: its
    tenants' queues alone are read, and its models only. ``reservations`` (the app's, job -> its worker) holds
    which one worker drains for each job that waited past ``backfill_age_s`` (:func:`_drains_for`); None: every worker
    that could host it drains. A quarantined worker gets :class:`Quarantined`. The lease: ``job_id, kind, config, epoch,
    attempt, devices`` (indexes on the worker), ``seat`` (the seat's index, or None for whole devices), ``expires_at``,
    ``ttl_s``, ``token`` and ``checkpoint`` (the job's last one, to resume from; or None). Two grants of one device raise
    :class:`sqlalchemy.exc.IntegrityError`: the caller rolls back and answers no lease (every lease of the request: one
    transaction).
    """
    if not 1 <= limit <= MAX_GRANTS:
        raise ValueError(f"a request takes 1 to {MAX_GRANTS} leases, not {limit}")
    now = store.clock()
    if conn.dialect.name == "postgresql":  # one grant at a time (SQLite's write lock does the same): see GRANT_LOCK
        conn.execute(select(func.pg_advisory_xact_lock(GRANT_LOCK)))
    worker = _asking(conn, store, worker_id, now)
    if worker is None:
        return []  # forgotten by the sweeper since the caller checked it: its next call is 404, and it registers again
    models = _offered(worker, bounds)
    whole, free, seats, free_seats = _places(conn, worker_id)
    if not free and not free_seats:
        return []
    shapes = memory.parse_shapes(worker["model_shapes"]) or {}
    device_memory, device_kind = memory.smallest([d.memory_bytes for d in whole]), (whole[0].kind if whole else "slot")
    held: dict[str, int] = {}
    quota: dict[str, int] = {}
    room = measured.SeatRoom(conn)
    seen_since = now - worker_timeout(settings)  # a worker not seen since is gone
    elsewhere = _SeatsElsewhere(conn, worker_id, seen_since, room)
    share = fairshare.shares(conn, list(bounds.tenants) if bounds is not None and bounds.tenants is not None else None)
    held_now = usage.held(conn) if usage is not None else fairshare.held_devices(conn)
    # Only the jobs that may fit a free place here, and those waiting past the backfill age that this worker may drain
    # for, among the first DEPTH of each queue: the database passes over the rest (an empty poll reads one page a tenant).
    fit, starved = max(len(free), 1 if free_seats else 0), now - settings.backfill_age_s
    mine = _draining_for(reservations, worker_id)

    def may_fit(c: Any) -> Any:
        return _may_fit(c, fit, starved, max(len(whole), 1), mine)

    granted: list[dict[str, Any]] = []
    for job in fairshare.fair_queue(conn, sorted(share), held_now, share, where=may_fit, live=True):
        kind, gpus, config = job["kind"], job["gpus"], job["config"]
        if model_of(job["config"]) not in models:
            continue
        need = players(config)  # a league's adapters: that many seats of one shared server, never whole devices
        # Whole devices only if there are enough and they have the memory (priced only then; memory.refusal is cached).
        on_devices = (need == 1 and gpus <= len(whole)
                      and memory.refusal(kind, gpus, config, shapes.get(model_of(job["config"])), device_memory, device_kind) is None)
        if not on_devices and not any(len(rows) >= need for rows in league_seats(seats, kind, gpus, config).values()):
            continue  # never fits here: it neither starts nor holds this worker's devices
        chosen = next((rows[:need] for rows in league_seats(free_seats, kind, gpus, config).values()
                       if len(rows) >= need and room.refusal(worker_id, rows[0], job) is None), [])
        if not chosen and on_devices and gpus <= len(free) and elsewhere.fit(job):
            continue  # a free seat of another worker fits it: the job waits for that worker's poll (it asks every few seconds)
        if not chosen and (gpus > len(free) or not on_devices):
            if now - job["created_at"] > settings.backfill_age_s and not _over_quota(conn, job, held, quota) \
                    and _drains_for(conn, store, reservations, job["id"], worker_id, mine, seen_since):
                break  # waited too long: the devices here drain to it, nobody behind jumps ahead
            continue  # backfill: smaller jobs behind may start
        if _over_quota(conn, job, held, quota):
            continue  # over its tenant's quota: waits, blocks nobody (its quota read once a grant, and only here)
        places = chosen or free[:gpus]
        lease = _take(conn, store, settings, worker_id, job, places, secret, now)
        if lease is None:
            continue
        granted.append(lease)
        weight = _count_grant(job, chosen, seats, usage, reservations)
        mine = None if job["id"] == mine else mine  # its reservation ended with its grant
        # the next job is chosen as the next request would choose it: these places are gone, the tenant holds more
        held_now[job["tenant_id"]] = held_now.get(job["tenant_id"], 0.0) + weight
        held[job["tenant_id"]] = held.get(job["tenant_id"], 0) + (1 if chosen else gpus)
        free, free_seats = _without(free, free_seats, places)
        room.forget(worker_id, places[0])
        if len(granted) >= limit or (not free and not free_seats):
            break
    return granted


def _offered(worker: dict[str, Any], bounds: WorkerBounds | None) -> set[str]:
    """The models the worker offers, within its credential's."""
    return bounds.offered(worker["models"]) if bounds is not None else set(json.loads(worker["models"]))


def _asking(conn: Connection, store: JobStore, worker_id: str, now: float) -> dict[str, Any] | None:
    """The worker's row, locked, for its lease request, and touched (alive from now on: a gone worker comes back here);
    None when it was forgotten; :class:`Quarantined` when it is quarantined."""
    worker = conn.execute(locked(conn, select(workers).where(workers.c.id == worker_id))).mappings().first()
    if worker is None:
        return None
    touch(conn, store, worker_id, now)
    if worker["quarantined_at"] is not None:
        why = worker["quarantine_reason"] or f"{worker['strikes']} of its leases in a row expired before the job's server came up"
        raise Quarantined(f"worker {worker_id} is quarantined: {why}. The operator releases it with: tinkergym scheduler workers release {worker_id}")
    return dict(worker)


def _places(conn: Connection, worker_id: str) -> tuple[list[Any], list[Any], list[tuple[Any, dict[str, Any]]], list[tuple[Any, dict[str, Any]]]]:
    """The worker's active places: its whole devices, the free ones, its seats (each with its server's base) and the free ones."""
    active = conn.execute(
        select(devices.c.id, devices.c.index, devices.c.seat_of, devices.c.shared, devices.c.memory_bytes, devices.c.kind, *measured.SEAT_COLUMNS)
        .where(devices.c.worker_id == worker_id, devices.c.active.is_(True)).order_by(devices.c.index)
    ).all()
    taken = set(conn.execute(select(allocations.c.device_id).where(allocations.c.device_id.in_([d.id for d in active]))).scalars())
    whole = [d for d in active if d.seat_of is None]
    seats = [(d, parse_shared(d.shared) or {}) for d in active if d.seat_of is not None]
    return whole, [d for d in whole if d.id not in taken], seats, [(d, shared) for d, shared in seats if d.id not in taken]


def _without(free: list[Any], free_seats: list[tuple[Any, dict[str, Any]]], places: list[Any]) -> tuple[list[Any], list[tuple[Any, dict[str, Any]]]]:
    """The free devices and seats less ``places`` (just granted)."""
    gone = {device.id for device in places}
    return [d for d in free if d.id not in gone], [(d, shared) for d, shared in free_seats if d.id not in gone]


def _count_grant(job: dict[str, Any], chosen: list[Any], seats: list[Any], usage: fairshare.Usage | None,
                 reservations: dict[str, str] | None) -> float:
    """After ``job`` is granted: its reservation ends, and its tenant's held devices count it (a seat: 1 / its server's
    seats); the devices it counts for."""
    if reservations is not None:
        reservations.pop(job["id"], None)
    weight = float(job["gpus"]) if not chosen else len(chosen) / max(1, sum(1 for d, _ in seats if d.seat_of == chosen[0].seat_of))
    if usage is not None:
        usage.granted(job["tenant_id"], weight)
    return weight


def _may_fit(c: Any, fit: int, starved: float, most: int, mine: str | None) -> Any:
    """The jobs (``c``: their columns) a grant reads: those of at most ``fit`` devices, and the starving ones (created
    before ``starved``) of at most ``most`` devices this worker may drain for: only the one it drains for (``mine``) if
    it drains for one.

    A worker draining for a job takes no other starving one: at 1,000 workers, with every queued job past the backfill
    age, the requests of draining workers read the front of every tenant's queue for jobs they could not take (a hundred
    page reads a request, under the grant lock)."""
    if mine is not None:
        return or_(c.gpus <= fit, c.id == mine)
    return or_(c.gpus <= fit, and_(c.created_at < starved, c.gpus <= most))  # more devices than the worker has: never here


def _draining_for(reservations: dict[str, str] | None, worker_id: str) -> str | None:
    """The starving job ``worker_id`` drains for, or None."""
    return next((job_id for job_id, holder in list((reservations or {}).items()) if holder == worker_id), None)


def _drains_for(conn: Connection, store: JobStore, reservations: dict[str, str] | None, job_id: str, worker_id: str,
                mine: str | None, seen_since: float) -> bool:
    """Whether ``worker_id`` (draining for ``mine``, or None) drains its devices for the starving job ``job_id`` (takes
    nothing after it in the order).

    One worker a starving job, the first that meets it (a worker drains for one job at a time), so the rest of the cluster
    keeps backfilling: what Slurm's backfill reserves for its top job. Its reservation moves to another worker when its
    holder has not been seen since ``seen_since`` (the worker timeout ago): a holder whose ``last_seen_at`` this
    scheduler wrote since then is alive without a read (:func:`worker_registry.touch`), another is read. Without
    ``reservations``, every worker that could host it drains."""
    if reservations is None:
        return True
    holder = reservations.get(job_id)
    if holder is not None and holder != worker_id:
        if store.touched.get(holder, -math.inf) >= seen_since:
            return False  # another worker drains for it, seen alive by this scheduler
        alive = conn.execute(select(workers.c.last_seen_at).where(workers.c.id == holder)).scalar_one_or_none()
        if alive is not None and alive >= seen_since:
            return False  # another worker drains for it
    if holder != worker_id:
        if mine is not None and mine != job_id:
            return False  # this worker drains for another job already
        reservations[job_id] = worker_id
    return True


def _take(
    conn: Connection, store: JobStore, settings: Any, worker_id: str, job: dict[str, Any], chosen: list[Any], secret: bytes, now: float,
) -> dict[str, Any] | None:
    """Move ``job`` queued -> leased on ``chosen`` devices; None when another grant took it.

    Its quota was checked by the caller (:func:`_over_quota`) in this transaction, after the grant lock: grants run one at
    a time (:data:`GRANT_LOCK`; SQLite's write lock, taken by the grant's first write), and only a grant adds to what a
    tenant holds, so no other grant can have taken the tenant's room since."""
    epoch = job["lease_epoch"] + 1
    expires = now + settings.lease_ttl_s
    token = server_token(secret, job["id"], epoch)
    seat = chosen[0].index if chosen[0].seat_of is not None else None
    indexes = [device.index for device in chosen] if seat is None else [chosen[0].seat_of]  # a league's seats: one device
    seated = {"seat": seat, **({"seats": [device.index for device in chosen]} if len(chosen) > 1 else {})} if seat is not None else {}
    attempt = store.grant(conn, job["id"], epoch, {"epoch": epoch, "devices": len(indexes), "expires_at": expires, "attempt": job["attempt"], **seated},
                          worker_id=worker_id, lease_expires_at=expires, server_url=None, server_token_digest=token_digest(token))
    if attempt is None:
        return None  # another worker's grant won this job
    # the primary key refuses a device held by another job: IntegrityError, all rolled back
    conn.execute(insert(allocations), [{"device_id": device.id, "job_id": job["id"], "epoch": epoch, "granted_at": now} for device in chosen])
    last = None
    if job["lease_epoch"] > 0:  # a checkpoint is written under a lease: a job never leased has none
        last = conn.execute(
            select(checkpoints.c.step, checkpoints.c.name).where(checkpoints.c.job_id == job["id"])
            .order_by(checkpoints.c.step.desc(), checkpoints.c.id.desc()).limit(1)
        ).mappings().first()
    return {
        "job_id": job["id"], "kind": job["kind"], "config": json.loads(job["config"]), "epoch": epoch, "attempt": job["attempt"],
        "devices": indexes, "seat": seat, "seats": [device.index for device in chosen] if seat is not None else None, "expires_at": expires,
        "ttl_s": settings.lease_ttl_s, "idle_timeout_s": settings.idle_timeout_s, "token": token,
        "checkpoint": dict(last) if last is not None else None,
    }
