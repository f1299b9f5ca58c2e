"""Open event streams: counted per key and overall, and woken by one watcher per app instead of polling each.

:class:`StreamHub` holds the app's open streams (:class:`Subscription`). A stream past ``max_streams_per_key`` for
its key, or past ``max_streams`` for the app, is refused (:class:`StreamRefused`, answered 429 with ``Retry-After``).

One background task (the watcher, started with the first stream) runs every ``interval_s`` seconds while streams
are open, and reads in one query both the event cursor (``jobs.cursor``, the last event's seq) of every job that
has an open stream and which of the streams' keys are still valid. A stream whose job's cursor is past what it
sent is woken and reads its new events; one whose key was revoked (or deleted) is woken to end. An idle stream
reads nothing: the database sees one query per interval, however many streams are open. A failed query is logged
and tried again at the next interval; the streams wait meanwhile (sending their keep-alives).

A stream of a key's whole job list (``GET /v1/jobs/changes``: ``job_id`` None, ``tenant`` its tenant or :data:`EVERY`
for an operator key) watches a fingerprint instead (:func:`read_versions`): per tenant, its jobs' count, the sum of their
event cursors and their latest update (an event appended to any of its jobs, a job made or deleted, changes it), and
the queue's count and creation times (a job ahead leaving the queue moves a queued job's position). One query reads
them, grouped per watched tenant, at most every ``CHANGES_POLL_S`` (an operator's reads every job's row: a list told
of a change within a second is live enough, and the database is spared five such scans a second).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Float, Integer, String, func, literal, select, union_all

from tinkergym.scheduler import states
from tinkergym.scheduler.db import api_keys, autocommit_reader, jobs

#: Seconds a refused client is told to wait (``Retry-After``): streams end with their jobs, or when clients leave.
RETRY_AFTER_S = 5


#: The least seconds between two reads of the job lists' fingerprints.
CHANGES_POLL_S = 1.0
#: The ``tenant`` of a job-list stream that watches every tenant's jobs (an operator key's).
EVERY = "*"
#: The queue's row in :meth:`StreamHub.read_versions` (no tenant can be named so: ``TENANT_PATTERN``).
QUEUE_ROW = " queue"
#: A fingerprint of a tenant's jobs (or of the queue): (count, sum of cursors, latest update).
Version = tuple[int, float, float]


class StreamRefused(Exception):
    """A stream over a limit (HTTP 429); the message names the limit and how to raise it."""


@dataclass(eq=False)
class Subscription:
    """One open stream: its job (None for a job-list stream of ``tenant``), its key, the last seq it sent (a job-list
    stream: the fingerprint it last reported), and the event the watcher sets to wake it."""

    job_id: str | None
    key_id: str
    cursor: int
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    revoked: bool = False  # the key was revoked: the stream ends when woken
    tenant: str | None = None
    version: tuple[Version, Version] | None = None
    uncounted: bool = False  # a key watched alone (StreamHub.watch_key): not one of the key's streams


class StreamHub:
    """The app's open streams, their limits, and the watcher that wakes them (see the module's docstring)."""

    def __init__(self, engine: Any, *, interval_s: float, max_streams: int, max_streams_per_key: int,
                 logger: logging.Logger | None = None) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.max_streams = max_streams
        self.max_streams_per_key = max_streams_per_key
        self.logger = logger or logging.getLogger("tinkergym.scheduler")
        self.subscriptions: set[Subscription] = set()
        self.per_key: Counter[str] = Counter()
        #: Watcher passes that read the database, and the ones that failed (for tests and diagnostics).
        self.passes = 0
        self.failures = 0
        self._failing = 0  # failed passes in a row
        self._versions_read = 0.0  # when the job lists' fingerprints were last read (monotonic)
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opened: asyncio.Event | None = None

    def streams_open(self) -> int:
        """The event streams open (the keys watched alone for forwarded answers are not streams)."""
        return sum(1 for s in self.subscriptions if not s.uncounted)

    def watch_key(self, key_id: str) -> Subscription:
        """Watch ``key_id`` alone, outside the stream limits (a forwarded answer, bounded by the gateway's own): the
        subscription is woken, ``revoked``, when the key is revoked; :meth:`close` it when the answer ends."""
        self._ensure_watcher()
        subscription = Subscription(None, key_id, 0, uncounted=True)
        self.subscriptions.add(subscription)
        assert self._opened is not None
        self._opened.set()
        return subscription

    def open(self, job_id: str | None, key_id: str, cursor: int, tenant: str | None = None) -> Subscription:
        """Count a new stream of ``key_id`` on ``job_id`` (resuming after ``cursor``), or on the job list of ``tenant``
        (``job_id`` None); :class:`StreamRefused` over a limit."""
        if self.per_key[key_id] >= self.max_streams_per_key:
            raise StreamRefused(
                f"this key has {self.per_key[key_id]} event streams open, the most one key may hold: close one first "
                f"(the operator raises the limit with: tinkergym scheduler serve --max-streams-per-key N)")
        streams = self.streams_open()
        if streams >= self.max_streams:
            raise StreamRefused(
                f"the scheduler has {streams} event streams open, the most it serves at once: retry later "
                f"(the operator raises the limit with: tinkergym scheduler serve --max-streams N)")
        self._ensure_watcher()
        subscription = Subscription(job_id, key_id, cursor, tenant=tenant)
        self.subscriptions.add(subscription)
        self.per_key[key_id] += 1
        assert self._opened is not None
        self._opened.set()
        return subscription

    def close(self, subscription: Subscription) -> None:
        """Free the stream's slot (once; closing again does nothing)."""
        if subscription in self.subscriptions:
            self.subscriptions.discard(subscription)
            if subscription.key_id in self.per_key and not subscription.uncounted:
                self.per_key[subscription.key_id] -= 1
                if self.per_key[subscription.key_id] <= 0:
                    del self.per_key[subscription.key_id]

    async def aclose(self) -> None:
        """Stop the watcher (the app's shutdown)."""
        task, self._task = self._task, None
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _ensure_watcher(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop = loop  # a watcher waits with the primitives of one event loop (tests run apps on several)
        self._opened = asyncio.Event()
        self._task = loop.create_task(self._watch(self._opened), name="tinkergym event stream watcher")

    async def _watch(self, opened: asyncio.Event) -> None:
        while True:
            if not self.subscriptions:
                opened.clear()
                await opened.wait()
            await asyncio.sleep(self.interval_s)
            if self.subscriptions:
                await self.watch_once()

    async def watch_once(self) -> None:
        """One pass: read the open streams' job cursors and live keys in one query; wake the streams that have news."""
        import anyio.to_thread

        watched = list(self.subscriptions)
        try:
            cursors, live_keys = await anyio.to_thread.run_sync(
                self._read, sorted({s.job_id for s in watched if s.job_id is not None}), sorted({s.key_id for s in watched}))
            tenants = sorted({s.tenant for s in watched if s.job_id is None and s.tenant is not None})
            versions: dict[str, tuple[Version, Version]] = {}
            if tenants and time.monotonic() - self._versions_read >= CHANGES_POLL_S:
                self._versions_read = time.monotonic()
                versions = await anyio.to_thread.run_sync(self.read_versions, tenants)
        except Exception as exc:  # noqa: BLE001 - the database is down or busy: the streams wait, the next pass retries
            self.failures += 1
            self._failing += 1
            if self._failing == 1 or self._failing % 100 == 0:
                self.logger.warning("event streams: reading job cursors failed (%s: %s); retrying every %g s", type(exc).__name__,
                                    str(exc).splitlines()[0][:300] if str(exc) else "", self.interval_s)
            return
        if self._failing:
            self.logger.warning("event streams: reading job cursors works again after %d failed passes", self._failing)
            self._failing = 0
        self.passes += 1
        for subscription in watched:
            if subscription.key_id not in live_keys:
                subscription.revoked = True
                subscription.wake.set()
            elif subscription.job_id is None:
                now = versions.get(subscription.tenant or "")
                if now is not None and now != subscription.version:
                    subscription.version = now
                    subscription.wake.set()
            elif cursors.get(subscription.job_id, subscription.cursor + 1) > subscription.cursor:  # a deleted job wakes too
                subscription.wake.set()

    def read_versions(self, tenants: list[str]) -> dict[str, tuple[Version, Version]]:
        """Each tenant's fingerprint (:data:`EVERY`: every tenant's jobs together) with the queue's, in one query."""
        aggregates = (func.count(), func.coalesce(func.sum(jobs.c.cursor), 0), func.coalesce(func.max(jobs.c.updated_at), 0.0))
        named = [t for t in tenants if t != EVERY]
        parts = [select(literal(QUEUE_ROW, String), *(func.count(), func.coalesce(func.sum(jobs.c.created_at), 0.0), literal(0.0, Float)))
                 .where(jobs.c.state == states.QUEUED)]
        if EVERY in tenants:
            parts.append(select(literal(EVERY, String), *aggregates))
        if named:
            parts.append(select(jobs.c.tenant_id, *aggregates).where(jobs.c.tenant_id.in_(named)).group_by(jobs.c.tenant_id))
        with autocommit_reader(self.engine).connect() as conn:
            rows = {str(name): (int(n), float(total), float(latest)) for name, n, total, latest in conn.execute(union_all(*parts))}
        queue = rows.pop(QUEUE_ROW, (0, 0.0, 0.0))
        return {t: (rows.get(t, (0, 0.0, 0.0)), queue) for t in tenants}

    def _read(self, job_ids: list[str], key_ids: list[str]) -> tuple[dict[str, int], set[str]]:
        query = union_all(
            select(literal("job", String), jobs.c.id, jobs.c.cursor).where(jobs.c.id.in_(job_ids)),
            select(literal("key", String), api_keys.c.id, literal(0, Integer))
            .where(api_keys.c.id.in_(key_ids), api_keys.c.revoked_at.is_(None)),
        )
        cursors: dict[str, int] = {}
        live: set[str] = set()
        with autocommit_reader(self.engine).connect() as conn:
            for kind, row_id, cursor in conn.execute(query):
                if kind == "job":
                    cursors[row_id] = int(cursor)
                else:
                    live.add(row_id)
        return cursors, live
