"""What a worker credential may do (:class:`WorkerBounds`), and the names of the principals: tenants and the cluster.

Plain data with no database: the key lookup (:mod:`tinkergym.scheduler.auth`) reads a key's bounds with
:func:`parse_bounds`, the operator's commands (:mod:`tinkergym.scheduler.credentials`) store them.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

#: A tenant's name: lower-case letters, digits, ``.``, ``_`` and ``-``, at most 64, starting with a letter or digit.
TENANT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
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
    def from_json(cls, text: str) -> WorkerBounds:
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
        held already by the credential (its other workers', and this worker's unlisted ones that jobs still hold)."""
        total = elsewhere + len(device_list)
        if total > self.devices:
            more = f" ({elsewhere} on its other workers or still held by jobs)" if elsewhere else ""
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

    def offered(self, models_json: str) -> set[str]:
        """The models a worker offers (its row's ``models``, JSON) within this credential's."""
        models = set(json.loads(models_json))
        return models & set(self.models) if self.models is not None else models


def parse_bounds(text: str | None) -> WorkerBounds | None:
    """A key's stored bounds; None for a tenant's key (or bounds that cannot be read: such a key is no worker)."""
    if not text:
        return None
    try:
        return WorkerBounds.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None
