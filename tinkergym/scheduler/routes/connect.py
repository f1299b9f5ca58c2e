"""The job's owner and its server: where to connect (and with which token), and saying the work is done.

The scheduler never proxies training traffic: the client asks ``GET /v1/jobs/{id}/connection`` for the
running server's URL and the token of the current lease epoch (derived, never stored), then talks to the
server directly (an inference job's calls may instead go through the scheduler's gateway, ``routes/gateway.py``,
which follows the job across leases). When the epoch moves on (the lease was lost and granted again), the old token stops
working with the old server's death, and the client asks again.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import Field
from sqlalchemy import delete
from tinkergym.scheduler import leases, states
from tinkergym.scheduler.deps import require
from tinkergym.scheduler.auth import Principal
from tinkergym.scheduler.db import MAX_INT, allocations
from tinkergym.scheduler.repository import Conflict, JobStore
from tinkergym.serve.wire import WireModel

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

#: The longest reason a client may give for completing a job.
MAX_REASON = 500


class Connection(WireModel):
    job_id: str
    state: str
    epoch: int
    url: str = Field(description="the job's server (a training server for train/sft jobs, an inference server for inference jobs)")
    token: str = Field(description="bearer token of that server for this lease epoch")


class Complete(WireModel):
    epoch: int = Field(ge=0, le=MAX_INT, description="the lease epoch the client trained against (fences a completion from an older lease)")
    reason: str | None = Field(None, max_length=MAX_REASON, description="why the client ends the job, in words for its owner (the Tinker "
                                                                         "front door says its session ended, and why): the job's end_reason")


class Completed(WireModel):
    job_id: str
    state: str


class ClientEvent(WireModel):
    """What the client reports of the run it drives: ``metrics`` of a step (numbers), a ``log`` line, or a ``transcript``
    (a few of a step's episodes, their messages cut short; the job's page on the dashboard shows them)."""

    type: Literal["metrics", "log", "transcript"]
    data: dict[str, Any] = Field(description="a JSON object of at most the tenant's max_event_bytes (64 KiB unless raised)")


class EventSeq(WireModel):
    seq: int


def _store(request: Request) -> JobStore:
    return request.app.state.store


@router.get("/{job_id}/connection", response_model=Connection, responses={404: {}, 409: {}})
def connection(job_id: str, request: Request, who: Principal = Depends(require("write"))) -> Any:
    """The running job's server and token; 409 (with the job's state) until the job is running."""
    store = _store(request)
    with store.read() as conn:
        job = store.get(conn, job_id, who.tenant_id)
    if job["state"] != states.RUNNING or not job["server_url"]:
        raise Conflict(f"job {job_id} is {job['state']}: its server is reachable once it is running")
    return {"job_id": job_id, "state": job["state"], "epoch": job["lease_epoch"], "url": job["server_url"],
            "token": leases.token_for(request.app, job_id, job["lease_epoch"])}


@router.post("/{job_id}/complete", response_model=Completed, responses={404: {}, 409: {}})
def complete(job_id: str, body: Complete, request: Request, who: Principal = Depends(require("write"))) -> Any:
    """The client is done with the job (a train job's run ended): it succeeds and its devices are freed at once.

    The worker sees the end at its next heartbeat and stops the server. Completing again answers the same. A ``reason``
    goes with the job's ``state`` event, and ``GET /v1/jobs/{id}`` answers it as the job's ``end_reason``.
    """
    store = _store(request)
    with store.transaction() as conn:
        job = store.get(conn, job_id, who.tenant_id, for_update=True)
        if job["state"] == states.SUCCEEDED:
            return {"job_id": job_id, "state": job["state"]}
        said = {"reason": body.reason} if body.reason else {}
        moved = store.transition(conn, job_id, states.SUCCEEDED, epoch=body.epoch, event={"by": "client", "epoch": body.epoch, **said},
                                 lease_expires_at=None, server_url=None, server_token_digest=None)
        conn.execute(delete(allocations).where(allocations.c.job_id == job_id))
    return {"job_id": job_id, "state": moved.job["state"]}


@router.post("/{job_id}/client-events", response_model=EventSeq, responses={404: {}, 409: {}, 413: {}, 429: {}})
def client_event(job_id: str, body: ClientEvent, request: Request, who: Principal = Depends(require("write"))) -> Any:
    """Append the client's ``metrics`` or ``log`` event to the job's stream (``tinkergym jobs logs --follow`` shows it).

    Within the tenant's quotas (:mod:`tinkergym.scheduler.quotas`): 413 for an event over ``max_event_bytes``, 429 once
    the job holds ``max_events_per_job`` events.
    """
    store = _store(request)
    with store.transaction() as conn:
        job = store.get(conn, job_id, who.tenant_id)
        if job["state"] in states.TERMINAL:
            raise Conflict(f"job {job_id} is {job['state']}: it takes no more events")
        return {"seq": store.append_event(conn, job_id, body.type, body.data, limited=True)}
