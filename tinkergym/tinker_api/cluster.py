"""The Tinker API's front door to a cluster: each training run and sampler is a scheduler job, on a worker's shared server.

``tinkergym serve tinker --scheduler URL --offer MODEL`` serves the one base URL the SDK knows and computes nothing
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

A front door that restarts keeps its clients' sessions, runs, samplers and checkpoints (:mod:`tinkergym.tinker_api.journal`):
:meth:`ClusterEngine.describe` gives a handle as plain data, :meth:`ClusterEngine.restore` makes it again without a
connection, and a run's first request, or its session's first heartbeat, after the restart (:meth:`ClusterEngine.attach`,
with the request's key) reattaches to its job and brings the server back to the log before the request runs (after a
heartbeat, on the keep-alive pool: :meth:`ClusterEngine.keepalive`): the newest stored state loaded and the log replayed, so a call that was running when the front door stopped, and was never logged, leaves no trace. A run with no
stored state yet cannot be brought back on its job's server (its adapter's start is not saved there): its job is ended
and a new one from the same config (the same seed: the same start) replays the log.

A client whose SDK still sends session heartbeats keeps its jobs: every ``maintenance_s`` the service pings the server of
each run and sampler of a live session (:meth:`ClusterEngine.keepalive`), which resets the scheduler's idle timeout as
a call does. A keep-alive that finds the server gone brings the job's next server to the log once the job runs on a new
lease (:meth:`ClusterEngine._follow`), so a worker that dies under an idle client does not end its job at the idle timeout.

A client that is gone (killed, or a script that ended without ``close()``) sends no heartbeat: once its session has had
none for ``session_timeout_s`` (``serve tinker --session-timeout``, 180 s; the SDK sends one every 10 s), the next
maintenance pass ends the session and :meth:`ClusterEngine.close` completes each of its jobs with the reason (the job's
``end_reason``, which ``tinkergym jobs show`` and the dashboard's job view show), which frees their seats at once; the
states the scheduler stored stay, and the run stays listed, so ``create_training_client_from_state(path)`` from a new
client resumes it on a new job. A front door that stops for good ends nothing: its jobs get no more calls nor
keep-alives, and each ends at the scheduler's idle timeout (``scheduler serve --idle-timeout``, 900 s), a seat's as a
whole server's (the worker stops a seat whose adapter got no call for that long). A front door started again on its
run folder restores its sessions with a fresh heartbeat clock: a client that is still alive reattaches with its next
heartbeat, one that is gone ends after the session timeout, and its jobs, which the front door can end only with the
client's key, at the idle timeout.

An offered vision-language model (``--offer NAME=<folder>``, a folder whose config has a ``vision_config`` and that holds
the image processor) takes image chunks: :meth:`ClusterEngine.vision` reads its image processor and image token from that
folder (no weights), so the SDK's images become image tokens here, and their pixels travel with each call (``sample``,
``forward_backward``, ``logprobs``) to the job's shared server; a text model's offer refuses them.

A weights-only load (``create_training_client_from_state``, ``load_state``) loads the state's trainable weights and keeps
the job's own optimizer moments, step and generator (a new run's are fresh), as ``serve tinker --model`` does; the call
log holds it, so a new lease replays it. Differences from ``serve tinker --model`` (refused with the reason): loading
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
from collections.abc import Callable
from typing import Any, TypeVar

from tinkergym.tinker_api.engines import EngineError, Saved, folder_size
from tinkergym.plumbing.install import pip_install

#: A job's checkpoint names (a state folder on its server).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Losing the server more often than this within one call gives up (the scheduler's max attempts end the job anyway).
MAX_RECOVERIES = 5
#: Seconds a saved state may take to reach the scheduler's artifact store (the worker uploads it).
STORE_WAIT_S = 600.0

T = TypeVar("T")


class ServerLost(EngineError):
    """A call gave up: the job's server was lost more than :data:`MAX_RECOVERIES` times while it ran (503: send it again)."""


@dataclass
class ClusterHandle:
    """A run's or sampler's job: its backend, the calls since its newest stored state, and that state.

    ``backend`` is None for a handle restored after a restart until a request reattaches it (:meth:`ClusterEngine.attach`);
    ``resync`` then says that the job's server must be brought back to the log before the next call. ``behind`` says that
    the handle is connected to a new lease's server that has not caught up with the log yet (a catch-up that was cut
    short): the next call finishes it first."""

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
    owner: str = ""  # the run's model_id or the sampler's id (the journal's key)
    config: dict[str, Any] = field(default_factory=dict)  # the job's config: a replacement job is submitted with it
    name: str = ""
    sampler: bool = False
    resync: bool = False
    behind: bool = False


def _plain_args(method: str, args: Any) -> Any:
    """A logged call's arguments as JSON data (a load's are a state's name)."""
    if method == "forward_backward":
        return {"request": args["request"].to_dict()}
    if method == "optim_step":
        return {"params": args["params"].to_dict()}
    return args


def _call_args(method: str, data: Any) -> Any:
    from tinkergym.protocol.types import ForwardBackwardRequest, OptimParams

    if method == "forward_backward":
        return {"request": ForwardBackwardRequest.from_dict(data["request"])}
    if method == "optim_step":
        return {"params": OptimParams.from_dict(data["params"])}
    return data


def offered_tokenizer(model: str) -> tuple[str, str | None]:
    """The tokenizer clients load for an offered ``model`` (``serve tinker --offer MODEL`` without ``=TOKENIZER``), and a
    warning when they must fetch it from the Hugging Face hub (None when not).

    The SDK's ``get_tokenizer()`` hands what ``get_info`` names to ``AutoTokenizer.from_pretrained``: a folder of this
    machine loads offline, a short name (``tiny``, ``smollm2-135m``) loads nowhere. So a folder is named as is; ``tiny`` and
    ``smollm2-135m`` by their folder in tinkergym's model cache, built (or converted) first where torch is installed; a hub
    id as it is (the hub or its local cache has it). Anything else keeps its name, with the warning.
    """
    import importlib.util
    import os

    from tinkergym.backends.models import SMOLLM2_HUB_ID, SMOLLM2_NAME, TINY_NAME, default_cache_dir, resolve_model
    from tinkergym.errors import ConfigError

    local = os.path.expanduser(model)
    if model not in (TINY_NAME, SMOLLM2_NAME) and os.path.isdir(local):
        return os.path.abspath(local), None
    if "/" in model and not model.startswith((".", "/", "~")):
        return model, None
    why = "tinkergym knows no model of that name"
    if model in (TINY_NAME, SMOLLM2_NAME):
        cached = default_cache_dir() / model
        if cached.is_dir():
            return str(cached), None
        missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
        if missing:
            why = f"making its folder here needs {' and '.join(missing)} ({pip_install('train')})"
        else:
            try:
                return resolve_model(model), None
            except (ConfigError, ImportError, OSError) as exc:
                why = f"its folder cannot be made here: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    name = SMOLLM2_HUB_ID if model == SMOLLM2_NAME else model
    return name, (f"warning: --offer {model}: {why}; clients will load its tokenizer {name!r} from the Hugging Face hub. "
                  f"Name one they can read with --offer {model}=FOLDER (or =HUB_ID).")


class ClusterEngine:
    """Runs and samplers as scheduler jobs (see the module docstring). ``offers``: model name -> tokenizer id."""

    def __init__(self, scheduler_url: str, offers: dict[str, str], root: Path, *, max_lora_rank: int = 64, checkpoint_every: int = 8,
                 dtype: str = "auto", wait_timeout: float | None = None, poll: float = 0.5, say: Any = None) -> None:
        self.url, self.offers, self.root = scheduler_url, dict(offers), root
        self.max_lora_rank, self.checkpoint_every, self.dtype = max_lora_rank, checkpoint_every, dtype
        self.wait_timeout, self.poll = wait_timeout, poll
        self.say = say or (lambda line: None)
        self._tokenizers: dict[str, Any] = {}
        self._visions: dict[str, Any] = {}
        self._vision_lock = threading.Lock()
        self.journal: Any = None  # a Journal: each handle's changes are written to it (set by the service that restores from it)

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

    def vision(self, name: str) -> Any:
        """The offered model's image inputs (:class:`~tinkergym.backends.torch.vision.VisionInputs`: its image processor and
        image token, read from the offer's tokenizer folder, or a hub id's files in the local Hugging Face cache or fetched
        alone; no weights are loaded here), or None for a text model or an offer whose files cannot be read here."""
        with self._vision_lock:
            if name not in self._visions:
                from tinkergym.backends.models import is_vision_folder
                from tinkergym.backends.tokenizer_files import files_folder

                folder = files_folder(self.offers.get(name, name))
                if folder is not None and is_vision_folder(folder):
                    from tinkergym.backends.torch.vision import VisionInputs

                    self._visions[name] = VisionInputs.of_folder(folder, self.tokenizer(name))
                else:
                    self._visions[name] = None
            return self._visions[name]

    # ----- jobs -------------------------------------------------------------------------------------------------
    def _job(self, credential: str, owner: str, model: str, rank: int, seed: int | None, source: Saved | None, load_now: bool) -> ClusterHandle:
        """A job that starts from ``source`` when given (the worker restores it); a sampler (``load_now``) loads it at once, a
        run when its client's load call says how (whole, or weights only: :meth:`load`)."""
        from tinkergym.client import SchedulerClient

        if not 1 <= rank <= self.max_lora_rank:
            raise EngineError(400, f"LoRA rank {rank} is not offered: this cluster takes ranks 1 to {self.max_lora_rank}")
        config: dict[str, Any] = {"model": model, "dtype": self.dtype, "lora_rank": rank, "lora_alpha": 32.0, "seed": 0 if seed is None else seed % 2**32,
                                  "trainer": "tinker", "env": ""}
        if source is not None:
            config.update(resume_job=source.location[0], resume_checkpoint=source.location[1])
        name = f"tinker {owner}"[:200]
        backend = self._submit(SchedulerClient(self.url, credential), config, name)
        handle = ClusterHandle(backend.job_id, backend, rank, self.root / "notes" / backend.job_id, owner=owner, config=config, name=name,
                               sampler=load_now)
        handle.notes.mkdir(parents=True, exist_ok=True)
        with handle.lock:
            self._connect(handle)
            if source is not None:  # the worker restored it from the scheduler
                handle.origin = source.location
                if load_now:  # where a new lease starts from too
                    self._load(handle, source.location[1])
                    handle.stored = source.location[1]
        return handle

    def _submit(self, client: Any, config: dict[str, Any], name: str) -> Any:
        from tinkergym.backends.scheduled import ScheduledBackend
        from tinkergym.client import SchedulerError

        try:
            return ScheduledBackend.submit(client, "train", config, name=name, poll=self.poll, wait_timeout=self.wait_timeout, say=self.say)
        except SchedulerError as exc:
            raise EngineError(exc.status or 503, f"the scheduler refused the run's job: {exc}", "user" if (exc.status or 500) < 500 else "server") from exc

    # ----- a restart: handles as plain data, and back -------------------------------------------------------------
    def describe(self, handle: ClusterHandle) -> dict[str, Any]:
        """The handle as JSON data (its log is the journal's calls)."""
        return {"job_id": handle.job_id, "rank": handle.rank, "stored": handle.stored, "origin": list(handle.origin) if handle.origin else None,
                "steps": handle.steps, "config": handle.config, "name": handle.name, "sampler": handle.sampler, "closed": handle.closed}

    def restore(self, owner: str, data: dict[str, Any], calls: list[tuple[str, Any]]) -> ClusterHandle:
        """A handle of :meth:`describe`'s data and its logged ``calls``, not connected: a request reattaches it (:meth:`attach`)."""
        origin = data.get("origin")
        return ClusterHandle(str(data["job_id"]), None, int(data["rank"]), self.root / "notes" / str(data["job_id"]),
                             log=[(method, _call_args(method, args)) for method, args in calls], stored=data.get("stored"),
                             origin=(str(origin[0]), str(origin[1])) if origin else None, steps=int(data.get("steps", 0)),
                             closed=bool(data.get("closed")), owner=owner, config=dict(data.get("config") or {}), name=str(data.get("name", "")),
                             sampler=bool(data.get("sampler")))

    def attach(self, handle: ClusterHandle, credential: str) -> None:
        """Reattach a restored handle to its job with a request's key (the job's tenant's); the next call first brings the job's
        server back to the log (:meth:`_resync`). A connected handle is left as it is."""
        from tinkergym.backends.scheduled import ScheduledBackend
        from tinkergym.client import SchedulerClient

        if handle.backend is not None:  # connected: never wait for the lock here (a long call holds it; the caller is an event loop)
            return
        with handle.lock:  # a restored handle's lock is held by no call (a call needs a backend)
            if handle.backend is None and not handle.closed:
                handle.backend = ScheduledBackend(SchedulerClient(self.url, credential), handle.job_id, poll=self.poll, wait_timeout=self.wait_timeout,
                                                  say=self.say)
                handle.resync = True

    def _ready(self, handle: ClusterHandle) -> None:
        """Under the handle's lock, before a call: a reattached handle's server brought back to the log."""
        if handle.backend is None:
            raise EngineError(503, f"job {handle.job_id} is not reattached after a restart of this server; send the request again", "server")
        if handle.resync:
            self._resync(handle)
            handle.resync = False
        if handle.behind:
            self._recover(handle, "its server has not caught up with the log yet", connect=False)

    def _resync(self, handle: ClusterHandle) -> None:
        """After a restart: the newest stored state and the log, on the job's server (a sampler's server loads its state again).
        A run with no stored state gets a new job from its config (the same start) that replays the log."""
        if not handle.sampler and handle.stored is None:
            old = handle.backend
            try:
                old.client.cancel(handle.job_id)
            except Exception as exc:  # noqa: BLE001 - an old job nobody calls ends at the scheduler's idle timeout anyway
                self.say(f"job {handle.job_id}: could not cancel it ({exc}); it ends when it goes idle")
            old.close()
            backend = self._submit(old.client, handle.config, handle.name)
            self.say(f"run {handle.owner}: job {backend.job_id} replaces job {handle.job_id}, and replays {len(handle.log)} calls")
            handle.backend, handle.job_id = backend, backend.job_id
            handle.notes = self.root / "notes" / backend.job_id
            handle.notes.mkdir(parents=True, exist_ok=True)
            self._persist(handle)
        self._recover(handle, "reattached after a restart of this front door; loading its newest stored state")

    def _persist(self, handle: ClusterHandle, call: tuple[str, Any] | None = None, clear: bool = False) -> None:
        """Write the handle (and the call its log just gained, or the log's end) to the journal, if there is one."""
        if self.journal is None or not handle.owner:
            return
        logged = (len(handle.log) - 1, call[0], _plain_args(*call)) if call is not None else None
        self.journal.put_handle(handle.owner, self.describe(handle), logged, clear)

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
        return self._job(credential, run_id, model, rank, seed, source, load_now=False)

    def open_sampler(self, sampler_id: str, model: str, rank: int, source: Saved | None, credential: str) -> ClusterHandle:
        return self._job(credential, sampler_id, model, rank, 0, source, load_now=True)

    def close(self, handle: ClusterHandle, forget: bool = False, reason: str | None = None) -> None:
        """End the job (its seat is freed at once), ``reason`` its end reason (``tinkergym jobs show`` and the dashboard show it);
        its stored checkpoints stay the scheduler's. A call in flight (its client may be gone) is waited for: it holds the lock."""
        with handle.lock:
            if handle.closed:
                return
            handle.closed = True
            if handle.backend is None:  # restored and never reattached: no key to end it with
                self.say(f"job {handle.job_id}: not reattached since a restart; it ends when it goes idle")
                return
            try:
                handle.backend.complete(store_timeout=60.0, reason=reason)
            except Exception as exc:  # noqa: BLE001 - a job that cannot be ended ends when its client goes quiet
                self.say(f"job {handle.job_id}: could not end it ({exc}); it ends when it goes idle")
            handle.backend.close()

    def keepalive(self, handle: ClusterHandle) -> None:
        """Tell the job's server that its client is alive, so a client that only sends heartbeats keeps its job past the
        scheduler's idle timeout. Not under the handle's lock (a long call holds it, and is itself activity); a lost server
        is the next call's to find. A handle reattached after a restart is first brought back to its log (:meth:`_ready`,
        when no call holds its lock): until then its job's server has no connection to ping."""
        if handle.closed or handle.backend is None:
            return
        if handle.resync and handle.lock.acquire(blocking=False):
            try:
                if handle.resync and not handle.closed:
                    self._ready(handle)
            except Exception as exc:  # noqa: BLE001 - the next call meets the same trouble and answers it
                self.say(f"job {handle.job_id}: not brought back after a restart yet ({exc}); the next call tries again")
            finally:
                handle.lock.release()
        try:
            handle.backend.ping()
        except Exception as exc:  # noqa: BLE001 - see above
            self.say(f"job {handle.job_id}: keep-alive found no server ({exc})")
            self._follow(handle)

    def _follow(self, handle: ClusterHandle) -> None:
        """After a keep-alive found the job's server gone: once the job runs on a new lease, bring that server to the log
        (the newest stored state, the calls since), so the keep-alive reaches it from then on and a client that only
        sends heartbeats keeps its job across a worker's death; otherwise that server would see no call and end the job
        at the scheduler's idle timeout. Never waits: a job not yet on a new lease is looked at again by the next pass, a
        handle a call holds is the call's to recover, and a catch-up cut short is finished by the next call (``behind``)."""
        from tinkergym.client import SchedulerError

        try:
            job = handle.backend.client.show(handle.job_id)
        except (SchedulerError, OSError) as exc:
            self.say(f"job {handle.job_id}: could not look at the job ({exc}); the next keep-alive looks again")
            return
        if job.get("state") != "running" or job.get("lease_epoch") == handle.backend.epoch or not handle.lock.acquire(blocking=False):
            return
        try:
            if not handle.closed and handle.backend.epoch != job.get("lease_epoch"):
                self._recover(handle, "its server is gone while its client is idle; the job runs on a new lease", wait=False)
        except Exception as exc:  # noqa: BLE001 - the next call meets the same trouble and answers it
            self.say(f"job {handle.job_id}: not brought to its new server yet ({exc}); the next call does it")
        finally:
            handle.lock.release()

    # ----- calls, with recovery -------------------------------------------------------------------------------------
    def call(self, handle: ClusterHandle, method: str, args: dict[str, Any]) -> dict[str, Any]:
        with handle.lock:
            self._ready(handle)
            result = self._with_server(handle, lambda: self._invoke(handle, method, args), "in one call")
            if method in ("forward_backward", "optim_step"):
                handle.log.append((method, args))
                handle.steps += method == "optim_step"
                self._persist(handle, (method, args))
            if method == "optim_step" and self.checkpoint_every and handle.steps % self.checkpoint_every == 0:
                self._store(handle, f"auto-{handle.steps:06d}", required=False)
            return result

    def _invoke(self, handle: ClusterHandle, method: str, args: dict[str, Any]) -> dict[str, Any]:
        backend = handle.backend
        if method == "sample":
            return backend.sample(args["request"]).to_dict()
        if method == "logprobs":
            if args.get("images") is None:
                return {"logprobs": backend.logprobs(args["sequences"], args["temperature"])}
            return {"logprobs": backend.logprobs(args["sequences"], args["temperature"], images=args["images"])}
        if method == "forward_backward":
            return backend.forward_backward(args["request"]).to_dict()
        if method == "optim_step":
            return {"metrics": backend.optim_step(args["params"])}
        raise EngineError(400, f"unknown call {method!r}")

    def _with_server(self, handle: ClusterHandle, action: Callable[[], T], what: str) -> T:
        """Run ``action`` on the job's server; a lost server is recovered (:meth:`_recover`) and the action run again, up to
        :data:`MAX_RECOVERIES` times (then :class:`ServerLost`). A refused action (``ConfigError``) is a 400 and changes nothing.
        ``what`` completes the message: "lost its server N times <what>"."""
        from tinkergym.backends.scheduled import BackendLost
        from tinkergym.errors import ConfigError

        for attempt in range(MAX_RECOVERIES + 1):
            try:
                return action()
            except BackendLost as exc:
                if attempt == MAX_RECOVERIES:
                    raise ServerLost(503, f"job {handle.job_id} lost its server {attempt + 1} times {what}: {exc}", "server") from exc
                self.say(str(exc))
                self._recover(handle)
            except ConfigError as exc:
                raise EngineError(400, str(exc)) from exc
        raise AssertionError("unreachable")

    def _recover(self, handle: ClusterHandle, why: str = "its server is gone; waiting for the next lease", connect: bool = True,
                 wait: bool = True) -> None:
        """The job's next lease: load its newest stored state and replay the calls made since, in order. ``connect=False``: the
        handle's server is the one to catch up (it is ``behind``). ``wait=False``: a server lost during the catch-up is not
        waited for; the handle stays ``behind`` and the next call recovers it."""
        from tinkergym.backends.scheduled import BackendLost

        while True:
            self.say(f"job {handle.job_id}: {why}, then replaying {len(handle.log)} calls")
            why = "its server is gone; waiting for the next lease"
            if connect:
                self._connect(handle)
            connect = True
            handle.behind = True
            try:
                if handle.stored is not None:
                    self._load(handle, handle.stored)
                for method, args in handle.log:
                    if method in ("load", "load_weights"):
                        self._load(handle, args, weights_only=method == "load_weights")
                    else:
                        self._invoke(handle, method, args)
            except BackendLost:
                if not wait:
                    return
                continue  # lost again while catching up: the next lease starts over
            handle.behind = False
            return

    def _store(self, handle: ClusterHandle, name: str, required: bool = True) -> None:
        """Save the job's state as ``name`` and wait until the scheduler holds it; the log before it is then no longer needed.

        A server that lost its lease before its worker stored the state (the worker died or froze after the save; the
        scheduler records nothing from a lease it has moved past: ``wait_stored`` raises ``BackendLost``) is a lost server
        like any other (:meth:`_with_server`): the next lease's server, brought to the log, saves it again.

        A state the scheduler does not hold (its server lost too often, or not stored within :data:`STORE_WAIT_S`) leaves the
        log as it was: with ``required`` (a client's save: sending it again is harmless) the call answers 503, otherwise (the
        engine's own ``auto-`` states, after a call that took effect) the run goes on and the next one tries again."""
        def save() -> bool:
            handle.backend.save_state(self._note(handle, name))
            return bool(handle.backend.wait_stored(name, timeout=STORE_WAIT_S))

        try:
            stored = self._with_server(handle, save, "while saving it")
        except ServerLost as exc:
            return self._not_stored(handle, name, exc.message, required)
        if not stored:
            return self._not_stored(handle, name, f"the scheduler did not hold it within {STORE_WAIT_S:g} s", required)
        handle.stored, handle.log = name, []
        self._persist(handle, clear=True)
        return None

    def _not_stored(self, handle: ClusterHandle, name: str, why: str, required: bool) -> None:
        if required:
            raise EngineError(503, f"job {handle.job_id}: state {name} was not stored: {why}; send the save again", "server")
        self.say(f"job {handle.job_id}: state {name} was not stored ({why}); its calls stay in the log")

    # ----- checkpoints ------------------------------------------------------------------------------------------------
    def check_name(self, handle: ClusterHandle, kind: str, name: str) -> None:
        if not NAME.match(name) or name.endswith(".tmp") or name.startswith("auto-"):
            raise EngineError(400, f"checkpoint name {name[:80]!r} is not allowed: 1-128 letters, digits, '.', '_' or '-', starting with "
                                   "a letter or digit, not ending in .tmp, not starting with auto- (the engine's own)")

    def save(self, handle: ClusterHandle, kind: str, name: str) -> Saved:
        """``training`` and ``sampler``: the job's whole state (a sampler loads its weights), stored by the scheduler before this
        returns; ``external``: the job's adapter exported by its server and downloaded here (a peft folder under this front
        door's ``external/<job>/<name>``)."""
        with handle.lock:
            self._ready(handle)
            if kind != "external":
                self._store(handle, name)
                return Saved((handle.job_id, name), None)
            folder = self.root / "external" / handle.job_id / name
            folder.parent.mkdir(parents=True, exist_ok=True)
            self._with_server(handle, lambda: handle.backend.export(str(folder)), "while exporting its weights")
        return Saved(folder, folder_size(folder))

    def load(self, handle: ClusterHandle, saved: Saved, optimizer: bool) -> None:
        """Load a state of the job (or the one it started from): whole with ``optimizer``, else its weights only. A new lease
        finds it again: a whole state the job started from is where the next lease starts, any other load is in the log."""
        if not isinstance(saved.location, tuple):
            raise EngineError(400, "this checkpoint holds external weights, for download; load a training checkpoint (save_state)")
        job_id, name = saved.location
        started_from = handle.origin == saved.location
        if job_id != handle.job_id and not started_from:
            raise EngineError(400, "loading another run's state into a running run is not offered by this cluster: create a training client "
                                   "from it (create_training_client_from_state[_with_optimizer])")
        with handle.lock:
            self._ready(handle)
            # a refused load (a state of another rank, say) is a 400 and leaves the job as it was
            self._with_server(handle, lambda: self._load(handle, name, weights_only=not optimizer), "while loading a state")
            if started_from and optimizer and handle.stored is None and not handle.log:
                handle.stored = name  # the whole state a new lease restores: where the job starts over
                self._persist(handle)
            else:
                handle.log.append(("load" if optimizer else "load_weights", name))
                self._persist(handle, handle.log[-1])

    def delete(self, saved: Saved) -> None:
        """Forget the name; the scheduler keeps the job's checkpoints until its retention removes them. An external
        checkpoint's folder here is removed."""
        if isinstance(saved.location, Path):
            shutil.rmtree(saved.location, ignore_errors=True)

