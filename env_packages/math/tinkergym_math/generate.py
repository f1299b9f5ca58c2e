"""Deterministic generator of the shipped math word-problem dataset.

Run ``python -m tinkergym_math.generate --out DIR --seed 0`` to write ``DIR/train.jsonl`` and
``DIR/test.jsonl``. With the defaults (seed 0, 250 problems per topic, a 10% test split) the output is
byte for byte the dataset shipped in ``tinkergym_math/data/``; the package's tests check that.

Each line is ``{"id", "topic", "question", "answer"}``. Every topic draws from its own
``random.Random`` seeded with ``"<seed>:<topic>"`` (string seeds hash the same way on every platform
and Python version), so adding a topic leaves the others unchanged. Questions are unique; the split is
stratified by topic.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from tinkergym_math import templates as arith
from tinkergym_math import templates_algebra as alg
from tinkergym_math.templates import Template

#: Topic name -> the templates it draws from.
TOPICS: dict[str, tuple[Template, ...]] = {
    "arithmetic": (arith.shopping, arith.collecting, arith.bakery, arith.buses, arith.savings),
    "order_of_operations": (arith.expression,),
    "percentages": (arith.discount, arith.percent_of, arith.percent_change),
    "fractions": (arith.pizza, arith.fraction_of, arith.fraction_ops),
    "linear_equations": (alg.solve_linear, alg.both_sides, alg.think_of_number),
    "systems": (alg.linear_system, alg.tickets, alg.sum_difference),
    "rates": (alg.speed, alg.work_together, alg.unit_rate),
    "ages": (alg.ages,),
    "ratios": (alg.ratios,),
    "averages": (alg.averages,),
}

DEFAULT_SEED = 0
DEFAULT_PER_TOPIC = 250
DEFAULT_TEST_FRACTION = 0.1


def generate_topic(topic: str, count: int, seed: int) -> list[dict[str, str]]:
    """``count`` unique problems of one topic (fewer only if the templates run out of variety)."""
    rng = random.Random(f"{seed}:{topic}")
    problems: list[dict[str, str]] = []
    seen: set[str] = set()
    attempts = 0
    while len(problems) < count and attempts < count * 20:
        attempts += 1
        question, answer = rng.choice(TOPICS[topic])(rng)
        if question in seen:
            continue
        seen.add(question)
        problems.append({"id": f"{topic}-{len(problems):04d}", "topic": topic, "question": question, "answer": answer})
    return problems


def generate(seed: int = DEFAULT_SEED, per_topic: int = DEFAULT_PER_TOPIC, test_fraction: float = DEFAULT_TEST_FRACTION) -> dict[str, list[dict[str, str]]]:
    """Generate every topic and split it; return ``{"train": [...], "test": [...]}`` in id order."""
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction!r}: choose a number in [0, 1).")
    splits: dict[str, list[dict[str, str]]] = {"train": [], "test": []}
    for topic in TOPICS:
        problems = generate_topic(topic, per_topic, seed)
        order = list(range(len(problems)))
        random.Random(f"{seed}:{topic}:split").shuffle(order)
        test_ids = set(order[: round(len(problems) * test_fraction)])
        for i, problem in enumerate(problems):
            splits["test" if i in test_ids else "train"].append(problem)
    return splits


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Write one JSON object per line (UTF-8, ``\\n`` line ends)."""
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: write ``train.jsonl`` and ``test.jsonl`` to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m tinkergym_math.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write train.jsonl and test.jsonl to")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="generator seed (default 0: the shipped data)")
    parser.add_argument("--per-topic", type=int, default=DEFAULT_PER_TOPIC, help="problems per topic (default 250)")
    parser.add_argument("--test-fraction", type=float, default=DEFAULT_TEST_FRACTION, help="share of each topic in test (default 0.1)")
    args = parser.parse_args(argv)
    splits = generate(args.seed, args.per_topic, args.test_fraction)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in splits.items():
        write_jsonl(args.out / f"{name}.jsonl", records)
        print(f"wrote {len(records)} problems to {args.out / f'{name}.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
