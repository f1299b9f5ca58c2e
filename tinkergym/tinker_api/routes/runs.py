"""Training runs: created, described, trained (forward, forward_backward, optim_step)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from tinker import types

from tinkergym.tinker_api import ops
from tinkergym.tinker_api.deps import Credential, Service, Tenant, future, read_body
from tinkergym.tinker_api.service import TinkerError

router = APIRouter()


@router.post("/api/v1/create_model")
async def create_model(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.CreateModelRequest)
    lora = parsed.lora_config
    if lora is None:
        raise TinkerError(400, "full fine-tuning is not offered through the Tinker API here: create a LoRA training client")
    if getattr(parsed.optimizer_config, "type", "adamw") != "adamw":
        raise TinkerError(400, f"optimizer {parsed.optimizer_config.type!r} is not offered: this server trains with AdamW")
    if not (lora.train_attn and lora.train_mlp):
        raise TinkerError(400, "LoRA on attention or MLP layers alone is not offered: this server adapts every linear layer")
    run = await run_in_threadpool(service.create_run, who, parsed.session_id, parsed.model_seq_id, parsed.base_model, lora.rank,
                                  lora.seed, parsed.user_metadata, credential)
    request_id = service.submit(who, lambda: {"model_id": run.model_id, "type": "create_model"}, run)
    return future(request_id, run.model_id)


@router.post("/api/v1/get_info")
async def get_info(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.GetInfoRequest)
    run = service.run(who, parsed.model_id, credential)
    facts = service.engine.model_info(run.base_model)
    return JSONResponse({"type": "get_info", "model_id": run.model_id, "is_lora": True, "lora_rank": run.rank, "model_name": run.base_model,
                         "model_data": {"arch": facts["arch"], "model_name": run.base_model, "tokenizer_id": facts["tokenizer_id"]}})


@router.post("/api/v1/forward_backward")
async def forward_backward(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    from tinkergym.tinker_api.wire import decode_forward_backward

    raw = await request.body()
    try:
        parsed, forward_only = decode_forward_backward(raw, request.headers.get("content-encoding"))
    except ValueError as exc:
        raise TinkerError(400, f"malformed forward_backward body: {str(exc)[:500]}") from None
    run = service.run(who, parsed.model_id, credential)
    operation = await run_in_threadpool(ops.forward_backward, service, run, parsed, forward_only)
    return future(service.submit(who, operation, run), run.model_id)


@router.post("/api/v1/optim_step")
async def optim_step(request: Request, service: Service, who: Tenant, credential: Credential) -> JSONResponse:
    parsed = await read_body(request, types.OptimStepRequest)
    run = service.run(who, parsed.model_id, credential)
    return future(service.submit(who, ops.optim_step(service, run, parsed), run), run.model_id)
