"""The vLLM engine: a sampler beside a trainer, its weights synced from it."""

from __future__ import annotations

from typing import Any


def build(request: Any) -> Any:
    """The ``vllm`` backend plugin: TorchBackend trains, a vLLM engine synced from it after every step samples."""
    from tinkergym.backends.torch import build as build_torch
    from tinkergym.backends.vllm.sampler import VLLMBackend, require_vllm

    c = request.config
    require_vllm()  # before the model loads: a missing vLLM is a quick, clear error
    backend = build_torch(request)
    # Room for the whole episode: the rollout loop stops at max_context, plus one turn of new tokens.
    engine = {"enforce_eager": c.sampler_eager, "device": c.sampler_device, "sleep": c.sampler_sleep}
    if c.sampler_gpu_memory is not None:
        engine["gpu_memory_utilization"] = c.sampler_gpu_memory
    if c.async_steps:  # the versions snapshots sample (up to K + 1 of them) and the one synced meanwhile
        engine["max_loras"] = c.async_steps + 2
    return VLLMBackend(backend, max_model_len=c.max_context + c.max_new_tokens, seed=c.seed, **engine)
