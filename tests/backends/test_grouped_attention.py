"""The grouped_matmul attention implementation (a CPU's default in bfloat16): sdpa's results with sdpa's masks, sdpa where it does not apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tinkergym.backends.torch.attention import NAME, grouped_matmul_attention, register
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, SampleRequest, SamplingParams


class _Attention(torch.nn.Module):
    """What the attention functions read of a transformers attention module."""

    def __init__(self, groups: int, is_causal: bool = True) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, is_causal


def _qkv(batch: int, heads: int, kv_heads: int, length: int, kv_length: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Queries as transformers makes them: [B, S, H, D] transposed, not contiguous.
    query = (2 * torch.randn(batch, length, heads, 16, generator=gen)).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, kv_length, 16, generator=gen) for _ in range(2))
    return [t.to(dtype).requires_grad_(True) for t in (query, key, value)]


def _left_padded_mask(pads: list[int], length: int, kv_length: int) -> torch.Tensor:
    """sdpa's boolean ``[B, 1, S, P]`` mask for left-padded rows whose last ``length`` positions are queries."""
    columns = torch.arange(kv_length)
    rows = torch.arange(kv_length - length, kv_length)
    causal = columns[None, :] <= rows[:, None]
    return torch.stack([causal & (columns >= pad)[None, :] for pad in pads])[:, None]


def _both(module: _Attention, tensors: list[torch.Tensor], mask: torch.Tensor | None) -> list[list[torch.Tensor]]:
    """Outputs and q/k/v gradients of sdpa and grouped_matmul on the same inputs (output rows ``keep`` only in the loss)."""
    results = []
    for attention in (sdpa_attention_forward, grouped_matmul_attention):
        inputs = [t.detach().clone().requires_grad_(True) for t in tensors]
        out, weights = attention(module, *inputs, mask, scaling=0.25)
        assert weights is None and out.shape == (inputs[0].shape[0], inputs[0].shape[2], inputs[0].shape[1], inputs[0].shape[3])
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        (out.float() * probe.float()).sum().backward()
        results.append([out.detach(), *(t.grad for t in inputs)])
    return results


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("length, kv_length", [(7, 7), (1, 9), (3, 11)])
def test_float32_outputs_and_gradients_equal_sdpa(kv_heads: int, length: int, kv_length: int) -> None:
    tensors = _qkv(3, 4, kv_heads, length, kv_length, torch.float32)
    mask = None if length == kv_length or length == 1 else _left_padded_mask([0, 2, 5], length, kv_length)
    sdpa, grouped = _both(_Attention(4 // kv_heads), tensors, mask)
    for a, b in zip(sdpa, grouped):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_padding_rows_equal_sdpa_where_read_and_stay_finite() -> None:
    """Left padding: a padding query sees no key; its output is finite (a NaN would reach later layers), the rest equals sdpa."""
    tensors = _qkv(2, 4, 2, 6, 6, torch.float32, seed=3)
    mask = _left_padded_mask([0, 3], 6, 6)
    mask[1, :, :3] = False  # padding queries see nothing, as transformers' masks for left-padded rows say
    out, _ = grouped_matmul_attention(_Attention(2), *tensors, mask, scaling=0.25)
    assert torch.isfinite(out).all()
    reference, _ = sdpa_attention_forward(_Attention(2), *tensors, mask, scaling=0.25)
    torch.testing.assert_close(out[1, 3:], reference[1, 3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], reference[0], atol=1e-5, rtol=1e-5)


def test_bfloat16_is_as_close_to_exact_as_sdpa() -> None:
    """Scores stay in float32: in bfloat16 the output is about as close to an exact result as sdpa's (bfloat16 scores are not)."""
    gen = torch.Generator().manual_seed(5)
    query = 3 * torch.randn(4, 6, 20, 64, generator=gen)  # scores of a trained model's size: bfloat16 rounds them coarsely
    key, value = torch.randn(4, 2, 20, 64, generator=gen), torch.randn(4, 2, 20, 64, generator=gen)
    tensors = [t.bfloat16() for t in (query, key, value)]
    exact, _ = sdpa_attention_forward(_Attention(3), *(t.double() for t in tensors), None, scaling=0.125)
    grouped, _ = grouped_matmul_attention(_Attention(3), *tensors, None, scaling=0.125)
    sdpa, _ = sdpa_attention_forward(_Attention(3), *tensors, None, scaling=0.125)
    error, sdpa_error = ((out.double() - exact).abs().max().item() for out in (grouped, sdpa))
    assert grouped.dtype == torch.bfloat16 and error < 2 * sdpa_error, (error, sdpa_error)


def test_causal_without_mask_is_upper_left_aligned_like_sdpa() -> None:
    """transformers passes no mask only where sdpa's is_causal (upper-left) is right, e.g. a prefill into a longer buffer."""
    tensors = _qkv(2, 4, 2, 4, 10, torch.float32, seed=7)
    sdpa, grouped = _both(_Attention(2), tensors, None)
    for a, b in zip(sdpa, grouped):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    bidirectional = _Attention(2, is_causal=False)
    sdpa, grouped = _both(bidirectional, tensors, None)
    torch.testing.assert_close(grouped[0], sdpa[0], atol=1e-5, rtol=1e-5)


def test_calls_it_does_not_cover_run_sdpa() -> None:
    """Attention dropout (random, drawn as sdpa draws it) and soft-capping (which sdpa refuses) go to sdpa."""
    tensors = [t.detach() for t in _qkv(2, 4, 2, 5, 5, torch.float32, seed=9)]
    torch.manual_seed(11)
    sdpa, _ = sdpa_attention_forward(_Attention(2), *tensors, None, dropout=0.5, scaling=0.25)
    torch.manual_seed(11)
    grouped, _ = grouped_matmul_attention(_Attention(2), *tensors, None, dropout=0.5, scaling=0.25)
    assert torch.equal(grouped, sdpa)
    with pytest.raises(ValueError, match="softcap"):
        grouped_matmul_attention(_Attention(2), *tensors, None, scaling=0.25, softcap=30.0)


def test_register_adds_a_name_and_leaves_transformers_own_alone() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert register() == register() == NAME
    assert AttentionInterface._global_mapping[NAME] is grouped_matmul_attention
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is sdpa_mask


def _backend(model: str, attn: str, lora_rank: int) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model=model, lora_rank=lora_rank, dtype="float32", seed=0, attn_implementation=attn, prefix_cache_mb=0))


def _batch() -> list[Datum]:
    """Two rows on one prompt and two on prompts of their own, of three lengths."""
    gen = torch.Generator().manual_seed(2)
    shared, alone, longer = (torch.randint(5, 200, (n,), generator=gen).tolist() for n in (5, 9, 12))
    data = []
    for prompt, advantage in ((shared, 1.0), (shared, -0.5), (alone, 0.25), (longer, 0.75)):
        tokens = prompt + torch.randint(5, 200, (4,), generator=gen).tolist()
        data.append(Datum(tokens=tokens, loss_mask=[0.0] * len(prompt) + [1.0] * 4, advantages=[advantage] * len(tokens)))
    return data


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_a_backend_with_it_matches_sdpa(tiny: str, lora_rank: int) -> None:
    """Logprobs, gradients and greedy samples (prompts of different lengths) of a backend with grouped_matmul equal sdpa's (float32)."""
    grouped = _backend(tiny, NAME, lora_rank)
    sdpa = _backend(tiny, "sdpa", lora_rank)
    assert grouped.info()["attn_implementation"] == grouped.model.config._attn_implementation == NAME
    data = _batch()
    for a, b in zip(sdpa.logprobs([d.tokens for d in data]), grouped.logprobs([d.tokens for d in data])):
        assert b == pytest.approx(a, abs=1e-5)
    spec = LossSpec(name="reinforce", aggregation="token")
    for backend in (sdpa, grouped):
        backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec))
    sdpa_grads = {n: p.grad for n, p in sdpa._trainable if p.grad is not None}
    grouped_grads = {n: p.grad for n, p in grouped._trainable if p.grad is not None}
    assert sdpa_grads.keys() == grouped_grads.keys() and sdpa_grads
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    prompts = [d.tokens[:-4] for d in data]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, seed=0, stop_token_ids=[])
    request = SampleRequest(prompts=prompts, params=params, num_samples=2)
    sampled = [[s.tokens for group in backend.sample(request).sequences for s in group] for backend in (sdpa, grouped)]
    assert sampled[0] == sampled[1] and all(len(tokens) == 6 for tokens in sampled[0])


def test_saved_models_do_not_name_it(tiny: str, tmp_path: Path) -> None:
    """A merged export loads anywhere: its config names no attention implementation (grouped_matmul exists only here)."""
    backend = _backend(tiny, NAME, 4)
    assert backend.model.config._attn_implementation == NAME
    backend.export(str(tmp_path / "merged"), merged=True)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert NAME not in json.dumps(config) and "attn_implementation" not in json.dumps(config)
