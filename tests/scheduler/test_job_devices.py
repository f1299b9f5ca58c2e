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
        "inference": ["serve-model", "--model", "tiny", "--detach", *at],
        "eval": ["eval", "--env", "tinker/Bandit-v0", "--model", "tiny", "--quiet", *at],
    }
    for kind, args in runs.items():
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 2, (kind, result.output)
        assert f"{kind} jobs run on one device today" in result.output and "--gpus 1 on the command line" in result.output, result.output
    assert kit.query(db_url, "SELECT COUNT(*) FROM jobs") == [(0,)]
