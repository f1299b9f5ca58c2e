"""Futures: a request's result retrieved (long-polled), or the request cancelled."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from tinker import types

from tinkergym.tinker_api.deps import Service, Tenant, get_logger, read_body
from tinkergym.tinker_api.service import TinkerError

router = APIRouter()

#: How long ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK waits 45 s for an answer).
RETRIEVE_WAIT_S = 20.0
PROTO = "application/x-protobuf"


@router.post("/api/v1/retrieve_future")
async def retrieve_future(request: Request, service: Service, who: Tenant) -> Response:
    parsed = await read_body(request, types.FutureRetrieveRequest)
    pending = service.pending(who, parsed.request_id)
    waiting = asyncio.wrap_future(pending.future)
    await asyncio.wait({waiting}, timeout=RETRIEVE_WAIT_S)  # never cancels the operation
    if not pending.future.done():
        return JSONResponse({"type": "try_again", "request_id": parsed.request_id, "queue_state": "active"})
    if pending.future.cancelled():
        return JSONResponse({"error": "the request was cancelled", "category": "user"})
    exc = pending.future.exception()
    if isinstance(exc, TinkerError):
        return JSONResponse({"error": exc.message, "category": exc.category})
    if exc is not None:
        get_logger(request).error(json.dumps({"event": "tinker_request_failed", "request_id": parsed.request_id, "error": repr(exc)[:2000]}),
                                  exc_info=exc)  # the traceback: where in the server it failed
        return JSONResponse({"error": f"the request failed on the server ({type(exc).__name__}); request id {parsed.request_id} "
                                      "in the server log", "category": "server"})
    result = pending.future.result()
    if isinstance(result, types.ForwardBackwardOutput):
        from tinkergym.tinker_api.wire import encode_forward_backward_output

        return Response(encode_forward_backward_output(result), media_type=PROTO)
    if isinstance(result, types.SampleResponse):
        from tinkergym.tinker_api.wire import encode_sample_response

        return Response(encode_sample_response(result), media_type=PROTO)
    return JSONResponse(result.model_dump(mode="json", exclude_none=False) if hasattr(result, "model_dump") else result)


@router.post("/api/v1/cancel_future")
async def cancel_future(request: Request, service: Service, who: Tenant) -> Response:
    data = await request.json()
    service.cancel(who, str(data.get("request_id", "")))
    return Response(status_code=200, content=b"null", media_type="application/json")
