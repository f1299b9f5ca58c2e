"""Memory of the torch backend: frozen compute-dtype copies, merged export on the host, KV caches in the compute
dtype, micro-batches that count the copies of shared prompts, logprobs micro-batched by tokens. Every change is
checked against what the code computed before it, to the bit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig, sampling_copy
from tinkergym.backends.torch.sampling import prefill
from tinkergym.backends.torch.scoring import MicroBatch
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams
from torch.utils._python_dispatch import TorchDispatchMode


def make(tiny: str, lora_rank: int = 0, dtype: str = "bfloat16", **kwargs: object) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model=tiny, lora_rank=lora_rank, dtype=dtype, device="cpu", **kwargs))


def train_step(backend: TorchBackend, kl_coef: float = 0.0) -> dict[str, float]:
    data = [Datum(tokens=[1, 5, 9, 4, 7, 3], loss_mask=[0, 0, 1, 1, 1, 1], advantages=[0, 0, 1, 1, 1, 1])]
    metrics = backend.forward_backward(ForwardBackwardRequest(data, LossSpec(name="reinforce", kl_coef=kl_coef))).metrics
    backend.optim_step(OptimParams(learning_rate=1e-2))
    return metrics


def old_sampling_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The sampling copy as it was made before: a whole deepcopy, then the linear layers converted."""
    sampler = copy.deepcopy(model).eval().requires_grad_(False)
    head = sampler.get_output_embeddings()
    if head is not None and head.weight is sampler.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().to(dtype), requires_grad=False)
    for module in sampler.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(dtype)
    return sampler


def test_sampling_copy_equals_the_old_one_and_duplicates_only_the_low_precision_weights(tiny: str) -> None:
    backend = make(tiny)
    train_step(backend)
    old = old_sampling_copy(backend.model, backend.dtype)
    new = sampling_copy(backend.model, backend.dtype)
    old_params = dict(old.named_parameters(remove_duplicate=False))
    new_params = dict(new.named_parameters(remove_duplicate=False))
    assert old_params.keys() == new_params.keys()
    for name, param in new_params.items():
        assert param.dtype == old_params[name].dtype and torch.equal(param, old_params[name]) and not param.requires_grad, name
    # Weights kept in float32 are the policy's own tensors; every new tensor is in bfloat16.
    sources = {p.data_ptr() for p in backend.model.parameters()}
    assert all(p.dtype == torch.bfloat16 for p in new.parameters() if p.data_ptr() not in sources)
    assert any(p.data_ptr() in sources for p in new.parameters())
    assert all(p.requires_grad for p in backend.model.parameters())  # the shared weights still train


def test_sampling_after_steps_repeats_the_old_copy_exactly(tiny: str) -> None:
    backend = make(tiny)
    request = SampleRequest(prompts=[[1, 2, 3, 4], [5, 6, 7]], num_samples=3, params=SamplingParams(max_new_tokens=10, seed=3))
    for _ in range(2):
        train_step(backend)
        new = backend.sample(request)
        sampler = backend._sampling_copy.model
        backend._sampling_copy.model = old_sampling_copy(backend.model, backend.dtype)
        old = backend.sample(request)
        backend._sampling_copy.model = sampler
        assert new == old


def test_frozen_copies_keep_their_kv_cache_in_the_compute_dtype(tiny: str) -> None:
    backend = make(tiny)
    with torch.no_grad(), backend._compute():
        _, cache, *_ = prefill(backend._sampling_model(), [[1, 2, 3], [1, 2, 3], [4, 5]], backend.pad_id, backend.device, True)
    assert all(layer.keys.dtype == layer.values.dtype == torch.bfloat16 for layer in cache.layers)


def test_kl_reference_is_a_compute_dtype_copy_with_the_old_results(tiny: str) -> None:
    backend = make(tiny)
    metrics = train_step(backend, kl_coef=0.1)
    reference = backend._reference
    assert {p.dtype for n, p in reference.named_parameters() if "proj" in n or "lm_head" in n} == {torch.bfloat16}
    batch = backend._collate([Datum(tokens=[1, 5, 9, 4, 7, 3, 2], loss_mask=[0, 0, 0, 1, 1, 1, 1])])
    micro = MicroBatch([0])
    new = backend._reference_logprobs(batch, micro, 0.7)
    backend._reference = backend._load_base(torch.float32).eval().requires_grad_(False)  # what it was before
    old = backend._reference_logprobs(batch, micro, 0.7)
    assert torch.equal(new, old)
    # The first step's KL metric (policy == reference) is the same either way.
    again = make(tiny)
    again._reference = again._load_base(torch.float32).eval().requires_grad_(False)
    assert train_step(again, kl_coef=0.1) == metrics


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_merged_export_is_bit_for_bit_the_old_one(tiny: str, tmp_path: Path, dtype: str) -> None:
    from safetensors.torch import load_file

    backend = make(tiny, lora_rank=4, dtype=dtype)
    train_step(backend)
    train_step(backend)
    backend.export(str(tmp_path / "new"), merged=True)
    copy.deepcopy(backend.model).merge_and_unload().save_pretrained(tmp_path / "old")  # the export before
    new, old = load_file(tmp_path / "new" / "model.safetensors"), load_file(tmp_path / "old" / "model.safetensors")
    assert new.keys() == old.keys()
    assert all(new[n].dtype == old[n].dtype and torch.equal(new[n], old[n]) for n in new)
    assert (tmp_path / "new" / "model.safetensors").read_bytes() == (tmp_path / "old" / "model.safetensors").read_bytes()
    base = backend.model.get_base_model().state_dict()
    assert not torch.equal(new["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.base_layer.weight"])


# ----- micro-batches ----------------------------------------------------------------------------------
def group_batch() -> list[Datum]:
    """Two GRPO-like groups: a 9-token and a 5-token prompt, four completions each, advantages of both signs."""
    data = []
    for g, prompt in enumerate(([3, 14, 15, 92, 65, 35, 89, 79, 32], [38, 46, 26, 43, 38])):
        for k, n in enumerate((3, 5, 2, 4)):
            tokens = prompt + [(7 * g + 11 * k + 13 * t) % 500 + 4 for t in range(n)]
            data.append(Datum(tokens=tokens, loss_mask=[0.0] * len(prompt) + [1.0] * n, advantages=[(-1.0) ** k * (0.5 + 0.1 * k)] * len(tokens)))
    return data


def test_plan_counts_the_copies_of_shared_prompts() -> None:
    from tinkergym.backends.torch.scoring import plan_micro_batches

    data = group_batch()
    # Budget 4 x 14 = 56 tokens. Without the copies both groups fit: 8 + 4 + 6 + 3 + 5 and 4 + 4 + 6 + 3 + 5.
    assert plan_micro_batches(data, 4) == [MicroBatch(list(range(8)), [4, 4], [9, 5])]
    # With them each row also holds the 8 cached prompt positions (the 4 of the second prompt padded to 8):
    # the first group's fourth row makes 26 + 4 x 8 = 58 > 56.
    plan = plan_micro_batches(data, 4, kv_cost=1.0)
    assert plan == [MicroBatch([0, 1, 2], [3], [9]), MicroBatch([3, 4, 5], [1, 2], [9, 5]), MicroBatch([6, 7], [2], [5])]
    for micro in plan:
        shared = [p - 1 for p, size in zip(micro.prefix_lens, micro.group_sizes) for _ in range(size)]
        own = sum(len(data[i].tokens) - s for i, s in zip(micro.indices, shared))
        assert sum(p - 1 for p in micro.prefix_lens) + own + len(micro.indices) * max(shared) <= 56
    assert plan_micro_batches(data, 4, kv_cost=0.25) == [MicroBatch([0, 1, 2, 3, 4, 5], [4, 2], [9, 5]), MicroBatch([6, 7], [2], [5])]


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_forward_backward_is_the_same_with_the_copies_counted(tiny: str, lora_rank: int) -> None:
    from tinkergym.backends.torch.scoring import plan_micro_batches

    request = ForwardBackwardRequest(group_batch(), LossSpec(name="reinforce", kl_coef=0.1))
    results = []
    for kv_cost in (0.0, 1.0):
        backend = make(tiny, lora_rank=lora_rank, dtype="float32", micro_batch_size=4)
        backend.plan = lambda data, share_prefixes=None, b=backend, kv_cost=kv_cost: plan_micro_batches(data, 4, True, kv_cost)
        metrics = backend.forward_backward(request).metrics
        results.append((len(backend.plan(request.data)), metrics, {n: p.grad.clone() for n, p in backend._trainable}))
    (n_old, old, old_grads), (n_new, new, new_grads) = results
    assert (n_old, n_new) == (1, 3)
    # Exact up to floating-point summation order (micro-batches add their gradients in another order).
    assert new.keys() == old.keys() and new == pytest.approx(old, rel=1e-5, abs=1e-6)
    for name, grad in new_grads.items():
        assert torch.allclose(grad, old_grads[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("dims", [(64, 176, 4, 2), (576, 1536, 9, 3), (896, 4864, 14, 2), (64, 128, 4, 4)])
def test_the_backend_counts_copies_at_what_they_cost(dims: tuple[int, int, int, int], lora: bool) -> None:
    # What a KV copy position costs against what autograd really keeps per token: never less (the planner
    # must not overfill a micro-batch), and not so much more that groups of samples get split for nothing.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tinkergym.backends.torch.backend import kv_token_cost

    hidden, intermediate, heads, kv_heads = dims
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         num_hidden_layers=2, vocab_size=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")) if lora else model.requires_grad_(True)
    storages: dict[int, int] = {}

    def keep(saved: torch.Tensor) -> torch.Tensor:
        storages[saved.untyped_storage().data_ptr()] = saved.untyped_storage().nbytes()
        return saved

    ids = torch.randint(0, 256, (4, 64))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda saved: saved):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    per_token = sum(storages.values()) / ids.numel()
    copy_position = 2 * 4 * kv_heads * (hidden // heads) * 4  # keys, values and their gradients, float32, 2 layers
    measured = copy_position / per_token
    assert measured <= kv_token_cost(config) <= 10 * measured


def old_logprobs(backend: TorchBackend, sequences: list[list[int]], chunk: int) -> list[list[float]]:
    """``logprobs`` as it was: chunks of ``max_sample_batch`` sequences, read back per chunk."""
    from tinkergym.backends.torch.scoring import logprobs_from

    out = []
    with torch.no_grad():
        for start in range(0, len(sequences), chunk):
            batch = backend._collate([Datum(tokens=s, loss_mask=[0.0] * len(s)) for s in sequences[start : start + chunk]])
            with backend._compute():
                logprobs = logprobs_from(backend.model, batch.tokens, batch.attention)
            out.extend(row[:n] for row, n in zip(logprobs.tolist(), batch.lengths))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_use_the_training_budget_and_do_not_depend_on_it(tiny: str, dtype: str) -> None:
    backend = make(tiny, lora_rank=0, dtype=dtype)
    sequences = [[(5 * i + 3 * t) % 700 + 4 for t in range(n)] for i, n in enumerate((7, 2, 13, 1, 9, 4, 11))]
    expected = old_logprobs(backend, sequences, 64)
    for size in (1, 2, 3, 8):
        backend.config.micro_batch_size = size
        assert len(backend.plan([Datum(s, [0.0] * len(s)) for s in sequences], share_prefixes=False)) == -(-len(sequences) // size)
        got = backend.logprobs(sequences)
        assert [len(row) for row in got] == [len(s) for s in sequences]
        for row, want in zip(got, expected):  # the same up to the kernels' summation order in other batch shapes
            assert row == pytest.approx(want, abs=1e-5), size
    assert backend.logprobs([]) == []


@pytest.mark.parametrize("checkpointing", [False, True])
def test_full_fine_tuning_copies_shared_prompts_in_the_compute_dtype(tiny: str, checkpointing: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Float32 masters under bfloat16 autocast: the per-row copies of a prompt's KV cache are bfloat16 (half the
    # memory), and the pass scores and trains as the unshared one does.
    from transformers import DynamicCache

    copied: list[set[torch.dtype]] = []
    select = DynamicCache.batch_select_indices

    def spy(cache: DynamicCache, indices: torch.Tensor) -> None:
        copied.append({t.dtype for layer in cache.layers for t in (layer.keys, layer.values)})
        return select(cache, indices)

    monkeypatch.setattr(DynamicCache, "batch_select_indices", spy)
    request = ForwardBackwardRequest(group_batch(), LossSpec(name="reinforce"))
    results = {}
    for share in (True, False):
        backend = make(tiny, lora_rank=0, dtype="bfloat16", share_prefixes=share, gradient_checkpointing=checkpointing)
        assert backend.param_dtype == torch.float32
        results[share] = (backend.forward_backward(request).metrics["loss"], torch.cat([p.grad.flatten() for _, p in backend._trainable]))
    assert copied and all(dtypes == {torch.bfloat16} for dtypes in copied)
    (shared_loss, shared_grad), (plain_loss, plain_grad) = results[True], results[False]
    assert shared_loss == pytest.approx(plain_loss, rel=2e-2)
    assert torch.nn.functional.cosine_similarity(shared_grad, plain_grad, dim=0) > 0.99


class WeightCasts(TorchDispatchMode):
    """Counts, per float32 weight of ``model``, the casts of it to bfloat16 that reach the kernels (autocast's included)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.owners = {p.untyped_storage().data_ptr() for p in model.parameters() if p.dtype == torch.float32}
        self.counts: dict[int, int] = {}  # by the weight's storage: a tied output layer is its embedding

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        source = args[0] if args else None
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16 and isinstance(source, torch.Tensor):
            storage = source.untyped_storage().data_ptr()
            if storage in self.owners:
                self.counts[storage] = self.counts.get(storage, 0) + 1
        return func(*args, **kwargs)


def test_full_fine_tuning_casts_each_master_weight_once_per_pass(tiny: str) -> None:
    """Autocast's casts of the float32 masters live for the whole forward_backward, not one micro-batch each."""
    backend = make(tiny, micro_batch_size=1)
    data = group_batch()
    assert len(backend.plan(data)) >= 4
    with WeightCasts(backend.model) as casts:
        backend.forward_backward(ForwardBackwardRequest(data, LossSpec(name="reinforce")))
    linear = {m.weight.untyped_storage().data_ptr() for m in backend.model.modules() if isinstance(m, torch.nn.Linear)}
    assert linear <= set(casts.counts)  # every linear layer's weight was cast, and seen here
    assert max(casts.counts.values()) == 1, casts.counts
    for p in backend.model.parameters():  # and the gradients reached every weight
        assert p.grad is not None


def _resident_mib() -> float:
    from tinkergym.backends.torch.runtime import resident_bytes

    resident = resident_bytes()
    assert resident is not None
    return resident / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident memory from /proc")
def test_freed_tensors_memory_goes_back_to_the_system() -> None:
    """glibc keeps the memory of freed tensors of up to 32 MiB in its heap: resident, though nothing uses it, until it is
    released."""
    from tinkergym.backends.torch.runtime import release_free_memory

    if not release_free_memory():
        pytest.skip("the C library has no malloc_trim")
    first = torch.ones(2**18)  # a MiB mapped and unmapped: glibc serves tensors of this size from its heap from now on
    del first
    held = [torch.ones(2**18) for _ in range(400)]
    before = _resident_mib()
    del held[::2]  # 200 MiB freed between tensors still in use: the heap cannot shrink from its top
    kept = _resident_mib()
    release_free_memory()
    assert kept > before - 50, "freed heap memory stayed resident until it was released"
    assert _resident_mib() < kept - 120
    assert all(t.sum().item() == 2**18 for t in held)  # what is still in use is untouched


def test_the_backends_release_memory_when_sampling_turns_to_training_and_back(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tinkergym.backends.torch import runtime
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig

    released: list[int] = []
    monkeypatch.setattr(runtime, "release_free_memory", lambda: released.append(1) or True)
    request = SampleRequest(prompts=[[1, 5, 9]], params=SamplingParams(max_new_tokens=3, temperature=0.0))
    backend = make(tiny, lora_rank=4, dtype="float32")
    backend.sample(request)
    backend.sample(request)
    assert released == []  # passes of one phase reuse each other's memory
    train_step(backend)
    train_step(backend)
    assert len(released) == 1
    backend.sample(request)
    assert len(released) == 2 and backend.phase_memory.releases == 2

    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32"))
    sessions = [base.open_session(LoraSessionConfig(lora_rank=4, seed=i)) for i in range(2)]
    base.sample_many([(s, request) for s in sessions])
    data = [Datum(tokens=[1, 5, 9, 4, 7, 3], loss_mask=[0, 0, 1, 1, 1, 1], advantages=[0, 0, 1, 1, 1, 1])]
    base.forward_backward_many([(s, ForwardBackwardRequest(data, LossSpec(name="reinforce"))) for s in sessions])
    assert len(released) == 3 and base.phase_memory.releases == 1
    base.sample_many([(s, request) for s in sessions])
    assert len(released) == 4


def test_a_phase_releases_when_its_passes_have_crept_past_the_first_ones_level(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinkergym.backends.torch import runtime

    resident = [0]
    released: list[int] = []
    monkeypatch.setattr(runtime, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(runtime, "release_free_memory", lambda: released.append(resident[0]) or True)
    memory = runtime.PhaseMemory(slack=0.1, min_slack=100)
    memory.enter("train")
    for after in (3000, 3100, 3250, 3300):  # the first pass sets the level; within 10% of it, nothing is released
        resident[0] = after
        memory.passed("train")
    assert released == []
    resident[0] = 3301  # past the training level by more than 10%
    memory.passed("train")
    assert released == [3301] and memory.level == {}
    resident[0] = 500  # after the release each phase's next pass sets its level anew (100 above it at least)
    memory.passed("sample")
    resident[0] = 1000
    memory.passed("train")
    resident[0] = 1100
    memory.passed("train")
    assert released == [3301]
    resident[0] = 1101
    memory.passed("train")
    memory.enter("train")  # the same phase again: no release
    assert released == [3301, 1101]
    memory.passed("train")
    memory.enter("sample")
    assert released == [3301, 1101, 1101] and memory.releases == 3


def test_a_pass_larger_than_those_before_it_releases_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinkergym.backends.torch import runtime
    from tinkergym.backends.torch.scoring import MicroBatch

    released: list[int] = []
    monkeypatch.setattr(runtime, "resident_bytes", lambda: None)
    monkeypatch.setattr(runtime, "release_free_memory", lambda: released.append(1) or True)
    memory = runtime.PhaseMemory(slack=0.1)
    memory.enter("train")
    for size in (1300, 1000, 1430):  # within 10% of the largest so far
        memory.passing("train", size)
    memory.passing("sample", 5000)  # the other phase's passes are measured against its own
    assert released == []
    memory.passing("train", 1431 + 143)  # past the largest by more than 10%: the smaller passes' pieces go first
    assert released == [1] and memory.largest == {"train": 1574}
    memory.passing("train", 1574)
    assert released == [1]
    data = [Datum(tokens=list(range(n)), loss_mask=[1] * n) for n in (10, 12, 7)]
    assert MicroBatch([0, 1, 2]).tokens(data) == 29
    assert MicroBatch([0, 1, 2], group_sizes=[2, 1], prefix_lens=[5, 3]).tokens(data) == 29 - 4  # the shared prompt runs once
