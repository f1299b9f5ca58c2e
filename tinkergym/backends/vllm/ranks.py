"""vLLM engines beside the ranks of a sharded job: :func:`sharded_with_vllm` builds a
:class:`~tinkergym.backends.torch.sharded.ShardedTorchBackend` whose ranks each sample their share of a request on a
:class:`RankEngine` (see :mod:`tinkergym.backends.torch.sharded_rollouts`).

Each engine runs in its rank's process on its rank's device, is synced at the first sample after an update (the
adapter, which every rank holds whole, written to the rank's own folder and loaded as a new adapter; full weights
gathered whole, one at a time as the engine reads them, or written to the rank's own folder where the engine reloads
from files), and sleeps during training passes where vLLM has sleep mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tinkergym.backends.torch.backend import TorchBackendConfig
from tinkergym.backends.torch.sharded import ShardedTorchBackend
from tinkergym.errors import ConfigError
from tinkergym.protocol.types import SampledSequence, SampleRequest


def sharded_with_vllm(config: TorchBackendConfig | None = None, **settings: Any) -> ShardedTorchBackend:
    """A sharded backend (call it on every rank, as :class:`ShardedTorchBackend`) whose ranks sample on vLLM engines beside
    them; ``settings``: fields of :class:`~tinkergym.backends.vllm.engine.VLLMSamplerConfig` other than the model, device,
    dtype and LoRA rank, which are the job's."""
    return ShardedTorchBackend(config, rollouts="vllm", engine=lambda backend: RankEngine(backend, settings))


class RankWeights:
    """What a :class:`~tinkergym.backends.vllm.sampler.VLLMSampler` syncs from (``info``, ``export``, ``model``), for the
    engine beside one rank of a sharded job: the rank's own adapter (kept whole on every rank), or the model's weights
    gathered whole (a collective: every rank syncs at once, as every rank samples at once)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def info(self) -> dict[str, Any]:
        return self.backend.info()

    @property
    def model(self) -> Any:
        """For an in-memory sync of full weights: their names and whole tensors, gathered one at a time as the engine reads
        them (None with LoRA, whose engine loads the adapter as an adapter)."""
        return None if self.backend.is_lora else GatheredWeights(self.backend.model, self.backend.dtype)

    def export(self, folder: str, merged: bool = False) -> None:
        """This rank's own copy of the weights in ``folder``: the adapter as a peft folder, or the whole model (gathered on
        every rank) as a transformers folder."""
        if self.backend.is_lora:
            if merged:
                raise ConfigError("a LoRA job's engines beside its ranks load the adapter as an adapter: give them lora_rank >= the job's")
            self.backend.export_adapter_here(folder)
        else:
            self.backend.export_here(folder)


class GatheredWeights:
    """A sharded model's ``state_dict`` as an engine reads it: each weight gathered whole when its turn comes, in ``dtype``."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype

    def state_dict(self) -> GatheredWeights:
        return self

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        for name, tensor in self.model.state_dict().items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, whole.detach().to(self.dtype)


class RankEngine:
    """A vLLM engine on this rank's device, beside its shards: samples the rank's share of each request, synced from the
    trained weights at the first sample after an update, asleep during training passes where vLLM has sleep mode."""

    def __init__(self, backend: Any, settings: dict[str, Any]) -> None:
        from tinkergym.backends.vllm.sampler import VLLMSampler

        info = backend.info()
        device = backend.device
        where = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
        settings = {"lora_rank": int(info.get("lora_rank") or 0), "device": where, "dtype": str(backend.dtype).removeprefix("torch."), **settings}
        self.sampler = VLLMSampler(backend.model_path, **settings)
        self.weights = RankWeights(backend)
        self.stale = True

    def prepare(self) -> None:
        """Sync the engine if the weights changed (every rank at once: a full model's sync gathers)."""
        if self.stale:
            self.sampler.sync_from(self.weights)
            self.stale = False

    def sample(self, share: SampleRequest, seeds: list[list[int]]) -> list[list[SampledSequence]]:
        return self.sampler.sample(share, seeds_by_prompt=seeds).sequences

    def sleep(self) -> None:
        self.sampler.sleep()

    def close(self) -> None:
        self.sampler.close()
