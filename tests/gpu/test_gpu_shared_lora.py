"""One base, many LoRA sessions on a GPU (tinkergym.backends.torch.shared): shared passes in float32 match each
session alone, and in bfloat16 a mixed batch trains, samples with each session's CUDA generator and scores.

Skipped where torch sees no CUDA device; ``TINKERGYM_TEST_DEVICE=cpu`` runs them on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams

DEVICE = os.environ.get("TINKERGYM_TEST_DEVICE", "cuda")
# TINKERGYM_TEST_DEVICE=cpu runs the GPU path on the CPU in make test's gpu-on-cpu lane (the marker gpu_on_cpu).
pytestmark = [pytest.mark.gpu_on_cpu, pytest.mark.skipif(
    torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); TINKERGYM_TEST_DEVICE=cpu runs these tests on the CPU",
)]
RANKS = (4, 8, 16)


def _sessions(tiny: str, dtype: str) -> tuple[SharedBase, list]:
    base = SharedBase(SharedBaseConfig(model=tiny, dtype=dtype, device=DEVICE, micro_batch_size=16))
    sessions = [base.open_session(LoraSessionConfig(lora_rank=r, lora_alpha=2.0 * r, seed=r)) for r in RANKS]
    for session in sessions:  # non-zero adapters, so each row's adapter changes its logits
        gen = torch.Generator().manual_seed(session.config.seed)
        with torch.no_grad():
            for name, param in session.params.items():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return base, sessions


def _requests() -> list[ForwardBackwardRequest]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for k, name in enumerate(("ppo", "cross_entropy", "importance_sampling")):
        prompt = torch.randint(5, 300, (6 + k,), generator=gen).tolist()
        data = []
        for i in range(4):
            completion = torch.randint(5, 300, (3 + i,), generator=gen).tolist()
            n = len(prompt) + len(completion)
            data.append(Datum(tokens=prompt + completion, loss_mask=[0.0] * len(prompt) + [1.0] * len(completion),
                              advantages=[0.5 - 0.3 * i] * n, sampling_logprobs=[-5.0] * n))
        out.append(ForwardBackwardRequest(data=data, loss=LossSpec(name=name, kl_coef=0.1 if k == 2 else 0.0)))
    return out


def _grads(session) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float().cpu() for p in session.params.values()])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_passes_match_each_session_alone(tiny, dtype) -> None:
    mixed_base, mixed = _sessions(tiny, dtype)
    alone_base, alone = _sessions(tiny, dtype)
    requests = _requests()
    outcomes = mixed_base.forward_backward_many(list(zip(mixed, requests)))
    for a, b, request, outcome in zip(mixed, alone, requests, outcomes):
        assert not isinstance(outcome, BaseException), outcome
        b.forward_backward(request)
        ga, gb = _grads(a), _grads(b)
        if dtype == "float32":
            torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)
        else:  # different batch shapes round differently in bfloat16
            assert torch.nn.functional.cosine_similarity(ga, gb, dim=0) > 0.99
        assert a.optim_step(OptimParams(learning_rate=1e-3))["step"] == 1.0
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    requests_s = [SampleRequest(prompts=[[11, 12, 13], [40, 41, 42, 43]], num_samples=2, params=params) for _ in RANKS]
    sampled = mixed_base.sample_many(list(zip(mixed, requests_s)))
    assert all(len(r.sequences) == 2 and all(len(s.tokens) > 0 for row in r.sequences for s in row) for r in sampled)
    if dtype == "float32":  # each session's own generator: the tokens it would draw alone
        for b in alone:
            b.optim_step(OptimParams(learning_rate=1e-3))
        for b, request, response in zip(alone, requests_s, sampled):
            assert [[s.tokens for s in row] for row in b.sample(request).sequences] == [[s.tokens for s in row] for row in response.sequences]
    scores = mixed_base.logprobs_many([(s, ([[11, 12, 13, 14, 15]], 1.0)) for s in mixed])
    assert all(len(rows[0]) == 5 and all(v <= 0 for v in rows[0]) for rows in scores)
