"""RemoteBackend: the Backend protocol over HTTP, as a client of the training server (``tinkergym serve backend``).

Standard library only (``http.client`` over one kept-alive connection, ``json``, ``hashlib`` by way of
:mod:`tinkergym.plumbing.downloads`), so a client without torch trains through it: envs, rollouts and the trainer run here,
the model on the server.

Every call carries its session's next sequence number. A call whose answer is lost (a dropped connection, a
502/503/504 from a proxy or a server that is starting) is sent again with the same number, with exponential
backoff: the server runs each number once and answers a repeat with the stored result, so a retried optimizer
step is applied once. A call still running after ``wait`` seconds comes back as 202 and is long-polled.

The server keeps states and exports under names (one path component). :class:`~tinkergym.trainers.session.TrainingRun`
passes local paths, which map to names:

- ``save_state(".../step_000010.staging.tmp")`` saves the server state ``step_000010`` (the folder name without
  a trailing ``.staging.tmp``/``.tmp``) and writes ``remote_state.json`` (url, name, step) into the local folder,
  so a local checkpoint folder says where its weights live;
- ``load_state(folder)`` loads the name that folder's ``remote_state.json`` names (with ``"weights_only": true`` there,
  only its trainable weights: the server keeps its own optimizer moments, step and generator);
- ``export(".../final")`` exports ``final`` on the server and downloads every file (sizes and SHA-256 checked)
  into the local folder, which is then an ordinary HF / peft folder.

``info()["tokenizer"]`` is a local folder holding the server model's tokenizer files (cached by content under
``$TINKERGYM_CACHE/remote`` or ``~/.cache/tinkergym/remote``), which ``AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from tinkergym.backends.tokenizer_files import cache_tokenizer_files, default_cache_dir
from tinkergym.protocol.types import ForwardBackwardRequest, ForwardBackwardResult, ImageData, OptimParams, SampleRequest, SampleResponse
from tinkergym.plumbing.downloads import DownloadMismatchError, save_checked
from tinkergym.plumbing.urls import check_backend_url, is_http_url  # noqa: F401 - importable from here
from tinkergym.errors import ConfigError, NonFiniteError, OutOfMemoryError, TinkergymError
from tinkergym.plumbing.folders import fresh_tmp_dir, plain_relative_parts, replace_dir

#: The wire protocol version this client speaks.
PROTOCOL = 1
#: Names of server states and exports: one path component.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: The file a checkpoint folder of a remote run holds instead of weights.
REMOTE_STATE = "remote_state.json"
#: Statuses that say "not now" rather than "no": retried with the same sequence number.
RETRY_STATUSES = frozenset({502, 503, 504})
MAX_BACKOFF_S = 10.0


@dataclass
class WireStats:
    """What a :class:`RemoteBackend` sent and received: request and response bodies, and the seconds spent
    encoding and decoding them (``json.dumps`` / ``json.loads`` on this side; headers are not counted)."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0

    def snapshot(self) -> dict[str, float]:
        """The counters as a plain dict (subtract two snapshots for one step's share)."""
        return dict(vars(self))


class RemoteBackendError(TinkergymError, RuntimeError):
    """The training server failed a call, or could not be reached within the retries."""


def server_name(path: str | os.PathLike[str]) -> str:
    """The server-side name for a local state or export folder: its name without a trailing ``.staging.tmp``/``.tmp``."""
    name = os.path.basename(os.fspath(path).rstrip("/"))
    for suffix in (".staging.tmp", ".tmp"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"{path}: a remote state or export needs a folder name of letters, digits, '.', '_' and '-' (got {name!r})")
    return name


class RemoteSnapshot:
    """The weights a training server had when :meth:`RemoteBackend.sampling_snapshot` was called, held on the server."""

    def __init__(self, backend: RemoteBackend, snapshot_id: str, version: int) -> None:
        self.backend, self.snapshot_id, self.version = backend, snapshot_id, version

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Completions sampled on the server with the snapshot's weights (thread-safe: the backend's calls go one at a time)."""
        return SampleResponse.from_dict(self.backend._call("sample", {"request": request.to_dict(), "snapshot": self.snapshot_id}))


class RemoteBackend:
    """The Backend protocol, computed by the training server at ``url`` (bearer ``token``).

    Args:
        url: the server, e.g. ``http://10.0.0.5:8765``.
        token: its bearer token (read it with :func:`tinkergym.serve.auth.read_token_file`).
        timeout: seconds to wait for bytes on the connection, beyond a long poll's own wait.
        retries: how often a call is sent again after a dropped connection or a 502/503/504.
        backoff: seconds before the first retry; each further one waits twice as long (at most 10 s).
        wait: seconds the server holds a call before answering 202 (the client then long-polls).
        cache_dir: where tokenizer folders are kept (default :func:`default_cache_dir`).
    """

    def __init__(
        self, url: str, token: str, *, timeout: float = 60.0, retries: int = 6, backoff: float = 0.5, wait: float = 30.0,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.url = check_backend_url(url)
        parts = urllib.parse.urlsplit(self.url)
        assert parts.hostname is not None  # check_backend_url accepts only URLs with a host
        self._https, self._host, self._port, self._base = parts.scheme == "https", parts.hostname, parts.port, parts.path.rstrip("/")
        self._token = token
        self.timeout, self.retries, self.backoff, self.wait = timeout, retries, backoff, wait
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.RLock()  # one connection and one sequence: calls go one at a time
        self._session: str | None = None
        self._seq = 0
        self._tokenizer: str | None = None
        #: Bodies and (de)serialization time of every request so far (see :class:`WireStats`).
        self.wire = WireStats()

    def __repr__(self) -> str:
        return f"RemoteBackend({self.url!r})"

    # ----- the Backend protocol ---------------------------------------------------------------------
    def ping(self) -> bool:
        """Tell the server its client is alive (``GET /v1/info``, which resets its idle timeout as a call does): one try, no
        retries. False, without a request, while a call holds the connection (that call is a sign of life itself)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            status, _, _ = self._send("GET", "/v1/info", None, None)
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            raise RemoteBackendError(f"the training server at {self.url} did not answer: {type(exc).__name__}: {exc}") from exc
        finally:
            self._lock.release()
        if status != 200:
            raise RemoteBackendError(f"the training server at {self.url} answered {status} to GET /v1/info")
        return True

    def info(self) -> dict[str, Any]:
        """The server's info (model, lora, dtype, device, step...) with ``tokenizer`` a local folder and ``url``."""
        info = self._get_json("/v1/info", "info")
        if info.get("protocol") != PROTOCOL:
            raise RemoteBackendError(
                f"the training server at {self.url} speaks protocol {info.get('protocol')!r}; this client speaks {PROTOCOL}: "
                "install the same tinkergym version on both sides"
            )
        return {**info, "tokenizer": self.tokenizer_dir(), "url": self.url}

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Completions for token prompts, sampled on the server."""
        return SampleResponse.from_dict(self._call("sample", {"request": request.to_dict()}))

    def sampling_snapshot(self) -> RemoteSnapshot:
        """A snapshot of the server's weights now, to sample from on another thread while training goes on
        (``async_steps``): the server keeps it (its newest eight) and samples from it when a ``sample`` call names it.
        Calls still go one at a time, in order (the server runs a snapshot's samples between the training calls): what
        overlaps the training is the rollout's env steps and tool calls, here."""
        answer = self._call("snapshot", {})
        return RemoteSnapshot(self, str(answer["snapshot"]), int(answer["version"]))

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0, images: list[list[ImageData]] | None = None) -> list[list[float]]:
        """Per-token logprobs of whole sequences under the server's current policy; ``images``: one list per sequence of the
        images its image tokens show (a vision-language model's shared server). Without images the call is the text one."""
        args: dict[str, Any] = {"sequences": sequences, "temperature": temperature}
        if images is not None and any(images):
            args["images"] = [[image.to_dict() for image in row] for row in images]
        return self._call("logprobs", args)["logprobs"]

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        """Loss and gradients on the server (they accumulate there until :meth:`optim_step`)."""
        return ForwardBackwardResult.from_dict(self._call("forward_backward", {"request": request.to_dict()}))

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        """One optimizer step on the server."""
        return self._call("optim_step", {"params": params.to_dict()})["metrics"]

    def save_state(self, path: str, name: str | None = None) -> None:
        """Save the server's state under ``name`` (default: :func:`server_name` of ``path``); write ``remote_state.json``
        into the folder ``path``."""
        name = server_name(name or path)
        self._call("save_state", {"name": name})
        step = self._get_json("/v1/info", "info").get("step")
        os.makedirs(path, exist_ok=True)
        note = Path(path, REMOTE_STATE)
        tmp = note.with_name(note.name + ".tmp")
        tmp.write_text(json.dumps({"url": self.url, "name": name, "step": step, "protocol": PROTOCOL}, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, note)

    def load_state(self, path: str) -> None:
        """Load on the server the state that ``path``'s ``remote_state.json`` names."""
        note = Path(path, REMOTE_STATE)
        if not note.is_file():
            if Path(path, "state.json").is_file():
                raise ConfigError(
                    f"{path} is a local checkpoint (its weights are in the folder, not on a training server); "
                    "continue it without --backend-url"
                )
            raise ConfigError(f"{path} is not a checkpoint of a remote run (no {REMOTE_STATE}); pass a folder that save_state wrote")
        try:
            meta = json.loads(note.read_text(encoding="utf-8"))
            name, weights_only = meta["name"], meta.get("weights_only", False)
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{note} is unreadable ({exc}); its checkpoint cannot be restored, resume from an earlier one") from exc
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ConfigError(f"{note} names no valid server state ({name!r})")
        if not isinstance(weights_only, bool):
            raise ConfigError(f"{note}: weights_only must be true or false, not {weights_only!r}")
        self._call("load_state", {"name": name, "weights_only": True} if weights_only else {"name": name})

    def export(self, path: str, merged: bool = False) -> None:
        """Export on the server under :func:`server_name` of ``path``, then download the folder into ``path`` (checked by SHA-256).
        The downloads hold the connection as a call does: a :meth:`ping` from another thread meanwhile sends nothing."""
        name = server_name(path)
        with self._lock:
            listing = self._call("export", {"name": name, "merged": merged})
            self._download_folder(name, listing, path)

    def _download_folder(self, name: str, listing: dict[str, Any], path: str) -> None:
        tmp = fresh_tmp_dir(path)
        try:
            for entry in listing["files"]:
                relative = _relative_file(entry["path"])
                dest = Path(tmp, *relative.split("/"))
                dest.parent.mkdir(parents=True, exist_ok=True)
                quoted = urllib.parse.quote(f"{name}/{relative}")
                self._download(f"/v1/files/exports/{quoted}", dest, int(entry["size"]), str(entry["sha256"]))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        replace_dir(tmp, os.fspath(path).rstrip("/"))

    def close(self) -> None:
        """Close the connection (the next call opens another)."""
        with self._lock:
            self._drop_connection()

    # ----- tokenizer --------------------------------------------------------------------------------
    def tokenizer_dir(self) -> str:
        """A local folder with the server model's tokenizer and chat template files (fetched once, cached by content)."""
        with self._lock:
            if self._tokenizer is None:
                answer = self._get_json("/v1/tokenizer", "tokenizer")
                try:
                    self._tokenizer = cache_tokenizer_files(answer, self.cache_dir, f"the training server at {self.url}")
                except ValueError as exc:
                    raise RemoteBackendError(str(exc)) from None
            return self._tokenizer

    # ----- calls ------------------------------------------------------------------------------------
    def _call(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run ``method`` on the server as the session's next numbered call; retries keep the number."""
        with self._lock:
            if self._session is None:
                opened = self._request("POST", "/v1/sessions", {}, "open a session")
                self._session, self._seq = opened["session_id"], int(opened.get("next_seq", 1)) - 1
            body = {"session_id": self._session, "seq": self._seq + 1, "method": method, "args": args}
            try:
                answer = self._request("POST", f"/v1/call?wait={self.wait:g}", body, method)
                self._seq += 1
                while answer.get("status") == "pending":
                    request_id = urllib.parse.quote(str(answer["request_id"]), safe="")
                    answer = self._request("GET", f"/v1/requests/{request_id}?wait={self.wait:g}", None, method)
            except (ConfigError, RemoteBackendError, NonFiniteError, OutOfMemoryError):
                # Whether the server counted a refused call is its business: the next call starts a fresh session.
                self._session = None
                raise
            return answer["result"]

    def _get_json(self, path: str, what: str) -> dict[str, Any]:
        with self._lock:
            return self._request("GET", path, None, what)

    def _request(self, method: str, path: str, body: Any, what: str, on_ok: Callable[[Any], None] | None = None) -> dict[str, Any]:
        """One request with retries on dropped connections and 502/503/504; an answer of 200 or 202 is returned, others raise."""
        delay, last, fresh_retry = self.backoff, "", True
        attempt = 0
        while attempt <= self.retries:
            pause = delay
            reused = self._conn is not None
            try:
                status, payload, retry_after = self._send(method, path, body, on_ok)
            except (OSError, http.client.HTTPException) as exc:
                self._drop_connection()
                last = f"{type(exc).__name__}: {exc}"
                if reused and fresh_retry:
                    # A kept-alive connection the server closed while idle (its keep-alive timeout): send again at
                    # once on a new one, once, without counting it as a retry.
                    fresh_retry = False
                    continue
            else:
                if status in (200, 202):
                    return payload
                if not _retryable(status, payload):
                    raise self._error(status, payload, what)
                last = f"HTTP {status}: {_message(payload)}"
                pause = max(pause, retry_after or 0.0)
            if attempt < self.retries:
                time.sleep(min(pause, MAX_BACKOFF_S))
                delay *= 2
            attempt += 1
        raise RemoteBackendError(
            f"{what}: no answer from the training server at {self.url} after {self.retries + 1} tries ({last}); "
            "check that it is running (tinkergym serve backend) and that --backend-url points at it"
        )

    def _send(self, method: str, path: str, body: Any, on_ok: Callable[[Any], None] | None) -> tuple[int, dict[str, Any], float | None]:
        """One HTTP exchange: (status, JSON body, Retry-After seconds); with ``on_ok``, a 200 body is handed to it unread."""
        if self._conn is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = kind(self._host, self._port, timeout=self.timeout + self.wait)
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        data, wire = None, self.wire
        if body is not None:
            start = time.perf_counter()
            data = json.dumps(body, separators=(",", ":")).encode("utf-8")
            wire.encode_s += time.perf_counter() - start
            wire.bytes_sent += len(data)
            headers["Content-Type"] = "application/json"
        wire.requests += 1
        self._conn.request(method, self._base + path, body=data, headers=headers)
        response = self._conn.getresponse()
        if on_ok is not None and response.status == 200:
            on_ok(response)
            return 200, {}, None
        raw = response.read()
        wire.bytes_received += len(raw)
        start = time.perf_counter()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"error": {"type": "http", "message": raw[:300].decode("utf-8", "replace")}}
        wire.decode_s += time.perf_counter() - start
        retry_after = response.getheader("Retry-After")
        return response.status, payload if isinstance(payload, dict) else {}, float(retry_after) if retry_after is not None and retry_after.isdigit() else None

    def _download(self, path: str, dest: Path, size: int, sha256: str) -> None:
        """Stream one exported file into ``dest``; its size and SHA-256 must match the listing."""

        def save(response: Any) -> None:
            try:
                save_checked(response, dest, size, sha256)
            except DownloadMismatchError as exc:
                raise RemoteBackendError(
                    f"downloading {path} from {self.url}: got {exc.written} bytes with SHA-256 {exc.sha256}, "
                    f"the export lists {size} bytes with {sha256}; export again"
                ) from None

        with self._lock:  # the connection is the calls' too: one request on it at a time
            self._request("GET", path, None, f"download {path}", on_ok=save)

    def _error(self, status: int, payload: dict[str, Any], what: str) -> TinkergymError:
        """The tinkergym error for a refused call, with the server's message."""
        message = _message(payload)
        kind = (payload.get("error") or {}).get("type") if isinstance(payload.get("error"), dict) else None
        if status == 401 and kind == "lease_ended":  # a scheduler job's server whose lease ended: the job moves on
            return RemoteBackendError(f"{what}: the training server at {self.url}: {message}")
        if status == 401:
            return ConfigError(
                f"the training server at {self.url} refused the token (401 Unauthorized): check that --backend-token-file "
                "holds the token the server was started with"
            )
        if kind in ("NonFiniteError", "non_finite"):
            return NonFiniteError(message)
        if kind == "OutOfMemoryError":
            return OutOfMemoryError(f"the training server: {message}")
        if status == 400:
            return ConfigError(f"{what}: the training server refused it: {message}")
        if status == 413:
            return ConfigError(f"{what}: the request is larger than the training server accepts ({message}); send smaller batches or raise its --max-body-mb")
        return RemoteBackendError(f"{what}: the training server at {self.url} answered {status}: {message}")

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _retryable(status: int, payload: dict[str, Any]) -> bool:
    """Whether a status is worth sending again: 502/503/504, and a 500 that is not the server's own error report."""
    if status in RETRY_STATUSES:
        return True
    return status == 500 and not isinstance(payload.get("error"), dict)


def _message(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(payload.get("detail") or error or "no message")


def _relative_file(path: Any) -> str:
    """An export listing's file path, checked: relative, '/'-separated, no '..' or empty parts."""
    parts = plain_relative_parts(path)
    if parts is None:
        raise RemoteBackendError(f"the training server listed an exported file with an unusable path {path!r}")
    return "/".join(parts)


def build(request: Any) -> RemoteBackend:
    """The ``remote`` backend plugin: the training server at the run's ``backend_url``, with the request's token."""
    return RemoteBackend(request.config.backend_url, request.backend_token or "")
