"""Whether a training job fits the memory of a worker's devices, before any lease.

A worker may register each device's memory (``memory_gb``) and, for each model it offers, the model's shape
(:func:`tinkergym.backends.torch.sizing.shape_dict`, counted once at the worker's start). From those the scheduler
prices what a ``train`` or ``sft`` job keeps on each of its devices whatever its batches (weights, gradients, AdamW's
moments; FSDP2's gathered layer and whole-model load for a job on several devices:
:func:`~tinkergym.backends.torch.sizing.static_estimate`, the figure ``serve backend`` checks at its start too). A job
that needs more than ``HEADROOM`` of a worker's smallest device is not hosted there: placement says why it waits
(``too_little_memory``, with the figures and what to change) and no lease sends it there. A worker that sent no memory
or no shape for the model is not checked (its server checks at its start). Torch-free.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tinkergym.config import DEFAULT_LORA_RANK
from tinkergym.errors import ConfigError

#: Job kinds whose server trains (and so holds gradients and optimizer state).
TRAINING_KINDS = ("train", "sft")
#: The share of a device's memory a job may plan on (the rest: the CUDA context, the allocator's reserve).
HEADROOM = 0.9


def parse_shapes(text: str | None) -> dict[str, Any] | None:
    """A worker's ``model_shapes`` column as a dict (None for none, or for text that is not a JSON object)."""
    try:
        shapes = json.loads(text) if text else None
    except ValueError:
        return None
    return shapes if isinstance(shapes, dict) else None


def smallest(memories: list[int | None]) -> int | None:
    """The memory (bytes) of a worker's smallest whole device; None when any of them did not say (nothing is checked)."""
    if not memories or any(m is None for m in memories):
        return None
    return min(m for m in memories if m is not None)


def refusal(kind: str, gpus: int, config: Any, shape: dict[str, Any] | None, device_bytes: int | None, device_kind: str) -> str | None:
    """Why a ``kind`` job of ``config`` on ``gpus`` devices of ``device_bytes`` each cannot fit (the figures and what to
    change); None when it fits or cannot be checked (not a training job, no shape, no memory, a config it cannot read)."""
    if kind not in TRAINING_KINDS or shape is None or device_bytes is None:
        return None
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    if not isinstance(config, dict):
        return None
    rank, dtype, checkpointing = config.get("lora_rank", DEFAULT_LORA_RANK), config.get("dtype", "auto"), config.get("gradient_checkpointing") is True
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0 or not isinstance(dtype, str):
        return None  # the worker refuses the config itself, with its own message
    return _refusal(json.dumps(shape, sort_keys=True), rank, dtype, checkpointing, gpus, device_bytes, "cuda" if device_kind == "gpu" else "cpu")


@functools.lru_cache(maxsize=1024)
def _refusal(shape_json: str, rank: int, dtype: str, checkpointing: bool, ranks: int, device_bytes: int, device: str) -> str | None:
    from tinkergym.backends.torch.sizing import check_fits, static_estimate

    try:
        estimate = static_estimate(json.loads(shape_json), lora_rank=rank, dtype=dtype, ranks=ranks, device=device,
                                   gradient_checkpointing=checkpointing)
        check_fits(estimate, device_bytes, HEADROOM)
    except ConfigError as exc:
        return str(exc)
    except (TypeError, ValueError, KeyError):
        return None  # a dtype or shape it cannot price: not checked here
    return None
