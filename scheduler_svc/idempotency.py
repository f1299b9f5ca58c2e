"""``Idempotency-Key`` on POST requests, with the IETF draft's semantics (draft-ietf-httpapi-idempotency-key-header).

A key is scoped by tenant, method and path and fingerprinted by the request body (its canonical JSON):

- the first request with a key runs; its response is stored **in the same transaction as what it creates**,
  so an acknowledged job always has its key and a key never points at nothing;
- a retry with the same key and body gets the stored response again (same status, same body), and
  creates nothing;
- the same key with another body is 422;
- a request refused without effect (a quota, :class:`Refused`) is not stored: a retry runs again;
- a retry while the first is still running is 409 (the first request marks the key in flight in a
  transaction of its own before it runs, naming the scheduler process that runs it; a marker of another
  process (one that was killed and restarted: the scheduler runs as one process per database) or older
  than :data:`STALE_AFTER_S` is a dead request's, and the next retry takes it over).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection

from tinkergym.scheduler.db import idempotency
from tinkergym.scheduler.repository import JobStore

MAX_KEY_LENGTH = 255
#: An in-flight marker older than this belongs to a request that died; a retry may take it over.
STALE_AFTER_S = 60.0
#: The ``response`` of a key whose first request is in flight: this prefix and the id of the process running it.
IN_FLIGHT = "in-flight:"


class IdempotencyError(Exception):
    """The key cannot be used now: ``status`` is 409 (first request in flight), 422 (other body) or 400 (bad key)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Refused(Exception):
    """Raised by a handler to answer ``status`` with ``payload`` without storing it: nothing was created, a retry runs again."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.payload = {"error": {"type": kind, "message": message}}


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
    handler: Callable[[Connection], tuple[int, dict[str, Any]]],
) -> Stored:
    """Run ``handler(conn)`` in a transaction once per key; without a key, just run it."""
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
    where = (idempotency.c.tenant_id == tenant_id, idempotency.c.method == method, idempotency.c.path == path, idempotency.c.key == key)
    # 1. Claim the key (its own transaction), or answer from what is there.
    marker = IN_FLIGHT + store.owner
    claim = {"tenant_id": tenant_id, "method": method, "path": path, "key": key, "body_digest": digest, "status": None, "response": marker}
    with store.transaction() as conn:
        # The common case, a new key, is one statement: an insert that does nothing when the key exists.
        if conn.execute(_insert_new(conn).values(**claim, created_at=store.clock()).returning(idempotency.c.key)).first() is None:
            row = conn.execute(select(idempotency).where(*where)).mappings().first()
            if row is None:  # the claim in the way was removed meanwhile (its work failed): the caller retries
                raise IdempotencyError(409, f"a request with Idempotency-Key {key!r} is in flight; retry after it ends")
            stored = _answer(row, digest, store.clock(), marker)
            if stored is not None:
                return stored
            # A stale marker (a request that died): take it over.
            conn.execute(update(idempotency).where(*where).values(body_digest=digest, response=marker, created_at=store.clock()))
    # 2. Do the work and store its response in one transaction.
    try:
        with store.transaction() as conn:
            status, payload = handler(conn)
            conn.execute(update(idempotency).where(*where).values(status=status, response=json.dumps(payload)))
    except BaseException as exc:
        with store.transaction() as conn:  # the work rolled back: free the key for a retry
            conn.execute(delete(idempotency).where(*where, idempotency.c.status.is_(None)))
        if isinstance(exc, Refused):
            return Stored(exc.status, exc.payload)
        raise
    return Stored(status, payload)


def _insert_new(conn: Connection) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` into the keys table, in the connection's dialect."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    return dialect_insert(idempotency).on_conflict_do_nothing()


def _answer(row: Any, digest: str, now: float, marker: str) -> Stored | None:
    """The stored answer for an existing key row; None when it is a dead request's in-flight marker."""
    if row["body_digest"] != digest:
        raise IdempotencyError(422, "this Idempotency-Key was used with another request body; use a new key for a new request")
    if row["status"] is None:
        if now - row["created_at"] > STALE_AFTER_S or (row["response"] or "") != marker:
            return None
        raise IdempotencyError(409, "a request with this Idempotency-Key is in flight; retry after it ends")
    return Stored(int(row["status"]), json.loads(row["response"]), replayed=True)
