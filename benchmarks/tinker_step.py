"""The GRPO step three ways: a local LoRA session, our wire (``serve shared``) and the Tinker API (``serve tinker``).

    python benchmarks/tinker_step.py                          # tiny and smollm2-135m, LoRA r=8, 1 warm-up + 3 timed steps
    python benchmarks/tinker_step.py --models smollm2-135m --steps 5 --json
    python benchmarks/tinker_step.py --quick                  # the tiny model, 1 timed step of 2 prompts x 4 samples (a smoke test)

The step is ``benchmarks/grpo_step.py``'s (its ``BenchSettings``): 8 prompts x 8 samples of at most 32 new tokens
of ``tinker/Bandit-v0``, scored by the env, then one optimizer step of a LoRA r=8 adapter. Every side runs tinkergym's
``GRPOTrainer`` with the same config and seed on the same engine, a
:class:`~tinkergym.backends.torch.shared.SharedBase` with one :class:`~tinkergym.backends.torch.shared.LoraSession`
(rank 8, alpha 32, seed 0, micro-batches of 8 rows, ``--dtype``); only the way the trainer reaches it differs:

- local: the session itself, in this process (no server, no wire);
- wire: ``tinkergym serve shared`` started here as its own process on 127.0.0.1, one adapter opened on it with the
  server's token (``POST /v1/adapters``), and a :class:`~tinkergym.backends.remote.RemoteBackend` with the
  adapter's token (tinkergym's JSON protocol);
- tinker: ``tinkergym serve tinker`` started here as its own process on 127.0.0.1 with a scheduler key database
  made in a temporary ``--data-dir`` (``create_key``), and a :class:`~tinkergym.backends.tinker_client.TinkerBackend`
  (the ``tinker`` SDK 0.38, key ``tml-<key>``).

The three alternate step by step (local step i, wire step i, tinker step i), so a change in what else the machine
runs touches all alike; only one computes at a time. The first step of each is a warm-up; medians of the next
``--steps``. Reported per model: the median step of each, the ratios tinker/wire (target: at most 1.1 on
SmolLM2-135M) and tinker/local, the sampling and training parts as the trainer saw them, the server's own time in
the engine (its log's ``call`` events), and per step the HTTP requests and the request and response body bytes
(the wire side from RemoteBackend's :class:`~tinkergym.backends.remote.WireStats`; the Tinker side counted on the
SDK's httpx client, headers not counted, its background heartbeats and telemetry included).

How the paths differ (all of it is part of what is measured):

- Adapter: serve tinker opens every LoRA adapter with alpha 32 (Tinker's: the update is scaled by 32 / rank), and a
  client cannot ask for another. The local and wire sessions are opened with alpha 32 too (not the sibling
  benchmarks' 16), so all three start from the same adapter; full fine-tuning is not offered by serve tinker.
- Sampling: the rollout sends one ``sample`` call of 64 prompts (8 distinct prompts, each 8 times, one sample
  each). Local and wire run it as one batch of 64 rows (a shared prompt is prefilled once). TinkerBackend sends one
  Tinker ``asample`` request per distinct prompt, 8 requests of 8 samples, all in flight, each with the rollout's
  seed (so every group draws from the same stream; the 8 samples of a request differ). serve tinker queues them on
  the sampler's adapter, and its shared worker runs an adapter's waiting samples in one pass (those that arrived
  while another ran, or within its gather time), so they run as one to a few batches. Each is an ``asample`` plus at
  least one ``retrieve_future``. The completions, rewards and so
  the trained sequences differ from the other sides' (the ``completion`` and ``trained`` columns; a note says when
  the Tinker side trained on nothing); local and wire must give the same metrics (``same``: float32 exactly,
  bfloat16 up to the last bits between processes).
- Sampler: after each optimizer step TinkerBackend asks for a new sampling client
  (``save_weights_and_get_sampling_client``): serve tinker exports the adapter to disk, opens a new session and
  loads the export into it (``sampler_s``, part of the sample time). Local and wire sample from the training
  session. The samplers of a Tinker session stay open until the session ends, one per step: with serve tinker's
  default ``--max-samplers-per-tenant 32``, a longer run's 33rd sample is refused (429).
- Loss: GRPOTrainer's default ``old_logprobs: trainer`` (the ratio's base is the same pass's logprobs, so the ratio is
  1) is computed in the forward-backward pass locally and on the wire. TinkerBackend sends it as one
  ``cross_entropy`` request with weights ``w * A`` (the same gradient), and computes the loss value and metrics on the
  client from the returned logprobs. serve tinker trains only the positions with a non-zero weight (a group's prompt
  is shared and gets no logits; rows whose advantage is 0 are left out of the pass) and scores the other positions
  in one ``logprobs`` call over the distinct prefixes that hold them, since the Tinker
  contract answers every position's logprob; the local and wire passes score the completions only. (``forward_s``,
  the separate ``forward`` TinkerBackend sends for off-policy settings, is 0 here.)
- Encoding: the wire sends JSON; the Tinker SDK sends ``forward``/``forward_backward`` as zstd-compressed protobuf
  and gets protobuf results and samples back, the rest as JSON. Every Tinker operation is a request that answers a
  future and a ``retrieve_future`` long poll for its result; the wire answers a call within its request when it
  finishes within the wait.
- Server settings: both servers keep their defaults (prefix cache 256 MiB, 64 rows decoded together); a round of the
  shared worker starts once its gather time (serve shared's ``--gather-ms`` 5 ms, serve tinker's fixed 2 ms) passed
  without a new call, at most ten gather times after its first.
- Authentication: serve tinker looks every request's key up in the scheduler's key table (SQLite here); serve shared
  compares a token digest.

Both servers run with ``OMP_NUM_THREADS`` set to this process's torch threads (``--threads``; the ``threads`` of
the result's ``machine``). The ``other`` columns are the cores that neither this process nor the servers used
during a step, the largest of the three sides in the first table: well above 0, the machine was shared and
the figures should be taken again (on 2 cores with other work, 2-thread kernels stall at every barrier; a
step can take ten times as long). The tiny model has random weights:
its completions name no arm, so it is paid a number hashed from the completion's text (``grpo_step.py``'s
``--reward hash``) on every side. SmolLM2 is paid the env's reward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_machine import CpuShare, _load, describe
from grpo_setup import QUICK_SHAPE, BenchSettings, _timed, make_env, versions
from remote_step import _stable, _stop, add_step_options, free_port, start_process, step_options, step_precision

SIDES = ("local", "wire", "tinker")
PARTS = ("sample", "forward_backward", "optim_step")
#: TinkerBackend's own steps timed apart where it has them: the scoring pass before a ppo forward_backward, and the
#: sampling client of the current weights (a new one after each optimizer step).
EXTRA_TINKER = ("_forward_logprobs", "_current_sampler")
#: serve tinker's LoRA alpha (fixed); the other sides are opened with it too.
TINKER_ALPHA = 32.0


def start_shared(model_path: str, folder: Path, threads: int, dtype: str, micro_batch_size: int) -> tuple[subprocess.Popen, str, str, Path]:
    """``tinkergym serve shared`` on a free loopback port: (process, url, the server's token, its JSON log)."""
    token = secrets.token_urlsafe(32)
    token_file = folder / "shared.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port, run_dir = free_port(), folder / "shared"
    command = [sys.executable, "-m", "tinkergym", "serve", "shared", "--model", model_path, "--dtype", dtype, "--device", "cpu",
               "--micro-batch-size", str(micro_batch_size), "--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file),
               "--run-dir", str(run_dir)]
    url = f"http://127.0.0.1:{port}"
    return start_process(command, url + "/health", folder, threads, "serve_shared"), url, token, run_dir / "server.log"


def open_adapter(url: str, admin_token: str, rank: int, alpha: float, seed: int) -> str:
    """Open an adapter on serve shared with the server's token; the adapter's own token."""
    body = json.dumps({"lora_rank": rank, "lora_alpha": alpha, "seed": seed}).encode()
    request = urllib.request.Request(url + "/v1/adapters", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {admin_token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["token"]


def start_tinker(model_path: str, model_name: str, folder: Path, threads: int, dtype: str, micro_batch_size: int | None = None,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str, Path]:
    """``tinkergym serve tinker`` (with ``extra`` options) on a free loopback port with a fresh key database: (process, url, the
    SDK's key, its JSON log)."""
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.db import database_url, make_engine, upgrade

    data_dir = folder / "tinker-data"
    engine = make_engine(database_url(None, data_dir))
    upgrade(engine)
    key = create_key(engine, "bench", ["read", "write"])[1]
    engine.dispose()
    port, run_dir = free_port(), folder / "tinker"
    command = [sys.executable, "-m", "tinkergym", "serve", "tinker", "--model", model_path, "--model-name", model_name, "--dtype", dtype,
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir), "--run-dir", str(run_dir), *extra]
    if micro_batch_size is not None:
        command += ["--micro-batch-size", str(micro_batch_size)]
    url = f"http://127.0.0.1:{port}"
    return start_process(command, url + "/api/v1/healthz", folder, threads, "serve_tinker", 600.0), url, "tml-" + key, run_dir / "server.log"


class HttpCount:
    """Requests and body bytes the tinker SDK's httpx clients exchange with ``port`` (headers not counted), by route.

    Installed on ``httpx.AsyncClient.send`` (the SDK's client class) while the context is open; a response's bytes
    are its ``Content-Length`` (every answer of serve tinker has one)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.requests = self.bytes_sent = self.bytes_received = 0
        self.routes: dict[str, int] = {}
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": self.requests, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "routes": dict(self.routes)}

    @contextlib.contextmanager
    def installed(self) -> Iterator[HttpCount]:
        import httpx

        original = httpx.AsyncClient.send
        counter = self

        async def send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            response = await original(client, request, *args, **kwargs)
            if request.url.port == counter.port:
                try:
                    sent = len(request.content)
                except Exception:  # noqa: BLE001 - a streamed body: its declared length
                    sent = int(request.headers.get("content-length", 0))
                received = int(response.headers.get("content-length", 0))
                route = request.url.path.removeprefix("/api/v1/")
                with counter._lock:
                    counter.requests += 1
                    counter.bytes_sent += sent
                    counter.bytes_received += received
                    counter.routes[route] = counter.routes.get(route, 0) + 1
            return response

        httpx.AsyncClient.send = send  # type: ignore[method-assign]
        try:
            yield self
        finally:
            httpx.AsyncClient.send = original  # type: ignore[method-assign]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system, all threads) process ``pid`` has used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_calls(log: Path, start_line: int) -> tuple[int, dict[str, float], dict[str, int]]:
    """(lines read, seconds and count of the engine calls by method) of a server's JSON log from line ``start_line``.

    A call's ``duration_ms`` is its round's time up to the call's end (one adapter here: the call's own time)."""
    lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in lines[start_line:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "call":
            method = record.get("method", "?")
            seconds[method] = seconds.get(method, 0.0) + record["duration_ms"] / 1000
            counts[method] = counts.get(method, 0) + 1
    return len(lines), seconds, counts


def _work(trainer: Any, output: Any) -> dict[str, int]:
    """Tokens the step sampled and the sequences it trained on (zero-advantage groups are left out of training)."""
    trajectories = output.trajectories
    advantages = trainer.advantages([t.total_reward for t in trajectories])
    trained = [t for t, a in zip(trajectories, advantages) if a != 0.0 and not t.failed and t.num_sampled_tokens]
    return {"completion_tokens": sum(t.num_sampled_tokens for t in trajectories), "prompt_tokens": sum(t.prompt_length for t in trajectories),
            "trained_sequences": len(trained), "trained_tokens": sum(len(t.tokens) for t in trained)}


def run_model(model: str, s: BenchSettings, lora_rank: int, say: Any) -> dict[str, Any]:
    """Alternate local, wire and tinker steps of ``model``; medians, ratios, requests and bytes, and where the time goes."""
    import torch

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.remote import RemoteBackend
    from tinkergym.backends.tinker_client import TinkerBackend
    from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.base import TrainingContext
    from tinkergym.trainers.grpo import GRPOTrainer

    model_path = resolve_model(model)
    s.reward = "hash" if model == "tiny" else "env"
    config = TrainConfig(
        env=s.env, env_kwargs=s.env_kwargs, model=model, lora_rank=lora_rank, lora_alpha=TINKER_ALPHA, batch_size=s.prompts,
        group_size=s.group_size, lr=s.lr, max_grad_norm=s.max_grad_norm, max_turns=1, max_new_tokens=s.max_new_tokens,
        temperature=s.temperature, seed=s.seed, dtype=s.dtype, micro_batch_size=s.micro_batch_size,
    ).validate()
    threads = torch.get_num_threads()
    processes: list[subprocess.Popen] = []
    backends: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tinker-step-") as scratch_name:
        scratch = Path(scratch_name)
        try:
            say(f"{model}: starting serve shared and serve tinker ...")
            shared, shared_url, admin, shared_log = start_shared(model_path, scratch, threads, s.dtype, config.micro_batch_size)
            processes.append(shared)
            tinker_proc, tinker_url, key, tinker_log = start_tinker(model_path, model, scratch, threads, s.dtype, config.micro_batch_size)
            processes.append(tinker_proc)
            counter = HttpCount(int(tinker_url.rsplit(":", 1)[1]))
            with counter.installed():
                started = time.perf_counter()
                base = SharedBase(SharedBaseConfig(model=model_path, dtype=s.dtype, device="cpu", micro_batch_size=config.micro_batch_size))
                backends["local"] = base.open_session(LoraSessionConfig(lora_rank=lora_rank, lora_alpha=TINKER_ALPHA, seed=s.seed))
                setup = {"local_setup_s": time.perf_counter() - started}
                started = time.perf_counter()
                backends["wire"] = RemoteBackend(shared_url, open_adapter(shared_url, admin, lora_rank, TINKER_ALPHA, s.seed), cache_dir=scratch / "cache")
                setup["wire_setup_s"] = time.perf_counter() - started
                started = time.perf_counter()
                backends["tinker"] = TinkerBackend(tinker_url, key, model, lora_rank, seed=s.seed, cache_dir=scratch / "cache")
                setup["tinker_setup_s"] = time.perf_counter() - started
                result = _alternate(backends, config, s, say, counter, {"wire": shared_log, "tinker": tinker_log}, [p.pid for p in processes],
                                    TrainingContext, GRPOTrainer, ChatTemplateRenderer)
                dtype = backends["local"].info()["dtype"]
        finally:
            for name in ("wire", "tinker"):
                if name in backends:
                    with contextlib.suppress(Exception):
                        backends[name].close()
            for process in processes:
                _stop(process)
    median = result["median"]
    return {
        "model": model, "mode": "lora", "lora_rank": lora_rank, "lora_alpha": TINKER_ALPHA, "dtype": dtype, **result, **setup,
        "tinker_over_wire": median["tinker_s"] / median["wire_s"], "tinker_over_local": median["tinker_s"] / median["local_s"],
        "wire_over_local": median["wire_s"] / median["local_s"],
    }


def _alternate(backends: dict[str, Any], config: Any, s: BenchSettings, say: Any, counter: HttpCount, logs: dict[str, Path],
               pids: list[int], TrainingContext: Any, GRPOTrainer: Any, ChatTemplateRenderer: Any) -> dict[str, Any]:
    seconds: dict[str, dict[str, float]] = {side: {} for side in SIDES}
    trainers = {}
    for side in SIDES:
        backend = backends[side]
        for name in PARTS:
            _timed(backend, name, seconds[side])
        if side == "tinker":  # its parts: the scoring pass before forward_backward, a new sampler after each optimizer step
            for name in EXTRA_TINKER:
                if hasattr(backend, name):
                    _timed(backend, name, seconds[side])
        ctx = TrainingContext(config, backend, ChatTemplateRenderer(backend.info()["tokenizer"]), lambda: make_env(s))
        trainers[side] = GRPOTrainer(ctx)
    log_lines = {side: 0 for side in logs}
    records: list[dict[str, Any]] = []
    same, load = True, {}
    for step in range(1 + s.steps):
        if step == 1:
            load["start"] = _load()
        row: dict[str, Any] = {}
        metrics = {}
        for side, trainer in trainers.items():
            before = backends["wire"].wire.snapshot() if side == "wire" else counter.snapshot()
            for name in (*PARTS, *EXTRA_TINKER):
                seconds[side][name] = 0.0
            cpu, servers = CpuShare(), sum(process_cpu_s(pid) for pid in pids)
            start = time.perf_counter()
            output = trainer.train_step(step)
            row[f"{side}_s"] = time.perf_counter() - start
            # cores the servers (ours) did not use either: near 0 means the machine was ours
            row[f"{side}_other_cores"] = max(cpu.stop()["other_cores"] - (sum(process_cpu_s(pid) for pid in pids) - servers) / row[f"{side}_s"], 0.0)
            metrics[side] = _stable(output.metrics)
            row.update({f"{side}_{name}_s": seconds[side][name] for name in PARTS})
            row[f"{side}_train_s"] = seconds[side]["forward_backward"] + seconds[side]["optim_step"]
            row[f"{side}_rest_s"] = row[f"{side}_s"] - sum(seconds[side][name] for name in PARTS)
            row.update({f"{side}_{k}": v for k, v in _work(trainer, output).items()})
            row[f"{side}_reward_mean"] = output.metrics.get("reward/mean")
            if side == "tinker":
                row["tinker_forward_s"] = seconds[side]["_forward_logprobs"]
                row["tinker_sampler_s"] = seconds[side]["_current_sampler"]
            if side in logs:
                after = backends["wire"].wire.snapshot() if side == "wire" else counter.snapshot()
                row[f"{side}_requests"] = after["requests"] - before["requests"]
                row[f"{side}_bytes_sent"] = after["bytes_sent"] - before["bytes_sent"]
                row[f"{side}_bytes_received"] = after["bytes_received"] - before["bytes_received"]
                if side == "tinker":
                    row["tinker_routes"] = {k: v - before["routes"].get(k, 0) for k, v in after["routes"].items() if v - before["routes"].get(k, 0)}
                else:
                    row["wire_client_serde_s"] = (after["encode_s"] - before["encode_s"]) + (after["decode_s"] - before["decode_s"])
                log_lines[side], call_s, calls = server_calls(logs[side], log_lines[side])
                row[f"{side}_server_call_s"] = sum(call_s.values())
                row[f"{side}_server_calls"] = calls
                row[f"{side}_server_call_s_by_method"] = {k: round(v, 4) for k, v in call_s.items()}
                # what the trainer waited on its backend beyond the engine's own time: wire, queues, (de)serialization
                row[f"{side}_outside_engine_s"] = sum(seconds[side][name] for name in PARTS) - row[f"{side}_server_call_s"]
        row["local_outside_engine_s"] = 0.0
        diff = max((abs(metrics["local"][k] - metrics["wire"].get(k, float("nan"))) for k in metrics["local"]), default=0.0)
        row["max_metric_diff"] = diff
        same = same and metrics["local"].keys() == metrics["wire"].keys() and diff <= 1e-6
        row["tinker_over_wire"] = row["tinker_s"] / row["wire_s"]
        row["other_cores"] = max(row[f"{side}_other_cores"] for side in SIDES)
        records.append(row)
        say(f"  step {step}{' (warm-up)' if step == 0 else ''}: local {row['local_s']:.3f} s, wire {row['wire_s']:.3f} s, "
            f"tinker {row['tinker_s']:.3f} s ({row['tinker_over_wire']:.3f}x wire; tinker sample {row['tinker_sample_s']:.3f} s against "
            f"{row['wire_sample_s']:.3f} s, train {row['tinker_train_s']:.3f} s against {row['wire_train_s']:.3f} s); "
            f"requests wire {row['wire_requests']}, tinker {row['tinker_requests']}")
    load["end"] = _load()
    timed = records[1:] or records
    median = {k: statistics.median(r[k] for r in timed) for k in timed[0] if isinstance(timed[0][k], (int, float))}
    return {"steps": records, "median": median, "same_metrics_local_wire": same, "load": load}


def print_table(results: list[dict[str, Any]], facts: dict[str, Any]) -> None:
    print(f"CPU: {describe(facts)}")
    print(f"{'model':<14} {'dtype':<9} {'local s':>8} {'wire s':>8} {'tinker s':>9} {'tinker/wire':>12} {'tinker/local':>13} {'wire/local':>11} "
          f"{'same':>5} {'other':>6}")
    for r in results:
        m = r["median"]
        print(f"{r['model']:<14} {r['dtype']:<9} {m['local_s']:>8.3f} {m['wire_s']:>8.3f} {m['tinker_s']:>9.3f} {r['tinker_over_wire']:>12.3f} "
              f"{r['tinker_over_local']:>13.3f} {r['wire_over_local']:>11.3f} {'yes' if r['same_metrics_local_wire'] else 'NO':>5} {m['other_cores']:>6.2f}")
    print()
    print(f"{'model':<14} {'side':<7} {'step s':>7} {'sample s':>9} {'train s':>8} {'rest s':>7} {'engine s':>9} {'outside s':>10} "
          f"{'requests':>9} {'sent KiB':>9} {'recv KiB':>9} {'completion':>11} {'trained':>8} {'reward':>7} {'other':>6}")
    for r in results:
        m = r["median"]
        for side in SIDES:
            remote = side != "local"
            engine = f"{m[f'{side}_server_call_s']:>9.3f}" if remote else f"{m['local_sample_s'] + m['local_train_s']:>9.3f}"
            wire = (f"{int(m[f'{side}_requests']):>9} {m[f'{side}_bytes_sent'] / 1024:>9.1f} {m[f'{side}_bytes_received'] / 1024:>9.1f}"
                    if remote else f"{'-':>9} {'-':>9} {'-':>9}")
            print(f"{r['model']:<14} {side:<7} {m[f'{side}_s']:>7.3f} {m[f'{side}_sample_s']:>9.3f} {m[f'{side}_train_s']:>8.3f} "
                  f"{m[f'{side}_rest_s']:>7.3f} {engine} {m[f'{side}_outside_engine_s']:>10.3f} {wire} "
                  f"{int(m[f'{side}_completion_tokens']):>11} {int(m[f'{side}_trained_sequences']):>8} {m[f'{side}_reward_mean']:>7.3f} "
                  f"{m[f'{side}_other_cores']:>6.2f}")
        print(f"  {r['model']} tinker: of its sample time {m['tinker_sampler_s']:.3f} s made the new sampling client; of its training time "
              f"{m['tinker_forward_s']:.3f} s scored the batch first (forward); engine calls per step {r['steps'][-1]['tinker_server_calls']}; "
              f"requests {r['steps'][-1]['tinker_routes']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_options(parser, "every side")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of this process and of both servers (0: torch's default here); on a machine others "
                             "share, 1 keeps each side clear of stalled thread barriers")
    args = parser.parse_args()
    say = step_options(args)
    # the SDK warns at every try_again answer of a long poll (an operation past serve tinker's 20 s wait): counted, not printed
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    dtype, facts, warning = step_precision(args, "every side", say)
    results = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        settings = BenchSettings(steps=args.steps, model=model, dtype=dtype, **(QUICK_SHAPE if args.quick else {}))
        results.append(run_model(model, settings, settings.lora_rank, say))
    notes = [warning] if warning else []
    for r in results:
        if r["median"]["tinker_trained_sequences"] == 0:
            notes.append(f"{r['model']}: the Tinker side trained on no sequence (every group's rewards were equal): its step is "
                         "sampling alone, and its ratios compare unlike steps")
    report = {"versions": versions(), "machine": facts, "dtype": dtype, "results": results, "notes": notes}
    if not args.json:
        print_table(results, facts)
        for note in notes:
            print(f"note: {note}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
