"""Slow and surplus clients against real servers on 127.0.0.1: trickled headers and bodies are cut off, a normal client
is served meanwhile, connections past the limit are answered 503; and every server command launches uvicorn with
those bounds (``tinkergym.serve.slow_clients``), and ``tinkergym scheduler serve`` passes its gateway and stream bounds
to the app."""

from __future__ import annotations

import http.client
import re
import secrets
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest
import testkit
import uvicorn

from click.testing import CliRunner

from testkit import log_text, wait_until_answers  # registered by tests/conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.serve.slow_clients import ConnectionLimits, RequestDeadlines, uvicorn_options
from tinkergym.cli import main

#: A failure bound only: every trickling connection must be closed long before this.
GIVE_UP_S = 20.0


async def length_app(scope: dict, receive: Any, send: Any) -> None:
    """A minimal ASGI app: reads the whole body, answers its length."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            done = "lifespan.startup.complete" if message["type"] == "lifespan.startup" else "lifespan.shutdown.complete"
            await send({"type": done})
            if done == "lifespan.shutdown.complete":
                return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=["httptools", "h11"])
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "httptools":
        pytest.importorskip("httptools")
    return request.param


@pytest.fixture
def serve(impl: str) -> Iterator[Callable[..., ThreadServer]]:
    started: list[ThreadServer] = []

    def start(app: Any = length_app, **limits: Any) -> ThreadServer:
        live = ThreadServer(app, **uvicorn_options(ConnectionLimits(**limits), impl))
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


class Trickle:
    """Raw connections, one per prefix, that send their prefix, then one byte every ``interval`` seconds; records what
    the server answers on each and which it has closed."""

    def __init__(self, port: int, prefixes: list[bytes], interval: float = 0.5) -> None:
        self.interval = interval
        self.sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in prefixes]
        for s, prefix in zip(self.sockets, prefixes):
            s.sendall(prefix)
            s.setblocking(False)
        self.answers: dict[socket.socket, bytes] = {s: b"" for s in self.sockets}
        self.closed: set[socket.socket] = set()

    def open(self) -> list[socket.socket]:
        return [s for s in self.sockets if s not in self.closed]

    def run(self, until: float = GIVE_UP_S, meanwhile: Callable[[], None] | None = None) -> None:
        """Trickle until the server closed every connection (or ``until`` seconds passed), calling ``meanwhile`` often."""
        deadline, next_byte = time.monotonic() + until, 0.0
        while self.open() and time.monotonic() < deadline:
            if time.monotonic() >= next_byte:
                for s in self.open():
                    try:
                        s.send(b"a")
                    except OSError:
                        self.closed.add(s)
                next_byte = time.monotonic() + self.interval
            if meanwhile is not None:
                meanwhile()
            readable, _, _ = select.select(self.open(), [], [], 0.05)
            for s in readable:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if data:
                    self.answers[s] += data
                else:
                    self.closed.add(s)

    def close(self) -> None:
        for s in self.sockets:
            s.close()


class NormalClient:
    """A well-behaved client making requests on one kept-alive connection; records every status."""

    def __init__(self, port: int, path: str = "/", body: bytes | None = b"hello") -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.path, self.body = path, body
        self.statuses: list[int] = []

    def __call__(self) -> None:
        self.connection.request("POST" if self.body is not None else "GET", self.path, body=self.body)
        response = self.connection.getresponse()
        response.read()
        self.statuses.append(response.status)


def still_open(s: socket.socket) -> bool:
    """True when the server has neither answered nor closed ``s`` (nothing to read on it yet)."""
    readable, _, _ = select.select([s], [], [], 0)
    return not readable


@pytest.mark.slow
def test_trickled_headers_are_cut_off_while_a_normal_client_is_served(serve) -> None:
    live = serve(header_timeout_s=2.0)
    slow = Trickle(live.port, [b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: "] * 50)
    normal = NormalClient(live.port)
    try:
        slow.run(meanwhile=normal)
        assert len(slow.closed) == 50, f"{50 - len(slow.closed)} trickling connections still open"
        assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in slow.answers.values())
        assert normal.statuses and set(normal.statuses) == {200}
    finally:
        slow.close()


def test_a_connection_that_sends_nothing_is_closed(serve) -> None:
    live = serve(header_timeout_s=1.0)
    silent = Trickle(live.port, [b""] * 5, interval=GIVE_UP_S * 2)  # connects, never sends a byte
    try:
        silent.run()
        assert len(silent.closed) == 5
    finally:
        silent.close()


@pytest.mark.slow
def test_a_trickled_body_is_cut_off_and_a_fast_large_one_is_not(serve) -> None:
    live = serve(header_timeout_s=2.0, body_timeout_s=2.0)
    slow = Trickle(live.port, [b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"] * 20)
    normal = NormalClient(live.port, body=b"x" * (4 << 20))  # 4 MiB at loopback speed: well within the bound
    try:
        slow.run(meanwhile=normal)
        assert len(slow.closed) == 20
        assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in slow.answers.values())
        assert normal.statuses and set(normal.statuses) == {200}
    finally:
        slow.close()


def test_the_next_request_on_a_kept_alive_connection_has_the_same_bound(serve) -> None:
    live = serve(header_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", live.port), timeout=GIVE_UP_S)
    try:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET / HT")  # the next request, never finished
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 ")  # ... and then the server closed it (recv returned b"")
    finally:
        s.close()


def test_connections_past_the_limit_are_answered_503_and_a_freed_slot_serves_again(serve) -> None:
    live = serve(header_timeout_s=GIVE_UP_S * 2, max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", live.port), timeout=5) for _ in range(4)]
    try:
        deadline = time.monotonic() + GIVE_UP_S
        while len(live.server.server_state.connections) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = NormalClient(live.port)
        refused()
        assert refused.statuses == [503]
        assert all(still_open(s) for s in idle)  # the ones within the limit are kept
        idle.pop().close()
        deadline, statuses = time.monotonic() + GIVE_UP_S, []
        while 200 not in statuses:
            assert time.monotonic() < deadline, statuses
            client = NormalClient(live.port)
            client()
            statuses += client.statuses
    finally:
        for s in idle:
            s.close()


def test_oversized_headers_are_refused(serve, impl: str) -> None:
    live = serve(max_header_bytes=16384)
    ok = NormalClient(live.port)
    ok.connection.putrequest("GET", "/")
    ok.connection.putheader("X-Big", "a" * 8000)
    ok.connection.endheaders()
    assert ok.connection.getresponse().status == 200
    s = socket.create_connection(("127.0.0.1", live.port), timeout=GIVE_UP_S)
    try:
        try:  # more than one read of the server's: h11 bounds what it holds of an incomplete request, not a whole one
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except OSError:
            pass  # the server answered and stopped reading before the rest
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 431 ")
    finally:
        s.close()


@pytest.mark.slow
def test_the_scheduler_app_cuts_off_keyless_trickling_clients(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("sqlalchemy")
    from tinkergym.scheduler.app import SchedulerSettings, create_app

    app = create_app(SchedulerSettings(db_url=f"sqlite:///{tmp_path / 'scheduler.db'}", data_dir=tmp_path / "data"), background=False)
    live = ThreadServer(app, **uvicorn_options(ConnectionLimits(header_timeout_s=2.0, body_timeout_s=2.0)))
    slow = Trickle(live.port, [b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tgk_"] * 20
                   + [b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"] * 10)
    normal = NormalClient(live.port, "/healthz", body=None)
    try:
        slow.run(meanwhile=normal)
        assert len(slow.closed) == 30
        answers = [slow.answers[s] for s in slow.sockets]
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers[:20])  # no key was ever checked: the headers never ended
        assert all(a.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 401 ")) for a in answers[20:])  # 401 at once, the body still cut off
        assert normal.statuses and set(normal.statuses) == {200}
    finally:
        slow.close()
        live.stop()


# ----- the launch code of each server --------------------------------------------------------------------------
class Built(Exception):
    """Raised by the fake ``uvicorn.Server`` with the config a command built (nothing listens)."""


@pytest.fixture
def built_config(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_server(config: Any) -> None:
        raise Built(config)

    monkeypatch.setattr(uvicorn, "Server", fake_server)


def private_file(path: Path) -> Path:
    path.write_text(secrets.token_urlsafe(32))
    path.chmod(0o600)
    return path


async def stub_app(scope: dict, receive: Any, send: Any) -> None:  # never called
    raise AssertionError("not served")


def scheduler_args(tmp_path: Path) -> list[str]:
    pytest.importorskip("fastapi")
    return ["scheduler", "serve", "--data-dir", str(tmp_path / "scheduler")]


def backend_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    pytest.importorskip("fastapi")
    from tinkergym.serve.training import app as server
    from tinkergym.backends.torch import backend as torch_backend

    monkeypatch.setattr(torch_backend, "TorchBackend", lambda config: object())
    monkeypatch.setattr(server, "create_app", lambda backend, **options: stub_app)
    return ["serve", "backend", "--model", "tiny", "--token-file", str(private_file(tmp_path / "token")), "--run-dir", str(tmp_path / "run")]


def shared_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    pytest.importorskip("fastapi")
    from tinkergym.backends.torch import shared as shared_engine
    from tinkergym.serve.training import shared as shared_server

    monkeypatch.setattr(shared_engine, "SharedBase", lambda config: object())
    monkeypatch.setattr(shared_server, "create_shared_app", lambda base, **options: stub_app)
    return ["serve", "shared", "--model", "tiny", "--token-file", str(private_file(tmp_path / "token")), "--run-dir", str(tmp_path / "run")]


def model_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    pytest.importorskip("fastapi")
    from tinkergym.backends import serving
    from tinkergym.backends.torch import inference as torch_inference
    from tinkergym.serve.inference import app as inference_server

    class Served:
        def models(self) -> list:
            return []

    monkeypatch.setattr(serving, "plan_serving", lambda **options: None)
    monkeypatch.setattr(torch_inference, "TorchInferenceEngine", lambda plan, **options: Served())
    monkeypatch.setattr(inference_server, "create_inference_app", lambda served, digest, **options: stub_app)
    return ["serve", "model", "--model", "tiny", "--engine", "torch", "--api-key-file", str(private_file(tmp_path / "key"))]


@pytest.mark.parametrize("command", [scheduler_args, backend_args, shared_args, model_args], ids=["scheduler", "serve backend", "serve shared", "serve model"])
def test_every_server_command_launches_uvicorn_with_the_bounds(command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               built_config: None) -> None:
    args = command(tmp_path, monkeypatch) if command is not scheduler_args else command(tmp_path)
    for flags, expected in (
        ([], ConnectionLimits()),
        (["--header-timeout", "3", "--body-timeout", "7", "--max-connections", "9"] + (["--max-streams", "5"] if command is scheduler_args else []),
         ConnectionLimits(header_timeout_s=3, body_timeout_s=7, max_connections=9)),
    ):
        result = CliRunner().invoke(main, args + flags)
        assert isinstance(result.exception, Built), result.output
        config = result.exception.args[0]
        assert issubclass(config.http, RequestDeadlines) and config.http.limits == expected
        assert config.limit_concurrency == expected.max_connections + 1
    helped = CliRunner().invoke(main, [*args[:2], "--help"])  # every server command is two words: scheduler serve, serve backend, ...
    assert all(flag in helped.output for flag in ("--header-timeout", "--body-timeout", "--max-connections"))
    refused = CliRunner().invoke(main, args + ["--header-timeout", "0"])
    assert refused.exit_code == 2 and "--header-timeout" in refused.output


@pytest.mark.parametrize("flags, settings, state, refused", [
    pytest.param(["--gateway-max-per-tenant", "3", "--gateway-read-timeout", "45"], {"gateway_max_per_tenant": 3, "gateway_read_timeout_s": 45.0},
                 {"gateway": {"max_per_tenant": 3, "read_timeout_s": 45.0}}, ["--gateway-max-per-tenant", "0"], id="gateway-bounds"),
    pytest.param(["--max-streams-per-key", "3", "--max-streams", "40"], {"max_streams_per_key": 3, "max_streams": 40},
                 {"streams": {"max_streams_per_key": 3, "max_streams": 40}}, ["--max-streams", "50", "--max-connections", "50"], id="stream-caps"),
])
def test_scheduler_serve_passes_its_options_to_the_app(flags: list[str], settings: dict[str, Any], state: dict[str, dict[str, Any]],
                                                       refused: list[str], tmp_path: Path, built_config: None) -> None:
    """Each option reaches the app's settings and the part of the app that applies it; left out, the settings' default."""
    args = scheduler_args(tmp_path)
    from tinkergym.scheduler.app import SchedulerSettings

    built = CliRunner().invoke(main, args + flags)
    assert isinstance(built.exception, Built), built.output
    app = built.exception.args[0].app
    assert {name: getattr(app.state.settings, name) for name in settings} == settings
    assert {part: {name: getattr(getattr(app.state, part), name) for name in names} for part, names in state.items()} == state
    default = CliRunner().invoke(main, args).exception.args[0].app.state.settings
    assert {name: getattr(default, name) for name in settings} == {name: getattr(SchedulerSettings, name) for name in settings}
    result = CliRunner().invoke(main, args + refused)
    assert result.exit_code == 2 and refused[0] in result.output
    helped = set(re.findall(r"--[\w-]+", CliRunner().invoke(main, ["scheduler", "serve", "--help"]).output))
    assert set(flags[::2]) <= helped


@pytest.mark.slow
def test_tinkergym_scheduler_serve_cuts_off_trickling_clients_and_extra_connections(tmp_path: Path) -> None:
    """The real command, in its own process: nothing here stands in for its launch code."""
    pytest.importorskip("fastapi")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "tinkergym", "scheduler", "serve", "--data-dir", str(tmp_path / "data"), "--port", str(port),
         "--header-timeout", "1", "--max-connections", "3", "--max-streams", "2"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/healthz", timeout=60, every=0.1, process=process, output=log_text(tmp_path / "serve.log"))
        slow = Trickle(port, [b"GET /healthz HTTP/1.1\r\nHost: x\r\n"] * 2)
        slow.run()
        assert len(slow.closed) == 2 and all(a.startswith(b"HTTP/1.1 408 ") for a in slow.answers.values())
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]  # accepted before the next one
        refused = NormalClient(port, "/healthz", body=None)
        refused()
        assert refused.statuses == [503]
        for s in idle:
            s.close()
    finally:
        testkit.stop(process)
        log.close()
