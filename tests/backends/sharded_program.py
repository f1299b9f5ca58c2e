"""The rank program of test_sharded.py, started by ``torchrun`` (``python -m torch.distributed.run``): every rank builds a
ShardedTorchBackend and runs the same calls; rank 0 writes what the test compares.

``python -m torch.distributed.run --nproc-per-node N sharded_program.py SPECS.json`` where each spec of the list (one
run, the runs one after another in the same process group, each on a backend of its own) names the model, the LoRA
rank, a state folder to load first (``load``) and one to save after the first step (``save``), the steps and the seed of
the first one's batch (``start``), whether the model is a vision-language model whose batches carry images (``vlm``),
and the file rank 0 writes (``out``): the first step's loss and gradients, the weights after every step, gathered
whole, and what sampling gave after the steps (split across the ranks, the prompts each rank decoded, and in lockstep).
Several runs in one launch start the ranks (torch, transformers) once.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from tinkergym.backends.torch.backend import TorchBackendConfig
from tinkergym.backends.torch.sharded import ShardedTorchBackend, init_process_group
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, ImageData, LossSpec, OptimParams, SampleRequest, SamplingParams


def batch(seed: int) -> ForwardBackwardRequest:
    """Three groups of three rows that share a prompt: importance sampling with advantages -1, 0, 1."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for group in range(3):
        prompt = torch.randint(5, 60, (4 + group,), generator=g).tolist()
        for k in range(3):
            completion = torch.randint(5, 60, (2 + k,), generator=g).tolist()
            tokens = prompt + completion
            data.append(Datum(tokens=tokens, loss_mask=[0.0] * len(prompt) + [1.0] * len(completion),
                              advantages=[0.0] * len(prompt) + [float(k - 1)] * len(completion), sampling_logprobs=[-1.0] * len(tokens)))
    return ForwardBackwardRequest(data, LossSpec("importance_sampling"))


def vlm_batch(model: str, seed: int) -> ForwardBackwardRequest:
    """A group of three rows that share a prompt with an image, then a group of three text rows of the same lengths: two
    ranks split them into image rows on rank 0 and text rows on rank 1, so only rank 0 runs the vision tower."""
    prompt, image = vlm_prompt(model, seed)
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(5, 60, (len(prompt),), generator=g).tolist()
    data = []
    for shared, images in ((prompt, [image]), (text, [])):
        for k in range(3):
            completion = torch.randint(5, 60, (2 + k,), generator=g).tolist()
            tokens = shared + completion
            data.append(Datum(tokens=tokens, loss_mask=[0.0] * len(shared) + [1.0] * len(completion), images=list(images),
                              advantages=[0.0] * len(shared) + [float(k - 1)] * len(completion), sampling_logprobs=[-1.0] * len(tokens)))
    return ForwardBackwardRequest(data, LossSpec("importance_sampling"))


def vlm_prompt(model: str, seed: int) -> tuple[list[int], ImageData]:
    """A chat prompt showing one random 32x32 image (drawn from ``seed``), and the image."""
    import numpy as np

    from tinkergym.chat import ImageChatRenderer

    array = np.random.default_rng(seed).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    renderer = ImageChatRenderer.from_folder(model)
    prompt = renderer.prompt_tokens([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}], None, images=[array])
    return prompt, ImageData.from_array(array)


def batches(spec: dict) -> Callable[[int], ForwardBackwardRequest]:
    return (lambda seed: vlm_batch(spec["model"], seed)) if spec.get("vlm") else batch


def samples(spec: dict) -> list[SampleRequest]:
    """:data:`SAMPLES`, and on a vision-language model one prompt with its image (every rank runs the vision tower)."""
    if not spec.get("vlm"):
        return SAMPLES
    prompt, image = vlm_prompt(spec["model"], 99)
    return [*SAMPLES, SampleRequest([prompt], SamplingParams(max_new_tokens=4, seed=5), num_samples=2, images=[[image]])]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def config(spec: dict) -> TorchBackendConfig:
    return TorchBackendConfig(model=spec["model"], dtype=spec.get("dtype", "float32"), lora_rank=spec["lora"], seed=3, micro_batch_size=2)


OPTIM = OptimParams(learning_rate=1e-3)
#: Sampled after the steps, with a seed and without (every rank samples the same: SPMD).
SAMPLES = [SampleRequest([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, seed=11), num_samples=2),
           SampleRequest([[5, 6, 7]], SamplingParams(max_new_tokens=6), num_samples=3)]
#: A rollout round as a GRPO trainer sends it: four groups of three copies of a prompt, seeded; the ranks split it.
ROLLOUT = SampleRequest([prompt for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [14]) for _ in range(3)],
                        SamplingParams(max_new_tokens=5, seed=23))


def broken(*args: object, **kwargs: object) -> None:
    raise RuntimeError("decode broke")


def main() -> None:
    specs = json.loads(open(sys.argv[1]).read())
    init_process_group("cpu", timeout_s=120)
    for spec in specs:
        run(spec)
        gc.collect()
    dist.destroy_process_group()


def run(spec: dict) -> None:
    backend = ShardedTorchBackend(config(spec))
    if spec.get("load"):
        backend.load_state(spec["load"])
    # What this rank holds of the weights at rest: its shards, and what every rank keeps whole (the adapter; a VLM's
    # vision side). Read before any pass: the root module stays gathered after its forward.
    found: dict = {"steps": [], "held_bytes": sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in backend.model.parameters())}
    found["first_sample"] = backend.sample(SAMPLES[0]).to_dict()  # sampling before training, too
    for step in range(spec["steps"]):
        result = backend.forward_backward(batches(spec)(spec.get("start", 0) + step))
        if step == 0:
            found["loss"] = result.metrics["loss"]
            found["grads"] = {n: whole(p.grad) for n, p in backend._trainable}
        metrics = backend.optim_step(OPTIM)
        found["steps"].append({"grad_norm": metrics["grad_norm"], "weights": {n: whole(p) for n, p in backend._trainable}})
        if step == 0 and spec.get("save"):
            backend.save_state(spec["save"])
    found["samples"] = [backend.sample(request).to_dict() for request in samples(spec)]
    found["rollout"] = backend.sample(ROLLOUT).to_dict()
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, backend.last_share)  # the prompts each rank decoded
    found["shares"] = shares
    mode, backend.rollouts = backend.rollouts, "lockstep"  # the same seeded requests, every rank decoding all of each
    found["lockstep_samples"] = [backend.sample(request).to_dict() for request in samples(spec) if request.params.seed is not None]
    backend.rollouts = mode
    # A share that breaks on the last rank fails the call on every rank (none waits for it), naming the rank; the next call
    # works. (Rank 0 must hear of it too: it is the one that answers a server's client.)
    if dist.get_rank() == dist.get_world_size() - 1:
        backend._sample = broken  # type: ignore[method-assign]
    try:
        backend.sample(ROLLOUT)
        found["failed"] = None
    except RuntimeError as exc:
        found["failed"] = str(exc)
    backend.__dict__.pop("_sample", None)
    found["after_failure"] = backend.sample(ROLLOUT).to_dict()
    if spec.get("export"):
        backend.export(spec["export"])
    found["logprobs"] = backend.logprobs([[5, 6, 7, 8, 9], [1, 2, 3]], 1.0)
    if dist.get_rank() == 0:
        torch.save(found, spec["out"])
    dist.barrier()


if __name__ == "__main__":
    main()
