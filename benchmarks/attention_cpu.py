"""Attention alone on a GRPO step's shapes: transformers' sdpa against tinkergym's grouped_matmul, on the CPU.

    python benchmarks/attention_cpu.py                  # SmolLM2-135M's heads (9 query, 3 key/value, 64 wide), native precision
    python benchmarks/attention_cpu.py --dtype float32 --rounds 20
    python benchmarks/attention_cpu.py --quick          # 2 rounds (a smoke test)

Shapes, each timed as the best of ``--rounds`` calls (after warm-up), rounds of the two alternating:

- ``train rows``: the training pass's completion rows, 18 rows x 30 queries over a 130-key prompt cache
  (forward and backward, left-padding masks as transformers builds them);
- ``train prompt``: a micro-batch's shared prompts, 3 x 99 tokens, causal without a mask (forward and backward);
- ``prefill``: sampling's shared prompts, 8 x 99 tokens, causal (forward);
- ``decode``: one decode step of 64 rows over 125 cached keys (forward).

Both functions are called as a transformers attention layer calls them (``[B, H, S, D]`` queries made by a
transpose, ``[B, KV, P, D]`` keys and values); the result is the time per call and the ratio sdpa / grouped.
``--dtype auto`` (the default) is the precision the CPU computes natively (tinkergym's ``dtype="auto"``: bfloat16
with AVX512-BF16 or AMX, float32 where bfloat16 is emulated); a forced emulated one prints a warning with its cost.
The CPU's kind and the matmul rate in the same precision (as ``grpo_step.py`` measures it) place the machine; the
last line is the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import bench_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="precision of the inputs (auto: the fastest one the CPU computes natively)")
    parser.add_argument("--rounds", type=int, default=10, help="timed calls per shape and implementation (best reported)")
    parser.add_argument("--quick", action="store_true", help="2 rounds (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tinkergym.backends.torch.attention import grouped_matmul_attention

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    precision = bench_machine.resolve_precision(args.dtype, "cpu")
    dtype = getattr(torch, precision)
    facts = bench_machine.machine_facts("cpu")
    warning = bench_machine.emulation_warning("attention", precision, "cpu")
    if warning:
        print(warning)
    rate = bench_machine.matmul_rate("cpu", precision)
    print(f"CPU: {bench_machine.describe(facts)}; matmul rate {rate['matmul_flops'] / 1e12:.3f} TFLOP/s ({precision}, square {rate['matmul_n']}); inputs in {precision}")
    results = []
    cases = [("train rows", 18, 30, 130, True, True), ("train prompt", 3, 99, 99, False, True), ("prefill", 8, 99, 99, False, False),
             ("prefill pad", 8, 99, 99, True, False), ("decode", 64, 1, 125, True, False)]
    print(f"{'shape':<14}{'B x S over P':>16}{'sdpa ms':>10}{'grouped ms':>12}{'sdpa/grouped':>14}")
    for name, batch, length, kv_length, padded, backward in cases:
        gen = torch.Generator().manual_seed(0)
        query = torch.randn(batch, length, 9, 64, generator=gen).to(dtype).transpose(1, 2)
        key, value = (torch.randn(batch, 3, kv_length, 64, generator=gen).to(dtype) for _ in range(2))
        mask = None
        if padded:
            columns, rows = torch.arange(kv_length), torch.arange(kv_length - length, kv_length)
            pads = torch.randint(0, 20, (batch,), generator=gen)
            mask = ((columns[None, :] <= rows[:, None])[None] & (columns[None, None, :] >= pads[:, None, None]))[:, None]
        best = {"sdpa": float("inf"), "grouped": float("inf")}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for label, attention in (("sdpa", sdpa_attention_forward), ("grouped", grouped_matmul_attention)):
                inputs = [t.detach().requires_grad_(backward) for t in (query, key, value)]
                start = time.perf_counter()
                with torch.set_grad_enabled(backward):
                    out, _ = attention(Layer(), *inputs, mask, scaling=0.125)
                    if backward:
                        out.sum().backward()
                if round_:
                    best[label] = min(best[label], time.perf_counter() - start)
        shape = f"{batch} x {length} / {kv_length}"
        print(f"{name:<14}{shape:>16}{best['sdpa'] * 1e3:>10.2f}{best['grouped'] * 1e3:>12.2f}{best['sdpa'] / best['grouped']:>14.2f}")
        results.append({"shape": name, "batch": batch, "queries": length, "keys": kv_length, "sdpa_s": best["sdpa"], "grouped_s": best["grouped"]})
    print(json.dumps({"machine": facts, "dtype": precision, "matmul": rate, "rounds": args.rounds, "results": results,
                      "notes": [warning] if warning else []}))


if __name__ == "__main__":
    main()
