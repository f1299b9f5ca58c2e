"""A sharded job on every GPU torch sees samples data-parallel (tinkergym.backends.torch.sharded_rollouts): each rank its
share of the prompts on a whole copy of the model, the same samples as one process on one device. Skipped where torch
sees no CUDA device; ``TINKERGYM_TEST_DEVICE=cpu`` runs it on two CPU ranks (gloo). This module is also the rank
program torchrun starts (``python test_gpu_sharded_rollouts.py SPEC.json``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

DEVICE = os.environ.get("TINKERGYM_TEST_DEVICE", "cuda")
DEVICE_TYPE = torch.device(DEVICE).type

pytestmark = [pytest.mark.gpu_on_cpu, pytest.mark.skipif(
    DEVICE_TYPE == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); TINKERGYM_TEST_DEVICE=cpu runs it on two CPU ranks",
)]

#: Five groups of three copies of a prompt, seeded: what a GRPO rollout round sends.
PROMPTS = [prompt for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17, 18, 19]) for _ in range(3)]


def request() -> Any:
    from tinkergym.protocol.types import SampleRequest, SamplingParams

    return SampleRequest(PROMPTS, SamplingParams(max_new_tokens=8, seed=41))


def config(model: str, lora: int, device: str) -> Any:
    from tinkergym.backends.torch.backend import TorchBackendConfig

    return TorchBackendConfig(model=model, dtype="float32", lora_rank=lora, seed=5, device=device)


def rank_main(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from tinkergym.backends.torch.sharded import ShardedTorchBackend, init_process_group

    device = f"cuda:{os.environ['LOCAL_RANK']}" if spec["device"] == "cuda" else "cpu"
    init_process_group(device)
    found = {}
    for lora in (8, 0):
        backend = ShardedTorchBackend(config(spec["model"], lora, device), rollouts="split")
        response = backend.sample(request())
        shares: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, backend.last_share)
        found[lora] = {"samples": response.to_dict(), "shares": shares, "rollouts": backend.info()["rollouts"]}
    if importlib.util.find_spec("vllm") is not None and spec["device"] == "cuda":  # a vLLM engine beside each rank
        from tinkergym.backends.vllm.ranks import sharded_with_vllm

        backend = sharded_with_vllm(config(spec["model"], 8, device), max_model_len=128)
        response = backend.sample(request())
        sequences = [prompt + row[0].tokens for prompt, row in zip(PROMPTS, response.sequences)]
        found["vllm"] = {"samples": response.to_dict(), "scored": backend.logprobs(sequences)}
        backend.close()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


RANKS = torch.cuda.device_count() if DEVICE_TYPE == "cuda" else 2


@pytest.fixture(scope="module")
def launched(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One torchrun launch over every device (both kinds of training in it): what rank 0 wrote, by LoRA rank."""
    import testkit  # registered by tests/conftest.py (here, not at the top: torchrun runs this file as the rank program too)

    tmp_path = tmp_path_factory.mktemp("ranks")
    out = tmp_path / "out.json"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": tiny, "device": DEVICE_TYPE, "out": str(out)}))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-addr", "127.0.0.1",
                           "--master-port", str(testkit.free_port()), __file__, str(spec)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("lora", [8, 0], ids=["lora", "full"])
def test_every_device_samples_its_share_as_one_device_would(launched: dict[str, Any], tiny: str, lora: int) -> None:
    from tinkergym.backends.torch.backend import TorchBackend

    found = launched[str(lora)]
    assert found["rollouts"] == "split"
    shares = found["shares"]
    assert sorted(i for share in shares for i in share) == list(range(len(PROMPTS)))
    assert sum(1 for share in shares if share) == min(RANKS, 5), f"every device decodes a share: {shares}"
    alone = TorchBackend(config(tiny, lora, "cuda:0" if DEVICE_TYPE == "cuda" else "cpu")).sample(request()).to_dict()
    for row, other in zip(found["samples"]["sequences"], alone["sequences"]):
        for mine, theirs in zip(row, other):
            assert mine["tokens"] == theirs["tokens"]
            assert mine["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-3)


def test_a_vllm_engine_beside_every_device_samples_the_trainers_distribution(launched: dict[str, Any]) -> None:
    if "vllm" not in launched:
        pytest.skip("needs vLLM on a GPU (pip install 'tinkergym[vllm]'); tests/vllm/test_vllm_sharded.py runs it on CPU ranks")
    found = launched["vllm"]
    for prompt, row, scored in zip(PROMPTS, found["samples"]["sequences"], found["scored"]):
        assert len(row[0]["tokens"]) > 0
        assert row[0]["logprobs"] == pytest.approx(scored[len(prompt):], abs=2e-3)  # two kernels in float32, TF32 off or on


if __name__ == "__main__":
    rank_main(json.loads(Path(sys.argv[1]).read_text()))
