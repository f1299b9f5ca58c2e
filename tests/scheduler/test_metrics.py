"""The scheduler's Prometheus metrics: ``GET /metrics`` for a key with the ``metrics`` scope only, parsed with
``prometheus_client``'s own parser, and each family moving as jobs are queued, leased, expired and streamed."""

from __future__ import annotations

from typing import Any

import pytest
import workerkit as kit  # registered by conftest.py

pytest.importorskip("prometheus_client")

from prometheus_client import CONTENT_TYPE_LATEST  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tinkergym.scheduler import leases  # noqa: E402


def scrape(client: Any, key: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: ``(name, sorted labels) -> value``."""
    answer = client.get("/metrics", headers=kit.auth(key))
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == CONTENT_TYPE_LATEST  # the text format prometheus_client writes
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(answer.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_need_the_metrics_scope_and_move_with_the_queue(make_client: Any, keys: Any) -> None:
    clock = kit.Clock()
    client = make_client(clock=clock, lease_ttl_s=30.0)
    user, scraper, worker_key = keys.new("acme", "read,write"), keys.new("ops", "metrics"), keys.new("ops", "worker")
    assert client.get("/metrics").status_code == 401
    refused = client.get("/metrics", headers=kit.auth(user))
    assert refused.status_code == 403 and "metrics" in refused.text

    before = scrape(client, scraper)
    assert value(before, "tinkergym_scheduler_jobs", state="queued", kind="train") == 0
    assert value(before, "tinkergym_scheduler_jobs", state="running", kind="inference") == 0  # every state and kind listed
    w = kit.register(client, worker_key, devices=2)
    first = kit.submit(client, user)
    clock.advance(1.0)  # distinct ages: the first is leased first
    second = kit.submit(client, user)
    samples = scrape(client, scraper)
    assert value(samples, "tinkergym_scheduler_jobs", state="queued", kind="train") == 2
    assert value(samples, "tinkergym_scheduler_devices", kind="device", state="free") == 2
    assert value(samples, "tinkergym_scheduler_workers", state="alive") == 1

    lease = w.lease()
    assert lease is not None and lease["job_id"] == first
    samples = scrape(client, scraper)
    assert value(samples, "tinkergym_scheduler_jobs", state="queued", kind="train") == 1
    assert value(samples, "tinkergym_scheduler_jobs", state="leased", kind="train") == 1
    assert value(samples, "tinkergym_scheduler_devices", kind="device", state="held") == 1
    assert value(samples, "tinkergym_scheduler_devices", kind="device", state="free") == 1
    assert value(samples, "tinkergym_scheduler_leases_granted_total") == 1

    clock.advance(31.0)  # the lease ends unrenewed: the sweeper requeues the job, and the worker is gone by now
    assert leases.sweep(client.app) == 1
    samples = scrape(client, scraper)
    assert value(samples, "tinkergym_scheduler_leases_expired_total") == 1
    assert value(samples, "tinkergym_scheduler_jobs", state="queued", kind="train") == 2
    assert value(samples, "tinkergym_scheduler_devices", kind="device", state="held") == 0
    clock.advance(100.0)
    assert value(scrape(client, scraper), "tinkergym_scheduler_workers", state="gone") == 1

    # request counts and latencies by route template, never by a job's path
    assert client.get(f"/v1/jobs/{second}", headers=kit.auth(user)).status_code == 200
    assert client.get("/no/such/path/" + "x" * 50, headers=kit.auth(user)).status_code == 404
    samples = scrape(client, scraper)
    assert value(samples, "tinkergym_http_requests_total", server="scheduler", route="/v1/jobs/{job_id}", method="GET", code="200") == 1
    assert value(samples, "tinkergym_http_request_duration_seconds_count", server="scheduler", route="/v1/jobs/{job_id}", method="GET") == 1
    assert value(samples, "tinkergym_http_requests_total", server="scheduler", route="unmatched", method="GET", code="404") == 1
    assert not any(second in dict(labels).get("route", "") for _, labels in samples)  # no job id in any label
    assert value(samples, "tinkergym_scheduler_event_streams_open") == 0


def test_an_admin_key_reads_the_metrics_and_the_scope_is_a_tenant_keys(make_client: Any, keys: Any) -> None:
    from tinkergym.scheduler.auth import parse_scopes

    client = make_client()
    assert client.get("/metrics", headers=kit.auth(keys.new("ops", "admin"))).status_code == 200
    assert parse_scopes("metrics") == ["metrics"]
