"""The torch engine: TorchBackend (sampling, scoring, training, states) on CPU or CUDA."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from tinkergym.errors import ConfigError


def build(request: Any) -> Any:
    """The ``torch`` backend plugin: a :class:`~tinkergym.backends.torch.backend.TorchBackend` with the run's model settings."""
    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    c = request.config
    return TorchBackend(
        TorchBackendConfig(
            model=resolve_model(c.model), lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
            dtype=c.dtype, micro_batch_size=c.micro_batch_size, seed=c.seed, deterministic=c.deterministic,
            gradient_checkpointing=c.gradient_checkpointing, prefix_cache_mb=c.prefix_cache_mb, lora_sampling=c.lora_sampling,
        )
    )


#: The shared bases of this process by their settings: every ``shared`` backend of one model is a session of one base.
_BASES: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()
_BASES_LOCK = threading.Lock()


def build_shared(request: Any) -> Any:
    """The ``shared`` backend plugin: a LoRA session of this process's shared base of the run's model
    (:class:`~tinkergym.backends.torch.lora_session.LoraSession`). Every ``shared`` backend built in one process with
    the same model settings is an adapter of the same base: one copy of the model for a self-play run's
    ``seat_policies=separate``, whose policies train in one mixed pass (and, moving in the same round, sample in one
    decode loop)."""
    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig

    c = request.config
    if c.lora_rank < 1:
        raise ConfigError("--backend shared holds LoRA adapters on one base model: give --lora-rank above 0 (full fine-tuning: --backend torch)")
    lacking = [name for name, on in (("--lora-dropout", c.lora_dropout), ("--gradient-checkpointing", c.gradient_checkpointing),
                                     ("--deterministic", c.deterministic)) if on]
    if lacking:
        raise ConfigError(f"--backend shared has no {', '.join(lacking)} (a shared base's passes serve every adapter): leave "
                          f"{'them' if len(lacking) > 1 else 'it'} out or train with --backend torch")
    if c.scheduler_url or c.backend_url or c.sampler != "torch":
        raise ConfigError("--backend shared trains on this machine with its own sampler: leave out --scheduler, --backend-url and --sampler")
    key = (resolve_model(c.model), c.dtype, c.micro_batch_size, c.prefix_cache_mb)
    with _BASES_LOCK:
        base = _BASES.get(key)
        if base is None:
            base = SharedBase(SharedBaseConfig(model=key[0], dtype=c.dtype, micro_batch_size=c.micro_batch_size, max_lora_rank=max(64, c.lora_rank),
                                               prefix_cache_mb=c.prefix_cache_mb))
            _BASES[key] = base
    return base.open_session(LoraSessionConfig(lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, seed=c.seed))
