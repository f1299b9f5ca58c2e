"""Ctrl-C in train and eval, and eval's progress bar: a real client process gets SIGINT; a stand-in scheduler records what it is asked."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from tinkergym.cli import main

TIMEOUT_S = 300  # a bound on failure only


class _Client:
    """``tinkergym *args`` as a subprocess, its stderr read line by line on a thread, so a test can wait for a line
    without blocking on the pipe; killed on leaving the ``with`` block if it still runs."""

    def __init__(self, *args: str, tmp_path: Path, key: str | None = "tgk_stand_in") -> None:
        env = {k: v for k, v in os.environ.items() if k != "TINKERGYM_API_KEY"}
        env.update({"TINKERGYM_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1", **({"TINKERGYM_API_KEY": key} if key else {})})
        self.process = subprocess.Popen([sys.executable, "-m", "tinkergym", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line)
        self.lines.put(None)  # stderr has ended

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def running(self) -> bool:
        return self.process.poll() is None

    def interrupt(self, signum: int = signal.SIGINT) -> None:
        self.process.send_signal(signum)

    def wait_for(self, text: str, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.seen):
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no line with {text!r} on stderr; saw:\n{''.join(self.seen)[-3000:]}")
            self.seen.append(line)

    def rest(self) -> str:
        """All of stderr, once it has ended (the process has exited or is about to)."""
        self._thread.join(timeout=TIMEOUT_S)
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.seen.append(line)
        return "".join(self.seen)

    def finish(self) -> str:
        """Waits for the process to exit; all of its stderr."""
        self.process.wait(timeout=TIMEOUT_S)
        return self.rest()


class _StandInScheduler(BaseHTTPRequestHandler):
    """Submit answers job j1, which stays queued; cancel answers (or, with ``block_cancel``, never does). Records each request."""

    protocol_version = "HTTP/1.1"
    requests: list[str] = []
    block_cancel = threading.Event()
    release = threading.Event()

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.requests.append(f"GET {self.path}")
        self._answer(200, {"id": "j1", "state": "queued", "queue_position": 1, "lease_epoch": 0})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append(f"POST {self.path}")
        if self.path.endswith("/cancel"):
            if self.block_cancel.is_set():
                self.release.wait(TIMEOUT_S)
            self._answer(200, {"id": "j1", "state": "cancelled"})
        else:
            self._answer(201, {"id": "j1", "state": "queued", "queue_position": 1, "lease_epoch": 0})


@pytest.fixture
def stand_in() -> Iterator[type[_StandInScheduler]]:
    handler = type("Handler", (_StandInScheduler,), {"requests": [], "block_cancel": threading.Event(), "release": threading.Event()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "eval"])
def test_ctrl_c_cancels_a_queued_job_and_a_second_one_exits_at_once(command: str, stand_in: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = (["train", "--env", "tinker/Bandit-v0", "--model", "tiny", "--steps", "5", "--out", str(out), "--quiet"] if command == "train"
            else ["eval", "--env", "tinker/Bandit-v0", "--model", "tiny", "--episodes", "2"])
    # First: the cancel is answered; the client says so and exits 130.
    with _Client(*args, "--scheduler", stand_in.url, tmp_path=tmp_path) as client:
        client.wait_for("position 1 in the queue")
        client.interrupt()
        stderr = client.finish()
    assert client.returncode == 130, stderr[-3000:]
    assert "POST /v1/jobs/j1/cancel" in stand_in.requests
    assert "job j1 is cancelled" in stderr and "Aborted!" not in stderr
    if command == "train":  # the run folder names the job: a resume reattaches to it or goes on in a new one
        assert f"tinkergym train --resume {out}" in stderr
        assert json.loads((out / "config.json").read_text())["scheduler_job"] == "j1"

    # Then: the scheduler does not answer the cancel; a second Ctrl-C exits at once and says what is left behind.
    stand_in.block_cancel.set()
    stand_in.requests.clear()
    if command == "train":
        args = ["train", "--resume", str(out), "--quiet"]
    with _Client(*args, *(["--scheduler", stand_in.url] if command == "eval" else []), tmp_path=tmp_path) as client:
        client.wait_for("position 1 in the queue")
        client.interrupt()
        client.wait_for("Ctrl-C again to exit at once")
        deadline = time.monotonic() + TIMEOUT_S
        while "POST /v1/jobs/j1/cancel" not in stand_in.requests:  # the cancel waits for an answer that does not come
            assert client.running() and time.monotonic() < deadline, "no cancel sent"
            time.sleep(0.02)
        client.interrupt()
        stderr = client.finish()
    assert client.returncode == 130, stderr[-3000:]
    assert "Ctrl-C again: exiting at once; job j1 may still hold its devices: tinkergym jobs cancel j1" in stderr


def test_sigterm_stops_a_scheduler_client_as_ctrl_c_does(stand_in: Any, tmp_path: Path) -> None:
    """``kill``, ``timeout`` or a batch system's notice: the job is cancelled, not left queued to start unattended."""
    args = ["eval", "--env", "tinker/Bandit-v0", "--model", "tiny", "--episodes", "2", "--scheduler", stand_in.url]
    with _Client(*args, tmp_path=tmp_path) as client:
        client.wait_for("position 1 in the queue")
        client.interrupt(signal.SIGTERM)
        stderr = client.finish()
    assert client.returncode == 130, stderr[-3000:]
    assert "POST /v1/jobs/j1/cancel" in stand_in.requests and "job j1 is cancelled" in stderr


@pytest.mark.slow
def test_ctrl_c_stops_a_local_run_resumably(tiny: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with _Client("train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--steps", "500", "--batch-size", "2",
                 "--group-size", "4", "--max-new-tokens", "4", "--checkpoint-every", "1", "--quiet", "--out", str(out), tmp_path=tmp_path,
                 key=None) as client:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "checkpoints" / "step_000001").is_dir():
            assert client.running() and time.monotonic() < deadline, client.rest()[-3000:]
            time.sleep(0.05)
        client.interrupt()
        stderr = client.finish()
    assert client.returncode == 130, stderr[-3000:]
    assert f"the run folder {out} stays resumable" in stderr and f"go on with: tinkergym train --resume {out}" in stderr
    last = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    result = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", str(last + 2), "--quiet"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (out / "final").is_dir()


def test_eval_shows_its_progress_unless_quiet(tiny: str) -> None:
    args = ["eval", "--env", "tinker/Bandit-v0", "--model", tiny, "--episodes", "3", "--max-new-tokens", "4", "--batch-size", "1", "--json"]
    shown = CliRunner().invoke(main, args, catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert "eval" in shown.stderr and "3/3" in shown.stderr and "reward=" in shown.stderr
    # The bar's mean runs over every batch so far: at the end it is the summary's mean (a batch of one episode each).
    last_shown = re.findall(r"reward=([^\]]+)\]", shown.stderr)[-1]
    assert last_shown == f"{json.loads(shown.stdout.strip().splitlines()[-1])['reward_mean']:.3g}"
    quiet = CliRunner().invoke(main, [*args, "--quiet"], catch_exceptions=False)
    assert quiet.exit_code == 0, quiet.output
    assert "3/3" not in quiet.stderr and "reward=" not in quiet.stderr
    assert json.loads(quiet.stdout.strip().splitlines()[-1]) == json.loads(shown.stdout.strip().splitlines()[-1])
