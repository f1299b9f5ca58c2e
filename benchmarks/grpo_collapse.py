"""One-step reward collapses of GRPO with LoRA on the SFT-warmed tiny model: tinkergym against TRL, same settings.

    python benchmarks/grpo_collapse.py                              # 25 steps, seeds 11,12,13, lr 1e-2 and 5e-3, both sides
    python benchmarks/grpo_collapse.py --quick                      # 3 steps, one seed, one lr (a smoke test)
    python benchmarks/grpo_collapse.py --only tinkergym --lrs 1e-2 --seeds 11 --trainer-args '{"scale_by_std": false}'
    python benchmarks/grpo_collapse.py --cache /tmp/warm --out collapse.json

The model is the one ``tests/trainers/test_learning.py``'s ``warm_model`` fixture makes: the tiny model (random
weights) after SFT on ``tinker/Bandit-v0``'s baseline demonstrations (3 arms, ``reward_mode="expected"``, full
fine-tuning, 60 steps of 16, lr 2e-3), made once and kept in ``--cache``. Each run then trains a LoRA adapter
(r=8, alpha 16, dropout 0, every linear layer) with GRPO: 8 prompts x 8 samples of at most 4 new tokens
(temperature 1), float32, one optimizer step per batch, clip 0.2, no KL, max grad norm 1, constant learning rate.

The two sides are matched as ``grpo_step.py`` matches them (the TRL side is ``grpo_trl.py``'s trainer, see
``grpo_step.py``'s docstring): the same prompts (tinkergym's seeds for each step, the env's observation and system
prompt in the model's chat template), the env's reward (TRL's reward function resets the env with the prompt's
seed and steps it with the completion), the same seed, learning rate, LoRA and optimizer settings. Settings that
still differ, by each library's defaults: TRL's ``dapo`` loss (token sum over the whole generation batch's
completion tokens) against tinkergym's ``ppo`` loss with token aggregation normalized by the step's sampled tokens
(the same thing); TRL's ``scale_rewards="group"`` divides by the group's sample std (N-1) + 1e-4, tinkergym by the
population std (N) + 1e-6 and gives tied groups exact zeros; TRL computes the loss over 8 micro-batches of 8
completions with gradient accumulation, tinkergym over groups sharing their prompt's KV cache; the sampling draws
differ (torch.multinomial against tinkergym's CDF inversion), so the samples, and so the curves, differ from the
first step on. Both sides keep completions cut by the token budget (TRL's ``mask_truncated_completions=False``,
tinkergym's ``truncation="keep"``) with the env's reward.

Every run is a fresh subprocess with one torch thread. The JSON file (``--out``) holds, per run, the mean reward
of every step and the share of the step's samples that hit the token budget (ended without a stop token; TRL's
``completions/clipped_ratio``). The table gives, per side, lr and seed: the lowest step reward, the number of
collapse steps (a step more than 0.25 below the mean of the 5 before it), the mean reward of the first 5 and of
the last 5 steps, and the run's time.

Measured (2-core CPU, seeds 11-20): at lr 1e-2, 4 of 10 runs collapse on each side (7 collapse steps tinkergym's,
12 TRL's), at 5e-3 none; in a collapse step most samples repeat the arm's name to the budget (``redredredred``,
invalid). It is GRPO's knife edge on this model, not tinkergym's (see docs/training/index.md, how the loss is computed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT_MARK = "GRPO_COLLAPSE_RESULT "
#: The settings of ``tests/trainers/test_learning.py`` (its ``COMMON``).
ENV_KWARGS = {"arms": 3, "reward_mode": "expected"}
COMMON = dict(env="tinker/Bandit-v0", dtype="float32", env_kwargs=ENV_KWARGS, max_new_tokens=4, checkpoint_every=1000, transcripts_every=0)
DROP = 0.25


def warm_model(cache: Path) -> str:
    """The tiny model after SFT on Bandit's baseline demonstrations (the ``warm_model`` fixture's recipe), made once in ``cache``."""
    final = cache / "sft" / "final"
    if (final / "config.json").exists():
        return str(final)
    from tinkergym.backends.models import build_tiny_model
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.session import TrainingRun

    tiny = build_tiny_model(cache / "tiny")
    config = TrainConfig(trainer="sft", model=tiny, lora_rank=0, steps=60, batch_size=16, lr=2e-3, out=str(cache / "sft"),
                         trainer_args={"demos": "baseline", "demo_episodes": 64}, **COMMON)
    TrainingRun(config).run(progress=False)
    return str(final)


def run_tinkergym(model: str, lr: float, seed: int, steps: int, trainer_args: dict[str, Any], config_args: dict[str, Any]) -> dict[str, list[float]]:
    """Our GRPO (``TrainingRun``), LoRA r8: the mean reward and budget share of every step."""
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.grpo import GRPOTrainer
    from tinkergym.trainers.reporting import read_metrics
    from tinkergym.trainers.session import TrainingRun

    budget: list[float] = []
    update = GRPOTrainer.update

    def counting_update(self: GRPOTrainer, backend: Any, trajectories: list, *args: Any, **kwargs: Any) -> dict[str, float]:
        # A sample cut by max_new_tokens ends without a stop token (the env, not the budget, ends a Bandit episode,
        # so the rollout's budget_truncated does not count these).
        stops = set(self.ctx.renderer.stop_token_ids)
        budget.append(sum(t.num_sampled_tokens >= self.ctx.config.max_new_tokens and t.tokens[-1] not in stops
                          for t in trajectories) / max(len(trajectories), 1))
        return update(self, backend, trajectories, *args, **kwargs)

    GRPOTrainer.update = counting_update  # this worker process only
    with tempfile.TemporaryDirectory(prefix="grpo-collapse-") as out:
        config = TrainConfig(trainer="grpo", model=model, lora_rank=8, lora_alpha=16, lora_dropout=0.0, steps=steps, batch_size=8, group_size=8,
                             lr=lr, seed=seed, out=out, trainer_args=trainer_args, **{**COMMON, **config_args})
        run = TrainingRun(config)
        run.run(progress=False)
        rows = read_metrics(run.folder / "metrics.jsonl")
    return {"reward": [r["reward/mean"] for r in rows], "budget": budget}


def run_trl(model: str, lr: float, seed: int, steps: int) -> dict[str, list[float]]:
    """TRL's GRPOTrainer as ``grpo_trl.py`` sets it up (``steps`` optimizer steps): the mean reward and budget share of every step."""
    from grpo_setup import BenchSettings
    from grpo_trl import _trl_trainer

    s = BenchSettings(env_kwargs=ENV_KWARGS, max_new_tokens=4, lr=lr, steps=steps - 1, seed=seed, dtype="float32", trl_dtype="float32",
                      device="cpu", model="tiny-warm", model_path=model, reward="env")
    with tempfile.TemporaryDirectory(prefix="grpo-collapse-trl-") as out:
        trainer, _ = _trl_trainer(s, "lora", out)
        trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    return {"reward": [r["reward"] for r in logs], "budget": [r["completions/clipped_ratio"] for r in logs]}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(args.worker)
    if spec["side"] == "trl":
        result = run_trl(spec["model"], spec["lr"], spec["seed"], spec["steps"])
    else:
        result = run_tinkergym(spec["model"], spec["lr"], spec["seed"], spec["steps"], spec["trainer_args"], spec["config_args"])
    print(RESULT_MARK + json.dumps(result), flush=True)


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in a fresh one-thread interpreter; its curves and wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return {**{k: spec[k] for k in ("side", "lr", "seed")}, **json.loads(line[len(RESULT_MARK):]), "seconds": seconds}
    raise RuntimeError(f"the {spec['side']} run (lr {spec['lr']}, seed {spec['seed']}) failed (exit {proc.returncode}):\n"
                       + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))


def collapses(rewards: list[float], drop: float = DROP) -> list[int]:
    """Steps whose reward is more than ``drop`` below the mean of the 5 steps before them."""
    return [i for i in range(5, len(rewards)) if sum(rewards[i - 5 : i]) / 5 - rewards[i] > drop]


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """A run's row of the table."""
    r = run["reward"]
    return {"min": min(r), "collapses": len(collapses(r)), "collapse_steps": collapses(r), "first5": sum(r[:5]) / len(r[:5]),
            "last5": sum(r[-5:]) / len(r[-5:])}


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"{'side':<10} {'lr':>7} {'seed':>4} {'min':>7} {'collapses':>9} {'first5':>7} {'last5':>7} {'time s':>7}  collapse steps")
    for run in runs:
        s = run["summary"]
        print(f"{run['side']:<10} {run['lr']:>7g} {run['seed']:>4} {s['min']:>7.3f} {s['collapses']:>9} {s['first5']:>7.3f} {s['last5']:>7.3f} "
              f"{run['seconds']:>7.0f}  {s['collapse_steps']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 steps, the first seed and lr only (a smoke test)")
    parser.add_argument("--steps", type=int, default=25, help="GRPO steps per run")
    parser.add_argument("--seeds", default="11,12,13", help="comma-separated seeds")
    parser.add_argument("--lrs", default="1e-2,5e-3", help="comma-separated learning rates")
    parser.add_argument("--only", choices=("tinkergym", "trl"), help="run one side only")
    parser.add_argument("--cache", default=None, help="folder of the warmed model (made once; default: a temporary folder)")
    parser.add_argument("--trainer-args", default="{}", help="tinkergym's trainer_args as JSON (e.g. '{\"scale_by_std\": false}')")
    parser.add_argument("--config-args", default="{}", help="more tinkergym TrainConfig fields as JSON (e.g. '{\"truncation\": \"mask\"}')")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    parser.add_argument("--json", action="store_true", help="print only the JSON report")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.worker:
        worker(args)
        return
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    lrs = [float(s) for s in args.lrs.split(",") if s.strip()]
    steps = args.steps
    if args.quick:
        seeds, lrs, steps = seeds[:1], lrs[:1], 3
    sides = [args.only] if args.only else ["tinkergym", "trl"]
    with tempfile.TemporaryDirectory(prefix="grpo-collapse-warm-") as scratch:
        cache = Path(args.cache or scratch)
        started = time.perf_counter()
        model = warm_model(cache)
        warm_s = time.perf_counter() - started
        if not args.json:
            print(f"warm model: {model} ({warm_s:.0f} s)", file=sys.stderr, flush=True)
        runs = []
        for lr in lrs:
            for seed in seeds:
                for side in sides:
                    spec = {"side": side, "lr": lr, "seed": seed, "steps": steps, "model": model,
                            "trainer_args": json.loads(args.trainer_args), "config_args": json.loads(args.config_args)}
                    run = run_one(spec)
                    run["summary"] = summary(run)
                    runs.append(run)
                    if not args.json:
                        print(f"{side} lr {lr:g} seed {seed}: {[round(r, 2) for r in run['reward']]} ({run['seconds']:.0f} s)", file=sys.stderr, flush=True)
    report = {"settings": {"steps": steps, "seeds": seeds, "lrs": lrs, "sides": sides, "drop": DROP, "trainer_args": json.loads(args.trainer_args),
                           "config_args": json.loads(args.config_args), **COMMON}, "warm_s": warm_s, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if not args.json:
        print_table(runs)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
