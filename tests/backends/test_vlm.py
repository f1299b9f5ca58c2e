"""Vision-language models through the stack: the image chat renderer, rollouts with images, TorchBackend with a tiny Qwen2-VL."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import tinkergym  # noqa: F401 - registers the hub's env ids
from tinkergym.chat import ImageChatRenderer
from tinkergym.protocol.types import Datum, SampledSequence, SampleRequest, SampleResponse
from tinkergym.rollouts import RolloutConfig, rollout


class PatchEnv:
    """A multi-turn image env: every observation shows a new image (of a size drawn on reset); three turns."""

    def reset(self, seed: int | None = None, options: Any = None) -> tuple[dict, dict]:
        self.rng = np.random.default_rng(seed)
        self.turn = 0
        return self._observation("What colour is it?"), {"system_prompt": "Look at the image."}

    def _observation(self, text: str) -> dict:
        size = int(self.rng.integers(40, 160))
        return {"text": text, "images": (self.rng.integers(0, 256, size=(size, size + 10, 3), dtype=np.uint8),)}

    def step(self, action: str) -> tuple:
        self.turn += 1
        return self._observation(f"And now? ({len(action)})"), 0.0, self.turn >= 3, False, {}


class ScriptedSampler:
    """Answers every prompt with the tokenizer's ids of a fixed reply and the stop token; keeps every request."""

    def __init__(self, renderer: ImageChatRenderer, reply: str = "red") -> None:
        self.reply = renderer.tokenizer.encode(reply, add_special_tokens=False) + [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.requests: list[SampleRequest] = []

    def sample(self, request: SampleRequest) -> SampleResponse:
        self.requests.append(SampleRequest([list(p) for p in request.prompts], request.params, request.num_samples, [list(i) for i in request.images]))
        return SampleResponse([[SampledSequence(list(self.reply), [-1.0] * len(self.reply), "stop")] for _ in request.prompts])


def _pixels(image: Any) -> list:
    return np.frombuffer(image.pixels(), dtype=np.uint8).reshape(image.height, image.width, 3).tolist()


def test_multi_turn_rollout_with_images_is_token_faithful(tiny_vlm: str) -> None:
    renderer = ImageChatRenderer.from_folder(tiny_vlm)
    sampler = ScriptedSampler(renderer)
    envs = [PatchEnv(), PatchEnv()]
    trajectories = rollout(envs, sampler, renderer, RolloutConfig(max_turns=5, max_new_tokens=8, env_workers=1), seeds=[1, 2])
    image_id = renderer.image_token_id
    for row, trajectory in enumerate(trajectories):
        assert trajectory.finish_reason == "terminated" and trajectory.error is None
        assert len(trajectory.images) == 3  # one image per observation, in order
        # Each turn's prompt begins with the previous turn's prompt and its sampled ids, and carries the images so far.
        prompts = [request.prompts[row] for request in sampler.requests]
        for turn, (before, after) in enumerate(zip(prompts, prompts[1:])):
            assert after[: len(before) + len(sampler.reply)] == before + sampler.reply
            assert sampler.requests[turn + 1].images[row] == trajectory.images[: turn + 2]
        assert prompts[-1] + sampler.reply == trajectory.tokens
        # The image tokens are the processor's count for each image: different sizes, different counts.
        counts = renderer.image_token_counts([np.asarray(_pixels(i), dtype=np.uint8) for i in trajectory.images])
        assert trajectory.tokens.count(image_id) == sum(counts) and len(set(counts)) > 1
        # And the whole trajectory is the template's rendering of its conversation with these images.
        images = [np.asarray(_pixels(i), dtype=np.uint8) for i in trajectory.images]
        rendered = renderer.render(trajectory.messages, images=images)
        assert rendered[: len(trajectory.tokens)] == trajectory.tokens
    assert _pixels(trajectories[0].images[0]) != _pixels(trajectories[1].images[0])


def test_colour_square_rollout_sends_its_image_and_text_renderers_send_none(tiny_vlm: str, tiny: str) -> None:
    from tinkergym.chat import ChatTemplateRenderer

    renderer = ImageChatRenderer.from_folder(tiny_vlm)
    env = gym.make("tinker/ColourSquare-v0")
    observation, _ = env.reset(seed=3)
    sampler = ScriptedSampler(renderer)
    (trajectory,) = rollout([gym.make("tinker/ColourSquare-v0")], sampler, renderer, RolloutConfig(max_new_tokens=4), seeds=[3])
    assert trajectory.finish_reason == "terminated" and len(trajectory.rewards) == 1
    assert _pixels(sampler.requests[0].images[0][0]) == observation["images"][0].tolist()
    assert trajectory.tokens.count(renderer.image_token_id) == 4  # 64 x 64 -> 56 x 56 -> 4 x 4 patches merged 2 x 2
    text = ChatTemplateRenderer(tiny)
    text_sampler = ScriptedSampler(text)
    (text_trajectory,) = rollout([gym.make("tinker/ColourSquare-v0")], text_sampler, text, RolloutConfig(max_new_tokens=4), seeds=[3])
    assert text_trajectory.images == [] and "images" not in text_sampler.requests[0].to_dict()
    assert "<image>" in text.tokenizer.decode(text_trajectory.tokens)


# ----- TorchBackend with a vision-language model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm_backend(tiny_vlm: str) -> Any:
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    return TorchBackend(TorchBackendConfig(model=tiny_vlm, dtype="float32", lora_rank=4, seed=0))


def _trainer_logprobs(backend: Any, data: list) -> list[list[float]]:
    from tinkergym.protocol.types import ForwardBackwardRequest, LossSpec

    result = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="cross_entropy", loss_scale=0.0), return_logprobs=True))
    backend.optimizer.zero_grad(set_to_none=True)
    return result.logprobs


def test_vlm_loads_with_lora_on_the_language_model_only(vlm_backend: Any) -> None:
    names = [n for n, _ in vlm_backend._trainable]
    assert names and all(".language_model." in n and "lora_" in n for n in names)
    assert not any("visual" in n for n in names)
    assert vlm_backend.vision is not None and vlm_backend.attn_implementation == "sdpa"


def test_sampler_logprobs_equal_trainer_logprobs_in_rollouts_with_images(vlm_backend: Any, tiny_vlm: str) -> None:
    from tinkergym.trainers.advantages import trajectories_to_data

    renderer = ImageChatRenderer.from_folder(tiny_vlm)
    config = RolloutConfig(max_turns=3, max_new_tokens=6, seed=5, env_workers=1)
    squares = rollout([gym.make("tinker/ColourSquare-v0") for _ in range(4)], vlm_backend, renderer, config, seeds=[0, 0, 1, 2])
    patches = rollout([PatchEnv(), PatchEnv()], vlm_backend, renderer, config, seeds=[7, 8])  # several images, text between
    trajectories = squares + patches
    for trajectory in trajectories:
        assert trajectory.error is None and trajectory.num_sampled_tokens > 0
        assert trajectory.tokens.count(renderer.image_token_id) == sum(vlm_backend.vision.token_count(i) for i in trajectory.images)
        assert renderer.image_token_id not in [t for t, m in zip(trajectory.tokens, trajectory.loss_mask) if m]  # never sampled
    assert all(len(t.images) == 3 for t in patches)
    data = trajectories_to_data(trajectories, [1.0] * len(trajectories))
    trainer = _trainer_logprobs(vlm_backend, data)
    worst = max(abs(a - b) for d, row in zip(data, trainer) for a, b, m in zip(row, d.sampling_logprobs, d.loss_mask) if m)
    assert worst < 1e-5, worst
    # The logprobs belong to each row's own image: scored with another square's (same size, same tokens) they differ.
    swapped = [Datum(tokens=data[i].tokens, loss_mask=data[i].loss_mask, images=data[5 - i].images) for i in (2, 3)]
    moved = max(abs(a - b) for i, row in zip((2, 3), _trainer_logprobs(vlm_backend, swapped)) for a, b, m in zip(row, trainer[i], data[i].loss_mask) if m)
    assert moved > 1e-4
