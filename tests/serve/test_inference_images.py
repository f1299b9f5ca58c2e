"""The inference server's chat images: ``image_url`` parts with ``data:`` URLs on a vision-language model, and refusals."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")
from fastapi.testclient import TestClient  # noqa: E402

from tinkergym.backends.serving import plan_serving  # noqa: E402
from tinkergym.backends.torch.inference import TorchInferenceEngine  # noqa: E402
from tinkergym.protocol.types import MAX_IMAGES, ImageData, SampleRequest, SamplingParams  # noqa: E402
from tinkergym.serve.auth import token_digest  # noqa: E402
from tinkergym.serve.inference.app import create_inference_app  # noqa: E402

KEY = "k" * 20 + "-inference-images-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
QUESTION = "What is in the picture?"


def _pixels(seed: int, size: tuple[int, int] = (64, 64)) -> Any:
    return np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)


def _data_url(pixels: Any, fmt: str = "PNG", media: str = "image/png") -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return f"data:{media};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(model: str, parts: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 5, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def vlm(tiny_vlm: str) -> Any:
    """The inference server on the tiny Qwen2-VL (float32, CPU), its engine and a client."""
    engine = TorchInferenceEngine(plan_serving(model=tiny_vlm, adapters=[], dtype="float32"), device="cpu")
    with TestClient(create_inference_app(engine, token_digest(KEY))) as http:
        yield SimpleNamespace(http=http, engine=engine, model=tiny_vlm)


@pytest.fixture(scope="module")
def text_server(tiny: str) -> Any:
    """The inference server on the tiny text model."""
    engine = TorchInferenceEngine(plan_serving(model=tiny, adapters=[]), device="cpu", max_model_len=64)
    with TestClient(create_inference_app(engine, token_digest(KEY))) as http:
        yield SimpleNamespace(http=http, engine=engine, model=tiny)


def _answer(vlm: Any, body: dict[str, Any]) -> tuple[list[int], list[float], dict[str, Any]]:
    """The sampled ids and logprobs of a chat request's one choice, and the whole answer."""
    response = vlm.http.post("/v1/chat/completions", headers=HEADERS, json={**body, "logprobs": True, "return_tokens_as_token_ids": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    content = answer["choices"][0]["logprobs"]["content"]
    return [int(e["token"].removeprefix("token_id:")) for e in content], [e["logprob"] for e in content], answer


def test_a_chat_image_is_sampled_as_torch_backend_samples_it(vlm: Any) -> None:
    """Token-faithful: the server's greedy answer is TorchBackend's on the image renderer's tokens and the same image."""
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.chat import ImageChatRenderer

    pixels = _pixels(1)
    stop = vlm.engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = _chat(vlm.model, [_image_part(_data_url(pixels)), {"type": "text", "text": QUESTION}], ignore_eos=True, stop_token_ids=[stop])
    served_ids, served_logprobs, answer = _answer(vlm, body)

    renderer = ImageChatRenderer.from_folder(vlm.model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = renderer.render(messages, add_generation_prompt=True, images=[pixels])
    assert prompt.count(renderer.image_token_id) == 4, "a 64 x 64 image is 4 image tokens of the tiny Qwen2-VL"
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    backend = TorchBackend(TorchBackendConfig(model=vlm.model, dtype="float32", device="cpu"))
    params = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=[stop])
    direct = backend.sample(SampleRequest(prompts=[prompt], params=params, images=[[ImageData.from_array(pixels)]])).sequences[0][0]
    assert served_ids == direct.tokens and len(served_ids) >= 1
    assert served_logprobs == pytest.approx(direct.logprobs, abs=1e-5)
    assert answer["choices"][0]["message"]["content"] == vlm.engine.tokenizer.decode(direct.tokens, skip_special_tokens=True)


def test_the_image_is_really_used(vlm: Any) -> None:
    """Two images of one size render to the same tokens, yet their logprobs differ; a JPEG is taken too."""
    answers = []
    for url in (_data_url(_pixels(1)), _data_url(_pixels(2)), _data_url(np.zeros((64, 64, 3), dtype=np.uint8), "JPEG", "image/jpeg")):
        _, logprobs, answer = _answer(vlm, _chat(vlm.model, [{"type": "text", "text": QUESTION}, _image_part(url)], ignore_eos=True, max_tokens=3))
        answers.append((answer["usage"]["prompt_tokens"], logprobs))
    assert answers[0][0] == answers[1][0] == answers[2][0]
    assert answers[0][1][0] != pytest.approx(answers[1][1][0], abs=1e-6)
    assert answers[0][1][0] != pytest.approx(answers[2][1][0], abs=1e-6)


def _big_png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (1025, 1024)).save(buffer, format="PNG")  # one column over the pixel bound; a few kilobytes
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.parametrize(("parts", "message"), [
    ([_image_part("https://example.com/cat.png")], "image URLs are not fetched"),
    ([_image_part("http://example.com/cat.png")], "data:image/png;base64"),
    ([_image_part("file:///etc/passwd")], "only data: URLs are taken"),
    ([_image_part("data:image/png;base64,@@not base64@@")], "base64 does not decode"),
    ([_image_part("data:image/png;base64," + base64.b64encode(b"hello, not a png").decode())], "not a readable PNG or JPEG"),
    ([_image_part("data:image/gif;base64,R0lGODlhAQABAAAAACw=")], "send PNG or JPEG"),
    ([_image_part("data:image/png,rawbytes")], "must hold base64"),
    ([{"type": "image_url", "image_url": {"url": _big_png()}}], "over the 1,048,576 pixels allowed; resize it first"),
    ([_image_part(_data_url(_pixels(0, (8, 8))))] * (MAX_IMAGES + 1), f"at most {MAX_IMAGES} are taken in one request"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "'input_audio' are not supported"),
    ([{"type": "image_url"}], "an image_url part needs"),
])
def test_bad_images_are_400_with_what_to_do(vlm: Any, parts: list[dict[str, Any]], message: str) -> None:
    response = vlm.http.post("/v1/chat/completions", headers=HEADERS, json=_chat(vlm.model, parts))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"].startswith("messages"), error


def test_images_to_a_text_model_are_refused_not_ignored(text_server: Any) -> None:
    http, model = text_server.http, text_server.model
    with_image = _chat(model, [{"type": "text", "text": "hi"}, _image_part(_data_url(_pixels(1)))])
    response = http.post("/v1/chat/completions", headers=HEADERS, json=with_image)
    assert response.status_code == 400, response.text
    assert "is a text model and reads no images" in response.json()["error"]["message"]
    unknown = http.post("/v1/chat/completions", headers=HEADERS, json=_chat(model, [{"type": "text", "text": "hi"}, {"type": "video_url"}]))
    assert unknown.status_code == 400 and "'video_url' are not supported" in unknown.json()["error"]["message"], unknown.text
    text = http.post("/v1/chat/completions", headers=HEADERS, json=_chat(model, [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]))
    assert text.status_code == 200, text.text


def test_image_tokens_without_their_image_are_refused(vlm: Any) -> None:
    """A completion prompt (or chat text) holding the image token has no image behind it: a 400, not a crash."""
    image_token = vlm.engine.backend.vision.image_token_id
    response = vlm.http.post("/v1/completions", headers=HEADERS, json={"model": vlm.model, "prompt": [5, image_token, 6], "max_tokens": 2})
    assert response.status_code == 400 and "image tokens" in response.json()["error"]["message"], response.text
    text = vlm.http.post("/v1/chat/completions", headers=HEADERS, json=_chat(vlm.model, [{"type": "text", "text": "<|image_pad|>"}]))
    assert text.status_code == 400 and "image tokens" in text.json()["error"]["message"], text.text
