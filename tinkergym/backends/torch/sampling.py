"""Batched token sampling with a transformers causal LM and its KV cache, over left-padded prompts.

The logprob reported for a sampled token is the log-softmax of the distribution it was actually drawn from:
logits divided by the temperature, then restricted by top-k / top-p and renormalized. With temperature 1
and no filters that is the policy's own logprob. Greedy decoding (temperature 0) reports the untempered
policy logprob of the chosen token, since the point mass it samples from would report 0 for every token.

The decode loop never waits for the device between steps: tokens, logprobs and stop flags stay on it, and
whether every row has stopped is read back once every :data:`STOP_CHECK_INTERVAL` steps. The steps run past
the first one at which every row had stopped are discarded, and the random generator is put back to its state
after that step, so the results and the random numbers drawn are those of a loop that checked every step.

A batch decodes until its last row stops, and the rows that stopped would ride along (fed a pad token) to the end.
At a check where at least :data:`COMPACT_SHARE` of the rows still in the batch have stopped, they leave it: their
keys and values (kept in the prefix cache first, where there is one) are dropped from the KV cache, and the steps
after run the remaining rows alone. A step's cost follows the rows still decoding, not the batch's first size. The
random numbers are still drawn for every row of the first batch, so each remaining row draws what it would have
drawn in the whole batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch

from tinkergym.backends.torch.cache_names import cache_kwargs, cache_of
from tinkergym.backends.torch.attention import NAME as GROUPED_MATMUL
from tinkergym.backends.torch.prefix_cache import PrefixCache
from tinkergym.backends.torch.row_adapters import rows_through
from tinkergym.backends.torch.scoring import host_to_device, padded_length_limit
from tinkergym.protocol.types import SampledSequence, SamplingParams
from tinkergym.errors import NonFiniteError

#: Decode steps between two reads of the stop flags (each read makes the host wait for the device).
STOP_CHECK_INTERVAL = 8
#: The share of a decode batch's rows that must have stopped, at a check, for them to leave the batch (see the module
#: docstring): each drop copies the KV cache of the rows that stay, so a batch is cut at most about log2(rows) times.
COMPACT_SHARE = 0.5


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


class SeededRows:
    """Random numbers by row, each row from its own seed (:func:`tinkergym.protocol.seeds.sample_seeds`): the number row
    ``r`` draws at decode step ``t`` is ``mix64(seed_r + (t + 1) * golden) / 2**64`` (splitmix64), a function of the two
    alone. So what a row samples does not depend on the rows beside it, the batches its request is cut into, the rank or
    the device that decodes it (the numbers are made on the host, in exact integer arithmetic), or the server it goes
    through. Its state is the step: the decode loop's rewind (:func:`decode`) and a shared base's settling
    (:meth:`RowGenerators.settle`) set it back like a generator's. The numbers of :data:`STEPS_AHEAD` steps are made and
    copied to the device at once."""

    #: Steps whose numbers are made and copied at once.
    STEPS_AHEAD = 64

    def __init__(self, seeds: list[int]) -> None:
        self.seeds = np.array([s & (2**64 - 1) for s in seeds], dtype=np.uint64)
        self.step = 0
        self._table: tuple[int, torch.device, torch.Tensor] | None = None  # (first step, device, [rows, STEPS_AHEAD])

    def __len__(self) -> int:
        return len(self.seeds)

    def rand(self, rows: int, device: torch.device) -> torch.Tensor:
        if rows != len(self.seeds):
            raise ValueError(f"{len(self.seeds)} seeded rows cannot draw for a batch of {rows}")
        first = self.step - self.step % self.STEPS_AHEAD
        if self._table is None or self._table[0] != first or self._table[1] != device:
            self._table = (first, device, host_to_device(torch.from_numpy(uniforms(self.seeds, first, self.STEPS_AHEAD)), device))
        column = self._table[2][:, self.step - first : self.step - first + 1]
        self.step += 1
        return column

    def get_state(self) -> int:
        return self.step

    def set_state(self, state: int) -> None:
        self.step = int(state)


class RowStreams:
    """A seeded request's sample seeds by prompt (:func:`~tinkergym.protocol.seeds.sample_seeds`), handed out in the order
    its batches take them: :meth:`take` gives the :class:`SeededRows` of a batch whose row ``j`` is the next sample of
    prompt ``rows[j]``."""

    def __init__(self, by_prompt: list[list[int]]) -> None:
        self.by_prompt = by_prompt
        self.used = [0] * len(by_prompt)

    def take(self, rows: list[int]) -> SeededRows:
        return SeededRows(self._next(rows))

    def slice(self, rows: list[int]) -> RowStreams:
        """The streams of a request of ``rows``' prompts, one sample each: the next sample of each (a call worked in slices)."""
        return RowStreams([[seed] for seed in self._next(rows)])

    def _next(self, rows: list[int]) -> list[int]:
        seeds = []
        for i in rows:
            seeds.append(self.by_prompt[i][self.used[i]])
            self.used[i] += 1
        return seeds


def uniforms(seeds: np.ndarray, first: int, steps: int) -> np.ndarray:
    """``[rows, steps]`` float32 numbers in [0, 1): row ``r``'s at decode steps ``first`` to ``first + steps - 1``."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        x = seeds[:, None] + (np.arange(first + 1, first + steps + 1, dtype=np.uint64)[None, :] * golden)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


class RowGenerators:
    """Random streams by rows: the rows of each segment draw from that segment's generator, in row order.

    Rows of several requests sampled in one batch (on a shared base) then draw the numbers each request would
    draw alone. ``get_state``/``set_state`` cover every generator, as the decode loop's rewind needs; ``history``
    keeps every generator's state after each step, so each request's generator can be put back to its state after
    the step where its own rows had all stopped (:meth:`settle`), as a batch of its own would leave it.
    """

    def __init__(self, segments: list[tuple[range, torch.Generator | SeededRows]]) -> None:
        self.segments = segments
        self.history: list[list[Any]] = []

    def rand(self, rows: int, device: torch.device) -> torch.Tensor:
        parts = [_uniforms(generator, len(span), device) for span, generator in self.segments]
        if sum(len(span) for span, _ in self.segments) != rows:
            raise ValueError("the generators' segments must cover every row of the batch")
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def get_state(self) -> list[Any]:
        state: list[Any] = [generator.get_state() for _, generator in self.segments]
        self.history.append(state)
        return state

    def set_state(self, state: list[Any]) -> None:
        for (_, generator), saved in zip(self.segments, state):
            generator.set_state(saved)

    def settle(self, start_state: list[Any], last_steps: list[int]) -> None:
        """Put segment ``i``'s generator to its state after step ``last_steps[i]`` (-1: before the first step).

        A generator that several segments share (unseeded requests of one session in one batch) is put to its state after
        the latest of their last steps, so no number it gave one of them is drawn again later.
        """
        last: dict[int, int] = {}  # id(generator) -> the segment whose last step is the latest
        for i, ((_, generator), step) in enumerate(zip(self.segments, last_steps)):
            if id(generator) not in last or step > last_steps[last[id(generator)]]:
                last[id(generator)] = i
        for i in last.values():
            generator, step = self.segments[i][1], last_steps[i]
            generator.set_state(start_state[i] if step < 0 else self.history[step][i])


def _uniforms(generator: Any, rows: int, device: torch.device) -> torch.Tensor:
    """``[rows, 1]`` numbers in [0, 1): from ``generator``'s own ``rand`` (:class:`RowGenerators`, :class:`SeededRows`), or
    ``torch.rand`` with it (a ``torch.Generator``, or None: the device's). Told by the method, not the class, so that a copy
    of this module loaded on its own (``benchmarks/decode_profile.py --baseline``) takes the streams of this one."""
    draw_own = getattr(generator, "rand", None)
    if callable(draw_own):
        numbers: torch.Tensor = draw_own(rows, device)
        return numbers
    return torch.rand((rows, 1), generator=generator, device=device)


def draw(probs_BV: torch.Tensor, generator: torch.Generator | RowGenerators | SeededRows | None, rows: Rows | None = None) -> torch.Tensor:
    """One index per row with probability ``probs_BV`` (rows need not sum to exactly 1), by inverting the CDF.

    One uniform number per row instead of ``torch.multinomial``'s random number per vocabulary entry, which
    costs more than the model's own decode step on a CPU. Entries with probability 0 are never drawn. ``rows``: the
    rows of ``probs_BV`` are these rows of a larger batch, and the numbers are drawn for all of that batch's rows.
    """
    cdf_BV = probs_BV.cumsum(dim=-1)
    count = probs_BV.shape[0] if rows is None else rows.batch
    u_B1 = _uniforms(generator, count, probs_BV.device)
    if rows is not None:
        u_B1 = u_B1[rows.index]
    u_B1 = u_B1 * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, u_B1, right=True).clamp_max(probs_BV.shape[-1] - 1).squeeze(-1)


class Rows:
    """The rows of a decode batch still in it: ``kept`` (their indexes in the first batch, in cache order, on the host)
    and ``index`` (the same on the device), out of ``batch`` rows."""

    def __init__(self, kept: list[int], batch: int, device: torch.device) -> None:
        self.kept, self.batch = kept, batch
        self.index = host_to_device(torch.tensor(kept, dtype=torch.long), device)


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | RowGenerators | SeededRows | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the distribution it was drawn from (see the module docstring).

    Probabilities are float32 whatever the logits' dtype; at temperature 1 without filters they come straight
    from the logits in one softmax pass, the chosen token's logprob is the log of its probability.
    """
    if not bool(logits_finite(logits_BV)):  # a diverged model: say so instead of a torch error
        raise NonFiniteError(DIVERGED)
    return _draw_next(logits_BV, params, generator)


DIVERGED = "the model's logits are NaN or infinite: the weights have diverged"


def logits_finite(logits_BV: torch.Tensor) -> torch.Tensor:
    """A boolean scalar on the device: whether every logit is finite."""
    # NaN propagates through max, and a row of -inf has no finite max: one reduction checks every row.
    return torch.isfinite(logits_BV.amax(dim=-1)).all()


def _draw_next(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | RowGenerators | SeededRows | None,
               rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if params.temperature <= 0:
        tokens_B = logits_BV.argmax(dim=-1)
        chosen = logits_BV.gather(-1, tokens_B[:, None]).squeeze(-1).float()
        return tokens_B, chosen - torch.logsumexp(logits_BV.float(), dim=-1)
    scaled = logits_BV
    if params.temperature != 1.0 or params.top_k > 0 or params.top_p < 1.0:
        scaled = filter_logits(logits_BV.float() / params.temperature, params.top_k, params.top_p)
    probs_BV = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    tokens_B = draw(probs_BV, generator, rows)
    return tokens_B, probs_BV.gather(-1, tokens_B[:, None]).squeeze(-1).log()


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` of prompts padded on the left, positions counted from each prompt's start."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention[row, width - len(prompt) :] = 1
    positions = (attention.cumsum(dim=-1) - 1).clamp_min(0)
    return host_to_device(input_ids, device), host_to_device(attention, device), host_to_device(positions, device)


def prefill(
    model: torch.nn.Module,
    prompts: list[list[int]],
    pad_id: int,
    device: torch.device,
    share_prompts: bool = True,
    prefix_cache: PrefixCache | None = None,
    adapters: list[int] | None = None,
) -> tuple[torch.Tensor, object, torch.Tensor, torch.Tensor]:
    """Run the prompts through the model once: ``(last logits [B, V], KV cache, attention mask, positions)``.

    Identical prompts (a GRPO group asks for many samples of one prompt) are run once, and their cache rows
    are copied to every sample that shares them: the prefill costs the distinct prompts, not the samples.
    ``share_prompts=False`` runs every row. With a ``prefix_cache``, what the prompts share with its entries
    is taken from it and only the rest runs (see :func:`_cached_columns`). ``adapters``: each prompt's adapter on a
    shared base (:mod:`~tinkergym.backends.torch.row_adapters`); prompts are shared within an adapter only.
    """
    keys = [(-1 if adapters is None else adapters[i], tuple(p)) for i, p in enumerate(prompts)]
    distinct: dict[tuple[int, tuple[int, ...]], int] = {}
    row_of = [distinct.setdefault(key, len(distinct)) if share_prompts else i for i, key in enumerate(keys)]
    unique = [list(p) for _, p in distinct] if share_prompts else prompts
    unique_adapters = None if adapters is None else ([a for a, _ in distinct] if share_prompts else adapters)
    input_ids, attention, positions = left_pad(unique, pad_id, device)
    mask = attention if len({len(p) for p in unique}) > 1 else None  # no padding: no mask to inspect (see decode)
    past, kept = _cached_columns(unique, prefix_cache, unique_adapters) if prefix_cache is not None else (None, 0)
    with rows_through(unique_adapters):
        out = model(
            input_ids=input_ids[:, kept:],
            attention_mask=mask,
            position_ids=positions[:, kept:],
            **cache_kwargs(past),
            use_cache=True,
            logits_to_keep=1,
        )
    logits_BV, cache = out.logits[:, -1], cache_of(out)
    if len(unique) < len(prompts):
        index = host_to_device(torch.tensor(row_of, dtype=torch.long), device)
        cache.batch_select_indices(index)
        logits_BV, attention, positions = logits_BV[index], attention[index], positions[index]
    return logits_BV, cache, attention, positions


def _cached_columns(prompts: list[list[int]], prefix_cache: PrefixCache, scopes: list[int] | None = None) -> tuple[object | None, int]:
    """``(cache, kept)``: a KV cache of the left-padded prompts' first ``kept`` columns from ``prefix_cache``, or ``(None, 0)``.

    Every row runs the same last ``run`` columns, ``run`` being the most any prompt has left once its cached
    prefix is taken: a row with less left runs the end of its cached prefix again, which is exact (those
    positions' keys are computed from the columns before them, as in a full prefill). Rows stay left-padded
    and contiguous, so every position keeps its cache index (what sliding-window and chunked masks measure).
    ``scopes``: each row's own scope (its adapter on a shared base); default the cache's.
    """
    from transformers import DynamicCache

    matches = [prefix_cache.match(p) if scopes is None else prefix_cache.match(p, scopes[i]) for i, p in enumerate(prompts)]
    width = max(len(p) for p in prompts)
    run = max(len(p) - n for p, (_, n) in zip(prompts, matches))
    kept = width - run
    prefix_cache.stats.prompt_tokens += sum(len(p) for p in prompts)
    if kept <= 0:
        return None, 0
    cache = DynamicCache()
    template = next(entry for entry, _ in matches if entry is not None).layers
    for layer, (keys, values) in enumerate(template):
        keys_BHKD = keys.new_zeros((len(prompts), keys.shape[0], kept, keys.shape[-1]))
        values_BHKD = values.new_zeros((len(prompts), values.shape[0], kept, values.shape[-1]))
        for row, (prompt, (entry, _)) in enumerate(zip(prompts, matches)):
            taken = len(prompt) - run
            if taken > 0:
                assert entry is not None  # taken is at most the matched length, 0 without an entry
                keys_BHKD[row, :, kept - taken :] = entry.layers[layer][0][:, :taken]
                values_BHKD[row, :, kept - taken :] = entry.layers[layer][1][:, :taken]
        cache.update(keys_BHKD, values_BHKD, layer)
    prefix_cache.stats.reused_tokens += sum(max(0, len(p) - run) for p in prompts)
    return cache, kept


def store_rows(prefix_cache: PrefixCache, cache: object, prompts: list[list[int]], completions: list[list[int]], scopes: list[int] | None = None,
               cache_rows: list[int] | None = None, width: int | None = None) -> None:
    """Keep each row's keys and values for its prompt and the sampled ids the model ran, in ``prefix_cache`` (under each
    row's scope in ``scopes``, default the cache's). ``cache_rows``: each prompt's row in ``cache`` (default: the i-th);
    ``width``: the batch's left-padded prompt width (default: the longest of ``prompts``).

    Only caches of plain full-attention layers are kept (sliding-window layers hold just their window).
    """
    if not all_preallocated(cache):
        return
    layers = cache.layers  # type: ignore[attr-defined]
    width = max(len(p) for p in prompts) if width is None else width
    ran = layers[0].keys.shape[-2] - width  # decode steps whose ids were run through the model
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        row = i if cache_rows is None else cache_rows[i]
        fed = min(len(completion), ran)
        start, end = width - len(prompt), width + fed
        kv = [(layer.keys[row, :, start:end].clone(), layer.values[row, :, start:end].clone()) for layer in layers]
        if scopes is None:
            prefix_cache.store([*prompt, *completion[:fed]], kv)
        else:
            prefix_cache.store([*prompt, *completion[:fed]], kv, scopes[i])


def all_preallocated(cache: object) -> bool:
    """Whether every layer of ``cache`` is a plain full-attention one made preallocated by :func:`preallocated` (what
    storing rows in the prefix cache, single-query masks and rows leaving the decode batch need)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(isinstance(layer, _preallocated_layer_class()) for layer in layers)


def preallocated(cache: object, extra: int) -> object:
    """``cache`` with each plain dynamic layer replaced by a :class:`_PreallocatedLayer` with room for ``extra`` more positions."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
            layers[i] = _preallocated_layer_class()(layer, extra)
    return cache


@functools.cache
def _preallocated_layer_class() -> type:
    """:class:`PreallocatedLayer`, defined on first use: transformers is imported only when a model samples."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A dynamic KV cache layer whose keys and values are views into buffers sized for the whole decode.

        transformers' dynamic layer concatenates every new position onto the whole cache (a fresh tensor, and a
        copy of all of it, per layer and step); here a step writes its position into the buffer in place. The
        views hold exactly the positions the dynamic layer would, so attention reads the same numbers.
        """

        keys: torch.Tensor  # DynamicLayer's are None until it is initialized; this one's are views from the start
        values: torch.Tensor

        def __init__(self, layer: DynamicLayer, extra: int) -> None:
            super().__init__()
            assert layer.keys is not None and layer.values is not None  # preallocated replaces initialized layers only
            self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True
            self._keys = _grown(layer.keys, extra)
            self._values = _grown(layer.values, extra)
            self._length = layer.keys.shape[-2]
            self.keys, self.values = self._keys[:, :, : self._length], self._values[:, :, : self._length]

        def select_rows(self, rows_R: torch.Tensor) -> None:
            """Keep the rows ``rows_R`` of the batch, in that order (the buffers are copied: the rows dropped free theirs)."""
            self._keys, self._values = self._keys.index_select(0, rows_R), self._values.index_select(0, rows_R)
            self.keys, self.values = self._keys[:, :, : self._length], self._values[:, :, : self._length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
            start, end = self._length, self._length + key_states.shape[-2]
            if end > self._keys.shape[-2]:  # never in the decode loop; stay correct if called past it
                self._keys, self._values = _grown(self.keys, end - start), _grown(self.values, end - start)
            self._keys[:, :, start:end] = key_states  # rounded to the cache's dtype as the dynamic layer's callers do
            self._values[:, :, start:end] = value_states
            self._length = end
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
            return self.keys, self.values

    return PreallocatedLayer


def _grown(states: torch.Tensor, extra: int) -> torch.Tensor:
    """A buffer ``[B, H, S + extra, D]`` whose first ``S`` positions are ``states``."""
    batch, heads, length, dim = states.shape
    buffer = states.new_empty((batch, heads, length + extra, dim))
    buffer[:, :, :length] = states
    return buffer


P = ParamSpec("P")
R = TypeVar("R")


def autograd_off(function: Callable[P, R]) -> Callable[P, R]:
    """Run ``function`` (whose first argument is the model) under inference mode, or under ``no_grad`` for a model sharded
    with FSDP2: tensors made in inference mode cannot be updated in place outside it, and FSDP2 reuses the buffers it
    gathers weights into for the next training pass."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from torch.distributed.fsdp import FSDPModule

        model = args[0] if args else kwargs.get("model")
        sharded = isinstance(model, FSDPModule)
        with torch.no_grad() if sharded else torch.inference_mode():
            return function(*args, **kwargs)

    return wrapper


@autograd_off
def sample_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    stop_ids: list[int],
    pad_id: int,
    generator: torch.Generator | RowGenerators | SeededRows | None = None,
    share_prompts: bool = True,
    check_interval: int = STOP_CHECK_INTERVAL,
    prefix_cache: PrefixCache | None = None,
    adapters: list[int] | None = None,
) -> list[SampledSequence]:
    """Sample one completion per prompt, all prompts in one batch sharing one KV cache.

    A row stops at the first token in ``stop_ids`` (kept as its last id, finish reason ``"stop"``) or after
    ``params.max_new_tokens`` (``"length"``). Rows that stopped keep being fed a pad token, which nothing reads.
    Identical prompts are prefilled once (see :func:`prefill`). Prompts of different lengths run apart when
    left padding would change the model's results (see :func:`~tinkergym.backends.torch.scoring.padded_length_limit`).
    Whether every row has stopped is read back every ``check_interval`` steps (see the module docstring).
    With a ``prefix_cache``, prompts start from what it holds, and every row's keys and values are kept in it
    afterwards (see :mod:`~tinkergym.backends.torch.prefix_cache`). ``adapters``: each prompt's adapter on a shared
    base (see :mod:`~tinkergym.backends.torch.row_adapters`), which is also its scope in the prefix cache.
    """
    limit = padded_length_limit(model)
    widths = sorted({len(p) for p in prompts})
    if limit is not None and len(widths) > 1 and widths[-1] + params.max_new_tokens > limit:
        if adapters is not None:
            raise ValueError("prompts of different lengths run apart on this model: sample each length in a batch of its own")
        by_row: dict[int, SampledSequence] = {}
        for width in widths:
            indices = [i for i, p in enumerate(prompts) if len(p) == width]
            rows_generator = SeededRows([int(generator.seeds[i]) for i in indices]) if isinstance(generator, SeededRows) else generator
            by_row.update(zip(indices, sample_batch(model, [prompts[i] for i in indices], params, stop_ids, pad_id, rows_generator, share_prompts,
                                                    check_interval, prefix_cache)))
        return [by_row[i] for i in range(len(prompts))]
    device = next(model.parameters()).device
    logits_BV, cache, attention, positions = prefill(model, prompts, pad_id, device, share_prompts, prefix_cache, adapters)
    cache = preallocated(cache, params.max_new_tokens)
    is_stop_V = stop_table(logits_BV.shape[-1], pad_id, stop_ids, device)
    mask = attention if len(widths) > 1 else None
    width = positions.shape[-1]

    def keep(rows: list[int], completions: list[list[int]], cache_rows: list[int] | None = None) -> None:
        """Keep in the prefix cache the keys and values of the batch's ``rows`` (rows ``cache_rows`` of the KV cache now,
        default the i-th) for their prompts and ``completions``."""
        assert prefix_cache is not None
        store_rows(prefix_cache, cache, [prompts[r] for r in rows], completions, None if adapters is None else [adapters[r] for r in rows],
                   cache_rows=cache_rows, width=width)

    def release(rows: list[int], cache_rows: list[int], tokens_RS: torch.Tensor) -> None:
        """Keep the rows leaving the decode batch (they have stopped) before they are dropped."""
        stops = set(stop_ids)
        keep(rows, [ids[: _stop_length(ids, stops)] for ids in tokens_RS.tolist()], cache_rows)

    storing = prefix_cache is not None and prefix_cache.max_bytes > 0
    with rows_through(adapters):
        tokens_BS, logprobs_BS, steps, kept = decode(model, logits_BV, cache, mask, positions, params, is_stop_V, pad_id, generator,
                                                     check_interval, adapters, release if storing else None)
    out = finished_sequences(tokens_BS, logprobs_BS, steps, stop_ids)
    if storing:  # the rows still in the batch at its end, in their cache order
        rows = list(range(len(prompts))) if kept is None else kept
        keep(rows, [out[r].tokens for r in rows])
    return out


def stop_table(vocab: int, pad_id: int, stop_ids: list[int], device: torch.device) -> torch.Tensor:
    """Whether each id is a stop id, as a boolean table on ``device`` that the decode loop looks ids up in.

    A gather: torch.isin of many stop ids sorts and deduplicates (a data-dependent size, read back from a GPU on
    every step). Sampled ids and the pad id fall inside it.
    """
    is_stop_V = torch.zeros(max([vocab, pad_id + 1, *(t + 1 for t in stop_ids)]), dtype=torch.bool)
    is_stop_V[[t for t in stop_ids if t >= 0]] = True
    return host_to_device(is_stop_V, device)


def finished_sequences(tokens_BS: torch.Tensor, logprobs_BS: torch.Tensor, steps: int, stop_ids: list[int]) -> list[SampledSequence]:
    """The decode loop's results as sequences: the only reads of them; a row's ids end at its first stop id (later
    ones are the pad fed to stopped rows)."""
    stops = set(stop_ids)
    out = []
    for ids, logprobs in zip(tokens_BS[:, :steps].tolist(), logprobs_BS[:, :steps].tolist()):
        n = _stop_length(ids, stops)
        out.append(SampledSequence(tokens=ids[:n], logprobs=logprobs[:n], finish_reason="stop" if ids[:n] and ids[n - 1] in stops else "length"))
    return out


def _stop_length(ids: list[int], stops: set[int]) -> int:
    """How many of a row's ``ids`` it sampled: through its first stop id, else all of them."""
    return next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))


def _single_query_masks(model: torch.nn.Module, cache: object, attention: torch.Tensor | None, steps: int) -> torch.Tensor | None:
    """The decode steps' attention masks as one ``[B, 1, 1, width + steps]`` boolean buffer (a step reads a prefix), or None.

    transformers takes a 4D mask as it is: it neither builds one from the 2D padding mask on every step nor reads
    that mask back to see whether it can drop it. With the padding mask this is the mask it would build (a
    single query sees every earlier position), so the results are the same. Without padding (``attention``
    None) transformers passes no mask and sdpa then runs its grouped-query kernel one query head at a time,
    which on a CPU takes several times longer than a decode step's attention with the heads of a key/value head
    packed together (what transformers does when there is a mask); the packed kernel rounds differently in the
    last bit, so the mask is only given there in a low-precision compute dtype, where the sampler is held to the
    training pass's numbers within a tolerance rather than to transformers' decode bit for bit. None (the
    plain path) for other attention implementations and for caches with other than plain full-attention layers,
    whose masks (sliding windows, chunks) a single mask cannot express. The grouped_matmul implementation takes the
    same masks, and none without padding.
    """
    config = getattr(model, "config", None)
    layers = getattr(cache, "layers", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", GROUPED_MATMUL) or not layers:
        return None
    if implementation == GROUPED_MATMUL and attention is None:  # its single query needs no mask and no head packing
        return None
    if not all_preallocated(cache):
        return None
    keys = layers[0].keys
    if attention is None and not (keys.device.type == "cpu" and keys.dtype in (torch.bfloat16, torch.float16)):
        return None
    batch, width = keys.shape[0], keys.shape[-2]
    masks_B11S = torch.ones((batch, 1, 1, width + steps), dtype=torch.bool, device=keys.device)
    if attention is not None:
        masks_B11S[:, 0, 0, :width] = attention.bool()
    return masks_B11S


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator ``torch.rand`` draws from on ``device`` without one; None where it cannot be told."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


def _first_stop(done: list[bool], diverged: list[bool], first_step: int) -> int | None:
    """The first step of a checked window after which every row had stopped (None: none); a divergence before it raises."""
    for i, (all_done, bad) in enumerate(zip(done, diverged)):
        if bad:  # a loop checking every step would have raised at the start of this step
            raise NonFiniteError(DIVERGED)
        if all_done:
            return first_step + i
    return None


#: What the decode loop tells its caller before rows leave the batch: their indexes in the first batch, their rows in
#: the KV cache now, and their ids so far ``[R, steps]`` on the device.
Release = Callable[[list[int], list[int], torch.Tensor], None]


def decode(
    model: torch.nn.Module,
    logits_BV: torch.Tensor,
    cache: object,
    attention: torch.Tensor | None,
    positions: torch.Tensor,
    params: SamplingParams,
    is_stop_V: torch.Tensor,
    pad_id: int,
    generator: torch.Generator | RowGenerators | SeededRows | None,
    check_interval: int,
    adapters: list[int] | None = None,
    release: Release | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, list[int] | None]:
    """``(tokens [B, S], logprobs [B, S], steps, kept)``: the decode loop from the prefill's logits, on the device.

    Only the first ``steps`` columns count. ``is_stop_V`` tells for each id whether it is a stop id. Stop flags
    are read every ``check_interval`` steps (see the module docstring). ``attention`` None means no row is
    padded: transformers then has no padding mask to inspect, which it would read back on every forward pass.
    Rows that stopped leave the batch (see the module docstring) where the cache allows it; ``kept`` is then the rows
    of the first batch still in ``cache`` at the end, in its order (None: all of them), and ``release`` is told of
    each row before it leaves. ``adapters``: each row's adapter on a shared base.
    """
    batch, steps, device = logits_BV.shape[0], params.max_new_tokens, logits_BV.device
    tokens_BS = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
    logprobs_BS = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    done_S = torch.zeros(steps, dtype=torch.bool, device=device)  # every row had stopped after the step
    diverged_S = torch.zeros(steps, dtype=torch.bool, device=device)  # the step's logits were NaN or infinite
    finished_B = torch.zeros(batch, dtype=torch.bool, device=device)
    rng = None
    if params.temperature > 0:
        rng = generator if generator is not None else _default_generator(device)
    if params.temperature > 0 and rng is None:
        check_interval = 1  # nothing to rewind: check every step, so no step runs past the stop
    rng_states: list[Any] = []  # the generator's state after each step since the last check
    window = 0  # the first step not yet checked
    next_position = positions[:, -1:] + 1
    width = positions.shape[-1]
    masks_B11S = _single_query_masks(model, cache, attention, steps)
    rows: Rows | None = None  # the rows still in the batch once some have left it (None: every row)
    compactable = batch > 1 and all_preallocated(cache)
    with contextlib.ExitStack() as scopes:
        for step in range(steps):
            diverged_S[step] = ~logits_finite(logits_BV)
            tokens_B, logprobs_B = _draw_next(logits_BV, params, rng, rows)
            tokens_B = torch.where(finished_B, torch.full_like(tokens_B, pad_id), tokens_B)
            if rows is None:
                tokens_BS[:, step], logprobs_BS[:, step] = tokens_B, logprobs_B
            else:
                tokens_BS[rows.index, step], logprobs_BS[rows.index, step] = tokens_B, logprobs_B
            finished_B |= is_stop_V[tokens_B]
            done_S[step] = finished_B.all()
            if rng is not None:
                rng_states.append(rng.get_state())
            if step + 1 == steps or step + 1 - window >= check_interval:
                checked = step + 1 - window
                flags = torch.cat([done_S[window : step + 1], diverged_S[window : step + 1], finished_B if compactable else finished_B[:0]]).tolist()
                end = _first_stop(flags[:checked], flags[checked : 2 * checked], window)
                if end is not None or step + 1 == steps:
                    end = step if end is None else end
                    if rng is not None:
                        rng.set_state(rng_states[end - window])
                    return tokens_BS, logprobs_BS, end + 1, None if rows is None else rows.kept
                window, rng_states = step + 1, []
                stopped = [i for i, flag in enumerate(flags[2 * checked :]) if flag]
                if compactable and stopped and len(stopped) >= COMPACT_SHARE * len(finished_B):
                    gone_set = set(stopped)
                    kept_now = [i for i in range(len(finished_B)) if i not in gone_set]
                    first = list(range(batch)) if rows is None else rows.kept
                    if release is not None:
                        gone = host_to_device(torch.tensor(stopped, dtype=torch.long), device)
                        release([first[i] for i in stopped], stopped, tokens_BS[gone if rows is None else rows.index[gone], : step + 1])
                    here = host_to_device(torch.tensor(kept_now, dtype=torch.long), device)
                    _drop_rows(cache, here)
                    tokens_B, finished_B, next_position = tokens_B[here], finished_B[here], next_position[here]
                    if masks_B11S is not None:
                        masks_B11S = masks_B11S[here]
                    elif attention is not None:
                        attention = attention[here]
                    rows = Rows([first[i] for i in kept_now], batch, device)
                    if adapters is not None:
                        scopes.enter_context(rows_through([adapters[i] for i in rows.kept]))
                    compactable = len(kept_now) > 1
            if masks_B11S is not None:
                attention = masks_B11S[..., : width + step + 1]
            elif attention is not None:
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            out = model(
                input_ids=tokens_B[:, None],
                attention_mask=attention,
                position_ids=next_position,
                **cache_kwargs(cache),
                use_cache=True,
            )
            logits_BV, cache = out.logits[:, -1], cache_of(out)
            next_position = next_position + 1
    return tokens_BS, logprobs_BS, 0, None if rows is None else rows.kept


def _drop_rows(cache: object, kept_R: torch.Tensor) -> None:
    """Keep only the rows ``kept_R`` of each preallocated layer of ``cache`` (their buffers, room for later steps included)."""
    for layer in cache.layers:  # type: ignore[attr-defined]
        layer.select_rows(kept_R)
