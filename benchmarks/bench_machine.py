"""Machine facts for the benchmarks: the device, its measured matmul rate, GPU memory, cores used by others, model weights.

Imported by the scripts in this folder (run as ``python benchmarks/<script>.py``, which puts this folder on
``sys.path``).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from tinkergym.backends.torch.machine import (  # noqa: F401 - the benchmarks import these from here
    ISA_CAPS, CpuShare, cpu_facts, describe, load_average, machine_facts, matmul_rate, matmul_size, native_dtype, sync,
)

_load = load_average

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def device_extra(device: str) -> dict[str, Any]:
    """The worker's GPU name and peak GPU memory (allocated and reserved by torch's caching allocator)."""
    if device != "cuda":
        return {"device": device}
    import torch

    return {
        "device": device, "gpu_name": torch.cuda.get_device_name(),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(), "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def resolve_precision(name: str, device: str) -> str:
    """``auto`` -> :func:`native_dtype`; any other name is kept (``bfloat16``, ``float32``)."""
    return native_dtype(device) if name == "auto" else name


def emulation_cost(side: str, dtype: str, native: str, rate: float, float32_rate: float) -> str | None:
    """The warning for ``side`` forced into ``dtype`` where the device's native precision is ``native``, naming the cost
    from the measured matmul rates (``dtype``'s and float32's, FLOP/s); None where ``dtype`` is native or float32."""
    if dtype in ("float32", native) or rate >= float32_rate:
        return None
    slower = float32_rate / max(rate, 1e-9)
    return (f"warning: {side} runs in {dtype}, which this device does not compute natively (tinkergym's auto picks {native}): "
            f"its matmuls measured {rate / 1e9:.1f} GFLOP/s against {float32_rate / 1e9:.1f} GFLOP/s in float32, {slower:.0f}x slower; "
            f"expect that side to take up to {slower:.0f}x as long (--dtype auto runs it at the native precision)")


def emulation_warning(side: str, dtype: str, device: str, seconds: float = 0.5) -> str | None:
    """:func:`emulation_cost` with both rates measured here (about ``seconds`` each), or None without measuring."""
    native = native_dtype(device)
    if dtype in ("float32", native):
        return None
    rate, float32_rate = (matmul_rate(device, d, seconds)["matmul_flops"] for d in (dtype, "float32"))
    return emulation_cost(side, dtype, native, rate, float32_rate)




def worker_result(script: str, mark: str, args: list[str], what: str) -> dict[str, Any]:
    """Run ``script`` with ``args`` in a fresh Python process and return the JSON it printed after ``mark`` (its last
    such line); a process that printed none raises with ``what`` failed, its exit code and its output's tail."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(mark):
            return json.loads(line[len(mark):])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
