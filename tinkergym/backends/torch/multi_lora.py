"""Many LoRA adapters on one frozen base: layers that add, for each row of a batch, the update of that row's adapter.

:func:`inject` wraps every targeted ``nn.Linear`` of a transformers model in a :class:`MultiLoraLinear`, which
computes ``base(x)`` once for the whole batch and adds ``scaling * B(A(x))`` to each row through the adapter
that row belongs to (:mod:`~tinkergym.backends.torch.row_adapters` says which), in plain torch so that it runs (and
backpropagates) on CPU and GPU alike. A batch whose rows all use one adapter runs it on every row. A batch of a few
adapters runs them **stacked**: their ``A`` factors as one ``[total rank, in]`` matrix and their ``B`` as one ``[out,
total rank]``, so two matmuls serve every row, and each row keeps only its own adapter's block of ``x A^T`` (the other
entries multiplied by 0, its own by its scaling). Nothing is gathered: a pass saves ``x`` once for every layer that
reads it, as a single adapter's does, so a batch that mixes adapters (a league's players) holds no more activations
than one adapter's, and a row's gradient reaches its own adapter alone (the zeros pass none to the others). The extra
work is the other adapters' columns of the rank-sized products; past :data:`STACK_SHARE` of the base layer's own work
(many adapters in one batch), rows are instead gathered by adapter, run through it and added back (``index_select`` /
``index_add``): the segmented form of the punica/S-LoRA kernels.

Each adapter has its own rank and alpha; its weights are float32 tensors outside the model's parameters, so
that each owner (a :class:`~tinkergym.backends.torch.lora_session.LoraSession`) keeps its own optimizer over them and
closing it frees them. Names and layout follow peft: an adapter saved by :func:`save_adapter` is an ordinary
peft folder (``adapter_config.json`` + ``adapter_model.safetensors``) that ``PeftModel.from_pretrained``, vLLM
and ``tinkergym serve model`` load, and :func:`read_adapter` reads such folders back.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tinkergym.backends.torch.row_adapters import current
from tinkergym.errors import ConfigError

#: peft's prefix of a saved adapter's weight names (a PeftModel holds the model as ``base_model.model``).
PEFT_PREFIX = "base_model.model."
#: The most work stacked adapters may add to a layer, as a share of the base layer's (see the module docstring).
STACK_SHARE = 0.5


@dataclass
class LoraWeights:
    """One adapter's factors in one layer: ``A`` ``[rank, in]``, ``B`` ``[out, rank]`` and ``scaling = alpha / rank``."""

    A: torch.nn.Parameter
    B: torch.nn.Parameter
    scaling: float

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        # As peft computes it: lora_B(lora_A(x)) * scaling.
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.A), self.B) * self.scaling


class MultiLoraLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` plus any number of LoRA adapters, applied row by row (see the module docstring)."""

    def __init__(self, base_layer: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.adapters: dict[int, LoraWeights] = {}  # plain attributes: not parameters of the model

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        plan = current()
        if plan is None or not self.adapters:
            return y
        if plan.only is not None:
            weights = self.adapters.get(plan.only)
            return y if weights is None else y + weights.delta(x).to(y.dtype)
        present = [(a, self.adapters[a]) for a in plan.present if a in self.adapters]
        if not present:
            return y
        total = sum(w.A.shape[0] for _, w in present)
        if total * (self.in_features + self.out_features) <= STACK_SHARE * self.in_features * self.out_features:
            h = torch.nn.functional.linear(x, torch.cat([w.A for _, w in present]))
            blocks = tuple((a, w.A.shape[0], w.scaling) for a, w in present)
            scales = plan.scales(blocks, h.device, h.dtype).view(x.shape[0], *([1] * (x.dim() - 2)), total)
            return y + torch.nn.functional.linear(h * scales, torch.cat([w.B for _, w in present], dim=1)).to(y.dtype)
        for adapter, rows in plan.segments(x.device):
            weights = self.adapters.get(adapter)
            if weights is not None:
                y = y.index_add(0, rows, weights.delta(x.index_select(0, rows)).to(y.dtype))
        return y


def inject(model: torch.nn.Module, target_modules: str | list[str] = "all-linear", within: str | None = None) -> dict[str, MultiLoraLinear]:
    """Wrap the targeted linear layers of ``model`` in place; ``{module name: layer}``.

    ``"all-linear"`` targets every ``nn.Linear`` but the output head, as peft does; a list names the layers by
    the last part of their module name (``q_proj``, ``v_proj``, ...). ``within``: only layers under a module of that
    name (``"language_model"``: a vision-language model's language model, not its vision tower, whose rows are image
    patches rather than the batch's rows).
    """
    head = model.get_output_embeddings()  # type: ignore[operator]  # an HF method via nn.Module.__getattr__
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if within is not None and f".{within}." not in f".{name}.":
            continue
        if target_modules == "all-linear" or name.rsplit(".", 1)[-1] in target_modules:
            targets.append(name)
    if not targets:
        raise ConfigError(f"no linear layer of the model matches lora_target_modules={target_modules!r}")
    layers = {}
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = MultiLoraLinear(getattr(parent, child))
        setattr(parent, child, layer)
        layers[name] = layer
    return layers


def adapter_bytes(layers: dict[str, MultiLoraLinear], rank: int) -> int:
    """Bytes of one float32 adapter of ``rank`` over ``layers``."""
    return 4 * rank * sum(layer.in_features + layer.out_features for layer in layers.values())


def add_adapter(
    layers: dict[str, MultiLoraLinear], adapter: int, rank: int, alpha: float, device: torch.device, generator: torch.Generator
) -> dict[str, torch.nn.Parameter]:
    """A new adapter in every layer, initialized as peft does (``A`` Kaiming-uniform, ``B`` zero: the update starts at 0).

    Returns its parameters by their peft names (``base_model.model.<layer>.lora_A.weight``), in layer order.
    ``generator`` (a CPU generator) draws ``A``, so an adapter's start depends on its own seed alone.
    """
    params: dict[str, torch.nn.Parameter] = {}
    for name, layer in layers.items():
        weights = LoraWeights(
            A=torch.nn.Parameter(draw_a(rank, layer.in_features, generator).to(device)),
            B=torch.nn.Parameter(torch.zeros(layer.out_features, rank, dtype=torch.float32, device=device)),
            scaling=alpha / rank,
        )
        layer.adapters[adapter] = weights
        params[f"{PEFT_PREFIX}{name}.lora_A.weight"] = weights.A
        params[f"{PEFT_PREFIX}{name}.lora_B.weight"] = weights.B
    return params


def draw_a(rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A LoRA ``A`` factor for a layer of ``in_features`` inputs, float32 on the CPU: ``nn.init.kaiming_uniform_(a,
    a=sqrt(5))`` as peft and ``nn.Linear`` use, drawn from ``generator``. Every place a LoRA job trains (a whole
    :class:`~tinkergym.backends.torch.backend.TorchBackend`, a session of a shared base) draws its adapter with this, layer
    by layer in the model's module order from ``torch.Generator().manual_seed(seed)``: one seed, one start, anywhere."""
    bound = math.sqrt(6.0 / ((1 + 5.0) * in_features))
    return torch.empty(rank, in_features, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def remove_adapter(layers: dict[str, MultiLoraLinear], adapter: int) -> None:
    """Drop the adapter from every layer (its tensors are freed once nothing else holds them)."""
    for layer in layers.values():
        layer.adapters.pop(adapter, None)


def target_names(layers: dict[str, MultiLoraLinear]) -> list[str]:
    """The distinct last parts of the layers' names: peft's ``target_modules`` for them."""
    return sorted({name.rsplit(".", 1)[-1] for name in layers})


def save_adapter(folder: str | os.PathLike, params: Mapping[str, torch.Tensor], rank: int, alpha: float, base_model: str, targets: list[str]) -> None:
    """Write the peft adapter folder of ``params`` (as :func:`add_adapter` names them) into ``folder``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM", lora_dropout=0.0)  # type: ignore[arg-type]  # peft's int alpha
    config.base_model_name_or_path = base_model
    config.save_pretrained(os.fspath(folder))
    save_file({name: p.detach().cpu().contiguous() for name, p in params.items()}, os.path.join(folder, "adapter_model.safetensors"))


def read_adapter(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int, float]:
    """``(weights by peft name, rank, alpha)`` of a peft LoRA folder; other adapter kinds are refused with the reason."""
    from safetensors.torch import load_file

    config_file = Path(folder, "adapter_config.json")
    weights_file = Path(folder, "adapter_model.safetensors")
    if not config_file.is_file() or not weights_file.is_file():
        raise ConfigError(f"{folder} is not a peft adapter folder (adapter_config.json and adapter_model.safetensors); pass an exported adapter")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ConfigError(f"{folder} is not a plain LoRA adapter (DoRA, rsLoRA and per-layer ranks are not supported on a shared base)")
    weights = {name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): t for name, t in load_file(os.fspath(weights_file)).items()}
    return weights, int(config["r"]), float(config["lora_alpha"])
