"""A job's events as server-sent events (``GET /v1/jobs/{id}/events/stream``).

The stream first sends the events after the client's cursor (the ``Last-Event-ID`` header a reconnecting
``EventSource`` sends, or ``?after=``), then stays open. It does not poll: the app's one watcher
(:class:`~tinkergym.scheduler.streams.StreamHub`) reads the event cursors of every streamed job in one query each
``sse_poll_s`` seconds and wakes the streams whose job has new events; a woken stream reads them (in a thread, with
a connection taken from the pool for that one read and given back, so an idle stream holds no connection) and
sends each as

::

    id: <seq>
    event: <type>
    data: <the event as JSON: seq, type, data, created_at>

A comment (``: keep-alive``) goes out when nothing else was sent for ``sse_keepalive_s`` seconds, so proxies
keep the connection and a client notices a dead one. The stream ends after the event that moves the job to a
terminal state (succeeded, failed, cancelled); a client that resumes after that event gets an empty stream.
A stream whose key is revoked ends at the watcher's next pass. Events are numbered per job (``seq``, unique in the
database) and sent in order, so resuming from the last ``id`` seen loses nothing and repeats nothing.

``GET /v1/jobs/changes`` streams the key's job list instead: a ``changed`` message when the stream opens and each
time the jobs the key sees change (an event appended to one, a job submitted or deleted, the queue moved), so a page
reads the list again when told to rather than on a timer. It carries no job data: what the list shows comes from
``GET /v1/jobs``, with its filters and paging, and a client that reconnects is told at once to read it again, so a
list kept this way is never stale after a dropped stream. An operator key's stream watches every tenant's jobs.

A key holds at most ``max_streams_per_key`` open streams and the app ``max_streams``; past either, 429 with
``Retry-After``.
"""

from __future__ import annotations

import json
import time
from typing import Any
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from tinkergym.serve.asgi import error_response
from tinkergym.scheduler import states
from tinkergym.scheduler.deps import require
from tinkergym.scheduler.auth import Principal
from tinkergym.scheduler.repository import JobStore, NotFound
from tinkergym.scheduler.routes.jobs import MAX_SEQ
from tinkergym.scheduler.streams import EVERY, RETRY_AFTER_S, StreamHub, StreamRefused, Subscription

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
#: ``/v1/jobs/changes``: included before the jobs' router, whose ``/v1/jobs/{job_id}`` would take the path.
changes_router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

#: The default when the app's settings do not say (``SchedulerSettings.sse_keepalive_s``).
KEEPALIVE_S = 15.0
#: Events read at once; a backlog larger than this goes out over several reads without waiting between them.
BATCH = 500
#: The reconnection delay (ms) the stream suggests to ``EventSource`` clients.
RETRY_MS = 1000


def parse_last_event_id(value: str | None, after: int) -> int:
    """The cursor to resume from: ``Last-Event-ID`` when it is a sequence number this stream sent, else ``after``."""
    if value is None or not value.strip():
        return after
    value = value.strip()
    if not value.isascii() or not value.isdigit() or int(value) > MAX_SEQ:
        raise ValueError(f"Last-Event-ID {value[:40]!r} is not an event id this stream sent (a non-negative integer)")
    return int(value)


def sse_message(event: dict[str, Any]) -> bytes:
    """One SSE message for a stored event (``data`` is one JSON line, so it needs no continuation lines)."""
    body = {k: event[k] for k in ("seq", "type", "data", "created_at")}
    return f"id: {event['seq']}\nevent: {event['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def is_terminal_event(event: dict[str, Any]) -> bool:
    """Whether ``event`` is the one that moved its job to a terminal state."""
    return event["type"] == "state" and isinstance(event["data"], dict) and event["data"].get("state") in states.TERMINAL


def _poll(store: JobStore, job_id: str, after: int) -> tuple[list[dict[str, Any]], bool]:
    """(events after ``after``, whether the job has ended), read in one short transaction.

    The job is read before its events: its terminal event is written in the same transaction as its state,
    so a job read as ended has that event among the ones read next (unless the client is already past it).
    """
    with store.read() as conn:
        job = store.get(conn, job_id)
        found = store.events_after(conn, job_id, after, BATCH)
    return found, job["state"] in states.TERMINAL


async def _stream(store: JobStore, subscription: Subscription, keepalive_s: float) -> AsyncIterator[bytes]:
    assert subscription.job_id is not None  # one job's stream
    yield f"retry: {RETRY_MS}\n\n".encode()
    last_sent = time.monotonic()
    while True:
        try:
            found, ended = await run_in_threadpool(_poll, store, str(subscription.job_id), subscription.cursor)
        except NotFound:
            return  # the job was deleted (retention): nothing more will come
        for event in found:
            yield sse_message(event)
            subscription.cursor, last_sent = event["seq"], time.monotonic()
            if is_terminal_event(event):
                return
        if len(found) >= BATCH:
            continue  # more backlog: read on at once
        if ended:
            return  # the client resumed after the terminal event: nothing more will come
        while not subscription.wake.is_set():  # until the watcher sees a new event (or a revoked key)
            with anyio.move_on_after(max(0.0, keepalive_s - (time.monotonic() - last_sent))):
                await subscription.wake.wait()
            if not subscription.wake.is_set():
                yield b": keep-alive\n\n"
                last_sent = time.monotonic()
        subscription.wake.clear()  # before the read: a wake during it is kept for the next round
        if subscription.revoked:
            return


class _CountedStream(StreamingResponse):
    """The stream's response; its slot in the hub is freed however the response ends (done, client gone, error)."""

    def __init__(self, content: Any, hub: StreamHub, subscription: Subscription, **options: Any) -> None:
        super().__init__(content, **options)
        self.hub, self.subscription = hub, subscription

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.hub.close(self.subscription)


@router.get(
    "/{job_id}/events/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}, 404: {}, 429: {}},
)
async def stream_events(
    job_id: str, request: Request, who: Principal = Depends(require("read")),
    after: int = Query(0, ge=0, le=MAX_SEQ, description="send events with seq > after (Last-Event-ID takes precedence)"),
    last_event_id: str | None = Header(None, alias="Last-Event-ID", max_length=40),
) -> Response:
    """The job's events as server-sent events: the backlog after the cursor, then each new one; ends with the job."""
    store: JobStore = request.app.state.store
    hub: StreamHub = request.app.state.streams
    cursor = parse_last_event_id(last_event_id, after)
    try:
        subscription = hub.open(job_id, who.key_id, cursor)  # refused before any database work
    except StreamRefused as exc:
        return error_response(429, "too_many_streams", str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})

    def check() -> None:
        with store.read() as conn:
            store.get(conn, job_id, who.tenant_filter())  # NotFound (404) for another tenant's job (an operator sees all)

    try:
        await run_in_threadpool(check)
    except BaseException:
        hub.close(subscription)
        raise
    keepalive_s = float(getattr(request.app.state.settings, "sse_keepalive_s", KEEPALIVE_S))
    return _CountedStream(
        _stream(store, subscription, keepalive_s), hub, subscription,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _changes(subscription: Subscription, keepalive_s: float, max_s: float) -> AsyncIterator[bytes]:
    yield f"retry: {RETRY_MS}\n\n".encode()
    ends = time.monotonic() + max_s
    while True:
        yield b"event: changed\ndata: {}\n\n"
        last_sent = time.monotonic()
        while not subscription.wake.is_set():
            if time.monotonic() >= ends:
                return  # the client connects again (and reads the list afresh)
            with anyio.move_on_after(max(0.0, min(keepalive_s - (time.monotonic() - last_sent), ends - time.monotonic()))):
                await subscription.wake.wait()
            if not subscription.wake.is_set() and time.monotonic() - last_sent >= keepalive_s:
                yield b": keep-alive\n\n"
                last_sent = time.monotonic()
        subscription.wake.clear()
        if subscription.revoked:
            return


@changes_router.get(
    "/changes",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events: `changed`"}, 429: {}},
)
async def stream_changes(request: Request, who: Principal = Depends(require("read"))) -> Response:
    """A ``changed`` message now and whenever the jobs this key sees change: read ``GET /v1/jobs`` again then."""
    hub: StreamHub = request.app.state.streams
    tenant = who.tenant_filter() or EVERY
    try:
        subscription = hub.open(None, who.key_id, 0, tenant=tenant)
    except StreamRefused as exc:
        return error_response(429, "too_many_streams", str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
    try:  # the fingerprint the client's next read will see at least: a change after it wakes the stream
        subscription.version = (await run_in_threadpool(hub.read_versions, [tenant]))[tenant]
    except BaseException:
        hub.close(subscription)
        raise
    settings = request.app.state.settings
    keepalive_s, max_s = float(getattr(settings, "sse_keepalive_s", KEEPALIVE_S)), float(getattr(settings, "changes_max_s", 600.0))
    return _CountedStream(_changes(subscription, keepalive_s, max_s), hub, subscription, media_type="text/event-stream",
                          headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
