"""What the training server's state calls do with the saved states in its run folder, past the backend's own methods.

:func:`load_weights_only` is a ``load_state`` of the weights alone (Tinker's ``load_state`` without the optimizer),
and :func:`prune_states` keeps the newest saved states (``serve backend --keep-states``).
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any

from tinkergym.errors import ConfigError


def prune_states(run_dir: Path, keep: int, current: Path) -> list[str]:
    """Delete all but the ``keep`` newest saved states (by modification time; ``current`` always stays); their names."""
    states_dir = run_dir / "states"
    saved = [p for p in states_dir.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.endswith(".tmp") and p != current]
    saved.sort(key=lambda p: p.stat().st_mtime)
    doomed = saved[: max(len(saved) - (keep - 1), 0)]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return [p.name for p in doomed]


def load_weights_only(backend: Any, folder: Path, run_dir: Path) -> None:
    """Load the trainable weights of the state ``folder`` and keep the backend's own optimizer moments, step and generator
    (Tinker's ``load_state`` without the optimizer; a new run's are fresh).

    The backend's current state is saved to a scratch folder, its weights file replaced by ``folder``'s, and that loaded:
    the backend's own checks (same trainable names and shapes) apply, and a refused load leaves it as it was. A state
    written by a server sharded over several ranks is refused (its weights are not one file).
    """
    weights = folder / "trainable.safetensors"
    if not weights.is_file() or weights.is_symlink():
        raise ConfigError(f"states/{folder.name} holds no trainable.safetensors (a sharded server's state?); a weights-only load "
                          "needs a state of one process: load it whole (load_state_with_optimizer)")
    scratch = run_dir / "scratch" / f"weights-only-{secrets.token_hex(6)}"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    try:
        backend.save_state(str(scratch))
        mine = scratch / "trainable.safetensors"
        if not mine.is_file():
            raise ConfigError("this server's state is sharded over several ranks; it loads a state whole (load_state_with_optimizer)")
        copy_weights(folder, scratch)
        backend.load_state(str(scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def copy_weights(source: Path, dest: Path) -> None:
    """``source``'s trainable weights over ``dest``'s, named as ``dest``'s state names them: a whole backend's and a shared
    base's session's name a LoRA adapter differently (:mod:`~tinkergym.backends.torch.lora_states`)."""
    from tinkergym.backends.torch import lora_states

    theirs, mine = source / "trainable.safetensors", dest / "trainable.safetensors"
    as_session = lora_states.is_session_state(lora_states.read_meta(str(dest)))
    if not (source / "state.json").is_file() or lora_states.is_session_state(lora_states.read_meta(str(source))) == as_session:
        shutil.copyfile(theirs, mine)
        return
    from safetensors.torch import load_file, save_file

    save_file(lora_states.named_for(load_file(theirs), as_session), mine)
