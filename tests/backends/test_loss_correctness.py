"""The training loss scores what was sampled: temperature, masked numerics, batch normalizers, sampler corrections."""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch

from tinkergym.backends.torch import losses
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, SampleRequest, SamplingParams
from tinkergym.errors import ConfigError


# ----- token logprobs (the fused log-softmax) ------------------------------------------------------
def test_token_logprobs_by_hand() -> None:
    logits = torch.tensor([[[0.0, 0.0], [1.0, 3.0], [2.0, 2.0]]])
    tokens = torch.tensor([[1, 1, 0]])
    expected = [0.0, -math.log(2.0), -2.0 - math.log(1.0 + math.exp(-2.0))]  # rows [0, 0] and [1, 3] predict ids 1 and 0
    assert losses.token_logprobs(logits, tokens)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_token_logprobs_low_precision_chunks_match_and_backprop() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=gen).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 11, (2, 7), generator=gen)
    reference = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    chunked = losses.token_logprobs(logits, tokens, chunk_size=3)
    assert chunked.dtype == torch.float32 and chunked.shape == (2, 7)
    assert torch.allclose(chunked[:, 1:], reference, atol=1e-6)
    chunked.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1024, 4])
def test_token_logprobs_gradient_matches_log_softmax(temperature: float, chunk_size: int) -> None:
    # The fused logprob's hand-written backward against autograd through a plain float32 log-softmax.
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 13, generator=gen, dtype=torch.float32) * 3
    tokens = torch.randint(0, 13, (3, 5), generator=gen)
    weights = torch.randn(3, 4, generator=gen)
    ours = logits.clone().requires_grad_(True)
    fused = losses.token_logprobs(ours, tokens, chunk_size=chunk_size, temperature=temperature)
    (fused[:, 1:] * weights).sum().backward()
    plain = logits.clone().requires_grad_(True)
    reference = torch.log_softmax(plain / temperature, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    (reference * weights).sum().backward()
    assert torch.allclose(fused[:, 1:], reference, atol=1e-6)
    assert torch.allclose(ours.grad, plain.grad, atol=1e-6)
    low = logits.to(torch.bfloat16).requires_grad_(True)  # the gradient comes back in the logits' dtype
    (losses.token_logprobs(low, tokens, chunk_size=chunk_size, temperature=temperature)[:, 1:] * weights).sum().backward()
    assert low.grad.dtype == torch.bfloat16 and torch.allclose(low.grad.float(), plain.grad, atol=2e-2)


def test_cpu_logprob_chunks_fit_a_cache_and_change_no_result() -> None:
    """On a CPU the default chunk is a few MiB of float32 rows (16 of a 49K vocabulary); results and gradients are those of 1,024-row chunks, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 40, 49152, generator=gen) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 49152, (2, 40), generator=gen)
    assert losses.chunk_rows(logits.view(-1, 49152), None) == 16 and losses.chunk_rows(logits, 7) == 7
    assert losses.chunk_rows(torch.empty(4, 49152, device="meta"), None) == losses.CHUNK_ROWS == 1024
    results = []
    for chunk_size in (None, 1024):
        ours = logits.clone().requires_grad_(True)
        scored = losses.token_logprobs(ours, tokens, chunk_size=chunk_size, temperature=0.7)
        scored.sum().backward()
        results.append((scored.detach(), ours.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def make_backend(tiny: str, lora_rank: int = 4, dtype: str = "float32") -> TorchBackend:
    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=lora_rank, dtype=dtype, seed=0))
    if lora_rank:  # a non-zero adapter, so the adapter's path changes the logits
        with torch.no_grad():
            for name, param in backend.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    return backend


def sampled_batch(backend: TorchBackend, temperature: float, prompts: int = 3, samples: int = 4, new_tokens: int = 12) -> list[Datum]:
    """Data sampled from ``backend`` itself at ``temperature``, with made-up advantages of both signs."""
    gen = torch.Generator().manual_seed(3)
    vocab = backend.model.config.vocab_size
    prompt_ids = [torch.randint(5, vocab, (5 + 3 * i,), generator=gen).tolist() for i in range(prompts)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=11, stop_token_ids=[vocab + 1])
    response = backend.sample(SampleRequest(prompts=prompt_ids, params=params, num_samples=samples))
    data = []
    for prompt, row in zip(prompt_ids, response.sequences):
        for k, sequence in enumerate(row):
            tokens = prompt + sequence.tokens
            mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
            advantage = (-1.0) ** k * (0.5 + k)
            data.append(Datum(tokens=tokens, loss_mask=mask, advantages=[advantage * m for m in mask],
                              sampling_logprobs=[0.0] * len(prompt) + sequence.logprobs))
    return data


def grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad and p.grad is not None}
    backend.model.zero_grad(set_to_none=True)
    return out


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal within float32 rounding: 1e-4 of each entry, and 1e-6 of the tensor's largest entry (an entry near zero is a
    sum of terms as large as the largest, whose rounding depends on the kernels the CPU picks: 1e-5 on a tensor of
    entries up to 30 was seen with oneDNN's AMX kernels)."""
    assert a.keys() == b.keys() and a
    for name in a:
        scale = max(1.0, float(b[name].abs().max()))
        assert torch.allclose(a[name], b[name], atol=1e-6 * scale, rtol=1e-4), (name, float((a[name] - b[name]).abs().max()))


# ----- 1. the ratio of an unchanged policy is 1 at any temperature ----------------------------------------
@pytest.mark.parametrize("lora_rank", [4, 0])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_unchanged_policy_has_ratio_one_at_any_temperature(tiny: str, temperature: float, lora_rank: int) -> None:
    backend = make_backend(tiny, lora_rank)
    data = sampled_batch(backend, temperature)
    spec = LossSpec(name="ppo", temperature=temperature)
    metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["mismatch/logp_abs_max"] < 1e-3 and metrics["mismatch/kl"] < 1e-6
    # Scoring the untempered distribution instead is what the temperature fixes: the test would see it.
    untempered = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo"))).metrics
    assert untempered["mismatch/logp_abs_max"] > 0.05


def test_logprobs_and_reference_use_the_temperature(tiny: str) -> None:
    backend = make_backend(tiny)
    data = sampled_batch(backend, 0.5, prompts=1, samples=2)
    scored = backend.logprobs([d.tokens for d in data], temperature=0.5)
    for datum, row in zip(data, scored):
        sampled = [lp for lp, m in zip(datum.sampling_logprobs, datum.loss_mask) if m]
        assert [lp for lp, m in zip(row, datum.loss_mask) if m] == pytest.approx(sampled, abs=1e-4)
    # The KL to the reference compares the tempered distributions too: before any update it is 0 for the
    # full model's frozen copy of itself (LoRA's reference differs: the adapter is switched off).
    full = make_backend(tiny, lora_rank=0)
    data = sampled_batch(full, 0.5, prompts=1, samples=2)
    metrics = full.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo", temperature=0.5, kl_coef=0.1))).metrics
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (LossSpec(temperature=0.0), "temperature must be > 0"),
        (LossSpec(top_k=20), "top_k=20"),
        (LossSpec(top_p=0.9), "top_p=0.9"),
        (LossSpec(tis_cap=2.0), "old_logprobs='trainer'"),
        (LossSpec(old_logprobs="vllm"), "old_logprobs must be one of"),
    ],
)
def test_loss_specs_that_cannot_be_scored_are_refused(tiny: str, spec: LossSpec, message: str) -> None:
    backend = make_backend(tiny)
    data = sampled_batch(backend, 1.0, prompts=1, samples=2)
    with pytest.raises(ConfigError, match=message):
        backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec))


# ----- 3. normalizers of the whole optimizer batch ------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_requests_split_with_batch_totals_give_the_gradient_of_one_request(tiny: str, aggregation: str) -> None:
    backend = make_backend(tiny)
    data = sampled_batch(backend, 1.0)
    spec = LossSpec(name="ppo", aggregation=aggregation, kl_coef=0.05)
    whole = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
    whole_grads = grads(backend)
    tokens, sequences = sum(sum(d.loss_mask[1:]) for d in data), len(data)
    losses_seen = 0.0
    for part in (data[:5], data[5:9], data[9:]):
        result = backend.forward_backward(ForwardBackwardRequest(data=part, loss=spec, num_tokens=tokens, num_sequences=sequences))
        losses_seen += result.metrics["loss"]
    assert losses_seen == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert_same_grads(grads(backend), whole_grads)


def test_sequences_left_out_still_count_in_the_normalizer(tiny: str) -> None:
    """Dropping zero-advantage sequences (no KL) with the batch's totals changes nothing."""
    backend = make_backend(tiny)
    data = sampled_batch(backend, 1.0)
    for datum in data[:6]:  # two degenerate groups
        datum.advantages = [0.0] * len(datum.tokens)
    tokens, sequences = sum(sum(d.loss_mask[1:]) for d in data), len(data)
    for aggregation in ("token", "sequence"):
        spec = LossSpec(name="ppo", aggregation=aggregation)
        backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec))
        everything = grads(backend)
        backend.forward_backward(ForwardBackwardRequest(data=data[6:], loss=spec, num_tokens=tokens, num_sequences=sequences))
        assert_same_grads(grads(backend), everything)
        backend.forward_backward(ForwardBackwardRequest(data=data[6:], loss=spec))  # the old normalizer: a bigger step
        alone = grads(backend)
        name = next(iter(alone))
        assert alone[name].norm() > 1.5 * everything[name].norm()


# ----- 4. KL and ratio numerics -------------------------------------------------------------------------
def test_masked_positions_cannot_make_the_loss_nan() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    advantages = torch.tensor([[0.0, 1.0, -1.0, 0.0]])
    policy = torch.tensor([[-95.0, -1.0, -2.0, -100.0]], requires_grad=True)
    reference = torch.tensor([[-2.0, -1.2, -1.5, -7.0]])  # the masked positions have log ratios of 93
    sampling = torch.tensor([[0.0, -1.1, -2.2, -300.0]])  # and a masked exp(logprob - sampler) would overflow
    weights = losses.aggregation_weights(mask, "token", float(mask.sum()), 1)
    spec = LossSpec(name="ppo", kl_coef=0.5, old_logprobs="trainer", tis_cap=2.0)
    loss, sums = losses.compute_loss(spec, policy, mask, weights, advantages, sampling, reference)
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(policy.grad).all()
    assert policy.grad[0, 0] == 0 and policy.grad[0, 3] == 0
    assert all(math.isfinite(v) for v in sums.values())
    # The masked values play no part: benign ones give the same loss.
    benign = torch.tensor([[-1.0, -1.0, -2.0, -1.0]], requires_grad=True)
    same, _ = losses.compute_loss(spec, benign, mask, weights, advantages, torch.tensor([[-1.0, -1.1, -2.2, -1.0]]),
                                  torch.tensor([[-1.0, -1.2, -1.5, -1.0]]))
    assert float(same) == pytest.approx(float(loss), abs=1e-6)


def test_k3_kl_is_bounded_where_the_reference_gives_a_token_almost_no_mass() -> None:
    policy = torch.tensor([-50.0, -0.1], requires_grad=True)
    reference = torch.tensor([-0.01, -60.0])
    kl = losses.k3_kl(policy, reference, torch.ones(2))
    assert torch.isfinite(kl).all() and float(kl.max()) <= losses.MAX_K3
    kl.sum().backward()
    assert torch.isfinite(policy.grad).all()


# ----- 5. sampler/trainer mismatch and its corrections ---------------------------------------------------
def test_mismatch_metrics_by_hand() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    trainer = torch.tensor([[-9.0, -1.0, -2.0, -0.5]])
    sampler = torch.tensor([[0.0, -1.1, -1.8, -0.5]])
    sums = losses.mismatch_sums(losses.masked_log_ratio(trainer, sampler, mask), mask)
    deltas = [0.1, -0.2, 0.0]
    assert sums["mismatch_abs_sum"] == pytest.approx(0.3, abs=1e-6)
    assert sums["mismatch_abs_max"] == pytest.approx(0.2, abs=1e-6)
    assert sums["mismatch_kl_sum"] == pytest.approx(sum(math.exp(d) - d - 1 for d in deltas), abs=1e-6)
    merged = losses.add_sums(losses.add_sums({}, sums), {"mismatch_abs_max": 0.05, "mismatch_abs_sum": 0.1, "mask_sum": 4.0})
    assert merged["mismatch_abs_max"] == pytest.approx(0.2) and merged["mismatch_abs_sum"] == pytest.approx(0.4)


def test_truncated_importance_weights_scale_the_policy_gradient(tiny: str) -> None:
    """With trainer old logprobs the ratio is 1, and each token's gradient is weighted by min(trainer/sampler, cap)."""
    backend = make_backend(tiny)
    data = sampled_batch(backend, 1.0, prompts=2, samples=3)
    gen = torch.Generator().manual_seed(5)
    cap = 1.2
    for datum in data:  # a sampler whose numerics differ from the trainer's by up to 0.5 nats
        shift = (torch.rand(len(datum.tokens), generator=gen) - 0.5).tolist()
        datum.sampling_logprobs = [lp + s * m for lp, s, m in zip(datum.sampling_logprobs, shift, datum.loss_mask)]
    spec = LossSpec(name="ppo", old_logprobs="trainer", tis_cap=cap)
    metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
    corrected = grads(backend)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and metrics["clip_fraction"] == 0.0
    trainer = backend.logprobs([d.tokens for d in data])
    weights = [[min(math.exp(t - s), cap) if m else 0.0 for t, s, m in zip(row, d.sampling_logprobs, d.loss_mask)] for row, d in zip(trainer, data)]
    masked = sum(sum(d.loss_mask[1:]) for d in data)
    assert metrics["tis/weight_mean"] == pytest.approx(sum(map(sum, weights)) / masked, rel=1e-4)
    assert metrics["tis/capped_fraction"] == pytest.approx(sum(w >= cap for row in weights for w in row) / masked, abs=1e-6)
    assert 0 < metrics["tis/capped_fraction"] < 1
    # The same gradient as REINFORCE with the weights folded into the advantages.
    weighted = [Datum(tokens=d.tokens, loss_mask=d.loss_mask, advantages=[a * w for a, w in zip(d.advantages, row)]) for d, row in zip(data, weights)]
    backend.forward_backward(ForwardBackwardRequest(data=weighted, loss=LossSpec(name="reinforce")))
    assert_same_grads(corrected, grads(backend))


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_bfloat16_sampling_matches_the_training_pass(tiny: str, lora_rank: int) -> None:
    """In bfloat16, full fine-tuning samples with the training pass's numerics (float32 norms and residual)."""
    backend = make_backend(tiny, lora_rank, dtype="bfloat16")
    data = sampled_batch(backend, 1.0, prompts=3, samples=4, new_tokens=16)
    metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo"))).metrics
    assert metrics["mismatch/logp_abs_mean"] < 5e-3, metrics


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_multi_turn_sequences_get_logits_only_where_a_turn_is_read(tiny: str, lora_rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled turns between unread env replies: the vocabulary projection runs at the read positions only, same loss and gradients."""
    import torch

    from tinkergym.backends.torch import batches as torch_batches
    from tinkergym.backends.torch import scoring as torch_scoring

    gen = torch.Generator().manual_seed(0)
    data = []
    for length, turns in ((40, [(9, 12), (20, 23), (33, 36)]), (31, [(6, 8), (15, 18), (27, 31)])):
        mask = [0.0] * length
        for start, end in turns:
            mask[start:end] = [1.0] * (end - start)
        tokens = torch.randint(5, 200, (length,), generator=gen).tolist()
        data.append(Datum(tokens=tokens, loss_mask=mask, advantages=[0.7 - len(data)] * length, sampling_logprobs=[-3.0] * length))
    read = torch_scoring.read_positions(data)
    assert read == sorted({t for d in data for t, m in enumerate(d.loss_mask) if m})
    spec = LossSpec(name="ppo", kl_coef=0.1)
    results = {}
    for gathered in (True, False):
        if not gathered:  # every position from the first read one on, as before
            monkeypatch.setattr(torch_batches, "read_positions", lambda rows: list(range(read[0], read[-1] + 1)))
        backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=lora_rank, dtype="float32", share_prefixes=False, micro_batch_size=8))
        with torch.no_grad():
            for name, param in backend.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
        widths: list[int] = []
        backend.model.get_output_embeddings().register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))  # noqa: B023 - removed with this iteration's backend
        metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        results[gathered] = (metrics, grads, widths)
    (metrics, grads, widths), (plain_metrics, plain_grads, plain_widths) = results[True], results[False]
    assert set(widths) == {len(read)} and set(plain_widths) == {40 - read[0] + 1}  # policy and KL reference passes alike
    assert metrics == pytest.approx(plain_metrics, rel=1e-5, abs=1e-6)
    assert grads.keys() == plain_grads.keys() and grads
    for name in grads:
        assert torch.allclose(grads[name], plain_grads[name], atol=1e-6, rtol=1e-4), name


# ----- the Tinker API's losses: summed, each as its definition, in value and gradient ----------------------------
def tinker_reference(name: str, lp: torch.Tensor, datum: Datum, mask: torch.Tensor) -> torch.Tensor:
    """Each loss of the Tinker API's docs over one sequence's read tokens (``mask``), written apart from tinkergym's."""
    q = torch.tensor(datum.sampling_logprobs, dtype=torch.float32)
    adv = torch.tensor(datum.advantages, dtype=torch.float32)
    ratio = torch.exp(lp - q)
    if name == "cispo":
        return -(torch.clamp(ratio, 0.8, 1.25).detach() * lp * adv * mask).sum()
    if name == "dro":
        return -((lp * adv - 0.5 * 0.3 * (lp - q) ** 2) * mask).sum()
    seq = torch.exp(((lp.detach() - q) * mask).sum() / mask.sum())
    token = seq * torch.exp(lp - lp.detach())
    return -(torch.minimum(token * adv, torch.clamp(token, 0.8, 1.25) * adv) * mask).sum()


@pytest.mark.parametrize("name", ["cispo", "dro", "gspo"])
def test_tinker_api_losses_equal_their_definitions_in_value_and_gradient(tiny: str, name: str) -> None:
    backend = make_backend(tiny)
    data = sampled_batch(backend, 1.0)
    for d in data:  # a sampler whose numerics differ, so ratios leave the clip range
        d.sampling_logprobs = [v + (0.3 if t % 2 else -0.3) * (v != 0) for t, v in enumerate(d.sampling_logprobs)]
    spec = LossSpec(name=name, aggregation="sum", clip_low=0.2, clip_high=0.25, beta=0.3)
    result = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec, return_logprobs=True))
    ours = grads(backend)
    assert result.logprobs is not None and len(result.logprobs) == len(data)
    total, weights = 0.0, []
    for datum, row in zip(data, result.logprobs):
        read = np.asarray(datum.loss_mask) != 0  # the pass scores the read tokens (others are 0.0)
        np.testing.assert_allclose(np.asarray(row)[read], np.asarray(backend.logprobs([datum.tokens])[0])[read], atol=1e-5)
        lp = torch.tensor(row, dtype=torch.float32, requires_grad=True)
        loss = tinker_reference(name, lp, datum, torch.tensor(datum.loss_mask, dtype=torch.float32))
        loss.backward()
        total += float(loss)
        weights.append((-lp.grad).tolist())  # a summed cross-entropy with weights -dL/dlogprob has the same gradient
    assert result.metrics["loss"] == pytest.approx(total, rel=1e-5, abs=1e-6)
    surrogate = [Datum(tokens=d.tokens, loss_mask=w) for d, w in zip(data, weights)]
    backend.forward_backward(ForwardBackwardRequest(data=surrogate, loss=LossSpec(name="cross_entropy", aggregation="sum")))
    assert_same_grads(ours, grads(backend))
