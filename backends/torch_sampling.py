"""Batched token sampling with a transformers causal LM and its KV cache, over left-padded prompts.

The logprob reported for a sampled token is the log-softmax of the distribution it was actually drawn from:
logits divided by the temperature, then restricted by top-k / top-p and renormalized. With temperature 1
and no filters that is the policy's own logprob. Greedy decoding (temperature 0) reports the untempered
policy logprob of the chosen token, since the point mass it samples from would report 0 for every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinkergym.backends.torch_scoring import padded_length_limit
from tinkergym.backends.types import SampledSequence, SamplingParams
from tinkergym.errors import NonFiniteError


def filter_logits(logits_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits with everything outside the top-k and the top-p nucleus set to -inf (0 / 1 switch a filter off).

    The most likely token always survives, so the result is never all -inf.
    """
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_BV, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the tokens ranked above it already reach top_p on their own.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


def draw(probs_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row with probability ``probs_BV`` (rows need not sum to exactly 1), by inverting the CDF.

    One uniform number per row instead of ``torch.multinomial``'s random number per vocabulary entry, which
    costs more than the model's own decode step on a CPU. Entries with probability 0 are never drawn.
    """
    cdf_BV = probs_BV.cumsum(dim=-1)
    u_B1 = torch.rand((probs_BV.shape[0], 1), generator=generator, device=probs_BV.device) * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, u_B1, right=True).clamp_max(probs_BV.shape[-1] - 1).squeeze(-1)


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the distribution it was drawn from (see the module docstring).

    Probabilities are float32 whatever the logits' dtype; at temperature 1 without filters they come straight
    from the logits in one softmax pass, the chosen token's logprob is the log of its probability.
    """
    # NaN propagates through max, and a row of -inf has no finite max: one reduction checks every row.
    if not bool(torch.isfinite(logits_BV.amax(dim=-1)).all()):  # a diverged model: say so instead of a torch error
        raise NonFiniteError("the model's logits are NaN or infinite: the weights have diverged")
    if params.temperature <= 0:
        tokens_B = logits_BV.argmax(dim=-1)
        chosen = logits_BV.gather(-1, tokens_B[:, None]).squeeze(-1).float()
        return tokens_B, chosen - torch.logsumexp(logits_BV.float(), dim=-1)
    scaled = logits_BV
    if params.temperature != 1.0 or params.top_k > 0 or params.top_p < 1.0:
        scaled = filter_logits(logits_BV.float() / params.temperature, params.top_k, params.top_p)
    probs_BV = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    tokens_B = draw(probs_BV, generator)
    return tokens_B, probs_BV.gather(-1, tokens_B[:, None]).squeeze(-1).log()


@dataclass
class _Rows:
    """Growing outputs of a batch: ids and logprobs per row, and which rows have stopped."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: torch.Tensor

    def append(self, tokens_B: torch.Tensor, logprobs_B: torch.Tensor, stop_ids: torch.Tensor) -> None:
        """Record one step's token and logprob for every row still running, then mark rows that hit a stop id."""
        for row, (token, logprob, done) in enumerate(zip(tokens_B.tolist(), logprobs_B.tolist(), self.finished.tolist())):
            if not done:
                self.tokens[row].append(token)
                self.logprobs[row].append(logprob)
        self.finished |= torch.isin(tokens_B, stop_ids)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` of prompts padded on the left, positions counted from each prompt's start."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention[row, width - len(prompt) :] = 1
    positions = (attention.cumsum(dim=-1) - 1).clamp_min(0)
    return input_ids.to(device), attention.to(device), positions.to(device)


def prefill(
    model: torch.nn.Module, prompts: list[list[int]], pad_id: int, device: torch.device, share_prompts: bool = True
) -> tuple[torch.Tensor, object, torch.Tensor, torch.Tensor]:
    """Run the prompts through the model once: ``(last logits [B, V], KV cache, attention mask, positions)``.

    Identical prompts (a GRPO group asks for many samples of one prompt) are run once, and their cache rows
    are copied to every sample that shares them: the prefill costs the distinct prompts, not the samples.
    ``share_prompts=False`` runs every row.
    """
    distinct: dict[tuple[int, ...], int] = {}
    row_of = [distinct.setdefault(tuple(p), len(distinct)) if share_prompts else i for i, p in enumerate(prompts)]
    unique = [list(p) for p in distinct] if share_prompts else prompts
    input_ids, attention, positions = left_pad(unique, pad_id, device)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1)
    logits_BV, cache = out.logits[:, -1], out.past_key_values
    if len(unique) < len(prompts):
        index = torch.tensor(row_of, dtype=torch.long, device=device)
        cache.batch_select_indices(index)
        logits_BV, attention, positions = logits_BV[index], attention[index], positions[index]
    return logits_BV, cache, attention, positions


@torch.inference_mode()
def sample_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    stop_ids: list[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    share_prompts: bool = True,
) -> list[SampledSequence]:
    """Sample one completion per prompt, all prompts in one batch sharing one KV cache.

    A row stops at the first token in ``stop_ids`` (kept as its last id, finish reason ``"stop"``) or after
    ``params.max_new_tokens`` (``"length"``). Rows that stopped keep being fed a pad token, which nothing reads.
    Identical prompts are prefilled once (see :func:`prefill`). Prompts of different lengths run apart when
    left padding would change the model's results (see :func:`~tinkergym.backends.torch_scoring.padded_length_limit`).
    """
    limit = padded_length_limit(model)
    widths = sorted({len(p) for p in prompts})
    if limit is not None and len(widths) > 1 and widths[-1] + params.max_new_tokens > limit:
        by_row: dict[int, SampledSequence] = {}
        for width in widths:
            indices = [i for i, p in enumerate(prompts) if len(p) == width]
            by_row.update(zip(indices, sample_batch(model, [prompts[i] for i in indices], params, stop_ids, pad_id, generator, share_prompts)))
        return [by_row[i] for i in range(len(prompts))]
    device = next(model.parameters()).device
    logits_BV, cache, attention, positions = prefill(model, prompts, pad_id, device, share_prompts)
    stop_B = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    rows = _Rows([[] for _ in prompts], [[] for _ in prompts], torch.zeros(len(prompts), dtype=torch.bool, device=device))
    next_position = positions[:, -1:] + 1
    for step in range(params.max_new_tokens):
        tokens_B, logprobs_B = sample_next(logits_BV, params, generator)
        tokens_B = torch.where(rows.finished, torch.full_like(tokens_B, pad_id), tokens_B)
        rows.append(tokens_B, logprobs_B, stop_B)
        if bool(rows.finished.all()) or step + 1 == params.max_new_tokens:
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(
            input_ids=tokens_B[:, None],
            attention_mask=attention,
            position_ids=next_position,
            past_key_values=cache,
            use_cache=True,
        )
        logits_BV, cache = out.logits[:, -1], out.past_key_values
        next_position = next_position + 1
    stops = set(stop_ids)
    return [
        SampledSequence(tokens=t, logprobs=lp, finish_reason="stop" if t and t[-1] in stops else "length")
        for t, lp in zip(rows.tokens, rows.logprobs)
    ]
