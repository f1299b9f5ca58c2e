"""Serving through the scheduler: `serve model --scheduler` and `eval --scheduler` on a run the scheduler trained.

The worker restores the training job's newest checkpoint from the artifact store and serves it under the run's
name; what it serves answers exactly as the same checkpoint served here, and differs from the base model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner

from tinkergym.serve.asgi import ThreadServer
from tinkergym.cli import main
from tinkergym.client import SchedulerClient
from tinkergym.errors import ConfigError
from tinkergym.backends.inference_jobs import job_config, served_name
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.worker.agent import WorkerOptions, server_command
from tinkergym.config import TrainConfig

EVAL = ("--env", "tinker/Bandit-v0", "--episodes", "4", "--max-new-tokens", "6", "--max-turns", "2")


def _options(tmp_path: Path) -> WorkerOptions:
    return WorkerOptions(name="w", host="127.0.0.1", devices=[{"index": 0, "kind": "slot", "name": "slot0"}], models=["tiny"],
                         work_dir=tmp_path, python="python")


@pytest.mark.parametrize("kind", ["inference", "eval"])
def test_a_serving_job_runs_serve_model_on_the_restored_checkpoint(kind: str, tmp_path: Path) -> None:
    lease = {"kind": kind, "idle_timeout_s": 600.0,
             "config": {"model": "tiny", "dtype": "float32", "lora_rank": 16, "resume_job": "job_1", "served_name": "bandit"}}
    command = server_command(_options(tmp_path), lease, 20001, tmp_path / "f", gpu=False, served="step_000004")
    assert command[:5] == ["python", "-m", "tinkergym", "serve", "model"]
    assert command[command.index("--checkpoint") + 1] == f"bandit={tmp_path / 'f' / 'states' / 'step_000004'}"
    assert "--exit-with-parent" in command and command[command.index("--idle-timeout") + 1] == "600"
    assert command[command.index("--api-key-file") + 1] == str(tmp_path / "f" / "token")
    with pytest.raises(ValueError, match="has no checkpoint to serve"):
        server_command(_options(tmp_path), lease, 20001, tmp_path / "f", gpu=False, served=None)
    for bad in ("../x", "tiny", "a b", ""):
        lease["config"]["served_name"] = bad
        with pytest.raises(ValueError, match="served_name"):
            server_command(_options(tmp_path), lease, 20001, tmp_path / "f", gpu=False, served="step_000004")
    base = server_command(_options(tmp_path), {"kind": kind, "config": {"model": "tiny"}}, 20001, tmp_path / "f", gpu=False)
    assert "--checkpoint" not in base and "--model" in base


def test_a_deterministic_train_job_gets_a_deterministic_training_server(tmp_path: Path) -> None:
    config = TrainConfig(env="tinker/Bandit-v0", model="tiny", deterministic=True, gradient_checkpointing=True).job_config()
    command = server_command(_options(tmp_path), {"kind": "train", "config": config}, 20001, tmp_path / "f", gpu=False)
    assert command[3:5] == ["serve", "backend"] and "--deterministic" in command and "--gradient-checkpointing" in command
    config["deterministic"] = "yes"
    assert "--deterministic" not in server_command(_options(tmp_path), {"kind": "train", "config": config}, 20001, tmp_path / "f", gpu=False)


def test_the_job_config_names_the_training_job_and_refuses_a_local_run(tmp_path: Path) -> None:
    assert job_config(model="smollm2-135m") == {"model": "smollm2-135m", "dtype": "auto"}
    run = tmp_path / "my run"
    run.mkdir()
    TrainConfig(env="tinker/Bandit-v0", model="tiny").save(run / "config.json")
    with pytest.raises(ConfigError, match="trained on this machine"):
        job_config(run_dir=run)
    result = CliRunner().invoke(main, ["serve", "model", "--scheduler", "http://127.0.0.1:9", "--api-key", "tgk_x", "--run", str(run)])
    assert result.exit_code == 2 and "trained on this machine" in result.output
    TrainConfig(env="tinker/Bandit-v0", model="tiny", scheduler_url="http://s", scheduler_job="job_abc", lora_rank=8).save(run / "config.json")
    assert job_config(run_dir=run) == {"model": "tiny", "dtype": "auto", "lora_rank": 8, "resume_job": "job_abc", "served_name": "my-run"}
    assert served_name(run) == "my-run"


def _eval(*args: str, out: Path) -> tuple[Any, list[dict]]:
    result = CliRunner().invoke(main, ["eval", *EVAL, *args, "--out", str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1]), [json.loads(line) for line in out.read_text().splitlines()]


def _wait_state(client: SchedulerClient, job_id: str, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while (job := client.show(job_id))["state"] != state:
        assert time.monotonic() < deadline, f"job {job_id} stayed {job['state']}"
        time.sleep(0.2)
    return job


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_scheduler_trained_run_is_served_and_evaluated_by_a_worker(db_url: str, keys: Any, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    monkeypatch.setenv("TINKERGYM_API_KEY", client_key)
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=5.0, sweep_interval_s=0.2)))
    work = tmp_path / "work"
    worker = subprocess.Popen(
        [sys.executable, "-m", "tinkergym", "worker", "--scheduler", scheduler.url, "--slots", "2", "--models", "tiny", "--name", "w1",
         "--work-dir", str(work), "--poll", "0.2"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "w"), env={**os.environ, "TINKERGYM_API_KEY": worker_key})
    client = SchedulerClient(scheduler.url, client_key)
    run = tmp_path / "bandit-run"
    try:
        trained = CliRunner().invoke(main, [
            "train", "--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--steps", "2", "--batch-size", "2",
            "--group-size", "4", "--max-new-tokens", "6", "--lr", "3e-2", "--checkpoint-every", "1", "--quiet", "--out", str(run),
            "--scheduler", scheduler.url], catch_exceptions=False)
        assert trained.exit_code == 0, trained.output
        training_job = json.loads((run / "config.json").read_text())["scheduler_job"]
        newest = max(client.checkpoints(training_job), key=lambda c: c["step"])
        last_saved = sorted(p.name for p in (run / "checkpoints").iterdir())[-1]
        assert newest["name"] == last_saved, "the job ends only once its worker has stored the run's last checkpoint"

        key_file = tmp_path / "endpoint.key"
        served = CliRunner().invoke(main, ["serve", "model", "--scheduler", scheduler.url, "--run", str(run), "--detach", "--key-file", str(key_file)],
                                    catch_exceptions=False)
        assert served.exit_code == 0, served.output
        endpoint = json.loads(served.stdout.splitlines()[-1])
        assert endpoint["models"] == ["tiny", "bandit-run"] and endpoint["key_file"] == str(key_file)
        assert key_file.stat().st_mode & 0o077 == 0
        job = client.show(endpoint["job"])
        assert job["kind"] == "inference" and job["state"] == "running" and job["config"]["resume_job"] == training_job
        restored = work / "jobs" / endpoint["job"] / str(job["lease_epoch"]) / "states" / newest["name"]
        assert (restored / "state.json").is_file(), "the worker serves the training job's newest checkpoint"

        through_job, job_transcripts = _eval("--endpoint", endpoint["url"], "--model", "bandit-run", "--api-key-file", str(key_file),
                                             out=tmp_path / "job.jsonl")
        _, base_transcripts = _eval("--endpoint", endpoint["url"], "--model", "tiny", "--api-key-file", str(key_file), out=tmp_path / "base.jsonl")

        from tinkergym.backends.serving import plan_serving
        from tinkergym.backends.torch.inference import TorchInferenceEngine
        from tinkergym.serve.inference.app import create_inference_app
        from tinkergym.serve.auth import token_digest

        here_key = tmp_path / "here.key"
        here_key.write_text("h" * 40 + "\n")
        here_key.chmod(0o600)
        here = ThreadServer(create_inference_app(TorchInferenceEngine(plan_serving(model="tiny", checkpoint=("bandit-run", str(restored)))),
                                                 token_digest("h" * 40)))
        try:
            locally, local_transcripts = _eval("--endpoint", here.url, "--model", "bandit-run", "--api-key-file", str(here_key),
                                               out=tmp_path / "here.jsonl")
        finally:
            here.stop()
        assert job_transcripts == local_transcripts and through_job == locally
        assert job_transcripts != base_transcripts, "the adapter is served, not the base model"

        evaluated, eval_transcripts = _eval("--run", str(run), "--scheduler", scheduler.url, out=tmp_path / "eval.jsonl")
        assert evaluated == through_job and eval_transcripts == job_transcripts
        eval_job = next(j for j in client.list(kind="eval"))
        assert eval_job["state"] == "succeeded" and eval_job["config"]["resume_job"] == training_job

        cancelled = CliRunner().invoke(main, ["jobs", "cancel", endpoint["job"], "--scheduler", scheduler.url], catch_exceptions=False)
        assert cancelled.exit_code == 0, cancelled.output
        _wait_state(client, endpoint["job"], "cancelled")
    finally:
        client.close()
        worker.terminate()
        worker.wait(timeout=60)
        scheduler.stop()
