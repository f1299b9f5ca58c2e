"""Rollouts sampled ahead of training (``async_steps`` K > 0): the next K steps sample while the current one trains.

What prime-rl's ``max_async_level``, tinker-cookbook's ``max_steps_off_policy`` and AReaL's bounded staleness do.
A synchronous step samples with the current weights and then trains, so the sampler waits for every update and the
update for every rollout. With K > 0, at the start of step ``j`` the trainer takes a snapshot of each learner's
weights (:meth:`~tinkergym.protocol.backend.SnapshotBackend.sampling_snapshot`, tagged with their version: the
optimizer steps they have taken) and hands step ``j + K``'s rollout, bound to that snapshot, to a pool of background
threads, while the trainer waits for step ``j``'s (handed over K steps before) and trains on it. So step ``s`` samples
with the weights the run had at the start of step ``s - K`` (the first K + 1 steps of a run, or of a resume, with the
weights it starts from), and a sample trains at most K versions after the one that drew it: exactly K once the
pipeline is full and every step updates. Which weights sample which step follows from the step alone.

The pool plays up to ``workers`` of the K steps handed over at once (``max_episodes_in_flight`` in whole steps, see
:func:`rollouts_at_once`): where the env is slow (a tool, an API, a judge), their env steps wait side by side while
their sample calls take turns on the backend, so K steps in flight sample up to K times as many episodes an hour as
one. Each rollout plays envs of its own (:class:`~tinkergym.trainers.base.EnvPool`). With one worker the rollouts play
in step order and an async run repeats exactly; with several, their sample calls interleave in the order their envs
answer, and the same tokens follow as long as the backend's answer to a call depends on the call alone (the torch
backend's prefix cache keeps each snapshot's prompts apart, but a prompt one rollout finds cached and another computes
afresh may differ in the last bits of a logit).

Order: sample calls go first (a sample call unblocks env work that runs beside the device; a training call unblocks
nothing until the step ends). :meth:`RolloutPipeline.take` gives the rollouts that just started a head start (their
first sample call before the step trains), the torch backend runs a waiting sample call before a waiting training call
and between a ``forward_backward``'s micro-batches (:mod:`tinkergym.backends.torch.turns`), and a snapshot of a backend
in this process samples on the trainer's thread (:class:`TrainerThreadCalls`).

Invariants:

- Prompts and sampling seeds are the step's own (``prompt_seeds(step)``), as in a synchronous run.
- A snapshot's weights never change, so no policy acts with weights from the middle of an update.
- Every trajectory carries the version of the snapshot that sampled it (:attr:`StepRollout.versions`). When its step
  trains, a group more than K versions old is dropped and counted (``async/dropped_groups``). The pipeline never
  hands one over by itself, but a backend whose snapshots lag behind the weights they were asked for (a sampler
  fleet that loads new weights late) produces them, and they must not train.
- Stale samples train only with an off-policy correction (:func:`corrects_staleness`): the importance ratio against
  the sampler's logprobs, or the truncated importance weight ``tis_cap``. The config refuses settings without one.
- Rollouts in flight when a run stops or restores a checkpoint are dropped (the thread stops at its next ``sample``);
  a resume samples them again from the checkpoint's weights.
- A rollout whose thread dies of an exception other than tinkergym's own (a crash in an env's code outside its
  episodes, a sampler's transient failure) is played again from the start, once, on the trainer's thread, with the
  same snapshot, prompts and seeds: what it had sampled before it died is thrown away, so the step trains the samples
  it would have trained and none twice (``async/rollout_retries``). A second failure, or a tinkergym error (a lost
  backend, a bad setting), ends the step as in a synchronous run. An env that raises inside an episode does not get
  here: that episode is masked and counted (:mod:`tinkergym.trainers.rollouts`).

The metrics of an async step: ``async/version_gap_mean`` and ``async/version_gap_max`` over the trained samples,
``async/dropped_groups``, ``async/rollout_retries``, ``time/rollout_wait_s`` (the trainer waiting for the step's
rollout, a retry included), ``time/update_s`` (training) and ``async/rollout_s`` (how long the rollout ran in the
background, overlapping earlier steps' training).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tinkergym.errors import ConfigError, TinkergymError
from tinkergym.protocol.types import LossSpec, SampleRequest, SampleResponse

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How many times a step's rollout whose thread died is played again before the step fails (see the module's docstring).
ROLLOUT_RETRIES = 1

#: How long the trainer waits, at most, for the rollouts just started to make their first sample call before it trains
#: (see :meth:`RolloutPipeline.take`): an env's reset and the first prompts take milliseconds; a slow reset is not waited out.
HEAD_START_S = 1.0

#: The name of a single-policy trainer's learner in :attr:`StepRollout.versions`.
POLICY = "policy"
#: Losses with an importance ratio (against the sampler's logprobs with ``old_logprobs="sampler"``), as the torch backend's.
RATIO_LOSSES = ("ppo", "importance_sampling", "cispo", "dro", "gspo")


class RolloutCancelled(TinkergymError, RuntimeError):
    """A rollout sampled ahead was still in flight when the run stopped or restored a checkpoint; it is dropped."""


def corrects_staleness(loss: LossSpec) -> bool:
    """Whether ``loss`` corrects for samples drawn by an older policy than the one it trains.

    The ratio of a ratio loss (:data:`RATIO_LOSSES`) against the sampler's logprobs (``old_logprobs="sampler"``) does;
    so does the truncated importance weight ``min(exp(current - sampler), tis_cap)`` of any policy loss. A ratio against
    the trainer's own logprobs starts at 1 and ``reinforce`` has none: alone they train stale samples as if the current
    policy had drawn them.
    """
    return (loss.name in RATIO_LOSSES and loss.old_logprobs == "sampler") or loss.tis_cap > 0


def check_correction(loss: LossSpec, async_steps: int, trainer: str) -> None:
    """Refuse a run that would train samples up to ``async_steps`` updates old with ``loss`` uncorrected."""
    if async_steps and not corrects_staleness(loss):
        raise ConfigError(
            f"async-steps {async_steps}: the {trainer} trainer's {loss.name!r} loss (old_logprobs {loss.old_logprobs!r}, tis_cap "
            f"{loss.tis_cap:g}) would train samples of a policy up to {async_steps} updates old uncorrected; use --old-logprobs "
            "sampler with a ratio loss, or --old-logprobs trainer --tis-cap C, or --async-steps 0."
        )


def check_snapshots(backends: dict[str, Any], async_steps: int) -> None:
    """Refuse ``async_steps`` > 0 unless every backend in ``backends`` samples from snapshots (``sampling_snapshot``)."""
    if not async_steps:
        return
    for backend in backends.values():
        if not callable(getattr(backend, "sampling_snapshot", None)):
            raise ConfigError(
                f"async-steps {async_steps} samples the next steps while one trains, which needs a backend that samples from a "
                f"fixed snapshot of the weights (a sampling_snapshot() method): the torch backend (--backend torch) or the tinker "
                f"backend (--backend tinker --backend-url URL). {type(backend).__name__} samples and trains one after the other: "
                "leave out --async-steps, or train through one of those."
            )


def rollouts_at_once(async_steps: int, max_episodes_in_flight: int, episodes_per_step: int) -> int:
    """How many steps' rollouts a pipeline ``async_steps`` ahead plays at once: as many as fit in ``max_episodes_in_flight``
    episodes in whole steps, at most ``async_steps``, at least one."""
    return max(1, min(async_steps, max_episodes_in_flight // max(1, episodes_per_step)))


def policy_version(backend: Any) -> int:
    """The version of ``backend``'s current weights: the optimizer steps they have taken (its ``info()["step"]``)."""
    return int(backend.info()["step"])


def fresh_groups(gaps_B: Sequence[int], group_size: int, max_gap: int) -> list[bool]:
    """Per trajectory: whether its group trains, i.e. no member was sampled more than ``max_gap`` versions ago.

    ``gaps_B[i]`` is how many versions the trained policy is ahead of the one that sampled trajectory ``i``; groups
    are ``group_size`` consecutive trajectories (a group's advantages are relative to each other, so it trains whole
    or not at all).
    """
    keep: list[bool] = []
    for start in range(0, len(gaps_B), group_size):
        group = gaps_B[start : start + group_size]
        keep += [max(group) <= max_gap] * len(group)
    return keep


def dropped_groups(keep_B: Sequence[bool], group_size: int) -> int:
    """How many groups of ``group_size`` consecutive trajectories :func:`fresh_groups` dropped."""
    return sum(1 for start in range(0, len(keep_B), group_size) if not keep_B[start])


def staleness_metrics(gaps_B: Sequence[int], keep_B: Sequence[bool], dropped_groups: int) -> dict[str, float]:
    """``async/version_gap_mean`` / ``_max`` over the trained trajectories (``keep_B``) and ``async/dropped_groups``."""
    trained = [g for g, k in zip(gaps_B, keep_B, strict=True) if k]
    return {
        "async/version_gap_mean": sum(trained) / len(trained) if trained else 0.0,
        "async/version_gap_max": float(max(trained, default=0)),
        "async/dropped_groups": float(dropped_groups),
    }


class StoppableSampler:
    """A snapshot's ``sample`` that refuses once ``stopped`` is set, so a rollout in flight ends at its next call.
    :attr:`called` is set at its first call (the rollout's head start, see :meth:`RolloutPipeline.take`). With a
    ``relay`` (a snapshot that samples on the trainer's thread, :class:`TrainerThreadCalls`) the call is handed to it."""

    def __init__(self, snapshot: Any, stopped: threading.Event, relay: TrainerThreadCalls | None = None) -> None:
        self.snapshot, self._stopped, self._relay = snapshot, stopped, relay
        self.version = int(snapshot.version)
        self.called = threading.Event()

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Sample with the snapshot, unless the pipeline it belongs to was closed."""
        if self._stopped.is_set():
            raise RolloutCancelled("the run stopped while this rollout was sampled ahead; it is dropped")
        if self._relay is not None:
            return self._relay.call(self.snapshot.sample, request, self.called)
        self.called.set()
        return self.snapshot.sample(request)


class TrainerThreadCalls:
    """Sample calls of the rollout threads, run on the trainer's thread.

    A backend in this process (:class:`~tinkergym.backends.torch.backend.TorchSnapshot`'s ``samples_on_trainer_thread``)
    runs one call at a time anyway, and its compute is fastest from one thread: every other thread that runs torch ops
    brings a team of OpenMP workers of its own, and once a process has more of them than cores, all of them stop
    spinning between operations (libgomp's throttling), which made a CPU decode 1.7x slower. So a rollout thread's
    sample call waits in a queue, and the trainer's thread runs it while it waits for a rollout (:meth:`serve`) or
    itself plays one (a retry: the call runs at once). A call that waits while the trainer trains runs after the
    training call; a stopped pipeline fails the calls that wait (:class:`RolloutCancelled`).
    """

    def __init__(self, stopped: threading.Event) -> None:
        self._stopped = stopped
        self._queue: queue.SimpleQueue[tuple[Callable[[Any], Any], Any, Future]] = queue.SimpleQueue()
        self._trainer = threading.get_ident()

    def call(self, function: Callable[[Any], T], argument: Any, queued: threading.Event) -> T:
        """``function(argument)`` on the trainer's thread (at once when called from it); its result or exception. ``queued``
        is set once the call waits in the queue (or runs)."""
        if threading.get_ident() == self._trainer:
            queued.set()
            return function(argument)
        done: Future = Future()
        self._queue.put((function, argument, done))
        queued.set()
        while True:
            try:
                return done.result(timeout=0.05)
            except FuturesTimeout:
                if self._stopped.is_set() and done.cancel():
                    raise RolloutCancelled("the run stopped while this rollout was sampled ahead; it is dropped") from None

    def serve(self, timeout: float) -> bool:
        """Run the calls that wait, or wait up to ``timeout`` seconds for one first; whether any ran."""
        ran, wait = False, timeout
        while True:
            try:
                function, argument, done = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                return ran
            wait = 0.0
            if not done.set_running_or_notify_cancel():
                continue  # its rollout stopped waiting
            try:
                done.set_result(function(argument))
            except Exception as exc:  # noqa: BLE001  # handed to the rollout's thread, which raises it
                done.set_exception(exc)
            except BaseException:  # Ctrl-C on the trainer's thread: the run stops, and the rollout with it
                done.set_exception(RolloutCancelled("the run stopped while this rollout was sampled ahead; it is dropped"))
                raise
            ran = True


@dataclass
class StepRollout(Generic[T]):
    """One step's rollout as the background thread played it."""

    step: int
    output: T
    #: The version of the snapshot each learner sampled with (by learner name).
    versions: dict[str, int]
    #: How long it ran on the background thread (sampling and env steps).
    seconds: float
    #: How many times it was played again after its thread died (at most :data:`ROLLOUT_RETRIES`).
    retries: int = 0


@dataclass
class _InFlight:
    """A handed-over step's rollout: its future, what plays it (to play it again), its snapshots' versions and samplers."""

    future: Future
    play: Callable[[], Any]
    versions: dict[str, int]
    samplers: list[StoppableSampler]


class RolloutPipeline(Generic[T]):
    """The rollouts of the next ``ahead`` steps, played on ``workers`` background threads (up to that many at once) from
    snapshots of ``learners``' weights.

    ``plan(step, samplers)`` runs on the trainer's thread when a step is handed over: it fixes everything of the step's
    rollout that depends on the trainer's state (prompts, opponents) and returns the function that plays it with
    ``samplers`` (a snapshot sampler per learner name) on the background thread. :meth:`take` is called once per step
    in order; a step out of order (a checkpoint restored) or :meth:`reset` drops what is in flight.
    """

    def __init__(self, learners: dict[str, Any], ahead: int, plan: Callable[[int, dict[str, Any]], Callable[[], T]], workers: int = 1) -> None:
        if ahead < 1:
            raise ValueError(f"a rollout pipeline samples at least one step ahead, not {ahead}")
        if not 1 <= workers <= ahead:
            raise ValueError(f"a rollout pipeline of {ahead} steps ahead plays 1 to {ahead} of them at once, not {workers}")
        check_snapshots(learners, ahead)
        self.learners, self.ahead, self.plan, self.workers = learners, ahead, plan, workers
        self._executor: ThreadPoolExecutor | None = None
        self._stopped = threading.Event()
        self._relay: TrainerThreadCalls | None = None  # for snapshots that sample on the trainer's thread
        # Each handed-over step's rollout in flight, with what plays it (to play it again) and its samplers.
        self._futures: dict[int, _InFlight] = {}
        self._next = -1  # the step take() expects next
        self._handed = -1  # the first step not yet handed over

    @classmethod
    def for_run(cls, learners: dict[str, Any], config: Any, plan: Callable[[int, dict[str, Any]], Callable[[], T]]) -> RolloutPipeline[T]:
        """The pipeline of a run's ``config`` (a TrainConfig): ``async_steps`` ahead, as many rollouts at once as
        :func:`rollouts_at_once` allows for its ``max_episodes_in_flight`` and batch size x group size episodes a step."""
        workers = rollouts_at_once(config.async_steps, config.max_episodes_in_flight, config.batch_size * config.group_size)
        return cls(learners, config.async_steps, plan, workers=workers)

    def take(self, step: int, last_step: int) -> tuple[StepRollout[T], float]:
        """Hand over the steps up to ``step + ahead`` (at most ``last_step``) not yet handed over, bound to snapshots of
        the current weights, then wait for ``step``'s rollout; returns it and the seconds waited.

        Before it returns, the rollouts that started meanwhile get a head start: the trainer waits until each has made
        its first sample call (up to :data:`HEAD_START_S`), so that on a backend that samples and trains on one device
        (whose sample calls go first, :mod:`tinkergym.backends.torch.turns`) their first turn samples before the step
        trains and their env steps overlap the update, instead of waiting behind it.
        """
        if step != self._next:
            self.reset()
            self._handed = step
        upto = min(step + self.ahead, max(last_step, step))
        if self._handed <= upto:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="rollouts-ahead")
            snapshots = {name: backend.sampling_snapshot() for name, backend in self.learners.items()}
            relayed = {name for name, snapshot in snapshots.items() if getattr(snapshot, "samples_on_trainer_thread", False)}
            if relayed and self._relay is None:
                self._relay = TrainerThreadCalls(self._stopped)
            for ahead_step in range(self._handed, upto + 1):
                samplers = {name: StoppableSampler(snapshot, self._stopped, self._relay if name in relayed else None)
                            for name, snapshot in snapshots.items()}
                versions = {name: sampler.version for name, sampler in samplers.items()}
                play = self.plan(ahead_step, samplers)
                future = self._executor.submit(_played, ahead_step, play, versions)
                self._futures[ahead_step] = _InFlight(future, play, versions, list(samplers.values()))
            self._handed = upto + 1
        started = time.perf_counter()
        rollout = self._result(step)
        waited = time.perf_counter() - started
        self._next = step + 1
        self._head_start()
        return rollout, waited

    def _head_start(self) -> None:
        """Wait until every rollout in flight that runs, or will run as soon as a worker frees, has made its first sample
        call or ended (up to :data:`HEAD_START_S` of waiting), running the calls handed to this thread meanwhile."""
        waited = 0.0
        while True:
            if self._relay is not None and self._relay.serve(0.0):
                continue  # ran what waited: sample calls go before the step trains
            running = [f for f in self._futures.values() if f.future.running()]
            pending = [f for f in self._futures.values() if not (f.future.running() or f.future.done())]
            starting = running + pending[: max(0, self.workers - len(running))]  # a free worker takes the earliest pending one
            if waited >= HEAD_START_S or all(f.future.done() or any(s.called.is_set() for s in f.samplers) for f in starting):
                return
            started = time.perf_counter()
            if self._relay is not None:
                if self._relay.serve(0.002):
                    continue  # the time a call ran is not waiting
            else:
                time.sleep(0.002)
            waited += time.perf_counter() - started

    def _result(self, step: int) -> StepRollout[T]:
        """``step``'s rollout; one whose thread died of an exception other than a tinkergym error is played again, from the
        start and on this thread, up to :data:`ROLLOUT_RETRIES` times."""
        flight = self._futures.pop(step)
        future, play, versions = flight.future, flight.play, flight.versions
        retries = 0
        while True:
            try:
                rollout = self._wait(future) if retries == 0 else _played(step, play, versions)
                rollout.retries = retries
                return rollout
            except TinkergymError:
                raise  # said what went wrong (a lost backend, a cancelled rollout, a bad setting): playing it again cannot help
            except Exception as exc:
                if retries >= ROLLOUT_RETRIES or self._stopped.is_set():
                    raise
                retries += 1
                log.warning("step %d's rollout failed (%s: %s); playing it again from its snapshot, its samples so far dropped",
                            step, type(exc).__name__, exc)

    def _wait(self, future: Future) -> StepRollout[T]:
        """``future``'s rollout, running the sample calls it (and the others in flight) hand to this thread meanwhile."""
        while self._relay is not None and not future.done():
            self._relay.serve(0.005)
        return future.result()

    def reset(self) -> None:
        """Drop every rollout handed over (in flight ones stop at their next ``sample``); the next :meth:`take` starts afresh."""
        self._stopped.set()
        for flight in self._futures.values():
            flight.future.cancel()
        self._futures.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor, self._stopped, self._relay = None, threading.Event(), None
        self._next = self._handed = -1

    def close(self) -> None:
        """:meth:`reset`: nothing keeps running after the run."""
        self.reset()


def _played(step: int, play: Callable[[], T], versions: dict[str, int]) -> StepRollout[T]:
    started = time.perf_counter()
    output = play()
    return StepRollout(step, output, dict(versions), time.perf_counter() - started)
