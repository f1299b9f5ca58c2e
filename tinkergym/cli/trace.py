"""``tinkergym trace RUN``: a run's timeline as a Chrome/Perfetto trace (see :mod:`tinkergym.plumbing.timeline`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tinkergym.cli.common import InputError, SafePath


@click.command("trace")
@click.argument("run", type=SafePath(file_okay=False, path_type=Path))
@click.option("--out", type=SafePath(dir_okay=False, path_type=Path), default=None,
              help="Where to write the trace (default: RUN/trace.json; - for stdout).")
@click.option("--steps", default=None, metavar="A:B", help="Only steps A to B (both included), with what ran between them.")
def trace(run: Path, out: Path | None, steps: str | None) -> None:
    """Write RUN's timeline as a trace that ui.perfetto.dev and chrome://tracing open.

    Every run records spans of its phases in RUN/timeline.jsonl, whatever trained it (locally, through a server,
    a scheduler job or a Tinker endpoint): each step, its rollout (sampling requests, env steps, tool calls), its
    update (forward_backward, optim_step), evaluations, checkpoints, and a scheduler job's wait in the queue. Env
    steps and tool calls run on the rollout's threads, each its own lane.

    \b
    Examples:
      tinkergym trace runs/bandit                          # runs/bandit/trace.json
      tinkergym trace runs/bandit --steps 10:12 --out steps.json
    """
    from tinkergym.plumbing.timeline import FILE, chrome_trace, read_spans

    spans = read_spans(run)
    if not spans:
        raise InputError(f"{run} has no timeline ({FILE}): give the folder of a run trained by this version of tinkergym")
    if steps is not None:
        try:
            first, last = (int(x) for x in steps.split(":", 1))
        except ValueError:
            raise InputError(f"--steps {steps!r}: give A:B, two step numbers") from None
        numbers = sorted(int(s.args.get("step", -1)) for s in spans if s.name == "step")
        picked = [s for s in spans if s.name == "step" and first <= int(s.args.get("step", -1)) <= last]
        if not picked:
            held = f"steps {numbers[0]} to {numbers[-1]}" if numbers else "no step yet"
            raise InputError(f"--steps {steps}: the timeline has no step in that range (it has {held})")
        start, end = min(s.start_us for s in picked), max(s.end_us for s in picked)
        following = [s for s in spans if s.start_us >= end and s.name in ("eval", "checkpoint") and int(s.args.get("step", -1)) <= last]
        end = max([end, *(s.end_us for s in following)])
        spans = [s for s in spans if s.start_us >= start and s.end_us <= end]
    document = json.dumps(chrome_trace(spans, process_name=f"tinkergym {run.name}"))
    if out is not None and str(out) == "-":
        click.echo(document)
        return
    target = out or run / "trace.json"
    target.write_text(document, encoding="utf-8")
    click.echo(f"{len(spans)} spans written to {target}: open it in https://ui.perfetto.dev or chrome://tracing", err=True)
