"""Whether a training job fits the memory of a worker's devices, before any lease.

A worker may register each device's memory (``memory_gb``) and, for each model it offers, the model's shape
(:func:`tinkergym.backends.torch.sizing.shape_dict`, counted once at the worker's start). From those the scheduler
prices what a ``train`` or ``sft`` job keeps on each of its devices whatever its batches (weights, gradients, AdamW's
moments; FSDP2's gathered layer and whole-model load for a job on several devices:
:func:`~tinkergym.backends.torch.sizing.static_estimate`, the figure ``serve backend`` checks at its start too). A job
that needs more than ``HEADROOM`` of a worker's smallest device is not hosted there: placement says why it waits
(``too_little_memory``, with the figures and what to change) and no lease sends it there. A worker that sent no memory
or no shape for the model is not checked (its server checks at its start).

A seat is placed by what its shared server measured (:func:`seat_refusal`, kept by :mod:`tinkergym.scheduler.measured`):
the larger of the server's peak and its memory now plus the job's activations, plus what the job keeps priced by
:func:`tinkergym.backends.torch.sizing.seat_estimate` times the model's learned factor (:func:`learned_factor`), within
``HEADROOM`` of the device; a job that fits a free seat by the rule but not so waits with ``memory_held``. Torch-free.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from tinkergym.config import DEFAULT_LORA_RANK, DEFAULT_MICRO_BATCH_SIZE
from tinkergym.errors import ConfigError
from tinkergym.scheduler.seats import config_of, players

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


# ----- seats: placed by the memory their shared server measures --------------------------------------------------
#: Tokens a seat job's sequences are priced at beyond its turns' new tokens (its prompt and observations), within max_context.
PROMPT_ALLOWANCE = 512
#: The learned factor stays within these (one odd measure cannot make a seat free or unplaceable for good).
FACTOR_BOUNDS = (0.5, 16.0)
#: The learned factor is the mean of up to this many measures, then moves by 1/FACTOR_WINDOW of each new one.
FACTOR_WINDOW = 20


@dataclass(frozen=True)
class SharedMemory:
    """A shared server's device as its last heartbeat measured it (bytes; None: not measured yet, or not said)."""

    total: int | None
    used: int | None
    peak: int | None
    base: int | None = None

    @property
    def measured(self) -> bool:
        return self.total is not None and self.used is not None


def seat_parts(config: Any, shape: dict[str, Any] | None, device_kind: str) -> tuple[int, int] | None:
    """``(kept, activations)`` bytes of a seat job of ``config`` (:func:`tinkergym.backends.torch.sizing.seat_estimate`);
    None when it cannot be priced (no shape, a config it cannot read)."""
    found = config_of(config)
    if shape is None or found is None:
        return None
    rank, dtype = found.get("lora_rank", DEFAULT_LORA_RANK), found.get("dtype", "auto")
    micro, turns, new, context = (found.get(k, d) for k, d in (("micro_batch_size", DEFAULT_MICRO_BATCH_SIZE), ("max_turns", 4),
                                                               ("max_new_tokens", 64), ("max_context", 2048)))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rank, micro, turns, new, context)) or not isinstance(dtype, str):
        return None
    return _seat_parts(json.dumps(shape, sort_keys=True), rank, dtype, "cuda" if device_kind == "gpu" else "cpu", micro,
                       min(context, PROMPT_ALLOWANCE + turns * new))


@functools.lru_cache(maxsize=1024)
def _seat_parts(shape_json: str, rank: int, dtype: str, device: str, micro: int, length: int) -> tuple[int, int] | None:
    from tinkergym.backends.torch.sizing import seat_estimate

    try:
        return seat_estimate(json.loads(shape_json), lora_rank=rank, dtype=dtype, device=device, micro_batch_size=micro, max_seq_len=length)
    except (ConfigError, TypeError, ValueError, KeyError):
        return None


def seat_refusal(config: Any, shape: dict[str, Any] | None, device: SharedMemory, factor: float, device_kind: str, where: str = "") -> str | None:
    """Why a seat job of ``config`` does not fit its shared server's device now, with the figures; None when it fits or
    cannot be checked (no measure yet, no size, no shape).

    The job needs what it keeps (priced, times ``factor``: what such jobs really kept, learned from the measures) on
    top of the larger of the server's measured peak and what it uses now plus the job's own activations (a shared
    server's passes hold one micro-batch's at a time); all of it within ``HEADROOM`` of the device."""
    parts = seat_parts(config, shape, device_kind)
    if parts is None or not device.measured:
        return None
    assert device.total is not None and device.used is not None
    kept, activations = parts
    count = players(config)  # a league keeps an adapter a player; its passes hold one micro-batch at a time
    kept *= count
    need = int(kept * factor)
    peak = max(device.peak or 0, device.used)
    projected = max(peak, device.used + activations) + need
    usable = int(device.total * HEADROOM)
    if projected <= usable:
        return None
    return (f"the shared server{where} uses {_gib(device.used)} now and {_gib(peak)} at its peak of the {_gib(usable)} a job may plan on "
            f"({HEADROOM:.0%} of {_gib(device.total)}); this job keeps about {_gib(need)} there "
            f"({'adapter' if count == 1 else f'{count} adapters'}, gradients and AdamW's moments "
            f"{_gib(kept)} x {factor:.2f}, learned from what seats measured) and passes {_gib(activations)} of activations: "
            f"it starts when a seat's job ends and frees its memory, or ask for a lower lora_rank or micro_batch_size")


def learned_factor(factor: float, samples: int, observed: int, priced: int) -> tuple[float, int] | None:
    """The factor and count after one measure: the server's growth since its base alone (``observed``) over what its
    seats' jobs were priced to keep (``priced``); None when the measure says nothing (nothing priced or grown)."""
    if priced <= 0 or observed <= 0:
        return None
    ratio = min(max(observed / priced, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])
    weight = min(samples, FACTOR_WINDOW - 1)
    return (factor * weight + ratio) / (weight + 1), samples + 1


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"
