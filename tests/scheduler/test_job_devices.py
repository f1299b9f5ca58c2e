"""Jobs ask for no more devices than their kind can use: the API refuses the rest with what to submit instead, and the CLI
shows that refusal and exits 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

import workerkit as kit  # registered by conftest.py
from click.testing import CliRunner

from tinkergym.cli import main
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.schemas import USABLE_DEVICES
from tinkergym.serve.asgi import ThreadServer

EVAL_REFUSAL = ("this job asks for 2 devices, but eval jobs run on one device today (its server would use only the first): "
                "submit it with gpus 1 (the default; --gpus 1 on the command line)")


def post(client: Any, key: str, kind: str, gpus: int, idempotency_key: str | None = None) -> Any:
    headers = {**kit.auth(key), **({"Idempotency-Key": idempotency_key} if idempotency_key else {})}
    return client.post("/v1/jobs", json={"kind": kind, "config": {"model": "tiny"}, "gpus": gpus}, headers=headers)


def test_each_kind_is_refused_more_devices_than_it_uses(make_client: Any, keys: Any, db_url: str) -> None:
    """Serving and eval jobs run on one device; train and sft jobs shard over every device they lease (one rank each, up
    to USABLE_DEVICES), within the tenant's quota."""
    client = make_client()
    user = keys.new("acme", "read,write")
    assert USABLE_DEVICES == {"train": 64, "sft": 64, "eval": 1, "inference": 1}
    for kind in ("eval", "inference"):
        refused = post(client, user, kind, gpus=2)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request"
        assert f"{kind} jobs run on one device today" in error["message"] and "submit it with gpus 1" in error["message"]
        accepted = post(client, user, kind, gpus=1)
        assert accepted.status_code == 201 and accepted.json()["gpus"] == 1, accepted.text
    assert post(client, user, "eval", gpus=2).json() == {"error": {"type": "invalid_request", "message": EVAL_REFUSAL}}
    for kind in ("train", "sft"):
        accepted = post(client, user, kind, gpus=2)
        assert accepted.status_code == 201 and accepted.json()["gpus"] == 2, accepted.text
    over = post(client, user, "train", gpus=65)  # the request's own bound
    assert over.status_code in (400, 422) and "less than or equal to 64" in over.json()["error"]["message"]
    assert "may hold at most 8" in post(client, user, "train", gpus=9).json()["error"]["message"]  # the tenant's quota
    # Nothing refused was stored: neither a job, nor the answer under its key (a retry runs again).
    assert kit.query(db_url, "SELECT kind, COUNT(*) FROM jobs WHERE gpus > 1 GROUP BY kind ORDER BY kind") == [("sft", 1), ("train", 1)]
    assert post(client, user, "eval", gpus=2, idempotency_key="k").status_code == 400
    retried = post(client, user, "eval", gpus=2, idempotency_key="k")
    assert retried.status_code == 400 and "idempotent-replayed" not in retried.headers


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[ThreadServer]:
    """A live scheduler with no worker that refuses unplaceable jobs: a job it accepted by mistake fails the CLI at once
    with another message, instead of leaving it waiting in the queue."""
    settings = SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", refuse_unplaceable=True)
    live = ThreadServer(create_app(settings, background=False))
    yield live
    live.stop()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the refusal reads no table: the API test above covers PostgreSQL
def test_the_cli_shows_the_refusal_and_exits_2(server: ThreadServer, keys: Any, db_url: str, tmp_path: Path) -> None:
    user = keys.new("acme", "read,write")
    at = ["--scheduler", server.url, "--api-key", user, "--gpus", "2"]
    runs = {
        "inference": ["serve", "model", "--model", "tiny", "--detach", *at],
        "eval": ["eval", "--env", "tinker/Bandit-v0", "--model", "tiny", "--quiet", *at],
    }
    for kind, args in runs.items():
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 2, (kind, result.output)
        assert f"{kind} jobs run on one device today" in result.output and "--gpus 1 on the command line" in result.output, result.output
    assert kit.query(db_url, "SELECT COUNT(*) FROM jobs") == [(0,)]


def test_the_help_says_a_training_job_shards_over_its_devices() -> None:
    """``train --gpus N`` runs the job's server one rank per device (sharded); ``eval --gpus`` stays one device."""
    def gpus_help(command: str) -> str:
        said = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=200).output.split())
        return said[said.index("--gpus INTEGER"):][:300]

    train = gpus_help("train")
    assert "refuses more" not in train and "one rank per device, the model sharded over them" in train, train
    evaluate = gpus_help("eval")
    assert "an eval job uses one today and the scheduler refuses more" in evaluate, evaluate


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the reason's tables: tests/scheduler/test_wait_reasons.py
def test_a_train_job_past_every_worker_is_queued_and_jobs_show_says_what_to_do(keys: Any, db_url: str, tmp_path: Path) -> None:
    """A train job on 4 devices is accepted (it would shard), and with the largest worker of 2 slots ``jobs show`` says
    that none can host it and what to submit instead; ``--refuse-unplaceable`` refuses it with the same advice."""
    import httpx

    user = keys.new("acme", "read,write")
    live = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))
    try:
        with httpx.Client(base_url=live.url) as http:
            kit.register(http, keys.worker(8), devices=2, models=("tiny",))
            queued = post(http, user, "train", gpus=4)
            assert queued.status_code == 201 and queued.json()["gpus"] == 4, queued.text
        job = queued.json()["id"]
        shown = CliRunner().invoke(main, ["jobs", "show", job, "--scheduler", live.url, "--api-key", user], catch_exceptions=False)
        assert shown.exit_code == 0, shown.output
        said = " ".join(shown.output.split())
        assert ("reason: too_few_devices: no worker offering tiny has 4 slots (the largest has 2 slots): resubmit it with "
                "--gpus 2 or fewer, or start a worker with 4 slots") in said, said
    finally:
        live.stop()
    refusing = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", refuse_unplaceable=True), background=False))
    try:
        with httpx.Client(base_url=refusing.url) as http:
            refused = post(http, user, "train", gpus=4)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"].endswith("no worker offering tiny has 4 devices (the workers offer tiny: up to 2 "
                                                            "device(s)): submit it with --gpus 2 or fewer"), refused.text
    finally:
        refusing.stop()
