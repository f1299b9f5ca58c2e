"""A GRPO step through RemoteBackend (a training server on 127.0.0.1) against the same step on a local TorchBackend.

    python benchmarks/remote_step.py                          # tiny and smollm2-135m, LoRA, 1 warm-up + 3 timed steps
    python benchmarks/remote_step.py --models tiny --steps 10 --json
    python benchmarks/remote_step.py --models smollm2-135m --full

The step is ``benchmarks/grpo_step.py``'s: 8 prompts x 8 samples of at most 32 new tokens of ``tinker/Bandit-v0``,
scored by the env, then one optimizer step (LoRA r=8, or every weight with ``--full``). Both sides run
tinkergym's ``GRPOTrainer`` with the same config and seed; only the backend differs:

- local: a :class:`~tinkergym.backends.torch_backend.TorchBackend` in this process;
- remote: ``tinkergym serve-backend`` started by this script as its own process on 127.0.0.1 (a real uvicorn
  server, a bearer token, the JSON wire protocol), built with the same settings, and a
  :class:`~tinkergym.backends.remote.RemoteBackend` in this process.

The two alternate step by step (local step i, then remote step i), so a change in what else the machine runs
touches both alike; only one of them computes at a time. Same seeds, same settings: the remote metrics must
equal the local ones (the ``same_metrics`` field; float32 on the tiny model is exact, bfloat16 may differ
in the last bits between processes). The first step of each is a warm-up; medians of the next ``--steps``.

Reported per model: the median step of each side and their ratio (target: at most 1.05), the bytes of the
request and response bodies per remote step and the number of HTTP requests, and where the extra time goes:
``client_serde_s`` (``json.dumps`` / ``json.loads`` in RemoteBackend, from its :class:`WireStats`),
``server_overhead_s`` (from the server's own JSON log: the summed duration of its HTTP requests minus the
summed duration of the Backend calls they ran, i.e. parsing, validation, encoding, thread hand-offs and
waiting in the event loop), and ``serde_share`` = both over the remote step time. The tiny model's step is
milliseconds of compute, so its ratio shows the protocol's fixed cost; SmolLM2's shows it on a real step.

The tiny model has random weights: its completions name no arm, so it is paid a number hashed from the
completion's text (``grpo_step.py``'s ``--reward hash``), which makes every group train. SmolLM2 is paid the
env's reward.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_machine import CpuShare, _load
from grpo_step import BenchSettings, _timed, make_env, versions

#: Metric keys that are timings (they differ between the sides by nature).
VOLATILE = ("time/", "perf/", "timing/", "throughput/")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_path: str, lora_rank: int, folder: Path, threads: int) -> tuple[subprocess.Popen, str, str, Path]:
    """``tinkergym serve-backend`` on a free loopback port: (process, url, token, its JSON log file)."""
    token = secrets.token_urlsafe(32)
    token_file = folder / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    run_dir = folder / "server"
    model_args = ["--full"] if lora_rank == 0 else ["--lora-rank", str(lora_rank)]
    command = [
        sys.executable, "-m", "tinkergym", "serve-backend", "--model", model_path, *model_args, "--device", "cpu", "--seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file), "--run-dir", str(run_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the training server exited with {process.returncode}; run the command by hand: {' '.join(command)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, url, token, run_dir / "server.log"
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the training server did not answer /health within 300 s")


def server_times(log: Path, start_line: int) -> tuple[int, float, float]:
    """(lines read, seconds of HTTP requests, seconds of Backend calls) of the server log from line ``start_line``."""
    lines = log.read_text(encoding="utf-8").splitlines()
    requests = calls = 0.0
    for line in lines[start_line:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "request" and record.get("route", "").startswith(("/v1/call", "/v1/requests")):
            requests += record["duration_ms"] / 1000
        elif record.get("event") == "call":
            calls += record["duration_ms"] / 1000
    return len(lines), requests, calls


def _stable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def run_model(model: str, s: BenchSettings, lora_rank: int, say: Any) -> dict[str, Any]:
    """Alternate local and remote steps of ``model``; medians, ratio, bytes and where the remote time goes."""
    import torch

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.remote import RemoteBackend
    from tinkergym.backends.torch_backend import TorchBackend, TorchBackendConfig
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.trainers.base import TrainingContext
    from tinkergym.trainers.config import TrainConfig
    from tinkergym.trainers.grpo import GRPOTrainer

    model_path = resolve_model(model)
    s.reward = "hash" if model == "tiny" else "env"
    config = TrainConfig(
        env=s.env, env_kwargs=s.env_kwargs, model=model_path, lora_rank=lora_rank, batch_size=s.prompts, group_size=s.group_size,
        lr=s.lr, max_grad_norm=s.max_grad_norm, max_turns=1, max_new_tokens=s.max_new_tokens, temperature=s.temperature, seed=s.seed,
    ).validate()
    with tempfile.TemporaryDirectory(prefix="remote-step-") as scratch:
        say(f"{model}: starting the training server ...")
        process, url, token, log = start_server(model_path, lora_rank, Path(scratch), torch.get_num_threads())
        try:
            # The server's settings: serve-backend's defaults with --lora-rank (or --full), seed 0, on the CPU.
            local = TorchBackend(TorchBackendConfig(model=model_path, lora_rank=lora_rank, device="cpu", seed=0))
            remote = RemoteBackend(url, token, cache_dir=Path(scratch, "cache"))
            trainers, seconds = {}, {"local": {}, "remote": {}}
            for side, backend in (("local", local), ("remote", remote)):
                for name in ("sample", "forward_backward", "optim_step"):
                    _timed(backend, name, seconds[side])
                ctx = TrainingContext(config, backend, ChatTemplateRenderer(backend.info()["tokenizer"]), lambda: make_env(s))
                trainers[side] = GRPOTrainer(ctx)
            records: list[dict[str, Any]] = []
            log_line, same, load = 0, True, {}
            for step in range(1 + s.steps):
                if step == 1:
                    load["start"] = _load()
                row: dict[str, Any] = {}
                metrics = {}
                for side, trainer in trainers.items():
                    wire = remote.wire.snapshot()
                    seconds[side].update(sample=0.0, forward_backward=0.0, optim_step=0.0)
                    cpu = CpuShare()
                    start = time.perf_counter()
                    output = trainer.train_step(step)
                    row[f"{side}_s"] = time.perf_counter() - start
                    if side == "local":  # during a remote step the server is another process: its cores are ours
                        row["other_cores"] = cpu.stop()["other_cores"]
                    metrics[side] = _stable(output.metrics)
                    row[f"{side}_backend_s"] = sum(seconds[side].values())
                    row.update({f"{side}_{name}_s": t for name, t in seconds[side].items()})
                    if side == "remote":
                        after = remote.wire.snapshot()
                        delta = {k: after[k] - wire[k] for k in after}
                        log_line, request_s, call_s = server_times(log, log_line)
                        row.update(
                            requests=delta["requests"], bytes_sent=delta["bytes_sent"], bytes_received=delta["bytes_received"],
                            client_serde_s=delta["encode_s"] + delta["decode_s"], server_overhead_s=max(request_s - call_s, 0.0),
                            server_call_s=call_s,
                        )
                        row["serde_share"] = (row["client_serde_s"] + row["server_overhead_s"]) / row["remote_s"]
                row["ratio"] = row["remote_s"] / row["local_s"]
                diff = max((abs(metrics["local"][k] - metrics["remote"].get(k, float("nan"))) for k in metrics["local"]), default=0.0)
                row["max_metric_diff"] = diff
                same = same and metrics["local"].keys() == metrics["remote"].keys() and diff <= 1e-6
                row["reward_mean"] = metrics["local"].get("reward/mean")
                records.append(row)
                say(f"  step {step}{' (warm-up)' if step == 0 else ''}: local {row['local_s']:.3f} s, remote {row['remote_s']:.3f} s "
                    f"({row['ratio']:.3f}x; backend calls local {row['local_backend_s']:.3f} s, remote {row['remote_backend_s']:.3f} s, "
                    f"on the server {row['server_call_s']:.3f} s), {row['bytes_sent'] / 1024:.0f} KiB sent, {row['bytes_received'] / 1024:.0f} KiB received")
            load["end"] = _load()
            remote.close()
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    timed = records[1:] or records
    median = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    return {
        "model": model, "mode": "full" if lora_rank == 0 else "lora", "dtype": local.info()["dtype"], "steps": records, "median": median,
        "ratio": median["remote_s"] / median["local_s"], "same_metrics": same, "load": load,
    }


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'model':<14} {'mode':<5} {'dtype':<9} {'local s':>8} {'remote s':>9} {'ratio':>6} {'requests':>9} {'sent KiB':>9} "
          f"{'recv KiB':>9} {'client serde ms':>16} {'server overhead ms':>19} {'serde share':>12} {'same':>5} {'other':>6}")
    for r in results:
        m = r["median"]
        print(f"{r['model']:<14} {r['mode']:<5} {r['dtype']:<9} {m['local_s']:>8.3f} {m['remote_s']:>9.3f} {r['ratio']:>6.3f} "
              f"{int(m['requests']):>9} {m['bytes_sent'] / 1024:>9.1f} {m['bytes_received'] / 1024:>9.1f} "
              f"{1000 * m['client_serde_s']:>16.1f} {1000 * m['server_overhead_s']:>19.1f} {m['serde_share']:>12.3%} "
              f"{'yes' if r['same_metrics'] else 'NO':>5} {m['other_cores']:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2-135m", help="comma-separated names resolve_model takes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step (median reported)")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA r=8")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    if args.steps < 1:
        sys.exit("--steps must be at least 1")

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    results = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        settings = BenchSettings(steps=args.steps, model=model)
        results.append(run_model(model, settings, 0 if args.full else settings.lora_rank, say))
    report = {"versions": versions(), "results": results}
    if not args.json:
        print_table(results)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
