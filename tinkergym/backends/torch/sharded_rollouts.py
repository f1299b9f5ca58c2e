"""Data-parallel sampling for a sharded job: each rank decodes its share of a request's prompts on a whole copy of the
model, and the ranks gather the samples (:class:`~tinkergym.backends.torch.sharded.ShardedTorchBackend`).

A sharded model decodes only in lockstep: every forward gathers each layer's weights from all ranks, so every rank must
run the same passes, and each rank would decode the whole request (an N-device job sampling at one device's speed).
Here each rank keeps a **replica**: the model whole, in the compute dtype, on its own device, outside FSDP. With LoRA the
frozen base is loaded once and only the adapter (kept whole on every rank anyway) is copied in after each update; in full
fine-tuning the trained weights are gathered whole (``DTensor.full_tensor``, one collective a weight) once per step, at
the first sample after it. The replica then decodes alone, as a plain :class:`~tinkergym.backends.torch.backend.TorchBackend`
does, so ranks may run different numbers of decode steps.

What a rank samples: :func:`split_prompts` gives each rank whole groups of copies of one prompt (a GRPO group stays on
one rank and shares its prefix), the costliest first to the least loaded rank. Each sample draws from its own seed
(:mod:`tinkergym.protocol.seeds`, computed from the whole request), so the samples are the same at any number of ranks,
one included. An unseeded request takes a seed from rank 0's global generator (saved with the state like any draw).

The replica costs one model's weights in the compute dtype on every device: :func:`replica_fits` checks the room before
it is built, and a model too big for it samples in lockstep on the sharded model instead (the same samples, at one
device's speed), saying so once in the log and in ``info()["rollouts"]``. Tensor-parallel decoding of such a model is
not built.

With vLLM (``rollouts="vllm"``, :func:`tinkergym.backends.vllm.ranks.sharded_with_vllm`), an engine beside each rank
takes the replica's place (:class:`~tinkergym.backends.vllm.ranks.RankEngine`): a vLLM engine on the rank's device (in the
rank's process), which decodes the rank's share with each completion's own seed, sleeps during
the training passes where vLLM has sleep mode, and is synced at the first sample after an update: the adapter, which
the rank holds whole, written to the rank's own folder and loaded as a new adapter; full weights gathered whole, one
at a time as the engine reads them (or, where the engine reloads from files, written to the rank's own folder).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tinkergym.protocol.seeds import prompt_groups

log = logging.getLogger("tinkergym.sharded")

#: How a sharded backend samples: ``auto`` splits each request across the ranks when a replica fits on every device,
#: ``split`` always does, ``lockstep`` never does (every rank decodes the whole request on the sharded model), ``vllm``
#: splits it across engines, one beside each rank (:mod:`tinkergym.backends.vllm.ranks`).
ROLLOUT_MODES = ("auto", "split", "lockstep", "vllm")

#: Room a replica needs beyond its weights, as a fraction of them: the decode's key-value cache and logits.
REPLICA_HEADROOM = 0.25


def split_prompts(prompts: Sequence[Sequence[int]], images: Sequence[Sequence[object]], num_samples: int, max_new_tokens: int,
                  world: int) -> list[list[int]]:
    """The prompt indices each of ``world`` ranks samples, in request order: whole groups of copies of one prompt, the
    costliest first (a group's prompt once, plus its samples' new tokens), each to the rank with the least so far (the
    lowest rank on a tie). A rank may get none."""
    groups = prompt_groups(prompts, images)
    costs = [len(prompts[g[0]]) + len(g) * num_samples * max(max_new_tokens, 1) for g in groups]
    load = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for g in sorted(range(len(groups)), key=lambda g: -costs[g]):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].extend(groups[g])
        load[rank] += costs[g]
    return [sorted(share) for share in shares]


def replica_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``model``'s weights whole in ``dtype`` (a sharded weight counts its global shape)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * size


def replica_fits(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a replica of ``model`` in ``dtype`` fits in what ``device`` has free now (host memory for a CPU), with
    :data:`REPLICA_HEADROOM` to spare. Every rank asks; the answer that counts is every rank's (see the backend)."""
    need = replica_bytes(model, dtype) * (1 + REPLICA_HEADROOM)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # held by torch's allocator, unused
        return need <= free + cached
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        return need <= int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return True  # no way to tell: try (a failed allocation says so)


def copy_weights(source: torch.nn.Module, replica: torch.nn.Module, trained_only: bool) -> None:
    """Copy ``source``'s weights (sharded ones gathered whole: a collective, every rank calls it in the same order) into
    the replica's weights of the same names; with ``trained_only`` the weights that train, alone."""
    from torch.distributed.tensor import DTensor

    target = dict(replica.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            if trained_only and not param.requires_grad:
                continue
            if name not in target:
                raise RuntimeError(f"the sampling replica has no weight {name}: it was not built as the trained model")
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            target[name].copy_(whole)

