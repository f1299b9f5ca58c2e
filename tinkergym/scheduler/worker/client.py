"""WorkerClient: the scheduler's worker API from the worker process, standard library only (no torch, no FastAPI).

It is :class:`tinkergym.client.SchedulerClient` (one kept-alive connection, backoff on dropped connections,
an ``Idempotency-Key`` on every POST kept across its retries) with the worker's verbs, every 5xx retried, and
the artifact transfers: a file upload streamed from disk (``PUT``, its SHA-256 checked by the scheduler) and a
download streamed to disk whose size and SHA-256 are checked before it is moved into place.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

from tinkergym.client import MAX_BACKOFF_S, SchedulerClient, SchedulerError
from tinkergym.plumbing.memory_use import FIELDS

#: What a heartbeat's ``memory`` carries: the server's measured figures, and a shared server's base and open adapters.
MEMORY_FIELDS = (*FIELDS, "base_bytes", "sessions")

_CHUNK = 1 << 20
#: Every 5xx (and the proxies' 502/503/504) is a "not now": the worker asks again after a pause.
SERVER_ERRORS = frozenset(range(500, 600))


def _q(part: Any) -> str:
    return urllib.parse.quote(str(part), safe="")


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            sha.update(chunk)
    return sha.hexdigest()


def _beat_body(epoch: int, usage: dict[str, int] | None, memory: dict[str, Any] | None) -> dict[str, Any]:
    """A heartbeat's body: the epoch, the usage if any, and the memory fields the scheduler takes (integers)."""
    memory = {k: v for k, v in (memory or {}).items() if k in MEMORY_FIELDS and isinstance(v, int) and not isinstance(v, bool)}
    return {"epoch": epoch, **({"usage": usage} if usage else {}), **({"memory": memory} if memory else {})}


class WorkerClient(SchedulerClient):
    """The worker side of the scheduler's API for the worker ``worker_id`` (set by :meth:`register`)."""

    retry_statuses = SERVER_ERRORS

    def __init__(self, url: str | None = None, api_key: str | None = None, *, worker_id: str | None = None, **options: Any) -> None:
        super().__init__(url, api_key, **options)
        self.worker_id = worker_id

    def copy(self, **options: Any) -> WorkerClient:
        """Another client for the same worker on a connection of its own (one per job, one per heartbeat loop)."""
        settings = {"timeout": self.timeout, "retries": self.retries, "backoff": self.backoff, "in_flight_wait": self.in_flight_wait, **options}
        return WorkerClient(self.url, self._key, worker_id=self.worker_id, **settings)

    def _job(self, job_id: str) -> str:
        return f"/v1/workers/{_q(self.worker_id)}/jobs/{_q(job_id)}"

    # ----- registration and leases ------------------------------------------------------------------
    def register(self, name: str, host: str, devices: list[dict[str, Any]], models: list[str],
                 model_shapes: dict[str, Any] | None = None) -> dict[str, Any]:
        """Register (or update) this worker and its devices (each may say its ``memory_gb``), with the shapes of the models
        it counted (:mod:`tinkergym.scheduler.memory`); remembers its id."""
        body = {"name": name, "host": host, "devices": devices, "models": models, **({"model_shapes": model_shapes} if model_shapes else {})}
        answer = self._request("POST", "/v1/workers", body)
        self.worker_id = answer["id"]
        return answer

    def leave(self) -> dict[str, Any]:
        """Tell the scheduler this worker is stopping: it is listed ``gone`` at once (alive again at its next call)."""
        return self._request("POST", f"/v1/workers/{_q(self.worker_id)}/leave", {})

    def lease(self) -> dict[str, Any] | None:
        """At most one queued job that fits the free devices (None when there is none)."""
        return self._request("POST", f"/v1/workers/{_q(self.worker_id)}/lease", {})["lease"]

    def leases(self, most: int) -> list[dict[str, Any]]:
        """Up to ``most`` queued jobs that fit the free devices, in one grant (none: an empty list). A scheduler that grants
        one a request answers one."""
        answer = self._request("POST", f"/v1/workers/{_q(self.worker_id)}/lease", {"max": max(1, most)})
        return answer["leases"] if "leases" in answer else [answer["lease"]] if answer.get("lease") else []

    def heartbeat(self, job_id: str, epoch: int, usage: dict[str, int] | None = None, memory: dict[str, Any] | None = None) -> dict[str, Any]:
        """Renew the lease: ``{state, cancelling, expires_at}``; a 409 means it is lost. ``usage``: the tokens the job's
        server trained and sampled so far at this lease (``tokens_trained``, ``tokens_sampled``); ``memory``: the
        server's memory measured now (:func:`tinkergym.plumbing.memory_use.measure`; a shared server's with its
        ``base_bytes`` and ``sessions``)."""
        return self._request("POST", f"{self._job(job_id)}/heartbeat", _beat_body(epoch, usage, memory))

    def heartbeats(self, beats: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Renew several leases in one call (``job_id``, ``epoch``, optional ``usage`` and ``memory`` each, as
        :meth:`heartbeat` takes them): each lease's answer, or ``{job_id, epoch, lost: true, error}`` for a lease lost."""
        body = [{"job_id": b["job_id"], **_beat_body(b["epoch"], b.get("usage"), b.get("memory"))} for b in beats]
        return self._request("POST", f"/v1/workers/{_q(self.worker_id)}/heartbeats", {"leases": body})["leases"]

    def report_state(self, job_id: str, epoch: int, state: str, *, error: str | None = None, server_url: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"epoch": epoch, "state": state}
        if error is not None:
            body["error"] = error[-4000:]
        if server_url is not None:
            body["server_url"] = server_url
        return self._request("POST", f"{self._job(job_id)}/state", body)

    def release(self, job_id: str, epoch: int, reason: str) -> dict[str, Any]:
        """Give the job back (this worker cannot run it): queued again at the same attempt; this worker is quarantined."""
        return self._request("POST", f"{self._job(job_id)}/release", {"epoch": epoch, "reason": reason[:2000]})

    def event(self, job_id: str, epoch: int, type_: str, data: dict[str, Any]) -> int:
        return int(self._request("POST", f"{self._job(job_id)}/events", {"epoch": epoch, "type": type_, "data": data})["seq"])

    def record_checkpoint(self, job_id: str, epoch: int, step: int, name: str) -> dict[str, Any]:
        """Record checkpoint ``name`` at ``step`` once all of its files are uploaded."""
        return self._request("POST", f"{self._job(job_id)}/checkpoints", {"epoch": epoch, "step": step, "name": name})

    # ----- artifacts --------------------------------------------------------------------------------
    def restorable(self, job_id: str, epoch: int) -> list[dict[str, Any]]:
        """Recorded checkpoints a new server may restore: those of the job the leased one continues, then its own."""
        return self._request("GET", f"{self._job(job_id)}/checkpoints", query={"epoch": epoch})["checkpoints"]

    def listing(self, job_id: str, epoch: int, name: str, source: str | None = None) -> list[dict[str, Any]]:
        """The files (``path``, ``size``, ``sha256``) of checkpoint ``name`` of the leased job (or of ``source``)."""
        query = {"epoch": epoch, "source": source if source != job_id else None}
        return self._request("GET", f"{self._job(job_id)}/artifacts/{_q(name)}", query=query)["files"]

    def drop_partial(self, job_id: str, epoch: int, name: str) -> None:
        """Remove what an earlier, unfinished upload of checkpoint ``name`` left (refused once it is recorded)."""
        self._request("DELETE", f"{self._job(job_id)}/artifacts/{_q(name)}", query={"epoch": epoch})

    def upload(self, job_id: str, epoch: int, name: str, relpath: str, file: Path) -> dict[str, Any]:
        """Upload one file of checkpoint ``name``, streamed from disk; the scheduler checks its SHA-256."""
        size, sha256 = os.path.getsize(file), file_sha256(file)
        path = f"{self._job(job_id)}/artifacts/{_q(name)}/{urllib.parse.quote(relpath)}?" + urllib.parse.urlencode({"epoch": epoch, "sha256": sha256})

        def send(conn: http.client.HTTPConnection) -> Any:
            with open(file, "rb") as body:
                headers = {**self._headers(), "Content-Type": "application/octet-stream", "Content-Length": str(size)}
                conn.request("PUT", self._base + path, body=body, headers=headers)
                response = conn.getresponse()
                return response, None

        return self._transfer("PUT", path, send)

    def download(self, job_id: str, epoch: int, name: str, relpath: str, dest: Path, size: int, sha256: str,
                 source: str | None = None) -> None:
        """Download one file of checkpoint ``name`` to ``dest``; a wrong size or SHA-256 is a :class:`SchedulerError`."""
        query = {"epoch": epoch, **({"source": source} if source and source != job_id else {})}
        path = f"{self._job(job_id)}/artifacts/{_q(name)}/{urllib.parse.quote(relpath)}?" + urllib.parse.urlencode(query)
        tmp = dest.with_name(dest.name + ".part")

        def receive(conn: http.client.HTTPConnection) -> Any:
            conn.request("GET", self._base + path, headers=self._headers())
            response = conn.getresponse()
            if response.status != 200:
                return response, None
            sha, received = hashlib.sha256(), 0
            with open(tmp, "wb") as out:
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    sha.update(chunk)
                    received += len(chunk)
                    out.write(chunk)
            if received != size or sha.hexdigest() != sha256:
                tmp.unlink(missing_ok=True)
                raise SchedulerError(f"{name}/{relpath}: got {received} bytes with SHA-256 {sha.hexdigest()[:12]}..., "
                                     f"the listing says {size} bytes, {sha256[:12]}...")
            os.replace(tmp, dest)
            return response, {}

        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._transfer("GET", path, receive)
        finally:
            tmp.unlink(missing_ok=True)

    def _transfer(self, method: str, path: str, exchange: Any) -> dict[str, Any]:
        """One streamed exchange on a connection of its own, retried on dropped connections and 5xx with backoff."""
        delay, last = self.backoff, ""
        for attempt in range(self.retries + 1):
            conn = self._connection(max(self.timeout, 60.0))
            try:
                response, result = exchange(conn)
                if result is not None:
                    return result
                raw = response.read()
                try:
                    payload = json.loads(raw) if raw else {}
                except ValueError:
                    payload = {"error": {"type": "http", "message": raw[:300].decode("utf-8", "replace")}}
                if 200 <= response.status < 300:
                    return payload
                if response.status not in self.retry_statuses:
                    raise self._error(response.status, payload if isinstance(payload, dict) else {}, method, path)
                last = f"HTTP {response.status}"
            except (OSError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            finally:
                conn.close()
            if attempt < self.retries:
                time.sleep(min(delay, MAX_BACKOFF_S))
                delay *= 2
        raise SchedulerError(f"{method} {path.split('?')[0]}: no answer from the scheduler at {self.url} after {self.retries + 1} tries ({last})")
