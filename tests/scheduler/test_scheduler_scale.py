"""The cluster simulator (``benchmarks/scheduler_scale.py --quick``) against the real scheduler process, on SQLite and on
PostgreSQL: 6 workers (some with seats), 60 jobs of 6 tenants with churn (jobs fail, are cancelled; workers vanish with
their leases and come back). Whatever the timing, the cluster keeps its invariants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_scale.py"


@pytest.mark.slow
@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_the_simulated_cluster_under_churn_keeps_every_invariant(db: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--db", db, "--json"], capture_output=True, text=True, timeout=600,
                          cwd=BENCHMARK.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads(proc.stdout.strip().splitlines()[-1])["runs"]
    assert run["db"] == db and run["jobs"] == 60 and run["batched_heartbeats"] is True
    # every job ended (succeeded, failed or cancelled), none lost
    assert run["drained"], run
    # no lease granted twice, no place over-committed, no quota exceeded (checked at every grant by the simulation)
    assert run["violations"] == [], run["violations"]
    # workers vanished holding leases, and each of those leases ended within the TTL (and a sweep) of the vanishing
    assert run["vanished_leases"] >= 1, "the run must have lost leases to check their requeue"
    assert run["requeue_s_max"] <= run["lease_ttl_s"] + 2.0, run
    # no job starved: past what its own tenant's quota forced on it (its tenant's earlier jobs over its max_gpus), no job
    # waited longer than the stated bound: the backfill age + two of the longest jobs + a lease TTL + 5 s of polls
    assert run["max_wait_past_quota_s"] <= run["wait_bound_s"], run
    # the only refusals the simulated workers met are the ones churn makes (a vanished worker's lost leases, quarantine)
    assert set(run["failures"]) <= {"lease 403", "run: lost", "run: final state 409", "run: state 409", "heartbeats 404"}, run["failures"]
    # most jobs were granted (a job cancelled while queued never is; a lost lease's job is granted again)
    assert run["grants"] >= 0.8 * run["jobs"] and run["submissions_per_s"] > 0
