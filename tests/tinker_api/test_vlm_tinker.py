"""The official ``tinker`` SDK against ``serve tinker`` on the tiny Qwen2-VL: image chunks sample, score and train; a wrong
``expected_tokens``, bytes that are no image and an image over the pixel bound are refused with a 400; a text model still
refuses image chunks."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")
pytest.importorskip("sqlalchemy")

from tinker import types  # noqa: E402

from testkit import serving  # noqa: E402
from tinkergym.chat import ImageChatRenderer  # noqa: E402

MODEL = "tiny-vlm-test"


def _png(seed: int, height: int = 64, width: int = 64) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """``serve tinker``'s app on the tiny VLM at ``(url, key)``."""
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.db import make_engine, upgrade
    from tinkergym.tinker_api.server import create_server

    root = tmp_path_factory.mktemp("tinker-vlm")
    engine = make_engine(f"sqlite:///{root / 'keys.db'}")
    upgrade(engine)
    key = "tml-" + create_key(engine, "alice", ["read", "write"])[1]
    base = SharedBase(SharedBaseConfig(model=tiny_vlm, dtype="float32", micro_batch_size=8))
    app = create_server(base, root / "runs", engine, logging.getLogger("tinker-vlm-test"), model_name=MODEL, tokenizer_id=tiny_vlm)
    with serving(app) as url:
        yield url, key
    engine.dispose()


@pytest.fixture
def client(vlm_server: tuple[str, str]) -> Iterator[Any]:
    service = tinker.ServiceClient(base_url=vlm_server[0], api_key=vlm_server[1])
    yield service
    service.close("success").result()


class Prompt:
    """A chat prompt with one image, as the SDK's chunks: its text before the image, the image, its text after."""

    def __init__(self, tiny_vlm: str, question: str = "What colour is it?") -> None:
        renderer = ImageChatRenderer.from_folder(tiny_vlm)
        self.image_id = renderer.image_token_id
        image = np.zeros((64, 64, 3), np.uint8)
        tokens = renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}], None, images=[image])
        first = tokens.index(self.image_id)
        self.count = tokens.count(self.image_id)
        self.before, self.after = tokens[:first], tokens[first + self.count:]
        self.answer = renderer.tokenizer.encode("red", add_special_tokens=False) + [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def chunks(self, png: bytes, after: list[int] | None = None, expected: int | None = None) -> types.ModelInput:
        return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=self.before),
                                        types.ImageChunk(data=png, format="png", expected_tokens=self.count if expected is None else expected),
                                        types.EncodedTextChunk(tokens=self.after + (after or []))])

    @property
    def length(self) -> int:
        return len(self.before) + self.count + len(self.after)

    def datum(self, png: bytes) -> types.Datum:
        """An SFT datum answering ``self.answer``, built as the SDK's cookbook builds one (0 as the target of an image position)."""
        full = self.before + [0] * self.count + self.after + self.answer
        weights = [0.0] * (self.length - 1) + [1.0] * len(self.answer)
        return types.Datum(model_input=self.chunks(png, self.answer[:-1]), loss_fn_inputs={"target_tokens": full[1:], "weights": weights})


@pytest.mark.slow
def test_image_chunks_sample_score_and_train_through_the_sdk(client: Any, tiny_vlm: str) -> None:
    prompt = Prompt(tiny_vlm)
    red, other = _png(1), _png(2)
    training = client.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    batch = [prompt.datum(red)]
    losses = []
    for _ in range(6):
        fb = training.forward_backward(batch, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0], losses
    # The forward's logprobs at the image's positions read 0; its loss is its answer's.
    out = training.forward(batch, "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    image_span = slice(len(prompt.before) - 1, len(prompt.before) - 1 + prompt.count)
    assert np.all(logprobs[image_span] == 0.0) and out.metrics["loss:sum"] == pytest.approx(-logprobs[-len(prompt.answer):].sum(), rel=1e-5)

    sampler = training.save_weights_and_get_sampling_client().result()
    response = sampler.sample(prompt.chunks(red), 2, types.SamplingParams(max_tokens=5, temperature=1.0, seed=3)).result()
    assert len(response.sequences) == 2
    for seq in response.sequences:
        assert seq.tokens and prompt.image_id not in seq.tokens  # image tokens are never sampled
        scored = sampler.compute_logprobs(prompt.chunks(red, seq.tokens)).result()
        assert len(scored) == prompt.length + len(seq.tokens) and scored[0] is None
        np.testing.assert_allclose(scored[prompt.length:], seq.logprobs, atol=1e-5)
        # Another image (the same size: the same tokens) gives other logprobs.
        moved = sampler.compute_logprobs(prompt.chunks(other, seq.tokens)).result()
        assert max(abs(a - b) for a, b in zip(moved[prompt.length:], scored[prompt.length:])) > 1e-3


def test_bad_image_chunks_are_refused_and_the_server_keeps_serving(client: Any, tiny_vlm: str) -> None:
    prompt = Prompt(tiny_vlm)
    training = client.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=1)
    with pytest.raises(tinker.BadRequestError, match=f"expected_tokens is {prompt.count + 1}.*takes {prompt.count} tokens"):
        sampler.sample(prompt.chunks(_png(1), expected=prompt.count + 1), 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="not a readable PNG"):
        sampler.sample(prompt.chunks(b"\x89PNG\r\n\x1a\nnot-really-a-png"), 1, params).result()
    big = _png(0, 1100, 1000)
    with pytest.raises(tinker.BadRequestError, match="over the 1,048,576 pixels"):
        sampler.sample(prompt.chunks(big), 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="not a readable PNG"):
        training.forward_backward([prompt.datum(b"garbage")], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="image token id"):  # an image's tokens without its image
        sampler.sample(types.ModelInput.from_ints(prompt.before + [prompt.image_id] * prompt.count + prompt.after), 1, params).result()
    assert sampler.sample(prompt.chunks(_png(1)), 1, params).result().sequences[0].tokens


def test_a_text_model_still_refuses_image_chunks(cluster: Any, connect: Any) -> None:
    training = connect().create_lora_training_client(base_model=cluster.model, rank=4).result()
    image = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.ImageChunk(data=_png(1), format="png", expected_tokens=4),
                                     types.EncodedTextChunk(tokens=[7, 8])])
    datum = types.Datum(model_input=image, loss_fn_inputs={"target_tokens": [6] + [0] * 4 + [7, 8, 9], "weights": [1.0] * 8})
    with pytest.raises(tinker.BadRequestError, match="image chunks are not supported: this server trains text models"):
        training.forward_backward([datum], "cross_entropy").result()


def test_the_front_doors_engine_reads_images_from_the_offers_folder_without_weights(tiny_vlm: str, tiny: str, tmp_path: Any) -> None:
    """``ClusterEngine.vision``: the offered VLM's image processor and image token from its tokenizer folder (an image takes as
    many tokens as the model's renderer makes), None for a text model's offer, whose image chunks ops.py refuses as before."""
    from types import SimpleNamespace

    from tinkergym.protocol.types import ImageData
    from tinkergym.tinker_api.cluster import ClusterEngine
    from tinkergym.tinker_api.service import TinkerError
    from tinkergym.tinker_api.ops import model_input

    cluster = ClusterEngine("http://127.0.0.1:9", {MODEL: tiny_vlm, "tiny": tiny}, tmp_path)
    prompt = Prompt(tiny_vlm)
    vision = cluster.vision(MODEL)
    assert vision is cluster.vision(MODEL) and vision.image_token_id == prompt.image_id
    assert vision.token_count(ImageData.from_array(np.zeros((64, 64, 3), np.uint8))) == prompt.count
    assert vision.token_count(ImageData.from_array(np.zeros((112, 56, 3), np.uint8))) != prompt.count
    tokens, images = model_input(SimpleNamespace(engine=cluster), MODEL, prompt.chunks(_png(1)), "prompt")
    assert tokens.count(prompt.image_id) == prompt.count and len(images) == 1 and images[0].height == 64
    assert cluster.vision("tiny") is None
    with pytest.raises(TinkerError, match="image chunks are not supported: this server trains text models"):
        model_input(SimpleNamespace(engine=cluster), "tiny", prompt.chunks(_png(1)), "prompt")
