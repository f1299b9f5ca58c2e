"""``tinkergym jobs list|show|cancel|logs`` against a live scheduler (and SchedulerClient's errors)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from click.testing import CliRunner
from tinkergym.scheduler import states
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import make_engine
from tinkergym.scheduler.repository import JobStore

from tinkergym.cli import main
from tinkergym.serve.asgi import ThreadServer
from tinkergym.client import SchedulerClient, SchedulerError
from tinkergym.errors import ConfigError

CONFIG = {"model": "smollm2-135m", "env": "tinker/Bandit-v0"}


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[ThreadServer]:
    live = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", sse_keepalive_s=0.5), background=False))
    yield live
    live.stop()


def jobs_cli(server: ThreadServer, key: str | None, *args: str) -> Any:
    env = {"TINKERGYM_SCHEDULER": server.url, "TINKERGYM_API_KEY": key}
    return CliRunner().invoke(main, ["jobs", *args], env=env, catch_exceptions=False)


def test_list_show_cancel_and_logs(server, keys) -> None:
    key = keys.new()
    client = SchedulerClient(server.url, key)
    made = [client.submit("train", CONFIG, name=f"run-{i}", priority=i)["id"] for i in range(3)]
    listed = jobs_cli(server, key, "list")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["ID", "KIND", "STATE", "PRIORITY", "GPUS", "ATTEMPT", "AGE", "REASON", "NAME"]
    assert [line.split()[0] for line in lines[1:]] == made[::-1]  # newest first
    assert lines[1].split()[1:] == ["train", "queued", "2", "1", "0", lines[1].split()[6], "no_worker", "run-2"]
    as_json = json.loads(jobs_cli(server, key, "list", "--json", "--limit", "2").output)
    assert [j["id"] for j in as_json] == made[:0:-1]
    shown = jobs_cli(server, key, "show", made[0])
    assert shown.exit_code == 0 and "state:" in shown.output and "queued" in shown.output and "smollm2-135m" in shown.output
    assert json.loads(jobs_cli(server, key, "show", made[0], "--json").output)["id"] == made[0]
    cancelled = jobs_cli(server, key, "cancel", made[0])
    assert cancelled.exit_code == 0 and cancelled.output.strip() == f"{made[0]}: cancelled"
    again = jobs_cli(server, key, "cancel", made[0])
    assert again.exit_code == 1 and "cannot be cancelled" in again.output
    only = jobs_cli(server, key, "list", "--state", "cancelled", "--json")
    assert [j["id"] for j in json.loads(only.output)] == [made[0]]
    logs = jobs_cli(server, key, "logs", made[0])
    assert logs.exit_code == 0
    rows = logs.output.splitlines()
    assert len(rows) == 2 and rows[0].split()[2] == "state" and '"state":"queued"' in rows[0] and '"state":"cancelled"' in rows[1]
    assert jobs_cli(server, key, "logs", made[0], "--after", "1", "--json").output.count("\n") == 1


def test_logs_follow_streams_until_the_job_ends(server, keys, db_url) -> None:
    key = keys.new()
    job_id = SchedulerClient(server.url, key).submit("train", CONFIG)["id"]
    engine = make_engine(db_url)
    store = JobStore(engine)

    def later() -> None:
        time.sleep(0.5)
        with store.transaction() as conn:
            store.append_event(conn, job_id, "metrics", {"step": 1, "reward": 0.5})
        time.sleep(0.3)
        with store.transaction() as conn:
            store.transition(conn, job_id, states.CANCELLED)

    writer = threading.Thread(target=later)
    writer.start()
    t0 = time.monotonic()
    followed = jobs_cli(server, key, "logs", job_id, "--follow")
    writer.join()
    engine.dispose()
    assert followed.exit_code == 0, followed.output
    assert time.monotonic() - t0 < 10
    rows = followed.output.splitlines()
    assert [r.split()[2] for r in rows] == ["state", "metrics", "state"]
    assert '"reward":0.5' in rows[1] and '"state":"cancelled"' in rows[2]


def test_no_key_or_a_bad_one_exits_2(server, keys) -> None:
    missing = jobs_cli(server, None, "list")
    assert missing.exit_code == 2 and "TINKERGYM_API_KEY" in missing.output and "--api-key" in missing.output
    blank = jobs_cli(server, "  ", "show", "job_x")
    assert blank.exit_code == 2 and "no API key" in blank.output
    refused = jobs_cli(server, "tgk_0123456789ab_" + "A" * 43, "list")
    assert refused.exit_code == 2 and "401" in refused.output and "TINKERGYM_API_KEY" in refused.output
    unknown = jobs_cli(server, keys.new(), "show", "job_nope")
    assert unknown.exit_code == 2 and "not found" in unknown.output
    no_url = CliRunner().invoke(main, ["jobs", "list", "--api-key", "tgk_x"], env={"TINKERGYM_SCHEDULER": None}, catch_exceptions=False)
    assert no_url.exit_code == 2 and "TINKERGYM_SCHEDULER" in no_url.output
    bad_url = CliRunner().invoke(main, ["jobs", "list", "--api-key", "tgk_x", "--scheduler", "ftp://x"], catch_exceptions=False)
    assert bad_url.exit_code == 2 and "http" in bad_url.output
    wrong_scope = jobs_cli(server, keys.new("acme", "read"), "cancel", "job_nope")
    assert wrong_scope.exit_code == 2 and "write" in wrong_scope.output


def test_client_errors_carry_the_status_and_the_servers_message(server, keys, monkeypatch) -> None:
    key = keys.new()
    client = SchedulerClient(server.url, key)
    with pytest.raises(SchedulerError) as bad:
        client.submit("train", {"model": "/etc/passwd"})
    assert bad.value.status == 400 and "not a path" in str(bad.value)
    with pytest.raises(SchedulerError) as missing:
        client.show("job_nope")
    assert missing.value.status == 404 and missing.value.input_error
    job = client.submit("train", CONFIG, idempotency_key="once")
    assert client.submit("train", CONFIG, idempotency_key="once")["id"] == job["id"]
    with pytest.raises(SchedulerError) as reused:
        client.submit("sft", CONFIG, idempotency_key="once")
    assert reused.value.status == 422
    assert client.cancel(job["id"])["state"] == "cancelled"
    with pytest.raises(SchedulerError) as ended:
        client.cancel(job["id"])
    assert ended.value.status == 409 and not ended.value.input_error
    assert [e["seq"] for e in client.events(job["id"])] == [1, 2] and client.events(job["id"], after=1)[0]["data"]["state"] == "cancelled"
    assert client.checkpoints(job["id"]) == []
    with pytest.raises(SchedulerError) as unauthorized:
        SchedulerClient(server.url, "tgk_0123456789ab_" + "A" * 43).list()
    assert unauthorized.value.status == 401 and "TINKERGYM_API_KEY" in str(unauthorized.value)
    monkeypatch.delenv("TINKERGYM_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="TINKERGYM_API_KEY"):
        SchedulerClient(server.url)
    monkeypatch.setenv("TINKERGYM_API_KEY", key)
    monkeypatch.setenv("TINKERGYM_SCHEDULER", server.url)
    assert SchedulerClient().show(job["id"])["id"] == job["id"]


def test_a_refusal_says_how_to_go_on(server, keys) -> None:
    reader = SchedulerClient(server.url, keys.new("acme", "read"))
    with pytest.raises(SchedulerError) as no_scope:
        reader.submit("train", CONFIG)
    assert no_scope.value.status == 403 and "'write' scope" in str(no_scope.value) and "key with that scope" in str(no_scope.value)
    gpus_only = SchedulerClient(server.url, keys.worker(2, kind="gpu"))
    with pytest.raises(SchedulerError) as wrong_kind:
        gpus_only._request("POST", "/v1/workers", {"name": "box", "host": "127.0.0.1", "devices": [{"index": 0, "kind": "slot"}], "models": ["tiny"]})
    message = str(wrong_kind.value)
    assert wrong_kind.value.status == 403 and "--gpus LIST" in message and "workers set ID --kind slot" in message
    assert "scope" not in message, "a bound of the credential is no missing scope"


def test_client_lists_across_pages(server, keys) -> None:
    key = keys.new()
    client = SchedulerClient(server.url, key)
    made = [client.submit("eval", CONFIG)["id"] for _ in range(7)]
    assert [j["id"] for j in client.iter_jobs(page_size=2)] == made[::-1]
    assert [j["id"] for j in client.list(limit=5)] == made[:1:-1]
    assert len(client.list(limit=None, kind="eval")) == 7 and client.list(kind="train") == []


def test_client_gives_up_on_an_unreachable_scheduler() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    client = SchedulerClient(f"http://127.0.0.1:{port}", "tgk_x", retries=2, backoff=0.01)
    with pytest.raises(SchedulerError) as away:
        client.list()
    assert away.value.status is None and "3 tries" in str(away.value) and not away.value.input_error
