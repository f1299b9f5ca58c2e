"""Typed request bodies of the inference server's OpenAI-compatible routes (pydantic, imported with the server).

Fields follow OpenAI's API, plus vLLM's extensions that token-faithful clients use: ``top_k``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` and ``return_tokens_as_token_ids``. Fields this
server does not use are ignored, as vLLM ignores them (:class:`OpenAIBody`, the one rule here that differs from every other
server's :class:`~tinkergym.serve.wire.WireModel`); settings it cannot honour are refused in
:mod:`tinkergym.serve.inference.app` with a message that says so. A chat message's content parts are text, or images as
``data:`` URLs (``image_url``) for a vision-language model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from tinkergym.serve.wire import WireModel

#: Bounds that keep one request from holding the model for long or filling memory.
MAX_N = 64
MAX_PROMPTS = 1024
MAX_STOP_IDS = 64
MAX_MESSAGES = 1024
MAX_TOKEN_ID = 2**31 - 1


class OpenAIBody(WireModel):
    """A body of the OpenAI-compatible routes: a field this server does not use is ignored, not refused. OpenAI's clients and
    the tools built on them send fields of OpenAI's newer API (``user``, ``metadata``, ``store``, ``response_format``, ...)
    that vLLM's server ignores too; refusing them would turn a working client away."""

    model_config = ConfigDict(extra="ignore")


class ErrorDetail(OpenAIBody):
    """What went wrong: ``param`` names the request field at fault, where one is."""

    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIBody):
    """The body of every refusal, in OpenAI's shape."""

    error: ErrorDetail


#: An event of a streamed completion (the schema of each event, as OpenAPI 3.2's ``itemSchema`` is).
STREAM_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last is [DONE]"}}}

#: The answers of the completion routes besides a JSON body, for the OpenAPI document: server-sent events with ``stream``,
#: and refusals (400, 401, 404, 413) in OpenAI's error shape.
COMPLETION_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": STREAM_EVENT}}, "description": "the completion, or with stream its server-sent events"},
    "4XX": {"model": ErrorResponse, "description": "refused, with what to change"},
}


class StreamOptions(OpenAIBody):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class _Sampling(OpenAIBody):
    """What completions and chat completions share: the model, sampling settings and vLLM's extensions."""

    model: str = Field(max_length=1000)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids, or a list of token id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    include_stop_str_in_output: bool = False


class ImageURL(OpenAIBody):
    """An ``image_url`` part's image: a ``data:image/png;base64,...`` or ``data:image/jpeg;base64,...`` URL (``detail`` is ignored)."""

    url: str
    detail: str | None = None


class ContentPart(OpenAIBody):
    """One part of a message's content: ``{"type": "text", "text": ...}`` or ``{"type": "image_url", "image_url": {"url": ...}}``.

    Parts of other types are refused in :mod:`tinkergym.serve.inference.app` (a 400 that names the two types taken).
    """

    model_config = ConfigDict(extra="allow")  # kept as sent: the app reads type, text and image_url, and refuses other types by name

    type: str = Field(max_length=64)
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(OpenAIBody):
    """One message; ``content`` is text or a list of content parts."""

    model_config = ConfigDict(extra="allow")  # its other fields (name, tool_calls, tool_call_id, ...) reach the chat template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered with the model's own chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
