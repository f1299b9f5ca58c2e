"""API keys: random, shown once, stored as a SHA-256 digest, looked up by their public id, compared in constant time.

A key reads ``tgk_<id>_<secret>``: ``tgk_`` makes it recognisable (secret scanners, logs), ``<id>`` (12 hex
characters) is the row it is looked up by, and ``<secret>`` is 32 random bytes (256 bits) in URL-safe
base64. The database holds ``sha256(key)`` only; a random key of that length needs no slow password hash,
and SHA-256 keeps a lookup in microseconds at hundreds of requests per second.

Scopes: ``read`` (list and show jobs, events, checkpoints, artifacts), ``write`` (submit and cancel jobs),
``worker`` (register devices, take and renew leases, report events and checkpoints) and ``admin`` (every
scope of its tenant, plus the cluster's workers). A key belongs to one tenant and never sees another's jobs.
Keys are made only by ``tinkergym scheduler keys create`` on the scheduler's machine: there is no
registration route.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from tinkergym.scheduler.db import api_keys, reader, tenants

KEY_PREFIX = "tgk_"
SCOPES = ("read", "write", "worker", "admin")
KEY_PATTERN = re.compile(r"^tgk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
TENANT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Principal:
    """Who a request is: the key's id, its tenant and scopes."""

    key_id: str
    tenant_id: str
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_scopes(text: str) -> list[str]:
    """``"read,write"`` -> ``["read", "write"]``; unknown scopes are a :class:`ValueError`."""
    scopes = sorted({s.strip() for s in text.split(",") if s.strip()})
    unknown = [s for s in scopes if s not in SCOPES]
    if not scopes or unknown:
        raise ValueError(f"scopes {text!r}: give a comma-separated list of {', '.join(SCOPES)}")
    return scopes


def ensure_tenant(conn: Any, tenant_id: str, max_gpus: int | None = None, max_queued: int | None = None) -> None:
    """Create the tenant if it does not exist; set its quotas where given."""
    if not TENANT_PATTERN.match(tenant_id):
        raise ValueError(f"tenant {tenant_id!r}: use lowercase letters, digits, '.', '_' and '-' (at most 64)")
    exists = conn.execute(select(tenants.c.id).where(tenants.c.id == tenant_id)).first()
    if exists is None:
        conn.execute(insert(tenants).values(id=tenant_id, max_gpus=8 if max_gpus is None else max_gpus,
                                            max_queued=100 if max_queued is None else max_queued, created_at=time.time()))
        return
    quotas = {k: v for k, v in (("max_gpus", max_gpus), ("max_queued", max_queued)) if v is not None}
    if quotas:
        conn.execute(update(tenants).where(tenants.c.id == tenant_id).values(**quotas))


def create_key(engine: Engine, tenant_id: str, scopes: list[str], name: str = "") -> tuple[str, str]:
    """A new key for ``tenant_id`` (created if needed): ``(key_id, key)``. The key is returned once and never stored."""
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    with engine.begin() as conn:
        ensure_tenant(conn, tenant_id)
        conn.execute(insert(api_keys).values(
            id=key_id, tenant_id=tenant_id, digest=key_digest(key), scopes=",".join(parse_scopes(",".join(scopes))),
            name=name, created_at=time.time(), revoked_at=None,
        ))
    return key_id, key


def list_keys(engine: Engine, tenant_id: str | None = None) -> list[dict[str, Any]]:
    """Every key (or a tenant's): id, tenant, scopes, name, created and revoked times; never a digest."""
    query = select(api_keys.c.id, api_keys.c.tenant_id, api_keys.c.scopes, api_keys.c.name, api_keys.c.created_at, api_keys.c.revoked_at)
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
    with reader(engine).connect() as conn:
        row = conn.execute(select(api_keys).where(api_keys.c.id == match.group(1))).mappings().first()
    # Compare even when the row is missing, so timing does not tell which ids exist.
    expected = row["digest"] if row is not None else "0" * 64
    if not hmac.compare_digest(key_digest(key), expected) or row is None or row["revoked_at"] is not None:
        return None
    return Principal(row["id"], row["tenant_id"], frozenset(row["scopes"].split(",")))
