"""N players trained at once: a league of N LoRA adapters on one shared base against N separate self-play runs.

    python benchmarks/league.py                        # SmolLM2-135M, N = 1, 2, 4, 8, 1 warm-up + 1 timed step each
    python benchmarks/league.py --players 1,4 --steps 2
    python benchmarks/league.py --quick                # tiny model, N = 1, 2, one timed step (a smoke test)

Both sides play GomokuDuel-v0 (5x5, three in a row) with the same settings per player: ``--batch-size`` x
``--group-size`` games a step for each player, at most ``--max-turns`` moves a seat of at most ``--max-new-tokens``
tokens, LoRA rank 8, float32 (this script's ``--dtype``), training passes of one group of games that share a prompt
(``--micro-batch-size``). They differ in this only:

- ``league``: one run, ``--trainer league --backend shared --trainer-arg players=N``: the base once, N adapters; a step
  plays every player's games together (the players' moves of a round in one decode loop) and updates them in one
  mixed-adapter pass.
- ``separate``: N self-play runs (``--trainer selfplay``, ``--backend torch``, each against itself), each in a process
  of its own one after another, as N jobs on one machine would be: their memory adds up (each run its own base), their
  games and time add up too.

Each side and N runs in a fresh process (the runs of ``separate`` each in one of their own), so peak memories never mix.
Reported per side and N: peak RSS (``league``: the run's process; ``separate``: the sum of the N processes' peaks, what
they hold running at once), the median step's wall time (``separate``: the N runs' steps added), games a step and
games per hour. The ratio that matters: the league's memory at N over its memory at N = 1 (goal: at most 1.5x at
N = 8), against separate's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_machine import describe, machine_facts, resolve_precision, worker_result

RESULT_MARK = "LEAGUE_RESULT "


def run_config(out: str, settings: dict[str, Any], trainer: str, players: int) -> Any:
    from tinkergym.config import TrainConfig

    common = dict(env="tinker/GomokuDuel-v0", env_kwargs={"size": 5, "win_length": 3}, model=settings["model_path"], dtype=settings["dtype"],
                  steps=1 + settings["steps"], batch_size=settings["batch_size"], group_size=settings["group_size"], max_turns=settings["max_turns"],
                  max_new_tokens=settings["max_new_tokens"], lora_rank=8, checkpoint_every=1000, transcripts_every=0, out=out, seed=settings["seed"],
                  kl_coef=0.05)  # every row trains (a random policy's games tie): the update is timed whole
    common["micro_batch_size"] = settings["micro_batch_size"]
    if trainer == "league":  # a league step's games are the players' together: as many a player as a separate run's
        return TrainConfig(trainer="league", backend="shared", trainer_args={"players": players}, **{**common, "batch_size": settings["batch_size"] * players})
    return TrainConfig(trainer="selfplay", opponents="", **common)


def run_worker(side: str, players: int, settings: dict[str, Any]) -> dict[str, Any]:
    """One run (``league`` of ``players``, or one ``separate`` self-play run): its steps' times and games, and its peak RSS."""
    from tinkergym.trainers.session import TrainingRun

    with tempfile.TemporaryDirectory() as folder:
        run = TrainingRun(run_config(str(Path(folder) / "run"), settings, side, players))
        started = time.perf_counter()
        run.run(progress=False)
        total = time.perf_counter() - started
        metrics = [json.loads(line) for line in (Path(folder) / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = metrics[1:] or metrics
    return {"side": side, "players": players, "step_s": [m["time/step_s"] for m in metrics], "games": [m["selfplay/games"] for m in metrics],
            "median_step_s": statistics.median(m["time/step_s"] for m in timed), "games_per_step": statistics.median(m["selfplay/games"] for m in timed),
            "run_s": total, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def spawn(side: str, players: int, settings: dict[str, Any]) -> dict[str, Any]:
    return worker_result(__file__, RESULT_MARK, ["--worker", side, "--players", str(players), "--settings", json.dumps(settings)],
                         f"the {side} N={players} worker")


def measure(side: str, players: int, settings: dict[str, Any]) -> dict[str, Any]:
    """``league``: one run of N players. ``separate``: N runs of one, in processes of their own, added up."""
    if side == "league":
        result = spawn("league", players, settings)
    else:
        runs = [spawn("separate", 1, {**settings, "seed": settings["seed"] + i}) for i in range(players)]
        result = {"side": "separate", "players": players, "runs": runs, "median_step_s": sum(r["median_step_s"] for r in runs),
                  "games_per_step": sum(r["games_per_step"] for r in runs), "peak_rss_bytes": sum(r["peak_rss_bytes"] for r in runs)}
    result["games_per_hour"] = result["games_per_step"] / result["median_step_s"] * 3600
    return result


def ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per side and N: peak memory over the side's N = 1; per N: the league's memory and games/h over separate's."""
    by = {(r["side"], r["players"]): r for r in results}
    out: dict[str, dict[str, float]] = {}
    for (side, n), r in sorted(by.items()):
        row = out.setdefault(str(n), {})
        if (side, 1) in by:
            row[f"{side}_memory_over_n1"] = r["peak_rss_bytes"] / by[(side, 1)]["peak_rss_bytes"]
        if side == "league" and ("separate", n) in by:
            row["memory_league_over_separate"] = r["peak_rss_bytes"] / by[("separate", n)]["peak_rss_bytes"]
            row["games_per_hour_league_over_separate"] = r["games_per_hour"] / by[("separate", n)]["games_per_hour"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a name or folder resolve_model takes (tiny: the test model)")
    parser.add_argument("--players", default="1,2,4,8", help="comma-separated numbers of players")
    parser.add_argument("--sides", default="league,separate", help="comma-separated: league, separate")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step (median reported)")
    parser.add_argument("--batch-size", type=int, default=2, help="prompts (game seeds) per step and player")
    parser.add_argument("--group-size", type=int, default=2, help="games per prompt")
    parser.add_argument("--max-turns", type=int, default=4, help="moves per seat at most")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per move at most")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="rows a training pass holds (default: --group-size, which with shared prompts is one group a pass at "
                             "every N, so that a league's passes hold what N = 1's hold and what grows with N is the adapters and "
                             "the games in flight; a larger one mixes more players' rows into a pass: faster on a GPU, more memory)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="float32", help="precision (auto: the device's native one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, N = 1, 2, one timed step of 1 x 2 games (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--worker", choices=("league", "separate"), help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(RESULT_MARK + json.dumps(run_worker(args.worker, int(args.players), json.loads(args.settings))), flush=True)
        return
    if args.quick:
        args.model, args.players, args.steps, args.batch_size, args.group_size, args.max_turns = "tiny", "1,2", 1, 1, 2, 2
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    try:
        counts = sorted({int(n) for n in args.players.split(",") if n.strip()})
    except ValueError:
        sys.exit(f"--players takes comma-separated numbers, not {args.players!r}")
    if not sides or any(s not in ("league", "separate") for s in sides) or not counts or counts[0] < 1 or args.steps < 1:
        sys.exit("--sides takes league and/or separate, --players numbers of at least 1, --steps at least 1")
    from tinkergym.backends.models import resolve_model

    settings = {"model": args.model, "model_path": resolve_model(args.model), "dtype": resolve_precision(args.dtype, "cpu"), "steps": args.steps,
                "batch_size": args.batch_size, "group_size": args.group_size, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                "seed": args.seed, "micro_batch_size": args.micro_batch_size or args.group_size}
    facts = machine_facts("cpu")
    if not args.json:
        print(f"machine: {describe(facts)}; native precision {facts['native_dtype']}", file=sys.stderr, flush=True)
    results = []
    for n in counts:
        for side in sides:
            results.append(measure(side, n, settings))
            r = results[-1]
            if not args.json:
                print(f"  {side} N={n}: step {r['median_step_s']:.2f} s, {r['games_per_hour']:.0f} games/h, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                      file=sys.stderr, flush=True)
    report = {"settings": settings, "machine": facts, "results": results, "ratios": ratios(results)}
    if not args.json:
        for n, row in report["ratios"].items():
            print(f"N={n}: " + "; ".join(f"{k} {v:.2f}" for k, v in row.items()))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
