"""The memory this process really uses, measured (not counted): what a server reports at every heartbeat.

:func:`measure` answers, in bytes:

- ``host_bytes`` and ``host_peak_bytes``: the process's resident memory now (``VmRSS``) and its high-water mark
  (``VmHWM``) from ``/proc/self/status``;
- ``device_bytes``, ``device_peak_bytes`` and ``device_total_bytes``: on a CUDA device the caching allocator's reserved
  memory now and at its peak (``torch.cuda.memory_reserved`` and ``max_memory_reserved``: what the device lends this
  process, freed tensors included) and the device's size (``mem_get_info``); on a CPU the device is the host, so
  the host's figures (and no size: the scheduler takes the one the worker registered).

:func:`reset_peak` starts the peaks again from now (``torch.cuda.reset_peak_memory_stats``; ``5`` written to
``/proc/self/clear_refs`` for ``VmHWM``): a server calls it when a job leaves, so the next peak is the jobs' that
stay. Torch is read only where the process has imported it already; standard library otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

FIELDS = ("device_bytes", "device_peak_bytes", "device_total_bytes", "host_bytes", "host_peak_bytes")


def _host() -> tuple[int, int]:
    found = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    now = found.get("VmRSS", 0)
    return now, max(now, found.get("VmHWM", 0))


def _cuda() -> Any:
    """The torch.cuda module when this process has imported torch and initialised CUDA; None otherwise."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    except (AttributeError, RuntimeError):
        return None


def measure() -> dict[str, int | None]:
    """This process's memory now and at its peak, host and device (see the module's notes)."""
    host, host_peak = _host()
    cuda = _cuda()
    if cuda is None:
        return {"device_bytes": host, "device_peak_bytes": host_peak, "device_total_bytes": None, "host_bytes": host, "host_peak_bytes": host_peak}
    try:
        free, total = cuda.mem_get_info()
        now, peak = int(cuda.memory_reserved()), int(cuda.max_memory_reserved())
    except RuntimeError:
        return {"device_bytes": None, "device_peak_bytes": None, "device_total_bytes": None, "host_bytes": host, "host_peak_bytes": host_peak}
    del free
    return {"device_bytes": now, "device_peak_bytes": max(now, peak), "device_total_bytes": int(total), "host_bytes": host,
            "host_peak_bytes": host_peak}


def reset_peak() -> None:
    """Start the host's and the device's peaks again from what is used now (best effort: a kernel that refuses keeps the old peak)."""
    cuda = _cuda()
    if cuda is not None:
        try:
            cuda.reset_peak_memory_stats()
        except RuntimeError:
            pass
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        pass


def release_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back to the device (a job left: its memory is another's now)."""
    cuda = _cuda()
    if cuda is not None:
        cuda.empty_cache()
