"""Shared prompts are computed once (sampling and training) and give the results of computing every copy."""

from __future__ import annotations

import pytest
import torch

from testkit import datum  # registered by tests/conftest.py

from tinkergym.backends.torch import scoring as torch_scoring
from tinkergym.backends.models import build_tiny_model
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.runtime import resolve_attn_implementation
from tinkergym.backends.torch.scoring import MicroBatch, plan_micro_batches, sequence_logprobs
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, SampleRequest, SamplingParams


def make_backend(tiny: str, share: bool, lora_rank: int = 4, micro_batch_size: int = 8, attn: str = "auto") -> TorchBackend:
    config = TorchBackendConfig(
        model=tiny, lora_rank=lora_rank, dtype="float32", seed=0, share_prefixes=share, micro_batch_size=micro_batch_size, attn_implementation=attn
    )
    return TorchBackend(config)


def grpo_like_batch() -> list[Datum]:
    """Two groups of samples on two prompts (completions of different lengths), plus one lone sequence."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=gen).tolist()

    prompts = [ids(9), ids(6)]
    data = []
    for g, prompt in enumerate(prompts):
        for k in range(3 + g):
            data.append(datum(prompt, ids(2 + (k * 3) % 5), advantage=(-1.0) ** k * (0.5 + k), shift=0.1 * k))
    data.insert(2, datum(ids(4), ids(5), advantage=1.5, shift=0.2))
    return data


def test_plan_groups_shared_prompts_and_keeps_the_rest_in_order() -> None:
    a, b = [1, 2, 3], [4, 5]
    data = [datum(a, [7], 1, 0), datum(b, [8], 1, 0), datum(a, [9, 9], 1, 0), datum([6], [1], 1, 0), datum(a, [5], 1, 0)]
    data.append(Datum(tokens=[1, 2], loss_mask=[0.0, 0.0]))  # no loss: never grouped
    # Budget 2 x 5 tokens: group a costs its prompt once (2 tokens before the last) + 2, 3 and 2 of its own.
    plan = plan_micro_batches(data, micro_batch_size=2)
    assert plan == [MicroBatch([0, 2, 4], [3], [3]), MicroBatch([1, 3]), MicroBatch([5])]
    assert plan_micro_batches(data, micro_batch_size=8, share_prefixes=False) == [MicroBatch([0, 1, 2, 3, 4, 5])]
    assert sorted(i for m in plan for i in m.indices) == list(range(len(data)))


def test_rows_run_in_passes_by_length_where_that_saves_more_than_a_pass_costs() -> None:
    own = [30, 2, 28, 3, 31]
    # One pass: 5 x 31 + 8 = 163 tokens; long and short apart: 3 x 31 + 2 x 3 + 2 x 8 = 115; three passes cost 121.
    assert torch_scoring.length_chunks(own, overhead=8) == [[4, 0, 2], [3, 1]]
    assert torch_scoring.length_chunks(own, overhead=100) == [[4, 0, 2, 3, 1]]
    assert torch_scoring.length_chunks(own, overhead=0) == [[4], [0], [2], [3], [1]]
    assert torch_scoring.length_chunks([5, 5, 5], overhead=0) == [[0, 1, 2]]


def test_plan_packs_groups_up_to_the_token_budget() -> None:
    a, b = [1, 2, 3, 4], [5, 6]
    data = [datum(a, [7, 7], 1, 0), datum(a, [8], 1, 0), datum(b, [9, 9, 9], 1, 0), datum(b, [9], 1, 0)]
    # Longest sequence 6 tokens. Costs: a = 3 + 3 + 2 = 8, b = 1 + 4 + 2 = 7.
    assert plan_micro_batches(data, micro_batch_size=3) == [MicroBatch([0, 1, 2, 3], [2, 2], [4, 2])]
    assert plan_micro_batches(data, micro_batch_size=2) == [MicroBatch([0, 1], [2], [4]), MicroBatch([2, 3], [2], [2])]
    # A budget below one group splits it; each part carries the prompt again.
    assert plan_micro_batches(data, micro_batch_size=1) == [MicroBatch([0], [1], [4]), MicroBatch([1], [1], [4]), MicroBatch([2], [1], [2]), MicroBatch([3], [1], [2])]


@pytest.mark.parametrize(("lora_rank", "micro_batch_size"), [(4, 1), (4, 3), (0, 3), (0, 8)])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_shared_prefix_gradients_equal_per_sequence_gradients(tiny: str, lora_rank: int, micro_batch_size: int, aggregation: str, length_passes: str) -> None:
    spec = LossSpec(name="ppo", clip_low=0.1, clip_high=0.3, kl_coef=0.1, aggregation=aggregation)
    shared_metrics = assert_sharing_changes_nothing(tiny, grpo_like_batch, spec, lora_rank, micro_batch_size)
    assert lora_rank == 0 or shared_metrics["kl"] > 0


def test_full_fine_tuning_in_bfloat16_scores_its_kl_reference_with_shared_prompts(tiny: str) -> None:
    """The KL reference of full fine-tuning in a lower dtype is a frozen copy whose passes store their KV cache through a
    hook (copies._cache_in); each group's rows get a copy of their prompt's cache, which must take their keys, not hand
    them to the prompt's cache (a shape error before)."""
    spec = LossSpec(name="ppo", clip_low=0.1, clip_high=0.3, kl_coef=0.1)
    results = {}
    for share in (True, False):
        backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=0, dtype="bfloat16", seed=0, share_prefixes=share, micro_batch_size=8))
        results[share] = backend.forward_backward(ForwardBackwardRequest(data=grpo_like_batch(), loss=spec)).metrics
    assert results[True]["kl"] == pytest.approx(results[False]["kl"], abs=1e-3)
    assert results[True]["loss"] == pytest.approx(results[False]["loss"], rel=2e-2, abs=1e-3)


def assert_sharing_changes_nothing(model: str, batch, spec: LossSpec, lora_rank: int, micro_batch_size: int) -> dict[str, float]:
    """Metrics and gradients of ``forward_backward`` on ``batch()`` are the same with and without shared prompts."""
    results = {}
    for share in (True, False):
        backend = make_backend(model, share, lora_rank=lora_rank, micro_batch_size=micro_batch_size)
        if lora_rank:  # a non-zero adapter, so the KL term and the adapter's gradient path are both exercised
            with torch.no_grad():
                for name, param in backend.model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
        metrics = backend.forward_backward(ForwardBackwardRequest(data=batch(), loss=spec)).metrics
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad and p.grad is not None}
        results[share] = (metrics, grads)
    (shared_metrics, shared_grads), (plain_metrics, plain_grads) = results[True], results[False]
    assert shared_metrics == pytest.approx(plain_metrics, rel=1e-5, abs=1e-6)
    assert shared_grads.keys() == plain_grads.keys() and shared_grads
    for name in plain_grads:
        assert torch.allclose(shared_grads[name], plain_grads[name], atol=1e-6, rtol=1e-4), name
    return shared_metrics


def test_sampling_shared_prompts_matches_sampling_each_copy(tiny: str) -> None:
    assert_shared_sampling_matches_each_copy(tiny, [[3, 17, 40, 9], [3, 17, 40, 9], [8, 8], [3, 17, 40, 9]])


def assert_shared_sampling_matches_each_copy(model: str, prompts: list[list[int]]) -> None:
    """Sampling with shared prompts gives the tokens and logprobs of sampling every copy, and scoring alone agrees."""
    params = SamplingParams(max_new_tokens=10, seed=7)
    out = {}
    for share in (True, False):
        backend = make_backend(model, share)
        out[share] = backend.sample(SampleRequest(prompts=prompts, params=params, num_samples=2)).sequences
    for shared_row, plain_row, prompt in zip(out[True], out[False], prompts):
        for shared, plain in zip(shared_row, plain_row):
            assert shared.tokens == plain.tokens
            assert shared.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
            scored = backend.logprobs([prompt + shared.tokens])[0][len(prompt) :]
            assert shared.logprobs == pytest.approx(scored, abs=1e-4), model


# Attention layouts whose masks depend on where tokens sit in the KV cache. Windows and chunks are smaller
# than the longest prompt of LAYOUT_PROMPTS, so a prompt padded the wrong way sees the wrong tokens.
LLAMA4_TINY = dict(model_type="llama4_text", head_dim=16, intermediate_size_mlp=128, num_local_experts=1, moe_layers=[], attention_chunk_size=5)
LAYOUTS = {
    "sliding": dict(use_sliding_window=True, sliding_window=6, max_window_layers=0),
    "mistral-sliding": dict(model_type="mistral", sliding_window=6),
    "qwen2-hybrid": dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "qwen3-hybrid": dict(model_type="qwen3", head_dim=16, use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    # Gemma 3: sliding and full layers with their own rotary bases.
    "gemma3-hybrid": dict(model_type="gemma3_text", head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    # Gemma 2: soft-capped attention logits, which transformers runs only eagerly ("auto" picks eager for it).
    "gemma2-hybrid": dict(model_type="gemma2", head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "chunked": dict(**LLAMA4_TINY, no_rope_layers=[1, 1]),
    # Llama 4: a chunked layer and a full NoPE layer whose attention temperature grows with the cache index
    # (every 8 tokens here instead of 8192).
    "chunked-hybrid": dict(**LLAMA4_TINY, no_rope_layers=[1, 0], floor_scale=8),
}
LAYOUT_PROMPTS = (12, 4, 7)


@pytest.fixture(scope="module")
def layout_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: build_tiny_model(root / name, **overrides) for name, overrides in LAYOUTS.items()}


def mixed_prompt_batch() -> list[Datum]:
    """Groups of samples on prompts of 12, 4 and 7 tokens (completions of 3 to 8 tokens), plus one lone sequence."""
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=gen).tolist()

    data = []
    for g, length in enumerate(LAYOUT_PROMPTS):
        prompt = ids(length)
        for k in range(2 + g % 2):
            data.append(datum(prompt, ids(3 + (4 * k + g) % 6), advantage=(-1.0) ** k * (0.5 + k + g), shift=0.1 * k))
    data.append(datum(ids(5), ids(4), advantage=1.5, shift=0.2))
    return data


def test_layouts_build_as_named(layout_models: dict[str, str]) -> None:
    from transformers import AutoConfig

    layer_types = {name: getattr(AutoConfig.from_pretrained(path), "layer_types", None) for name, path in layout_models.items()}
    assert layer_types["sliding"] == ["sliding_attention"] * 2
    assert AutoConfig.from_pretrained(layout_models["mistral-sliding"]).sliding_window == 6
    assert layer_types["qwen2-hybrid"] == layer_types["gemma3-hybrid"] == layer_types["gemma2-hybrid"] == ["sliding_attention", "full_attention"]
    assert make_backend(layout_models["gemma2-hybrid"], share=True).attn_implementation == "eager"
    assert make_backend(layout_models["sliding"], share=True).attn_implementation == "sdpa"  # float32 on a CPU
    assert resolve_attn_implementation("auto", torch.device("cpu"), torch.bfloat16, layout_models["sliding"]) == "grouped_matmul"
    assert layer_types["chunked"] == ["chunked_attention"] * 2
    assert layer_types["chunked-hybrid"] == ["chunked_attention", "full_attention"]
    # Every group shares one micro-batch, so prompts of different lengths are padded against each other.
    plan = plan_micro_batches(mixed_prompt_batch(), micro_batch_size=8)
    assert sorted(plan[0].prefix_lens) == sorted(LAYOUT_PROMPTS)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "grouped_matmul"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_shared_prefix_logprobs_equal_each_sequence_alone(layout_models: dict[str, str], layout: str, attn: str, length_passes: str) -> None:
    if layout.startswith("gemma2") and attn != "eager":
        pytest.skip("transformers runs Gemma 2's soft-capped attention only eagerly")
    backend = make_backend(layout_models[layout], share=True, lora_rank=0, attn=attn)
    data = mixed_prompt_batch()
    alone = backend.logprobs([d.tokens for d in data])
    (micro,) = [m for m in plan_micro_batches(data, micro_batch_size=8) if m.group_sizes]
    batch = backend._collate([data[i] for i in micro.indices])
    with torch.no_grad():
        shared = sequence_logprobs(backend.model, batch.tokens, batch.attention, batch.mask, micro)
    for row, i in enumerate(micro.indices):
        first = data[i].loss_mask.index(1.0)
        got = shared[row, first : len(data[i].tokens)].tolist()
        assert got == pytest.approx(alone[i][first:], abs=1e-4), (layout, i)


@pytest.mark.parametrize("lora_rank", [4, 0])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_shared_prefix_gradients_equal_per_sequence_gradients(layout_models: dict[str, str], layout: str, lora_rank: int, length_passes: str) -> None:
    spec = LossSpec(name="ppo", clip_low=0.1, clip_high=0.3, kl_coef=0.1, aggregation="token")
    assert_sharing_changes_nothing(layout_models[layout], mixed_prompt_batch, spec, lora_rank, micro_batch_size=8)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_sampling_prompts_of_different_lengths_matches_scoring_alone(layout_models: dict[str, str], layout: str) -> None:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in LAYOUT_PROMPTS]
    prompts.append(prompts[0])
    assert_shared_sampling_matches_each_copy(layout_models[layout], prompts)


def test_padded_length_limit_reads_llama4_temperature_tuning(layout_models: dict[str, str]) -> None:
    from tinkergym.backends.torch.scoring import padded_length_limit

    assert padded_length_limit(make_backend(layout_models["chunked-hybrid"], True).model) == 7  # through the LoRA wrapper
    assert padded_length_limit(make_backend(layout_models["chunked"], True).model) is None  # no NoPE layer
    assert padded_length_limit(make_backend(layout_models["sliding"], True).model) is None
