"""The shared training server: one base model, many LoRA adapters, each with a token of its own (``tinkergym serve shared``).

The server's own token (the operator's, or a scheduler worker's) manages adapters: ``POST /v1/adapters`` opens one
(its rank, alpha and seed; refused past ``--max-lora-rank``, ``--max-adapters`` or the memory budget, with the
figures) and answers its id and a new random token, shown once (the server keeps its SHA-256 digest only);
``GET /v1/adapters`` lists them with the memory they hold and how long each has been idle (``idle_s``: since its
client's last call; 0 while one runs); ``DELETE /v1/adapters/{id}`` closes one and frees its
memory. An adapter's token reaches that adapter alone, through the routes of the single training server
(:mod:`tinkergym.serve.training.app`): ``/v1/info``, ``/v1/tokenizer``, ``/v1/sessions``, ``/v1/call``,
``/v1/requests/{id}``, ``/v1/files/exports/...``, with its own call store (sequence numbers, exactly-once) and
its own run folder (``<run-dir>/adapters/<id>/``). So :class:`~tinkergym.backends.remote.RemoteBackend` trains
through an adapter unchanged, given the server's URL and the adapter's token.

One thread runs every adapter's calls (:class:`SharedWorker`). Each adapter's calls run in the order they were
numbered; across adapters, rounds take the next call of each adapter with one waiting, round-robin from a
rotating start (an adapter the last round passed over first, a call already in slices after fresh calls), up to
``pass_tokens`` tokens a round, so one adapter's large or many calls never hold another's back
for more than a round. A ``sample``, ``forward_backward`` or ``logprobs`` call larger than that is worked in slices over
several rounds, so other adapters' calls run between its slices: whole units of the base (batches of ``max_sample_batch``
sequences, even of one prompt; micro-batches of rows), each slice carrying on from the last, so the call gets what it
would get in one go (:mod:`~tinkergym.backends.torch.call_slices`). A slice holds one unit at least, so another adapter
waits at most one unit of a huge call (a decode batch of ``max_sample_batch`` sequences, a micro-batch); a call of one
unit, or one sampling prompts with images, runs in a round of its own. An adapter's waiting reads of one
kind (``sample``, ``logprobs``: they change no weights) join its first call in the round, within the budget, so a
client's concurrent sampling requests share one pass. A round starts when ``gather_s`` passed without a new call
(and, unless every adapter has a call waiting, ``gather_s`` after the first), at most ten times ``gather_s`` after
it; a round of reads only waits ``read_gather_s`` instead. The ``forward_backward``, ``sample`` and ``logprobs`` calls of a round run together on the base
(:class:`~tinkergym.backends.torch.shared.SharedBase`), each failing alone; the others (``optim_step``, states,
export) one by one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from prometheus_client import Gauge
from fastapi.concurrency import run_in_threadpool
from pydantic import Field
from starlette.responses import JSONResponse

from tinkergym.errors import ConfigError
from tinkergym.plumbing.memory_use import measure, release_cached_memory, reset_peak
from tinkergym.serve.asgi import BodyLimit, RequestLog, StrictJSON, WireJSON, error_response
from tinkergym.serve.auth import LeaseFile, bearer_matches, bearer_token, token_digest
from tinkergym.serve.metrics import TokenTally
from tinkergym.serve.training.app import (ERRORS, PROTOCOL_VERSION, ErrorResponse, TrainingService, add_training_error_handlers, public_info,
                                          router, training_metrics)
from tinkergym.serve.training.calls import CallError, CallLimits, CallRecord, call_error, run_call, sample_tokens, wire_result
from tinkergym.serve.wire import WireModel

#: Routes of the server's own token; every other route but /health serves one adapter.
ADMIN_PREFIX = "/v1/adapters"
#: Calls that read an adapter without changing it: several of one adapter run in one pass (see :meth:`SharedWorker._take_round`).
JOINED_READS = ("sample", "logprobs")
#: The outcome of a slice that is not its call's last: the call is not finished yet.
_MORE_SLICES = object()
#: A round waits for more calls at most this many times its gather time (see :meth:`SharedWorker._loop`).
GATHER_ROUNDS = 10
CLOSED = "this adapter was closed (DELETE /v1/adapters/{id}) before the call ran"


class AdapterCreate(WireModel):
    lora_rank: int = Field(8, ge=1, le=4096, description="the adapter's rank (up to the server's --max-lora-rank)")
    lora_alpha: float = Field(16.0, gt=0, le=1e6, description="the update is scaled by lora_alpha / lora_rank")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds the adapter's initialization and its sampling generator")
    adapter_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="its id and folder name (default: random)")
    token_sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$",
                                     description="the SHA-256 (hex) of a token the caller made (a job's lease token), instead of a new one")
    source: AdapterSource | None = Field(None, description="start from another adapter's export (sample a saved adapter without a copy of the base)")


class AdapterSource(WireModel):
    adapter_id: str = Field(max_length=64, description="an open adapter of this server")
    export: str = Field(max_length=128, description="the name of one of its exports: the new adapter starts from it, with its rank and alpha")


class AdapterCreated(WireModel):
    adapter_id: str
    token: str | None = Field(description="the adapter's bearer token, shown once (null when the caller sent its digest)")
    info: dict[str, Any]


class AdapterLease(WireModel):
    seconds: float = Field(gt=0, le=10**6, description="the adapter takes calls for this long from now on, then 401 lease_ended")
    epoch: int = Field(ge=0, le=2**62, description="the lease's epoch: a renewal of an older epoch than the last is refused (409)")


class Conflict(ConfigError):
    """An adapter id or token in use, or a stale lease: 409."""


def call_tokens(record: CallRecord) -> int:
    """The tokens a call puts through the model, for the round's budget (0 for calls that run none)."""
    call = record.call
    if call is None:
        return 0
    if call.method == "sample":
        return sample_tokens(call.args["request"])
    if call.method == "forward_backward":
        return sum(len(d.tokens) for d in call.args["request"].data)
    if call.method == "logprobs":
        return sum(map(len, call.args["sequences"]))
    return 0


@dataclass
class _Queue:
    records: deque[CallRecord] = field(default_factory=deque)
    last_done: float = field(default_factory=time.monotonic)


class WorkerPort:
    """What one adapter's :class:`TrainingService` sees of the shared worker: its own queue."""

    def __init__(self, worker: SharedWorker, adapter_id: str) -> None:
        self.worker, self.adapter_id = worker, adapter_id

    def submit(self, record: CallRecord) -> None:
        self.worker.submit(self.adapter_id, record)

    @property
    def pending(self) -> int:
        return self.worker.pending(self.adapter_id)

    @property
    def last_done(self) -> float:
        return self.worker.last_done(self.adapter_id)

    @property
    def tokens(self) -> TokenTally:
        return self.worker.tally(self.adapter_id)

    def stop(self, timeout: float = 5.0) -> None:
        """Nothing of its own to stop: the server stops the shared worker."""


class SharedWorker:
    """One thread that runs every adapter's calls in rounds (see the module docstring)."""

    def __init__(self, base: Any, logger: logging.Logger, keep_states: int = 0, pass_tokens: int = 65536, gather_s: float = 0.005,
                 max_waiting: int = 16, max_disk_bytes: int = 0, read_gather_s: float | None = None) -> None:
        self.base, self.logger, self.keep_states, self.pass_tokens, self.gather_s = base, logger, keep_states, pass_tokens, gather_s
        #: The gather time of a round whose first calls are all reads (a client's concurrent samples come apart by tens of ms).
        self.read_gather_s = gather_s if read_gather_s is None else read_gather_s
        self.max_waiting, self.max_disk_bytes = max_waiting, max_disk_bytes
        self.adapters: dict[str, tuple[Any, Path]] = {}  # id -> (session, run folder)
        self._tallies: dict[str, TokenTally] = {}  # id -> what its calls trained and sampled
        self._queues: dict[str, _Queue] = {}
        self._running: set[str] = set()
        self._cond = threading.Condition()
        self._slices: dict[str, Any] = {}  # request id -> a call being worked in slices (the base's CallSlices)
        self._start = 0
        self._passed_over: set[str] = set()  # adapters with a call waiting that the last round did not take
        self._last_submit = 0.0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.rounds: list[list[tuple[str, str]]] = []  # the last 64 rounds' (adapter, method), newest last
        self.rounds_run = 0  # rounds since the start
        #: ``observer(method, call, result, ok, seconds)`` after each call (the server's metrics), or None.
        self.observer: Any = None
        self.last_activity = time.monotonic()

    def add(self, adapter_id: str, session: Any, run_dir: Path) -> WorkerPort:
        with self._cond:
            self.adapters[adapter_id] = (session, run_dir)
            self._queues[adapter_id] = _Queue()
            self._tallies[adapter_id] = TokenTally()
        return WorkerPort(self, adapter_id)

    def tally(self, adapter_id: str) -> TokenTally:
        """What the adapter's calls trained and sampled (an empty tally once it is removed)."""
        return self._tallies.get(adapter_id) or TokenTally()

    def remove(self, adapter_id: str) -> None:
        """Forget an adapter; calls of it still waiting fail (409), one running finishes first."""
        with self._cond:
            queue = self._queues.pop(adapter_id, None)
            while adapter_id in self._running:
                self._cond.wait(1.0)
            self.adapters.pop(adapter_id, None)
            self._tallies.pop(adapter_id, None)
        for record in (queue.records if queue else ()):
            self._slices.pop(record.request_id, None)
            record.finish(error=call_error(ConfigError(CLOSED), record.request_id, self.logger))

    def submit(self, adapter_id: str, record: CallRecord) -> None:
        with self._cond:
            queue = self._queues.get(adapter_id)
            if queue is None:
                record.finish(error=call_error(ConfigError(CLOSED), record.request_id, self.logger))
                return
            if len(queue.records) >= self.max_waiting:  # each waiting call holds its body: a tenant's queue is bounded
                record.finish(error=CallError(429, "too_many_calls", f"{len(queue.records)} calls of this adapter are waiting, its most "
                                              f"(--max-waiting-calls {self.max_waiting}); wait for their results before sending more"))
                return
            queue.records.append(record)
            self._last_submit = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tinkergym-shared-worker", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self, adapter_id: str) -> int:
        with self._cond:
            queue = self._queues.get(adapter_id)
            return (len(queue.records) if queue else 0) + (adapter_id in self._running)

    def last_done(self, adapter_id: str) -> float:
        queue = self._queues.get(adapter_id)
        return queue.last_done if queue else self.last_activity

    def busy(self) -> bool:
        with self._cond:
            return bool(self._running) or any(q.records for q in self._queues.values())

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _take_round(self) -> list[tuple[str, CallRecord, list[int] | None]]:
        """The next call of each adapter with one waiting, round-robin from a rotating start, within the token budget: a
        call larger than the budget gives a slice of its units (see :meth:`_sliced`), and stays at the head of its queue
        until its last slice is taken. Each entry: ``(adapter, call, the slice's rows or None for the whole call)``."""
        ids = [a for a, q in self._queues.items() if q.records]
        if not ids:
            return []
        start = self._start % len(ids)
        self._start += 1
        # An adapter passed over last round (for the budget) goes first; a call already in slices goes after the fresh
        # calls, so a call that arrives while a huge one runs waits one slice, and the huge one one round at most.
        order = sorted(ids[start:] + ids[:start], key=lambda a: 0 if a in self._passed_over else 2 if self._queues[a].records[0].request_id in self._slices else 1)
        taken: list[tuple[str, CallRecord, list[int] | None]] = []
        used = 0
        for adapter_id in order:
            records = self._queues[adapter_id].records
            slices = self._sliced(adapter_id, records[0])
            if slices is not None:
                rows, cost = slices.take(self.pass_tokens - used, anyway=not taken)
                if rows:
                    used += cost
                    taken.append((adapter_id, records[0], rows))
                    if slices.finished:
                        records.popleft()  # its last slice
                continue
            cost = call_tokens(records[0])
            if taken and used + cost > self.pass_tokens:
                continue
            first = records.popleft()
            taken.append((adapter_id, first, None))
            used += cost
            # Reads (sample, logprobs) change no weights: an adapter's waiting reads of one kind join its first in the same pass.
            while (first.method in JOINED_READS and records and records[0].method == first.method and self._sliced(adapter_id, records[0]) is None
                   and used + call_tokens(records[0]) <= self.pass_tokens):
                used += call_tokens(records[0])
                taken.append((adapter_id, records.popleft(), None))
        self._running = {a for a, _, _ in taken}
        self._passed_over = set(ids) - self._running
        return taken

    def _sliced(self, adapter_id: str, record: CallRecord) -> Any:
        """The slices of a call larger than a round's budget (made on first sight by the base's ``call_slices``: see
        :mod:`~tinkergym.backends.torch.call_slices`), or None for a call run whole."""
        known = self._slices.get(record.request_id)
        if (known is not None or record.call is None or call_tokens(record) <= self.pass_tokens
                or adapter_id not in self.adapters or not hasattr(self.base, "call_slices")):
            return known
        slices = self.base.call_slices(self.adapters[adapter_id][0], record.method, _joint_args(record))
        if slices is not None:
            self._slices[record.request_id] = slices
        return slices

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not any(q.records for q in self._queues.values()):
                    self._cond.wait()
                # Other adapters' calls often follow within moments (their clients step in lock-step), and a client's concurrent
                # reads arrive one by one: wait for them until gather_s passes without a new call (at most GATHER_ROUNDS times
                # that); with every adapter's call here, only while calls keep coming.
                start = time.monotonic()
                while not self._stopping:
                    heads = [q.records[0].method for q in self._queues.values() if q.records]
                    gather = self.read_gather_s if all(m in JOINED_READS for m in heads) else self.gather_s
                    quiet = self._last_submit + gather
                    ready = all(q.records for q in self._queues.values())
                    until = min(quiet if ready else max(quiet, start + gather), start + GATHER_ROUNDS * gather)
                    now = time.monotonic()
                    if now >= until:
                        break
                    self._cond.wait(until - now)
                if self._stopping:
                    return
                taken = self._take_round()
            try:
                self._run_round(taken)
            finally:
                with self._cond:
                    now = time.monotonic()
                    for adapter_id, _, _ in taken:
                        if adapter_id in self._queues:
                            self._queues[adapter_id].last_done = now
                    self._running = set()
                    self.last_activity = now
                    self.rounds = [*self.rounds[-63:], [(a, r.method) for a, r, _ in taken]]
                    self.rounds_run += 1
                    self._cond.notify_all()

    def _run_round(self, taken: list[tuple[str, CallRecord, list[int] | None]]) -> None:
        start = time.perf_counter()
        outcomes: dict[str, Any] = {}
        ready = [(a, r, rows) for a, r, rows in taken if r.call is not None and a in self.adapters]
        together = {"forward_backward": self.base.forward_backward_many, "sample": self.base.sample_many, "logprobs": self.base.logprobs_many}
        for method, run in together.items():
            # A sample from a snapshot runs alone (run_call below refuses it: a shared server takes no snapshots).
            mine = [(a, r, rows) for a, r, rows in ready if r.call is not None and r.call.method == method and not r.call.args.get("snapshot")]
            if not mine:
                continue
            args = [(self.adapters[a][0], _joint_args(r) if rows is None else self._slices[r.request_id].part(rows)) for a, r, rows in mine]
            carries = [None if rows is None else self._slices[r.request_id].carry_for(rows) for _, r, rows in mine]
            try:
                results = run(args, carries) if any(c is not None for c in carries) else run(args)
            except Exception as exc:  # noqa: BLE001 - a fault of the joint call itself fails its calls
                results = [exc] * len(mine)
            for (adapter_id, record, rows), result in zip(mine, results):
                outcomes[record.request_id] = result if rows is None else self._slice_done(adapter_id, record, rows, result)
        for adapter_id, record, _ in ready:
            if record.request_id not in outcomes:
                session, run_dir = self.adapters[adapter_id]
                try:
                    if record.method in ("save_state", "export"):
                        self._check_disk(run_dir)
                    outcomes[record.request_id] = run_call(session, record.call, run_dir, self.keep_states)  # type: ignore[arg-type]
                except Exception as exc:  # noqa: BLE001 - the call's stored outcome
                    outcomes[record.request_id] = exc
        for adapter_id, record, _ in taken:
            outcome = outcomes.get(record.request_id, ConfigError(CLOSED))
            if outcome is _MORE_SLICES:
                continue  # its next slice runs in a later round
            error = call_error(outcome, record.request_id, self.logger) if isinstance(outcome, BaseException) else None
            result = None if error is not None else (wire_result(record.method, outcome) if record.method in together else outcome)
            seconds = time.perf_counter() - start
            self.logger.info(json.dumps({
                "event": "call", "request_id": record.request_id, "adapter": adapter_id, "session": record.session_id, "seq": record.seq,
                "method": record.method, "ok": error is None, "round": len(taken), "duration_ms": round(1000 * seconds, 1),
            }))
            if self.observer is not None:  # a call of a shared pass is timed as the pass
                self.observer(record.method, record.call, result, error is None, seconds)
            if error is None:
                self.tally(adapter_id).add(record.method, record.call, result)
            record.finish(result=result, error=error)

    def _slice_done(self, adapter_id: str, record: CallRecord, rows: list[int], result: Any) -> Any:
        """Keep a slice's results; the call's whole result after its last slice, :data:`_MORE_SLICES` before it, or the
        slice's error (which ends the call: its slices left are dropped, and a training call's gradients put back)."""
        slices = self._slices[record.request_id]
        if isinstance(result, BaseException):
            self._slices.pop(record.request_id, None)
            if record.method == "forward_backward":
                self.base.abandon(self.adapters[adapter_id][0], slices.carry)
            with self._cond:
                queue = self._queues.get(adapter_id)
                if queue is not None and queue.records and queue.records[0] is record:
                    queue.records.popleft()
            return result
        slices.add(rows, result)
        if not slices.finished:
            return _MORE_SLICES
        self._slices.pop(record.request_id, None)
        return slices.result()

    def _check_disk(self, run_dir: Path) -> None:
        """Refuse a new state or export while the adapter's folder holds its most bytes (``max_disk_bytes``; 0: no bound)."""
        if not self.max_disk_bytes:
            return
        held = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink())
        if held >= self.max_disk_bytes:
            raise ConfigError(f"this adapter's states and exports hold {held / 2**20:.1f} MB, its most ({self.max_disk_bytes / 2**20:.0f} MB, "
                              "--max-adapter-disk-mb): save states under names already used (the client reuses its last two) or ask the "
                              "operator for room")


def _joint_args(record: CallRecord) -> Any:
    args = record.call.args  # type: ignore[union-attr]
    if record.method != "logprobs":
        return args["request"]
    # A logprobs call may carry one list of images per sequence (a vision-language base); without them it is the text call.
    return (args["sequences"], args["temperature"]) if args.get("images") is None else (args["sequences"], args["temperature"], args["images"])


@dataclass
class Adapter:
    adapter_id: str
    session: Any
    service: TrainingService
    digest: bytes
    run_dir: Path
    #: ``time.monotonic()`` past which the adapter takes no calls, and the epoch of the lease that set it (None: no lease).
    lease_until: float | None = None
    lease_epoch: int = -1

    def lease_ended(self) -> bool:
        return self.lease_until is not None and time.monotonic() >= self.lease_until


class SharedService:
    """The base, its adapters and the shared worker: what the routes of one shared app share."""

    def __init__(self, base: Any, run_dir: Path, logger: logging.Logger, keep_results: int, max_sessions: int, keep_states: int,
                 limits: CallLimits, pass_tokens: int, gather_s: float, max_waiting: int, max_disk_bytes: int) -> None:
        self.base, self.run_dir, self.logger = base, run_dir, logger
        self.keep_results, self.max_sessions, self.keep_states, self.limits = keep_results, max_sessions, keep_states, limits
        self.worker = SharedWorker(base, logger, keep_states, pass_tokens, gather_s, max_waiting, max_disk_bytes)
        self.adapters: dict[str, Adapter] = {}
        self._by_digest: dict[bytes, Adapter] = {}
        self._lock = threading.Lock()
        self.base_bytes = measure()["device_bytes"]  # measured with the base alone: what the seats' growth is counted from

    def open(self, body: AdapterCreate) -> dict[str, Any]:
        from tinkergym.backends.torch.shared import LoraSessionConfig

        with self._lock:  # the id and token are checked and taken at once
            adapter_id = body.adapter_id or secrets.token_hex(8)
            if adapter_id in self.adapters:
                raise Conflict(f"adapter {adapter_id!r} is open already; close it first or choose another id")
            token = None if body.token_sha256 else secrets.token_urlsafe(32)
            digest = bytes.fromhex(body.token_sha256) if body.token_sha256 else token_digest(token)  # type: ignore[arg-type]
            if digest in self._by_digest:
                raise Conflict("another adapter has this token; make a new one")
            rank, alpha, start = body.lora_rank, body.lora_alpha, None
            if body.source is not None:
                start = self._export(body.source)
                rank, alpha = start[1], start[2]
            session = self.base.open_session(LoraSessionConfig(lora_rank=rank, lora_alpha=alpha, seed=body.seed))
            if start is not None:
                try:
                    session.load_adapter(start[0])
                except Exception:
                    self.base.close_session(session)
                    raise
            folder = self.run_dir / "adapters" / adapter_id
            folder.mkdir(parents=True, exist_ok=True)
            service = TrainingService(session, folder, self.logger, self.keep_results, self.max_sessions, self.keep_states, self.limits,
                                      worker=self.worker.add(adapter_id, session, folder))
            adapter = Adapter(adapter_id, session, service, digest, folder)
            self.adapters[adapter_id] = adapter
            self._by_digest[adapter.digest] = adapter
        self.logger.info(json.dumps({"event": "adapter_opened", "adapter": adapter_id, "lora_rank": body.lora_rank}))
        return {"adapter_id": adapter_id, "token": token, "info": service.info()}

    def close(self, adapter_id: str, purge: bool) -> bool:
        with self._lock:
            adapter = self.adapters.pop(adapter_id, None)
            if adapter is None:
                return False
            self._by_digest.pop(adapter.digest, None)
        self.worker.remove(adapter_id)
        self.base.close_session(adapter.session)
        release_cached_memory()
        reset_peak()  # the next peak is the staying adapters': the scheduler's measure of room for another
        if purge:
            shutil.rmtree(adapter.run_dir, ignore_errors=True)
        self.logger.info(json.dumps({"event": "adapter_closed", "adapter": adapter_id, "purged": purge}))
        return True

    def _export(self, source: AdapterSource) -> tuple[str, int, float]:
        """``(folder, rank, alpha)`` of an open adapter's export, checked as the export routes check names."""
        from tinkergym.serve.training.calls import named_dir

        adapter = self.adapters.get(source.adapter_id)
        if adapter is None:
            raise ConfigError(f"source: no open adapter {source.adapter_id[:64]!r}")
        folder = named_dir(adapter.run_dir.resolve(), "exports", source.export)
        config = folder / "adapter_config.json"
        if not config.is_file():
            raise ConfigError(f"source: adapter {source.adapter_id!r} has no export named {source.export!r}; export it first")
        saved = json.loads(config.read_text())
        return str(folder), int(saved["r"]), float(saved["lora_alpha"])

    def lease(self, adapter_id: str, body: AdapterLease) -> dict[str, Any]:
        """Move the adapter's lease deadline to ``seconds`` from now; a renewal of an older epoch is a :class:`Conflict`."""
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            raise KeyError(adapter_id)
        if body.epoch < adapter.lease_epoch:
            raise Conflict(f"lease epoch {body.epoch} is older than the adapter's {adapter.lease_epoch}: a newer lease holds it")
        adapter.lease_until, adapter.lease_epoch = time.monotonic() + body.seconds, body.epoch
        return {"adapter_id": adapter_id, "epoch": body.epoch, "seconds": body.seconds}

    def by_token(self, authorization: str | None) -> Adapter | None:
        token = bearer_token(authorization)
        # A dict keyed by the SHA-256 digest: the digest of a guess tells nothing about the tokens held.
        return None if token is None else self._by_digest.get(token_digest(token))

    def listing(self) -> dict[str, Any]:
        now = time.monotonic()
        adapters = [{"adapter_id": a.adapter_id, "lora_rank": a.session.config.lora_rank, "lora_alpha": a.session.config.lora_alpha,
                     "step": a.session.step, "pending": self.worker.pending(a.adapter_id),
                     "idle_s": round(max(0.0, now - a.service.last_activity()), 3), **self.worker.tally(a.adapter_id).as_dict()}
                    for a in list(self.adapters.values())]
        return {"base": public_info(self.base.info()), "memory": self.base.memory(), "measured": self.measured(), "adapters": adapters,
                "protocol": PROTOCOL_VERSION, "limits": self.limits.as_dict()}

    def measured(self) -> dict[str, Any]:
        """The server's memory as measured now (:func:`tinkergym.plumbing.memory_use.measure`), with the base's alone
        (``base_bytes``, at the start) and the adapters open (``sessions``): what its worker reports at each heartbeat."""
        return {**measure(), "base_bytes": self.base_bytes, "sessions": len(self.adapters)}

    def last_activity(self) -> float:
        if self.worker.busy():
            return time.monotonic()
        return max([self.worker.last_activity, *(a.service.last_activity() for a in self.adapters.values())])


admin = APIRouter(prefix=ADMIN_PREFIX, tags=["adapters"])


def _shared(request: Request) -> SharedService:
    return request.app.state.shared


@admin.post("", status_code=201, response_model=AdapterCreated, responses=ERRORS)
async def open_adapter(body: AdapterCreate, request: Request) -> dict[str, Any]:
    """Open an adapter on the base; its token is in the answer only."""
    return await run_in_threadpool(_shared(request).open, body)


@admin.get("", responses=ERRORS)
async def list_adapters(request: Request) -> dict[str, Any]:
    """The base, the memory it and each adapter hold, and the adapters."""
    return await run_in_threadpool(_shared(request).listing)


@admin.put("/{adapter_id}/lease", responses=ERRORS)
async def lease_adapter(adapter_id: str, body: AdapterLease, request: Request) -> Any:
    """Bind the adapter to a lease: past ``seconds`` from now it refuses every call (401 lease_ended) until renewed."""
    try:
        return _shared(request).lease(adapter_id[:64], body)
    except KeyError:
        return error_response(404, "not_found", f"no open adapter {adapter_id[:64]!r}")


@admin.delete("/{adapter_id}", responses=ERRORS)
async def close_adapter(adapter_id: str, request: Request, purge: bool = Query(False, description="also delete its states and exports")) -> Any:
    """Close an adapter: its waiting calls fail, its token stops working, its memory is freed."""
    if not await run_in_threadpool(_shared(request).close, adapter_id[:64], purge):
        return error_response(404, "not_found", f"no open adapter {adapter_id[:64]!r}")
    return {"closed": True}


def _refusal(status: int, kind: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse({"error": {"type": kind, "message": message, "code": status}}, status_code=status, headers=headers)


def _authenticate(app: FastAPI, shared: SharedService, admin_digest: bytes, lease: LeaseFile | None) -> None:
    @app.middleware("http")
    async def authenticate(request, call_next):
        path = request.url.path
        if path == "/health":
            return await call_next(request)
        authorization = request.headers.get("authorization")
        is_admin = bearer_matches(authorization, admin_digest)
        adapter = None if is_admin else shared.by_token(authorization)
        if not is_admin and adapter is None:
            return _refusal(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)")
        if lease is not None and lease.ended():
            return _refusal(401, "lease_ended", "this server's lease has ended, so it takes no more calls; connect through the scheduler")
        on_admin_route = path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")
        if on_admin_route and not is_admin:
            return _refusal(403, "forbidden", "adapters are opened and closed with the server's token, not an adapter's")
        if not on_admin_route and path != "/openapi.json":
            if adapter is None:
                return _refusal(403, "forbidden", "this route serves one adapter: call it with that adapter's token (POST /v1/adapters answers it)")
            if adapter.lease_ended():
                return _refusal(401, "lease_ended", "this adapter's lease has ended, so it takes no more calls; connect to the job's new "
                                                    "server through the scheduler")
            request.state.service = adapter.service
        return await call_next(request)


def create_shared_app(
    base: Any,
    *,
    run_dir: str | os.PathLike[str],
    token_digest: bytes,
    max_body_mb: float = 64,
    logger: logging.Logger | None = None,
    keep_results: int = 16,
    keep_states: int = 0,
    max_sessions: int = 64,
    limits: CallLimits = CallLimits(),
    lease: LeaseFile | None = None,
    pass_tokens: int = 65536,
    gather_ms: float = 5.0,
    max_waiting_calls: int = 16,
    max_adapter_disk_mb: float = 0.0,
) -> FastAPI:
    """A FastAPI app serving the adapters of ``base`` (a :class:`~tinkergym.backends.torch.shared.SharedBase`).

    ``token_digest`` is the server's own token's (it manages adapters); ``pass_tokens`` bounds the tokens of one
    round of calls across adapters; a round waits up to ``gather_ms`` for other adapters' calls; an adapter may have
    ``max_waiting_calls`` calls waiting (more are refused, 429) and ``max_adapter_disk_mb`` of states and exports
    (0: no bound; a new one past it is refused, 400); the other arguments mean what they mean for
    :func:`~tinkergym.serve.training.app.create_app`, per adapter.
    """
    folder = Path(run_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    log = logger or logging.getLogger("tinkergym.serve.training.app")
    shared = SharedService(base, folder, log, keep_results, max_sessions, keep_states, limits, pass_tokens, gather_ms / 1000,
                           max_waiting_calls, int(max_adapter_disk_mb * 2**20))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(shared.worker.stop)

    app = FastAPI(title="tinkergym shared training server", version=str(PROTOCOL_VERSION), lifespan=lifespan,
                  docs_url=None, redoc_url=None, default_response_class=WireJSON)
    app.state.shared = shared
    # Every route answers 403 to the other kind of token; a call past an adapter's waiting calls is 429.
    app.include_router(admin, responses={403: {"model": ErrorResponse}})
    app.include_router(router, responses={403: {"model": ErrorResponse}, 429: {"model": ErrorResponse}})
    add_training_error_handlers(app, log)

    @app.exception_handler(Conflict)
    async def conflict(request: Request, exc: Conflict) -> WireJSON:
        return error_response(409, "conflict", str(exc)[:2000])

    # No NaN in a body (infinity bounds nothing where the protocol allows it): inside BodyLimit, which bounds what it reads.
    app.add_middleware(StrictJSON, allow_infinity=True)
    app.add_middleware(BodyLimit, max_bytes=int(max_body_mb * 1024 * 1024), hint="send the batch in several forward_backward calls (--max-body-mb)")
    _authenticate(app, shared, token_digest, lease)
    app.add_middleware(RequestLog, logger=log)
    app.state.metrics = training_metrics(app, "shared", shared.worker)
    Gauge("tinkergym_shared_adapters", "LoRA adapters open on the shared base", registry=app.state.metrics.registry).set_function(
        lambda: len(shared.adapters))
    return app
