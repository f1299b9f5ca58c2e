"""Training on vLLM samples: the ratio of an unchanged policy stays within the logged sampler/trainer mismatch.

vLLM samples at the rollout temperature and reports the logprobs of that distribution; the training loss
scores the same tempered distribution, so before any update every token's ratio is within the mismatch that
``forward_backward`` measures and logs (``mismatch/*``), which in float32 is kernel rounding (about 1e-5).
"""

from __future__ import annotations

import math

import pytest

from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, SampleRequest, SamplingParams
from tinkergym.backends.vllm.sampler import VLLMBackend

LORA_RANK = 8


@pytest.fixture(scope="module")
def backend(tiny: str, kit):
    backend = VLLMBackend(kit.backend(tiny, lora_rank=LORA_RANK), dtype="float32", max_model_len=256)
    yield backend
    backend.close()


def vllm_batch(backend: VLLMBackend, kit, temperature: float) -> list[Datum]:
    prompts = [kit.encode(backend, "Hello there"), kit.encode(backend, "The quick brown fox jumps over"), kit.prompt(backend)]
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5)
    response = backend.sample(SampleRequest(prompts=prompts, params=params, num_samples=4))
    data = []
    for prompt, row in zip(prompts, response.sequences):
        for k, sequence in enumerate(row):
            mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
            data.append(Datum(tokens=prompt + sequence.tokens, loss_mask=mask, advantages=[(-1.0) ** k * m for m in mask],
                              sampling_logprobs=[0.0] * len(prompt) + sequence.logprobs))
    return data


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_ratio_stays_within_the_logged_mismatch(backend: VLLMBackend, kit, temperature: float) -> None:
    data = vllm_batch(backend, kit, temperature)
    spec = LossSpec(name="ppo", temperature=temperature)
    metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
    worst = metrics["mismatch/logp_abs_max"]
    assert worst < 1e-3 and metrics["mismatch/logp_abs_mean"] <= worst and metrics["mismatch/kl"] >= 0
    assert math.exp(-worst) - 1e-6 <= metrics["ratio_mean"] <= math.exp(worst) + 1e-6
    assert metrics["clip_fraction"] == 0.0
    # Scoring untempered logits would put the ratio far outside it.
    untempered = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo"))).metrics
    assert untempered["mismatch/logp_abs_max"] > 0.05
    # Trainer old logprobs start the ratio at exactly 1; the truncated weights are the measured mismatch.
    corrected = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(temperature=temperature, old_logprobs="trainer", tis_cap=2.0))).metrics
    assert corrected["ratio_mean"] == pytest.approx(1.0, abs=1e-7)
    assert abs(corrected["tis/weight_mean"] - 1.0) <= math.exp(worst) - 1 + 1e-6
    backend.backend.model.zero_grad(set_to_none=True)
