"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases through its own client library, opt-in.

``tinkergym train --wandb PROJECT`` logs every step's numbers to a W&B run in PROJECT, with the run's settings as its
config. The W&B run's id is kept in the run folder (``wandb_id``), so ``--resume`` continues the same W&B run (W&B
keeps the first value it got for a step: steps a resume runs again keep their first numbers there, while
metrics.jsonl holds the new ones). W&B's own settings apply: ``WANDB_MODE=offline`` logs to ``<run>/wandb/`` without
an account or a network (``wandb sync`` uploads it later), ``WANDB_API_KEY`` logs in.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from tinkergym.errors import ConfigError
from tinkergym.plumbing.install import pip_install

ID_FILE = "wandb_id"


class WandbTracker:
    """One W&B run for one tinkergym run folder (the same one across resumes)."""

    def __init__(self, folder: Path, project: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(f"--wandb needs the wandb client library: install it with: {pip_install('wandb')}") from exc
        id_file = folder / ID_FILE
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n", encoding="utf-8")
        self.run = wandb.init(project=project, id=run_id, name=folder.name, dir=str(folder), config=config, resume="allow",
                              settings=wandb.Settings(silent=True))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers and (self.run.step is None or step >= self.run.step):  # W&B refuses steps below its own
            self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()
