"""The training server's ``logprobs`` call with images: parse_call checks them (one list per sequence, the protocol's image
bounds, base64 that decodes) before anything runs; a shared server of a vision-language model scores sequences with their
images over HTTP as its session does in process, a text call's JSON is what it was before images; a server of its own on
a vision-language model (TorchBackend) scores them as its training pass and sampler do, and a text model's server refuses
them with a 400 and keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from tinkergym.backends.remote import RemoteBackend  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402
from tinkergym.protocol.types import MAX_IMAGE_PIXELS, MAX_IMAGES, ImageData  # noqa: E402
from tinkergym.serve.training.calls import parse_call  # noqa: E402

ADMIN = "a" * 40


def _image(seed: int, size: int = 64) -> ImageData:
    return ImageData.from_array(np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8))


def test_parse_call_takes_images_per_sequence_and_refuses_bad_ones() -> None:
    image = _image(1, 8)
    plain = parse_call("logprobs", {"sequences": [[1, 2], [3, 4]]})
    assert plain.args == {"sequences": [[1, 2], [3, 4]], "temperature": 1.0}  # no images key: the text call as it was
    parsed = parse_call("logprobs", {"sequences": [[1, 2], [3, 4]], "images": [[image.to_dict()], []]})
    assert parsed.args["images"] == [[image], []] and isinstance(parsed.args["images"][0][0], ImageData)
    bad_base64 = {**image.to_dict(), "data": "!" * len(image.data)}  # the right length, not base64
    too_big = {"height": MAX_IMAGE_PIXELS + 1, "width": 1, "data": ""}
    refused = [
        ({"images": [[image.to_dict()]]}, "one list per sequence \\(2\\), not 1"),
        ({"images": [[image.to_dict()] * (MAX_IMAGES + 1), []]}, f"at most {MAX_IMAGES}"),
        ({"images": [[bad_base64], []]}, r"args\.images\[0\]\[0\]: an image's data is not base64"),
        ({"images": [[too_big], []]}, "larger than the"),
        ({"images": [[{"height": 2, "width": 2}], []]}, r"args\.images\[0\]\[0\]"),
        ({"images": [["not an image"], []]}, r"args\.images\[0\]\[0\]: expected a ImageData object"),
        ({"images": "nope"}, "args.images: expected a list"),
    ]
    for extra, message in refused:
        with pytest.raises(ConfigError, match=message):
            parse_call("logprobs", {"sequences": [[1, 2], [3, 4]], **extra})


class _Recording(RemoteBackend):
    """A RemoteBackend that keeps the JSON of each call's args as it goes on the wire."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, token)
        self.sent: list[str] = []

    def _call(self, method: str, args: dict[str, Any]) -> Any:
        self.sent.append(json.dumps(args))
        return super()._call(method, args)


def test_a_shared_vlm_server_scores_with_images_as_its_session_does(tiny_vlm: str, tmp_path: Path) -> None:
    import httpx

    from testkit import serving
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig
    from tinkergym.chat import ImageChatRenderer
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.shared import create_shared_app

    base = SharedBase(SharedBaseConfig(model=tiny_vlm, dtype="float32", micro_batch_size=4))
    reference = base.open_session(LoraSessionConfig(lora_rank=4, lora_alpha=8.0, seed=5))
    renderer = ImageChatRenderer.from_folder(tiny_vlm)
    pictures = [_image(11), _image(12, 72)]
    arrays = [np.frombuffer(i.pixels(), np.uint8).reshape(i.height, i.width, 3) for i in pictures]
    sequences = [renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}], None,
                                        images=[a]) + [40, 41, 42] for a in arrays]
    images = [[p] for p in pictures]
    with serving(create_shared_app(base, run_dir=tmp_path, token_digest=token_digest(ADMIN))) as url:
        token = httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {ADMIN}"},
                           json={"lora_rank": 4, "lora_alpha": 8.0, "seed": 5}).json()["token"]
        remote = _Recording(url, token)
        scored = remote.logprobs(sequences, 1.0, images=images)
        np.testing.assert_allclose(np.concatenate(scored), np.concatenate(reference.logprobs(sequences, 1.0, images=images)), atol=1e-5)
        # another image of the same size: the same tokens, other logprobs
        swapped = remote.logprobs(sequences[:1], 1.0, images=[[_image(13)]])
        assert np.abs(np.asarray(swapped[0]) - np.asarray(scored[0])).max() > 1e-3
        # a text call's JSON is the text call's (no images key); its image tokens without images are refused (400)
        text = [list(range(5, 15))]
        assert remote.logprobs(text, 1.0, images=[[]]) == remote.logprobs(text)
        assert remote.sent[-1] == remote.sent[-2] == json.dumps({"sequences": text, "temperature": 1.0})
        with pytest.raises(ConfigError, match="image tokens"):
            remote.logprobs(sequences[:1])
        # bad image bytes from a hostile client: a 400, and the server goes on serving
        session = httpx.post(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {token}"}).json()["session_id"]
        hostile = {**pictures[0].to_dict(), "data": "#" * len(pictures[0].data)}
        answer = httpx.post(f"{url}/v1/call?wait=30", headers={"Authorization": f"Bearer {token}"},
                            json={"session_id": session, "seq": 1, "method": "logprobs",
                                  "args": {"sequences": sequences[:1], "images": [[hostile]]}})
        assert answer.status_code == 400 and "not base64" in answer.text, answer.text
        np.testing.assert_allclose(remote.logprobs(sequences, 1.0, images=images)[1], scored[1], atol=1e-6)
        remote.close()
    base.close_session(reference)


def test_a_text_model_server_refuses_images_and_keeps_serving(tiny: str, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.app import create_app

    backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", device="cpu", lora_rank=4, seed=3))
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with TestClient(create_app(backend, run_dir=tmp_path, token_digest=token_digest(ADMIN)), raise_server_exceptions=False) as http:
        session = http.post("/v1/sessions", headers=auth).json()["session_id"]

        def call(seq: int, args: dict[str, Any]) -> Any:
            return http.post("/v1/call?wait=30", headers=auth, json={"session_id": session, "seq": seq, "method": "logprobs", "args": args})

        refused = call(1, {"sequences": [[5, 6, 7]], "images": [[_image(1, 8).to_dict()]]})
        assert refused.status_code == 400 and "reads no images" in refused.text, refused.text
        served = call(2, {"sequences": [[5, 6, 7]]})
        assert served.status_code == 200 and len(served.json()["result"]["logprobs"][0]) == 3


def test_a_vlm_training_server_scores_with_images_as_its_training_pass_and_sampler_do(tiny_vlm: str, tmp_path: Path) -> None:
    """A server of its own (``serve backend``, TorchBackend) on a vision-language model: ``logprobs`` with images equals the
    logprobs its training pass returns for the same datum's completion, and the sampler's for a sampled completion; another image of the
    same size moves them; image tokens without their images are refused."""
    from testkit import serving
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.chat import ImageChatRenderer
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, SampleRequest, SamplingParams
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.app import create_app

    backend = TorchBackend(TorchBackendConfig(model=tiny_vlm, dtype="float32", device="cpu", lora_rank=4, seed=3))
    renderer = ImageChatRenderer.from_folder(tiny_vlm)
    pictures = [_image(21), _image(22, 72)]
    arrays = [np.frombuffer(i.pixels(), np.uint8).reshape(i.height, i.width, 3) for i in pictures]
    prompts = [renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}], None,
                                      images=[a]) for a in arrays]
    images = [[p] for p in pictures]
    # the sampler's logprobs of its own completions, and the training pass's of the same rows, before the server starts
    sampled = backend.sample(SampleRequest(prompts=prompts, images=images, num_samples=1,
                                           params=SamplingParams(max_new_tokens=4, temperature=1.0, seed=7)))
    completions = [group[0] for group in sampled.sequences]
    sequences = [prompt + c.tokens for prompt, c in zip(prompts, completions)]
    data = [Datum(tokens=p + c.tokens, loss_mask=[0.0] * len(p) + [1.0] * len(c.tokens), images=row)
            for p, c, row in zip(prompts, completions, images)]
    trained = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="cross_entropy"), return_logprobs=True))
    assert trained.logprobs is not None
    with serving(create_app(backend, run_dir=tmp_path, token_digest=token_digest(ADMIN))) as url:
        remote = _Recording(url, ADMIN)
        scored = remote.logprobs(sequences, 1.0, images=images)
        for row, expected, prompt, completion in zip(scored, trained.logprobs, prompts, completions):
            np.testing.assert_allclose(row[len(prompt):], expected[len(prompt):], atol=1e-5)  # the pass reads the completion only
            np.testing.assert_allclose(row[len(prompt):], completion.logprobs, atol=1e-4)
        swapped = remote.logprobs(sequences[:1], 1.0, images=[[_image(23)]])
        assert np.abs(np.asarray(swapped[0]) - np.asarray(scored[0])).max() > 1e-3
        with pytest.raises(ConfigError, match="image tokens"):
            remote.logprobs(sequences[:1])
        remote.close()
