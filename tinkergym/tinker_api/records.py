"""The records of the Tinker API's state: tenants' sessions, training runs, samplers, checkpoints and pending requests.

:class:`~tinkergym.tinker_api.service.TinkerService` holds them and changes them; :mod:`tinkergym.tinker_api.journal`
writes them to disk and rebuilds them after a restart. They are plain data, with what the API's routes answer about
runs and checkpoints (``describe``).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tinkergym.tinker_api.engines import Saved


def utc_now() -> datetime:
    """Now, in UTC (the time of checkpoints and of runs' last requests)."""
    return datetime.now(timezone.utc)


@dataclass
class Checkpoint:
    checkpoint_id: str  # "weights/<name>", "sampler_weights/<name>" or "external_weights/<name>"
    kind: str
    saved: Saved
    time: datetime
    user_metadata: dict[str, str] | None = None

    def tinker_path(self, model_id: str) -> str:
        return f"tinker://{model_id}/{self.checkpoint_id}"

    @property
    def name(self) -> str:
        return self.checkpoint_id.split("/", 1)[1]

    def describe(self, model_id: str) -> dict[str, Any]:
        return {"checkpoint_id": self.checkpoint_id, "checkpoint_type": self.kind, "time": self.time.isoformat(),
                "tinker_path": self.tinker_path(model_id), "size_bytes": self.saved.size, "public": False, "user_metadata": self.user_metadata}


@dataclass
class Run:
    """A training run: its engine handle, checkpoints and the executor that runs its requests in order."""

    model_id: str
    tenant: str
    session_id: str
    base_model: str
    rank: int
    handle: Any
    executor: concurrent.futures.ThreadPoolExecutor
    user_metadata: dict[str, Any] | None = None
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)
    last_request: datetime = field(default_factory=utc_now)
    closed: bool = False

    def describe(self) -> dict[str, Any]:
        def last(kind: str) -> dict[str, Any] | None:
            mine = [c for c in self.checkpoints.values() if c.kind == kind]
            return max(mine, key=lambda c: c.time).describe(self.model_id) if mine else None

        return {"training_run_id": self.model_id, "base_model": self.base_model, "model_owner": self.tenant, "is_lora": True,
                "corrupted": False, "lora_rank": self.rank, "last_request_time": self.last_request.isoformat(),
                "last_checkpoint": last("training"), "last_sampler_checkpoint": last("sampler"),
                "user_metadata": {str(k): str(v) for k, v in (self.user_metadata or {}).items()} or None}


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    handle: Any


@dataclass
class Session:
    session_id: str
    tenant: str
    created: float
    last_heartbeat: float
    runs: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass
class Pending:
    """A request's future: its tenant, the operation's concurrent future, and what it answers with (JSON or protobuf)."""

    request_id: str
    tenant: str
    future: concurrent.futures.Future
    created: float = field(default_factory=time.monotonic)
