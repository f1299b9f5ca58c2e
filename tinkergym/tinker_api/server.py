"""The Tinker API apps of ``tinkergym serve tinker``: on a shared base here, or in front of a scheduler; both authenticated with the
scheduler's tenant keys."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tinkergym.serve.training.shared import SharedWorker
from tinkergym.tinker_api.app import create_tinker_app
from tinkergym.tinker_api.engines import LocalEngine
from tinkergym.tinker_api.service import Limits, TinkerService


def tenant_of(engine: Any) -> Any:
    """``authenticate(key) -> tenant`` on the scheduler's key table: a valid, unrevoked key with the ``write`` scope."""
    from tinkergym.scheduler.auth import authenticate

    def tenant(key: str) -> str | None:
        principal = authenticate(engine, key)
        return principal.tenant_id if principal is not None and principal.allows("write") else None

    return tenant


def create_server(base: Any, root: Path, engine: Any, logger: logging.Logger, *, model_name: str, tokenizer_id: str | None = None,
                  max_lora_rank: int = 64, gather_ms: float = 2.0, sample_gather_ms: float = 50.0, pass_tokens: int = 65536, **limits: Any) -> Any:
    """The app of ``serve tinker``: ``base`` (a :class:`~tinkergym.backends.torch.shared.SharedBase`) serves every tenant's runs;
    ``pass_tokens`` bounds a round of calls (a larger call is worked in slices: see :class:`SharedWorker`)."""
    worker = SharedWorker(base, logger, keep_states=0, pass_tokens=pass_tokens, gather_s=gather_ms / 1000.0, max_waiting=64,
                          read_gather_s=sample_gather_ms / 1000.0)
    local = LocalEngine(base, worker, root, model_name, tokenizer_id or str(base.model_path), max_lora_rank)
    service = TinkerService(local, logger, limits=Limits(**limits))
    return create_tinker_app(service, tenant_of(engine), logger)


def create_front_door(scheduler_url: str, offers: dict[str, str], root: Path, engine: Any, logger: logging.Logger, *, max_lora_rank: int = 64,
                      checkpoint_every: int = 8, dtype: str = "auto", **limits: Any) -> Any:
    """The app of ``serve tinker --scheduler``: every run and sampler a job of the scheduler at ``scheduler_url`` (its key table: ``engine``).
    Its sessions, runs, samplers and checkpoints are kept in ``root/front_door.sqlite``: an app made on the same ``root`` starts
    with them (:mod:`tinkergym.tinker_api.journal`)."""
    import json

    from tinkergym.tinker_api.cluster import ClusterEngine
    from tinkergym.tinker_api.journal import FILE as JOURNAL_FILE
    from tinkergym.tinker_api.journal import Journal

    def say(line: str) -> None:
        logger.info(json.dumps({"event": "tinker_cluster", "message": line}))

    cluster = ClusterEngine(scheduler_url, offers, root, max_lora_rank=max_lora_rank, checkpoint_every=checkpoint_every, dtype=dtype, say=say)
    service = TinkerService(cluster, logger, limits=Limits(**limits), journal=Journal(root / JOURNAL_FILE))
    return create_tinker_app(service, tenant_of(engine), logger)
