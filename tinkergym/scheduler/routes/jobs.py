"""Jobs: submit (idempotent), list (filters, cursor pages), show, cancel, events, checkpoints."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from pydantic import Field
from sqlalchemy import and_, func, or_, select
from tinkergym.config import is_model_name
from tinkergym.scheduler import placement, states
from tinkergym.scheduler.artifacts import JOB_ID
from tinkergym.scheduler.deps import Forbidden, require
from tinkergym.scheduler.auth import TENANT_PATTERN, Principal
from tinkergym.scheduler.db import MAX_INT, allocations, devices, events, jobs
from tinkergym.scheduler.idempotency import Refused
from tinkergym.scheduler.repository import Conflict, JobStore
from tinkergym.scheduler.routes import in_writer_thread, respond_once
from tinkergym.scheduler.schemas import JobCreate, device_refusal
from tinkergym.serve.wire import WireModel

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

MAX_CONFIG_BYTES = 64 * 1024
#: Config keys that name folders on the submitting machine: the worker chooses its own.
CLIENT_PATH_KEYS = ("out", "resume", "data", "config")
#: The largest event seq (``events.seq`` is a 32-bit integer on PostgreSQL): a larger cursor is a 400, not a 500.
MAX_SEQ = MAX_INT


class WaitReason(WireModel):
    """Why a queued job waits (:mod:`tinkergym.scheduler.placement`)."""

    code: Literal["no_worker", "no_model", "too_few_devices", "too_little_memory", "quota", "behind", "memory_held", "busy", "ready"]
    message: str


class Job(WireModel):
    id: str
    tenant: str | None = Field(None, description="the tenant that owns the job (an operator key lists every tenant's)")
    kind: str
    state: str
    name: str
    priority: int
    gpus: int
    attempt: int
    max_attempts: int
    created_at: float
    updated_at: float
    finished_at: float | None = None
    error: str | None = None
    lease_epoch: int
    server_url: str | None = None
    queue_position: int | None = Field(None, description="its place in its tenant's queue, 1 for the tenant's next; queued jobs")
    seat: bool | None = Field(None, description="in GET /v1/jobs: whether the job holds a seat of a shared server (true) or "
                                                "whole devices (false) now; null while it holds nothing")
    wait_reason: WaitReason | None = Field(None, description="why a queued job waits; queued jobs, in GET /v1/jobs and /v1/jobs/{id}")
    last_event: int = Field(0, description="the seq of the job's newest event (read the ones after it with ?after=)")
    end_reason: str | None = Field(None, description="why an ended job ended, as the client that completed it said (the Tinker front "
                                                     "door: its session ended, and why); in GET /v1/jobs/{id} (a failed job says why in error)")
    config: dict[str, Any]


class JobPage(WireModel):
    jobs: list[Job]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


class Event(WireModel):
    seq: int
    type: str
    data: dict[str, Any]
    created_at: float


class EventPage(WireModel):
    events: list[Event]
    cursor: int = Field(description="the last seq returned (pass as ?after= to continue)")


class Checkpoint(WireModel):
    step: int
    name: str
    epoch: int
    created_at: float


class CheckpointList(WireModel):
    checkpoints: list[Checkpoint]


def _store(request: Request) -> JobStore:
    return request.app.state.store


def check_config(config: dict[str, Any]) -> dict[str, Any]:
    """The job's config, refused (ValueError -> 400) when too large, naming a path as its model, or carrying client paths."""
    if len(json.dumps(config)) > MAX_CONFIG_BYTES:
        raise ValueError(f"config is larger than {MAX_CONFIG_BYTES} bytes")
    model = config.get("model")
    if not is_model_name(model):
        raise ValueError(
            f"config.model {str(model)[:100]!r} is not a model name: name one the workers serve (e.g. smollm2-135m), not a path"
        )
    stray = [k for k in CLIENT_PATH_KEYS if config.get(k)]
    if stray:
        raise ValueError(f"config fields {stray} name folders on your machine; the scheduler's workers choose their own")
    return config


def queue_position(conn: Any, job: dict[str, Any]) -> int | None:
    """1 + the queued jobs of its tenant considered before ``job`` (higher priority, or equal priority and older): its
    place in its tenant's queue. Tenants take turns by fair share (:mod:`tinkergym.scheduler.fairshare`), so that is what
    a tenant can move, and reading it costs what the tenant's own queue does."""
    if job["state"] != states.QUEUED:
        return None
    ahead = conn.execute(select(func.count()).select_from(jobs).where(
        jobs.c.tenant_id == job["tenant_id"], jobs.c.state == states.QUEUED,
        or_(jobs.c.priority > job["priority"], and_(jobs.c.priority == job["priority"], jobs.c.created_at < job["created_at"])),
    )).scalar_one()
    return int(ahead) + 1


def queue_positions(conn: Any, rows: list[dict[str, Any]]) -> dict[str, int]:
    """The queue positions of the queued jobs among ``rows`` (as :func:`queue_position` counts them), in one query over
    their tenants' queues."""
    wanted = {r["id"] for r in rows if r["state"] == states.QUEUED}
    if not wanted:
        return {}
    owners = sorted({r["tenant_id"] for r in rows if r["id"] in wanted})
    ranked = select(jobs.c.id, func.rank().over(partition_by=jobs.c.tenant_id, order_by=(jobs.c.priority.desc(), jobs.c.created_at))
                    .label("position")).where(jobs.c.state == states.QUEUED, jobs.c.tenant_id.in_(owners)).subquery()
    return {i: int(p) for i, p in conn.execute(select(ranked.c.id, ranked.c.position).where(ranked.c.id.in_(sorted(wanted))))}


def seats_held(conn: Any, rows: list[dict[str, Any]]) -> dict[str, bool]:
    """For each job among ``rows`` that holds something now: whether it is a seat of a shared server (one query)."""
    holding = [r["id"] for r in rows if r["state"] in states.HOLDING]
    if not holding:
        return {}
    found = conn.execute(select(allocations.c.job_id, devices.c.seat_of).join(devices, devices.c.id == allocations.c.device_id)
                         .where(allocations.c.job_id.in_(holding))).all()
    return {job_id: seat_of is not None for job_id, seat_of in found}


def job_view(conn: Any, job: dict[str, Any], position: bool | int | None = False, wait_reason: dict[str, str] | None = None) -> dict[str, Any]:
    """The public view of a job row (no token digests, no worker ids); ``position``: True counts its place in the
    queue, a number is that place (:func:`queue_positions` counts a page's in one query)."""
    view = {k: job[k] for k in Job.model_fields if k in job and k not in ("config", "queue_position", "wait_reason", "last_event", "seat",
                                                                         "end_reason")}
    view["tenant"] = job["tenant_id"]
    view["config"] = json.loads(job["config"])
    view["queue_position"] = queue_position(conn, job) if position is True else (position or None)
    view["wait_reason"] = wait_reason
    view["last_event"] = job.get("cursor", 0)
    return view


@router.post("", status_code=201, response_model=Job, responses={409: {}, 422: {}, 429: {}})
async def submit(
    body: JobCreate, request: Request, who: Principal = Depends(require("write")),
    idempotency_key: str | None = Header(None, alias="Idempotency-Key", max_length=255),
) -> Any:
    """Queue a job; it is in the database before this answers 201. Retries with the same ``Idempotency-Key`` get the same job."""
    config = check_config(body.config.model_dump(mode="json", exclude_unset=True))  # what was sent, checked and typed
    settings = request.app.state.settings

    def create(conn: Any) -> tuple[int, dict[str, Any]]:
        unusable = device_refusal(body.kind, body.gpus)  # here, not before: a retry of a request stored earlier is replayed
        if unusable is not None:
            raise Refused(400, "invalid_request", unusable)
        # The job first, then the tenant's quotas with its queue counted (this job included) and held to the commit:
        # over a quota, raising rolls the job back.
        job, quotas = _store(request).create_queued_job(
            conn, tenant_id=who.tenant_id, kind=body.kind, gpus=body.gpus, config=config, priority=body.priority,
            name=body.name, max_attempts=body.max_attempts or settings.max_attempts,
        )
        assert quotas is not None  # count_queue (the default) counts them
        if body.gpus > quotas.max_gpus:
            raise Refused(400, "invalid_request", f"the job asks for {body.gpus} GPUs; tenant {who.tenant_id!r} may hold at most {quotas.max_gpus}")
        if getattr(settings, "refuse_unplaceable", False):
            unplaceable = placement.refusal(conn, who.tenant_id, body.config.model, body.gpus, body.kind, config)
            if unplaceable is not None:
                raise Refused(400, "unplaceable", f"no worker could ever run this job: {unplaceable}")
        if quotas.queued > quotas.max_queued:
            raise Refused(429, "quota", f"tenant {who.tenant_id!r} has {quotas.max_queued} queued jobs, its quota; wait for some to start or cancel some")
        return 201, job_view(conn, job)

    fields = {**body.model_dump(mode="json"), "config": config}  # the config as sent: defaults filled in are not the request
    return await in_writer_thread(request, lambda: respond_once(request, who, idempotency_key, fields, create))


def _decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor.encode("ascii") + b"=" * (-len(cursor) % 4)))
        t, job_id = float(data["t"]), data["id"]
        if not isinstance(job_id, str) or not JOB_ID.match(job_id):
            raise ValueError(job_id)
        return t, job_id
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeError):
        raise ValueError(f"cursor {cursor[:40]!r} is not one this server gave out; start without a cursor") from None


def _encode_cursor(job: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps({"t": job["created_at"], "id": job["id"]}).encode()).decode().rstrip("=")


@router.get("", response_model=JobPage)
def list_jobs(
    request: Request, who: Principal = Depends(require("read")),
    state: str | None = Query(None, description="comma-separated states"), kind: str | None = Query(None),
    limit: int = Query(50, ge=1, le=500), cursor: str | None = Query(None, max_length=200),
    tenant: str | None = Query(None, max_length=64, description="an operator key: only this tenant's jobs"),
) -> Any:
    """The tenant's jobs (an operator key: every tenant's), newest first, a page at a time; ``GET /v1/jobs/changes``
    says when to read the list again."""
    query = select(jobs)
    only = who.tenant_filter()
    if tenant and not TENANT_PATTERN.match(tenant):
        raise ValueError(f"tenant {tenant[:64]!r} is not a tenant name (lowercase letters, digits, '.', '_' and '-')")
    if tenant and only is not None and tenant != only:
        raise Forbidden(f"this key lists only tenant {only!r}'s jobs; listing another tenant's needs the 'operator' scope", "scope")
    if only is not None or tenant:
        query = query.where(jobs.c.tenant_id == (only or tenant))
    if state:
        wanted = [s.strip() for s in state.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in states.STATES]
        if unknown:
            raise ValueError(f"unknown states {unknown}; the states are {', '.join(states.STATES)}")
        query = query.where(jobs.c.state.in_(wanted))
    if kind:
        if kind not in states.KINDS:
            raise ValueError(f"unknown kind {kind!r}; the kinds are {', '.join(states.KINDS)}")
        query = query.where(jobs.c.kind == kind)
    if cursor:
        t, job_id = _decode_cursor(cursor)
        query = query.where(or_(jobs.c.created_at < t, and_(jobs.c.created_at == t, jobs.c.id < job_id)))
    query = query.order_by(jobs.c.created_at.desc(), jobs.c.id.desc()).limit(limit + 1)
    store = _store(request)
    with store.read() as conn:
        rows = [dict(r) for r in conn.execute(query).mappings()]
        reasons = placement.wait_reasons(conn, request.app.state.settings, store.clock(), rows[:limit], request.app)
        positions, seats = queue_positions(conn, rows[:limit]), seats_held(conn, rows[:limit])
        page = [{**job_view(conn, r, position=positions.get(r["id"]), wait_reason=reasons.get(r["id"])), "seat": seats.get(r["id"])}
                for r in rows[:limit]]
    return {"jobs": page, "next_cursor": _encode_cursor(rows[limit - 1]) if len(rows) > limit else None}


@router.get("/{job_id}", response_model=Job, responses={404: {}})
def show(job_id: str, request: Request, who: Principal = Depends(require("read"))) -> Any:
    """One job (404 for another tenant's, unless the key is an operator's)."""
    store = _store(request)
    with store.read() as conn:
        job = store.get(conn, job_id, who.tenant_filter())
        reasons = placement.wait_reasons(conn, request.app.state.settings, store.clock(), [job], request.app)
        return {**job_view(conn, job, position=True, wait_reason=reasons.get(job_id)), "end_reason": end_reason(conn, job)}


def end_reason(conn: Any, job: dict[str, Any]) -> str | None:
    """The ``reason`` of an ended job's last ``state`` event (a client's, given when it completed the job), or None."""
    if job["state"] not in states.TERMINAL:
        return None
    data = conn.execute(select(events.c.data).where(events.c.job_id == job["id"], events.c.type == "state")
                        .order_by(events.c.seq.desc()).limit(1)).scalar()
    reason = json.loads(data).get("reason") if data else None
    return reason if isinstance(reason, str) else None


@router.post("/{job_id}/cancel", response_model=Job, responses={404: {}, 409: {}})
def cancel(
    job_id: str, request: Request, who: Principal = Depends(require("write")),
    idempotency_key: str | None = Header(None, alias="Idempotency-Key", max_length=255),
) -> Any:
    """Cancel: a queued job at once; a leased or running one through ``cancelling`` (its worker stops the server)."""
    store = _store(request)

    def do_cancel(conn: Any) -> tuple[int, dict[str, Any]]:
        job = store.get(conn, job_id, who.tenant_id, for_update=True)
        if job["state"] == states.QUEUED:
            moved = store.transition(conn, job_id, states.CANCELLED, event={"by": who.key_id})
        elif job["state"] in (states.LEASED, states.STARTING, states.RUNNING):
            moved = store.transition(conn, job_id, states.CANCELLING, event={"by": who.key_id})
        elif job["state"] == states.CANCELLING:
            return 200, job_view(conn, job)
        else:
            raise Conflict(f"job {job_id} is {job['state']}: it has ended and cannot be cancelled")
        return 200, job_view(conn, moved.job)

    return respond_once(request, who, idempotency_key, {"job_id": job_id}, do_cancel)


@router.get("/{job_id}/events", response_model=EventPage, responses={404: {}})
def list_events(
    job_id: str, request: Request, who: Principal = Depends(require("read")),
    after: int = Query(0, ge=0, le=MAX_SEQ, description="return events with seq > after"), limit: int = Query(100, ge=1, le=1000),
) -> Any:
    """The job's events after a cursor, oldest first."""
    store = _store(request)
    with store.read() as conn:
        store.get(conn, job_id, who.tenant_filter())
        found = store.events_after(conn, job_id, after, limit)
    return {"events": [{k: e[k] for k in ("seq", "type", "data", "created_at")} for e in found], "cursor": found[-1]["seq"] if found else after}


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses={404: {}})
def list_checkpoints(job_id: str, request: Request, who: Principal = Depends(require("read"))) -> Any:
    """The checkpoints the job's servers recorded, by step."""
    store = _store(request)
    with store.read() as conn:
        store.get(conn, job_id, who.tenant_filter())
        rows = store.checkpoints(conn, job_id)
    return {"checkpoints": [{k: r[k] for k in ("step", "name", "epoch", "created_at")} for r in rows]}
