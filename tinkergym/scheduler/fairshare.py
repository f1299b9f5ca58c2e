"""The grant order: fair share among tenants, then priority and age within a tenant; a few jobs deep in each queue.

A lease request (:func:`tinkergym.scheduler.granting.grant`) walks the queued jobs in this order and takes the first that
fits the worker. The head of the queue of the tenant that holds the least of the cluster now goes first: its held
devices (a seat a quarter of one on a 4-seat server, as usage counts it) over its ``share`` (1 unless the operator gave
it more; ``tinkergym scheduler tenants set --share``). Every free place goes to the tenant furthest below
its share, so tenants with work get the cluster in proportion to their shares whatever the sizes, number or order of
their jobs (max-min fairness, as Slurm's fair-share factor and Kubernetes' queue weights give), and a tenant alone gets
all of it. Within a tenant, jobs go by priority and then age: a job's priority (which its tenant sets) orders that
tenant's own jobs and never puts them before another tenant's, so no tenant gets past its share by raising it.

The work of one request does not grow with the queue: it reads the head of each tenant's queue (an index range,
``ix_jobs_tenant_queue``; one query for all tenants on PostgreSQL, a ``LATERAL`` join), then :data:`DEPTH` jobs deeper in a
tenant's queue at most, page by page, only as far as the jobs before them do not fit (backfill). A tenant's job deeper
than that waits for the jobs before it; the backfill age bound (a job waiting past ``backfill_age_s`` stops smaller jobs
from starting around it) keeps the head of every queue from starving.

The tenants' held devices are read once a second at most (:class:`Usage`, one grouped query) and counted up at each
grant between reads: the order needs no more, and quotas are checked exactly at the grant (its transaction).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import and_, case, func, or_, select, true, union_all
from sqlalchemy.engine import Connection

from tinkergym.scheduler import states
from tinkergym.scheduler.db import allocations, devices, jobs, tenants

#: Jobs read at once from each tenant's queue, and the most looked at in one tenant's queue by one request.
PAGE = 8
DEPTH = 32
#: Seconds the tenants' held devices are reused for before they are read again.
USAGE_TTL_S = 1.0

QUEUE_COLUMNS = (jobs.c.id, jobs.c.tenant_id, jobs.c.kind, jobs.c.priority, jobs.c.created_at, jobs.c.gpus, jobs.c.config,
                 jobs.c.lease_epoch, jobs.c.attempt)


def held_devices(conn: Connection) -> dict[str, float]:
    """Devices each tenant's jobs hold now (one query): a whole device 1, a seat 1 / the seats of its server."""
    seats = select(devices.c.worker_id, devices.c.seat_of, func.count().label("n")).where(
        devices.c.seat_of.is_not(None), devices.c.active.is_(True)).group_by(devices.c.worker_id, devices.c.seat_of).subquery()
    weight = case((devices.c.seat_of.is_(None), 1.0), else_=1.0 / func.coalesce(seats.c.n, 1))
    query = (select(jobs.c.tenant_id, func.sum(weight))
             .select_from(allocations.join(jobs, jobs.c.id == allocations.c.job_id).join(devices, devices.c.id == allocations.c.device_id)
                          .outerjoin(seats, and_(seats.c.worker_id == devices.c.worker_id, seats.c.seat_of == devices.c.seat_of)))
             .group_by(jobs.c.tenant_id))
    return {tenant: float(held) for tenant, held in conn.execute(query)}


class Usage:
    """Each tenant's held devices for the grant order: read at most every :data:`USAGE_TTL_S`, counted up at each grant
    between reads (a place freed shows at the next read). One per app; safe from any thread."""

    def __init__(self, ttl_s: float = USAGE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._held: dict[str, float] = {}
        self._read_at = -float("inf")
        self._lock = threading.Lock()

    def held(self, conn: Connection) -> dict[str, float]:
        with self._lock:
            if time.monotonic() - self._read_at < self.ttl_s:
                return dict(self._held)
        held = held_devices(conn)
        with self._lock:
            self._held, self._read_at = held, time.monotonic()
        return dict(held)

    def granted(self, tenant: str, weight: float) -> None:
        with self._lock:
            self._held[tenant] = self._held.get(tenant, 0.0) + weight


def shares(conn: Connection, tenant_ids: list[str] | None) -> dict[str, float]:
    """Each tenant's share (1 where none is set), for ``tenant_ids`` (None: every tenant)."""
    query = select(tenants.c.id, tenants.c.share)
    if tenant_ids is not None:
        query = query.where(tenants.c.id.in_(tenant_ids))
    return {tenant: float(share or 1.0) for tenant, share in conn.execute(query)}


def _after(last: dict[str, Any] | None, c: Any = jobs.c) -> Any:
    """Jobs after ``last`` in a tenant's queue order (priority desc, created_at, id); ``c``: the columns to compare."""
    if last is None:
        return true()
    p, t, i = last["priority"], last["created_at"], last["id"]
    return or_(c.priority < p, and_(c.priority == p, or_(c.created_at > t, and_(c.created_at == t, c.id > i))))


def _tenant_page(tenant: Any, last: dict[str, Any] | None, limit: int, where: Callable[[Any], Any] | None = None, depth: int = DEPTH) -> Any:
    """The next ``limit`` queued jobs of ``tenant`` after ``last``; with ``where`` (a condition on the columns it is given),
    only those it selects among the first ``depth`` of the queue: the database passes over the rest, and reads ``depth``
    index entries at most, however long the queue."""
    order = (jobs.c.priority.desc(), jobs.c.created_at.asc(), jobs.c.id.asc())
    if where is None:
        return select(*QUEUE_COLUMNS).where(jobs.c.tenant_id == tenant, jobs.c.state == states.QUEUED, _after(last)).order_by(*order).limit(limit)
    front = select(*QUEUE_COLUMNS).where(jobs.c.tenant_id == tenant, jobs.c.state == states.QUEUED).order_by(*order).limit(depth)
    if not isinstance(tenant, str):  # the LATERAL form: the window refers to the outer query's tenants row
        front = front.correlate(tenants)
    window = front.subquery("window")
    w = window.c
    return select(*w).where(where(w), _after(last, w)).order_by(w.priority.desc(), w.created_at.asc(), w.id.asc()).limit(limit)


def queue_heads(conn: Connection, tenant_ids: list[str], limit: int = PAGE, where: Callable[[Any], Any] | None = None,
                depth: int = DEPTH) -> dict[str, list[dict[str, Any]]]:
    """The first ``limit`` queued jobs of each of ``tenant_ids`` (those with none are left out), each in its queue order;
    ``where``: only those it selects among the first ``depth`` of each queue (:func:`_tenant_page`)."""
    found: dict[str, list[dict[str, Any]]] = {}
    if not tenant_ids:
        return found
    if conn.dialect.name == "postgresql":
        page = _tenant_page(tenants.c.id, None, limit, where, depth).lateral("head")
        query = select(page).select_from(tenants.join(page, true())).where(tenants.c.id.in_(tenant_ids))
        rows = list(conn.execute(query).mappings())
    else:  # no LATERAL: one statement of per-tenant pages (SQLite takes up to 500 terms in one compound select)
        rows = []
        for at in range(0, len(tenant_ids), 400):
            chunk: list[Any] = [_tenant_page(t, None, limit, where, depth).subquery().select() for t in tenant_ids[at:at + 400]]
            statement: Any = union_all(*chunk) if len(chunk) > 1 else chunk[0]
            rows.extend(conn.execute(statement).mappings())
    for row in rows:
        found.setdefault(row["tenant_id"], []).append(dict(row))
    for queue in found.values():
        queue.sort(key=lambda j: (-j["priority"], j["created_at"], j["id"]))
    return found


def fair_queue(conn: Connection, tenant_ids: list[str], held: dict[str, float], share: dict[str, float],
               depth: int = DEPTH, page: int = PAGE, turns: bool = False, where: Callable[[Any], Any] | None = None,
               live: bool = False) -> Iterator[dict[str, Any]]:
    """Queued jobs of ``tenant_ids`` in grant order (see the module's notes), at most ``depth`` of each tenant's, read
    ``page`` at a time. ``turns``: as if each job were granted in turn (its tenant's held devices counted up by its size,
    so tenants alternate as grants make them): the order in which a busy cluster would start them, which the wait
    reasons read; without it, the order of one grant (the held devices as they are). ``where`` (a grant's: the jobs that
    may fit the worker's free places, and those waiting past the backfill age): only the jobs it selects among the first
    ``depth`` of each queue; the database passes over the others. ``live``: ``held`` is the caller's to count up between
    jobs (a request granting many counts each job it grants), and the order follows it."""
    held = held if live and not turns else dict(held)
    heads = queue_heads(conn, tenant_ids, min(page, depth), where, depth)
    queues = {t: (q, len(q) == min(page, depth)) for t, q in heads.items()}  # (jobs read, whether more may follow)
    seen = dict.fromkeys(heads, 0)
    heap = [_key(held, share, t, q[0]) for t, (q, _) in queues.items()]
    heapq.heapify(heap)
    while heap:
        *_, tenant = heapq.heappop(heap)
        queue, more = queues[tenant]
        job = queue.pop(0)
        seen[tenant] += 1
        yield job
        if turns:
            held[tenant] = held.get(tenant, 0.0) + float(job["gpus"])
        if not queue and more and seen[tenant] < depth:
            want = min(page, depth - seen[tenant])
            queue = [dict(r) for r in conn.execute(_tenant_page(tenant, job, want, where, depth)).mappings()]
            more = len(queue) == want
        queues[tenant] = (queue, more)
        if queue and seen[tenant] < depth:
            heapq.heappush(heap, _key(held, share, tenant, queue[0]))


def _key(held: dict[str, float], share: dict[str, float], tenant: str, job: dict[str, Any]) -> tuple[Any, ...]:
    # a job's priority orders its tenant's own queue (the head is the tenant's most urgent job); across tenants, the share
    return (held.get(tenant, 0.0) / max(share.get(tenant, 1.0), 1e-9), job["created_at"], job["id"], tenant)
