"""ASGI pieces shared by tinkergym's servers (training, inference, scheduler): exact JSON, body limits, request logs."""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import time
import urllib.parse
from typing import Any
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class WireJSON(JSONResponse):
    """JSON with floats as Python writes them (exact round trip), non-finite ones as ``NaN`` / ``Infinity``.

    Text that UTF-8 cannot carry (a lone UTF-16 surrogate, stored before :class:`StrictJSON` refused it) is sent as
    a JSON escape instead, so whatever was stored can always be answered.
    """

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode("ascii")


#: Characters no database column stores and no UTF-8 reply carries: NUL (PostgreSQL refuses it in text) and lone
#: UTF-16 surrogates (which only a JSON escape such as ``\ud800`` can produce).
UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")


def unstorable_text(value: Any, where: str) -> str | None:
    """Where in ``value`` (JSON data: keys and string values, nested) a string holds a NUL or a lone surrogate, or None."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            if UNSTORABLE.search(item):
                return at
        elif isinstance(item, dict):
            for key, child in item.items():
                if UNSTORABLE.search(key):
                    return f"{at} (a key)"
                stack.append((child, f"{at}.{key[:40]}"))
        elif isinstance(item, list):
            stack.extend((child, f"{at}[{i}]") for i, child in enumerate(item))
    return None


#: What a JSON body must hold to carry a number that is not finite: Python's ``NaN`` and ``Infinity`` (which its json
#: reads), an exponent of three digits (``1e999``) or a run of 309 digits (both past a float's range: infinity).
_NOT_FINITE_HINT = re.compile(rb"NaN|Infinity|[0-9][eE]\+?[0-9]{3}|[0-9]{309}")


def non_finite_number(value: Any, where: str, allow_infinity: bool = False) -> str | None:
    """Where in ``value`` (JSON data, nested) a number is NaN or (unless ``allow_infinity``) infinite, or None."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, float):
            if item != item or (not allow_infinity and not math.isfinite(item)):
                return at
        elif isinstance(item, dict):
            stack.extend((child, f"{at}.{str(key)[:40]}") for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, f"{at}[{i}]") for i, child in enumerate(item))
    return None


class StrictJSON:
    """Refuse, with 400, what could be stored but not answered, or computed with but not meant: a NUL or a lone
    surrogate in the path, the query or any string of a JSON body (keys included), and a number of a JSON body that is
    NaN or infinite (``NaN``, ``Infinity``, ``1e999``), before any route sees it. The refusal names the field. A server
    whose protocol gives infinity a meaning (the training servers: a clip or a gradient norm at infinity bounds nothing)
    passes ``allow_infinity=True``: NaN alone is refused here, and each field's own check bounds the rest.

    JSON bodies are read whole (bounded by :class:`BodyLimit`, which must be added after this, outside it) and replayed
    to the app; only a body with a backslash-u escape, or with the text of a number that is not finite, is parsed (the
    only ways such characters or numbers reach JSON text). Bodies of
    another content type, and requests ``exempt(scope)`` names, pass as they are. ``answer(status, kind, message)`` builds
    the refusal (default :func:`error_response`), as for :class:`BodyLimit`.
    """

    def __init__(self, app: Any, exempt: Callable[[dict], bool] | None = None, answer: Callable[[int, str, str], Any] | None = None,
                 allow_infinity: bool = False) -> None:
        self.app = app
        self.exempt = exempt
        self.answer = answer or error_response
        self.allow_infinity = allow_infinity

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (self.exempt is not None and self.exempt(scope)):
            return await self.app(scope, receive, send)
        query = urllib.parse.unquote(scope.get("query_string", b"").decode("latin-1"), errors="replace")
        problem = next((at for text, at in ((scope["path"], "the path"), (query, "the query string")) if UNSTORABLE.search(text)), None)
        content_type = dict(scope["headers"]).get(b"content-type", b"application/json")
        if problem is None and b"json" in content_type:
            chunks, more = [], True
            try:
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        return
                    chunks.append(message.get("body", b""))
                    more = message.get("more_body", False)
            except BodyTooLarge as exc:  # raised by BodyLimit, outside the app's own handlers
                await self.answer(exc.status_code, "body_too_large", str(exc.detail))(scope, receive, send)
                return
            body = b"".join(chunks)
            text_hint = b"\\u" in body
            number_hint = (b"NaN" in body) if self.allow_infinity else _NOT_FINITE_HINT.search(body) is not None
            if text_hint or number_hint:
                try:
                    data = json.loads(body)
                except ValueError:
                    pass  # not JSON: the route answers that
                else:
                    problem = unstorable_text(data, "the body") if text_hint else None
                    number = non_finite_number(data, "the body", self.allow_infinity) if number_hint and problem is None else None
                    if number is not None:
                        what = "NaN" if self.allow_infinity else "not a finite number (NaN or infinite)"
                        message = f"{number} is {what}: send a finite number in its range"
                        await self.answer(400, "invalid_request", message)(scope, receive, send)
                        return
            replayed, upstream = False, receive

            async def replay() -> dict:
                nonlocal replayed
                if replayed:
                    return await upstream()  # http.disconnect, when the client goes
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            receive = replay
        if problem is not None:
            message = f"{problem} holds a NUL character or a lone UTF-16 surrogate, which cannot be stored: send valid Unicode text"
            await self.answer(400, "invalid_request", message)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def error_response(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> WireJSON:
    """``{"error": {"type", "message"}}`` with ``status``."""
    return WireJSON({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


class BodyTooLarge(StarletteHTTPException):
    """A request body past the limit (raised while it streams in)."""


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with 413: by ``Content-Length`` before reading, and by counting streamed bytes.

    ``exempt(scope)``, when given, names the requests that pass unlimited (a route that streams large bodies
    to disk under a limit of its own, such as the scheduler's artifact uploads). ``answer(status, kind, message)``
    builds the refusal of a declared length (default :func:`error_response`); a body that streams past the limit
    raises :class:`BodyTooLarge`, which the app's exception handlers answer in the same shape.
    """

    def __init__(self, app: Any, max_bytes: int, hint: str = "send a smaller request", exempt: Callable[[dict], bool] | None = None,
                 answer: Callable[[int, str, str], Any] = error_response) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.hint = hint
        self.exempt = exempt
        self.answer = answer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (self.exempt is not None and self.exempt(scope)):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            status = 413 if declared.isdigit() else 400
            response = self.answer(status, "body_too_large" if status == 413 else "invalid_request", self._message(declared))
            return await response(scope, receive, send)
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(413, self._message(None))
            return message

        await self.app(scope, limited_receive, send)

    def _message(self, declared: bytes | None) -> str:
        if declared is not None and not declared.isdigit():
            return f"Content-Length {declared[:40]!r} is not a number"
        return f"request body too large: the server takes bodies of at most {self.max_bytes:,} bytes; {self.hint}"


def status_of(send: Any) -> tuple[Any, list[int]]:
    """``(send, status)``: ``send`` wrapped to note the answer's status in ``status[0]`` (500 until one is sent)."""
    status = [500]

    async def send_status(message: dict) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        await send(message)

    return send_status, status


class RequestLog:
    """One JSON line per request: request id, method, route, status, duration in ms, session and seq."""

    def __init__(self, app: Any, logger: logging.Logger) -> None:
        self.app = app
        self.logger = logger

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        send_status, status = status_of(send)
        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or scope.get("path", "")
            self.logger.info(json.dumps({
                "event": "request", "request_id": state.get("request_id") or secrets.token_hex(8),
                "method": scope.get("method"), "route": route[:200], "status": status[0],
                "duration_ms": round(1000 * (time.perf_counter() - start), 1),
                "session": state.get("session"), "seq": state.get("seq"),
            }))


def add_error_handlers(app: Any, logger: logging.Logger, log_name: str = "the server log") -> None:
    """The JSON error bodies every tinkergym server gives: HTTP errors as they are, malformed requests 400,
    anything unexpected 500 with its traceback in the log only (``log_name`` says where to look)."""
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Any, exc: StarletteHTTPException) -> WireJSON:
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        return error_response(exc.status_code, kinds.get(exc.status_code, "invalid_request"), str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Any, exc: RequestValidationError) -> WireJSON:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5])
        return error_response(400, "invalid_request", f"malformed request: {problems}"[:2000])

    @app.exception_handler(Exception)
    async def unexpected(request: Any, exc: Exception) -> WireJSON:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, "internal", f"unexpected server error ({type(exc).__name__}); see {log_name}")


class ThreadServer:
    """An ASGI app under uvicorn on 127.0.0.1 in a daemon thread of this process (tests, benchmarks, embedding).

    The listening socket is created with ``IPPROTO_TCP`` as uvicorn's own are: asyncio turns Nagle's algorithm
    off only for such sockets, and without that every kept-alive request waits 40 ms for a delayed ACK.
    ``timeout_graceful_shutdown`` bounds how long :meth:`stop` waits for open streams and long polls; other
    keyword arguments go to ``uvicorn.Config``.
    """

    def __init__(
        self, app: Any, *, timeout_graceful_shutdown: float = 1.0, log_level: str = "critical", start_timeout: float = 30.0, **config: Any,
    ) -> None:
        import socket
        import threading

        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level=log_level,
            timeout_graceful_shutdown=timeout_graceful_shutdown,  # type: ignore[arg-type]  # uvicorn's int: it goes to asyncio.wait_for, which takes a float
            **config,
        ))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Shut the server down (graceful, bounded) and close its socket."""
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.socket.close()
