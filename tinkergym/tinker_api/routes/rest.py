"""The REST listing: a tenant's training runs and their checkpoints, deleted, and a checkpoint's weights' facts."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from tinkergym.tinker_api.deps import Service, Tenant

router = APIRouter()


@router.get("/api/v1/training_runs")
async def training_runs(service: Service, who: Tenant, limit: int = 20, offset: int = 0) -> JSONResponse:
    mine = [run for run in service.runs.values() if run.tenant == who]
    page = mine[max(0, offset): max(0, offset) + max(1, min(limit, 1000))]
    return JSONResponse({"training_runs": [run.describe() for run in page], "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)}})


@router.get("/api/v1/training_runs/{model_id}")
async def training_run(model_id: str, service: Service, who: Tenant) -> JSONResponse:
    return JSONResponse(service.run(who, model_id).describe())


@router.get("/api/v1/training_runs/{model_id}/checkpoints")
async def checkpoints(model_id: str, service: Service, who: Tenant) -> JSONResponse:
    run = service.run(who, model_id)
    return JSONResponse({"checkpoints": [c.describe(run.model_id) for c in run.checkpoints.values()], "cursor": None})


@router.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(model_id: str, checkpoint_id: str, service: Service, who: Tenant) -> Response:
    await run_in_threadpool(service.delete_checkpoint, who, model_id, checkpoint_id)
    return Response(status_code=204)


@router.post("/api/v1/weights_info")
async def weights_info(request: Request, service: Service, who: Tenant) -> JSONResponse:
    data = await request.json()
    run, _ = service.checkpoint(who, str(data.get("tinker_path", "")))
    return JSONResponse({"base_model": run.base_model, "is_lora": True, "lora_rank": run.rank, "train_unembed": False,
                         "train_mlp": True, "train_attn": True})
