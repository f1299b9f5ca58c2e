"""Workers in the scheduler's tables: registration within a credential's bounds, status (alive or gone), strikes and
quarantine, and forgetting silent ones (see :mod:`tinkergym.scheduler.leases` for how these fit the leases)."""

from __future__ import annotations

import json
import logging
import math
import secrets
from typing import Any

from sqlalchemy import delete, func, insert, select, true, update
from sqlalchemy.engine import Connection

from tinkergym.scheduler import states
from tinkergym.scheduler.bounds import WorkerBounds
from tinkergym.scheduler.db import allocations, api_keys, devices, jobs, memory_factors, workers
from tinkergym.scheduler.repository import JobStore
from tinkergym.scheduler.seats import parse_shared, seat_index, shared_json


def locked(conn: Connection, query: Any) -> Any:
    """``query FOR NO KEY UPDATE`` where the database has it (SQLite's ``BEGIN IMMEDIATE`` already holds the write lock).

    Not ``FOR UPDATE``: that lock also blocks the foreign-key checks of rows that refer to the locked one (``FOR KEY
    SHARE``), so a grant holding its worker's row and a state report of another of that worker's jobs (which checks
    ``jobs.worker_id``) deadlocked under load. Lockers still exclude each other, and a ``DELETE`` still waits for them."""
    return query if conn.dialect.name == "sqlite" else query.with_for_update(key_share=True)


def register_worker(
    conn: Connection, *, key_id: str, bounds: WorkerBounds, name: str, host: str, device_list: list[dict[str, Any]], models: list[str],
    now: float, model_shapes: dict[str, dict[str, Any]] | None = None,
) -> str:
    """Create or update the worker ``name`` of worker credential ``key_id`` and upsert its places by index; its id.

    A device with ``shared`` (``seats``, ``model``, ``dtype``, ``max_lora_rank``) runs a shared training server: it is
    registered as its seats (:mod:`tinkergym.scheduler.seats`), not as a whole device. The registration must fit the
    credential's ``bounds`` (:class:`~tinkergym.scheduler.bounds.BoundsError` otherwise), counting every device the
    credential holds: the active devices of its other workers, and every device of any of its workers that a job still
    holds, listed now or not (a device with seats counts once). Places the worker no longer lists are marked inactive
    (a job holding one keeps it until it ends, and it counts until then; no new job gets it), so re-registering with
    other indexes while jobs run cannot hold more devices than the bound. Registrations of one key are serialised by a
    lock on the key's row, so two at once cannot both fit the bound.
    """
    conn.execute(locked(conn, select(api_keys.c.id).where(api_keys.c.id == key_id))).first()
    row = conn.execute(select(workers.c.id).where(workers.c.key_id == key_id, workers.c.name == name)).first()
    mine = select(workers.c.id).where(workers.c.key_id == key_id)
    elsewhere = devices.c.active.is_(True) & (devices.c.worker_id != row[0] if row is not None else true())
    counted = conn.execute(select(devices.c.worker_id, devices.c.index, devices.c.seat_of).where(
        devices.c.worker_id.in_(mine), elsewhere | devices.c.id.in_(select(allocations.c.device_id)))).all()
    listed_here = {(row[0] if row else None, int(d["index"])) for d in device_list}
    bounds.check_registration(device_list, models, len(physical_devices(counted) - listed_here))
    values = {"host": host, "models": json.dumps(sorted(set(models))), "last_seen_at": now,
              "model_shapes": json.dumps(model_shapes, sort_keys=True) if model_shapes else None}
    if row is None:
        worker_id = "wkr_" + secrets.token_hex(8)
        conn.execute(insert(workers).values(id=worker_id, name=name, key_id=key_id, registered_at=now, **values))
    else:
        worker_id = row[0]
        conn.execute(update(workers).where(workers.c.id == worker_id).values(**values))
    known: dict[int, int] = {index: id_ for id_, index in conn.execute(select(devices.c.id, devices.c.index).where(devices.c.worker_id == worker_id))}
    listed = set()
    for index, fields in places(device_list):
        listed.add(index)
        if index in known:
            conn.execute(update(devices).where(devices.c.id == known[index]).values(**fields))
        else:
            conn.execute(insert(devices).values(worker_id=worker_id, index=index, **fields))
    gone = [known[i] for i in known if i not in listed]
    if gone:
        conn.execute(update(devices).where(devices.c.id.in_(gone)).values(active=False))
    return worker_id


def places(device_list: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The rows a registration's devices make, ``(index, fields)``: a whole device, or the seats of a shared one."""
    found: list[tuple[int, dict[str, Any]]] = []
    for device in device_list:
        memory = device.get("memory_gb")
        fields = {"kind": device["kind"], "name": device.get("name", ""), "active": True, "seat_of": None, "shared": None,
                  "memory_bytes": int(memory * 2**30) if memory else None}
        shared = device.get("shared")
        if not shared:
            found.append((device["index"], fields))
            continue
        base = shared_json(shared["model"], shared.get("dtype") or "auto", int(shared["max_lora_rank"]))
        for k in range(int(shared["seats"])):
            found.append((seat_index(device["index"], k), {**fields, "name": f"{fields['name'] or device['index']} seat {k}",
                                                           "seat_of": device["index"], "shared": base}))
    return found


def physical_devices(rows: Any) -> set[tuple[str, int]]:
    """The devices that rows of ``devices`` (``worker_id``, ``index``, ``seat_of``) stand for, as ``(worker, index)``: each
    seat stands for its device."""
    return {(r.worker_id, r.index if r.seat_of is None else r.seat_of) for r in rows}


ALIVE, GONE = "alive", "gone"
#: Silent workers forgotten per sweeper pass at most.
FORGET_BATCH = 100


def worker_timeout(settings: Any) -> float:
    """Seconds without a call after which a worker is gone: ``worker_timeout_s`` (None: three lease TTLs), at least one TTL."""
    configured = getattr(settings, "worker_timeout_s", None)
    return max(float(configured) if configured else 3.0 * settings.lease_ttl_s, settings.lease_ttl_s)


def mark_gone(conn: Connection, worker_id: str, now: float, timeout: float) -> None:
    """List the worker ``gone`` from ``now`` (it said it is stopping): its last call moves to just past the timeout."""
    conn.execute(update(workers).where(workers.c.id == worker_id).values(last_seen_at=min(now - timeout - 1e-3, now)))


def worker_status(last_seen_at: float, now: float, timeout: float) -> str:
    """``gone`` when the worker has not been seen for ``timeout`` seconds, else ``alive``."""
    return GONE if now - last_seen_at > timeout else ALIVE


def worker_view(conn: Connection, worker_id: str, *, now: float, timeout: float) -> dict[str, Any] | None:
    """The worker's public view (id, name, host, models, ``status``, devices and seats with ``busy``, times); None if there is none."""
    row = conn.execute(select(workers).where(workers.c.id == worker_id)).mappings().first()
    if row is None:
        return None
    busy = select(allocations.c.device_id)
    found = conn.execute(
        select(devices.c.index, devices.c.kind, devices.c.name, devices.c.active, devices.c.id.in_(busy).label("busy"), devices.c.seat_of,
               devices.c.shared, devices.c.memory_bytes, devices.c.used_bytes, devices.c.peak_bytes, devices.c.host_bytes, devices.c.host_peak_bytes,
               devices.c.measured_at).where(devices.c.worker_id == worker_id).order_by(devices.c.index)
    ).mappings()
    return {
        "id": row["id"], "name": row["name"], "host": row["host"], "models": json.loads(row["models"]),
        "status": worker_status(row["last_seen_at"], now, timeout),
        "devices": [{**{k: (bool(d[k]) if k in ("active", "busy") else d[k]) for k in d}, "shared": parse_shared(d["shared"])} for d in found],
        "registered_at": row["registered_at"], "last_seen_at": row["last_seen_at"],
        "strikes": row["strikes"], "quarantined": row["quarantined_at"] is not None, "quarantine_reason": row["quarantine_reason"],
    }


def owned_worker(conn: Connection, worker_id: str, key_id: str) -> dict[str, Any] | None:
    """The worker's row if it exists and was registered with key ``key_id``; None otherwise."""
    row = conn.execute(select(workers).where(workers.c.id == worker_id, workers.c.key_id == key_id)).mappings().first()
    return dict(row) if row is not None else None


def strike_worker(conn: Connection, store: JobStore, job: dict[str, Any], quarantine_after: int, now: float) -> None:
    """Count a lease of ``job`` that expired before its server came up against its worker; quarantine it at ``quarantine_after``.

    The job's owner reads why in its events (the worker, its strikes, and its quarantine). Strikes reset when the worker
    proves itself (a heartbeat after it reported a job running: :func:`tinkergym.scheduler.leases.proven`), not when it
    merely reports ``running``; a quarantined worker gets no lease until the operator releases it.
    """
    worker_id = job["worker_id"]
    row = conn.execute(locked(conn, select(workers.c.strikes, workers.c.quarantined_at).where(workers.c.id == worker_id))).first()
    if row is None:
        return
    strikes = row.strikes + 1
    quarantine = bool(quarantine_after) and strikes >= quarantine_after and row.quarantined_at is None
    reason = f"{strikes} of its leases in a row expired before the job ran on it (it took jobs and never ran them)"
    conn.execute(update(workers).where(workers.c.id == worker_id).values(
        strikes=strikes, **({"quarantined_at": now, "quarantine_reason": reason} if quarantine else {})))
    data: dict[str, Any] = {"message": "the lease expired before the job ran on its worker", "worker": worker_id, "strikes": strikes}
    if quarantine:
        data["message"] += f"; worker {worker_id} is quarantined after {strikes} such leases in a row and gets no more jobs"
    store.append_event(conn, job["id"], "log", data)


def count_loss(conn: Connection, store: JobStore, job: dict[str, Any], policy: Any, now: float) -> None:
    """Count a lost lease of ``job`` against its worker if the worker still calls (seen after the lease ended: it is
    alive and let this lease go) and the lease ended while this scheduler ran (``policy.since``: after an outage, a
    worker's first call may come before the sweep of the leases that ran out meanwhile), within ``policy.quarantine_window_s``; at ``policy.quarantine_losses`` such losses in
    the window it is quarantined, whatever it reported. The count is a fixed window: it starts at the first loss after
    the last window ended."""
    worker_id = job["worker_id"]
    row = conn.execute(locked(conn, select(workers.c.last_seen_at, workers.c.losses, workers.c.losses_since, workers.c.quarantined_at)
                                     .where(workers.c.id == worker_id))).first()
    if row is None or row.last_seen_at < job["lease_expires_at"] or job["lease_expires_at"] < policy.since:
        return  # it stopped calling before the lease ended (it died holding it), or the lease ran out while no scheduler ran
    if row.losses_since is None or now - row.losses_since > policy.quarantine_window_s:
        losses, since = 1, now
    else:
        losses, since = row.losses + 1, row.losses_since
    quarantine = bool(policy.quarantine_losses) and losses >= policy.quarantine_losses and row.quarantined_at is None
    reason = f"it lost {losses} leases within {policy.quarantine_window_s:g} s while it kept calling the scheduler"
    conn.execute(update(workers).where(workers.c.id == worker_id).values(
        losses=losses, losses_since=since, **({"quarantined_at": now, "quarantine_reason": reason} if quarantine else {})))
    if quarantine:
        store.append_event(conn, job["id"], "log", {"message": f"worker {worker_id} is quarantined: {reason}", "worker": worker_id,
                                                    "losses": losses})


def quarantine_worker(conn: Connection, worker_id: str, reason: str, now: float) -> None:
    """Quarantine the worker for ``reason`` (it reported it cannot run jobs): no lease until the operator releases it."""
    conn.execute(update(workers).where(workers.c.id == worker_id).values(
        quarantined_at=func.coalesce(workers.c.quarantined_at, now), quarantine_reason=reason))


def release_worker(store: JobStore, worker_id: str) -> bool:
    """End a worker's quarantine and clear its strikes; False when there is no such worker."""
    with store.transaction() as conn:
        result = conn.execute(update(workers).where(workers.c.id == worker_id).values(
            strikes=0, losses=0, losses_since=None, quarantined_at=None, quarantine_reason=None))
    return result.rowcount == 1


def forget_worker(store: JobStore, worker_id: str, seen_before: float) -> bool:
    """Delete a worker not seen since ``seen_before`` that holds nothing, with its devices (one transaction); whether it did.

    Re-checks under lock (its key's row first, as registration takes it) that the worker is still that silent,
    holds no lease and no device; ended jobs that ran on it stop naming it (``jobs.worker_id`` becomes null).
    """
    with store.transaction() as conn:
        row = conn.execute(select(workers.c.key_id).where(workers.c.id == worker_id)).first()
        if row is None:
            return False
        conn.execute(locked(conn, select(api_keys.c.id).where(api_keys.c.id == row.key_id))).first()
        worker = conn.execute(locked(conn, select(workers).where(workers.c.id == worker_id))).mappings().first()
        if worker is None or worker["last_seen_at"] >= seen_before:
            return False
        held = conn.execute(select(jobs.c.id).where(jobs.c.worker_id == worker_id, jobs.c.state.in_(sorted(states.HOLDING))).limit(1)).first()
        owned = select(devices.c.id).where(devices.c.worker_id == worker_id)
        if held is not None or conn.execute(select(allocations.c.device_id).where(allocations.c.device_id.in_(owned)).limit(1)).first():
            return False
        conn.execute(update(jobs).where(jobs.c.worker_id == worker_id).values(worker_id=None))
        conn.execute(delete(devices).where(devices.c.worker_id == worker_id))
        conn.execute(delete(memory_factors).where(memory_factors.c.worker_id == worker_id))
        conn.execute(delete(workers).where(workers.c.id == worker_id))
    return True


def sweep_workers(app: Any) -> dict[str, int]:
    """Log the workers that turned gone or came back since the last pass, and forget those gone for ``worker_forget_s``.

    Returns ``{"gone": workers gone now, "forgotten": workers deleted by this pass}``. The status itself is
    derived (:func:`worker_status`), so this pass only reports it and forgets.
    """
    store: JobStore = app.state.store
    settings = app.state.settings
    now, timeout = store.clock(), worker_timeout(settings)
    with store.read() as conn:
        silent = {r.id: r for r in conn.execute(
            select(workers.c.id, workers.c.name, workers.c.last_seen_at).where(workers.c.last_seen_at < now - timeout))}
    logger = getattr(app.state, "logger", None) or logging.getLogger("tinkergym.scheduler")
    before: set[str] = getattr(app.state, "gone_workers", set())
    for worker_id in sorted(set(silent) - before):
        logger.warning("worker %s (%s) is gone: not seen for %.0f s", worker_id, silent[worker_id].name, now - silent[worker_id].last_seen_at)
    for worker_id in sorted(before - set(silent)):
        logger.info("worker %s is back", worker_id)
    forgotten = 0
    forget_after = getattr(settings, "worker_forget_s", None)
    if forget_after:
        cutoff = now - max(float(forget_after), timeout)
        for worker_id in [w for w, r in silent.items() if r.last_seen_at < cutoff][:FORGET_BATCH]:
            try:
                if forget_worker(store, worker_id, cutoff):
                    forgotten += 1
                    silent.pop(worker_id)
                    logger.info("forgot worker %s: not seen for over %.0f s, holding nothing", worker_id, now - cutoff)
            except Exception:  # noqa: BLE001 - one worker's failure must not stop the sweep
                logger.exception("could not forget worker %s", worker_id)
    app.state.gone_workers = set(silent)
    return {"gone": len(silent), "forgotten": forgotten}


#: A worker's ``last_seen_at`` moves at most this often (seconds): it says alive or gone against a timeout of tens of
#: seconds, and a write of the worker's row at each of its calls was a third of PostgreSQL's time at 1,000 workers (the
#: calls of a worker waiting on each other's row lock, and on its grant's).
TOUCH_EVERY_S = 1.0


#: Workers a store remembers writing the row of (:func:`touch`); past it, it forgets them all.
MAX_TOUCHED = 100_000


def touch(conn: Connection, store: JobStore, worker_id: str, now: float) -> None:
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
