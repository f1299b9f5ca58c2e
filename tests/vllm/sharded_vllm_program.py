"""The rank program of test_vllm_sharded.py, started by ``torchrun``: a ShardedTorchBackend whose ranks each sample their
share of a request on a vLLM engine beside them (``sharded_with_vllm``), train on the samples and sample again.

``python -m torch.distributed.run --nproc-per-node N sharded_vllm_program.py SPEC.json``: the spec names the model, the
LoRA rank (0: full fine-tuning) and the file rank 0 writes: for each of two steps, the samples, the prompts each rank
decoded, and the trainer's own logprobs of the sampled tokens (before the step's update, as the engine sampled them),
and after the last update the trainer's logprobs of the first step's samples again.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tinkergym.backends.torch.backend import TorchBackendConfig
from tinkergym.backends.torch.sharded import init_process_group
from tinkergym.backends.vllm.ranks import sharded_with_vllm
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams

#: A rollout round: four groups of two copies of a prompt, seeded (the ranks split it by groups).
PROMPTS = [prompt for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [14]) for _ in range(2)]


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    init_process_group("cpu", timeout_s=300)
    backend = sharded_with_vllm(TorchBackendConfig(model=spec["model"], dtype="float32", lora_rank=spec["lora"], seed=3, micro_batch_size=4),
                                max_model_len=256)
    found: dict = {"steps": []}
    for step in range(2):
        response = backend.sample(SampleRequest(PROMPTS, SamplingParams(max_new_tokens=6, seed=31 + step)))
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, backend.last_share)
        sequences = [prompt + row[0].tokens for prompt, row in zip(PROMPTS, response.sequences)]
        found["steps"].append({"samples": response.to_dict(), "shares": shares, "scored": backend.logprobs(sequences)})
        data = [Datum(tokens=tokens, loss_mask=[0.0] * len(prompt) + [1.0] * (len(tokens) - len(prompt)),
                      advantages=[0.0] * len(prompt) + [1.0 if i % 2 else -1.0] * (len(tokens) - len(prompt)),
                      sampling_logprobs=[0.0] * len(prompt) + row[0].logprobs)
                for i, (prompt, tokens, row) in enumerate(zip(PROMPTS, sequences, response.sequences))]
        backend.forward_backward(ForwardBackwardRequest(data, LossSpec("importance_sampling")))
        backend.optim_step(OptimParams(learning_rate=1e-2))
    first = found["steps"][0]["samples"]["sequences"]
    found["rescored"] = backend.logprobs([prompt + row[0]["tokens"] for prompt, row in zip(PROMPTS, first)])
    found["full_sync"] = backend._engine.sampler.full_sync  # how the engine took full weights: from memory, or from files
    if dist.get_rank() == 0:
        torch.save(found, spec["out"])
    backend.close()
    dist.barrier()


if __name__ == "__main__":
    main()
