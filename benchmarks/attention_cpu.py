"""Attention alone on a GRPO step's shapes: transformers' sdpa against tinkergym's grouped_matmul, on the CPU.

    python benchmarks/attention_cpu.py                  # SmolLM2-135M's heads (9 query, 3 key/value, 64 wide), bfloat16
    python benchmarks/attention_cpu.py --dtype float32 --rounds 20

Shapes, each timed as the best of ``--rounds`` calls (after warm-up), rounds of the two alternating:

- ``train rows``: the training pass's completion rows, 18 rows x 30 queries over a 130-key prompt cache
  (forward and backward, left-padding masks as transformers builds them);
- ``train prompt``: a micro-batch's shared prompts, 3 x 99 tokens, causal without a mask (forward and backward);
- ``prefill``: sampling's shared prompts, 8 x 99 tokens, causal (forward);
- ``decode``: one decode step of 64 rows over 125 cached keys (forward).

Both functions are called as a transformers attention layer calls them (``[B, H, S, D]`` queries made by a
transpose, ``[B, KV, P, D]`` keys and values); the result is the time per call and the ratio sdpa / grouped.
The same bfloat16 matmul rate as ``grpo_step.py`` is printed to place the machine.
"""

from __future__ import annotations

import argparse
import time

import bench_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=10, help="timed calls per shape and implementation (best reported)")
    args = parser.parse_args()

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tinkergym.backends.torch_attention import grouped_matmul_attention

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    dtype = getattr(torch, args.dtype)
    print(f"matmul rate: {bench_machine.matmul_rate('cpu')['matmul_flops'] / 1e12:.3f} TFLOP/s (bfloat16, square); threads {torch.get_num_threads()}, {args.dtype}")
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


if __name__ == "__main__":
    main()
