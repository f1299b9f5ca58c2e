"""Matches: a policy against named opponents on a multi-agent env, seats alternating, with win/draw/loss and ratings.

Used by the self-play trainer's evaluation and by ``tinkergym eval --opponent``. Opponent names are those of
the self-play league: ``baseline`` and ``random`` (the env package's agents), ``snapshot:N`` (a run's frozen
snapshot after N steps, ``<run>/snapshots/step_N``) and ``run:DIR`` (the newest weights of another run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from tinkergym.chat import ChatRenderer
from tinkergym.errors import ConfigError
from tinkergym.games import Game, GameResult, ModelPlayer, Player, ScriptedPlayer, play_games
from tinkergym.rollouts import RolloutConfig, Trajectory

LEARNER = "learner"
_SNAPSHOT = re.compile(r"snapshot:(\d+)")


@dataclass
class Record:
    """The policy's results against one opponent."""

    wins: int = 0
    draws: int = 0
    losses: int = 0
    errors: int = 0
    results: list[GameResult] = field(default_factory=list)

    @property
    def games(self) -> int:
        """Games that finished without an error."""
        return self.wins + self.draws + self.losses

    def rates(self) -> dict[str, float]:
        """Win, draw and loss rates over the finished games."""
        n = max(self.games, 1)
        return {"win": self.wins / n, "draw": self.draws / n, "loss": self.losses / n}


def scripted_opponent(env_id: str, kind: str) -> ScriptedPlayer:
    """The env package's ``baseline`` or ``random`` agent (random text where a package declares no random agent)."""
    import tinkergym
    from tinkergym.agents import RandomTextAgent
    from tinkergym.registry import load_baseline, load_random_agent

    env_spec = tinkergym.spec(env_id)
    if kind == "baseline":
        factory = load_baseline(env_spec)
        if factory is None:
            raise ConfigError(f"{env_spec.distribution} declares no baseline agent for {env_id}; leave baseline out of --opponents.")
    else:
        factory = load_random_agent(env_spec) or RandomTextAgent
    return ScriptedPlayer(kind, factory)


def opponent_player(name: str, env_id: str, run_dir: str | Path | None = None, frozen: Any = None) -> Player:
    """The player ``name`` means: ``baseline``, ``random``, ``snapshot:N`` (of ``run_dir``) or ``run:DIR``."""
    if name in ("baseline", "random"):
        return scripted_opponent(env_id, name)
    snapshot = _SNAPSHOT.fullmatch(name)
    if snapshot is not None:
        if run_dir is None:
            raise ConfigError(f"opponent {name}: a snapshot belongs to a run; pass the run with --run DIR.")
        folder = Path(run_dir) / "snapshots" / f"step_{int(snapshot.group(1)):06d}"
        if not folder.is_dir():
            taken = sorted(p.name.removeprefix("step_").lstrip("0") or "0" for p in (Path(run_dir) / "snapshots").glob("step_*"))
            raise ConfigError(f"opponent {name}: {run_dir} has no such snapshot; it has: {', '.join('snapshot:' + t for t in taken) or 'none'}.")
        return ModelPlayer(name, frozen.add_checkpoint(name, folder))
    if name.startswith("run:") and len(name) > 4:
        return ModelPlayer(name, frozen.add_run(name, name[4:]))
    raise ConfigError(f"opponent {name!r}: choose baseline, random, snapshot:N or run:DIR.")


def play_matches(
    policy: Player | dict[str, Player],
    opponents: dict[str, Player],
    make_env: Callable[[], Any],
    seeds: list[int],
    renderer: ChatRenderer,
    settings: RolloutConfig,
    seats: list[str] | None = None,
) -> tuple[dict[str, Record], list[Trajectory]]:
    """Play ``policy`` against every opponent once per seed, taking every seat in turn (or each of ``seats`` in turn); all
    games at once.

    ``policy`` may map each seat to a player of its own (a policy per seat): each then plays only its seat.
    Returns the record against each opponent and the policy's trajectories (model policies only).
    """
    games, labels, mine_of = [], [], []
    for name, opponent in opponents.items():
        for i, seed in enumerate(seeds):
            env = make_env()
            every = list(env.possible_agents)
            taken = seats or every
            mine = taken[i % len(taken)]
            me = policy[mine] if isinstance(policy, dict) else policy
            games.append(Game(env, {a: me if a == mine else opponent for a in every}, seed=seed))
            labels.append(name)
            mine_of.append(mine)
    records = {name: Record() for name in opponents}
    trajectories: list[Trajectory] = []
    for result, name, seat in zip(play_games(games, renderer, settings), labels, mine_of):
        record = records[name]
        record.results.append(result)
        outcome = result.outcome(seat)
        if outcome is None:
            record.errors += 1
        elif outcome == 1.0:
            record.wins += 1
        elif outcome == 0.0:
            record.losses += 1
        else:
            record.draws += 1
        trajectory = result.seats[seat].trajectory
        if trajectory is not None:
            trajectories.append(trajectory)
    return records, trajectories


def records_table(records: dict[str, Record]) -> str:
    """Win/draw/loss against each opponent as a plain text table."""
    lines = [f"{'opponent':<24} {'games':>5} {'win':>6} {'draw':>6} {'loss':>6} {'errors':>6}"]
    for name, record in records.items():
        rates = record.rates()
        lines.append(f"{name:<24} {record.games:>5} {rates['win']:>6.1%} {rates['draw']:>6.1%} {rates['loss']:>6.1%} {record.errors:>6}")
    return "\n".join(lines)


def rated(records: dict[str, Record], league: Any = None) -> Any:
    """A :class:`~tinkergym.trainers.league.League` with every opponent's games recorded (a fresh one if ``league`` is None)."""
    from tinkergym.trainers.league import League, LeagueMember

    league = league if league is not None else League()
    for name, record in records.items():
        if name not in league:
            kind = name if name in ("baseline", "random") else "snapshot" if name.startswith("snapshot:") else "policy"
            league.add(LeagueMember(name, kind))
        for outcome in [1.0] * record.wins + [0.5] * record.draws + [0.0] * record.losses:
            league.record(name, outcome)
    return league


def match_settings(max_turns: int, max_new_tokens: int, max_context: int = 4096, temperature: float = 0.0, seed: int | None = 0) -> RolloutConfig:
    """Greedy by default: an evaluation plays the policy's best move."""
    return RolloutConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, max_context=max_context, temperature=temperature, seed=seed)


__all__ = ["LEARNER", "Record", "match_settings", "opponent_player", "play_matches", "rated", "records_table"]
