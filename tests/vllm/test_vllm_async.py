"""``async_steps`` with the vLLM sampler: each version of a LoRA policy is its own adapter in the engine, so rollouts
sampled ahead keep their version while the trainer steps and the engine loads the next one."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from testkit import Watched, add_graded_env, check_bounded_staleness  # registered by tests/conftest.py

from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.vllm.sampler import VLLMBackend
from tinkergym.config import TrainConfig
from tinkergym.errors import ConfigError
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams
from tinkergym.trainers.session import TrainingRun


def _tokens(response: Any) -> list[list[list[int]]]:
    return [[s.tokens for s in row] for row in response.sequences]


class WatchedVLLM(Watched, VLLMBackend):
    """The real VLLMBackend (a TorchBackend trains, a vLLM engine samples), watched (:class:`testkit.Watched`)."""


def test_a_snapshot_keeps_its_adapter_while_new_versions_load_and_lets_go_of_it_when_gone(tiny: str) -> None:
    torch_backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=8, lora_alpha=16.0, dtype="float32", seed=0))
    backend = VLLMBackend(torch_backend, max_model_len=256, seed=0, max_loras=3)
    request = SampleRequest([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3), num_samples=3)
    train = ForwardBackwardRequest([Datum([5, 6, 7, 8, 9, 10], [0.0] + [1.0] * 5)], LossSpec("cross_entropy"))

    def step() -> None:
        backend.forward_backward(train)
        backend.optim_step(OptimParams(learning_rate=0.5))

    try:
        old = backend.sampling_snapshot()
        assert old.version == 0 and backend.sampling_snapshot() is old
        before = _tokens(old.sample(request))
        drawn: list[Any] = []
        thread = threading.Thread(target=lambda snapshot: drawn.extend(_tokens(snapshot.sample(request)) for _ in range(3)), args=(old,))
        thread.start()
        for _ in range(2):  # trains, and loads each new version into the engine, while the other thread samples the old one
            step()
            backend.sampling_snapshot()
        thread.join(120)
        assert drawn == [before] * 3, "a snapshot sampled another version than its own"
        new = backend.sampling_snapshot()
        assert new.version == 2 and _tokens(new.sample(request)) == _tokens(backend.sample(request)) != before
        assert _tokens(old.sample(request)) == before, "a newer sync replaced the adapter an older snapshot samples"
        held, folder = old.request.lora_int_id, old.request.lora_path
        assert held in backend.sampler._adapters and os.path.isdir(folder)
        del old, thread
        gc.collect()
        step()
        backend.sampling_snapshot()  # the sync after the snapshot is gone removes its adapter, from the engine and the disk
        assert held not in backend.sampler._adapters and not os.path.exists(folder)
        assert set(backend.sampler._adapters) == {new.request.lora_int_id, backend.sampler.current_adapter.lora_int_id}  # new is alive
    finally:
        backend.close()


def test_full_weights_have_no_snapshots(tiny: str) -> None:
    backend = VLLMBackend(TorchBackend(TorchBackendConfig(model=tiny, lora_rank=0, dtype="float32", seed=0)), max_model_len=256, seed=0)
    try:
        with pytest.raises(ConfigError, match="one LoRA adapter per version"):
            backend.sampling_snapshot()
    finally:
        backend.close()


def test_a_grpo_run_samples_k_steps_ahead_with_vllm(tiny: str, fake_site: Any, tmp_path: Path) -> None:
    """K = 2 through the vLLM sampler: rollouts sampled ahead while the trainer trains, every trained sample at most
    K versions old and trained with the sampler's own logprobs."""
    add_graded_env(fake_site)
    out = tmp_path / "run"
    config = TrainConfig(env="fake/Graded-v0", trainer="grpo", model=tiny, sampler="vllm", dtype="float32", lora_rank=8, steps=5,
                         batch_size=2, group_size=4, max_turns=1, max_new_tokens=6, max_context=256, lr=5e-2, checkpoint_every=5,
                         transcripts_every=0, old_logprobs="sampler", async_steps=2, out=str(out))
    torch_backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=8, dtype="float32", seed=0))
    watched = WatchedVLLM(torch_backend, delay=0.3, max_model_len=256 + 6, seed=0, max_loras=4)
    try:
        TrainingRun(config, backend=watched).run(progress=False)
        check_bounded_staleness(watched, out, 2, steps=5)
    finally:
        watched.close()
