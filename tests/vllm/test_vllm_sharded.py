"""A sharded job's ranks each with a vLLM engine beside them (``ShardedTorchBackend(rollouts="vllm")``), on CPU ranks
(gloo) started by torchrun: each rank samples its share of a request, the engines' logprobs are the trainer's, after an
update too (the weights reach every engine), and the samples do not depend on the number of ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import testkit  # registered by tests/conftest.py

torch = pytest.importorskip("torch")

PROGRAM = Path(__file__).with_name("sharded_vllm_program.py")
sys.path.insert(0, str(PROGRAM.parent))
import sharded_vllm_program as program  # noqa: E402 - the rank program's prompts, one definition

#: Engine and trainer logprobs of the same token, float32 (as tests/vllm/test_vllm_sampler.py).
TOL = 1e-4


def torchrun(ranks: int, model: str, lora: int, tmp_path: Path) -> dict[str, Any]:
    spec = tmp_path / f"spec-{ranks}-{lora}.json"
    out = tmp_path / f"out-{ranks}-{lora}.pt"
    spec.write_text(json.dumps({"model": model, "lora": lora, "out": str(out)}))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(testkit.free_port()), str(PROGRAM), str(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return torch.load(out)


def tokens(step: dict[str, Any]) -> list[list[int]]:
    return [row[0]["tokens"] for row in step["samples"]["sequences"]]


@pytest.mark.parametrize("lora", [8, 0], ids=["lora", "full"])
def test_each_rank_samples_its_share_on_an_engine_synced_every_step(tiny: str, tiny_untied: str, tmp_path: Path, lora: int) -> None:
    # Full weights on the model with its own output head: the engine takes them from memory, each weight gathered whole
    # from the shards as the engine reads it (the path a GPU takes; tied embeddings on a CPU rebuild the engine instead).
    found = torchrun(2, tiny if lora else tiny_untied, lora, tmp_path)
    assert lora or found["full_sync"] == "memory"
    for step in found["steps"]:
        shares = step["shares"]
        assert all(shares) and sorted(i for share in shares for i in share) == list(range(len(program.PROMPTS)))
        owner = {i: r for r, share in enumerate(shares) for i in share}
        assert all(owner[i] == owner[i ^ 1] for i in owner), "the two copies of a prompt are decoded on one rank"
        for prompt, row, scored in zip(program.PROMPTS, step["samples"]["sequences"], step["scored"]):
            sampled = row[0]
            assert len(sampled["tokens"]) > 0
            assert max(abs(a - b) for a, b in zip(sampled["logprobs"], scored[len(prompt):])) < TOL
    # The update moved the weights far past the tolerance: the second step's agreement is the sync's doing.
    before, after = found["steps"][0]["scored"], found["rescored"]
    assert max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x, y)) > 100 * TOL
    if lora == 8:
        alone = torchrun(1, tiny, lora, tmp_path)
        assert [tokens(step) for step in alone["steps"]] == [tokens(step) for step in found["steps"]], "1 rank and 2 draw the same samples"
