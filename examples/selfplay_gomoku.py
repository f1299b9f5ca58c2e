"""Self-play on 7x7 Gomoku (four in a row) with SmolLM2-135M: before and after, against the baseline and random players.

    python examples/selfplay_gomoku.py                       # SFT warm-up, self-play, evaluation (2-core CPU: under 45 min)
    python examples/selfplay_gomoku.py --sft-steps 24 --steps 16 --max-turns 12 --eval-games 32   # about an hour
    python examples/selfplay_gomoku.py --steps 40 --sft-steps 60 --eval-games 64 --max-turns 25

1. SFT warm-up on the baseline's games against itself (each seat's side is one conversation), so the model
   learns the move format and the board (``tinkergym train --trainer sft --demos baseline``). Its LoRA adapter
   (``sft/final``) is the next run's ``--model``: merged into the base, with a new LoRA trained on top.
2. Self-play from the warm model (``tinkergym train --selfplay``): the learner against itself and a league of the
   baseline, a random legal player and its own snapshots, with per-seat advantages, ratings and collapse checks.
3. Greedy games of the warm model and of the trained one against the baseline and the random player, the
   learner taking each seat in turn (``tinkergym eval --opponent``).

Prints win/draw/loss before and after, the rating table, whether collapse detection fired, and where the
learning curve (with its ratings panel) is; writes ``summary.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ENV = "tinker/GomokuDuel-v0"
BOARD = {"size": 7, "win_length": 4}


def matches(model: str | None, run: str | None, games: int, max_turns: int, max_new_tokens: int) -> dict[str, dict[str, float]]:
    """Greedy win/draw/loss of a model (or a run's newest weights) against the baseline and the random player."""
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.games import ModelPlayer
    from tinkergym.trainers.evaluation import eval_seeds
    from tinkergym.trainers.matches import LEARNER, match_settings, opponent_player, play_matches
    from tinkergym.trainers.session import env_factory, load_backend_for_eval

    backend = load_backend_for_eval(model=model, run_dir=run)
    renderer = ChatTemplateRenderer(backend.info()["tokenizer"])
    opponents = {name: opponent_player(name, ENV) for name in ("baseline", "random")}
    records, _ = play_matches(ModelPlayer(LEARNER, backend), opponents, env_factory(ENV, BOARD, multi_agent=True), eval_seeds(0, games),
                              renderer, match_settings(max_turns, max_new_tokens))
    return {name: {**r.rates(), "games": r.games, "errors": r.errors} for name, r in records.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/selfplay-gomoku")
    parser.add_argument("--sft-steps", type=int, default=16)
    parser.add_argument("--sft-batch-size", type=int, default=8, help="games per SFT step (each seat's side is one conversation)")
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=4, help="self-play steps")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8, help="games per step = batch size x group size")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-turns", type=int, default=8, help="moves per seat (a game that runs past it is a draw)")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--micro-batch-size", type=int, default=2,
                        help="sequences per training pass: a seat's game is one long sequence (about 2K tokens at 12 moves a seat)")
    parser.add_argument("--reuse-sft", action="store_true", help="skip the warm-up when OUT/sft/final exists (a previous run's)")
    parser.add_argument("--eval-games", type=int, default=16, help="games against each opponent, before and after")
    args = parser.parse_args()
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.league import League
    from tinkergym.trainers.reporting import read_metrics
    from tinkergym.trainers.session import TrainingRun

    out = Path(args.out)
    common = dict(env=ENV, env_kwargs=BOARD, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, checkpoint_every=10, transcripts_every=5,
                  micro_batch_size=args.micro_batch_size)
    if not (args.reuse_sft and (out / "sft" / "final").is_dir()):
        TrainingRun(TrainConfig(trainer="sft", model="smollm2-135m", steps=args.sft_steps, batch_size=args.sft_batch_size, lr=args.sft_lr,
                                out=str(out / "sft"), trainer_args={"demos": "baseline", "demo_episodes": 128}, **common)).run()
    warm = str(out / "sft" / "final")
    before = matches(warm, None, args.eval_games, args.max_turns, args.max_new_tokens)
    selfplay = TrainingRun(TrainConfig(trainer="selfplay", model=warm, steps=args.steps, batch_size=args.batch_size, group_size=args.group_size,
                                       lr=args.lr, snapshot_every=max(1, args.steps // 3), eval_every=max(1, args.steps // 2), eval_episodes=8, out=str(out / "selfplay"), **common))
    selfplay.run()
    after = matches(None, str(out / "selfplay"), args.eval_games, args.max_turns, args.max_new_tokens)
    records = read_metrics(out / "selfplay" / "metrics.jsonl")
    fired = [r["step"] for r in records if r.get("collapse/any")]
    newest = max((out / "selfplay" / "checkpoints").glob("step_*/trainer_state.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    state = json.loads(newest.read_text())
    league = League()
    league.load_state_dict(state.get("state", state)["league"])
    print(f"\n{'opponent':<10} {'before W/D/L':>20} {'after W/D/L':>20}")
    for name in before:
        b, a = before[name], after[name]
        print(f"{name:<10} {b['win']:>6.0%} {b['draw']:>6.0%} {b['loss']:>6.0%} {a['win']:>6.0%} {a['draw']:>6.0%} {a['loss']:>6.0%}")
    print("\nratings at the end of self-play:\n" + league.table())
    print(f"\ncollapse detection fired at steps: {fired or 'never'}")
    print(f"learning curve: {out / 'selfplay' / 'learning_curve.png'}")
    summary = {"before": before, "after": after, "collapse_steps": fired, "ratings": league.ratings()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
