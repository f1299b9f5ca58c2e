"""The worker's Prometheus metrics (``tinkergym worker --metrics-port PORT``: ``http://127.0.0.1:PORT/metrics``, a listener
of its own on loopback, no key; counts only, never a job id):

- ``tinkergym_worker_places{kind, state}``: its whole devices and seats (``kind`` ``device`` or ``seat``), ``free`` or
  ``held`` by one of its jobs, read when scraped;
- ``tinkergym_worker_lease_polls_total{result}``: its asks for a lease, ``granted``, ``empty`` or ``error``;
- ``tinkergym_worker_jobs_ended_total{outcome}``: its leases' ends (``succeeded``, ``failed``, ``cancelled``, ``lost``,
  ``released``, ``shutdown``; anything else ``other``).

The servers it starts for jobs serve their own (their ``--metrics-port``, not set by the worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from tinkergym.serve.metrics import ServerMetrics

#: Outcomes counted by name (a runner's ``outcome``); any other is ``other``.
OUTCOMES = frozenset({"succeeded", "failed", "cancelled", "lost", "released", "shutdown"})


class WorkerMetrics(ServerMetrics):
    """A worker's registry: the families above; ``places()`` answers ``(whole devices, seats, places held)``."""

    def __init__(self, places: Callable[[], tuple[int, int, set[tuple[str, Any]]]]) -> None:
        super().__init__("worker")
        self.polls = Counter("tinkergym_worker_lease_polls", "Asks for a lease, by result", ["result"], registry=self.registry)
        self.ended = Counter("tinkergym_worker_jobs_ended", "Leases of this worker that ended, by outcome", ["outcome"], registry=self.registry)
        self.registry.register(_Places(places))

    def job_ended(self, outcome: str) -> None:
        self.ended.labels(outcome if outcome in OUTCOMES else "other").inc()


class _Places:
    def __init__(self, places: Callable[[], tuple[int, int, set[tuple[str, Any]]]]) -> None:
        self.places = places

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        whole, seats, held = self.places()
        family = GaugeMetricFamily("tinkergym_worker_places", "Whole devices and seats of this worker, free or held", labels=["kind", "state"])
        for kind, total in (("device", whole), ("seat", seats)):
            taken = sum(1 for k, _ in held if k == kind)
            family.add_metric([kind, "held"], taken)
            family.add_metric([kind, "free"], max(total - taken, 0))
        yield family
