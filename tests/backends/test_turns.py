"""Sampling goes first on a backend that samples and trains on one device (:mod:`tinkergym.backends.torch.turns`).

With ``async_steps`` the next steps' rollouts sample from snapshots while the trainer trains; what overlaps the env's
time depends on whose call runs first. The lock is tested alone (order, hand-over between parts of a long call,
reentrancy), then on the real tiny :class:`~tinkergym.backends.torch.backend.TorchBackend`: a snapshot's sample call
that arrives mid-``forward_backward`` runs between two micro-batches and changes neither the gradients nor its own
samples, and a rollout handed over by the pipeline samples its first turn before the step it was handed over in trains.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig  # noqa: E402
from tinkergym.backends.torch.turns import TurnLock  # noqa: E402
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, SampleRequest, SamplingParams  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402
from tinkergym.trainers.async_rollouts import RolloutCancelled, RolloutPipeline  # noqa: E402


def _wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_a_waiting_sample_call_goes_before_a_training_call_that_waited_longer() -> None:
    lock, order = TurnLock(), []
    running, release = threading.Event(), threading.Event()
    trainer_at_gate = threading.Event()

    def sample(name: str, hold_until: threading.Event | None = None) -> None:
        def run() -> None:
            order.append(name)
            running.set()
            if hold_until is not None:
                hold_until.wait(10)
        lock.call(run, sampling=True)

    def train() -> None:
        trainer_at_gate.set()
        lock.call(lambda: order.append("train"))

    first = threading.Thread(target=sample, args=("sample 1", release))
    first.start()
    assert running.wait(10)
    trainer = threading.Thread(target=train)
    trainer.start()
    assert trainer_at_gate.wait(10)
    time.sleep(0.05)  # the training call waits, before the second sample call arrives
    second = threading.Thread(target=sample, args=("sample 2",))
    second.start()
    _wait_for(lambda: lock.waiting_samplers == 2, "the second sample call")
    release.set()
    for thread in (first, trainer, second):
        thread.join(10)
    assert order == ["sample 1", "sample 2", "train"]


def test_a_long_call_lets_waiting_samplers_in_between_its_parts_only() -> None:
    lock, events = TurnLock(), []
    assert lock.let_samplers_in() is False, "a thread that does not hold the lock has nothing to hand over"

    def long_call() -> None:
        assert lock.let_samplers_in() is False, "no sampler waits"
        thread.start()
        _wait_for(lambda: lock.waiting_samplers == 1, "the sampler")
        events.append("part 1")
        assert lock.call(lock.let_samplers_in) is False, "reentrant: a call inside a call does not hand the lock over"
        events.append("part 1 done")
        assert lock.let_samplers_in() is True
        events.append("part 2")

    thread = threading.Thread(target=lambda: lock.call(lambda: events.append("sample"), sampling=True))
    lock.call(long_call)
    thread.join(10)
    assert events == ["part 1", "part 1 done", "sample", "part 2"]


def _backend(tiny: str, micro_batch_size: int) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, lora_alpha=8.0, dtype="float32", seed=0, micro_batch_size=micro_batch_size))


TRAIN = ForwardBackwardRequest(
    [Datum([5, 6, 7, 8, 9, 10], [0.0, 0.0, 1.0, 1.0, 1.0, 1.0], [a] * 6, [-2.0] * 6) for a in (1.0, -0.5, 0.25)]
    + [Datum([11, 12, 13, 14], [0.0, 1.0, 1.0, 1.0], [-1.0] * 4, [-2.5] * 4)],
    LossSpec("importance_sampling"),
)
SAMPLE = SampleRequest([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=5, temperature=1.0, seed=3), num_samples=2)


def _grads(backend: TorchBackend) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for _, p in backend._trainable if p.grad is not None]


def test_a_snapshot_sampled_mid_forward_backward_runs_between_micro_batches_and_changes_nothing(tiny: str) -> None:
    alone = _backend(tiny, micro_batch_size=1)
    expected_metrics = alone.forward_backward(TRAIN).metrics
    expected_grads = _grads(alone)
    expected_samples = alone.sampling_snapshot().sample(SAMPLE)

    backend = _backend(tiny, micro_batch_size=1)
    snapshot = backend.sampling_snapshot()
    order: list[str] = []
    drawn: list[Any] = []

    def sampler() -> None:
        drawn.append(snapshot.sample(SAMPLE))
        order.append("sampled")

    thread = threading.Thread(target=sampler)
    forwards = {"n": 0}

    def on_forward(module: Any, args: Any, output: Any) -> None:  # the first micro-batch's forward: a rollout's env answers
        if threading.current_thread() is not threading.main_thread():
            return  # the sampler's own forwards
        forwards["n"] += 1
        order.append(f"forward {forwards['n']}")
        if forwards["n"] == 1:
            thread.start()
            _wait_for(lambda: backend._lock.waiting_samplers == 1, "the sample call to wait")

    hook = backend.model.register_forward_hook(on_forward)
    try:
        metrics = backend.forward_backward(TRAIN).metrics
    finally:
        hook.remove()
    thread.join(60)
    assert 1 <= order.index("sampled") < len(order) - 1, f"the sample call ran between micro-batches: {order}"
    assert forwards["n"] >= 2 and backend.model.training
    for name, value in expected_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    for got, want in zip(_grads(backend), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert [[s.tokens for s in row] for row in drawn[0].sequences] == [[s.tokens for s in row] for row in expected_samples.sequences]


def test_a_rollout_handed_over_samples_its_first_turn_before_the_step_trains(tiny: str) -> None:
    # One micro-batch: forward_backward has no point between micro-batches to let a sampler in, so only the
    # pipeline's head start puts the rollout's sample call first.
    backend = _backend(tiny, micro_batch_size=8)
    order: list[str] = []

    def plan(step: int, samplers: dict[str, Any]) -> Any:
        def play() -> int:
            time.sleep(0.2)  # an env's reset
            samplers["policy"].sample(SAMPLE)
            order.append(f"step {step} sampled")
            return step
        return play

    pipeline = RolloutPipeline({"policy": backend}, ahead=1, plan=plan)
    try:
        for step in range(3):
            rollout, _ = pipeline.take(step, last_step=2)
            assert rollout.output == step
            backend.forward_backward(TRAIN)
            order.append(f"step {step} trained")
    finally:
        pipeline.close()
    assert order == ["step 0 sampled", "step 1 sampled", "step 0 trained", "step 2 sampled", "step 1 trained", "step 2 trained"]


class ThreadNoting(TorchBackend):
    """The real TorchBackend, noting which thread ran each snapshot's sample call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampled_on: list[int] = []

    def _sample_snapshot(self, snapshot: Any, request: SampleRequest) -> Any:
        self.sampled_on.append(threading.get_ident())
        return super()._sample_snapshot(snapshot, request)


def test_the_rollout_threads_sample_calls_run_on_the_trainers_thread_and_their_errors_reach_the_rollout(tiny: str) -> None:
    # A CPU decode is fastest from one thread (see TrainerThreadCalls): the rollouts' calls run on the thread that trains.
    backend = ThreadNoting(TorchBackendConfig(model=tiny, lora_rank=4, lora_alpha=8.0, dtype="float32", seed=0))
    expected = backend.sampling_snapshot().sample(SAMPLE)
    backend.sampled_on.clear()
    rollout_threads: set[int] = set()

    def plan(step: int, samplers: dict[str, Any]) -> Any:
        def play() -> Any:
            rollout_threads.add(threading.get_ident())
            if step == 1:
                return samplers["policy"].sample(SampleRequest([[5, 6, 7]], SamplingParams(temperature=-1.0)))  # refused
            return [samplers["policy"].sample(SAMPLE) for _ in range(2)]
        return play

    pipeline = RolloutPipeline({"policy": backend}, ahead=1, plan=plan)
    try:
        rollout, _ = pipeline.take(0, last_step=1)
        assert [[s.tokens for s in row] for row in rollout.output[1].sequences] == [[s.tokens for s in row] for row in expected.sequences]
        with pytest.raises(ConfigError, match="temperature"):
            pipeline.take(1, last_step=1)
    finally:
        pipeline.close()
    assert backend.sampled_on and set(backend.sampled_on) == {threading.get_ident()}
    assert threading.get_ident() not in rollout_threads


def test_a_call_waiting_for_the_trainers_thread_ends_when_the_pipeline_stops(tiny: str) -> None:
    backend = _backend(tiny, micro_batch_size=8)
    outcome: list[BaseException] = []
    gate = threading.Event()

    def plan(step: int, samplers: dict[str, Any]) -> Any:
        def play() -> None:
            samplers["policy"].sample(SAMPLE)  # step 1's runs in take()'s head start
            if step == 1:
                gate.wait(30)
                try:
                    samplers["policy"].sample(SAMPLE)  # waits in the queue: the trainer is not in take() again
                except BaseException as exc:
                    outcome.append(exc)
                    raise
        return play

    pipeline = RolloutPipeline({"policy": backend}, ahead=1, plan=plan)
    pipeline.take(0, last_step=5)
    gate.set()
    time.sleep(0.3)
    assert not outcome, "the call ran without the trainer's thread"
    started = time.monotonic()
    pipeline.close()
    _wait_for(lambda: bool(outcome), "the waiting call to end")
    assert isinstance(outcome[0], RolloutCancelled) and time.monotonic() - started < 5
