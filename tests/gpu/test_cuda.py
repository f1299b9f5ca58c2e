"""TorchBackend on a GPU: device, precision and attention choices, sampling, scoring, training and checkpoints.

Skipped where torch sees no CUDA device. ``TINKERGYM_TEST_DEVICE=cpu`` runs the same tests on the CPU (a check
of the tests themselves; the auto-choice test then checks the CPU's choices). Everything runs on the tiny
model, so the whole file takes well under a minute on a GPU.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tinkergym.backends.torch import backend as torch_backend
from tinkergym.backends.torch import runtime as torch_setup
from tinkergym.backends.torch.state_files import read_optimizer_state
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.scoring import MicroBatch, plan_micro_batches, sequence_logprobs
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams

DEVICE = os.environ.get("TINKERGYM_TEST_DEVICE", "cuda")
DEVICE_TYPE = torch.device(DEVICE).type
# TINKERGYM_TEST_DEVICE=cpu runs the GPU path on the CPU in make test's gpu-on-cpu lane (the marker gpu_on_cpu).
pytestmark = [pytest.mark.gpu_on_cpu, pytest.mark.skipif(
    DEVICE_TYPE == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); TINKERGYM_TEST_DEVICE=cpu runs these tests on the CPU",
)]
# bfloat16 keeps 8 bits of mantissa: logits of a few units carry errors of about 1e-2, and different batch
# shapes (prefill and decode steps against one full pass; a shared prompt against its copies) round differently.
BF16_MEAN, BF16_MAX = 2e-2, 0.15


def make_backend(tiny: str, lora_rank: int = 4, dtype: str = "bfloat16", **overrides) -> TorchBackend:
    """A backend on DEVICE; with LoRA, a non-zero adapter, so the adapter's path changes the logits."""
    settings = {"model": tiny, "lora_rank": lora_rank, "dtype": dtype, "device": DEVICE, "seed": 0, "micro_batch_size": 4, **overrides}
    config = TorchBackendConfig(**settings)
    backend = TorchBackend(config)
    if lora_rank:
        with torch.no_grad():
            for name, param in backend.model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    return backend


def prompts(count: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(5, 200, (5 + 3 * i,), generator=gen).tolist() for i in range(count)]


def sampled_batch(backend: TorchBackend, temperature: float, samples: int = 4, new_tokens: int = 12) -> list[Datum]:
    """A GRPO-like batch sampled from ``backend`` itself: groups of ``samples`` on each prompt, advantages of both signs."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=11, stop_token_ids=[len(backend.tokenizer) + 1])
    response = backend.sample(SampleRequest(prompts=prompts(), params=params, num_samples=samples))
    data = []
    for prompt, row in zip(prompts(), response.sequences):
        for k, sequence in enumerate(row):
            mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
            advantage = (-1.0) ** k * (0.5 + k)
            data.append(Datum(tokens=prompt + sequence.tokens, loss_mask=mask, advantages=[advantage * m for m in mask],
                              sampling_logprobs=[0.0] * len(prompt) + sequence.logprobs))
    return data


def sft_datum(backend: TorchBackend) -> Datum:
    tokens = backend.tokenizer.encode("<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>")
    return Datum(tokens=tokens, loss_mask=[1.0] * len(tokens))


def trainable(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}


def assert_finite_metrics(metrics: dict[str, float]) -> None:
    assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics


def test_auto_picks_the_gpu_bfloat16_and_sdpa_or_flash_attention(tiny: str) -> None:
    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, device="auto", dtype="auto", attn_implementation="auto"))
    info = backend.info()
    cuda = torch.cuda.is_available()
    assert info["device"].startswith("cuda" if cuda else "cpu")
    assert {p.device.type for p in backend.model.parameters()} == {"cuda" if cuda else "cpu"}
    if cuda:
        assert info["dtype"] == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")
        flash = torch_backend.flash_attn_importable() and info["dtype"] == "bfloat16"
        assert info["attn_implementation"] == ("flash_attention_2" if flash else "sdpa")
    else:  # a CPU: our grouped_matmul kernel in its native bfloat16, sdpa in float32, for a model that supports sdpa
        assert info["attn_implementation"] == ("grouped_matmul" if info["dtype"] == "bfloat16" else "sdpa")
    # The choice itself, with flash-attn present and absent, whatever is installed here (tests/backends/test_torch_backend.py
    # checks the import test with broken and working stand-ins of the package).
    cuda_device = torch.device("cuda")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_setup, "flash_attn_importable", lambda: True)
        assert torch_backend.resolve_attn_implementation("auto", cuda_device, torch.bfloat16, tiny) == "flash_attention_2"
        assert torch_backend.resolve_attn_implementation("auto", cuda_device, torch.float32, tiny) == "sdpa"
        patch.setattr(torch_setup, "flash_attn_importable", lambda: False)
        assert torch_backend.resolve_attn_implementation("auto", cuda_device, torch.bfloat16, tiny) == "sdpa"


@pytest.mark.parametrize("lora_rank", [4, 0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sampling_is_seeded_and_its_logprobs_match_scoring(tiny: str, dtype: str, lora_rank: int) -> None:
    backend = make_backend(tiny, lora_rank, dtype)
    request = SampleRequest(prompts=prompts(2), params=SamplingParams(max_new_tokens=12, seed=7), num_samples=3)
    first = backend.sample(request)
    assert backend.sample(request) == first
    vocab = len(backend.tokenizer)
    errors = []
    for prompt, row in zip(prompts(2), first.sequences):
        assert len(row) == 3
        for seq in row:
            assert 1 <= len(seq.tokens) <= 12 and len(seq.logprobs) == len(seq.tokens)
            assert all(0 <= t < vocab for t in seq.tokens)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in seq.logprobs)
            scored = backend.logprobs([prompt + seq.tokens])[0][len(prompt) :]
            errors.extend(abs(a - b) for a, b in zip(scored, seq.logprobs))
    if dtype == "float32":
        assert max(errors) < 1e-4
    else:
        assert sum(errors) / len(errors) < BF16_MEAN and max(errors) < BF16_MAX, (sum(errors) / len(errors), max(errors))


@pytest.mark.parametrize("lora_rank", [4, 0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unchanged_policy_has_ratio_one_at_temperature_0_7(tiny: str, dtype: str, lora_rank: int) -> None:
    backend = make_backend(tiny, lora_rank, dtype)
    data = sampled_batch(backend, 0.7)
    metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo", temperature=0.7))).metrics
    assert_finite_metrics(metrics)
    assert metrics["clip_fraction"] == 0.0
    if dtype == "float32":
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
        assert metrics["mismatch/logp_abs_max"] < 1e-3 and metrics["mismatch/kl"] < 1e-6
    else:
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=BF16_MEAN)
        assert metrics["mismatch/logp_abs_mean"] < BF16_MEAN and metrics["mismatch/logp_abs_max"] < BF16_MAX, metrics
    assert all(torch.isfinite(p.grad).all() for p in backend.model.parameters() if p.grad is not None)


def shared_and_plain_logprobs(backend: TorchBackend, data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the batch's groups scored with their prompts shared and each row on its own, and the loss mask."""
    (micro,) = [m for m in plan_micro_batches(data, micro_batch_size=len(data)) if m.group_sizes]
    batch = backend._collate([data[i] for i in micro.indices])
    backend.model.eval()
    with torch.no_grad(), backend._compute():
        shared = sequence_logprobs(backend.model, batch.tokens, batch.attention, batch.mask, micro)
        plain = sequence_logprobs(backend.model, batch.tokens, batch.attention, batch.mask, MicroBatch(micro.indices))
    return shared, plain, batch.mask.bool()


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_shared_prefix_scoring_matches_scoring_each_row(tiny: str, lora_rank: int) -> None:
    exact = make_backend(tiny, lora_rank, "float32")
    data = sampled_batch(exact, 1.0)
    shared, plain, mask = shared_and_plain_logprobs(exact, data)
    assert torch.isfinite(shared).all() and float((shared - plain)[mask].abs().max()) < 1e-4
    low = make_backend(tiny, lora_rank, "bfloat16")
    shared, plain, mask = shared_and_plain_logprobs(low, data)
    diff = (shared - plain)[mask].abs()
    assert torch.isfinite(shared).all() and float(diff.mean()) < BF16_MEAN and float(diff.max()) < BF16_MAX, (float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_shared_prefix_training_pass_matches_the_unshared_one(tiny: str, lora_rank: int) -> None:
    """float32: the same loss metrics and gradients with and without shared prompts."""
    data = sampled_batch(make_backend(tiny, lora_rank, "float32"), 1.0)
    results = {}
    for share in (True, False):
        backend = make_backend(tiny, lora_rank, "float32", share_prefixes=share, micro_batch_size=8)
        spec = LossSpec(name="ppo", clip_low=0.1, clip_high=0.3, kl_coef=0.1)
        metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
        assert_finite_metrics(metrics)
        results[share] = (metrics, {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None})
    (shared_metrics, shared_grads), (plain_metrics, plain_grads) = results[True], results[False]
    assert shared_metrics == pytest.approx(plain_metrics, rel=1e-4, abs=1e-5)
    assert shared_grads.keys() == plain_grads.keys() and shared_grads
    for name in plain_grads:
        assert torch.allclose(shared_grads[name], plain_grads[name], atol=1e-5, rtol=1e-3), name


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_optimizer_steps_change_the_trainable_weights_and_lower_the_loss(tiny: str, lora_rank: int) -> None:
    backend = make_backend(tiny, lora_rank)
    frozen = {n: p.detach().clone() for n, p in backend.model.named_parameters() if not p.requires_grad}
    before = trainable(backend)
    assert before and all(p.device.type == DEVICE_TYPE for p in before.values())
    request = ForwardBackwardRequest(data=[sft_datum(backend)], loss=LossSpec(name="cross_entropy"))
    seen = []
    for _ in range(8):
        metrics = backend.forward_backward(request).metrics
        assert_finite_metrics(metrics)
        seen.append(metrics["loss"])
        stats = backend.optim_step(OptimParams(learning_rate=1e-2, max_grad_norm=1.0))
        assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    assert seen[-1] < 0.7 * seen[0], seen
    after = trainable(backend)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert all(torch.equal(frozen[n], p) for n, p in backend.model.named_parameters() if not p.requires_grad)
    assert backend.info()["step"] == 8 and all(p.grad is None for p in backend.model.parameters())


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_save_and_load_state_round_trip(tiny: str, tmp_path: Path, lora_rank: int) -> None:
    original = make_backend(tiny, lora_rank)
    data = sampled_batch(original, 1.0)
    spec = LossSpec(name="ppo", kl_coef=0.05)
    for _ in range(2):
        original.forward_backward(ForwardBackwardRequest(data=data, loss=spec))
        original.optim_step(OptimParams(learning_rate=1e-2, max_grad_norm=1.0))
    original.save_state(str(tmp_path / "state"))
    saved_weights = trainable(original)
    unseeded = SampleRequest(prompts=prompts(2), params=SamplingParams(max_new_tokens=8), num_samples=2)  # the global (CUDA) RNG
    expected_sample = original.sample(unseeded)
    expected_metrics = original.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
    original.optim_step(OptimParams(learning_rate=1e-2, max_grad_norm=1.0))

    resumed = make_backend(tiny, lora_rank, seed=123)
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.info()["step"] == 2
    loaded_weights = trainable(resumed)
    assert loaded_weights.keys() == saved_weights.keys()
    assert all(torch.equal(loaded_weights[n], saved_weights[n]) and loaded_weights[n].device.type == DEVICE_TYPE for n in saved_weights)
    saved = read_optimizer_state(tmp_path / "state")["state"]
    loaded = resumed.optimizer.state_dict()["state"]
    assert saved and saved.keys() == loaded.keys()
    for index in saved:
        for key, value in saved[index].items():
            assert torch.equal(loaded[index][key].cpu(), value), (index, key)
            if key != "step":
                assert loaded[index][key].device.type == DEVICE_TYPE, (index, key)
    assert resumed.sample(unseeded) == expected_sample
    metrics = resumed.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
    assert_finite_metrics(metrics)
    assert metrics == pytest.approx(expected_metrics, rel=1e-4, abs=1e-5)
    resumed.optim_step(OptimParams(learning_rate=1e-2, max_grad_norm=1.0))
    final_a, final_b = trainable(original), trainable(resumed)
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.allclose(final_a[name], final_b[name], atol=1e-5, rtol=1e-4), name
