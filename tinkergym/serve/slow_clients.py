"""Bounds on slow and surplus HTTP clients, for the scheduler, the training server and the inference server.

uvicorn closes a kept-alive connection that sends nothing for ``timeout_keep_alive`` seconds, but it gives a client
all the time it likes to send a request: a connection that trickles its headers (or its body) a byte at a time is
served for ever, before any key is checked. :class:`ConnectionLimits` bounds that, and
:func:`uvicorn_options` turns the limits into ``uvicorn.Config`` options, with an HTTP protocol class (a subclass of
uvicorn's httptools or h11 protocol, whichever uvicorn would pick) that:

- closes a connection whose request headers are not complete within ``header_timeout_s`` of its first byte (of the
  connection, for its first request), answering ``408 Request Timeout``;
- closes a connection whose request body has not arrived within ``body_timeout_s`` of its headers, plus one second
  for every ``body_min_rate`` bytes received (so a large body sent at a fair rate is never cut off), answering 408
  if the application has not answered yet; time the server itself stops reading (the application has not taken the
  body yet) does not count;
- answers ``431`` to request headers over ``max_header_bytes``;
- answers ``503 Service Unavailable`` at once, and closes, a connection made while ``max_connections`` are open
  (uvicorn's ``limit_concurrency``, set to the same bound, refuses requests past it as well).

Nothing here imports uvicorn until a protocol class is built, so the CLI's option defaults come from here for free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

#: Accepted connections beyond ``max_connections`` are answered 503 and closed; this long is left for the client to
#: read the answer before the socket is torn down.
REFUSED_LINGER_S = 1.0


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send a request, and how many connections are served at once.

    Args:
        header_timeout_s: A request's headers must be complete within this many seconds of its first byte.
        body_timeout_s: A request's body must arrive within this many seconds of its headers, plus one second per
            ``body_min_rate`` bytes received.
        body_min_rate: Bytes per second that earn a body more time past ``body_timeout_s``.
        max_connections: Connections open at once; a connection past it is answered 503 and closed.
        max_header_bytes: The request line and headers of one request, in bytes; more is answered 431.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    body_min_rate: float = 65536.0
    max_connections: int = 2048
    max_header_bytes: int = 65536

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "body_min_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)!r}")
        if self.max_connections < 1 or self.max_header_bytes < 1024:
            raise ValueError("max_connections must be at least 1 and max_header_bytes at least 1024")


def uvicorn_options(limits: ConnectionLimits, http: str = "auto") -> dict[str, Any]:
    """``uvicorn.Config`` options that enforce ``limits`` (``http``: ``auto``, ``httptools`` or ``h11``)."""
    return {
        "http": protocol_class(limits, http),
        # uvicorn counts the connection asking among the open ones: one more, so that max_connections are served.
        "limit_concurrency": limits.max_connections + 1,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
    }


def server_config(app: Any, limits: ConnectionLimits, **options: Any) -> Any:
    """A ``uvicorn.Config`` for ``app`` with ``options`` and the protocol and bounds of ``limits``.

    Also raises this process's soft limit of open files, where the hard limit allows, so that ``max_connections``
    sockets fit.
    """
    import uvicorn

    _raise_open_files_limit(limits.max_connections + 256)
    return uvicorn.Config(app, **options, **uvicorn_options(limits))


def _raise_open_files_limit(wanted: int) -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
    except (ImportError, OSError, ValueError):  # not on this platform, or not allowed: the kernel's limit stands
        pass


def protocol_class(limits: ConnectionLimits, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``auto``: httptools where it imports, else h11) bounded by ``limits``."""
    if http == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            http = "h11"
        else:
            http = "httptools"
    if http not in ("httptools", "h11"):
        raise ValueError(f"http {http!r}: use auto, httptools or h11")
    return _bounded(limits, http)


@cache
def _bounded(limits: ConnectionLimits, http: str) -> type[asyncio.Protocol]:
    base = _base(http)
    return type(base.__name__, (base,), {"limits": limits, "__doc__": base.__doc__})


@cache
def _base(http: str) -> type[asyncio.Protocol]:
    return _httptools_deadlines() if http == "httptools" else _h11_deadlines()


def _response(status: int, reason: str, message: str) -> bytes:
    body = message.encode("ascii")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode("ascii") + body


class RequestDeadlines:
    """The deadlines of one connection (mixed into a uvicorn protocol): headers, then body, then none until the next request."""

    limits: ConnectionLimits
    transport: Any
    loop: asyncio.AbstractEventLoop
    connections: set
    logger: logging.Logger

    _timer: asyncio.TimerHandle | None = None
    _phase: str = ""  # "headers", "body" or "" (no deadline: the request is read, or the connection is idle between requests)
    _body_started = 0.0
    _body_bytes = 0
    _header_bytes = 0
    _too_large = False
    _refused = False

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]  # the uvicorn protocol this is mixed into
        self._admit()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)  # type: ignore[misc]  # the uvicorn protocol this is mixed into

    def _admit(self) -> bool:
        """At ``connection_made``, after uvicorn counted the connection: False (and a 503) when it is one too many."""
        if len(self.connections) <= self.limits.max_connections:
            self._start_headers()
            return True
        self.connections.discard(self)
        self._refuse(_response(503, "Service Unavailable", f"more than {self.limits.max_connections} connections are open; retry later"))
        return False

    def _refuse(self, answer: bytes) -> None:
        """Send ``answer`` and end the connection, reading (and dropping) what the client still sends for a moment: a
        close with its request unread would reset the connection, and the client might not see the answer."""
        self._cancel()
        self._phase, self._refused = "", True
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.abort)

    def _headers_too_large(self) -> bytes:
        return _response(431, "Request Header Fields Too Large", f"request headers over {self.limits.max_header_bytes} bytes")

    def _start_headers(self) -> None:
        if self._phase != "headers":
            self._cancel()
            self._phase, self._header_bytes = "headers", 0
            self._timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _start_body(self) -> None:
        self._cancel()
        self._phase, self._body_started, self._body_bytes = "body", time.monotonic(), 0
        self._timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.limits.max_header_bytes:
            self._too_large = True
            raise ValueError("request headers too large")  # stops the parser; its error answer becomes a 431

    def _request_read(self) -> None:
        self._cancel()
        self._phase = ""

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self._phase != "headers" or self.transport.is_closing():
            return
        self._close(f"request headers not complete within {self.limits.header_timeout_s:g} s", answer=True)

    def _body_late(self) -> None:
        self._timer = None
        if self._phase != "body" or self.transport.is_closing():
            return
        limits = self.limits
        flow = getattr(self, "flow", None)
        if flow is not None and flow.read_paused:  # the server is not reading (the app has not taken the body): not the client's delay
            self._body_started += limits.body_timeout_s
            self._timer = self.loop.call_later(limits.body_timeout_s, self._body_late)
            return
        deadline = self._body_started + limits.body_timeout_s + self._body_bytes / limits.body_min_rate
        left = deadline - time.monotonic()
        if left > 0:
            self._timer = self.loop.call_later(left, self._body_late)
            return
        cycle = getattr(self, "cycle", None)
        self._close(f"request body not received within {limits.body_timeout_s:g} s (plus 1 s per {limits.body_min_rate:g} bytes)",
                    answer=cycle is None or not cycle.response_started)

    def _close(self, why: str, *, answer: bool) -> None:
        self._phase = ""
        client = getattr(self, "client", None)
        self.logger.info("closing the connection from %s: %s", f"{client[0]}:{client[1]}" if client else "a client", why)
        if answer:
            self.transport.write(_response(408, "Request Timeout", why))
        self.transport.close()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.abort)  # a client that reads nothing cannot hold the socket


def _httptools_deadlines() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsDeadlines(RequestDeadlines, HttpToolsProtocol):
        """uvicorn's httptools protocol with :class:`RequestDeadlines` (its parser's callbacks mark the phases)."""

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._start_headers()

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._start_body()
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._request_read()
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if self._too_large:
                self._refuse(self._headers_too_large())
            else:
                super().send_400_response(msg)

    return HttpToolsDeadlines


def _h11_deadlines() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11Deadlines(RequestDeadlines, H11Protocol):
        """uvicorn's h11 protocol with :class:`RequestDeadlines` (the phase follows h11's state of the client)."""

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._phase == "body":
                self._body_bytes += len(data)
            elif self.conn.their_state is h11.IDLE:
                self._start_headers()  # the first byte of a request (the keep-alive timer watched the idle time before it)
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._follow(between_requests=True)

        def send_400_response(self, msg: str) -> None:
            if self.conn.their_state is h11.ERROR and len(self.conn.trailing_data[0]) > self.limits.max_header_bytes:
                self._refuse(self._headers_too_large())  # h11 bounds what it buffers of an incomplete request
            else:
                super().send_400_response(msg)

        def _follow(self, between_requests: bool = False) -> None:
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if self._phase != "body":
                    self._start_body()
            elif state is h11.IDLE:
                if between_requests and self.conn.trailing_data[0]:
                    self._start_headers()  # the next request has begun
                elif between_requests:
                    self._request_read()
            elif self._phase:
                self._request_read()

    return H11Deadlines
