"""LoRA sampling from a merged copy (``lora_sampling``): the adapter's results, refreshed with every change of the adapter."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable

import pytest
import torch

from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.copies import MergedLoraCopy
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams
from tinkergym.errors import ConfigError

PROMPTS = [[5, 17, 33, 8, 91], [7, 7, 120, 64, 3, 44, 19], [200, 13]]


def make(tiny: str, lora_sampling: str, dtype: str = "float32", **kwargs: object) -> TorchBackend:
    config = TorchBackendConfig(model=tiny, lora_rank=4, lora_alpha=32.0, dtype=dtype, device="cpu", seed=0, lora_sampling=lora_sampling, **kwargs)
    return TorchBackend(config)


def train(backend: TorchBackend, steps: int = 2) -> None:
    data = [Datum(tokens=p + [9, 21, 4], loss_mask=[0.0] * len(p) + [1.0] * 3, advantages=[1.0 - i] * (len(p) + 3)) for i, p in enumerate(PROMPTS)]
    for _ in range(steps):
        backend.forward_backward(ForwardBackwardRequest(data=data, loss=LossSpec(name="reinforce")))
        backend.optim_step(OptimParams(learning_rate=5e-2))


def sample(backend: TorchBackend, temperature: float = 1.0) -> list:
    params = SamplingParams(max_new_tokens=8, temperature=temperature, seed=3, stop_token_ids=[])
    return [s for group in backend.sample(SampleRequest(prompts=PROMPTS, params=params, num_samples=2)).sequences for s in group]


def assert_same_samples(a: list, b: list, atol: float) -> None:
    assert [s.tokens for s in a] == [s.tokens for s in b]
    for x, y in zip(a, b):
        assert y.logprobs == pytest.approx(x.logprobs, abs=atol)


def test_merged_samples_equal_the_adapters_after_every_step(tiny: str) -> None:
    """Float32: the same tokens and logprobs within rounding, before training and after each optimizer step (the
    copy is refreshed: a stale copy samples from the old adapter, which the trained one visibly is not)."""
    merged, adapter = make(tiny, "merged"), make(tiny, "adapter")
    for step in range(3):
        samples = sample(merged)
        assert isinstance(merged._sampling_copy, MergedLoraCopy) and adapter._sampling_copy is None
        # within float32 rounding: the merged weight (W + s BA) and the adapter's path (Wx + s B(Ax)) round differently;
        # 1.3e-5 at a logprob of -7 after two steps was seen with oneDNN's AMX kernels
        assert_same_samples(sample(adapter), samples, atol=5e-5)
        if step == 0:
            untrained = [s.logprobs for s in samples]
        train(merged, 1)
        train(adapter, 1)
    assert max(abs(a - b) for s, u in zip(samples, untrained) for a, b in zip(s.logprobs, u)) > 1e-2


def test_bfloat16_merged_samples_stay_within_rounding(tiny: str) -> None:
    merged, adapter = make(tiny, "merged", "bfloat16"), make(tiny, "adapter", "bfloat16")
    train(merged)
    train(adapter)
    a, b = sample(adapter, temperature=0.0), sample(merged, temperature=0.0)
    assert sum(x.tokens == y.tokens for x, y in zip(a, b)) >= len(a) - 1  # greedy picks may flip at a near tie
    for x, y in zip(a, b):
        if x.tokens == y.tokens:
            assert y.logprobs == pytest.approx(x.logprobs, abs=0.1)


def test_the_copy_duplicates_only_the_adapted_weights_and_leaves_the_model_alone(tiny: str) -> None:
    backend = make(tiny, "merged")
    train(backend)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    copy = backend._sampling_model()
    assert not any("lora_" in n for n, _ in copy.named_parameters())
    live = {p.data_ptr() for p in backend.model.parameters()}
    adapted = [m.get_base_layer().weight for m in backend.model.modules() if hasattr(m, "lora_A")]
    own = [p for p in copy.parameters() if p.data_ptr() not in live]
    assert len(own) == len(adapted) and sum(p.numel() for p in own) == sum(w.numel() for w in adapted)
    assert all(not p.requires_grad for p in copy.parameters())
    # The live model still trains its adapter, unchanged by building and refreshing the copy.
    assert {n for n, p in backend.model.named_parameters() if p.requires_grad} == trainable
    assert all(torch.equal(p, before[n]) for n, p in backend.model.named_parameters())


def test_adapter_is_the_default_and_other_adapter_states_use_the_live_model(tiny: str) -> None:
    default = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", device="cpu"))
    assert default.config.lora_sampling == "adapter" and default._sampling_model() is default.model
    backend = make(tiny, "merged")
    assert backend._sampling_model() is backend._sampling_copy.model
    with backend.model.disable_adapter():  # the base model (an inference engine's base, the KL reference)
        assert backend._sampling_model() is backend.model
        base = sample(backend)
    train(backend)
    with backend.model.disable_adapter():
        assert_same_samples(sample(backend), base, atol=0.0)
    backend.model.add_adapter("other", backend.model.peft_config["default"])
    backend.model.set_adapter("other")
    assert backend._sampling_model() is backend.model
    assert MergedLoraCopy.build(backend.model) is None  # several adapters: never merged


def test_what_it_cannot_merge_is_left_to_the_adapter(tiny: str) -> None:
    """DoRA (a LoRA variant) and a model without adapters get no merged copy."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny)
    assert MergedLoraCopy.build(plain) is None
    dora = get_peft_model(plain, LoraConfig(r=2, use_dora=True, target_modules=["q_proj", "v_proj"]))
    assert MergedLoraCopy.build(dora) is None
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert isinstance(MergedLoraCopy.build(lora), MergedLoraCopy)


def test_resumed_state_samples_as_the_run_it_resumes(tiny: str, tmp_path: Path) -> None:
    """load_state refreshes a copy built before it: the resumed backend samples what the saving one does."""
    first = make(tiny, "merged")
    train(first)
    first.save_state(str(tmp_path / "state"))
    second = make(tiny, "merged")
    sample(second)  # builds the copy from the untrained adapter
    second.load_state(str(tmp_path / "state"))
    assert_same_samples(sample(second), sample(first), atol=0.0)


def test_lora_sampling_is_validated() -> None:
    with pytest.raises(ConfigError, match="lora_sampling"):
        TorchBackendConfig(lora_sampling="fused")


def test_train_passes_it_to_the_backend_and_records_it(tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from click.testing import CliRunner

    from tinkergym.backends.torch import backend as torch_backend
    from tinkergym.cli import main

    built: list[str] = []
    real = torch_backend.TorchBackend

    def recording(config: TorchBackendConfig) -> TorchBackend:
        built.append(config.lora_sampling)
        return real(config)

    monkeypatch.setattr(torch_backend, "TorchBackend", recording)
    out = tmp_path / "run"
    args = ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--steps", "1", "--batch-size", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--lora-sampling", "merged", "--quiet", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert built == ["merged"] and json.loads((out / "config.json").read_text())["lora_sampling"] == "merged"
    bad = CliRunner().invoke(main, [*args[:-2], "--lora-sampling", "fused", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "fused" in bad.output


@pytest.mark.parametrize("option", [["--lora-sampling", "merged"], ["--prefix-cache-mb", "0"]])
def test_train_refuses_server_owned_options_beside_a_training_server(option: list[str]) -> None:
    """Refused whatever their value: a 0 is an option given too."""
    from click.testing import CliRunner

    from tinkergym.cli import main

    result = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--backend-url", "http://127.0.0.1:9", *option, "--quiet"])
    assert result.exit_code == 2 and option[0] in result.output and "serve backend" in result.output


def test_serve_backend_passes_it(serve_backend_config: Callable[..., TorchBackendConfig]) -> None:
    assert serve_backend_config().lora_sampling == "adapter"
    assert serve_backend_config("--lora-sampling", "merged").lora_sampling == "merged"
