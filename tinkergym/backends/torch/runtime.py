"""How TorchBackend sets up torch: device, dtype, attention implementation, deterministic kernels, gradient checkpointing."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import json
import os
import warnings
from pathlib import Path
from collections.abc import Callable, Iterator

import torch

from tinkergym.backends.torch.attention import NAME as GROUPED_MATMUL
from tinkergym.backends.torch.attention import register as register_grouped_matmul
from tinkergym.errors import ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@functools.cache
def _malloc_trim() -> Callable[[ctypes.c_size_t], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_free_memory() -> bool:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``); False where there is no such call.

    On a CPU, glibc serves torch's tensors of up to 32 MiB from its heap and keeps their memory when they are freed. A
    sampling phase's keys and values and prefix cache (hundreds of small tensors, a GiB at 32 games in flight) stayed
    in the process through the training passes after them, whose larger tensors glibc maps afresh: the process held
    both phases' memory at once (a league of 8 players: 4.7 GiB after its first step where 1 GiB was live). Called where
    one phase's memory is done with; it costs milliseconds, and pages taken again later are faulted in anew.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux: ``/proc/self/statm``); None where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PhaseMemory:
    """When a backend releases the C heap's free memory (:func:`release_free_memory`).

    - When its work turns from sampling to training or back (:meth:`enter`): each phase's tensors are of other sizes
      than the other's, so what one freed the other seldom reuses.
    - Within a phase, when the heap has crept (:meth:`passed`, after each pass): passes of the same size reuse each
      other's memory, but not all of it (a league's training passes grew the process ~100 MiB a pass at SmolLM2-135M).
      The resident memory after the first pass of a phase (or after a release) is its level; a pass that leaves more
      than ``slack`` (a share of the level, ``min_slack`` at least) above it releases. Releasing after every pass
      instead cost 7% of a CPU pass (the next pass faults its memory in again); this costs that every few passes.
    - Before a pass larger (in tokens, :meth:`passing`) by more than ``slack`` than any before it since the last
      release: its tensors are larger than the free pieces the smaller passes left, which would stay resident beside
      them (a league's one pass of two players' unshared rows took 1.9 GiB more than the passes before it, 0.9 of them
      such pieces).

    On a GPU the heap holds little and seldom grows: it releases at the turns only.
    """

    def __init__(self, slack: float = 0.1, min_slack: int = 256 * 2**20) -> None:
        self.slack, self.min_slack = slack, min_slack
        self.phase: str | None = None
        self.level: dict[str, int] = {}  # per phase: the resident memory after its first pass since the last release
        self.largest: dict[str, int] = {}  # per phase: its largest pass since the last release, in tokens
        self.releases = 0

    def enter(self, phase: str) -> None:
        """Work of ``phase`` (``"sample"`` or ``"train"``) starts."""
        if self.phase is not None and phase != self.phase:
            self._release()
        self.phase = phase

    def passing(self, phase: str, size: int) -> None:
        """A pass of ``phase`` of ``size`` (tokens it runs) starts. Each phase keeps its own level and largest pass:
        with rollouts sampled on another thread while a step trains, the two phases' passes come in turn."""
        largest = self.largest.get(phase, 0)
        if largest and size > largest * (1 + self.slack):
            self._release()
        self.largest[phase] = max(self.largest.get(phase, 0), size)

    def passed(self, phase: str) -> None:
        """A pass of ``phase`` ended (its tensors freed)."""
        now = resident_bytes()
        if now is None:
            return
        level = self.level.get(phase)
        if level is None:
            self.level[phase] = now
        elif now > level + max(self.min_slack, self.slack * level):
            self._release()

    def _release(self) -> None:
        self.level, self.largest = {}, {}
        if release_free_memory():
            self.releases += 1


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; anything else as torch reads it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> bfloat16 where ``device`` computes it natively (CUDA bf16, CPU AVX512-BF16/AMX), else float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return torch.bfloat16 if native else torch.float32


def deterministic_mode() -> None:
    """Deterministic kernels for this process: ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic
    kernel raises instead of running), cuBLAS's fixed workspace and no cuDNN autotuning. Set before the first CUDA call."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


_FLASH_ATTN: list[bool] = []


def flash_attn_importable() -> bool:
    """Whether ``flash_attn`` really imports here (once per process). A wheel built for another torch or CUDA is found
    by ``find_spec`` but fails at import (undefined symbols), which must mean "not installed", not a crash at load."""
    if not _FLASH_ATTN:
        if importlib.util.find_spec("flash_attn") is None:
            _FLASH_ATTN.append(False)
        else:
            try:
                import flash_attn  # noqa: F401

                _FLASH_ATTN.append(True)
            except Exception as exc:  # noqa: BLE001 - ImportError, OSError, RuntimeError: any failure means unusable
                warnings.warn(f"flash-attn is installed but does not import ({type(exc).__name__}: {str(exc)[:200]}); using sdpa attention",
                              stacklevel=2)
                _FLASH_ATTN.append(False)
    return _FLASH_ATTN[0]


def resolve_attn_implementation(name: str, device: torch.device, dtype: torch.dtype, model_path: str | None = None) -> str:
    """``"auto"`` -> flash_attention_2 when flash-attn is importable on cuda in bfloat16 (it needs half precision), else
    sdpa; on a CPU in half precision :mod:`~tinkergym.backends.torch.attention`'s grouped_matmul (sdpa's masks, faster
    there on training shapes), in float32 sdpa (whose float32 kernels are as fast or faster at every shape measured);
    eager for a model class that supports neither (Gemma 2's soft-capped attention, for one)."""
    if name != "auto":
        return name
    if device.type == "cuda" and dtype == torch.bfloat16 and flash_attn_importable():
        if _model_class_supports(model_path, "_supports_flash_attn"):
            return "flash_attention_2"
    if not _model_class_supports(model_path, "_supports_sdpa"):
        return "eager"
    return GROUPED_MATMUL if device.type == "cpu" and dtype != torch.float32 else "sdpa"


def _model_class_supports(model_path: str | None, flag: str) -> bool:
    """Whether the transformers class of the model in ``model_path`` declares ``flag`` (True when it cannot be told)."""
    if model_path is None or not os.path.isfile(os.path.join(model_path, "config.json")):
        return True
    import transformers

    architectures = json.loads(Path(model_path, "config.json").read_text()).get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    return bool(getattr(model_class, flag, True))


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer of ``model`` (a transformers model) in training mode, keeping the KV cache passed to it.

    Non-reentrant checkpointing: gradients reach a LoRA adapter on a frozen base without inputs that require
    grad. Transformers drops a layer's KV cache under checkpointing unless the layer says the cache survives a
    recompute; the training passes give their layers caches that do (see
    :func:`~tinkergym.backends.torch.scoring.replayable_cache`), so the layers say so.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"{type(model).__name__} does not support gradient checkpointing; train without --gradient-checkpointing")
    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        raise ConfigError("gradient checkpointing with shared prompts needs a newer transformers: pip install -U transformers")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence the FutureWarning peft causes by reading transformers' deprecated ``is_gradient_checkpointing`` (not actionable here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def load_causal_lm(path: str, dtype: torch.dtype | str, **kwargs: object) -> torch.nn.Module:
    """The causal LM in folder ``path`` in ``dtype``; a peft adapter folder (a LoRA run's ``final/``) merged into its base.

    A vision-language model folder (:func:`~tinkergym.backends.models.is_vision_folder`) loads as
    ``AutoModelForImageTextToText`` (its vision tower and language model together).

    ``AutoModelForCausalLM.from_pretrained`` of an adapter folder attaches the adapter unmerged, under peft's
    default name: a LoRA added on top for training would then replace it, and training would start from the
    base model instead of the adapter's. Here the base (``base_model_name_or_path``, itself possibly an adapter
    folder) is loaded in float32, the adapter merged into it in float32 and the result cast to ``dtype`` once
    (``dtype="auto"``: merged in the dtype the base's config names, as transformers loads it).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tinkergym.backends.models import adapter_base, is_adapter_folder, is_vision_folder

    if kwargs.get("attn_implementation") == GROUPED_MATMUL:
        register_grouped_matmul()
    if not is_adapter_folder(path):
        auto = AutoModelForImageTextToText if is_vision_folder(path) else AutoModelForCausalLM
        return auto.from_pretrained(path, dtype=dtype, **kwargs)
    from peft import PeftModel

    base_path = adapter_base(path)
    base = load_causal_lm(base_path, "auto" if dtype == "auto" else torch.float32, **kwargs)
    with quiet_peft():
        merged = PeftModel.from_pretrained(base, path).merge_and_unload()
    return merged if dtype == "auto" else merged.to(dtype)


def compute_in(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device`` where trainable weights (float32 masters, a LoRA adapter) are kept in another
    dtype than the computation's; nothing to do in float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
