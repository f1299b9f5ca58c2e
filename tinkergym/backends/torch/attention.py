"""``grouped_matmul``: attention as two batched matmuls per key/value head, for the short sequences of RL on a CPU.

On a CPU, torch's sdpa runs its flash kernel, which on the shapes of a GRPO step (tens of queries over a
prompt of about a hundred keys, or one query while decoding) computes at a few percent of the machine's
matmul rate: most of a training pass's attention time is that kernel's backward pass. Here each key/value
head's query heads are stacked into one ``[G * S, D]`` block (no ``repeat_kv`` copy of the keys), the scores
are one float32 matmul, masked, soft-maxed in float32, and the probabilities meet the values in the values'
dtype. On SmolLM2-135M's GRPO shapes forward plus backward takes about 2.3x less time than sdpa's kernel, and
a decode step's attention about 1.3x less (``benchmarks/README.md``). That holds for half precision only: in
float32 sdpa's CPU kernels are as fast or faster at every shape measured, so ``attn_implementation="auto"`` picks
this implementation on a CPU in bfloat16 and keeps sdpa in float32.

Numerics: the scores stay in float32, like sdpa's kernels and unlike transformers' ``eager`` (whose bfloat16
scores round a score of 20 by up to 0.06): in bfloat16 the output is within sdpa's own rounding of an exact
result. Masks are sdpa's (the implementation registers transformers' ``sdpa_mask``), including sdpa's
upper-left causal alignment where transformers passes no mask.

Anything else runs transformers' sdpa as before: other devices (a GPU's fused kernels are the fast path
there), attention dropout, soft-capping, attention sinks and position biases. The name is registered with
transformers on first use (:func:`register`), the documented way to add an attention implementation; nothing
of transformers' own is replaced. A model saved from a backend names no implementation in its config.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "grouped_matmul"


def grouped_matmul_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: ``query [B, H, S, D]``, ``key``/``value`` ``[B, KV, P, D]`` -> ``[B, S, H, D]``."""
    batch, heads, length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if _needs_sdpa(query, key, value, attention_mask, dropout, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    groups = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # sdpa is autocast to the compute dtype: its inputs are rounded to it
        compute = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(compute), key.to(compute), value.to(compute)
    with torch.autocast(device_type, enabled=False):
        # Heads h = kv * groups + g read key/value head kv (transformers' repeat_kv order).
        scores = torch.matmul(query.float().reshape(batch, kv_heads, groups * length, dim), key.float().transpose(-1, -2))
        scores_5 = scores.view(batch, kv_heads, groups, length, kv_length).mul_(scaling)  # in place: matmul keeps its inputs only
        # Masked scores get float32's lowest value, not -inf: a padding query that sees no key then averages the
        # values (finite, and never read) instead of making NaN that padding keys would carry into later layers.
        lowest = torch.finfo(torch.float32).min
        if attention_mask is not None:
            mask_5 = _grouped(attention_mask, kv_heads, groups)
            scores_5 = scores_5.masked_fill_(~mask_5, lowest) if mask_5.dtype == torch.bool else scores_5.add_(mask_5)
        elif is_causal and length > 1:
            # transformers passes no mask only where sdpa's upper-left aligned causal mask is the right one.
            hidden = torch.ones(length, kv_length, dtype=torch.bool, device=query.device).triu_(1)
            scores_5 = scores_5.masked_fill_(hidden, lowest)
        probs = torch.softmax(scores_5, dim=-1).to(value.dtype)
        out = torch.matmul(probs.view(batch, kv_heads, groups * length, kv_length), value)
    return out.view(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def _needs_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, dropout: float, kwargs: dict) -> bool:
    """Whether this call is one the grouped path does not cover (see the module docstring)."""
    if query.device.type != "cpu" or dropout:
        return True
    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias")) or kwargs.get("output_attentions"):
        return True
    batch, heads = query.shape[:2]
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3] or heads % key.shape[1] or value.shape[-1] != query.shape[-1]:
        return True
    if mask is None:
        return False
    return mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, heads) or mask.shape[-1] != key.shape[2]


def _grouped(mask: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """A ``[B, 1 or H, S, P]`` mask as ``[B, 1 or KV, 1 or G, S, P]``, to broadcast over the grouped scores."""
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.view(mask.shape[0], kv_heads, groups, *mask.shape[2:])


def register() -> str:
    """Make ``attn_implementation="grouped_matmul"`` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, grouped_matmul_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
