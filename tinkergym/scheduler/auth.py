"""API keys: random, shown once, stored as a SHA-256 digest, looked up by their public id, compared in constant time.

A key reads ``tgk_<id>_<secret>``: ``tgk_`` makes it recognisable (secret scanners, logs), ``<id>`` (12 hex
characters) is the row it is looked up by, and ``<secret>`` is 32 random bytes (256 bits) in URL-safe
base64. The database holds ``sha256(key)`` only; a random key of that length needs no slow password hash,
and SHA-256 keeps a lookup in microseconds at hundreds of requests per second.

Scopes of a tenant's key: ``read`` (list and show jobs, events, checkpoints, artifacts), ``write`` (submit and
cancel jobs) and ``admin`` (every scope of its tenant, and the workers that serve it). A key belongs to one tenant
and never sees another's jobs, except an ``operator`` key: it reads the whole cluster (every tenant's jobs, events and
checkpoints, the workers with what they hold, every tenant's usage; ``GET /v1/cluster``) and changes nothing it does
not own, since its other scopes still act within its own tenant. ``admin`` does not imply ``operator``. The ``worker`` scope (register devices, take and renew leases, report events and
checkpoints) belongs to worker credentials only, the cluster's keys with bounds
(:mod:`tinkergym.scheduler.credentials`): ``admin`` does not imply it. Keys are made only by ``tinkergym scheduler
keys create`` (tenants) and ``tinkergym scheduler workers create`` (workers) on the scheduler's machine: there is
no registration route.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.engine import Engine

from tinkergym.scheduler.bounds import TENANT_PATTERN, WorkerBounds, parse_bounds  # noqa: F401 - TENANT_PATTERN: importable from here
from tinkergym.scheduler.db import Prepared, api_keys, autocommit_reader, reader, tenants

KEY_PREFIX = "tgk_"
SCOPES = ("read", "write", "metrics", "operator", "worker", "admin")
#: The scopes a tenant's key may hold (``worker`` is a worker credential's alone). ``metrics`` reads the cluster's
#: aggregate Prometheus metrics (``GET /metrics``: counts, no ids), for the operator's scraper. ``operator`` reads
#: every tenant's jobs and the cluster (never implied by ``admin``).
TENANT_SCOPES = ("read", "write", "metrics", "operator", "admin")
KEY_PATTERN = re.compile(r"^tgk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
#: A key's row by its id: every request's lookup (a statement prepared once, run outside any transaction).
_KEY_ROW = Prepared(select(api_keys.c.id, api_keys.c.tenant_id, api_keys.c.digest, api_keys.c.scopes, api_keys.c.revoked_at,
                           api_keys.c.worker_bounds).where(api_keys.c.id == bindparam("id")))


@dataclass(frozen=True)
class Principal:
    """Who a request is: the key's id, its tenant and scopes, and a worker credential's bounds (None for a tenant's key)."""

    key_id: str
    tenant_id: str
    scopes: frozenset[str]
    bounds: WorkerBounds | None = None

    def allows(self, scope: str) -> bool:
        if scope == "worker":  # a worker credential's alone: admin does not imply it
            return self.bounds is not None and "worker" in self.scopes
        if scope == "operator":  # the whole cluster: admin (its own tenant's everything) does not imply it
            return self.bounds is None and "operator" in self.scopes
        return scope in self.scopes or "admin" in self.scopes

    @property
    def operator(self) -> bool:
        """Whether this key reads the whole cluster (``operator`` scope)."""
        return self.allows("operator")

    def tenant_filter(self) -> str | None:
        """The tenant a read is limited to: this key's, or None (every tenant) for an operator key."""
        return None if self.operator else self.tenant_id


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_scopes(text: str) -> list[str]:
    """``"read,write"`` -> ``["read", "write"]``: a tenant key's scopes; unknown ones, and ``worker``, are a :class:`ValueError`."""
    scopes = sorted({s.strip() for s in text.split(",") if s.strip()})
    if "worker" in scopes:
        raise ValueError("the worker scope belongs to worker credentials, which only the operator makes: "
                         "tinkergym scheduler workers create NAME --devices N")
    unknown = [s for s in scopes if s not in TENANT_SCOPES]
    if not scopes or unknown:
        raise ValueError(f"scopes {text!r}: give a comma-separated list of {', '.join(TENANT_SCOPES)}")
    return scopes


def new_key() -> tuple[str, str]:
    """A fresh ``(key_id, key)``: ``tgk_<12 hex>_<43 URL-safe base64 characters>``."""
    key_id = secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def ensure_tenant(
    conn: Any, tenant_id: str, max_gpus: int | None = None, max_queued: int | None = None, *, max_artifact_bytes: int | None = None,
    max_events_per_job: int | None = None, max_event_bytes: int | None = None, keep_ended_jobs: int | None = None,
    max_idempotency_records: int | None = None, max_idempotency_bytes: int | None = None, share: float | None = None,
) -> None:
    """Create the tenant if it does not exist; set its quotas where given (new tenants: the table's defaults for the rest)."""
    if not TENANT_PATTERN.match(tenant_id):
        raise ValueError(f"tenant {tenant_id!r}: use lowercase letters, digits, '.', '_' and '-' (at most 64)")
    given = {"max_gpus": max_gpus, "max_queued": max_queued, "max_artifact_bytes": max_artifact_bytes,
             "max_events_per_job": max_events_per_job, "max_event_bytes": max_event_bytes, "keep_ended_jobs": keep_ended_jobs,
             "max_idempotency_records": max_idempotency_records, "max_idempotency_bytes": max_idempotency_bytes, "share": share}
    quotas = {k: v for k, v in given.items() if v is not None}
    exists = conn.execute(select(tenants.c.id).where(tenants.c.id == tenant_id)).first()
    if exists is None:
        conn.execute(insert(tenants).values(id=tenant_id, **{"max_gpus": 8, "max_queued": 100, **quotas}, created_at=time.time()))
        return
    if quotas:
        conn.execute(update(tenants).where(tenants.c.id == tenant_id).values(**quotas))


def create_key(engine: Engine, tenant_id: str, scopes: list[str], name: str = "") -> tuple[str, str]:
    """A new key for ``tenant_id`` (created if needed): ``(key_id, key)``. The key is returned once and never stored."""
    key_id, key = new_key()
    with engine.begin() as conn:
        ensure_tenant(conn, tenant_id)
        conn.execute(insert(api_keys).values(
            id=key_id, tenant_id=tenant_id, digest=key_digest(key), scopes=",".join(parse_scopes(",".join(scopes))),
            name=name, created_at=time.time(), revoked_at=None,
        ))
    return key_id, key


def list_keys(engine: Engine, tenant_id: str | None = None) -> list[dict[str, Any]]:
    """Every tenant's key (or one tenant's): id, tenant, scopes, name, created and revoked times; never a digest.

    Worker credentials are listed by :func:`tinkergym.scheduler.credentials.list_worker_keys`."""
    query = (select(api_keys.c.id, api_keys.c.tenant_id, api_keys.c.scopes, api_keys.c.name, api_keys.c.created_at, api_keys.c.revoked_at)
             .where(api_keys.c.worker_bounds.is_(None)))
    if tenant_id is not None:
        query = query.where(api_keys.c.tenant_id == tenant_id)
    with reader(engine).connect() as conn:
        return [dict(r) for r in conn.execute(query.order_by(api_keys.c.created_at)).mappings()]


def revoke_key(engine: Engine, key_id: str) -> bool:
    """Revoke a key at once (its next request is 401); False when there is no such unrevoked key."""
    with engine.begin() as conn:
        result = conn.execute(
            update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None)).values(revoked_at=time.time())
        )
    return result.rowcount == 1


def authenticate(engine: Engine, key: str) -> Principal | None:
    """The principal of a valid, unrevoked key; None for anything else (malformed, unknown, revoked, wrong secret)."""
    match = KEY_PATTERN.match(key or "")
    if match is None:
        return None
    with autocommit_reader(engine).connect() as conn:
        rows = _KEY_ROW.rows(conn, {"id": match.group(1)})
    return _principal(key, rows)


def _principal(key: str, rows: list[tuple]) -> Principal | None:
    key_id, tenant_id, expected, scopes, revoked_at, bounds = rows[0] if rows else (None, None, "0" * 64, "", None, None)
    # Compare even when the row is missing, so timing does not tell which ids exist.
    if not hmac.compare_digest(key_digest(key), expected) or key_id is None or revoked_at is not None:
        return None
    return Principal(key_id, tenant_id, frozenset(scopes.split(",")), parse_bounds(bounds))


class KeyLookup:
    """:func:`authenticate` for the auth middleware, from the event loop: no worker thread per request.

    Every request still reads its key's row (a revoked key is refused at once: nothing is cached), on a
    connection of the lookup's own:

    - SQLite (a file): read-only, read from the event loop's thread itself with a busy timeout of 0. A WAL
      reader takes no lock a writer holds, so this never waits; should SQLite be busy all the same, the lookup
      goes to a worker thread (:func:`authenticate`) instead of waiting in the loop.
    - PostgreSQL: a psycopg ``AsyncConnection`` in autocommit mode (the loop serves other requests while the
      server answers); on any error the connection is dropped and this request's lookup goes to a worker thread.

    :meth:`aclose` closes the connection (the middleware calls it when the app shuts down).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._connection: Any = None
        self._loop: Any = None
        self._opening: Any = None
        self._sql = _KEY_ROW.sql(engine.dialect)[0]
        self._sqlite_path: str | None = None
        self._conninfo: str | None = None
        if engine.dialect.name == "sqlite":
            path = engine.url.database
            self._sqlite_path = path if path and path != ":memory:" and not path.startswith("file:") else None
        elif engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg":
            self._conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def principal(self, key: str) -> Principal | None:
        """The key's principal; None for anything but a valid, unrevoked key."""
        match = KEY_PATTERN.match(key or "")
        if match is None:
            return None
        params = {"id": match.group(1)}
        rows: list[tuple] | None = None
        try:
            if self._sqlite_path is not None:
                rows = self._sqlite_rows(params)
            elif self._conninfo is not None:
                rows = await self._postgres_rows(self._conninfo, params)
        except Exception:  # noqa: BLE001 - busy, locked, disconnected: the worker thread's lookup waits, retries and reports
            await self.aclose()
            rows = None
        if rows is None:
            from starlette.concurrency import run_in_threadpool

            return await run_in_threadpool(authenticate, self.engine, key)
        return _principal(key, rows)

    def _sqlite_rows(self, params: dict[str, str]) -> list[tuple]:
        if self._connection is None:
            import sqlite3
            from urllib.parse import quote

            self._connection = sqlite3.connect(f"file:{quote(self._sqlite_path or '')}?mode=ro", uri=True, timeout=0,
                                               isolation_level=None, check_same_thread=False)
        return self._connection.execute(self._sql, params).fetchall()

    async def _postgres_rows(self, conninfo: str, params: dict[str, str]) -> list[tuple]:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._connection is not None and self._loop is not loop:  # made on another event loop (tests): not usable here
            self._connection = None
        if self._connection is None:
            if self._opening is None or self._loop is not loop:
                import psycopg

                self._loop = loop
                self._opening = loop.create_task(psycopg.AsyncConnection.connect(conninfo, autocommit=True))
            opening = self._opening
            try:
                connection = await asyncio.shield(opening)
            finally:
                if self._opening is opening and opening.done():
                    self._opening = None
            if self._connection is None:
                self._connection = connection
            elif self._connection is not connection:
                await connection.close()
        cursor = self._connection.cursor()
        async with cursor:
            await cursor.execute(self._sql, params)
            return await cursor.fetchall()

    async def aclose(self) -> None:
        """Close the lookup's connection (a later lookup opens another)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            result = connection.close()
            if hasattr(result, "__await__"):
                await result
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass
