"""``tinkergym results``: the results table of the hub's own agentic tasks, regenerated row by row."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from tinkergym.cli.common import InputError, SafePath, table

#: Where rows write their folders and keep their runs, unless told otherwise (``--quick`` keeps apart from both).
OUT, WORK = Path("docs/results"), Path("runs/results")
QUICK_OUT, QUICK_WORK = Path("runs/results-quick/out"), Path("runs/results-quick/work")


@click.group()
def results() -> None:
    """The results table: does training make the agent better, at what cost, on the hub's own tasks?

    \b
    Each row is a task (an env and the kwargs that set its difficulty) and a recipe (model, trainer, budget),
    evaluated greedily on held-out seeds before, during and after training, with 95% intervals.

    \b
    Examples:
      tinkergym results list
      tinkergym results run math            # trains, evaluates, writes docs/results/math/; again: resumes
      tinkergym results run all --quick     # every row on the tiny test model: checks the harness in minutes
      tinkergym results table --update README.md
    """


@results.command("list")
@click.option("--out", type=SafePath(file_okay=False, path_type=Path), default=OUT, show_default=True, help="Folder of the rows' results.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per row: its task, recipe and why.")
def list_command(out: Path, as_json: bool) -> None:
    """The declared rows: name, env, budget, and whether a result is there."""
    from tinkergym.results.rows import ROWS

    if as_json:
        for row in ROWS:
            click.echo(json.dumps({"name": row.name, "task": row.task, "env": row.env, "env_kwargs": row.env_kwargs,
                                   "eval_env_kwargs": row.eval_env_kwargs, "model": row.model, "trainer": row.trainer,
                                   "recipe": row.recipe, "eval_episodes": row.eval_episodes, "why": row.why}))
        return
    lines = []
    for row in ROWS:
        r = row.recipe
        path = out / row.name / "result.json"
        status = "not run"
        if path.is_file():
            try:
                status = f"done, {json.loads(path.read_text(encoding='utf-8'))['wall_s'] / 60:.0f} min"
            except (OSError, ValueError, KeyError, TypeError):
                status = "unreadable"
        lines.append((row.name, row.env, f"{r['steps']} x {r['batch_size']} x {r['group_size']}", str(row.eval_episodes), status, row.task))
    click.echo(table(("ROW", "ENV", "STEPS x PROMPTS x SAMPLES", "EVAL", "RESULT", "TASK"), lines))


@results.command("run")
@click.argument("names", nargs=-1, required=True, metavar="ROW... | all")
@click.option("--quick", is_flag=True,
              help="On the tiny test model at the smallest budget: checks the whole harness (training, held-out evaluation, "
                   "intervals, files, table, resume) in a minute or two a row. Not a learning run.")
@click.option("--out", type=SafePath(file_okay=False, path_type=Path),
              help=f"Folder of the rows' results (default {OUT}; with --quick {QUICK_OUT}).")
@click.option("--work", type=SafePath(file_okay=False, path_type=Path),
              help=f"Folder of the rows' training runs, checkpoints included (default {WORK}; with --quick {QUICK_WORK}).")
@click.option("--peer", type=click.Choice(["trl"]),
              help="Train the row with another trainer instead, on the same recipe and evaluation, after tinkergym's run of it: "
                   "trl (TRL's GRPOTrainer; single-turn rows; needs trl installed). Writes OUT/ROW/trl/ and OUT/ROW/vs_trl.png.")
@click.option("--steps", "peer_steps", type=click.IntRange(1), metavar="N",
              help="With --peer: the peer trains only the first N steps of the row's recipe (N one of the steps after which "
                   "tinkergym evaluated the row) and is compared with tinkergym after as many.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def run_command(
    names: tuple[str, ...], quick: bool, out: Path | None, work: Path | None, peer: str | None, peer_steps: int | None, quiet: bool,
) -> None:
    """Train ROW's recipe and evaluate it before and after on held-out seeds; write OUT/ROW/.

    \b
    A row's run is an ordinary training run in WORK/ROW: run the row again after a stop (Ctrl-C, a kill, a
    reboot) and it resumes from its newest checkpoint; a finished row only writes its folder again. Each full
    row takes up to an hour on a 2-core CPU (`tinkergym results list` shows their budgets).
    """
    from tinkergym.results.rows import ROWS, get_row
    from tinkergym.results.runner import run_row

    try:
        rows = list(ROWS) if names == ("all",) else [get_row(name) for name in names]
    except KeyError as exc:
        raise InputError(str(exc.args[0])) from exc
    out = out or (QUICK_OUT if quick else OUT)
    work = work or (QUICK_WORK if quick else WORK)
    if peer_steps is not None and peer is None:
        raise click.UsageError("--steps goes with --peer: a row's own run takes the steps of its recipe.")
    if peer is not None:
        from tinkergym.results.trl_peer import check_single_turn, run_trl_peer

        for row in rows:
            check_single_turn(row)  # before any row runs
    for row in rows:
        command = shlex.join(["tinkergym", "results", "run", row.name, *(["--quick"] if quick else []), *(["--peer", peer] if peer else []),
                              *(["--steps", str(peer_steps)] if peer_steps else [])])
        try:
            if peer is not None:
                result = run_trl_peer(row, out, work, quick=quick, progress=not quiet, command=command, steps=peer_steps)
            else:
                result = run_row(row, out, work, quick=quick, progress=not quiet, command=command)
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted: {work / row.name} keeps its checkpoints; run `{command}` again to resume it.", err=True)
            sys.exit(130)
        before, after, change = result["before"], result["after"], result["change"]
        click.echo(json.dumps({"row": row.name, **({"peer": peer} if peer else {}), "before": round(before["success_rate"], 4),
                               "after": round(after["success_rate"], 4), "change_interval": [round(v, 4) for v in change["success_interval"]],
                               "learns": change["success_interval"][0] > 0, "wall_s": result["wall_s"], "folder": str(out / row.name)}))


@results.command("table")
@click.option("--out", type=SafePath(file_okay=False, path_type=Path), default=OUT, show_default=True, help="Folder of the rows' results.")
@click.option("--update", type=SafePath(exists=True, dir_okay=False, path_type=Path), metavar="FILE",
              help="Write the table into FILE between its <!-- results-table:start --> and <!-- results-table:end --> lines.")
@click.option("--check", is_flag=True, help="With --update: change nothing; exit 1 if FILE's table is not the one the results give.")
def table_command(out: Path, update: Path | None, check: bool) -> None:
    """Every row as one Markdown table (rows not run yet included), on stdout or into a file."""
    from tinkergym.results.table import END, START, render, update as write_table

    text = render(out)
    if update is None:
        if check:
            raise click.UsageError("--check goes with --update FILE.")
        click.echo(text, nl=False)
        return
    if check:
        current = update.read_text(encoding="utf-8")
        if f"{START}\n{text}{END}" not in current:
            raise click.ClickException(f"the results table in {update} is not the one {out} gives; run: tinkergym results table --update {update}")
        return
    changed = write_table(update, text)
    click.echo(f"{update}: {'table updated' if changed else 'table already up to date'}", err=True)
