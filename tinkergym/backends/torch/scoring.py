"""Token logprobs of training sequences under a causal LM, computed with as little repeated work as possible.

Two savings, both exact up to floating-point summation order:

- Shared prefixes. The samples of a GRPO group start with the same prompt, which carries no loss (mask 0).
  :func:`plan_micro_batches` groups sequences whose whole masked-out prompt is identical and packs groups
  into micro-batches by a token budget; :func:`sequence_logprobs` runs each group's prompt once, repeats its
  KV cache for the group's rows and runs only the rows' own tokens on top of it. Gradients flow back through
  the repeated cache into the prompt's single forward pass, so the prompt's contribution to the gradient is
  the same as with one copy per sample.
  With 8 samples of a 100-token prompt and 25-token completions this scores ~300 tokens instead of ~1,000.
  Groups with prompts of different lengths share a micro-batch: each prompt is padded on the left, so its
  rows' tokens follow it directly in the KV cache. Sliding-window and chunked attention measure distances in
  cache indices (and chunks from the first unpadded one), so this is exact for every attention layout
  transformers builds masks for: full, sliding-window, chunked and stacks that mix them. Llama 4's
  attention temperature tuning scales queries by cache index, not position; past its ``floor_scale``
  prompts of different lengths are run apart (see :func:`padded_length_limit`), each length still shared.
- Logits only where a loss is read. Positions before the first masked-in token of a micro-batch produce no
  logits (the vocabulary projection and log-softmax are a large share of a small model's work).

Sequences without a shared prompt (SFT transcripts, single samples) are scored the ordinary way, right-padded.

Gradient checkpointing (see ``TorchBackendConfig.gradient_checkpointing``) keeps the shared prompt: both passes
hand their layers a KV cache whose update a checkpointed layer may repeat when the backward pass recomputes it
(:func:`replayable_cache`), so the prompt's keys and values still reach its rows and gradients flow back.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import torch

from tinkergym.backends.torch import losses
from tinkergym.backends.torch.cache_names import cache_kwargs, cache_of
from tinkergym.backends.torch.copies import update_in
from tinkergym.backends.torch.row_adapters import pick, rows_through
from tinkergym.protocol.types import Datum


@dataclass
class MicroBatch:
    """Data scored together: their indices, and for shared prompts the size and prompt length of each group.

    With ``group_sizes`` empty the rows are scored on their own. Otherwise the rows come in consecutive
    groups of ``group_sizes[g]`` rows that start with the same ``prefix_lens[g]`` tokens.
    """

    indices: list[int]
    group_sizes: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)

    def tokens(self, data: Sequence[Datum]) -> int:
        """The tokens the pass runs through the model: its rows', a shared prompt's once (what its memory grows with)."""
        return sum(len(data[i].tokens) for i in self.indices) - sum((n - 1) * (p - 1) for n, p in zip(self.group_sizes, self.prefix_lens))


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor built from Python lists) on ``device``, without making the host wait for a GPU.

    On CUDA the copy goes through pinned memory with ``non_blocking=True``: a copy from pageable memory blocks
    the host until the GPU has caught up, which would stall the queue of kernels once per copied tensor.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def first_loss_position(datum: Datum) -> int | None:
    """The first position (>= 1) with a non-zero loss mask, or None when the datum carries no loss."""
    return next((t for t in range(1, len(datum.tokens)) if datum.loss_mask[t] != 0), None)


def plan_micro_batches(
    data: list[Datum], micro_batch_size: int, share_prefixes: bool = True, kv_cost: float = 0.0, scopes: list[int] | None = None,
) -> list[MicroBatch]:
    """Split the request into micro-batches that each cost at most what ``micro_batch_size`` sequences would.

    With ``share_prefixes``, sequences whose tokens before the first masked-in position are identical (two
    or more of them) share that prompt: a group costs its prompt once plus each member's own tokens, and
    groups are packed into micro-batches up to ``micro_batch_size`` times the longest sequence's tokens (the
    memory an unshared micro-batch may take). The other sequences form micro-batches of ``micro_batch_size``
    in their original order.

    Each shared row also holds its own copy of the prompts' KV cache, as wide as the micro-batch's longest
    prompt (shorter ones are padded to it): ``kv_cost`` is what one cache entry costs, in tokens run through
    the model (0 leaves the copies out; see ``TorchBackend`` for the estimate it passes). ``scopes``: each datum's
    adapter on a shared base; only sequences of one scope share a prompt (a prompt's keys depend on the adapter).
    """
    groups: dict[tuple, list[int]] = {}
    rest: list[int] = []
    for i, datum in enumerate(data):
        first = first_loss_position(datum) if share_prefixes else None
        if first is None or first < 2:
            rest.append(i)
        else:
            groups.setdefault((-1 if scopes is None else scopes[i], tuple(datum.tokens[:first])), []).append(i)
    budget = micro_batch_size * max((len(d.tokens) for d in data), default=1)
    batches: list[MicroBatch] = []
    current, cost, width = MicroBatch([]), 0, 0  # width: the longest shared prompt in `current`, which every row's cache copy spans
    for (_, prompt), members in groups.items():
        if len(members) < 2:
            rest.extend(members)
            continue
        opened = False  # whether this group already has rows in `current`
        for i in members:
            extra = len(data[i].tokens) - len(prompt) + 1 + (0 if opened else len(prompt) - 1)
            wider = max(width, len(prompt) - 1)
            if current.indices and cost + extra + kv_cost * (len(current.indices) + 1) * wider > budget:
                batches.append(current)
                current, cost, opened = MicroBatch([]), 0, False
                extra, wider = len(data[i].tokens), len(prompt) - 1
            if not opened:
                current.group_sizes.append(0)
                current.prefix_lens.append(len(prompt))
                opened = True
            current.indices.append(i)
            current.group_sizes[-1] += 1
            cost, width = cost + extra, wider
    if current.indices:
        batches.append(current)
    rest.sort()
    batches.extend(MicroBatch(rest[start : start + micro_batch_size]) for start in range(0, len(rest), micro_batch_size))
    return batches


def logprobs_from(
    model: torch.nn.Module, tokens_BT: torch.Tensor, attention_BT: torch.Tensor, start: int = 1, temperature: float = 1.0,
    adapters: list[int] | None = None, model_inputs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` logprobs of right-padded rows at ``temperature``, with logits only for positions ``start - 1`` onward (earlier entries are 0).

    ``adapters``: each row's adapter on a shared base (see :mod:`~tinkergym.backends.torch.row_adapters`). ``model_inputs``:
    more arguments of the forward pass (a vision-language model's pixels and positions, see :mod:`~tinkergym.backends.torch.vision`).
    """
    batch, length = tokens_BT.shape
    keep_from = max(start - 1, 0)
    with rows_through(adapters):
        logits = model(input_ids=tokens_BT, attention_mask=attention_BT, use_cache=False, logits_to_keep=length - keep_from, **(model_inputs or {})).logits
    scored = losses.token_logprobs(logits, tokens_BT[:, keep_from:], temperature=temperature)
    zeros = torch.zeros(batch, keep_from, dtype=scored.dtype, device=scored.device)
    return torch.cat([zeros, scored], dim=1)


def logprobs_at(
    model: torch.nn.Module, tokens_BT: torch.Tensor, attention_BT: torch.Tensor, read: list[int], temperature: float = 1.0,
    adapters: list[int] | None = None, model_inputs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` logprobs of right-padded rows at ``temperature``, with logits only where some row reads (``read``: positions >= 1).

    A multi-turn episode reads its sampled turns only, a small share of a sequence that is mostly the env's
    replies: the vocabulary projection and log-softmax run on the hidden states of the positions before the
    read ones, gathered, instead of on every position from the first read one on. Other entries are 0.
    """
    batch, length = tokens_BT.shape
    index = host_to_device(torch.tensor(read, dtype=torch.long), tokens_BT.device)
    with rows_through(adapters):
        logits = model(input_ids=tokens_BT, attention_mask=attention_BT, use_cache=False, logits_to_keep=index - 1, **(model_inputs or {})).logits
    scored = losses.target_logprobs(logits, tokens_BT.index_select(1, index), temperature=temperature)
    return scored.new_zeros(batch, length).index_copy(1, index, scored)


def read_positions(data: list[Datum]) -> list[int]:
    """The positions (>= 1) where any datum's loss mask is non-zero, in order."""
    return sorted({t for d in data for t in range(1, len(d.tokens)) if d.loss_mask[t] != 0})


def padded_length_limit(model: torch.nn.Module) -> int | None:
    """How many cache indices a left-padded row may span before padding changes the model's results; None: no limit.

    Attention masks (full, sliding-window, chunked) see through left padding. Llama 4's attention temperature
    tuning does not: its NoPE layers scale queries by ``floor((i + 1) / floor_scale)`` of the cache index
    ``i``, not of the position, so a padded row's scales differ from its own once indices reach
    ``floor_scale - 1``. Past that, callers run prompts of different lengths apart.
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if config is not None and getattr(config, "attn_temperature_tuning", False) and 0 in (getattr(config, "no_rope_layers", None) or []):
        return int(config.floor_scale) - 1
    return None


def _left_padded_prefixes(rows_GT: torch.Tensor, shared: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` ``[G, width]`` of each row's first ``shared[g]`` tokens, padded on the left.

    Each prompt ends at column ``width - 1``, so the tokens run after it (cache index ``width + j``) sit
    exactly as far from every prompt token, in cache indices, as in the unpadded sequence. Sliding-window
    masks measure distance in cache indices, and chunked masks count chunks from the first unpadded column:
    with right padding, a shorter prompt's tokens would look further away than they are.
    """
    device = rows_GT.device
    pads = width - host_to_device(torch.tensor(shared), device)
    columns = torch.arange(width, device=device)[None] - pads[:, None]
    mask = columns >= 0
    positions = columns.clamp_min(0)
    ids = torch.where(mask, rows_GT[:, :width].gather(1, positions), torch.zeros_like(positions))
    return ids, mask.long(), positions


def _shared_prefix_logprobs(
    model: torch.nn.Module,
    tokens_BT: torch.Tensor,
    lengths: list[int],
    group_sizes: list[int],
    prefix_lens: list[int],
    temperature: float = 1.0,
    adapters: list[int] | None = None,
) -> torch.Tensor:
    """``[B, T]`` logprobs of rows in groups that share a prompt, each group's prompt run once (a group's rows share an adapter).

    One pass runs the groups' prompts but their last token (left-padded, see :func:`_left_padded_prefixes`;
    no logits: an empty ``logits_to_keep``); its KV cache is repeated for each group's rows. A second pass
    runs every row from its prompt's last token on, whose logits predict the row's first own token, so every
    prediction comes out of that one batched pass. Padding inside the cache is masked out; positions
    continue each prompt, and so do cache indices, which sliding-window and chunked layers measure by. Rows
    of very different lengths run in separate passes on the same prompt cache (see :func:`length_chunks`).
    """
    length = tokens_BT.shape[1]
    shared = [p - 1 for p in prefix_lens]
    shared_of_row = [s for s, size in zip(shared, group_sizes) for _ in range(size)]
    own = [n - s for n, s in zip(lengths, shared_of_row)]
    limit = padded_length_limit(model)
    if limit is not None and len(set(shared)) > 1 and max(shared) + max(own) > limit:
        parts = _own_token_logits_by_prompt_length(model, tokens_BT, lengths, group_sizes, shared, adapters)
    else:
        parts = _own_token_logits(model, tokens_BT, lengths, group_sizes, shared, adapters)
    out: dict[int, torch.Tensor] = {}  # by row: the parts cover every row
    for rows, rows_BS, logits in parts:
        scored_BS = losses.token_logprobs(logits, rows_BS, temperature=temperature)
        for i, row in enumerate(rows):
            s, n = shared_of_row[row], own[row]
            out[row] = torch.cat([scored_BS.new_zeros(s), scored_BS[i, :n], scored_BS.new_zeros(length - s - n)])
    return torch.stack([out[row] for row in range(len(lengths))])


#: What one more pass over a chunk of rows costs, in padded tokens, by device type (see :func:`length_chunks`).
CHUNK_OVERHEAD_TOKENS = {"cpu": 32, "cuda": 4096}


def length_chunks(own: list[int], overhead: int) -> list[list[int]]:
    """Rows grouped into passes by length: ``[row indices]`` per pass, longest rows first.

    Rows run right-padded to the longest row of their pass, so a pass of rows of very different lengths mostly
    computes padding. The rows sorted by length are cut where that saves more padded tokens than the
    ``overhead`` of another pass costs (an exact minimum over contiguous cuts). On a GPU a pass's fixed cost
    is large next to a token's and rows rarely split; on a CPU compute is paid per token.
    """
    order = sorted(range(len(own)), key=lambda r: -own[r])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j rows (longest first)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows i..j-1 in one pass, padded to row i's length
            cost = best[i] + overhead + (j - i) * own[order[i]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], n
    while j > 0:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def _own_token_logits(
    model: torch.nn.Module, tokens_BT: torch.Tensor, lengths: list[int], group_sizes: list[int], shared: list[int], adapters: list[int] | None = None
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """``[(rows, rows_BS, logits_BSV)]``: rows from their prompt's last token on (right-padded) and their logits, pass by pass.

    Group ``g``'s first ``shared[g]`` tokens run once, left-padded (see :func:`_left_padded_prefixes`); its
    KV cache serves every pass (see :func:`length_chunks`).
    """
    device = tokens_BT.device
    length = tokens_BT.shape[1]
    # Every index is known on the host: built there and copied once, so the device never waits on the host.
    group_of_rows = [g for g, size in enumerate(group_sizes) for _ in range(size)]
    own = [n - shared[g] for n, g in zip(lengths, group_of_rows)]
    starts_host = list(itertools.accumulate(group_sizes, initial=0))[:-1]
    starts = host_to_device(torch.tensor(starts_host, dtype=torch.long), device)
    width = max(shared)
    prefix_ids, prefix_mask, prefix_positions = _left_padded_prefixes(tokens_BT[starts], shared, width)
    no_logits = torch.empty(0, dtype=torch.long, device=device)
    prefix = {"input_ids": prefix_ids, "attention_mask": prefix_mask, "position_ids": prefix_positions, "logits_to_keep": no_logits}
    use_cache = not _checkpoints_layers(model)
    with rows_through(pick(adapters, starts_host)):
        if use_cache:
            prefix_cache = cache_of(model(**prefix, use_cache=True))
            _store_in_compute_dtype(prefix_cache)
        else:
            # Transformers turns `use_cache` off under checkpointing (with a warning) and makes no cache, but layers
            # that may keep one still get a cache given explicitly; each pass gets one its recomputes can replay.
            prefix_cache = replayable_cache(model)
            model(**prefix, **cache_kwargs(prefix_cache), use_cache=False)
    parts = []
    for rows in length_chunks(own, CHUNK_OVERHEAD_TOKENS.get(device.type, CHUNK_OVERHEAD_TOKENS["cuda"])):
        span = max(own[r] for r in rows)
        group_of, offsets, own_B = (
            host_to_device(torch.tensor(values, dtype=torch.long), device)
            for values in ([group_of_rows[r] for r in rows], [shared[group_of_rows[r]] for r in rows], [own[r] for r in rows])
        )
        index = host_to_device(torch.tensor(rows, dtype=torch.long), device)
        steps = torch.arange(span, device=device)[None]
        rows_mask = steps < own_B[:, None]
        columns = (offsets[:, None] + steps).clamp_max(length - 1)
        rows_BS = torch.where(rows_mask, tokens_BT[index].gather(1, columns), torch.zeros_like(columns))
        attention = torch.cat([prefix_mask[group_of], rows_mask.long()], dim=1)
        with rows_through(pick(adapters, rows)):
            logits = model(
                input_ids=rows_BS,
                attention_mask=attention,
                position_ids=offsets[:, None] + steps,
                **cache_kwargs(cache_rows(prefix_cache, group_of)),
                use_cache=use_cache,
            ).logits
        parts.append((rows, rows_BS, logits))
    return parts


def _store_in_compute_dtype(cache: Any) -> None:
    """Round ``cache``'s keys and values to autocast's compute dtype, in place, before they are copied per row.

    Float32 master weights (full fine-tuning under autocast) make the rotary embedding return float32 keys, and
    transformers then concatenates the values into float32 too: each row's copy of its prompt's cache would take
    twice the memory :func:`~tinkergym.backends.torch.copies.kv_token_cost` counts. Attention reads keys and
    values in the compute dtype anyway (autocast casts its inputs), so the forward pass is unchanged. The cast
    is differentiable. The cache's ``update`` then rounds the keys and values the rows' own tokens append the
    same way (a no-op where they come in the compute dtype already).
    """
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.is_floating_point()]
    if not layers or not torch.is_autocast_enabled(layers[0].keys.device.type):
        return
    dtype = torch.get_autocast_dtype(layers[0].keys.device.type)
    cast = [layer for layer in layers if {layer.keys.dtype, layer.values.dtype} != {dtype}]
    for layer in cast:
        layer.keys, layer.values, layer.dtype = layer.keys.to(dtype), layer.values.to(dtype), dtype
    if "update" not in cache.__dict__:
        cache.update = functools.partial(update_in, dtype, cache.update)


def _checkpoints_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs its layers under gradient checkpointing now (it does only in training mode)."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


@functools.cache
def _replayable_cache_class() -> type:
    from transformers import DynamicCache

    class ReplayableCache(DynamicCache):
        """A DynamicCache for one forward pass whose layers may run twice: a checkpointed layer's recompute in the
        backward pass calls ``update`` again, and gets what the forward pass got, without changing the cache.

        Each layer's state is remembered (a shallow copy: cache layers replace their tensors, never write into
        them) before its first update; a second update of the same layer runs on a copy of that state.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.before_update: dict[int, Any] = {}

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
            if layer_idx in self.before_update:
                return copy.copy(self.before_update[layer_idx]).update(key_states, value_states, *args, **kwargs)
            layer_class = getattr(self, "layer_class_to_replicate", None)
            if layer_class is not None:
                while len(self.layers) <= layer_idx:
                    self.layers.append(layer_class())
            self.before_update[layer_idx] = copy.copy(self.layers[layer_idx])
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return ReplayableCache


def cache_rows(cache: Any, indices: torch.Tensor) -> Any:
    """A new cache for the next pass holding rows ``indices`` of ``cache``, which stays as it is.

    A shallow copy (cache layers replace their tensors, never write into them): ``cache`` serves several passes,
    and a :func:`replayable_cache` its own recomputes. Keys and values are stored in the compute dtype (see
    :func:`_store_in_compute_dtype`) before the rows are copied.
    """
    rows = copy.copy(cache)
    rows.__dict__.pop("update", None)  # a wrapper of the original's update (see _store_in_compute_dtype)
    rows.layers = [_copy_layer(layer) for layer in cache.layers]
    if hasattr(rows, "before_update"):
        rows.before_update = {}
    _store_in_compute_dtype(rows)
    rows.batch_select_indices(indices)
    return rows


def _copy_layer(layer: Any) -> Any:
    """A shallow copy of a cache layer whose ``update`` writes into the copy: a layer of a cache that a frozen copy's
    hook made (:func:`~tinkergym.backends.torch.copies._cache_in`) carries an ``update`` wrapper bound to that layer,
    which a plain copy would keep (every row pass would then append to the prompt's own cache)."""
    new = copy.copy(layer)
    wrapper = new.__dict__.pop("update", None)
    if isinstance(wrapper, functools.partial) and wrapper.func is update_in:
        new.update = functools.partial(update_in, wrapper.args[0], new.update)
    elif wrapper is not None:
        raise TypeError(f"cannot copy a KV cache layer whose update was replaced by {wrapper!r}")
    return new


def replayable_cache(model: torch.nn.Module) -> Any:
    """An empty KV cache for ``model`` that checkpointed layers can use (see ``ReplayableCache`` in :func:`_replayable_cache_class`)."""
    return _replayable_cache_class()(config=model.config)


def _own_token_logits_by_prompt_length(
    model: torch.nn.Module, tokens_BT: torch.Tensor, lengths: list[int], group_sizes: list[int], shared: list[int], adapters: list[int] | None = None
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """:func:`_own_token_logits` run once per distinct prompt length, so that no prompt is padded (see :func:`padded_length_limit`)."""
    starts = list(itertools.accumulate(group_sizes, initial=0))
    parts = []
    for width in sorted(set(shared)):
        groups = [g for g, s in enumerate(shared) if s == width]
        rows = [r for g in groups for r in range(starts[g], starts[g + 1])]
        sizes = [group_sizes[g] for g in groups]
        picked = tokens_BT.index_select(0, host_to_device(torch.tensor(rows, dtype=torch.long), tokens_BT.device))
        for chunk, rows_BS, logits in _own_token_logits(model, picked, [lengths[r] for r in rows], sizes, [width] * len(groups), pick(adapters, rows)):
            parts.append(([rows[i] for i in chunk], rows_BS, logits))
    return parts


def sequence_logprobs(
    model: torch.nn.Module,
    tokens_BT: torch.Tensor,
    attention_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    micro: MicroBatch | None = None,
    temperature: float = 1.0,
    lengths: list[int] | None = None,
    read: list[int] | None = None,
    adapters: list[int] | None = None,
    model_inputs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Float32 ``[B, T]`` logprobs of right-padded sequences at ``temperature`` (entry ``t`` scores ``tokens[t]``; unread entries are 0).

    ``micro`` says which rows share prompts (see :class:`MicroBatch`); ``mask_BT`` tells which positions are
    read, so rows scored on their own skip the logits before the first one. Callers that hold the data on the
    host pass the rows' ``lengths`` and ``read`` (every position >= 1 any row reads, see :func:`read_positions`);
    without them both are read back from the device, which makes the host wait for a GPU. Rows scored on their
    own whose reads have gaps get logits at the read positions only (see :func:`logprobs_at`). ``adapters``: each
    row's adapter on a shared base (see :mod:`~tinkergym.backends.torch.row_adapters`). ``model_inputs``: more arguments
    of the forward pass (a vision-language model's, whose rows with images never share prompts).
    """
    if micro is not None and micro.group_sizes:
        if model_inputs:
            raise ValueError("rows with images are scored on their own: plan them with share_prefixes=False")
        if lengths is None:
            lengths = attention_BT.sum(dim=1).tolist()
        return _shared_prefix_logprobs(model, tokens_BT, lengths, micro.group_sizes, micro.prefix_lens, temperature, adapters)
    if read and read[-1] - read[0] + 1 > len(read):  # reads with gaps (turns between env replies): logits there only
        return logprobs_at(model, tokens_BT, attention_BT, read, temperature, adapters, model_inputs)
    if read is None:
        reads_T = mask_BT.any(dim=0).nonzero()
        first_read = int(reads_T[0]) if len(reads_T) else None
    else:
        first_read = read[0] if read else None
    start = tokens_BT.shape[1] - 1 if first_read is None else first_read
    return logprobs_from(model, tokens_BT, attention_BT, max(start, 1), temperature, adapters, model_inputs)
