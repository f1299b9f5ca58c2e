"""The training server's calls: names in the run folder, parsing and limits, running a call, the ordered worker, and the
per-session sequence store.

Nothing here knows HTTP. A call is ``(session, seq, method, args)`` with JSON args; :func:`parse_call` turns
the args into the plain-data requests of :mod:`tinkergym.protocol.types` (unknown fields and wrong JSON types
are a :class:`~tinkergym.errors.ConfigError`; the checks of single arguments are :mod:`tinkergym.serve.training.arg_checks`)
within :class:`CallLimits`, :func:`run_call` runs a parsed call on the backend (what the state calls do with saved states
past the backend's own methods is :mod:`tinkergym.serve.training.saved_states`), :class:`CallStore` accepts a session's
calls strictly in sequence order and keeps their results, so a retried number returns the stored result instead of
running again, and :class:`CallWorker` runs the accepted calls one at a time in acceptance order.

Only JSON reaches the backend: nothing a client sends is unpickled or executed, and the names of states and
exports are checked by :func:`named_dir` (one path component, no symlinks, inside the run folder).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import inspect
import json
import logging
import math
import os
import queue
import re
import secrets
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable

from tinkergym.protocol.types import ForwardBackwardRequest, OptimParams, SampleRequest, SamplingParams
from tinkergym.errors import ConfigError, NonFiniteError, TinkergymError
from tinkergym.plumbing.folders import plain_relative_parts
from tinkergym.serve.metrics import TokenTally
from tinkergym.serve.training.arg_checks import check_token_ids, checked, from_json, json_type_error, scoring_images
from tinkergym.serve.training.saved_states import load_weights_only, prune_states

#: Names of states and exports: one path component of letters, digits, ``.``, ``_`` and ``-``.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: A snapshot's id, as :class:`Snapshots` makes them.
SNAPSHOT_ID = re.compile(r"v[0-9]{1,12}-[0-9]{1,12}")  # whole string (fullmatch): no trailing newline, ASCII digits only

#: Where named folders live inside the run folder (``external``: the Tinker API's downloadable adapters, kept apart from exports).
KINDS = {"states": "states", "exports": "exports", "external": "external"}


class SequenceError(TinkergymError, ValueError):
    """A call number that is neither the next one nor a retry of a kept one, or a retry with other arguments."""


class UnknownSessionError(TinkergymError, KeyError):
    """A session id the server never issued (or forgot: it keeps a bounded number of sessions)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# ----- names --------------------------------------------------------------------------------------------
def named_dir(run_dir: Path, kind: str, name: Any) -> Path:
    """``run_dir/<kind>/<name>`` after checking ``name``; a bad name or a symlink on the way is a :class:`ConfigError`.

    ``run_dir`` must be resolved already. The ``.tmp`` siblings that atomic writes use are checked too, and
    names ending in ``.tmp`` are refused: those are the folders of writes in progress.
    """
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name.endswith(".tmp"):
        raise ConfigError(
            f"name {str(name)[:80]!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit, one path component, not ending in '.tmp'"
        )
    parent = run_dir / KINDS[kind]
    folder = parent / name
    for path in (parent, folder, Path(f"{folder}.tmp"), Path(f"{folder}.old.tmp")):
        if path.is_symlink():
            raise ConfigError(f"{kind}/{name}: {path.name} is a symbolic link, which the server never follows")
    if os.path.commonpath([os.path.realpath(folder), str(run_dir)]) != str(run_dir):
        raise ConfigError(f"{kind}/{name} resolves outside the run folder")
    return folder


def file_in(folder: Path, relative: str) -> Path:
    """The regular file ``folder/relative``: no empty, ``.`` or ``..`` component, no symlink; else :class:`FileNotFoundError`."""
    parts = plain_relative_parts(relative)
    if parts is None:
        raise FileNotFoundError(relative)
    path = folder
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise FileNotFoundError(relative)
    if not path.is_file():
        raise FileNotFoundError(relative)
    return path


def file_listing(folder: Path) -> list[dict[str, Any]]:
    """``[{"path", "size", "sha256"}]`` of every regular file under ``folder``, paths relative and sorted."""
    listing = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        listing.append({"path": path.relative_to(folder).as_posix(), "size": path.stat().st_size, "sha256": digest.hexdigest()})
    return listing


# ----- limits and parsing -------------------------------------------------------------------------------
def sample_tokens(request: SampleRequest) -> int:
    """The tokens a sample call holds at most: every sequence's prompt and ``max_new_tokens``."""
    return request.num_samples * (sum(map(len, request.prompts)) + len(request.prompts) * request.params.max_new_tokens)


@dataclass(frozen=True)
class CallLimits:
    """What one call may ask of the backend, checked from the request's numbers before anything is allocated.

    ``num_samples``: completions per prompt; ``new_tokens``: a sample call's ``max_new_tokens``; ``sequences``: the
    sequences a call holds (a sample call's prompts times ``num_samples``, a training or scoring call's rows);
    ``tokens``: the tokens a call holds (a sample call's prompt and new tokens of every sequence it makes, a
    training or scoring call's summed row lengths). Each is a ``serve backend`` option, named in the refusal and
    listed by ``GET /v1/info``.
    """

    num_samples: int = 4096
    new_tokens: int = 1 << 20
    sequences: int = 1 << 16
    tokens: int = 1 << 27

    #: The serve backend option of each limit.
    OPTIONS = {"num_samples": "--max-num-samples", "new_tokens": "--max-request-new-tokens", "sequences": "--max-request-sequences",
               "tokens": "--max-request-tokens"}

    def as_dict(self) -> dict[str, int]:
        """The limits by name, as ``/v1/info`` lists them."""
        return {"max_" + f.name: getattr(self, f.name) for f in fields(self)}

    def check(self, name: str, value: int, where: str, what: str) -> None:
        """Refuse ``value`` over the limit ``name`` with a :class:`ConfigError` that names the limit and its option."""
        limit = getattr(self, name)
        if value > limit:
            raise ConfigError(f"{where}: {value:,} {what} is over this server's limit of {limit:,} ({self.OPTIONS[name]} on serve backend; "
                              f"GET /v1/info lists the limits): split the request into smaller calls")

    def check_sample(self, request: SampleRequest) -> None:
        """A sample request's samples per prompt, new tokens, sequences and held tokens."""
        if request.num_samples < 1 or request.params.max_new_tokens < 0:
            raise ConfigError("args.request: num_samples must be >= 1 and params.max_new_tokens >= 0")
        self.check("num_samples", request.num_samples, "args.request.num_samples", "samples per prompt")
        self.check("new_tokens", request.params.max_new_tokens, "args.request.params.max_new_tokens", "new tokens")
        self.check("sequences", len(request.prompts) * request.num_samples, "args.request", "sequences (prompts x num_samples)")
        self.check("tokens", sample_tokens(request), "args.request", "tokens (num_samples x (prompt tokens + max_new_tokens) over the prompts)")

    def check_rows(self, rows: list[list[int]], where: str) -> None:
        """A training or scoring call's rows and their summed length."""
        self.check("sequences", len(rows), where, "sequences")
        self.check("tokens", sum(map(len, rows)), where, "tokens")


def check_optim(params: OptimParams) -> None:
    """AdamW's own bounds on its settings (the backend sets them per step, past the optimizer's constructor checks), and
    no NaN or infinity where one writes NaN into the weights. A :class:`ConfigError` names the setting."""
    bounds: dict[str, tuple[Callable[[float], bool], str]] = {
        "learning_rate": (lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
        "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
        "eps": (lambda v: 0 < v < math.inf, "a finite number > 0"),  # 0 divides 0 by 0 where a gradient is 0
        "weight_decay": (lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        "max_grad_norm": (lambda v: v >= 0, "a number >= 0 (0: no clipping)"),
    }
    for name, (fits, wanted) in bounds.items():
        value = getattr(params, name)
        if not fits(value):  # NaN fits nothing
            raise ConfigError(f"args.params.{name} must be {wanted}, got {value!r}")


def _only(args: dict[str, Any], method: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    unknown = set(args) - set(required) - set(optional)
    missing = [k for k in required if k not in args]
    if unknown or missing:
        raise ConfigError(
            f"{method} takes args {list(required) + list(optional)} ({', '.join(optional) or 'none'} optional); "
            f"unknown: {sorted(unknown)}, missing: {missing}"
        )


@dataclass
class ParsedCall:
    """A checked call: the backend method to run with its plain-data arguments."""

    method: str
    args: dict[str, Any]


def parse_call(method: Any, args: Any, vocab_size: int | None = None, limits: CallLimits = CallLimits()) -> ParsedCall:
    """Check a call's JSON ``args`` and build the backend's arguments; anything wrong, or over ``limits``, is a
    :class:`ConfigError`."""
    if not isinstance(args, dict):
        raise json_type_error("args", "an object", args)
    if method == "snapshot":
        _only(args, method, ())
        return ParsedCall(method, {})
    if method == "sample":
        _only(args, method, ("request",), ("snapshot",))
        request = from_json(SampleRequest, args["request"], "args.request")
        snapshot = args.get("snapshot")
        if snapshot is not None and not (isinstance(snapshot, str) and SNAPSHOT_ID.fullmatch(snapshot)):
            raise ConfigError(f"args.snapshot must be a snapshot id a snapshot call answered, not {str(snapshot)[:40]!r}")
        try:
            request.params.check()
        except ValueError as exc:
            raise ConfigError(f"args.request.params.{exc}") from None
        limits.check_sample(request)
        check_token_ids(request.prompts, vocab_size, "args.request.prompts")
        return ParsedCall(method, {"request": request, "snapshot": snapshot})
    if method == "logprobs":
        _only(args, method, ("sequences",), ("temperature", "images"))
        sequences = checked(args["sequences"], list[list[int]], "args.sequences")
        limits.check_rows(sequences, "args.sequences")
        check_token_ids(sequences, vocab_size, "args.sequences")
        parsed = {"sequences": sequences, "temperature": checked(args.get("temperature", 1.0), float, "args.temperature")}
        if not 0 < parsed["temperature"] <= SamplingParams.MAX_TEMPERATURE:  # NaN fails the comparison too
            raise ConfigError(f"args.temperature must be in (0, {SamplingParams.MAX_TEMPERATURE:g}], not {parsed['temperature']!r}")
        if args.get("images") is not None:
            parsed["images"] = scoring_images(args["images"], len(sequences))
        return ParsedCall(method, parsed)
    if method == "forward_backward":
        _only(args, method, ("request",))
        request = from_json(ForwardBackwardRequest, args["request"], "args.request")
        limits.check_rows([d.tokens for d in request.data], "args.request.data")
        if request.num_tokens is not None and not 0 <= request.num_tokens < math.inf:
            raise ConfigError(f"args.request.num_tokens must be the batch's summed loss mask: a finite number >= 0, not {request.num_tokens!r}")
        check_token_ids([d.tokens for d in request.data], vocab_size, "args.request.data.tokens")
        return ParsedCall(method, {"request": request})
    if method == "optim_step":
        _only(args, method, ("params",))
        params = from_json(OptimParams, args["params"], "args.params")
        check_optim(params)
        return ParsedCall(method, {"params": params})
    if method == "save_state":
        _only(args, method, ("name",))
        return ParsedCall(method, {"name": checked(args["name"], str, "args.name")})
    if method == "load_state":
        _only(args, method, ("name",), ("weights_only",))
        return ParsedCall(method, {"name": checked(args["name"], str, "args.name"),
                                   "weights_only": checked(args.get("weights_only", False), bool, "args.weights_only")})
    if method == "export":
        _only(args, method, ("name",), ("merged",))
        return ParsedCall(method, {"name": checked(args["name"], str, "args.name"), "merged": checked(args.get("merged", False), bool, "args.merged")})
    known = "sample, logprobs, forward_backward, optim_step, save_state, load_state, export, snapshot"
    raise ConfigError(f"unknown method {str(method)[:60]!r}; the methods are: {known}")


# ----- running a call -----------------------------------------------------------------------------------
def wire_result(method: str, value: Any) -> dict[str, Any]:
    """The JSON result of a ``sample``, ``logprobs`` or ``forward_backward`` call from what the backend returned."""
    return {"logprobs": value} if method == "logprobs" else value.to_dict()


class Snapshots:
    """The snapshots of a server's weights its client samples from while it trains (``async_steps``): a ``snapshot`` call
    takes one (``backend.sampling_snapshot()``) and answers its id and version; a ``sample`` call naming the id samples
    from it. The newest ``keep`` are held (a run needs K + 1 at most; serve backend holds 8 of a LoRA backend, 3 of a full
    fine-tuning one, each a copy of the model); a sample from an older one is refused."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._held: OrderedDict[str, Any] = OrderedDict()
        self._taken = 0

    def take(self, backend: Any) -> dict[str, Any]:
        """A snapshot of ``backend``'s weights now: ``{"snapshot": id, "version": its optimizer steps}``."""
        take = getattr(backend, "sampling_snapshot", None)
        if not callable(take):
            raise ConfigError(f"this server's backend ({type(backend).__name__}) takes no snapshots to sample from while it trains: "
                              "leave out --async-steps")
        snapshot = take()
        self._taken += 1
        snapshot_id = f"v{int(snapshot.version)}-{self._taken}"
        self._held[snapshot_id] = snapshot
        while len(self._held) > self.keep:
            self._held.popitem(last=False)
        return {"snapshot": snapshot_id, "version": int(snapshot.version)}

    def get(self, snapshot_id: str) -> Any:
        """The held snapshot ``snapshot_id``; a :class:`ConfigError` once it is gone."""
        snapshot = self._held.get(snapshot_id)
        if snapshot is None:
            raise ConfigError(f"snapshot {snapshot_id!r} is not held (this server keeps its newest {self.keep}, and none across a "
                              "restart): take a new one with a snapshot call")
        return snapshot


def run_call(backend: Any, call: ParsedCall, run_dir: Path, keep_states: int = 0, snapshots: Snapshots | None = None) -> dict[str, Any]:
    """Run a checked call on ``backend`` and return its JSON result (names are checked again, now, before use).

    With ``keep_states`` > 0, a ``save_state`` leaves only that many saved states (the newest) in the run folder.
    ``snapshots``: where ``snapshot`` calls keep what a ``sample`` call may name (None: the server takes none).
    """
    args = call.args
    if call.method == "snapshot" or (call.method == "sample" and args.get("snapshot") is not None):
        if snapshots is None:
            raise ConfigError(f"this server ({type(backend).__name__}) takes no snapshots to sample from while it trains: leave out --async-steps")
        if call.method == "snapshot":
            return snapshots.take(backend)
        return wire_result(call.method, snapshots.get(args["snapshot"]).sample(args["request"]))
    if call.method == "sample":
        return wire_result(call.method, backend.sample(args["request"]))
    if call.method == "logprobs":
        if args.get("images") is None:
            return wire_result(call.method, backend.logprobs(args["sequences"], args["temperature"]))
        if "images" not in inspect.signature(backend.logprobs).parameters:
            raise ConfigError(f"this server's backend ({type(backend).__name__}) scores no images in logprobs: score sequences with "
                              "images with forward_backward (a Datum with its images, loss_scale 0, return_logprobs=True), or on a "
                              "shared server (serve shared) of a vision-language model")
        return wire_result(call.method, backend.logprobs(args["sequences"], args["temperature"], images=args["images"]))
    if call.method == "forward_backward":
        return wire_result(call.method, backend.forward_backward(args["request"]))
    if call.method == "optim_step":
        return {"metrics": {str(k): float(v) for k, v in backend.optim_step(args["params"]).items()}}
    if call.method == "save_state":
        folder = named_dir(run_dir, "states", args["name"])
        folder.parent.mkdir(parents=True, exist_ok=True)
        backend.save_state(str(folder))
        pruned = prune_states(run_dir, keep_states, folder) if keep_states > 0 else []
        return {"pruned": pruned} if pruned else {}
    if call.method == "load_state":
        folder = named_dir(run_dir, "states", args["name"])
        if not folder.is_dir():
            raise ConfigError(f"no saved state named {args['name']!r}; save one with save_state first")
        if any(p.is_symlink() for p in folder.iterdir()):
            raise ConfigError(f"states/{args['name']} holds a symbolic link, which the server never follows")
        if args.get("weights_only"):
            load_weights_only(backend, folder, run_dir)
        else:
            backend.load_state(str(folder))
        return {}
    if call.method == "export":
        folder = named_dir(run_dir, "exports", args["name"])
        folder.parent.mkdir(parents=True, exist_ok=True)
        backend.export(str(folder), merged=args["merged"])
        return {"name": args["name"], "files": file_listing(folder)}
    raise ConfigError(f"unknown method {call.method!r}")


# ----- outcomes -----------------------------------------------------------------------------------------
@dataclass
class CallError:
    """A failed call as the client sees it: HTTP status, error type and a message without traceback."""

    status: int
    type: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` body."""
        return {"error": {"type": self.type, "message": self.message}}


def call_error(exc: BaseException, request_id: str, logger: logging.Logger) -> CallError:
    """Map an exception to what the client sees: bad input is 400 with its message, diverged weights 409 (the model's state,
    not the server, is at fault: load a saved state), anything else 500 (traceback only in the log)."""
    if isinstance(exc, (ConfigError, ValueError, TypeError)):
        return CallError(400, "invalid_request", str(exc)[:2000])
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    logger.error(json.dumps({"event": "call_failed", "request_id": request_id, "error": type(exc).__name__, "traceback": trace}))
    if isinstance(exc, NonFiniteError):
        return CallError(409, type(exc).__name__, f"{str(exc)[:2000]}; load a saved state (load_state) to go on")
    if isinstance(exc, TinkergymError):  # deliberate errors (a diverged run) say what happened
        return CallError(500, type(exc).__name__, str(exc)[:2000])
    return CallError(500, "internal", f"the call failed on the server ({type(exc).__name__}); request id {request_id} in the server log")


# ----- records, the store and the worker ---------------------------------------------------------------
@dataclass
class CallRecord:
    """One accepted call and, once it ran, its result or error; waiters are woken when it finishes."""

    request_id: str
    session_id: str
    seq: int
    method: str
    fingerprint: str
    call: ParsedCall | None  # None when checking the args already failed (error is set)
    result: dict[str, Any] | None = None
    error: CallError | None = None
    done: bool = False
    _waiters: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self, result: dict[str, Any] | None = None, error: CallError | None = None) -> None:
        """Store the outcome and wake every waiter (each waiter is a thread-safe callback)."""
        with self._lock:
            self.result, self.error, self.done = result, error, True
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def on_done(self, wake: Callable[[], None]) -> bool:
        """Register ``wake`` for when the call finishes; False (nothing registered) when it already has."""
        with self._lock:
            if self.done:
                return False
            self._waiters.append(wake)
            return True

    def forget(self, wake: Callable[[], None]) -> None:
        """Unregister ``wake`` (its waiter gave up)."""
        with self._lock:
            if wake in self._waiters:
                self._waiters.remove(wake)


def fingerprint(method: Any, args: Any) -> str:
    """A digest of a call's method and args (key order does not matter), to tell a true retry from a different call."""
    text = json.dumps([method, args], sort_keys=True, separators=(",", ":"), allow_nan=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class _Session:
    last_seq: int = 0
    records: OrderedDict[int, CallRecord] = field(default_factory=OrderedDict)


class CallStore:
    """Sessions and their last ``keep`` calls; accepts ``seq == last + 1`` and returns kept records for retries.

    At most ``max_sessions`` sessions are kept (the least recently used is forgotten), so memory stays bounded.
    """

    def __init__(self, keep: int = 16, max_sessions: int = 64) -> None:
        self.keep = keep
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._by_id: dict[str, CallRecord] = {}
        self._lock = threading.Lock()

    def new_session(self) -> str:
        """A fresh session id (32 hex characters)."""
        session_id = secrets.token_hex(16)
        with self._lock:
            self._sessions[session_id] = _Session()
            while len(self._sessions) > self.max_sessions:
                _, old = self._sessions.popitem(last=False)
                for record in old.records.values():
                    self._by_id.pop(record.request_id, None)
        return session_id

    def accept(self, session_id: str, seq: int, method: Any, args: Any, parse: Callable[[], ParsedCall]) -> tuple[CallRecord, bool]:
        """The record of call ``seq`` and whether it is new (to be run); raises :class:`UnknownSessionError` or :class:`SequenceError`.

        ``parse`` checks the args of a new call; when it fails the call is still accepted (its number is used)
        and its stored outcome is that error.
        """
        print_fp = fingerprint(method, args)
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise UnknownSessionError(f"unknown session {session_id[:64]!r}; create one with POST /v1/sessions")
            self._sessions.move_to_end(session_id)
            kept = session.records.get(seq)
            if kept is not None:
                if kept.fingerprint != print_fp:
                    raise SequenceError(f"seq {seq} was already accepted with other method or args; expected seq {session.last_seq + 1} for a new call")
                return kept, False
            if seq != session.last_seq + 1:
                raise SequenceError(f"seq {seq} is out of order: expected seq {session.last_seq + 1} (or a retry of one of the last {len(session.records)} calls)")
            request_id = secrets.token_hex(16)
            try:
                call, error = parse(), None
            except ConfigError as exc:
                call, error = None, CallError(400, "invalid_request", str(exc)[:2000])
            record = CallRecord(request_id, session_id, seq, str(method), print_fp, call)
            if error is not None:
                record.finish(error=error)
            session.last_seq = seq
            session.records[seq] = record
            self._by_id[request_id] = record
            while len(session.records) > self.keep:
                _, old = session.records.popitem(last=False)
                self._by_id.pop(old.request_id, None)
            return record, True

    def get(self, request_id: str) -> CallRecord | None:
        """The kept record with this id, or None."""
        with self._lock:
            return self._by_id.get(request_id)


_T = TypeVar("_T")


def snapshots_for(backend: Any) -> Snapshots:
    """What the client samples from while the server trains (async steps): a LoRA snapshot is the adapter's size, a full
    fine-tuning one a whole model, so fewer of those are held."""
    return Snapshots(keep=8 if getattr(backend, "is_lora", True) else 3)


@dataclass
class _WorkerTask:
    """A function a worker's thread runs between calls (:meth:`CallWorker.run`), and the future it answers through."""

    function: Callable[[], Any]
    future: concurrent.futures.Future[Any]

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.function())
        except BaseException as exc:  # noqa: BLE001 - whatever it raised is raised again where run() waits
            self.future.set_exception(exc)


class CallWorker:
    """One thread that runs accepted calls on the backend, strictly in the order they were submitted.

    Made with :meth:`building`, the same thread also builds the backend, so that one thread runs every torch operation
    of the server, as the trainer keeps its own (``TrainerThreadCalls`` in ``tinkergym.trainers.async_rollouts``): on a
    CPU each thread that runs torch operations gets an OpenMP team of its own, and two threads that both keep running
    torch work slow each other's decodes (1.7x measured). A model loaded once on another thread was measured not to
    (``benchmarks/remote_step.py``: the same ratio to a local step either way), so this is the rule, not a speed-up.
    """

    def __init__(self, backend: Any, run_dir: Path, logger: logging.Logger, keep_states: int = 0) -> None:
        self.backend = backend
        self.snapshots = snapshots_for(backend)
        self.run_dir = run_dir
        self.logger = logger
        self.keep_states = keep_states
        self.pending = 0  # calls submitted and not finished
        self.last_done = time.monotonic()
        #: ``observer(method, call, result, ok, seconds)`` after each call (the server's metrics), or None.
        self.observer: Callable[[str, Any, Any, bool, float], None] | None = None
        self.tokens = TokenTally()  # what the server's calls trained and sampled (GET /v1/usage)
        self._queue: queue.Queue[CallRecord | _WorkerTask | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @classmethod
    def building(cls, build: Callable[[], Any], run_dir: Path, logger: logging.Logger, keep_states: int = 0) -> CallWorker:
        """A worker whose backend is ``build()``, called on the worker's own thread (what it raises is raised here)."""
        worker = cls(None, run_dir, logger, keep_states)
        worker.backend = worker.run(build)
        worker.snapshots = snapshots_for(worker.backend)
        return worker

    def run(self, function: Callable[[], _T]) -> _T:
        """Run ``function`` on the worker's thread after the calls submitted before it; return what it returns."""
        if threading.current_thread() is self._thread:
            return function()
        task = _WorkerTask(function, concurrent.futures.Future())
        with self._start_lock:
            self._start()
        self._queue.put(task)
        result: _T = task.future.result()
        return result

    def submit(self, record: CallRecord) -> None:
        """Queue ``record`` to run after every call submitted before it (the thread starts on first use)."""
        with self._start_lock:
            self.pending += 1
            self._start()
        self._queue.put(record)

    def _start(self) -> None:
        """Start the thread unless it runs (under ``_start_lock``)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="tinkergym-backend-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Let the thread finish the call it is running and end."""
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _loop(self) -> None:
        while (record := self._queue.get()) is not None:
            if isinstance(record, _WorkerTask):
                record.run()
                continue
            start = time.perf_counter()
            result, error = None, None
            try:
                result = run_call(self.backend, record.call, self.run_dir, self.keep_states, self.snapshots)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - any failure becomes the call's stored outcome
                error = call_error(exc, record.request_id, self.logger)
            seconds = time.perf_counter() - start
            self.logger.info(json.dumps({
                "event": "call", "request_id": record.request_id, "session": record.session_id, "seq": record.seq,
                "method": record.method, "ok": error is None, "duration_ms": round(1000 * seconds, 1),
            }))
            if self.observer is not None:
                self.observer(record.method, record.call, result, error is None, seconds)
            if error is None:
                self.tokens.add(record.method, record.call, result)
            record.finish(result=result, error=error)
            with self._start_lock:
                self.pending -= 1
                self.last_done = time.monotonic()
