"""A league through the scheduler, with real processes on 127.0.0.1: a scheduler, ``tinkergym worker --shared-devices 0
--seats 3`` and ``tinkergym train --trainer league --scheduler``. The job takes two seats of the one shared server (one
adapter a player, one lease, one job toward the quota), each player's token opens its own adapter alone, the players'
calls are sent together, and the run's numbers are those of the same league trained locally on ``--backend shared``,
step for step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("tinkergym_gomoku")

from click.testing import CliRunner  # noqa: E402
from sqlalchemy import select  # noqa: E402

from tinkergym.cli import main  # noqa: E402
from tinkergym.client import player_token  # noqa: E402
from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.scheduler.db import allocations, events, jobs, make_engine  # noqa: E402
from tinkergym.serve.asgi import ThreadServer  # noqa: E402
from tinkergym.trainers.reporting import read_metrics  # noqa: E402
from workerkit import shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

LEAGUE = ("--trainer", "league", "--trainer-arg", "players=2", "--trainer-arg", "max_snapshots=0", "--env", "tinker/GomokuDuel-v0",
          "--kwarg", "size=5", "--kwarg", "win_length=3", "--model", "tiny", "--dtype", "float32", "--lora-rank", "4", "--seed", "3",
          "--steps", "2", "--batch-size", "2", "--group-size", "2", "--max-turns", "4", "--max-new-tokens", "6", "--lr", "3e-2",
          "--checkpoint-every", "1", "--quiet")
KEPT = ("loss", "p1/loss", "grad_norm", "p1/grad_norm", "reward/mean", "p1/reward/mean", "selfplay/games", "selfplay/moves",
        "tokens/sampled", "p1/tokens/sampled", "rating/p0", "rating/p1")


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_league_trains_through_the_scheduler_on_seats_of_one_server_as_it_does_locally(
        db_url: str, keys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    local = CliRunner().invoke(main, ["train", *LEAGUE, "--out", str(tmp_path / "local")], catch_exceptions=False)
    assert local.exit_code == 0, local.output

    user, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2)))
    worker = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache)
    engine = make_engine(db_url)
    try:
        client = subprocess.run(
            [sys.executable, "-m", "tinkergym", "train", *LEAGUE, "--out", str(tmp_path / "scheduled"), "--scheduler", scheduler.url],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "TINKERGYM_API_KEY": user, "TINKERGYM_CACHE": str(tmp_path / "client-cache")})
        assert client.returncode == 0, client.stderr[-4000:]
        job_id = json.loads((tmp_path / "scheduled" / "config.json").read_text())["scheduler_job"]
        with engine.connect() as conn:
            leased = [json.loads(e.data) for e in conn.execute(select(events.c.data).where(events.c.job_id == job_id, events.c.type == "lease"))]
            state = conn.execute(select(jobs.c.state, jobs.c.config).where(jobs.c.id == job_id)).one()
            held = conn.execute(select(allocations)).all()
        assert state.state == "succeeded" and json.loads(state.config)["players"] == 2
        assert len(leased) == 1 and len(leased[0]["seats"]) == 2 and leased[0]["devices"] == 1, "one lease, a seat a player, one device"
        assert held == [], "the job's end frees both seats"
        # a player's token opens its own adapter alone: after the job, none answers (the adapters are closed)
        connection = httpx.get(f"{scheduler.url}/v1/jobs/{job_id}/connection", headers={"Authorization": f"Bearer {user}"})
        assert connection.status_code in (404, 409), connection.text
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        scheduler.stop()
        engine.dispose()

    mine, theirs = read_metrics(tmp_path / "scheduled" / "metrics.jsonl"), read_metrics(tmp_path / "local" / "metrics.jsonl")
    assert len(mine) == len(theirs) == 2
    compared = 0
    for step, (a, b) in enumerate(zip(mine, theirs)):
        for key in KEPT:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (step, key, a[key], b[key])
                compared += 1
    assert compared >= 2 * 6 and {"p1/reward/mean", "rating/p1"} <= set(mine[-1])
    # each player saved its state on its own adapter of the server (a tiny model's games all end alike: no row trains here;
    # tests/trainers/test_league_players.py trains players apart)
    note = json.loads((tmp_path / "scheduled" / "checkpoints" / "step_000001" / "players" / "p1" / "remote_state.json").read_text())
    assert note["name"] == "step_000001.p1", "every checkpoint keeps its own state of each player"
    assert (tmp_path / "scheduled" / "final" / "players" / "p1" / "adapter_config.json").is_file(), "each player exports"
    games = [json.loads(line) for line in (tmp_path / "scheduled" / "league" / "matches.jsonl").read_text().splitlines()]
    assert games == [json.loads(line) for line in (tmp_path / "local" / "league" / "matches.jsonl").read_text().splitlines()]
    assert player_token("tok", 0) == "tok" and player_token("tok", 1) != player_token("tok", 2) != "tok"
