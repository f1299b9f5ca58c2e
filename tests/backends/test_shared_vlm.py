"""LoRA sessions on a shared vision-language base (tinkergym.backends.torch.shared with a tiny Qwen2-VL): a session samples,
scores and trains with images as TorchBackend does with the same adapter, and sessions in one batch keep their own images."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tinkergym.chat import ImageChatRenderer  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402
from tinkergym.protocol.types import (  # noqa: E402
    Datum,
    ForwardBackwardRequest,
    ImageData,
    LossSpec,
    SampleRequest,
    SamplingParams,
)

RANK, ALPHA = 4, 8.0


def _image(seed: int, size: int = 64) -> ImageData:
    return ImageData.from_array(np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8))


def _prompt(renderer: ImageChatRenderer, images: list[ImageData], text: str) -> list[int]:
    arrays = [np.frombuffer(i.pixels(), np.uint8).reshape(i.height, i.width, 3) for i in images]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return renderer.prompt_tokens([{"role": "user", "content": content}], None, images=arrays)


def _perturbed_backend(tiny_vlm: str, seed: int, folder: Any) -> Any:
    """A LoRA TorchBackend on the tiny VLM whose B factors are not zero (so the adapter changes the logprobs), exported to ``folder``."""
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    backend = TorchBackend(TorchBackendConfig(model=tiny_vlm, dtype="float32", lora_rank=RANK, lora_alpha=ALPHA, seed=seed))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    backend.export(str(folder))
    return backend


@pytest.fixture(scope="module")
def pair(tiny_vlm: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """``(backend, base, session)``: a TorchBackend and a session on a shared base holding the same adapter."""
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig

    folder = tmp_path_factory.mktemp("vlm-adapter")
    backend = _perturbed_backend(tiny_vlm, 3, folder)
    base = SharedBase(SharedBaseConfig(model=tiny_vlm, dtype="float32", micro_batch_size=4))
    session = base.open_session(LoraSessionConfig(lora_rank=RANK, lora_alpha=ALPHA))
    session.load_adapter(str(folder))
    return backend, base, session


def test_a_session_on_a_vlm_base_adapts_the_language_model_only(pair: tuple[Any, Any, Any]) -> None:
    _, base, session = pair
    assert base.vision is not None and base.info()["reads_images"] and base.attn_implementation == "sdpa"
    assert base.layers and all(".language_model." in f".{name}." for name in base.layers)
    assert not any("visual" in name for name in base.layers)
    assert set(session.params) == {n.replace(".default", "") for n, _ in pair[0]._trainable}  # the layers TorchBackend's adapter has


def test_a_session_samples_scores_and_trains_with_images_as_torch_backend(pair: tuple[Any, Any, Any], tiny_vlm: str) -> None:
    backend, _, session = pair
    renderer = ImageChatRenderer.from_folder(tiny_vlm)
    images = [[_image(1)], [], [_image(2, 80), _image(3)]]
    prompts = [_prompt(renderer, row, f"Describe {i}.") for i, row in enumerate(images)]
    request = SampleRequest(prompts=prompts, images=images, num_samples=2, params=SamplingParams(max_new_tokens=6, temperature=1.0, seed=7))
    ours, theirs = session.sample(request), backend.sample(request)
    image_id = renderer.image_token_id
    for mine, other in zip(ours.sequences, theirs.sequences):
        assert [s.tokens for s in mine] == [s.tokens for s in other]
        assert np.allclose([lp for s in mine for lp in s.logprobs], [lp for s in other for lp in s.logprobs], atol=1e-5)
        assert all(image_id not in s.tokens for s in mine)  # image tokens are never sampled
    # Training on the samples: the same loss and logprobs, and the sampler's logprobs are the trainer's.
    data = [Datum(tokens=p + s.tokens, loss_mask=[0.0] * len(p) + [1.0] * len(s.tokens), images=row,
                  sampling_logprobs=[0.0] * len(p) + s.logprobs) for p, row, seqs in zip(prompts, images, ours.sequences) for s in seqs]
    fb = ForwardBackwardRequest(data=data, loss=LossSpec(name="cross_entropy"), return_logprobs=True)
    mine_result = session.forward_backward(fb)
    other_result = backend.forward_backward(fb)
    backend.optimizer.zero_grad(set_to_none=True)
    grads = {n: p.grad.clone() for n, p in session.params.items()}
    session.optimizer.zero_grad(set_to_none=True)
    assert abs(mine_result.metrics["loss"] - other_result.metrics["loss"]) < 1e-5, (mine_result.metrics, other_result.metrics)
    assert mine_result.metrics["mismatch/logp_abs_max"] < 1e-5
    assert any(g.abs().max() > 0 for g in grads.values())
    for d, mine_row, other_row in zip(data, mine_result.logprobs, other_result.logprobs):
        assert np.allclose([a for a, m in zip(mine_row, d.loss_mask) if m], [b for b, m in zip(other_row, d.loss_mask) if m], atol=1e-5)
    # Scoring with images equals the training pass's logprobs; without its images, a row with image tokens is refused.
    scored = session.logprobs([d.tokens for d in data], 1.0, [d.images for d in data])
    for d, row, trained in zip(data, scored, mine_result.logprobs):
        assert np.allclose([a for a, m in zip(row, d.loss_mask) if m], [b for b, m in zip(trained, d.loss_mask) if m], atol=1e-5)
    with pytest.raises(ConfigError, match="image tokens"):
        session.logprobs([data[0].tokens])
    # Another image of the same size (the same tokens) gives other logprobs.
    swapped = session.logprobs([data[0].tokens], 1.0, [[_image(9)]])
    moved = max(abs(a - b) for a, b, m in zip(swapped[0], scored[0], data[0].loss_mask) if m)
    assert moved > 1e-4, moved


def test_sessions_in_one_batch_keep_their_own_images(pair: tuple[Any, Any, Any], tiny_vlm: str, tmp_path: Any) -> None:
    from tinkergym.backends.torch.shared import LoraSessionConfig

    _, base, first = pair
    _perturbed_backend(tiny_vlm, 5, tmp_path / "other")
    second = base.open_session(LoraSessionConfig(lora_rank=RANK, lora_alpha=ALPHA))
    try:
        second.load_adapter(str(tmp_path / "other"))
        renderer = ImageChatRenderer.from_folder(tiny_vlm)
        rows = {first: [[_image(11)], [_image(12)]], second: [[_image(13)], []]}
        samples = {s: SampleRequest(prompts=[_prompt(renderer, r, "What is it?") for r in row], images=row, num_samples=2,
                                    params=SamplingParams(max_new_tokens=5, temperature=1.0, seed=s.id)) for s, row in rows.items()}
        alone = {s: s.sample(r) for s, r in samples.items()}
        together = base.sample_many(list(samples.items()))
        for (s, _), response in zip(samples.items(), together):
            assert response == alone[s]
        trains = {s: ForwardBackwardRequest(data=[Datum(tokens=p + seq.tokens, loss_mask=[0.0] * len(p) + [1.0] * len(seq.tokens), images=img)
                                                  for p, img, seqs in zip(r.prompts, r.images, alone[s].sequences) for seq in seqs],
                                            loss=LossSpec(name="cross_entropy"), return_logprobs=True) for s, r in samples.items()}
        solo = {}
        for s, request in trains.items():
            solo[s] = (s.forward_backward(request), {n: p.grad.clone() for n, p in s.params.items()})
            s.optimizer.zero_grad(set_to_none=True)
        joint = base.forward_backward_many(list(trains.items()))
        for (s, _), result in zip(trains.items(), joint):
            assert abs(result.metrics["loss"] - solo[s][0].metrics["loss"]) < 1e-5
            for a, b in zip(result.logprobs, solo[s][0].logprobs):
                assert np.allclose(a, b, atol=1e-5)
            for n, p in s.params.items():
                assert torch.allclose(p.grad, solo[s][1][n], atol=1e-6), n
            s.optimizer.zero_grad(set_to_none=True)
        scored = base.logprobs_many([(s, ([d.tokens for d in r.data], 1.0, [d.images for d in r.data])) for s, r in trains.items()])
        for (s, request), rows_scored in zip(trains.items(), scored):
            for d, a, b in zip(request.data, rows_scored, solo[s][0].logprobs):
                assert np.allclose([x for x, m in zip(a, d.loss_mask) if m], [y for y, m in zip(b, d.loss_mask) if m], atol=1e-5)
    finally:
        base.close_session(second)


def test_a_text_base_still_refuses_images(tiny: str) -> None:
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig

    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    session = base.open_session()
    with pytest.raises(ConfigError, match="reads no images"):
        session.sample(SampleRequest(prompts=[[1, 2]], images=[[_image(0)]]))
    with pytest.raises(ConfigError, match="reads no images"):
        session.forward_backward(ForwardBackwardRequest(data=[Datum([1, 2], [0.0, 1.0], images=[_image(0)])], loss=LossSpec(name="cross_entropy")))
    with pytest.raises(ConfigError, match="reads no images"):
        session.logprobs([[1, 2]], 1.0, [[_image(0)]])


def test_images_travel_to_a_shared_server_and_back(pair: tuple[Any, Any, Any], tiny_vlm: str, tmp_path: Any) -> None:
    """``serve shared`` on the tiny VLM: an adapter reached over HTTP (RemoteBackend) samples and trains with images as a
    session of the same seed does in process."""
    pytest.importorskip("fastapi")
    import httpx

    from testkit import serving
    from tinkergym.backends.remote import RemoteBackend
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.shared import create_shared_app

    admin = "a" * 40
    served = SharedBase(SharedBaseConfig(model=tiny_vlm, dtype="float32", micro_batch_size=4))
    reference = pair[1].open_session(LoraSessionConfig(lora_rank=RANK, lora_alpha=ALPHA, seed=21))
    try:
        with serving(create_shared_app(served, run_dir=tmp_path, token_digest=token_digest(admin))) as url:
            token = httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {admin}"},
                               json={"lora_rank": RANK, "lora_alpha": ALPHA, "seed": 21}).json()["token"]
            remote = RemoteBackend(url, token)
            renderer = ImageChatRenderer.from_folder(tiny_vlm)
            images = [[_image(31)], [_image(32, 72)]]
            request = SampleRequest(prompts=[_prompt(renderer, row, "Which?") for row in images], images=images, num_samples=2,
                                    params=SamplingParams(max_new_tokens=5, temperature=1.0, seed=4))
            response = remote.sample(request)
            solo = reference.sample(request)
            assert [[s.tokens for s in row] for row in response.sequences] == [[s.tokens for s in row] for row in solo.sequences]
            data = [Datum(tokens=p + s.tokens, loss_mask=[0.0] * len(p) + [1.0] * len(s.tokens), images=row,
                          sampling_logprobs=[0.0] * len(p) + s.logprobs) for p, row, seqs in zip(request.prompts, images, response.sequences) for s in seqs]
            fb = ForwardBackwardRequest(data=data, loss=LossSpec(name="cross_entropy"))
            metrics = remote.forward_backward(fb).metrics
            assert metrics["mismatch/logp_abs_max"] < 1e-5  # the server's sampler logprobs are its trainer's
            assert metrics["loss"] == pytest.approx(reference.forward_backward(fb).metrics["loss"], abs=1e-5)
    finally:
        pair[1].close_session(reference)
