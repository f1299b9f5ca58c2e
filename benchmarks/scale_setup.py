"""The processes of a run of the cluster simulator (``scheduler_scale.py``), each from the scheduler's own source tree
(``--code``): the database prepared (tenants with their quotas and keys, a worker credential per simulated worker) and
``tinkergym scheduler serve`` started on a free port of 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_machine import free_port  # sibling modules: benchmarks/ is on sys.path
from scale_report import SEATS

LEASE_TTL = 30.0  # the scheduler's default (--lease-ttl sets it)


def setup(url: str, tenants: int, workers: int, max_gpus: list[int], max_queued: list[int], out: str) -> None:
    """Tenants with quotas and a key each, and one worker credential per worker; the keys written to ``out`` as JSON."""
    from sqlalchemy import update

    from tinkergym.scheduler.auth import create_key, ensure_tenant
    from tinkergym.scheduler.bounds import WorkerBounds
    from tinkergym.scheduler.credentials import create_worker_key
    from tinkergym.scheduler.db import make_engine, tenants as tenants_table, upgrade

    engine = make_engine(url)
    upgrade(engine)
    keys: dict[str, Any] = {"tenants": {}, "workers": [], "operator": None}
    for t in range(tenants):
        name = f"t{t:03d}"
        keys["tenants"][name] = create_key(engine, name, ["read", "write"], "sim")[1]
        with engine.begin() as conn:
            ensure_tenant(conn, name, max_gpus=max_gpus[t], max_queued=max_queued[t])
            conn.execute(update(tenants_table).where(tenants_table.c.id == name).values(keep_ended_jobs=100_000))
    keys["operator"] = create_key(engine, "ops", ["read", "operator", "metrics"], "sim")[1]
    for w in range(workers):
        keys["workers"].append(create_worker_key(engine, WorkerBounds(devices=8 + SEATS), f"sim-{w}")[1])
    keys["probe"] = create_worker_key(engine, WorkerBounds(devices=8), "probe")[1]
    engine.dispose()
    Path(out).write_text(json.dumps(keys))


def run_setup(code: Path, url: str, tenants: int, workers: int, max_gpus: list[int], max_queued: list[int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "keys.json"
        args = json.dumps([url, tenants, workers, max_gpus, max_queued, str(out)])
        script = f"import json,sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import scale_setup as s; s.setup(*json.loads(sys.argv[1]))"
        subprocess.run([sys.executable, "-c", script, args], check=True, env={**os.environ, "PYTHONPATH": str(code)})
        return json.loads(out.read_text())


# ----- the scheduler process ---------------------------------------------------------------------------------------
def start_scheduler(code: Path, url: str, data_dir: Path, settings: list[str], lease_ttl: float = LEASE_TTL) -> tuple[subprocess.Popen, int]:
    from scheduler_load import wait_ready  # noqa: PLC0415 - a sibling script (benchmarks/ is on sys.path)

    port = free_port()
    command = [sys.executable, "-m", "tinkergym", "scheduler", "serve", "--db", url, "--data-dir", str(data_dir), "--port", str(port),
               "--lease-ttl", str(lease_ttl), *settings]
    log = open(data_dir / "serve.log", "wb")  # noqa: SIM115 - the process's whole life
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(code)})
    wait_ready(process, port, 90.0, lambda: (data_dir / "serve.log").read_text()[-3000:])
    return process, port
