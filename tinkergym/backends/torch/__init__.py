"""The torch engine: TorchBackend (sampling, scoring, training, states) on CPU or CUDA."""

from __future__ import annotations

from typing import Any


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
