"""GRPO steps per hour with rollouts sampled ahead (``--async-steps K``, K = 0, 1, 2), on the local torch backend or
through a Tinker endpoint, where the env is slow or not, and the reward curves.

    python benchmarks/async_rollouts.py                                   # torch, smollm2-135m, MathTool-v0, K = 0 1 2, seeds 0 1 2
    python benchmarks/async_rollouts.py --env tinker/Math-v0 --env-latency 0.5 --ks 0 1 2 4
    python benchmarks/async_rollouts.py --backend tinker                  # through serve tinker (started here)
    python benchmarks/async_rollouts.py --backend remote                  # through serve backend (one started here per run)
    python benchmarks/async_rollouts.py --backend scheduled               # each run a job of a scheduler and worker started here
    python benchmarks/async_rollouts.py --model docs/results/math-tool/warmup_adapter --env-kwargs '{"split": "train", "tools": ["python"]}'
    python benchmarks/async_rollouts.py --env tinker/Bandit-v0            # compute-bound: async must not be slower
    python benchmarks/async_rollouts.py --quick                           # the tiny model, K = 0 1, seed 0, 2 steps (a smoke test)

Every run is a ``TrainingRun`` of tinkergym's GRPO trainer in this process. ``--backend torch`` (default): a local
:class:`~tinkergym.backends.torch.backend.TorchBackend` per run; rollouts sampled ahead draw from its snapshots (a copy of
the LoRA adapter swapped in for each sample call) while the trainer trains. ``--backend tinker``: ``tinkergym
serve tinker`` started here as its own process on 127.0.0.1 (a key database made in a temporary ``--data-dir``, the
SDK's key ``tml-<key>``) and a :class:`~tinkergym.backends.tinker_client.TinkerBackend` per run; its sampling requests
wait in the server's queue beside the training calls. ``--backend remote``: ``tinkergym serve backend`` started here
for each run (its weights start afresh; not timed) and a :class:`~tinkergym.backends.remote.RemoteBackend`; rollouts
sampled ahead name a snapshot the server keeps (``sample`` with ``snapshot``) while the next training calls run.
``--backend scheduled``: ``tinkergym scheduler serve`` and one ``tinkergym worker`` started here; each run is a job
(a :class:`~tinkergym.backends.scheduled.ScheduledBackend`) whose server the worker starts, so a run's time also holds
the lease and the server's start (the same for every K). The default env is ``tinker/MathTool-v0``: multi-turn word
problems with a sandboxed ``python`` tool and a calculator, paid 1 for a correct ``\\boxed{}`` answer plus
``--format-reward`` for a well-formed one (``--env-kwargs`` adds to its kwargs). ``--model`` takes a peft adapter folder
too: ``docs/results/math-tool/warmup_adapter`` is SmolLM2 after the math-tool row's warm-up, which calls python and
boxes what it printed, so its groups' rewards differ and every step trains (the untrained model scores 0 on every
sample, so its steps train nothing). ``--max-episodes-in-flight N`` bounds the rollouts played at once (default: K
steps' worth, every step handed over plays at once). ``--env-latency S`` wraps the env in
:class:`~tinkergym.wrappers.LatencyWrapper`: every env step waits S seconds more (a remote API or judge). The runs of
one seed differ only in K; all use one correction (default: the trainer's for K > 0, ``--old-logprobs trainer --tis-cap
2``: PPO's ratio from the trainer's own logprobs times the truncated weight against the sampler's; ``--old-logprobs
sampler`` for PPO's ratio against the sampler's logprobs; at K = 0 both are the on-policy step), so only the overlap
differs. Runs alternate K within a seed
(K = 0, 1, 2 for seed 0, then seed 1, ...), so a change in what else the machine runs touches every K alike.

Reported per K (medians over seeds): steps per hour over the training loop (the summed ``time/step_s``; the final
checkpoint and export are left out, the same for every K), samples drawn per hour (steps per hour x batch size x group
size), the speed-up over the first K (after an untimed warm-up run), the reward per sample (``reward/mean`` over the
run's steps, the mean over seeds and the seeds' range), where a step's time went (waiting for its rollout,
``time/rollout_wait_s`` or at K = 0 ``time/rollout_s``, and training, ``time/update_s``), the learner's idle fraction
(the time it waited for rollouts over the loop's), how long a rollout ran in the background (``async/rollout_s``) and
the mean version gap of the trained samples. The reward curves are ``reward/mean`` of each step against the samples
drawn so far (batch size x group size per step, the same for every K), per seed and averaged over seeds. ``--plot
FILE`` draws the curves (needs matplotlib). Nothing here asserts a time; on a 2-core CPU sampling and training share
the cores, so the overlap is bounded by them: what async wins here is the env's time (``--env-latency``, tools),
during which the trainer trains.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_machine import describe, machine_facts
from remote_step import _stop, scheduler_with_worker, start_server
from tinker_step import start_tinker

#: The env measured by default; ``--env`` takes any single-agent hub env (its default kwargs, MathTool's given here).
ENV = "tinker/MathTool-v0"


def train(args: argparse.Namespace, url: str | None, key: str | None, k: int, seed: int, folder: Path) -> dict[str, Any]:
    """One run of ``args.steps`` GRPO steps at ``async_steps`` k (through the Tinker endpoint ``url``, or on a local torch
    backend where ``url`` is None); its loop time, steps per hour and per-step numbers."""
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.reporting import read_metrics
    from tinkergym.trainers.session import TrainingRun

    out = folder / f"k{k}-seed{seed}"
    process = None
    if args.backend == "remote":  # a server of its own per run: every run starts from the same weights
        server_folder = folder / f"server-k{k}-seed{seed}"
        server_folder.mkdir(parents=True)
        process, url, key, _ = start_server(args.model_path, args.lora_rank, server_folder, args.server_threads, 2 * args.lora_rank,
                                            args.micro_batch_size, args.dtype)
        where: dict[str, Any] = {"backend_url": url, "model": args.model}
    elif args.backend == "scheduled":
        where = {"scheduler_url": url, "model": args.model}
    elif url:
        where = {"backend": "tinker", "backend_url": url, "model": args.served_name}
    else:
        where = {"backend": "torch", "model": args.model, "dtype": args.dtype}
    env_kwargs = {"format_reward": args.format_reward, "max_turns": args.max_turns} if args.env == ENV else {}
    at_once = args.max_episodes_in_flight or k * args.batch_size * args.group_size or 1
    config = TrainConfig(
        **where, env=args.env, trainer="grpo", lora_rank=args.lora_rank, steps=args.steps, env_latency=args.env_latency,
        batch_size=args.batch_size, group_size=args.group_size, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
        max_context=args.max_context, lr=args.lr, seed=seed, old_logprobs=args.old_logprobs,
        tis_cap=args.tis_cap if args.old_logprobs == "trainer" else 0.0, async_steps=k, checkpoint_every=args.steps,
        max_episodes_in_flight=at_once, micro_batch_size=args.micro_batch_size, transcripts_every=0,
        env_kwargs={**env_kwargs, **json.loads(args.env_kwargs)}, out=str(out),
    )
    try:
        run = TrainingRun(config, backend_token=None if args.backend == "scheduled" else key,
                          api_key=key if args.backend == "scheduled" else None)
        started = time.perf_counter()
        run.run(progress=False)
        wall = time.perf_counter() - started
    finally:
        if process is not None:
            _stop(process)
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 0]
    loop = sum(r["time/step_s"] for r in records)

    def column(name: str, fallback: str | None = None) -> list[float]:
        return [float(r.get(name, r.get(fallback or name, 0.0))) for r in records]

    return {
        "k": k, "seed": seed, "loop_s": loop, "wall_s": wall, "steps_per_hour": len(records) * 3600.0 / loop,
        "idle_fraction": sum(float(r.get("time/rollout_wait_s", r.get("time/rollout_s", 0.0))) for r in records) / loop,
        "reward": column("reward/mean"), "step_s": column("time/step_s"), "rollout_wait_s": column("time/rollout_wait_s", "time/rollout_s"),
        "update_s": column("time/update_s"), "rollout_s": column("async/rollout_s", "time/rollout_s"),
        "version_gap": column("async/version_gap_mean"), "dropped_groups": column("async/dropped_groups"),
        "trained_sequences": column("batch/trained_sequences"), "turns": column("turns/mean"),
    }


def summarize(runs: list[dict[str, Any]], ks: list[int], samples_per_step: int) -> dict[str, Any]:
    """Per K: medians over seeds of steps per hour and the per-step means; the mean reward curve over seeds."""
    out: dict[str, Any] = {}
    base = statistics.median(r["steps_per_hour"] for r in runs if r["k"] == ks[0])
    base_runs = [r for r in runs if r["k"] == ks[0]]
    for k in ks:
        mine = [r for r in runs if r["k"] == k]
        per_hour = statistics.median(r["steps_per_hour"] for r in mine)
        steps = len(mine[0]["reward"])
        per_seed = [statistics.fmean(r["reward"]) for r in mine]  # reward per sample drawn, over the run
        out[str(k)] = {
            "steps_per_hour": per_hour, "speedup": per_hour / base, "samples_per_hour": per_hour * samples_per_step,
            "reward_per_sample": statistics.fmean(per_seed), "reward_per_sample_range": [min(per_seed), max(per_seed)],
            **_by_version(mine, base_runs),
            **{name: statistics.median(statistics.fmean(r[name]) for r in mine) for name in ("step_s", "rollout_wait_s", "update_s", "rollout_s", "version_gap")},
            "idle_fraction": statistics.median(r["idle_fraction"] for r in mine),
            "dropped_groups": sum(sum(r["dropped_groups"]) for r in mine),
            "samples": [samples_per_step * (i + 1) for i in range(steps)],
            "reward_mean": [statistics.fmean(r["reward"][i] for r in mine) for i in range(steps)],
            "reward_by_seed": {str(r["seed"]): r["reward"] for r in mine},
        }
    return out


def _versions(run: dict[str, Any]) -> list[int]:
    """The version of the weights that sampled each step of ``run`` (the step trains version ``step``, ``gap`` versions on)."""
    return [step - round(gap) for step, gap in enumerate(run["version_gap"])]


def _at_versions(runs: list[dict[str, Any]], newest: int) -> list[float]:
    """Per run: the mean over versions 0..``newest`` of the reward per sample each version drew."""
    per_seed = []
    for run in runs:
        drawn: dict[int, list[float]] = {}
        for version, reward in zip(_versions(run), run["reward"]):
            drawn.setdefault(version, []).append(reward)
        per_seed.append(statistics.fmean(statistics.fmean(drawn[v]) for v in range(newest + 1) if v in drawn))
    return per_seed


def _by_version(runs: list[dict[str, Any]], base_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Reward per sample at equal versions, ``runs`` (one K) against ``base_runs`` (K = 0) over the versions every one of
    ``runs`` sampled with. Over a short run, K > 0 samples its first K + 1 steps with the starting weights, so its reward
    per sample over the run lags K updates by construction; at equal versions it says whether the updates of stale
    samples learn as much as those of fresh ones."""
    newest = min(max(_versions(r)) for r in runs)
    mine, base = _at_versions(runs, newest), _at_versions(base_runs, newest)
    return {"versions_compared": newest, "reward_at_equal_versions": statistics.fmean(mine),
            "reward_at_equal_versions_range": [min(mine), max(mine)], "base_at_equal_versions": statistics.fmean(base),
            "base_at_equal_versions_range": [min(base), max(base)]}


def print_report(summary: dict[str, Any], ks: list[int], facts: dict[str, Any], args: argparse.Namespace) -> None:
    where = {"tinker": "through serve tinker", "remote": "through serve backend", "scheduled": "through a scheduler's worker"}.get(args.backend, "on the torch backend")
    print(f"{args.model} {where}, {args.env} (env latency {args.env_latency:g} s a step): {args.batch_size} prompts x {args.group_size} samples "
          f"per step, {args.steps} steps, seeds {args.seeds}; {describe(facts)}")
    print(f"{'K':>2} {'steps/h':>9} {'samples/h':>10} {'speed-up':>9} {'step s':>8} {'wait s':>8} {'idle':>6} {'train s':>8} {'rollout s':>10} "
          f"{'gap':>5} {'dropped':>8} {'reward/sample (seeds)':>24} {'at equal versions (seeds)':>26} {'K=' + str(ks[0]) + ' there':>24}")
    for k in ks:
        s = summary[str(k)]
        low, high = s["reward_per_sample_range"]
        print(f"{k:>2} {s['steps_per_hour']:>9.1f} {s['samples_per_hour']:>10.0f} {s['speedup']:>8.2f}x {s['step_s']:>8.2f} {s['rollout_wait_s']:>8.2f} "
              f"{s['idle_fraction']:>6.2f} {s['update_s']:>8.2f} {s['rollout_s']:>10.2f} {s['version_gap']:>5.2f} {s['dropped_groups']:>8} "
              f"{s['reward_per_sample']:>8.3f} [{low:.3f}, {high:.3f}] "
              f"0..{s['versions_compared']:<2} {s['reward_at_equal_versions']:>6.3f} [{s['reward_at_equal_versions_range'][0]:.3f}, "
              f"{s['reward_at_equal_versions_range'][1]:.3f}] {s['base_at_equal_versions']:>8.3f} [{s['base_at_equal_versions_range'][0]:.3f}, "
              f"{s['base_at_equal_versions_range'][1]:.3f}]")
    print("\nreward/mean (mean over seeds) against samples drawn:")
    print(f"{'samples':>8} " + " ".join(f"{'K=' + str(k):>8}" for k in ks))
    for i, samples in enumerate(summary[str(ks[0])]["samples"]):
        print(f"{samples:>8} " + " ".join(f"{summary[str(k)]['reward_mean'][i]:>8.3f}" for k in ks))


def plot(summary: dict[str, Any], ks: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for k in ks:
        s = summary[str(k)]
        line = axes.plot(s["samples"], s["reward_mean"], label=f"K={k} (mean)", linewidth=2)[0]
        for rewards in s["reward_by_seed"].values():
            axes.plot(s["samples"], rewards, color=line.get_color(), alpha=0.25, linewidth=1)
    axes.set_xlabel("samples drawn")
    axes.set_ylabel("reward/mean")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("torch", "remote", "scheduled", "tinker"), default="torch",
                        help="a local TorchBackend, serve backend started here for each run, a scheduler and worker started here, "
                             "or serve tinker started here")
    parser.add_argument("--model", default="smollm2-135m", help="the model trained (tiny, smollm2-135m, a folder)")
    parser.add_argument("--env-latency", type=float, default=0.0, metavar="S", help="every env step waits S seconds more (LatencyWrapper)")
    parser.add_argument("--env", default=ENV, help=f"the env (default {ENV}; e.g. tinker/Bandit-v0, where every step trains)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="the --async-steps values (the first is the speed-up's base)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--old-logprobs", choices=("sampler", "trainer"), default="trainer",
                        help="the stale samples' correction: (trainer, the default) the ratio against the trainer's own logprobs times "
                        "the truncated importance weight --tis-cap (AReaL's decoupled PPO), or PPO's ratio against the sampler's logprobs")
    parser.add_argument("--tis-cap", type=float, default=2.0, metavar="C", help="with --old-logprobs trainer: the weight's cap (default 2)")
    parser.add_argument("--format-reward", type=float, default=0.1)
    parser.add_argument("--env-kwargs", default="{}", metavar="JSON", help="more kwargs of the env (added to the defaults)")
    parser.add_argument("--max-episodes-in-flight", type=int, default=0, metavar="N",
                        help="bound on the episodes the rollouts ahead play at once (default 0: K steps' worth, all of them)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--server-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="with --backend tinker: OMP threads of the server (default: all cores but one, which the client's envs and tools use; "
                             "more threads than free cores makes every decode step wait at OpenMP barriers)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps of an untimed run first (the server's first passes are slow)")
    parser.add_argument("--plot", metavar="FILE", help="draw the reward curves to this PNG (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="tiny model, K = 0 1, seed 0, 2 steps of 2 x 2 (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    if args.quick:
        args.model, args.ks, args.seeds, args.steps, args.batch_size, args.group_size, args.max_new_tokens = "tiny", [0, 1], [0], 2, 2, 2, 8
    args.served_name = "bench-" + Path(args.model).name

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    from tinkergym.backends.models import resolve_model

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated benchmark still stops its server (the finally below)
    model_path = args.model_path = resolve_model(args.model)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="async-steps-") as tmp:
        folder = Path(tmp)
        process = url = key = None
        jobs = contextlib.ExitStack()
        if args.backend == "scheduled":
            say(f"starting a scheduler and a worker serving {args.model} ...")
            url, key, _ = jobs.enter_context(scheduler_with_worker(args.model, folder, args.server_threads))
        if args.backend == "tinker":
            say(f"starting serve tinker on {args.model} ...")
            process, url, key, _ = start_tinker(model_path, args.served_name, folder, args.server_threads, args.dtype,
                                                extra=("--max-runs-per-tenant", "64", "--max-samplers-per-tenant", "256"))
        try:
            if args.warmup_steps:
                say(f"warm-up: {args.warmup_steps} step(s), not counted ...")
                train(argparse.Namespace(**{**vars(args), "steps": args.warmup_steps}), url, key, args.ks[0], args.seeds[0], folder / "warmup")
            for seed in args.seeds:
                for k in args.ks:
                    run = train(args, url, key, k, seed, folder)
                    runs.append(run)
                    say(f"seed {seed} K={k}: {run['steps_per_hour']:.1f} steps/h (loop {run['loop_s']:.1f} s, run {run['wall_s']:.1f} s), "
                        f"rewards {[round(r, 3) for r in run['reward']]}")
        finally:
            if process is not None:
                _stop(process)
            jobs.close()
    summary = summarize(runs, args.ks, args.batch_size * args.group_size)
    facts = machine_facts("cpu")
    result = {"model": args.model, "backend": args.backend, "env": args.env, "env_latency": args.env_latency, "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
              "by_k": summary, "runs": runs, "machine": facts}
    if not args.json:
        print_report(summary, args.ks, facts, args)
    if args.plot:
        plot(summary, args.ks, args.plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
