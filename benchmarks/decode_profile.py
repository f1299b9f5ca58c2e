"""Where ``TorchBackend.sample``'s time goes on a GRPO-shaped request: prefill, decode forwards, the rest of each step.

    python benchmarks/decode_profile.py                      # LoRA, 8 prompts x 8 samples x 24 tokens, 3 timed calls
    python benchmarks/decode_profile.py --modes lora full --calls 5 --top 30
    python benchmarks/decode_profile.py --no-profile         # timings only (the profiler slows each op a little)
    python benchmarks/decode_profile.py --quick --model tiny # 1 call of 4 tokens, no profile (a smoke test)
    python benchmarks/decode_profile.py --stop-every 29 --new-tokens 64 --baseline 1cd5038 --no-profile
                                                             # rows of many lengths, against the loop that ran every row to the end

The request is a GRPO step's sampling: the first ``--prompts`` observations of ``tinker/Bandit-v0`` (the env of
``grpo_step.py``, with its system prompt) rendered by SmolLM2-135M-Instruct's chat template, ``--group`` samples
each, temperature 1, seeded. No row stops early (the stop id is outside the vocabulary), so every call decodes
exactly ``--new-tokens`` steps and the calls are comparable. ``--stop-every K`` makes every K-th token id a stop
id instead: rows stop at many lengths, as a rollout's answers do (about 1/K of a row's draws stop it), the same
ones in every call (seeded), which is where dropping stopped rows from the batch pays. The backend is built as ``grpo_step.py`` builds it
(``--dtype auto``: bfloat16 where the CPU computes it natively, float32 where it is emulated; LoRA r=8 or full
fine-tuning); a forced emulated precision prints a warning with its cost.

Printed per mode: the median wall time of ``sample`` and its split into the shared-prefix prefill, the decode
forward passes (timed by hooks on the sampling model) and the rest of each decode step (drawing the token,
stop flags, the loop itself); then the FLOP floor of the call at the measured matmul rates, and with the
profiler a table of the top ops by self CPU time plus the share of the call spent outside any op (Python,
transformers' bookkeeping, the dispatcher). Matmul rates are measured in the same run, in the call's precision:
square products (``bench_machine.matmul_rate``, sized by time) and the decode's own shapes (about a second each).
The CPU's kind (torch's capability, native bfloat16 or not) heads the output; the last line is the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import bench_machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=("lora", "full"), default=["lora"], help="LoRA r=8 and/or full fine-tuning (default: lora)")
    parser.add_argument("--model", default="smollm2-135m", help="a name or folder resolve_model takes (default: smollm2-135m)")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts (default 8)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens decoded per sample (default 24)")
    parser.add_argument("--calls", type=int, default=3, help="timed calls after one warm-up (default 3)")
    parser.add_argument("--top", type=int, default=25, help="rows of the profiler table (default 25)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled call")
    parser.add_argument("--baseline", metavar="REV", help="also time tinkergym/backends/torch/sampling.py of git revision REV, calls alternating")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--lora-sampling", choices=("adapter", "merged"), default="adapter", help="LoRA's sampling: through the adapter or a merged copy")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="the backend's precision (auto: the fastest one the CPU computes natively)")
    parser.add_argument("--stop-every", type=int, default=0, metavar="K",
                        help="every K-th token id stops a row: rows of many lengths (default 0: no row stops early)")
    parser.add_argument("--quick", action="store_true", help="1 timed call of 4 tokens, no profile (a smoke test)")
    args = parser.parse_args(argv)
    if args.stop_every < 0:
        parser.error(f"--stop-every {args.stop_every}: give a positive K (every K-th id stops a row), or 0 for no early stop")
    if args.quick:
        args.calls, args.new_tokens, args.no_profile = 1, 4, True
    return args


def decode_matmul_rate(batch: int, hidden: int, intermediate: int, vocab: int, dtype: str, seconds: float = 1.0) -> float:
    """FLOP/s of the decode step's own linear shapes ([batch, in] x [in, out]) in ``dtype``: the best of 5 rounds of about
    a fifth of ``seconds`` each (one pass over the shapes is timed first, so an emulated precision stays as short)."""
    import torch

    shapes = [(hidden, hidden), (hidden, intermediate), (intermediate, hidden), (hidden, vocab)]
    xs = [torch.randn(batch, k).to(getattr(torch, dtype)) for k, _ in shapes]
    ws = [torch.randn(n, k).to(getattr(torch, dtype)) for k, n in shapes]
    flops = sum(2.0 * batch * k * n for k, n in shapes)

    def one_pass() -> None:
        for x, w in zip(xs, ws):
            torch.nn.functional.linear(x, w)

    one_pass()  # warm-up
    start = time.perf_counter()
    one_pass()
    passes = min(max(1, int(seconds / 5 / max(time.perf_counter() - start, 1e-6))), 1000)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(passes):
            one_pass()
        best = max(best, passes * flops / (time.perf_counter() - start))
    return best


def build(mode: str, model: str, lora_sampling: str = "adapter", dtype: str = "auto") -> Any:
    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    rank = 8 if mode == "lora" else 0
    return TorchBackend(TorchBackendConfig(model=resolve_model(model), lora_rank=rank, lora_alpha=16, lora_dropout=0.0, dtype=dtype, device="cpu", seed=0,
                                           lora_sampling=lora_sampling))


def request(backend: Any, args: argparse.Namespace) -> Any:
    """The GRPO-shaped request: Bandit-v0's first prompts, chat-rendered, ``args.group`` samples each, no early stop."""
    from grpo_setup import BenchSettings, step_prompts

    from tinkergym.protocol.types import SampleRequest, SamplingParams
    from tinkergym.chat import ChatTemplateRenderer

    renderer = ChatTemplateRenderer(backend.info()["tokenizer"])
    rows = step_prompts(BenchSettings(prompts=args.prompts), 0)
    prompts = [renderer.prompt_tokens(messages, None) for _, messages in rows]
    stops = list(range(args.stop_every, len(backend.tokenizer), args.stop_every)) if args.stop_every else [len(backend.tokenizer) + 5]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1, stop_token_ids=stops)
    return SampleRequest(prompts=prompts, params=params, num_samples=args.group)


class SplitTimer:
    """Wall time of ``prefill`` (in each given sampling module) and of every later forward pass of the sampling model."""

    def __init__(self, backend: Any, modules: list[Any]) -> None:
        self.originals = [(m, m.prefill) for m in modules]
        self.model = backend._sampling_model()
        self.prefill_s = self.forward_s = 0.0
        self.forwards = 0
        self._in_prefill = False
        for module, original in self.originals:
            module.prefill = self._timed(original)
        self.hooks = [self.model.register_forward_pre_hook(self._pre), self.model.register_forward_hook(self._post)]

    def _timed(self, original: Any) -> Any:
        def timed_prefill(*a: Any, **k: Any) -> Any:
            start, self._in_prefill = time.perf_counter(), True
            try:
                return original(*a, **k)
            finally:
                self.prefill_s += time.perf_counter() - start
                self._in_prefill = False

        return timed_prefill

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        if not self._in_prefill:
            self.forward_s += time.perf_counter() - self._start
            self.forwards += 1

    def reset(self) -> None:
        self.prefill_s = self.forward_s = 0.0
        self.forwards = 0

    def close(self) -> None:
        for module, original in self.originals:
            module.prefill = original
        for hook in self.hooks:
            hook.remove()


def baseline_module(revision: str) -> Any:
    """``tinkergym/backends/torch/sampling.py`` as it was at git ``revision``, loaded as a module of its own."""
    import importlib.util
    import pathlib
    import subprocess
    import tempfile

    root = pathlib.Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{revision}:tinkergym/backends/torch/sampling.py"], cwd=root, check=True, capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "torch_sampling_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("torch_sampling_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile_call(backend: Any, req: Any, top: int) -> None:
    """One call under torch.profiler: the top ops by self CPU time and the time spent outside any op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        backend.sample(req)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top))
    in_ops = sum(e.self_cpu_time_total for e in averages if not e.key.startswith("ProfilerStep")) / 1e6
    print(f"profiled call {wall:.2f} s; self time of all ops {in_ops:.2f} s; outside any op (Python, framework) {wall - in_ops:.2f} s")


def unseeded(sample_batch: Any) -> Any:
    """A baseline's ``sample_batch`` from before seeded requests drew one stream per sample: it gets the device's generator
    in place of the streams (its ids then differ from the current revision's wherever the request is seeded)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 5 and callable(getattr(args[5], "rand", None)):
            args = (*args[:5], None, *args[6:])
        if callable(getattr(kwargs.get("generator"), "rand", None)):
            kwargs["generator"] = None
        return sample_batch(*args, **kwargs)
    return call


def timed_calls(backend: Any, req: Any, variants: dict[str, Any], calls: int, new_tokens: int | None) -> tuple[dict[str, list], dict[str, Any]]:
    """``calls`` timed calls per variant (a sampling module), the variants taking turns, after one warm-up call each."""
    from tinkergym.backends.torch import backend as torch_backend

    timer = SplitTimer(backend, list(variants.values()))
    records: dict[str, list] = {name: [] for name in variants}
    outputs: dict[str, Any] = {}
    try:
        for i in range(calls + 1):
            order = list(variants.items()) if i % 2 == 0 else list(reversed(variants.items()))
            for name, module in order:
                torch_backend.sample_batch = module.sample_batch if hasattr(module, "SeededRows") else unseeded(module.sample_batch)
                timer.reset()
                start = time.perf_counter()
                outputs[name] = backend.sample(req)
                total = time.perf_counter() - start
                assert new_tokens is None or all(len(s.tokens) == new_tokens for group in outputs[name].sequences for s in group)
                if i:  # the first round is the warm-up
                    records[name].append({"total": total, "prefill": timer.prefill_s, "forward": timer.forward_s,
                                          "rest": total - timer.prefill_s - timer.forward_s, "steps": timer.forwards + 1})
    finally:
        torch_backend.sample_batch = variants["current"].sample_batch
        timer.close()
    return records, outputs


def compare(outputs: dict[str, Any]) -> str:
    """Whether the baseline sampled the same ids, and the largest logprob difference where it did."""
    new, old = (outputs[k].sequences for k in ("current", "baseline"))
    pairs = [(a, b) for ga, gb in zip(new, old) for a, b in zip(ga, gb)]
    same = [(a, b) for a, b in pairs if a.tokens == b.tokens]
    diff = max((abs(x - y) for a, b in same for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    return f"{len(same)}/{len(pairs)} sequences with the same ids as the baseline; largest logprob difference among them {diff:.2e}"


def run_mode(mode: str, args: argparse.Namespace, rates: dict[str, float]) -> dict[str, Any]:
    import torch

    from tinkergym.backends.torch import sampling as torch_sampling

    backend = build(mode, args.model, args.lora_sampling, args.dtype)
    req = request(backend, args)
    variants = {"current": torch_sampling}
    if args.baseline:
        variants["baseline"] = baseline_module(args.baseline)
    records, outputs = timed_calls(backend, req, variants, args.calls, None if args.stop_every else args.new_tokens)
    lengths = [len(s.tokens) for group in outputs["current"].sequences for s in group]
    params = sum(p.numel() for n, p in backend.model.named_parameters() if "lora_" not in n)
    batch = args.prompts * args.group
    distinct_tokens = sum(len(p) for p in req.prompts)
    prompt_len = statistics.mean(len(p) for p in req.prompts)
    flops = {"decode": 2.0 * params * batch * (args.new_tokens - 1), "prefill": 2.0 * params * distinct_tokens}
    print(f"\n== {mode}: {batch} sequences x {args.new_tokens} tokens, prompts of ~{prompt_len:.0f} tokens "
          f"({distinct_tokens} distinct prompt tokens), dtype {backend.dtype}, attention {backend.attn_implementation}, threads {torch.get_num_threads()}")
    if args.stop_every:
        print(f"rows stop on every {args.stop_every}th id: {statistics.mean(lengths):.1f} tokens a row on average, {max(lengths)} the longest "
              f"(the FLOP floor below counts every row to the end)")
    medians = {}
    for name, rows in records.items():
        med = medians[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        n = med["steps"] - 1
        calls = ", ".join(f"{r['total']:.2f}" for r in rows)
        print(f"{name}: sample {med['total']:.3f} s median, {min(r['total'] for r in rows):.3f} s best of {args.calls} ({calls})")
        print(f"  prefill {med['prefill']:.3f} s | decode forwards {med['forward']:.3f} s ({1e3 * med['forward'] / max(n, 1):.1f} ms/step x {n:.0f}) "
              f"| rest {med['rest']:.3f} s ({1e3 * med['rest'] / med['steps']:.1f} ms/step: drawing, flags, loop)")
    if args.baseline:
        best = {name: min(r["total"] for r in rows) for name, rows in records.items()}
        print(f"speedup {medians['baseline']['total'] / medians['current']['total']:.2f}x (medians), "
              f"{best['baseline'] / best['current']:.2f}x (best calls); {compare(outputs)}")
    total_flops = flops["decode"] + flops["prefill"]
    for name, rate in rates.items():
        print(f"  floor at {name} {rate / 1e12:.2f} TFLOP/s: decode {flops['decode'] / rate:.3f} s + prefill {flops['prefill'] / rate:.3f} s "
              f"= {total_flops / rate:.3f} s  (current call {medians['current']['total'] * rate / total_flops:.1f}x)")
    if not args.no_profile:
        profile_call(backend, req, args.top)
    return {"mode": mode, "dtype": str(backend.dtype).removeprefix("torch."), "attn_implementation": backend.attn_implementation,
            "sequences": batch, "new_tokens": args.new_tokens, "stop_every": args.stop_every, "mean_tokens": statistics.mean(lengths),
            "flop_floor": total_flops, "median": medians, "calls": records}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from tinkergym.backends.models import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = bench_machine.resolve_precision(args.dtype, "cpu")
    facts = bench_machine.machine_facts("cpu")
    warning = bench_machine.emulation_warning("the backend", args.dtype, "cpu")
    if warning:
        print(warning)
    square = bench_machine.matmul_rate("cpu", args.dtype)
    config = json.loads(open(f"{resolve_model(args.model)}/config.json").read())
    shaped = decode_matmul_rate(args.prompts * args.group, config["hidden_size"], config["intermediate_size"], config["vocab_size"], args.dtype)
    print(f"CPU: {bench_machine.describe(facts)}")
    print(f"matmul in {args.dtype}: square {square['matmul_n']} {square['matmul_flops'] / 1e12:.2f} TFLOP/s; "
          f"decode shapes (batch {args.prompts * args.group}) {shaped / 1e12:.2f} TFLOP/s")
    rates = {"square": square["matmul_flops"], "decode-shapes": shaped}
    modes = [run_mode(mode, args, rates) for mode in args.modes]
    print(json.dumps({"machine": facts, "dtype": args.dtype, "matmul": {**square, "decode_shapes_flops": shaped}, "modes": modes,
                      "notes": [warning] if warning else []}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
