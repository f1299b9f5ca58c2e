"""One tenant's huge call on a shared server, another's small one beside it: the small call's latency, with the huge call
worked in slices (``--pass-tokens``) and run whole, against the small call's latency alone.

    python benchmarks/shared_fairness.py                      # SmolLM2-135M, one prompt x 256 samples x 32 tokens
    python benchmarks/shared_fairness.py --samples 512 --new-tokens 64
    python benchmarks/shared_fairness.py --quick --json       # tiny model (a smoke test)

One ``serve shared`` app in this process (its HTTP routes called in-process), two adapters. The small call: one prompt,
one sample, ``--small-tokens`` new tokens (median of ``--repeats`` calls alone). The huge call: one prompt (as every
Tinker ``sample`` call is) and ``--samples`` samples of ``--new-tokens`` new tokens (seeded, temperature 1), decoded in
batches of ``--max-sample-batch`` sequences. For each mode, the huge call is sent, and once its first pass runs the
small call is sent and timed to its answer:

- ``sliced``: ``--pass-tokens`` (default 4096, below one batch's tokens): the huge call is worked one decode batch a
  round, and the small call runs after the batch under way;
- ``whole``: a budget above the huge call's tokens (the server before slicing, or a budget the call fits in): the small
  call waits for the whole huge call.

The huge call runs once first, whole, to warm up (the first pass of each decode shape builds its kernels). Reported:
each latency, the huge call's time in each mode (slicing should cost it nothing), one batch's time (the huge
call's sliced time over its batches) and the ratios beside/alone. The machine's float32 matmul rate is measured in the
same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_machine import describe, machine_facts, matmul_rate, resolve_precision

TOKEN = "f" * 40


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a name or folder resolve_model takes (tiny: the test model)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--samples", type=int, default=256, help="the huge call's samples of its one prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="the huge call's max_new_tokens")
    parser.add_argument("--small-tokens", type=int, default=1, help="the small call's max_new_tokens")
    parser.add_argument("--max-sample-batch", type=int, default=64, help="sequences decoded together (the unit of a slice)")
    parser.add_argument("--pass-tokens", type=int, default=4096, help="a round's token budget in the sliced mode")
    parser.add_argument("--repeats", type=int, default=5, help="small calls alone (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 48 samples of 8 tokens in batches of 8")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.quick:
        args.model, args.samples, args.new_tokens, args.max_sample_batch, args.pass_tokens, args.repeats = "tiny", 48, 8, 8, 64, 3
    from fastapi.testclient import TestClient

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.protocol.types import SampleRequest, SamplingParams
    from tinkergym.serve.auth import token_digest
    from tinkergym.serve.training.shared import create_shared_app

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    facts = machine_facts("cpu")
    dtype = resolve_precision(args.dtype, "cpu")
    rate = matmul_rate("cpu", "float32")
    say(f"CPU: {describe(facts)}; float32 matmul {rate['matmul_flops'] / 1e9:.1f} GFLOP/s")
    base = SharedBase(SharedBaseConfig(model=resolve_model(args.model), dtype=dtype, max_sample_batch=args.max_sample_batch))
    run_dir = Path(tempfile.mkdtemp(prefix="fairness-"))
    app = create_shared_app(base, run_dir=run_dir, token_digest=token_digest(TOKEN), pass_tokens=args.pass_tokens)
    http = TestClient(app)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    worker = app.state.shared.worker
    text = base.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a short story about a lighthouse."}],
                                              add_generation_prompt=True, tokenize=False)
    prompt = list(base.tokenizer(text, add_special_tokens=False)["input_ids"])
    huge = SampleRequest([prompt], SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=7), num_samples=args.samples)
    small = SampleRequest([prompt[-8:]], SamplingParams(max_new_tokens=args.small_tokens, temperature=1.0, seed=3))

    class Client:
        def __init__(self, seed: int) -> None:
            token = http.post("/v1/adapters", headers=admin, json={"seed": seed}).json()["token"]
            self.headers = {"Authorization": f"Bearer {token}"}
            self.session = http.post("/v1/sessions", headers=self.headers).json()["session_id"]
            self.seq = 0

        def send(self, request: Any) -> str:
            self.seq += 1
            body = {"session_id": self.session, "seq": self.seq, "method": "sample", "args": {"request": request.to_dict()}}
            response = http.post("/v1/call?wait=0", headers=self.headers, json=body)
            assert response.status_code in (200, 202), response.text
            return response.json()["request_id"]

        def wait(self, request_id: str) -> dict[str, Any]:
            while True:  # a wait is at most 300 s a poll
                response = http.get(f"/v1/requests/{request_id}?wait=300", headers=self.headers)
                if response.status_code != 202:
                    assert response.status_code == 200, response.text
                    return response.json()["result"]

        def timed(self, request: Any) -> float:
            start = time.perf_counter()
            self.wait(self.send(request))
            return time.perf_counter() - start

    heavy, light = Client(1), Client(2)
    light.timed(small)  # warm-up
    worker.pass_tokens = 1 << 40
    warm = heavy.timed(huge)  # every decode shape once (the first pass of a shape builds its kernels)
    say(f"the huge call once, to warm up: {warm:.2f} s")
    alone = statistics.median(light.timed(small) for _ in range(args.repeats))
    say(f"small call alone: {alone:.3f} s (median of {args.repeats})")
    batches = -(-args.samples // args.max_sample_batch)
    modes: dict[str, dict[str, float]] = {}
    results = {}
    for mode, budget in (("sliced", args.pass_tokens), ("whole", 1 << 40)):
        worker.pass_tokens = budget
        start = time.perf_counter()
        big = heavy.send(huge)
        while not worker._running:
            time.sleep(0.001)
        beside = light.timed(small)
        results[mode] = heavy.wait(big)
        huge_s = time.perf_counter() - start
        modes[mode] = {"small_beside_s": beside, "huge_s": huge_s, "beside_over_alone": beside / alone}
        say(f"{mode}: small call beside the huge one {beside:.3f} s ({beside / alone:.1f}x alone); huge call {huge_s:.2f} s")
    same = [[s["tokens"] for s in row] for row in results["sliced"]["sequences"]] == [[s["tokens"] for s in row] for row in results["whole"]["sequences"]]
    batch_s = modes["sliced"]["huge_s"] / batches
    report = {
        "machine": facts, "float32_matmul": rate, "model": args.model, "dtype": dtype, "samples": args.samples,
        "new_tokens": args.new_tokens, "max_sample_batch": args.max_sample_batch, "pass_tokens": args.pass_tokens, "batches": batches,
        "small_alone_s": alone, "modes": modes, "batch_s": batch_s, "same_samples": same,
        "sliced_beside_over_batch": modes["sliced"]["small_beside_s"] / batch_s,
        "whole_over_sliced_beside": modes["whole"]["small_beside_s"] / modes["sliced"]["small_beside_s"],
        "sliced_huge_over_whole": modes["sliced"]["huge_s"] / modes["whole"]["huge_s"],
    }
    say(f"one batch {batch_s:.2f} s; the small call waited {report['whole_over_sliced_beside']:.1f}x less with slicing; "
        f"the huge call took {report['sliced_huge_over_whole']:.2f}x its whole time; the same samples: {same}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
