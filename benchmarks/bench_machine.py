"""Machine facts for the benchmarks: the device, its measured matmul rate, GPU memory, cores used by others, model weights.

Imported by the scripts in this folder (run as ``python benchmarks/<script>.py``, which puts this folder on
``sys.path``).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def has_weights(folder: str) -> bool:
    """Whether a model folder holds weights (safetensors or torch files, single or sharded)."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in WEIGHT_FILES)


def random_model(folder: str, seed: int, dest: str) -> str:
    """Write the model of ``folder``'s ``config.json`` with weights drawn with ``seed`` (float32) into ``dest``, with ``folder``'s other files."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest)
    for name in os.listdir(folder):  # tokenizer files, chat template, generation config
        if name != "config.json" and os.path.isfile(os.path.join(folder, name)):
            shutil.copy2(os.path.join(folder, name), os.path.join(dest, name))
    return dest


def resolve_device(name: str) -> str:
    """``auto`` -> cuda when torch sees a GPU, else cpu; ``cuda`` without a GPU is an error."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU here")
    return name


def sync(device: str) -> None:
    """Wait for the GPU's queued work (a no-op on a CPU), so that wall times cover it."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def device_extra(device: str) -> dict[str, Any]:
    """The worker's GPU name and peak GPU memory (allocated and reserved by torch's caching allocator)."""
    if device != "cuda":
        return {"device": device}
    import torch

    return {
        "device": device, "gpu_name": torch.cuda.get_device_name(),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(), "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def matmul_rate(device: str, rounds: int = 5) -> dict[str, Any]:
    """The best rate of ``rounds`` timed rounds of square bfloat16 matmuls on ``device`` (about a second in all)."""
    import torch

    n = 8192 if device == "cuda" else 4096
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    flops = 2.0 * n**3
    for _ in range(2):  # warm-up: library initialization, kernel choice
        a @ b
    sync(device)
    start = time.perf_counter()
    a @ b
    sync(device)
    per_round = min(max(1, int(0.2 / max(time.perf_counter() - start, 1e-6))), 1000)  # rounds of about 0.2 s
    best = 0.0
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        for _ in range(per_round):
            a @ b
        sync(device)
        best = max(best, flops * per_round / (time.perf_counter() - start))
    out = {"matmul_flops": best, "matmul_n": n, "matmul_dtype": "bfloat16", "device": device}
    if device == "cuda":
        out["gpu_name"] = torch.cuda.get_device_name()
    return out


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class CpuShare:
    """Cores used by this process and by every other process between ``start()`` and ``stop()`` (from /proc/stat).

    ``other_cores`` near 0 means the measurement had the machine to itself; the load average alone cannot
    say that, since it counts this process too.
    """

    def __init__(self) -> None:
        self.start()

    @staticmethod
    def _snapshot() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, usage.ru_utime + usage.ru_stime, usage.ru_stime

    def start(self) -> None:
        """Begin a measurement window."""
        self._begin = self._snapshot()

    def stop(self) -> dict[str, float]:
        """``self_cores`` (of which ``self_sys_cores`` in the kernel) and ``other_cores``, averaged over the window."""
        wall, busy, own, sys_ = (b - a for a, b in zip(self._begin, self._snapshot()))
        wall = max(wall, 1e-9)
        return {"self_cores": own / wall, "self_sys_cores": sys_ / wall, "other_cores": max(busy - own, 0.0) / wall}
