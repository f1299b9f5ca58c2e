"""A LoRA job's saved state, read by either place it trains: a whole
:class:`~tinkergym.backends.torch.backend.TorchBackend` (``serve backend``, a local run) or a
:class:`~tinkergym.backends.torch.lora_session.LoraSession` of a shared base (a seat of ``serve shared``, the Tinker API).

Both write ``state.json``, ``trainable.safetensors`` and the optimizer's ``optimizer.safetensors`` + ``optimizer.json``;
they differ in three things, which the functions here translate:

- the adapter's names: peft's with the adapter's name in a backend (``...q_proj.lora_A.default.weight``), without it in a
  session (``...q_proj.lora_A.weight``, an exported adapter's names);
- the random state: a backend's is the process's generators (``rng.safetensors`` with ``torch``, ``numpy_keys`` and on a GPU
  ``cuda``, and ``rng.json``), a session's its own generator (``rng.safetensors`` with ``generator``). The generator that
  draws samples moves (a session's is the device's; a backend's the device's default one); Python's and numpy's, which a
  backend alone keeps, stay as they are in a backend that loads a session's state;
- ``state.json``: a session's says ``"kind": "lora_session"`` and format 1, a backend's format 2.

AdamW's state is kept by parameter index, and both order the adapter alike (layer by layer in the model's module order, ``A``
then ``B``), so it moves as it is; :func:`check_optimizer_shapes` checks that each index's moments have its parameter's shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tinkergym.errors import ConfigError

#: Version of a whole backend's save_state folder. 1: optimizer.pt and rng.pt pickles (refused since);
#: 2: optimizer and RNG states as safetensors + JSON.
BACKEND_STATE_FORMAT = 2
#: Version of a session's save_state folder.
SESSION_STATE_FORMAT = 1
#: ``state.json``'s ``kind`` in a session's state.
SESSION_KIND = "lora_session"
#: The adapter's name inside a backend's peft model.
ADAPTER_NAME = "default"


def read_meta(path: str) -> dict[str, Any]:
    """A state folder's ``state.json``; a folder without one is refused with what to pass."""
    meta_file = Path(path, "state.json")
    if not meta_file.is_file():
        raise ConfigError(f"{path} is not a backend state folder (no state.json); pass a folder written by save_state")
    meta: dict[str, Any] = json.loads(meta_file.read_text())
    return meta


def is_session_state(meta: Mapping[str, Any]) -> bool:
    """Whether ``state.json``'s contents are a session's."""
    return meta.get("kind") == SESSION_KIND


def session_name(backend_name: str) -> str:
    """A backend's adapter weight name as a session names it."""
    return backend_name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.").replace(f".lora_B.{ADAPTER_NAME}.", ".lora_B.")


def backend_name(session_name: str) -> str:
    """A session's adapter weight name as a backend's peft model names it."""
    if f".lora_A.{ADAPTER_NAME}." in session_name or f".lora_B.{ADAPTER_NAME}." in session_name:
        return session_name
    return session_name.replace(".lora_A.", f".lora_A.{ADAPTER_NAME}.").replace(".lora_B.", f".lora_B.{ADAPTER_NAME}.")


def named_for(weights: Mapping[str, torch.Tensor], session: bool) -> dict[str, torch.Tensor]:
    """``weights`` of either kind named as a session (``session``) or a whole backend names them."""
    rename = session_name if session else backend_name
    return {rename(name): tensor for name, tensor in weights.items()}


def check_adapter(path: str, meta: Mapping[str, Any], rank: int, alpha: float) -> None:
    """Refuse a state whose adapter has another rank or alpha than the one loading it, saying which to use."""
    config = meta.get("config") or {}
    saved_rank, saved_alpha = config.get("lora_rank"), config.get("lora_alpha")
    if saved_rank != rank or (saved_alpha is not None and float(saved_alpha) != float(alpha)):
        raise ConfigError(f"{path} holds a LoRA adapter of rank {saved_rank} and alpha {saved_alpha}; this one has rank {rank} and alpha "
                          f"{alpha:g}: load it where the job's adapter has the saved settings")


def check_optimizer_shapes(path: str, state: Mapping[str, Any], params: list[torch.Tensor]) -> None:
    """Refuse an AdamW state whose per-index moments do not have the shapes of ``params`` (the loader's, in its order)."""
    for index, moments in state.get("state", {}).items():
        index = int(index)
        if index >= len(params) or any(isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape
                                       for value in moments.values()):
            raise ConfigError(f"{path}: the optimizer state does not match this adapter's parameters (index {index}); "
                              "load it where the job's adapter has the saved settings")


def sampler_state(tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """From a backend's ``rng.safetensors``: the state of the generator that draws on ``device`` (None when not saved)."""
    key = "cuda" if device.type == "cuda" else "torch"
    return tensors.get(key)


def set_device_generator(state: torch.Tensor, device: torch.device) -> None:
    """Give ``device``'s default generator (what a backend samples with) the state of a session's generator."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif device.type == "cpu":
        torch.set_rng_state(state)
