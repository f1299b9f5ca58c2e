"""The memory a server measures and reports at its heartbeats (tinkergym.plumbing.memory_use), in a process of its own
so that no other test's memory moves the figures."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys
from tinkergym.plumbing.memory_use import measure, reset_peak
start = measure()
block = bytearray(300 * 2**20)
block[::4096] = b"x" * len(block[::4096])  # every page touched: resident
held = measure()
del block
freed = measure()
reset_peak()
after = measure()
print(json.dumps({"start": start, "held": held, "freed": freed, "after": after, "torch": "torch" in sys.modules}))
"""


def test_measure_follows_the_process_and_reset_peak_starts_the_peak_again() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    found = json.loads(out.splitlines()[-1])
    start, held, freed, after = found["start"], found["held"], found["freed"], found["after"]
    mib = 2**20
    assert not found["torch"], "measuring imports no torch"
    assert held["host_bytes"] - start["host_bytes"] > 290 * mib and held["host_peak_bytes"] >= held["host_bytes"]
    assert freed["host_bytes"] < held["host_bytes"] - 290 * mib, "a freed block leaves the resident memory"
    # the peak remembers it (within the kernel's lazily summed per-CPU counters: a few pages)
    assert freed["host_peak_bytes"] >= held["host_bytes"] - 4 * mib
    assert after["host_peak_bytes"] < held["host_bytes"] - 250 * mib, "until the peak is started again"
    # on a CPU the device is the host, and its size is the worker's to say
    assert after["device_bytes"] == after["host_bytes"] and after["device_peak_bytes"] == after["host_peak_bytes"]
    assert after["device_total_bytes"] is None
