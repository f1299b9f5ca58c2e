"""One base model, many LoRA sessions: each session trains its own adapter, and calls of several sessions share passes.

:class:`SharedBase` loads a transformers model once (dtype, attention and device as
:class:`~tinkergym.backends.torch.backend.TorchBackend` chooses them) and wraps its linear layers in
:class:`~tinkergym.backends.torch.multi_lora.MultiLoraLinear`. :meth:`SharedBase.open_session` adds a
:class:`~tinkergym.backends.torch.lora_session.LoraSession`: an adapter of its own rank and alpha (up to ``max_lora_rank``), its own AdamW state, random
generator, step counter, saved states and export. A session implements the
:class:`~tinkergym.protocol.backend.Backend` protocol on its own; the ``*_many`` methods of the base run the
calls of several sessions together:

- ``forward_backward_many``: the requests' rows are planned into micro-batches as one request would be (what
  ``micro_batch_size`` sequences cost; a prompt is shared within a session only), so a pass holds rows of several
  sessions. Each row goes through its own session's adapter; each session's loss is weighted
  with its own request's normalizers, and one backward pass fills every session's gradients. A session's
  gradient equals that of its request alone (up to floating-point summation order), and no gradient reaches
  an adapter whose session has no row in the pass. A pass that fails is undone (every session's gradients are
  put back as they were) and its requests run one by one, so only the failing request fails.
- ``sample_many``: requests with the same sampling settings decode in shared batches; each request's sequences are
  batched by ``max_sample_batch`` as TorchBackend batches them (a prompt's samples may span batches), and each
  request's rows draw from its own generator (its seed, or the session's), so it gets the tokens it would get alone.
- ``logprobs_many``: rows of every request at one temperature in shared passes.
- ``call_slices``: a call cut into those units (decode batches, micro-batches), for a server that works a huge call
  over several rounds with other sessions' calls between (:mod:`~tinkergym.backends.torch.call_slices`).

Vision-language models (a base folder with a ``vision_config`` and an image processor): sessions sample, score and train
with images as :class:`~tinkergym.backends.torch.backend.TorchBackend` does (:mod:`~tinkergym.backends.torch.vision`):
the adapters sit on the language model only, a pass's rows carry their own images (pixels and 3D positions built from
the rows in the pass's order, so rows of several sessions never see another's image), rows with images share no prompt
and bypass the prefix cache, a prompt with images is sampled on its own after the text rows, and image tokens are
never sampled.

Memory: the base once, plus per session its adapter, gradients and AdamW's two moments (four times the adapter
in float32), plus the activations of a pass. :meth:`SharedBase.memory` reports it; a session that would take
the sessions past ``memory_budget_mb`` is refused with the figures. The prefix cache is shared, each entry scoped
by its session. Gradient checkpointing and LoRA dropout are not offered on a shared base (a recomputation runs
where the rows' adapters are no longer known).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tinkergym.backends.models import is_vision_folder, resolve_model
from tinkergym.backends.torch import losses, multi_lora
from tinkergym.backends.torch.attention import NAME as GROUPED_MATMUL
from tinkergym.backends.torch.call_slices import CallSlices, FitCarry
from tinkergym.backends.torch.batches import (
    Batch,
    check_prompts,
    check_scored_images,
    collate,
    request_normalizers,
    sample_batches,
    validate_data,
)
from tinkergym.backends.torch.copies import kv_token_cost
from tinkergym.backends.torch.lora_session import LoraSession, LoraSessionConfig, Outcome
from tinkergym.backends.torch.prefix_cache import PrefixCache
from tinkergym.backends.torch.row_adapters import rows_through
from tinkergym.backends.torch.runtime import DTYPES, PhaseMemory, compute_in, load_causal_lm, resolve_attn_implementation, resolve_device, resolve_dtype
from tinkergym.backends.torch.sampling import RowGenerators, RowStreams, SeededRows, sample_batch
from tinkergym.backends.torch.scoring import MicroBatch, logprobs_from, padded_length_limit, plan_micro_batches, sequence_logprobs
from tinkergym.backends.torch.sizing import LANGUAGE_MODEL
from tinkergym.backends.torch.vision import VisionInputs, forbid_tokens, sample_with_images, vision_token_ids
from tinkergym.config import DEFAULT_DTYPE, DEFAULT_MICRO_BATCH_SIZE
from tinkergym.errors import ConfigError
from tinkergym.protocol.seeds import sample_seeds
from tinkergym.protocol.types import (
    Datum,
    ForwardBackwardRequest,
    ImageData,
    ForwardBackwardResult,
    SampleRequest,
    SampleResponse,
    SampledSequence,
    PlainData,
)

T = TypeVar("T")


@dataclass
class SharedBaseConfig(PlainData):
    """Settings of a :class:`SharedBase`; the model, precision and attention settings mean what they mean for
    :class:`~tinkergym.backends.torch.backend.TorchBackendConfig`.

    Attributes:
        micro_batch_size: Rows per training or scoring pass, across sessions.
        max_sample_batch: Rows decoded together, across sessions.
        max_lora_rank: The largest rank a session may ask for.
        max_sessions: Sessions open at once.
        memory_budget_mb: Memory for the sessions' adapters, gradients and optimizer states (0: no bound).
        prefix_cache_mb: Memory for the prefix cache, shared by the sessions; each entry is scoped by its session's
            adapter and dropped when that adapter changes or the session trains (its memory goes to the activations, as
            in ``TorchBackend``) (:mod:`~tinkergym.backends.torch.prefix_cache`); 0 turns it off. Rows of K sessions
            sampled together fill it K times as fast as one job's: raise it for multi-turn envs with many sessions.
    """

    model: str = "tiny"
    dtype: str = DEFAULT_DTYPE
    device: str = "auto"
    attn_implementation: str = "auto"
    lora_target_modules: str | list[str] = "all-linear"
    micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE
    max_sample_batch: int = 64
    share_prefixes: bool = True
    max_lora_rank: int = 64
    max_sessions: int = 64
    memory_budget_mb: float = 0.0
    prefix_cache_mb: float = 256.0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be 'auto', 'bfloat16' or 'float32', not {self.dtype!r}")
        for name in ("micro_batch_size", "max_sample_batch", "max_lora_rank", "max_sessions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("memory_budget_mb", "prefix_cache_mb"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be 0 (none) or more, not {getattr(self, name)}")


def _mb(n: int) -> float:
    return round(n / 2**20, 2)


class SharedBase:
    """A frozen base model in this process with any number of :class:`~tinkergym.backends.torch.lora_session.LoraSession` adapters (see the module docstring)."""

    def __init__(self, config: SharedBaseConfig | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config or SharedBaseConfig()
        self.model_path = resolve_model(self.config.model, self.config.cache_dir)
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.attn_implementation = resolve_attn_implementation(self.config.attn_implementation, self.device, self.dtype, self.model_path)
        self.reads_images = is_vision_folder(self.model_path)
        if self.reads_images and self.attn_implementation == GROUPED_MATMUL:
            self.attn_implementation = "sdpa"  # the vision tower's attention runs on packed patches, which only the built-in kernels take
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = load_causal_lm(self.model_path, self.dtype, attn_implementation=self.attn_implementation)
        self.model = model.to(self.device).requires_grad_(False)
        #: A vision-language model's inputs beside the ids (None for a text model): see tinkergym.backends.torch.vision.
        self.vision = VisionInputs.of(self.model, self.model_path, self.tokenizer) if self.reads_images else None
        if self.reads_images:
            forbid_tokens(self.model, vision_token_ids(self.tokenizer))
        within = LANGUAGE_MODEL if self.reads_images else None  # the vision tower stays frozen and adapter-free
        self.layers = multi_lora.inject(self.model, self.config.lora_target_modules, within=within)
        self.sessions: dict[int, LoraSession] = {}
        self.prefix_cache = PrefixCache(max_bytes=int(self.config.prefix_cache_mb * 2**20))
        self.phase_memory = PhaseMemory()
        self._next_id = 1
        self._lock = threading.RLock()  # one pass at a time over the shared model
        self._given: dict[int, Any] = {}  # a sample_many call's generators, by its requests' ids
        self._carried: dict[int, FitCarry] = {}  # a forward_backward_many call's carries, by its requests' ids
        fallbacks = (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        self.pad_id = next(t for t in fallbacks if t is not None)
        self.base_bytes = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def info(self) -> dict[str, Any]:
        """The model, tokenizer folder, precision, device, batching and bounds every session shares."""
        dtype = str(self.dtype).removeprefix("torch.")
        return {
            "model": self.config.model, "model_path": self.model_path, "tokenizer": self.model_path,
            "micro_batch_size": self.config.micro_batch_size, "dtype": dtype, "param_dtype": dtype, "device": str(self.device),
            "attn_implementation": self.attn_implementation, "deterministic": False, "gradient_checkpointing": False,
            "total_params": sum(p.numel() for p in self.model.parameters()), "max_lora_rank": self.config.max_lora_rank,
            "max_sessions": self.config.max_sessions, "reads_images": self.reads_images,
        }

    # ----- sessions ---------------------------------------------------------------------------------
    def session_bytes(self, rank: int) -> int:
        """Memory of one session of ``rank``: its adapter, gradients and AdamW's two moments, all float32."""
        return 4 * multi_lora.adapter_bytes(self.layers, rank)

    def memory(self) -> dict[str, Any]:
        """The base, each session and the total, in bytes (activations of a pass come on top)."""
        sessions = {str(s.id): self.session_bytes(s.config.lora_rank) for s in self.sessions.values()}
        return {"base_bytes": self.base_bytes, "sessions_bytes": sum(sessions.values()), "by_session": sessions,
                "budget_bytes": int(self.config.memory_budget_mb * 2**20), "total_bytes": self.base_bytes + sum(sessions.values())}

    def open_session(self, config: LoraSessionConfig | None = None) -> LoraSession:
        """A new session with a fresh adapter; refused (:class:`ConfigError`) past the rank, session or memory bounds."""
        config = config or LoraSessionConfig()
        if not 1 <= config.lora_rank <= self.config.max_lora_rank:
            raise ConfigError(f"lora_rank must be between 1 and this server's max_lora_rank {self.config.max_lora_rank}, not {config.lora_rank}; "
                              "full fine-tuning needs a server of its own")
        if not config.lora_alpha > 0:
            raise ConfigError(f"lora_alpha must be above 0, not {config.lora_alpha}")
        with self._lock:
            if len(self.sessions) >= self.config.max_sessions:
                raise ConfigError(f"this server holds its most sessions ({self.config.max_sessions}); close one or use another server")
            budget = int(self.config.memory_budget_mb * 2**20)
            need, held = self.session_bytes(config.lora_rank), self.memory()["sessions_bytes"]
            if budget and held + need > budget:
                raise ConfigError(f"a rank-{config.lora_rank} session needs {_mb(need)} MB (adapter, gradients and optimizer state); "
                                  f"the sessions hold {_mb(held)} MB of this server's {_mb(budget)} MB: ask for a lower rank or another server")
            session = LoraSession(self, self._next_id, config)
            self.sessions[session.id] = session
            self._next_id += 1
            return session

    def close_session(self, session: LoraSession) -> None:
        """Drop the session's adapter and optimizer state; its memory is freed."""
        with self._lock:
            if self.sessions.pop(session.id, None) is not None:
                multi_lora.remove_adapter(self.layers, session.id)
                self.prefix_cache.drop_scope(session.id)
                session._close()

    def _compute(self) -> contextlib.AbstractContextManager:
        return compute_in(self.device, self.dtype)

    # ----- training ---------------------------------------------------------------------------------
    def forward_backward_many(self, calls: Sequence[tuple[LoraSession, ForwardBackwardRequest]],
                              carries: Sequence[FitCarry | None] | None = None) -> list[Outcome]:
        """Each call's :class:`ForwardBackwardResult`, or the exception it raised; see the module docstring.

        ``carries``: per call, the :class:`~tinkergym.backends.torch.call_slices.FitCarry` of a call worked in slices (this
        request one of its slices), or None: its loss sums add to the carry's, and its metrics are the whole call's so far.
        """
        given = {id(r): c for (_, r), c in zip(calls, carries or ()) if c is not None}
        with self._lock:
            for (session, request) in calls:
                carry = given.get(id(request))
                if carry is not None and carry.saved is None:  # its first slice: what a failed slice puts back
                    carry.saved = session._saved(True)
            self._carried = given
            try:
                return self._isolated(calls, self._forward_backward_together, self._check_forward_backward, restore_grads=True)
            finally:
                self._carried = {}

    def abandon(self, session: LoraSession, carry: FitCarry) -> None:
        """A call worked in slices failed: put its session's gradients back as they were before its first slice."""
        if carry.saved is not None:
            with self._lock:
                session._restore(*carry.saved)

    def _check_forward_backward(self, session: LoraSession, request: ForwardBackwardRequest) -> None:
        session._check_open()
        validate_data(request.data, request.loss, self.reads_images)
        if self.vision is not None and any(d.images for d in request.data):
            self.vision.check_rows([d.tokens for d in request.data], [d.images for d in request.data], "datum")

    def _forward_backward_together(self, calls: Sequence[tuple[LoraSession, ForwardBackwardRequest]]) -> list[ForwardBackwardResult]:
        for session, _ in calls:  # their prefixes' memory goes to the activations; sampling after the update starts afresh anyway
            self.prefix_cache.drop_scope(session.id)
        self.phase_memory.enter("train")
        kv_cost = kv_token_cost(self.model.config)
        normalizers = [request_normalizers(request) for _, request in calls]
        sums: list[list[dict[str, torch.Tensor]]] = [[] for _ in calls]
        scored: list[list[list[float]]] = [[[] for _ in request.data] if request.return_logprobs else [] for _, request in calls]
        by_temperature: dict[float, list[int]] = {}
        for k, (_, request) in enumerate(calls):
            by_temperature.setdefault(request.loss.temperature, []).append(k)
        self.model.train()
        with self._compute():
            for temperature, members in by_temperature.items():
                # Every call's rows planned as one request, prompts shared within a session only: passes hold several sessions' rows.
                rows = [(k, i) for k in members for i in range(len(calls[k][1].data))]
                data = [calls[k][1].data[i] for k, i in rows]
                share = self.config.share_prefixes and not any(d.images for d in data)  # rows with images are scored on their own
                for micro in plan_micro_batches(data, self.config.micro_batch_size, share, kv_cost, scopes=[k for k, _ in rows]):
                    self.phase_memory.passing("train", micro.tokens(data))
                    self._one_pass(calls, [rows[j] for j in micro.indices], micro, temperature, normalizers, sums, scored)
                    self.phase_memory.passed("train")
        results: list[ForwardBackwardResult] = []
        carried: list[tuple[FitCarry, dict[str, float]]] = []
        for (_, request), micro_sums, logprobs in zip(calls, sums, scored):
            carry = self._carried.get(id(request))
            totals: dict[str, float] = {} if carry is None else carry.totals
            for floats in losses.sums_to_floats(micro_sums):
                totals = losses.add_sums(totals, floats)
            if carry is not None:
                carried.append((carry, totals))
            results.append(ForwardBackwardResult(metrics=losses.finalize_metrics(totals), logprobs=logprobs if request.return_logprobs else None))
        for carry, totals in carried:  # only once every call's pass is done (a failed joint run is run again call by call)
            carry.totals = totals
        return results

    def _one_pass(self, calls: Sequence[tuple[LoraSession, ForwardBackwardRequest]], picked: list[tuple[int, int]], micro: MicroBatch,
                  temperature: float, normalizers: list[tuple[float, int]], sums: list[list[dict[str, torch.Tensor]]],
                  scored: list[list[list[float]]]) -> None:
        """One pass over ``picked`` (``(call, row)`` in ``micro``'s order), each call's loss on its own rows, one backward."""
        rows = [calls[k][1].data[i] for k, i in picked]
        adapters = [calls[k][0].id for k, _ in picked]
        local = MicroBatch(list(range(len(rows))), micro.group_sizes, micro.prefix_lens)
        batch = collate(rows, self.device, per_token=False)  # each session's losses read its own rows' (below)
        width = batch.tokens.shape[1]
        inputs = self._image_inputs(batch.tokens, batch.attention, [r.images for r in rows])
        logprobs = sequence_logprobs(self.model, batch.tokens, batch.attention, batch.mask, local, temperature,
                                     lengths=batch.lengths, read=batch.read, adapters=adapters, model_inputs=inputs)
        reference = None
        if any(calls[k][1].loss.kl_coef > 0 for k, _ in picked):
            with torch.no_grad():  # the base alone: no adapter
                reference = sequence_logprobs(self.model, batch.tokens, batch.attention, batch.mask, local, temperature,
                                              lengths=batch.lengths, read=batch.read, model_inputs=inputs)
        total_loss = None
        with torch.autocast(self.device.type, enabled=False):
            for k in dict.fromkeys(k for k, _ in picked):
                spec = calls[k][1].loss
                positions = [p for p, (owner, _) in enumerate(picked) if owner == k]
                index = torch.tensor(positions, dtype=torch.long).to(self.device)
                part: Batch = collate([rows[p] for p in positions], self.device, width)
                weights = losses.aggregation_weights(part.mask, spec.aggregation, *normalizers[k])
                kl_reference = None if reference is None or spec.kl_coef <= 0 else reference.index_select(0, index)
                loss, part_sums = losses.compute_loss_on_device(
                    spec, logprobs.index_select(0, index), part.mask, weights, part.advantages, part.sampling_logprobs, kl_reference, part.old_logprobs,
                )
                total_loss = loss if total_loss is None else total_loss + loss
                sums[k].append(part_sums)
            if total_loss is not None:
                total_loss.backward()
        if any(calls[k][1].return_logprobs for k, _ in picked):
            for (k, i), row in zip(picked, logprobs.detach().float().cpu().tolist()):
                if calls[k][1].return_logprobs:
                    scored[k][i] = row[: len(calls[k][1].data[i].tokens)]

    def _image_inputs(self, tokens_BT: torch.Tensor, attention_BT: torch.Tensor, images: list[list[ImageData]]) -> dict[str, torch.Tensor] | None:
        """A pass's pixels and positions for rows ``tokens_BT`` showing ``images`` (row by row, in the pass's order); None without images."""
        if self.vision is None or not any(images):
            return None
        return self.vision.model_inputs(tokens_BT, attention_BT, images)

    # ----- sampling and scoring ---------------------------------------------------------------------
    def sample_many(self, calls: Sequence[tuple[LoraSession, SampleRequest]], generators: Sequence[Any] | None = None) -> list[Outcome]:
        """Each call's :class:`SampleResponse`, or the exception it raised; see the module docstring.

        ``generators``: per call, what it draws from in place of its seed's streams or its session's generator, or None: a
        request sampled in slices over several passes draws on as its whole call would (:meth:`CallSlices.carry_for`).
        """
        self._given = {id(r): g for (_, r), g in zip(calls, generators or ()) if g is not None}
        try:
            return self._isolated(calls, self._sample_together, self._check_sample, restore_grads=False)
        finally:
            self._given = {}

    def call_slices(self, session: LoraSession, method: str, args: Any) -> CallSlices | None:
        """``session``'s call of ``method`` (``args`` as the ``*_many`` method takes them) cut into the units this base runs
        it in, for a server that works a call larger than its pass in slices (:mod:`~tinkergym.backends.torch.call_slices`);
        None for a call of one unit, one with images to sample, or one that fails its checks (it fails when run whole)."""
        checks: dict[str, Callable[[LoraSession, Any], None]] = {
            "sample": self._check_sample, "forward_backward": self._check_forward_backward, "logprobs": self._check_logprobs}
        check = checks.get(method)
        if check is None:
            return None
        try:
            check(session, args)
        except Exception:  # noqa: BLE001 - run whole, it fails with its own error
            return None
        units: deque[tuple[list[int], int]] = deque()
        if method == "sample":
            if any(args.images):
                return None
            new = args.params.max_new_tokens
            for rows in sample_batches(range(len(args.prompts)), args.num_samples, self.config.max_sample_batch):
                units.append((rows, sum(len(args.prompts[i]) + new for i in rows)))
            # What its slices draw from: its samples' own streams (seeded), or the session's generator (None; no other call
            # of the session draws from it meanwhile: the session's later calls wait behind this one).
            seeded = args.params.seed is not None
            carry: Any = RowStreams(sample_seeds(args.prompts, args.num_samples, args.params.seed, args.images)) if seeded else None
            normalizers = None
        else:
            if method == "forward_backward":
                data, share = args.data, self.config.share_prefixes and not any(d.images for d in args.data)
                carry, normalizers = FitCarry(), request_normalizers(args)
            else:
                sequences, _, images = _scoring_call(args)
                data, share = [Datum(tokens=t, loss_mask=[0.0] * len(t), images=_images_of(images, i)) for i, t in enumerate(sequences)], False
                carry, normalizers = None, None
            for micro in plan_micro_batches(data, self.config.micro_batch_size, share, kv_token_cost(self.model.config)):
                units.append((list(micro.indices), sum(len(data[i].tokens) for i in micro.indices)))
        if len(units) < 2:
            return None
        return CallSlices(method, args, units, carry, normalizers)

    def _check_sample(self, session: LoraSession, request: SampleRequest) -> None:
        session._check_open()
        check_prompts(request.prompts, request.images, self.reads_images)
        if self.vision is not None and any(request.images):
            self.vision.check_rows(request.prompts, request.images, "prompt")

    def _sample_together(self, calls: Sequence[tuple[LoraSession, SampleRequest]]) -> list[SampleResponse]:
        eos = self.tokenizer.eos_token_id
        out: list[dict[int, list[SampledSequence]]] = [{} for _ in calls]
        settings: dict[Any, list[int]] = {}
        stop_ids: list[list[int]] = []
        for k, (_, request) in enumerate(calls):
            p = request.params
            stops = tuple(p.stop_token_ids) or ((eos,) if eos is not None else ())
            stop_ids.append(list(stops))
            settings.setdefault((p.max_new_tokens, p.temperature, p.top_p, p.top_k, stops), []).append(k)
        # Prompts with images are sampled on their own after the text rows (see the module docstring).
        text_rows = [[i for i in range(len(r.prompts)) if not (r.images and r.images[i])] for _, r in calls]
        one_length = padded_length_limit(self.model) is None
        # A seeded request draws each sample from its own stream, as TorchBackend's sample does (tinkergym.protocol.seeds);
        # an unseeded one from its session's generator, across its batches.
        generators: dict[int, torch.Generator | RowStreams] = {
            k: self._given.get(id(r)) or (s.generator if r.params.seed is None else RowStreams(sample_seeds(r.prompts, r.num_samples, r.params.seed, r.images)))
            for k, (s, r) in enumerate(calls)}
        self.model.eval()
        self.phase_memory.enter("sample")
        most = self.config.max_sample_batch
        for key, members in settings.items():
            # Each request's sequences in batches of max_sample_batch, as it would be batched alone (and as TorchBackend
            # batches them); several requests' batches share a decode batch where they fit in one.
            batches: list[list[tuple[int, list[int]]]] = [[]]  # [(call, the prompt of each of its sequences in the batch)]
            for k in members:
                for rows in sample_batches(text_rows[k], calls[k][1].num_samples, most):
                    piece = (k, rows)
                    used = sum(len(rows) for _, rows in batches[-1])
                    if batches[-1] and (used + len(piece[1]) > most or not one_length):
                        batches.append([])
                    batches[-1].append(piece)
            params = calls[members[0]][1].params
            for pieces in batches:
                if pieces:
                    self._sample_batch(calls, pieces, params, list(key[-1]), generators, out)
                    self.phase_memory.passed("sample")
        for k, (session, request) in enumerate(calls):
            for i in (i for i in range(len(request.prompts)) if request.images and request.images[i]):
                out[k][i] = self._sample_images(session, request, i, stop_ids[k], generators[k])
        return [SampleResponse(sequences=[seqs[i] for i in range(len(r.prompts))]) for seqs, (_, r) in zip(out, calls)]

    def _sample_batch(self, calls: Sequence[tuple[LoraSession, SampleRequest]], pieces: list[tuple[int, list[int]]], params: Any,
                      stop_ids: list[int], generators: dict[int, torch.Generator | RowStreams], out: list[dict[int, list[SampledSequence]]]) -> None:
        """Decode ``pieces`` (each a call and the prompt of each of its sequences) in one batch, each call's rows drawing
        from its own generator; each sequence is appended to its prompt's in ``out``."""
        prompts: list[list[int]] = []
        adapters: list[int] = []
        segments: list[tuple[range, torch.Generator | SeededRows]] = []
        for k, rows in pieces:
            session, request = calls[k]
            start = len(prompts)
            prompts.extend(request.prompts[i] for i in rows)
            adapters.extend([session.id] * (len(prompts) - start))
            generator = generators[k]
            segments.append((range(start, len(prompts)), generator.take(rows) if isinstance(generator, RowStreams) else generator))
        rng = RowGenerators(segments) if params.temperature > 0 else None
        start_state = [g.get_state() for _, g in segments]
        with self._compute():
            sequences = sample_batch(self.model, prompts, params, stop_ids, self.pad_id, rng, self.config.share_prefixes,
                                     prefix_cache=self.prefix_cache, adapters=adapters)
        if rng is not None:  # each generator as its own batch would leave it: after the step its last row stopped
            rng.settle(start_state, [max(len(sequences[i].tokens) for i in span) - 1 for span, _ in segments])
        for (k, rows), (span, _) in zip(pieces, segments):
            for j, i in enumerate(rows):
                out[k].setdefault(i, []).append(sequences[span[0] + j])

    def _sample_images(self, session: LoraSession, request: SampleRequest, i: int, stop_ids: list[int],
                       generator: torch.Generator | RowStreams) -> list[SampledSequence]:
        """The samples of prompt ``i`` of ``request``, which has images: prefilled once through the session's adapter, past the
        prefix cache, in batches of at most ``max_sample_batch`` (as TorchBackend samples it)."""
        assert self.vision is not None  # _check_sample refused images otherwise
        sequences: list[SampledSequence] = []
        for start in range(0, request.num_samples, self.config.max_sample_batch):
            count = min(self.config.max_sample_batch, request.num_samples - start)
            drawn = generator.take([i] * count) if isinstance(generator, RowStreams) else generator
            with self._compute(), rows_through([session.id]):
                sequences.extend(sample_with_images(self.model, request.prompts[i], request.images[i], self.vision, count, request.params,
                                                    stop_ids, self.pad_id, drawn))
        return sequences

    def logprobs_many(self, calls: Sequence[tuple[LoraSession, tuple]]) -> list[Outcome]:
        """Each call's per-token logprobs of ``(sequences, temperature)`` or ``(sequences, temperature, images)`` (one list of
        images per sequence, for a vision-language base), or the exception it raised."""
        return self._isolated(calls, self._logprobs_together, self._check_logprobs, restore_grads=False)

    def _check_logprobs(self, session: LoraSession, call: tuple) -> None:
        session._check_open()
        sequences, _, images = _scoring_call(call)
        check_scored_images(sequences, images, self.reads_images)
        if self.vision is not None:
            self.vision.check_rows(sequences, images or [[] for _ in sequences], "sequence")

    def _logprobs_together(self, calls: Sequence[tuple[LoraSession, tuple]]) -> list[list[list[float]]]:
        scoring = [_scoring_call(call) for _, call in calls]
        out: list[list[list[float]]] = [[[] for _ in seqs] for seqs, _, _ in scoring]
        rows = [(k, i) for k, (seqs, _, _) in enumerate(scoring) for i in range(len(seqs))]
        self.model.eval()
        for temperature in sorted({t for _, t, _ in scoring}):
            mine = [(k, i) for k, i in rows if scoring[k][1] == temperature]
            data = [Datum(tokens=scoring[k][0][i], loss_mask=[0.0] * len(scoring[k][0][i]), images=_images_of(scoring[k][2], i)) for k, i in mine]
            for micro in plan_micro_batches(data, self.config.micro_batch_size, False):
                picked = [data[j] for j in micro.indices]
                batch = collate(picked, self.device, per_token=False)
                adapters = [calls[mine[j][0]][0].id for j in micro.indices]
                with torch.no_grad(), self._compute():
                    inputs = self._image_inputs(batch.tokens, batch.attention, [d.images for d in picked])
                    scored = logprobs_from(self.model, batch.tokens, batch.attention, temperature=temperature, adapters=adapters, model_inputs=inputs)
                for j, row in zip(micro.indices, scored.tolist()):
                    k, i = mine[j]
                    out[k][i] = row[: len(data[j].tokens)]
        return out

    # ----- isolation --------------------------------------------------------------------------------
    def _isolated(self, calls: Sequence[tuple[LoraSession, Any]], together: Callable[[Sequence[tuple[LoraSession, Any]]], list[T]],
                  check: Callable[[LoraSession, Any], None], restore_grads: bool) -> list[Outcome]:
        """Run ``calls`` together; a call that fails its ``check`` fails alone, and a failed joint run is undone and run call by call.

        Reads (``restore_grads`` False: sampling, scoring) may hold several calls of one session: they change no weights, and
        unseeded ones draw from the session's generator one after another (see :meth:`RowGenerators.settle`).
        """
        outcomes: list[Outcome] = [None] * len(calls)
        ready: list[int] = []
        for k, (session, request) in enumerate(calls):
            try:
                check(session, request)
            except Exception as exc:  # noqa: BLE001 - the request's own error is its outcome
                outcomes[k] = exc
            else:
                ready.append(k)
        if restore_grads and len({id(calls[k][0]) for k in ready}) < len(ready):
            raise ValueError("one training call per session at a time: a session's calls run in order")
        with self._lock:
            groups = [ready] if ready else []
            while groups:
                group = groups.pop(0)
                saved = {k: calls[k][0]._saved(restore_grads) for k in group}
                try:
                    results = together([calls[k] for k in group])
                except Exception as exc:  # noqa: BLE001 - undone below; each call then meets its own error alone
                    for k in group:
                        calls[k][0]._restore(*saved[k])
                    if len(group) == 1:
                        outcomes[group[0]] = exc
                    else:
                        groups = [[k] for k in group] + groups
                    continue
                for k, result in zip(group, results):
                    outcomes[k] = result
        return outcomes


def _scoring_call(call: tuple) -> tuple[list[list[int]], float, list[list[ImageData]] | None]:
    """``(sequences, temperature, images or None)`` of a ``logprobs_many`` call given with or without its images."""
    sequences, temperature, *rest = call
    return sequences, temperature, (rest[0] if rest else None)


def _images_of(images: list[list[ImageData]] | None, i: int) -> list[ImageData]:
    return [] if images is None else list(images[i])
