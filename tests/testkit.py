"""Helpers shared by test modules in several folders: waiting for a condition or a server, training data, folder skips.

``tests/conftest.py`` loads this file by path and registers it as the module ``testkit`` (with
``--import-mode=importlib`` no test folder is on ``sys.path``), before any test module, which ``import testkit``.
It imports nothing beyond pytest and the protocol's types, so any test folder can use it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest

from tinkergym.protocol.types import Datum, ForwardBackwardRequest, OptimParams, SampleRequest, SampleResponse


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60.0, every: float = 0.1,
               process: subprocess.Popen | None = None, output: Callable[[], str] | None = None) -> Any:
    """Call ``check`` every ``every`` seconds until it returns something true, and return that.

    Fails (AssertionError, naming ``what``) once ``timeout`` seconds have passed, or at once when ``process``
    has exited; ``output()`` (the process's log, say) ends the message where given."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if process is not None and process.poll() is not None:
            problem = f"the process exited with {process.returncode} while waiting for {what}"
        elif time.monotonic() >= deadline:
            problem = f"timed out after {timeout} s waiting for {what}"
        else:
            time.sleep(every)
            continue
        raise AssertionError(problem + (f"\n{output()}" if output is not None else ""))


def stop(process: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM ``process`` and wait ``timeout`` seconds for it (then kill it); its return code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    return process.returncode


def answers(url: str) -> bool:
    """True when a GET of ``url`` answers with a success status; False when the connection fails or it answers an error."""
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:  # refused, reset, timed out, or an HTTP error status (HTTPError is an OSError)
        return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server started as a process)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_answers(url: str, timeout: float = 60.0, every: float = 0.2, process: subprocess.Popen | None = None,
                       output: Callable[[], str] | None = None) -> None:
    """Wait until a GET of ``url`` (a server's health route) answers with a success status (:func:`wait_until`)."""
    wait_until(f"{url} to answer", lambda: answers(url), timeout, every, process, output)


def exited_output(process: subprocess.Popen) -> Callable[[], str]:
    """``output`` for :func:`wait_until` of a process whose stdout is a pipe: its output once it has exited (a read
    of a running process's pipe would block), else a note that it is still running."""
    return lambda: process.stdout.read() if process.poll() is not None else "(still running, no answer)"


def log_text(path: Path) -> Callable[[], str]:
    """``output`` for :func:`wait_until`: the last 3000 characters of the log file ``path``."""
    return lambda: path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path})"


def datum(prompt: list[int], completion: list[int], advantage: float, shift: float) -> Datum:
    """A training row: ``prompt + completion``, loss on the completion, one advantage, sampling logprobs that
    alternate around -2 by ``shift``."""
    tokens = prompt + completion
    return Datum(
        tokens=tokens,
        loss_mask=[0.0] * len(prompt) + [1.0] * len(completion),
        advantages=[advantage] * len(tokens),
        sampling_logprobs=[-2.0 + shift * ((-1) ** t) for t in range(len(tokens))],
    )


class _SkippedModule(pytest.Module):
    """A test module of a folder whose requirement is missing: collecting it reports a skip, without importing it."""

    reason = ""

    def _getobj(self) -> Any:
        pytest.skip(self.reason, allow_module_level=True)


def import_problem(*modules: str) -> str:
    """Why one of ``modules`` cannot be imported (the reason ``pytest.importorskip`` gives), or "" when all import."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return f"could not import {name!r}: {exc}"
    return ""


def folder_requires(*modules: str) -> Callable[..., pytest.Module | None]:
    """A ``pytest_pycollect_makemodule`` hook for a folder's conftest.py: where one of ``modules`` cannot be
    imported, every test module of the folder is reported skipped, with the reason, instead of being imported; so
    the modules import them at the top, with no ``pytest.importorskip`` of their own.

    A ``pytest.importorskip`` at the top of the conftest itself would skip the folder when pytest collects it from
    ``tests``, but stop pytest with a traceback when the folder or one of its files is named on the command line
    (pytest imports that conftest before collecting, outside any collector).

    The modules are imported when the folder's first test module is collected, not when the conftest loads: under
    pytest-xdist the controlling process, which collects nothing, then never imports torch (5-10 s before it starts
    the test processes, and more on a fresh environment, where that import compiles every module's bytecode)."""
    reasons: list[str] = []

    def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
        if not reasons:
            reasons.append(import_problem(*modules))
        if not reasons[0]:
            return None
        module = _SkippedModule.from_parent(parent, path=module_path)
        module.reason = f"{parent.path.name}/{module_path.name}: {reasons[0]}"
        return module

    return pytest_pycollect_makemodule


def mark_folder(items: list[pytest.Item], folder: Path, marker: pytest.MarkDecorator) -> None:
    """Add ``marker`` to each of ``items`` under ``folder`` (for a folder conftest's ``pytest_collection_modifyitems``,
    which pytest calls with every collected item, not only the folder's)."""
    for item in items:
        if item.path.is_relative_to(folder):
            item.add_marker(marker)


@contextlib.contextmanager
def serving(app: Any, log_level: str = "warning") -> Iterator[str]:
    """Serve an ASGI ``app`` under uvicorn on 127.0.0.1 (a free port) in a thread; yields its base URL, stops it after."""
    import socket
    import threading

    import uvicorn

    # proto IPPROTO_TCP, as uvicorn's own sockets: asyncio turns Nagle off only for those (else 40 ms per keep-alive request)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until("the server to start", lambda: server.started, timeout=30, every=0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def check_training_metrics(text: str, server: str, adapters: int | None = None, route: str = "/v1/call", calls: int = 2) -> None:
    """A training server's Prometheus metrics after runs trained through it: parsed by prometheus_client's own parser,
    every family moved (calls, their time, tokens sampled and trained, requests by route template)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted({"server": server, **labels}.items()))), 0.0)

    for method in ("sample", "forward_backward", "optim_step"):
        assert value("tinkergym_calls_total", method=method, ok="true") >= calls, method
        assert value("tinkergym_call_duration_seconds_sum", method=method) > 0, method
    assert value("tinkergym_tokens_total", kind="sampled") > 0 and value("tinkergym_tokens_total", kind="trained") > 0
    assert value("tinkergym_http_requests_total", route=route, method="POST", code="200") >= calls
    if adapters is not None:
        assert samples[("tinkergym_shared_adapters", ())] == adapters
    assert not any("session" in dict(labels) or "adapter" in dict(labels) for _, labels in samples)  # no ids as labels


#: Distributions whose ids are generated from another library (one per dataset or game): their own packages run the
#: conformance checks on every id (env_packages/*/tests); the hub-wide loops here take our own envs.
GENERATED_FAMILIES = frozenset({"tinkergym-reasoning-gym", "tinkergym-textarena"})


def own_envs() -> list[Any]:
    """The installed env specs the hub-wide tests loop over: every one but the generated families' (see above)."""
    import tinkergym

    return [s for s in tinkergym.list_envs() if s.distribution not in GENERATED_FAMILIES]


def group_by_module_fixtures(items: list[pytest.Item]) -> None:
    """Put each test that uses a module-scoped fixture into the ``xdist_group`` named after its module, unless it names
    a group itself: under ``--dist loadgroup`` the fixture is then built once, not once per test process."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group") is not None:
            continue
        if any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# ----- async steps: a backend watched while it samples ahead --------------------------------------------------------
GRADED_ENV = "fake/Graded-v0"
GRADED = '''
from tinkergym import TextEnv

class GradedEnv(TextEnv):
    """One turn: the prompt carries a number drawn from the reset's seed; the reward is the share of vowels in the reply."""

    metadata = {**TextEnv.metadata, "tinkergym": {"data": "free", "turns": "single", "agents": 1}}

    def _reset(self, options):
        return f"task {int(self.np_random.integers(1_000_000))}: say something", {}

    def _step(self, action):
        return "done", sum(c in "aeiou" for c in action.lower()) / max(len(action), 1), True, False, {}
'''


def add_graded_env(fake_site: Any) -> str:
    """Install and register ``fake/Graded-v0`` (random replies of the tiny model get rewards that differ within a group,
    so every step trains) on the ``fake_site`` fixture; returns its id."""
    import tinkergym

    fake_site.add("fakeenv-graded", {GRADED_ENV: "fakeenv_graded:GradedEnv"}, module_code=GRADED)
    tinkergym.register_installed_envs(refresh=True)
    return GRADED_ENV


class WatchedSnapshot:
    """A snapshot whose samples are recorded in its backend's ``sampled`` (prompt + completion -> version) and ``intervals``."""

    def __init__(self, snapshot: Any, owner: Watched) -> None:
        self.snapshot, self.owner, self.version = snapshot, owner, snapshot.version

    def sample(self, request: SampleRequest) -> SampleResponse:
        started = time.perf_counter()
        response = self.snapshot.sample(request)
        with self.owner.watch_lock:
            self.owner.intervals.append(("sample", started, time.perf_counter()))
            for prompt, sequences in zip(request.prompts, response.sequences):
                for sequence in sequences:
                    self.owner.sampled[tuple(prompt + sequence.tokens)] = (self.version, list(sequence.logprobs))
        return response


class Watched:
    """Mixed into a real backend that takes snapshots (``class WatchedTorch(Watched, TorchBackend)``): records of what was
    sampled and trained at which version, training slowed by ``delay`` (outside the backend, as a slow environment or tool
    would hold the trainer), so the sampling thread runs ahead. ``lag`` > 0 plays a sampler fleet that loads new weights
    late: a snapshot asked for is the one taken ``lag`` calls before."""

    def __init__(self, *args: Any, delay: float = 0.0, lag: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delay, self.lag = delay, lag
        self.watch_lock = threading.Lock()
        self.sampled: dict[tuple[int, ...], tuple[int, list[float]]] = {}
        self.trained: list[tuple[int, ForwardBackwardRequest]] = []  # (the version it trained, the request)
        self.intervals: list[tuple[str, float, float]] = []
        self.snapshots: list[Any] = []

    def sampling_snapshot(self) -> WatchedSnapshot:
        self.snapshots.append(super().sampling_snapshot())  # type: ignore[misc]
        return WatchedSnapshot(self.snapshots[max(0, len(self.snapshots) - 1 - self.lag)], self)

    def forward_backward(self, request: ForwardBackwardRequest) -> Any:
        from tinkergym.trainers.async_rollouts import policy_version

        started = time.perf_counter()
        time.sleep(self.delay)
        self.trained.append((policy_version(self), request))
        result = super().forward_backward(request)  # type: ignore[misc]
        self.intervals.append(("train", started, time.perf_counter()))
        return result

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        started = time.perf_counter()
        out = super().optim_step(params)  # type: ignore[misc]
        self.intervals.append(("train", started, time.perf_counter()))
        return out

    def sampled_version(self, tokens: list[int]) -> tuple[int, list[float]]:
        """The version and logprobs of the recorded sample that ``tokens`` (a trained sequence) is."""
        return self.sampled[tuple(tokens)]


def metrics(out: Path) -> list[dict[str, Any]]:
    """A run folder's ``metrics.jsonl`` records."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def prompts(out: Path, step: int) -> list[str]:
    """The user prompts of a run's training step ``step`` (its transcripts)."""
    rows = [json.loads(line) for line in (out / "transcripts" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]
    return [next(m["content"] for m in row["messages"] if m["role"] == "user") for row in rows]


def sampled_ahead(intervals: list[tuple[str, float, float]], steps: int) -> bool:
    """Whether more than one step's sample calls ran before the first training call: the rollouts of later steps sampled
    before step 0 trained (a synchronous run makes exactly one step's). Overlap in time is not asked for: sample calls
    go first (a rollout handed over samples its first turn before the step trains), so a quick one ends before it."""
    samples = [a for kind, a, _ in intervals if kind == "sample"]
    first_train = min(a for kind, a, _ in intervals if kind == "train")
    return sum(1 for a in samples if a < first_train) > len(samples) / steps


def check_bounded_staleness(watched: Watched, out: Path, k: int, steps: int) -> None:
    """A run of ``steps`` steps with ``async_steps`` ``k`` through ``watched``: later steps sampled before step 0 trained, one snapshot per
    handover, every trained sequence one a snapshot sampled at most ``k`` versions before (exactly ``k`` once the pipeline
    is full), trained with a correction and the snapshot's own logprobs, and the logged gaps and times agree."""
    from tinkergym.trainers.async_rollouts import corrects_staleness

    assert sampled_ahead(watched.intervals, steps), "only step 0's rollout sampled before step 0 trained: nothing was sampled ahead"
    assert len(watched.snapshots) == steps - k, "one snapshot at the start for steps 0..K, then one per step handed over"
    gaps = []
    for version, request in watched.trained:
        assert corrects_staleness(request.loss), request.loss
        for datum in request.data:
            sampled_at, logprobs = watched.sampled_version(datum.tokens)  # every trained sequence is one a snapshot sampled
            assert 0 <= version - sampled_at <= k
            assert datum.sampling_logprobs[-len(logprobs):] == logprobs, "the ratio's old policy is the snapshot's own logprobs"
            gaps.append(version - sampled_at)
    assert max(gaps) == k, "once the pipeline is full a step trains samples exactly K versions old"
    logged = [m for m in metrics(out) if m["step"] >= 0]
    assert [m["async/version_gap_max"] for m in logged] == [float(min(s, k)) for s in range(steps)]
    assert all(m["async/dropped_groups"] == 0 and m["batch/trained_sequences"] > 0 for m in logged)
    assert all(m["time/rollout_wait_s"] >= 0 and m["time/update_s"] >= watched.delay and m["async/rollout_s"] > 0 for m in logged)
    assert "time/rollout_s" not in logged[0]
