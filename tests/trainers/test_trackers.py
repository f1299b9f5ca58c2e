"""``train --wandb PROJECT``: every step's numbers go to a Weights & Biases run through W&B's own client (offline mode: no
account, no network), the same W&B run across ``--resume``. That without the flag nothing of W&B is written is checked in process, by
tests/trainers/test_training.py::test_train_writes_the_run_folder."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("wandb")

from tinkergym.trainers.reporting import read_metrics

RUN = ["--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--batch-size", "2", "--group-size", "2",
       "--max-new-tokens", "4", "--checkpoint-every", "1", "--quiet"]


def _records(path: Path) -> list[Any]:
    """The records of a W&B ``.wandb`` file: a LevelDB-style log (32 KiB blocks of checksum, length, type, data) of protobufs."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, found, part = path.read_bytes(), 7, [], b""  # 7: the header (":W&B", magic, version)
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        part = data if kind in (1, 2) else part + data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            found.append(record)
    return found


def _logged(run: Path) -> tuple[set[str], dict[int, dict[str, Any]]]:
    """The W&B run ids and each logged step's numbers, over every offline run in ``run/wandb``."""
    ids, steps = set(), {}
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                steps.setdefault(int(items["_step"]), items)
    return ids, steps


def _train(tmp_path: Path, *args: str) -> None:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TINKERGYM_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "tinkergym", "train", *args], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_wandb_gets_every_step_and_a_resume_continues_its_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(tmp_path, *RUN, "--steps", "2", "--out", str(run), "--wandb", "tinkergym-test")
    _train(tmp_path, "--resume", str(run), "--steps", "3", "--quiet")
    ids, steps = _logged(run)
    assert ids == {(run / "wandb_id").read_text().strip()}  # one W&B run, resumed
    records = read_metrics(run / "metrics.jsonl")
    assert sorted(steps) == [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        assert steps[record["step"]]["reward/mean"] == pytest.approx(record["reward/mean"])
        assert steps[record["step"]]["tokens/sampled"] == pytest.approx(record["tokens/sampled"])
