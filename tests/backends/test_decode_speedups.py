"""The decode loop's shortcuts give a plain transformers decode's results: a KV cache written in place, 4D masks.

The reference here is the model's own forward with transformers' dynamic cache (``torch.cat`` per step) and the
2D padding mask, fed the sampled tokens: in float32 the sampler must match it bit for bit; in bfloat16 on a CPU
without padding sdpa's decode attention runs the packed grouped-query kernel, which rounds differently in the last
bit, so there the logits are held to the reference within bfloat16 rounding. Every test runs with sdpa and with
the grouped_matmul implementation a CPU defaults to in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tinkergym.backends.torch.cache_names import cache_kwargs, cache_of
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.sampling import preallocated, _preallocated_layer_class, _single_query_masks, prefill, sample_batch
from tinkergym.protocol.types import SamplingParams


@pytest.fixture(scope="module", params=["sdpa", "grouped_matmul"])
def backends(tiny: str, request: pytest.FixtureRequest) -> dict[str, TorchBackend]:
    """Backends of each dtype with sdpa attention and with the grouped_matmul implementation a CPU defaults to in bfloat16."""
    return {
        dtype: TorchBackend(TorchBackendConfig(model=tiny, lora_rank=0, dtype=dtype, device="cpu", seed=0, attn_implementation=request.param))
        for dtype in ("float32", "bfloat16")
    }


def prompts(lengths: tuple[int, ...], samples: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [p for n in lengths for p in [torch.randint(5, 200, (n,), generator=gen).tolist()] * samples]


@torch.inference_mode()
def plain_decode_logits(model: torch.nn.Module, batch: list[list[int]], tokens_BS: torch.Tensor, pad_id: int) -> list[torch.Tensor]:
    """Each step's logits [B, V] from transformers' dynamic cache and 2D mask, fed ``tokens_BS`` (prefill included)."""
    logits_BV, cache, attention, positions = prefill(model, batch, pad_id, torch.device("cpu"))
    out, position = [logits_BV.float()], positions[:, -1:] + 1
    for step in range(tokens_BS.shape[1] - 1):
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        result = model(input_ids=tokens_BS[:, step : step + 1], attention_mask=attention, position_ids=position, **cache_kwargs(cache), use_cache=True)
        cache, position = cache_of(result), position + 1
        out.append(result.logits[:, -1].float())
    return out


@pytest.mark.parametrize("lengths", [(6, 6), (4, 9, 6)])
def test_float32_sampling_matches_a_plain_transformers_decode_bit_for_bit(backends: dict[str, TorchBackend], lengths: tuple[int, ...]) -> None:
    backend = backends["float32"]
    model, batch = backend._sampling_model(), prompts(lengths, 3)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=4)
    out = sample_batch(model, batch, params, [], backend.pad_id, torch.Generator().manual_seed(4))
    tokens_BS = torch.tensor([s.tokens for s in out])
    logprobs = [step.log_softmax(-1) for step in plain_decode_logits(model, batch, tokens_BS, backend.pad_id)]
    expected = torch.stack([lp.gather(-1, tokens_BS[:, i : i + 1]).squeeze(-1) for i, lp in enumerate(logprobs)], dim=1)
    # The sampler's logprob is the log of the softmax probability; the reference's the log-softmax: equal up to that.
    assert torch.allclose(torch.tensor([s.logprobs for s in out]), expected, atol=1e-5, rtol=0)
    # Bit for bit: the same decode run with the sampler's cache and masks gives the same logits as the plain one.
    assert all(torch.equal(a, b) for a, b in zip(shortcut_decode_logits(model, batch, tokens_BS, backend.pad_id), plain_decode_logits(model, batch, tokens_BS, backend.pad_id)))


@torch.inference_mode()
def shortcut_decode_logits(model: torch.nn.Module, batch: list[list[int]], tokens_BS: torch.Tensor, pad_id: int) -> list[torch.Tensor]:
    """As :func:`plain_decode_logits`, with the sampler's preallocated cache and its 4D masks where it uses them."""
    logits_BV, cache, attention, positions = prefill(model, batch, pad_id, torch.device("cpu"))
    steps = tokens_BS.shape[1]
    cache = preallocated(cache, steps)
    padded = attention if len({len(p) for p in batch}) > 1 else None
    masks = _single_query_masks(model, cache, padded, steps)
    out, position, width = [logits_BV.float()], positions[:, -1:] + 1, positions.shape[-1]
    for step in range(steps - 1):
        if masks is not None:
            mask = masks[..., : width + step + 1]
        else:
            padded = mask = None if padded is None else torch.cat([padded, torch.ones_like(padded[:, :1])], dim=1)
        result = model(input_ids=tokens_BS[:, step : step + 1], attention_mask=mask, position_ids=position, **cache_kwargs(cache), use_cache=True)
        cache, position = cache_of(result), position + 1
        out.append(result.logits[:, -1].float())
    return out


def test_the_cache_is_written_in_place(backends: dict[str, TorchBackend]) -> None:
    model = backends["float32"]._sampling_model()
    with torch.inference_mode():
        _, cache, _, _ = prefill(model, prompts((5,), 2), 0, torch.device("cpu"))
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        cache = preallocated(cache, 3)
        layer = cache.layers[0]
        assert all(isinstance(each, _preallocated_layer_class()) for each in cache.layers)
        assert all(torch.equal(each.keys, k) and torch.equal(each.values, v) for each, (k, v) in zip(cache.layers, before))
        pointer = layer.keys.data_ptr()
        for step in range(4):  # one more than there is room for: it grows instead of failing
            new_k, new_v = torch.full_like(layer.keys[:, :, :1], float(step)), torch.full_like(layer.values[:, :, :1], -float(step))
            keys, values = layer.update(new_k, new_v)
            assert keys.shape[-2] == values.shape[-2] == layer.get_seq_length() == 6 + step
            assert torch.equal(keys[:, :, :5], before[0][0]) and torch.equal(keys[:, :, -1:], new_k) and torch.equal(values[:, :, -1:], new_v)
            assert step == 3 or layer.keys.data_ptr() == pointer  # no copy while there is room
        assert pointer != layer.keys.data_ptr()  # regrown on the fourth step only
    assert _single_query_masks(model, cache, None, 3) is None  # float32 without padding: transformers' own path


def test_bfloat16_without_padding_stays_within_rounding_of_the_plain_decode(backends: dict[str, TorchBackend]) -> None:
    backend = backends["bfloat16"]
    model, batch = backend._sampling_model(), prompts((7,), 4)
    with backend._compute():
        out = sample_batch(model, batch, SamplingParams(max_new_tokens=10, temperature=1.0), [], backend.pad_id, torch.Generator().manual_seed(1))
        tokens_BS = torch.tensor([s.tokens for s in out])
        with torch.inference_mode():
            _, cache, _, _ = prefill(model, batch, backend.pad_id, torch.device("cpu"))
            # sdpa takes the packed path through a mask; grouped_matmul needs none without padding
            packed = _single_query_masks(model, preallocated(cache, 10), None, 10) is not None
            assert packed == (backend.attn_implementation == "sdpa")
        plain = plain_decode_logits(model, batch, tokens_BS, backend.pad_id)
        shortcut = shortcut_decode_logits(model, batch, tokens_BS, backend.pad_id)
    for a, b in zip(plain, shortcut):
        assert (a.log_softmax(-1) - b.log_softmax(-1)).abs().max() < 0.05
