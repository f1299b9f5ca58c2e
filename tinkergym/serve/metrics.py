"""Prometheus metrics of tinkergym's servers: one registry per app, the HTTP families every server has, ``/metrics``.

Every app that serves metrics holds a :class:`ServerMetrics` (its own ``CollectorRegistry``, so several apps in one
process never share or clash) and runs :class:`MetricsMiddleware`, which counts each request and times it by route
*template* (``/v1/jobs/{job_id}``, never the path itself; a path no route matches counts as ``unmatched``), method and
status code. Labels stay low-cardinality by design: no job, session, key or tenant id is ever a label. Families a
server owns (the scheduler's queue and devices) are read when scraped, by a collector over its database
(:class:`~tinkergym.scheduler.metrics.SchedulerCollector`), so they are right after a restart and never drift.

The body is Prometheus's text format, written by the official ``prometheus_client`` (its ``CONTENT_TYPE_LATEST``).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

#: Request latency buckets in seconds: from a key lookup to a long poll or a model's pass.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: The route label of a request no route matched (random paths must not grow the label set).
UNMATCHED = "unmatched"
#: The text format's content type.
CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Methods counted by name; any other is ``other`` (a client picks the method).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class ServerMetrics:
    """A server's registry and its HTTP families; ``server`` names the server kind (``scheduler``, ``training``, ...)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.registry = CollectorRegistry()
        self.requests = Counter("tinkergym_http_requests", "HTTP requests answered, by route template, method and status code",
                                ["server", "route", "method", "code"], registry=self.registry)
        self.latency = Histogram("tinkergym_http_request_duration_seconds", "Time from a request's arrival to the end of its answer",
                                 ["server", "route", "method"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, route: str, method: str, code: int, seconds: float) -> None:
        self.requests.labels(self.server, route, method, str(code)).inc()
        self.latency.labels(self.server, route, method).observe(seconds)

    def render(self) -> bytes:
        """Every family of the registry in the text format."""
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware: each HTTP request counted and timed in ``metrics`` (see the module docstring)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from tinkergym.serve.asgi import status_of

        start = time.perf_counter()
        send_status, status = status_of(send)
        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = str(scope.get("method"))
            method = method if method in METHODS else "other"
            self.metrics.observe(route[:200], method, status[0], time.perf_counter() - start)


#: Call duration buckets in seconds: an optimizer step on a small adapter to a long sampling call.
CALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


def call_tokens(method: str, call: Any, result: Any) -> tuple[int, int]:
    """``(trained, sampled)`` tokens of one finished call: a ``forward_backward``'s rows, a ``sample``'s new tokens."""
    if method == "sample" and isinstance(result, dict):
        return 0, sum(len(seq.get("tokens", ())) for row in result.get("sequences", ()) for seq in row)
    if method == "forward_backward" and call is not None:
        return sum(len(d.tokens) for d in call.args["request"].data), 0
    return 0, 0


class TokenTally:
    """Tokens trained and sampled by a server's (or one adapter's) calls since it started: what its worker reports in the
    lease's heartbeats for the tenant's usage (``GET /v1/usage`` on the server, or the shared server's adapter listing)."""

    def __init__(self) -> None:
        self.trained = 0
        self.sampled = 0
        self._lock = threading.Lock()

    def add(self, method: str, call: Any, result: Any) -> None:
        trained, sampled = call_tokens(method, call, result)
        if trained or sampled:
            with self._lock:
                self.trained += trained
                self.sampled += sampled

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"tokens_trained": self.trained, "tokens_sampled": self.sampled}


class CallMetrics:
    """A training server's calls (:mod:`tinkergym.serve.training`): counted and timed by method and outcome, and the
    tokens they put through the model (``kind`` ``sampled``: new tokens drawn; ``trained``: the tokens of the rows of a
    ``forward_backward``), whose rate is the server's throughput (``rate(tinkergym_tokens_total[1m])``). The step time
    is ``tinkergym_call_duration_seconds`` of ``forward_backward`` plus ``optim_step``."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.server = metrics.server
        self.calls = Counter("tinkergym_calls", "Backend calls run, by method and outcome", ["server", "method", "ok"], registry=metrics.registry)
        self.duration = Histogram("tinkergym_call_duration_seconds", "Time a backend call ran (queueing not included)", ["server", "method"],
                                  buckets=CALL_BUCKETS, registry=metrics.registry)
        self.tokens = Counter("tinkergym_tokens", "Tokens sampled and trained", ["server", "kind"], registry=metrics.registry)

    def observe(self, method: str, call: Any, result: Any, ok: bool, seconds: float) -> None:
        """One finished call: ``call`` its parsed arguments (``ParsedCall``), ``result`` its wire result (a dict) or None."""
        self.calls.labels(self.server, method, "true" if ok else "false").inc()
        self.duration.labels(self.server, method).observe(seconds)
        if not ok:
            return
        trained, sampled = call_tokens(method, call, result)
        if method == "sample":
            self.tokens.labels(self.server, "sampled").inc(sampled)
        elif method == "forward_backward":
            self.tokens.labels(self.server, "trained").inc(trained)


def serve_metrics(metrics: ServerMetrics, port: int, host: str = "127.0.0.1") -> Any:
    """Serve ``metrics`` at ``http://host:port/metrics`` from a thread of this process (the training and inference servers'
    and the worker's ``--metrics-port``: a listener of its own, on loopback by default, with no key: whoever reaches it
    reads counts, never ids). Answers the HTTP server, whose ``shutdown()`` stops it."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return server


#: Phase duration buckets in seconds: an env step or a tool call to a long step.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
#: A tool name kept as a label; any other is ``other`` (names come from env code, bounded anyway).
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class PhaseMetrics:
    """A training run's phases (the spans of its :mod:`~tinkergym.plumbing.timeline`) as one histogram,
    ``tinkergym_phase_duration_seconds{name, tool}``: steps, rollouts, sampling requests, env steps, tool calls (``tool``: the
    tool's name; the ``python`` tool's are the sandbox's calls), ``forward_backward``, ``optim_step``, evaluations,
    checkpoints. Its ``_count`` counts them: ``rate(tinkergym_phase_duration_seconds_count{name="tool"}[1m])`` is tool calls
    per second. Served by ``tinkergym train --metrics-port``."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.duration = Histogram("tinkergym_phase_duration_seconds", "Time of each phase of the run (its timeline's spans)",
                                  ["name", "tool"], buckets=PHASE_BUCKETS, registry=metrics.registry)

    def observe(self, span: Any) -> None:
        tool = str(span.args.get("tool", ""))
        self.duration.labels(span.name, tool if not tool or TOOL_NAME.match(tool) else "other").observe(span.seconds)
