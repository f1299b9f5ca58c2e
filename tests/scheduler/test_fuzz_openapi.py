"""Hostile input: schemathesis generates requests for every operation of the scheduler's OpenAPI document,
with a valid key for each route (a tenant's admin key; a worker credential for the workers' routes), and the
scheduler answers none of them with a 5xx.

A worker is registered and a job is queued first, so the generated ids sometimes meet real rows; the
fuzzer's own ids and bodies (NULs, huge numbers, odd unicode, wrong types) must all end as 4xx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("schemathesis")

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.auth import create_key
from tinkergym.scheduler.credentials import WorkerBounds, create_worker_key
from tinkergym.scheduler.db import make_engine, upgrade

HEADERS: dict[str, str] = {}
WORKER_HEADERS: dict[str, str] = {}


def _headers(operation: Any) -> dict[str, str]:
    """The worker credential for the workers' own routes (registering, leases, reports), the admin key elsewhere."""
    path, method = operation.path, operation.method.upper()
    return WORKER_HEADERS if path.startswith("/v1/workers/") or (path == "/v1/workers" and method == "POST") else HEADERS


@pytest.fixture
def scheduler_schema(tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path / 'scheduler.db'}"
    engine = make_engine(url)
    upgrade(engine)
    HEADERS["Authorization"] = "Bearer " + create_key(engine, "fuzz", ["admin"])[1]
    WORKER_HEADERS["Authorization"] = "Bearer " + create_worker_key(engine, WorkerBounds(4))[1]
    engine.dispose()
    app = create_app(SchedulerSettings(db_url=url, data_dir=tmp_path / "data"), background=False)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:  # real rows for the generated requests to meet
        worker = {"name": "w", "host": "127.0.0.1", "devices": [{"index": 0, "kind": "slot"}], "models": ["tiny"]}
        assert client.post("/v1/workers", json=worker, headers=WORKER_HEADERS).status_code == 200
        job = {"kind": "train", "config": {"model": "tiny"}}
        assert client.post("/v1/jobs", json=job, headers=HEADERS).status_code == 201
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=HEADERS)


@pytest.mark.slow
def test_no_request_makes_a_server_error(scheduler_schema: Any) -> None:
    # One Hypothesis run per operation (schemathesis' own pytest plugin does the same through parametrize).
    operations = [result.ok() for result in scheduler_schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    failures, statuses = [], []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case: Any) -> None:
            statuses.append(case.call_and_validate(headers=_headers(operation), checks=[not_a_server_error]).status_code)  # noqa: B023 - run within this iteration

        try:
            run()
        except Exception as exc:  # noqa: BLE001 - gathered: every operation is fuzzed before the test fails
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
    assert len(statuses) >= 5 * len(operations) and {200, 400, 404} <= set(statuses), sorted(set(statuses))
