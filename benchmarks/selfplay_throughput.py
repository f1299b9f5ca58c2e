"""Self-play rollout throughput: a batch of games played at once against the same games played one at a time.

    python benchmarks/selfplay_throughput.py                          # SmolLM2-135M, 16 games of 7x7 Gomoku (4 in a row)
    python benchmarks/selfplay_throughput.py --model tiny --games 32  # the test-sized model
    python benchmarks/selfplay_throughput.py --temperature 1.0        # sampled moves (the two runs then play different games)
    python benchmarks/selfplay_throughput.py --quick --model tiny     # 2 games of 2 moves a seat (a smoke test)

The learner holds both seats of every ``tinker/GomokuDuel-v0`` game (pure self-play) and plays up to
``--max-turns`` moves per seat. ``batched`` plays all games through one :func:`tinkergym.games.play_games`
call (one ``sample`` call per round for every game's seat to move); ``one at a time`` calls it once per
game, in order, with the same seeds; ``batched, no prefix cache`` is the batched run with the backend's prefix
cache off, so every round prefills each seat's whole conversation again. Greedy by default, so the runs play
the same games (up to batch numerics: the table shows each run's moves). Columns: ``wall`` seconds; ``moves/s`` every move of every
seat (rejected ones included) per second; ``sample`` time inside ``sample``; ``env`` time inside the env's
``reset`` / ``step`` / ``observe``; ``env share`` env over wall; ``other`` the rest (rendering, decoding,
bookkeeping); ``reused`` the share of prompt tokens the prefix cache supplied. The ratio lines are the batched run's
moves per second over the other runs'. The model runs in ``--dtype`` (``auto``: the precision the CPU computes
natively, as tinkergym's ``dtype="auto"``; a forced emulated one prints a warning with its cost); the CPU's kind and
the precision are printed first and recorded in the JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import bench_machine
import tinkergym
from tinkergym.chat import ChatTemplateRenderer
from tinkergym.games import Game, ModelPlayer, play_games
from tinkergym.rollouts import RolloutConfig


class TimedEnv:
    """An AEC env whose ``reset``, ``step`` and ``observe`` are timed; everything else is the env's."""

    def __init__(self, env: Any, stats: dict[str, float]) -> None:
        self.__dict__["env"], self.__dict__["stats"] = env, stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.stats["env"] += time.perf_counter() - start

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        return self._timed(self.env.reset, seed=seed, options=options)

    def step(self, action: Any) -> None:
        return self._timed(self.env.step, action)

    def observe(self, agent: str) -> str:
        return self._timed(self.env.observe, agent)


class TimedSampler:
    """The backend's ``sample``, timed and counted."""

    def __init__(self, backend: Any, stats: dict[str, float]) -> None:
        self.backend, self.stats = backend, stats

    def sample(self, request: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.backend.sample(request)
        finally:
            self.stats["sample"] += time.perf_counter() - start
            self.stats["calls"] += 1


def run(backend: Any, renderer: ChatTemplateRenderer, args: argparse.Namespace, batched: bool, cache_mb: float = 1024.0) -> dict[str, float]:
    """Play the benchmark's games batched or one at a time, with a prefix cache of ``cache_mb`` MiB; return the timings."""
    from tinkergym.backends.torch.prefix_cache import PrefixCache

    backend.prefix_cache = PrefixCache(max_bytes=int(cache_mb * 2**20))
    stats = {"env": 0.0, "sample": 0.0, "calls": 0.0}
    learner = ModelPlayer("learner", TimedSampler(backend, stats))
    kwargs = {"size": args.size, "win_length": args.win_length}
    games = [Game(TimedEnv(tinkergym.make_aec("tinker/GomokuDuel-v0", **kwargs), stats), {"player_0": learner, "player_1": learner}, seed=s)
             for s in range(args.games)]
    settings = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    if batched:
        results = play_games(games, renderer, settings)
    else:
        results = [r for g in games for r in play_games([g], renderer, settings)]
    wall = time.perf_counter() - start
    moves = sum(r.moves for r in results)
    illegal = sum(s.illegal_moves for r in results for s in r.seats.values())
    cache = backend.prefix_cache.stats
    return {"wall": wall, "moves": moves, "illegal": illegal, "moves_per_s": moves / wall, **stats, "env_share": stats["env"] / wall,
            "other": wall - stats["sample"] - stats["env"], "reused": cache.reused_tokens / max(1, cache.prompt_tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, or a local folder")
    parser.add_argument("--games", type=int, default=16)
    parser.add_argument("--size", type=int, default=7)
    parser.add_argument("--win-length", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=6, help="moves per seat before the game is cut (a draw)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (both runs play the same games)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="the model's precision (auto: the fastest one the device computes natively)")
    parser.add_argument("--skip-no-cache", action="store_true", help="leave out the run without the prefix cache (the slowest)")
    parser.add_argument("--quick", action="store_true", help="2 games of 2 moves a seat, without the no-cache run (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.games, args.max_turns, args.skip_no_cache = 2, 2, True
    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    backend = TorchBackend(TorchBackendConfig(model=resolve_model(args.model), dtype=args.dtype, seed=args.seed))
    device = backend.device.type
    facts, dtype = bench_machine.machine_facts(device), str(backend.dtype).removeprefix("torch.")
    warning = bench_machine.emulation_warning("the model", dtype, device)
    print(f"CPU: {bench_machine.describe(facts)}; device {device}, {dtype}")
    if warning:
        print(warning)
    renderer = ChatTemplateRenderer(backend.info()["tokenizer"])
    run(backend, renderer, argparse.Namespace(**{**vars(args), "games": 2}), batched=True)  # warm-up
    rows = {"batched": run(backend, renderer, args, batched=True)}
    if not args.skip_no_cache:
        rows["batched, no prefix cache"] = run(backend, renderer, args, batched=True, cache_mb=0)
    rows["one at a time"] = run(backend, renderer, args, batched=False)
    print(f"{'':<25} {'wall s':>8} {'moves':>6} {'illegal':>7} {'moves/s':>8} {'sample s':>9} {'calls':>6} {'env s':>7} {'env share':>9} {'other s':>8} {'reused':>7}")
    for name, r in rows.items():
        print(f"{name:<25} {r['wall']:>8.2f} {r['moves']:>6} {r['illegal']:>7} {r['moves_per_s']:>8.2f} {r['sample']:>9.2f} {int(r['calls']):>6} "
              f"{r['env']:>7.3f} {r['env_share']:>9.2%} {r['other']:>8.2f} {r['reused']:>7.1%}")
    ratios = {name: rows["batched"]["moves_per_s"] / r["moves_per_s"] for name, r in rows.items() if name != "batched"}
    for name, ratio in ratios.items():
        print(f"batched / {name}: {ratio:.2f}x the moves per second")
    print(json.dumps({"model": args.model, "games": args.games, "machine": facts, "dtype": dtype, "notes": [warning] if warning else [],
                      "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      **{k: {m: round(v, 4) for m, v in r.items()} for k, r in rows.items()}}))


if __name__ == "__main__":
    main()
