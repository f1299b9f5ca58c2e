"""The machine a measurement ran on: CPU model and kernel capability, native precision, GPU, a measured matmul rate, and the
cores other processes took meanwhile. Recorded beside every benchmark figure and every result (``tinkergym results``):
machines of one kind differ by 2x, so a figure means something only beside the machine's own rates.

torch is imported inside the functions that need it; :class:`CpuShare` and :func:`load_average` need none.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any
from collections.abc import Callable


def sync(device: str) -> None:
    """Wait for the GPU's queued work (a no-op on a CPU), so that wall times cover it."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


#: Environment variables that cap the instruction sets torch's kernels use. ``ONEDNN_MAX_CPU_ISA=AVX2`` alone turns
#: native bfloat16 off (torch then computes bfloat16 matmuls in its own emulated kernel, as on an AVX2-only CPU);
#: with the other two, an AVX-512 machine runs every kernel as an AVX2-only one does. Recorded in each result.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def native_dtype(device: str) -> str:
    """The fastest precision ``device`` computes natively: what tinkergym's ``dtype="auto"`` decides there."""
    import torch

    from tinkergym.backends.torch.runtime import resolve_dtype

    return str(resolve_dtype("auto", torch.device(device))).removeprefix("torch.")


def cpu_facts() -> dict[str, Any]:
    """The CPU's model, torch's kernel capability, whether bfloat16 is native, its bfloat16 flags, ISA caps in force."""
    import torch

    model, flags = "unknown", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu_model": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bfloat16": native_dtype("cpu") == "bfloat16", "cpu_bf16_flags": sorted(f for f in flags if "bf16" in f),
        "isa_caps": {k: os.environ[k] for k in ISA_CAPS if k in os.environ}, "threads": torch.get_num_threads(),
    }


def machine_facts(device: str) -> dict[str, Any]:
    """:func:`cpu_facts` plus, on a GPU, its name and whether it computes bfloat16 natively."""
    facts = cpu_facts()
    if device == "cuda":
        import torch

        facts.update(gpu_name=torch.cuda.get_device_name(), gpu_native_bfloat16=torch.cuda.is_bf16_supported())
    facts["native_dtype"] = native_dtype(device)
    return facts


def describe(facts: dict[str, Any]) -> str:
    """One line naming the CPU kind: model, capability, native bfloat16 or not, ISA caps."""
    caps = " ".join(f"{k}={v}" for k, v in facts["isa_caps"].items())
    return (f"{facts['cpu_model']} ({facts['cpu_capability']}, bfloat16 {'native' if facts['cpu_native_bfloat16'] else 'emulated'}"
            f"{', capped: ' + caps if caps else ''}; {facts['threads']} threads)")


def matmul_size(seconds_of: Callable[[int], float], target_s: float, start: int = 128, cap: int = 4096) -> int:
    """The side of the square product to time: doubled from ``start`` until one product takes ``target_s`` or ``cap`` is reached.

    ``seconds_of(n)`` times one product of side ``n``. Sizing by time keeps the measurement short where a precision
    is emulated (a 4096^3 bfloat16 product takes over a minute on an AVX2-only CPU) and large where it is fast.
    """
    n = start
    while n < cap and seconds_of(n) < target_s:
        n *= 2
    return min(n, cap)


def matmul_rate(device: str, dtype: str = "bfloat16", seconds: float = 1.0) -> dict[str, Any]:
    """FLOP/s of square ``dtype`` matmuls on ``device``: the best of 5 rounds, the whole measurement about ``seconds``.

    The side is chosen by time (:func:`matmul_size`: a product of about a fiftieth of ``seconds``, at most 4096 on
    a CPU and 8192 on a GPU), then each of 5 rounds repeats it for about a sixth of ``seconds``.
    """
    import torch

    torch_dtype = getattr(torch, dtype)
    operands: dict[int, tuple[Any, Any]] = {}

    def product(n: int) -> float:
        if n not in operands:
            operands.clear()
            operands[n] = (torch.randn(n, n, device=device).to(torch_dtype), torch.randn(n, n, device=device).to(torch_dtype))
        a, b = operands[n]
        a @ b  # warm-up: library initialization, kernel choice
        best = float("inf")
        for _ in range(2):  # the faster of two: a stray stall would make the side too small
            sync(device)
            start = time.perf_counter()
            a @ b
            sync(device)
            best = min(best, time.perf_counter() - start)
        return best

    began = time.perf_counter()
    n = matmul_size(product, seconds / 50, cap=8192 if device == "cuda" else 4096)
    one = product(n)
    a, b = operands[n]
    per_round = min(max(1, int(seconds / 6 / max(one, 1e-6))), 10000)
    best = 0.0
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        for _ in range(per_round):
            a @ b
        sync(device)
        best = max(best, 2.0 * n**3 * per_round / (time.perf_counter() - start))
    out = {"matmul_flops": best, "matmul_n": n, "matmul_dtype": dtype, "matmul_s": time.perf_counter() - began, "device": device}
    if device == "cuda":
        out["gpu_name"] = torch.cuda.get_device_name()
    return out


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    """The installed version of each distribution in ``names`` (``"not installed"`` where it is not)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


class CpuShare:
    """Cores used by this process and by every other process between ``start()`` and ``stop()`` (from /proc/stat).

    ``other_cores`` near 0 means the measurement had the machine to itself; the load average alone cannot
    say that, since it counts this process too.
    """

    def __init__(self) -> None:
        self.start()

    @staticmethod
    def _snapshot() -> tuple[float, float, float, float]:
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
