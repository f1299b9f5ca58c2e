"""The one base of every tinkergym server's request and response bodies: :class:`WireModel`.

The training servers, the inference server and the scheduler type their bodies as subclasses of it, so one class says what
a body on tinkergym's wire is. A server whose protocol needs another rule says so in a subclass with its reason: the
inference server's OpenAI-compatible bodies ignore fields they do not use, as OpenAI's and vLLM's servers do
(:class:`~tinkergym.serve.inference.schemas.OpenAIBody`); a chat message keeps its other fields for the chat template, and
a scheduler job's config keeps the run's other settings for the people who read the job.

Numbers are checked at the door, not here: :class:`~tinkergym.serve.asgi.StrictJSON` refuses a body with NaN (and, where
a protocol gives infinity no meaning, an infinity) before any model parses it, and names the field. A model could not
do it for every server: pydantic's ``allow_inf_nan`` refuses NaN and infinity together, and a training server's clip
or gradient norm at infinity bounds nothing on purpose.

The Tinker API (:mod:`tinkergym.tinker_api`) has no body models of its own: its requests are validated by the ``tinker``
SDK's own types (:mod:`tinker.types`, whose request types refuse unknown fields as this base does), so the server reads
exactly what the client wrote; its protobuf bodies are :mod:`tinkergym.tinker_api.wire`'s.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A request or response body of a tinkergym server: a field it does not name is refused (the error names the field),
    so a client's misspelt setting is an error instead of a default silently used."""

    model_config = ConfigDict(extra="forbid")
