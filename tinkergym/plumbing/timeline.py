"""A run's timeline: spans of its phases, kept per step in the run folder, and the Chrome/Perfetto trace they make.

While a :class:`Timeline` is recording (:func:`recording`), :func:`span` notes the start, end and thread of each phase
it wraps, from any thread (env steps and tool calls run on the rollout's thread pool, sampling ahead on its own
thread). The phases:

============================  ===============================================================================
span (``cat``)                what it covers
============================  ===============================================================================
``step`` (step)               one training step (``time/step_s``); ``eval`` and ``checkpoint`` follow it
``rollout`` (phase)           the step's episodes: ``sample`` requests (sampling) and ``env.step`` (env)
``rollout_wait`` (phase)      with ``--async-steps``: waiting for a rollout sampled ahead
``update`` (phase)            advantages, ``forward_backward`` and ``optim_step`` (backend)
``tool`` (tool)               one tool call of an env (``args.tool``: its name)
``queue`` (setup)             a scheduler job waiting for its lease and server
============================  ===============================================================================

:class:`~tinkergym.trainers.session.TrainingRun` appends each step's spans to ``<run>/timeline.jsonl`` (one JSON object
per span: ``name``, ``cat``, ``start_us`` and ``end_us`` since the epoch, ``thread``, ``args``), whatever the backend
(local, a training server, a scheduler job, a Tinker endpoint: the spans are the client's view of each call).
``tinkergym trace RUN`` writes them in the Trace Event Format (``{"traceEvents": [...]}``, complete events ``"ph": "X"``)
that ui.perfetto.dev and chrome://tracing open. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The file of a run's spans, in its folder.
FILE = "timeline.jsonl"


@dataclass
class Span:
    name: str
    cat: str
    start_us: float
    end_us: float
    thread: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.end_us - self.start_us) / 1e6


class Timeline:
    """Spans noted from any thread, taken out in the order they ended (see the module docstring)."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._listeners: list[Callable[[Span], None]] = []
        self._lock = threading.Lock()
        # wall-clock microseconds of a perf_counter reading: durations from the monotonic clock, times an epoch's
        self._offset_us = time.time_ns() / 1000 - time.perf_counter_ns() / 1000

    def now_us(self) -> float:
        return time.perf_counter_ns() / 1000 + self._offset_us

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "phase", **args: Any) -> Iterator[None]:
        start = self.now_us()
        try:
            yield
        finally:
            done = Span(name, cat, start, self.now_us(), threading.get_ident(), {k: v for k, v in args.items() if v is not None})
            with self._lock:
                self._spans.append(done)
                listeners = list(self._listeners)
            for listener in listeners:
                listener(done)

    def add_listener(self, listener: Callable[[Span], None]) -> None:
        """Call ``listener(span)`` as each span ends, from the thread that ran it (the run's metrics, ``train --metrics-port``)."""
        with self._lock:
            self._listeners.append(listener)

    def take(self) -> list[Span]:
        """The spans noted since the last take."""
        with self._lock:
            spans, self._spans = self._spans, []
        return spans


_active: Timeline | None = None


@contextlib.contextmanager
def recording(timeline: Timeline) -> Iterator[Timeline]:
    """Make ``timeline`` the one :func:`span` notes into, in every thread, until the block ends."""
    global _active
    previous, _active = _active, timeline
    try:
        yield timeline
    finally:
        _active = previous


def span(name: str, cat: str = "phase", **args: Any) -> contextlib.AbstractContextManager[None]:
    """A span of the recording timeline, or nothing when none records."""
    active = _active
    return active.span(name, cat, **args) if active is not None else contextlib.nullcontext()


def append_spans(folder: str | Path, spans: list[Span]) -> None:
    """Add ``spans`` to the run folder's :data:`FILE`."""
    if not spans:
        return
    with open(Path(folder) / FILE, "a", encoding="utf-8") as out:
        out.write("".join(json.dumps(asdict(s), separators=(",", ":")) + "\n" for s in spans))


def trim_spans(folder: str | Path, keep_through: int | None) -> None:
    """Drop the spans of the steps after ``keep_through`` (every span for ``None``) from the run folder's :data:`FILE`, as a
    resume drops those steps' metrics: a step that is trained again is in the timeline once. A step's spans are those
    that started before the next step's ``step`` span (its rollouts, update, evaluation and checkpoint)."""
    path = Path(folder) / FILE
    if keep_through is None:
        path.unlink(missing_ok=True)
        return
    spans = read_spans(folder)
    later = [s.start_us for s in spans if s.name == "step" and s.cat == "step" and int(s.args.get("step", -1)) > keep_through]
    if not later:
        return
    cut = min(later)
    kept = [s for s in spans if s.start_us < cut and int(s.args.get("step", keep_through)) <= keep_through]
    tmp = path.with_name(FILE + ".tmp")
    tmp.write_text("".join(json.dumps(asdict(s), separators=(",", ":")) + "\n" for s in kept), encoding="utf-8")
    tmp.replace(path)


def read_spans(folder: str | Path) -> list[Span]:
    """The run folder's spans (a line cut short by a crash is skipped)."""
    path = Path(folder) / FILE
    spans = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            spans.append(Span(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return spans


def chrome_trace(spans: list[Span], process_name: str = "tinkergym run") -> dict[str, Any]:
    """The Trace Event Format of ``spans``: one complete event each, threads numbered in order of appearance (the run's
    own thread first), times in microseconds."""
    threads: dict[int, int] = {}
    for s in sorted(spans, key=lambda s: s.start_us):
        threads.setdefault(s.thread, len(threads) + 1)
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": process_name}}]
    for tid in threads.values():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": "run" if tid == 1 else f"worker {tid - 1}"}})
    for s in sorted(spans, key=lambda s: (s.start_us, -s.end_us)):
        events.append({"name": s.name, "cat": s.cat, "ph": "X", "ts": round(s.start_us, 3), "dur": round(s.end_us - s.start_us, 3),
                       "pid": 1, "tid": threads[s.thread], "args": s.args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
