"""``benchmarks/vllm_sampling.py --quick`` still runs: every side on the tiny model at the CPU's native precision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_vllm_sampling_quick(tiny: str) -> None:
    from tinkergym.backends.torch.runtime import resolve_dtype

    proc = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_sampling.py"), "--quick", "--model", tiny, "--device", "cpu"],
                          capture_output=True, text=True, cwd=BENCHMARKS.parent, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    native = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert report["dtype"] == native and report["machine"]["native_dtype"] == native
    assert report["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    sides = {r["side"]: r for r in report["results"]}
    assert set(sides) == {"vllm", "hf_generate", "torch_backend"}
    assert all(r["dtype"] == native and r["tokens"] == 2 * 2 * 8 and r["tokens_per_s"] > 0 for r in sides.values())
    assert set(report["ratios"]) == {"vllm/hf_generate", "torch_backend/hf_generate", "vllm/torch_backend"}
