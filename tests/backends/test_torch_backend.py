"""Loss functions on hand-computed tensors, and the local torch backend on the tiny model in float32."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tinkergym.backends.torch import losses
from tinkergym.protocol.backend import Backend
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.sampling import filter_logits
from tinkergym.protocol.types import (
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LossSpec,
    OptimParams,
    SampleRequest,
    SampleResponse,
    SampledSequence,
    SamplingParams,
)
from tinkergym.errors import ConfigError, OutOfMemoryError

OPTIM = OptimParams(learning_rate=1e-2, max_grad_norm=1.0)


# ----- losses -----------------------------------------------------------------------------------------
def test_k3_kl_by_hand() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    reference = torch.tensor([-1.0, -1.0, -1.5])
    r = reference - logprobs
    expected = torch.exp(r) - r - 1
    assert torch.allclose(losses.k3_kl(logprobs, reference), expected)
    assert losses.k3_kl(logprobs, reference)[0] == 0.0
    assert (losses.k3_kl(logprobs, reference) >= 0).all()


def test_policy_losses_by_hand() -> None:
    logprobs = torch.log(torch.tensor([0.5, 0.25]))
    advantages = torch.tensor([2.0, -1.0])
    sampling = torch.log(torch.tensor([0.25, 0.5]))  # ratios 2.0 and 0.5
    ce, _, _ = losses.policy_loss("cross_entropy", logprobs)
    assert ce.tolist() == pytest.approx([math.log(2), math.log(4)])
    rf, _, _ = losses.policy_loss("reinforce", logprobs, advantages)
    assert rf.tolist() == pytest.approx([2 * math.log(2), -math.log(4)])
    is_loss, ratio, _ = losses.policy_loss("importance_sampling", logprobs, advantages, sampling)
    assert ratio.tolist() == pytest.approx([2.0, 0.5])
    assert is_loss.tolist() == pytest.approx([-4.0, 0.5])
    # Asymmetric clipping: ratio 2 with A > 0 is capped at 1 + clip_high; ratio 0.5 with A < 0 at 1 - clip_low.
    ppo, ratio, clipped = losses.policy_loss("ppo", logprobs, advantages, sampling, clip_low=0.1, clip_high=0.3)
    assert ppo.tolist() == pytest.approx([-1.3 * 2.0, 0.9])
    assert clipped.tolist() == [1.0, 1.0]
    unclipped_ppo, _, clipped = losses.policy_loss("ppo", logprobs, -advantages, sampling, clip_low=0.1, clip_high=0.3)
    assert unclipped_ppo.tolist() == pytest.approx([4.0, -0.5])  # the pessimistic (unclipped) term wins
    assert clipped.tolist() == [0.0, 0.0]
    with pytest.raises(ConfigError):
        losses.policy_loss("ppo", logprobs, advantages)
    with pytest.raises(ConfigError):
        losses.policy_loss("dpo", logprobs)


def test_aggregation_weights_by_hand() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    token = losses.aggregation_weights(mask, "token", total_mask=4.0, num_sequences=2)
    assert token.sum() == pytest.approx(1.0) and token[0, 1] == pytest.approx(0.25)
    sequence = losses.aggregation_weights(mask, "sequence", total_mask=4.0, num_sequences=2)
    assert sequence[0].tolist() == pytest.approx([0, 1 / 6, 1 / 6, 1 / 6])
    assert sequence[1].tolist() == pytest.approx([0, 0.5, 0, 0])
    assert sequence[2].tolist() == [0, 0, 0, 0]


def test_compute_loss_and_metrics_by_hand() -> None:
    logprobs = torch.log(torch.tensor([[1.0, 0.5, 0.25]]))
    sampling = torch.log(torch.tensor([[1.0, 0.25, 0.25]]))
    reference = torch.log(torch.tensor([[1.0, 0.5, 0.5]]))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    advantages = torch.tensor([[0.0, 1.0, 1.0]])
    spec = LossSpec(name="ppo", clip_low=0.2, clip_high=0.2, kl_coef=0.5, loss_scale=2.0)
    weights = losses.aggregation_weights(mask, "token", 2.0, 1)
    loss, sums = losses.compute_loss(spec, logprobs, mask, weights, advantages, sampling, reference)
    kl = [0.0, math.exp(math.log(2)) - math.log(2) - 1]
    expected = 2.0 * ((-1.2 + 0.5 * kl[0]) + (-1.0 + 0.5 * kl[1])) / 2
    assert float(loss) == pytest.approx(expected)
    metrics = losses.finalize_metrics(sums)
    assert metrics["loss"] == pytest.approx(expected)
    assert metrics["tokens"] == 2.0
    assert metrics["kl"] == pytest.approx(sum(kl) / 2)
    assert metrics["ratio_mean"] == pytest.approx(1.5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def test_filter_logits() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.1)).tolist() == [[False, True, True, True]]


# ----- the backend ----------------------------------------------------------------------------------
def make_backend(tiny: str, **overrides) -> TorchBackend:
    settings = {"model": tiny, "dtype": "float32", "device": "cpu", "lora_rank": 4, "micro_batch_size": 4, **overrides}
    return TorchBackend(TorchBackendConfig(**settings))


def encode(backend: TorchBackend, text: str) -> list[int]:
    return backend.tokenizer.encode(text, add_special_tokens=False)


def rl_batch(backend: TorchBackend) -> list[Datum]:
    """Sequences of different lengths with prompt tokens masked out and made-up advantages and sampler logprobs."""
    texts = ["The sun rises in the east.", "12 + 3 = 15", "Hello, world! How are you today, my friend?", "Yes.", "Five in a row wins."]
    data = []
    for i, text in enumerate(texts):
        tokens = encode(backend, text)
        current = backend.logprobs([tokens])[0]
        prompt = min(2, len(tokens) - 1)
        data.append(
            Datum(
                tokens=tokens,
                loss_mask=[0.0] * prompt + [1.0] * (len(tokens) - prompt),
                advantages=[(-1.0) ** i * (0.5 + i)] * len(tokens),
                sampling_logprobs=[lp + 0.3 * ((-1) ** t) for t, lp in enumerate(current)],
            )
        )
    return data


def sft_datum(backend: TorchBackend) -> Datum:
    tokens = encode(backend, "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>")
    return Datum(tokens=tokens, loss_mask=[1.0] * len(tokens))


def grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad}


def weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def test_backend_info_and_protocol(tiny: str) -> None:
    backend = make_backend(tiny)
    assert isinstance(backend, Backend)
    info = backend.info()
    assert info["tokenizer"] == tiny and info["lora_rank"] == 4 and info["step"] == 0
    assert (info["dtype"], info["device"], info["attn_implementation"]) == ("float32", "cpu", "sdpa")
    assert 0 < info["trainable_params"] < info["total_params"]
    full = make_backend(tiny, lora_rank=0).info()
    assert full["trainable_params"] == full["total_params"]


def test_config_round_trip_and_validation() -> None:
    config = TorchBackendConfig(model="tiny", lora_target_modules=["q_proj", "v_proj"])
    assert TorchBackendConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ConfigError):
        TorchBackendConfig(dtype="float16")
    with pytest.raises(ConfigError):
        TorchBackendConfig(lora_rank=-1)


def test_sample_is_seeded_and_reports_finish_reasons(tiny: str) -> None:
    backend = make_backend(tiny)
    prompts = [encode(backend, "Hello there"), encode(backend, "The quick brown fox jumps over")]
    request = SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=8, seed=7), num_samples=3)
    first, second = backend.sample(request), backend.sample(request)
    assert first == second
    assert [len(row) for row in first.sequences] == [3, 3]
    assert all(s.finish_reason == "length" and len(s.tokens) == 8 for row in first.sequences for s in row)
    other = backend.sample(SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=8, seed=8), num_samples=3))
    assert other != first
    vocab = len(backend.tokenizer)
    stop_anywhere = SamplingParams(max_new_tokens=8, seed=7, stop_token_ids=list(range(vocab)))
    stopped = backend.sample(SampleRequest(prompts=prompts, params=stop_anywhere)).sequences
    assert [(len(s.tokens), s.finish_reason) for row in stopped for s in row] == [(1, "stop"), (1, "stop")]
    unstopped = backend.sample(SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=8, seed=7))).sequences
    assert [s.tokens for row in stopped for s in row] == [row[0].tokens[:1] for row in unstopped]


def test_sample_stops_at_eos_by_default(tiny: str) -> None:
    backend = make_backend(tiny, lora_rank=0)
    eos = backend.tokenizer.eos_token_id
    always_eos = torch.nn.Linear(backend.model.config.hidden_size, len(backend.tokenizer))
    with torch.no_grad():  # a head that says <|im_end|> whatever it reads
        always_eos.weight.zero_()
        always_eos.bias.zero_()
        always_eos.bias[eos] = 10.0
    backend.model.lm_head = always_eos
    prompts = [encode(backend, "Hi"), encode(backend, "A longer prompt here")]
    result = backend.sample(SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=5, temperature=0.0)))
    assert [s.tokens for row in result.sequences for s in row] == [[eos], [eos]]
    assert all(s.finish_reason == "stop" for row in result.sequences for s in row)


def test_sampled_logprobs_match_scoring(tiny: str) -> None:
    backend = make_backend(tiny)
    backend.forward_backward(ForwardBackwardRequest(data=[sft_datum(backend)], loss=LossSpec(name="cross_entropy")))
    backend.optim_step(OPTIM)  # a non-zero adapter, so the LoRA path is part of what is compared
    prompts = [encode(backend, "Hi"), encode(backend, "Water boils at one hundred degrees and")]
    result = backend.sample(SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=12, seed=3), num_samples=2))
    for prompt, row in zip(prompts, result.sequences):
        for seq in row:
            scored = backend.logprobs([prompt + seq.tokens])[0][len(prompt) :]
            assert len(seq.logprobs) == len(seq.tokens)
            assert max(abs(a - b) for a, b in zip(scored, seq.logprobs)) < 1e-4


def test_sampled_logprobs_are_of_the_tempered_filtered_distribution(tiny: str) -> None:
    backend = make_backend(tiny)
    prompt = encode(backend, "Monday, Tuesday,")
    for params in (SamplingParams(max_new_tokens=6, temperature=0.5, seed=1), SamplingParams(max_new_tokens=6, temperature=1.3, top_k=5, seed=1)):
        seq = backend.sample(SampleRequest(prompts=[prompt], params=params)).sequences[0][0]
        ids = torch.tensor([prompt + seq.tokens])
        with torch.no_grad():
            logits = backend.model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / params.temperature
        expected = torch.log_softmax(filter_logits(logits, params.top_k), -1).gather(-1, torch.tensor(seq.tokens)[:, None]).squeeze(-1)
        assert seq.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_greedy_is_top_k_one(tiny: str) -> None:
    backend = make_backend(tiny)
    prompt = encode(backend, "The board has rows")
    greedy = backend.sample(SampleRequest(prompts=[prompt], params=SamplingParams(max_new_tokens=6, temperature=0.0))).sequences[0][0]
    top1 = backend.sample(SampleRequest(prompts=[prompt], params=SamplingParams(max_new_tokens=6, top_k=1, seed=5))).sequences[0][0]
    assert greedy.tokens == top1.tokens
    assert top1.logprobs == [0.0] * 6
    assert greedy.logprobs == pytest.approx(backend.logprobs([prompt + greedy.tokens])[0][len(prompt) :], abs=1e-4)


def test_logprobs_first_entry_is_zero(tiny: str) -> None:
    backend = make_backend(tiny)
    out = backend.logprobs([encode(backend, "One two three"), encode(backend, "Four")])
    assert [row[0] for row in out] == [0.0, 0.0]
    assert [len(row) for row in out] == [len(encode(backend, "One two three")), len(encode(backend, "Four"))]
    assert all(v < 0 for row in out for v in row[1:])


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_give_the_gradients_of_one_batch(tiny: str, aggregation: str) -> None:
    results = {}
    for size in (1, 8):
        backend = make_backend(tiny, lora_rank=0, micro_batch_size=size)
        spec = LossSpec(name="ppo", clip_low=0.1, clip_high=0.3, kl_coef=0.1, aggregation=aggregation)
        metrics = backend.forward_backward(ForwardBackwardRequest(data=rl_batch(backend), loss=spec)).metrics
        results[size] = (metrics, grads(backend))
    (m1, g1), (m8, g8) = results[1], results[8]
    assert m1 == pytest.approx(m8, rel=1e-5, abs=1e-6)
    for name in g1:
        assert torch.allclose(g1[name], g8[name], atol=1e-6, rtol=1e-4), name


def test_gradients_accumulate_until_optim_step(tiny: str) -> None:
    backend = make_backend(tiny)
    request = ForwardBackwardRequest(data=[sft_datum(backend)], loss=LossSpec(name="cross_entropy"))
    backend.forward_backward(request)
    once = grads(backend)
    backend.forward_backward(request)
    twice = grads(backend)
    assert all(torch.allclose(twice[n], 2 * once[n], atol=1e-7) for n in once)
    stats = backend.optim_step(OPTIM)
    assert stats["step"] == 1.0 and stats["grad_norm"] > 0
    assert all(p.grad is None for p in backend.model.parameters())


def test_forward_backward_metrics_and_errors(tiny: str) -> None:
    backend = make_backend(tiny)
    data = rl_batch(backend)
    metrics = backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo"))).metrics
    mismatch = {"mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/kl"}
    assert set(metrics) == {"loss", "tokens", "ratio_mean", "clip_fraction"} | mismatch
    assert metrics["tokens"] == sum(sum(d.loss_mask[1:]) for d in data)
    assert 0 < metrics["clip_fraction"] < 1
    assert set(backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="reinforce"))).metrics) == {"loss", "tokens"} | mismatch
    sft = [Datum(tokens=d.tokens, loss_mask=d.loss_mask) for d in data]
    assert set(backend.forward_backward(ForwardBackwardRequest(data=sft, loss=LossSpec(name="cross_entropy"))).metrics) == {"loss", "tokens"}
    bad = [Datum(tokens=data[0].tokens, loss_mask=data[0].loss_mask)]
    with pytest.raises(ConfigError, match="advantages"):
        backend.forward_backward(ForwardBackwardRequest(data=bad, loss=LossSpec(name="ppo")))
    with pytest.raises(ConfigError, match="loss_mask"):
        backend.forward_backward(ForwardBackwardRequest(data=[Datum(tokens=[1, 2, 3], loss_mask=[1.0])], loss=LossSpec(name="cross_entropy")))
    with pytest.raises(ConfigError, match="unknown loss"):
        backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="dpo")))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_cross_entropy_goes_down(tiny: str, lora_rank: int) -> None:
    backend = make_backend(tiny, lora_rank=lora_rank)
    request = ForwardBackwardRequest(data=[sft_datum(backend)], loss=LossSpec(name="cross_entropy"))
    losses_seen = []
    for _ in range(10):
        losses_seen.append(backend.forward_backward(request).metrics["loss"])
        backend.optim_step(OptimParams(learning_rate=1e-2))
    assert losses_seen[-1] < 0.5 * losses_seen[0]
    assert backend.info()["step"] == 10


def test_lora_trains_only_the_adapter(tiny: str) -> None:
    backend = make_backend(tiny)
    before = weights(backend)
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for _ in range(3):
        backend.forward_backward(ForwardBackwardRequest(data=[sft_datum(backend)], loss=LossSpec(name="cross_entropy")))
        backend.optim_step(OPTIM)
    after = weights(backend)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert any(not torch.equal(before[n], after[n]) for n in trainable)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_kl_is_zero_before_training_and_grows(tiny: str, lora_rank: int) -> None:
    backend = make_backend(tiny, lora_rank=lora_rank)
    data = rl_batch(backend)
    spec = LossSpec(name="importance_sampling", kl_coef=0.1)
    first = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics["kl"]
    assert abs(first) < 1e-6
    for _ in range(3):
        backend.optim_step(OPTIM)
        last = backend.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics["kl"]
    assert last > 1e-5


def test_bfloat16_keeps_trainable_weights_in_float32(tiny: str) -> None:
    full = make_backend(tiny, lora_rank=0, dtype="bfloat16")
    assert (full.info()["dtype"], full.info()["param_dtype"]) == ("bfloat16", "float32")
    data = rl_batch(full)
    spec = LossSpec(name="importance_sampling", kl_coef=0.1)
    assert abs(full.forward_backward(ForwardBackwardRequest(data=data, loss=spec)).metrics["kl"]) < 1e-6
    before = weights(full)
    full.optim_step(OptimParams(learning_rate=1e-5))  # a step far below bfloat16 resolution still lands
    after = weights(full)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    lora = make_backend(tiny, lora_rank=4, dtype="bfloat16")
    dtypes = {p.dtype for n, p in lora.model.named_parameters() if p.requires_grad}
    frozen = {p.dtype for n, p in lora.model.named_parameters() if not p.requires_grad}
    assert (dtypes, frozen) == ({torch.float32}, {torch.bfloat16})
    sample = lora.sample(SampleRequest(prompts=[encode(lora, "Hello")], params=SamplingParams(max_new_tokens=4, seed=0)))
    assert len(sample.sequences[0][0].tokens) == 4


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_save_and_load_resume_bit_exactly(tiny: str, tmp_path: Path, lora_rank: int) -> None:
    def train(backend: TorchBackend, steps: int) -> list[dict]:
        out = []
        for _ in range(steps):
            metrics = backend.forward_backward(ForwardBackwardRequest(data=rl_batch(backend), loss=LossSpec(name="ppo", kl_coef=0.05))).metrics
            sample = backend.sample(SampleRequest(prompts=[[5, 6, 7]], params=SamplingParams(max_new_tokens=4)))  # unseeded: global RNG
            out.append({**metrics, **backend.optim_step(OPTIM), "sample": sample.sequences[0][0].tokens})
        return out

    original = make_backend(tiny, lora_rank=lora_rank, lora_dropout=0.1 if lora_rank else 0.0)
    train(original, 2)
    original.save_state(str(tmp_path / "state"))
    original.save_state(str(tmp_path / "state"))  # overwriting an existing checkpoint works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    expected = train(original, 2)

    resumed = make_backend(tiny, lora_rank=lora_rank, lora_dropout=0.1 if lora_rank else 0.0, seed=123)
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.info()["step"] == 2
    assert train(resumed, 2) == expected
    final_a, final_b = weights(original), weights(resumed)
    assert all(torch.equal(final_a[n], final_b[n]) for n in final_a)


def test_load_state_rejects_other_settings(tiny: str, tmp_path: Path) -> None:
    make_backend(tiny, lora_rank=4).save_state(str(tmp_path / "state"))
    with pytest.raises(ConfigError, match="lora_rank"):
        make_backend(tiny, lora_rank=0).load_state(str(tmp_path / "state"))
    with pytest.raises(ConfigError, match="state.json"):
        make_backend(tiny).load_state(str(tmp_path))


def trained(tiny: str, lora_rank: int) -> TorchBackend:
    backend = make_backend(tiny, lora_rank=lora_rank)
    for _ in range(3):
        backend.forward_backward(ForwardBackwardRequest(data=[sft_datum(backend)], loss=LossSpec(name="cross_entropy")))
        backend.optim_step(OPTIM)
    return backend


def backend_logits(backend: TorchBackend, ids: torch.Tensor) -> torch.Tensor:
    backend.model.eval()
    with torch.no_grad():
        return backend.model(input_ids=ids).logits


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # raised inside peft
def test_export_adapter_loads_with_peft(tiny: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = trained(tiny, 4)
    backend.export(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([sft_datum(backend).tokens])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, backend_logits(backend, ids), atol=1e-5)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "adapter")).encode("hello") == backend.tokenizer.encode("hello")


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # raised inside peft
def test_training_from_an_adapter_folder_starts_from_the_adapter(tiny: str, tmp_path: Path) -> None:
    # A LoRA run's final/ as --model (SFT warm-up, then RL or self-play): the adapter is merged into its base,
    # with a new LoRA (or every weight) trained on top; not the base model with the adapter dropped.
    backend = trained(tiny, 4)
    backend.export(str(tmp_path / "sft"))
    ids = torch.tensor([sft_datum(backend).tokens])
    expected = backend_logits(backend, ids)
    assert not torch.allclose(backend_logits(make_backend(tiny), ids), expected, atol=1e-3)  # training moved it
    for lora_rank in (4, 0):
        warm = make_backend(str(tmp_path / "sft"), lora_rank=lora_rank)
        assert torch.allclose(backend_logits(warm, ids), expected, atol=1e-5)
        warm.export(str(tmp_path / f"rl-{lora_rank}"))  # an adapter whose base is itself an adapter folder, or a full model
        assert torch.allclose(backend_logits(make_backend(str(tmp_path / f"rl-{lora_rank}")), ids), expected, atol=1e-5)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_export_merged_loads_with_transformers(tiny: str, tmp_path: Path, lora_rank: int) -> None:
    from transformers import AutoModelForCausalLM

    backend = trained(tiny, lora_rank)
    before = weights(backend)
    backend.export(str(tmp_path / "merged"), merged=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.tensor([sft_datum(backend).tokens])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, backend_logits(backend, ids), atol=1e-5)
    after = weights(backend)
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_requests_round_trip_through_json() -> None:
    requests = [
        SampleRequest(prompts=[[1, 2], [3]], params=SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, stop_token_ids=[2], seed=1), num_samples=2),
        SampleResponse(sequences=[[SampledSequence(tokens=[4, 2], logprobs=[-0.1, -0.2], finish_reason="stop")]]),
        ForwardBackwardRequest(data=[Datum(tokens=[1, 2, 3], loss_mask=[0, 1, 1], advantages=[0, 1, 1], sampling_logprobs=[0, -1, -2])], loss=LossSpec(name="ppo", kl_coef=0.1)),
        ForwardBackwardResult(metrics={"loss": 1.5, "tokens": 2.0}),
        OptimParams(learning_rate=1e-4, max_grad_norm=0.0),
    ]
    for request in requests:
        assert type(request).from_dict(json.loads(json.dumps(request.to_dict()))) == request


@pytest.mark.parametrize("body, usable", [("", True), ("raise ImportError('undefined symbol: _ZN3c104cuda')", False),
                                          ("raise OSError('libcudart.so.11.0: cannot open shared object file')", False)])
def test_flash_attention_is_chosen_only_when_flash_attn_really_imports(body: str, usable: bool, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A flash-attn built for another torch is found by find_spec but fails to import: it counts as absent, with a warning."""
    import sys
    import warnings

    import torch

    from tinkergym.backends.torch import backend as torch_backend
    from tinkergym.backends.torch import runtime as torch_setup

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(torch_setup, "_FLASH_ATTN", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = torch_backend.resolve_attn_implementation("auto", torch.device("cuda"), torch.bfloat16)
    assert choice == ("flash_attention_2" if usable else "sdpa")
    assert any("does not import" in str(w.message) for w in caught) is not usable
    assert torch_backend.resolve_attn_implementation("auto", torch.device("cuda"), torch.float32) == "sdpa"
    assert torch_backend.resolve_attn_implementation("auto", torch.device("cpu"), torch.bfloat16) == "grouped_matmul"
    assert torch_backend.resolve_attn_implementation("auto", torch.device("cpu"), torch.float32) == "sdpa"
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)


def test_deterministic_mode_is_set_for_the_process_reported_and_kept_by_the_run(tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--deterministic reaches torch (deterministic algorithms, cuBLAS workspace), info() reports it, config.json keeps it,
    and two runs with it log the same metrics."""
    import os

    import torch
    from click.testing import CliRunner

    from tinkergym.cli import main
    from tinkergym.trainers.reporting import read_metrics

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", deterministic=True))
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert backend.info()["deterministic"] is True and backend.info()["attn_implementation"] == "sdpa"
        runs = []
        for name in ("a", "b"):
            args = ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--steps", "2", "--batch-size", "2",
                    "--group-size", "4", "--max-new-tokens", "6", "--deterministic", "--quiet", "--out", str(tmp_path / name)]
            result = CliRunner().invoke(main, args, catch_exceptions=False)
            assert result.exit_code == 0, result.output
            assert json.loads((tmp_path / name / "config.json").read_text())["deterministic"] is True
            runs.append([{k: v for k, v in r.items() if not k.startswith(("time/", "tokens/per_s"))} for r in read_metrics(tmp_path / name / "metrics.jsonl")])
        assert runs[0] == runs[1] and len(runs[0]) == 2
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_running_out_of_memory_says_what_to_lower_and_drops_the_partial_step(tiny: str) -> None:
    """A failed allocation (CUDA's OutOfMemoryError, or a CPU allocator's refusal) becomes advice, not a torch traceback."""
    backend = make_backend(tiny, micro_batch_size=1)
    data = [Datum(tokens=[3, 9 + k, 27, 4, 5], loss_mask=[0.0, 0.0, 1.0, 1.0, 1.0], advantages=[1.0 - 2 * k] * 5) for k in range(2)]
    request = ForwardBackwardRequest(data=data, loss=LossSpec(name="reinforce"))
    layer = next(m for m in backend.model.modules() if type(m).__name__.endswith("DecoderLayer"))
    passes: list[int] = []

    def fail(error: Exception, after: int):
        def hook(module, args):
            passes.append(1)
            if len(passes) > after:
                raise error
        return layer.register_forward_pre_hook(hook)

    handle = fail(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), after=1)  # the second micro-batch
    with pytest.raises(OutOfMemoryError, match="lower micro_batch_size \\(now 1; --micro-batch-size\\).*--gradient-checkpointing") as info:
        backend.forward_backward(request)
    handle.remove()
    assert "1 sequences, 5 tokens" in str(info.value) and "Tried to allocate 20.00 GiB" in str(info.value)
    assert all(p.grad is None for _, p in backend._trainable)  # the first micro-batch's gradients were dropped
    backend.forward_backward(request)  # the backend goes on; its gradients are the whole request's, once
    fresh = make_backend(tiny, micro_batch_size=1)
    fresh.forward_backward(request)
    for (name, got), (_, want) in zip(backend._trainable, fresh._trainable):
        assert torch.equal(got.grad, want.grad), name

    prompt = encode(backend, "Hello there")
    backend.sample(SampleRequest(prompts=[prompt], params=SamplingParams(max_new_tokens=3)))
    assert backend.prefix_cache.entries
    passes.clear()
    handle = fail(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10000000000 bytes"), after=0)
    with pytest.raises(OutOfMemoryError, match="sampling ran out of cpu memory on 1 sequences.*max_sample_batch.*--prefix-cache-mb"):
        backend.sample(SampleRequest(prompts=[prompt + [5]], params=SamplingParams(max_new_tokens=3)))
    handle.remove()
    assert not backend.prefix_cache.entries
    handle = fail(RuntimeError("shapes do not match"), after=0)  # other errors pass through as they are
    with pytest.raises(RuntimeError, match="shapes do not match"):
        backend.forward_backward(request)
    handle.remove()
