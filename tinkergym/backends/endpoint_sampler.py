"""Sampling through an OpenAI-compatible ``/v1/completions`` endpoint, token ids in and token ids out.

:class:`EndpointSampler` implements ``sample`` of the Backend protocol, so the rollout loop (and with it
``tinkergym eval --endpoint``) runs against a served model exactly as against a local backend. It sends each
round's prompts as token ids in one batched request and reads the sampled ids back from vLLM's
``return_tokens_as_token_ids`` convention (``"token_id:<id>"`` strings in ``logprobs.tokens``). A server that
answers with text alone is refused: re-tokenizing text would not give back the ids the model sampled.
``tinkergym serve model`` and vLLM's OpenAI server both qualify.

The chat template stays on the client (the rollout loop renders with a local tokenizer), so the served
model must use that tokenizer: a local one, or the server's own files (:meth:`EndpointSampler.fetch_tokenizer`,
from tinkergym's servers). Standard library HTTP only: evaluating through an endpoint needs no torch.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tinkergym.protocol.types import SampledSequence, SampleRequest, SampleResponse
from tinkergym.errors import ConfigError, TinkergymError

_TOKEN_ID = re.compile(r"token_id:(\d+)")


class EndpointError(TinkergymError, RuntimeError):
    """The endpoint failed to answer a request it should have answered (down, a server error, a malformed body)."""


def read_api_key_file(path: str | Path) -> str:
    """The API key in ``path`` (its first line); a missing or empty file is a :class:`ConfigError`."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc}).") from exc
    if not text:
        raise ConfigError(f"--api-key-file {path} is empty; write the server's API key into it.")
    return text.splitlines()[0].strip()


def resolve_tokenizer(name: str) -> str:
    """A local folder holding the tokenizer: a folder as given (a run's ``final/`` holds one), else the model ``name`` resolves to."""
    if Path(name).is_dir():
        return name
    from tinkergym.backends.models import resolve_model

    return resolve_model(name)


def api_base(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--endpoint {url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class EndpointSampler:
    """``sample`` over ``/v1/completions`` of the model named ``model`` at ``url``.

    Args:
        url: The server, with or without the trailing ``/v1``.
        model: The served model name (``/v1/models`` lists them; with LoRA adapters, the adapter's name).
        api_key: Sent as ``Authorization: Bearer <api_key>``; None sends none.
        tokenizer: The local tokenizer folder the prompts were rendered with (reported by :meth:`info`).
        timeout: Seconds one request may take.
    """

    def __init__(self, url: str, model: str, api_key: str | None = None, tokenizer: str | None = None, timeout: float = 600.0) -> None:
        self.base = api_base(url)
        self.model, self.api_key, self.tokenizer, self.timeout = model, api_key, tokenizer, timeout

    def info(self) -> dict[str, Any]:
        """The endpoint, the served model name and the local tokenizer."""
        return {"model": self.model, "endpoint": self.base, "tokenizer": self.tokenizer}

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.base + route, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc, route) from exc
        except urllib.error.URLError as exc:
            raise EndpointError(f"cannot reach {self.base}{route}: {exc.reason}; is the server running (tinkergym serve model)?") from exc
        except (OSError, ValueError) as exc:  # a dropped connection, a timeout, a body that is not JSON
            raise EndpointError(f"{self.base}{route} did not answer with JSON: {exc}") from exc

    def _http_error(self, exc: urllib.error.HTTPError, route: str) -> Exception:
        try:
            detail = json.loads(exc.read().decode("utf-8", "replace"))
            message = detail.get("error", {}).get("message") if isinstance(detail.get("error"), dict) else detail.get("message")
        except (ValueError, AttributeError, OSError):
            message = None
        message = str(message or exc.reason)[:1000]
        if exc.code in (401, 403):
            return ConfigError(f"{self.base} refused the API key (HTTP {exc.code}): pass the server's key with --api-key-file FILE.")
        if exc.code == 404:
            return ConfigError(f"{self.base}{route}: {message} (HTTP 404)")
        if exc.code in (400, 422):
            return ConfigError(f"{self.base}{route} refused the request: {message} (HTTP {exc.code})")
        return EndpointError(f"{self.base}{route} failed: {message} (HTTP {exc.code})")

    def fetch_tokenizer(self, cache_dir: Path | None = None) -> str:
        """Use the server's own tokenizer files (``GET /v1/tokenizer``, which tinkergym's servers send), cached by content.

        A server without the route (vLLM's) is a :class:`ConfigError` saying to pass a local ``--tokenizer``.
        """
        from tinkergym.backends.tokenizer_files import cache_tokenizer_files, default_cache_dir

        try:
            answer = self._call("GET", "/tokenizer")
        except ConfigError as exc:
            if "HTTP 404" not in str(exc):
                raise
            raise ConfigError(f"{self.base} does not send its tokenizer (no /v1/tokenizer): pass --tokenizer, the local model "
                              "(name or folder) whose tokenizer and chat template the served model uses.") from exc
        try:
            self.tokenizer = cache_tokenizer_files(answer, cache_dir or default_cache_dir(), self.base)
        except ValueError as exc:
            raise EndpointError(str(exc)) from exc
        return self.tokenizer

    def served_models(self) -> list[str]:
        """The names ``/v1/models`` lists."""
        listing = self._call("GET", "/models")
        try:
            return [entry["id"] for entry in listing["data"]]
        except (KeyError, TypeError) as exc:
            raise EndpointError(f"{self.base}/models did not answer with a model list") from exc

    def check(self, probe_token: int = 0) -> None:
        """Fail now, with what to do, if the model is not served or the server does not return token ids."""
        served = self.served_models()
        if self.model not in served:
            raise ConfigError(f"{self.base} does not serve {self.model!r}; it serves: {', '.join(served) or 'nothing'}. Pass one of them with --model.")
        request = SampleRequest(prompts=[[probe_token]])
        request.params.max_new_tokens, request.params.temperature = 1, 0.0
        self.sample(request)

    def sample(self, request: SampleRequest) -> SampleResponse:
        """One ``/v1/completions`` request for all prompts; ``sequences[i]`` holds the ``num_samples`` completions of prompt ``i``."""
        params, n = request.params, request.num_samples
        prompts = [list(p) for p in request.prompts]
        sent_n = n
        if params.temperature == 0 and n > 1:  # vLLM refuses n > 1 with greedy decoding: send the copies as prompts
            prompts, sent_n = [p for p in prompts for _ in range(n)], 1
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompts, "n": sent_n, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "logprobs": 1, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False, "stream": False,
        }
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            body["seed"] = params.seed
        answer = self._call("POST", "/completions", body)
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0)) if isinstance(answer, dict) else []
        if len(choices) != len(request.prompts) * n:
            raise EndpointError(f"{self.base}/completions answered {len(choices)} choices for {len(request.prompts)} prompts x {n} samples")
        sequences = [self._sequence(choice, set(params.stop_token_ids)) for choice in choices]
        return SampleResponse(sequences=[sequences[i * n : (i + 1) * n] for i in range(len(request.prompts))])

    def _sequence(self, choice: dict[str, Any], stop_ids: set[int]) -> SampledSequence:
        """A choice's sampled ids and logprobs; a choice with text only is refused."""
        logprobs = choice.get("logprobs") or {}
        pieces, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
        matches = [_TOKEN_ID.fullmatch(p) if isinstance(p, str) else None for p in pieces or []]
        if pieces is None or not all(matches) or not isinstance(values, list) or len(values) != len(pieces):
            raise ConfigError(
                f"{self.base} answers completions with text, not token ids: evaluation needs the sampled ids themselves "
                "(re-tokenized text is not what the model sampled). Serve the model with tinkergym serve model, or vLLM "
                "(which honours return_tokens_as_token_ids with logprobs)."
            )
        tokens = [int(m.group(1)) for m in matches if m is not None]  # all of them: checked above
        # A stop the ids do not show (a server that leaves the stop token out) reads as a turn cut short: the rollout
        # loop then closes the turn with the template's own end-of-turn token instead of assuming it was sampled.
        stopped = choice.get("finish_reason") == "stop" and bool(tokens) and tokens[-1] in stop_ids
        return SampledSequence(tokens=tokens, logprobs=[float(v) if v is not None else 0.0 for v in values], finish_reason="stop" if stopped else "length")
