"""What sharding costs one device: a training step of ShardedTorchBackend on one rank (FSDP2, a process group of one)
against the plain TorchBackend, same model, batch and settings.

    python benchmarks/sharded_step.py                                  # smollm2-135m, full fine-tuning, on this machine
    python benchmarks/sharded_step.py --model tiny --lora-rank 8 --steps 3 --json
    python benchmarks/sharded_step.py --model Qwen/Qwen2.5-1.5B --dtype bfloat16 --device cuda   # the GPU figure

Each side runs in a fresh process of its own (so its peak memory is its own): ``--warmup`` steps, then ``--steps``
timed steps of ``forward_backward`` + ``optim_step`` on one fixed batch (``--rows`` rows of ``--length`` tokens, every
token trained, importance sampling with advantages of +-1). The sides run one after the other, alternating
``--rounds`` times, and the medians are reported with their ratio (sharded / plain).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the timed steps; on a CPU the process's peak resident set
(``VmHWM``) minus its resident set before the model loaded. The losses of the two sides' first steps are printed too:
one rank of FSDP2 computes what the plain path computes (float32: equal to the last bits or nearly).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    """One side in this process: its step times, first loss and peak memory."""
    import torch

    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams

    before = _rss_kib("VmRSS")
    config = TorchBackendConfig(model=args.model, lora_rank=args.lora_rank, dtype=args.dtype, device=args.device, seed=1,
                                micro_batch_size=args.micro_batch_size, share_prefixes=False)
    if args.side == "sharded":
        from tinkergym.backends.torch.sharded import ShardedTorchBackend, init_process_group

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        init_process_group(args.device)
        backend: Any = ShardedTorchBackend(config)
    else:
        backend = TorchBackend(config)
    generator = torch.Generator().manual_seed(0)
    data = [Datum(tokens=torch.randint(5, 1000, (args.length,), generator=generator).tolist(), loss_mask=[0.0] + [1.0] * (args.length - 1),
                  advantages=[1.0 if i % 2 else -1.0] * args.length, sampling_logprobs=[-1.0] * args.length) for i in range(args.rows)]
    request = ForwardBackwardRequest(data, LossSpec("importance_sampling"))
    optim = OptimParams(learning_rate=1e-5)
    cuda = backend.device.type == "cuda"
    times, first = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = backend.forward_backward(request)
        backend.optim_step(optim)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        first = result.metrics["loss"] if first is None else first
    peak = torch.cuda.max_memory_allocated() if cuda else (_rss_kib("VmHWM") - before) * 1024
    return {"side": args.side, "times": times, "first_loss": first, "peak_bytes": peak, "device": str(backend.device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning (default)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="times each side runs, alternating")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--side", choices=("plain", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29591, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "sharded": []}
    passed = [a for a in sys.argv[1:] if a != "--json"]
    for _round in range(args.rounds):
        for side in ("plain", "sharded"):
            done = subprocess.run([sys.executable, __file__, *passed, "--side", side], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"the {side} side failed:\n{done.stderr[-3000:]}")
            results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary: dict[str, Any] = {"model": args.model, "lora_rank": args.lora_rank, "dtype": args.dtype, "device": results["plain"][0]["device"],
                               "batch": f"{args.rows} x {args.length}", "micro_batch_size": args.micro_batch_size, "cpus": os.cpu_count()}
    for side, runs in results.items():
        summary[side] = {"median_step_s": statistics.median(t for r in runs for t in r["times"]),
                         "peak_mib": max(r["peak_bytes"] for r in runs) / 2**20, "first_loss": runs[0]["first_loss"]}
    summary["step_ratio"] = summary["sharded"]["median_step_s"] / summary["plain"]["median_step_s"]
    summary["peak_ratio"] = summary["sharded"]["peak_mib"] / max(summary["plain"]["peak_mib"], 1e-9)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    kind = f"LoRA r{args.lora_rank}" if args.lora_rank else "full"
    print(f"{summary['model']} ({kind}, {args.dtype}, {summary['device']}, "
          f"batch {summary['batch']}, micro-batch {args.micro_batch_size})")
    for side in ("plain", "sharded"):
        row = summary[side]
        print(f"  {side:8s} step {row['median_step_s']:.3f} s  peak {row['peak_mib']:.0f} MiB  first loss {row['first_loss']:.6g}")
    print(f"  sharded / plain: step {summary['step_ratio']:.3f}x, peak memory {summary['peak_ratio']:.3f}x")


if __name__ == "__main__":
    main()
