"""A league through the scheduler, with real processes on 127.0.0.1: a scheduler, ``tinkergym worker --shared-devices 0
--seats 3`` and ``tinkergym train --trainer league --scheduler``. The job takes two seats of the one shared server (one
adapter a player, one lease, one job toward the quota), the players' calls are sent together, every player's state is
stored as a checkpoint; the worker is killed once a checkpoint of both players is stored, a second one takes the job,
restores both players and the run goes on. Its numbers are those of the same league trained locally on
``--backend shared``, step for step."""

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
pytest.importorskip("tinkergym_gomoku")

from click.testing import CliRunner  # noqa: E402
from sqlalchemy import select  # noqa: E402

from tinkergym.cli import main  # noqa: E402
from tinkergym.client import player_token  # noqa: E402
from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.scheduler.db import allocations, checkpoints, events, jobs, make_engine  # noqa: E402
from tinkergym.serve.asgi import ThreadServer  # noqa: E402
from tinkergym.trainers.reporting import read_metrics  # noqa: E402
from workerkit import shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

LEAGUE = ("--trainer", "league", "--trainer-arg", "players=2", "--trainer-arg", "max_snapshots=0", "--env", "tinker/GomokuDuel-v0",
          "--kwarg", "size=5", "--kwarg", "win_length=3", "--model", "tiny", "--dtype", "float32", "--lora-rank", "4", "--seed", "3",
          "--steps", "3", "--batch-size", "2", "--group-size", "2", "--max-turns", "4", "--max-new-tokens", "6", "--lr", "3e-2",
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
    second = None
    engine = make_engine(db_url)
    try:
        client = subprocess.Popen(  # each env step waits 0.5 s (it changes no number): the run outlives the first worker
            [sys.executable, "-m", "tinkergym", "train", *LEAGUE, "--env-latency", "0.5", "--out", str(tmp_path / "scheduled"),
             "--scheduler", scheduler.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TINKERGYM_API_KEY": user, "TINKERGYM_CACHE": str(tmp_path / "client-cache")})
        deadline = time.monotonic() + 300
        while True:  # a checkpoint of both players stored: the first worker is killed (its shared server with it)
            with engine.connect() as conn:
                stored = {r.name for r in conn.execute(select(checkpoints.c.name))}
            if {"step_000000", "step_000000.p1"} <= stored:
                break
            assert client.poll() is None, client.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no checkpoint of both players was stored: {stored}"
            time.sleep(0.1)
        worker.kill()
        worker.wait()
        second = shared_worker(scheduler.url, worker_key, tmp_path / "w2", cache)
        _, stderr = client.communicate(timeout=600)
        assert client.returncode == 0, stderr[-4000:]
        assert "reconnected to its new server (epoch 2)" in stderr, stderr[-3000:]
        job_id = json.loads((tmp_path / "scheduled" / "config.json").read_text())["scheduler_job"]
        with engine.connect() as conn:
            leased = [json.loads(e.data) for e in conn.execute(select(events.c.data).where(events.c.job_id == job_id, events.c.type == "lease"))]
            state = conn.execute(select(jobs.c.state, jobs.c.config).where(jobs.c.id == job_id)).one()
            held = conn.execute(select(allocations)).all()
            stored = {r.name for r in conn.execute(select(checkpoints.c.name).where(checkpoints.c.job_id == job_id))}
        assert state.state == "succeeded" and json.loads(state.config)["players"] == 2
        assert len(leased) == 2 and all(len(lease["seats"]) == 2 and lease["devices"] == 1 for lease in leased), "a lease a worker, a seat a player"
        assert held == [], "the job's end frees both seats"
        assert {f"step_00000{k}{p}" for k in range(3) for p in ("", ".p1")} <= stored, "every checkpoint holds every player's state"
    finally:
        for process in (worker, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        scheduler.stop()
        engine.dispose()

    mine, theirs = read_metrics(tmp_path / "scheduled" / "metrics.jsonl"), read_metrics(tmp_path / "local" / "metrics.jsonl")
    assert len(mine) == len(theirs) == 3
    compared = 0
    for step, (a, b) in enumerate(zip(mine, theirs)):
        for key in KEPT:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (step, key, a[key], b[key])
                compared += 1
    assert compared >= 3 * 6 and {"p1/reward/mean", "rating/p1"} <= set(mine[-1])
    # each player saved its state on its own adapter of the server (a tiny model's games all end alike: no row trains here;
    # tests/trainers/test_league_players.py trains players apart)
    note = json.loads((tmp_path / "scheduled" / "checkpoints" / "step_000002" / "players" / "p1" / "remote_state.json").read_text())
    assert note["name"] == "step_000002.p1", "every checkpoint keeps its own state of each player"
    assert (tmp_path / "scheduled" / "final" / "players" / "p1" / "adapter_config.json").is_file(), "each player exports"
    games = [json.loads(line) for line in (tmp_path / "scheduled" / "league" / "matches.jsonl").read_text().splitlines()]
    assert games == [json.loads(line) for line in (tmp_path / "local" / "league" / "matches.jsonl").read_text().splitlines()]
    assert player_token("tok", 0) == "tok" and player_token("tok", 1) != player_token("tok", 2) != "tok"
