"""``serve backend`` refuses, before any weight loads, a model whose weights, gradients and Adam state alone exceed a device
(tinkergym.backends.torch.sizing): exit code 2, one line with the figures and what to change."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tinkergym.backends.torch.backend import TorchBackendConfig  # noqa: E402
from tinkergym.cli.serve.backend import check_memory  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402


@pytest.mark.slow
def test_a_model_that_cannot_fit_its_device_is_refused_with_the_figures(tiny: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "tinkergym", "serve", "backend", "--model", tiny, "--full", "--dtype", "float32",
                           "--device", "cpu", "--token-file", str(token), "--run-dir", str(tmp_path / "run"), "--port", "29998",
                           "--device-memory-gb", "0.0001"], capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert "needs about" in lines[0] and "per device" in lines[0] and "LoRA instead of full fine-tuning" in lines[0], lines[0]
    assert not (tmp_path / "run" / "server.log").exists() or "call" not in (tmp_path / "run" / "server.log").read_text()


def test_the_check_passes_what_fits_and_skips_a_cpu_without_a_figure(tiny: str) -> None:
    full = TorchBackendConfig(model=tiny, lora_rank=0, dtype="float32", device="cpu")
    check_memory(full, 1, 1.0)  # a GiB holds the tiny model's weights, gradients and moments
    check_memory(full, 1, None)  # a CPU has no figure to check against
    with pytest.raises(ConfigError, match="per device"):
        check_memory(full, 1, 1e-5)
    check_memory(TorchBackendConfig(model=tiny, lora_rank=8, dtype="float32", device="cpu"), 2, 0.01)  # LoRA, 2 ranks: small


def test_the_check_counts_a_vision_language_models_vision_tower(tiny_vlm: str) -> None:
    """The tiny Qwen2-VL in full fine-tuning: its vision tower's weights take 16 bytes each (weights, gradients, two
    moments in float32) in the figure checked; a device short of the tower's share is refused."""
    from transformers import AutoConfig

    from tinkergym.backends.torch.sizing import model_shape, shape_dict, static_estimate

    shape = model_shape(AutoConfig.from_pretrained(tiny_vlm))
    assert shape.vision_params > 0
    needed = static_estimate(shape_dict(shape), lora_rank=0, dtype="float32", ranks=1, device="cpu").per_rank
    full = TorchBackendConfig(model=tiny_vlm, lora_rank=0, dtype="float32", device="cpu")
    check_memory(full, 1, needed * 1.001 / 0.9 / 2**30)  # 0.9: check_fits's headroom
    with pytest.raises(ConfigError, match="per device"):
        check_memory(full, 1, (needed - 16 * shape.vision_params) * 1.001 / 0.9 / 2**30)
