"""Every server's request and response bodies derive from one base, :class:`tinkergym.serve.wire.WireModel`.

The walk reads each app's own route table (bodies, response models, declared answers, and the models nested in them), so
a new route cannot be forgotten; it must also meet every schema of the app's OpenAPI document, so a body it misses fails
too. A server whose rule differs on purpose does so in a subclass (the inference server's ``OpenAIBody``).
"""

from __future__ import annotations

import logging
import typing
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from pydantic import BaseModel  # noqa: E402

from tinkergym.serve.auth import token_digest  # noqa: E402
from tinkergym.serve.wire import WireModel  # noqa: E402

TOKEN = "t" * 32
#: FastAPI's own schemas of its 422 answer (every server answers it 400 in its own shape: add_error_handlers).
FASTAPI_SCHEMAS = {"HTTPValidationError", "ValidationError"}


def body_models(app: Any) -> set[type[BaseModel]]:
    """The pydantic models of every route's bodies and answers, and the models nested in their fields."""
    from fastapi import routing

    flatten = getattr(routing, "iter_route_contexts", None)  # newer FastAPI keeps an included router as one entry
    types: list[Any] = []
    for route in (flatten(app.routes) if flatten is not None else app.routes):
        if not isinstance(getattr(route, "original_route", route), routing.APIRoute):
            continue
        dependants = [route.dependant]
        while dependants:
            dependant = dependants.pop()
            types += [param.field_info.annotation for param in dependant.body_params]
            dependants += dependant.dependencies
        types += [route.response_model, *(answer.get("model") for answer in route.responses.values())]
    found: set[type[BaseModel]] = set()
    while types:
        kind = types.pop()
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            if kind not in found:
                found.add(kind)
                hints = typing.get_type_hints(kind)  # a field's annotation may still be a forward reference
                types += [hints[name] for name in kind.model_fields]
        else:
            types += typing.get_args(kind)
    return found


def training_app(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    from tinkergym.serve.training.app import create_app

    return create_app(object(), run_dir=tmp_path / "run", token_digest=token_digest(TOKEN))


def shared_app(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.serve.training.shared import create_shared_app

    base = SharedBase(SharedBaseConfig(model=request.getfixturevalue("tiny"), dtype="float32", max_sessions=2))
    return create_shared_app(base, run_dir=tmp_path / "shared", token_digest=token_digest(TOKEN))


def inference_app(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    from tinkergym.serve.inference.app import create_inference_app

    return create_inference_app(object(), token_digest(TOKEN))  # its routes only: no engine is called


def scheduler_app(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    pytest.importorskip("sqlalchemy")
    from tinkergym.scheduler.app import SchedulerSettings, create_app

    return create_app(SchedulerSettings(db_url=f"sqlite:///{tmp_path / 'scheduler.db'}", data_dir=tmp_path / "data"), background=False)


def tinker_app(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    pytest.importorskip("tinker")
    from tinkergym.tinker_api.app import create_tinker_app
    from tinkergym.tinker_api.service import TinkerService

    logger = logging.getLogger("tinkergym-wire-models-test")
    return create_tinker_app(TinkerService(object(), logger), lambda key: None, logger)


@pytest.mark.parametrize("make", [training_app, shared_app, inference_app, scheduler_app, tinker_app], ids=lambda make: make.__name__)
def test_every_body_derives_from_the_one_wire_model(make: Any, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    app = make(tmp_path, request)
    models = body_models(app)
    others = sorted(f"{model.__module__}.{model.__qualname__}" for model in models if not issubclass(model, WireModel))
    assert not others, f"bodies that do not derive from tinkergym.serve.wire.WireModel: {others}"
    # The walk met every schema the OpenAPI document names (a clash of names is written module__Name).
    schemas = {name.rsplit("__", 1)[-1] for name in app.openapi().get("components", {}).get("schemas", {})} - FASTAPI_SCHEMAS
    assert schemas <= {model.__name__ for model in models}, f"schemas the walk missed: {sorted(schemas - {m.__name__ for m in models})}"


def test_the_rules_that_differ_are_subclasses_that_say_so() -> None:
    """Unknown fields are refused but where a server's protocol says otherwise, in a subclass: the inference server ignores
    what OpenAI's clients send and it does not use; a chat message and a job's config keep what they do not name."""
    from pydantic import ValidationError

    from tinkergym.scheduler.schemas import JobConfig, JobCreate
    from tinkergym.serve.inference.schemas import ChatMessage, CompletionRequest

    with pytest.raises(ValidationError, match="extra_field"):
        JobCreate.model_validate({"kind": "train", "config": {"model": "tiny"}, "extra_field": 1})
    assert JobConfig.model_validate({"model": "tiny", "env": "bandit"}).model_extra == {"env": "bandit"}
    request = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "user": "someone", "store": False})
    assert request.model_extra is None and not hasattr(request, "user")
    assert ChatMessage.model_validate({"role": "assistant", "content": "x", "name": "bot"}).model_dump()["name"] == "bot"
