"""K LoRA GRPO jobs on one base model: one shared base against K separate engines and against one base time-sliced.

    python benchmarks/shared_lora.py                          # K = 1, 2, 4, 8; all three layouts; 1 warm-up + 2 timed steps
    python benchmarks/shared_lora.py --ks 1,2,4 --steps 1     # fewer jobs and steps
    python benchmarks/shared_lora.py --layouts shared,separate --json
    python benchmarks/shared_lora.py --quick                  # tiny model, K = 1, 2, 1 timed step (a smoke test)

Every job runs the GRPO step of ``grpo_step.py``'s shapes: 8 prompts x 8 samples of at most 32 new tokens at
temperature 1, then one ``ppo`` ``forward_backward`` over the 64 sampled completions (tokens = prompt +
completion, loss mask 0 on the prompt and 1 on the completion, one random advantage in [-1, 1] per completion,
the sampler's logprobs as ``sampling_logprobs``), then one AdamW ``optim_step``. Each job has prompts of its own
(the model's chat template around a short question naming the job, the prompt and the step), a LoRA adapter of
rank 8, alpha 16 on every linear layer, and its own seed (``--seed`` + job). The layouts differ in this only:

- ``shared``: one :class:`~tinkergym.backends.torch.shared.SharedBase` with K sessions. A step is ONE
  ``sample_many`` call over the K jobs' requests (whole requests decoded together up to the base's
  ``max_sample_batch`` of 64 rows: each job's 64 rows fill a batch, as a job alone), then ONE
  ``forward_backward_many`` (every job's rows planned as one request, what ``micro_batch_size`` = 8 sequences cost
  per pass, prompts shared within a job: passes hold several jobs' rows, one backward each), then each
  session's ``optim_step``.
  Memory: the base once, plus each session's adapter, gradients and optimizer state.
- ``separate``: K :class:`~tinkergym.backends.torch.backend.TorchBackend` instances (peft LoRA, the same rank,
  alpha, dtype and micro-batch size; its own ``max_sample_batch`` of 64 and prefix cache as it comes), each
  doing its own sample, forward_backward and optim_step, the jobs one after another: what K single-job servers
  on one machine cost, K copies of the base in memory.
- ``time_sliced``: one SharedBase with K sessions, as ``shared``, but each session's calls run alone
  (``session.sample``, ``session.forward_backward``, ``session.optim_step``), the jobs one after another:
  the shared base's memory with no shared passes.

Each layout and K runs in a fresh subprocess, one after another (every layout of one K before the next K), so
peak memories never mix; each result is printed to stderr as it lands. Reported per
layout and K, over the median of ``--steps`` timed steps after 1 warm-up step: the process's peak RSS (VmHWM)
and its RSS once the engines are loaded; the step's wall time (all K jobs' steps done: in ``shared`` every job
waits for the whole shared step, in the other two the jobs take turns); each job's own time (the wall time of
its own calls: in ``shared`` the whole step, since it shares every pass); aggregate tokens/s: sampled tokens
(completions) plus trained tokens (prompt + completion of every trained row) of all jobs over the step's wall
time; and the cores other processes used meanwhile (``other``). Ratios per K: shared's peak memory over
shared K=1 and over separate K, and shared's tokens/s over separate's and over time_sliced's. ``--dtype``
(default float32; ``auto``: tinkergym's choice, bfloat16 where the CPU computes it natively) applies to every
layout; the float32 matmul rate is measured in the same run for scale. ``--model`` takes what
``tinkergym.backends.models.resolve_model`` takes (default ``smollm2-135m``; ``tiny`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from typing import Any

from bench_machine import CpuShare, _load, describe, machine_facts, matmul_rate, resolve_precision, worker_result

RESULT_MARK = "SHARED_LORA_RESULT "
LAYOUTS = ("shared", "separate", "time_sliced")
MIB = 2**20
PROMPTS, SAMPLES, MAX_NEW_TOKENS, TEMPERATURE = 8, 8, 32, 1.0
#: --quick's step, a smoke test of every layout on the tiny model (its timings compare nothing): 2 prompts x 4 samples of at most 8 new tokens.
QUICK_PROMPTS, QUICK_SAMPLES, QUICK_MAX_NEW_TOKENS = 2, 4, 8
LORA_RANK, LORA_ALPHA, MICRO_BATCH_SIZE, LR = 8, 16.0, 8, 1e-5
#: A job's step may be this many times its step alone and still count as held (``capacity``).
SLOWER = 1.5


def memory_status() -> dict[str, int]:
    """This process's resident memory now (VmRSS) and its high-water mark (VmHWM), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def job_prompts(tokenizer: Any, job: int, step: int, count: int = PROMPTS) -> list[list[int]]:
    """The ``count`` prompts of ``job`` at ``step``: the chat template around a short question of its own, as token ids."""
    prompts = []
    for i in range(count):
        text = f"Job {job}, step {step}, question {i}: name a prime number between {10 * i + job} and {10 * i + job + 40}, and say why."
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return prompts


def sample_request(prompts: list[list[int]], samples: int = SAMPLES, max_new_tokens: int = MAX_NEW_TOKENS) -> Any:
    from tinkergym.protocol.types import SampleRequest, SamplingParams

    return SampleRequest(prompts=prompts, params=SamplingParams(max_new_tokens=max_new_tokens, temperature=TEMPERATURE), num_samples=samples)


def train_request(prompts: list[list[int]], response: Any, rng: random.Random) -> tuple[Any, dict[str, int]]:
    """The ppo request over every sampled completion (random advantages), and the step's token counts."""
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec

    data, sampled = [], 0
    for prompt, group in zip(prompts, response.sequences):
        for seq in group:
            advantage, n = rng.uniform(-1.0, 1.0), len(seq.tokens)
            sampled += n
            data.append(Datum(tokens=prompt + seq.tokens, loss_mask=[0.0] * len(prompt) + [1.0] * n,
                              advantages=[0.0] * len(prompt) + [advantage] * n, sampling_logprobs=[0.0] * len(prompt) + list(seq.logprobs)))
    counts = {"prompt_tokens": sum(len(p) * len(group) for p, group in zip(prompts, response.sequences)), "sampled_tokens": sampled, "trained_tokens": sum(len(d.tokens) for d in data)}
    return ForwardBackwardRequest(data=data, loss=LossSpec(name="ppo")), counts


def run_worker(layout: str, k: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Build the layout's engines for ``k`` jobs, run 1 warm-up + ``steps`` timed steps, and measure them."""
    import torch
    from transformers import AutoTokenizer

    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig
    from tinkergym.protocol.types import OptimParams

    started = time.perf_counter()
    model, dtype, seed = settings["model_path"], settings["dtype"], settings["seed"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    base = None
    if layout == "separate":
        jobs: list[Any] = [TorchBackend(TorchBackendConfig(model=model, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, dtype=dtype,
                                                           micro_batch_size=MICRO_BATCH_SIZE, seed=seed + j, device="cpu")) for j in range(k)]
    else:
        base = SharedBase(SharedBaseConfig(model=model, dtype=dtype, device="cpu", micro_batch_size=MICRO_BATCH_SIZE))
        jobs = [base.open_session(LoraSessionConfig(lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, seed=seed + j)) for j in range(k)]
    setup_s, loaded = time.perf_counter() - started, memory_status()["VmRSS"]
    optim = OptimParams(learning_rate=LR)
    rngs = [random.Random(seed * 1000 + j) for j in range(k)]
    records, load = [], {}
    for step in range(1 + settings["steps"]):
        if step == 1:
            load["start"] = _load()
        prompts = [job_prompts(tokenizer, j, step, settings["prompts"]) for j in range(k)]
        counts: list[dict[str, int]] = []
        job_s = [0.0] * k
        cpu = CpuShare()
        start = time.perf_counter()
        if layout == "shared":
            responses = base.sample_many([(s, sample_request(p, settings["samples"], settings["max_new_tokens"])) for s, p in zip(jobs, prompts)])
            sample_s = time.perf_counter() - start
            requests = []
            for p, response, rng in zip(prompts, responses, rngs):
                request, count = train_request(p, unwrap(response), rng)
                requests.append(request)
                counts.append(count)
            for outcome in base.forward_backward_many(list(zip(jobs, requests))):
                unwrap(outcome)
            for session in jobs:
                session.optim_step(optim)
            job_s = [time.perf_counter() - start] * k
        else:  # separate and time_sliced: each job's calls alone, the jobs one after another
            sample_s = 0.0
            for j, job in enumerate(jobs):
                mine = time.perf_counter()
                response = job.sample(sample_request(prompts[j], settings["samples"], settings["max_new_tokens"]))
                sample_s += time.perf_counter() - mine
                request, count = train_request(prompts[j], response, rngs[j])
                job.forward_backward(request)
                job.optim_step(optim)
                counts.append(count)
                job_s[j] = time.perf_counter() - mine
        step_s = time.perf_counter() - start
        totals = {key: sum(c[key] for c in counts) for key in counts[0]}
        records.append({"step_s": step_s, "sample_s": sample_s, "train_s": step_s - sample_s, "job_s": job_s,
                        "tokens_per_s": (totals["sampled_tokens"] + totals["trained_tokens"]) / step_s, **totals, **cpu.stop()})
    load["end"] = _load()
    timed = records[1:] or records
    median = {key: statistics.median(r[key] for r in timed) for key in timed[0] if key != "job_s"}
    median["job_s"] = [statistics.median(r["job_s"][j] for r in timed) for j in range(k)]
    memory = memory_status()
    return {
        "layout": layout, "k": k, "steps": records, "median": median, "setup_s": setup_s, "loaded_rss_bytes": loaded,
        "peak_rss_bytes": max(memory["VmHWM"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        "engine_bytes": base.memory()["total_bytes"] if base is not None else None, "dtype": dtype, "threads": torch.get_num_threads(), "load": load,
    }


def unwrap(outcome: Any) -> Any:
    """A ``*_many`` outcome as its own call would return it: the result, or its exception raised."""
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def spawn(layout: str, k: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Run one layout and K (or the ``matmul`` rate measurement) in a fresh Python process and return its result."""
    return worker_result(__file__, RESULT_MARK, ["--worker", layout, "--ks", str(k), "--settings", json.dumps(settings)], f"the {layout} K={k} worker")


def ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per K: shared's peak memory over shared K=1 and over separate, shared's tokens/s over separate's and time_sliced's."""
    by = {(r["layout"], r["k"]): r for r in results}
    out: dict[str, dict[str, float]] = {}
    for k in sorted({r["k"] for r in results}):
        shared = by.get(("shared", k))
        if shared is None:
            continue
        row = {}
        if ("shared", 1) in by:
            row["memory_shared_over_shared_k1"] = shared["peak_rss_bytes"] / by[("shared", 1)]["peak_rss_bytes"]
        for other in ("separate", "time_sliced"):
            if (other, k) in by:
                if other == "separate":
                    row["memory_shared_over_separate"] = shared["peak_rss_bytes"] / by[(other, k)]["peak_rss_bytes"]
                row[f"tokens_per_s_shared_over_{other}"] = shared["median"]["tokens_per_s"] / by[(other, k)]["median"]["tokens_per_s"]
        out[str(k)] = row
    return out


def machine_memory() -> int:
    """This machine's memory in bytes (``MemTotal``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(fixed, per_job)`` of the least-squares line through ``(K, bytes)`` points (per_job 0 for one point)."""
    if len(points) == 1:
        return points[0][1], 0.0
    n = len(points)
    mean_k, mean_b = sum(k for k, _ in points) / n, sum(b for _, b in points) / n
    slope = sum((k - mean_k) * (b - mean_b) for k, b in points) / sum((k - mean_k) ** 2 for k, _ in points)
    return mean_b - slope * mean_k, slope


def capacity(results: list[dict[str, Any]], budget: int, slower: float = SLOWER) -> dict[str, Any]:
    """How many jobs this machine holds at once each way, by memory and by step time (see the module's notes).

    ``shared``: one process; its peak RSS against K is a line (the base and the passes' activations once, then what each
    job keeps), so ``floor((budget - fixed) / per_job)`` jobs fit. ``separate``: a job is a server, a process of its
    own, each at the peak of ``separate`` K=1, so ``floor(budget / that)`` fit (the in-process line of the K
    separate engines is reported beside it). By time: the largest measured K whose step (every job's step, since the
    K jobs share the machine's cores either way) is at most ``slower`` times a job alone (``separate`` K=1).
    """
    by = {(r["layout"], r["k"]): r for r in results}
    alone = by.get(("separate", 1)) or by.get(("shared", 1))
    out: dict[str, Any] = {"budget_bytes": budget, "slower": slower}
    for layout in ("shared", "separate"):
        points = sorted((r["k"], float(r["peak_rss_bytes"])) for r in results if r["layout"] == layout)
        if not points:
            continue
        fixed, per_job = _line(points)
        row: dict[str, Any] = {"fixed_bytes": fixed, "per_job_bytes": per_job, "measured_ks": [k for k, _ in points]}
        if layout == "shared":
            row["most_by_memory"] = int((budget - fixed) // per_job) if per_job > 0 else None
        else:
            server = by[("separate", 1)]["peak_rss_bytes"] if ("separate", 1) in by else None
            row["server_peak_bytes"] = server
            row["most_by_memory"] = int(budget // server) if server else None
        if alone is not None:
            limit = slower * alone["median"]["step_s"]
            within = [r["k"] for r in results if r["layout"] == layout and r["median"]["step_s"] <= limit]
            row["step_limit_s"] = limit
            row["most_by_time_measured"] = max(within) if within else 0
            row["most_at_once"] = min(row["most_by_time_measured"], row["most_by_memory"] or 0)
        out[layout] = row
    if "shared" in out and "separate" in out and out["separate"].get("most_by_memory"):
        out["memory_ratio"] = (out["shared"]["most_by_memory"] or 0) / out["separate"]["most_by_memory"]
        if out["separate"].get("most_at_once"):
            out["at_once_ratio"] = out["shared"]["most_at_once"] / out["separate"]["most_at_once"]
    return out


def print_capacity(found: dict[str, Any]) -> None:
    gib = 2**30
    print(f"jobs held at once in {found['budget_bytes'] / gib:.1f} GiB:")
    for layout in ("shared", "separate"):
        row = found.get(layout)
        if row is None:
            continue
        how = (f"one process, {row['fixed_bytes'] / gib:.2f} GiB + {row['per_job_bytes'] / MIB:.0f} MiB a job" if layout == "shared"
               else f"a process a job at {row['server_peak_bytes'] / gib:.2f} GiB (in one process: {row['per_job_bytes'] / MIB:.0f} MiB a job)"
               if row.get("server_peak_bytes") else "")
        text = f"  {layout:<9} by memory {row['most_by_memory']} ({how})"
        if "most_by_time_measured" in row:
            text += (f"; within {found['slower']:g}x a job's step alone ({row['step_limit_s']:.1f} s): K <= {row['most_by_time_measured']} "
                     f"of K = {','.join(map(str, row['measured_ks']))}; at once {row['most_at_once']}")
        print(text)
    if "memory_ratio" in found:
        print(f"  shared/separate: {found['memory_ratio']:.1f}x by memory" + (f", {found['at_once_ratio']:.1f}x at once" if "at_once_ratio" in found else ""))


def print_table(results: list[dict[str, Any]], by_k: dict[str, dict[str, float]]) -> None:
    """One row per layout and K, then the ratios per K."""
    print(f"{'layout':<12} {'K':>2} {'step s':>7} {'sample s':>9} {'train s':>8} {'job s':>7} {'tokens s+t':>12} {'tokens/s':>9} "
          f"{'loaded MiB':>11} {'peak MiB':>9} {'other':>6}  load start -> end")
    for r in results:
        m = r["median"]
        print(f"{r['layout']:<12} {r['k']:>2} {m['step_s']:>7.2f} {m['sample_s']:>9.2f} {m['train_s']:>8.2f} {statistics.mean(m['job_s']):>7.2f} "
              f"{int(m['sampled_tokens']):>5}+{int(m['trained_tokens']):<6} {m['tokens_per_s']:>9.1f} {r['loaded_rss_bytes'] / MIB:>11.0f} "
              f"{r['peak_rss_bytes'] / MIB:>9.0f} {m['other_cores']:>6.2f}  {r['load'].get('start')} -> {r['load'].get('end')}")
    for k, row in by_k.items():
        parts = []
        if "memory_shared_over_shared_k1" in row:
            parts.append(f"memory shared/shared K=1 {row['memory_shared_over_shared_k1']:.2f}")
        if "memory_shared_over_separate" in row:
            parts.append(f"memory shared/separate {row['memory_shared_over_separate']:.2f}")
        for other in ("separate", "time_sliced"):
            if f"tokens_per_s_shared_over_{other}" in row:
                parts.append(f"tokens/s shared/{other} {row[f'tokens_per_s_shared_over_{other}']:.2f}")
        if parts:
            print(f"K={k}: " + "; ".join(parts))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a name or folder resolve_model takes (tiny: the test model)")
    parser.add_argument("--ks", default="1,2,4,8", help="comma-separated numbers of jobs")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step (median reported)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="float32",
                        help="precision of every layout (auto: tinkergym's choice, the device's native one)")
    parser.add_argument("--seed", type=int, default=0, help="job j's adapter and sampling seed is seed + j")
    parser.add_argument("--quick", action="store_true", help="tiny model, K = 1, 2, one timed step of 2 prompts x 4 samples of at most 8 new tokens (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--memory-budget-gib", type=float, default=None,
                        help="the memory the jobs-held-at-once figure fills (default: this machine's MemTotal)")
    parser.add_argument("--report", metavar="JSON", help="print the table and figures of a saved result (this script's --json output) and exit")
    parser.add_argument("--worker", choices=(*LAYOUTS, "matmul"), help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    budget = int(args.memory_budget_gib * 2**30) if args.memory_budget_gib else machine_memory()
    if args.report:
        with open(args.report) as f:
            saved = json.loads(f.read().strip().splitlines()[-1])
        saved["ratios"], saved["capacity"] = ratios(saved["results"]), capacity(saved["results"], budget)
        print_table(saved["results"], saved["ratios"])
        print_capacity(saved["capacity"])
        print(json.dumps(saved))
        return
    if args.worker:
        settings = json.loads(args.settings)
        result = matmul_rate("cpu", "float32") if args.worker == "matmul" else run_worker(args.worker, int(args.ks), settings)
        print(RESULT_MARK + json.dumps(result), flush=True)
        return
    shape = (QUICK_PROMPTS, QUICK_SAMPLES, QUICK_MAX_NEW_TOKENS) if args.quick else (PROMPTS, SAMPLES, MAX_NEW_TOKENS)
    if args.quick:
        args.model, args.ks, args.steps = "tiny", "1,2", 1
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        sys.exit(f"--layouts takes {', '.join(LAYOUTS)}, not {args.layouts!r}")
    try:
        ks = sorted({int(k) for k in args.ks.split(",") if k.strip()})
    except ValueError:
        sys.exit(f"--ks takes comma-separated numbers, not {args.ks!r}")
    if not ks or ks[0] < 1 or args.steps < 1:
        sys.exit("--ks needs numbers of at least 1 and --steps at least 1")
    from tinkergym.backends.models import resolve_model

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    settings = {"model": args.model, "model_path": resolve_model(args.model), "dtype": resolve_precision(args.dtype, "cpu"),
                "steps": args.steps, "seed": args.seed, "prompts": shape[0], "samples": shape[1], "max_new_tokens": shape[2],
                "temperature": TEMPERATURE, "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA, "micro_batch_size": MICRO_BATCH_SIZE, "lr": LR}
    facts = machine_facts("cpu")
    say(f"machine: {describe(facts)}; native precision {facts['native_dtype']}; measuring the float32 matmul rate ...")
    rate = spawn("matmul", 1, settings)
    results = []
    for k in ks:  # every layout of one K before the next K: a run cut short still compares the K it finished
        for layout in layouts:
            say(f"running {layout} K={k} ({args.model}, {settings['dtype']}, 1 warm-up + {args.steps} timed steps), load {_load()} ...")
            results.append(spawn(layout, k, settings))
            m = results[-1]["median"]
            say(f"  {layout} K={k}: step {m['step_s']:.2f} s, {m['tokens_per_s']:.1f} tokens/s, peak RSS {results[-1]['peak_rss_bytes'] / MIB:.0f} MiB, "
                f"other cores {m['other_cores']:.2f}")
    by_k = ratios(results)
    report = {"settings": settings, "machine": facts, "matmul": rate, "results": results, "ratios": by_k, "capacity": capacity(results, budget)}
    if not args.json:
        print(f"model: {args.model} ({settings['dtype']}); CPU: {describe(facts)}; float32 matmul rate {rate['matmul_flops'] / 1e12:.3f} TFLOP/s")
        print_table(results, by_k)
        print_capacity(report["capacity"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
