"""The Tinker front door (`serve tinker --scheduler`) on a vision-language model: a real scheduler, a worker process whose
shared server holds the tiny Qwen2-VL (offered by a hub id found in the local Hugging Face cache), and the official SDK.
A LoRA run's cross-entropy loss on a datum with an image falls; a sampler of its weights scores its own samples with the
image as it sampled them, another image changes them; bad image bytes are a 400 and the front door goes on serving."""

from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")

from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.scheduler.db import make_engine  # noqa: E402
from tinkergym.serve.asgi import ThreadServer  # noqa: E402
from workerkit import shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

MODEL = "local/tiny-vlm"
STEPS = 4


def _png(seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _hub_cache(folder: str, root: Path) -> Path:
    """A Hugging Face cache under ``root`` holding ``folder`` as the snapshot of :data:`MODEL`."""
    repo = root / ("models--" + MODEL.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(folder, repo / "snapshots" / ("0" * 40))
    return root


class Prompt:
    """A chat prompt with one image as the SDK's chunks (text, image, text), and an SFT datum answering it."""

    def __init__(self, folder: str) -> None:
        from tinkergym.chat import ImageChatRenderer

        renderer = ImageChatRenderer.from_folder(folder)
        self.image_id = renderer.image_token_id
        tokens = renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}], None,
                                        images=[np.zeros((64, 64, 3), np.uint8)])
        first = tokens.index(self.image_id)
        self.count = tokens.count(self.image_id)
        self.before, self.after = tokens[:first], tokens[first + self.count:]
        self.length = len(tokens)
        self.answer = renderer.tokenizer.encode("red", add_special_tokens=False) + [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def chunks(self, png: bytes, after: list[int] | None = None) -> Any:
        from tinker import types

        return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=self.before), types.ImageChunk(data=png, format="png", expected_tokens=self.count),
                                        types.EncodedTextChunk(tokens=self.after + (after or []))])

    def datum(self, png: bytes) -> Any:
        from tinker import types

        full = self.before + [0] * self.count + self.after + self.answer  # 0 as an image position's target, as the cookbook writes
        weights = [0.0] * (self.length - 1) + [1.0] * len(self.answer)
        return types.Datum(model_input=self.chunks(png, self.answer[:-1]), loss_fn_inputs={"target_tokens": full[1:], "weights": weights})


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_image_chunks_train_sample_and_score_through_the_front_door(db_url: str, keys: Any, tiny_vlm: str, tmp_path: Path) -> None:
    from tinker import types

    from tinkergym.tinker_api.server import create_front_door

    hub = _hub_cache(tiny_vlm, tmp_path / "hub")
    alice, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    engine = make_engine(db_url)
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2,
                                                          idle_timeout_s=120.0)))
    door = ThreadServer(create_front_door(scheduler.url, {MODEL: tiny_vlm}, tmp_path / "door", engine, logging.getLogger("front-door-vlm"),
                                          dtype="float32", checkpoint_every=0))
    worker = shared_worker(scheduler.url, worker_key, tmp_path / "w1", tmp_path / "cache", seats=2, model=MODEL,
                           env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    prompt, red, other = Prompt(tiny_vlm), _png(1), _png(2)
    try:
        with tinker.ServiceClient(base_url=door.url, api_key="tml-" + alice) as service:
            training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
            losses = []
            for _ in range(STEPS):
                fb = training.forward_backward([prompt.datum(red)], "cross_entropy")
                training.optim_step(types.AdamParams(learning_rate=2e-2))
                losses.append(fb.result().metrics["loss:sum"])
            with pytest.raises(tinker.BadRequestError, match="not a readable PNG"):
                training.forward_backward([prompt.datum(b"\x89PNG\r\n\x1a\nnot-really-a-png")], "cross_entropy").result()
            sampler = training.save_weights_and_get_sampling_client().result()
            drawn = sampler.sample(prompt.chunks(red), 2, types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)).result()
            scored = [sampler.compute_logprobs(prompt.chunks(red, s.tokens)).result() for s in drawn.sequences]
            moved = sampler.compute_logprobs(prompt.chunks(other, drawn.sequences[0].tokens)).result()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        door.stop()
        scheduler.stop()
        engine.dispose()
    print("losses", losses)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.7 * losses[0], losses
    for seq, lp in zip(drawn.sequences, scored):
        assert seq.tokens and prompt.image_id not in seq.tokens  # image tokens are never sampled
        assert len(lp) == prompt.length + len(seq.tokens) and lp[0] is None
        np.testing.assert_allclose(lp[prompt.length:], seq.logprobs, atol=1e-4)  # the sampler's logprobs, with the image
    gap = max(abs(a - b) for a, b in zip(moved[prompt.length:], scored[0][prompt.length:]))
    print("another image moves the logprobs by", gap)
    assert gap > 1e-3
