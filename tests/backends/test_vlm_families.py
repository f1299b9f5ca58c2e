"""The image path on each Qwen image-grid family tinkergym reads (Qwen2-VL, Qwen2.5-VL's windowed vision tower, Qwen3-VL's
deepstack features and interleaved 3D rotary sections), each built tiny from a config in float32: the sampler's logprobs of
its completions equal the trainer's scoring with the same image, another image moves them, LoRA adapts the language
model only, and a few steps of SFT on an image datum lower its loss; the shared LoRA server's session agrees with
TorchBackend on the same adapter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")

from tinkergym.backends.models import TINY_VLM_FAMILIES, build_tiny_vlm  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402
from tinkergym.protocol.types import (  # noqa: E402
    Datum, ForwardBackwardRequest, ImageData, LossSpec, OptimParams, SampleRequest, SamplingParams,
)


def _image(seed: int, size: int = 64) -> tuple[np.ndarray, ImageData]:
    array = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return array, ImageData.from_array(array)


@pytest.fixture(scope="module", params=TINY_VLM_FAMILIES)
def family_vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", family=request.param)


def test_each_family_samples_scores_and_trains_with_images(family_vlm: str) -> None:
    import json

    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.chat import ImageChatRenderer

    architecture = json.loads(Path(family_vlm, "config.json").read_text())["architectures"][0]
    backend = TorchBackend(TorchBackendConfig(model=family_vlm, dtype="float32", lora_rank=4, seed=0))
    adapted = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert adapted and all(".language_model." in n for n in adapted), (architecture, adapted[:3])
    renderer = ImageChatRenderer.from_folder(family_vlm)
    (array, image), (other_array, other) = _image(1), _image(2, 72)
    prompt = renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}], None, images=[array])
    sampled = backend.sample(SampleRequest(prompts=[prompt], images=[[image]], num_samples=2, params=SamplingParams(max_new_tokens=5, seed=3)))
    for seq in sampled.sequences[0]:
        scored = backend.logprobs([prompt + seq.tokens], images=[[image]])[0][len(prompt):]
        np.testing.assert_allclose(seq.logprobs, scored, atol=1e-5, err_msg=architecture)
    tokens = sampled.sequences[0][0].tokens
    # the other image (another size: another count of image tokens) moves the same completion's logprobs
    other_prompt = renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}], None,
                                          images=[other_array])
    moved = backend.logprobs([other_prompt + tokens], images=[[other]])[0][len(other_prompt):]
    assert np.abs(np.asarray(moved) - np.asarray(sampled.sequences[0][0].logprobs)).max() > 1e-3, architecture
    with pytest.raises(ConfigError, match="image tokens"):
        backend.logprobs([prompt + tokens], images=[[other]])
    answer = renderer.tokenizer.encode("red", add_special_tokens=False)
    datum = Datum(tokens=prompt + answer, loss_mask=[0.0] * len(prompt) + [1.0] * len(answer), images=[image])
    losses = []
    for _ in range(4):
        losses.append(backend.forward_backward(ForwardBackwardRequest(data=[datum], loss=LossSpec(name="cross_entropy"))).metrics["loss"])
        backend.optim_step(OptimParams(learning_rate=2e-2))
    assert losses[-1] < 0.7 * losses[0], (architecture, losses)


def test_each_familys_shared_session_equals_torch_backend(family_vlm: str) -> None:
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig
    from tinkergym.chat import ImageChatRenderer

    renderer = ImageChatRenderer.from_folder(family_vlm)
    array, image = _image(4)
    prompt = renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}], None, images=[array])
    sequence = prompt + [40, 41, 42]
    base = SharedBase(SharedBaseConfig(model=family_vlm, dtype="float32", micro_batch_size=4))
    session = base.open_session(LoraSessionConfig(lora_rank=4, lora_alpha=8.0, seed=5))
    backend = TorchBackend(TorchBackendConfig(model=family_vlm, dtype="float32", lora_rank=4, lora_alpha=8.0, seed=5))
    np.testing.assert_allclose(session.logprobs([sequence], 1.0, images=[[image]])[0], backend.logprobs([sequence], images=[[image]])[0], atol=1e-5)
    base.close_session(session)


def test_an_unknown_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="qwen2_vl, qwen2_5_vl, qwen3_vl"):
        build_tiny_vlm(tmp_path / "m", family="llava")
