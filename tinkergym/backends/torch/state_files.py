"""Backend training state as safetensors and JSON only: nothing in a state folder is ever unpickled.

A :class:`~tinkergym.backends.torch.backend.TorchBackend` state folder holds, besides ``state.json`` and
``trainable.safetensors``:

- ``optimizer.safetensors`` + ``optimizer.json``: ``optimizer.state_dict()`` split in two. Every tensor goes
  into the safetensors file (per-parameter state under ``state.{param_id}.{key}``, e.g. ``state.0.exp_avg``);
  the JSON document keeps the rest (``param_groups`` with lr, betas, eps, weight_decay and parameter ids;
  non-tensor per-parameter entries) with a reference ``{"__tensor__": name}`` where a tensor was and
  ``{"__tuple__": [...]}`` for a tuple, so the state dict comes back exactly.
- ``rng.safetensors`` + ``rng.json``: the torch CPU generator state, NumPy's MT19937 keys (int64) and the
  CUDA generator state of the backend's own device (only when it is a CUDA device), beside Python's
  ``random.getstate()`` and NumPy's position and cached gaussian.

:func:`optimizer_state_to_files` and :func:`optimizer_state_from_files` are pure: a state dict to a
``(tensors, document)`` pair and back. :func:`rng_state_to_files` reads the generators into such a pair and
:func:`restore_rng_state` sets them from one; the ``write_*`` and ``read_*`` functions put a pair into a
folder and read it back, and :func:`check_state_format` refuses folders of another format before any is read.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from tinkergym.errors import ConfigError

OPTIMIZER_FILES = ("optimizer.safetensors", "optimizer.json")
RNG_FILES = ("rng.safetensors", "rng.json")
#: Pickled files of state format 1; a folder holding one is refused, never unpickled.
LEGACY_PICKLES = ("optimizer.pt", "rng.pt")

TENSOR = "__tensor__"
TUPLE = "__tuple__"


# ----- optimizer ----------------------------------------------------------------------------------------
def optimizer_state_to_files(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into CPU tensors (for safetensors) and a JSON-able document."""
    tensors: dict[str, torch.Tensor] = {}
    state = {}
    for param_id, entries in state_dict["state"].items():
        if not isinstance(param_id, int) or isinstance(param_id, bool):
            raise TypeError(f"optimizer state is keyed by parameter index, not {param_id!r}")
        state[str(param_id)] = _encode(entries, f"state.{param_id}", tensors)
    extra = {k: _encode(v, k, tensors) for k, v in state_dict.items() if k not in ("state", "param_groups")}
    document = {"state": state, "param_groups": _encode(state_dict["param_groups"], "param_groups", tensors), **extra}
    return tensors, document


def optimizer_state_from_files(tensors: dict[str, torch.Tensor], document: dict[str, Any]) -> dict[str, Any]:
    """Rebuild the state dict that :func:`optimizer_state_to_files` split (tensors stay where they are given)."""
    rebuilt = {k: _decode(v, tensors) for k, v in document.items() if k != "state"}
    rebuilt["state"] = {int(param_id): _decode(entries, tensors) for param_id, entries in document["state"].items()}
    return rebuilt


def _encode(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` under dotted names that start with ``name``."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().cpu().contiguous()
        return {TENSOR: name}
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or {TENSOR, TUPLE} & set(value):
            raise TypeError(f"{name}: cannot store a dict with keys {list(value)} as JSON")
        return {k: _encode(v, f"{name}.{k}", tensors) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{name}: cannot store a {type(value).__name__} in a state folder (tensors, numbers, strings, lists, dicts only)")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {TENSOR}:
            return tensors[value[TENSOR]]
        if set(value) == {TUPLE}:
            return tuple(_decode(v, tensors) for v in value[TUPLE])
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value


def write_optimizer_state(folder: str | os.PathLike, state_dict: dict[str, Any]) -> None:
    """Write ``state_dict`` as ``optimizer.safetensors`` and ``optimizer.json`` into ``folder``."""
    _write_pair(folder, OPTIMIZER_FILES, *optimizer_state_to_files(state_dict))


def read_optimizer_state(folder: str | os.PathLike) -> dict[str, Any]:
    """The optimizer state dict that :func:`write_optimizer_state` wrote into ``folder``, tensors on the CPU."""
    return optimizer_state_from_files(*_read_pair(folder, OPTIMIZER_FILES))


# ----- random number generators -------------------------------------------------------------------------
def rng_state_to_files(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The torch, NumPy, Python and (for a CUDA ``device``) that device's CUDA generator states, as tensors and JSON."""
    # The global generator is MT19937, whose legacy state is this tuple (the stubs also allow another generator's dict).
    _, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    version, internal, python_gauss = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64))}
    if device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    document = {
        "python": {"version": version, "internal": list(internal), "gauss": python_gauss},
        "numpy": {"pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "device": str(device),
    }
    return tensors, document


def restore_rng_state(tensors: dict[str, torch.Tensor], document: dict[str, Any], device: torch.device) -> None:
    """Set the generators from :func:`rng_state_to_files`'s output; the CUDA one only on a CUDA ``device``.

    A state saved on one device restores onto the backend's device whatever its index or the number of
    visible GPUs; a state saved without CUDA leaves a CUDA generator as it is.
    """
    torch.set_rng_state(tensors["torch"])
    python = document["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss"]))
    npy = document["numpy"]
    np.random.set_state(("MT19937", tensors["numpy_keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"]))
    if device.type == "cuda" and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], device)


def write_rng_state(folder: str | os.PathLike, device: torch.device) -> None:
    """Write the current generator states (see :func:`rng_state_to_files`) as ``rng.safetensors`` and ``rng.json``."""
    _write_pair(folder, RNG_FILES, *rng_state_to_files(device))


def read_rng_state(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The ``(tensors, document)`` pair :func:`write_rng_state` wrote, for :func:`restore_rng_state`."""
    return _read_pair(folder, RNG_FILES)


# ----- files --------------------------------------------------------------------------------------------
def check_state_format(folder: str | os.PathLike, saved_format: Any, current_format: int) -> None:
    """Raise ConfigError for a state folder of another format, above all one holding format 1's pickles."""
    pickles = [name for name in LEGACY_PICKLES if Path(folder, name).exists()]
    if pickles or not isinstance(saved_format, int) or saved_format < current_format:
        found = f", with pickled {' and '.join(pickles)}" if pickles else ""
        raise ConfigError(
            f"{folder} was written by an older tinkergym state format (format {saved_format}{found}), which this "
            "version refuses to load because it never unpickles; export the model with the tinkergym version that "
            "wrote it (TorchBackend.export, or take the run's final/ folder) and train on from the exported folder, "
            "or retrain"
        )
    if saved_format != current_format:
        raise ConfigError(
            f"{folder} has state format {saved_format}, newer than the format {current_format} this tinkergym "
            "reads; upgrade tinkergym to load it"
        )


def _write_pair(folder: str | os.PathLike, names: tuple[str, str], tensors: dict[str, torch.Tensor], document: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(folder, names[0]))
    Path(folder, names[1]).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def _read_pair(folder: str | os.PathLike, names: tuple[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    missing = [name for name in names if not Path(folder, name).is_file()]
    if missing:
        raise ConfigError(f"{folder} lacks {' and '.join(missing)}; pass a complete folder written by save_state")
    document = json.loads(Path(folder, names[1]).read_text(encoding="utf-8"))
    return load_file(os.path.join(folder, names[0]), device="cpu"), document
