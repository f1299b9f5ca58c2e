"""Leases: grant queued jobs to workers' devices, renew them by heartbeat, expire them, fence every write by epoch.

A lease is a job's ``lease_epoch`` (a number that only grows: every grant adds one), its holder
(``jobs.worker_id``) and its end (``jobs.lease_expires_at``, renewed by heartbeats). Every write a worker
makes names the epoch; a write with another epoch, or for a job its worker no longer holds, is a
:class:`~tinkergym.scheduler.repository.Conflict` (HTTP 409), so a paused or partitioned worker cannot act
after its lease is gone.

Granting (:func:`grant`) is pull: a worker asks, and gets at most one job that fits its free devices. A job
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

Expiry (:func:`sweep`) runs in the app's background task (:func:`tinkergym.scheduler.sweeps.sweep_forever`), so a lease expires with
no other traffic: the job goes back to ``queued`` with ``attempt + 1`` (``failed`` once attempts reach
``max_attempts``; a ``cancelling`` job becomes ``cancelled``) and its devices are freed, in one transaction
per job that re-reads the job under lock and compares its epoch and expiry, so a heartbeat racing the
expiry cannot also win.

Workers that go silent (killed, cut off) are noticed by the same sweeper: a worker not seen (no registration,
lease poll, heartbeat or state report) for ``worker_timeout_s`` is ``gone``. That status is derived from
``workers.last_seen_at`` and the clock, never stored, so it cannot disagree with the time the worker was last
seen, needs no write to change, and survives a restart; the worker is ``alive`` again the moment its next call
touches ``last_seen_at``. Granting is pull (the worker's own poll touches it first), so a gone worker's devices
are never granted, and its leases have already expired when it turns gone (the timeout is at least the lease
TTL, and every heartbeat touches the worker). The sweeper logs each worker that turns gone or comes back, and
forgets (deletes, with its devices) a worker gone for ``worker_forget_s`` that holds nothing; a forgotten
worker's next poll is answered 404 and it registers again.

Only a worker credential leases (:mod:`tinkergym.scheduler.credentials`): the grant reads the queues of the tenants
its credential serves, and offers only the models it allows. A worker proves it runs a lease by heartbeating the job
after it reported it running, or by reporting a checkpoint (:func:`proven`); reporting ``running`` alone proves
nothing. A lease that expires unproven is the worker's fault: a strike against it, and the job is queued again at
the same attempt; at ``quarantine_after`` strikes in a row (default 2) the worker is quarantined: its lease requests are
refused (403) until the operator releases it (``tinkergym scheduler workers release``). A proven lease that expires
counts against the job's attempts (a job that kills its worker still ends), unless every lease the job lost was lost
by a worker now quarantined. And any worker that loses ``quarantine_losses`` leases (default 3) within
``quarantine_window_s`` (an hour) while it keeps calling the scheduler is quarantined, whatever it reported; one that
died holding leases (it stopped calling) is not. The owner's events say which worker lost the lease and when it was
quarantined. A credential's workers can hold at most its device bound.

A worker that cannot run a job it was granted (its machine lacks a package, the model's files or a device) gives it back
(:func:`release_job`): the job is queued again at the same attempt and the worker is quarantined with the reason, so a
job is given back at most once per worker and never fails for a worker's fault.

Each lease carries a server token, ``HMAC-SHA256(scheduler secret, "<job id>:<epoch>")``: the worker hands it
to the job's server, the job's owner gets the same one from the scheduler, and it stops working when the
epoch moves on. The database keeps only its SHA-256 digest; the secret is 32 random bytes in the 0600 file
``<data_dir>/scheduler.secret``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from sqlalchemy import BigInteger, Float, String, Text, and_, bindparam, case, cast, delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from tinkergym.scheduler import fairshare, measured, memory, states
from tinkergym.scheduler.artifact_paths import CHECKPOINT_NAME
from tinkergym.scheduler.bounds import WorkerBounds
from tinkergym.scheduler.db import allocations, checkpoints, devices, events, jobs, tenants, workers
from tinkergym.scheduler.repository import Conflict, JobStore
from tinkergym.scheduler.seats import fits, league_seats, model_of, parse_shared, players
from tinkergym.scheduler.usage import charge_renewal, held_weights, token_gains
from tinkergym.scheduler.worker_registry import (  # noqa: F401 - the workers' half, importable from here
    ALIVE, FORGET_BATCH, GONE, count_loss, locked, strike_worker, forget_worker, mark_gone, owned_worker, quarantine_worker, register_worker,
    release_worker, sweep_workers, worker_status, worker_timeout, worker_view,
)

SECRET_FILE = "scheduler.secret"
TOKEN_PREFIX = "tgs_"
#: The PostgreSQL advisory lock every grant takes for its transaction: grants run one at a time, whatever the number of
#: scheduler processes. Concurrent grants would contend for the same jobs at the head of the queue and lock tenants' rows
#: in different orders (each grant checks the quota of each job it tries under its tenant's row lock), which deadlocks
#: under load; one at a time, a grant takes a few milliseconds and none waits on another's row locks.
GRANT_LOCK = 0x7467_6772_616E_7400  # "tggrant\0"
#: Free seats of other workers one lease request looks at (for a packable job it would put on a whole device), at most.
OTHER_SEATS = 64
#: Queued jobs one lease request considers at most (the queue is read in pages of :data:`_PAGE`).
MAX_SCAN = 5000
_PAGE = 200
#: A checkpoint's name: one path component inside the job's artifact folder.
#: States a worker may report, and the events it may append.
REPORTABLE = (states.STARTING, states.RUNNING, states.SUCCEEDED, states.FAILED, states.CANCELLED)
WORKER_EVENTS = ("log", "metrics", "error")


# ----- the server token ------------------------------------------------------------------------------
def load_secret(data_dir: str | Path) -> bytes:
    """The scheduler's 32-byte secret from ``<data_dir>/scheduler.secret`` (mode 0600), created on first use.

    Creation is atomic (written to a private temporary file, then hard-linked into place), so processes
    racing to create it all end up with the same secret.
    """
    path = Path(data_dir) / SECRET_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".scheduler-secret-")  # mode 0600
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            os.unlink(tmp)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    secret = path.read_bytes()
    if len(secret) != 32:
        raise RuntimeError(f"{path} holds {len(secret)} bytes, not a 32-byte secret; remove it to make a new one")
    return secret


def app_secret(app: Any) -> bytes:
    """The app's scheduler secret (loaded once from its data folder)."""
    secret = getattr(app.state, "server_secret", None)
    if secret is None:
        secret = app.state.server_secret = load_secret(app.state.settings.data_dir)
    return secret


def server_token(secret: bytes, job_id: str, epoch: int) -> str:
    """The token of the job's server at lease ``epoch``: ``tgs_`` + URL-safe base64 of HMAC-SHA256(secret, "job:epoch")."""
    mac = hmac.new(secret, f"{job_id}:{epoch}".encode(), hashlib.sha256).digest()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(mac).decode("ascii").rstrip("=")


def token_for(app: Any, job_id: str, epoch: int) -> str:
    """:func:`server_token` with the app's secret (what the worker got with the lease; for the job's owner too)."""
    return server_token(app_secret(app), job_id, epoch)


def token_digest(token: str) -> str:
    """SHA-256 of a token, hex: what ``jobs.server_token_digest`` holds (never the token)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


#: A worker's ``last_seen_at`` moves at most this often (seconds): it says alive or gone against a timeout of tens of
#: seconds, and a write of the worker's row at each of its calls was a third of PostgreSQL's time at 1,000 workers (the
#: calls of a worker waiting on each other's row lock, and on its grant's).
TOUCH_EVERY_S = 1.0


#: Workers a store remembers writing the row of (:func:`_touch`); past it, it forgets them all.
MAX_TOUCHED = 100_000


def _touch(conn: Connection, store: JobStore, worker_id: str, now: float) -> None:
    """The worker was seen at ``now``: its row is written unless it was seen within :data:`TOUCH_EVERY_S` (a row that
    does not match is neither written nor waited for). A worker this store wrote within that time is not asked about at
    all: the statement that matched nothing was an eighth of a batched heartbeat's time at 1,000 workers."""
    touched = store.touched
    if 0.0 <= now - touched.get(worker_id, -math.inf) < TOUCH_EVERY_S:
        return
    conn.execute(update(workers).where(workers.c.id == worker_id, workers.c.last_seen_at < now - TOUCH_EVERY_S).values(last_seen_at=now))
    if len(touched) >= MAX_TOUCHED:  # a bound, whatever the workers registered
        touched.clear()
    touched[worker_id] = now


# ----- granting --------------------------------------------------------------------------------------
def queued_jobs(conn: Connection, tenant_ids: tuple[str, ...] | None = None) -> Iterator[dict[str, Any]]:
    """Queued jobs (of ``tenant_ids`` only, when given) in grant order (priority desc, created_at asc, id asc), a page at a time."""
    cols = (jobs.c.id, jobs.c.tenant_id, jobs.c.kind, jobs.c.priority, jobs.c.created_at, jobs.c.gpus, jobs.c.config,
            jobs.c.lease_epoch, jobs.c.attempt)
    last: dict[str, Any] | None = None
    for _ in range(0, MAX_SCAN, _PAGE):
        query = select(*cols).where(jobs.c.state == states.QUEUED)
        if tenant_ids is not None:
            query = query.where(jobs.c.tenant_id.in_(tenant_ids))
        if last is not None:
            p, t, i = last["priority"], last["created_at"], last["id"]
            query = query.where(or_(jobs.c.priority < p, and_(jobs.c.priority == p, or_(
                jobs.c.created_at > t, and_(jobs.c.created_at == t, jobs.c.id > i)))))
        rows = [dict(r) for r in conn.execute(
            query.order_by(jobs.c.priority.desc(), jobs.c.created_at.asc(), jobs.c.id.asc()).limit(_PAGE)).mappings()]
        yield from rows
        if len(rows) < _PAGE:
            return
        last = rows[-1]


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
        offered = set(json.loads(row.models))
        if parsed.models is not None:
            offered &= set(parsed.models)
        found.append((parse_shared(row.shared) or {}, frozenset(offered), parsed, row))
    return found


class Quarantined(PermissionError):
    """The worker is quarantined (HTTP 403): too many of its leases expired before their job's server came up."""


def grant(
    conn: Connection, store: JobStore, settings: Any, worker_id: str, secret: bytes, bounds: WorkerBounds | None = None,
    usage: fairshare.Usage | None = None, reservations: dict[str, tuple[str, float]] | None = None,
) -> dict[str, Any] | None:
    """Lease at most one queued job to ``worker_id``: :func:`grant_many` with ``limit`` 1; the lease, or None."""
    granted = grant_many(conn, store, settings, worker_id, secret, bounds, usage, reservations, limit=1)
    return granted[0] if granted else None


#: Leases one request takes at most (:func:`grant_many`): a worker's devices and seats are fewer.
MAX_GRANTS = 64


def grant_many(
    conn: Connection, store: JobStore, settings: Any, worker_id: str, secret: bytes, bounds: WorkerBounds | None = None,
    usage: fairshare.Usage | None = None, reservations: dict[str, tuple[str, float]] | None = None, limit: int = 1,
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
    tenants' queues alone are read, and its models only. ``reservations`` (the app's, job -> its worker and when) holds
    which one worker drains for each job that waited past ``backfill_age_s`` (:func:`_drains_for`); None: every worker
    that could host it drains. A quarantined worker gets :class:`Quarantined`. The lease: ``job_id, kind, config, epoch, attempt,
    devices`` (indexes on the worker), ``seat`` (the seat's index, or None for whole devices), ``expires_at``, ``ttl_s``, ``token`` and ``checkpoint`` (the job's last one,
    to resume from; or None). Two grants of one device raise :class:`sqlalchemy.exc.IntegrityError`: the caller rolls
    back and answers no lease (every lease of the request: one transaction).
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
    elsewhere = _SeatsElsewhere(conn, worker_id, now - worker_timeout(settings), room)
    share = fairshare.shares(conn, list(bounds.tenants) if bounds is not None and bounds.tenants is not None else None)
    held_now = usage.held(conn) if usage is not None else fairshare.held_devices(conn)
    # Only the jobs that may fit a free place here, and those waiting past the backfill age (this worker may drain for
    # them), among the first DEPTH of each queue: the database passes over the rest (an empty poll reads one page a tenant).
    fit, starved = max(len(free), 1 if free_seats else 0), now - settings.backfill_age_s

    def may_fit(c: Any) -> Any:
        return or_(c.gpus <= fit, c.created_at < starved)

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
                    and _drains_for(conn, reservations, job["id"], worker_id, now - worker_timeout(settings)):
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
    models = set(json.loads(worker["models"]))
    if bounds is not None and bounds.models is not None:
        models &= set(bounds.models)
    return models


def _asking(conn: Connection, store: JobStore, worker_id: str, now: float) -> dict[str, Any] | None:
    """The worker's row, locked, for its lease request, and touched (alive from now on: a gone worker comes back here);
    None when it was forgotten; :class:`Quarantined` when it is quarantined."""
    worker = conn.execute(locked(conn, select(workers).where(workers.c.id == worker_id))).mappings().first()
    if worker is None:
        return None
    _touch(conn, store, worker_id, now)
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
                 reservations: dict[str, tuple[str, float]] | None) -> float:
    """After ``job`` is granted: its reservation ends, and its tenant's held devices count it (a seat: 1 / its server's
    seats); the devices it counts for."""
    if reservations is not None:
        reservations.pop(job["id"], None)
    weight = float(job["gpus"]) if not chosen else len(chosen) / max(1, sum(1 for d, _ in seats if d.seat_of == chosen[0].seat_of))
    if usage is not None:
        usage.granted(job["tenant_id"], weight)
    return weight


def _drains_for(conn: Connection, reservations: dict[str, tuple[str, float]] | None, job_id: str, worker_id: str, seen_since: float) -> bool:
    """Whether ``worker_id`` drains its devices for the starving job ``job_id`` (takes nothing after it in the order).

    One worker a starving job, the first that meets it (a worker drains for one job at a time), so the rest of the cluster
    keeps backfilling: what Slurm's backfill reserves for its top job. Its reservation moves to another worker when its
    holder has not been seen within the worker timeout. Without ``reservations``, every worker that could host it drains."""
    if reservations is None:
        return True
    holder = reservations.get(job_id)
    if holder is not None and holder[0] != worker_id:
        alive = conn.execute(select(workers.c.last_seen_at).where(workers.c.id == holder[0])).scalar_one_or_none()
        if alive is not None and alive >= seen_since:
            return False  # another worker drains for it
    if holder is None or holder[0] != worker_id:
        if any(w == worker_id and other != job_id for other, (w, _) in list(reservations.items())):
            return False  # this worker drains for another job already
        reservations[job_id] = (worker_id, seen_since)
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


# ----- the holder's writes (all fenced) --------------------------------------------------------------
def held_job(conn: Connection, store: JobStore, worker_id: str, job_id: str, epoch: int) -> dict[str, Any]:
    """The job's row if ``worker_id`` holds its lease at ``epoch``; :class:`Conflict` otherwise (the fence)."""
    job = store.check_epoch(conn, job_id, epoch)
    if job["worker_id"] != worker_id:
        raise Conflict(f"job {job_id} is not leased to this worker")
    return job


def heartbeat(conn: Connection, store: JobStore, settings: Any, worker_id: str, job_id: str, epoch: int,
              usage: dict[str, int] | None = None, memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """Renew the lease for another ``lease_ttl_s``; ``{job_id, epoch, state, cancelling, expires_at}``. The job is charged
    the device-seconds since the last renewal and the tokens its server reports in ``usage`` (:mod:`.usage`); the
    memory its server measured (``memory``) is kept on its devices for placement (:mod:`.measured`).

    A lease already past its end is lost even before the sweeper sees it (409): the worker must stop the
    job's server. ``cancelling`` True tells it to stop the server and report ``cancelled``; a cancelling job's lease is
    renewed no further than ``cancel_deadline_s`` after the cancel (the job moved to ``cancelling`` then, and its
    ``updated_at`` has not moved since), so a worker that ignores the cancel loses the lease there and the sweeper
    cancels the job, freeing its devices and its tenant's quota.
    """
    now = store.clock()
    before = held_job(conn, store, worker_id, job_id, epoch)
    expires = now + settings.lease_ttl_s
    if before["state"] == states.CANCELLING:
        expires = min(expires, before["updated_at"] + getattr(settings, "cancel_deadline_s", math.inf))
    job = store.renew_lease(conn, job_id, epoch, worker_id, expires)
    proof = before["updated_at"] + settings.lease_ttl_s  # past it, the expiry was set by a heartbeat after "running" (proven)
    if before["state"] == states.RUNNING and before["lease_expires_at"] <= proof < job["lease_expires_at"]:
        # The first heartbeat after the job was reported running: the worker runs it, its strikes end (once, not at every one).
        conn.execute(update(workers).where(workers.c.id == worker_id, workers.c.strikes != 0).values(strikes=0))
    charge_renewal(conn, before, now, settings.lease_ttl_s, epoch, usage)  # the device-seconds and tokens since the last renewal
    if memory:
        measured.record(conn, worker_id, job_id, memory, now)
    _touch(conn, store, worker_id, now)
    return {"job_id": job_id, "epoch": epoch, "state": job["state"], "cancelling": job["state"] == states.CANCELLING,
            "expires_at": job["lease_expires_at"]}


#: Leases one call of :func:`heartbeat_many` renews at most (a worker's devices and seats are bounded far below it).
MAX_BEATS = 1024
_RENEW: Any = bindparam("b_id")


def heartbeat_many(conn: Connection, store: JobStore, settings: Any, worker_id: str, beats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`heartbeat` for each of the worker's leases in ``beats`` (``job_id``, ``epoch``, optional ``usage`` and
    ``memory``), in one transaction and a few statements whatever their number: each lease's answer as :func:`heartbeat`
    gives it, or ``{job_id, epoch, lost: true, error}`` for a lease it no longer holds (that job's server must stop; the
    others are renewed all the same).

    One worker's call a heartbeat interval, not one per lease: the scheduler's work for 8 leases is about that of one."""
    if len(beats) > MAX_BEATS:
        raise ValueError(f"{len(beats)} leases in one heartbeat: at most {MAX_BEATS}")
    now = store.clock()
    ids = sorted({beat["job_id"] for beat in beats})
    rows = {row["id"]: dict(row) for row in conn.execute(locked(conn, select(
        jobs.c.id, jobs.c.state, jobs.c.lease_epoch, jobs.c.worker_id, jobs.c.lease_expires_at, jobs.c.updated_at, jobs.c.usage_reported,
    ).where(jobs.c.id.in_(ids)).order_by(jobs.c.id))).mappings()}
    weights = held_weights(conn, ids)
    answers: list[dict[str, Any]] = []
    renewals: list[dict[str, Any]] = []
    proven_now = False
    seen: set[str] = set()
    for beat in beats:
        job_id, epoch = beat["job_id"], beat["epoch"]
        job = rows.get(job_id)
        lost = _beat_refusal(job, job_id, epoch, worker_id, now) if job_id not in seen else f"job {job_id} is named twice in one heartbeat"
        seen.add(job_id)
        if lost is not None or job is None:
            answers.append({"job_id": job_id, "epoch": epoch, "lost": True, "error": lost})
            continue
        expires = now + settings.lease_ttl_s
        if job["state"] == states.CANCELLING:
            expires = min(expires, job["updated_at"] + getattr(settings, "cancel_deadline_s", math.inf))
        proof = job["updated_at"] + settings.lease_ttl_s
        proven_now |= job["state"] == states.RUNNING and job["lease_expires_at"] <= proof < expires
        elapsed = min(max(0.0, now - (float(job["lease_expires_at"]) - settings.lease_ttl_s)), settings.lease_ttl_s) if settings.lease_ttl_s > 0 else 0.0
        trained, sampled, reported = token_gains(job, epoch, beat.get("usage"))
        renewals.append({"b_id": job_id, "b_expires": expires, "b_seconds": elapsed * weights.get(job_id, 0.0), "b_trained": trained,
                         "b_sampled": sampled, "b_reported": reported})
        if beat.get("memory"):
            measured.record(conn, worker_id, job_id, beat["memory"], now)
        answers.append({"job_id": job_id, "epoch": epoch, "state": job["state"], "cancelling": job["state"] == states.CANCELLING,
                        "expires_at": expires})
    if renewals:
        _renew(conn, renewals)
    if proven_now:  # a first heartbeat after "running": the worker runs its jobs, its strikes end
        conn.execute(update(workers).where(workers.c.id == worker_id, workers.c.strikes != 0).values(strikes=0))
    _touch(conn, store, worker_id, now)
    return answers


#: The columns of a renewal (:func:`_renew`), each with its type in PostgreSQL's arrays.
_RENEWAL = {"b_id": String, "b_expires": Float, "b_seconds": Float, "b_trained": BigInteger, "b_sampled": BigInteger, "b_reported": Text}


def _renew(conn: Connection, renewals: list[dict[str, Any]]) -> None:
    """Write ``renewals`` (one a lease: its job, new expiry, device-seconds and tokens gained, the report to keep or None).

    PostgreSQL: one ``UPDATE ... FROM unnest(...)`` whatever their number, each column a typed array (a ``NULL`` report is
    a ``NULL`` of text, and the statement's text is the same for any number of leases: prepared once). SQLite, in-process:
    one ``UPDATE`` a lease (``executemany``)."""
    if conn.dialect.name == "postgresql":
        rows = func.unnest(*(cast(bindparam(name, [r[name] for r in renewals]), ARRAY(kind)) for name, kind in _RENEWAL.items()))
        new = rows.table_valued(*_RENEWAL).render_derived(name="renewal")
        conn.execute(update(jobs).where(jobs.c.id == new.c.b_id).values(
            lease_expires_at=new.c.b_expires, device_seconds=jobs.c.device_seconds + new.c.b_seconds,
            tokens_trained=jobs.c.tokens_trained + new.c.b_trained, tokens_sampled=jobs.c.tokens_sampled + new.c.b_sampled,
            usage_reported=func.coalesce(new.c.b_reported, jobs.c.usage_reported),
        ))
        return
    conn.execute(update(jobs).where(jobs.c.id == _RENEW).values(
        lease_expires_at=bindparam("b_expires"), device_seconds=jobs.c.device_seconds + bindparam("b_seconds"),
        tokens_trained=jobs.c.tokens_trained + bindparam("b_trained"), tokens_sampled=jobs.c.tokens_sampled + bindparam("b_sampled"),
        usage_reported=func.coalesce(bindparam("b_reported"), jobs.c.usage_reported),
    ), renewals)


def _beat_refusal(job: dict[str, Any] | None, job_id: str, epoch: int, worker_id: str, now: float) -> str | None:
    """Why the worker no longer holds the lease of ``job_id`` at ``epoch`` (the messages :func:`held_job` and
    :meth:`JobStore.renew_lease` give), or None when it does."""
    if job is None:
        return f"no job {job_id}"
    if job["lease_epoch"] != epoch or job["state"] not in states.HOLDING:
        return f"job {job_id}: lease epoch {epoch} is stale (the job is {job['state']} at epoch {job['lease_epoch']})"
    if job["worker_id"] != worker_id:
        return f"job {job_id} is not leased to this worker"
    if job["lease_expires_at"] is None or job["lease_expires_at"] < now:
        return f"job {job_id}: the lease at epoch {epoch} is lost (it ended before this heartbeat)"
    return None


def report_state(
    conn: Connection, store: JobStore, worker_id: str, job_id: str, epoch: int, state: str, *,
    error: str | None = None, server_url: str | None = None,
) -> dict[str, Any]:
    """Move the held job to ``state`` (starting, running, succeeded, failed, cancelled), fenced by ``epoch``.

    ``running`` stores ``server_url``; an end (succeeded, failed, cancelled) frees the job's devices in the
    same transaction; ``cancelled`` only from ``cancelling``. Reporting the state the job is already in is
    answered again without a change (a retried report). Returns ``{job_id, epoch, state}``.
    """
    if state not in REPORTABLE:
        raise ValueError(f"state {state!r}: a worker reports one of {', '.join(REPORTABLE)}")
    job = held_job(conn, store, worker_id, job_id, epoch)
    if job["state"] == state:
        return {"job_id": job_id, "epoch": epoch, "state": state}
    if state == states.CANCELLED and job["state"] != states.CANCELLING:
        raise Conflict(f"job {job_id} is {job['state']}: only a cancelling job can be reported cancelled")
    values: dict[str, Any] = {}
    event: dict[str, Any] = {"epoch": epoch}
    if state == states.RUNNING:
        if not server_url:
            raise ValueError("a running job needs server_url: where its server listens")
        values["server_url"] = server_url  # (strikes are not reset here: a worker proves itself by running, see heartbeat)
    if error:
        event["error"] = values["error"] = error
    if state == states.FAILED and not error:
        values["error"] = "the worker reported the job failed"
    if state in states.TERMINAL:
        values.update(lease_expires_at=None, server_url=None, server_token_digest=None)
    store.transition(conn, job_id, state, epoch=epoch, event=event, **values)
    if state in states.TERMINAL:
        conn.execute(delete(allocations).where(allocations.c.job_id == job_id))
    _touch(conn, store, worker_id, store.clock())
    return {"job_id": job_id, "epoch": epoch, "state": state}


def report_event(conn: Connection, store: JobStore, worker_id: str, job_id: str, epoch: int, type_: str, data: dict[str, Any]) -> int:
    """Append a ``log``, ``metrics`` or ``error`` event to the held job's stream (fenced); its seq."""
    if type_ not in WORKER_EVENTS:
        raise ValueError(f"event type {type_!r}: a worker appends one of {', '.join(WORKER_EVENTS)}")
    held_job(conn, store, worker_id, job_id, epoch)
    return store.append_event(conn, job_id, type_, data, limited=True)  # within the tenant's quotas (tinkergym.scheduler.quotas)


def report_checkpoint(conn: Connection, store: JobStore, worker_id: str, job_id: str, epoch: int, step: int, name: str) -> dict[str, Any]:
    """Record a checkpoint folder ``name`` (one path component) at ``step`` (fenced). The same name and step again is a no-op."""
    if not CHECKPOINT_NAME.match(name) or name in (".", ".."):
        raise ValueError(f"checkpoint name {name[:100]!r}: one folder name of letters, digits, '.', '_' and '-'")
    held_job(conn, store, worker_id, job_id, epoch)
    existing = conn.execute(select(checkpoints).where(checkpoints.c.job_id == job_id, checkpoints.c.name == name)).mappings().first()
    if existing is not None:
        if existing["step"] != step:
            raise Conflict(f"job {job_id} already has checkpoint {name!r} at step {existing['step']}")
        return {"job_id": job_id, "step": step, "name": name, "epoch": existing["epoch"]}
    store.add_checkpoint(conn, job_id, epoch, step, name)
    return {"job_id": job_id, "step": step, "name": name, "epoch": epoch}


def release_job(conn: Connection, store: JobStore, worker_id: str, job_id: str, epoch: int, reason: str) -> dict[str, Any]:
    """The worker gives the held job back because it cannot run it (its machine's fault, ``reason``), fenced by ``epoch``.

    The job is queued again at the same attempt (a cancelling one is cancelled), its devices are freed, an event names
    the worker and the reason, and the worker is quarantined for it (no lease until the operator releases it), so a
    job is given back at most once per worker. Returns ``{job_id, epoch, state}``.
    """
    job = held_job(conn, store, worker_id, job_id, epoch)
    now = store.clock()
    to = states.CANCELLED if job["state"] == states.CANCELLING else states.QUEUED
    values: dict[str, Any] = {"worker_id": None, "server_url": None, "lease_expires_at": None, "server_token_digest": None}
    conn.execute(delete(allocations).where(allocations.c.job_id == job_id))
    store.transition(conn, job_id, to, epoch=epoch, event={"reason": "given back by its worker", "epoch": epoch, "worker": worker_id}, **values)
    quarantine_worker(conn, worker_id, f"it gave job {job_id} back: {reason}", now)
    store.append_event(conn, job_id, "log", {"message": f"worker {worker_id} could not run the job and gave it back (not counted as an attempt): "
                                                        f"{reason}; the worker is quarantined", "worker": worker_id, "reason": reason})
    _touch(conn, store, worker_id, now)
    return {"job_id": job_id, "epoch": epoch, "state": to}


# ----- expiry ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossPolicy:
    """How a lost lease is charged (the scheduler's settings of the same names; see :func:`expire`)."""

    lease_ttl_s: float = 30.0
    quarantine_after: int = 0  # unproven losses in a row that quarantine a worker (0: never)
    quarantine_losses: int = 0  # losses of any kind within quarantine_window_s that quarantine a worker (0: never)
    quarantine_window_s: float = 3600.0
    #: When this scheduler started: a lease that ran out before it (while none ran) counts against no worker's window.
    since: float = -math.inf

    @classmethod
    def of(cls, settings: Any, since: float = -math.inf) -> LossPolicy:
        return cls(since=since, **{f: getattr(settings, f) for f in ("lease_ttl_s", "quarantine_after", "quarantine_losses", "quarantine_window_s")
                                   if hasattr(settings, f)})


def expire(store: JobStore, job_id: str, epoch: int, now: float, policy: LossPolicy = LossPolicy()) -> bool:
    """Expire the job's lease at ``epoch`` if it ended before ``now`` (one transaction); whether it did.

    Re-reads the job under lock and compares epoch, state and expiry, so a heartbeat that renewed it first,
    or a grant of a new epoch, wins instead. The job's devices are freed, and it moves on by who lost the lease:

    - a cancelling job is cancelled;
    - a lease its worker never proved (:func:`proven`: no heartbeat came after it reported the job running, and no
      checkpoint was reported in it) is the worker's fault, not the job's: a strike against the worker (:func:`strike_worker`,
      quarantined at ``quarantine_after`` in a row), and the job is queued again at the same attempt;
    - a proven lease counts against the job's attempts: queued with ``attempt + 1``, or failed at ``max_attempts``
      unless every lease it lost was lost by a worker now quarantined (then queued again at the same attempt).

    Every loss by a worker still calling (seen after the lease ended) counts against it within ``quarantine_window_s``:
    ``quarantine_losses`` of them quarantine it, whatever it reports (:func:`count_loss`). A worker that died holding
    leases stops calling, and its losses are not held against it.
    """
    with store.transaction() as conn:
        job = store.get(conn, job_id, for_update=True)
        ends = job["lease_expires_at"]
        if job["lease_epoch"] != epoch or job["state"] not in states.HOLDING or ends is None or ends >= now:
            return False
        worker_id = job["worker_id"]
        ran = worker_id is None or proven(conn, job, policy.lease_ttl_s)
        if worker_id is not None:
            if not ran:
                strike_worker(conn, store, job, policy.quarantine_after, now)
            count_loss(conn, store, job, policy, now)
        values: dict[str, Any] = {"worker_id": None, "server_url": None, "lease_expires_at": None, "server_token_digest": None}
        event: dict[str, Any] = {"reason": "lease expired", "epoch": epoch, "worker": worker_id}
        if job["state"] == states.CANCELLING:
            to = states.CANCELLED
            event["reason"] = "lease ended: the worker did not report the cancelled job stopped in time"
        elif not ran:
            to = states.QUEUED
            event["reason"] = "lease expired before the job ran on its worker (not counted as an attempt)"
        elif job["attempt"] + 1 < job["max_attempts"]:
            to = states.QUEUED
            values["attempt"] = job["attempt"] + 1
        elif _all_lost_by_quarantined(conn, job_id, worker_id):
            to = states.QUEUED
            event["reason"] = "lease expired; every lease the job lost was lost by a quarantined worker: queued again"
        else:
            to = states.FAILED
            values.update(attempt=job["attempt"] + 1, error=f"the job's lease was lost {job['attempt'] + 1} times (max_attempts)")
        conn.execute(delete(allocations).where(allocations.c.job_id == job_id))
        store.transition(conn, job_id, to, epoch=epoch, event=event, **values)
    return True


def proven(conn: Connection, job: dict[str, Any], ttl_s: float) -> bool:
    """Whether the worker proved it runs the job in this lease: the job is running and a heartbeat renewed the lease after
    the worker reported it running (the job's ``updated_at`` is that report's time, which heartbeats leave alone, and a
    heartbeat sets the expiry to its own time plus the TTL), or the worker reported a checkpoint in this lease. A worker
    that reports ``running`` and never heartbeats proves nothing."""
    if job["state"] in (states.RUNNING, states.CANCELLING) and job["lease_expires_at"] > job["updated_at"] + ttl_s:
        return True
    return conn.execute(select(checkpoints.c.id).where(checkpoints.c.job_id == job["id"], checkpoints.c.epoch == job["lease_epoch"])
                        .limit(1)).first() is not None


def _all_lost_by_quarantined(conn: Connection, job_id: str, worker_id: str | None) -> bool:
    """Whether every lease ``job_id`` lost (its expiry events, and this one's ``worker_id``) was lost by a worker that is
    quarantined now."""
    losers = {worker_id}
    for (data,) in conn.execute(select(events.c.data).where(events.c.job_id == job_id, events.c.type == "state")):
        record = json.loads(data)
        if record.get("state") in (states.QUEUED, states.FAILED) and str(record.get("reason", "")).startswith("lease expired"):
            losers.add(record.get("worker"))
    if None in losers:
        return False  # a loss of an earlier version (no worker recorded), or of no worker: not known to be a rogue's
    quarantined = conn.execute(select(func.count()).select_from(workers).where(
        workers.c.id.in_(sorted(losers)), workers.c.quarantined_at.is_not(None))).scalar_one()
    return quarantined == len(losers)


def sweep(app: Any) -> int:
    """Expire every lease that ended before now (the app's clock); how many expired. Safe to run anywhere, any time."""
    store: JobStore = app.state.store
    now = store.clock()
    with store.read() as conn:
        due = conn.execute(
            select(jobs.c.id, jobs.c.lease_epoch).where(jobs.c.state.in_(sorted(states.HOLDING)), jobs.c.lease_expires_at < now)
            .order_by(jobs.c.lease_expires_at).limit(MAX_SCAN)
        ).all()
    expired = 0
    for job_id, epoch in due:
        try:
            expired += expire(store, job_id, epoch, now, LossPolicy.of(app.state.settings, getattr(app.state, "started_at", -math.inf)))
        except Exception:  # noqa: BLE001 - one job's failure must not stop the others' expiry
            app.state.logger.exception("could not expire the lease of job %s at epoch %s", job_id, epoch)
    if expired:
        app.state.logger.info("expired %d lease(s)", expired)
        metrics = getattr(app.state, "metrics", None)
        if metrics is not None:
            metrics.leases_expired.inc(expired)
    return expired


def wake(app: Any) -> None:
    """Ask the sweeper to run soon (a job was queued or devices were freed). Safe from any thread; a no-op without a sweeper."""
    loop = getattr(app.state, "sweep_loop", None)
    event = getattr(app.state, "sweep_event", None)
    if loop is None or event is None:
        return
    try:
        loop.call_soon_threadsafe(event.set)
    except RuntimeError:
        pass  # the loop is closed: the app is shutting down
