"""A job's training server stops on its own: when its parent (the worker) dies, and when its client goes quiet."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from testkit import wait_until_answers  # registered by tests/conftest.py

from tinkergym.serve.lifetime import IDLE_EXIT_CODE, Watchdog

TOKEN = "lifetime-test-token-0123456789abcdef0123456789"


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve_command(tiny: str, tmp_path: Path, port: int, *extra: str) -> list[str]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    return [
        sys.executable, "-m", "tinkergym", "serve", "backend", "--model", tiny, "--device", "cpu", "--lora-rank", "4",
        "--port", str(port), "--token-file", str(token), "--run-dir", str(tmp_path / "server"), *extra,
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_watchdog_fires_on_idleness_but_not_while_active() -> None:
    stopped: list[int] = []
    last = [time.monotonic()]
    dog = Watchdog(idle_timeout=0.3, last_activity=lambda: last[0], interval=0.05, stop=stopped.append).start()
    for _ in range(10):  # activity every 0.1 s keeps it quiet
        time.sleep(0.1)
        last[0] = time.monotonic()
    assert stopped == [] and dog.exit_code is None
    time.sleep(0.6)
    assert stopped == [IDLE_EXIT_CODE] and dog.exit_code == IDLE_EXIT_CODE
    with pytest.raises(ValueError, match="last_activity"):
        Watchdog(idle_timeout=1.0)


def test_a_running_call_counts_as_activity(tmp_path: Path) -> None:
    from tinkergym.serve.training.app import create_app
    from tinkergym.serve.auth import token_digest

    app = create_app(object(), run_dir=tmp_path, token_digest=token_digest(TOKEN))
    service = app.state.service
    before = service.last_activity()
    service.worker.pending += 1  # as while a call runs
    time.sleep(0.2)
    assert service.last_activity() > before + 0.15
    service.worker.pending -= 1
    frozen = service.last_activity()
    time.sleep(0.2)
    assert service.last_activity() == frozen


@pytest.mark.slow
def test_an_idle_server_exits_with_its_code(tiny: str, tmp_path: Path) -> None:
    port = _port()
    server = subprocess.Popen(_serve_command(tiny, tmp_path, port, "--idle-timeout", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/health", timeout=120)
        assert server.wait(timeout=30) == IDLE_EXIT_CODE
        assert "no client call for 2 s" in server.stderr.read()
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "reparenting"])
def test_the_server_stops_when_its_worker_is_killed(tiny: str, tmp_path: Path, pdeathsig: bool) -> None:
    port = _port()
    command = _serve_command(tiny, tmp_path, port, "--exit-with-parent")
    # A stand-in worker: starts the server as its child (with PR_SET_PDEATHSIG or not), says its pid, then waits.
    worker_code = textwrap.dedent(f"""
        import subprocess, sys, time
        from tinkergym.serve.lifetime import die_with_parent
        child = subprocess.Popen({command!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent if {pdeathsig} else None)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    worker = subprocess.Popen([sys.executable, "-c", worker_code], stdout=subprocess.PIPE, text=True)
    server_pid = int(worker.stdout.readline())
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/health", timeout=120)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 15
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), "the server outlived its worker"
    finally:
        if _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
