"""The training server: the Backend protocol over HTTP (wire protocol version 1).

:func:`create_app` builds a FastAPI app around any object that implements
:class:`~tinkergym.protocol.backend.Backend`; ``tinkergym serve backend`` runs it with a
:class:`~tinkergym.backends.torch.backend.TorchBackend` under uvicorn. Every route but ``GET /health`` needs
the bearer token (:mod:`tinkergym.serve.auth`).

Routes are thin: ``POST /v1/call`` hands the call to a :class:`~tinkergym.serve.training.calls.CallStore`
(sequence numbers per session: a retried number returns the stored result and never runs twice) and waits
up to ``wait`` seconds for the single worker thread to run it; a call still running answers 202 and the
client long-polls ``GET /v1/requests/{request_id}``. Bodies over ``max_body_mb`` are refused with 413 before
they are read whole. Each request is logged as one JSON line (request id, method, route, status, duration,
session, seq); tracebacks go to the log only.

Floats travel as JSON numbers written with Python's ``repr``, so they round-trip exactly; a non-finite value
(a diverged gradient norm) is written as ``NaN`` / ``Infinity``, which Python's ``json`` reads back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import Field, StrictInt, StrictStr

from tinkergym.serve.asgi import BodyLimit, RequestLog, StrictJSON, WireJSON, add_error_handlers, error_response
from tinkergym.serve.wire import WireModel
from tinkergym.serve.training.calls import (
    CallLimits,
    CallRecord,
    CallStore,
    CallWorker,
    SequenceError,
    UnknownSessionError,
    file_in,
    named_dir,
    parse_call,
)
from tinkergym.serve.auth import LeaseFile, require_token
from tinkergym.backends.tokenizer_files import read_tokenizer_files
from tinkergym.errors import ConfigError
from tinkergym.plumbing.memory_use import measure

PROTOCOL_VERSION = 1

#: ``info()`` keys that hold local paths of the server's machine.
LOCAL_PATH_KEYS = ("model_path", "tokenizer")

MAX_WAIT = 300.0


# ----- wire models (they document every route in /openapi.json) ----------------------------------------
class HealthResponse(WireModel):
    status: Literal["ok"] = "ok"


class SessionResponse(WireModel):
    session_id: str = Field(description="32 hex characters")
    next_seq: int = 1


class CallBody(WireModel):
    """One Backend call: method ``sample``, ``logprobs``, ``forward_backward``, ``optim_step``, ``save_state``, ``load_state`` or ``export``."""

    session_id: StrictStr = Field(max_length=64)
    seq: StrictInt = Field(ge=1, description="last accepted seq + 1 for a new call; a kept seq to retry one")
    method: StrictStr = Field(max_length=64)
    args: dict[str, Any]


class CallDone(WireModel):
    request_id: str
    seq: int
    status: Literal["done"] = "done"
    result: dict[str, Any]


class CallPending(WireModel):
    request_id: str
    seq: int
    status: Literal["pending"] = "pending"


class ErrorDetail(WireModel):
    type: str
    message: str
    code: int | None = Field(None, description="the HTTP status, where the answer carries it (401)")


class ErrorResponse(WireModel):
    error: ErrorDetail


class TokenizerResponse(WireModel):
    files: dict[str, str] = Field(description="file name -> text, for AutoTokenizer.from_pretrained(folder)")


ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 500)}


# ----- the service behind the routes --------------------------------------------------------------------
def _vocab_size(backend: Any) -> int | None:
    """The number of input embeddings, to refuse token ids past it (None when the backend does not tell)."""
    model = getattr(backend, "model", None)
    try:
        return int(model.get_input_embeddings().num_embeddings)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - any backend without a transformers model
        return None


def public_info(info: dict[str, Any]) -> dict[str, Any]:
    """A backend's ``info()`` as clients see it: no local paths of the server's machine, a model folder by its name."""
    public = {k: v for k, v in info.items() if k not in LOCAL_PATH_KEYS}
    model = public.get("model")
    if isinstance(model, str) and (os.path.isabs(model) or os.path.exists(model)):
        public["model"] = Path(model).name
    return public


class TrainingService:
    """One backend, its run folder, the call store and the worker: what the routes of one app share."""

    def __init__(self, backend: Any, run_dir: Path, logger: logging.Logger, keep_results: int, max_sessions: int, keep_states: int = 0,
                 limits: CallLimits = CallLimits(), worker: Any = None) -> None:
        self.backend = backend
        self.limits = limits
        self.run_dir = run_dir
        self.logger = logger
        self.store = CallStore(keep=keep_results, max_sessions=max_sessions)
        # Its own thread, or a port of a worker shared by several backends (tinkergym.serve.training.shared).
        self.worker = worker if worker is not None else CallWorker(backend, run_dir, logger, keep_states)
        self.vocab_size = _vocab_size(backend)
        self._tokenizer_files: dict[str, str] | None = None
        self._touched = time.monotonic()

    def touch(self) -> None:
        """Note a client call (for the idle timeout)."""
        self._touched = time.monotonic()

    def last_activity(self) -> float:
        """The monotonic time of the last sign of a client: now while a call runs, else its last request or finished call."""
        if self.worker.pending:
            return time.monotonic()
        return max(self._touched, self.worker.last_done)

    def accept(self, body: CallBody) -> CallRecord:
        """Accept (and queue) a new call or find the kept one a retry names."""
        self.touch()
        record, new = self.store.accept(body.session_id, body.seq, body.method, body.args, lambda: parse_call(body.method, body.args, self.vocab_size, self.limits))
        if new and not record.done:
            self.worker.submit(record)
        return record

    def info(self) -> dict[str, Any]:
        """``backend.info()`` without local paths, plus the protocol version and the limits of one call."""
        return {**public_info(self.backend.info()), "protocol": PROTOCOL_VERSION, "limits": self.limits.as_dict()}

    def tokenizer_files(self) -> dict[str, str]:
        """The allowlisted tokenizer files of the model folder (read once)."""
        if self._tokenizer_files is None:
            self._tokenizer_files = read_tokenizer_files(self.backend.info()["tokenizer"])
        return self._tokenizer_files

    def export_file(self, name: str, relative: str) -> Path:
        """An exported file (bad names are a :class:`ConfigError`, missing files a :class:`FileNotFoundError`)."""
        return file_in(named_dir(self.run_dir, "exports", name), relative)


async def wait_for(record: CallRecord, seconds: float) -> None:
    """Return when ``record`` is done or ``seconds`` have passed, without blocking the event loop."""
    if record.done or seconds <= 0:
        return
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop closed (server shutting down): nobody is waiting any more
            pass

    if record.on_done(wake):
        try:
            await asyncio.wait_for(event.wait(), min(seconds, MAX_WAIT))
        except asyncio.TimeoutError:  # noqa: UP041 - Python 3.10: not the builtin TimeoutError
            record.forget(wake)


def record_response(record: CallRecord) -> WireJSON:
    """200 with the result, 202 while running, or the stored error."""
    headers = {"X-Request-ID": record.request_id}
    if not record.done:
        return WireJSON({"request_id": record.request_id, "seq": record.seq, "status": "pending"}, status_code=202, headers=headers)
    if record.error is not None:
        return WireJSON(record.error.to_dict(), status_code=record.error.status, headers=headers)
    return WireJSON({"request_id": record.request_id, "seq": record.seq, "status": "done", "result": record.result}, headers=headers)


# ----- routes -------------------------------------------------------------------------------------------
router = APIRouter()
WAIT = Query(30.0, ge=0, le=MAX_WAIT, description="seconds to wait for the result before answering 202")


def _service(request: Request) -> TrainingService:
    """The app's service, or the one the request's token picked (an adapter of a shared server)."""
    picked = getattr(request.state, "service", None)
    return picked if picked is not None else request.app.state.service


@router.get("/health", response_model=HealthResponse)
async def health() -> dict[str, str]:
    """Liveness, without a token."""
    return {"status": "ok"}


@router.get("/v1/info", responses=ERRORS)
async def info(request: Request) -> dict[str, Any]:
    """The backend's ``info()`` without local paths, plus ``protocol``; like a call, a sign of the client's life (the idle timeout)."""
    _service(request).touch()
    return await run_in_threadpool(_service(request).info)


@router.get("/v1/usage", responses=ERRORS)
async def usage(request: Request) -> dict[str, Any]:
    """Tokens this server's (or this adapter's) calls trained and sampled since it started, and its memory measured now
    (``memory``: :func:`tinkergym.plumbing.memory_use.measure`): what its worker reports at each heartbeat, for the
    tenant's usage and the scheduler's placement. Not a sign of the client's life (the idle timeout)."""
    return {**_service(request).worker.tokens.as_dict(), "memory": measure()}


@router.get("/v1/tokenizer", response_model=TokenizerResponse, responses=ERRORS)
async def tokenizer(request: Request) -> dict[str, Any]:
    """The tokenizer and chat template files of the model folder."""
    return {"files": await run_in_threadpool(_service(request).tokenizer_files)}


@router.post("/v1/sessions", response_model=SessionResponse, responses=ERRORS)
async def new_session(request: Request) -> dict[str, Any]:
    """A new session: its calls are numbered from 1."""
    return {"session_id": _service(request).store.new_session(), "next_seq": 1}


@router.post("/v1/call", response_model=CallDone, responses={202: {"model": CallPending}, **ERRORS})
async def call(body: CallBody, request: Request, wait: float = WAIT) -> WireJSON:
    """Run (or find, for a retried seq) one call; 202 when it has not finished within ``wait`` seconds."""
    request.state.session, request.state.seq = body.session_id, body.seq
    record = await run_in_threadpool(_service(request).accept, body)
    request.state.request_id = record.request_id
    await wait_for(record, wait)
    return record_response(record)


@router.get("/v1/requests/{request_id}", response_model=CallDone, responses={202: {"model": CallPending}, **ERRORS})
async def poll(request_id: str, request: Request, wait: float = WAIT) -> WireJSON:
    """Long poll: the call's result once it is done, or 202 after ``wait`` seconds."""
    _service(request).touch()
    record = _service(request).store.get(request_id)
    if record is None:
        return error_response(404, "not_found", f"unknown request id {request_id[:64]!r} (the server keeps the last calls of each session)")
    request.state.request_id, request.state.session, request.state.seq = record.request_id, record.session_id, record.seq
    await wait_for(record, wait)
    return record_response(record)


@router.get("/v1/files/exports/{name}/{path:path}", response_class=FileResponse, responses=ERRORS)
async def export_file(name: str, path: str, request: Request) -> Any:
    """The bytes of one exported file."""
    try:
        file = _service(request).export_file(name, path)
    except FileNotFoundError:
        return error_response(404, "not_found", f"exports/{name[:128]} has no file {path[:200]!r}")
    return FileResponse(file, media_type="application/octet-stream")


# ----- middleware ---------------------------------------------------------------------------------------
# ----- the app factory ----------------------------------------------------------------------------------
def add_training_error_handlers(app: FastAPI, logger: logging.Logger) -> None:
    """The error handlers every training server shares: 404 for an unknown session, 409 out of sequence, 400 bad input."""
    add_error_handlers(app, logger, "the server log")

    @app.exception_handler(UnknownSessionError)
    async def unknown_session(request: Request, exc: UnknownSessionError) -> WireJSON:
        return error_response(404, "not_found", str(exc))

    @app.exception_handler(SequenceError)
    async def out_of_sequence(request: Request, exc: SequenceError) -> WireJSON:
        return error_response(409, "sequence", str(exc))

    @app.exception_handler(ConfigError)
    async def bad_input(request: Request, exc: ConfigError) -> WireJSON:
        return error_response(400, "invalid_request", str(exc)[:2000])


def create_app(
    backend: Any,
    *,
    run_dir: str | os.PathLike[str],
    token_digest: bytes,
    max_body_mb: float = 64,
    logger: logging.Logger | None = None,
    keep_results: int = 16,
    keep_states: int = 0,
    max_sessions: int = 64,
    limits: CallLimits = CallLimits(),
    lease: LeaseFile | None = None,
    worker: CallWorker | None = None,
) -> FastAPI:
    """A FastAPI app serving ``backend`` (any :class:`~tinkergym.protocol.backend.Backend`) over HTTP.

    Args:
        backend: The policy's compute; only the app's worker thread calls its training methods.
        run_dir: Where states (``states/<name>``) and exports (``exports/<name>``) are written.
        token_digest: :func:`~tinkergym.serve.auth.token_digest` of the bearer token.
        max_body_mb: Larger request bodies are refused with 413.
        logger: Receives one JSON line per request and per call, and tracebacks; defaults to
            ``logging.getLogger("tinkergym.serve.training.app")``.
        keep_results: Calls kept per session for retries.
        max_sessions: Sessions kept (the least recently used is forgotten).
        keep_states: With a value > 0, each ``save_state`` deletes all but that many newest saved states.
        limits: What one call may ask for (samples, new tokens, sequences, tokens); larger asks are refused with 400.
        lease: The lease the server serves under (a scheduler's worker started it): past its end every call is refused.
        worker: The thread that runs the calls, when the caller made it (:meth:`CallWorker.building`: the backend was built
            on it); by default one of its own.
    """
    folder = Path(run_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    log = logger or logging.getLogger("tinkergym.serve.training.app")
    service = TrainingService(backend, folder, log, keep_results, max_sessions, keep_states, limits, worker)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(service.worker.stop)

    app = FastAPI(
        title="tinkergym training server", version=str(PROTOCOL_VERSION), lifespan=lifespan,
        docs_url=None, redoc_url=None, default_response_class=WireJSON,
    )
    app.state.service = service
    app.include_router(router)
    add_training_error_handlers(app, log)
    # Added innermost first: the log sees every request, the token is checked before any body is read.
    # No NaN in a body (infinity bounds nothing where the protocol allows it): inside BodyLimit, which bounds what it reads.
    app.add_middleware(StrictJSON, allow_infinity=True)
    app.add_middleware(BodyLimit, max_bytes=int(max_body_mb * 1024 * 1024), hint="send the batch in several forward_backward calls (--max-body-mb)")
    require_token(app, token_digest, lease=lease)
    app.add_middleware(RequestLog, logger=log)
    app.state.metrics = training_metrics(app, "training", service.worker)
    return app


def training_metrics(app: FastAPI, server: str, worker: Any) -> Any:
    """The app's Prometheus registry (served by ``--metrics-port``): its requests, and ``worker``'s calls and tokens."""
    from tinkergym.serve.metrics import CallMetrics, MetricsMiddleware, ServerMetrics

    metrics = ServerMetrics(server)
    worker.observer = CallMetrics(metrics).observe
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return metrics
