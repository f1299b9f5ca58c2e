"""Workers: register devices, take leases, heartbeat, report state, events and checkpoints (scope ``worker``).

Only a worker credential (:mod:`tinkergym.scheduler.credentials`, made by the operator) has the ``worker`` scope;
a registration must fit its bounds (403 otherwise) and a lease is granted within them. A quarantined worker's
lease request is 403 (:class:`~tinkergym.scheduler.granting.Quarantined`). A worker is registered under the key
that registered it: only that key may act for it (another key gets 404). Every write about a job names the lease epoch it holds; a stale epoch, or a job this worker does not
hold, is 409 (the fence). Every POST takes an ``Idempotency-Key`` (the IETF draft's semantics); without one,
registering, heartbeats, state reports and checkpoints are idempotent by themselves, and a lease request
or an event is not (a retried lease request may get a second job).

A worker is listed ``alive`` or ``gone``: gone when it has made no call for the scheduler's ``worker_timeout_s``
(killed, or cut off), alive again from its next call (see :mod:`tinkergym.scheduler.leases`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import HTTPException
from pydantic import Field, field_validator, model_validator
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from tinkergym.scheduler import granting, leases, states
from tinkergym.scheduler.artifact_paths import CHECKPOINT_NAME
from tinkergym.scheduler.deps import require
from tinkergym.scheduler.auth import Principal
from tinkergym.scheduler.bounds import parse_bounds
from tinkergym.scheduler.db import MAX_INT, api_keys, workers
from tinkergym.scheduler.repository import JobStore
from tinkergym.scheduler.routes import rerun_rolled_back, respond_once
from tinkergym.config import DTYPES, is_model_name
from tinkergym.serve.wire import WireModel
from tinkergym.scheduler.seats import MAX_SEATS

router = APIRouter(prefix="/v1/workers", tags=["workers"])

WORKER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
HOST = r"^[A-Za-z0-9.:\[\]-]{1,255}$"
SERVER_URL = re.compile(r"^https?://[A-Za-z0-9.:\[\]-]{1,255}(/[!-~]*)?$")
IdempotencyKey = Header(None, alias="Idempotency-Key", max_length=255)


class SharedIn(WireModel):
    """A device run as a shared training server: its seats are leased one LoRA job each (tinkergym.scheduler.seats)."""

    seats: int = Field(ge=1, le=MAX_SEATS, description="LoRA jobs the server holds at once")
    model: str = Field(max_length=200, description="the server's base model: one of the worker's models")
    dtype: str = Field("auto", pattern="^(" + "|".join(DTYPES) + ")$", description="the base's dtype (a job's dtype must be this, or auto)")
    max_lora_rank: int = Field(64, ge=1, le=4096, description="the largest rank a job on a seat may have")


class DeviceIn(WireModel):
    index: int = Field(ge=0, le=1023, description="CUDA_VISIBLE_DEVICES index (or CPU slot number)")
    kind: Literal["gpu", "slot"]
    name: str = Field("", max_length=200)
    shared: SharedIn | None = Field(None, description="run it as a shared training server of seats, not as a whole device")
    memory_gb: float | None = Field(None, gt=0, le=65536, description="its memory in GiB: training jobs that cannot fit it are not sent "
                                                                      "here (with model_shapes; none: not checked)")


class ModelShapeIn(WireModel):
    """A model's size as the memory estimate reads it (tinkergym.backends.torch.sizing.ModelShape; the worker counts it)."""

    hidden: int = Field(ge=1, le=2**20)
    intermediate: int = Field(ge=1, le=2**24)
    layers: int = Field(ge=1, le=4096)
    heads: int = Field(ge=1, le=4096)
    kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=2**16)
    vocab: int = Field(ge=1, le=2**24)
    gated_mlp: bool
    params: int = Field(ge=1, le=10**14)
    linear_params: int = Field(ge=0, le=10**14)
    layer_params: int = Field(ge=0, le=10**14)
    root_params: int = Field(ge=0, le=10**14)
    largest_param: int = Field(ge=0, le=10**14)
    lora_io: int = Field(ge=0, le=10**12)
    lora_linears: int = Field(ge=0, le=10**7)


class WorkerRegister(WireModel):
    """A worker and what it holds. Registering the same name with the same key again updates it."""

    name: str = Field(pattern=WORKER_NAME)
    host: str = Field(pattern=HOST, description="where the servers it starts listen (clients connect there directly)")
    devices: list[DeviceIn] = Field(min_length=1, max_length=256)
    models: list[str] = Field(default_factory=list, max_length=100, description="model names its servers serve")
    model_shapes: dict[str, ModelShapeIn] = Field(default_factory=dict, max_length=100,
                                                  description="the size of each model it offers (for the memory check before a lease)")

    @field_validator("devices")
    @classmethod
    def _unique_indexes(cls, value: list[DeviceIn]) -> list[DeviceIn]:
        indexes = [d.index for d in value]
        if len(set(indexes)) != len(indexes):
            raise ValueError("device indexes must be unique")
        return value

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: list[str]) -> list[str]:
        bad = [m for m in value if not is_model_name(m)]
        if bad:
            raise ValueError(f"not model names: {bad[:3]}")
        return value

    @model_validator(mode="after")
    def _shapes_of_offered_models(self) -> WorkerRegister:
        unknown = sorted(set(self.model_shapes) - set(self.models))
        if unknown:
            raise ValueError(f"model_shapes names models the worker does not offer: {', '.join(unknown[:3])}")
        return self

    @model_validator(mode="after")
    def _shared_models_offered(self) -> WorkerRegister:
        wrong = sorted({d.shared.model for d in self.devices if d.shared is not None and d.shared.model not in self.models})
        if wrong:
            raise ValueError(f"a shared device's model must be one of the worker's models, not {', '.join(wrong[:3])}")
        return self


class SharedOut(WireModel):
    model: str
    dtype: str
    max_lora_rank: int


class DeviceOut(WireModel):
    index: int = Field(description="a device's CUDA_VISIBLE_DEVICES index or slot number; a seat's own number (from 1024)")
    kind: str
    name: str
    active: bool
    busy: bool
    seat_of: int | None = Field(None, description="a seat: the device it sits on (its shared server's)")
    shared: SharedOut | None = Field(None, description="a seat: its server's base")
    memory_bytes: int | None = Field(None, description="the device's size as the worker registered it")
    used_bytes: int | None = Field(None, description="device memory its server used at its job's last heartbeat (a seat: its shared server's)")
    peak_bytes: int | None = Field(None, description="device memory at that server's peak")
    host_bytes: int | None = Field(None, description="that server's resident host memory")
    host_peak_bytes: int | None = Field(None, description="that server's resident host memory at its peak")
    measured_at: float | None = Field(None, description="when it was measured (null: never)")


class Worker(WireModel):
    id: str
    name: str
    host: str
    models: list[str]
    status: Literal["alive", "gone"] = Field(description="gone: no call for the scheduler's worker timeout; alive again at its next call")
    devices: list[DeviceOut]
    registered_at: float
    last_seen_at: float
    strikes: int = Field(0, description="leases in a row that expired before the job's server came up")
    quarantined: bool = Field(False, description="no more leases until the operator releases it (tinkergym scheduler workers release)")
    quarantine_reason: str | None = Field(None, description="why it is quarantined")


class WorkerList(WireModel):
    workers: list[Worker]


class Checkpoint(WireModel):
    step: int
    name: str


class Lease(WireModel):
    job_id: str
    kind: str
    config: dict[str, Any]
    epoch: int
    attempt: int
    devices: list[int] = Field(description="device indexes on this worker (CUDA_VISIBLE_DEVICES); a seat's: the device it sits on")
    seat: int | None = Field(None, description="the seat this job sits on (its index), on the shared server of devices[0]; null: whole devices")
    expires_at: float
    ttl_s: float = Field(description="heartbeat well within this")
    idle_timeout_s: float | None = Field(None, description="stop the job's server when its client has made no call for this long")
    token: str = Field(description="the job's server token, bound to this epoch")
    checkpoint: Checkpoint | None = Field(None, description="the job's last checkpoint, to resume from")


class LeaseAsk(WireModel):
    max: int = Field(1, ge=1, le=granting.MAX_GRANTS, description="leases to take at most, each on free places of its own "
                                                                  "(a worker asks for as many as it has free places)")


class LeaseAnswer(WireModel):
    lease: Lease | None = Field(None, description="the first lease granted; null when no queued job fits this worker's free devices")
    leases: list[Lease] = Field(default_factory=list, description="every lease granted (up to the request's max)")


class Fenced(WireModel):
    epoch: int = Field(ge=1, le=MAX_INT, description="the lease epoch this worker holds")


class TokenUsage(WireModel):
    tokens_trained: int = Field(ge=0, le=2**53, description="tokens the job's server trained at this lease so far")
    tokens_sampled: int = Field(ge=0, le=2**53, description="tokens the job's server sampled at this lease so far")


class ServerMemory(WireModel):
    """The job's server's memory as it measured it now (tinkergym.plumbing.memory_use; a seat's: its shared server's)."""

    device_bytes: int | None = Field(None, ge=0, le=2**53, description="device memory in use now (on a CPU: the host's)")
    device_peak_bytes: int | None = Field(None, ge=0, le=2**53, description="device memory at its peak (since the last job left a shared server)")
    device_total_bytes: int | None = Field(None, ge=0, le=2**53, description="the device's size, where the server can tell")
    host_bytes: int | None = Field(None, ge=0, le=2**53, description="the server's resident host memory now")
    host_peak_bytes: int | None = Field(None, ge=0, le=2**53, description="its resident host memory at its peak")
    base_bytes: int | None = Field(None, ge=0, le=2**53, description="a shared server: device memory in use with the base model alone")
    sessions: int | None = Field(None, ge=0, le=4096, description="a shared server: adapters open now")


class Heartbeat(Fenced):
    usage: TokenUsage | None = Field(None, description="the server's token counts at this lease (totals, not increments)")
    memory: ServerMemory | None = Field(None, description="the server's memory measured now (placement of seats reads it)")


class HeartbeatAnswer(WireModel):
    job_id: str
    epoch: int
    state: str
    cancelling: bool = Field(description="true: stop the job's server and report state cancelled")
    expires_at: float


class LeaseBeat(Heartbeat):
    job_id: str = Field(max_length=40, description="a job this worker holds")


class Heartbeats(WireModel):
    leases: list[LeaseBeat] = Field(max_length=leases.MAX_BEATS, description="every lease the worker holds, in one call")


class BeatAnswer(WireModel):
    job_id: str
    epoch: int
    state: str | None = Field(None, description="the job's state (absent when the lease is lost)")
    cancelling: bool = Field(False, description="true: stop the job's server and report state cancelled")
    expires_at: float | None = None
    lost: bool = Field(False, description="true: this worker no longer holds the lease; stop the job's server")
    error: str | None = Field(None, description="why the lease is lost")


class HeartbeatsAnswer(WireModel):
    leases: list[BeatAnswer]


class StateReport(Fenced):
    state: Literal["starting", "running", "succeeded", "failed", "cancelled"]
    error: str | None = Field(None, max_length=4000)
    server_url: str | None = Field(None, max_length=500, description="where the job's server listens (with state running)")

    @field_validator("server_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not SERVER_URL.match(value):
            raise ValueError("server_url must be an http(s) URL")
        return value


class StateAnswer(WireModel):
    job_id: str
    epoch: int
    state: str


class ReleaseReport(Fenced):
    reason: str = Field(min_length=1, max_length=2000, description="why this worker cannot run the job (its machine's fault)")


class EventReport(Fenced):
    type: Literal["log", "metrics", "error"]
    data: dict[str, Any]


class EventAnswer(WireModel):
    seq: int


class CheckpointReport(Fenced):
    step: int = Field(ge=0, le=MAX_INT)
    name: str = Field(pattern=CHECKPOINT_NAME.pattern, description="one folder name inside the job's artifact folder")


class CheckpointAnswer(WireModel):
    job_id: str
    step: int
    name: str
    epoch: int


def _store(request: Request) -> JobStore:
    return request.app.state.store


def _view(request: Request, conn: Any, worker_id: str) -> dict[str, Any] | None:
    return leases.worker_view(conn, worker_id, now=_store(request).clock(), timeout=leases.worker_timeout(request.app.state.settings))


def _own(conn: Any, worker_id: str, who: Principal) -> dict[str, Any]:
    worker = leases.owned_worker(conn, worker_id, who.key_id)
    if worker is None:
        raise HTTPException(404, f"no worker {worker_id[:80]!r} registered with this key")
    return worker


@router.post("", response_model=Worker, responses={403: {}, 409: {}, 422: {}})
def register(
    body: WorkerRegister, request: Request, who: Principal = Depends(require("worker")), idempotency_key: str | None = IdempotencyKey,
) -> Any:
    """Register (or update) this worker and the devices it holds; devices are matched by index."""
    store = _store(request)
    bounds = who.bounds
    assert bounds is not None  # require("worker") admits worker credentials alone, and each has bounds

    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        worker_id = leases.register_worker(
            conn, key_id=who.key_id, bounds=bounds, name=body.name, host=body.host, device_list=[d.model_dump() for d in body.devices],
            models=body.models, now=store.clock(), model_shapes={m: s.model_dump() for m, s in body.model_shapes.items()},
        )
        view = _view(request, conn, worker_id)
        assert view is not None  # registered above, in this transaction
        return 200, view

    response = respond_once(request, who, idempotency_key, body.model_dump(mode="json"), handler)
    leases.wake(request.app)
    return response


@router.get("", response_model=WorkerList)
def list_workers(
    request: Request, status: Literal["alive", "gone"] | None = Query(None, description="only the workers in this status"),
    who: Principal = Depends(require("read")),
) -> Any:
    """The workers that serve this key's tenant (its own pool and the shared ones): the capacity and models it can use,
    with status and devices (``busy``: held by a job now; never whose job, nor why a worker is quarantined, which may
    name another tenant's job). Any tenant key with ``read`` lists them;
    the operator lists them all with ``tinkergym scheduler workers list``."""
    with _store(request).read() as conn:
        rows = conn.execute(select(workers.c.id, api_keys.c.worker_bounds).join(api_keys, api_keys.c.id == workers.c.key_id)
                            .order_by(workers.c.registered_at, workers.c.id)).all()
        ids = [r.id for r in rows if (bounds := parse_bounds(r.worker_bounds)) is not None and bounds.serves(who.tenant_id)]
        found = [v for v in (_view(request, conn, i) for i in ids) if v is not None]
    # Why a worker is quarantined may name another tenant's job and its error: the operator's listing shows it.
    return {"workers": [{**v, "quarantine_reason": None} for v in found if status is None or v["status"] == status]}


@router.post("/{worker_id}/leave", response_model=Worker, responses={404: {}, 422: {}})
def leave(worker_id: str, request: Request, who: Principal = Depends(require("worker"))) -> Any:
    """This worker is stopping (its servers are stopped): listed ``gone`` at once instead of after the worker timeout;
    its leases still end as leases do. Its next call makes it ``alive`` again."""
    store, settings = _store(request), request.app.state.settings

    with store.transaction() as conn:
        _own(conn, worker_id, who)
        leases.mark_gone(conn, worker_id, store.clock(), leases.worker_timeout(settings))
        return _view(request, conn, worker_id)


@router.post("/{worker_id}/lease", response_model=LeaseAnswer, responses={403: {}, 404: {}, 409: {}, 422: {}})
async def lease(worker_id: str, request: Request, body: LeaseAsk | None = None, who: Principal = Depends(require("worker")),
                idempotency_key: str | None = IdempotencyKey) -> Any:
    """Take queued jobs that fit this worker's free devices and models, up to ``max`` (default 1) in one grant: ``leases``,
    and the first of them as ``lease`` (``{"lease": null, "leases": []}`` when none fits).

    A worker with several free places asks for that many at once: one request fills them, in the order one request after
    another would (:func:`tinkergym.scheduler.granting.grant_many`), for about the scheduler's work of one grant.

    Grants go one at a time; a request waits for its turn on the event loop, not in a thread of the pool that serves
    every route, so under a burst of lease requests heartbeats and state reports still run (with the waiters holding the
    pool's threads, leases expired unrenewed at 1,000 workers and their workers were quarantined)."""
    store, settings, app = _store(request), request.app.state.settings, request.app
    secret = leases.app_secret(app)

    most = body.max if body is not None else 1

    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        _own(conn, worker_id, who)
        granted = granting.grant_many(conn, store, settings, worker_id, secret, who.bounds, getattr(app.state, "usage", None),
                                      getattr(app.state, "reservations", None), limit=most)
        for one in granted:
            one.pop("token")  # never stored (the idempotency record keeps the answer): derived again below
            # counted once, when made (a retried poll answers the kept record); a grant whose transaction then fails to
            # commit (two grants of one device: rare) is counted too
            request.app.state.metrics.leases_granted.inc()
        return 200, {"lease": granted[0] if granted else None, "leases": granted}

    def with_token(answer: dict[str, Any]) -> dict[str, Any]:
        kept = answer["leases"] if "leases" in answer else [answer["lease"]] if answer.get("lease") else []  # a record kept before "leases"
        granted = [{**one, "token": leases.server_token(secret, one["job_id"], one["epoch"])} for one in kept]
        return {"lease": granted[0] if granted else None, "leases": granted}

    async with grant_gate(app):  # one grant at a time in this process
        try:
            return await run_in_threadpool(respond_once, request, who, idempotency_key, {"worker_id": worker_id, "max": most}, handler,
                                           with_token, getattr(app.state, "grant_store", None))
        except IntegrityError:  # a device taken by a concurrent grant: this one rolled back whole
            return {"lease": None, "leases": []}


def grant_gate(app: Any) -> asyncio.Lock:
    """The app's turn for grants on the running event loop (:data:`tinkergym.scheduler.granting.GRANT_LOCK` is the
    database's, across processes)."""
    loop = asyncio.get_running_loop()
    gate = getattr(app.state, "grant_gate", None)
    if gate is None or gate[0] is not loop:
        gate = app.state.grant_gate = (loop, asyncio.Lock())
    return gate[1]


@router.post("/{worker_id}/jobs/{job_id}/heartbeat", response_model=HeartbeatAnswer, responses={404: {}, 409: {}, 422: {}})
def heartbeat(
    worker_id: str, job_id: str, body: Heartbeat, request: Request, who: Principal = Depends(require("worker")),
    idempotency_key: str | None = IdempotencyKey,
) -> Any:
    """Renew the job's lease (409 when it is lost: stop the job's server). ``cancelling``: stop it and report ``cancelled``.
    ``usage``: the tokens the job's server trained and sampled so far at this lease (the tenant's usage); ``memory``:
    its memory measured now, kept on the job's devices (a seat's: on every seat of its device) for placement."""
    store, settings = _store(request), request.app.state.settings
    usage = body.usage.model_dump() if body.usage is not None else None
    memory = body.memory.model_dump() if body.memory is not None else None

    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        _own(conn, worker_id, who)
        return 200, leases.heartbeat(conn, store, settings, worker_id, job_id, body.epoch, usage, memory)

    return respond_once(request, who, idempotency_key, body.model_dump(mode="json"), handler)


@router.post("/{worker_id}/heartbeats", response_model=HeartbeatsAnswer, responses={404: {}, 422: {}})
def heartbeats(worker_id: str, body: Heartbeats, request: Request, who: Principal = Depends(require("worker"))) -> Any:
    """Renew every lease this worker holds in one call (what a heartbeat does for one, for each); a lease it no longer
    holds is answered ``lost`` (stop that job's server) and the others are renewed all the same. Idempotent by itself:
    an ``Idempotency-Key`` is accepted and not stored (a retry renews again, from its own time)."""
    store, settings = _store(request), request.app.state.settings
    beats = [{"job_id": b.job_id, "epoch": b.epoch, "usage": b.usage.model_dump() if b.usage is not None else None,
              "memory": b.memory.model_dump() if b.memory is not None else None} for b in body.leases]
    def renew() -> dict[str, Any]:
        with store.transaction() as conn:
            _own(conn, worker_id, who)
            return {"leases": leases.heartbeat_many(conn, store, settings, worker_id, beats)}

    return rerun_rolled_back(renew)


@router.post("/{worker_id}/jobs/{job_id}/state", response_model=StateAnswer, responses={404: {}, 409: {}, 422: {}})
def report_state(
    worker_id: str, job_id: str, body: StateReport, request: Request, who: Principal = Depends(require("worker")),
    idempotency_key: str | None = IdempotencyKey,
) -> Any:
    """Report the job's state (starting, running with ``server_url``, succeeded, failed with ``error``, cancelled)."""
    store = _store(request)

    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        _own(conn, worker_id, who)
        return 200, leases.report_state(conn, store, worker_id, job_id, body.epoch, body.state, error=body.error, server_url=body.server_url)

    response = respond_once(request, who, idempotency_key, body.model_dump(mode="json"), handler)
    if body.state in states.TERMINAL:
        leases.wake(request.app)
    return response


@router.post("/{worker_id}/jobs/{job_id}/events", response_model=EventAnswer, responses={404: {}, 409: {}, 413: {}, 422: {}, 429: {}})
def report_event(
    worker_id: str, job_id: str, body: EventReport, request: Request, who: Principal = Depends(require("worker")),
    idempotency_key: str | None = IdempotencyKey,
) -> Any:
    """Append a ``log``, ``metrics`` or ``error`` event to the job's stream."""
    store = _store(request)

    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        _own(conn, worker_id, who)
        return 200, {"seq": leases.report_event(conn, store, worker_id, job_id, body.epoch, body.type, body.data)}

    return respond_once(request, who, idempotency_key, body.model_dump(mode="json"), handler)


@router.post("/{worker_id}/jobs/{job_id}/checkpoints", response_model=CheckpointAnswer, responses={404: {}, 409: {}, 422: {}})
def report_checkpoint(
    worker_id: str, job_id: str, body: CheckpointReport, request: Request, who: Principal = Depends(require("worker")),
    idempotency_key: str | None = IdempotencyKey,
) -> Any:
    """Record a checkpoint the job's server wrote (``name``: its folder in the job's artifact folder)."""
    store = _store(request)

    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        _own(conn, worker_id, who)
        return 200, leases.report_checkpoint(conn, store, worker_id, job_id, body.epoch, body.step, body.name)

    return respond_once(request, who, idempotency_key, body.model_dump(mode="json"), handler)


@router.post("/{worker_id}/jobs/{job_id}/release", response_model=StateAnswer, responses={404: {}, 409: {}, 422: {}})
def release_job(
    worker_id: str, job_id: str, body: ReleaseReport, request: Request, who: Principal = Depends(require("worker")),
    idempotency_key: str | None = IdempotencyKey,
) -> Any:
    """Give the job back because this worker cannot run it (a package, a model or a device missing on its machine): the
    job is queued again at the same attempt and the worker is quarantined with ``reason`` until the operator releases it."""
    store = _store(request)

    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        _own(conn, worker_id, who)
        return 200, leases.release_job(conn, store, worker_id, job_id, body.epoch, body.reason)

    response = respond_once(request, who, idempotency_key, body.model_dump(mode="json"), handler)
    leases.wake(request.app)
    return response
