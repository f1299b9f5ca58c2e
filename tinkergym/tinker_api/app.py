"""The Tinker REST API (``/api/v1/...``) as the ``tinker`` SDK calls it, served by tinkergym on a shared base.

Routes, bodies and responses are the SDK's own types (:mod:`tinker.types`); ``forward_backward`` and ``forward``
come as the SDK's protobuf (:mod:`tinker.proto`), zstd-compressed (the server's client config asks for it), and
their results and samples go back as protobuf (:mod:`tinkergym.tinker_api.wire`). Every route but ``healthz``
needs ``X-API-Key: tml-<key>``: a tinkergym tenant key behind the ``tml-`` prefix the SDK requires (``tinkergym
scheduler keys create`` makes them; the server keeps their SHA-256 digests only). A key's tenant reaches its own
sessions, runs, samplers, futures and checkpoints and nothing else. What the server does not offer (a model, a
loss, image inputs to a text model) is refused with a Tinker-style error that says so, never a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from tinkergym.serve.asgi import BodyLimit, StrictJSON
from tinkergym.tinker_api.deps import refusal
from tinkergym.tinker_api.service import EXTERNAL_FILES_ROUTE, TinkerError, TinkerService

#: The prefix the SDK requires of an API key; behind it, a tinkergym key.
KEY_PREFIX = "tml-"


def create_tinker_app(service: TinkerService, authenticate: Callable[[str], str | None], logger: logging.Logger) -> FastAPI:
    """The app; ``authenticate(key)`` answers the tenant of a tinkergym key (the part after ``tml-``), or None. Its routes come
    in groups, one router each (:mod:`tinkergym.tinker_api.routes`): the service and sessions, training runs, their weights and
    checkpoints, sampling, futures, and the REST listing of runs and checkpoints."""
    from tinkergym.tinker_api.routes import futures, rest, runs, sampling, sessions, weights

    app = FastAPI(title="tinkergym Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = service  # what the routes' dependencies read (tinkergym.tinker_api.deps)
    app.state.tinker_logger = logger
    _guard(app, service, authenticate)
    for group in (sessions, runs, weights, sampling, futures, rest):
        app.include_router(group.router)

    from tinkergym.serve.metrics import CallMetrics, MetricsMiddleware, ServerMetrics

    app.state.metrics = ServerMetrics("tinker")  # served by serve tinker --metrics-port
    worker = getattr(service.engine, "worker", None)  # the local engine's shared worker: its calls and tokens
    if worker is not None:
        worker.observer = CallMetrics(app.state.metrics).observe
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app


def _guard(app: FastAPI, service: TinkerService, authenticate: Callable[[str], str | None]) -> None:
    """The middlewares every request passes: the key checked before a body is read (but for ``healthz`` and signed download
    URLs), a body bounded and its numbers finite; a refusal (:class:`TinkerError`) answered as the SDK reads it."""
    # Innermost first: the key is checked (below) before a body is read; a body is bounded, and its numbers finite.
    refuse = lambda status, kind, message: refusal(status, message)  # noqa: E731 - the SDK reads "detail"
    app.add_middleware(StrictJSON, answer=refuse)
    app.add_middleware(BodyLimit, max_bytes=service.limits.max_body_bytes, answer=refuse,
                       hint="send fewer datums per forward_backward call, or fewer prompts per sample call")

    @app.middleware("http")
    async def authenticated(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if path == "/api/v1/healthz" or path.startswith(EXTERNAL_FILES_ROUTE + "/"):  # a signed URL is its own credential
            return await call_next(request)
        key = request.headers.get("x-api-key") or ""
        if not key.startswith(KEY_PREFIX):
            return refusal(401, "send X-API-Key: tml-<your tinkergym key> (TINKER_API_KEY); ask the operator for a key")
        tenant = await run_in_threadpool(authenticate, key[len(KEY_PREFIX):])
        if tenant is None:
            return refusal(401, "this API key is not valid (unknown, revoked or mistyped)")
        request.state.tenant = tenant
        request.state.credential = key[len(KEY_PREFIX):]  # a cluster engine submits the run's jobs with it, as its tenant
        try:
            return await call_next(request)
        except TinkerError as exc:
            return refusal(exc.status, exc.message)

    @app.exception_handler(TinkerError)
    async def refused(request: Request, exc: TinkerError) -> JSONResponse:
        return refusal(exc.status, exc.message)
