"""SchedulerClient: the scheduler's job API from Python, standard library only (no torch, no HTTP library).

::

    from tinkergym.client import SchedulerClient

    client = SchedulerClient("http://10.0.0.2:8780", api_key)        # or api_key=None: $TINKERGYM_API_KEY
    job = client.submit("train", {"model": "smollm2-135m", "env": "tinker/Bandit-v0"}, gpus=1)
    for event in client.follow(job["id"]):                             # until the job ends
        print(event["seq"], event["type"], event["data"])

Requests go over one kept-alive ``http.client`` connection. A request whose answer is lost (a dropped
connection, 502/503/504 from a proxy or a restarting scheduler) is sent again with exponential backoff.
Every POST carries an ``Idempotency-Key`` (a fresh uuid4 per call, the same on each of its retries), so a
submission retried after a lost answer creates one job; a 409 saying that the first attempt is still in flight
is retried too. Refusals raise :class:`SchedulerError` with the scheduler's message; ``status`` says which.

:meth:`SchedulerClient.follow` reads the job's server-sent event stream and, when the connection drops,
reconnects with ``Last-Event-ID`` set to the last event it yielded: no event is lost or repeated.
"""

from __future__ import annotations

import base64
import builtins  # builtins.list: inside SchedulerClient, `list` names its method
import hashlib
import hmac
import http.client
import json
import os
import threading
import time
import urllib.parse
import uuid
import sys
from typing import Any
from collections.abc import Callable, Iterator

from tinkergym.errors import ConfigError, TinkergymError
from tinkergym.plumbing.urls import SCHEDULER_ENV, check_scheduler_url  # noqa: F401 - importable from here

#: The environment variables the CLI and :class:`SchedulerClient` read when no URL or key is given (and SCHEDULER_ENV).
API_KEY_ENV = "TINKERGYM_API_KEY"
#: Statuses that mean "not now" rather than "no": sent again after a pause.
RETRY_STATUSES = frozenset({502, 503, 504})
#: Statuses that mean the request (or the key) is wrong: the CLI exits 2 for these.
INPUT_STATUSES = frozenset({400, 401, 403, 404, 413, 422})
#: Job states a job never leaves (as in ``tinkergym.scheduler.states``, not imported: that needs the server's libraries).
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
MAX_BACKOFF_S = 10.0
#: Seconds a queued job waits with no worker able to host it before :func:`wait_running` says how to go on.
UNPLACEABLE_HINT_S = 600.0
#: Wait reasons (``wait_reason.code``) that hold until a worker that can host the job registers.
UNPLACEABLE = frozenset({"no_worker", "no_model", "too_few_devices", "too_little_memory"})
PAGE_SIZE = 500



def player_token(token: str, index: int) -> str:
    """The bearer token of player ``index`` of a league job's lease (``players`` in its config: one adapter a player on
    one shared server): player 0's is the lease's own ``token``, the others' are derived from it (HMAC-SHA256), so the
    job's owner and the worker holding the lease know them and nothing stores them. A player's token opens its adapter
    alone, as every seat's does."""
    if index == 0:
        return token
    digest = hmac.new(token.encode(), f"player:{index}".encode(), hashlib.sha256).digest()
    return "tgp_" + base64.urlsafe_b64encode(digest).decode().rstrip("=")

class SchedulerError(TinkergymError, RuntimeError):
    """The scheduler refused a request (``status``, ``kind`` and its message), or could not be reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    @property
    def input_error(self) -> bool:
        """Whether the request itself (or the key) was wrong, as opposed to the scheduler failing or being away."""
        return self.status in INPUT_STATUSES


class JobEnded(TinkergymError, RuntimeError):
    """The job reached a terminal state (failed, cancelled, succeeded) while the client still needed it, or did not start in time."""


def print_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


#: States a job never runs again from: the terminal ones, and ``cancelling`` (its worker is stopping it; it ends cancelled).
ENDING_STATES = TERMINAL_STATES | {"cancelling"}


def ended_message(job: dict[str, Any]) -> str:
    """Why a client can no longer use ``job`` (in one of :data:`ENDING_STATES`): a cancel says so, and by whom it may come."""
    job_id, state = job["id"], job["state"]
    if state in ("cancelled", "cancelling"):
        return (f"job {job_id} is cancelled: it was cancelled while this client used it (tinkergym jobs cancel {job_id}, "
                f"or Cancel job on the dashboard); see tinkergym jobs logs {job_id}")
    return f"job {job_id} is {state}{': ' + job['error'] if job.get('error') else ''}; see tinkergym jobs logs {job_id}"


def wait_running(
    client: SchedulerClient, job_id: str, *, after_epoch: int | None = None, timeout: float | None = None, poll: float = 1.0,
    say: Callable[[str], None] = print_stderr, still_queued: str = "", unplaceable_after: float | None = UNPLACEABLE_HINT_S,
    same_epoch_after: float | None = None,
) -> dict[str, Any]:
    """Wait until job ``job_id`` runs (at a lease epoch above ``after_epoch``); its connection (``url``, ``token``, ``epoch``).

    With ``same_epoch_after``, a job still running at ``after_epoch`` that many seconds into the wait gives that epoch's
    connection back: the scheduler, not one failed call, says whether a server is gone, and a lease it still holds is
    the server to go on with (a call that failed while the server was briefly unreachable, or while the worker's renewal
    of the server's lease ran late, would otherwise wait for a new epoch that never comes).

    Each change of the job's state (and queue position, and why it waits) is said once, and so is each message its
    worker logs while it prepares the job's server (restoring a checkpoint, loading the model). A terminal job, or one not
    running within ``timeout`` seconds (None: no limit), raises :class:`JobEnded` (so does a ``cancelling`` one, which never
    runs again: :func:`ended_message` says it was cancelled); ``still_queued`` ends the latter's
    message. A job that no worker can host (no worker alive, none offering its model, none large enough) for
    ``unplaceable_after`` seconds is said once, with how to go on; the wait goes on (None: never said).
    """
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    shown = None
    unplaceable_since: float | None = None
    hinted = False
    seen: int | None = None  # the job's newest event when the wait began: what its worker says from then on is said
    while True:
        job = client.show(job_id)
        state = job["state"]
        seen = job.get("last_event", 0) if seen is None else seen
        if state in ("leased", "starting") and job.get("last_event", 0) > seen:
            for event in client.events(job_id, after=seen):  # what the worker is doing: restoring, loading the model
                seen = max(seen, int(event["seq"]))
                if event["type"] == "log" and isinstance(event["data"].get("message"), str):
                    say(f"job {job_id}: {event['data']['message'][:300]}")
        if state in ENDING_STATES:
            raise JobEnded(ended_message({**job, "id": job_id}))
        same_epoch_again = (same_epoch_after is not None and after_epoch is not None and job.get("lease_epoch") == after_epoch
                            and time.monotonic() - started >= same_epoch_after)
        if state == "running" and (after_epoch is None or job["lease_epoch"] > after_epoch or same_epoch_again):
            try:
                return client.connection(job_id)
            except SchedulerError as exc:
                if exc.status != 409:  # 409: it stopped running between the two requests
                    raise
        status = f"job {job_id}: {state}" + (f", position {job['queue_position']} in the queue" if job.get("queue_position") else "")
        reason = job.get("wait_reason") if state == "queued" else None
        if reason:
            status += f" ({reason['message']})"
        if status != shown:
            say(status)
            shown = status
        if reason and reason.get("code") in UNPLACEABLE:
            unplaceable_since = time.monotonic() if unplaceable_since is None else unplaceable_since
            if not hinted and unplaceable_after is not None and time.monotonic() - unplaceable_since >= unplaceable_after:
                hinted = True
                model = (job.get("config") or {}).get("model") or "MODEL"
                say(f"job {job_id} has waited {unplaceable_after:g} s and no worker can run it: {reason['message']}. It keeps waiting; "
                    f"drop it with: tinkergym jobs cancel {job_id}, or start a worker that can run it: tinkergym worker --models {model}")
        else:
            unplaceable_since = None
        if deadline is not None and time.monotonic() > deadline:
            raise JobEnded(f"job {job_id} did not start within {timeout:g} s (it is {state}){'; ' + still_queued if still_queued else ''}")
        time.sleep(poll)


class SchedulerClient:
    """The scheduler's job API at ``url`` with ``api_key`` (default ``$TINKERGYM_API_KEY``).

    Args:
        url: the scheduler, e.g. ``http://10.0.0.2:8780`` (default ``$TINKERGYM_SCHEDULER``).
        api_key: a key from ``tinkergym scheduler keys create`` (``tgk_...``).
        timeout: seconds to wait for an answer on the connection.
        retries: how often a request is sent again after a dropped connection, a 502/503/504 or an in-flight 409.
        backoff: seconds before the first retry; each further one waits twice as long (at most 10 s).
        in_flight_wait: seconds a POST keeps retrying while the scheduler says its first attempt is in flight (409).
        stream_timeout: seconds :meth:`follow` waits for a byte before it counts the connection as dead (the
            scheduler sends a keep-alive every 15 s, so keep this above that).
    """

    #: Answers sent again after a pause (a subclass may widen them, e.g. to every 5xx).
    retry_statuses: frozenset[int] = RETRY_STATUSES

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, timeout: float = 30.0, retries: int = 6, backoff: float = 0.25,
        stream_timeout: float = 45.0, in_flight_wait: float = 75.0,
    ) -> None:
        self.url = check_scheduler_url(url)
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        if not key or not key.strip():
            raise ConfigError(f"no API key: pass --api-key or set {API_KEY_ENV} (keys come from `tinkergym scheduler keys create`)")
        self._key = key.strip()
        parts = urllib.parse.urlsplit(self.url)
        assert parts.hostname is not None  # check_scheduler_url accepts only URLs with a host
        self._https, self._host, self._port, self._base = parts.scheme == "https", parts.hostname, parts.port, parts.path.rstrip("/")
        self.timeout, self.retries, self.backoff, self.stream_timeout = timeout, retries, backoff, stream_timeout
        self.in_flight_wait = in_flight_wait
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # one connection: requests go one at a time

    def __repr__(self) -> str:
        return f"SchedulerClient({self.url!r})"

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- verbs ------------------------------------------------------------------------------------
    def submit(
        self, kind: str, config: dict[str, Any], gpus: int = 1, priority: int = 0, name: str = "", *, max_attempts: int | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Queue a job (``kind``: train, sft, eval, inference; ``config``: the TrainConfig as a dict) and return it.

        The job is in the scheduler's database when this returns. Pass ``idempotency_key`` to make a submission
        that survives this process (a retry with the same key and arguments returns the same job).
        """
        body: dict[str, Any] = {"kind": kind, "config": config, "gpus": gpus, "priority": priority, "name": name}
        if max_attempts is not None:
            body["max_attempts"] = max_attempts
        return self._request("POST", "/v1/jobs", body, idempotency_key=idempotency_key)

    def list(self, state: str | None = None, kind: str | None = None, limit: int | None = 50) -> list[dict[str, Any]]:
        """The tenant's jobs, newest first: at most ``limit`` of them (None: all), following the server's cursors.

        ``state`` is one state or a comma-separated list. For a lazy walk over every job, use :meth:`iter_jobs`.
        """
        found: list[dict[str, Any]] = []
        for job in self.iter_jobs(state, kind, page_size=min(limit or PAGE_SIZE, PAGE_SIZE)):
            found.append(job)
            if limit is not None and len(found) >= limit:
                break
        return found

    def iter_jobs(self, state: str | None = None, kind: str | None = None, page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every job of the tenant, newest first, fetched a page of ``page_size`` at a time as the iterator is consumed."""
        cursor: str | None = None
        while True:
            page = self._request("GET", "/v1/jobs", query={"state": state, "kind": kind, "limit": page_size, "cursor": cursor})
            yield from page["jobs"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def show(self, job_id: str) -> dict[str, Any]:
        """One job (its state, attempt, queue position, server URL once running, config)."""
        return self._request("GET", f"/v1/jobs/{_quote(job_id)}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job: a queued one ends at once, a running one goes through ``cancelling``. An ended job is a 409."""
        return self._request("POST", f"/v1/jobs/{_quote(job_id)}/cancel", {})

    def connection(self, job_id: str) -> dict[str, Any]:
        """The running job's server: ``url``, ``token`` (of the current lease epoch) and ``epoch``; a 409 until it runs."""
        return self._request("GET", f"/v1/jobs/{_quote(job_id)}/connection")

    def complete(self, job_id: str, epoch: int, reason: str | None = None) -> dict[str, Any]:
        """End the job the client trained through at lease ``epoch``: it succeeds and frees its devices. ``reason`` (at most
        500 characters) says why, to the job's owner: ``tinkergym jobs show`` prints it as the job's ``end_reason``."""
        return self._request("POST", f"/v1/jobs/{_quote(job_id)}/complete", {"epoch": epoch, **({"reason": reason} if reason else {})})

    def report(self, job_id: str, type_: str, data: dict[str, Any]) -> int:
        """Append a ``metrics``, ``log`` or ``transcript`` event of the client's run to the job's stream; its seq."""
        return int(self._request("POST", f"/v1/jobs/{_quote(job_id)}/client-events", {"type": type_, "data": data})["seq"])

    def events(self, job_id: str, after: int = 0) -> builtins.list[dict[str, Any]]:
        """Every event of the job with ``seq > after`` recorded so far, oldest first (``seq``, ``type``, ``data``, ``created_at``)."""
        found: list[dict[str, Any]] = []
        while True:
            page = self._request("GET", f"/v1/jobs/{_quote(job_id)}/events", query={"after": after, "limit": 1000})
            found.extend(page["events"])
            if not page["events"]:
                return found
            after = int(page["cursor"])

    def checkpoints(self, job_id: str) -> builtins.list[dict[str, Any]]:
        """The checkpoints the job's servers recorded (``step``, ``name``, ``epoch``, ``created_at``), by step."""
        return self._request("GET", f"/v1/jobs/{_quote(job_id)}/checkpoints")["checkpoints"]

    def usage(self) -> builtins.list[dict[str, Any]]:
        """This key's tenant's usage beside its quotas (an operator key: every tenant's): devices held, device-seconds,
        tokens trained and sampled, stored bytes, events."""
        return self._request("GET", "/v1/usage")["tenants"]

    def cluster(self) -> dict[str, Any]:
        """The cluster as an operator key sees it: workers and what each device holds, leases ending, the queue, usage."""
        return self._request("GET", "/v1/cluster")

    def workers(self, status: str | None = None) -> builtins.list[dict[str, Any]]:
        """The workers that serve this key's tenant: ``name``, ``status`` (alive, gone), ``models``, ``devices`` (``busy``)."""
        return self._request("GET", "/v1/workers", query={"status": status})["workers"]

    def follow(self, job_id: str, after: int = 0) -> Iterator[dict[str, Any]]:
        """The job's events with ``seq > after`` as they happen, until the one that ends the job.

        Reads the server-sent event stream; after a dropped connection (or a stream that closed early) it
        reconnects with ``Last-Event-ID`` = the last seq yielded, so nothing is lost or yielded twice. Gives up
        with :class:`SchedulerError` after ``retries`` failed reconnections in a row.
        """
        path = f"/v1/jobs/{_quote(job_id)}/events/stream"
        cursor, failures, delay = after, 0, self.backoff
        while True:
            try:
                for event in self._stream(path, cursor):
                    cursor, failures, delay = int(event["seq"]), 0, self.backoff
                    yield event
                    if event["type"] == "state" and isinstance(event.get("data"), dict) and event["data"].get("state") in TERMINAL_STATES:
                        return
                # The stream closed without the terminal event: ended already (resumed past it), or the server went away.
                if self.show(job_id)["state"] in TERMINAL_STATES and not self._request(
                    "GET", f"/v1/jobs/{_quote(job_id)}/events", query={"after": cursor, "limit": 1})["events"]:
                    return
                last = "the stream closed before the job ended"
            except (OSError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            except SchedulerError as exc:
                if exc.status not in RETRY_STATUSES:
                    raise
                last = str(exc)
            failures += 1
            if failures > self.retries:
                raise SchedulerError(f"following job {job_id}: lost the event stream from {self.url} {failures} times in a row ({last})")
            time.sleep(min(delay, MAX_BACKOFF_S))
            delay *= 2

    def close(self) -> None:
        """Close the connection (the next request opens another)."""
        with self._lock:
            self._drop()

    # ----- wire -------------------------------------------------------------------------------------
    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}", "Accept": "application/json", "User-Agent": "tinkergym-client"}

    def _request(
        self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None, idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """One request with retries; a 2xx body is returned, anything else raises :class:`SchedulerError`."""
        if query:
            pairs = {k: v for k, v in query.items() if v is not None and v != ""}
            path = f"{path}?{urllib.parse.urlencode(pairs)}" if pairs else path
        headers = self._headers()
        data = None
        if method == "POST":
            headers["Idempotency-Key"] = idempotency_key or str(uuid.uuid4())  # kept across this call's retries
            data = json.dumps(body if body is not None else {}, separators=(",", ":")).encode("utf-8")
            headers["Content-Type"] = "application/json"
        delay, last, failures, fresh_retry = self.backoff, "", 0, True
        in_flight_until: float | None = None
        while True:
            pause = delay
            reused = self._conn is not None
            try:
                with self._lock:
                    status, payload, retry_after = self._send(method, path, data, headers)
            except (OSError, http.client.HTTPException) as exc:
                with self._lock:
                    self._drop()
                last = f"{type(exc).__name__}: {exc}"
                if reused and fresh_retry:  # a kept-alive connection the server closed while idle: once more at once
                    fresh_retry = False
                    continue
            else:
                if 200 <= status < 300:
                    return payload
                if _in_flight(status, payload, method):
                    # An earlier attempt of this very request still runs (or died holding its key, which the scheduler
                    # frees after a minute): its answer comes on a retry. Waited for by time, not by the retry count.
                    now = time.monotonic()
                    in_flight_until = in_flight_until if in_flight_until is not None else now + self.in_flight_wait
                    if now < in_flight_until:
                        time.sleep(min(max(pause, retry_after or 0.0), 2.0, in_flight_until - now))
                        delay = min(delay * 2, 2.0)
                        continue
                    raise self._error(status, payload, method, path)
                if status not in self.retry_statuses:
                    raise self._error(status, payload, method, path)
                last = f"HTTP {status}: {_message(payload)}"
                pause = max(pause, retry_after or 0.0)
            failures += 1
            if failures > self.retries:
                break
            time.sleep(min(pause, MAX_BACKOFF_S))
            delay *= 2
        raise SchedulerError(
            f"{method} {path}: no answer from the scheduler at {self.url} after {self.retries + 1} tries ({last}); "
            f"check that it is running (tinkergym scheduler serve) and that --scheduler / {SCHEDULER_ENV} points at it"
        )

    def _send(self, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> tuple[int, dict[str, Any], float | None]:
        """One exchange on the kept-alive connection: (status, JSON body, Retry-After seconds)."""
        if self._conn is None:
            self._conn = self._connection(self.timeout)
        self._conn.request(method, self._base + path, body=data, headers=headers)
        response = self._conn.getresponse()
        raw = response.read()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"error": {"type": "http", "message": raw[:300].decode("utf-8", "replace")}}
        retry_after = response.getheader("Retry-After") or ""
        return response.status, payload if isinstance(payload, dict) else {"value": payload}, float(retry_after) if retry_after.isdigit() else None

    def _model_server(self) -> bool:
        """Whether the URL answers as a training or inference server does: ``/health`` without a key, and ``/healthz`` (the
        scheduler's, without a key) not. Asked on connections of its own, only to explain a refused key."""
        answers = {}
        for probe in ("/health", "/healthz"):
            connection = self._connection(min(self.timeout, 5.0))
            try:
                connection.request("GET", self._base + probe, headers={"Accept": "application/json"})
                answers[probe] = connection.getresponse().status
            except (OSError, http.client.HTTPException):
                return False
            finally:
                connection.close()
        return answers["/health"] == 200 and answers["/healthz"] != 200

    def _error(self, status: int, payload: dict[str, Any], method: str, path: str) -> SchedulerError:
        message, kind = _message(payload), _kind(payload)
        if status == 401 and self._model_server():
            text = (f"{self.url} is a tinkergym training or inference server (serve backend, serve model), not the scheduler: "
                    "give the scheduler's URL (`tinkergym scheduler serve`, port 8780 by default) with --scheduler or "
                    f"{SCHEDULER_ENV}")
        elif status == 401:
            text = (f"the scheduler at {self.url} refused the API key (401): pass a valid, unrevoked key with --api-key or "
                    f"{API_KEY_ENV} (keys come from `tinkergym scheduler keys create`)")
        elif status == 403:
            hint = "; ask the operator for a key with that scope" if kind == "scope" else ""
            text = f"the API key may not do this ({method} {path}): {message}{hint}"
        elif status == 404:
            text = f"not found: {message} (jobs of other tenants are not visible to this key)"
        elif status == 413:
            text = f"the request is larger than the scheduler accepts: {message}"
        elif status == 422:
            text = f"the scheduler refused the request: {message}"
        else:
            text = f"{method} {path}: the scheduler answered {status}: {message}"
        return SchedulerError(text, status, kind)

    def _stream(self, path: str, after: int) -> Iterator[dict[str, Any]]:
        """The events of one SSE connection (``Last-Event-ID: after``), each parsed from its ``data`` line."""
        conn = self._connection(self.stream_timeout)
        try:
            headers = {**self._headers(), "Accept": "text/event-stream", "Last-Event-ID": str(after)}
            conn.request("GET", self._base + path, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                raw = response.read()
                try:
                    payload = json.loads(raw) if raw else {}
                except ValueError:
                    payload = {"error": {"type": "http", "message": raw[:300].decode("utf-8", "replace")}}
                raise self._error(response.status, payload if isinstance(payload, dict) else {}, "GET", path)
            yield from parse_sse(response)
        finally:
            conn.close()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def parse_sse(response: Any) -> Iterator[dict[str, Any]]:
    """Events from a ``text/event-stream`` body (anything with ``readline``): each message's ``data`` as JSON.

    Comments (keep-alives) and ``retry:`` fields are skipped; a message whose data is not a JSON object is
    skipped too. A connection that ends mid-message raises ``http.client.IncompleteRead`` (the caller reconnects).
    """
    fields: dict[str, str] = {}
    data: list[str] = []
    while True:
        line = response.readline()
        if not line:
            if fields or data:
                raise http.client.IncompleteRead(b"", None)  # a message cut off: the caller resumes from the last whole one
            return
        text = line.decode("utf-8").rstrip("\r\n")
        if not text:
            if data:
                try:
                    event = json.loads("\n".join(data))
                except ValueError:
                    event = None
                if isinstance(event, dict) and "seq" in event:
                    event.setdefault("type", fields.get("event", "message"))
                    yield event
            fields, data = {}, []
            continue
        if text.startswith(":"):
            continue
        name, _, value = text.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name in ("id", "event"):
            fields[name] = value


def _in_flight(status: int, payload: dict[str, Any], method: str) -> bool:
    """Whether an answer says that the first attempt of this idempotent POST is still running on the scheduler."""
    return status == 409 and method == "POST" and "in flight" in _message(payload)


def _quote(part: str) -> str:
    return urllib.parse.quote(str(part), safe="")


def _message(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(payload.get("detail") or error or "no message")


def _kind(payload: dict[str, Any]) -> str | None:
    error = payload.get("error")
    return str(error.get("type")) if isinstance(error, dict) and error.get("type") else None
