"""How much device memory a :class:`~tinkergym.backends.torch.backend.TorchBackend` training job needs, before it runs.

:func:`estimate_training_memory` reads a model's transformers config, builds the model on the ``meta`` device (no
weights are read or allocated) to count its parameters, and adds up what one device holds at the peak of a training
step that accumulates micro-batches (the second micro-batch of a step, the optimizer's moments already made):

- **weights**: LoRA keeps the frozen base in the compute ``dtype`` and the adapter in float32 (peft's choice); full
  fine-tuning keeps every weight in ``param_dtype``, float32 masters when the compute dtype is lower (TorchBackend's rule,
  :func:`backend_param_dtype`). Full fine-tuning under autocast also keeps a compute-dtype copy of every linear weight
  for the whole ``forward_backward`` (autocast's cast cache; see ``TorchBackend.forward_backward``): **autocast weight
  copies**.
- **gradients** of the trainable weights, in their dtype; **optimizer**: AdamW's two moments per trainable weight.
- **activations** of one micro-batch of ``micro_batch_size`` rows of ``max_seq_len`` tokens at the backward pass's
  peak: what autograd keeps per token and decoder layer (a Llama-style layer: two RMSNorms, attention, a gated MLP; see
  :func:`layer_token_bytes`), the attention probabilities where the attention implementation keeps them
  (``grouped_matmul`` on a CPU, ``eager``), the logits of every token in the compute dtype, and the largest transient
  of the backward pass: the logits' gradient with the float32 chunk the log-softmax works on (see
  :mod:`~tinkergym.backends.torch.losses`), or a layer's gradients through its attention probabilities (see
  :func:`activation_bytes`). Unmodelled: LoRA dropout (0 by default), which keeps a copy of each adapted input.
- A vision-language model (a config with a ``vision_config``) is counted as TorchBackend loads it, whole
  (``AutoModelForImageTextToText``): its vision tower's weights (every weight outside the language model and its
  output layer, the projector included; :attr:`ModelShape.vision_params`) are among the weights, frozen beside the base
  with LoRA (``"all-linear"`` adapts the language model's linear layers only, as TorchBackend does) and trained with
  the rest in full fine-tuning (their gradients and AdamW moments too). The tower's activations are not counted: with
  LoRA the frozen tower keeps none for the backward pass, and in full fine-tuning they grow with the patches of a
  micro-batch's images, which the estimate is not told.
- With ``ranks > 1`` (:mod:`~tinkergym.backends.torch.sharded`): FSDP2 shards the weights, gradients and optimizer
  state of the modules it wraps over the ranks; a LoRA adapter, and a vision-language model's vision side (with its
  gradients and AdamW moments in full fine-tuning), are left out of FSDP and replicated on every rank. One
  decoder layer and the root module's weights (embeddings, final norm, head) are gathered whole at a time, in the
  compute dtype, and in full fine-tuning the layer's gradient before its reduce-scatter (**gathered**). Every rank
  first loads the whole model on the host and ``fully_shard`` moves it to the device a layer at a time; on a CPU the
  host is the device, so there the whole model is held at once (**loading**), which can be the peak.

The formula is checked against autograd's saved tensors and against measured peaks of real steps on a CPU
(``tests/backends/test_sizing.py``); on a GPU the caching allocator's reserve and the CUDA context (several hundred
MB) come on top, which :func:`check_fits` leaves to its ``headroom``. Importing this module imports no torch.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from tinkergym.errors import ConfigError

GiB = 2**30
#: Bytes per element of the dtypes a backend computes or keeps weights in.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Attention implementations that keep the attention probabilities (``[heads, query, key]`` per row) for the backward pass.
KEEPS_PROBABILITIES = ("grouped_matmul", "eager")
#: The LoRA adapter a full fine-tuning job that does not fit is offered (TorchBackendConfig's default targets).
SUGGESTED_LORA_RANK = 16


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only model (a vision-language model's language model, its vision tower
    counted in the weights), read from its config (:func:`model_shape`)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated_mlp: bool  #: a gate and an up projection (Llama, Qwen, Mistral) rather than one up projection (GPT-2)
    params: int  #: every weight once (a tied output layer is its embedding; a vision-language model's vision tower included)
    linear_params: int  #: the linear layers' weights and biases, the output layer's included even when tied (what autocast casts;
    #: a vision-language model's vision layers too)
    layer_params: int  #: the largest repeated block's (a decoder layer; a vision-language model's vision blocks too)
    root_params: int  #: outside the repeated blocks (embeddings, final norm, an untied head, a vision patch embedding): FSDP2's root module
    largest_param: int  #: the largest single weight tensor (its gradient is made whole before it is added)
    lora_io: int  #: the sum of ``in + out`` over the linear layers ``"all-linear"`` adapts (adapter params = rank x this): peft's
    #: choice, or a vision-language model's language model's linear layers (TorchBackend's)
    lora_linears: int  #: how many linear layers ``"all-linear"`` adapts
    vision_params: int = 0  #: of ``params``, a vision-language model's outside its language model (vision tower, projector)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds at the peak of a training step, by part (see the module's notes); ``per_rank`` is the peak."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    weight_copies: int = 0
    gathered: int = 0
    loading: int = 0
    ranks: int = 1
    params: int = 0
    trainable_params: int = 0
    #: What it was estimated from, so that :func:`check_fits` can price other settings: the resolved arguments, the
    #: model's shape and the adapter's ``(params, adapted layers)``.
    settings: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    shape: ModelShape | None = field(default=None, repr=False, compare=False)
    adapter: tuple[int, int] = field(default=(0, 0), repr=False, compare=False)

    @property
    def training(self) -> int:
        """Bytes per device while training: the sum of the parts."""
        return self.weights + self.weight_copies + self.gathered + self.gradients + self.optimizer + self.activations

    @property
    def per_rank(self) -> int:
        """Peak bytes per device: training, or loading the whole model where a sharded job's ranks each load it first."""
        return max(self.training, self.loading)

    @property
    def total(self) -> int:
        """Peak bytes over all ``ranks`` devices."""
        return self.per_rank * self.ranks

    def describe(self) -> str:
        """One line: each part and the sum, e.g. ``weights 0.50 GiB, gradients ..., activations 0.21 GiB = 2.2 GiB per device``."""
        parts = [("weights", self.weights), ("autocast weight copies", self.weight_copies), ("gathered layer", self.gathered),
                 ("gradients", self.gradients), ("optimizer", self.optimizer), ("activations", self.activations)]
        text = ", ".join(f"{name} {_gib(size)}" for name, size in parts if size or name in ("weights", "activations"))
        text += f" = {_gib(self.training)} per device"
        if self.ranks > 1:
            text += f" ({self.ranks} devices)"
        if self.loading > self.training:
            text += f"; loading the whole model first takes {_gib(self.loading)}"
        return text


def _gib(size: float) -> str:
    """``size`` bytes for people: ``1.23 GiB``, ``12.3 GiB``, ``456 MiB`` below a GiB, ``12 KiB`` below a MiB."""
    if size < 2**20:
        return f"{size / 2**10:.3g} KiB"
    if size < GiB:
        return f"{size / 2**20:.3g} MiB"
    return f"{size / GiB:.2f} GiB" if size < 10 * GiB else f"{size / GiB:.1f} GiB"


def backend_param_dtype(lora_rank: int, dtype: str) -> str:
    """The dtype TorchBackend keeps the trained model's weights in: float32 masters for full fine-tuning in a lower
    compute dtype, else the compute dtype (a LoRA base; its adapter is float32 whatever this says)."""
    return "float32" if lora_rank == 0 and dtype != "float32" else dtype


def _dtype_name(dtype: Any, device: str) -> str:
    """``dtype`` (a name, ``"auto"`` or a torch dtype) as a key of :data:`DTYPE_BYTES`."""
    name = str(dtype).removeprefix("torch.")
    if name == "auto":  # TorchBackend's "auto" also checks a CPU's bfloat16 support; a GPU is assumed to have it
        return "bfloat16" if device == "cuda" else "float32"
    if name not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)} or 'auto', not {dtype!r}")
    return name


def _text_config(model_config: Any) -> Any:
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def model_shape(model_config: Any) -> ModelShape:
    """The :class:`ModelShape` of a transformers config, counted on a model built on the ``meta`` device (no weights)."""
    config_class: Any = type(model_config)  # a key of the cache, with the config's JSON
    return _model_shape(model_config.to_json_string(use_diff=False), config_class)


def is_vision_config(model_config: Any) -> bool:
    """Whether ``model_config`` is a vision-language model's (it has a ``vision_config``; TorchBackend's rule for a folder)."""
    return getattr(model_config, "vision_config", None) is not None


#: The module of a vision-language model that holds its language model: LoRA adapts its linear layers only (TorchBackend,
#: the shared server's sessions, and the estimates here), and the vision tower stays frozen.
LANGUAGE_MODEL = "language_model"


def in_language_model(name: str) -> bool:
    """Whether the module or weight ``name`` of a vision-language model is its language model's (what TorchBackend's LoRA adapts)."""
    return f".{LANGUAGE_MODEL}." in f".{name}."


def language_model_linears(model: Any) -> list[str]:
    """The names of a vision-language model's linear layers in its language model: LoRA's ``all-linear`` there (peft's own
    ``all-linear`` would adapt the vision tower too)."""
    import torch

    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and in_language_model(n)]


def _meta_model(config: Any) -> Any:
    """``config``'s model on the ``meta`` device, as TorchBackend loads it (a vision-language model whole)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto: Any = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return auto.from_config(config)
    except Exception as exc:  # noqa: BLE001 - any failure to build means the model cannot be counted
        raise ConfigError(f"cannot build {type(config).__name__} on the meta device to count its weights ({exc}); estimate memory by hand") from exc


@functools.lru_cache(maxsize=32)
def _model_shape(config_json: str, config_class: Any) -> ModelShape:
    import torch

    config = config_class.from_dict(json.loads(config_json))
    model = _meta_model(config)
    text = _text_config(config)
    heads = text.num_attention_heads
    output = model.get_output_embeddings()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in _decoder_layers(model)]
    unique = {id(p): p for p in model.parameters()}
    vision: dict[int, Any] = {}
    if is_vision_config(config):  # every weight outside the language model and its output layer
        head = {id(p) for p in output.parameters()}
        vision = {id(p): p for n, p in model.named_parameters() if not in_language_model(n) and id(p) not in head}
        language = [(n, m) for n, m in linears if in_language_model(n)]  # what TorchBackend's "all-linear" adapts in a VLM
    else:
        language = [(n, m) for n, m in linears if m is not output]
    vision_params = sum(p.numel() for p in vision.values())
    return ModelShape(
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        gated_mlp=any(n.endswith(("gate_proj", "gate_up_proj", "w3")) for n, _ in language),
        params=sum(p.numel() for p in unique.values()),
        linear_params=sum(p.numel() for _, m in linears for p in m.parameters()),
        layer_params=max(layer_params, default=0),
        root_params=sum(p.numel() for p in unique.values()) - sum(layer_params),
        largest_param=max(p.numel() for p in unique.values()),
        lora_io=sum(m.in_features + m.out_features for _, m in language),
        lora_linears=len(language),
        vision_params=vision_params,
    )


def _decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks FSDP2 wraps one by one (the model's ``_no_split_modules`` classes; see ``sharded.decoder_layers``)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def lora_counts(model_config: Any, rank: int, target_modules: str | list[str]) -> tuple[int, int]:
    """``(adapter params, adapted linear layers)`` of peft's LoRA of ``rank`` on ``target_modules``, applied on the meta device
    (``"all-linear"`` of a vision-language model: its language model's linear layers, as TorchBackend adapts them)."""
    targets = target_modules if isinstance(target_modules, str) else tuple(target_modules)
    config_class: Any = type(model_config)
    return _lora_counts(model_config.to_json_string(use_diff=False), config_class, rank, targets)


@functools.lru_cache(maxsize=32)
def _lora_counts(config_json: str, config_class: Any, rank: int, targets: str | tuple[str, ...]) -> tuple[int, int]:
    from peft import LoraConfig, get_peft_model

    from tinkergym.backends.torch.runtime import quiet_peft

    config = config_class.from_dict(json.loads(config_json))
    model = _meta_model(config)
    modules: str | list[str] = targets if isinstance(targets, str) else list(targets)
    if modules == "all-linear" and is_vision_config(config):  # TorchBackend adapts the language model only
        modules = language_model_linears(model)
    try:
        with quiet_peft():
            model = get_peft_model(model, LoraConfig(r=rank, target_modules=modules))
    except ValueError as exc:
        raise ConfigError(f"lora_target_modules {targets!r} match no layer of this model ({exc}); name its linear layers, or use 'all-linear'") from exc
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return adapter, sum(1 for m in model.modules() if hasattr(m, "lora_A"))


def layer_token_bytes(shape: ModelShape, compute: int, full: bool, casts: bool, attention: str, lora_width: int = 0) -> int:
    """What autograd keeps per token of one decoder layer (linear in the sequence length), in bytes.

    ``compute``: bytes per element of the compute dtype; ``full``: every weight trains (the norms keep their normalized
    input for their weight's gradient); ``casts``: float32 masters under autocast, so each linear layer keeps its own
    compute-dtype copy of its input (three for q, k, v; two for a gated MLP); ``lora_width``: the summed ranks of the
    layer's adapters (each keeps its down-projected input). Llama-style RMSNorms compute in float32 and keep their
    input and its inverse RMS in float32 whatever the dtype. Counted from what a Llama layer hands autograd
    (``tests/backends/test_sizing.py`` compares it, tensor by tensor, for each mode).
    """
    h, i, f, a = shape.hidden, shape.intermediate, 4, compute
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    mlp_inputs = 2 if shape.gated_mlp else 1
    norms = 2 * (f * h + f) + (2 * f * h if full else 0)
    inputs = (3 + mlp_inputs) * a * h if casts else 2 * a * h
    if attention in KEEPS_PROBABILITIES:
        # grouped_matmul: queries and keys in float32 (its scores' matmul), values in the compute dtype; eager
        # repeats the keys and values per query head.
        kept = f * (q + kv) + a * kv if attention == "grouped_matmul" else a * 3 * q
    elif attention == "flash_attention_2":
        kept = a * (q + 2 * kv + q) + f * shape.heads  # q, k, v, the output and its log-sum-exp
    else:
        kept = a * (q + 2 * q + q) + f * shape.heads  # sdpa repeats keys and values per query head under a padding mask
    mlp = (4 if shape.gated_mlp else 2) * a * i  # gate, up, activated gate, their product (or up and activated)
    return norms + inputs + kept + a * q + mlp + a * lora_width


def saved_bytes(shape: ModelShape, *, rows: int, length: int, compute: int, param: int, full: bool, casts: bool,
                attention: str, lora_width: int = 0, checkpointing: bool = False, recomputed: bool = True) -> int:
    """What autograd keeps of a forward pass over ``rows`` sequences of ``length`` tokens, in bytes.

    Every layer's kept tensors (:func:`layer_token_bytes`), or under gradient checkpointing each layer's input plus
    one layer recomputed in the backward pass; the attention probabilities (``heads x length x length`` per row and
    layer) where they are kept, and the boolean mask the layers share; the final norm's tensors, the head's input
    (where the head trains), the rotary embedding's cosines and sines (in the residual stream's dtype) and the ids.
    With LoRA the first layer's first norm keeps nothing (no weight before it trains). ``recomputed`` False leaves
    the recomputed layer (its kept tensors and probabilities) out of a checkpointed pass.
    """
    tokens = rows * length
    per_layer = layer_token_bytes(shape, compute, full, casts, attention, lora_width)
    probabilities = 0  # per layer
    if attention in KEEPS_PROBABILITIES:  # float32 scores soft-maxed, and the probabilities in the compute dtype
        probabilities = shape.heads * rows * length * length * (4 + (compute if compute != 4 else 0))
    mask = 0 if attention == "flash_attention_2" else rows * length * length
    if checkpointing:
        kept = tokens * shape.layers * param * shape.hidden + ((tokens * per_layer + probabilities) if recomputed else 0)
    else:
        kept = shape.layers * (tokens * per_layer + probabilities)
    once = 4 * shape.hidden + 4 + 2 * shape.head_dim * param + ((4 + compute) * shape.hidden + 8 if full else 0)
    if not full and shape.layers and not checkpointing:
        once -= 4 * shape.hidden + 4  # with LoRA nothing before the first layer's norm trains: it keeps nothing
    return kept + mask + tokens * once


def activation_bytes(shape: ModelShape, *, rows: int, length: int, compute: int, param: int, full: bool, casts: bool,
                     attention: str, lora_width: int, checkpointing: bool, device: str) -> int:
    """Peak bytes of one micro-batch beyond the weights, gradients and optimizer: :func:`saved_bytes` and the backward pass's peak.

    The logits of every token (the backend scores from the first masked-in position, so this is at most what it
    scores) are kept in the compute dtype through the backward pass. On top of what is kept, the largest of: the
    logits' gradient and the float32 chunk of rows the log-softmax's backward works on (see
    :mod:`~tinkergym.backends.torch.losses`); a layer's backward through kept attention probabilities (the gradients
    of the probabilities and of the scores, float32); in full fine-tuning, the logits' gradient and the largest
    weight's gradient made whole (under autocast first in the compute dtype) before it is added to the accumulated one.
    Under gradient checkpointing the two phases of the backward pass do not overlap: the head's (logits and their
    gradients) ends before the first layer is recomputed, so the peak is the larger of the two, each over the layers'
    inputs: the head's, or one recomputed layer's kept tensors, probabilities and their backward.
    """
    from tinkergym.backends.torch.losses import CHUNK_ROWS, CPU_CHUNK_BYTES

    tokens = rows * length
    kept = saved_bytes(shape, rows=rows, length=length, compute=compute, param=param, full=full, casts=casts,
                       attention=attention, lora_width=lora_width, checkpointing=checkpointing)
    logits = tokens * shape.vocab * compute
    chunk = max(1, CPU_CHUNK_BYTES // (4 * shape.vocab)) if device == "cpu" else CHUNK_ROWS
    softmax_backward = logits + min(tokens, chunk) * shape.vocab * 4
    attention_backward = 8 * shape.heads * rows * length * length if attention in KEEPS_PROBABILITIES else 0
    new_gradient = logits + shape.largest_param * (4 + (compute if casts else 0)) if full else 0
    if checkpointing:
        layer = kept - saved_bytes(shape, rows=rows, length=length, compute=compute, param=param, full=full, casts=casts,
                                   attention=attention, lora_width=lora_width, checkpointing=True, recomputed=False)
        return kept - layer + max(logits + max(softmax_backward, new_gradient), layer + attention_backward)
    return kept + logits + max(softmax_backward, attention_backward, new_gradient)


def estimate_training_memory(
    model_config: Any,
    *,
    lora_rank: int,
    lora_target_modules: str | list[str] | None = None,
    dtype: Any,
    param_dtype: Any = None,
    micro_batch_size: int,
    max_seq_len: int,
    ranks: int = 1,
    gradient_checkpointing: bool = False,
    optimizer: str = "adamw",
    device: str = "cuda",
    attn_implementation: str = "auto",
) -> MemoryEstimate:
    """Bytes per device of training ``model_config`` (a transformers config) as TorchBackend trains it; see the module's notes.

    ``dtype``: the compute dtype; ``param_dtype``: what the trained weights are kept in (None: TorchBackend's rule,
    :func:`backend_param_dtype`); ``lora_rank`` 0 is full fine-tuning; ``lora_target_modules`` None is
    ``"all-linear"``; a micro-batch is ``micro_batch_size`` rows of ``max_seq_len`` tokens (the backend packs shared
    prompts within that many tokens); ``device`` ``"cuda"`` or ``"cpu"`` picks the attention implementation ``"auto"``
    stands for (sdpa; on a CPU in half precision grouped_matmul) and the log-softmax's chunk; ``ranks`` > 1: the FSDP2 sharded backend.
    """
    if optimizer != "adamw":
        raise ConfigError(f"optimizer must be 'adamw' (the only one TorchBackend uses), not {optimizer!r}")
    if lora_rank < 0 or micro_batch_size < 1 or max_seq_len < 1 or ranks < 1:
        raise ConfigError("lora_rank must be >= 0, and micro_batch_size, max_seq_len and ranks at least 1")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device must be 'cuda' or 'cpu', not {device!r}")
    compute_name = _dtype_name(dtype, device)
    settings: dict[str, Any] = {
        "lora_rank": lora_rank, "lora_target_modules": lora_target_modules or "all-linear", "dtype": compute_name,
        "param_dtype": _dtype_name(param_dtype, device) if param_dtype is not None else backend_param_dtype(lora_rank, compute_name),
        "micro_batch_size": micro_batch_size, "max_seq_len": max_seq_len, "ranks": ranks, "gradient_checkpointing": gradient_checkpointing,
        "device": device, "attn_implementation": attn_implementation,
    }
    adapter = (0, 0) if lora_rank == 0 else lora_counts(model_config, lora_rank, settings["lora_target_modules"])
    return estimate_from_shape(model_shape(model_config), adapter, settings)


def estimate_from_shape(shape: ModelShape, adapter: tuple[int, int], settings: dict[str, Any]) -> MemoryEstimate:
    """:func:`estimate_training_memory` of a counted model: ``adapter`` is ``(params, adapted layers)``, ``settings`` its arguments, resolved."""
    compute, param = DTYPE_BYTES[settings["dtype"]], DTYPE_BYTES[settings["param_dtype"]]
    ranks, lora = settings["ranks"], settings["lora_rank"] > 0
    adapter_params, adapted = adapter
    attention = settings["attn_implementation"]
    if attention == "auto":  # TorchBackend's choice (runtime.resolve_attn_implementation) for a model with an sdpa path
        attention = "grouped_matmul" if settings["device"] == "cpu" and settings["dtype"] != "float32" else "sdpa"
    casts = not lora and param != compute and ranks == 1  # sharded: FSDP2 gathers the weights in the compute dtype already
    trainable = adapter_params if lora else shape.params
    trainable_bytes = 4 if lora else param  # peft keeps an adapter in float32
    sharded = 1 if lora else ranks  # the adapter is replicated on every rank
    lora_width = settings["lora_rank"] * adapted // max(shape.layers, 1)
    activations = activation_bytes(
        shape, rows=settings["micro_batch_size"], length=settings["max_seq_len"], compute=compute, param=param, full=not lora,
        casts=casts, attention=attention, lora_width=lora_width, checkpointing=settings["gradient_checkpointing"], device=settings["device"],
    )
    whole = shape.vision_params if ranks > 1 else 0  # sharded: a vision-language model's vision side is whole on every rank
    trained_whole = 0 if lora else whole
    weights = -(-(shape.params - whole) * param // ranks) + whole * param + adapter_params * 4
    copies = shape.linear_params * compute if casts else 0
    if lora and compute != 4:
        copies += adapter_params * compute  # autocast's casts of the float32 adapter
    gathered = 0
    if ranks > 1:
        gathered = (shape.layer_params + shape.root_params) * compute + (0 if lora else shape.layer_params * 4)
    return MemoryEstimate(
        weights=weights,
        gradients=-(-(trainable - trained_whole) * trainable_bytes // sharded) + trained_whole * trainable_bytes,
        optimizer=-(-2 * (trainable - trained_whole) * trainable_bytes // sharded) + 2 * trained_whole * trainable_bytes,  # AdamW's two moments
        activations=activations,
        weight_copies=copies,
        gathered=gathered,
        # A sharded job loads the whole model on the host first; fully_shard then moves it to the device layer by layer.
        # On a CPU the host is the device, so the whole model is there at once.
        loading=shape.params * param + adapter_params * 4 if ranks > 1 and settings["device"] == "cpu" else 0,
        ranks=ranks,
        params=shape.params + adapter_params,
        trainable_params=trainable,
        settings=settings,
        shape=shape,
        adapter=adapter,
    )


def _alternatives(estimate: MemoryEstimate, usable: int) -> list[str]:
    """What to change, each with the figure it would need: fewer tokens per micro-batch, gradient checkpointing, LoRA,
    the fewest devices that fit (where any do), and where no one change fits, all of the first three together."""
    settings, redo = estimate.settings, functools.partial(replace_settings, estimate)
    rows, length = settings["micro_batch_size"], settings["max_seq_len"]
    out, together = [], {}
    if rows > 1:
        n = next((n for n in range(rows - 1, 0, -1) if redo(micro_batch_size=n).per_rank <= usable), 1)
        out.append(f"micro_batch_size {n} (now {rows}): {_gib(redo(micro_batch_size=n).per_rank)}")
        together["micro_batch_size"] = n
    elif length > 1:
        out.append(f"sequences of {length // 2} tokens (now {length}): {_gib(redo(max_seq_len=length // 2).per_rank)}")
    if not settings["gradient_checkpointing"]:
        out.append(f"gradient checkpointing (--gradient-checkpointing): {_gib(redo(gradient_checkpointing=True).per_rank)}")
        together["gradient_checkpointing"] = True
    if settings["lora_rank"] == 0:
        out.append(f"LoRA instead of full fine-tuning (lora_rank {SUGGESTED_LORA_RANK}): {_gib(redo(lora_rank=SUGGESTED_LORA_RANK).per_rank)}")
        together["lora_rank"] = SUGGESTED_LORA_RANK
    ranks = next((r for r in (2, 4, 8, 16, 32, 64) if r > settings["ranks"] and redo(ranks=r).per_rank <= usable), None)
    if ranks is not None:
        out.append(f"{ranks} devices (now {settings['ranks']}): {_gib(redo(ranks=ranks).per_rank)} each")
    if len(together) > 1 and all(redo(**{k: v}).per_rank > usable for k, v in together.items()):
        out.append(f"all of {', '.join(f'{k}={v}' for k, v in together.items())} together: {_gib(redo(**together).per_rank)}")
    return out


def check_fits(estimate: MemoryEstimate, device_bytes: int, headroom: float = 0.9) -> None:
    """Raise :class:`~tinkergym.errors.ConfigError` with the figures and what to change when ``estimate`` needs more than
    ``headroom`` of a device's ``device_bytes`` (the rest: the CUDA context, the allocator's reserve, fragmentation)."""
    usable = int(device_bytes * headroom)
    if estimate.per_rank <= usable:
        return
    options = "; ".join(_alternatives(estimate, usable) if estimate.shape is not None else ["a smaller model"])
    raise ConfigError(
        f"this training job needs about {_gib(estimate.per_rank)} per device ({estimate.describe()}) but a device has "
        f"{_gib(device_bytes)} ({headroom:.0%} usable): change one of these: {options}"
    )


def replace_settings(estimate: MemoryEstimate, **changes: Any) -> MemoryEstimate:
    """``estimate`` redone for the same model with some settings changed; a new ``lora_rank`` adapts every linear layer
    (``"all-linear"``) and keeps the weights as TorchBackend would (:func:`backend_param_dtype`)."""
    if estimate.shape is None:
        raise ConfigError("this estimate holds no model shape; call estimate_training_memory again")
    settings, adapter = {**estimate.settings, **changes}, estimate.adapter
    if "lora_rank" in changes:
        rank = settings["lora_rank"]
        settings.update(lora_target_modules="all-linear", param_dtype=backend_param_dtype(rank, settings["dtype"]))
        adapter = (rank * estimate.shape.lora_io, estimate.shape.lora_linears) if rank else (0, 0)
    return estimate_from_shape(estimate.shape, adapter, settings)


__all__ = [
    "MemoryEstimate", "ModelShape", "activation_bytes", "saved_bytes", "backend_param_dtype", "check_fits", "estimate_from_shape",
    "estimate_training_memory", "in_language_model", "is_vision_config", "layer_token_bytes", "lora_counts", "model_shape",
    "replace_settings",
]


# ----- a worker's models, as the scheduler sees them -----------------------------------------------------
#: The fields of a :class:`ModelShape`, in order: what a worker sends for each model it offers. ``vision_params`` stays
#: home: it is a part of ``params`` that no figure reads apart, and the scheduler's wire takes these fields only.
SHAPE_FIELDS = tuple(name for name in ModelShape.__dataclass_fields__ if name != "vision_params")


def shape_dict(shape: ModelShape) -> dict[str, Any]:
    """``shape`` as JSON-ready fields (``gated_mlp`` a bool, the rest integers)."""
    return {name: getattr(shape, name) for name in SHAPE_FIELDS}


def static_estimate(shape: dict[str, Any], *, lora_rank: int, dtype: str, ranks: int, device: str,
                    gradient_checkpointing: bool = False) -> MemoryEstimate:
    """What a training job keeps on each device whatever its batches: weights, gradients and optimizer state (and the
    gathered layer of a sharded job, and its whole-model load), from a model's :func:`shape_dict`, with LoRA on every
    linear layer (``"all-linear"``, TorchBackend's default; a vision-language model's language model's) and one token
    of activations. What ``serve backend`` checks at its start (``--device-memory-gb``) and the scheduler before a
    lease. Torch-free."""
    model = ModelShape(**shape)
    compute = _dtype_name(dtype, device)
    settings = {"lora_rank": lora_rank, "lora_target_modules": "all-linear", "dtype": compute, "param_dtype": backend_param_dtype(lora_rank, compute),
                "micro_batch_size": 1, "max_seq_len": 1, "ranks": ranks, "gradient_checkpointing": gradient_checkpointing,
                "device": device, "attn_implementation": "auto"}
    adapter = (lora_rank * model.lora_io, model.lora_linears) if lora_rank else (0, 0)
    return estimate_from_shape(model, adapter, settings)


def seat_estimate(shape: dict[str, Any], *, lora_rank: int, dtype: str, device: str, micro_batch_size: int, max_seq_len: int) -> tuple[int, int]:
    """``(kept, activations)``: the bytes a LoRA job adds to a shared server's device, from a model's :func:`shape_dict`:
    what it keeps between calls (its adapter, gradients and AdamW's two moments in float32, and autocast's copy of the
    adapter in a half precision) and the activations of one of its micro-batches (``micro_batch_size`` rows of
    ``max_seq_len`` tokens), which a shared server's passes hold one at a time. What the scheduler prices a seat job
    at (:func:`tinkergym.scheduler.memory.seat_refusal`). Torch-free."""
    model = ModelShape(**shape)
    compute = _dtype_name(dtype, device)
    settings = {"lora_rank": lora_rank, "lora_target_modules": "all-linear", "dtype": compute, "param_dtype": backend_param_dtype(lora_rank, compute),
                "micro_batch_size": micro_batch_size, "max_seq_len": max_seq_len, "ranks": 1, "gradient_checkpointing": False,
                "device": device, "attn_implementation": "auto"}
    adapter = lora_rank * model.lora_io
    estimate = estimate_from_shape(model, (adapter, model.lora_linears), settings)
    kept = adapter * 4 + estimate.gradients + estimate.optimizer + (adapter * DTYPE_BYTES[compute] if DTYPE_BYTES[compute] != 4 else 0)
    return kept, estimate.activations


def main(argv: list[str] | None = None) -> int:
    """``python -m tinkergym.backends.torch.sizing MODEL...``: each model's :func:`shape_dict` as one JSON object
    (model name -> fields; a model that cannot be counted is left out and said on standard error). A worker runs it
    once at its start, so that its own process imports no torch."""
    import sys

    from transformers import AutoConfig

    from tinkergym.backends.models import resolve_model

    shapes = {}
    for name in (sys.argv[1:] if argv is None else argv):
        try:
            shapes[name] = shape_dict(model_shape(AutoConfig.from_pretrained(resolve_model(name))))
        except Exception as exc:  # noqa: BLE001 - one model that cannot be read leaves the others counted
            print(f"tinkergym: cannot count the weights of {name}: {exc}", file=sys.stderr)
    print(json.dumps(shapes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
