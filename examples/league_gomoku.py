"""A league of LoRA players on 7x7 Gomoku (four in a row) with SmolLM2-135M: do the players learn?

    python examples/league_gomoku.py                  # warm-up, league, evaluation (2-core CPU: about 90 minutes)
    python examples/league_gomoku.py --steps 2 --eval-games 8 --out runs/league-try   # a short try

1. Warm-up: SFT on the env's random agent's games (``--trainer sft``, ``demos=random``): the move format, no
   strategy (the untrained model writes no legal move). Its adapter is the league's ``--model``, merged into the base.
2. The league (``--trainer league``, ``players=N``): N adapters of the warm model, one shared base, trained against
   each other. Each player's adapter starts at zero (LoRA's B), so every player's first snapshot is the warm model.
3. Greedy games, a pairing's games in one decode loop over one base (one pairing after another, so that each game's
   conversation so far stays in the prefix cache and a turn prefills only its new tokens): the warm model and every
   player against the random agent
   (the same seeds, each seat in turn), and the league's best player (by rating) against its first snapshot.

Writes ``summary.json`` in ``--out``: win/draw/loss with Wilson 95% intervals, and each player's change against the
warm model over the same seeds (paired bootstrap, 95%). Run it again to go on: a finished stage is not run twice (the
league resumes from its newest checkpoint, the evaluation from its next pairing: ``eval/steps-K/``); with more
``--steps`` than before the league goes on past its end and the evaluation runs again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ENV = "tinker/GomokuDuel-v0"
BOARD = {"size": 7, "win_length": 4}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/league-gomoku")
    parser.add_argument("--players", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=6, help="league steps")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4, help="games per step = batch size x group size")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max-turns", type=int, default=12, help="moves per seat (a game that runs past it is a draw)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--eval-games", type=int, default=64, help="games of each evaluated pairing")
    parser.add_argument("--model", default="smollm2-135m")
    return parser.parse_args()


def warm_up(args: argparse.Namespace, out: Path) -> str:
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.session import TrainingRun

    final = out / "sft" / "final"
    if not final.is_dir():
        TrainingRun(TrainConfig(env=ENV, env_kwargs=BOARD, trainer="sft", model=args.model, steps=args.sft_steps, batch_size=8, lr=5e-4,
                                lora_rank=8, lora_alpha=16, micro_batch_size=2, max_context=1024, max_turns=args.max_turns,
                                checkpoint_every=args.sft_steps, out=str(out / "sft"),
                                trainer_args={"demos": "random", "demo_episodes": 128})).run()
    return str(final.resolve())


def league(args: argparse.Namespace, out: Path, warm: str) -> Any:
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.session import TrainingRun

    folder = out / "league"
    if (folder / "checkpoints").is_dir():  # more --steps than the run was started with go on past its end
        steps = json.loads((folder / "config.json").read_text(encoding="utf-8"))["steps"]
        run = TrainingRun.resume(folder, changes={"steps": args.steps} if args.steps > steps else None)
    else:
        run = TrainingRun(TrainConfig(env=ENV, env_kwargs=BOARD, trainer="league", backend="shared", model=warm, steps=args.steps,
                                      batch_size=args.batch_size, group_size=args.group_size, lr=args.lr, lora_rank=8, lora_alpha=16,
                                      max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, micro_batch_size=1, prefix_cache_mb=4096,
                                      checkpoint_every=1, transcripts_every=2, out=str(folder), trainer_args={"players": args.players}))
    run.run()
    return run


def evaluate(args: argparse.Namespace, run: Any) -> dict[str, Any]:
    """Each evaluated pairing's games in one decode loop (the players are adapters of one base), pairing after pairing."""
    from tinkergym.backends.torch.shared import LoraSessionConfig
    from tinkergym.games import Game, ModelPlayer, play_games
    from tinkergym.results.stats import paired_bootstrap_difference, wilson
    from tinkergym.trainers.evaluation import eval_seeds
    from tinkergym.trainers.matches import match_settings, scripted_opponent
    from tinkergym.trainers.session import env_factory

    trainer, c = run.trainer, run.config

    def adapter(folder: Path | None) -> Any:  # a session of the league's base with a player's exported adapter
        session = trainer.joint.open_session(LoraSessionConfig(lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, seed=c.seed))
        if folder is not None:
            session.load_adapter(str(folder))
        return session

    final = Path(c.out) / "final"
    # an adapter that never trained is the warm model: every player's first snapshot
    policies = {"warm": adapter(None), **{name: adapter(final if i == 0 else final / "players" / name) for i, name in enumerate(trainer.players)}}
    best = trainer.table.table()[0]["player"]
    make_env = env_factory(ENV, BOARD, multi_agent=True)
    seeds = eval_seeds(0, args.eval_games)
    random_agent = scripted_opponent(ENV, "random")
    pairings = [(name, "random") for name in policies] + [(best, "warm")]
    # each pairing's scores as it ends: a stopped evaluation goes on from the next pairing
    done = Path(c.out).parent / "eval" / f"steps-{c.steps}"
    done.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    scores: dict[tuple[str, str], list[float]] = {}
    for mine, other in pairings:  # one pairing's games at a time (one decode loop): their conversations fit the prefix cache
        saved = done / f"{mine}-vs-{other}.json"
        if saved.is_file() and len(got := json.loads(saved.read_text(encoding="utf-8"))) == len(seeds):
            scores[(mine, other)] = got
            continue
        games, seats_of = [], []
        for i, seed in enumerate(seeds):
            env = make_env()
            seats = list(env.possible_agents)
            me = seats[i % len(seats)]
            opponent = random_agent if other == "random" else ModelPlayer(other, policies[other], temperature=0.0)
            games.append(Game(env, {s: ModelPlayer(mine, policies[mine], temperature=0.0) if s == me else opponent for s in seats}, seed=seed))
            seats_of.append(me)
        results = play_games(games, trainer.ctx.renderer, match_settings(args.max_turns, args.max_new_tokens))
        # an error counts as a loss
        scores[(mine, other)] = [0.0 if (x := result.outcome(seat)) is None else x for result, seat in zip(results, seats_of)]
        saved.write_text(json.dumps(scores[(mine, other)]) + "\n", encoding="utf-8")
    summary: dict[str, Any] = {"eval_games": args.eval_games, "eval_seconds": round(time.perf_counter() - started, 1), "best": best,
                               "ratings": trainer.table.table(), "pairings": {}}
    for (mine, other), got in scores.items():
        wins = sum(1 for x in got if x == 1.0)
        row = {"games": len(got), "win": wins / len(got), "draw": sum(1 for x in got if x == 0.5) / len(got),
               "loss": sum(1 for x in got if x == 0.0) / len(got), "win_interval": list(wilson(wins, len(got)))}
        if other == "random" and mine != "warm":
            won = [float(x == 1.0) for x in got]
            mean, low, high = paired_bootstrap_difference([float(x == 1.0) for x in scores[("warm", "random")]], won)
            row["win_change_vs_warm"] = [mean, low, high]
        summary["pairings"][f"{mine} vs {other}"] = row
    return summary


def main() -> None:
    args = parse()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    warm = warm_up(args, out)
    timings["warm_up_s"] = round(time.perf_counter() - started, 1)
    run = league(args, out, warm)
    timings["league_s"] = round(time.perf_counter() - started - timings["warm_up_s"], 1)
    summary = {**evaluate(args, run), **timings, "league_steps": run.config.steps, "settings": vars(args)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"\n{'pairing':<20} {'games':>5} {'win':>6} {'draw':>6} {'loss':>6}  win 95%         change vs warm")
    for name, row in summary["pairings"].items():
        change = row.get("win_change_vs_warm")
        shown = f"{change[0]:+.3f} [{change[1]:+.3f}, {change[2]:+.3f}]" if change else ""
        print(f"{name:<20} {row['games']:>5} {row['win']:>6.1%} {row['draw']:>6.1%} {row['loss']:>6.1%}  "
              f"[{row['win_interval'][0]:.3f}, {row['win_interval'][1]:.3f}]  {shown}")
    print(f"\nsummary: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
