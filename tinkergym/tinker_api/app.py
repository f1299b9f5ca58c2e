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

from fastapi import FastAPI, Request
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


def create_tinker_app(service: TinkerService, authenticate: Callable[[str], str | None], logger: logging.Logger) -> FastAPI:
    """The app; ``authenticate(key)`` answers the tenant of a tinkergym key (the part after ``tml-``), or None."""
    from tinker import types

    app = FastAPI(title="tinkergym Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = service
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

    async def body(request: Request, model: Any) -> Any:
        try:
            data = await request.json()
            return model.model_validate(data)
        except Exception as exc:  # noqa: BLE001 - malformed input is the client's error
            raise TinkerError(400, f"malformed {model.__name__}: {str(exc)[:500]}") from None

    def tenant(request: Request) -> str:
        return request.state.tenant

    def future(request_id: str, model_id: str | None = None, **extra: Any) -> JSONResponse:
        return JSONResponse({"request_id": request_id, "model_id": model_id, **extra})

    # ----- service --------------------------------------------------------------------------------------
    @app.get("/api/v1/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/api/v1/client/config")
    async def client_config() -> JSONResponse:
        return JSONResponse(CLIENT_CONFIG)

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> JSONResponse:
        return JSONResponse({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    @app.post("/api/v1/telemetry")
    async def telemetry() -> JSONResponse:
        return JSONResponse({"status": "accepted"})

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> JSONResponse:
        return JSONResponse(service.capabilities())

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> JSONResponse:
        await body(request, types.CreateSessionRequest)
        session_id = service.create_session(tenant(request))
        return JSONResponse({"type": "create_session", "session_id": session_id})

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> JSONResponse:
        parsed = await body(request, types.SessionHeartbeatRequest)
        try:
            await run_in_threadpool(service.heartbeat, tenant(request), parsed.session_id, request.state.credential)
        except TinkerError as exc:
            if exc.status == 404:
                return _error(410, f"session {parsed.session_id[:80]!r} has ended")
            raise
        return JSONResponse({"type": "session_heartbeat"})

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        await run_in_threadpool(service.finish_session, tenant(request), session_id)
        return Response(status_code=200, content=b"null", media_type="application/json")

    # ----- training runs ----------------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> JSONResponse:
        parsed = await body(request, types.CreateModelRequest)
        lora = parsed.lora_config
        if lora is None:
            raise TinkerError(400, "full fine-tuning is not offered through the Tinker API here: create a LoRA training client")
        if getattr(parsed.optimizer_config, "type", "adamw") != "adamw":
            raise TinkerError(400, f"optimizer {parsed.optimizer_config.type!r} is not offered: this server trains with AdamW")
        if not (lora.train_attn and lora.train_mlp):
            raise TinkerError(400, "LoRA on attention or MLP layers alone is not offered: this server adapts every linear layer")
        run = await run_in_threadpool(service.create_run, tenant(request), parsed.session_id, parsed.model_seq_id, parsed.base_model, lora.rank,
                                      lora.seed, parsed.user_metadata, request.state.credential)
        request_id = service.submit(tenant(request), lambda: {"model_id": run.model_id, "type": "create_model"}, run)
        return future(request_id, run.model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> JSONResponse:
        parsed = await body(request, types.GetInfoRequest)
        run = service.run(tenant(request), parsed.model_id, request.state.credential)
        facts = service.engine.model_info(run.base_model)
        return JSONResponse({"type": "get_info", "model_id": run.model_id, "is_lora": True, "lora_rank": run.rank, "model_name": run.base_model,
                             "model_data": {"arch": facts["arch"], "model_name": run.base_model, "tokenizer_id": facts["tokenizer_id"]}})

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> JSONResponse:
        from tinkergym.tinker_api.wire import decode_forward_backward

        raw = await request.body()
        try:
            parsed, forward_only = decode_forward_backward(raw, request.headers.get("content-encoding"))
        except ValueError as exc:
            raise TinkerError(400, f"malformed forward_backward body: {str(exc)[:500]}") from None
        run = service.run(tenant(request), parsed.model_id, request.state.credential)
        operation = await run_in_threadpool(ops.forward_backward, service, run, parsed, forward_only)
        return future(service.submit(tenant(request), operation, run), run.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> JSONResponse:
        parsed = await body(request, types.OptimStepRequest)
        run = service.run(tenant(request), parsed.model_id, request.state.credential)
        return future(service.submit(tenant(request), ops.optim_step(service, run, parsed), run), run.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> JSONResponse:
        parsed = await body(request, types.SaveWeightsRequest)
        run = service.run(tenant(request), parsed.model_id, request.state.credential)
        save = ops.save_state(service, run, parsed.path, "training", parsed.user_metadata)
        return future(service.submit(tenant(request), lambda: {"path": save(), "type": "save_weights"}, run), run.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> JSONResponse:
        parsed = await body(request, types.SaveWeightsForSamplerRequest)
        run = service.run(tenant(request), parsed.model_id, request.state.credential)
        if parsed.path is None:
            credential = request.state.credential

            def snapshot() -> dict[str, Any]:
                sampler = service.sampler_from_run(run, credential)
                return {"path": None, "sampling_session_id": sampler.sampler_id, "type": "save_weights_for_sampler"}

            return future(service.submit(tenant(request), snapshot, run), run.model_id)
        save = ops.save_state(service, run, parsed.path, "sampler", parsed.user_metadata)
        return future(service.submit(tenant(request), lambda: {"path": save(), "type": "save_weights_for_sampler"}, run), run.model_id)

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request) -> JSONResponse:
        parsed = await body(request, types.SaveWeightsExternalRequest)
        if parsed.age_encryption_recipients:
            raise TinkerError(400, "age encryption of exported weights is not offered by this server: save without "
                                   "age_encryption_recipients (the files are served only to signed URLs of your key's runs)")
        run = service.run(tenant(request), parsed.model_id, request.state.credential)
        save = ops.save_state(service, run, parsed.path, "external", None)
        return future(service.submit(tenant(request), lambda: {"path": save(), "type": "save_weights_external"}, run), run.model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request) -> JSONResponse:
        return JSONResponse(service.external_urls(tenant(request), model_id, checkpoint_id, str(request.base_url)))

    @app.get(EXTERNAL_FILES_ROUTE + "/{token}")
    async def external_weights_file(token: str) -> Response:
        try:
            file = service.signed_file(token)
        except TinkerError as exc:
            return _error(exc.status, exc.message)
        except ValueError:  # a token that is not ours (undecodable): the signature check passed only for ours
            return _error(403, "this download URL is not valid here")
        return FileResponse(file, media_type="application/octet-stream")

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> JSONResponse:
        parsed = await body(request, types.LoadWeightsRequest)
        who = tenant(request)
        if parsed.model_id is not None:
            run = service.run(who, parsed.model_id, request.state.credential)
        else:  # create-via-load: a new run with the checkpoint's rank
            if parsed.session_id is None or parsed.model_seq_id is None:
                raise TinkerError(400, "load_weights needs model_id, or session_id and model_seq_id")
            source, checkpoint = service.checkpoint(who, parsed.path)
            run = await run_in_threadpool(service.create_run, who, parsed.session_id, parsed.model_seq_id, parsed.base_model or source.base_model,
                                          source.rank, None, parsed.user_metadata, request.state.credential, checkpoint.saved)
        load = ops.load_state(service, run, parsed.path, bool(parsed.optimizer))
        return future(service.submit(who, lambda: {"path": load(), "model_id": run.model_id, "type": "load_weights"}, run), run.model_id)

    # ----- sampling -----------------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> JSONResponse:
        parsed = await body(request, types.CreateSamplingSessionRequest)
        sampler = await run_in_threadpool(service.create_sampler, tenant(request), parsed.session_id, parsed.base_model, parsed.model_path,
                                          request.state.credential)
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id})

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> JSONResponse:
        sampler = service.sampler(tenant(request), sampler_id)
        return JSONResponse({"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path})

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> JSONResponse:
        parsed = await body(request, types.SampleRequest)
        who = tenant(request)
        if parsed.sampling_session_id is not None:
            sampler = service.sampler(who, parsed.sampling_session_id, request.state.credential)
        else:
            raise TinkerError(400, "sample through a sampling client (create_sampling_client): this server needs a sampling_session_id")
        operation, ids = await run_in_threadpool(ops.sample, service, sampler, parsed)  # image chunks are decoded there
        return future(service.submit(who, operation), None, sample_sequence_ids=ids)

    # ----- futures ------------------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        parsed = await body(request, types.FutureRetrieveRequest)
        pending = service.pending(tenant(request), parsed.request_id)
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
            logger.error(json.dumps({"event": "tinker_request_failed", "request_id": parsed.request_id, "error": repr(exc)[:2000]}),
                         exc_info=exc)  # the traceback: where in the server it failed
            return JSONResponse({"error": f"the request failed on the server ({type(exc).__name__}); request id {parsed.request_id} "
                                          "in the server log", "category": "server"})
        result = pending.future.result()
        if isinstance(result, types.ForwardBackwardOutput):
            from tinkergym.tinker_api.wire import encode_forward_backward_output

            return Response(encode_forward_backward_output(result), media_type=PROTO)
        if isinstance(result, types.SampleResponse):
            from tinkergym.tinker_api.wire import encode_sample_response

            return Response(encode_sample_response(result), media_type=PROTO)
        return _json(result)

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request) -> Response:
        data = await request.json()
        service.cancel(tenant(request), str(data.get("request_id", "")))
        return Response(status_code=200, content=b"null", media_type="application/json")

    # ----- REST: training runs and checkpoints ------------------------------------------------------------------
    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> JSONResponse:
        mine = [r for r in service.runs.values() if r.tenant == tenant(request)]
        page = mine[max(0, offset): max(0, offset) + max(1, min(limit, 1000))]
        return JSONResponse({"training_runs": [r.describe() for r in page], "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)}})

    @app.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str, request: Request) -> JSONResponse:
        return JSONResponse(service.run(tenant(request), model_id).describe())

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, request: Request) -> JSONResponse:
        run = service.run(tenant(request), model_id)
        return JSONResponse({"checkpoints": [c.describe(run.model_id) for c in run.checkpoints.values()], "cursor": None})

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request) -> Response:
        await run_in_threadpool(service.delete_checkpoint, tenant(request), model_id, checkpoint_id)
        return Response(status_code=204)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> JSONResponse:
        data = await request.json()
        run, _ = service.checkpoint(tenant(request), str(data.get("tinker_path", "")))
        return JSONResponse({"base_model": run.base_model, "is_lora": True, "lora_rank": run.rank, "train_unembed": False,
                             "train_mlp": True, "train_attn": True})

    from tinkergym.serve.metrics import CallMetrics, MetricsMiddleware, ServerMetrics

    app.state.metrics = ServerMetrics("tinker")  # served by serve-tinker --metrics-port
    worker = getattr(service.engine, "worker", None)  # the local engine's shared worker: its calls and tokens
    if worker is not None:
        worker.observer = CallMetrics(app.state.metrics).observe
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
