"""``tinkergym envs``: list, inspect, check and scaffold env packages."""

from __future__ import annotations

import inspect
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import click

from tinkergym.cli.common import SafePath, construct_env, parse_kwargs
from tinkergym.errors import CheckFailed, ConfigError, EnvUnavailableError, TinkergymError
from tinkergym.plumbing.install import pip_install
from tinkergym.registry import EnvSpec, list_envs, load_baseline, load_entry_point, spec


@click.group()
def envs() -> None:
    """List, inspect, check and create env packages."""


@envs.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per env instead of a table.")
def list_command(as_json: bool) -> None:
    """List every installed env id (reads package metadata only; imports no env package)."""
    specs = list_envs(refresh=True)
    if as_json:
        for s in specs:
            click.echo(json.dumps(s.to_dict()))
        return
    if not specs:
        click.echo(f"No env packages installed. Try: {pip_install(dist='tinkergym-gomoku')}  (or: tinkergym envs new NAME)")
        return
    rows = [("ID", "PACKAGE", "VERSION", "DATA", "TURNS", "AGENTS", "SUMMARY")]
    rows += [(s.id, s.distribution, s.version, s.data, s.turns, str(s.agents), s.summary) for s in specs]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[6])


@envs.command("info")
@click.argument("env_id")
def info_command(env_id: str) -> None:
    """Show what the hub knows about ENV_ID and the env's own documentation."""
    s = spec(env_id)
    for field in ("id", "distribution", "version", "entry_point", "kind", "data", "turns", "agents", "summary", "baseline", "random_agent", "max_episode_steps"):
        value = getattr(s, field)
        if value not in (None, ""):
            click.echo(f"{field + ':':<19}{value}")
    env_class = load_entry_point(s.entry_point, s.distribution)
    doc = inspect.getdoc(env_class)
    if doc:
        click.echo("\n" + doc)


def _check_one(s: EnvSpec, kwargs: dict, fuzz_count: int) -> None:
    from tinkergym.registry import make, make_aec
    from tinkergym.testing import check_text_aec_env, check_text_env

    baseline = load_baseline(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            env = construct_env(make_aec if s.kind == "aec" else make, s.id, kwargs)
        except ConfigError as exc:
            if kwargs:  # the user's --kwarg is wrong, not the env: a usage error (exit 2)
                raise click.UsageError(str(exc)) from exc
            raise
        if s.kind == "aec":
            check_text_aec_env(env, baseline=baseline, fuzz_count=fuzz_count)
        else:
            check_text_env(env, baseline=baseline, fuzz_count=fuzz_count)


@envs.command("check")
@click.argument("env_ids", nargs=-1, metavar="[ENV_ID]...")
@click.option("--all", "check_all", is_flag=True, help="Check every installed env.")
@click.option("--kwarg", "kwargs", multiple=True, metavar="KEY=VALUE", help="Keyword argument for the env (repeatable).")
@click.option("--fuzz", "fuzz_count", default=200, show_default=True, type=click.IntRange(0, 100_000), help="Random action strings to try on top of the hostile set.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def check_command(env_ids: tuple[str, ...], check_all: bool, kwargs: tuple[str, ...], fuzz_count: int, quiet: bool = False) -> None:
    """Run the conformance checkers (Gymnasium check_env / PettingZoo api_test + tinkergym's) on envs.

    Each env's line says how long its check took, and the summary names the slowest. A bar on stderr shows
    the envs checked so far and the one being checked (only on a terminal; --quiet: none).

    Exits with 1 if any env fails, 2 on bad usage.
    """
    if bool(env_ids) == check_all:
        raise click.UsageError("give one or more ENV_IDs, or --all (not both).")
    specs = list_envs(refresh=True) if check_all else [spec(i) for i in env_ids]
    env_kwargs = parse_kwargs(kwargs)
    failures = skipped = 0
    took: dict[str, float] = {}
    started = time.perf_counter()
    with progress_bar(len(specs), quiet) as bar:
        for s in specs:
            bar.set_postfix_str(s.id)  # the env being checked: a slow one is named while it runs
            begun = time.perf_counter()
            try:
                _check_one(s, env_kwargs, fuzz_count)
            except EnvUnavailableError as exc:
                if not check_all:
                    raise
                skipped += 1
                line, colour = f"skip  {s.id}  ({s.distribution})\n      {exc}", "yellow"
            except (CheckFailed, TinkergymError) as exc:
                failures += 1
                line, colour = f"FAIL  {s.id}  ({s.distribution}, {duration(time.perf_counter() - begun)})\n      {exc}", "red"
            else:
                line, colour = f"ok    {s.id}  ({duration(time.perf_counter() - begun)})", "green"
            took[s.id] = time.perf_counter() - begun
            with bar.external_write_mode():  # the line above the bar, never through it
                click.secho(line, fg=colour)
            bar.update(1)
    summary = f"{len(specs) - failures - skipped} passed, {failures} failed" + (f", {skipped} skipped (not installable offline)" if skipped else "")
    click.echo(f"{summary} in {duration(time.perf_counter() - started)}{_slowest(took)}")
    if failures:
        sys.exit(1)


def progress_bar(total: int, quiet: bool, file: Any = None) -> Any:
    """The check's bar on stderr (``file``): envs checked of ``total``, the one being checked; off with ``quiet`` or off a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="check", unit="env", file=file or sys.stderr, disable=True if quiet else None, leave=False)


def duration(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``2 min 11 s``: a check's time, as long as it needs to be."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


#: Envs the summary names as the slowest, at most.
SLOWEST_SHOWN = 3


def _slowest(took: dict[str, float]) -> str:
    """``; slowest: a (2 min 11 s), b (40 s)``: the envs that took longest, where several were checked."""
    if len(took) < 2:
        return ""
    ranked = sorted(took.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]
    return "; slowest: " + ", ".join(f"{env_id} ({duration(seconds)})" for env_id, seconds in ranked)


@envs.command("new")
@click.argument("name")
@click.option("--dir", "parent", type=SafePath(file_okay=False, path_type=Path), default=Path("."), show_default=True, help="Folder to create the package in.")
@click.option("--id", "env_id", default=None, help="The env id to declare (default: NAME/CamelName-v0).")
@click.option("--force", is_flag=True, help="Write into an existing, non-empty package folder.")
def new_command(name: str, parent: Path, env_id: str | None, force: bool) -> None:
    """Create a pip-installable env package tinkergym-NAME with an example env, a baseline agent and tests."""
    from tinkergym.registry.scaffold import PackagePlan, scaffold_package

    root = scaffold_package(name, parent, env_id=env_id, force=force)
    plan = PackagePlan.for_name(name, env_id)
    click.echo(f"Created {root} providing {plan.env_id}.\nNext:\n  pip install -e {root}\n  tinkergym envs check {plan.env_id}\n  python -m pytest {root / 'tests'}")
