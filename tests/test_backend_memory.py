"""Memory of the torch backend: frozen compute-dtype copies, merged export on the host, KV caches in the compute
dtype, micro-batches that count the copies of shared prompts, logprobs micro-batched by tokens. Every change is
checked against what the code computed before it, to the bit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tinkergym.backends.torch_backend import TorchBackend, TorchBackendConfig, _sampling_copy  # noqa: E402
from tinkergym.backends.torch_sampling import prefill  # noqa: E402
from tinkergym.backends.torch_scoring import MicroBatch  # noqa: E402
from tinkergym.backends.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams  # noqa: E402


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
    new = _sampling_copy(backend.model, backend.dtype)
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
        sampler = backend._sampling_copy
        backend._sampling_copy = old_sampling_copy(backend.model, backend.dtype)
        old = backend.sample(request)
        backend._sampling_copy = sampler
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
