"""Gradient checkpointing: same metrics and gradients as without it, shared prompts still shared, and the setting kept by runs."""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable

import pytest
import torch

from testkit import datum  # registered by tests/conftest.py

from tinkergym.backends.torch import backend as torch_backend
from tinkergym.backends.models import build_tiny_model
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.scoring import plan_micro_batches
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec

PPO_KL = LossSpec(name="ppo", clip_low=0.1, clip_high=0.3, kl_coef=0.1, aggregation="token")


def grouped_batch() -> list[Datum]:
    """Groups of samples on prompts of 9, 4 and 6 tokens (completions of different lengths), plus one lone sequence."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=gen).tolist()

    data = []
    for g, length in enumerate((9, 4, 6)):
        prompt = ids(length)
        for k in range(2 + g % 2):
            data.append(datum(prompt, ids(2 + (3 * k + g) % 5), advantage=(-1.0) ** k * (0.5 + k), shift=0.1 * k))
    data.insert(2, datum(ids(4), ids(5), advantage=1.5, shift=0.2))
    return data


def make_backend(model: str, lora_rank: int, share: bool, checkpointing: bool) -> TorchBackend:
    config = TorchBackendConfig(model=model, lora_rank=lora_rank, dtype="float32", seed=0, share_prefixes=share, gradient_checkpointing=checkpointing)
    backend = TorchBackend(config)
    if lora_rank:  # a non-zero adapter, so the KL term and the adapter's gradient path both count
        with torch.no_grad():
            for name, param in backend.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    return backend


def train_once(backend: TorchBackend) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    metrics = backend.forward_backward(ForwardBackwardRequest(data=grouped_batch(), loss=PPO_KL)).metrics
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad and p.grad is not None}
    return metrics, grads


def assert_checkpointing_changes_nothing(model: str, lora_rank: int, share: bool) -> dict[str, float]:
    (plain_metrics, plain_grads), (checked_metrics, checked_grads) = (
        train_once(make_backend(model, lora_rank, share, checkpointing)) for checkpointing in (False, True)
    )
    assert checked_metrics.keys() == plain_metrics.keys()
    for key, value in plain_metrics.items():
        assert checked_metrics[key] == pytest.approx(value, abs=1e-5), key
    trainable = {n for n, p in make_backend(model, lora_rank, share, False).model.named_parameters() if p.requires_grad}
    assert checked_grads.keys() == plain_grads.keys() == trainable
    for name, grad in plain_grads.items():
        assert torch.allclose(checked_grads[name], grad, atol=1e-5, rtol=0), name
    return checked_metrics


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("lora_rank", [4, 0])
def test_checkpointing_gives_the_same_metrics_and_gradients(tiny: str, lora_rank: int, share: bool, length_passes: str) -> None:
    assert any(m.group_sizes for m in plan_micro_batches(grouped_batch(), 8, share)) == share
    metrics = assert_checkpointing_changes_nothing(tiny, lora_rank, share)
    assert lora_rank == 0 or metrics["kl"] > 0


@pytest.mark.parametrize(
    "layout",
    {
        "qwen2-sliding": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0},
        "gemma3-hybrid": {"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
        "llama4-chunked": {"model_type": "llama4_text", "head_dim": 16, "intermediate_size_mlp": 128, "num_local_experts": 1, "moe_layers": [],
                           "attention_chunk_size": 5, "no_rope_layers": [1, 1]},
    }.items(),
    ids=lambda item: item[0],
)
def test_checkpointing_keeps_shared_prompts_exact_on_windowed_layouts(tmp_path: Path, layout: tuple[str, dict]) -> None:
    """Sliding-window cache layers keep only their window: a layer's recompute must still see what its forward saw."""
    name, overrides = layout
    model = build_tiny_model(tmp_path / name, **overrides)
    assert_checkpointing_changes_nothing(model, lora_rank=4, share=True)


def decoder_tokens_run(backend: TorchBackend) -> list[int]:
    """Tokens (rows x columns) of each call of the first decoder layer's MLP during one ``forward_backward``."""
    calls: list[int] = []
    layer = next(m for m in backend.model.modules() if type(m).__name__.endswith("DecoderLayer"))
    # A pre-hook: the backward pass may stop a recompute as soon as it has what it needs, before the MLP returns.
    handle = layer.mlp.register_forward_pre_hook(lambda _module, args: calls.append(args[0].shape[0] * args[0].shape[1]))
    try:
        backend.forward_backward(ForwardBackwardRequest(data=grouped_batch(), loss=LossSpec(name="importance_sampling")))
    finally:
        handle.remove()
    return calls


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_checkpointing_recomputes_layers_and_still_shares_prompts(tiny: str, lora_rank: int) -> None:
    shared, unshared = (decoder_tokens_run(make_backend(tiny, lora_rank, share, False)) for share in (True, False))
    checked = decoder_tokens_run(make_backend(tiny, lora_rank, True, True))
    assert sum(shared) < sum(unshared)  # prompts run once per group
    # Every pass runs again in the backward pass (prompts, rows on their cache, the lone sequence), none grows.
    assert sorted(checked) == sorted(shared + shared)
    info = make_backend(tiny, lora_rank, True, True).info()
    assert info["gradient_checkpointing"] is True


def test_checkpointing_is_off_outside_training(tiny: str) -> None:
    """Sampling and scoring run in eval mode and recompute nothing."""
    backend = make_backend(tiny, 4, True, True)
    layer = next(m for m in backend.model.modules() if type(m).__name__.endswith("DecoderLayer"))
    calls: list[int] = []
    layer.mlp.register_forward_pre_hook(lambda _module, args: calls.append(1))
    backend.logprobs([[5, 6, 7, 8]])
    assert calls == [1]


def test_run_records_checkpointing_and_resume_keeps_it(tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from tinkergym.cli import main

    enabled: list[str] = []
    enable = torch_backend.enable_gradient_checkpointing
    monkeypatch.setattr(torch_backend, "enable_gradient_checkpointing", lambda model: (enabled.append(type(model).__name__), enable(model)))
    out = tmp_path / "run"
    args = ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--steps", "1", "--batch-size", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--checkpoint-every", "1", "--gradient-checkpointing", "--quiet", "--out", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["gradient_checkpointing"] is True
    assert len(enabled) == 1
    result = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", "2", "--quiet"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(enabled) == 2 and json.loads((out / "config.json").read_text())["gradient_checkpointing"] is True


def test_train_config_round_trips_the_setting(tmp_path: Path) -> None:
    from tinkergym.config import TrainConfig

    assert TrainConfig().gradient_checkpointing is False
    config = TrainConfig.from_dict({"gradient_checkpointing": True})
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))).gradient_checkpointing is True


def test_train_refuses_checkpointing_beside_a_training_server() -> None:
    from click.testing import CliRunner

    from tinkergym.cli import main

    args = ["train", "--env", "tinker/Bandit-v0", "--backend-url", "http://127.0.0.1:9", "--gradient-checkpointing", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "--gradient-checkpointing" in result.output and "serve backend" in result.output


def test_serve_backend_passes_the_flag(serve_backend_config: Callable[..., TorchBackendConfig]) -> None:
    assert serve_backend_config().gradient_checkpointing is False
    assert serve_backend_config("--gradient-checkpointing").gradient_checkpointing is True
