"""A league of trained players: N LoRA adapters of one base model, all learning at once against each other.

``tinkergym train --trainer league --env tinker/GomokuDuel-v0 --trainer-arg players=4`` (its backend is ``shared``, or
a scheduler's job with ``--scheduler``; another ``--backend`` is refused): the run's backend is player ``p0``; ``p1`` ... ``p{N-1}`` are
more adapters of the same shared base (seeds ``seed + i``), so the base is held once whatever N. Each step plays
``batch_size * group_size`` games (all players' together), then updates every player once:

- **Pairing** (prioritized fictitious self-play among the players, :class:`PlayerTable`): game ``i`` is player
  ``p{i mod N}``'s; its opponent is drawn from the other players with weight ``(1 - p) ** pfsp_exponent``, ``p`` its
  estimated chance of beating them from their games so far (one win and one loss of prior), so a player meets most
  often those it loses to; with probability ``self_play_share`` (and always when N = 1) it plays itself. Seats
  alternate (``p{i mod N}`` moves first in even games), so in every round both players of a pairing have moves and
  the players' moves are sampled in one decode loop (:func:`tinkergym.games.sample_calls`).
- **Update**: each player on its own seats of the step's games, per-seat advantages as self-play's, every player's
  ``forward_backward`` in one mixed-adapter pass (:meth:`~tinkergym.trainers.grpo.GRPOTrainer.update_many`), then each
  player's own optimizer step (its own AdamW state, sampling streams and learning rate: ``learning_rates``).
- **Ratings**: every finished game between two players updates their openskill ratings and results; logged as
  ``rating/<player>`` and ``league/winrate_<a>_vs_<b>``, saved with each checkpoint (``--resume`` goes on exactly).

- **Snapshots**: every ``--snapshot-every`` steps each player's adapter is exported to ``snapshots/<player>/step_N``
  and joins as a frozen member ``<player>@N`` (a session of the same base that never trains), drawn like a player;
  past ``max_snapshots`` open at once the oldest retire (kept in the table, drawn no more).
- **Roles** (``roles=true``): player ``p<i>`` always holds seat ``i mod S`` of the env's ``S`` seats and meets only
  members of the other roles, so each adapter learns one role (first or second player, proposer or solver).
- **Record**: ``league/matches.jsonl`` (every game: step, player, seat holders, outcomes) and ``league/table.json``
  (the rating table), cut back to the checkpoint on ``--resume``.

Players beyond ``p0`` are saved in every checkpoint under ``players/<name>`` and exported to ``final/players/<name>``
(``p0`` is the run's own export, ``final/``). A league of one is self-play on the shared backend, metric for metric.
Through a scheduler (``--scheduler``) the players are the job's adapters on seats of one shared server
(:class:`tinkergym.backends.scheduled.LeagueJoint`), without snapshots.

``trainer_args``: ``players`` (2), ``pfsp_exponent`` (2), ``self_play_share`` (0), ``scale_by_std`` (true),
``learning_rates`` (one per player; default the run's ``lr`` for each), ``max_snapshots`` (8; 0 through a scheduler),
``roles`` (false).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from tinkergym.errors import ConfigError
from tinkergym.games import Game, GameResult, ModelPlayer, Player, play_games
from tinkergym.plumbing import timeline
from tinkergym.protocol.types import LoraSessionConfig
from tinkergym.trainers.base import StepOutput, TrainingContext
from tinkergym.trainers.grpo import GRPOTrainer, phase_times
from tinkergym.trainers.league import outcome_key, plackett_luce
from tinkergym.trainers.selfplay import LEARNER, seat_advantages, share_arg, game_metrics, learner_seats

#: Most players a league trains at once (each is an adapter with its optimizer state on the one base).
MAX_PLAYERS = 64
#: Frozen snapshots in the league at once, by default (every player's, ``--snapshot-every`` steps apart).
DEFAULT_SNAPSHOTS = 8
_STATE_VERSION = 1


def player_name(index: int) -> str:
    return f"p{index}"


class PlayerTable:
    """The players' results against each other, their openskill ratings, and whom each plays next (see the module's notes)."""

    def __init__(self, names: list[str], exponent: float = 2.0) -> None:
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"a league needs distinct player names, got {names!r}")
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not 0 <= exponent < math.inf:
            raise ConfigError(f"pfsp_exponent must be a number >= 0 (2 plays the players one loses to most, 0 all alike), got {exponent!r}")
        self.names, self.exponent = list(names), float(exponent)
        self.players = list(names)  # the members it began with: a checkpoint of the table is of these
        self.retired: set[str] = set()  # members kept in the table (ratings, results) and drawn no more
        self._model = plackett_luce()
        self._ratings = {n: self._model.rating() for n in names}
        self._results = {a: {b: {"wins": 0, "draws": 0, "losses": 0} for b in names if b != a} for a in names}

    def add(self, name: str) -> None:
        """A new member (a frozen snapshot of a player) with a fresh rating and no results yet."""
        if name in self._ratings:
            raise ConfigError(f"the league already has a member {name!r}")
        for row in self._results.values():
            row[name] = {"wins": 0, "draws": 0, "losses": 0}
        self._results[name] = {b: {"wins": 0, "draws": 0, "losses": 0} for b in self.names}
        self.names.append(name)
        self._ratings[name] = self._model.rating()

    def retire(self, name: str) -> None:
        """``name`` is drawn no more (its ratings and results stay in the table)."""
        self.retired.add(name)

    @property
    def active(self) -> list[str]:
        """The members that may be drawn, in the order they joined."""
        return [n for n in self.names if n not in self.retired]

    def win_probability(self, a: str, b: str) -> float:
        """``a``'s estimated chance of beating ``b``: their results with one win and one loss of prior."""
        r = self._results[a][b]
        return (r["wins"] + 0.5 * r["draws"] + 1) / (r["wins"] + r["draws"] + r["losses"] + 2)

    def opponent_weights(self, a: str, among: list[str] | None = None) -> dict[str, float]:
        """The probability that ``a``'s next game is against each other active member, or each of ``among`` (sums to 1;
        empty where there is none: a league of one)."""
        others = [b for b in (self.active if among is None else among) if b != a]
        f = [(1.0 - self.win_probability(a, b)) ** self.exponent for b in others]
        total = sum(f)
        return {b: (x / total if total > 0 else 1.0 / len(others)) for b, x in zip(others, f)}

    def sample_opponent(self, a: str, rng: random.Random, among: list[str] | None = None) -> str:
        """An opponent for ``a`` drawn by :meth:`opponent_weights` (``a`` itself where there is no other)."""
        weights = self.opponent_weights(a, among)
        if not weights:
            return a
        return rng.choices(list(weights), weights=list(weights.values()), k=1)[0]

    def record(self, a: str, b: str, outcome_for_a: float) -> None:
        """A finished game of ``a`` against ``b`` (1 a win, 0.5 a draw, 0 a loss for ``a``); a player against itself counts nothing."""
        key = outcome_key(outcome_for_a)
        if a == b:
            return
        ranks = {1.0: [0, 1], 0.5: [0, 0], 0.0: [1, 0]}[float(outcome_for_a)]
        (new_a,), (new_b,) = self._model.rate([[self._ratings[a]], [self._ratings[b]]], ranks=ranks)
        self._ratings[a], self._ratings[b] = new_a, new_b
        self._results[a][b][key] += 1
        self._results[b][a][{"wins": "losses", "losses": "wins", "draws": "draws"}[key]] += 1

    def metrics(self) -> dict[str, float]:
        """``rating/<member>`` (openskill ordinal) and ``league/winrate_<a>_vs_<b>`` of every pair that has played, of the
        active members."""
        active = self.active
        out = {f"rating/{n}": float(self._ratings[n].ordinal()) for n in active}
        for a in active:
            for b, r in self._results[a].items():
                games = r["wins"] + r["draws"] + r["losses"]
                if games and a < b and b not in self.retired:
                    out[f"league/winrate_{a}_vs_{b}"] = r["wins"] / games
        return out

    def table(self) -> list[dict[str, Any]]:
        """Every player, best ordinal first: its rating and its results against all the others together."""
        rows = []
        for n in self.names:
            totals = {k: sum(r[k] for r in self._results[n].values()) for k in ("wins", "draws", "losses")}
            rows.append({"player": n, "ordinal": self._ratings[n].ordinal(), "mu": self._ratings[n].mu, "sigma": self._ratings[n].sigma, **totals})
        return sorted(rows, key=lambda r: (-r["ordinal"], r["player"]))

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "players": self.players, "names": self.names, "exponent": self.exponent, "retired": sorted(self.retired),
                "ratings": {n: [r.mu, r.sigma] for n, r in self._ratings.items()}, "results": self._results}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of a table of the same players; the members it had added (snapshots) join."""
        players = state.get("players", state.get("names")) if isinstance(state, dict) else None
        names = state.get("names") if isinstance(state, dict) else None
        if not isinstance(names, list) or state.get("version") != _STATE_VERSION or players != self.players:
            raise ConfigError(f"the checkpoint's league is of other players ({players if players is not None else state!r}) "
                              f"than this run's {self.players}: resume with the same players")
        self.names = [str(n) for n in names]
        self.exponent = float(state["exponent"])
        self.retired = {str(n) for n in state.get("retired", [])}
        self._ratings = {n: self._model.rating(mu=float(mu), sigma=float(sigma)) for n, (mu, sigma) in state["ratings"].items()}
        self._results = {a: {b: {k: int(v) for k, v in r.items()} for b, r in row.items()} for a, row in state["results"].items()}


class LeagueTrainer(GRPOTrainer):
    """N LoRA players of one shared base trained at once against each other (see the module's notes)."""

    needs_env = True
    multi_agent = True
    #: A run of this trainer without ``--backend`` (and on this machine) trains through this one.
    default_backend = "shared"
    known_args = frozenset({"players", "pfsp_exponent", "self_play_share", "scale_by_std", "learning_rates", "max_snapshots", "roles"})
    advantage_name = "selfplay"

    def __init__(self, ctx: TrainingContext) -> None:
        super().__init__(ctx)
        c, args = ctx.config, ctx.config.trainer_args
        count = args.get("players", 2)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PLAYERS:
            raise ConfigError(f"trainer arg players={count!r}: give a whole number of players from 1 to {MAX_PLAYERS}")
        self.joint: Any = getattr(ctx.backend, "joint", None)
        if self.joint is None or not hasattr(self.joint, "open_session"):
            raise ConfigError("the league trains its players as adapters of one base model held once: train with --backend shared "
                              "(its default; LoRA, on this machine), not --backend " + str(c.backend or "torch"))
        if c.async_steps:
            raise ConfigError("the league plays every step's games with the players' current adapters: leave out --async-steps")
        self.self_play_share = share_arg(args, "self_play_share", 0.0)
        self.scale_by_std = bool(args.get("scale_by_std", True))
        rates = args.get("learning_rates", [c.lr] * count)
        if (not isinstance(rates, list) or len(rates) != count
                or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < math.inf for r in rates)):
            raise ConfigError(f"trainer arg learning_rates={rates!r}: give one learning rate above 0 per player ({count}), e.g. "
                              f"learning_rates=[{', '.join(['1e-4'] * count)}]")
        self.learning_rates = [float(r) for r in rates]
        holds_snapshots = getattr(self.joint, "holds_snapshots", True)  # a league job of a scheduler holds its players alone
        self.max_snapshots = args.get("max_snapshots", DEFAULT_SNAPSHOTS if holds_snapshots else 0)
        if isinstance(self.max_snapshots, bool) or not isinstance(self.max_snapshots, int) or not 0 <= self.max_snapshots <= MAX_PLAYERS:
            raise ConfigError(f"trainer arg max_snapshots={self.max_snapshots!r}: give how many frozen snapshots play at once, "
                              f"0 to {MAX_PLAYERS} (0: none; --snapshot-every says how often one is taken)")
        if self.max_snapshots and not holds_snapshots:
            raise ConfigError(f"trainer arg max_snapshots={self.max_snapshots}: a league through a scheduler holds its players' adapters "
                              "alone (its job's seats), no frozen snapshots: leave max_snapshots out (or 0)")
        room = getattr(getattr(self.joint, "config", None), "max_sessions", None)
        if room is not None and count + self.max_snapshots > room:
            raise ConfigError(f"{count} players and {self.max_snapshots} snapshots are {count + self.max_snapshots} adapters; this base "
                              f"holds at most {room}: give fewer players or a lower max_snapshots")
        self.seats = self._seats()
        self.roles = bool(args.get("roles", False))
        if self.roles and count < len(self.seats):
            raise ConfigError(f"roles=true gives each player one seat of {self.seats} (player i the seat i mod {len(self.seats)}): "
                              f"give at least {len(self.seats)} players")
        if self.roles and self.self_play_share:
            raise ConfigError("roles=true: a player keeps its seat, so it cannot play itself; leave out self_play_share")
        self.players: dict[str, Any] = {player_name(0): ctx.backend}
        for i in range(1, count):
            self.players[player_name(i)] = self.joint.open_session(LoraSessionConfig(lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, seed=c.seed + i))
        self.snapshots: dict[str, Any] = {}  # the open snapshots' sessions, by name (``p1@4``: p1 after 4 steps)
        self.table = PlayerTable(list(self.players), float(args.get("pfsp_exponent", 2.0)))
        self.matches = MatchLog(Path(c.out) / "league")

    def _seats(self) -> list[str]:
        if self.ctx.make_env is None:
            raise ConfigError("the league needs a multi-agent env (--env, e.g. tinker/GomokuDuel-v0)")
        env = self.ctx.make_env()
        try:
            return list(env.possible_agents)
        finally:
            env.close()

    def learners(self) -> dict[str, Any]:
        """Every player by name, with its backend (a session of the shared base)."""
        return dict(self.players)

    def role(self, member: str) -> str:
        """The seat a member plays with ``roles=true`` (a snapshot its player's)."""
        return self.seats[int(member.split("@")[0][1:]) % len(self.seats)]

    def settings(self, seed: int | None = None, temperature: float | None = None) -> Any:
        from tinkergym.rollouts import RolloutConfig

        c = self.ctx.config
        return RolloutConfig(max_turns=c.max_turns, max_new_tokens=c.max_new_tokens, max_context=c.max_context,
                             temperature=c.temperature if temperature is None else temperature, seed=seed)

    def holders(self, index: int, mine: str, rng: random.Random) -> dict[str, str]:
        """Who holds each seat of game ``index``, player ``mine``'s (see the module's notes)."""
        if self.roles:
            held = {self.role(mine): mine}
            for seat in self.seats:
                if seat not in held:
                    held[seat] = self.table.sample_opponent(mine, rng, [m for m in self.table.active if self.role(m) == seat])
            return {seat: held[seat] for seat in self.seats}
        other = mine if len(self.players) == 1 or rng.random() < self.self_play_share else self.table.sample_opponent(mine, rng)
        first, second = (mine, other) if (index // len(self.players)) % 2 == 0 else (other, mine)
        return {self.seats[0]: first, **{seat: second for seat in self.seats[1:]}}

    def schedule(self, step: int, envs: list[Any]) -> tuple[list[Game], list[tuple[str, dict[str, str]]]]:
        """The step's games in ``envs`` and each one's player and seat holders: a pure function of the seed, the step and the table."""
        c = self.ctx.config
        rng = random.Random(f"league:{c.seed}:{step}")
        names = list(self.players)
        games, pairs = [], []
        for i, (env, seed) in enumerate(zip(envs, self.ctx.prompt_seeds(step, len(envs)))):
            mine = names[i % len(names)]
            holders = self.holders(i, mine, rng)
            games.append(Game(env, {seat: ModelPlayer(name, self.member(name)) for seat, name in holders.items()}, seed=seed))
            pairs.append((mine, holders))
        return games, pairs

    def member(self, name: str) -> Any:
        """A player's or an open snapshot's session."""
        return self.players[name] if name in self.players else self.snapshots[name]

    def train_step(self, step: int) -> StepOutput:
        """Every game to its end, then one update of every player (one mixed pass), then the ratings and snapshots."""
        c = self.ctx.config
        pool = self.ctx.env_pool
        if pool is None:
            raise ConfigError("the league needs a multi-agent env (--env, e.g. tinker/GomokuDuel-v0)")
        started = time.perf_counter()
        with pool.lend(c.batch_size * c.group_size) as envs, timeline.span("rollout", games=len(envs)):
            games, pairs = self.schedule(step, envs)
            results = play_games(games, self.ctx.renderer, self.settings(seed=c.seed * 100_003 + step))
        rolled_out = time.perf_counter()
        with timeline.span("update"):
            metrics = self.update_players(results)
        metrics.update(phase_times(started, rolled_out))
        opponents = []
        for result, (mine, holders) in zip(results, pairs):
            seat = self.role(mine) if self.roles else result.seat_of(mine)[0]
            outcome = result.outcome(seat) if result.error is None else None
            others = sorted({name for s, name in holders.items() if s != seat})
            if outcome is not None:
                for other in others:
                    self.table.record(mine, other, outcome)
            opponents.append(LEARNER if others == [mine] else others[0])
        self.matches.write(step, results, pairs)
        metrics.update(game_metrics(results, opponents, set(self.players)))
        metrics.update(self.table.metrics())
        if self.max_snapshots and c.snapshot_every and (step + 1) % c.snapshot_every == 0:
            self.take_snapshots(step + 1)
        self.matches.write_table(self.table)
        every = [t for name in self.players for t in learner_seats(results, {name})[0]]
        return StepOutput(metrics, every)

    def update_players(self, results: list[GameResult]) -> dict[str, float]:
        """One update of each player on its own seats of ``results`` (one mixed pass); ``p0``'s metrics plain, the others' prefixed."""
        jobs, prefixes = [], []
        for name, backend in self.players.items():
            trajectories, seats = learner_seats(results, {name})
            jobs.append((backend, trajectories, seat_advantages(seats, self.scale_by_std)))
            prefixes.append("" if name == player_name(0) else f"{name}/")
        metrics: dict[str, float] = {}
        for prefix, updated in zip(prefixes, self.update_many(jobs, self.learning_rates)):
            metrics.update({prefix + k: v for k, v in updated.items()})
        return metrics

    # ----- snapshots ---------------------------------------------------------------------------------
    def snapshot_folder(self, name: str) -> Path:
        player, steps = name.split("@")
        return Path(self.ctx.config.out) / "snapshots" / player / f"step_{int(steps):06d}"

    def take_snapshots(self, steps: int) -> None:
        """Every player's adapter after ``steps`` updates, exported (a peft adapter folder, ``snapshots/<player>/step_N``) and
        opened as a frozen member of the league (``<player>@<steps>``); past ``max_snapshots`` the oldest are retired."""
        for name, backend in self.players.items():
            snapshot = f"{name}@{steps}"
            backend.export(str(self.snapshot_folder(snapshot)))
            self.table.add(snapshot)
            self.open_snapshot(snapshot)
        for old in list(self.snapshots)[:max(len(self.snapshots) - self.max_snapshots, 0)]:
            self.table.retire(old)
            self.joint.close_session(self.snapshots.pop(old))

    def open_snapshot(self, name: str) -> None:
        c = self.ctx.config
        session = self.joint.open_session(LoraSessionConfig(lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, seed=c.seed))
        session.load_adapter(str(self.snapshot_folder(name)))
        self.snapshots[name] = session

    # ----- evaluation --------------------------------------------------------------------------------
    def evaluate(self, step: int, seeds: list[int], make_env: Callable[[], Any] | None = None) -> tuple[dict[str, float], list[Any]]:
        """Greedy games of every player against the env's scripted ``baseline`` and ``random`` agents, every seat in turn
        (with ``roles=true`` its own): ``eval/<outcome>_vs_<agent>`` (``p0``'s; the others' prefixed ``p<i>/``); the
        trajectories are ``p0``'s."""
        from tinkergym.trainers.matches import play_matches, scripted_opponent

        c = self.ctx.config
        make_env = make_env or self.ctx.make_env
        if make_env is None:
            raise ConfigError("the league needs a multi-agent env (--env, e.g. tinker/GomokuDuel-v0)")
        opponents: dict[str, Player] = {kind: scripted_opponent(c.env, kind) for kind in ("baseline", "random")}
        settings = self.settings(seed=c.seed, temperature=0.0)
        metrics: dict[str, float] = {}
        kept: list[Any] = []
        for index, (name, backend) in enumerate(self.players.items()):
            records, trajectories = play_matches(ModelPlayer(name, backend, temperature=0.0), opponents, make_env, seeds, self.ctx.renderer,
                                                 settings, seats=[self.role(name)] if self.roles else None)
            prefix = "" if index == 0 else f"{name}/"
            for kind, record in records.items():
                metrics.update({f"{prefix}eval/{outcome}_vs_{kind}": rate for outcome, rate in record.rates().items()})
            kept = kept or trajectories
        return metrics, kept

    # The session saves, restores and exports p0 (the run's backend); these do the same for the other players.
    def save_backends(self, folder: Path) -> None:
        for name, backend in list(self.players.items())[1:]:
            backend.save_state(str(Path(folder) / "players" / name))

    def load_backends(self, folder: Path) -> None:
        for name, backend in list(self.players.items())[1:]:
            backend.load_state(str(Path(folder) / "players" / name))

    def export_backends(self, folder: Path) -> None:
        for name, backend in list(self.players.items())[1:]:
            backend.export(str(Path(folder) / "players" / name))

    def state_dict(self) -> dict[str, Any]:
        """The players' table (ratings, results, snapshots) and how many games the match history holds."""
        return {"players": self.table.state_dict(), "matches": self.matches.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the open snapshots load from their folders; the match history goes back to the checkpoint."""
        if "players" in state:
            self.table.load_state_dict(state["players"])
            for name in self.table.active:
                if name not in self.players and name not in self.snapshots:
                    self.open_snapshot(name)
        if "matches" in state:
            self.matches.truncate(int(state["matches"]))

    def close(self) -> None:
        """Free the other players' and the snapshots' adapters (the run closes ``p0``, its own backend)."""
        super().close()
        for session in [*list(self.players.values())[1:], *self.snapshots.values()]:
            self.joint.close_session(session)
        self.snapshots.clear()


class MatchLog:
    """The league's artifacts in ``<out>/league``: ``matches.jsonl``, one line per game (step, seat holders, outcomes, moves,
    error), and ``table.json``, the rating table (:meth:`PlayerTable.table`) as it stands."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.count = 0

    @property
    def path(self) -> Path:
        return self.folder / "matches.jsonl"

    def write(self, step: int, results: list[GameResult], pairs: list[tuple[str, dict[str, str]]]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as out:
            for result, (mine, holders) in zip(results, pairs):
                outcomes = {seat: (None if result.error is not None else result.outcome(seat)) for seat in holders}
                out.write(json.dumps({"step": step, "player": mine, "seats": holders, "outcomes": outcomes, "moves": result.moves,
                                      "error": None if result.error is None else str(result.error)[:200]}) + "\n")
                self.count += 1

    def truncate(self, count: int) -> None:
        """Keep the first ``count`` games (a resumed run plays the later ones again)."""
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True) if self.path.is_file() else []
        if len(lines) < count:
            raise ConfigError(f"{self.path} holds {len(lines)} games, the checkpoint counts {count}: the run's league folder was changed")
        if lines:
            self.path.write_text("".join(lines[:count]), encoding="utf-8")
        self.count = count

    def write_table(self, table: PlayerTable) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / "table.json.tmp"
        tmp.write_text(json.dumps({"members": table.table(), "retired": sorted(table.retired)}, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.folder / "table.json")
