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

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import FileResponse, JSONResponse, Response

from tinkergym.serve.asgi import BodyLimit, StrictJSON
from tinkergym.tinker_api import ops
from tinkergym.tinker_api.service import EXTERNAL_FILES_ROUTE, TinkerError, TinkerService

#: The prefix the SDK requires of an API key; behind it, a tinkergym key.
KEY_PREFIX = "tml-"
#: How long ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK waits 45 s for an answer).
RETRIEVE_WAIT_S = 20.0
PROTO = "application/x-protobuf"

#: What the SDK reads at start (``ClientConfigResponse``): API keys (no JWT exchange), zstd-compressed protobuf
#: forward_backward bodies, one chunk per turn (this server runs a run's requests in arrival order), custom losses on
#: the client.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "proto_compress_fwdbwd": True,
    "parallel_fwdbwd_chunks": False,
    "custom_loss_server_side": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "use_pyqwest_transport": False,
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message, "error": message}, status_code=status)


def _json(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", exclude_none=False) if hasattr(model, "model_dump") else model)


class _Routes:
    """What every route of the app shares: the service, the log, the SDK's types, and the helpers that read a request."""

    def __init__(self, service: TinkerService, logger: logging.Logger) -> None:
        from tinker import types

        self.service, self.logger, self.types = service, logger, types

    @staticmethod
    async def body(request: Request, model: Any) -> Any:
        """The request's JSON body as the SDK's ``model``; malformed input is the client's error (400)."""
        try:
            data = await request.json()
            return model.model_validate(data)
        except Exception as exc:  # noqa: BLE001 - malformed input is the client's error
            raise TinkerError(400, f"malformed {model.__name__}: {str(exc)[:500]}") from None

    @staticmethod
    def tenant(request: Request) -> str:
        return request.state.tenant

    @staticmethod
    def future(request_id: str, model_id: str | None = None, **extra: Any) -> JSONResponse:
        """The SDK's answer to a request queued on a run (or a sampler): the id it retrieves the result with."""
        return JSONResponse({"request_id": request_id, "model_id": model_id, **extra})


def create_tinker_app(service: TinkerService, authenticate: Callable[[str], str | None], logger: logging.Logger) -> FastAPI:
    """The app; ``authenticate(key)`` answers the tenant of a tinkergym key (the part after ``tml-``), or None. Its routes come
    in groups, one router each: the service and sessions, training runs, their weights and checkpoints, sampling, futures, and
    the REST listing of runs and checkpoints."""
    app = FastAPI(title="tinkergym Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = service
    _guard(app, service, authenticate)
    routes = _Routes(service, logger)
    for group in (_service_routes, _run_routes, _weights_routes, _sampling_routes, _future_routes, _rest_routes):
        app.include_router(group(routes))

    from tinkergym.serve.metrics import CallMetrics, MetricsMiddleware, ServerMetrics

    app.state.metrics = ServerMetrics("tinker")  # served by serve-tinker --metrics-port
    worker = getattr(service.engine, "worker", None)  # the local engine's shared worker: its calls and tokens
    if worker is not None:
        worker.observer = CallMetrics(app.state.metrics).observe
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app


def _guard(app: FastAPI, service: TinkerService, authenticate: Callable[[str], str | None]) -> None:
    """The middlewares every request passes: the key checked before a body is read (but for ``healthz`` and signed download
    URLs), a body bounded and its numbers finite; a refusal (:class:`TinkerError`) answered as the SDK reads it."""
    # Innermost first: the key is checked (below) before a body is read; a body is bounded, and its numbers finite.
    refuse = lambda status, kind, message: _error(status, message)  # noqa: E731 - the SDK reads "detail"
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
            return _error(401, "send X-API-Key: tml-<your tinkergym key> (TINKER_API_KEY); ask the operator for a key")
        tenant = await run_in_threadpool(authenticate, key[len(KEY_PREFIX):])
        if tenant is None:
            return _error(401, "this API key is not valid (unknown, revoked or mistyped)")
        request.state.tenant = tenant
        request.state.credential = key[len(KEY_PREFIX):]  # a cluster engine submits the run's jobs with it, as its tenant
        try:
            return await call_next(request)
        except TinkerError as exc:
            return _error(exc.status, exc.message)

    @app.exception_handler(TinkerError)
    async def refused(request: Request, exc: TinkerError) -> JSONResponse:
        return _error(exc.status, exc.message)


def _service_routes(r: _Routes) -> APIRouter:
    """The service's own routes (health, the client's config, capabilities, telemetry) and sessions."""
    router = APIRouter()

    @router.get("/api/v1/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @router.post("/api/v1/client/config")
    async def client_config() -> JSONResponse:
        return JSONResponse(CLIENT_CONFIG)

    @router.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> JSONResponse:
        return JSONResponse({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    @router.post("/api/v1/telemetry")
    async def telemetry() -> JSONResponse:
        return JSONResponse({"status": "accepted"})

    @router.get("/api/v1/get_server_capabilities")
    async def capabilities() -> JSONResponse:
        return JSONResponse(r.service.capabilities())

    @router.post("/api/v1/create_session")
    async def create_session(request: Request) -> JSONResponse:
        await r.body(request, r.types.CreateSessionRequest)
        session_id = r.service.create_session(r.tenant(request))
        return JSONResponse({"type": "create_session", "session_id": session_id})

    @router.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.SessionHeartbeatRequest)
        try:
            await run_in_threadpool(r.service.heartbeat, r.tenant(request), parsed.session_id, request.state.credential)
        except TinkerError as exc:
            if exc.status == 404:
                return _error(410, f"session {parsed.session_id[:80]!r} has ended")
            raise
        return JSONResponse({"type": "session_heartbeat"})

    @router.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        await run_in_threadpool(r.service.finish_session, r.tenant(request), session_id)
        return Response(status_code=200, content=b"null", media_type="application/json")

    return router


def _run_routes(r: _Routes) -> APIRouter:
    """Training runs: created, described, trained (forward, forward_backward, optim_step)."""
    router = APIRouter()

    @router.post("/api/v1/create_model")
    async def create_model(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.CreateModelRequest)
        lora = parsed.lora_config
        if lora is None:
            raise TinkerError(400, "full fine-tuning is not offered through the Tinker API here: create a LoRA training client")
        if getattr(parsed.optimizer_config, "type", "adamw") != "adamw":
            raise TinkerError(400, f"optimizer {parsed.optimizer_config.type!r} is not offered: this server trains with AdamW")
        if not (lora.train_attn and lora.train_mlp):
            raise TinkerError(400, "LoRA on attention or MLP layers alone is not offered: this server adapts every linear layer")
        run = await run_in_threadpool(r.service.create_run, r.tenant(request), parsed.session_id, parsed.model_seq_id, parsed.base_model, lora.rank,
                                      lora.seed, parsed.user_metadata, request.state.credential)
        request_id = r.service.submit(r.tenant(request), lambda: {"model_id": run.model_id, "type": "create_model"}, run)
        return r.future(request_id, run.model_id)

    @router.post("/api/v1/get_info")
    async def get_info(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.GetInfoRequest)
        run = r.service.run(r.tenant(request), parsed.model_id, request.state.credential)
        facts = r.service.engine.model_info(run.base_model)
        return JSONResponse({"type": "get_info", "model_id": run.model_id, "is_lora": True, "lora_rank": run.rank, "model_name": run.base_model,
                             "model_data": {"arch": facts["arch"], "model_name": run.base_model, "tokenizer_id": facts["tokenizer_id"]}})

    @router.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> JSONResponse:
        from tinkergym.tinker_api.wire import decode_forward_backward

        raw = await request.body()
        try:
            parsed, forward_only = decode_forward_backward(raw, request.headers.get("content-encoding"))
        except ValueError as exc:
            raise TinkerError(400, f"malformed forward_backward body: {str(exc)[:500]}") from None
        run = r.service.run(r.tenant(request), parsed.model_id, request.state.credential)
        operation = await run_in_threadpool(ops.forward_backward, r.service, run, parsed, forward_only)
        return r.future(r.service.submit(r.tenant(request), operation, run), run.model_id)

    @router.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.OptimStepRequest)
        run = r.service.run(r.tenant(request), parsed.model_id, request.state.credential)
        return r.future(r.service.submit(r.tenant(request), ops.optim_step(r.service, run, parsed), run), run.model_id)

    return router


def _weights_routes(r: _Routes) -> APIRouter:
    """A run's weights: saved as a state, for a sampler or for download (and their signed URLs), loaded."""
    router = APIRouter()

    @router.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.SaveWeightsRequest)
        run = r.service.run(r.tenant(request), parsed.model_id, request.state.credential)
        save = ops.save_state(r.service, run, parsed.path, "training", parsed.user_metadata)
        return r.future(r.service.submit(r.tenant(request), lambda: {"path": save(), "type": "save_weights"}, run), run.model_id)

    @router.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.SaveWeightsForSamplerRequest)
        run = r.service.run(r.tenant(request), parsed.model_id, request.state.credential)
        if parsed.path is None:
            credential = request.state.credential

            def snapshot() -> dict[str, Any]:
                sampler = r.service.sampler_from_run(run, credential)
                return {"path": None, "sampling_session_id": sampler.sampler_id, "type": "save_weights_for_sampler"}

            return r.future(r.service.submit(r.tenant(request), snapshot, run), run.model_id)
        save = ops.save_state(r.service, run, parsed.path, "sampler", parsed.user_metadata)
        return r.future(r.service.submit(r.tenant(request), lambda: {"path": save(), "type": "save_weights_for_sampler"}, run), run.model_id)

    @router.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.SaveWeightsExternalRequest)
        if parsed.age_encryption_recipients:
            raise TinkerError(400, "age encryption of exported weights is not offered by this server: save without "
                                   "age_encryption_recipients (the files are served only to signed URLs of your key's runs)")
        run = r.service.run(r.tenant(request), parsed.model_id, request.state.credential)
        save = ops.save_state(r.service, run, parsed.path, "external", None)
        return r.future(r.service.submit(r.tenant(request), lambda: {"path": save(), "type": "save_weights_external"}, run), run.model_id)

    @router.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request) -> JSONResponse:
        return JSONResponse(r.service.external_urls(r.tenant(request), model_id, checkpoint_id, str(request.base_url)))

    @router.get(EXTERNAL_FILES_ROUTE + "/{token}")
    async def external_weights_file(token: str) -> Response:
        try:
            file = r.service.signed_file(token)
        except TinkerError as exc:
            return _error(exc.status, exc.message)
        except ValueError:  # a token that is not ours (undecodable): the signature check passed only for ours
            return _error(403, "this download URL is not valid here")
        return FileResponse(file, media_type="application/octet-stream")

    @router.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.LoadWeightsRequest)
        who = r.tenant(request)
        if parsed.model_id is not None:
            run = r.service.run(who, parsed.model_id, request.state.credential)
        else:  # create-via-load: a new run with the checkpoint's rank
            if parsed.session_id is None or parsed.model_seq_id is None:
                raise TinkerError(400, "load_weights needs model_id, or session_id and model_seq_id")
            source, checkpoint = r.service.checkpoint(who, parsed.path)
            run = await run_in_threadpool(r.service.create_run, who, parsed.session_id, parsed.model_seq_id, parsed.base_model or source.base_model,
                                          source.rank, None, parsed.user_metadata, request.state.credential, checkpoint.saved)
        load = ops.load_state(r.service, run, parsed.path, bool(parsed.optimizer))
        return r.future(r.service.submit(who, lambda: {"path": load(), "model_id": run.model_id, "type": "load_weights"}, run), run.model_id)

    return router


def _sampling_routes(r: _Routes) -> APIRouter:
    """Samplers: created, described, sampled."""
    router = APIRouter()

    @router.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.CreateSamplingSessionRequest)
        sampler = await run_in_threadpool(r.service.create_sampler, r.tenant(request), parsed.session_id, parsed.base_model, parsed.model_path,
                                          request.state.credential)
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id})

    @router.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> JSONResponse:
        sampler = r.service.sampler(r.tenant(request), sampler_id)
        return JSONResponse({"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path})

    @router.post("/api/v1/asample")
    async def asample(request: Request) -> JSONResponse:
        parsed = await r.body(request, r.types.SampleRequest)
        who = r.tenant(request)
        if parsed.sampling_session_id is not None:
            sampler = r.service.sampler(who, parsed.sampling_session_id, request.state.credential)
        else:
            raise TinkerError(400, "sample through a sampling client (create_sampling_client): this server needs a sampling_session_id")
        operation, ids = await run_in_threadpool(ops.sample, r.service, sampler, parsed)  # image chunks are decoded there
        return r.future(r.service.submit(who, operation), None, sample_sequence_ids=ids)

    return router


def _future_routes(r: _Routes) -> APIRouter:
    """Futures: a request's result retrieved (long-polled), or the request cancelled."""
    router = APIRouter()

    @router.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        parsed = await r.body(request, r.types.FutureRetrieveRequest)
        pending = r.service.pending(r.tenant(request), parsed.request_id)
        waiting = asyncio.wrap_future(pending.future)
        await asyncio.wait({waiting}, timeout=RETRIEVE_WAIT_S)  # never cancels the operation
        if not pending.future.done():
            return JSONResponse({"type": "try_again", "request_id": parsed.request_id, "queue_state": "active"})
        if pending.future.cancelled():
            return JSONResponse({"error": "the request was cancelled", "category": "user"})
        exc = pending.future.exception()
        if isinstance(exc, TinkerError):
            return JSONResponse({"error": exc.message, "category": exc.category})
        if exc is not None:
            r.logger.error(json.dumps({"event": "tinker_request_failed", "request_id": parsed.request_id, "error": repr(exc)[:2000]}),
                           exc_info=exc)  # the traceback: where in the server it failed
            return JSONResponse({"error": f"the request failed on the server ({type(exc).__name__}); request id {parsed.request_id} "
                                          "in the server log", "category": "server"})
        result = pending.future.result()
        if isinstance(result, r.types.ForwardBackwardOutput):
            from tinkergym.tinker_api.wire import encode_forward_backward_output

            return Response(encode_forward_backward_output(result), media_type=PROTO)
        if isinstance(result, r.types.SampleResponse):
            from tinkergym.tinker_api.wire import encode_sample_response

            return Response(encode_sample_response(result), media_type=PROTO)
        return _json(result)

    @router.post("/api/v1/cancel_future")
    async def cancel_future(request: Request) -> Response:
        data = await request.json()
        r.service.cancel(r.tenant(request), str(data.get("request_id", "")))
        return Response(status_code=200, content=b"null", media_type="application/json")

    return router


def _rest_routes(r: _Routes) -> APIRouter:
    """The REST listing: a tenant's training runs and their checkpoints, deleted, and a checkpoint's weights' facts."""
    router = APIRouter()

    @router.get("/api/v1/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> JSONResponse:
        who = r.tenant(request)
        mine = [run for run in r.service.runs.values() if run.tenant == who]
        page = mine[max(0, offset): max(0, offset) + max(1, min(limit, 1000))]
        return JSONResponse({"training_runs": [run.describe() for run in page], "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)}})

    @router.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str, request: Request) -> JSONResponse:
        return JSONResponse(r.service.run(r.tenant(request), model_id).describe())

    @router.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, request: Request) -> JSONResponse:
        run = r.service.run(r.tenant(request), model_id)
        return JSONResponse({"checkpoints": [c.describe(run.model_id) for c in run.checkpoints.values()], "cursor": None})

    @router.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request) -> Response:
        await run_in_threadpool(r.service.delete_checkpoint, r.tenant(request), model_id, checkpoint_id)
        return Response(status_code=204)

    @router.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> JSONResponse:
        data = await request.json()
        run, _ = r.service.checkpoint(r.tenant(request), str(data.get("tinker_path", "")))
        return JSONResponse({"base_model": run.base_model, "is_lora": True, "lora_rank": run.rank, "train_unembed": False,
                             "train_mlp": True, "train_attn": True})

    return router
