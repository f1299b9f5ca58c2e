"""The local compute backend: a transformers causal LM, LoRA (peft) or full fine-tuning, in this process.

:class:`TorchBackend` implements every :class:`~tinkergym.protocol.backend.Backend` method:

- ``sample``: batched generation with a KV cache over left-padded prompts (see
  :mod:`tinkergym.backends.torch.sampling` for what the returned logprobs mean).
- ``forward_backward``: micro-batches of at most ``micro_batch_size`` sequences; sequences that share their
  prompt (a GRPO group) run it once (see :mod:`tinkergym.backends.torch.scoring`). Each micro-batch's loss is
  weighted with normalizers of the whole request, so the accumulated gradients equal those of one big batch.
  Gradients keep accumulating across calls until ``optim_step``.
- KL to a reference (``LossSpec.kl_coef`` > 0): with LoRA the reference is the same model with the adapter
  switched off (no second copy of the weights). With full fine-tuning a frozen copy of the starting weights
  is loaded from disk the first time a KL term is asked for, and only then.
- ``save_state`` / ``load_state``: trainable weights, AdamW state, step and the torch, CUDA (of the backend's
  device), Python and NumPy RNG states, as safetensors and JSON only (see :mod:`tinkergym.backends.torch.state_files`;
  nothing is ever unpickled); training resumed from a checkpoint continues bit for bit.
- ``export``: the peft adapter folder, or (``merged=True`` or full fine-tuning) a plain transformers folder,
  both with the tokenizer.

Precision: ``dtype`` is the compute dtype. LoRA keeps the frozen base in it and the adapter in float32;
full fine-tuning in bfloat16 keeps float32 weights; both compute under autocast (AdamW updates applied to
bfloat16 weights are mostly rounded away, and peft's own float32 path for the adapter spends more time on
casting activations than on the adapter itself).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np
import torch

from tinkergym.backends.torch import lora_states, losses, multi_lora
from tinkergym.backends.torch.batches import (
    Batch, adamw_step, check_prompts, check_scored_images, check_weights_finite, collate, request_normalizers, sample_batches, validate_data,
)
from tinkergym.backends.models import is_vision_folder, resolve_model, tokenizer_folder
from tinkergym.backends.torch.attention import NAME as GROUPED_MATMUL
from tinkergym.backends.torch.vision import VisionInputs, forbid_tokens, sample_with_images, vision_token_ids
from tinkergym.backends.torch.sharded_states import SHARDED_FORMAT, load_sharded_state
from tinkergym.backends.torch.state_files import check_state_format, read_optimizer_state, read_rng_state, restore_rng_state, write_optimizer_state, write_rng_state
from tinkergym.backends.torch.copies import CastCopy, MergedLoraCopy, frozen_in_compute_dtype, merged_on_host, sampling_copy, kv_token_cost  # noqa: F401
from tinkergym.backends.torch.prefix_cache import PrefixCache, adapter_scope
from tinkergym.backends.torch.sampling import RowStreams, sample_batch
from tinkergym.backends.torch.turns import TurnLock
from tinkergym.backends.torch.runtime import (  # noqa: F401 - public here too
    DTYPES,
    PhaseMemory,
    compute_in,
    deterministic_mode,
    enable_gradient_checkpointing,
    flash_attn_importable,
    load_causal_lm,
    quiet_peft,
    resolve_attn_implementation,
    resolve_device,
    resolve_dtype,
)
from tinkergym.backends.torch.scoring import (
    MicroBatch,
    logprobs_from,
    plan_micro_batches,
    sequence_logprobs,
)
from tinkergym.protocol.seeds import sample_seeds
from tinkergym.protocol.types import (
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    ImageData,
    OptimParams,
    SampleRequest,
    SampleResponse,
    SampledSequence,
    PlainData,
)
from tinkergym.config import DEFAULT_DTYPE, DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK, DEFAULT_MICRO_BATCH_SIZE
from tinkergym.errors import ConfigError, OutOfMemoryError
from tinkergym.plumbing.folders import fresh_tmp_dir, replace_dir

#: Version of the save_state folder layout (:data:`~tinkergym.backends.torch.lora_states.BACKEND_STATE_FORMAT`).
STATE_FORMAT = lora_states.BACKEND_STATE_FORMAT


@dataclass
class TorchBackendConfig(PlainData):
    """Settings of a :class:`TorchBackend`: ids, paths and numbers only, so it serializes with the run.

    Attributes:
        model: A local HF folder, a known name (``"tiny"``, ``"smollm2-135m"``) or a hub id; see
            :func:`~tinkergym.backends.models.resolve_model`.
        lora_rank: LoRA rank; 0 trains every parameter (full fine-tuning).
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``).
        lora_dropout: Dropout on the LoRA input during ``forward_backward``.
        lora_target_modules: ``"all-linear"`` or a list of module names, as peft takes them.
        dtype: Compute dtype: ``"auto"`` (bfloat16 where the hardware supports it, else float32),
            ``"bfloat16"`` or ``"float32"``. Full fine-tuning in bfloat16 keeps float32 master weights and
            computes under autocast; LoRA keeps the frozen base in bfloat16 and the adapter in float32.
        device: ``"auto"`` (cuda if available, else cpu) or a torch device string.
        attn_implementation: ``"auto"`` (flash_attention_2 when flash-attn is installed, on cuda, in bfloat16;
            on a CPU in half precision ``"grouped_matmul"``, see :mod:`~tinkergym.backends.torch.attention`; else sdpa) or any name
            transformers accepts.
        micro_batch_size: Sequences per forward/backward pass; bounds memory, not the effective batch. Groups
            that share a prompt are packed up to the tokens of that many of the request's longest sequences.
        max_sample_batch: Sequences generated together in one batch.
        share_prefixes: Run a prompt shared by several sequences once, when sampling and when training
            (exact up to floating-point summation order); False scores every sequence on its own.
        prefix_cache_mb: Memory for automatic prefix caching when sampling: each sampled sequence's keys and values
            are kept, and a later prompt that starts with one (the next turn of a multi-turn episode or game)
            runs only what follows (:mod:`~tinkergym.backends.torch.prefix_cache`). Emptied whenever the weights
            change and at every training pass; 0 turns it off.
        seed: Seeds torch, Python and NumPy at start (LoRA initialization, unseeded sampling, dropout).
        cache_dir: Where named models are built or converted; None uses the default cache.
        deterministic: Deterministic kernels only (:func:`deterministic_mode`: for the whole process), so a run and
            its resume repeat bit for bit on a GPU too, at some cost in speed; on CPU the kernels already are.
        gradient_checkpointing: Keep only each decoder layer's input during ``forward_backward`` and recompute the
            rest in the backward pass: activation memory of one layer instead of all, for about a third more
            compute. Works with LoRA and full fine-tuning and keeps shared prompts shared (see
            :mod:`tinkergym.backends.torch.scoring`); gradients equal those without it.
        lora_sampling: How LoRA samples: ``"adapter"`` through the adapter, as the training pass computes; or
            ``"merged"`` from a copy of the adapted weights with the adapter merged in
            (:class:`~tinkergym.backends.torch.copies.MergedLoraCopy`: a second copy of those weights, refreshed
            after each optimizer step), 1.25-1.4x faster sampling on a CPU. In bfloat16 the merged weights are
            rounded: an update under half a bfloat16 step of its weight is lost to the sampler (``mismatch/*`` grows).
    """

    model: str = "tiny"
    lora_rank: int = DEFAULT_LORA_RANK
    lora_alpha: float = float(DEFAULT_LORA_ALPHA)
    lora_dropout: float = 0.0
    lora_target_modules: str | list[str] = "all-linear"
    dtype: str = DEFAULT_DTYPE
    device: str = "auto"
    attn_implementation: str = "auto"
    micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE
    max_sample_batch: int = 64
    share_prefixes: bool = True
    prefix_cache_mb: float = 1024.0
    seed: int = 0
    cache_dir: str | None = None
    deterministic: bool = False
    gradient_checkpointing: bool = False
    lora_sampling: str = "adapter"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be 'auto', 'bfloat16' or 'float32', not {self.dtype!r}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0 (0 = full fine-tuning), not {self.lora_rank}")
        if self.micro_batch_size < 1 or self.max_sample_batch < 1:
            raise ConfigError("micro_batch_size and max_sample_batch must be at least 1")
        if self.lora_sampling not in ("merged", "adapter"):
            raise ConfigError(f"lora_sampling must be 'adapter' or 'merged', not {self.lora_sampling!r}")
        if not (self.prefix_cache_mb >= 0 and math.isfinite(self.prefix_cache_mb)):
            raise ConfigError(f"prefix_cache_mb must be >= 0 (0 turns the prefix cache off), not {self.prefix_cache_mb}")


def _locked(sampling: bool) -> Any:
    """A decorator: run the method holding the backend's lock. A snapshot sampled on another thread (``async_steps``) runs
    between the training thread's calls (or between a ``forward_backward``'s micro-batches), never inside one; a sample
    call (``sampling``) that waits goes before the training calls that wait (:class:`~tinkergym.backends.torch.turns.TurnLock`)."""

    def decorate(method: Any) -> Any:
        @functools.wraps(method)
        def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._lock.call(lambda: method(self, *args, **kwargs), sampling)

        return locked

    return decorate


_one_at_a_time = _locked(sampling=False)
_sampling_first = _locked(sampling=True)


class TorchSnapshot:
    """The weights of a :class:`TorchBackend` at one version (its optimizer steps), to sample from on another thread while
    the backend trains on (:meth:`TorchBackend.sampling_snapshot`): a copy of the LoRA adapter's weights, or of the whole
    model in the compute dtype for full fine-tuning. Its ``sample`` is thread-safe."""

    #: A rollout pipeline runs this snapshot's sample calls on the trainer's thread (see
    #: :class:`~tinkergym.trainers.async_rollouts.TrainerThreadCalls`): the backend's compute is fastest from one thread.
    samples_on_trainer_thread = True

    def __init__(self, backend: TorchBackend, version: int, weights: list[torch.Tensor] | None = None, model: torch.nn.Module | None = None) -> None:
        self.backend, self.version, self.weights, self.model = backend, version, weights, model

    def sample(self, request: SampleRequest) -> SampleResponse:
        """``request`` sampled with the snapshot's weights (as :meth:`TorchBackend.sample` samples with the current ones)."""
        return self.backend._sample_snapshot(self, request)


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


class TorchBackend:
    """A policy in this process: transformers model (+ peft LoRA), AdamW, checkpoints and export.

    Args:
        config: Model, LoRA, precision and batching settings; defaults to :class:`TorchBackendConfig`.
    """

    def __init__(self, config: TorchBackendConfig | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config or TorchBackendConfig()
        self.model_path = resolve_model(self.config.model, self.config.cache_dir)
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        attn = self.config.attn_implementation
        if self.config.deterministic:
            deterministic_mode()
            if attn == "auto" and self.device.type == "cuda":
                attn = "eager"  # flash-attn's and the efficient sdpa kernels' backward passes accumulate in a varying order
        self.attn_implementation = resolve_attn_implementation(attn, self.device, self.dtype, self.model_path)
        self.reads_images = is_vision_folder(self.model_path)
        if self.reads_images and self.attn_implementation == GROUPED_MATMUL:
            self.attn_implementation = "sdpa"  # the vision tower's attention runs on packed patches, which only the built-in kernels take
        # Full fine-tuning keeps float32 master weights and computes in self.dtype under autocast: AdamW on
        # bfloat16 weights would round most small updates away. LoRA keeps the frozen base in self.dtype
        # (peft keeps the adapter in float32).
        full_low_precision = self.config.lora_rank == 0 and self.dtype != torch.float32
        self.param_dtype = torch.float32 if full_low_precision else self.dtype
        random.seed(self.config.seed)
        np.random.seed(self.config.seed)
        torch.manual_seed(self.config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(self.model_path))
        self.model = self._load_base(self.param_dtype)
        #: A vision-language model's inputs beside the ids (None for a text model): see tinkergym.backends.torch.vision.
        self.vision = VisionInputs.of(self.model, self.model_path, self.tokenizer) if self.reads_images else None
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        if self.config.lora_rank > 0:
            self.model = self._add_lora(self.model)
        else:
            self.model.requires_grad_(True)
        self.step = 0
        self._trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # The fused kernel updates every weight in one pass; the default per-tensor loop takes seconds per
        # step for full fine-tuning of a 135M model on a CPU.
        self.optimizer = torch.optim.AdamW([p for _, p in self._trainable], lr=0.0, fused=self.device.type in ("cpu", "cuda"))
        self._reference: torch.nn.Module | None = None
        self._sampling_copy: CastCopy | MergedLoraCopy | None = None  # see _sampling_model
        self._sampling_copy_stale = False  # the trainable weights changed since the copy was made or refreshed
        self.prefix_cache = PrefixCache(max_bytes=int(self.config.prefix_cache_mb * 2**20))
        self.phase_memory = PhaseMemory()
        self._lock = TurnLock()  # one call at a time, sample calls first: the training thread's, or a snapshot's (see sampling_snapshot)
        self._last_snapshot: TorchSnapshot | None = None
        # Padding is only ever read behind the attention mask, so any id does when the tokenizer has none.
        fallbacks = (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        self.pad_id = next(t for t in fallbacks if t is not None)

    def _load_base(self, dtype: torch.dtype, device: torch.device | None = None) -> torch.nn.Module:
        """The base model from disk in ``dtype`` on ``device`` (default: the backend's device)."""
        model = load_causal_lm(self.model_path, dtype, attn_implementation=self.attn_implementation)
        # torch 2.13 multiplies a non-contiguous [B, 1, H] slice (what logits_to_keep leaves) with a frozen
        # weight by broadcasting the weight to [B, H, V] first: seconds per prefill with a frozen (LoRA) head.
        model.get_output_embeddings().register_forward_pre_hook(_contiguous_input)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        if self.reads_images:
            forbid_tokens(model, vision_token_ids(self.tokenizer))
        return model.to(self.device if device is None else device)

    def _compute(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype when any trainable weights (full float32 masters, a LoRA adapter) are kept in another one."""
        return compute_in(self.device, self.dtype)

    def _add_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model

        targets = self.config.lora_target_modules
        if self.reads_images and targets == "all-linear":
            from tinkergym.backends.torch.sizing import language_model_linears

            targets = language_model_linears(model)  # the vision tower stays frozen (peft's all-linear would adapt it too)
        lora = LoraConfig(
            r=self.config.lora_rank,
            lora_alpha=self.config.lora_alpha,  # type: ignore[arg-type]  # peft's int: it divides alpha by r
            lora_dropout=self.config.lora_dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        with quiet_peft():
            model = get_peft_model(model, lora)
        # An exported adapter names the model this backend started from as its base (an adapter folder it
        # started from included; load_causal_lm merges that), not the base that folder was merged into.
        for adapter_config in model.peft_config.values():
            adapter_config.base_model_name_or_path = self.model_path
        # The adapter's A factors drawn as a shared base's session draws them (multi_lora.draw_a, module order, a generator
        # of the seed alone): a job starts from the same adapter on a whole server, a shared seat or the Tinker API.
        init = torch.Generator().manual_seed(self.config.seed)
        with torch.no_grad():
            for module in model.modules():
                adapters = getattr(module, "lora_A", None)  # peft's ModuleDict of the layer's adapters (one here)
                if isinstance(adapters, torch.nn.ModuleDict):
                    for a in adapters.values():
                        weight = a.weight
                        assert isinstance(weight, torch.Tensor)
                        weight.copy_(multi_lora.draw_a(weight.shape[0], weight.shape[1], init))
        # peft casts each layer's input to the adapter's float32 before the adapter; under autocast (every
        # forward here runs in _compute) the adapter computes in the compute dtype from its float32 weights.
        for module in model.modules():
            if hasattr(module, "lora_A"):
                module.cast_input_dtype_enabled = False  # type: ignore[assignment]  # peft's flag; nn.Module.__setattr__ types tensors
        return model

    @property
    def is_lora(self) -> bool:
        """Whether the trainable weights are a LoRA adapter (else every weight trains)."""
        return self.config.lora_rank > 0

    def info(self) -> dict[str, Any]:
        """Model, tokenizer folder, LoRA rank, dtype, device, step and parameter counts."""
        return {
            "model": self.config.model,
            "model_path": self.model_path,
            "tokenizer": tokenizer_folder(self.model_path),
            "lora_rank": self.config.lora_rank,
            "lora_alpha": self.config.lora_alpha,
            "lora_dropout": self.config.lora_dropout,
            "micro_batch_size": self.config.micro_batch_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "device": str(self.device),
            "attn_implementation": self.attn_implementation,
            "deterministic": self.config.deterministic,
            "gradient_checkpointing": self.config.gradient_checkpointing,
            "step": self.step,
            "trainable_params": sum(p.numel() for _, p in self._trainable),
            "total_params": sum(p.numel() for p in self.model.parameters()),
        }

    # ----- sampling and scoring ---------------------------------------------------------------------
    @_sampling_first
    def sample(self, request: SampleRequest) -> SampleResponse:
        """``num_samples`` completions per prompt, in batches of at most ``max_sample_batch`` sequences.

        With ``params.seed`` set, each sample draws from its own stream (:mod:`tinkergym.protocol.seeds`) and repeats
        exactly, whatever the batches and wherever it is drawn; without it, sampling draws from the global torch RNG
        (seeded by the config and saved with the state).
        """
        return self._sample_current(request)

    def _sample_current(self, request: SampleRequest) -> SampleResponse:
        """:meth:`sample`'s work, under the lock (a sharded backend splits it across its ranks)."""
        return self._sample(request, self._sampling_model(), None)

    @_one_at_a_time
    def sampling_snapshot(self) -> TorchSnapshot:
        """A sampler of the weights as they are now, which later optimizer steps leave alone (``async_steps``: the next
        steps' rollouts sample from it on another thread while this one trains).

        LoRA: a copy of the adapter's weights (float32, the adapter's size); sampling swaps them into the model for the
        call, under the backend's lock, and back. Full fine-tuning: a copy of the whole model in the compute dtype (one
        more model's weights in memory per snapshot alive: at most ``async_steps`` + 1), sampled on its own. A snapshot
        of the current version is made once and shared. The prefix cache keeps a snapshot's prompts apart from the
        current weights'.
        """
        last = self._last_snapshot
        if last is not None and last.version == self.step:
            return last
        if self.is_lora:
            snapshot = TorchSnapshot(self, self.step, weights=[p.detach().clone() for _, p in self._trainable])
        else:
            model = copy.deepcopy(self.model).requires_grad_(False).eval()
            snapshot = TorchSnapshot(self, self.step, model=model if self.param_dtype == self.dtype else model.to(self.dtype))
        self._last_snapshot = snapshot
        return snapshot

    @_sampling_first
    def _sample_snapshot(self, snapshot: TorchSnapshot, request: SampleRequest) -> SampleResponse:
        scope = ("snapshot", snapshot.version, id(snapshot))
        if snapshot.model is not None:
            return self._sample(request, snapshot.model, scope)
        assert snapshot.weights is not None
        live = [p.detach().clone() for _, p in self._trainable]
        try:
            with torch.no_grad():
                for (_, param), weight in zip(self._trainable, snapshot.weights):
                    param.copy_(weight)
            return self._sample(request, self.model.eval(), scope)
        finally:
            with torch.no_grad():
                for (_, param), weight in zip(self._trainable, live):
                    param.copy_(weight)

    def _sample(self, request: SampleRequest, model: torch.nn.Module, scope: Any, seeds_by_prompt: list[list[int]] | None = None) -> SampleResponse:
        """:meth:`sample` with ``model``; the prefix cache under ``scope`` (None: the model's adapters). ``seeds_by_prompt``:
        each prompt's sample seeds, given (a share of a larger request's prompts) rather than computed from ``params.seed``."""
        params = request.params
        self._check_sample(request)
        eos = self.tokenizer.eos_token_id
        stop_ids = list(params.stop_token_ids) or ([eos] if eos is not None else [])
        n = request.num_samples
        # A seeded request: each sample its own stream (tinkergym.protocol.seeds); else the device's default generator.
        if seeds_by_prompt is None and params.seed is not None:
            seeds_by_prompt = sample_seeds(request.prompts, n, params.seed, request.images)
        seeds = None if seeds_by_prompt is None else RowStreams(seeds_by_prompt)
        with_images = [i for i, images in enumerate(request.images) if images]
        text_rows = [i for i in range(len(request.prompts)) if i >= len(request.images) or not request.images[i]]
        self.prefix_cache.scope = adapter_scope(model) if scope is None else scope
        self.phase_memory.enter("sample")
        results: list[SampledSequence] = []
        for rows in sample_batches(text_rows, n, self.config.max_sample_batch):
            chunk = [request.prompts[i] for i in rows]
            generator = None if seeds is None else seeds.take(rows)
            with self._compute(), self._out_of_memory_advice(chunk, training=False):
                results.extend(sample_batch(model, chunk, params, stop_ids, self.pad_id, generator, self.config.share_prefixes, prefix_cache=self.prefix_cache))
            self.phase_memory.passed("sample")
        sequences: dict[int, list[SampledSequence]] = {i: results[k * n : (k + 1) * n] for k, i in enumerate(text_rows)}
        for i in with_images:  # each prompt with images on its own, past the prefix cache (see tinkergym.backends.torch.vision)
            assert self.vision is not None  # check_prompts refused images otherwise
            sequences[i] = []
            for start in range(0, n, self.config.max_sample_batch):
                count = min(self.config.max_sample_batch, n - start)
                generator = None if seeds is None else seeds.take([i] * count)
                with self._compute(), self._out_of_memory_advice([request.prompts[i]] * count, training=False):
                    sequences[i].extend(sample_with_images(model, request.prompts[i], request.images[i], self.vision, count, params, stop_ids, self.pad_id, generator))
        return SampleResponse(sequences=[sequences[i] for i in range(len(request.prompts))])

    def _check_sample(self, request: SampleRequest) -> None:
        """Refuse a request this backend cannot sample (its parameters, its prompts, their images), before any work."""
        try:
            request.params.check()
        except ValueError as exc:
            raise ConfigError(f"params.{exc}") from None
        check_prompts(request.prompts, request.images, self.reads_images)
        if self.vision is not None and any(request.images):
            self.vision.check_rows(request.prompts, request.images, "prompt")

    def _sampling_model(self) -> torch.nn.Module:
        """The model to sample with: the policy itself, or a copy made for sampling, refreshed when the weights changed.

        Full fine-tuning with float32 master weights samples from a :class:`CastCopy` (autocast re-casts every
        weight on every forward pass under inference mode, its cast cache being off there, which costs more than
        a decode step itself); LoRA with ``lora_sampling`` merged from a :class:`MergedLoraCopy` while this
        backend's own adapter is the active one (an inference engine switches to others, or turns adapters off).
        """
        if self.is_lora:
            wanted = self.config.lora_sampling == "merged" and adapter_scope(self.model) == (("default",), False)
        else:
            wanted = self.param_dtype != self.dtype
        if not wanted:
            return self.model.eval()
        if self._sampling_copy is None:  # a LoRA copy is None where it cannot merge: the live model samples
            self._sampling_copy = MergedLoraCopy.build(self.model) if self.is_lora else CastCopy(self.model, self.dtype)
        elif self._sampling_copy_stale:
            self._sampling_copy.refresh()
        self._sampling_copy_stale = False
        return self.model.eval() if self._sampling_copy is None else self._sampling_copy.model

    @contextlib.contextmanager
    def _out_of_memory_advice(self, rows: list[Any], training: bool) -> Iterator[None]:
        """Turn running out of device memory into :class:`OutOfMemoryError` saying what to lower; drop a partial step's gradients.

        A CUDA allocation that fails raises ``torch.OutOfMemoryError``; a CPU one ``RuntimeError`` (where the
        operating system refuses it rather than ending the process). The caches this backend holds are freed,
        and with ``training`` the gradients accumulated since the last optimizer step (no longer a whole step's).
        """
        try:
            yield
        except RuntimeError as exc:
            if not (isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)):
                raise
            self.prefix_cache.clear()
            lengths = [len(getattr(row, "tokens", row)) for row in rows]
            shape = f"{len(rows)} sequences, {sum(lengths)} tokens, the longest {max(lengths)}"
            if training:
                self.optimizer.zero_grad(set_to_none=True)
                advice = (
                    f"lower micro_batch_size (now {self.config.micro_batch_size}; --micro-batch-size), turn on gradient checkpointing "
                    "(--gradient-checkpointing) or shorten the sequences (--max-context). The gradients accumulated since the last "
                    "optimizer step were dropped"
                )
            else:
                advice = (
                    f"lower max_sample_batch (now {self.config.max_sample_batch}), the prefix cache (--prefix-cache-mb, now "
                    f"{self.config.prefix_cache_mb:g}) or the prompts' length (--max-context)"
                )
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            what = "training pass" if training else "sampling"
            raise OutOfMemoryError(f"{what} ran out of {self.device.type} memory on {shape}: {advice}. ({exc})") from exc

    def _weights_changed(self) -> None:
        """Mark everything computed from the old weights stale: the sampling copy and the prefix cache."""
        self._sampling_copy_stale = True
        self._last_snapshot = None  # a snapshot taken before holds the old weights (it stays valid for those who hold it)
        self.prefix_cache.clear()

    @_one_at_a_time
    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0, images: list[list[ImageData]] | None = None) -> list[list[float]]:
        """Per-token logprobs of whole sequences under the current policy at ``temperature`` (entry 0 is 0.0).

        Scored in the micro-batches training would score them in (see :meth:`plan`), so scoring long sequences
        takes no more memory than training on them; read back once. ``images`` (a vision-language model): one list per
        sequence of the images its image tokens show, in order; a sequence's image tokens must match its images' count.
        """
        check_scored_images(sequences, images, self.reads_images)
        if self.vision is not None:
            self.vision.check_rows(sequences, images or [[] for _ in sequences], "sequence")
        self.model.eval()
        data = [Datum(tokens=s, loss_mask=[0.0] * len(s), images=list(images[i]) if images else []) for i, s in enumerate(sequences)]
        parts: list[torch.Tensor] = []
        order: list[int] = []
        with torch.no_grad():
            for micro in self.plan(data, share_prefixes=False):
                batch = self._collate([data[i] for i in micro.indices])
                with self._compute():
                    parts.append(logprobs_from(self.model, batch.tokens, batch.attention, temperature=temperature,
                                               model_inputs=batch.model_inputs or None))
                order.extend(micro.indices)
        if not parts:
            return []
        width = max(part.shape[1] for part in parts)
        rows = torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts]).tolist()
        out: list[list[float]] = [[] for _ in sequences]
        for i, row in zip(order, rows):
            out[i] = row[: len(sequences[i])]
        return out

    def plan(self, data: list[Datum], share_prefixes: bool | None = None) -> list[MicroBatch]:
        """The micro-batches ``data`` is scored in: :func:`plan_micro_batches` with this backend's settings and
        the cost of its KV cache copies (see :func:`kv_token_cost`)."""
        share = self.config.share_prefixes if share_prefixes is None else share_prefixes
        share = share and not any(d.images for d in data)  # rows with images are scored on their own (tinkergym.backends.torch.vision)
        return plan_micro_batches(data, self.config.micro_batch_size, share, kv_token_cost(self.model.config))

    def _collate(self, data: list[Datum]) -> Batch:
        batch = collate(data, self.device)
        if self.vision is not None and any(d.images for d in data):
            batch.model_inputs = self.vision.model_inputs(batch.tokens, batch.attention, [d.images for d in data])
        return batch

    # ----- training ---------------------------------------------------------------------------------
    @_one_at_a_time
    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        """Compute the named loss on the batch, micro-batch by micro-batch, and accumulate gradients.

        Metrics: ``loss`` and ``tokens`` always; ``kl`` when ``kl_coef`` > 0; ``ratio_mean`` for ``ppo`` and
        ``importance_sampling``; ``clip_fraction`` for ``ppo``; with sampler logprobs, the sampler/trainer
        mismatch (``mismatch/logp_abs_mean``, ``mismatch/logp_abs_max``, ``mismatch/kl``) and with ``tis_cap``
        the truncated importance weights (``tis/weight_mean``, ``tis/capped_fraction``). Means are over masked
        tokens; the loss is normalized by the request's ``num_tokens``/``num_sequences`` when given.
        """
        spec, data = request.loss, request.data
        self._check_data(data, spec)
        self.prefix_cache.clear()  # its memory goes to the activations; sampling after an update starts afresh anyway
        self.phase_memory.enter("train")
        total_mask, num_sequences = request_normalizers(request)
        self.model.train()
        # Metric sums stay on the device until every micro-batch ran: one read-back, not one per metric and micro-batch.
        micro_sums: list[dict[str, torch.Tensor]] = []
        scored: list[list[float] | None] = [None] * len(data) if request.return_logprobs else []
        # One autocast region for all micro-batches: autocast casts a float32 master weight once per region and keeps
        # the cast (the weights stay as they are until optim_step), not once per micro-batch. Loss and backward: no autocast.
        with self._compute():
            for micro in self.plan(data):
                if self._lock.let_samplers_in():  # a snapshot sampled in between (async_steps): its env steps overlap the rest
                    self.model.train()
                self.phase_memory.passing("train", micro.tokens(data))
                sums, logprobs = self._train_micro(data, micro, spec, total_mask, num_sequences)
                if request.return_logprobs:
                    for i, row in zip(micro.indices, logprobs.detach().float().cpu().tolist()):
                        scored[i] = row[: len(data[i].tokens)]
                micro_sums.append(sums)
                self.phase_memory.passed("train")
        totals: dict[str, float] = {}
        for floats in losses.sums_to_floats(micro_sums):  # added in micro-batch order, in float64, as they always were
            totals = losses.add_sums(totals, floats)
        return ForwardBackwardResult(metrics=losses.finalize_metrics(totals), logprobs=scored if request.return_logprobs else None)  # type: ignore[arg-type]

    def _check_data(self, data: list[Datum], spec: Any) -> None:
        """A training request's checks (:func:`~tinkergym.backends.torch.batches.validate_data`), and on a vision-language
        model that each datum's images fill its image tokens."""
        validate_data(data, spec, self.reads_images)
        if self.vision is not None and any(d.images for d in data):
            self.vision.check_rows([d.tokens for d in data], [d.images for d in data], "datum")

    def _train_micro(self, data: list[Datum], micro: MicroBatch, spec: Any, total_mask: float, num_sequences: int,
                     scale: float = 1.0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One micro-batch's loss and backward (gradients accumulate); its metric sums and logprobs. ``scale`` multiplies
        the loss (0: a pass that only takes part in a sharded model's collectives, adding nothing)."""
        rows = [data[i] for i in micro.indices]
        with self._out_of_memory_advice(rows, training=True):
            batch = self._collate(rows)
            logprobs = self._sequence_logprobs(self.model, batch, micro, spec.temperature)
            with torch.autocast(self.device.type, enabled=False):  # a nested region keeps the outer one's casts
                reference = self._reference_logprobs(batch, micro, spec.temperature) if spec.kl_coef > 0 else None
                weights = losses.aggregation_weights(batch.mask, spec.aggregation, total_mask, num_sequences)
                loss, sums = losses.compute_loss_on_device(
                    spec, logprobs, batch.mask, weights, batch.advantages, batch.sampling_logprobs, reference, batch.old_logprobs
                )
                (loss if scale == 1.0 else loss * scale).backward()
        return sums, logprobs

    @staticmethod
    def _sequence_logprobs(model: torch.nn.Module, batch: Batch, micro: MicroBatch, temperature: float) -> torch.Tensor:
        return sequence_logprobs(
            model, batch.tokens, batch.attention, batch.mask, micro, temperature, lengths=batch.lengths, read=batch.read,
            model_inputs=batch.model_inputs or None,
        )

    def _reference_logprobs(self, batch: Batch, micro: MicroBatch, temperature: float) -> torch.Tensor:
        with torch.no_grad(), self._compute():
            if self.is_lora:
                with self.model.disable_adapter():  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
                    return self._sequence_logprobs(self.model, batch, micro, temperature)
            if self._reference is None:
                # The starting weights, read back from disk only when a KL term first needs them.
                # Computed like the policy, so the two agree exactly before the first update. Float32 masters
                # are read on the host and the linear layers go to the device in the compute dtype (see
                # frozen_in_compute_dtype): autocast rounds them the same way on every pass.
                if self.param_dtype == self.dtype:
                    self._reference = self._load_base(self.param_dtype).eval().requires_grad_(False)
                else:
                    self._reference = frozen_in_compute_dtype(self._load_base(self.param_dtype, torch.device("cpu")), self.dtype, self.device)
            return self._sequence_logprobs(self._reference, batch, micro, temperature)

    @_one_at_a_time
    def optim_step(self, params: OptimParams) -> dict[str, float]:
        """One AdamW step with the accumulated gradients (clipped to ``max_grad_norm``), then clear them.

        Returns ``grad_norm`` (before clipping), ``learning_rate`` and the new ``step``.
        """
        trainable = [p for _, p in self._trainable]
        metrics, stepped = adamw_step(self.optimizer, trainable, params, self.step)
        if stepped:
            self.step += 1
            self._weights_changed()
            check_weights_finite(trainable, self.step, params.learning_rate)
        return metrics

    # ----- checkpoints and export -------------------------------------------------------------------
    @_one_at_a_time
    def save_state(self, path: str) -> None:
        """Write trainable weights, AdamW state, step and RNG states into the folder ``path`` atomically.

        Files: ``state.json``, ``trainable.safetensors``, ``optimizer.safetensors`` + ``optimizer.json`` and
        ``rng.safetensors`` + ``rng.json`` (see :mod:`tinkergym.backends.torch.state_files`); no pickles.
        """
        from safetensors.torch import save_file

        self.prefix_cache.clear()  # a run resumed from here starts with an empty cache: so does this one
        tmp = fresh_tmp_dir(path)
        save_file({n: p.detach().cpu().contiguous() for n, p in self._trainable}, os.path.join(tmp, "trainable.safetensors"))
        write_optimizer_state(tmp, self.optimizer.state_dict())
        write_rng_state(tmp, self.device)
        meta = {"format": STATE_FORMAT, "step": self.step, "config": self.config.to_dict(), "model_path": self.model_path}
        Path(tmp, "state.json").write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(tmp, os.fspath(path).rstrip("/"))

    @_one_at_a_time
    def load_state(self, path: str) -> None:
        """Restore what :meth:`save_state` wrote; the backend must have the same model and LoRA settings. A LoRA backend
        also loads what a shared base's session wrote (a job that trained on a seat: :mod:`~tinkergym.backends.torch.lora_states`).

        Gradients accumulated since the last :meth:`optim_step` are dropped: a state holds none, and a client that loads
        one after a lost call (its server unreachable for a moment) must not step with that call's gradients.
        A folder of an older state format (``optimizer.pt``/``rng.pt`` pickles) is refused with a ConfigError.
        """
        from safetensors.torch import load_file

        meta = lora_states.read_meta(path)
        if lora_states.is_session_state(meta):  # a job that trained on a seat of a shared base goes on here
            self._load_session_state(path, meta)
            return
        if meta.get("format") == SHARDED_FORMAT:  # written by a server sharded over several ranks: loads here whole
            load_sharded_state(self, path)
            self.optimizer.zero_grad(set_to_none=True)
            return
        check_state_format(path, meta.get("format"), STATE_FORMAT)
        weights = load_file(os.path.join(path, "trainable.safetensors"), device=str(self.device))
        names = [n for n, _ in self._trainable]
        if sorted(weights) != sorted(names):
            raise ConfigError(
                f"{path} holds other trainable weights than this backend (saved with lora_rank="
                f"{meta['config'].get('lora_rank')}, this one has {self.config.lora_rank}); build the backend with the saved config"
            )
        # Everything is read before anything changes, so a broken folder leaves the backend as it was.
        optimizer_state, rng_state = read_optimizer_state(path), read_rng_state(path)
        self._restore(weights, optimizer_state, int(meta["step"]))
        restore_rng_state(*rng_state, self.device)

    def _load_session_state(self, path: str, meta: dict[str, Any]) -> None:
        """:meth:`load_state` of a state a shared base's session wrote (:mod:`~tinkergym.backends.torch.lora_states`)."""
        from safetensors.torch import load_file

        if not self.is_lora:
            raise ConfigError(f"{path} holds a LoRA adapter's state; a full fine-tuning backend cannot load it")
        lora_states.check_adapter(path, meta, self.config.lora_rank, self.config.lora_alpha)
        saved = load_file(os.path.join(path, "trainable.safetensors"), device=str(self.device))
        weights = lora_states.named_for(saved, session=False)
        if sorted(weights) != sorted(n for n, _ in self._trainable) or any(weights[n].shape != p.shape for n, p in self._trainable):
            raise ConfigError(f"{path} holds the adapter of other layers than this backend's ({self.config.lora_target_modules}); "
                              "load it where the job's adapter targets the saved layers")
        optimizer_state = read_optimizer_state(path)
        lora_states.check_optimizer_shapes(path, optimizer_state, [p for _, p in self._trainable])
        generator = load_file(os.path.join(path, "rng.safetensors"))["generator"]
        self._restore(weights, optimizer_state, int(meta["step"]))
        lora_states.set_device_generator(generator, self.device)

    def _restore(self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any], step: int) -> None:
        """Put a read state's trainable weights, AdamW state and step in place (pending gradients dropped)."""
        with torch.no_grad():
            for name, param in self._trainable:
                param.copy_(weights[name])
        self._weights_changed()
        self.optimizer.load_state_dict(optimizer_state)
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step

    @_one_at_a_time
    def export(self, path: str, merged: bool = False) -> None:
        """Write an HF folder with the tokenizer: the peft adapter, or with ``merged`` (or full fine-tuning) a plain model.

        The adapter loads with ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)``;
        the merged folder with ``AutoModelForCausalLM.from_pretrained(path)``. Training state is untouched.
        """
        self._write_export(self.model, path, merged)

    def _write_export(self, model: torch.nn.Module, path: str, merged: bool) -> None:
        """:meth:`export` of ``model`` (this backend's, or a whole copy of a sharded one's)."""
        tmp = fresh_tmp_dir(path)
        if self.is_lora and not merged:
            model.save_pretrained(tmp)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        elif self.is_lora:
            # Merging rewrites the layers in place, so it happens on a copy, in host memory.
            merged_on_host(model).save_pretrained(tmp)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        else:
            model.save_pretrained(tmp)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        self.tokenizer.save_pretrained(tmp)
        if self.vision is not None:
            self.vision.image_processor.save_pretrained(tmp)
        replace_dir(tmp, os.fspath(path).rstrip("/"))
