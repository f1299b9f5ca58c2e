"""A scheduler job cancelled from elsewhere (``tinkergym jobs cancel``, the dashboard) while a run trains through it: the
client says it was cancelled, and never that it waits for a next lease that will not come."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tinkergym.backends.scheduled import JobEnded, ScheduledBackend
from tinkergym.client import SchedulerError, wait_running


class ShowsState:
    """The scheduler's answers about one job in ``state``; each ``show`` is counted."""

    url = "http://scheduler.invalid"

    def __init__(self, state: str) -> None:
        self.state, self.shown = state, 0

    def show(self, job_id: str) -> dict[str, Any]:
        self.shown += 1
        return {"id": job_id, "state": self.state, "error": None, "last_event": 0, "lease_epoch": 1}

    def events(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        return []

    def connection(self, job_id: str) -> dict[str, Any]:
        raise SchedulerError("not running", 409)


@pytest.mark.parametrize("state", ["cancelling", "cancelled"])
def test_a_lost_server_of_a_cancelled_job_is_said_to_be_cancelled(state: str) -> None:
    said: list[str] = []
    backend = ScheduledBackend(ShowsState(state), "job_1", poll=0.01, wait_timeout=1.0, say=said.append)
    backend.epoch = 1
    with pytest.raises(JobEnded, match=r"^job job_1 is cancelled: it was cancelled while this client used it \(tinkergym jobs cancel job_1"):
        backend.reconnect()
    assert not any("did not answer" in line or "next lease" in line for line in said), said


def test_a_lost_server_of_a_live_job_still_waits_for_its_next_lease() -> None:
    said: list[str] = []
    backend = ScheduledBackend(ShowsState("queued"), "job_1", poll=0.01, wait_timeout=0.05, say=said.append)
    backend.epoch = 1
    with pytest.raises(JobEnded, match="did not start within"):
        backend.reconnect()
    assert said[0] == "job job_1: its server at epoch 1 did not answer; waiting for the job's next lease"


def test_waiting_for_a_cancelling_job_ends_at_once() -> None:
    client = ShowsState("cancelling")
    with pytest.raises(JobEnded, match="^job job_1 is cancelled: "):
        wait_running(client, "job_1", poll=0.01, timeout=5.0, say=lambda line: None)
    assert client.shown == 1


#: A backend plugin: the torch backend of a scheduler job that is cancelled once the run's first checkpoint is saved (its
#: next sampling call finds the server gone, and the scheduler says the job is cancelled).
PLUGIN = textwrap.dedent(
    """
    from tinkergym.backends.scheduled import BackendLost, ScheduledBackend

    class Cancelled:
        url = "http://scheduler.invalid"

        def show(self, job_id):
            return {"id": job_id, "state": "cancelled", "error": None, "last_event": 0, "lease_epoch": 1}

        def events(self, job_id, after=0):
            return []

    class CancelledUnder:
        job_id, epoch, poll, wait_timeout = "job_x", 1, 0.01, 5.0
        reconnect, connect, wait_running = ScheduledBackend.reconnect, ScheduledBackend.connect, ScheduledBackend.wait_running

        def __init__(self, inner):
            self.inner, self.client, self.saved = inner, Cancelled(), False

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def say(self, line):
            print(line, flush=True)

        def save_state(self, *args, **kwargs):
            self.saved = True
            return self.inner.save_state(*args, **kwargs)

        def sample(self, request):
            if self.saved:
                raise BackendLost("job job_x: its server did not answer")
            return self.inner.sample(request)

    def build(request):
        from tinkergym.backends.torch import build as build_torch

        return CancelledUnder(build_torch(request))
    """
)


def test_train_through_a_job_cancelled_elsewhere_exits_1_saying_so_and_how_to_go_on(tiny: str, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from tinkergym.cli import main

    site = tmp_path / "site"
    (site / "cancelled_backend-1.0.dist-info").mkdir(parents=True)
    (site / "cancelled_backend-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: cancelled-backend\nVersion: 1.0\n")
    (site / "cancelled_backend-1.0.dist-info" / "entry_points.txt").write_text("[tinkergym.backends]\ncancelled = cancelled_backend:build\n")
    (site / "cancelled_backend.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--steps", "3", "--batch-size", "2",
                                       "--group-size", "2", "--max-new-tokens", "4", "--dtype", "float32", "--checkpoint-every", "1",
                                       "--quiet", "--out", str(out), "--backend", "cancelled"])
    assert result.exit_code == 1, result.output
    assert "Error: job job_x is cancelled: it was cancelled while this client used it" in result.stderr, result.output
    assert f"go on with: tinkergym train --resume {out}" in result.stderr and "(newest: step_000000)" in result.stderr
    assert "did not answer; waiting" not in result.output
