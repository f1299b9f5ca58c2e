"""Run reporting: metrics.jsonl, TensorBoard events, opt-in trackers (:mod:`tinkergym.trainers.trackers`) and the learning-curve PNG."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from tinkergym.errors import ConfigError


class MetricsLog:
    """Appends one JSON line per step and mirrors the numbers to TensorBoard when a writer is installed."""

    def __init__(self, folder: Path, keep_through: int | None = None, wandb_project: str | None = None,
                 run_config: dict[str, Any] | None = None) -> None:
        self.path = folder / "metrics.jsonl"
        # A resumed run keeps the records through its checkpoint's step and rewrites the later ones; a new run keeps none.
        kept = [] if keep_through is None else [r for r in read_metrics(self.path) if r["step"] <= keep_through]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        # TensorBoard's files are append-only: drop the same steps from them, or the steps run again show twice.
        trim_event_files(folder / "tensorboard", keep_through)
        # A resume's own file name, so a writer opened within the same second never truncates a kept file.
        self._writer = _tensorboard_writer(folder / "tensorboard", "" if keep_through is None else f".from_step_{keep_through + 1}")
        self._trackers: list[Any] = []
        if wandb_project:
            from tinkergym.trainers.trackers import WandbTracker

            self._trackers.append(WandbTracker(folder, wandb_project, run_config or {}))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step."""
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({**metrics, "step": step}) + "\n")  # the run's step wins over a backend's counter
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        for tracker in self._trackers:
            tracker.log(step, metrics)

    def close(self) -> None:
        """Flush and close the TensorBoard writer and the trackers."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def _tensorboard_writer(folder: Path, filename_suffix: str = "") -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter  # type: ignore[no-redef]  # the same writer's API, where torch's is missing
        except ImportError:
            return None
    return SummaryWriter(log_dir=str(folder), filename_suffix=filename_suffix)


def _event_class() -> Any:
    """The ``Event`` protobuf of whichever TensorBoard writer is installed (``None`` without one)."""
    try:
        from tensorboardX.proto.event_pb2 import Event
    except ImportError:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
        except ImportError:
            return None
    return Event


def read_event_records(path: Path) -> Iterator[tuple[bytes, Any]]:
    """Each complete record of a TensorBoard event file as (its bytes as stored, the parsed ``Event``).

    The file is a sequence of TFRecords: a little-endian u64 length, a u32 checksum of it, the payload
    and a u32 checksum of the payload. A torn or unreadable tail (a process killed mid-write) ends the file.
    """
    event_class = _event_class()
    if event_class is None:
        return
    from google.protobuf.message import DecodeError  # installed with every TensorBoard writer

    data, pos = path.read_bytes(), 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        end = pos + 12 + length + 4
        if end > len(data):
            return
        try:
            event = event_class.FromString(data[pos + 12 : pos + 12 + length])
        except DecodeError:
            return
        yield data[pos:end], event
        pos = end


def trim_event_files(folder: Path, keep_through: int | None) -> None:
    """Drop the events after step ``keep_through`` (every event for ``None``) from the TensorBoard files in ``folder``.

    Kept records are copied byte for byte into a file of the same name (so the files still sort in the order
    they were written); a file left with no summary is removed. Any reader then sees each step once, not only
    readers that honour TensorBoard's ``purge_step``.
    """
    if not folder.is_dir():
        return
    tmp = folder / ".trim.tmp"  # no "tfevents" in the name: TensorBoard never reads a half-written copy
    tmp.unlink(missing_ok=True)
    for path in sorted(folder.glob("*tfevents*")):
        if keep_through is None:
            path.unlink()
            continue
        if _event_class() is None:
            return  # nothing installed reads (or wrote) event files
        records = list(read_event_records(path))
        kept = [(raw, event) for raw, event in records if event.step <= keep_through or event.WhichOneof("what") == "file_version"]
        if not any(event.HasField("summary") for _, event in kept):
            path.unlink()
        elif len(kept) < len(records) or path.stat().st_size != sum(len(raw) for raw, _ in records):
            tmp.write_bytes(b"".join(raw for raw, _ in kept))
            os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (empty if it does not exist).

    Each line must be a JSON object with an integer ``step``; a last line cut short (a process killed while
    writing it) is dropped. Anything else is a :class:`ConfigError` that names the file and the line.
    """
    if not path.is_file():
        return []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); it is not a metrics file tinkergym wrote.") from exc
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            if number == len(lines):  # no newline after it: the write was cut short
                break
            problem = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise ConfigError(f"{path} line {number} is not valid JSON ({problem}); fix or delete that line.") from exc
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            shown = line if len(line) <= 60 else line[:57] + "..."
            raise ConfigError(f"{path} line {number}: expected a JSON object with an integer 'step', as training writes, not {shown!r}; fix or delete that line.")
        records.append(record)
    return records


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
    else:  # self-play: the greedy win rate against each fixed opponent beside the reward
        keys = tuple(keys) + tuple(sorted({k for r in records for k in r if k.startswith("eval/win_vs_")}))
    ratings = sorted({k for r in records for k in r if k.startswith("rating/")})
    if ratings:  # self-play: a second panel with every league member's rating
        figure, (axis, rating_axis) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    else:
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
    if ratings:
        for key in ratings:
            points = [(r["step"], r[key]) for r in records if key in r]
            style = {"linewidth": 2.5} if key == "rating/learner" else {"linewidth": 1, "alpha": 0.8}
            rating_axis.plot(*zip(*points), label=key.removeprefix("rating/"), marker="o" if len(points) < 30 else None, markersize=3, **style)
        rating_axis.set_xlabel("step")
        rating_axis.set_ylabel("rating (openskill ordinal)")
        rating_axis.grid(alpha=0.3)
        rating_axis.legend(fontsize="small", ncol=2)
    out = folder / "learning_curve.png"
    figure.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return out
