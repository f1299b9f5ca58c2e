"""Run reporting: metrics.jsonl, TensorBoard events and the learning-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON line per step and mirrors the numbers to TensorBoard when a writer is installed."""

    def __init__(self, folder: Path, keep_through: int | None = None) -> None:
        self.path = folder / "metrics.jsonl"
        # A resumed run keeps the records through its checkpoint's step and rewrites the later ones; a new run keeps none.
        kept = [] if keep_through is None else [r for r in read_metrics(self.path) if r["step"] <= keep_through]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._writer = _tensorboard_writer(folder / "tensorboard")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step."""
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({**metrics, "step": step}) + "\n")  # the run's step wins over a backend's counter
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _tensorboard_writer(folder: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter(log_dir=str(folder))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (empty if it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_learning_curve(folder: Path, keys: tuple[str, ...] = ("reward/mean", "eval/reward_mean")) -> Path | None:
    """Draw the learning curve of a run folder into learning_curve.png (``None`` without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(folder / "metrics.jsonl")
    if not any(key in r for r in records for key in keys):  # e.g. SFT: no rewards, show the loss
        keys = ("loss",)
    figure, axis = plt.subplots(figsize=(7, 4))
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            axis.plot(*zip(*points), marker="o" if len(points) < 30 else None, label=key)
    axis.set_xlabel("step")
    axis.set_ylabel("loss" if keys == ("loss",) else "reward")
    axis.set_title(folder.name)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend()
    out = folder / "learning_curve.png"
    figure.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return out
