"""Train on any single-agent env and compare the greedy evaluation before and after training.

    python examples/train_and_compare.py --env tinker/Math-v0 --kwarg format_reward=0.5 --steps 10
    python examples/train_and_compare.py --env tinker/Gomoku-v0 --kwarg size=7 --kwarg win_length=4 \\
        --kwarg opponent='"random"' --max-turns 8 --max-new-tokens 8 --warmup-sft-steps 20 --steps 15

Every option of ``tinkergym train`` that matters here has a flag; the run folder keeps the metrics, the
learning-curve PNG and the transcripts. The evaluation before training is logged as step -1.

``--warmup-sft-steps N`` first fine-tunes every weight for N steps on the env's baseline agent's games
(``--demos baseline``) into ``OUT/sft``, then runs RL with LoRA from that model (``OUT/sft/final``, a plain
transformers folder): a model that cannot yet write a legal move gets no reward signal from RL (every
episode of a group forfeits alike, so every advantage is 0), and the warm-up gives it one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tinkergym.config import TrainConfig
from tinkergym.trainers.reporting import read_metrics
from tinkergym.trainers.session import TrainingRun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True)
    parser.add_argument("--kwarg", action="append", default=[], help="env KEY=JSON_VALUE (repeatable)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trainer", default="grpo")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--eval-episodes", type=int, default=32)
    parser.add_argument("--warmup-sft-steps", type=int, default=0, help="full fine-tuning steps on baseline demonstrations first")
    parser.add_argument("--warmup-lr", type=float, default=1e-4)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward pass (lower it for long episodes)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kwargs = {k: json.loads(v) for k, v in (pair.split("=", 1) for pair in args.kwarg)}
    out = args.out or f"runs/{args.env.split('/')[-1]}-{args.trainer}"
    model = args.model
    if args.warmup_sft_steps:
        # Its own process: the memory of full fine-tuning goes back to the system before RL starts.
        command = [
            sys.executable, "-m", "tinkergym", "train", "--trainer", "sft", "--demos", "baseline", "--env", args.env,
            "--model", model, "--full", "--lr", str(args.warmup_lr), "--steps", str(args.warmup_sft_steps), "--batch-size", "8",
            "--checkpoint-every", str(args.warmup_sft_steps), "--trainer-arg", "demo_episodes=128", "--out", f"{out}/sft",
            *(f"--kwarg={pair}" for pair in args.kwarg),
        ]
        subprocess.run(command, check=True)
        model = f"{out}/sft/final"
        print(f"warm-up: {args.warmup_sft_steps} SFT steps on baseline games -> {model}")
    config = TrainConfig(
        env=args.env, env_kwargs=kwargs, trainer=args.trainer, model=model, lora_rank=args.lora_rank, lr=args.lr,
        steps=args.steps, batch_size=args.batch_size, group_size=args.group_size, max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens, eval_every=args.steps, eval_episodes=args.eval_episodes,
        checkpoint_every=args.steps, micro_batch_size=args.micro_batch_size, out=out,
    )
    TrainingRun(config).run()
    records = read_metrics(Path(out) / "metrics.jsonl")
    rewards = [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/reward_mean" in r]
    print("step  train reward")
    for step, reward in rewards:
        print(f"{step:>4}  {reward:+.3f}")
    print(f"eval before: reward {evals[0]['eval/reward_mean']:+.3f}, success {evals[0]['eval/success_rate']:.3f}")
    print(f"eval after:  reward {evals[-1]['eval/reward_mean']:+.3f}, success {evals[-1]['eval/success_rate']:.3f}")
    print(f"curve: {Path(out) / 'learning_curve.png'}")


if __name__ == "__main__":
    main()
