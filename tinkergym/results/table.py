"""The results table: every declared row as one line of Markdown, from the result.json files of the rows that ran.

A row that has not run yet keeps its line (its task and recipe), so the table always shows the whole suite. A row
whose result came from ``--quick`` (the tiny test model) says so: it proves the harness, not learning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinkergym.errors import ConfigError
from tinkergym.results.rows import ROWS, Row
from tinkergym.results.runner import SCHEMA

#: The lines between which ``results table --update FILE`` writes the table.
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
#: Keys every result.json has (and their types), checked before a row is shown.
REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema": int, "row": str, "quick": bool, "env": str, "model": str, "trainer": str, "recipe": dict, "before": dict, "after": dict,
    "change": dict, "learns": bool, "samples": int, "wall_s": (int, float), "machine": dict, "commit": dict, "seeds": dict,
}


def load_result(path: Path) -> dict[str, Any]:
    """A row's result.json, checked against :data:`REQUIRED`; a :class:`ConfigError` that says what is wrong otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read as JSON ({exc}); run its row again to write it.") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; run its row again to write it.")
    for key, kind in REQUIRED.items():
        if not isinstance(data.get(key), kind) or (kind is int and isinstance(data.get(key), bool)):
            raise ConfigError(f"{path}: {key!r} is missing or not of type {getattr(kind, '__name__', 'number')}; run its row again to write it.")
    if data["schema"] != SCHEMA:
        raise ConfigError(f"{path} has result schema {data['schema']}, this tinkergym reads {SCHEMA}; run its row again.")
    return data


def _percent(rate: float) -> str:
    return f"{100 * rate:.1f}"


def _arm(arm: dict[str, Any]) -> str:
    low, high = arm["success_interval"]
    return f"{_percent(arm['success_rate'])}% [{_percent(low)}, {_percent(high)}]"


def _before(result: dict[str, Any]) -> str:
    """The start of RL; after a warm-up, also the untrained model's rate on the same episodes."""
    if not result.get("base"):
        return _arm(result["before"])
    return f"{_arm(result['before'])} after warm-up (untrained: {_percent(result['base']['success_rate'])}%)"


def _change(change: dict[str, Any]) -> str:
    low, high = change["success_interval"]
    return f"{100 * change['success_rate']:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def _recipe(row: Row, result: dict[str, Any] | None) -> str:
    recipe = result["recipe"] if result else row.recipe
    trainer = (result or {}).get("trainer", row.trainer).upper()
    adapter = f"LoRA r{recipe['lora_rank']}" if recipe["lora_rank"] else "full"
    warmup = ""
    if row.warmup:
        kept = "" if row.warmup.min_reward is None else f" (episodes with reward above {row.warmup.min_reward:g})"
        warmup = f"SFT warm-up on {row.warmup.demos} play{kept}, then "
    return f"{warmup}{trainer}, {adapter}, {recipe['steps']} steps x {recipe['batch_size']} prompts x {recipe['group_size']}"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def render(results: Path) -> str:
    """The Markdown table of every declared row, filled from ``results/ROW/result.json`` where it exists."""
    lines = [
        "| Row | Task | Recipe | Success before | Success after | Change, points [95%] | Learns | Samples | Wall |",
        "| --- | --- | --- | ---: | ---: | ---: | :---: | ---: | ---: |",
    ]
    for row in ROWS:
        path = results / row.name / "result.json"
        result = load_result(path) if path.is_file() else None
        task = row.task.replace("|", "\\|")
        if result is None:
            lines.append(f"| {row.name} | {task} | {_recipe(row, None)} | not run yet | | | | | |")
            continue
        name = f"{row.name} (quick: tiny model)" if result["quick"] else row.name
        lines.append(
            f"| {name} | {task} | {_recipe(row, result)} | {_before(result)} | {_arm(result['after'])} | "
            f"{_change(result['change'])} | {'yes' if result['learns'] else 'no'} | {result['samples']:,} | {_minutes(result['wall_s'])} |"
        )
    lines.append("")
    lines.append("Success: greedy episodes on held-out seeds, Wilson 95% intervals; change: paired bootstrap 95% interval. "
                 "A row learns when the whole interval of its change is above zero.")
    return "\n".join(lines) + "\n"


def update(file: Path, table: str) -> bool:
    """Write ``table`` between :data:`START` and :data:`END` in ``file``; whether the file changed."""
    text = file.read_text(encoding="utf-8")
    if START not in text or END not in text or text.index(START) > text.index(END):
        raise ConfigError(f"{file} has no {START} ... {END} block to write the table into; add those two lines where it goes.")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{table}{END}{tail}"
    if new == text:
        return False
    file.write_text(new, encoding="utf-8")
    return True
