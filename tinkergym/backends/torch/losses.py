"""Pure torch functions for the losses a backend computes: token logprobs, policy losses, KL, aggregation.

Shapes are ``[B, T]`` with every per-token tensor aligned to the tokens: entry ``t`` is about predicting
``tokens[t]`` from ``tokens[:t]`` (entry 0 predicts nothing). Aggregation is expressed as per-token weights
whose normalizers are computed over the whole optimizer batch (the request's, unless the request names the
batch's totals), so a batch split into micro-batches, or into several requests before one optimizer step,
sums to exactly the loss of the unsplit batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tinkergym.protocol.types import OLD_LOGPROBS
from tinkergym.errors import ConfigError

LOSS_NAMES = ("cross_entropy", "ppo", "importance_sampling", "reinforce", "cispo", "dro", "gspo")
AGGREGATIONS = ("token", "sequence", "sum")
# Losses that compare against the sampler's logprobs (an importance ratio).
RATIO_LOSSES = ("ppo", "importance_sampling", "cispo", "dro", "gspo")
POLICY_LOSSES = ("ppo", "importance_sampling", "reinforce", "cispo", "dro", "gspo")


#: Bound on a log importance ratio before it is exponentiated: exp(20) is finite in float32 with room to spare.
MAX_LOG_RATIO = 20.0
#: Bound on the per-token k3 KL value, as verl bounds its low-variance KL.
MAX_K3 = 10.0
#: The largest float32: the loss settings scale and clamp float32 tensors, and torch refuses a number past it.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: The largest size of a loss setting (``loss_scale``, ``kl_coef``, the clips, ...) and of a datum's per-token weight or
#: advantage: their products with logprobs and with each other stay far inside float32 (a loss scale of 1e38 would not).
MAX_LOSS_NUMBER = 1e6
#: The loss settings that bound something, which infinity switches off (every other one is a finite number).
UNBOUNDED_AT_INFINITY = frozenset({"clip_low", "clip_high", "tis_cap"})


class _TargetLogprob(torch.autograd.Function):
    """Float32 ``log softmax(logits / temperature)[target]`` per row, a chunk of rows at a time, never a ``[N, V]`` float32 tensor kept.

    Forward: each chunk's float32 logits give the log-normalizer (one ``logsumexp``) and the target's logit;
    only the normalizers (``N`` floats) are kept besides the logits themselves. Backward: the gradient of a
    row is ``g * (onehot(target) - softmax) / temperature``, written chunk by chunk straight into a tensor of
    the logits' dtype. A log-softmax instead writes a float32 ``[N, V]`` result and reads it back in the
    backward pass, with a ``[N, V]`` zero-filled gradient for the gather besides: three to four times the
    memory traffic over the vocabulary, the largest tensor of a small model's pass.
    """

    @staticmethod
    def forward(ctx: Any, logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float, chunk_size: int) -> torch.Tensor:
        rows = logits_NV.shape[0]
        out_N = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
        lse_N = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
        for start in range(0, rows, chunk_size):
            stop = start + chunk_size
            scaled = _scaled(logits_NV[start:stop], temperature)
            lse_N[start:stop] = torch.logsumexp(scaled, dim=-1)
            out_N[start:stop] = scaled.gather(-1, targets_N[start:stop, None]).squeeze(-1) - lse_N[start:stop]
        ctx.save_for_backward(logits_NV, targets_N, lse_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out_N

    @staticmethod
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits_NV, targets_N, lse_N = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        for start in range(0, logits_NV.shape[0], ctx.chunk_size):
            stop = start + ctx.chunk_size
            grad = grad_N[start:stop, None].float()
            probs = _scaled(logits_NV[start:stop], ctx.temperature).sub_(lse_N[start:stop, None]).exp_()
            probs.mul_(-grad).scatter_add_(-1, targets_N[start:stop, None], grad)
            if ctx.temperature != 1.0:
                probs.div_(ctx.temperature)
            grad_NV[start:stop] = probs
        return grad_NV, None, None, None


#: Float32 logits one chunk of :class:`_TargetLogprob` holds on a CPU: small enough that a chunk's passes (the cast,
#: the log-normalizer's max, exp and sum; in the backward the softmax and the gradient) read it from cache, not
#: memory. 16 rows of a 49K vocabulary: forward and backward 2.8x faster than 1,024 rows, the same results.
CPU_CHUNK_BYTES = 3 * 2**20
#: Rows per chunk elsewhere (a GPU: few, large kernels).
CHUNK_ROWS = 1024


def chunk_rows(logits_NV: torch.Tensor, chunk_size: int | None) -> int:
    """``chunk_size``, or by default :data:`CHUNK_ROWS` rows, on a CPU as many as :data:`CPU_CHUNK_BYTES` of float32 holds."""
    if chunk_size is not None:
        return chunk_size
    if logits_NV.device.type == "cpu":
        return max(1, CPU_CHUNK_BYTES // (4 * logits_NV.shape[-1]))
    return CHUNK_ROWS


def _scaled(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new float32 tensor of ``logits_NV / temperature`` (the division in float32, as the sampler divides)."""
    scaled = logits_NV.to(torch.float32, copy=True)
    return scaled.div_(temperature) if temperature != 1.0 else scaled


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Float32 logprobs of each token under the logits of the previous position; ``[B, T]``, column 0 is 0.

    ``temperature`` scores the distribution ``softmax(logits / temperature)``, the one a sampler at that
    temperature draws from (in float32, so a bfloat16 model's logits are not rounded again by the division).

    No ``[B, T, V]`` copy is made: the logits are read through a flat view (every position is scored against
    the next token, the last one against a dummy id and dropped), ``chunk_size`` positions at a time in
    float32 (default :func:`chunk_rows`), and only a log-normalizer per position is kept for the backward pass
    (see :class:`_TargetLogprob`).
    """
    batch = logits_BTV.shape[0]
    next_BT = torch.cat([tokens_BT[:, 1:], torch.zeros_like(tokens_BT[:, :1])], dim=1)
    zeros = torch.zeros(batch, 1, dtype=torch.float32, device=logits_BTV.device)
    return torch.cat([zeros, target_logprobs(logits_BTV, next_BT, chunk_size, temperature)[:, :-1]], dim=1)


def target_logprobs(logits_BKV: torch.Tensor, targets_BK: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Float32 ``[B, K]`` logprob of ``targets[b, k]`` under ``logits[b, k]`` at ``temperature`` (no shift; see :func:`token_logprobs`)."""
    batch, length, vocab = logits_BKV.shape
    flat = logits_BKV.reshape(-1, vocab)
    return _TargetLogprob.apply(flat, targets_BK.reshape(-1), temperature, chunk_rows(flat, chunk_size)).view(batch, length)


def masked_log_ratio(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``numerator - denominator`` where ``mask`` is set and 0 elsewhere, bounded by :data:`MAX_LOG_RATIO`.

    Masking comes before any exponential: positions outside the loss (prompts, padding, observations) hold
    arbitrary values, and an ``exp`` of one of them that overflows would turn ``inf * 0`` into NaN.
    """
    log_ratio = numerator - denominator
    if mask is not None:
        log_ratio = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(r) - r - 1`` with ``r = ref - policy``.

    Non-negative, zero where the two agree, and unbiased for tokens sampled from the policy. Entries outside
    ``mask`` are 0; ``r`` is bounded by :data:`MAX_LOG_RATIO` and the value by :data:`MAX_K3` (as verl's
    low-variance KL), so one token far out of the reference's support cannot make the loss NaN or infinite.
    """
    log_ratio = masked_log_ratio(ref_logprobs, logprobs, mask)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp_max(MAX_K3)


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    mask: torch.Tensor | None = None,
    beta: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token loss of ``name``, with the importance ratio and the clipped-token indicator where they exist.

    - ``cross_entropy``: ``-logprob``.
    - ``reinforce``: ``-logprob * advantage``.
    - ``importance_sampling``: ``-ratio * advantage`` with ``ratio = exp(logprob - old_logprob)``.
    - ``ppo``: ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``; a token counts as
      clipped where the clipped term is the smaller one (its gradient is zero there).
    - ``cispo``: ``-sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * logprob * A``.
    - ``dro``: ``-(logprob * A - beta / 2 * (logprob - old_logprob) ** 2)``.
    - ``gspo``: ``ppo``'s with each token's ratio ``sg(s) * exp(logprob - sg(logprob))``, where ``s`` is the exponential
      of the row's mean masked log ratio (GSPO-token: the sequence's value, the token's own gradient).

    The ratio is 1 outside ``mask`` (see :func:`masked_log_ratio`).
    """
    if name not in LOSS_NAMES:
        raise ConfigError(f"unknown loss {name!r}; use one of {', '.join(LOSS_NAMES)}")
    if name == "cross_entropy":
        return -logprobs, None, None
    if advantages is None:
        raise ConfigError(f"the {name!r} loss needs advantages for every datum")
    if name == "reinforce":
        return -logprobs * advantages, None, None
    if old_logprobs is None:
        raise ConfigError(f"the {name!r} loss needs sampling_logprobs for every datum (the logprobs sample() returned)")
    if name == "dro":
        gap = masked_log_ratio(logprobs, old_logprobs, mask)
        return -(logprobs * advantages - 0.5 * beta * gap**2), torch.exp(gap.detach()), None
    ratio = torch.exp(masked_log_ratio(logprobs, old_logprobs, mask))
    if name == "importance_sampling":
        return -ratio * advantages, ratio, None
    if name == "cispo":
        clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
        return -clipped_ratio * logprobs * advantages, ratio, (clipped_ratio != ratio.detach()).float()
    if name == "gspo":
        gap = masked_log_ratio(logprobs.detach(), old_logprobs, mask)
        weight = (mask > 0).float() if mask is not None else torch.ones_like(gap)
        row = (gap * weight).sum(dim=-1, keepdim=True) / weight.sum(dim=-1, keepdim=True).clamp_min(1.0)
        ratio = torch.exp(row + logprobs - logprobs.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), ratio, (clipped < unclipped).float()


def validate_spec(spec: Any) -> None:
    """Refuse a :class:`~tinkergym.protocol.types.LossSpec` that cannot be computed, with what to do instead."""
    if spec.name not in LOSS_NAMES:
        raise ConfigError(f"unknown loss {spec.name!r}; use one of {', '.join(LOSS_NAMES)}")
    if spec.aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown aggregation {spec.aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    if spec.old_logprobs not in OLD_LOGPROBS:
        raise ConfigError(f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, not {spec.old_logprobs!r}")
    if not spec.temperature > 0:
        raise ConfigError(
            f"the loss temperature must be > 0 (got {spec.temperature}): greedy samples have no distribution to train on; "
            "sample training rollouts at a temperature > 0 (greedy decoding is fine in evaluation)"
        )
    if spec.top_k > 0 or spec.top_p < 1.0:
        raise ConfigError(
            f"top_k={spec.top_k}, top_p={spec.top_p}: the training loss scores the full distribution at the sampling "
            "temperature, so truncated sampling would bias the importance ratio; sample training rollouts with top_k=0 and "
            "top_p=1 (top-k/top-p are fine in evaluation)"
        )
    settings = {name: getattr(spec, name) for name in ("clip_low", "clip_high", "kl_coef", "loss_scale", "temperature", "tis_cap", "beta")}
    unfit = [f"{name}={value!r}" for name, value in settings.items()
             if not abs(value) <= MAX_LOSS_NUMBER and not (value == math.inf and name in UNBOUNDED_AT_INFINITY)]  # NaN fits nothing
    if unfit:
        raise ConfigError(f"{', '.join(unfit)}: the loss settings must be numbers of at most {MAX_LOSS_NUMBER:.0e} in size (clip_low, "
                          "clip_high and tis_cap may be infinite: no bound); a larger one overflows the loss in float32")
    if spec.tis_cap < 0 or spec.kl_coef < 0:
        raise ConfigError(f"tis_cap and kl_coef must be >= 0 (0 = off), not {spec.tis_cap} and {spec.kl_coef}")
    if not 0 <= spec.beta < math.inf:
        raise ConfigError(f"beta (dro's penalty) must be >= 0 and finite, not {spec.beta}")
    if spec.tis_cap > 0 and spec.name in RATIO_LOSSES and spec.old_logprobs != "trainer":
        raise ConfigError(
            "tis_cap weighs each token by min(trainer/sampler ratio, cap), so the PPO ratio must start from the "
            "trainer's old logprobs, not the sampler's: set old_logprobs='trainer' as well"
        )


def aggregation_weights(mask_BT: torch.Tensor, aggregation: str, total_mask: float, num_sequences: int) -> torch.Tensor:
    """Per-token weights that turn a sum over tokens into the requested mean over the whole batch.

    ``token``: every masked token weighs ``mask / total_mask`` (the batch's summed mask). ``sequence``:
    each sequence's tokens weigh ``mask / (its own mask sum * num_sequences)``, so every sequence with a
    non-empty mask counts equally. Rows with an empty mask weigh nothing. ``total_mask`` and
    ``num_sequences`` are the whole optimizer batch's, which may be more than the rows being weighed.
    """
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    if aggregation == "sum":
        return mask_BT
    if aggregation == "token":
        return mask_BT / max(total_mask, 1e-12)
    per_row = mask_BT.sum(dim=1, keepdim=True)
    return torch.where(per_row > 0, mask_BT / per_row.clamp_min(1e-12), torch.zeros_like(mask_BT)) / max(num_sequences, 1)


def _mismatch_tensors(delta: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    read = mask > 0
    # |delta| >= 0, so zeros outside the mask leave the maximum of a non-empty mask alone and make an empty one 0.
    return {
        "mismatch_abs_sum": (delta.abs() * mask).sum(),
        "mismatch_abs_max": torch.where(read, delta.abs(), torch.zeros_like(delta)).amax(),
        "mismatch_kl_sum": ((torch.exp(delta) - delta - 1.0) * mask).sum(),
    }


def mismatch_sums(delta: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums that measure how far the sampler's logprobs are from the trainer's on the sampled tokens.

    ``delta`` is ``masked_log_ratio(trainer, sampler, mask)``. ``mismatch_abs_sum`` (of ``|trainer - sampler|``),
    ``mismatch_abs_max`` and ``mismatch_kl_sum`` (the k3 estimate of KL(sampler || trainer), unbiased for tokens
    drawn by the sampler), all over masked tokens.
    """
    return sums_to_floats([_mismatch_tensors(delta, mask)])[0]


def compute_loss(
    spec: Any,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    advantages: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`compute_loss_on_device` with the metric sums read back as floats (one wait for the device)."""
    loss, sums = compute_loss_on_device(spec, logprobs, mask, weights, advantages, sampling_logprobs, ref_logprobs, old_logprobs)
    return loss, sums_to_floats([sums])[0]


def compute_loss_on_device(
    spec: Any,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    advantages: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss of one micro-batch and the metric sums to accumulate across micro-batches.

    The sums stay on the device as detached float32 scalars, so a training pass need not wait for the device
    between micro-batches; :func:`sums_to_floats` reads any number of them back at once.

    ``spec`` is a :class:`~tinkergym.protocol.types.LossSpec`; ``weights`` come from
    :func:`aggregation_weights`; ``ref_logprobs`` are needed when ``spec.kl_coef > 0``.

    The old policy of the importance ratio is ``old_logprobs`` when given (a trainer recomputed them), else
    with ``spec.old_logprobs == "trainer"`` the policy's own logprobs of this pass, detached (equal to a
    recomputation as long as no optimizer step ran since the batch was sampled, as in GRPO's one step per
    batch), else the sampler's. With ``spec.tis_cap`` > 0 each token's loss is multiplied by the truncated
    importance weight ``min(exp(trainer_old - sampler), tis_cap)``, which corrects for a sampler whose
    numerics differ from the trainer's (vLLM, a bfloat16 copy).

    The sums are mask-weighted (``mask_sum``, ``kl_sum``, ``ratio_sum``, ``clipped_sum``, ``tis_sum``,
    mismatch sums) plus ``loss`` and ``tokens``; :func:`finalize_metrics` turns accumulated sums into means.
    """
    trainer_old = old_logprobs if old_logprobs is not None else logprobs.detach()
    ratio_base: torch.Tensor | None
    if spec.name in RATIO_LOSSES and (old_logprobs is not None or spec.old_logprobs == "trainer"):
        ratio_base = trainer_old
    else:
        ratio_base = sampling_logprobs
    per_token, ratio, clipped = policy_loss(spec.name, logprobs, advantages, ratio_base, spec.clip_low, spec.clip_high, mask, getattr(spec, "beta", 0.05))
    sums: dict[str, torch.Tensor] = {"mask_sum": mask.sum(), "tokens": (mask > 0).sum()}
    if sampling_logprobs is not None:
        sampler_gap = masked_log_ratio(trainer_old.detach(), sampling_logprobs, mask)
        sums.update(_mismatch_tensors(sampler_gap, mask))
        if spec.tis_cap > 0 and spec.name in POLICY_LOSSES:
            tis = torch.exp(sampler_gap).clamp_max(spec.tis_cap)
            per_token = per_token * tis
            sums["tis_sum"] = (tis * mask).sum()
            sums["tis_capped_sum"] = ((tis >= spec.tis_cap).float() * mask).sum()
    if spec.kl_coef > 0:
        if ref_logprobs is None:
            raise ConfigError("kl_coef > 0 needs reference logprobs")
        kl = k3_kl(logprobs, ref_logprobs, mask)
        per_token = per_token + spec.kl_coef * kl
        sums["kl_sum"] = (kl.detach() * mask).sum()
    if ratio is not None:
        sums["ratio_sum"] = (ratio.detach() * mask).sum()
    if clipped is not None:
        sums["clipped_sum"] = (clipped * mask).sum()
    loss = spec.loss_scale * (per_token * weights).sum()
    sums["loss"] = loss.detach()
    return loss, {key: value.detach() for key, value in sums.items()}


def sums_to_floats(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """The scalar tensors of every dict in ``batches`` as Python floats, read back from the device in one copy.

    Each float is what ``float()`` of its tensor gives: float32 holds every float32 or bfloat16 value (and
    counts below 2**24) exactly; float64 is used only when some value is float64 (MPS has no float64).
    """
    values = [value.reshape(()) for sums in batches for value in sums.values()]
    if not values:
        return [{} for _ in batches]
    dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
    values = [v.to(dtype) for v in values]
    flat = iter(torch.stack(values).tolist())
    return [{key: next(flat) for key in sums} for sums in batches]


def add_sums(total: dict[str, float], sums: dict[str, float]) -> dict[str, float]:
    """``total`` with each of ``sums`` added in (a new dict); keys ending in ``_max`` keep the maximum."""
    out = dict(total)
    for key, value in sums.items():
        if key.endswith("_max"):
            out[key] = max(out.get(key, value), value)
        else:
            out[key] = out.get(key, 0.0) + value
    return out


#: Accumulated sum -> the metric it becomes when divided by the summed mask.
_MEANS = (
    ("kl_sum", "kl"),
    ("ratio_sum", "ratio_mean"),
    ("clipped_sum", "clip_fraction"),
    ("tis_sum", "tis/weight_mean"),
    ("tis_capped_sum", "tis/capped_fraction"),
    ("mismatch_abs_sum", "mismatch/logp_abs_mean"),
    ("mismatch_kl_sum", "mismatch/kl"),
)


def finalize_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Means from accumulated sums: ``loss``, ``tokens`` and, where computed, ``kl``, ``ratio_mean``,
    ``clip_fraction``, ``tis/*`` and the sampler/trainer mismatch ``mismatch/logp_abs_mean``,
    ``mismatch/logp_abs_max`` and ``mismatch/kl``."""
    denom = max(sums.get("mask_sum", 0.0), 1e-12)
    metrics = {"loss": sums.get("loss", 0.0), "tokens": sums.get("tokens", 0.0)}
    for key, name in _MEANS:
        if key in sums:
            metrics[name] = sums[key] / denom
    if "mismatch_abs_max" in sums:
        metrics["mismatch/logp_abs_max"] = sums["mismatch_abs_max"]
    return metrics
