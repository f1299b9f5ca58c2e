"""What the Tinker API's routes share: :class:`TinkerService`, which holds tenants' sessions, training runs, samplers, futures
and checkpoints (their records are :mod:`tinkergym.tinker_api.records`), its :class:`Limits`, and signed download URLs.

A Tinker training run (``create_model``) is a LoRA adapter that an engine (:mod:`tinkergym.tinker_api.engines`)
opens: a session of a shared base in this process, or a scheduler job. A sampler is an adapter of its own holding
a snapshot of some weights (a saved checkpoint, a run's current weights, or the base: a new adapter is the base,
its B matrices being zero).

Each request the SDK sends becomes a future (``request_id``): a Python operation on the executor of its training
run (one thread per run, so a run's requests run in the order they arrived, which the SDK makes their ``seq_id``
order) or on the samplers' pool. ``retrieve_future`` waits for it a while and answers ``try_again`` until it is
done. A tenant reaches only its own sessions, runs, samplers, futures and checkpoints: anything else answers as if
it did not exist (404).

A session ends when its client finishes it (the SDK's ``close``) or, once it has sent no heartbeat for
:attr:`Limits.session_timeout_s` (the SDK sends one every :data:`SDK_HEARTBEAT_S` while its ``ServiceClient`` lives, idle
or not), at the next maintenance pass (every :attr:`Limits.maintenance_s`, whether or not anyone calls): its runs and
samplers are closed with the reason, which a cluster's jobs keep as their end reason. A run with checkpoints stays listed,
so its ``tinker://`` paths still load. Another tenant's heartbeats are 404s and keep nothing alive.

A checkpoint is ``tinker://<model_id>/weights/<name>`` (``save_state``: adapter, Adam moments, step and generator),
``tinker://<model_id>/sampler_weights/<name>`` (``save_weights_for_sampler``) or
``tinker://<model_id>/external_weights/<name>`` (``save_weights_external``: a peft adapter folder, which
``get_external_weights_urls`` hands out as one signed download URL per file); the engine keeps it.

With a :class:`~tinkergym.tinker_api.journal.Journal` (the cluster's front door), the sessions, runs, samplers,
checkpoints, request ids and the results of runs' requests are written to disk as they change, and a service made on the
same journal starts with them (:meth:`TinkerService.restore`, which :func:`~tinkergym.tinker_api.journal.restore_records`
does): a restart keeps every name a client holds.

A signed URL names a file of an external checkpoint and when it expires, with an HMAC-SHA256 of both under a key
that lives only in this process: it needs no API key (as a storage bucket's signed URL), answers nothing once it has
expired or its checkpoint was deleted, and reaches no other file.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from tinkergym.tinker_api import losses as tinker_losses
from tinkergym.tinker_api.engines import EngineError, Saved
from tinkergym.tinker_api.journal import decode_result, encode_result, restore_records
from tinkergym.tinker_api.records import Checkpoint, Pending, Run, Sampler, Session, utc_now

#: Checkpoint kinds and their ``tinker://`` segment and folder.
KINDS = {"training": ("weights", "states"), "sampler": ("sampler_weights", "exports"), "external": ("external_weights", "external")}
SEGMENTS = {segment: kind for kind, (segment, _) in KINDS.items()}
#: Seconds a signed download URL of an external checkpoint's file stays valid.
EXTERNAL_URL_TTL_S = 3600
#: The route that serves those files (no API key: the URL's signature is the credential).
EXTERNAL_FILES_ROUTE = "/api/v1/external_weights_files"
#: The longest signed token a download may carry (a longer one is refused before it is decoded).
MAX_SIGNED_TOKEN = 2048
#: Seconds between the session heartbeats the tinker SDK (0.38) sends on its own, from a background thread, for as long as its
#: ``ServiceClient`` lives (whether or not the script calls anything); it warns after 120 s without an answered one.
SDK_HEARTBEAT_S = 10.0


#: A request refused with an HTTP status; ``category`` is the SDK's ``RequestErrorCategory`` (user or server).
TinkerError = EngineError


def not_found(what: str) -> TinkerError:
    return TinkerError(404, f"{what} not found (it does not exist, or it belongs to another key's tenant)")


def owned(found: Any, tenant: str, what: str) -> Any:
    """``found`` when it exists and is ``tenant``'s; anything else answers as if it did not exist."""
    if found is None or found.tenant != tenant:
        raise not_found(what)
    return found


@dataclass
class Limits:
    """What one tenant may hold at once, and the sizes of one request."""

    max_runs_per_tenant: int = 8
    max_kept_runs_per_tenant: int = 256
    max_samplers_per_tenant: int = 32
    max_sessions_per_tenant: int = 16
    max_pending_per_tenant: int = 1024
    max_checkpoints_per_run: int = 64
    max_datums: int = 4096
    max_tokens: int = 1 << 22
    max_new_tokens: int = 1 << 14
    max_num_samples: int = 256
    max_body_bytes: int = 256 << 20  # one request's body (413 past it): max_tokens of JSON token ids, masks and advantages fit
    keep_done_futures: int = 4096
    #: Seconds without a heartbeat after which a session ends, its runs and samplers closed (a cluster's jobs ended, their seats
    #: freed; their saved states kept): 18 of the SDK's heartbeat periods (:data:`SDK_HEARTBEAT_S`), so a client that lives
    #: (idle or not) never comes near it, and past the SDK's own warning that its heartbeats fail (120 s).
    session_timeout_s: float = 180.0
    #: Seconds between passes that end sessions without heartbeats and keep live sessions' jobs alive (see :meth:`TinkerService.maintain`).
    maintenance_s: float = 30.0


class TinkerService:
    """The Tinker API's state on one shared base (see the module docstring)."""

    def __init__(self, engine: Any, logger: logging.Logger, limits: Limits | None = None, journal: Any = None) -> None:
        self.engine, self.logger = engine, logger
        self.limits = limits or Limits()
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures: dict[str, Pending] = {}
        #: Sessions ended here, newest last (id -> tenant; at most ``keep_done_futures``): finishing one again answers as the first time.
        self.ended: OrderedDict[str, str] = OrderedDict()
        self.journal = journal
        self._lock = threading.RLock()
        self._url_key = secrets.token_bytes(32)  # signs download URLs; a restarted server's URLs are void, as its checkpoints are
        self._sampling = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tinker-sample")
        self._keepalive_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tinker-keepalive")
        self._closing_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tinker-session-end")
        self._keeping_alive: set[int] = set()
        #: Runs being opened (model_id -> tenant, and the future of the run): a retried creation waits for the first.
        self._opening: dict[str, tuple[str, concurrent.futures.Future]] = {}
        if journal is not None:
            engine.journal = journal
            self.restore()
        threading.Thread(target=_maintain_while_alive, args=(weakref.ref(self), self.limits.maintenance_s), name="tinker-maintenance",
                         daemon=True).start()

    # ----- the journal: what a restart keeps -----------------------------------------------------------------
    def _write(self, method: str, *args: Any) -> None:
        """``journal.<method>(*args)`` when there is a journal."""
        if self.journal is not None:
            getattr(self.journal, method)(*args)

    def restore(self) -> None:
        """Start with what the journal holds (:func:`~tinkergym.tinker_api.journal.restore_records`): sessions (their heartbeat
        clocks start now), runs and samplers (their handles not connected until a request reattaches them, :meth:`attach`) and
        checkpoints."""
        data = self.journal.load()
        with self._lock:
            restore_records(data, self.engine, self.sessions, self.runs, self.samplers)
        self.logger.info(json.dumps({"event": "tinker_restored", "sessions": len(data["sessions"]), "runs": len(data["runs"]),
                                     "samplers": len(data["samplers"]), "checkpoints": len(data["checkpoints"])}))

    def attach(self, found: Any, credential: str | None) -> Any:
        """``found`` (a run or sampler) with its handle reattached to its job with the request's key, where the engine's handles
        outlive a restart; ``found`` itself."""
        attach = getattr(self.engine, "attach", None)
        if attach is not None and credential:
            attach(found.handle, credential)
        return found

    def _keep_result(self, request_id: str, future: concurrent.futures.Future) -> None:
        """A run's request's result, written to the journal once done, so that it is answered after a restart."""
        if future.cancelled() or future.exception() is not None:
            return
        try:
            self.journal.put_result(request_id, encode_result(future.result()))
        except Exception as exc:  # noqa: BLE001 - the answer in memory stands; only a restart would lose it
            self.logger.warning(json.dumps({"event": "tinker_result_not_kept", "request_id": request_id, "error": str(exc)[:500]}))

    def maintain(self) -> None:
        """End the sessions whose client stopped sending heartbeats (their adapters freed even on a server nobody calls, a
        cluster's jobs ended with the reason), and keep the jobs of live sessions from their idle timeout where the engine's runs
        are jobs (``engine.keepalive``). The lock is held only to read and change the tables: the jobs end after it."""
        with self._lock:
            lapsed = [(session, self._take_session(session)) for session in self._lapsed_sessions()]
            handles = [r.handle for r in self.runs.values() if not r.closed and r.session_id in self.sessions]
            handles += [s.handle for s in self.samplers.values() if s.session_id in self.sessions]
        keepalive = getattr(self.engine, "keepalive", None)
        for handle in handles:  # each a request to a job's server, on a pool: a server that hangs holds back no other
            if keepalive is None or id(handle) in self._keeping_alive:
                continue
            self._keeping_alive.add(id(handle))
            self._keepalive_pool.submit(self._keep_alive, keepalive, handle)
        why = (f"its Tinker session ended: no heartbeat from the client for {self.limits.session_timeout_s:g} s (the client stopped without "
               "ServiceClient.close); the run's saved states are kept: create_training_client_from_state(path) resumes it")
        ending = [self._closing_pool.submit(self._close_all, session, closing, why) for session, closing in lapsed]
        concurrent.futures.wait(ending, timeout=self.limits.maintenance_s)  # one slow to end (a call in flight holds its job) goes on alone

    def _keep_alive(self, keepalive: Callable[[Any], None], handle: Any) -> None:
        try:
            keepalive(handle)
        finally:
            self._keeping_alive.discard(id(handle))

    # ----- sessions -----------------------------------------------------------------------------------
    def create_session(self, tenant: str) -> str:
        with self._lock:
            deadline = time.monotonic() - self.limits.session_timeout_s
            mine = [s for s in self.sessions.values() if s.tenant == tenant and s.last_heartbeat >= deadline]  # lapsed ones end at the next pass
            if len(mine) >= self.limits.max_sessions_per_tenant:
                raise TinkerError(429, f"this tenant has {len(mine)} sessions open, its most; let idle ones lapse "
                                       f"({self.limits.session_timeout_s:.0f} s without a heartbeat) or end them")
            session_id = "session-" + secrets.token_hex(8)
            now = time.monotonic()
            self.sessions[session_id] = Session(session_id, tenant, now, now)
            self._write("put_session", session_id, tenant, time.time())
        return session_id

    def session(self, tenant: str, session_id: str) -> Session:
        return owned(self.sessions.get(session_id), tenant, f"session {session_id[:80]!r}")

    def heartbeat(self, tenant: str, session_id: str, credential: str | None = None) -> None:
        """A session's client is alive. After a restart (the engine's handles outlive it), the first heartbeat that brings the
        key reattaches the session's runs and samplers to their jobs and starts bringing their servers back (on the keep-alive
        pool), so a client that only sends heartbeats keeps its jobs, and its next call finds its server ready. Another
        tenant's heartbeat is a 404 and keeps nothing alive."""
        with self._lock:
            self.session(tenant, session_id).last_heartbeat = time.monotonic()
            objects: list[Run | Sampler] = [*self.runs.values(), *self.samplers.values()]
            detached = [f for f in objects
                        if f.session_id == session_id and f.tenant == tenant and getattr(f.handle, "backend", True) is None
                        and not getattr(f, "closed", False)]
        keepalive = getattr(self.engine, "keepalive", None)
        for one in detached:
            self.attach(one, credential)
            if keepalive is not None and id(one.handle) not in self._keeping_alive:
                self._keeping_alive.add(id(one.handle))
                self._keepalive_pool.submit(self._keep_alive, keepalive, one.handle)

    def _lapsed_sessions(self) -> list[Session]:
        """Under the lock: the sessions whose client sent no heartbeat for ``session_timeout_s``."""
        deadline = time.monotonic() - self.limits.session_timeout_s
        return [s for s in self.sessions.values() if s.last_heartbeat < deadline]

    def finish_session(self, tenant: str, session_id: str) -> None:
        """The client ends its session (the SDK's ``close``): its runs and samplers are closed. Finishing a session this
        tenant has ended already answers the same, so a retry whose first attempt ended it (the answer lost, or slow to come
        while its jobs ended) does not fail; another tenant's session, or one never opened, is a 404."""
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None and self.ended.get(session_id) == tenant:
                return
            session = self.session(tenant, session_id)
        self.end_session(session, "its Tinker session ended: the client closed it (ServiceClient.close)")

    def end_session(self, session: Session, why: str = "its Tinker session ended") -> None:
        """Close the session's runs and samplers (their memory is freed; a cluster's jobs end, ``why`` recorded as each job's end
        reason). The service's lock is held only to take them out of its tables: the engine closes them after (a cluster job's end
        may wait for its last state to be stored), so one session's end holds back no other tenant's request. A session ended
        already is left as it is."""
        with self._lock:
            closing = self._take_session(session)
        self._close_all(session, closing, why)

    def _take_session(self, session: Session) -> list[tuple[Any, bool]] | None:
        """Under the lock: the session out of the tables, its runs retired and its samplers dropped; the handles to close (and
        whether the engine may forget each one's files), or None for a session ended already."""
        if self.sessions.pop(session.session_id, None) is None:
            return None
        self.ended[session.session_id] = session.tenant
        while len(self.ended) > self.limits.keep_done_futures:
            self.ended.popitem(last=False)
        self._write("drop_session", session.session_id)
        closing = [(run.handle, self._retire_run(run)) for run in (self.runs.get(m) for m in list(session.runs))
                   if run is not None and not run.closed]
        for sampler_id in list(session.samplers):
            sampler = self.samplers.pop(sampler_id, None)
            if sampler is not None:
                self._write("drop_sampler", sampler_id)
                closing.append((sampler.handle, False))
        return closing

    def _close_all(self, session: Session, closing: list[tuple[Any, bool]] | None, why: str) -> None:
        """Outside the lock: the engine closes the handles :meth:`_take_session` took; one that fails holds back no other."""
        if closing is None:
            return
        for handle, forget in closing:
            try:
                self.engine.close(handle, forget=forget, reason=why)
            except Exception as exc:  # noqa: BLE001 - the session has ended; a job that could not be ended ends at its idle timeout
                self.logger.warning(json.dumps({"event": "tinker_close_failed", "session": session.session_id, "error": str(exc)[:500]}))
        self.logger.info(json.dumps({"event": "tinker_session_ended", "session": session.session_id, "tenant": session.tenant, "why": why}))

    def _retire_run(self, run: Run) -> bool:
        """Under the lock: the run takes no more calls; one with checkpoints stays listed (its tinker:// paths still load), one
        without is forgotten. Whether the engine may forget its files when it closes the handle."""
        run.closed = True
        run.executor.shutdown(wait=False, cancel_futures=True)
        if not run.checkpoints:
            self.runs.pop(run.model_id, None)
            self._write("drop_run", run.model_id)
        else:
            self._write("close_run", run.model_id)
        return not run.checkpoints

    # ----- futures --------------------------------------------------------------------------------------
    def submit(self, tenant: str, operation: Callable[[], Any], run: Run | None = None) -> str:
        """Queue ``operation`` (on ``run``'s executor, else the samplers' pool) and answer its request id."""
        with self._lock:
            pending = sum(1 for p in self.futures.values() if p.tenant == tenant and not p.future.done())
            if pending >= self.limits.max_pending_per_tenant:
                raise TinkerError(429, f"this tenant has {pending} requests waiting, its most; retrieve their results before sending more")
            self._forget_done()
            request_id = "req-" + secrets.token_hex(12)
            if run is not None:
                if run.closed:
                    raise not_found(f"training run {run.model_id!r}")
                run.last_request = utc_now()
                future = run.executor.submit(operation)
            else:
                future = self._sampling.submit(operation)
            self.futures[request_id] = Pending(request_id, tenant, future)
        if self.journal is not None:
            self.journal.put_request(request_id, tenant)
            if run is not None:
                future.add_done_callback(lambda done: self._keep_result(request_id, done))
        return request_id

    def _forget_done(self) -> None:
        done = [k for k, p in self.futures.items() if p.future.done()]
        for key in done[: max(0, len(done) - self.limits.keep_done_futures)]:
            del self.futures[key]

    def pending(self, tenant: str, request_id: str) -> Pending:
        """The request's future; after a restart, one made of its kept result, or 410 for one that was running then."""
        found = self.futures.get(request_id)
        if found is None and self.journal is not None:
            kept = self.journal.request(str(request_id)[:200])
            if kept is not None and kept[0] == tenant:
                if kept[1] is None:
                    raise TinkerError(410, f"request {request_id[:80]!r} was not done when this server restarted, or was a sampler's (whose "
                                           "results are not kept): it changed no training run; send it again")
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(decode_result(kept[1]))
                return Pending(request_id, tenant, future)
        return owned(found, tenant, f"request {request_id[:80]!r}")

    def cancel(self, tenant: str, request_id: str) -> bool:
        return self.pending(tenant, request_id).future.cancel()

    # ----- engine calls ----------------------------------------------------------------------------------
    def call(self, handle: Any, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """One Backend-protocol call of a run or sampler, waited for; a failure raises :class:`TinkerError`."""
        return self.engine.call(handle, method, args)

    # ----- runs and samplers -------------------------------------------------------------------------------
    def create_run(self, tenant: str, session_id: str, model_seq_id: int, base_model: str, rank: int, seed: int | None,
                   user_metadata: dict[str, Any] | None, credential: str = "", source: Saved | None = None) -> Run:
        """The run ``<session_id>:train:<model_seq_id>`` (the id the SDK derives too); a retried creation answers the run made first
        (waiting for it while it is made). The engine opens it outside the lock (a cluster's job may wait long for a seat), so other
        requests, and every session's heartbeats, go on meanwhile; a session that ends meanwhile gets no run (its job is ended)."""
        with self._lock:
            session = self.session(tenant, session_id)
            model_id = f"{session_id}:train:{int(model_seq_id)}"
            if model_id in self.runs:
                return self.runs[model_id]
            made = self._opening.get(model_id)
            if made is None:
                self.engine.check_model(base_model)
                mine = [r for r in self.runs.values() if r.tenant == tenant]
                opening = sum(1 for t, _ in self._opening.values() if t == tenant)
                if sum(not r.closed for r in mine) + opening >= self.limits.max_runs_per_tenant:
                    raise TinkerError(429, f"this tenant has {sum(not r.closed for r in mine) + opening} training runs open, its most; end a "
                                           "session (ServiceClient.close) to close its runs")
                if len(mine) + opening >= self.limits.max_kept_runs_per_tenant:
                    raise TinkerError(429, f"this tenant keeps {len(mine)} training runs with checkpoints, its most; delete the checkpoints "
                                           "of old runs (RestClient.delete_checkpoint): a closed run without checkpoints is forgotten")
                self._opening[model_id] = (tenant, concurrent.futures.Future())
        if made is not None:
            return made[1].result()  # the first creation's run, or its refusal
        try:
            run = self._open_run(session, model_id, base_model, rank, seed, user_metadata, credential, source)
        except Exception as exc:
            with self._lock:
                _, future = self._opening.pop(model_id)
            future.set_exception(exc)
            raise
        with self._lock:
            _, future = self._opening.pop(model_id)
        future.set_result(run)
        self.logger.info(json.dumps({"event": "tinker_run_created", "model_id": model_id, "tenant": tenant, "rank": rank}))
        return run

    def _open_run(self, session: Session, model_id: str, base_model: str, rank: int, seed: int | None, user_metadata: dict[str, Any] | None,
                  credential: str, source: Saved | None) -> Run:
        """The engine's run, entered in the tables if its session still lives; else closed (a 404, as for a session ended before)."""
        handle = self.engine.open_run(model_id, base_model, rank, seed, credential, source)
        run: Run | None = None
        with self._lock:
            if self.sessions.get(session.session_id) is session:
                executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tinker-{model_id}")
                run = Run(model_id, session.tenant, session.session_id, base_model, rank, handle, executor, user_metadata)
                self.runs[model_id] = run
                session.runs.add(model_id)
                if self.journal is not None:
                    self.journal.put_run(model_id, session.tenant, session.session_id, base_model, rank, user_metadata, self.engine.describe(handle))
        if run is None:
            self.engine.close(handle, forget=True, reason="its Tinker session ended while the run's job started")
            raise not_found(f"session {session.session_id[:80]!r}")
        return run

    def run(self, tenant: str, model_id: str, credential: str | None = None) -> Run:
        """The tenant's run; with the request's ``credential``, its handle reattached after a restart (:meth:`attach`)."""
        return self.attach(owned(self.runs.get(model_id), tenant, f"training run {str(model_id)[:80]!r}"), credential)

    def checkpoint(self, tenant: str, tinker_path: str) -> tuple[Run, Checkpoint]:
        """The run and checkpoint a ``tinker://<run>/<weights|sampler_weights|external_weights>/<name>`` path names, if the tenant
        owns them."""
        if not isinstance(tinker_path, str) or not tinker_path.startswith("tinker://"):
            raise TinkerError(400, f"{str(tinker_path)[:200]!r} is not a tinker:// path (tinker://<run>/weights/<name> or .../sampler_weights/<name>)")
        parts = tinker_path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in SEGMENTS:
            raise TinkerError(400, f"{tinker_path[:200]!r} is not a checkpoint path: tinker://<run>/weights/<name>, .../sampler_weights/<name> "
                                   "or .../external_weights/<name>")
        run = self.run(tenant, parts[0])
        found = run.checkpoints.get(f"{parts[1]}/{parts[2]}")
        if found is None:
            raise not_found(f"checkpoint {tinker_path[:200]!r}")
        return run, found

    def new_checkpoint(self, run: Run, kind: str, name: str) -> str:
        """The id ``<weights|sampler_weights>/<name>`` of a checkpoint about to be saved; refused past the run's bound."""
        self.engine.check_name(run.handle, kind, name)
        checkpoint_id = f"{KINDS[kind][0]}/{name}"
        if checkpoint_id not in run.checkpoints and len(run.checkpoints) >= self.limits.max_checkpoints_per_run:
            raise TinkerError(429, f"training run {run.model_id} holds {len(run.checkpoints)} checkpoints, its most; delete some "
                                   "(RestClient.delete_checkpoint) first")
        return checkpoint_id

    def save(self, run: Run, kind: str, name: str, user_metadata: dict[str, str] | None = None) -> Checkpoint:
        """Save the run's weights (``training``: with the optimizer) as a checkpoint the run lists."""
        checkpoint_id = self.new_checkpoint(run, kind, name)
        checkpoint = Checkpoint(checkpoint_id, kind, self.engine.save(run.handle, kind, name), utc_now(), user_metadata)
        with self._lock:
            run.checkpoints[checkpoint_id] = checkpoint
            where = checkpoint.saved.location
            self._write("put_checkpoint", run.model_id, checkpoint_id, kind, {"path": str(where)} if isinstance(where, Path) else
                        {"job": where[0], "name": where[1]}, checkpoint.saved.size, checkpoint.time.isoformat(), user_metadata)
        return checkpoint

    # ----- external weights: signed download URLs ----------------------------------------------------
    def external_urls(self, tenant: str, model_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        """``get_external_weights_urls``: a signed URL for each file of the tenant's external checkpoint, and their expiry."""
        run = self.run(tenant, model_id)
        checkpoint = run.checkpoints.get(checkpoint_id)
        if checkpoint is None:
            raise not_found(f"checkpoint {checkpoint_id[:200]!r}")
        if checkpoint.kind != "external":
            raise TinkerError(400, f"{checkpoint.tinker_path(model_id)[:200]!r} is a {checkpoint.kind} checkpoint; download URLs are given for "
                                   "external weights (save_weights_external)")
        folder = Path(checkpoint.saved.location)
        expires = int(time.time()) + EXTERNAL_URL_TTL_S
        base = base_url.rstrip("/") + EXTERNAL_FILES_ROUTE
        urls = {}
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            relative = file.relative_to(folder).as_posix()
            urls[relative] = f"{base}/{self._sign([model_id, checkpoint_id, relative, expires])}"
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, timezone.utc).isoformat()}

    def _sign(self, fields: list[Any]) -> str:
        payload = base64.urlsafe_b64encode(json.dumps(fields, separators=(",", ":")).encode()).decode().rstrip("=")
        return f"{payload}.{hmac.new(self._url_key, payload.encode(), hashlib.sha256).hexdigest()}"

    def signed_file(self, token: str) -> Path:
        """The file a signed URL's ``token`` names, while it has not expired and its checkpoint exists; else a refusal."""
        payload, _, mac = str(token)[:MAX_SIGNED_TOKEN + 1].rpartition(".")
        expected = hmac.new(self._url_key, payload.encode(), hashlib.sha256).hexdigest()
        if len(token) > MAX_SIGNED_TOKEN or not payload or not hmac.compare_digest(mac.encode(), expected.encode()):
            raise TinkerError(403, "this download URL is not valid here: ask for new ones (RestClient.get_external_weights_urls)")
        model_id, checkpoint_id, relative, expires = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        if time.time() > expires:
            raise TinkerError(403, "this download URL has expired: ask for new ones (RestClient.get_external_weights_urls)")
        run = self.runs.get(model_id)
        checkpoint = run.checkpoints.get(checkpoint_id) if run is not None else None
        if checkpoint is None or checkpoint.kind != "external":
            raise not_found("the checkpoint of this download URL")
        folder = Path(checkpoint.saved.location).resolve()
        file = (folder / relative).resolve()
        if not file.is_relative_to(folder) or not file.is_file():
            raise not_found("the file of this download URL")
        return file

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        run = self.run(tenant, model_id)
        with self._lock:
            found = run.checkpoints.pop(checkpoint_id, None)
            if found is not None:
                self._write("drop_checkpoint", run.model_id, checkpoint_id)
        if found is None:
            raise not_found(f"checkpoint {checkpoint_id[:200]!r}")
        self.engine.delete(found.saved)
        with self._lock:
            if run.closed and not run.checkpoints:
                self.runs.pop(run.model_id, None)
                self._write("drop_run", run.model_id)
                self.engine.close(run.handle, forget=True)

    def create_sampler(self, tenant: str, session_id: str, base_model: str | None, model_path: str | None, credential: str = "") -> Sampler:
        """A sampler holding the weights of ``model_path`` (a sampler or training checkpoint), or the base model's. A session that
        ends while the engine opens it (outside the lock) gets no sampler (its job is ended)."""
        with self._lock:
            session = self.session(tenant, session_id)
            source: Saved | None = None
            rank, model = 1, base_model
            if model_path is not None:
                run, checkpoint = self.checkpoint(tenant, model_path)
                if checkpoint.kind == "external":
                    raise TinkerError(400, f"{model_path[:200]!r} holds external weights, for download (get_external_weights_urls); "
                                           "sample from a sampler checkpoint (save_weights_for_sampler) or a training checkpoint")
                source, rank, model = checkpoint.saved, run.rank, run.base_model
            else:
                self.engine.check_model(base_model)
            mine = [s for s in self.samplers.values() if s.tenant == tenant]
            evicted = mine[: max(0, len(mine) - self.limits.max_samplers_per_tenant + 1)]  # the oldest first: an RL loop's spent samplers
            for old in evicted:
                self.samplers.pop(old.sampler_id, None)
                self._write("drop_sampler", old.sampler_id)
                for other in self.sessions.values():
                    other.samplers.discard(old.sampler_id)
        for old in evicted:
            self.engine.close(old.handle, reason=f"its Tinker sampler was closed: its tenant opened a new one past its bound of "
                                                 f"{self.limits.max_samplers_per_tenant} samplers (the oldest close first)")
            self.logger.info(json.dumps({"event": "tinker_sampler_evicted", "sampler": old.sampler_id, "tenant": tenant}))
        sampler_id = "sampler-" + secrets.token_hex(8)
        handle = self.engine.open_sampler(sampler_id, model, rank, source, credential)
        sampler: Sampler | None = None
        with self._lock:
            if self.sessions.get(session_id) is session:
                sampler = Sampler(sampler_id, tenant, session_id, str(model), model_path, handle)
                self.samplers[sampler_id] = sampler
                session.samplers.add(sampler_id)
                if self.journal is not None:
                    self.journal.put_sampler(sampler_id, tenant, session_id, str(model), model_path, self.engine.describe(handle))
        if sampler is None:
            self.engine.close(handle, reason="its Tinker session ended while the sampler's job started")
            raise not_found(f"session {session_id[:80]!r}")
        return sampler

    def sampler(self, tenant: str, sampler_id: str, credential: str | None = None) -> Sampler:
        """The tenant's sampler; with the request's ``credential``, its handle reattached after a restart (:meth:`attach`)."""
        return self.attach(owned(self.samplers.get(sampler_id), tenant, f"sampler {str(sampler_id)[:80]!r}"), credential)

    def sampler_from_run(self, run: Run, credential: str = "") -> Sampler:
        """A sampler with a snapshot of ``run``'s current weights (``save_weights_for_sampler`` without a name)."""
        name = "ephemeral-" + secrets.token_hex(6)
        checkpoint = self.save(run, "sampler", name)
        try:
            return self.create_sampler(run.tenant, run.session_id, None, checkpoint.tinker_path(run.model_id), credential)
        finally:
            with self._lock:
                run.checkpoints.pop(checkpoint.checkpoint_id, None)
                self._write("drop_checkpoint", run.model_id, checkpoint.checkpoint_id)
            self.engine.delete(checkpoint.saved)

    # ----- capabilities ------------------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": self.engine.models()}

    def check_tokens(self, rows: list[list[int]], where: str, model: str | None = None) -> None:
        total = sum(map(len, rows))
        if total > self.limits.max_tokens:
            raise TinkerError(400, f"{where}: {total:,} tokens is over this server's limit of {self.limits.max_tokens:,} per request; send smaller requests")
        vocab = self.engine.model_info(model)["vocab_size"] if model else None
        if vocab is not None:
            for row in rows:
                bad = [t for t in row if not 0 <= t < vocab]
                if bad:
                    raise TinkerError(400, f"{where}: token id {bad[0]} is outside the model's vocabulary (0 to {vocab - 1})")


def as_array(tensor: Any) -> np.ndarray:
    """A Tinker ``TensorData`` (dense or sparse CSR) as a dense numpy array of its shape."""
    array = tensor.to_numpy() if hasattr(tensor, "to_numpy") else np.asarray(tensor.data)
    return np.asarray(array)


def loss_settings(name: str, config: Any) -> dict[str, float]:
    try:
        return tinker_losses.check_loss(name, config)
    except tinker_losses.LossInputError as exc:
        raise TinkerError(400, str(exc)) from exc


def _maintain_while_alive(service: weakref.ref, interval: float) -> None:
    """:meth:`TinkerService.maintain` every ``interval`` seconds until the service is gone."""
    while True:
        time.sleep(interval)
        alive = service()
        if alive is None:
            return
        try:
            alive.maintain()
        except Exception as exc:  # noqa: BLE001 - the next pass tries again
            alive.logger.warning(json.dumps({"event": "tinker_maintenance_failed", "error": str(exc)[:500]}))
        del alive
