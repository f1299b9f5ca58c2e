"""Jobs, events and checkpoints in the database: every state change a compare-and-set.

:class:`JobStore` is the only code that writes ``jobs.state``. A transition names the state it moves to;
the states it may come from are :data:`tinkergym.scheduler.states.TRANSITIONS`'s, and a write made on behalf
of a lease also names the lease's epoch. The ``UPDATE`` carries both in its ``WHERE`` clause, so a stale
writer (a worker whose lease expired and was granted again, a cancel racing a finish) changes nothing and
gets :class:`Conflict` (HTTP 409), whatever the interleaving.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator

from sqlalchemy import and_, bindparam, func, insert, select, update
from sqlalchemy.engine import Connection, Engine

from tinkergym.scheduler import quotas, states
from tinkergym.scheduler.errors import Conflict, NotFound  # noqa: F401 - importable from here
from tinkergym.scheduler.db import Prepared, checkpoints, events, jobs, reader, tenants, write_lock

#: Event types a job's stream carries (``data`` is a JSON object).
EVENT_TYPES = ("state", "log", "metrics", "checkpoint", "lease", "error", "waiting", "transcript")


def _first_event() -> Any:
    return insert(events).values(job_id=bindparam("id"), seq=bindparam("event_seq"), type=bindparam("event_type"),
                                 data=bindparam("event_data"), created_at=bindparam("created_at"))


_INSERT_JOB = Prepared(insert(jobs).values({c.key: bindparam(c.key) for c in jobs.c}))
_INSERT_FIRST_EVENT = Prepared(_first_event())
#: A queued job's first event, as :meth:`JobStore.append_event` would write it.
_QUEUED_EVENT = json.dumps({"state": states.QUEUED, "attempt": 0})
_QUEUED_COUNT = Prepared(select(func.count()).select_from(
    select(jobs.c.id).where(jobs.c.tenant_id == bindparam("tenant_id"), jobs.c.state == states.QUEUED).limit(bindparam("limit")).subquery()))
# SQLite (the write lock held since BEGIN IMMEDIATE): the quotas and the queued jobs in one statement.
_QUOTAS_AND_QUEUED = Prepared(select(
    tenants.c.max_gpus, tenants.c.max_queued,
    select(func.count()).select_from(
        select(jobs.c.id).where(jobs.c.tenant_id == bindparam("tenant_id"), jobs.c.state == states.QUEUED)
        .limit(select(tenants.c.max_queued + 1).where(tenants.c.id == bindparam("tenant_id")).scalar_subquery()).subquery()
    ).scalar_subquery(),
).where(tenants.c.id == bindparam("tenant_id")))
# PostgreSQL: the job and its first event (CTEs: the event's foreign key is checked at the statement's end), then
# the tenant's queue lock (an advisory lock held to the commit) and its quotas, in one statement.
_INSERT_JOB_AND_LOCK_QUEUE = Prepared(
    select(func.pg_advisory_xact_lock(bindparam("queue_lock")), tenants.c.max_gpus, tenants.c.max_queued)
    .where(tenants.c.id == bindparam("tenant_id"))
    .add_cte(insert(jobs).values({c.key: bindparam(c.key) for c in jobs.c}).cte("new_job"))
    .add_cte(_first_event().cte("first_event"))
)


@dataclass
class Quotas:
    """A tenant's quotas and its queued jobs (counted no further than ``max_queued + 1``)."""

    max_gpus: int
    max_queued: int
    queued: int


def _queue_lock(tenant_id: str) -> int:
    """The id of the PostgreSQL advisory lock that serializes a tenant's submissions (a signed 64-bit hash)."""
    return int.from_bytes(hashlib.blake2b(b"queue\x00" + tenant_id.encode("utf-8"), digest_size=8).digest(), "big", signed=True)


def now() -> float:
    return time.time()


def new_job_id() -> str:
    return "job_" + secrets.token_hex(12)


def _event_row(job_id: str, seq: int, type_: str, text: str, at: float) -> dict[str, Any]:
    """An ``events`` row: the job's event number ``seq`` (its cursor after the event), its JSON ``text``, made ``at``."""
    return {"job_id": job_id, "seq": seq, "type": type_, "data": text, "created_at": at}


@dataclass
class Transition:
    """What a transition wrote: the job's new row (as a dict) and the event it appended."""

    job: dict[str, Any]
    event_seq: int


class JobStore:
    """Reads and compare-and-set writes of jobs, their events and checkpoints, on one engine."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = now) -> None:
        self.engine = engine
        self.clock = clock
        self.touched: dict[str, float] = {}  # worker -> when this store last wrote its last_seen_at (tinkergym.scheduler.worker_registry.touch)
        #: This process's id (a fresh one per start): in-flight idempotency markers name it.
        self.owner = secrets.token_hex(8)
        #: Idempotency keys (tenant, method, path, key) whose request is running in this process (:mod:`tinkergym.scheduler.idempotency`).
        self.keys_in_flight: set[tuple[str, ...]] = set()
        self.keys_lock = threading.Lock()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One transaction (``BEGIN IMMEDIATE`` on SQLite): committed on success, rolled back on any exception."""
        with write_lock(self.engine), self.engine.begin() as connection:
            yield connection

    def read(self) -> Any:
        """A connection for reads (on SQLite a snapshot that never waits for writers): ``with store.read() as conn``."""
        return reader(self.engine).connect()

    # ----- jobs -------------------------------------------------------------------------------------
    def create_job(
        self, conn: Connection, *, tenant_id: str, kind: str, gpus: int, config: dict[str, Any], priority: int = 0,
        name: str = "", max_attempts: int = 3,
    ) -> dict[str, Any]:
        """Insert a queued job (inside the caller's transaction, with its idempotency record) and its first event."""
        return self.create_queued_job(conn, tenant_id=tenant_id, kind=kind, gpus=gpus, config=config, priority=priority, name=name,
                                      max_attempts=max_attempts, count_queue=False)[0]

    def create_queued_job(
        self, conn: Connection, *, tenant_id: str, kind: str, gpus: int, config: dict[str, Any], priority: int = 0,
        name: str = "", max_attempts: int = 3, count_queue: bool = True,
    ) -> tuple[dict[str, Any], Quotas | None]:
        """Insert a queued job and its first event; then (``count_queue``) the tenant's quotas and queued jobs, this one included.

        The count is atomic: on PostgreSQL the tenant's submissions are serialized from here to their commit (an
        advisory lock taken after the insert, so that it is held as briefly as can be, then the count in a statement
        of its own, whose snapshot has every job committed before the lock was granted); SQLite's write lock does that
        already. A caller that finds a quota exceeded raises, rolling the job back.
        """
        if kind not in states.KINDS:
            raise ValueError(f"unknown job kind {kind!r}; the kinds are {', '.join(states.KINDS)}")
        t = self.clock()
        row = {
            "id": new_job_id(), "tenant_id": tenant_id, "kind": kind, "state": states.QUEUED, "priority": priority, "gpus": gpus,
            "config": json.dumps(config, sort_keys=True), "name": name, "attempt": 0, "max_attempts": max_attempts,
            "created_at": t, "updated_at": t, "finished_at": None, "error": None, "lease_epoch": 0, "worker_id": None,
            "lease_expires_at": None, "server_url": None, "server_token_digest": None, "cursor": 1, "artifact_bytes": 0,
            "device_seconds": 0.0, "tokens_trained": 0, "tokens_sampled": 0, "usage_reported": None,
        }
        # The job with its cursor at its first event, and that event (seq 1): statements prepared once and run on the
        # driver's cursor (a submission's hot path).
        params = {**row, "event_seq": 1, "event_type": "state", "event_data": _QUEUED_EVENT}
        if conn.dialect.name == "postgresql" and count_queue:
            max_gpus, max_queued = _INSERT_JOB_AND_LOCK_QUEUE.rows(conn, {**params, "queue_lock": _queue_lock(tenant_id)})[0][1:]
            queued = _QUEUED_COUNT.rows(conn, {"tenant_id": tenant_id, "limit": max_queued + 1})[0][0]
            return row, Quotas(max_gpus, max_queued, queued)
        _INSERT_JOB.run(conn, params)
        _INSERT_FIRST_EVENT.run(conn, params)
        if not count_queue:
            return row, None
        if conn.dialect.name != "sqlite":
            raise NotImplementedError(f"counting a queue atomically on {conn.dialect.name}")
        return row, Quotas(*_QUOTAS_AND_QUEUED.rows(conn, {"tenant_id": tenant_id})[0])

    def get(self, conn: Connection, job_id: str, tenant_id: str | None = None, *, for_update: bool = False) -> dict[str, Any]:
        """The job's row; :class:`NotFound` when it does not exist or belongs to another tenant than ``tenant_id``."""
        if len(job_id) > 40 or "\x00" in job_id:  # no job has such an id (and PostgreSQL refuses NUL in text)
            raise NotFound(job_id)
        query = select(jobs).where(jobs.c.id == job_id)
        if tenant_id is not None:
            query = query.where(jobs.c.tenant_id == tenant_id)
        if for_update and conn.dialect.name != "sqlite":  # SQLite's BEGIN IMMEDIATE already holds the write lock
            query = query.with_for_update(key_share=True)  # NO KEY UPDATE: rows referring to it (events) are not blocked
        row = conn.execute(query).mappings().first()
        if row is None:
            raise NotFound(job_id)
        return dict(row)

    def transition(
        self, conn: Connection, job_id: str, to_state: str, *, epoch: int | None = None, event: dict[str, Any] | None = None,
        **values: Any,
    ) -> Transition:
        """Move ``job_id`` to ``to_state`` if it is in one of the allowed source states (and at lease ``epoch``).

        ``values`` are other columns written in the same ``UPDATE``. Appends a ``state`` event (with ``event``'s
        fields). Raises :class:`Conflict` when nothing matched, :class:`NotFound` when the job does not exist.
        """
        allowed = states.sources(to_state)
        t = self.clock()
        clause = and_(jobs.c.id == job_id, jobs.c.state.in_(sorted(allowed)))
        if epoch is not None:
            clause = and_(clause, jobs.c.lease_epoch == epoch)
        if to_state in states.TERMINAL:
            values.setdefault("finished_at", t)
        # the row, its new state and its event cursor in one statement (the event's seq), then the event: two statements
        row = conn.execute(update(jobs).where(clause).values(state=to_state, updated_at=t, cursor=jobs.c.cursor + 1, **values)
                           .returning(*jobs.c)).mappings().first()
        if row is None:
            current = self.get(conn, job_id)  # NotFound if there is no such job
            fenced = f" at lease epoch {epoch} (the job's epoch is {current['lease_epoch']})" if epoch is not None else ""
            raise Conflict(f"job {job_id} is {current['state']}: it cannot become {to_state}{fenced}")
        job = dict(row)
        data = json.dumps({"state": to_state, "attempt": job["attempt"], **(event or {})})
        conn.execute(insert(events), [_event_row(job_id, job["cursor"], "state", data, t)])
        return Transition(job, job["cursor"])

    def grant(self, conn: Connection, job_id: str, epoch: int, lease_event: dict[str, Any], **values: Any) -> int | None:
        """:meth:`transition` of a queued job to ``leased`` at lease ``epoch`` (from ``epoch - 1``), with its ``state``
        event and then its ``lease`` event (``lease_event``), in two statements (the row with both events' numbers, then
        both events) where a transition and an event more take four: a grant is the scheduler's most frequent
        transition, made under the grant lock. The job's ``attempt``; None when it is no longer queued at ``epoch - 1``
        (another grant took it, or it was cancelled)."""
        t = self.clock()
        row = conn.execute(
            update(jobs).where(jobs.c.id == job_id, jobs.c.state.in_(sorted(states.sources(states.LEASED))), jobs.c.lease_epoch == epoch - 1)
            .values(state=states.LEASED, updated_at=t, lease_epoch=epoch, cursor=jobs.c.cursor + 2, **values)
            .returning(jobs.c.cursor, jobs.c.attempt)
        ).first()
        if row is None:
            return None
        attempt = int(row.attempt)
        conn.execute(insert(events), [_event_row(job_id, row.cursor - 1, "state", json.dumps({"state": states.LEASED, "attempt": attempt, "epoch": epoch}), t),
                                      _event_row(job_id, row.cursor, "lease", json.dumps(lease_event), t)])
        return attempt

    def check_epoch(self, conn: Connection, job_id: str, epoch: int) -> dict[str, Any]:
        """The job's row if its lease epoch is ``epoch`` and it holds a lease; :class:`Conflict` otherwise (fencing)."""
        job = self.get(conn, job_id, for_update=True)
        if job["lease_epoch"] != epoch or job["state"] not in states.HOLDING:
            raise Conflict(f"job {job_id}: lease epoch {epoch} is stale (the job is {job['state']} at epoch {job['lease_epoch']})")
        return job

    def renew_lease(self, conn: Connection, job_id: str, epoch: int, worker_id: str, expires_at: float) -> dict[str, Any]:
        """Extend a held, unexpired lease to ``expires_at`` (compare-and-set on epoch, holder and expiry); :class:`Conflict` if lost."""
        clause = and_(jobs.c.id == job_id, jobs.c.lease_epoch == epoch, jobs.c.worker_id == worker_id,
                      jobs.c.state.in_(sorted(states.HOLDING)), jobs.c.lease_expires_at >= self.clock())
        if conn.execute(update(jobs).where(clause).values(lease_expires_at=expires_at)).rowcount != 1:
            current = self.get(conn, job_id)
            raise Conflict(f"job {job_id}: the lease at epoch {epoch} is lost (the job is {current['state']} at epoch {current['lease_epoch']})")
        return self.get(conn, job_id)

    # ----- events -----------------------------------------------------------------------------------
    def append_event(self, conn: Connection, job_id: str, type_: str, data: dict[str, Any], *, limited: bool = False) -> int:
        """Append an event to the job's stream; its ``seq`` is the job's cursor + 1 (unique per job).

        ``limited``: an event a client or a worker sent, appended only within its tenant's quotas (events per job,
        bytes per event), else :class:`~tinkergym.scheduler.quotas.QuotaExceeded`. The scheduler's own events are not.
        """
        if type_ not in EVENT_TYPES:
            raise ValueError(f"unknown event type {type_!r}; the types are {', '.join(EVENT_TYPES)}")
        text = json.dumps(data)
        if limited:
            seq = quotas.next_limited_seq(conn, job_id, len(text.encode("utf-8")))
        else:
            seq = conn.execute(
                update(jobs).where(jobs.c.id == job_id).values(cursor=jobs.c.cursor + 1).returning(jobs.c.cursor)
            ).scalar_one()
        conn.execute(insert(events), [_event_row(job_id, seq, type_, text, self.clock())])
        return seq

    def events_after(self, conn: Connection, job_id: str, after: int, limit: int = 100) -> list[dict[str, Any]]:
        """The job's events with ``seq > after``, oldest first."""
        rows = conn.execute(
            select(events).where(events.c.job_id == job_id, events.c.seq > after).order_by(events.c.seq).limit(limit)
        ).mappings()
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    # ----- checkpoints ------------------------------------------------------------------------------
    def add_checkpoint(self, conn: Connection, job_id: str, epoch: int, step: int, name: str) -> None:
        """Record a checkpoint the job's server wrote at lease ``epoch`` (fenced) and append its event."""
        self.check_epoch(conn, job_id, epoch)
        conn.execute(insert(checkpoints).values(job_id=job_id, step=step, name=name, epoch=epoch, created_at=self.clock()))
        self.append_event(conn, job_id, "checkpoint", {"step": step, "name": name})

    def checkpoints(self, conn: Connection, job_id: str) -> list[dict[str, Any]]:
        rows = conn.execute(select(checkpoints).where(checkpoints.c.job_id == job_id).order_by(checkpoints.c.step))
        return [dict(r) for r in rows.mappings()]
