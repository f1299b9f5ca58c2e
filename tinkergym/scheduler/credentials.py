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

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from tinkergym.scheduler.db import api_keys, tenants

#: The tenant that worker credentials belong to: not a valid tenant name, so no tenant can be it.
CLUSTER = "_cluster"
DEVICE_KINDS = ("gpu", "slot")
#: Most devices one credential may be given.
MAX_DEVICES = 4096


class BoundsError(PermissionError):
    """A worker asked for more than its credential allows (HTTP 403)."""


@dataclass(frozen=True)
class WorkerBounds:
    """What a worker credential may register and serve."""

    devices: int
    kind: str | None = None
    models: tuple[str, ...] | None = None
    tenants: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or not 1 <= self.devices <= MAX_DEVICES:
            raise ValueError(f"devices {self.devices!r}: a count from 1 to {MAX_DEVICES}")
        if self.kind is not None and self.kind not in DEVICE_KINDS:
            raise ValueError(f"device kind {self.kind!r}: one of {', '.join(DEVICE_KINDS)}")
        from tinkergym.scheduler.auth import TENANT_PATTERN  # auth imports this module

        for name in self.tenants or ():
            if not TENANT_PATTERN.match(name):
                raise ValueError(f"tenant {name!r}: not a tenant name")
        if self.models is not None and not self.models:
            raise ValueError("models: name at least one, or leave it out for any model")
        if self.tenants is not None and not self.tenants:
            raise ValueError("tenants: name at least one, or leave it out to serve every tenant")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "WorkerBounds":
        data = json.loads(text)
        return cls(
            devices=int(data["devices"]), kind=data.get("kind"),
            models=tuple(data["models"]) if data.get("models") is not None else None,
            tenants=tuple(data["tenants"]) if data.get("tenants") is not None else None,
        )

    def describe(self) -> str:
        """``4 gpu, models: any, tenants: acme`` (for listings and messages)."""
        kind = self.kind or "device"
        models = ", ".join(self.models) if self.models is not None else "any"
        served = ", ".join(self.tenants) if self.tenants is not None else "all"
        return f"{self.devices} {kind}{'s' if self.devices != 1 and self.kind != 'slot' else ''}, models: {models}, tenants: {served}"

    def check_registration(self, device_list: list[dict[str, Any]], models: list[str], elsewhere: int) -> None:
        """:class:`BoundsError` unless a worker with ``device_list`` and ``models`` fits, ``elsewhere`` devices being
        registered already by the credential's other workers."""
        total = elsewhere + len(device_list)
        if total > self.devices:
            more = f" ({elsewhere} on its other workers)" if elsewhere else ""
            raise BoundsError(
                f"this worker credential may register {self.devices} device(s); this registration makes {total}{more}. "
                "Register fewer, or have the operator make a credential for more: tinkergym scheduler workers create NAME --devices N"
            )
        wrong = sorted({d["kind"] for d in device_list if self.kind is not None and d["kind"] != self.kind})
        if wrong:
            offer = "--gpus LIST" if self.kind == "gpu" else "--slots N"
            raise BoundsError(
                f"this worker credential registers {self.kind} devices only, not {', '.join(wrong)}: start the worker "
                f"with {offer}, or have the operator change the credential (tinkergym scheduler workers set ID --kind "
                f"{wrong[0]}) or make one (tinkergym scheduler workers create NAME --devices N --kind {wrong[0]})"
            )
        if self.models is not None:
            extra = sorted(set(models) - set(self.models))
            if extra:
                raise BoundsError(f"this worker credential may offer the models {', '.join(self.models)}, not {', '.join(extra[:5])}")

    def serves(self, tenant_id: str) -> bool:
        return self.tenants is None or tenant_id in self.tenants


def parse_bounds(text: str | None) -> WorkerBounds | None:
    """A key's stored bounds; None for a tenant's key (or bounds that cannot be read: such a key is no worker)."""
    if not text:
        return None
    try:
        return WorkerBounds.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None


def _digest(key: str) -> str:
    from tinkergym.scheduler.auth import key_digest

    return key_digest(key)


def _ensure_cluster(conn: Any) -> None:
    if conn.execute(select(tenants.c.id).where(tenants.c.id == CLUSTER)).first() is None:
        # The cluster's tenant holds no jobs: no GPUs, no queue.
        conn.execute(insert(tenants).values(id=CLUSTER, max_gpus=0, max_queued=0, created_at=time.time()))


def create_worker_key(engine: Engine, bounds: WorkerBounds, name: str = "") -> tuple[str, str]:
    """A new worker credential with ``bounds``: ``(key_id, key)``. The key is returned once and never stored."""
    from tinkergym.scheduler.auth import new_key

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
