"""Retention of ended jobs and of ``Idempotency-Key`` records: what the database would otherwise keep forever.

Run by the app's sweeper (:func:`sweep_if_due`, at most every ``retention_interval_s`` of the app's clock):

- An ended job (succeeded, failed, cancelled) is deleted with its events, checkpoints and artifacts (files) when
  its tenant has ``keep_ended_jobs`` newer ended jobs (``tinkergym scheduler tenants set TENANT
  --keep-ended-jobs N``), or when it ended more than ``job_retention_s`` ago (``tinkergym scheduler serve
  --job-retention``; 0: no age limit). A job that a queued or running job continues (its config's
  ``resume_job``) is kept until that job ends; a job that has not ended is never touched.
- ``Idempotency-Key`` records older than ``idempotency_ttl_s`` (``--idempotency-ttl``, a day by default, as Stripe
  keeps them) are deleted: a retry after that runs as a new request.

One job is deleted like this: its events first, :data:`EVENT_BATCH` at a time, each batch a transaction of its own
(a job may hold many); then one transaction checks it again (ended, not continued), deletes its remaining events,
checkpoints, allocations and row, and moves its files to the artifact store's trash (a rename: quick, and put
back should the transaction fail); after the commit the trash is emptied. A crash in between leaves only trash,
which the next pass empties. Each pass does bounded work (:data:`JOB_BATCH` jobs, :data:`KEY_BATCHES` batches of
keys) and the next sweep goes on at once when work was left.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import delete, func, select, tuple_
from tinkergym.scheduler import states
from tinkergym.scheduler.artifacts import ArtifactStore, continued_jobs
from tinkergym.scheduler.db import allocations, checkpoints, events, idempotency, jobs, tenants
from tinkergym.scheduler.repository import NotFound
from tinkergym.scheduler.usage import retire_usage

#: Jobs one pass deletes at most.
JOB_BATCH = 50
#: Events deleted per transaction (a job's events go in batches before its row).
EVENT_BATCH = 5000
#: Idempotency records deleted per transaction, and such transactions per pass.
KEY_BATCH = 5000
KEY_BATCHES = 10


def due(app: Any) -> bool:
    """Whether a pass should run now: ``retention_interval_s`` of the app's clock passed since the last (or the last left
    work, or the clock went back). Always on: every tenant keeps at most its ``keep_ended_jobs``."""
    now = app.state.store.clock()
    last = getattr(app.state, "job_retention_ran_at", None)
    return last is None or now < last or now - last >= app.state.settings.retention_interval_s


def sweep_if_due(app: Any) -> dict[str, int] | None:
    """:func:`sweep_jobs` when :func:`due`; what it did, or None."""
    return sweep_jobs(app) if due(app) else None


def sweep_jobs(app: Any) -> dict[str, int]:
    """One pass (see the module's notes): ``{"jobs": ended jobs deleted, "keys": idempotency records deleted}``."""
    store, artifacts, settings = app.state.store, app.state.artifacts, app.state.settings
    logger = getattr(app.state, "logger", None) or logging.getLogger("tinkergym.scheduler")
    now = store.clock()
    app.state.job_retention_ran_at = now
    artifacts.empty_trash()  # what a pass that crashed after its commit left
    with store.read() as conn:
        chosen = doomed_jobs(conn, now - settings.job_retention_s if settings.job_retention_s else None, JOB_BATCH)
    done = {"jobs": 0, "keys": 0}
    for job_id in chosen:
        try:
            done["jobs"] += delete_job(store, artifacts, job_id)
        except Exception:  # noqa: BLE001 - one job's failure must not stop the others
            logger.exception("could not delete ended job %s", job_id)
    artifacts.empty_trash()
    more_keys = False
    if settings.idempotency_ttl_s:
        for _ in range(KEY_BATCHES):
            deleted = delete_keys(store, now - settings.idempotency_ttl_s, KEY_BATCH)
            done["keys"] += deleted
            more_keys = deleted == KEY_BATCH
            if not more_keys:
                break
    if len(chosen) == JOB_BATCH or more_keys:
        app.state.job_retention_ran_at = None  # work was left: the next sweep goes on
    if any(done.values()):
        logger.info("job retention: %(jobs)d ended job(s) deleted, %(keys)d idempotency record(s) expired", done)
    return done


def doomed_jobs(conn: Any, ended_by: float | None, limit: int) -> list[str]:
    """Ended jobs to delete, oldest end first: those beyond their tenant's ``keep_ended_jobs`` newest ended jobs, and
    (``ended_by``) those that ended by then; never one that a live job continues."""
    ended = func.coalesce(jobs.c.finished_at, jobs.c.updated_at)
    newest_first = func.row_number().over(partition_by=jobs.c.tenant_id, order_by=(ended.desc(), jobs.c.id.desc()))
    ranked = (
        select(jobs.c.id, ended.label("ended"), newest_first.label("rank"), tenants.c.keep_ended_jobs.label("keep"))
        .join_from(jobs, tenants, tenants.c.id == jobs.c.tenant_id).where(jobs.c.state.in_(sorted(states.TERMINAL)))
        .subquery()
    )
    doomed = ranked.c.rank > ranked.c.keep
    if ended_by is not None:
        doomed = doomed | (ranked.c.ended <= ended_by)
    kept = continued_jobs(conn)
    query = select(ranked.c.id).where(doomed).order_by(ranked.c.ended, ranked.c.id).limit(limit + len(kept))
    return [job_id for job_id in conn.execute(query).scalars() if job_id not in kept][:limit]


def delete_job(store: Any, artifacts: ArtifactStore, job_id: str) -> bool:
    """Delete an ended job that no live job continues, with its events, checkpoints, allocations and files; whether it did."""
    while True:  # the events but the last batch, a batch per transaction
        with store.transaction() as conn:
            job = conn.execute(select(jobs.c.state, jobs.c.cursor).where(jobs.c.id == job_id)).first()
            if job is None or job.state not in states.TERMINAL or continued_jobs(conn, job_id):
                return False
            first = conn.execute(select(func.min(events.c.seq)).where(events.c.job_id == job_id)).scalar()
            if first is None or job.cursor - first < EVENT_BATCH:
                break
            conn.execute(delete(events).where(events.c.job_id == job_id, events.c.seq < first + EVENT_BATCH))
    handle = None
    try:
        with store.transaction() as conn:
            try:
                job = store.get(conn, job_id, for_update=True)
            except NotFound:  # deleted meanwhile (by another process's pass)
                return False
            if job["state"] not in states.TERMINAL or continued_jobs(conn, job_id):
                return False
            for table in (events, checkpoints, allocations):
                conn.execute(delete(table).where(table.c.job_id == job_id))
            retire_usage(conn, job)
            conn.execute(delete(jobs).where(jobs.c.id == job_id))
            handle = artifacts.trash(job_id)  # last: a failed commit puts the files back
    except BaseException:
        if handle is not None:
            artifacts.untrash(job_id, handle)
        raise
    return True


def delete_keys(store: Any, created_by: float, limit: int) -> int:
    """Delete up to ``limit`` idempotency records created by ``created_by`` (one transaction); how many."""
    key = tuple_(idempotency.c.tenant_id, idempotency.c.method, idempotency.c.path, idempotency.c.key)
    old = select(idempotency.c.tenant_id, idempotency.c.method, idempotency.c.path, idempotency.c.key) \
        .where(idempotency.c.created_at <= created_by).limit(limit)
    with store.transaction() as conn:
        return conn.execute(delete(idempotency).where(key.in_(old))).rowcount
