"""Frozen copies of a training model for the GPU path: the compute-dtype sampling copy, the KL reference, the merged export.

Full fine-tuning keeps float32 master weights; the copies it samples and scores with hold their linear weights in
the compute dtype (bfloat16) without a float32 duplicate on the device at any time, and their KV caches store
keys and values in that dtype. A merged LoRA export is merged on the host. :func:`kv_token_cost` is the share of
a token's memory one copy of a shared prompt's KV cache takes, which the micro-batch planner counts.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from tinkergym.backends.torch.cache_names import cache_name


def sampling_copy(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | None = None) -> torch.nn.Module:
    """A frozen copy of ``model`` on ``device`` whose linear weights are in ``dtype`` and whose other weights stay as they are.

    Built weight by weight, never as a whole duplicate in the weights' own dtype: each linear weight is cast
    straight into a new ``dtype`` tensor, and every other weight already on ``device`` in its dtype is shared
    with ``model`` (a frozen alias that in-place updates of ``model`` reach), else moved there. A tied output
    embedding gets its own ``dtype`` weight: converting the shared one would also turn the input embeddings,
    and with them the whole residual stream, into ``dtype``.
    """
    device = device if device is not None else next(model.parameters()).device
    linear = {id(p) for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)}
    other = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)}
    memo: dict[int, Any] = {}
    for param in model.parameters():
        target = dtype if id(param) in linear and id(param) not in other else param.dtype
        memo[id(param)] = torch.nn.Parameter(param.detach().to(device=device, dtype=target), requires_grad=False)
    sampler = copy.deepcopy(model, memo).to(device).eval().requires_grad_(False)  # .to moves the buffers only
    sampler.register_forward_pre_hook(functools.partial(_cache_in, dtype), with_kwargs=True)
    head = sampler.get_output_embeddings()  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
    if head is not None and head.weight is sampler.get_input_embeddings().weight:  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        source = model.get_output_embeddings().weight.detach()  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        head.weight = torch.nn.Parameter(source.to(device=device, dtype=dtype), requires_grad=False)
    return sampler


class CastCopy:
    """:func:`sampling_copy` of ``source`` as :attr:`model`; :meth:`refresh` copies ``source``'s changed weights into it in place."""

    def __init__(self, source: torch.nn.Module, dtype: torch.dtype) -> None:
        self.source, self.model = source, sampling_copy(source, dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        for name, source in self.source.named_parameters(remove_duplicate=False):
            if targets[name].data_ptr() != source.data_ptr():  # weights kept in their dtype are shared
                targets[name].copy_(source)


def frozen_in_compute_dtype(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``model`` (loaded on the host, used for nothing else) frozen on ``device`` as :func:`sampling_copy` makes its copy.

    Converted in place, layer by layer, so no more than one layer's weights exist twice at any time, on the
    host; the linear layers reach ``device`` already in ``dtype``.
    """
    model.eval().requires_grad_(False)
    head = model.get_output_embeddings()  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
    if head is not None and head.weight is model.get_input_embeddings().weight:  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        head.weight = torch.nn.Parameter(head.weight.detach().to(device=device, dtype=dtype), requires_grad=False)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(device=device, dtype=dtype)
    model.to(device).register_forward_pre_hook(functools.partial(_cache_in, dtype), with_kwargs=True)
    return model


def _cache_in(dtype: torch.dtype, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook: a KV cache that stores keys and values in ``dtype`` for a pass that starts one.

    With float32 embeddings and norms the rotary embedding multiplies the compute-dtype keys by float32 cosines,
    so transformers' cache would hold float32 keys and then, concatenated into them, float32 values: twice the
    memory. Attention reads them in ``dtype`` anyway (autocast casts its inputs; flash-attn needs them so), so
    rounding them when they are stored changes no result of a pass without gradients.
    """
    given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None  # either name, whichever the caller used
    if kwargs.get("use_cache") and not given and not torch.is_grad_enabled():
        from transformers import DynamicCache

        cache = DynamicCache(config=module.config)  # type: ignore[arg-type]  # the HF config via nn.Module.__getattr__
        for layer in cache.layers:
            layer.update = functools.partial(update_in, dtype, layer.update)  # type: ignore[method-assign, union-attr]  # linear-attention layers lack update
        kwargs[cache_name()] = cache
    return args, kwargs


def update_in(dtype: torch.dtype, update: Any, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    return update(keys.to(dtype), values.to(dtype), *args, **kwargs)


def kv_token_cost(config: Any) -> float:
    """What one position of a copied KV cache costs next to a token run through the model in training, estimated high.

    A copy holds keys and values (``2 * kv_heads * head_dim`` numbers per layer) and in the backward pass their
    gradient as many again. A token run through the model keeps, per layer, its norms' inputs and outputs,
    queries, keys, values, the attention output and the MLP's gate, up and activated intermediates for the
    backward pass; counted here as just ``2 * hidden + 2 * intermediate`` numbers, about a sixth of what a
    Llama-style layer keeps (``tests/backends/test_backend_memory.py`` measures it), so the copies are never undercounted.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    intermediate = getattr(config, "intermediate_size", None) or 2 * config.hidden_size
    return min(1.0, 4 * heads * head_dim / (2 * config.hidden_size + 2 * intermediate))


def merged_on_host(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a peft model) with its adapters merged, in host memory: no second copy of it on its device.

    The weights are copied to the host one by one; each layer's update (``B @ A`` times the scaling) is still
    computed on the device by the live layer, exactly as peft computes it there, and added on the host (an
    elementwise sum, rounded the same way everywhere), so the merged weights are those of merging on the device.
    """
    host = torch.device("cpu")
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(p.detach().to(host, copy=True), requires_grad=p.requires_grad) for p in model.parameters()}
    memo.update({id(b): b.detach().to(host, copy=True) for b in model.buffers()})
    copied = copy.deepcopy(model, memo)
    live = dict(model.named_modules())
    for name, module in copied.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "lora_A"):
            module.get_delta_weight = functools.partial(_delta_to_host, live[name])
    return copied.merge_and_unload()  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__


def _delta_to_host(module: torch.nn.Module, adapter: str) -> torch.Tensor:
    return module.get_delta_weight(adapter).cpu()  # type: ignore[operator]  # a peft method via nn.Module.__getattr__


class MergedLoraCopy:
    """A frozen, plain copy of a peft model for sampling: each adapted linear layer's weight is ``W + scaling * B @ A``.

    Sampling through peft runs two small matmuls per adapted layer besides the base layer's, with their casts,
    scaling and sum: on a CPU that made a LoRA decode step 1.25x a full fine-tuning one (``decode_profile.py``, side by side).
    Here only the adapted linear weights are duplicated (in the base's dtype), every other weight is the live
    model's own; the merge is computed in float32 and rounded once. :meth:`refresh` recomputes the merged
    weights in place after the adapter changed. :meth:`build` returns None for what it does not cover: other
    adapter layer types or variants (DoRA), several adapters, a weight shared with another module (a tied head).
    """

    def __init__(self, model: torch.nn.Module, pairs: list[tuple[torch.nn.Module, torch.Tensor]], adapter: str) -> None:
        self.model, self._pairs, self._adapter = model, pairs, adapter

    @classmethod
    def build(cls, peft_model: torch.nn.Module, adapter: str = "default") -> MergedLoraCopy | None:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]
        if list(getattr(peft_model, "peft_config", {})) != [adapter] or not layers:
            return None
        if any(type(m) is not LoraLinear  # type: ignore[comparison-overlap]  # mypy misses that peft's Linear is such a layer
               or m.lora_variant or adapter not in m.lora_A for m in layers):
            return None
        weights = [m.get_base_layer().weight for m in layers]
        adapted = {id(w) for w in weights}
        elsewhere = [p for m in peft_model.modules() if not isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)]
        if len(adapted) != len(weights) or any(id(p) in adapted for p in elsewhere):
            return None
        # Every weight but the adapted ones is shared (the memo maps it to itself); buffers are copied (small).
        memo: dict[int, Any] = {id(p): p for p in peft_model.parameters()}
        for layer, weight in zip(layers, weights):
            memo[id(weight)] = torch.nn.Parameter(_merged_weight(layer, adapter), requires_grad=False)
        copied = copy.deepcopy(peft_model, memo)
        live = dict(peft_model.named_modules())
        pairs = [(live[name], m.get_base_layer().weight) for name, m in copied.named_modules() if isinstance(m, BaseTunerLayer)]
        return cls(copied.unload().eval(), pairs, adapter)  # type: ignore[operator, arg-type]  # HF/peft methods, attributes via nn.Module.__getattr__

    @torch.no_grad()
    def refresh(self) -> None:
        for layer, target in self._pairs:
            target.copy_(_merged_weight(layer, self._adapter))


def _merged_weight(layer: torch.nn.Module, adapter: str) -> torch.Tensor:
    """``layer``'s base weight plus its adapter's update (peft's ``get_delta_weight``), summed in float32, in the weight's dtype."""
    weight = layer.get_base_layer().weight  # type: ignore[operator]  # a peft method via nn.Module.__getattr__
    with torch.no_grad():
        return (weight.float() + layer.get_delta_weight(adapter).float()).to(weight.dtype)  # type: ignore[operator]  # a peft method via nn.Module.__getattr__
