"""The stable endpoint of an inference job: ``/v1/jobs/{id}/openai/v1/...`` forwarded to the job's current server.

An inference (or eval) job's server moves when its worker dies: the job is queued again, another worker starts a
new server at a new URL with a new lease epoch's token. An OpenAI client given ``base_url =
<scheduler>/v1/jobs/<id>/openai/v1`` and the owner's API key (a tenant key with the ``write`` scope: the gateway
grants what ``GET /v1/jobs/{id}/connection`` grants, the use of the job's server) keeps working across such moves:
every request is forwarded to the server the job runs on now, with that epoch's token (derived as for the
connection, never stored) in place of the owner's key, and the answer streams back as it comes (server-sent
events chunk by chunk, nothing buffered).

Answers of the gateway itself: 404 for an unknown job, another tenant's, or one whose kind is not served (training
traffic never passes through the scheduler); 503 with ``Retry-After`` while the job has no server that answers
(queued, starting, or its server gone before the lease expired); 409 once the job has ended (or is being
cancelled); 429 with
``Retry-After`` past the tenant's ``gateway_max_per_tenant`` requests in flight; 504 when the server sends nothing
for ``gateway_read_timeout_s``. The app's body limit (``max_body_bytes``) bounds what is forwarded.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from tinkergym.serve.asgi import error_response
from tinkergym.scheduler import leases, states
from tinkergym.scheduler.deps import require
from tinkergym.scheduler.auth import Principal
from tinkergym.scheduler.repository import Conflict, NotFound
from tinkergym.scheduler.worker.job_servers import SERVING_KINDS

router = APIRouter(prefix="/v1/jobs", tags=["gateway"])

#: Request headers passed to the job's server (the owner's Authorization and every other header stay here).
FORWARDED_REQUEST_HEADERS = ("content-type", "accept")
#: Response headers passed back to the client.
FORWARDED_RESPONSE_HEADERS = ("content-type", "cache-control", "retry-after")
#: Seconds a client is told to wait (Retry-After) while the job has no server.
RETRY_AFTER_S = 5
#: Connections kept to the jobs' servers, per app.
MAX_CONNECTIONS = 256
CONNECT_TIMEOUT_S = 5.0


class Forwarding:
    """The app's forwarding state: one HTTP client (per event loop) and the count of requests in flight per tenant."""

    def __init__(self, max_per_tenant: int, read_timeout_s: float) -> None:
        self.max_per_tenant = max_per_tenant
        self.read_timeout_s = read_timeout_s
        self.in_flight: dict[str, int] = {}
        self._client: Any = None
        self._loop: Any = None

    def client(self) -> Any:
        """The shared ``httpx.AsyncClient`` of the running event loop (a client's connections belong to one loop)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            timeout = httpx.Timeout(self.read_timeout_s, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S)
            limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=32, keepalive_expiry=30.0)
            self._client, self._loop = httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False, trust_env=False), loop
        return self._client

    def acquire(self, tenant: str) -> bool:
        """Count one more request of ``tenant`` in flight; False (nothing counted) past the cap."""
        held = self.in_flight.get(tenant, 0)  # the event loop's thread alone touches the counts: no lock
        if held >= self.max_per_tenant:
            return False
        self.in_flight[tenant] = held + 1
        return True

    def release(self, tenant: str) -> None:
        held = self.in_flight.get(tenant, 1) - 1
        if held > 0:
            self.in_flight[tenant] = held
        else:
            self.in_flight.pop(tenant, None)

    async def aclose(self) -> None:
        """Close the shared client (at the app's shutdown)."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._loop = None


#: The last event of a streamed answer cut off because its key was revoked (an OpenAI client reads it as an error).
REVOKED_EVENT = b'data: {"error": {"type": "unauthorized", "message": "the API key was revoked: this answer ends here"}}\n\n'


class ForwardedResponse(StreamingResponse):
    """The server's answer streamed back as it arrives.

    The upstream response is closed and the tenant's slot freed however the stream ends: at its last chunk (before the
    end of the body is sent, so a client that saw the end may send its next request at once), with the client gone or
    the request cancelled, or when the key that sent it is revoked (``watch``, a subscription of the app's stream hub
    that the hub's watcher wakes then, as it ends event streams): a server-sent answer gets one last error event.
    """

    def __init__(self, upstream: Any, done: Any, watch: Any = None) -> None:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() in FORWARDED_RESPONSE_HEADERS}
        super().__init__(self._chunks(upstream), status_code=upstream.status_code, headers=headers)
        self.upstream = upstream
        self.released = False
        self.done = done
        self.watch = watch
        self.events = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def _chunks(self, upstream: Any) -> Any:
        revoked = None if self.watch is None else asyncio.ensure_future(self.watch.wake.wait())
        chunks = upstream.aiter_raw().__aiter__()
        try:
            while True:
                step = asyncio.ensure_future(chunks.__anext__())
                while revoked is not None and not step.done():
                    await asyncio.wait({step, revoked}, return_when=asyncio.FIRST_COMPLETED)
                    if revoked.done() and not self.watch.revoked:  # woken for nothing: wait on
                        self.watch.wake.clear()
                        revoked = asyncio.ensure_future(self.watch.wake.wait())
                        continue
                    if not step.done():  # the key was revoked while the server was still answering
                        step.cancel()
                        await asyncio.gather(step, return_exceptions=True)
                        if self.events:
                            yield REVOKED_EVENT
                        return
                try:
                    chunk = await step
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            if revoked is not None:
                revoked.cancel()
            await self._finish()

    async def _finish(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            await self.upstream.aclose()
        finally:
            self.done()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._finish()


def _unavailable(message: str) -> Any:
    return error_response(503, "unavailable", message, headers={"Retry-After": str(RETRY_AFTER_S)})


def _served_job(request: Request, job_id: str, tenant_id: str) -> dict[str, Any]:
    store = request.app.state.store
    with store.read() as conn:
        job = store.get(conn, job_id, tenant_id)
    if job["kind"] not in SERVING_KINDS:  # a training job's server is the client's to call, never through here
        raise NotFound(job_id)
    return job


GATEWAY_PATH = "/{job_id}/openai/v1/{path:path}"
ANSWERS: dict[int | str, dict[str, Any]] = {404: {}, 409: {}, 413: {}, 429: {}, 502: {}, 503: {}, 504: {}}


@router.post(GATEWAY_PATH, responses=ANSWERS, operation_id="gateway_post", summary="Forward a POST to the inference job's current server")
@router.get(GATEWAY_PATH, responses=ANSWERS, operation_id="gateway_get", summary="Forward a GET to the inference job's current server")
async def forward(job_id: str, path: str, request: Request, who: Principal = Depends(require("write"))) -> Any:
    """Forward ``/v1/{path}`` (``models``, ``completions``, ``chat/completions``...) to the job's running server.

    The answer is the server's, streamed back unchanged (``stream: true`` as server-sent events).
    """
    if any(part in (".", "..") for part in path.split("/")):  # the server's /v1 API only, whatever the client's encoding
        raise NotFound(job_id)
    job = await run_in_threadpool(_served_job, request, job_id, who.tenant_id)
    if job["state"] in states.TERMINAL or job["state"] == states.CANCELLING:
        raise Conflict(f"job {job_id} is {job['state']}: it serves no more; submit a new inference job")
    if job["state"] != states.RUNNING or not job["server_url"]:
        return _unavailable(f"job {job_id} is {job['state']}: it has no server yet; retry shortly")
    gate: Forwarding = request.app.state.gateway
    if not gate.acquire(who.tenant_id):
        return error_response(429, "too_many_requests", f"this tenant has {gate.max_per_tenant} requests in flight through the gateway; "
                              "retry when one ends", headers={"Retry-After": "1"})
    hub = request.app.state.streams
    watch = hub.watch_key(who.key_id)  # the answer ends when the key is revoked

    def done() -> None:
        hub.close(watch)
        gate.release(who.tenant_id)

    try:
        return await _send(request, gate, job, path, done, watch)
    except BaseException:
        done()
        raise


async def _send(request: Request, gate: Forwarding, job: dict[str, Any], path: str, done: Any, watch: Any = None) -> Any:
    import httpx

    token = leases.token_for(request.app, job["id"], job["lease_epoch"])
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
    headers.update({"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"})
    query = request.url.query
    url = f"{job['server_url'].rstrip('/')}/v1/{quote(path, safe='/')}" + (f"?{query}" if query else "")
    client = gate.client()
    upstream_request = client.build_request(request.method, url, headers=headers, content=await request.body())
    try:
        upstream = await client.send(upstream_request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError):
        done()
        return _unavailable(f"job {job['id']}'s server does not answer (its worker may be gone); retry shortly")
    except httpx.TimeoutException:
        done()
        return error_response(504, "timeout", f"job {job['id']}'s server sent nothing for {gate.read_timeout_s:g} s")
    except httpx.HTTPError as exc:
        done()
        return error_response(502, "bad_gateway", f"job {job['id']}'s server failed to answer ({type(exc).__name__})")
    if upstream.status_code == 401:  # the owner's key was checked here: a 401 there means this epoch's token is done
        await upstream.aclose()
        done()
        return _unavailable(f"job {job['id']}'s lease has ended on its server (the job is moving); retry shortly")
    return ForwardedResponse(upstream, done, watch)
