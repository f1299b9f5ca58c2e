"""Pure torch functions for the losses a backend computes: token logprobs, policy losses, KL, aggregation.

Shapes are ``[B, T]`` with every per-token tensor aligned to the tokens: entry ``t`` is about predicting
``tokens[t]`` from ``tokens[:t]`` (entry 0 predicts nothing). Aggregation is expressed as per-token weights
whose normalizers are computed over the whole request, so a batch split into micro-batches sums to exactly
the loss of the unsplit batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from tinkergym.errors import ConfigError

LOSS_NAMES = ("cross_entropy", "ppo", "importance_sampling", "reinforce")
AGGREGATIONS = ("token", "sequence")
# Losses that compare against the sampler's logprobs (an importance ratio).
RATIO_LOSSES = ("ppo", "importance_sampling")
POLICY_LOSSES = ("ppo", "importance_sampling", "reinforce")


def _chunk_logprobs(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_NV, dim=-1, dtype=torch.float32).gather(-1, targets_N[:, None]).squeeze(-1)


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Float32 logprobs of each token under the logits of the previous position; ``[B, T]``, column 0 is 0.

    No ``[B, T, V]`` copy is made: the logits are read through a flat view (every position is scored against
    the next token, the last one against a dummy id and dropped), with one float32 log-softmax pass. Up to
    ``chunk_size`` positions keep that float32 result for the backward pass; longer inputs are scored
    ``chunk_size`` positions at a time and, under autograd, each chunk is recomputed in the backward pass
    instead of keeping its float32 copy.
    """
    batch, length, vocab = logits_BTV.shape
    next_BT = torch.cat([tokens_BT[:, 1:], torch.zeros_like(tokens_BT[:, :1])], dim=1)
    logits_NV, targets_N = logits_BTV.reshape(-1, vocab), next_BT.reshape(-1)
    if logits_NV.shape[0] <= chunk_size:
        logprobs_N = _chunk_logprobs(logits_NV, targets_N)
    else:
        pieces = []
        for start in range(0, logits_NV.shape[0], chunk_size):
            chunk, targets = logits_NV[start : start + chunk_size], targets_N[start : start + chunk_size]
            if chunk.requires_grad:
                pieces.append(checkpoint(_chunk_logprobs, chunk, targets, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(chunk, targets))
        logprobs_N = torch.cat(pieces)
    zeros = torch.zeros(batch, 1, dtype=torch.float32, device=logits_BTV.device)
    return torch.cat([zeros, logprobs_N.view(batch, length)[:, :-1]], dim=1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(r) - r - 1`` with ``r = ref - policy``.

    Non-negative, zero where the two agree, and unbiased for tokens sampled from the policy.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    advantages: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token loss of ``name``, with the importance ratio and the clipped-token indicator where they exist.

    - ``cross_entropy``: ``-logprob``.
    - ``reinforce``: ``-logprob * advantage``.
    - ``importance_sampling``: ``-ratio * advantage`` with ``ratio = exp(logprob - sampling_logprob)``.
    - ``ppo``: ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``; a token counts as
      clipped where the clipped term is the smaller one (its gradient is zero there).
    """
    if name not in LOSS_NAMES:
        raise ConfigError(f"unknown loss {name!r}; use one of {', '.join(LOSS_NAMES)}")
    if name == "cross_entropy":
        return -logprobs, None, None
    if advantages is None:
        raise ConfigError(f"the {name!r} loss needs advantages for every datum")
    if name == "reinforce":
        return -logprobs * advantages, None, None
    if sampling_logprobs is None:
        raise ConfigError(f"the {name!r} loss needs sampling_logprobs for every datum (the logprobs sample() returned)")
    ratio = torch.exp(logprobs - sampling_logprobs)
    if name == "importance_sampling":
        return -ratio * advantages, ratio, None
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), ratio, (clipped < unclipped).float()


def aggregation_weights(mask_BT: torch.Tensor, aggregation: str, total_mask: float, num_sequences: int) -> torch.Tensor:
    """Per-token weights that turn a sum over tokens into the requested mean over the whole request.

    ``token``: every masked token weighs ``mask / total_mask`` (the request's summed mask). ``sequence``:
    each sequence's tokens weigh ``mask / (its own mask sum * num_sequences)``, so every sequence with a
    non-empty mask counts equally. Rows with an empty mask weigh nothing.
    """
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    if aggregation == "token":
        return mask_BT / max(total_mask, 1e-12)
    per_row = mask_BT.sum(dim=1, keepdim=True)
    return torch.where(per_row > 0, mask_BT / per_row.clamp_min(1e-12), torch.zeros_like(mask_BT)) / max(num_sequences, 1)


def compute_loss(
    spec: Any,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    advantages: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of one micro-batch and the metric sums to accumulate across micro-batches.

    ``spec`` is a :class:`~tinkergym.backends.types.LossSpec`; ``weights`` come from
    :func:`aggregation_weights`; ``ref_logprobs`` are needed when ``spec.kl_coef > 0``. The sums are
    mask-weighted (``mask_sum``, ``kl_sum``, ``ratio_sum``, ``clipped_sum``) plus ``loss`` and ``tokens``;
    :func:`finalize_metrics` turns the accumulated sums into means.
    """
    per_token, ratio, clipped = policy_loss(spec.name, logprobs, advantages, sampling_logprobs, spec.clip_low, spec.clip_high)
    sums: dict[str, float] = {"mask_sum": float(mask.sum()), "tokens": float((mask > 0).sum())}
    if spec.kl_coef > 0:
        if ref_logprobs is None:
            raise ConfigError("kl_coef > 0 needs reference logprobs")
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + spec.kl_coef * kl
        sums["kl_sum"] = float((kl.detach() * mask).sum())
    if ratio is not None:
        sums["ratio_sum"] = float((ratio.detach() * mask).sum())
    if clipped is not None:
        sums["clipped_sum"] = float((clipped * mask).sum())
    loss = spec.loss_scale * (per_token * weights).sum()
    sums["loss"] = float(loss.detach())
    return loss, sums


def add_sums(total: dict[str, float], sums: dict[str, float]) -> dict[str, float]:
    """``total`` with each of ``sums`` added in (a new dict)."""
    out = dict(total)
    for key, value in sums.items():
        out[key] = out.get(key, 0.0) + value
    return out


def finalize_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Means from accumulated sums: ``loss``, ``tokens`` and, where computed, ``kl``, ``ratio_mean``, ``clip_fraction``."""
    denom = max(sums.get("mask_sum", 0.0), 1e-12)
    metrics = {"loss": sums.get("loss", 0.0), "tokens": sums.get("tokens", 0.0)}
    for key, name in (("kl_sum", "kl"), ("ratio_sum", "ratio_mean"), ("clipped_sum", "clip_fraction")):
        if key in sums:
            metrics[name] = sums[key] / denom
    return metrics
