"""One base, many LoRA sessions (tinkergym.backends.torch.shared): shared passes give each session the gradients,
samples and logprobs of its request alone, touch no other adapter, fail one request alone, and bound memory."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from tests.testkit import datum  # noqa: E402
from tinkergym.backends.torch import multi_lora, row_adapters  # noqa: E402
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig  # noqa: E402
from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams  # noqa: E402

RANKS = (4, 8, 16)


def _perturbed_adapter(tiny: str, rank: int, folder, seed: int) -> None:
    """An exported adapter of ``rank`` whose B factors are not zero, so every factor gets a gradient."""
    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=rank, lora_alpha=2.0 * rank, dtype="float32", seed=seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    backend.export(str(folder))


def _requests(seed: int) -> list[ForwardBackwardRequest]:
    """A GRPO batch with shared prompts (ppo), an SFT batch (cross_entropy) and a batch with a KL term."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(5, 300) for _ in range(n)]  # noqa: E731
    prompt = ids(7)
    grpo = [datum(prompt, ids(rng.randrange(2, 6)), rng.uniform(-1, 1), 0.1 * i) for i in range(4)]
    sft = [Datum(tokens=ids(9), loss_mask=[0.0] * 3 + [1.0] * 6) for _ in range(3)]
    kl = [datum(ids(5), ids(4), rng.uniform(-1, 1), 0.0) for _ in range(2)]
    return [
        ForwardBackwardRequest(data=grpo, loss=LossSpec(name="ppo")),
        ForwardBackwardRequest(data=sft, loss=LossSpec(name="cross_entropy")),
        ForwardBackwardRequest(data=kl, loss=LossSpec(name="importance_sampling", kl_coef=0.2)),
    ]


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[int, str]:
    out = {}
    for rank in RANKS:
        folder = tmp_path_factory.mktemp(f"adapter{rank}")
        _perturbed_adapter(tiny, rank, folder, seed=rank)
        out[rank] = str(folder)
    return out


@pytest.fixture(params=["stacked", "segmented"])
def lora_form(request, monkeypatch) -> str:
    """Both ways a pass of several adapters runs (tinkergym.backends.torch.multi_lora): stacked, and gathered by adapter."""
    monkeypatch.setattr(multi_lora, "STACK_SHARE", math.inf if request.param == "stacked" else 0.0)
    return request.param


def _sessions(base: SharedBase, adapters: dict[int, str]) -> list:
    sessions = []
    for rank in RANKS:
        session = base.open_session(LoraSessionConfig(lora_rank=rank, lora_alpha=2.0 * rank, seed=rank))
        session.load_adapter(adapters[rank])
        sessions.append(session)
    return sessions


def _grads(session) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in session.params.items() if p.grad is not None}


def _adapters_per_pass(base: SharedBase) -> tuple[list[int], object]:
    seen: list[int] = []

    def record(module, args, kwargs):
        plan = row_adapters.current()
        seen.append(0 if plan is None else len(set(plan.adapters)))

    return seen, base.model.register_forward_pre_hook(record, with_kwargs=True)


def test_a_shared_pass_gives_each_session_the_gradients_of_its_request_alone(tiny, adapters, lora_form) -> None:
    requests = _requests(0)
    expected = []
    for rank, request in zip(RANKS, requests):
        alone = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=rank, lora_alpha=2.0 * rank, dtype="float32", micro_batch_size=4))
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(alone.model, load_file(f"{adapters[rank]}/adapter_model.safetensors"))
        metrics = alone.forward_backward(request).metrics
        grads = {n.replace(".default", ""): p.grad.clone() for n, p in alone.model.named_parameters() if p.grad is not None}
        expected.append((metrics, grads))
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=16))
    sessions = _sessions(base, adapters)
    bystander = base.open_session(LoraSessionConfig(lora_rank=8, seed=99))
    seen, hook = _adapters_per_pass(base)
    outcomes = base.forward_backward_many(list(zip(sessions, requests)))
    hook.remove()
    assert max(seen) >= 2, f"no pass held rows of several sessions: adapters per model call {seen}"
    for session, outcome, (metrics, grads) in zip(sessions, outcomes, expected):
        assert outcome.metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-6)
        mine = _grads(session)
        assert sorted(mine) == sorted(grads) and len(mine) == len(session.params)
        for name, grad in grads.items():
            torch.testing.assert_close(mine[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert _grads(bystander) == {}, "a session with no row in the pass got gradients"
    # The optimizer steps each session alone: the bystander's adapter and optimizer stay as they were.
    before = {n: p.detach().clone() for n, p in bystander.params.items()}
    for session in sessions:
        assert session.optim_step(OptimParams(learning_rate=1e-3))["step"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in bystander.params.items()) and bystander.optimizer.state_dict()["state"] == {}


def test_mixed_sampling_and_scoring_equal_each_session_alone(tiny, adapters, lora_form) -> None:
    prompts = {4: [[11, 12, 13], [40, 41]], 8: [[11, 12, 13]], 16: [[7, 8, 9, 10, 11]]}
    # Stop ids that end rows at different steps, so that a session's rows can all stop before the batch's last step.
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=list(range(0, 1024, 3)))
    mixed_base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    alone_base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    mixed, alone = _sessions(mixed_base, adapters), _sessions(alone_base, adapters)

    def requests(seeded: bool) -> list[SampleRequest]:
        return [SampleRequest(prompts=prompts[r], num_samples=3, params=SamplingParams(**{**params.to_dict(), "seed": r if seeded else None})) for r in RANKS]

    for seeded in (True, False):  # a request's seed, or the session's own generator
        seen, hook = _adapters_per_pass(mixed_base)
        together = mixed_base.sample_many(list(zip(mixed, requests(seeded))))
        hook.remove()
        assert max(seen) == 3
        for session, request, response in zip(alone, requests(seeded), together):
            solo = session.sample(request)
            assert [[s.tokens for s in row] for row in response.sequences] == [[s.tokens for s in row] for row in solo.sequences]
            for row, solo_row in zip(response.sequences, solo.sequences):
                for seq, solo_seq in zip(row, solo_row):
                    assert seq.logprobs == pytest.approx(solo_seq.logprobs, abs=1e-5)
        last_steps = {max(len(s.tokens) for row in r.sequences for s in row) for r in together}
        assert len(last_steps) > 1, f"every session ran to the same step ({last_steps}): nothing tells a session's own stop"
        for a, b in zip(mixed, alone):  # each generator left where its own batch would leave it
            assert torch.equal(a.generator.get_state(), b.generator.get_state())
    sequences = [[11, 12, 13, 14, 15, 16], [40, 41, 42]]
    scored = mixed_base.logprobs_many([(s, (sequences, 1.0)) for s in mixed])
    for session, rows in zip(alone, scored):
        for row, solo in zip(rows, session.logprobs(sequences)):
            assert row == pytest.approx(solo, abs=1e-5)
    # The adapters differ, so do their scores: each row went through its own session's adapter.
    assert scored[0][0] != pytest.approx(scored[2][0], abs=1e-4)


def test_rows_of_each_adapter_keep_it_after_stopped_rows_leave_the_decode_batch(tiny, adapters) -> None:
    """Rows that stopped leave the batch (see tests/backends/test_decode_rows_leave.py); each row still decoding goes on
    through its own session's adapter: every session gets what it gets sampled alone."""
    params = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=list(range(0, 1024, 11)))
    mixed_base, alone_base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32")), SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    mixed, alone = _sessions(mixed_base, adapters), _sessions(alone_base, adapters)
    requests = [SampleRequest(prompts=[[11 + r, 12, 13], [40, 41, r]], num_samples=3, params=SamplingParams(**{**params.to_dict(), "seed": r}))
                for r in RANKS]
    rows: list[int] = []
    hook = mixed_base.model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    together = mixed_base.sample_many(list(zip(mixed, requests)))
    hook.remove()
    assert rows[1] == 18 and min(rows[1:]) <= 9, rows  # the decode started with every row, and rows left it
    for session, request, response in zip(alone, requests, together):
        solo = session.sample(request)
        assert [[s.tokens for s in row] for row in response.sequences] == [[s.tokens for s in row] for row in solo.sequences]
        for row, solo_row in zip(response.sequences, solo.sequences):
            for seq, solo_seq in zip(row, solo_row):
                assert seq.logprobs == pytest.approx(solo_seq.logprobs, abs=1e-5)
    for a, b in zip(mixed, alone):  # each generator left where its own batch would leave it
        assert torch.equal(a.generator.get_state(), b.generator.get_state())


def test_an_exported_session_adapter_is_a_peft_folder_with_the_same_logprobs(tiny, adapters, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    session = _sessions(base, adapters)[1]
    session.export(str(tmp_path / "out"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), str(tmp_path / "out")).eval()
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, :-1].log_softmax(-1)
    expected = [0.0, *logits.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()]
    assert session.logprobs(tokens.tolist())[0] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ConfigError, match="exports its adapter"):
        session.export(str(tmp_path / "merged"), merged=True)


def test_one_sessions_error_fails_its_request_alone(tiny, adapters) -> None:
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=16))
    sessions = _sessions(base, adapters)
    requests = _requests(1)
    base.forward_backward_many(list(zip(sessions, requests)))  # gradients accumulate in every session
    before = [_grads(s) for s in sessions]
    vocab = base.model.config.vocab_size
    out_of_vocab = ForwardBackwardRequest(data=[Datum(tokens=[5, vocab + 7, 6], loss_mask=[0.0, 1.0, 1.0])], loss=LossSpec(name="cross_entropy"))
    outcomes = base.forward_backward_many([(sessions[0], requests[0]), (sessions[1], out_of_vocab), (sessions[2], requests[2])])
    assert isinstance(outcomes[1], Exception) and not isinstance(outcomes[0], Exception) and not isinstance(outcomes[2], Exception)
    after = [_grads(s) for s in sessions]
    assert all(torch.equal(after[1][n], g) for n, g in before[1].items()), "the failing request changed its session's gradients"
    for k in (0, 2):  # the others accumulated their request once more, as they would alone
        for name, grad in before[k].items():
            torch.testing.assert_close(after[k][name], 2 * grad, rtol=1e-5, atol=1e-5)
    # A request refused by its checks never reaches the pass.
    bad = ForwardBackwardRequest(data=[Datum(tokens=[5, 6, 7], loss_mask=[1.0])], loss=LossSpec(name="cross_entropy"))
    outcomes = base.forward_backward_many([(sessions[0], bad), (sessions[1], requests[1])])
    assert isinstance(outcomes[0], ConfigError) and "loss_mask" in str(outcomes[0]) and outcomes[1].metrics["tokens"] > 0


def test_sessions_are_bounded_by_rank_count_and_memory_and_closing_frees_them(tiny) -> None:
    probe = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    one = probe.session_bytes(8)
    assert one == 4 * 4 * 8 * sum(layer.in_features + layer.out_features for layer in probe.layers.values())
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", max_lora_rank=16, max_sessions=3, memory_budget_mb=2.5 * one / 2**20))
    with pytest.raises(ConfigError, match="max_lora_rank 16"):
        base.open_session(LoraSessionConfig(lora_rank=32))
    first, second = base.open_session(), base.open_session()
    assert base.memory()["sessions_bytes"] == 2 * one and base.memory()["base_bytes"] > 0
    with pytest.raises(ConfigError, match=r"needs .* MB .* hold .* MB of this server's .* MB"):
        base.open_session()
    base.close_session(first)
    assert base.memory()["sessions_bytes"] == one and all(first.id not in layer.adapters for layer in base.layers.values())
    with pytest.raises(ConfigError, match="closed"):
        first.sample(SampleRequest(prompts=[[1, 2]]))
    third = base.open_session(LoraSessionConfig(lora_rank=4))
    assert third.id not in (first.id, second.id)
    small = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", max_sessions=1))
    small.open_session()
    with pytest.raises(ConfigError, match="most sessions"):
        small.open_session()


def test_a_session_resumes_from_its_saved_state_bit_for_bit_dropping_pending_gradients(tiny, tmp_path) -> None:
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    request = _requests(2)[0]
    params = OptimParams(learning_rate=1e-2)
    first = base.open_session(LoraSessionConfig(lora_rank=4, seed=3))
    for _ in range(2):
        first.forward_backward(request)
        first.optim_step(params)
    first.save_state(str(tmp_path / "state"))
    first.forward_backward(request)
    first.optim_step(params)
    sampled = first.sample(SampleRequest(prompts=[[3, 4, 5]], params=SamplingParams(max_new_tokens=5)))
    other = base.open_session(LoraSessionConfig(lora_rank=4, seed=77))
    other.forward_backward(_requests(5)[0])  # gradients pending when the state loads: a state holds none, so they go
    other.load_state(str(tmp_path / "state"))
    assert other.step == 2
    other.forward_backward(request)
    other.optim_step(params)
    assert all(torch.equal(p, other.params[n]) for n, p in first.params.items())
    assert other.sample(SampleRequest(prompts=[[3, 4, 5]], params=SamplingParams(max_new_tokens=5))) == sampled
    wrong = base.open_session(LoraSessionConfig(lora_rank=8))
    with pytest.raises(ConfigError, match="other adapter weights"):
        wrong.load_state(str(tmp_path / "state"))


def test_the_prefix_cache_serves_each_sessions_next_turn_from_its_own_keys(tiny, adapters) -> None:
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=4)
    mixed_base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    mixed = _sessions(mixed_base, adapters)
    first = [[11, 12, 13, 14], [20, 21, 22]]
    turn1 = mixed_base.sample_many([(s, SampleRequest(prompts=first, params=params)) for s in mixed])
    # The next turn of each conversation: its prompt, what the session sampled, and a reply.
    second = [[[*p, *row[0].tokens, 30, 31] for p, row in zip(first, r.sequences)] for r in turn1]
    reused = mixed_base.prefix_cache.stats.reused_tokens
    turn2 = mixed_base.sample_many([(s, SampleRequest(prompts=second[k], params=params)) for k, s in enumerate(mixed)])
    assert mixed_base.prefix_cache.stats.reused_tokens - reused >= sum(len(p) for p in first) * len(mixed)
    fresh = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", prefix_cache_mb=0))
    uncached = _sessions(fresh, adapters)
    for k, session in enumerate(uncached):  # keys from the cache give the tokens a full prefill gives
        solo = session.sample(SampleRequest(prompts=second[k], params=params))
        assert [[s.tokens for s in row] for row in solo.sequences] == [[s.tokens for s in row] for row in turn2[k].sequences]
    # A session that steps drops its own entries, and no other's.
    scopes = {e.scope for e in mixed_base.prefix_cache.entries.values()}
    assert scopes == {s.id for s in mixed}
    mixed[0].forward_backward(_requests(3)[1])
    mixed[0].optim_step(OptimParams(learning_rate=1e-2))
    assert {e.scope for e in mixed_base.prefix_cache.entries.values()} == scopes - {mixed[0].id}


def test_a_training_call_in_slices_gives_the_whole_calls_gradients_and_metrics_and_a_failed_one_puts_them_back(tiny, adapters) -> None:
    """``call_slices`` cuts a GRPO-and-KL call into micro-batches; run one slice per pass (each with the whole call's
    normalizers, its sums carried), it gives the gradients and metrics of the call in one go. ``abandon`` after a slice
    puts the session's gradients back as they were before the call."""
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=2))
    sessions = []
    for _ in range(2):
        session = base.open_session(LoraSessionConfig(lora_rank=8, lora_alpha=16.0, seed=8))
        session.load_adapter(adapters[8])
        sessions.append(session)
    sliced, whole = sessions
    grpo, _, kl = _requests(7)
    request = ForwardBackwardRequest(data=grpo.data + kl.data, loss=LossSpec(name="ppo", kl_coef=0.2), return_logprobs=True)
    plan = base.call_slices(sliced, "forward_backward", request)
    assert plan is not None and len(plan.units) >= 3
    while not plan.finished:
        rows, cost = plan.take(0, anyway=True)  # one micro-batch a pass
        assert cost == sum(len(request.data[i].tokens) for i in rows)
        [result] = base.forward_backward_many([(sliced, plan.part(rows))], [plan.carry])
        plan.add(rows, result)
    [alone] = base.forward_backward_many([(whole, request)])
    assert plan.result().metrics == pytest.approx(alone.metrics, rel=1e-5, abs=1e-7)
    for mine, theirs in zip(plan.result().logprobs, alone.logprobs):
        assert mine == pytest.approx(theirs, abs=1e-5)
    done, expected = _grads(sliced), _grads(whole)
    assert done.keys() == expected.keys() and done
    for name in done:
        torch.testing.assert_close(done[name], expected[name], rtol=1e-4, atol=1e-6)

    plan = base.call_slices(sliced, "forward_backward", request)
    rows, _ = plan.take(0, anyway=True)
    base.forward_backward_many([(sliced, plan.part(rows))], [plan.carry])
    assert any(not torch.equal(g, done[n]) for n, g in _grads(sliced).items())
    base.abandon(sliced, plan.carry)
    for name, grad in _grads(sliced).items():
        assert torch.equal(grad, done[name])
    assert base.call_slices(sliced, "forward_backward", ForwardBackwardRequest(data=kl.data[:1], loss=kl.loss)) is None  # one unit
