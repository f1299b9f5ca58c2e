"""A run's weights: saved as a state, for a sampler or for download (and their signed URLs), loaded."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import FileResponse, JSONResponse, Response
from tinker import types

from tinkergym.tinker_api import ops
from tinkergym.tinker_api.deps import Credential, Service, Tenant, future, read_body, refusal
from tinkergym.tinker_api.service import EXTERNAL_FILES_ROUTE, TinkerError

router = APIRouter()


@router.post("/api/v1/save_weights")
async def save_weights(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.SaveWeightsRequest)
    run = service.run(who, parsed.model_id, credential)
    save = ops.save_state(service, run, parsed.path, "training", parsed.user_metadata)
    return future(service.submit(who, lambda: {"path": save(), "type": "save_weights"}, run), run.model_id)


@router.post("/api/v1/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.SaveWeightsForSamplerRequest)
    run = service.run(who, parsed.model_id, credential)
    if parsed.path is None:

        def snapshot() -> dict[str, Any]:
            sampler = service.sampler_from_run(run, credential)
            return {"path": None, "sampling_session_id": sampler.sampler_id, "type": "save_weights_for_sampler"}

        return future(service.submit(who, snapshot, run), run.model_id)
    save = ops.save_state(service, run, parsed.path, "sampler", parsed.user_metadata)
    return future(service.submit(who, lambda: {"path": save(), "type": "save_weights_for_sampler"}, run), run.model_id)


@router.post("/api/v1/save_weights_external")
async def save_weights_external(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.SaveWeightsExternalRequest)
    if parsed.age_encryption_recipients:
        raise TinkerError(400, "age encryption of exported weights is not offered by this server: save without "
                               "age_encryption_recipients (the files are served only to signed URLs of your key's runs)")
    run = service.run(who, parsed.model_id, credential)
    save = ops.save_state(service, run, parsed.path, "external", None)
    return future(service.submit(who, lambda: {"path": save(), "type": "save_weights_external"}, run), run.model_id)


@router.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request, service: Service, who: Tenant) -> JSONResponse:
    return JSONResponse(service.external_urls(who, model_id, checkpoint_id, str(request.base_url)))


@router.get(EXTERNAL_FILES_ROUTE + "/{token}")
async def external_weights_file(token: str, service: Service) -> Response:
    # A file of an external checkpoint, to a signed URL: its own credential (no API key).
    try:
        file = service.signed_file(token)
    except TinkerError as exc:
        return refusal(exc.status, exc.message)
    except ValueError:  # a token that is not ours (undecodable): the signature check passed only for ours
        return refusal(403, "this download URL is not valid here")
    return FileResponse(file, media_type="application/octet-stream")


@router.post("/api/v1/load_weights")
async def load_weights(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.LoadWeightsRequest)
    if parsed.model_id is not None:
        run = service.run(who, parsed.model_id, credential)
    else:  # create-via-load: a new run with the checkpoint's rank
        if parsed.session_id is None or parsed.model_seq_id is None:
            raise TinkerError(400, "load_weights needs model_id, or session_id and model_seq_id")
        source, checkpoint = service.checkpoint(who, parsed.path)
        run = await run_in_threadpool(service.create_run, who, parsed.session_id, parsed.model_seq_id, parsed.base_model or source.base_model,
                                      source.rank, None, parsed.user_metadata, credential, checkpoint.saved)
    load = ops.load_state(service, run, parsed.path, bool(parsed.optimizer))
    return future(service.submit(who, lambda: {"path": load(), "model_id": run.model_id, "type": "load_weights"}, run), run.model_id)
