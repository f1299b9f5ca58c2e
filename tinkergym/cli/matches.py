"""``tinkergym eval --opponent``: a trained policy against named opponents on a multi-agent env."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click


def eval_matches(
    env: str, model: str | None, run_dir: str | None, opponents: tuple[str, ...], episodes: int, kwargs: dict[str, Any],
    max_turns: int, max_new_tokens: int, temperature: float, seed: int, out: Path | None, as_json: bool = False,
) -> None:
    """Play ``episodes`` games against each opponent (seats alternating); print the table and the ratings, and with ``as_json``
    a JSON line of each opponent's games and rates on stdout."""
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.games import ModelPlayer
    from tinkergym.config import TrainConfig
    from tinkergym.cli.common import save_transcripts
    from tinkergym.trainers.evaluation import eval_seeds
    from tinkergym.trainers.matches import LEARNER, match_settings, opponent_player, play_matches, rated, records_table
    from tinkergym.trainers.session import env_factory, load_backend_for_eval
    from tinkergym.trainers.snapshots import FrozenPolicies

    if len(set(opponents)) != len(opponents):
        raise click.UsageError("--opponent names one opponent twice.")
    make_env = env_factory(env, kwargs, multi_agent=True)
    base = TrainConfig.load(Path(run_dir) / "config.json") if run_dir else None
    frozen = FrozenPolicies(base.model if base else (model or "smollm2-135m"), base.dtype if base else "auto")
    players = {name: opponent_player(name, env, run_dir, frozen) for name in opponents}  # bad names fail before the model loads
    backend = load_backend_for_eval(model=model, run_dir=run_dir)
    renderer = ChatTemplateRenderer(backend.info()["tokenizer"])
    settings = match_settings(max_turns, max_new_tokens, temperature=temperature, seed=seed)
    records, trajectories = play_matches(ModelPlayer(LEARNER, backend), players, make_env, eval_seeds(seed, episodes), renderer, settings)
    click.echo(records_table(records), err=True)
    click.echo("\nratings (openskill, ordinal = mu - 3 sigma):\n" + rated(records).table(), err=True)
    save_transcripts(out, trajectories, env)
    if as_json:
        summary = {name: {"games": r.games, "errors": r.errors, **{k: round(v, 4) for k, v in r.rates().items()}} for name, r in records.items()}
        click.echo(json.dumps({"env": env, "opponents": summary}))
        sys.stdout.flush()
