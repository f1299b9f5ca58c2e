"""A Tinker session's end against an engine whose run takes long to start (a cluster job waiting for a seat): the start holds
back no heartbeat of any session, a retried creation waits for the first, and a session that lapses meanwhile gets no run,
its run's job ended with the reason."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

import pytest

pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from tinkergym.tinker_api.service import Limits, TinkerError, TinkerService  # noqa: E402


class SlowEngine:
    """Opens a run only once ``release`` is set; records what it closes and why."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.closed: list[tuple[Any, str | None]] = []

    def check_model(self, name: str | None) -> None:
        pass

    def open_run(self, run_id: str, model: str, rank: int, seed: int | None, credential: str, source: Any = None) -> str:
        self.started.set()
        assert self.release.wait(30)
        return f"job of {run_id}"

    def close(self, handle: Any, forget: bool = False, reason: str | None = None) -> None:
        self.closed.append((handle, reason))


def test_a_run_slow_to_start_holds_back_no_heartbeat_and_a_session_that_lapses_meanwhile_gets_no_run() -> None:
    engine = SlowEngine()
    service = TinkerService(engine, logging.getLogger("session-end-test"), Limits(session_timeout_s=30.0))
    mine, theirs = service.create_session("alice"), service.create_session("bob")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        creating = pool.submit(service.create_run, "alice", mine, 0, "tiny", 4, None, None)
        assert engine.started.wait(10)
        retried = pool.submit(service.create_run, "alice", mine, 0, "tiny", 4, None, None)  # the SDK's retry of the same creation
        for tenant, session_id in (("bob", theirs), ("alice", mine)):  # the run's start holds back no session's heartbeat
            pool.submit(service.heartbeat, tenant, session_id).result(timeout=5)
        service.sessions[mine].last_heartbeat -= service.limits.session_timeout_s + 1
        pool.submit(service.maintain).result(timeout=5)  # the session lapses while its run's job still starts
        assert mine not in service.sessions and theirs in service.sessions
        engine.release.set()
        for attempt in (creating, retried):
            with pytest.raises(TinkerError) as ended:
                attempt.result(timeout=10)
            assert ended.value.status == 404
    assert engine.closed == [(f"job of {mine}:train:0", "its Tinker session ended while the run's job started")]
    assert service.runs == {}
