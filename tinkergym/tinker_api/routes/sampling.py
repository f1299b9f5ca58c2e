"""Samplers: created, described, sampled."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from tinker import types

from tinkergym.tinker_api import ops
from tinkergym.tinker_api.deps import Credential, Service, Tenant, future, read_body
from tinkergym.tinker_api.service import TinkerError

router = APIRouter()


@router.post("/api/v1/create_sampling_session")
async def create_sampling_session(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.CreateSamplingSessionRequest)
    sampler = await run_in_threadpool(service.create_sampler, who, parsed.session_id, parsed.base_model, parsed.model_path, credential)
    return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id})


@router.get("/api/v1/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, service: Service, who: Tenant) -> JSONResponse:
    sampler = service.sampler(who, sampler_id)
    return JSONResponse({"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path})


@router.post("/api/v1/asample")
async def asample(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.SampleRequest)
    if parsed.sampling_session_id is None:
        raise TinkerError(400, "sample through a sampling client (create_sampling_client): this server needs a sampling_session_id")
    sampler = service.sampler(who, parsed.sampling_session_id, credential)
    operation, ids = await run_in_threadpool(ops.sample, service, sampler, parsed)  # image chunks are decoded there
    return future(service.submit(who, operation), None, sample_sequence_ids=ids)
