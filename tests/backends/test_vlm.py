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


class CountingProcessor:
    """The image processor, counting the images it is given (by their pixels' digest)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.seen: list[tuple] = []

    def __call__(self, images: list, **kwargs: Any) -> Any:
        from tinkergym.chat import image_digest

        self.seen.extend(image_digest(image) for image in images)
        return self.processor(images=images, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.processor, name)


def test_a_multi_turn_episode_runs_the_image_processor_once_per_image(tiny_vlm: str) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer, processor = AutoTokenizer.from_pretrained(tiny_vlm), AutoImageProcessor.from_pretrained(tiny_vlm)
    runs = {}
    for name, entries in (("cached", 512), ("uncached", 0)):
        renderer = ImageChatRenderer(tokenizer, CountingProcessor(processor), cache_entries=entries)
        sampler = ScriptedSampler(renderer)
        trajectories = rollout([PatchEnv(), PatchEnv(), PatchEnv()], sampler, renderer, RolloutConfig(max_turns=5, max_new_tokens=8, env_workers=1),
                               seeds=[1, 2, 1])
        runs[name] = (renderer.image_processor.seen, trajectories, sampler.requests)
    seen, trajectories, requests = runs["cached"]
    assert all(len(t.images) == 3 for t in trajectories)
    # Nine images, two episodes alike (seed 1): six distinct images, each processed once.
    assert len(seen) == len(set(seen)) == 6
    # Without the cache every turn measures every image so far again; the tokens and the images sent are the same.
    assert len(runs["uncached"][0]) > 3 * len(seen)
    assert [t.tokens for t in trajectories] == [t.tokens for t in runs["uncached"][1]]
    assert [r.prompts for r in requests] == [r.prompts for r in runs["uncached"][2]]
    assert [r.images for r in requests] == [r.images for r in runs["uncached"][2]]


def test_the_image_cache_keeps_the_most_recently_used_images(tiny_vlm: str) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    renderer = ImageChatRenderer(AutoTokenizer.from_pretrained(tiny_vlm), CountingProcessor(AutoImageProcessor.from_pretrained(tiny_vlm)), cache_entries=2)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 256, size=(40 + 30 * i, 50, 3), dtype=np.uint8) for i in range(3))
    counts = renderer.image_token_counts([a, b])
    assert renderer.image_token_counts([b, a.copy()]) == counts[::-1] and len(renderer.image_processor.seen) == 2  # equal pixels: no new run
    renderer.image_token_counts([c])  # the cache holds two: b, the least recently used, goes
    renderer.image_token_counts([a, c])
    assert len(renderer.image_processor.seen) == 3
    assert renderer.image_token_counts([b]) == counts[1:] and len(renderer.image_processor.seen) == 4
    uncached = ImageChatRenderer(renderer.tokenizer, renderer.image_processor.processor, cache_entries=0)
    assert uncached.image_token_counts([a, b, c]) == renderer.image_token_counts([a, b, c])


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


def test_token_counts_are_kept_per_image_size(vlm_backend: Any) -> None:
    """The image processor runs once per image size for the token-count checks, and the kept counts are the processor's."""
    from tinkergym.backends.torch.vision import VisionInputs
    from tinkergym.protocol.types import ImageData

    real = vlm_backend.vision
    calls: list[int] = []

    class Counting:  # the real processor, its calls counted
        def __getattr__(self, name: str) -> Any:
            return getattr(real.image_processor, name)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(len(kwargs["images"]))
            return real.image_processor(*args, **kwargs)

    vision = VisionInputs(Counting(), real.image_token_id, None)
    rng = np.random.default_rng(0)
    images = [ImageData.from_array(rng.integers(0, 256, size=size, dtype=np.uint8)) for size in [(56, 84, 3), (56, 84, 3), (112, 56, 3), (56, 84, 3)]]
    counts = [vision.token_count(i) for i in images]
    assert counts == [real.token_count(i) for i in images] and counts[0] != counts[2]
    assert len(calls) == 2  # two sizes
    rows = [[real.image_token_id] * (counts[0] + counts[2]) + [5, 6]]
    vision.check_rows(rows, [[images[1], images[2]]], "row")
    assert len(calls) == 2
    vision.COUNT_CACHE = 1  # a new size evicts the others: the next look at an old size runs the processor again
    vision.token_count(ImageData.from_array(rng.integers(0, 256, size=(84, 84, 3), dtype=np.uint8)))
    vision.token_count(images[0])
    assert len(calls) == 4 and list(vision._counts) == [(56, 84)]


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


def test_backends_refuse_images_they_cannot_read(vlm_backend: Any, tiny: str) -> None:
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.errors import ConfigError
    from tinkergym.protocol.types import ForwardBackwardRequest, ImageData, LossSpec

    image = ImageData.from_array(np.zeros((64, 64, 3), np.uint8))
    text_backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", lora_rank=2))
    with pytest.raises(ConfigError, match="reads no images"):
        text_backend.sample(SampleRequest(prompts=[[1, 2]], images=[[image]]))
    with pytest.raises(ConfigError, match="reads no images"):
        text_backend.forward_backward(ForwardBackwardRequest(data=[Datum([1, 2], [0.0, 1.0], images=[image])], loss=LossSpec(name="cross_entropy")))
    # A prompt whose image tokens do not match its images' features is refused before the model runs.
    with pytest.raises(ConfigError, match="image tokens"):
        vlm_backend.sample(SampleRequest(prompts=[[1, vlm_backend.vision.image_token_id, 2]], images=[[image]]))
    with pytest.raises(ConfigError, match="image tokens"):  # image tokens without their images
        vlm_backend.logprobs([[1, vlm_backend.vision.image_token_id, 2]])
    assert len(vlm_backend.logprobs([[1, 5, 6]])[0]) == 3  # text sequences score as before


# ----- learning -------------------------------------------------------------------------------------------------
#: ColourSquare-v0 seeds whose squares are red (the first four) and blue (the last four): a policy that always names
#: one colour earns 0.5 on them, so a reward above that needs the image.
BALANCED_SEEDS = (1, 6, 9, 11, 0, 2, 3, 4)


def _square_prompt(renderer: ImageChatRenderer, seed: int) -> tuple[list[int], Any, str]:
    from tinkergym.protocol.types import ImageData

    env = gym.make("tinker/ColourSquare-v0")
    observation, info = env.reset(seed=seed)
    messages = [{"role": "system", "content": info["system_prompt"]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": observation["text"]}]}]
    image = observation["images"][0]
    return renderer.prompt_tokens(messages, None, images=[image]), ImageData.from_array(image), env.unwrapped.colour


def _answer(renderer: ImageChatRenderer, prompt: list[int], image: Any, colour: str) -> Datum:
    answer = renderer.tokenizer.encode(colour, add_special_tokens=False) + [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return Datum(tokens=prompt + answer, loss_mask=[0.0] * len(prompt) + [1.0] * len(answer), images=[image])


@pytest.fixture(scope="module")
def warm_vlm(tiny_vlm: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny VLM after 20 steps of SFT (full fine-tuning) on ColourSquare answers of a random colour: the answer's
    format, not which colour (a random tiny model's logits are too flat for a LoRA to learn the format fast)."""
    import random

    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.protocol.types import ForwardBackwardRequest, LossSpec, OptimParams

    renderer = ImageChatRenderer.from_folder(tiny_vlm)
    backend = TorchBackend(TorchBackendConfig(model=tiny_vlm, dtype="float32", lora_rank=0, seed=0))
    rng = random.Random(0)
    for step in range(30):
        data = []
        for seed in range(100 + 8 * step, 108 + 8 * step):
            prompt, image, _ = _square_prompt(renderer, seed)
            data.append(_answer(renderer, prompt, image, rng.choice(["red", "blue"])))
        backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="cross_entropy")))
        backend.optim_step(OptimParams(learning_rate=5e-3))
    path = str(tmp_path_factory.mktemp("warm-vlm") / "model")
    backend.export(path, merged=True)
    return path


# The rollouts' seed is an offset plus the step. A run whose first draws make the policy answer one colour for every
# square can stay there (every group ties: no gradient), so whether a short budget learns is the draws' luck. Measured:
# full fine-tuning in 14 steps learns from offset 100 (0 never does in 24 steps; 200 from step 15); LoRA in 24 steps
# learns from offsets 200, 300, 400 and 500 (0 and 100 do not).


def _grpo_on_balanced_squares(backend: Any, renderer: ImageChatRenderer, steps: int, learning_rate: Any, group: int = 8,
                              rollout_seed: int = 0) -> list[float]:
    """GRPO on the balanced squares, ``group`` samples of each per step (rollout seed: ``rollout_seed`` + step);
    ``learning_rate(step)`` is each step's rate. Returns each step's mean reward."""
    from tinkergym.protocol.types import ForwardBackwardRequest, LossSpec, OptimParams
    from tinkergym.trainers.advantages import group_relative_advantages, trajectories_to_data

    rewards = []
    for step in range(steps):
        envs = [gym.make("tinker/ColourSquare-v0") for _ in range(len(BALANCED_SEEDS) * group)]
        seeds = [BALANCED_SEEDS[i // group] for i in range(len(envs))]
        trajectories = rollout(envs, backend, renderer, RolloutConfig(max_new_tokens=3, max_turns=1, seed=rollout_seed + step, env_workers=1),
                               seeds=seeds)
        step_rewards = [t.total_reward for t in trajectories]
        rewards.append(sum(step_rewards) / len(step_rewards))
        data = trajectories_to_data(trajectories, group_relative_advantages(step_rewards, group))
        if data:
            tokens = sum(sum(t.loss_mask) for t in trajectories)
            backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo"), num_tokens=tokens, num_sequences=len(trajectories)))
            backend.optim_step(OptimParams(learning_rate=learning_rate(step)))
    return rewards


@pytest.mark.slow
def test_grpo_on_colour_square_raises_reward_past_guessing(warm_vlm: str) -> None:
    """GRPO with full fine-tuning on four red and four blue squares: the reward rises from guessing (0.5) to answering
    from the image in 14 steps (LoRA, below, needs more steps and a decaying rate)."""
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    renderer = ImageChatRenderer.from_folder(warm_vlm)
    backend = TorchBackend(TorchBackendConfig(model=warm_vlm, dtype="float32", lora_rank=0, seed=0))
    rewards = _grpo_on_balanced_squares(backend, renderer, 14, lambda step: 2e-3, rollout_seed=100)
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert start < 0.65 and end > 0.8, [round(r, 3) for r in rewards]


@pytest.mark.slow
def test_grpo_with_lora_on_colour_square_raises_reward_past_guessing(warm_vlm: str) -> None:
    """GRPO with LoRA (on the language model only; the vision tower stays frozen) on the same squares: the reward rises
    from guessing to answering from the image. The rate decays linearly from 1e-2 to 1e-3: at a constant rate that
    learns within the budget, once nearly every group ties the few that do not swing the answer's bias from one colour
    to the other (the reward falls back to 0.5 for a step or several)."""
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    renderer = ImageChatRenderer.from_folder(warm_vlm)
    backend = TorchBackend(TorchBackendConfig(model=warm_vlm, dtype="float32", lora_rank=8, lora_alpha=32, seed=0))
    assert all(".language_model." in name for name, _ in backend._trainable)
    steps = 24
    rewards = _grpo_on_balanced_squares(backend, renderer, steps, lambda step: 1e-2 * (1 - 0.9 * step / (steps - 1)), rollout_seed=200)
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert start < 0.65 and end > 0.8, [round(r, 3) for r in rewards]


@pytest.mark.slow
def test_lora_gradient_reaches_the_image_conditioned_path(warm_vlm: str) -> None:
    """With LoRA on the language model only, SFT on the right colours lowers the loss with the right images, and the
    loss with the red and blue squares' images swapped rises: the adapted model answers from the image."""
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.protocol.types import ForwardBackwardRequest, LossSpec, OptimParams

    renderer = ImageChatRenderer.from_folder(warm_vlm)
    backend = TorchBackend(TorchBackendConfig(model=warm_vlm, dtype="float32", lora_rank=8, seed=0))
    squares = [_square_prompt(renderer, seed) for seed in BALANCED_SEEDS]
    right = [_answer(renderer, prompt, image, colour) for prompt, image, colour in squares]
    swapped = [Datum(d.tokens, d.loss_mask, images=right[(i + 4) % 8].images) for i, d in enumerate(right)]  # red <-> blue

    def colour_nll(data: list[Datum]) -> float:
        rows = _trainer_logprobs(backend, data)
        return -sum(row[d.loss_mask.index(1.0)] for d, row in zip(data, rows)) / len(data)

    before, before_swapped = colour_nll(right), colour_nll(swapped)
    for _ in range(22):
        backend.forward_backward(ForwardBackwardRequest(data=right, loss=LossSpec(name="cross_entropy")))
        backend.optim_step(OptimParams(learning_rate=5e-3))
    after, after_swapped = colour_nll(right), colour_nll(swapped)
    assert after < 0.5 * before, (before, after)
    assert after_swapped > before_swapped + 0.5 and after_swapped > after + 1.0, (before_swapped, after_swapped, after)


def test_images_travel_to_a_training_server_and_back(vlm_backend: Any, tiny_vlm: str, tmp_path: Any) -> None:
    """Rollouts through RemoteBackend send their images over HTTP: the server samples from them and scores them as in-process."""
    pytest.importorskip("fastapi")
    from tinkergym.backends.remote import RemoteBackend
    from tinkergym.protocol.types import ForwardBackwardRequest, LossSpec
    from tinkergym.serve.asgi import ThreadServer
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.app import create_app
    from tinkergym.trainers.advantages import trajectories_to_data

    token = "vlm-remote-test-token-0123456789abcdef"
    server = ThreadServer(create_app(vlm_backend, run_dir=tmp_path / "server", token_digest=token_digest(token)))
    try:
        client = RemoteBackend(server.url, token)
        renderer = ImageChatRenderer.from_folder(tiny_vlm)
        config = RolloutConfig(max_new_tokens=5, seed=11, env_workers=1)
        trajectories = rollout([gym.make("tinker/ColourSquare-v0") for _ in range(3)], client, renderer, config, seeds=[4, 5, 6])
        local = rollout([gym.make("tinker/ColourSquare-v0") for _ in range(3)], vlm_backend, renderer, config, seeds=[4, 5, 6])
        assert [t.tokens for t in trajectories] == [t.tokens for t in local]  # same seed, same images: the same samples
        data = trajectories_to_data(trajectories, [1.0] * 3)
        result = client.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="cross_entropy", loss_scale=0.0), return_logprobs=True))
        worst = max(abs(a - b) for d, row in zip(data, result.logprobs) for a, b, m in zip(row, d.sampling_logprobs, d.loss_mask) if m)
        assert worst < 1e-5, worst
    finally:
        server.stop()
        vlm_backend.optimizer.zero_grad(set_to_none=True)


def test_eval_of_a_vlm_folder_renders_and_sends_its_images(tiny_vlm: str, tiny: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from click.testing import CliRunner

    from tinkergym.backends.torch.backend import TorchBackend
    from tinkergym.chat import ChatTemplateRenderer, renderer_for
    from tinkergym.cli import main

    assert isinstance(renderer_for(tiny_vlm), ImageChatRenderer)
    assert type(renderer_for(tiny)) is ChatTemplateRenderer
    sent: list[int] = []
    sample = TorchBackend.sample
    monkeypatch.setattr(TorchBackend, "sample", lambda self, request: (sent.append(sum(map(len, request.images))), sample(self, request))[1])
    args = ["eval", "--env", "tinker/ColourSquare-v0", "--episodes", "2", "--max-new-tokens", "3", "--model", tiny_vlm, "--out", str(tmp_path / "eval.jsonl"), "--json"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index('{"env"'):].splitlines()[0])  # after the progress bar's carriage returns
    assert summary["failed"] == 0.0 and summary["episodes"] == 2.0
    assert sent == [2]  # one sampling round, one image per episode


def test_train_on_a_vlm_folder_sends_its_images_to_sampling_and_training(tiny_vlm: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from tinkergym.backends.torch.backend import TorchBackend
    from tinkergym.cli import main

    sampled: list[int] = []
    trained: list[int] = []
    sample, forward_backward = TorchBackend.sample, TorchBackend.forward_backward
    monkeypatch.setattr(TorchBackend, "sample", lambda self, request: (sampled.append(sum(map(len, request.images))), sample(self, request))[1])
    monkeypatch.setattr(TorchBackend, "forward_backward",
                        lambda self, request: (trained.extend(len(d.images) for d in request.data), forward_backward(self, request))[1])
    args = ["train", "--env", "tinker/ColourSquare-v0", "--steps", "1", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "3",
            "--model", tiny_vlm, "--dtype", "float32", "--quiet", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sampled and sum(sampled) == 4  # one image per episode, 2 prompts x 2 samples
    assert all(n == 1 for n in trained)  # every trained sequence carries its episode's image (a step whose groups all tie trains none)


def test_a_remote_run_renders_images_with_the_servers_image_processor(tiny_vlm: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training server of a VLM sends its image processor's files with the tokenizer's, so the client's renderer is the
    image renderer: a rollout through the server has the in-process token ids, and ``tinkergym train --backend-url``
    sends every episode's image."""
    pytest.importorskip("fastapi")
    from pathlib import Path

    from click.testing import CliRunner

    from tinkergym.backends.remote import RemoteBackend
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.chat import renderer_for
    from tinkergym.cli import main
    from tinkergym.serve.asgi import ThreadServer
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.app import create_app

    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path / "cache"))
    backend = TorchBackend(TorchBackendConfig(model=tiny_vlm, dtype="float32", lora_rank=4, seed=0))
    token = "vlm-remote-renderer-token-0123456789abcdef"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    server = ThreadServer(create_app(backend, run_dir=tmp_path / "server", token_digest=token_digest(token)))
    try:
        client = RemoteBackend(server.url, token, cache_dir=tmp_path / "tokenizers")
        folder = Path(client.info()["tokenizer"])
        assert (folder / "preprocessor_config.json").is_file() and not (folder / "config.json").exists()
        renderer = renderer_for(str(folder))
        assert isinstance(renderer, ImageChatRenderer)
        config = RolloutConfig(max_new_tokens=4, seed=3, env_workers=1)
        remote = rollout([gym.make("tinker/ColourSquare-v0") for _ in range(2)], client, renderer, config, seeds=[1, 2])
        local = rollout([gym.make("tinker/ColourSquare-v0") for _ in range(2)], backend, ImageChatRenderer.from_folder(tiny_vlm), config, seeds=[1, 2])
        assert [t.tokens for t in remote] == [t.tokens for t in local]
        assert all(t.tokens.count(renderer.image_token_id) == 4 and len(t.images) == 1 for t in remote)

        sampled: list[int] = []
        sample = TorchBackend.sample
        monkeypatch.setattr(TorchBackend, "sample", lambda self, request: (sampled.append(sum(map(len, request.images))), sample(self, request))[1])
        args = ["train", "--env", "tinker/ColourSquare-v0", "--steps", "1", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "3",
                "--backend-url", server.url, "--backend-token-file", str(token_file), "--quiet", "--out", str(tmp_path / "run")]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert sum(sampled) == 4  # one image per episode, 2 prompts x 2 samples
    finally:
        server.stop()
