"""Shared prompts are computed once (sampling and training) and give the results of computing every copy."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tinkergym.backends.models import build_tiny_model  # noqa: E402
from tinkergym.backends.torch_backend import TorchBackend, TorchBackendConfig  # noqa: E402
from tinkergym.backends.torch_scoring import MicroBatch, plan_micro_batches  # noqa: E402
from tinkergym.backends.types import Datum, ForwardBackwardRequest, LossSpec, SampleRequest, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def make_backend(tiny: str, share: bool, lora_rank: int = 4, micro_batch_size: int = 8) -> TorchBackend:
    config = TorchBackendConfig(model=tiny, lora_rank=lora_rank, dtype="float32", seed=0, share_prefixes=share, micro_batch_size=micro_batch_size)
    return TorchBackend(config)


def datum(prompt: list[int], completion: list[int], advantage: float, shift: float) -> Datum:
    tokens = prompt + completion
    return Datum(
        tokens=tokens,
        loss_mask=[0.0] * len(prompt) + [1.0] * len(completion),
        advantages=[advantage] * len(tokens),
        sampling_logprobs=[-2.0 + shift * ((-1) ** t) for t in range(len(tokens))],
    )


def grpo_like_batch() -> list[Datum]:
    """Two groups of samples on two prompts (completions of different lengths), plus one lone sequence."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=gen).tolist()

    prompts = [ids(9), ids(6)]
    data = []
    for g, prompt in enumerate(prompts):
        for k in range(3 + g):
            data.append(datum(prompt, ids(2 + (k * 3) % 5), advantage=(-1.0) ** k * (0.5 + k), shift=0.1 * k))
    data.insert(2, datum(ids(4), ids(5), advantage=1.5, shift=0.2))
    return data


def test_plan_groups_shared_prompts_and_keeps_the_rest_in_order() -> None:
    a, b = [1, 2, 3], [4, 5]
    data = [datum(a, [7], 1, 0), datum(b, [8], 1, 0), datum(a, [9, 9], 1, 0), datum([6], [1], 1, 0), datum(a, [5], 1, 0)]
    data.append(Datum(tokens=[1, 2], loss_mask=[0.0, 0.0]))  # no loss: never grouped
    # Budget 2 x 5 tokens: group a costs its prompt once (2 tokens before the last) + 2, 3 and 2 of its own.
    plan = plan_micro_batches(data, micro_batch_size=2)
    assert plan == [MicroBatch([0, 2, 4], [3], [3]), MicroBatch([1, 3]), MicroBatch([5])]
    assert plan_micro_batches(data, micro_batch_size=8, share_prefixes=False) == [MicroBatch([0, 1, 2, 3, 4, 5])]
    assert sorted(i for m in plan for i in m.indices) == list(range(len(data)))


def test_plan_packs_groups_up_to_the_token_budget() -> None:
    a, b = [1, 2, 3, 4], [5, 6]
    data = [datum(a, [7, 7], 1, 0), datum(a, [8], 1, 0), datum(b, [9, 9, 9], 1, 0), datum(b, [9], 1, 0)]
    # Longest sequence 6 tokens. Costs: a = 3 + 3 + 2 = 8, b = 1 + 4 + 2 = 7.
    assert plan_micro_batches(data, micro_batch_size=3) == [MicroBatch([0, 1, 2, 3], [2, 2], [4, 2])]
    assert plan_micro_batches(data, micro_batch_size=2) == [MicroBatch([0, 1], [2], [4]), MicroBatch([2, 3], [2], [2])]
    # A budget below one group splits it; each part carries the prompt again.
    assert plan_micro_batches(data, micro_batch_size=1) == [MicroBatch([0], [1], [4]), MicroBatch([1], [1], [4]), MicroBatch([2], [1], [2]), MicroBatch([3], [1], [2])]


@pytest.mark.parametrize(("lora_rank", "micro_batch_size"), [(4, 1), (4, 3), (0, 3), (0, 8)])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_shared_prefix_gradients_equal_per_sequence_gradients(tiny: str, lora_rank: int, micro_batch_size: int, aggregation: str) -> None:
    spec = LossSpec(name="ppo", clip_low=0.1, clip_high=0.3, kl_coef=0.1, aggregation=aggregation)
    results = {}
    for share in (True, False):
        backend = make_backend(tiny, share, lora_rank=lora_rank, micro_batch_size=micro_batch_size)
        if lora_rank:  # a non-zero adapter, so the KL term and the adapter's gradient path are both exercised
            with torch.no_grad():
                for name, param in backend.model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
        metrics = backend.forward_backward(ForwardBackwardRequest(data=grpo_like_batch(), loss=spec)).metrics
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad and p.grad is not None}
        results[share] = (metrics, grads)
    (shared_metrics, shared_grads), (plain_metrics, plain_grads) = results[True], results[False]
    assert shared_metrics == pytest.approx(plain_metrics, rel=1e-5, abs=1e-6)
    assert lora_rank == 0 or shared_metrics["kl"] > 0
    assert shared_grads.keys() == plain_grads.keys() and shared_grads
    for name in plain_grads:
        assert torch.allclose(shared_grads[name], plain_grads[name], atol=1e-6, rtol=1e-4), name


def test_sampling_shared_prompts_matches_sampling_each_copy(tiny: str) -> None:
    prompts = [[3, 17, 40, 9], [3, 17, 40, 9], [8, 8], [3, 17, 40, 9]]
    params = SamplingParams(max_new_tokens=10, seed=7)
    out = {}
    for share in (True, False):
        backend = make_backend(tiny, share)
        out[share] = backend.sample(SampleRequest(prompts=prompts, params=params, num_samples=2)).sequences
    for shared_row, plain_row, prompt in zip(out[True], out[False], prompts):
        for shared, plain in zip(shared_row, plain_row):
            assert shared.tokens == plain.tokens
            assert shared.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
            scored = backend.logprobs([prompt + shared.tokens])[0][len(prompt) :]
            assert shared.logprobs == pytest.approx(scored, abs=1e-4)
