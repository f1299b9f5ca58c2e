"""What ``train``, ``eval`` and ``jobs logs`` show people by default: a run's or an evaluation's key numbers in a line or
two (``--json`` prints the whole record instead)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: A step's numbers a person looks at first, in order: (metrics key, label). ``success`` is a rate, shown as a percentage.
KEY_NUMBERS = (
    ("reward/mean", "reward"),
    ("loss", "loss"),
    ("eval/reward_mean", "eval reward"),
    ("eval/success_rate", "eval success"),
)


def number(value: float) -> str:
    """``0.625``, ``1.23e-05``, ``1.2e+03``: four significant digits, as short as they go."""
    return f"{value:.4g}"


def percent(rate: float) -> str:
    """``62.5%``."""
    return f"{100 * rate:.1f}%"


def _shown(key: str, value: Any) -> str | None:
    """``value`` of metrics ``key`` as a person reads it; None for a value that is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return percent(value) if key.endswith("success_rate") else number(value)


def key_numbers(record: dict[str, Any]) -> list[str]:
    """``["reward 0.625", "loss 0.0123", ...]``: the :data:`KEY_NUMBERS` that ``record`` (a metrics record) holds."""
    found = []
    for key, label in KEY_NUMBERS:
        shown = _shown(key, record.get(key))
        if shown is not None:
            found.append(f"{label} {shown}")
    return found


def train_summary(folder: Path, record: dict[str, Any], steps: int | None) -> str:
    """The end of ``train``: the run's last step of ``steps`` and its key numbers, then where the run folder and its model are.

    ``record``: the run's last metrics record (its ``step`` counts from 0); empty when the run logged none.
    """
    step = record.get("step")
    trained = int(step) + 1 if isinstance(step, int) and step >= 0 else 0
    done = f"{trained} of {steps} steps" if steps else f"{trained} step{'' if trained == 1 else 's'}"
    line = ", ".join([done, *key_numbers(record)])
    final = folder / "final"
    where = f"run folder: {folder}" + (f" (the model: {final}; every step's numbers: {folder / 'metrics.jsonl'})" if final.is_dir() else "")
    return f"{line}\n{where}"


def eval_summary(env: str, metrics: dict[str, float]) -> str:
    """The end of ``eval``: ``tinker/Bandit-v0: 32 episodes, success 50.0%, mean reward 0.625 (2 failed, 12.3 tokens per episode)``.

    ``metrics``: :func:`tinkergym.trainers.evaluation.summarize`'s, without the ``eval/`` prefix.
    """
    episodes, failed = int(metrics.get("episodes", 0)), int(metrics.get("failed", 0))
    line = f"{env}: {episodes} episode{'' if episodes == 1 else 's'}"
    if "success_rate" in metrics:
        line += f", success {percent(metrics['success_rate'])}"
    if "reward_mean" in metrics:
        line += f", mean reward {number(metrics['reward_mean'])}"
    notes = ([f"{failed} failed"] if failed else []) + ([f"{metrics['tokens_per_episode']:.1f} tokens per episode"] if "tokens_per_episode" in metrics else [])
    return line + (f" ({', '.join(notes)})" if notes else "")


def metrics_summary(data: Any) -> str | None:
    """``step 6: reward 0.625, loss 0.0123 (--json for all 20 numbers)``: a ``metrics`` event's data (a step's numbers) in one
    line; None for data that holds none of :data:`KEY_NUMBERS`."""
    if not isinstance(data, dict):
        return None
    numbers = key_numbers(data)
    if not numbers:
        return None
    step = data.get("step")
    return f"{f'step {step}: ' if step is not None else ''}{', '.join(numbers)} (--json for all {len(data)} numbers)"
