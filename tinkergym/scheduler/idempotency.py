"""``Idempotency-Key`` on POST requests, with the IETF draft's semantics (draft-ietf-httpapi-idempotency-key-header).

A key is scoped by tenant, method and path and fingerprinted by the request body (its canonical JSON):

- the first request with a key runs, and its response is stored **in the same transaction as what it creates**
  (one transaction: look the key up, do the work, store the response), so an acknowledged job always has its
  key, a key never points at nothing, and a request that fails or dies leaves nothing behind: a retry runs again;
- a retry with the same key and body gets the stored response again (same status, same body), and
  creates nothing;
- the same key with another body is 422;
- a request refused without effect (a quota, :class:`Refused`) is not stored: a retry runs again;
- a new key of a tenant's key (not a worker credential's) past the tenant's bounds (``tenants.max_idempotency_records`` records, ``max_idempotency_bytes`` bytes of
  stored answers; ``tinkergym scheduler tenants set``) is 429 with ``Retry-After``, when its oldest record expires
  (``idempotency_ttl_s``): nothing runs, and the same request without a key still does. A retry of a stored key is
  always answered. The check is made before the request runs, so a tenant ends at most one answer past its bytes;
- a retry while the first is still running is 409. In flight means: in this process, a request with the key
  that has not ended (a set the store keeps); in another process on the same PostgreSQL database, a transaction
  holding the key's advisory lock (``pg_try_advisory_xact_lock``, taken in the statement that looks the key
  up). On SQLite another process's transaction holds the write lock, so a retry waits for it and then finds its
  response. Should a first request of another process store the key between a retry's lookup and its insert
  anyway, the retry's work rolls back and it answers with what was stored.

Earlier versions claimed a key in a transaction of its own before the work, leaving a row with no status whose
``response`` names the process running it (:data:`IN_FLIGHT`). Such a row still answers 409 while it names this
process and is younger than :data:`STALE_AFTER_S`; otherwise it is a dead request's, and the next retry takes it over.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator

from sqlalchemy import and_, bindparam, func, literal_column, select, true, update
from sqlalchemy.engine import Connection

from tinkergym.scheduler.db import Prepared, idempotency, tenants
from tinkergym.scheduler.repository import JobStore

MAX_KEY_LENGTH = 255
#: An in-flight marker older than this belongs to a request that died; a retry may take it over.
STALE_AFTER_S = 60.0
#: The ``response`` of a key whose first request is in flight (rows of earlier versions): this prefix and the id of the process running it.
IN_FLIGHT = "in-flight:"

_SCOPE = ("tenant_id", "method", "path", "key")
_ROW = (idempotency.c.body_digest, idempotency.c.status, idempotency.c.response, idempotency.c.created_at)


def _find_key(dialect: str) -> Any:
    """The key's row; on PostgreSQL with, first, whether its advisory lock was free (the lock is then held until commit)."""
    match = [idempotency.c[name] == bindparam(name) for name in _SCOPE]
    if dialect != "postgresql":
        return select(true(), *_ROW).where(*match)
    one = select(literal_column("1").label("one")).subquery("one")
    return select(func.pg_try_advisory_xact_lock(bindparam("lock")), *_ROW).select_from(one.outerjoin(idempotency, and_(*match)))


def _insert_key(dialect: str) -> Any:
    values: dict[str, Any] = {c.key: bindparam(c.key) for c in idempotency.c}
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as insert_postgresql

        return insert_postgresql(idempotency).values(values).on_conflict_do_nothing()
    from sqlalchemy.dialects.sqlite import insert as insert_sqlite

    return insert_sqlite(idempotency).values(values).on_conflict_do_nothing()


_FIND_KEY = Prepared(_find_key)
_READ_KEY = Prepared(_find_key("any"))  # the row alone, no lock: an answer to replay
_INSERT_KEY = Prepared(_insert_key)


class IdempotencyError(Exception):
    """The key cannot be used now: ``status`` is 409 (first request in flight), 422 (other body), 400 (bad key) or 429
    (the tenant's records are at their bounds; ``retry_after`` seconds until the oldest expires)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def stored_bytes() -> Any:
    """The bytes of the stored answers of the records an aggregate query reads (JSON written ASCII: a character a byte)."""
    return func.coalesce(func.sum(func.length(idempotency.c.response)), 0)


def held_records(conn: Connection, tenant_id: str) -> tuple[int, int, float | None]:
    """The tenant's Idempotency-Key records: how many, the bytes of their stored answers, and when the oldest was made."""
    count, size, oldest = conn.execute(
        select(func.count(), stored_bytes(), func.min(idempotency.c.created_at)).where(idempotency.c.tenant_id == tenant_id)).one()
    return int(count), int(size), oldest


def check_bounds(conn: Connection, tenant_id: str, now: float, ttl_s: float | None) -> None:
    """:class:`IdempotencyError` 429 when the tenant holds its bound of records, or of their bytes, already."""
    bounds = conn.execute(select(tenants.c.max_idempotency_records, tenants.c.max_idempotency_bytes)
                          .where(tenants.c.id == tenant_id)).first()
    if bounds is None:
        return
    count, size, oldest = held_records(conn, tenant_id)
    if count < bounds[0] and size < bounds[1]:
        return
    wait = max(1, math.ceil(oldest + ttl_s - now)) if ttl_s and oldest is not None else 3600
    held = f"{count:,} records" if count >= bounds[0] else f"{size:,} bytes of stored answers"
    raise IdempotencyError(
        429, f"this tenant holds {held} under Idempotency-Keys, its bound (records: {bounds[0]:,}, bytes: {bounds[1]:,}): retry "
             f"after the oldest expires (Retry-After), send the request without an Idempotency-Key, or ask the operator "
             f"(tinkergym scheduler tenants set {tenant_id} --max-idempotency-records N --max-idempotency-mb M)", retry_after=wait)


class Refused(Exception):
    """Raised by a handler to answer ``status`` with ``payload`` without storing it: nothing was created, a retry runs again."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.payload = {"error": {"type": kind, "message": message}}


class _StoredMeanwhile(Exception):
    """Another process stored the key between this request's lookup and its insert: roll the work back."""


@dataclass
class Stored:
    """A response to send: status and JSON body; ``replayed`` when it is the first request's, sent again."""

    status: int
    body: dict[str, Any]
    replayed: bool = False


def fingerprint(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def run_once(
    store: JobStore, *, tenant_id: str, method: str, path: str, key: str | None, body: Any,
    handler: Callable[[Connection], tuple[int, dict[str, Any]]], ttl_s: float | None = None, bounded: bool = True,
) -> Stored:
    """Run ``handler(conn)`` in a transaction once per key, storing its response there; without a key, just run it.
    ``ttl_s``: how long records are kept (the ``Retry-After`` of a key refused at the tenant's bounds); ``bounded``
    False: the caller is no tenant (a worker credential, whose every heartbeat and report carries a key), and its
    records are not held to a tenant's bounds."""
    if key is None:
        try:
            with store.transaction() as conn:
                status, payload = handler(conn)
        except Refused as refused:
            return Stored(refused.status, refused.payload)
        return Stored(status, payload)
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise IdempotencyError(400, f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable characters")
    digest = fingerprint(body)
    scope = {"tenant_id": tenant_id, "method": method, "path": path, "key": key}
    with _in_flight(store, scope) as claimed:
        if not claimed:  # a request with the key runs in this process: replay a stored answer, else 409
            return _stored_answer(store, scope, digest)
        try:
            with store.transaction() as conn:
                free, row = _find(conn, scope)
                taking_over = row is not None
                if row is not None:
                    stored = _answer(row, digest, store.clock(), IN_FLIGHT + store.owner)
                    if stored is not None:
                        return stored
                elif not free:
                    raise IdempotencyError(409, "a request with this Idempotency-Key is in flight; retry after it ends")
                if bounded and not taking_over:
                    check_bounds(conn, tenant_id, store.clock(), ttl_s)
                status, payload = handler(conn)
                record = {**scope, "body_digest": digest, "status": status, "response": json.dumps(payload), "created_at": store.clock()}
                if taking_over:  # a dead request's marker (an earlier version's): this request's answer replaces it
                    where = [idempotency.c[name] == scope[name] for name in _SCOPE]
                    stored_now = conn.execute(update(idempotency).where(*where, idempotency.c.status.is_(None)).values(**record)).rowcount == 1
                else:
                    stored_now = _INSERT_KEY.run(conn, record) == 1
                if not stored_now:
                    raise _StoredMeanwhile
        except Refused as refused:
            return Stored(refused.status, refused.payload)
        except _StoredMeanwhile:
            return _stored_answer(store, scope, digest)
    return Stored(status, payload)


def _stored_answer(store: JobStore, scope: dict[str, str], digest: str) -> Stored:
    """The answer stored under the key, read without a lock; 409 when there is none yet (its first request is in flight)."""
    with store.read() as conn:
        rows = _READ_KEY.rows(conn, scope)
    row = dict(zip(("free", "body_digest", "status", "response", "created_at"), rows[0])) if rows else None
    stored = _answer(row, digest, store.clock(), IN_FLIGHT + store.owner) if row is not None else None
    if stored is None:
        raise IdempotencyError(409, "a request with this Idempotency-Key is in flight; retry after it ends")
    return stored


@contextmanager
def _in_flight(store: JobStore, scope: dict[str, str]) -> Iterator[bool]:
    """Mark the key in flight in this process while the block runs: True, or False when a request with it already is."""
    claim = tuple(scope[name] for name in _SCOPE)
    with store.keys_lock:
        if claim in store.keys_in_flight:
            claimed = False
        else:
            store.keys_in_flight.add(claim)
            claimed = True
    try:
        yield claimed
    finally:
        if claimed:
            with store.keys_lock:
                store.keys_in_flight.discard(claim)


def _find(conn: Connection, scope: dict[str, str]) -> tuple[bool, dict[str, Any] | None]:
    """(whether no other transaction holds the key, its row or None)."""
    params: dict[str, Any] = scope
    if conn.dialect.name == "postgresql":
        name = "\x00".join(scope[n] for n in _SCOPE).encode("utf-8")
        params = {**scope, "lock": int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "big", signed=True)}
    rows = _FIND_KEY.rows(conn, params)
    if not rows:
        return True, None
    free, body_digest, status, response, created_at = rows[0]
    if body_digest is None:  # PostgreSQL's outer join: no row
        return bool(free), None
    return bool(free), {"body_digest": body_digest, "status": status, "response": response, "created_at": created_at}


def _answer(row: Any, digest: str, now: float, marker: str) -> Stored | None:
    """The stored answer for an existing key row; None when it is a dead request's in-flight marker."""
    if row["body_digest"] != digest:
        raise IdempotencyError(422, "this Idempotency-Key was used with another request body; use a new key for a new request")
    if row["status"] is None:
        if now - row["created_at"] > STALE_AFTER_S or (row["response"] or "") != marker:
            return None
        raise IdempotencyError(409, "a request with this Idempotency-Key is in flight; retry after it ends")
    return Stored(int(row["status"]), json.loads(row["response"]), replayed=True)
