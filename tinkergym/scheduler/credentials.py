"""Worker credentials: the cluster's keys for its workers, made only by the operator, each with its bounds.

A worker is a principal of the cluster, not of a tenant (as a Kubernetes node is): a tenant's key, ``admin``
included, never registers a worker or takes a lease. ``tinkergym scheduler workers create`` on the scheduler's
machine makes a worker credential, an API key (``tgk_...``, stored hashed like every key) of the reserved tenant
:data:`CLUSTER` with the ``worker`` scope only and its bounds (:class:`WorkerBounds`):

- ``devices``: how many devices the credential may register, across all the workers registered with it (a
  credential for 4 GPUs cannot register 64, nor 4 workers of 4 each);
- ``kind``: the kind of device it registers (``gpu`` or ``slot``; None: either);
- ``models``: the models its workers may offer (None: any);
- ``tenants``: the tenants whose jobs its workers run (a tenant's own pool); None: every tenant's.

A registration beyond these bounds is refused (403, naming the bound); a lease is granted only within them (the
grant reads only the queues of the credential's tenants). The bounds are stored with the key
(``api_keys.worker_bounds``, JSON) and read with it on every request, so a change applies at the next call.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from tinkergym.scheduler.auth import key_digest, new_key
from tinkergym.scheduler.bounds import CLUSTER, WorkerBounds, parse_bounds
from tinkergym.scheduler.db import api_keys, tenants

def _digest(key: str) -> str:
    return key_digest(key)


def _ensure_cluster(conn: Any) -> None:
    if conn.execute(select(tenants.c.id).where(tenants.c.id == CLUSTER)).first() is None:
        # The cluster's tenant holds no jobs: no GPUs, no queue.
        conn.execute(insert(tenants).values(id=CLUSTER, max_gpus=0, max_queued=0, created_at=time.time()))


def create_worker_key(engine: Engine, bounds: WorkerBounds, name: str = "") -> tuple[str, str]:
    """A new worker credential with ``bounds``: ``(key_id, key)``. The key is returned once and never stored."""

    key_id, key = new_key()
    with engine.begin() as conn:
        _ensure_cluster(conn)
        conn.execute(insert(api_keys).values(
            id=key_id, tenant_id=CLUSTER, digest=_digest(key), scopes="worker", name=name, created_at=time.time(),
            revoked_at=None, worker_bounds=bounds.to_json(),
        ))
    return key_id, key


def list_worker_keys(engine: Engine) -> list[dict[str, Any]]:
    """Every worker credential: id, name, bounds, created and revoked times; never a digest."""
    query = (select(api_keys.c.id, api_keys.c.name, api_keys.c.worker_bounds, api_keys.c.created_at, api_keys.c.revoked_at)
             .where(api_keys.c.worker_bounds.is_not(None)).order_by(api_keys.c.created_at))
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(query).mappings()]
    for row in rows:
        row["bounds"] = parse_bounds(row.pop("worker_bounds"))
    return rows


def set_worker_bounds(engine: Engine, key_id: str, bounds: WorkerBounds) -> bool:
    """Replace a worker credential's bounds (its workers' next calls see them); False when there is no such credential."""
    with engine.begin() as conn:
        result = conn.execute(update(api_keys).where(api_keys.c.id == key_id, api_keys.c.worker_bounds.is_not(None))
                              .values(worker_bounds=bounds.to_json()))
    return result.rowcount == 1
