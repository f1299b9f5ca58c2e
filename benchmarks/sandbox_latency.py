"""Per-call latency of the tool sandbox: bubblewrap isolation against the rlimits guard and a bare interpreter.

    python benchmarks/sandbox_latency.py                 # 40 calls of each, interleaved
    python benchmarks/sandbox_latency.py --calls 200 --code "print(sum(range(10**5)))"
    python benchmarks/sandbox_latency.py --quick         # 2 calls of each (a smoke test)

Three ways to run the same code, taken in turn call after call so that load on the machine hits them alike:

- ``bubblewrap``: :func:`tinkergym.sandbox.run_python` as tool calls run it (namespaces, uid drop when root,
  tmpfs, limits);
- ``rlimits``: the same function with ``isolation="rlimits"`` (a subprocess with the same limits, no
  namespaces; the weaker opt-in);
- ``bare``: ``python3 -I -c CODE`` through :mod:`subprocess` with nothing around it: this machine's own
  cost of starting an interpreter, the floor under both.

It prints the median and 90th percentile of each in milliseconds and the ratios to ``bare``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from tinkergym.sandbox import find_python, run_python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="calls of each kind (default 40)")
    parser.add_argument("--code", default="print(sum(range(10)))", help="the code each call runs")
    parser.add_argument("--quick", action="store_true", help="2 calls of each (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.calls = 2
    python = find_python()
    kinds = {
        "bubblewrap": lambda: run_python(args.code),
        "rlimits": lambda: run_python(args.code, isolation="rlimits"),
        "bare": lambda: subprocess.run([python, "-I", "-c", args.code], capture_output=True, check=True),
    }
    for run in kinds.values():  # warm-up: page cache, the one-off bubblewrap probe
        run()
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.calls):
        for kind, run in kinds.items():
            start = time.perf_counter()
            run()
            times[kind].append((time.perf_counter() - start) * 1000)
    bare = statistics.median(times["bare"])
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, uid {os.geteuid()}, interpreter {python}")
    print(f"{'kind':<12}{'median ms':>10}{'p90 ms':>9}{'x bare':>8}")
    summary = {}
    for kind, values in times.items():
        values.sort()
        median, p90 = statistics.median(values), values[int(0.9 * (len(values) - 1))]
        summary[kind] = {"median_ms": round(median, 2), "p90_ms": round(p90, 2)}
        print(f"{kind:<12}{median:>10.1f}{p90:>9.1f}{median / bare:>8.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
