"""The Tinker API's front door to a cluster: each training run and sampler is a scheduler job, on a worker's shared server.

``tinkergym serve-tinker --scheduler URL --offer MODEL`` serves the one base URL the SDK knows and computes nothing
itself: :class:`ClusterEngine` submits, for each Tinker training run, a LoRA ``train`` job in the name of the key that
created it (its tenant's quotas, devices and isolation apply), waits for its lease and talks to the job's server (a
seat of a worker's shared server, or a server of its own) through
:class:`~tinkergym.backends.scheduled.ScheduledBackend`. A sampler is a job of its own that starts from the snapshot
it samples (``resume_job`` and ``resume_checkpoint``: the worker restores that state, the engine loads it), so later
training never reaches it.

A worker that dies moves the run to another worker, and the client never sees a wrong result:

- each run keeps, since its newest checkpoint the scheduler has stored, the log of the calls that changed it
  (``forward_backward``, ``optim_step``); every ``checkpoint_every`` optimizer steps the engine saves a state
  (``auto-<step>``) and, once stored, drops the log before it;
- a call that finds the server gone (:class:`~tinkergym.backends.scheduled.BackendLost`) waits for the job's next
  lease, loads the newest stored state (the worker restored it), replays the log (the same calls, in order, on the
  same data: the same gradients and steps) and runs the call again; the SDK sees a slow answer, or its own retry.

A client whose SDK still sends session heartbeats keeps its jobs: every ``keepalive_s`` the service pings the server of
each run and sampler of a live session (:meth:`ClusterEngine.keepalive`), which resets the scheduler's idle timeout as
a call does; a session that stops its heartbeats lets its jobs end when they go idle.

A weights-only load (``create_training_client_from_state``, ``load_state``) loads the state's trainable weights and keeps
the job's own optimizer moments, step and generator (a new run's are fresh), as ``serve-tinker --model`` does; the call
log holds it, so a new lease replays it. Differences from ``serve-tinker --model`` (refused with the reason): loading
another run's state into a running run (create a training client from it). Checkpoints are the jobs' (the scheduler's
artifact store keeps them; ``delete_checkpoint`` forgets the name only).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinkergym.tinker_api.engines import EngineError, Saved, folder_size

#: A job's checkpoint names (a state folder on its server).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Losing the server more often than this within one call gives up (the scheduler's max attempts end the job anyway).
MAX_RECOVERIES = 5


@dataclass
class ClusterHandle:
    """A run's or sampler's job: its backend, the calls since its newest stored state, and that state."""

    job_id: str
    backend: Any
    rank: int
    notes: Path
    log: list[tuple[str, Any]] = field(default_factory=list)
    stored: str | None = None  # the newest state the scheduler holds, which a new lease restores
    origin: tuple[str, str] | None = None  # the (job, state) the job started from
    steps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


class ClusterEngine:
    """Runs and samplers as scheduler jobs (see the module docstring). ``offers``: model name -> tokenizer id."""

    def __init__(self, scheduler_url: str, offers: dict[str, str], root: Path, *, max_lora_rank: int = 64, checkpoint_every: int = 8,
                 dtype: str = "auto", wait_timeout: float | None = None, poll: float = 0.5, say: Any = None) -> None:
        self.url, self.offers, self.root = scheduler_url, dict(offers), root
        self.max_lora_rank, self.checkpoint_every, self.dtype = max_lora_rank, checkpoint_every, dtype
        self.wait_timeout, self.poll = wait_timeout, poll
        self.say = say or (lambda line: None)
        self._tokenizers: dict[str, Any] = {}

    # ----- what is offered --------------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        return [{"model_name": name, "max_context_length": None, "trainable": True, "sampleable": True} for name in self.offers]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.offers:
            raise EngineError(400, f"base model {name[:200]!r} is not offered by this cluster; it offers {', '.join(map(repr, self.offers))} "
                                   "(get_server_capabilities lists them)")

    def model_info(self, name: str) -> dict[str, Any]:
        return {"arch": "", "tokenizer_id": self.offers.get(name, name), "vocab_size": None, "max_context": None}

    def tokenizer(self, name: str) -> Any:
        if name not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[name] = AutoTokenizer.from_pretrained(self.offers.get(name, name))
        return self._tokenizers[name]

    # ----- jobs -------------------------------------------------------------------------------------------------
    def _job(self, credential: str, name: str, model: str, rank: int, seed: int | None, source: Saved | None, load_now: bool) -> ClusterHandle:
        """A job that starts from ``source`` when given (the worker restores it); a sampler (``load_now``) loads it at once, a
        run when its client's load call says how (whole, or weights only: :meth:`load`)."""
        from tinkergym.backends.scheduled import ScheduledBackend
        from tinkergym.client import SchedulerClient, SchedulerError

        if not 1 <= rank <= self.max_lora_rank:
            raise EngineError(400, f"LoRA rank {rank} is not offered: this cluster takes ranks 1 to {self.max_lora_rank}")
        config: dict[str, Any] = {"model": model, "dtype": self.dtype, "lora_rank": rank, "lora_alpha": 32.0, "seed": 0 if seed is None else seed % 2**32,
                                  "trainer": "tinker", "env": ""}
        if source is not None:
            config.update(resume_job=source.location[0], resume_checkpoint=source.location[1])
        client = SchedulerClient(self.url, credential)
        try:
            backend = ScheduledBackend.submit(client, "train", config, name=name, poll=self.poll, wait_timeout=self.wait_timeout, say=self.say)
        except SchedulerError as exc:
            raise EngineError(exc.status or 503, f"the scheduler refused the run's job: {exc}", "user" if (exc.status or 500) < 500 else "server") from exc
        handle = ClusterHandle(backend.job_id, backend, rank, self.root / "notes" / backend.job_id)
        handle.notes.mkdir(parents=True, exist_ok=True)
        with handle.lock:
            self._connect(handle)
            if source is not None:  # the worker restored it from the scheduler
                handle.origin = source.location
                if load_now:  # where a new lease starts from too
                    self._load(handle, source.location[1])
                    handle.stored = source.location[1]
        return handle

    def _connect(self, handle: ClusterHandle) -> None:
        from tinkergym.client import JobEnded

        try:
            handle.backend.connect() if handle.backend.epoch is None else handle.backend.reconnect()
        except JobEnded as exc:  # for good: a retry cannot help, so the SDK must not retry (4xx)
            raise EngineError(410, f"job {handle.job_id} of this run ended: {exc}; start a new training client from the run's last "
                                   "checkpoint (create_training_client_from_state_with_optimizer)") from exc
        except TimeoutError as exc:
            raise EngineError(503, f"job {handle.job_id} did not run: {exc}", "server") from exc

    def _note(self, handle: ClusterHandle, name: str, weights_only: bool = False) -> str:
        """A local folder naming the job's state ``name`` (what RemoteBackend's load_state reads)."""
        folder = handle.notes / (f"{name}.weights-only" if weights_only else name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "remote_state.json").write_text(json.dumps({"name": name, "weights_only": weights_only}) + "\n")
        return str(folder)

    def _load(self, handle: ClusterHandle, name: str, weights_only: bool = False) -> None:
        handle.backend.load_state(self._note(handle, name, weights_only))

    def open_run(self, run_id: str, model: str, rank: int, seed: int | None, credential: str, source: Saved | None = None) -> ClusterHandle:
        return self._job(credential, f"tinker {run_id}"[:200], model, rank, seed, source, load_now=False)

    def open_sampler(self, sampler_id: str, model: str, rank: int, source: Saved | None, credential: str) -> ClusterHandle:
        return self._job(credential, f"tinker {sampler_id}"[:200], model, rank, 0, source, load_now=True)

    def close(self, handle: ClusterHandle, forget: bool = False) -> None:
        """End the job (its seat is freed at once); its stored checkpoints stay the scheduler's."""
        with handle.lock:
            if handle.closed:
                return
            handle.closed = True
            try:
                handle.backend.complete(store_timeout=60.0)
            except Exception as exc:  # noqa: BLE001 - a job that cannot be ended ends when its client goes quiet
                self.say(f"job {handle.job_id}: could not end it ({exc}); it ends when it goes idle")
            handle.backend.close()

    def keepalive(self, handle: ClusterHandle) -> None:
        """Tell the job's server that its client is alive, so a client that only sends heartbeats keeps its job past the
        scheduler's idle timeout. Not under the handle's lock (a long call holds it, and is itself activity); a lost server
        is the next call's to find."""
        if handle.closed:
            return
        try:
            handle.backend.ping()
        except Exception as exc:  # noqa: BLE001 - see above
            self.say(f"job {handle.job_id}: keep-alive found no server ({exc})")

    # ----- calls, with recovery -------------------------------------------------------------------------------------
    def call(self, handle: ClusterHandle, method: str, args: dict[str, Any]) -> dict[str, Any]:
        with handle.lock:
            result = self._recovering(handle, method, args)
            if method in ("forward_backward", "optim_step"):
                handle.log.append((method, args))
            if method == "optim_step":
                handle.steps += 1
                if self.checkpoint_every and handle.steps % self.checkpoint_every == 0:
                    self._store(handle, f"auto-{handle.steps:06d}")
            return result

    def _invoke(self, handle: ClusterHandle, method: str, args: dict[str, Any]) -> dict[str, Any]:
        backend = handle.backend
        if method == "sample":
            return backend.sample(args["request"]).to_dict()
        if method == "logprobs":
            return {"logprobs": backend.logprobs(args["sequences"], args["temperature"])}
        if method == "forward_backward":
            return backend.forward_backward(args["request"]).to_dict()
        if method == "optim_step":
            return {"metrics": backend.optim_step(args["params"])}
        raise EngineError(400, f"unknown call {method!r}")

    def _recovering(self, handle: ClusterHandle, method: str, args: dict[str, Any]) -> dict[str, Any]:
        from tinkergym.backends.scheduled import BackendLost
        from tinkergym.errors import ConfigError

        for attempt in range(MAX_RECOVERIES + 1):
            try:
                return self._invoke(handle, method, args)
            except BackendLost as exc:
                if attempt == MAX_RECOVERIES:
                    raise EngineError(503, f"job {handle.job_id} lost its server {attempt + 1} times in one call: {exc}", "server") from exc
                self._recover(handle)
            except ConfigError as exc:
                raise EngineError(400, str(exc)) from exc
        raise AssertionError("unreachable")

    def _recover(self, handle: ClusterHandle) -> None:
        """The job's next lease: load its newest stored state and replay the calls made since, in order."""
        from tinkergym.backends.scheduled import BackendLost

        while True:
            self.say(f"job {handle.job_id}: its server is gone; waiting for the next lease, then replaying {len(handle.log)} calls")
            self._connect(handle)
            try:
                if handle.stored is not None:
                    self._load(handle, handle.stored)
                for method, args in handle.log:
                    if method in ("load", "load_weights"):
                        self._load(handle, args, weights_only=method == "load_weights")
                    else:
                        self._invoke(handle, method, args)
                return
            except BackendLost:
                continue  # lost again while catching up: the next lease starts over

    def _store(self, handle: ClusterHandle, name: str) -> None:
        """Save the job's state as ``name`` and wait until the scheduler holds it; the log before it is no longer needed."""
        from tinkergym.backends.scheduled import BackendLost

        for _ in range(MAX_RECOVERIES + 1):
            try:
                handle.backend.save_state(self._note(handle, name))
                break
            except BackendLost:
                self._recover(handle)
        handle.backend._wait_stored(name, timeout=600.0)
        handle.stored, handle.log = name, []

    # ----- checkpoints ------------------------------------------------------------------------------------------------
    def check_name(self, handle: ClusterHandle, kind: str, name: str) -> None:
        if not NAME.match(name) or name.endswith(".tmp") or name.startswith("auto-"):
            raise EngineError(400, f"checkpoint name {name[:80]!r} is not allowed: 1-128 letters, digits, '.', '_' or '-', starting with "
                                   "a letter or digit, not ending in .tmp, not starting with auto- (the engine's own)")

    def save(self, handle: ClusterHandle, kind: str, name: str) -> Saved:
        """``training`` and ``sampler``: the job's whole state (a sampler loads its weights), stored by the scheduler before this
        returns; ``external``: the job's adapter exported by its server and downloaded here (a peft folder under this front
        door's ``external/<job>/<name>``)."""
        from tinkergym.backends.scheduled import BackendLost

        with handle.lock:
            if kind != "external":
                self._store(handle, name)
                return Saved((handle.job_id, name), None)
            folder = self.root / "external" / handle.job_id / name
            folder.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(MAX_RECOVERIES + 1):
                try:
                    handle.backend.export(str(folder))
                    break
                except BackendLost:
                    self._recover(handle)
            else:
                raise EngineError(503, f"job {handle.job_id} lost its server {MAX_RECOVERIES + 1} times while exporting its weights", "server")
        return Saved(folder, folder_size(folder))

    def load(self, handle: ClusterHandle, saved: Saved, optimizer: bool) -> None:
        """Load a state of the job (or the one it started from): whole with ``optimizer``, else its weights only. A new lease
        finds it again: a whole state the job started from is where the next lease starts, any other load is in the log."""
        from tinkergym.backends.scheduled import BackendLost
        from tinkergym.errors import ConfigError

        if not isinstance(saved.location, tuple):
            raise EngineError(400, "this checkpoint holds external weights, for download; load a training checkpoint (save_state)")
        job_id, name = saved.location
        started_from = handle.origin == saved.location
        if job_id != handle.job_id and not started_from:
            raise EngineError(400, "loading another run's state into a running run is not offered by this cluster: create a training client "
                                   "from it (create_training_client_from_state[_with_optimizer])")
        with handle.lock:
            for attempt in range(MAX_RECOVERIES + 1):
                try:
                    self._load(handle, name, weights_only=not optimizer)
                    break
                except BackendLost as exc:
                    if attempt == MAX_RECOVERIES:
                        raise EngineError(503, f"job {handle.job_id} lost its server {attempt + 1} times while loading a state: {exc}",
                                          "server") from exc
                    self._recover(handle)
                except ConfigError as exc:  # e.g. a state of another rank: the job is as it was
                    raise EngineError(400, str(exc)) from exc
            if started_from and optimizer and handle.stored is None and not handle.log:
                handle.stored = name  # the whole state a new lease restores: where the job starts over
            else:
                handle.log.append(("load" if optimizer else "load_weights", name))

    def delete(self, saved: Saved) -> None:
        """Forget the name; the scheduler keeps the job's checkpoints until its retention removes them. An external
        checkpoint's folder here is removed."""
        if isinstance(saved.location, Path):
            shutil.rmtree(saved.location, ignore_errors=True)

