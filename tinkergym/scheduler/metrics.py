"""The scheduler's Prometheus metrics (``GET /metrics``, a key with the ``metrics`` scope; ``admin`` has it too).

Besides the HTTP families every server has (:mod:`tinkergym.serve.metrics`):

- ``tinkergym_scheduler_jobs{state, kind}``: jobs by state and kind (the queue depth is ``state="queued"``), every
  state and kind listed, 0 included;
- ``tinkergym_scheduler_devices{kind, state}``: the active devices and seats of registered workers (``kind``
  ``device`` or ``seat``), ``free`` or ``held`` by a lease, and the ``inactive`` ones (a worker that registered fewer);
- ``tinkergym_scheduler_workers{state}``: registered workers ``alive``, ``gone`` (no call within the worker timeout) or
  ``quarantined``;
- ``tinkergym_scheduler_event_streams_open``: the server-sent event streams held open now;
- ``tinkergym_scheduler_leases_granted_total`` and ``tinkergym_scheduler_leases_expired_total``: since the process
  started (a counter restarts at 0 with it, which Prometheus's ``rate`` understands).

The first four are read from the database when scraped (one grouped query each), so they hold across restarts and
several scheduler processes on one database. No job, worker, key or tenant id is a label.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import and_, case, func, select

from tinkergym.scheduler import states
from tinkergym.scheduler.db import allocations, devices, jobs, reader, workers
from tinkergym.scheduler.worker_registry import worker_timeout
from tinkergym.serve.metrics import ServerMetrics


class SchedulerMetrics(ServerMetrics):
    """The scheduler app's registry: the HTTP families, the lease counters and :class:`SchedulerCollector`."""

    def __init__(self, app: Any) -> None:
        super().__init__("scheduler")
        self.leases_granted = Counter("tinkergym_scheduler_leases_granted", "Leases granted to workers since the scheduler started",
                                      registry=self.registry)
        self.leases_expired = Counter("tinkergym_scheduler_leases_expired", "Leases that expired unrenewed (their jobs requeued or failed) "
                                      "since the scheduler started", registry=self.registry)
        self.registry.register(SchedulerCollector(app))


class SchedulerCollector:
    """The families read from the database at each scrape (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def describe(self) -> list[Any]:
        return []  # read at scrape time only: registering it must not query the database

    def collect(self) -> Iterator[Any]:
        state = self.app.state
        now = state.settings.clock()
        gone_after = worker_timeout(state.settings)
        with reader(state.engine).connect() as conn:
            by_job = {(s, k): n for s, k, n in conn.execute(select(jobs.c.state, jobs.c.kind, func.count()).group_by(jobs.c.state, jobs.c.kind))}
            held = select(allocations.c.device_id)
            by_device = conn.execute(
                select(devices.c.seat_of.is_(None), devices.c.active, devices.c.id.in_(held), func.count())
                .group_by(devices.c.seat_of.is_(None), devices.c.active, devices.c.id.in_(held))
            ).all()
            quarantined = workers.c.quarantined_at.is_not(None)
            gone = and_(~quarantined, workers.c.last_seen_at < now - gone_after)
            alive = and_(~quarantined, workers.c.last_seen_at >= now - gone_after)
            by_worker = conn.execute(select(*(func.coalesce(func.sum(case((c, 1), else_=0)), 0) for c in (alive, gone, quarantined)))).one()
        job_family = GaugeMetricFamily("tinkergym_scheduler_jobs", "Jobs by state and kind (the queue depth: state queued)", labels=["state", "kind"])
        for s in states.STATES:
            for k in states.KINDS:
                job_family.add_metric([s, k], by_job.get((s, k), 0))
        yield job_family
        device_family = GaugeMetricFamily("tinkergym_scheduler_devices", "Devices and seats of registered workers by state",
                                          labels=["kind", "state"])
        counts = {(kind, st): 0 for kind in ("device", "seat") for st in ("free", "held", "inactive")}
        for whole, active, is_held, n in by_device:
            key = ("device" if whole else "seat", "inactive" if not active else ("held" if is_held else "free"))
            counts[key] += n
        for (kind, st), n in counts.items():
            device_family.add_metric([kind, st], n)
        yield device_family
        worker_family = GaugeMetricFamily("tinkergym_scheduler_workers", "Registered workers by state", labels=["state"])
        for st, n in zip(("alive", "gone", "quarantined"), by_worker):
            worker_family.add_metric([st], int(n))
        yield worker_family
        streams = GaugeMetricFamily("tinkergym_scheduler_event_streams_open", "Server-sent event streams open now")
        streams.add_metric([], state.streams.streams_open())
        yield streams

