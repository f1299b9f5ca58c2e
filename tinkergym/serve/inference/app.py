"""The OpenAI-compatible inference server: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

:func:`create_inference_app` builds a FastAPI app around an :class:`~tinkergym.backends.serving.InferenceEngine`.
Every route but ``/health`` needs ``Authorization: Bearer <api key>`` (:mod:`tinkergym.serve.auth`),
which is what OpenAI clients send. A request's ``model`` picks the base or one of its LoRA adapters; an
unknown name is a 404 that lists the served names.

``GET /v1/tokenizer`` sends the tokenizer and chat template files (as the training server does), so a client
renders prompts with the served model's own template without a copy of the model.

Token faithfulness (vLLM's conventions): ``/v1/completions`` takes ``prompt`` as text or token ids, and with
``return_tokens_as_token_ids: true`` and ``logprobs`` set, ``logprobs.tokens`` holds the sampled ids as
``"token_id:<id>"`` strings beside their logprobs, the final stop token included. ``top_logprobs`` holds
the sampled token only, so ``logprobs`` (``top_logprobs`` in chat) above 1 is refused rather than answered
with fewer alternatives than asked for. Stop strings are refused too: stop with ``stop_token_ids``.

Chat content parts are ``text`` and ``image_url``; a part of any other type is refused (400), never skipped. An image
is sent inline as a ``data:image/png;base64,...`` or ``data:image/jpeg;base64,...`` URL: the server fetches nothing, so
``http(s)://`` URLs are refused with that advice. Each image's size is read from its header before its pixels are
decoded (at most :data:`~tinkergym.protocol.types.MAX_IMAGE_PIXELS` pixels, and at most
:data:`~tinkergym.protocol.types.MAX_IMAGES` images a request), the conversation is rendered by the engine's
:meth:`~tinkergym.backends.serving.InferenceEngine.image_renderer` (the model's image token repeated as many times
as the image processor makes features of each image) and sampled with its images. Images sent to a text model, or to
an engine that takes none (vLLM's), are a 400 that says so. ``/v1/completions`` takes text and token ids only.

``stream: true`` answers with server-sent events in OpenAI's chunk shapes, one chunk per token, ending with
``data: [DONE]``. The torch engine generates a request's completions in one batch before the first chunk is
sent; an engine that generates incrementally can stream as it goes behind the same route.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from typing import Any
from collections.abc import Iterator

from tinkergym.backends.serving import InferenceEngine
from tinkergym.serve.inference.schemas import COMPLETION_ANSWERS, MAX_PROMPTS, MAX_TOKEN_ID, ChatCompletionRequest, CompletionRequest
from tinkergym.protocol.types import MAX_IMAGES, ImageData, SampledSequence, SamplingParams, read_image_file
from tinkergym.errors import ConfigError

#: Largest request body accepted (a batch of long token-id prompts fits many times over).
MAX_BODY_BYTES = 32 * 2**20
#: A stop id no token has: with ``ignore_eos`` and no ``stop_token_ids`` nothing may stop a completion early.
_NO_STOP = -1
#: The media types of the ``data:`` URLs an ``image_url`` part may hold (image/jpg: a common misspelling of image/jpeg).
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg")
#: What an image part should look like, for refusals.
_DATA_URL_HINT = "send the image inline as a data:image/png;base64,... or data:image/jpeg;base64,... URL"


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def create_inference_app(engine: InferenceEngine, token_digest: bytes, max_body_bytes: int = MAX_BODY_BYTES, lease: Any = None) -> Any:
    """The FastAPI app serving ``engine`` behind the API key whose SHA-256 digest is ``token_digest``; with a ``lease``
    (:class:`~tinkergym.serve.auth.LeaseFile`: a scheduler's worker started it), no call past its end."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from tinkergym.serve.auth import require_token

    app = FastAPI(title="tinkergym inference server")
    app.state.engine = engine
    _answer_errors_openai_style(app, max_body_bytes)
    renderers: list[Any] = []

    def chat_renderer() -> Any:
        """The model's chat template, loaded on the first chat request."""
        if not renderers:
            from tinkergym.chat import ChatTemplateRenderer

            try:
                renderers.append(ChatTemplateRenderer(engine.tokenizer))
            except ConfigError as exc:
                raise APIError(400, f"this model cannot chat: {exc} Use /v1/completions.") from exc
        return renderers[0]

    @app.get("/health")
    def health() -> dict[str, str]:
        """Liveness; the one route without the API key."""
        return {"status": "ok"}

    tokenizer_files: list[dict[str, str]] = []

    @app.get("/v1/tokenizer")
    def tokenizer() -> dict[str, Any]:
        """The served model's tokenizer and chat template files (``{"files": {name: text}}``), as the training server sends
        them: a client renders prompts with exactly these (``tinkergym eval --endpoint`` needs no local model then)."""
        if not tokenizer_files:
            import tempfile

            from tinkergym.backends.tokenizer_files import read_tokenizer_files

            with tempfile.TemporaryDirectory(prefix="tinkergym-tokenizer-") as folder:
                engine.tokenizer.save_pretrained(folder)
                tokenizer_files.append(read_tokenizer_files(folder))
        return {"files": tokenizer_files[0]}

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        """The base and each adapter (``parent`` = the base id), as vLLM lists ``--lora-modules``."""
        created = int(time.time())
        data: list[dict[str, Any]] = [
            {"id": m.id, "object": "model", "created": created, "owned_by": "tinkergym", "root": m.root, "parent": m.parent,
             "max_model_len": engine.max_model_len, "permission": []}
            for m in engine.models()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions", responses=COMPLETION_ANSWERS)
    def completions(request: CompletionRequest) -> Any:
        """Complete text or token-id prompts; ``stream: true`` answers with server-sent events."""
        chunks_or_body = complete(engine, request)
        if request.stream:
            return StreamingResponse(chunks_or_body, media_type="text/event-stream")
        return chunks_or_body

    @app.post("/v1/chat/completions", responses=COMPLETION_ANSWERS)
    def chat_completions(request: ChatCompletionRequest) -> Any:
        """Answer a conversation rendered with the model's chat template; ``stream: true`` answers with server-sent events."""
        chunks_or_body = chat(engine, request, chat_renderer())
        if request.stream:
            return StreamingResponse(chunks_or_body, media_type="text/event-stream")
        return chunks_or_body

    require_token(app, token_digest, lease=lease)  # added last but one: every other answer needs the key
    from tinkergym.serve.metrics import MetricsMiddleware, ServerMetrics

    app.state.metrics = ServerMetrics("inference")  # served by --metrics-port on a listener of its own
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app


def _answer_errors_openai_style(app: Any, max_body_bytes: int) -> None:
    """:class:`APIError`, invalid bodies (400, not FastAPI's 422) and oversized bodies (413) in OpenAI's error shape.

    Bodies are bounded by the servers' shared :class:`~tinkergym.serve.asgi.BodyLimit`: by ``Content-Length``
    before reading, and by counting the bytes of a body that streams in without one (chunked transfer). Text with a
    lone UTF-16 surrogate (no tokenizer encodes one) or a NUL is refused by :class:`~tinkergym.serve.asgi.StrictJSON`.
    """
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    from tinkergym.serve.asgi import BodyLimit, BodyTooLarge, StrictJSON

    def openai_error(status: int, kind: str, message: str) -> JSONResponse:
        return JSONResponse(APIError(status, message).body(), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid request"))
        return JSONResponse(APIError(400, message, where).body(), status_code=400)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return openai_error(exc.status_code, "body_too_large", str(exc.detail))

    app.add_middleware(StrictJSON, answer=openai_error)  # inside BodyLimit, which bounds what it reads
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, hint="send fewer or shorter prompts per request", answer=openai_error)


# ----- requests -> engine calls ----------------------------------------------------------------------------
def _check_model(engine: InferenceEngine, name: str) -> None:
    served = [m.id for m in engine.models()]
    if name not in served:
        raise APIError(404, f"The model `{name}` does not exist. Served models: {', '.join(served)}", "model", "NotFoundError")


def _refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    if request.stop:
        raise APIError(400, "stop strings are not supported; stop at token ids with stop_token_ids", "stop")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise APIError(400, f"{name} is not supported (only 0)", name)
    if request.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")


def _sampling(engine: InferenceEngine, request: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], max_tokens: int | None, extra_stops: list[int]) -> SamplingParams:
    """Sampling settings of a request, checked against the context length (``max_tokens`` None: the rest of the context)."""
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = engine.max_model_len - longest
    if longest + max_tokens > engine.max_model_len or max_tokens < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {engine.max_model_len} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion).",
            "max_tokens",
        )
    stops = set(request.stop_token_ids or [])
    if not request.ignore_eos:
        stops.update(engine.eos_token_ids, extra_stops)
    if any(not 0 <= s <= MAX_TOKEN_ID for s in stops):
        raise APIError(400, "stop_token_ids must be token ids (0 or more)", "stop_token_ids")
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    temperature = 1.0 if request.temperature is None else request.temperature
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature, top_p=1.0 if request.top_p is None else request.top_p,
        top_k=top_k, stop_token_ids=sorted(stops) or [_NO_STOP], seed=request.seed,
    )


def _token_prompts(engine: InferenceEngine, prompt: Any) -> list[list[int]]:
    """``prompt`` as token id lists: texts are tokenized (special tokens added, as vLLM does), ids checked."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt or len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"give between 1 and {MAX_PROMPTS} prompts", "prompt")
    out = [engine.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
    for ids in out:
        if not ids:
            raise APIError(400, "a prompt must have at least one token", "prompt")
        if len(ids) >= engine.max_model_len:
            raise APIError(400, f"a prompt of {len(ids)} tokens leaves no room in the context of {engine.max_model_len}", "prompt")
        if min(ids) < 0 or max(ids) >= engine.vocab_size:
            raise APIError(400, f"prompt token ids must lie in [0, {engine.vocab_size})", "prompt")
    return out


def _generate(
    engine: InferenceEngine, model: str, prompts: list[list[int]], params: SamplingParams, n: int, images: list[list[ImageData]] | None = None,
) -> list[SampledSequence]:
    """The completions in OpenAI's choice order: prompt by prompt, ``n`` each (``images``: one list per prompt, or none)."""
    try:
        rows = engine.generate(model, prompts, params, n, images=images) if images else engine.generate(model, prompts, params, n)
    except ConfigError as exc:
        raise APIError(400, str(exc)) from exc
    return [sequence for row in rows for sequence in row]


def complete(engine: InferenceEngine, request: CompletionRequest) -> dict[str, Any] | Iterator[str]:
    """The ``/v1/completions`` answer: a body, or with ``stream`` the server-sent events."""
    _check_model(engine, request.model)
    _refuse_unsupported(request)
    if request.echo or request.suffix or (request.best_of or request.n) != request.n:
        raise APIError(400, "echo, suffix and best_of are not supported", "echo")
    if request.logprobs is not None and request.logprobs > 1:
        raise APIError(400, "logprobs above 1 is not supported: top_logprobs holds the sampled token only", "logprobs")
    prompts = _token_prompts(engine, request.prompt)
    params = _sampling(engine, request, prompts, request.max_tokens, [])
    sequences = _generate(engine, request.model, prompts, params, request.n)
    view = _TokenView(engine.tokenizer, request.return_tokens_as_token_ids, request.skip_special_tokens, set(params.stop_token_ids))
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    usage = _usage(prompts, request.n, sequences)
    keep_stop = request.include_stop_str_in_output
    if request.stream:
        return _completion_events(view, sequences, request, completion_id, created, usage)
    choices = []
    for index, seq in enumerate(sequences):
        choice = {"index": index, "text": view.text(seq, keep_stop), "finish_reason": seq.finish_reason, "stop_reason": view.stop_reason(seq, engine)}
        choice["logprobs"] = view.completion_logprobs(seq.tokens, seq.logprobs) if request.logprobs is not None else None
        choices.append(choice)
    return {"id": completion_id, "object": "text_completion", "created": created, "model": request.model, "choices": choices, "usage": usage}


def chat(engine: InferenceEngine, request: ChatCompletionRequest, renderer: Any) -> dict[str, Any] | Iterator[str]:
    """The ``/v1/chat/completions`` answer (``renderer``: the model's chat template): a body, or with ``stream`` the server-sent events."""
    _check_model(engine, request.model)
    _refuse_unsupported(request)
    if request.top_logprobs is not None and request.top_logprobs > 1:
        raise APIError(400, "top_logprobs above 1 is not supported: it holds the sampled token only", "top_logprobs")
    messages, image_urls = _chat_messages(request)
    pixels: list[Any] = []
    if image_urls:
        renderer = _image_renderer(engine)  # a text model, or an engine without images, refuses before anything is decoded
        if len(image_urls) > MAX_IMAGES:
            raise APIError(400, f"the messages hold {len(image_urls)} images; at most {MAX_IMAGES} are taken in one request: send fewer", "messages")
        pixels = [decode_image_url(url, where) for where, url in image_urls]
    try:
        if pixels:
            prompt = renderer.render(messages, request.tools, add_generation_prompt=request.add_generation_prompt, images=pixels)
        else:
            prompt = renderer.render(messages, request.tools, add_generation_prompt=request.add_generation_prompt)
    except Exception as exc:  # a template that rejects these messages (roles out of order, a bad tool schema)
        raise APIError(400, f"the chat template cannot render these messages: {exc}", "messages") from exc
    prompts = _token_prompts(engine, prompt)
    params = _sampling(engine, request, prompts, request.max_completion_tokens or request.max_tokens, renderer.stop_token_ids)
    images = [[ImageData.from_array(p) for p in pixels]] if pixels else None
    sequences = _generate(engine, request.model, prompts, params, request.n, images)
    view = _TokenView(engine.tokenizer, request.return_tokens_as_token_ids, request.skip_special_tokens, set(params.stop_token_ids))
    chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    usage = _usage(prompts, request.n, sequences)
    if request.stream:
        return _chat_events(view, sequences, request, chat_id, created, usage)
    choices = []
    for index, seq in enumerate(sequences):
        logprobs = {"content": view.chat_logprobs(seq.tokens, seq.logprobs, request.top_logprobs)} if request.logprobs else None
        message = {"role": "assistant", "content": view.text(seq, False)}
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": seq.finish_reason, "stop_reason": view.stop_reason(seq, engine)})
    return {"id": chat_id, "object": "chat.completion", "created": created, "model": request.model, "choices": choices, "usage": usage}


def _chat_messages(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The messages as the chat template takes them, and each image part's ``(where, url)`` in order.

    Without images, list-of-parts content is joined into text; with images, content lists are kept, each image part as
    ``{"type": "image"}`` (as :class:`~tinkergym.chat.ImageChatRenderer` renders it). Other part types are refused.
    """
    messages: list[dict[str, Any]] = []
    image_urls: list[tuple[str, str]] = []
    for i, message in enumerate(request.messages):
        data = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text or ""})
                elif part.type == "image_url":
                    if part.image_url is None:
                        raise APIError(400, f"{where}: an image_url part needs \"image_url\": {{\"url\": ...}}; {_DATA_URL_HINT}", where)
                    parts.append({"type": "image"})
                    image_urls.append((where, part.image_url.url))
                else:
                    raise APIError(400, f"{where}: content parts of type {part.type!r} are not supported; send text and image_url parts", where)
            data["content"] = parts
        data.setdefault("content", "")
        messages.append(data)
    if not image_urls:
        for data in messages:
            if isinstance(data["content"], list):
                data["content"] = "".join(part["text"] for part in data["content"] if part["type"] == "text")
    return messages, image_urls


def _image_renderer(engine: InferenceEngine) -> Any:
    """The engine's renderer of conversations with images; a 400 saying why where it takes none."""
    image_renderer = getattr(engine, "image_renderer", None)
    if image_renderer is None:
        raise APIError(400, "this server's engine takes no images; send text only", "messages")
    try:
        return image_renderer()
    except ConfigError as exc:
        raise APIError(400, f"images are not taken here: {exc}", "messages") from exc


def decode_image_url(url: str, where: str) -> Any:
    """The ``(H, W, 3)`` uint8 pixels of a ``data:`` URL's PNG or JPEG, read bounded: its size from its header first
    (at most :data:`MAX_IMAGE_PIXELS` pixels), then its pixels; anything else is a 400 that says what to send."""
    scheme = url[:16].partition(":")[0].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https"):
        raise APIError(400, f"{where}: image URLs are not fetched (this server reaches no network); {_DATA_URL_HINT}", where)
    if scheme != "data":
        raise APIError(400, f"{where}: only data: URLs are taken as images, not {url[:20]!r}...; {_DATA_URL_HINT}", where)
    header, comma, payload = url[5:].partition(",")
    media_type, *options = [piece.strip().lower() for piece in header.split(";")]
    if not comma or "base64" not in options:
        raise APIError(400, f"{where}: the data: URL must hold base64 after ';base64,'; {_DATA_URL_HINT}", where)
    if media_type not in IMAGE_MEDIA_TYPES:
        raise APIError(400, f"{where}: images of type {media_type[:40]!r} are not taken: send PNG or JPEG (data:image/png;base64,...)", where)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"{where}: the image's base64 does not decode ({exc}); send the file's bytes in standard base64", where) from None
    try:
        return read_image_file(data)
    except ValueError as exc:
        raise APIError(400, f"{where}: {exc}", where) from None


def _usage(prompts: list[list[int]], n: int, sequences: list[SampledSequence]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts) * n
    completion_tokens = sum(len(s.tokens) for s in sequences)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


# ----- sampled ids -> OpenAI's text and logprob shapes -------------------------------------------------------
class _TokenView:
    """Text, token strings and logprob blocks of sampled ids, as one request wants them."""

    def __init__(self, tokenizer: Any, as_ids: bool, skip_special: bool, stop_ids: set[int]) -> None:
        self.tokenizer, self.as_ids, self.skip_special, self.stop_ids = tokenizer, as_ids, skip_special, stop_ids

    def visible(self, seq: SampledSequence, keep_stop: bool) -> list[int]:
        """The ids whose text is shown: without the final stop id (unless ``keep_stop``)."""
        if seq.finish_reason == "stop" and seq.tokens and seq.tokens[-1] in self.stop_ids and not keep_stop:
            return seq.tokens[:-1]
        return seq.tokens

    def text(self, seq: SampledSequence, keep_stop: bool) -> str:
        """The completion's text."""
        return self.tokenizer.decode(self.visible(seq, keep_stop), skip_special_tokens=self.skip_special)

    def stop_reason(self, seq: SampledSequence, engine: InferenceEngine) -> int | None:
        """The stop id a completion ended at, as vLLM reports it (None at an end-of-sequence id or the length limit)."""
        if seq.finish_reason == "stop" and seq.tokens and seq.tokens[-1] not in engine.eos_token_ids:
            return seq.tokens[-1]
        return None

    def piece(self, token: int) -> str:
        """One token as ``logprobs.tokens`` shows it: ``"token_id:<id>"``, or its text."""
        return f"token_id:{token}" if self.as_ids else self.tokenizer.decode([token], skip_special_tokens=False)

    def completion_logprobs(self, tokens: list[int], logprobs: list[float], offset: int = 0) -> dict[str, Any]:
        """The ``logprobs`` block of a completion choice."""
        pieces = [self.piece(t) for t in tokens]
        offsets, at = [], offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": list(logprobs), "top_logprobs": [{p: lp} for p, lp in zip(pieces, logprobs)], "text_offset": offsets}

    def chat_logprobs(self, tokens: list[int], logprobs: list[float], top: int | None) -> list[dict[str, Any]]:
        """The ``logprobs.content`` list of a chat choice."""
        out = []
        for token, logprob in zip(tokens, logprobs):
            piece = self.piece(token)
            entry = {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}
            entry["top_logprobs"] = [dict(entry)] if top else []
            out.append(entry)
        return out

    def deltas(self, seq: SampledSequence, keep_stop: bool) -> list[str]:
        """The text each token adds, for streaming; a token that ends inside a character adds its text with the next one."""
        visible = self.visible(seq, keep_stop)
        out, shown = [], ""
        for end in range(1, len(visible) + 1):
            text = self.tokenizer.decode(visible[:end], skip_special_tokens=self.skip_special)
            if end < len(visible) and text.endswith("\ufffd"):
                out.append("")
                continue
            out.append(text[len(shown) :])
            shown = text
        return out + [""] * (len(seq.tokens) - len(visible))


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _completion_events(view: _TokenView, sequences: list[SampledSequence], request: CompletionRequest, completion_id: str, created: int, usage: dict[str, int]) -> Iterator[str]:
    """Server-sent events of completions: one chunk per token, the last of each choice with its finish reason."""
    head = {"id": completion_id, "object": "text_completion", "created": created, "model": request.model}
    for index, seq in enumerate(sequences):
        deltas = view.deltas(seq, request.include_stop_str_in_output)
        offset = 0
        for t, (token, logprob, delta) in enumerate(zip(seq.tokens, seq.logprobs, deltas)):
            last = t == len(seq.tokens) - 1
            logprobs = view.completion_logprobs([token], [logprob], offset) if request.logprobs is not None else None
            offset += len(view.piece(token))
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": seq.finish_reason if last else None}
            yield _event({**head, "choices": [choice]})
        if not seq.tokens:
            yield _event({**head, "choices": [{"index": index, "text": "", "logprobs": None, "finish_reason": seq.finish_reason}]})
    if request.stream_options is not None and request.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _chat_events(view: _TokenView, sequences: list[SampledSequence], request: ChatCompletionRequest, chat_id: str, created: int, usage: dict[str, int]) -> Iterator[str]:
    """Server-sent events of chat completions: the role, one content chunk per token, then the finish reason."""
    head = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": request.model}
    for index, seq in enumerate(sequences):
        yield _event({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        for token, logprob, delta in zip(seq.tokens, seq.logprobs, view.deltas(seq, False)):
            logprobs = {"content": view.chat_logprobs([token], [logprob], request.top_logprobs)} if request.logprobs else None
            yield _event({**head, "choices": [{"index": index, "delta": {"content": delta}, "logprobs": logprobs, "finish_reason": None}]})
        yield _event({**head, "choices": [{"index": index, "delta": {}, "logprobs": None, "finish_reason": seq.finish_reason}]})
    if request.stream_options is not None and request.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"
