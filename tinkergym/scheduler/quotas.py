"""A tenant's quotas on what it can grow: events per job and their size, and the bytes its jobs' artifacts hold.

Each is a column of ``tenants`` (``tinkergym scheduler tenants set TENANT --max-events-per-job N --max-event-kb N
--max-artifact-gb N``), read by the statement that would grow past it, so it is checked exactly, whatever runs
at once:

- **events per job** (``max_events_per_job``) and **one event's size** (``max_event_bytes``, its ``data`` as
  JSON): an event that a client or a worker sends (``client-events``; a worker's ``log``, ``metrics`` and
  ``error``) is appended by :meth:`~tinkergym.scheduler.repository.JobStore.append_event` with ``limited=True``,
  whose ``UPDATE`` of the job's event cursor carries both limits in its ``WHERE`` clause
  (:func:`next_limited_seq`). Over them, 429 (the job holds its quota of events) or 413 (the event is too large).
  The scheduler's own events (state changes, leases, checkpoints, retention notes) are never refused: a job's life
  bounds them. The count is the job's cursor, so those count toward the quota too.
- **stored artifact bytes** (``max_artifact_bytes``): the sum of ``jobs.artifact_bytes`` over the tenant's jobs.
  An upload is refused (413) when its ``Content-Length``, or the bytes streamed so far, cannot fit
  (:func:`artifact_usage`), and again exactly when it commits (:func:`charge_upload`: the tenant's row is locked,
  so two uploads at once cannot both take the last bytes). A file uploaded again at the same path counts its
  new size only; deleted files are given back (:func:`release_bytes`, :func:`set_job_bytes`).

A refusal is :class:`QuotaExceeded` (the app answers its ``status``); it rolls its transaction back, so nothing is
stored under an ``Idempotency-Key``: the same request runs again once the quota is raised.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Integer, bindparam, case, func, literal, select, update
from sqlalchemy.engine import Connection

from tinkergym.scheduler.db import jobs, tenants
from tinkergym.scheduler.errors import NotFound

GIB = 1 << 30
KIB = 1 << 10


class QuotaExceeded(Exception):
    """A request would take a tenant past one of its quotas: answered ``status`` (413 or 429), never stored."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _tenant_limit(column: Any) -> Any:
    return select(column).where(tenants.c.id == jobs.c.tenant_id).scalar_subquery()


# The job's cursor moves on only while the job holds fewer events than its tenant's quota and the event fits.
_LIMITED_APPEND = (
    update(jobs)
    .where(jobs.c.id == bindparam("job_id"), jobs.c.cursor < _tenant_limit(tenants.c.max_events_per_job),
           bindparam("size", type_=Integer) <= _tenant_limit(tenants.c.max_event_bytes))
    .values(cursor=jobs.c.cursor + 1)
    .returning(jobs.c.cursor)
)


def next_limited_seq(conn: Connection, job_id: str, size: int) -> int:
    """The next event seq of ``job_id`` for an event whose ``data`` is ``size`` bytes as JSON, taken only within its
    tenant's quotas; else :class:`QuotaExceeded` (413: too large, 429: the job holds its quota of events) that names
    the quota and the command that raises it."""
    seq = conn.execute(_LIMITED_APPEND, {"job_id": job_id, "size": size}).scalar()
    if seq is not None:
        return int(seq)
    row = conn.execute(
        select(jobs.c.cursor, jobs.c.tenant_id, tenants.c.max_events_per_job, tenants.c.max_event_bytes)
        .join_from(jobs, tenants, tenants.c.id == jobs.c.tenant_id).where(jobs.c.id == job_id)
    ).first()
    if row is None:
        raise NotFound(job_id)
    if size > row.max_event_bytes:
        raise QuotaExceeded(413, (
            f"the event's data is {size:,} bytes as JSON, over tenant {row.tenant_id}'s max_event_bytes ({row.max_event_bytes:,}); "
            f"send smaller events, or raise it with: tinkergym scheduler tenants set {row.tenant_id} --max-event-kb {math.ceil(size / KIB)}"))
    raise QuotaExceeded(429, (
        f"job {job_id} holds {row.cursor:,} events, tenant {row.tenant_id}'s max_events_per_job ({row.max_events_per_job:,}); "
        f"raise it with: tinkergym scheduler tenants set {row.tenant_id} --max-events-per-job {max(2 * row.max_events_per_job, 1000)}"))


# ----- artifact bytes ------------------------------------------------------------------------------------
def stored_bytes(conn: Connection, tenant_id: str) -> int:
    """The bytes the tenant's jobs' stored artifacts hold."""
    return int(conn.execute(select(func.coalesce(func.sum(jobs.c.artifact_bytes), 0)).where(jobs.c.tenant_id == tenant_id)).scalar_one())


def artifact_usage(conn: Connection, tenant_id: str) -> tuple[int, int]:
    """The tenant's ``max_artifact_bytes`` and the bytes its jobs store now (a read without a lock: an early check)."""
    limit = conn.execute(select(tenants.c.max_artifact_bytes).where(tenants.c.id == tenant_id)).scalar_one()
    return int(limit), stored_bytes(conn, tenant_id)


def refuse_upload(job: dict[str, Any], size: int, stored: int, limit: int) -> QuotaExceeded:
    """The 413 for a file of ``size`` bytes of ``job`` that does not fit its tenant's ``limit`` (``stored`` held besides it)."""
    tenant = job["tenant_id"]
    return QuotaExceeded(413, (
        f"a file of {size:,} bytes for job {job['id']} would take tenant {tenant}'s stored artifacts to {stored + size:,} bytes, "
        f"over its max_artifact_bytes ({limit:,}); delete old jobs' artifacts (tinkergym scheduler serve --artifact-retention), "
        f"or raise it with: tinkergym scheduler tenants set {tenant} --max-artifact-gb {max(math.ceil((stored + size) / GIB), 1)}"))


def charge_upload(conn: Connection, job: dict[str, Any], size: int, replaced: int) -> None:
    """Count a file of ``size`` bytes (replacing one of ``replaced`` bytes, 0 for a new path) in ``job``'s
    ``artifact_bytes``, or :class:`QuotaExceeded` if its tenant's stored bytes would pass ``max_artifact_bytes``.

    Called in the upload's commit transaction, with the job's row locked; the tenant's row is locked here (``FOR NO
    KEY UPDATE`` on PostgreSQL, which a job's insert does not wait for; SQLite's write lock is held already), so
    uploads of one tenant are counted one at a time.
    """
    query = select(tenants.c.max_artifact_bytes).where(tenants.c.id == job["tenant_id"])
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(key_share=True)
    limit = int(conn.execute(query).scalar_one())
    stored = stored_bytes(conn, job["tenant_id"]) - replaced
    if size > replaced and stored + size > limit:
        raise refuse_upload(job, size, stored, limit)
    _add(conn, job["id"], size - replaced)


def _add(conn: Connection, job_id: str, delta: int) -> None:
    """``artifact_bytes += delta`` on the job, never below 0 (files stored before bytes were counted count as 0)."""
    total = jobs.c.artifact_bytes + literal(delta)
    conn.execute(update(jobs).where(jobs.c.id == job_id).values(artifact_bytes=case((total < 0, 0), else_=total)))


def release_bytes(conn: Connection, job_id: str, freed: int) -> None:
    """Give back ``freed`` bytes of the job's deleted files."""
    if freed:
        _add(conn, job_id, -freed)


def set_job_bytes(conn: Connection, job_id: str, total: int) -> None:
    """Set the job's ``artifact_bytes`` to what its stored files hold (after deletes, or to count files stored before)."""
    conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.artifact_bytes != total).values(artifact_bytes=total))
