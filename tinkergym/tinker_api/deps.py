"""What a Tinker API route depends on: the service, the request's tenant and key, its body as an SDK type, and the answers
the SDK reads (a queued request's future, a refusal).

Routes take the service, the tenant and the key as FastAPI dependencies (:data:`Service`, :data:`Tenant`, :data:`Credential`),
read from ``app.state`` and ``request.state``, where :func:`~tinkergym.tinker_api.app.create_tinker_app` and its key check
put them. Routes import what they need from here, and the app (which adds the key check and the handler that answers
:class:`~tinkergym.tinker_api.service.TinkerError`) imports the routes: no module imports the other back.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel
from starlette.responses import JSONResponse

from tinkergym.tinker_api.service import TinkerError, TinkerService

Body = TypeVar("Body", bound=BaseModel)


def refusal(status: int, message: str) -> JSONResponse:
    """A refusal as the SDK reads it: the message under ``detail`` (and again under ``error``)."""
    return JSONResponse({"detail": message, "error": message}, status_code=status)


async def get_service(request: Request) -> TinkerService:  # async: FastAPI would run a plain def in a thread
    """The app's :class:`~tinkergym.tinker_api.service.TinkerService`."""
    return request.app.state.tinker


async def get_tenant(request: Request) -> str:
    """The tenant of the request's API key (the app's key check sets it)."""
    return request.state.tenant


async def get_credential(request: Request) -> str:
    """The request's tinkergym key (behind ``tml-``): a cluster engine submits a run's jobs with it, as its tenant."""
    return request.state.credential


def get_logger(request: Request) -> logging.Logger:
    """The app's log (where a failed request's traceback goes)."""
    return request.app.state.tinker_logger


Service = Annotated[TinkerService, Depends(get_service)]
Tenant = Annotated[str, Depends(get_tenant)]
Credential = Annotated[str, Depends(get_credential)]


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as the SDK's ``model``; malformed input is the client's error (400)."""
    try:
        data = await request.json()
        return model.model_validate(data)
    except Exception as exc:  # noqa: BLE001 - malformed input is the client's error
        raise TinkerError(400, f"malformed {model.__name__}: {str(exc)[:500]}") from None


def future(request_id: str, model_id: str | None = None, **extra: Any) -> JSONResponse:
    """The SDK's answer to a request queued on a run (or a sampler): the id it retrieves the result with."""
    return JSONResponse({"request_id": request_id, "model_id": model_id, **extra})
