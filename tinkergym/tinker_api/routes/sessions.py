"""The service's own routes (health, the client's config, capabilities, telemetry) and sessions: what a ``ServiceClient``
asks when it starts and while it lives."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response
from tinker import types

from tinkergym.tinker_api.deps import Credential, Service, Tenant, read_body, refusal
from tinkergym.tinker_api.service import TinkerError

router = APIRouter()

#: What the SDK reads at start (``ClientConfigResponse``): API keys (no JWT exchange), zstd-compressed protobuf
#: forward_backward bodies, one chunk per turn (this server runs a run's requests in arrival order), custom losses on
#: the client.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "proto_compress_fwdbwd": True,
    "parallel_fwdbwd_chunks": False,
    "custom_loss_server_side": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "use_pyqwest_transport": False,
}


@router.get("/api/v1/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.post("/api/v1/client/config")
async def client_config() -> JSONResponse:
    return JSONResponse(CLIENT_CONFIG)


@router.post("/api/v1/client/dynamic_config")
async def dynamic_config() -> JSONResponse:
    return JSONResponse({"refresh_interval_sec": 300, "sample_cancel_enabled": False})


@router.post("/api/v1/telemetry")
async def telemetry() -> JSONResponse:
    return JSONResponse({"status": "accepted"})


@router.get("/api/v1/get_server_capabilities")
async def capabilities(service: Service) -> JSONResponse:
    return JSONResponse(service.capabilities())


@router.post("/api/v1/create_session")
async def create_session(request: Request, service: Service, who: Tenant) -> JSONResponse:
    await read_body(request, types.CreateSessionRequest)
    session_id = service.create_session(who)
    return JSONResponse({"type": "create_session", "session_id": session_id})


@router.post("/api/v1/session_heartbeat")
async def heartbeat(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.SessionHeartbeatRequest)
    try:
        await run_in_threadpool(service.heartbeat, who, parsed.session_id, credential)
    except TinkerError as exc:
        if exc.status == 404:
            return refusal(410, f"session {parsed.session_id[:80]!r} has ended")
        raise
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/api/v1/sessions/{session_id}/finish")
async def finish(session_id: str, service: Service, who: Tenant) -> Response:
    await run_in_threadpool(service.finish_session, who, session_id)
    return Response(status_code=200, content=b"null", media_type="application/json")
