"""Plain pieces of a training pass shared by every torch engine: a request's checks, its rows collated on the
device, and one AdamW step over a list of trainable tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tinkergym.backends.torch import losses
from tinkergym.backends.torch.scoring import host_to_device, read_positions
from tinkergym.errors import ConfigError, NonFiniteError
from tinkergym.protocol.types import MAX_IMAGES, Datum, ForwardBackwardRequest, LossSpec, OptimParams


@dataclass
class Batch:
    """A right-padded micro-batch on the device; per-token tensors are None when the request has none."""

    tokens: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)
    #: Every position >= 1 that any row reads, known on the host.
    read: list[int] = field(default_factory=list)
    #: More arguments of the forward pass: a vision-language model's pixels and positions (empty for text).
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def _pad_right(rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return host_to_device(out, device)


#: Why an engine without a vision-language model refuses a request with images.
NO_IMAGES = ("this backend's model reads no images: send images only to a TorchBackend of a vision-language model "
             "(a model folder with a vision_config and an image processor, e.g. Qwen2-VL)")


def validate_data(data: list[Datum], spec: LossSpec, reads_images: bool = False) -> None:
    """A training request's checks: every datum's arrays as long as its tokens, what the loss needs, and images only
    where the model reads them (``reads_images``)."""
    losses.validate_spec(spec)
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            raise ConfigError(f"datum {i} has no tokens")
        if datum.images and not reads_images:
            raise ConfigError(f"datum {i} carries images, but {NO_IMAGES}")
        if len(datum.loss_mask) != n:
            raise ConfigError(f"datum {i}: loss_mask has {len(datum.loss_mask)} entries for {n} tokens; give one per token")
        for name in ("loss_mask", "advantages", "sampling_logprobs", "old_logprobs"):
            values = getattr(datum, name)
            if name != "loss_mask" and values and len(values) != n:  # (loss_mask's length: just above)
                raise ConfigError(f"datum {i}: {name} has {len(values)} entries for {n} tokens; give one per token (or none)")
            # A NaN anywhere makes the sum NaN (max() may step over one: NaN compares false); the max bounds each entry.
            if values and not (math.isfinite(sum(map(abs, values))) and max(map(abs, values)) <= losses.MAX_LOSS_NUMBER):
                raise ConfigError(f"datum {i}: {name} holds {_worst(values)!r}: every entry must be a finite number of at most "
                                  f"{losses.MAX_LOSS_NUMBER:.0e} in size")
    for name, needed in (("advantages", losses.POLICY_LOSSES), ("sampling_logprobs", losses.RATIO_LOSSES)):
        if spec.name in needed and not all(getattr(d, name) for d in data):
            raise ConfigError(f"the {spec.name!r} loss needs {name} on every datum")


def _worst(values: list[float]) -> float:
    """The entry of ``values`` that breaks the bound: a NaN, else the largest in size."""
    return next((v for v in values if v != v), max(values, key=abs))


def request_normalizers(request: ForwardBackwardRequest) -> tuple[float, int]:
    """``(tokens, sequences)`` a request's loss is normalized by: its ``num_tokens``/``num_sequences``, else its masked-in
    tokens and the sequences that have any."""
    data = request.data
    total = sum(sum(d.loss_mask[1:]) for d in data) if request.num_tokens is None else request.num_tokens
    sequences = request.num_sequences
    if sequences is None:
        sequences = sum(1 for d in data if any(m != 0 for m in d.loss_mask[1:]))
    return total, sequences


def check_prompts(prompts: list[list[int]], images: Sequence[Sequence[object]] | None = None, reads_images: bool = False) -> None:
    """A sample request's prompts each need a token, and carry ``images`` only where the model reads them (``reads_images``):
    refuse anything else with a :class:`ConfigError`."""
    if images and any(images) and not reads_images:
        raise ConfigError(f"the prompts carry images, but {NO_IMAGES}")
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token (e.g. the chat template's generation prompt)")


def sample_batches(prompts: Sequence[int], num_samples: int, most: int) -> list[list[int]]:
    """How a sample request's sequences are decoded: each of ``prompts`` (indices) ``num_samples`` times, in order, cut
    into batches of at most ``most`` (a prompt's samples may span two). Every torch engine batches a request so, which
    keeps its draws the same wherever it runs (alone, beside other tenants' calls, or in slices)."""
    flat = [i for i in prompts for _ in range(num_samples)]
    return [flat[first : first + most] for first in range(0, len(flat), most)]


def check_scored_images(sequences: list[list[int]], images: Sequence[Sequence[object]] | None, reads_images: bool) -> None:
    """A ``logprobs`` call's ``images`` (None for text): one list per sequence, at most :data:`MAX_IMAGES` each, and only
    where the model reads images; a :class:`ConfigError` says what is wrong (a vision model's row checks come after)."""
    if images is None:
        return
    if len(images) != len(sequences):
        raise ConfigError(f"images must hold one list per sequence ({len(sequences)}), not {len(images)}")
    for i, row in enumerate(images):
        if len(row) > MAX_IMAGES:
            raise ConfigError(f"sequence {i} carries {len(row)} images; at most {MAX_IMAGES} are allowed")
    check_prompts(sequences, images, reads_images)


def collate(data: list[Datum], device: torch.device, width: int | None = None, per_token: bool = True) -> Batch:
    """``data`` right-padded to ``width`` (default: its longest row) on ``device``; with ``per_token`` False, without the
    advantages and logprobs (a pass whose losses read them from other batches)."""
    width = max(len(d.tokens) for d in data) if width is None else width
    # Right padding with id 0: causal attention never lets a real token see the padding after it.
    tokens = _pad_right([d.tokens for d in data], width, torch.long, device)
    attention = _pad_right([[1] * len(d.tokens) for d in data], width, torch.long, device)
    # The first token is not predicted by anything.
    mask = _pad_right([[0.0, *d.loss_mask[1:]] for d in data], width, torch.float32, device)
    batch = Batch(tokens=tokens, attention=attention, mask=mask, lengths=[len(d.tokens) for d in data], read=read_positions(data))
    if not per_token:
        return batch
    if all(d.advantages for d in data):
        batch.advantages = _pad_right([d.advantages for d in data], width, torch.float32, device)
    if all(d.sampling_logprobs for d in data):
        batch.sampling_logprobs = _pad_right([d.sampling_logprobs for d in data], width, torch.float32, device)
    if all(d.old_logprobs for d in data):
        batch.old_logprobs = _pad_right([d.old_logprobs for d in data], width, torch.float32, device)
    return batch


def adamw_step(optimizer: torch.optim.Optimizer, trainable: Sequence[torch.Tensor], params: OptimParams, step: int) -> tuple[dict[str, float], bool]:
    """One AdamW step of ``optimizer`` with the gradients of ``trainable`` (clipped to ``max_grad_norm``), then clear them.

    Returns the metrics (``grad_norm`` before clipping, ``learning_rate``, the new ``step``) and whether it
    stepped: a non-finite gradient norm steps nothing (the gradients are dropped; the caller sees ``grad_norm``),
    and weights made NaN or infinite by the step raise :class:`NonFiniteError` before they reach a checkpoint.
    """
    for group in optimizer.param_groups:
        group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps, weight_decay=params.weight_decay)
    grads = [p.grad for p in trainable if p.grad is not None]
    kinds = _by_kind([p for p in trainable if p.grad is not None])
    if len(kinds) > 1:  # a sharded model's shards beside the weights every rank keeps whole: one norm over both
        norms = [float(torch.nn.utils.get_total_norm([p.grad for p in kind if p.grad is not None])) for kind in kinds]
        grad_norm = math.sqrt(math.fsum(n * n for n in norms))
        if params.max_grad_norm > 0:
            for kind in kinds:
                torch.nn.utils.clip_grads_with_norm_(kind, params.max_grad_norm, torch.tensor(grad_norm))
    elif params.max_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, params.max_grad_norm))
    else:
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    if not math.isfinite(grad_norm):  # never write NaN into the weights
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "learning_rate": params.learning_rate, "step": float(step)}, False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "learning_rate": params.learning_rate, "step": float(step + 1)}, True


def _by_kind(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` as plain tensors and DTensors apart (torch's norms and clipping take one kind at a time); empty kinds left out."""
    kinds: dict[bool, list[torch.Tensor]] = {}
    for p in params:
        kinds.setdefault(hasattr(p.grad, "full_tensor"), []).append(p)
    return list(kinds.values())


def check_weights_finite(trainable: Sequence[torch.Tensor], step: int, learning_rate: float) -> None:
    """Raise :class:`NonFiniteError` when an optimizer step made any of ``trainable`` NaN or infinite (a sharded weight, a
    DTensor, is gathered whole first: every rank calls this)."""
    # NaN and inf propagate into sums: one number per tensor.
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainable]
    if not bool(torch.stack([p.detach().sum(dtype=torch.float32) for p in whole]).isfinite().all()):
        raise NonFiniteError(f"optimizer step {step} made weights NaN or infinite (learning rate {learning_rate:g})")
