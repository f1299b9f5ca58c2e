"""Leases: grant queued jobs to workers' devices, renew them by heartbeat, expire them, fence every write by epoch.

A lease is a job's ``lease_epoch`` (a number that only grows: every grant adds one), its holder
(``jobs.worker_id``) and its end (``jobs.lease_expires_at``, renewed by heartbeats). Every write a worker
makes names the epoch; a write with another epoch, or for a job its worker no longer holds, is a
:class:`~tinkergym.scheduler.repository.Conflict` (HTTP 409), so a paused or partitioned worker cannot act
after its lease is gone.

Granting is :mod:`tinkergym.scheduler.granting`'s: a worker asks, and gets queued jobs that fit its free places.

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

from sqlalchemy import BigInteger, Float, String, Text, bindparam, cast, delete, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from tinkergym.scheduler import measured, states
from tinkergym.scheduler.artifact_paths import CHECKPOINT_NAME
from tinkergym.scheduler.db import allocations, checkpoints, events, jobs, workers
from tinkergym.scheduler.repository import Conflict, JobStore
from tinkergym.scheduler.usage import charge_renewal, held_weights, token_gains
from tinkergym.scheduler.worker_registry import (  # noqa: F401 - the workers' half, importable from here
    ALIVE, FORGET_BATCH, GONE, count_loss, locked, strike_worker, forget_worker, mark_gone, owned_worker, quarantine_worker, register_worker,
    release_worker, sweep_workers, touch, worker_status, worker_timeout, worker_view,
)

SECRET_FILE = "scheduler.secret"
TOKEN_PREFIX = "tgs_"
#: Leases one pass of the sweeper expires at most, and queued jobs its pass of wait reasons reads (placement).
MAX_SCAN = 5000
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
    touch(conn, store, worker_id, now)
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
    touch(conn, store, worker_id, now)
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
    touch(conn, store, worker_id, store.clock())
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
    touch(conn, store, worker_id, now)
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
