"""End to end: `tinkergym train` runs GRPO steps of the tiny test model on tinker/Household-v0 (needs the train extra)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tinkergym.backends.models import build_tiny_model  # noqa: E402 - after the skips: it needs the train extra
from tinkergym.cli import main  # noqa: E402
from tinkergym.trainers.reporting import read_metrics  # noqa: E402


@pytest.mark.slow
def test_grpo_trains_the_tiny_model_on_household(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")  # the tiny model of tests/conftest.py's `tiny` fixture
    out = tmp_path / "run"
    args = [
        "train", "--env", "tinker/Household-v0", "--kwarg", "rooms=1", "--kwarg", "distractors=0", "--kwarg", "horizon=20",
        "--model", model, "--dtype", "float32", "--steps", "2", "--batch-size", "1", "--group-size", "2",
        "--max-turns", "2", "--max-new-tokens", "8", "--kl-coef", "0.01", "--quiet", "--out", str(out),
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["batch/trained_sequences"] == 2 and r["turns/mean"] >= 1 for r in records), "every sequence is trained on"
    config = json.loads((out / "config.json").read_text())
    assert (config["env"], config["env_kwargs"]) == ("tinker/Household-v0", {"rooms": 1, "distractors": 0, "horizon": 20})
    assert (out / "final" / "adapter_config.json").is_file()
    episode = json.loads((out / "transcripts" / "train_step_000000.jsonl").read_text().splitlines()[0])
    messages = episode["messages"]
    assert messages[0]["role"] == "system" and "household robot" in messages[0]["content"]
    assert messages[1]["role"] == "user" and "Your task is to: " in messages[1]["content"]
    assert [m["role"] for m in messages[2:4]] == ["assistant", "user"]
