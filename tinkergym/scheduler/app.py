"""The scheduler's ASGI app, built by :func:`create_app` from :class:`SchedulerSettings` (nothing happens at import).

Routes are thin (``routes/``): they authenticate, check the scope, and call the stores (``repository``,
``leases``) in one transaction. Errors are ``{"error": {"type", "message"}}``: 400 malformed, 401 no or a bad
key, 403 a key without the scope, 404 unknown (or another tenant's), 409 a lost compare-and-set or a stale
lease epoch, 413 a body over the limit (or a tenant's quota on one event or its stored artifact bytes), 422 an
Idempotency-Key reused with another body, 429 a tenant's quota reached (queued jobs, events per job: raised with
``tinkergym scheduler tenants set``), 503 with ``Retry-After`` an inference job that has no server yet (the gateway,
``routes/gateway.py``). ``/healthz`` and ``/readyz`` are public, and so are the dashboard's static files (``/ui/``,
:mod:`tinkergym.scheduler.ui`) and the redirect from ``/`` to them; every other route needs a key (``Authorization: Bearer tgk_...``); ``/metrics``
(Prometheus) a key with the ``metrics`` scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import text
from starlette.responses import PlainTextResponse, Response

from tinkergym.serve.asgi import BodyLimit, RequestLog, StrictJSON, WireJSON, add_error_handlers, error_response
from tinkergym.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tinkergym.serve.metrics import MetricsMiddleware
from tinkergym.scheduler.auth import KeyLookup
from tinkergym.scheduler.bounds import BoundsError
from tinkergym.scheduler.deps import Forbidden, require
from tinkergym.scheduler.db import make_engine, reader, upgrade
from tinkergym.scheduler.fairshare import Usage
from tinkergym.scheduler.granting import Quarantined
from tinkergym.scheduler.metrics import SchedulerMetrics
from tinkergym.scheduler.quotas import QuotaExceeded
from tinkergym.scheduler.repository import Conflict, JobStore, NotFound, now
from tinkergym.scheduler.ui import is_ui_path, mount_ui

PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})


@dataclass
class SchedulerSettings:
    """Everything the app needs; ``tinkergym scheduler serve`` builds it from its options.

    Args:
        db_url: SQLAlchemy URL (``sqlite:///path/scheduler.db`` or ``postgresql://user@host/db``).
        data_dir: The artifact store: ``<data_dir>/jobs/<job id>/`` holds each job's checkpoints and exports.
        lease_ttl_s: A lease not renewed by a heartbeat within this many seconds expires.
        sweep_interval_s: How often the background task expires leases (jobs are granted when workers ask).
        backfill_age_s: A queued job waiting longer than this stops smaller jobs behind it from starting
            (so large jobs are not starved); younger ones let smaller jobs start around them.
        max_body_bytes: Larger request bodies are refused with 413 (artifact uploads aside).
        max_artifact_bytes: Larger artifact files (checkpoint files a worker uploads) are refused with 413.
        idle_timeout_s: A running job whose client has not called its server for this long is ended.
        sse_poll_s: How often the app's one stream watcher looks for new events of every streamed job, in one query
            (a new event reaches its streams within this).
        sse_keepalive_s: An event stream with nothing to send sends a keep-alive comment this often.
        max_streams_per_key: Event streams one key may hold open at once; past it, 429 with ``Retry-After``.
        max_streams: Event streams the app serves at once, all keys together; past it, 429 with ``Retry-After``.
        changes_max_s: A job-list stream (``GET /v1/jobs/changes``) ends after this long; its client connects again
            and is told to read the list afresh, so no connection outlives a proxy's limit by much.
        worker_timeout_s: A worker with no call (registration, lease poll, heartbeat, state report) for this long
            is listed ``gone`` until its next call; None: three lease TTLs (never less than one TTL).
        worker_forget_s: A worker gone this long that holds nothing is deleted (it registers again when it
            comes back); None or 0: never.
        checkpoint_keep_s: This long after a job ended, every checkpoint but its newest is deleted (the newest
            is what a job continuing it restores); None or 0: never.
        artifact_retention_s: This long after a job ended, all its artifacts are deleted (not while a queued or
            running job continues it); None or 0: kept forever.
        retention_interval_s: The artifact retention pass runs at most this often (by ``clock``), and so does the job
            retention pass (:mod:`tinkergym.scheduler.retention`).
        job_retention_s: This long after a job ended, it is deleted with its events, checkpoints and artifacts (not
            while a queued or running job continues it); None or 0: kept (each tenant still keeps only its
            ``keep_ended_jobs`` newest ended jobs).
        idempotency_ttl_s: Idempotency-Key records older than this are deleted (a retry after it runs again); None
            or 0: kept forever.
        quarantine_after: A worker whose leases expire this many times in a row before the job ran on it (no heartbeat
            after it reported the job running, no checkpoint: it takes jobs and never runs them) is quarantined: no more leases until the operator releases it
            (``tinkergym scheduler workers release``); 0: never. Below ``max_attempts``, so one such worker alone
            never fails a job.
        quarantine_losses: A worker that loses this many leases within ``quarantine_window_s`` while it keeps calling
            the scheduler (each lease it let go, whatever it reported of the job) is quarantined; 0: never. A worker
            that died holding leases (it stopped calling) is not. At most ``max_attempts``, so a worker that keeps losing
            one job is quarantined before the job fails (which then queues again).
        quarantine_window_s: The window of ``quarantine_losses``.
        cancel_deadline_s: A cancelled job's worker must stop it within this long: its heartbeats renew the lease no
            further, so past it the lease ends, the job is ``cancelled`` and its devices and quota are free, whether
            the worker stopped the job's server or not.
        refuse_unplaceable: Refuse (400) a job that no registered worker, alive or gone, could ever host (its model is
            offered by none, or none offering it has its device count), naming what the workers offer; False: it waits
            with its reason (:mod:`tinkergym.scheduler.placement`).
        gateway_max_per_tenant: Requests one tenant may have in flight through the inference gateway
            (``/v1/jobs/{id}/openai/v1/...``) at once; past it, 429 with ``Retry-After``.
        gateway_read_timeout_s: A job's server that sends nothing for this long ends the forwarded request (504).
        cache_s: How long what is read for the grant order and the wait reasons is reused: the tenants' held devices
            (fair share, :mod:`tinkergym.scheduler.fairshare`; between reads, grants count them up) and the live workers'
            places. 0: read at every request.
        clock: The time source (tests move it).
    """

    db_url: str
    data_dir: Path
    lease_ttl_s: float = 30.0
    sweep_interval_s: float = 1.0
    backfill_age_s: float = 600.0
    max_body_bytes: int = 1 << 20
    max_artifact_bytes: int = 20 << 30
    idle_timeout_s: float = 900.0
    max_attempts: int = 3
    sse_poll_s: float = 0.2
    sse_keepalive_s: float = 15.0
    max_streams_per_key: int = 16
    max_streams: int = 1000
    changes_max_s: float = 600.0
    worker_timeout_s: float | None = None
    worker_forget_s: float | None = 86400.0
    checkpoint_keep_s: float | None = 3600.0
    artifact_retention_s: float | None = 30 * 86400.0
    retention_interval_s: float = 60.0
    job_retention_s: float | None = 90 * 86400.0
    idempotency_ttl_s: float | None = 86400.0
    quarantine_after: int = 2
    quarantine_losses: int = 3
    quarantine_window_s: float = 3600.0
    cancel_deadline_s: float = 300.0
    refuse_unplaceable: bool = False
    gateway_max_per_tenant: int = 64
    gateway_read_timeout_s: float = 600.0
    cache_s: float = 1.0
    clock: Callable[[], float] = field(default=now, repr=False)


def _bearer(headers: dict[bytes, bytes]) -> str:
    header = headers.get(b"authorization", b"").decode("latin-1")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


class ApiKeyAuth:
    """ASGI middleware: every path but :data:`PUBLIC_PATHS` needs a valid key (401 before the body is read).

    The principal goes into the request's state (``request.state.principal``) for :func:`require`. The key's row
    is read on every request (a revoked key is refused at once), from the event loop
    (:class:`~tinkergym.scheduler.auth.KeyLookup`: no worker thread per request); its connection closes with the app.
    """

    def __init__(self, app: Any, engine: Any) -> None:
        self.app = app
        self.engine = engine
        self.lookup = KeyLookup(engine)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._closing_at_shutdown(send))
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or is_ui_path(scope["path"]):  # the dashboard's files
            return await self.app(scope, receive, send)
        key = _bearer(dict(scope["headers"]))
        who = await self.lookup.principal(key) if key else None
        if who is None:
            response = error_response(401, "unauthorized", "a valid API key is required: Authorization: Bearer tgk_...",
                                      headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        state = scope.setdefault("state", {})
        state["principal"] = who
        state["tenant"] = who.tenant_id
        await self.app(scope, receive, send)

    def _closing_at_shutdown(self, send: Any) -> Any:
        async def send_closing(message: dict) -> None:
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await self.lookup.aclose()
            await send(message)

        return send_closing


def _add_error_handlers(app: FastAPI, logger: logging.Logger) -> None:
    add_error_handlers(app, logger, "the scheduler log")

    @app.exception_handler(Forbidden)
    @app.exception_handler(BoundsError)
    @app.exception_handler(Quarantined)
    async def forbidden(request: Request, exc: Exception) -> WireJSON:
        return error_response(403, exc.kind if isinstance(exc, Forbidden) else "forbidden", str(exc))

    @app.exception_handler(QuotaExceeded)
    async def quota_exceeded(request: Request, exc: QuotaExceeded) -> WireJSON:
        return error_response(exc.status, "quota", str(exc))

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> WireJSON:
        return error_response(404, "not_found", f"no job {str(exc)[:80]!r}")

    @app.exception_handler(Conflict)
    async def conflict(request: Request, exc: Conflict) -> WireJSON:
        return error_response(409, "conflict", str(exc)[:2000])

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> WireJSON:
        return error_response(400, "invalid_request", str(exc)[:2000])


def _grant_store(store: JobStore, settings: SchedulerSettings) -> JobStore:
    """The store lease requests run on: on PostgreSQL, a connection of their own (grants go one at a time), so a grant
    never waits for a connection of the pool behind the state reports, heartbeats and views that share it (at 1,000
    workers the pool's 15 connections served 40 threads); SQLite's one writer at a time: the same store."""
    if store.engine.dialect.name == "sqlite":
        return store
    grants = JobStore(make_engine(settings.db_url, pool_size=1, max_overflow=1), settings.clock)
    grants.owner = store.owner  # one process: its in-flight idempotency records are the same owner's
    return grants


def _add_health(app: FastAPI) -> None:
    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz() -> Any:
        """Readiness: the database answers."""

        def ping() -> None:
            with reader(app.state.engine).connect() as conn:
                conn.execute(text("SELECT 1"))

        try:
            await run_in_threadpool(ping)
        except Exception as exc:  # noqa: BLE001 - any database failure means not ready
            return error_response(503, "unavailable", f"the database does not answer ({type(exc).__name__})")
        return {"status": "ready"}


def _add_metrics(app: FastAPI) -> None:
    @app.get("/metrics", tags=["metrics"], dependencies=[Depends(require("metrics"))], response_class=PlainTextResponse)
    async def metrics() -> Response:
        """The scheduler's Prometheus metrics (text format); the key needs the ``metrics`` scope (see :mod:`tinkergym.scheduler.metrics`)."""
        body = await run_in_threadpool(app.state.metrics.render)
        return Response(body, media_type=METRICS_CONTENT_TYPE)


def create_app(settings: SchedulerSettings, *, logger: logging.Logger | None = None, background: bool = True) -> FastAPI:
    """The scheduler app: upgrades the database, then serves the routes; ``background`` runs the lease sweeper.

    The event streams' watcher (:class:`~tinkergym.scheduler.streams.StreamHub`) runs either way, from the first stream.

    With ``background`` False (tests that drive the sweeper by hand), leases expire only when
    :func:`tinkergym.scheduler.leases.sweep` is called. Queued jobs are granted when a worker asks for a lease.
    """
    from tinkergym.scheduler import sweeps
    from tinkergym.scheduler.artifacts import DirectoryStore
    from tinkergym.scheduler.routes import artifacts as artifact_routes
    from tinkergym.scheduler.routes import connect as connect_routes
    from tinkergym.scheduler.routes import events as event_routes
    from tinkergym.scheduler.routes import cluster as cluster_routes
    from tinkergym.scheduler.routes import gateway as gateway_routes
    from tinkergym.scheduler.routes import jobs as job_routes
    from tinkergym.scheduler.routes import workers as worker_routes
    from tinkergym.scheduler.streams import StreamHub

    log = logger or logging.getLogger("tinkergym.scheduler")
    engine = make_engine(settings.db_url)
    upgrade(engine)
    settings.data_dir = Path(settings.data_dir).resolve()
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(sweeps.sweep_forever(app)) if background else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await app.state.streams.aclose()
            await app.state.gateway.aclose()
            engine.dispose()
            if app.state.grant_store.engine is not engine:
                app.state.grant_store.engine.dispose()

    app = FastAPI(title="tinkergym scheduler", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, default_response_class=WireJSON)
    app.state.settings = settings
    app.state.started_at = settings.clock()  # a lease that ran out while no scheduler ran is no worker's fault (leases.expire)
    app.state.engine = engine
    app.state.store = JobStore(engine, settings.clock)
    app.state.usage = Usage(settings.cache_s)
    app.state.reservations = {}  # a starving job -> the one worker that drains for it (granting.grant), in memory only
    app.state.grant_gate = None  # one grant at a time: routes.workers.grant_gate (granting.GRANT_LOCK is the database's)
    app.state.grant_store = _grant_store(app.state.store, settings)
    app.state.front_lock, app.state.front_cache = threading.Lock(), None  # views' shared read of the grant order (placement.front_reasons)
    app.state.artifacts = DirectoryStore(settings.data_dir / "jobs")
    app.state.streams = StreamHub(engine, interval_s=settings.sse_poll_s, max_streams=settings.max_streams,
                                  max_streams_per_key=settings.max_streams_per_key, logger=log)
    app.state.gateway = gateway_routes.Forwarding(settings.gateway_max_per_tenant, settings.gateway_read_timeout_s)
    app.state.logger = log
    app.state.metrics = SchedulerMetrics(app)
    _add_health(app)
    _add_metrics(app)
    app.include_router(event_routes.changes_router)  # before /v1/jobs/{job_id}
    app.include_router(job_routes.router)
    app.include_router(event_routes.router)
    app.include_router(connect_routes.router)
    app.include_router(gateway_routes.router)
    app.include_router(worker_routes.router)
    app.include_router(artifact_routes.worker_router)
    app.include_router(artifact_routes.owner_router)
    app.include_router(cluster_routes.router)
    _add_error_handlers(app, log)
    # Added innermost first: the log sees every request, the key is checked before the body is read, the body's size
    # before its text. The dashboard's files (/ui/) are answered innermost, by the files alone.
    mount_ui(app)
    app.add_middleware(StrictJSON, exempt=artifact_routes.is_upload)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, hint="send a smaller request", exempt=artifact_routes.is_upload)
    app.add_middleware(ApiKeyAuth, engine=engine)
    app.add_middleware(RequestLog, logger=log)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
