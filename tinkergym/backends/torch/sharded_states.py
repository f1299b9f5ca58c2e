"""States of a sharded backend (:mod:`tinkergym.backends.torch.sharded`), read without a process group: whether a folder
is one, its trainable weights whole (what serving a checkpoint needs), and loading it into a single-process backend.

A sharded state folder holds ``state.json`` (``format`` :data:`SHARDED_FORMAT`, the step, the ranks it was saved at,
the backend's config) and ``dcp/``, a :mod:`torch.distributed.checkpoint` of ``{"model": trainable weights, "optim":
the optimizer's state}``, each rank's shards in files of their own; it loads at any number of ranks.

DCP names its index ``dcp/.metadata``, a hidden name, which the scheduler's artifact store refuses and a worker's
upload skips (hidden names are never a state's files). So the index is also kept as ``dcp/metadata.dcp``
(:func:`keep_index`), and a state that arrives without ``.metadata`` gets it back from that copy before it loads
(:func:`dcp_folder`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tinkergym.errors import ConfigError

#: The format of a sharded state folder (``state.json``'s ``format``).
SHARDED_FORMAT = "tinkergym-sharded-1"
#: DCP's own name of its index, and the copy of it a state carries under a name that is not hidden.
DCP_INDEX, INDEX_COPY = ".metadata", "metadata.dcp"


def keep_index(dcp_path: str) -> None:
    """After a DCP save into ``dcp_path``: keep its index also under :data:`INDEX_COPY` (see the module's notes)."""
    import shutil

    shutil.copyfile(os.path.join(dcp_path, DCP_INDEX), os.path.join(dcp_path, INDEX_COPY))


def dcp_folder(path: str) -> str:
    """The DCP folder of the state ``path``, with DCP's index in place: restored from :data:`INDEX_COPY` where the state
    came through a store that keeps no hidden files (written beside it, then renamed: a reader never sees half of it)."""
    folder = os.path.join(path, "dcp")
    index, copy = os.path.join(folder, DCP_INDEX), os.path.join(folder, INDEX_COPY)
    if not os.path.isfile(index):
        if not os.path.isfile(copy):
            raise ConfigError(f"{path} is a sharded state without its index (dcp/{DCP_INDEX} or dcp/{INDEX_COPY}): it is incomplete")
        tmp = f"{index}.{os.getpid()}.tmp"
        import shutil

        shutil.copyfile(copy, tmp)
        os.replace(tmp, index)
    return folder


def is_sharded_state(path: str) -> bool:
    """Whether the state folder ``path`` was written by a sharded backend."""
    try:
        return json.loads(Path(path, "state.json").read_text()).get("format") == SHARDED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def trainable_only(state: dict[str, Any], trainable: list[tuple[str, torch.nn.Parameter]]) -> dict[str, Any]:
    """The entries of a model state dict that train (a LoRA state holds the adapter, not the frozen base)."""
    names = {n for n, _ in trainable}
    kept = {k: v for k, v in state.items() if k in names}
    return kept if len(kept) == len(names) else state


def sharded_meta(path: str) -> dict[str, Any]:
    """The ``state.json`` of a sharded state folder; a ConfigError for a folder that holds no sharded state."""
    meta_file = Path(path, "state.json")
    if not meta_file.is_file():
        raise ConfigError(f"{path} is not a backend state folder (no state.json); pass a folder written by save_state")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != SHARDED_FORMAT:
        raise ConfigError(f"{path} is a state of format {meta.get('format')!r}, not a sharded one ({SHARDED_FORMAT})")
    return meta


def trainable_weights(path: str) -> dict[str, torch.Tensor]:
    """The trainable weights of a state folder, whole, on the host: a plain one's ``trainable.safetensors``, or a sharded
    one's shards read back together without a process group (what serving a checkpoint needs)."""
    if not is_sharded_state(path):
        from safetensors.torch import load_file

        return load_file(os.path.join(path, "trainable.safetensors"))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(dcp_folder(path))
    metadata = reader.read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in metadata.items() if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return model


def load_sharded_state(backend: Any, path: str) -> None:
    """Load a sharded state (saved at any number of ranks) into a plain single-process backend, optimizer included."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    meta = sharded_meta(path)
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    state = {"model": trainable_only(model_state, backend._trainable), "optim": optim_state}
    dcp.load(state, checkpoint_id=dcp_folder(path))  # no process group: read whole
    set_state_dict(backend.model, backend.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    backend._weights_changed()
    backend.step = int(meta["step"])
