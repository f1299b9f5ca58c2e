"""What tenants use and what the cluster holds: device-seconds, the usage views beside the quotas, the queue's history.

- **Device-seconds** (``jobs.device_seconds``): each lease renewal adds the time since the lease's last renewal (at most
  one lease length) times the devices the job holds, a seat counting its share of its device (1 / the seats on it)
  (:func:`charge_renewal`, called by :func:`tinkergym.scheduler.leases.heartbeat`). The last stretch of a lease, from
  its last renewal to its end, is not counted: at most one heartbeat interval. Retention folds a deleted job's into its
  tenant's ``retired_device_seconds`` (:func:`retire_usage`), so a tenant's total outlives its old jobs.
- **Tokens trained and sampled** (``jobs.tokens_trained``, ``jobs.tokens_sampled``): the job's worker reads its server's
  totals (``GET /v1/usage`` of a whole server, the adapter listing of a shared one) before each heartbeat and sends them
  (:func:`token_increments`: only what grew since the last report at that lease counts, so a retried or late report
  adds nothing, and a new lease's server counts from 0). The tokens of calls after the last heartbeat are not counted.
- **Usage** (:func:`usage_rows`, ``GET /v1/usage``): per tenant, its jobs queued and holding devices, the devices held,
  device-seconds, tokens trained and sampled, stored artifact bytes and events, each beside its quota (``tinkergym scheduler tenants set``).
- **The queue's history** (:func:`sample_queue`, run by the sweeper): jobs queued and holding devices, and devices
  held and free, every ``QUEUE_SAMPLE_S`` seconds of the app's clock, the last ``QUEUE_SAMPLES`` samples kept in the
  process (a restarted scheduler starts a new history; Prometheus's ``tinkergym_scheduler_jobs`` keeps the long one).
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from sqlalchemy import and_, case, func, select, update
from sqlalchemy.engine import Connection

from tinkergym.scheduler import states
from tinkergym.scheduler.bounds import CLUSTER
from tinkergym.scheduler.db import allocations, devices, idempotency, jobs, tenants
from tinkergym.scheduler.idempotency import stored_bytes

#: Seconds between two samples of the queue's history, and the samples kept (an hour at the default).
QUEUE_SAMPLE_S = 10.0
QUEUE_SAMPLES = 360


def held_weight(conn: Connection, job_id: str) -> float:
    """The devices ``job_id`` holds, a seat counting 1 / the seats of its device."""
    return held_weights(conn, [job_id]).get(job_id, 0.0)


def held_weights(conn: Connection, job_ids: list[str]) -> dict[str, float]:
    """:func:`held_weight` of each of ``job_ids`` in one query (the jobs' places, each seat with the seats of its device)."""
    if not job_ids:
        return {}
    peers = devices.alias("peers")
    seats = select(func.count()).where(peers.c.worker_id == devices.c.worker_id, peers.c.seat_of == devices.c.seat_of, peers.c.active)
    held = conn.execute(select(allocations.c.job_id, case((devices.c.seat_of.is_(None), None), else_=seats.scalar_subquery()).label("seats"))
                        .join(devices, devices.c.id == allocations.c.device_id).where(allocations.c.job_id.in_(job_ids))).all()
    weights: dict[str, float] = {}
    for row in held:
        share = 1.0 if row.seats is None else 1.0 / max(1, int(row.seats))
        weights[row.job_id] = weights.get(row.job_id, 0.0) + share
    return weights


def charge_renewal(conn: Connection, job: dict[str, Any], now: float, ttl: float, epoch: int = 0,
                   usage: dict[str, int] | None = None) -> None:
    """Add the device-seconds of ``job`` since its lease's last renewal (its row before this renewal) and the tokens its
    server counted since the last report (``usage``: the server's totals at lease ``epoch``)."""
    values: dict[str, Any] = {}
    expires = job.get("lease_expires_at")
    if expires is not None and ttl > 0:
        elapsed = min(max(0.0, now - (float(expires) - ttl)), ttl)
        weight = held_weight(conn, job["id"]) if elapsed > 0 else 0.0
        if weight > 0:
            values["device_seconds"] = jobs.c.device_seconds + elapsed * weight
    if usage:
        values.update(token_increments(job, epoch, usage))
    if values:
        conn.execute(update(jobs).where(jobs.c.id == job["id"]).values(**values))


def token_increments(job: dict[str, Any], epoch: int, usage: dict[str, int]) -> dict[str, Any]:
    """The column updates for a server's token totals at lease ``epoch``: each counter grows by what it gained since the
    last report at that epoch (a new epoch's server counts from 0; a repeated or older report adds nothing)."""
    trained, sampled, reported = token_gains(job, epoch, usage)
    values: dict[str, Any] = {}
    if trained:
        values["tokens_trained"] = jobs.c.tokens_trained + trained
    if sampled:
        values["tokens_sampled"] = jobs.c.tokens_sampled + sampled
    if reported is not None:
        values["usage_reported"] = reported
    return values


def token_gains(job: dict[str, Any], epoch: int, usage: dict[str, int] | None) -> tuple[int, int, str | None]:
    """(tokens trained, tokens sampled) gained since the job's last report at lease ``epoch``, and the new report to keep
    (None: nothing gained)."""
    if not usage:
        return 0, 0, None
    try:
        last = json.loads(job.get("usage_reported") or "{}")
    except ValueError:
        last = {}
    if last.get("epoch") != epoch:
        last = {"epoch": epoch, "tokens_trained": 0, "tokens_sampled": 0}
    reported = dict(last)
    gains = []
    for key in ("tokens_trained", "tokens_sampled"):
        now, before = int(usage.get(key, 0)), int(last.get(key, 0))
        gains.append(max(0, now - before))
        if now > before:
            reported[key] = now
    return gains[0], gains[1], json.dumps(reported, sort_keys=True) if any(gains) else None


def retire_usage(conn: Connection, job: dict[str, Any]) -> None:
    """Fold a job that is being deleted into its tenant's ``retired_*`` totals."""
    spent = {f"retired_{k}": getattr(tenants.c, f"retired_{k}") + job[k] for k in ("device_seconds", "tokens_trained", "tokens_sampled")
             if job.get(k)}
    if spent:
        conn.execute(update(tenants).where(tenants.c.id == job["tenant_id"]).values(**spent))


def usage_rows(conn: Connection, tenant_id: str | None) -> list[dict[str, Any]]:
    """Each tenant's usage beside its quotas (``tenant_id`` None: every tenant), by tenant id."""
    holding = sorted(states.HOLDING)
    per_job = select(
        jobs.c.tenant_id,
        func.coalesce(func.sum(case((jobs.c.state == states.QUEUED, 1), else_=0)), 0).label("queued"),
        func.coalesce(func.sum(case((jobs.c.state.in_(holding), 1), else_=0)), 0).label("holding"),
        func.count().label("jobs"),
        func.coalesce(func.sum(jobs.c.device_seconds), 0.0).label("device_seconds"),
        func.coalesce(func.sum(jobs.c.tokens_trained), 0).label("tokens_trained"),
        func.coalesce(func.sum(jobs.c.tokens_sampled), 0).label("tokens_sampled"),
        func.coalesce(func.sum(jobs.c.artifact_bytes), 0).label("artifact_bytes"),
        func.coalesce(func.sum(jobs.c.cursor), 0).label("events"),
    ).group_by(jobs.c.tenant_id)
    held = select(jobs.c.tenant_id, func.count().label("devices_held")).join(allocations, allocations.c.job_id == jobs.c.id) \
        .where(devices_only()).group_by(jobs.c.tenant_id)
    seats = select(jobs.c.tenant_id, func.count().label("seats_held")).join(allocations, allocations.c.job_id == jobs.c.id) \
        .where(~devices_only()).group_by(jobs.c.tenant_id)
    query = select(tenants).where(tenants.c.id != CLUSTER)  # the worker credentials' tenant runs no jobs
    if tenant_id is not None:
        query, per_job, held, seats = (q.where(c == tenant_id) for q, c in
                                       ((query, tenants.c.id), (per_job, jobs.c.tenant_id), (held, jobs.c.tenant_id), (seats, jobs.c.tenant_id)))
    by_jobs = {r.tenant_id: r for r in conn.execute(per_job)}
    by_held = {r.tenant_id: int(r.devices_held) for r in conn.execute(held)}
    by_seats = {r.tenant_id: int(r.seats_held) for r in conn.execute(seats)}
    records = select(idempotency.c.tenant_id, func.count().label("records"), stored_bytes().label("bytes")).group_by(idempotency.c.tenant_id)
    if tenant_id is not None:
        records = records.where(idempotency.c.tenant_id == tenant_id)
    by_records = {r.tenant_id: (int(r.records), int(r.bytes)) for r in conn.execute(records)}
    rows = []
    for t in conn.execute(query.order_by(tenants.c.id)).mappings():
        j = by_jobs.get(t["id"])
        rows.append({
            "tenant": t["id"],
            "jobs": int(j.jobs) if j else 0,
            "queued": int(j.queued) if j else 0, "max_queued": t["max_queued"],
            "holding": int(j.holding) if j else 0,
            "devices_held": by_held.get(t["id"], 0), "seats_held": by_seats.get(t["id"], 0), "max_gpus": t["max_gpus"],
            "device_seconds": float(j.device_seconds if j else 0.0) + float(t["retired_device_seconds"] or 0.0),
            "tokens_trained": int(j.tokens_trained if j else 0) + int(t["retired_tokens_trained"] or 0),
            "tokens_sampled": int(j.tokens_sampled if j else 0) + int(t["retired_tokens_sampled"] or 0),
            "artifact_bytes": int(j.artifact_bytes) if j else 0, "max_artifact_bytes": t["max_artifact_bytes"],
            "events": int(j.events) if j else 0, "max_events_per_job": t["max_events_per_job"], "max_event_bytes": t["max_event_bytes"],
            "keep_ended_jobs": t["keep_ended_jobs"],
            "idempotency_records": by_records.get(t["id"], (0, 0))[0], "max_idempotency_records": t["max_idempotency_records"],
            "idempotency_bytes": by_records.get(t["id"], (0, 0))[1], "max_idempotency_bytes": t["max_idempotency_bytes"],
        })
    return rows


def devices_only() -> Any:
    """A clause on ``allocations``: the allocation is a whole device, not a seat."""
    return allocations.c.device_id.in_(select(devices.c.id).where(devices.c.seat_of.is_(None)))


def queue_sample(conn: Connection, now: float) -> dict[str, Any]:
    """Now's jobs queued and holding, by kind, and the active devices and seats held and free."""
    by_state = conn.execute(select(jobs.c.state, jobs.c.kind, func.count())
                            .where(jobs.c.state.in_([states.QUEUED, *sorted(states.HOLDING)])).group_by(jobs.c.state, jobs.c.kind)).all()
    queued = {k: 0 for k in states.KINDS}
    holding = {k: 0 for k in states.KINDS}
    for state, kind, n in by_state:
        counted = queued if state == states.QUEUED else holding
        counted[kind] = counted.get(kind, 0) + int(n)
    held = select(allocations.c.device_id)
    whole = devices.c.seat_of.is_(None)
    counts = conn.execute(select(*(func.coalesce(func.sum(case((c, 1), else_=0)), 0) for c in (
        and_(whole, devices.c.id.in_(held)), and_(whole, ~devices.c.id.in_(held)),
        and_(~whole, devices.c.id.in_(held)), and_(~whole, ~devices.c.id.in_(held)),
    ))).where(devices.c.active)).one()
    return {"t": now, "queued": queued, "holding": holding, "devices_held": int(counts[0]), "devices_free": int(counts[1]),
            "seats_held": int(counts[2]), "seats_free": int(counts[3])}


def sample_queue(app: Any) -> bool:
    """Append a :func:`queue_sample` to the app's history when ``QUEUE_SAMPLE_S`` passed since the last; whether it did."""
    state = app.state
    history: deque | None = getattr(state, "queue_history", None)
    if history is None:
        history = state.queue_history = deque(maxlen=QUEUE_SAMPLES)
    now = state.store.clock()
    if history and now - history[-1]["t"] < QUEUE_SAMPLE_S:
        return False
    with state.store.read() as conn:
        history.append(queue_sample(conn, now))
    return True
