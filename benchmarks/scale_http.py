"""The keep-alive asyncio HTTP client of the cluster simulator (``scheduler_scale.py``): thousands of simulated workers
and tenants share a pool of connections to one scheduler, with no dependency beyond the standard library."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any


class Http:
    """HTTP/1.1 requests to 127.0.0.1:``port`` over a pool of kept-alive connections; ``(status, json body)``."""

    def __init__(self, port: int, size: int) -> None:
        self.port = port
        self.size = size
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.slots = asyncio.Semaphore(size)
        self.requests = 0

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 22)

    async def request(self, method: str, path: str, key: str, body: Any = None, headers: dict[str, str] | None = None,
                      timeout: float = 120.0) -> tuple[int, Any]:
        if method == "POST" and "/v1/workers" in path and headers is None:  # the worker client keys every POST (its retries reuse it)
            headers = {"Idempotency-Key": uuid.uuid4().hex}
        data = b"" if body is None else json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n{extra}"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        async with self.slots:
            for attempt in range(3):
                fresh = not self.idle
                reader, writer = self.idle.pop() if self.idle else await self._connect()
                try:
                    writer.write(head + data)
                    status, payload, keep = await asyncio.wait_for(_read_response(reader), timeout)
                except (ConnectionError, asyncio.IncompleteReadError, OSError):
                    writer.close()
                    if attempt == 2:
                        raise
                    if fresh:  # closed unanswered (an overloaded server drops a request whose head it did not read in time):
                        await asyncio.sleep(0.2 * (attempt + 1))  # again after a pause, as the worker's client does
                    continue  # a kept-alive connection the server closed while idle: at once on a new one
                except asyncio.TimeoutError:
                    writer.close()
                    raise
                if keep:
                    self.idle.append((reader, writer))
                else:
                    writer.close()
                self.requests += 1
                return status, payload
        raise RuntimeError("unreachable")

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, Any, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    keep = headers.get("connection", "").lower() != "close"
    try:
        payload = json.loads(body) if body.strip() else None
    except ValueError:
        payload = body.decode(errors="replace")
    return status, payload, keep
