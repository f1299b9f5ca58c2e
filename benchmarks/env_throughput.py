"""Env throughput: steps per second of every installed env with its baseline agent in the loop.

    python benchmarks/env_throughput.py                       # every installed env, default kwargs
    python benchmarks/env_throughput.py tinker/Gomoku-v0 --kwargs '{"opponent": "random"}'

For each env it reports steps/s with the agent in the loop (``total``) and steps/s of ``env.step`` time
alone (``env``), on the raw env and through ``gym.make``'s wrappers. Multi-agent envs count one step per
agent action.
"""

from __future__ import annotations

import argparse
import json
import time
import sys
from typing import Any

import tinkergym
from tinkergym.agents import RandomTextAgent
from tinkergym.errors import EnvUnavailableError
from tinkergym.registry import load_baseline, load_entry_point


def _single(env: Any, make_agent: Any, seconds: float) -> tuple[int, float, float]:
    steps, env_time, seed = 0, 0.0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        obs, info = env.reset(seed=seed)
        agent, seed = make_agent(seed), seed + 1
        done = False
        while not done:
            action = agent(obs, info)
            t = time.perf_counter()
            obs, _, terminated, truncated, info = env.step(action)
            env_time += time.perf_counter() - t
            steps += 1
            done = terminated or truncated
    return steps, time.perf_counter() - start, env_time


def _aec(env: Any, make_agent: Any, seconds: float) -> tuple[int, float, float]:
    steps, env_time, seed = 0, 0.0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        env.reset(seed=seed)
        agents = {a: make_agent(seed + i) for i, a in enumerate(env.possible_agents)}
        seed += 1
        for name in env.agent_iter():
            obs, _, terminated, truncated, info = env.last()
            action = None if terminated or truncated else agents[name](obs, info)
            t = time.perf_counter()
            env.step(action)
            env_time += time.perf_counter() - t
            steps += action is not None
    return steps, time.perf_counter() - start, env_time


def measure(env_id: str, kwargs: dict[str, Any], seconds: float) -> list[dict[str, Any]]:
    """Measure ``env_id`` raw and (single-agent only) through ``gym.make``."""
    s = tinkergym.spec(env_id)
    baseline = load_baseline(s)
    make_agent = (lambda seed: baseline(seed=seed)) if baseline else (lambda seed: RandomTextAgent(seed))
    rows = []
    if s.kind == "aec":
        envs = {"raw": tinkergym.make_aec(env_id, **kwargs)}
    else:
        envs = {"raw": load_entry_point(s.entry_point, s.distribution)(**kwargs), "gym.make": tinkergym.make(env_id, **kwargs)}
    for how, env in envs.items():
        (_aec if s.kind == "aec" else _single)(env, make_agent, min(0.3, seconds))  # warm-up
        steps, wall, env_time = (_aec if s.kind == "aec" else _single)(env, make_agent, seconds)
        rows.append({"env": env_id, "kwargs": kwargs, "how": how, "steps": steps,
                     "total_steps_per_s": round(steps / wall), "env_steps_per_s": round(steps / env_time)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("env_ids", nargs="*", help="env ids (default: every installed env)")
    parser.add_argument("--kwargs", default="{}", help="JSON kwargs for the envs, e.g. '{\"size\": 7}'")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per env and mode")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument("--quick", action="store_true", help="0.1 s per env and mode (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 0.1
    ids = args.env_ids or [s.id for s in tinkergym.list_envs()]
    print(f"{'env':<24} {'kwargs':<24} {'how':<9} {'steps':>8} {'total steps/s':>14} {'env steps/s':>12}")
    for env_id in ids:
        try:
            rows = measure(env_id, json.loads(args.kwargs), args.seconds)
        except EnvUnavailableError as exc:  # data it needs is not installed here (it never downloads): said, not measured
            print(f"{env_id}: skipped: {exc}", file=sys.stderr)
            continue
        for row in rows:
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{row['env']:<24} {json.dumps(row['kwargs']):<24} {row['how']:<9} {row['steps']:>8} "
                      f"{row['total_steps_per_s']:>14,} {row['env_steps_per_s']:>12,}")


if __name__ == "__main__":
    main()
