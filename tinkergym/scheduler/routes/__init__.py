"""The scheduler's routes: thin, one module per resource; :func:`respond_once` runs a POST once per Idempotency-Key."""

from __future__ import annotations

import time
from typing import Any, TypeVar
from collections.abc import Callable

from sqlalchemy.exc import OperationalError

T = TypeVar("T")

#: How many submissions run their transaction at once, per app: on SQLite one (its writes take turns on the write
#: lock anyway; more threads would only wait there and contend for the GIL), on PostgreSQL a few.
WRITERS = {"sqlite": 1}
DEFAULT_WRITERS = 4


async def in_writer_thread(request: Any, function: Callable[[], T]) -> T:
    """``function()`` in a worker thread, with at most :data:`WRITERS` such calls of the app running at once (the
    others wait in the event loop, not as threads)."""
    import asyncio

    import anyio
    import anyio.to_thread

    state = request.app.state
    loop = asyncio.get_running_loop()
    if getattr(state, "writers_loop", None) is not loop:  # a limiter waits with the primitives of one event loop
        state.writers = anyio.CapacityLimiter(WRITERS.get(state.engine.dialect.name, DEFAULT_WRITERS))
        state.writers_loop = loop
    return await anyio.to_thread.run_sync(function, limiter=state.writers)


#: SQLSTATEs of a transaction the database rolled back for another's sake (deadlock detected, serialization failure):
#: :func:`respond_once` runs it again, up to RETRIES times.
RETRYABLE = ("40P01", "40001")
RETRIES = 2


def rerun_rolled_back(function: Callable[[], T]) -> T:
    """``function()`` (one transaction), run again when the database rolled it back for another's sake (:data:`RETRYABLE`),
    :data:`RETRIES` times at most."""
    for attempt in range(RETRIES + 1):
        try:
            return function()
        except OperationalError as exc:  # PostgreSQL chose this transaction to break a deadlock: it rolled back whole
            if attempt == RETRIES or getattr(exc.orig, "sqlstate", None) not in RETRYABLE:
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")


def respond_once(request: Any, who: Any, key: str | None, body: Any, handler: Any, finish: Any = None, store: Any = None) -> Any:
    """Run ``handler(conn)`` in one transaction, once per ``Idempotency-Key`` when one is given; the JSON response.

    ``finish(body)`` completes a successful answer, first or replayed, after it is stored (what must not be stored,
    such as a token). A replayed answer carries ``Idempotent-Replayed: true``. ``store``: the store whose connection
    the transaction runs on (the app's unless given: lease requests run on the app's ``grant_store``).
    """
    from tinkergym.serve.asgi import WireJSON, error_response
    from tinkergym.scheduler.idempotency import IdempotencyError, run_once

    try:
        stored = rerun_rolled_back(lambda: run_once(
            store if store is not None else request.app.state.store, tenant_id=who.tenant_id, method=request.method, path=request.url.path,
            key=key, body=body, handler=handler, ttl_s=request.app.state.settings.idempotency_ttl_s,
            bounded=who.bounds is None))  # a worker credential's records (every heartbeat's) are the cluster's
    except IdempotencyError as exc:
        kinds = {409: "conflict", 422: "idempotency_key_reused", 400: "invalid_request", 429: "quota"}
        headers = None if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return error_response(exc.status, kinds[exc.status], str(exc), headers=headers)
    answer = finish(stored.body) if finish is not None and 200 <= stored.status < 300 else stored.body
    return WireJSON(answer, status_code=stored.status, headers={"Idempotent-Replayed": "true"} if stored.replayed else None)
