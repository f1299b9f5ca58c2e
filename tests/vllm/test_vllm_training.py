"""Training with rollouts sampled by vLLM: ``TrainConfig(sampler="vllm")`` and ``tinkergym train --sampler vllm``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinkergym.backends.vllm.sampler import VLLMBackend
from tinkergym.config import TrainConfig
from tinkergym.trainers.reporting import read_metrics
from tinkergym.trainers.session import TrainingRun

SETTINGS = dict(env="tinker/Bandit-v0", steps=3, batch_size=2, group_size=4, max_turns=1, max_new_tokens=6, dtype="float32", lr=1e-3)


@pytest.mark.parametrize("lora_rank", [8, 0])
def test_training_run_samples_with_vllm_synced_every_step(tiny: str, tmp_path: Path, lora_rank: int) -> None:
    config = TrainConfig(model=tiny, sampler="vllm", lora_rank=lora_rank, out=str(tmp_path / "run"), max_context=256, **SETTINGS)
    run = TrainingRun(config)
    assert isinstance(run.backend, VLLMBackend)
    sampler = run.backend.sampler
    try:
        run.run(progress=False)
        records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] >= 0]
        # One sync before the first rollouts, then one before each step that follows an optimizer step (a step
        # whose groups all tied has nothing to train on, so the next step samples the same weights, unsynced).
        updates = sum(1 for r in records[:-1] if r["batch/trained_sequences"] > 0)
        assert sampler.version == 1 + updates and sampler.synced_step == updates
        assert sampler.info()["lora_rank"] == (8 if lora_rank else 0)
    finally:
        run.close()
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["tokens/sampled"] > 0 for r in records)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["sampler"] == "vllm"
    assert (tmp_path / "run" / "final").is_dir()


def test_cli_trains_with_the_vllm_sampler(tiny: str, tmp_path: Path) -> None:
    out = tmp_path / "cli-run"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items() if k != "steps"]
    command = [sys.executable, "-m", "tinkergym", "train", "--model", tiny, "--sampler", "vllm", "--steps", "1", "--max-context", "256", "--out", str(out), "--quiet", "--json", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["run"] == str(out)
    assert json.loads((out / "config.json").read_text())["sampler"] == "vllm"
