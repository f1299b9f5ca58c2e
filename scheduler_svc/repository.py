"""Jobs, events and checkpoints in the database: every state change a compare-and-set.

:class:`JobStore` is the only code that writes ``jobs.state``. A transition names the state it moves to;
the states it may come from are :data:`tinkergym.scheduler.states.TRANSITIONS`'s, and a write made on behalf
of a lease also names the lease's epoch. The ``UPDATE`` carries both in its ``WHERE`` clause, so a stale
writer (a worker whose lease expired and was granted again, a cancel racing a finish) changes nothing and
gets :class:`Conflict` (HTTP 409), whatever the interleaving.
"""

from __future__ import annotations

import json
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from sqlalchemy import and_, insert, select, update
from sqlalchemy.engine import Connection, Engine

from tinkergym.scheduler import states
from tinkergym.scheduler.db import checkpoints, events, jobs, reader, write_lock

#: Event types a job's stream carries (``data`` is a JSON object).
EVENT_TYPES = ("state", "log", "metrics", "checkpoint", "lease", "error")


class Conflict(Exception):
    """A compare-and-set lost: the job is not in a state (or lease epoch) the write expects (HTTP 409)."""


class NotFound(Exception):
    """No such job for this tenant (HTTP 404: another tenant's job is not found either)."""


def now() -> float:
    return time.time()


def new_job_id() -> str:
    return "job_" + secrets.token_hex(12)


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
        #: This process's id (a fresh one per start): in-flight idempotency markers name it.
        self.owner = secrets.token_hex(8)

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
        if kind not in states.KINDS:
            raise ValueError(f"unknown job kind {kind!r}; the kinds are {', '.join(states.KINDS)}")
        t = self.clock()
        row = {
            "id": new_job_id(), "tenant_id": tenant_id, "kind": kind, "state": states.QUEUED, "priority": priority, "gpus": gpus,
            "config": json.dumps(config, sort_keys=True), "name": name, "attempt": 0, "max_attempts": max_attempts,
            "created_at": t, "updated_at": t, "finished_at": None, "error": None, "lease_epoch": 0, "worker_id": None,
            "lease_expires_at": None, "server_url": None, "server_token_digest": None, "cursor": 1,
        }
        # Two statements: the job with its cursor at its first event, and that event (seq 1).
        conn.execute(insert(jobs).values(**row))
        conn.execute(insert(events).values(job_id=row["id"], seq=1, type="state", data=json.dumps({"state": states.QUEUED, "attempt": 0}),
                                           created_at=t))
        return row

    def get(self, conn: Connection, job_id: str, tenant_id: str | None = None, *, for_update: bool = False) -> dict[str, Any]:
        """The job's row; :class:`NotFound` when it does not exist or belongs to another tenant than ``tenant_id``."""
        if len(job_id) > 40 or "\x00" in job_id:  # no job has such an id (and PostgreSQL refuses NUL in text)
            raise NotFound(job_id)
        query = select(jobs).where(jobs.c.id == job_id)
        if tenant_id is not None:
            query = query.where(jobs.c.tenant_id == tenant_id)
        if for_update and conn.dialect.name != "sqlite":  # SQLite's BEGIN IMMEDIATE already holds the write lock
            query = query.with_for_update()
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
        result = conn.execute(update(jobs).where(clause).values(state=to_state, updated_at=t, **values))
        if result.rowcount != 1:
            current = self.get(conn, job_id)  # NotFound if there is no such job
            fenced = f" at lease epoch {epoch} (the job's epoch is {current['lease_epoch']})" if epoch is not None else ""
            raise Conflict(f"job {job_id} is {current['state']}: it cannot become {to_state}{fenced}")
        job = self.get(conn, job_id)
        seq = self.append_event(conn, job_id, "state", {"state": to_state, "attempt": job["attempt"], **(event or {})})
        return Transition(job, seq)

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
    def append_event(self, conn: Connection, job_id: str, type_: str, data: dict[str, Any]) -> int:
        """Append an event to the job's stream; its ``seq`` is the job's cursor + 1 (unique per job)."""
        if type_ not in EVENT_TYPES:
            raise ValueError(f"unknown event type {type_!r}; the types are {', '.join(EVENT_TYPES)}")
        seq = conn.execute(
            update(jobs).where(jobs.c.id == job_id).values(cursor=jobs.c.cursor + 1).returning(jobs.c.cursor)
        ).scalar_one()
        conn.execute(insert(events).values(job_id=job_id, seq=seq, type=type_, data=json.dumps(data), created_at=self.clock()))
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
