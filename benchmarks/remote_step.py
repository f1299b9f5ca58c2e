"""A GRPO step through RemoteBackend (a training server on 127.0.0.1) against the same step on a local TorchBackend.

    python benchmarks/remote_step.py                          # tiny and smollm2-135m, LoRA, 1 warm-up + 3 timed steps
    python benchmarks/remote_step.py --models tiny --steps 10 --json
    python benchmarks/remote_step.py --models smollm2-135m --full
    python benchmarks/remote_step.py --quick                  # the tiny model, 1 timed step of 2 prompts x 4 samples (a smoke test)

The step is ``benchmarks/grpo_step.py``'s: 8 prompts x 8 samples of at most 32 new tokens of ``tinker/Bandit-v0``,
scored by the env, then one optimizer step (LoRA r=8, or every weight with ``--full``). Both sides run
tinkergym's ``GRPOTrainer`` with the same config and seed; only the backend differs:

- local: a :class:`~tinkergym.backends.torch.backend.TorchBackend` in this process;
- remote: ``tinkergym serve backend`` started by this script as its own process on 127.0.0.1 (a real uvicorn
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

Both sides compute in ``--dtype`` (``auto``: the precision the CPU computes natively, as tinkergym's ``dtype="auto"``;
a forced emulated one prints a warning with its cost); the CPU's kind is recorded with the results.

The tiny model has random weights: its completions name no arm, so it is paid a number hashed from the
completion's text (``grpo_step.py``'s ``--reward hash``), which makes every group train. SmolLM2 is paid the
env's reward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable, Iterator

from bench_machine import CpuShare, _load, describe, emulation_warning, free_port, machine_facts, resolve_precision
from grpo_setup import QUICK_SHAPE, BenchSettings, _timed, make_env, versions

#: Metric keys that are timings (they differ between the sides by nature).
VOLATILE = ("time/", "perf/", "timing/", "throughput/")


def start_server(model_path: str, lora_rank: int, folder: Path, threads: int, lora_alpha: int, micro_batch_size: int,
                 dtype: str = "auto") -> tuple[subprocess.Popen, str, str, Path]:
    """``tinkergym serve backend`` on a free loopback port: (process, url, token, its JSON log file)."""
    token = secrets.token_urlsafe(32)
    token_file = folder / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    run_dir = folder / "server"
    model_args = ["--full"] if lora_rank == 0 else ["--lora-rank", str(lora_rank), "--lora-alpha", str(lora_alpha)]
    model_args += ["--micro-batch-size", str(micro_batch_size), "--dtype", dtype]
    command = [
        sys.executable, "-m", "tinkergym", "serve", "backend", "--model", model_path, *model_args, "--device", "cpu", "--seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file), "--run-dir", str(run_dir),
    ]
    url = f"http://127.0.0.1:{port}"
    return start_process(command, url + "/health", folder, threads, "serve_backend"), url, token, run_dir / "server.log"


def start_process(command: list[str], health: str, folder: Path, threads: int, what: str, timeout: float = 300.0) -> subprocess.Popen:
    """Start a server ``command`` (``OMP_NUM_THREADS`` = ``threads``, its stderr to ``folder/<what>.err``) and wait until
    ``health`` answers 200; a server that exits or stays silent for ``timeout`` seconds raises with its stderr's tail."""
    env = {k: v for k, v in os.environ.items() if k != "TINKERGYM_SCHEDULER_DB"}
    env["OMP_NUM_THREADS"] = str(threads)
    err = folder / f"{what}.err"
    with open(err, "wb") as sink:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sink, env=env)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            tail = err.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited with {process.returncode}: {' '.join(command)}\n{tail}")
        try:
            with urllib.request.urlopen(health, timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"{what} did not answer {health} within {timeout:.0f} s")


def server_times(log: Path | None, start_line: int) -> tuple[int, float, float]:
    """(lines read, seconds of HTTP requests, seconds of Backend calls) of the server log from line ``start_line``."""
    lines = log.read_text(encoding="utf-8").splitlines() if log is not None and log.is_file() else []
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


@contextlib.contextmanager
def remote_side(via: str, model: str, config: Any, scratch: Path, threads: int, say: Any) -> Iterator[tuple[Any, Callable[[], Any], Callable[[], Path | None], dict[str, float]]]:
    """The remote backend: (backend, its RemoteBackend (for the wire counters), its server's log, setup times).

    ``direct``: ``serve backend`` started here. ``scheduler``: ``tinkergym scheduler serve`` and ``tinkergym worker
    --slots 1`` started here, the run submitted as a job; the worker starts the server, the client connects to it.
    """
    if via == "direct":
        say(f"{model}: starting the training server ...")
        process, url, token, log = start_server(config.model_path, config.lora_rank, scratch, threads, config.lora_alpha, config.micro_batch_size,
                                                config.dtype)
        from tinkergym.backends.remote import RemoteBackend

        remote = RemoteBackend(url, token, cache_dir=scratch / "cache")
        try:
            yield remote, lambda: remote, lambda: log, {}
        finally:
            remote.close()
            _stop(process)
        return
    from tinkergym.backends.scheduled import ScheduledBackend
    from tinkergym.client import SchedulerClient

    with scheduler_with_worker(model, scratch, threads) as (url, client_key, work_dir):
        started = time.perf_counter()
        backend = ScheduledBackend.submit(SchedulerClient(url, client_key), "train", config.job_config,
                                          say=say, poll=0.2, remote={"cache_dir": scratch / "cache"})
        backend.connect()
        setup = {"submit_to_connected_s": time.perf_counter() - started}

        def log() -> Path | None:
            found = sorted(work_dir.rglob("server.log"))
            return found[-1] if found else None

        yield backend, lambda: backend._remote, log, setup
        backend.complete()


@contextlib.contextmanager
def scheduler_with_worker(model: str, scratch: Path, threads: int) -> Iterator[tuple[str, str, Path]]:
    """``tinkergym scheduler serve`` (SQLite in ``scratch``) and ``tinkergym worker --slots 1`` serving ``model``, started
    here on 127.0.0.1: (the scheduler's URL, a client key that may submit, the worker's folder); both stop after."""
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.credentials import WorkerBounds, create_worker_key
    from tinkergym.scheduler.db import make_engine, upgrade

    db = f"sqlite:///{scratch / 'scheduler.db'}"
    engine = make_engine(db)
    upgrade(engine)
    client_key, worker_key = create_key(engine, "bench", ["read", "write"])[1], create_worker_key(engine, WorkerBounds(1))[1]
    engine.dispose()
    port = free_port()
    scheduler = subprocess.Popen([sys.executable, "-m", "tinkergym", "scheduler", "serve", "--db", db, "--data-dir", str(scratch / "data"),
                                  "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work_dir = scratch / "worker"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TINKERGYM_API_KEY": worker_key}
    worker = subprocess.Popen([sys.executable, "-m", "tinkergym", "worker", "--scheduler", f"http://127.0.0.1:{port}", "--slots", "1",
                               "--models", model, "--work-dir", str(work_dir), "--host", "127.0.0.1", "--heartbeat", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/readyz", scheduler)
        yield f"http://127.0.0.1:{port}", client_key, work_dir
    finally:
        _stop(worker)
        _stop(scheduler)


def _wait_http(url: str, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[3]} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {seconds:g} s")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def _stable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def run_model(model: str, s: BenchSettings, lora_rank: int, say: Any, via: str = "direct") -> dict[str, Any]:
    """Alternate local and remote steps of ``model``; medians, ratio, bytes and where the remote time goes."""
    import torch

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.trainers.base import TrainingContext
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.grpo import GRPOTrainer

    model_path = resolve_model(model)
    s.reward = "hash" if model == "tiny" else "env"
    config = TrainConfig(
        env=s.env, env_kwargs=s.env_kwargs, model=model, lora_rank=lora_rank, batch_size=s.prompts, group_size=s.group_size,
        lr=s.lr, max_grad_norm=s.max_grad_norm, max_turns=1, max_new_tokens=s.max_new_tokens, temperature=s.temperature, seed=s.seed,
        dtype=s.dtype,
    ).validate()
    server = SimpleNamespace(model_path=model_path, lora_rank=lora_rank, lora_alpha=config.lora_alpha, micro_batch_size=config.micro_batch_size,
                             dtype=s.dtype, job_config=config.job_config())
    with tempfile.TemporaryDirectory(prefix="remote-step-") as scratch, \
            remote_side(via, model, server, Path(scratch), torch.get_num_threads(), say) as (remote, wire_of, log_of, setup):
        # The server's settings: the run's LoRA rank, alpha and micro-batch size, seed 0, on the CPU.
        local = TorchBackend(TorchBackendConfig(model=model_path, lora_rank=lora_rank, lora_alpha=config.lora_alpha,
                                                micro_batch_size=config.micro_batch_size, device="cpu", seed=0, dtype=s.dtype))
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
                wire = wire_of().wire.snapshot()
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
                    after = wire_of().wire.snapshot()
                    delta = {k: after[k] - wire[k] for k in after}
                    log_line, request_s, call_s = server_times(log_of(), log_line)
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
    timed = records[1:] or records
    median = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    return {
        "model": model, "via": via, "mode": "full" if lora_rank == 0 else "lora", "dtype": local.info()["dtype"], "steps": records,
        "median": median, "ratio": median["remote_s"] / median["local_s"], "same_metrics": same, "load": load, **setup,
    }


def print_table(results: list[dict[str, Any]], facts: dict[str, Any]) -> None:
    print(f"CPU: {describe(facts)}")
    print(f"{'model':<14} {'via':<10} {'mode':<5} {'dtype':<9} {'local s':>8} {'remote s':>9} {'ratio':>6} {'requests':>9} {'sent KiB':>9} "
          f"{'recv KiB':>9} {'client serde ms':>16} {'server overhead ms':>19} {'serde share':>12} {'same':>5} {'other':>6}")
    for r in results:
        m = r["median"]
        print(f"{r['model']:<14} {r['via']:<10} {r['mode']:<5} {r['dtype']:<9} {m['local_s']:>8.3f} {m['remote_s']:>9.3f} {r['ratio']:>6.3f} "
              f"{int(m['requests']):>9} {m['bytes_sent'] / 1024:>9.1f} {m['bytes_received'] / 1024:>9.1f} "
              f"{1000 * m['client_serde_s']:>16.1f} {1000 * m['server_overhead_s']:>19.1f} {m['serde_share']:>12.3%} "
              f"{'yes' if r['same_metrics'] else 'NO':>5} {m['other_cores']:>6.2f}")
        if "submit_to_connected_s" in r:
            print(f"  {r['model']} through the scheduler: {r['submit_to_connected_s']:.2f} s from submission to the job's server answering")


def add_step_options(parser: argparse.ArgumentParser, sides: str) -> None:
    """The options of the step benchmarks (this one and tinker_step.py): models, timed steps, precision, --quick, --json."""
    parser.add_argument("--models", default="tiny,smollm2-135m", help="comma-separated names resolve_model takes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step (median reported)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help=f"precision of {sides} (auto: the fastest one the CPU computes natively)")
    parser.add_argument("--quick", action="store_true", help="the tiny model only, 1 timed step of 2 prompts x 4 samples of at most 8 new tokens (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")


def step_options(args: argparse.Namespace) -> Callable[[str], None]:
    """Apply --quick and check --steps (exits on a bad one); the ``say`` that prints progress to stderr unless --json."""
    if args.quick:
        args.models, args.steps = "tiny", 1
    if args.steps < 1:
        sys.exit("--steps must be at least 1")

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    return say


def step_precision(args: argparse.Namespace, sides: str, say: Callable[[str], None]) -> tuple[str, dict[str, Any], str | None]:
    """``(dtype, machine facts, warning)``: the precision --dtype names on this CPU, said when it is emulated."""
    dtype, facts = resolve_precision(args.dtype, "cpu"), machine_facts("cpu")
    warning = emulation_warning(sides, dtype, "cpu")
    if warning:
        say(warning)
    return dtype, facts, warning


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_options(parser, "both sides")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA r=8")
    parser.add_argument("--via", choices=("direct", "scheduler", "both"), default="direct",
                        help="the remote side: a server started here, or a job of a scheduler whose worker starts it (both: one after the other)")
    args = parser.parse_args()
    say = step_options(args)
    dtype, facts, warning = step_precision(args, "both sides", say)
    results = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        settings = BenchSettings(steps=args.steps, model=model, dtype=dtype, **(QUICK_SHAPE if args.quick else {}))
        for via in (("direct", "scheduler") if args.via == "both" else (args.via,)):
            results.append(run_model(model, settings, 0 if args.full else settings.lora_rank, say, via))
    report = {"versions": versions(), "machine": facts, "dtype": dtype, "results": results, "notes": [warning] if warning else []}
    if not args.json:
        print_table(results, facts)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
