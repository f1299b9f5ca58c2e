"""The cluster as an operator sees it (``GET /v1/cluster``) and each tenant's usage beside its quotas (``GET /v1/usage``).

``/v1/me`` says what the key is (its tenant and scopes). ``/v1/cluster`` needs a key with the ``operator`` scope (``tinkergym scheduler keys create TENANT --scopes
read,operator``; ``admin`` does not imply it): every worker with its devices and seats, what each holds (the job, its
tenant and state, when its lease ends), its heartbeat and quarantine; the leases ending soonest; the queue now and its
history (:mod:`tinkergym.scheduler.usage`); every tenant's usage. ``/v1/usage`` answers a tenant's key with its own
tenant's row and an operator key with every tenant's. Both are reads: nothing here changes anything.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field
from sqlalchemy import select

from tinkergym.scheduler.auth import Principal
from tinkergym.scheduler.db import allocations, devices, jobs, workers
from tinkergym.scheduler.deps import require
from tinkergym.scheduler.repository import JobStore
from tinkergym.serve.wire import WireModel
from tinkergym.scheduler.usage import queue_sample, usage_rows
from tinkergym.scheduler.worker_registry import worker_timeout, worker_view

router = APIRouter(prefix="/v1", tags=["cluster"])
#: The leases listed by how soon they end.
ENDING_SOON = 50


class Me(WireModel):
    key_id: str
    tenant: str
    scopes: list[str]
    operator: bool = Field(description="whether this key reads the whole cluster (GET /v1/cluster, every tenant's jobs)")


class Usage(WireModel):
    tenant: str
    jobs: int = Field(description="jobs kept (retention deletes old ended ones)")
    queued: int
    max_queued: int
    holding: int = Field(description="jobs holding devices or seats now (leased, starting, running, cancelling)")
    devices_held: int
    seats_held: int
    max_gpus: int
    device_seconds: float = Field(description="devices held times seconds, a seat counting its share of its device")
    tokens_trained: int = Field(description="tokens its jobs' servers trained (forward_backward rows)")
    tokens_sampled: int = Field(description="new tokens its jobs' servers sampled")
    artifact_bytes: int
    max_artifact_bytes: int
    events: int = Field(description="events its kept jobs hold")
    max_events_per_job: int
    max_event_bytes: int
    keep_ended_jobs: int
    idempotency_records: int = Field(description="Idempotency-Key records (stored answers) it holds")
    max_idempotency_records: int
    idempotency_bytes: int = Field(description="bytes of those stored answers")
    max_idempotency_bytes: int


class UsageList(WireModel):
    tenants: list[Usage]


class Holder(WireModel):
    job_id: str
    tenant: str
    state: str
    kind: str
    epoch: int
    lease_expires_at: float | None
    granted_at: float


class ClusterDevice(WireModel):
    index: int
    kind: str
    name: str
    active: bool
    seat_of: int | None = None
    shared: dict[str, Any] | None = None
    held_by: Holder | None = None


class ClusterWorker(WireModel):
    id: str
    name: str
    host: str
    models: list[str]
    status: str
    registered_at: float
    last_seen_at: float
    strikes: int
    quarantined: bool
    quarantine_reason: str | None = None
    devices: list[ClusterDevice]


class Cluster(WireModel):
    now: float
    workers: list[ClusterWorker]
    ending: list[Holder] = Field(description=f"the {ENDING_SOON} leases that end soonest")
    queue: dict[str, Any] = Field(description="now: jobs queued and holding by kind, devices and seats held and free")
    history: list[dict[str, Any]] = Field(description="the queue's samples, oldest first (this scheduler process's)")
    tenants: list[Usage]


def _store(request: Request) -> JobStore:
    return request.app.state.store


@router.get("/me", response_model=Me)
def me(who: Principal = Depends(require("read"))) -> Any:
    """This key: its id (never the secret), tenant and scopes, and whether it is an operator's."""
    return {"key_id": who.key_id, "tenant": who.tenant_id, "scopes": sorted(who.scopes), "operator": who.operator}


@router.get("/usage", response_model=UsageList)
def usage(request: Request, who: Principal = Depends(require("read"))) -> Any:
    """This key's tenant's usage beside its quotas (an operator key: every tenant's)."""
    with _store(request).read() as conn:
        return {"tenants": usage_rows(conn, who.tenant_filter())}


@router.get("/cluster", response_model=Cluster, responses={403: {}})
def cluster(request: Request, who: Principal = Depends(require("operator"))) -> Any:
    """Every worker and what it holds, the leases ending soonest, the queue and its history, every tenant's usage."""
    store, settings = _store(request), request.app.state.settings
    now = store.clock()
    with store.read() as conn:
        holders = {r.device_id: {"job_id": r.id, "tenant": r.tenant_id, "state": r.state, "kind": r.kind, "epoch": r.epoch,
                                 "lease_expires_at": r.lease_expires_at, "granted_at": r.granted_at}
                   for r in conn.execute(select(allocations.c.device_id, allocations.c.epoch, allocations.c.granted_at, jobs.c.id,
                                                jobs.c.tenant_id, jobs.c.state, jobs.c.kind, jobs.c.lease_expires_at)
                                         .join(jobs, jobs.c.id == allocations.c.job_id))}
        ids = {(r.worker_id, r.index): r.id for r in conn.execute(select(devices.c.id, devices.c.worker_id, devices.c.index))}
        found = []
        for worker_id in conn.execute(select(workers.c.id).order_by(workers.c.registered_at, workers.c.id)).scalars():
            view = worker_view(conn, worker_id, now=now, timeout=worker_timeout(settings))
            if view is None:
                continue
            view["devices"] = [{**{k: d[k] for k in ("index", "kind", "name", "active", "seat_of", "shared")},
                                "held_by": holders.get(ids.get((worker_id, d["index"])))} for d in view["devices"]]
            found.append(view)
        ending = sorted({h["job_id"]: h for h in holders.values() if h["lease_expires_at"] is not None}.values(),
                        key=lambda h: h["lease_expires_at"])[:ENDING_SOON]
        queue = queue_sample(conn, now)
        tenants = usage_rows(conn, None)
    history = list(getattr(request.app.state, "queue_history", None) or [])
    return {"now": now, "workers": found, "ending": ending, "queue": queue, "history": history, "tenants": tenants}
