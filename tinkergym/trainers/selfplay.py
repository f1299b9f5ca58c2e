"""Self-play on multi-agent (AEC) text games: the learner against itself and a rated league of opponents.

Each step is two phases. **Rollout**: ``batch_size * group_size`` games are played at once by
:func:`tinkergym.games.play_games`; in game ``i`` the learner holds seat ``i mod seats`` (so it plays every
seat equally often) and the other seats go, with probability ``self_play_share``, to the learner itself
(both seats learn), otherwise to one league member drawn by prioritized fictitious self-play
(:class:`~tinkergym.trainers.league.League`). **Update**: only after every game has ended, one GRPO-style
optimizer step on the learner's seats; nothing samples while it runs, so no policy ever acts with weights
from the middle of an update.

Advantages are per seat (role-conditioned baselines): a seat's return minus the mean return of the
learner's trajectories in that seat this step, over their std (``scale_by_std``), so the first mover's
edge is not learned as skill. Illegal moves cost the env's documented penalty (it is in the seat's
return); failed and budget-ended games follow ``truncation`` / ``truncated_reward`` as in single-agent runs.

The league holds the env's scripted ``baseline`` and ``random`` agents (the package's ``baseline`` and
``random_agent``), frozen ``snapshots`` of the learner every ``snapshot_every`` steps (served for sampling
only, :mod:`tinkergym.trainers.snapshots`), and ``run:DIR`` policies, as ``--opponents`` lists them. Every
finished learner-vs-member game updates the ratings (openskill); ratings, the collapse detector's state
and the snapshot list are saved with each checkpoint, so ``--resume`` continues exactly. When the
:class:`~tinkergym.trainers.collapse.CollapseDetector` fires, the run says so and raises the fixed
opponents' share of games to ``collapse_fixed_share``. The win rate against fixed members it watches is
taken over the newest :data:`FIXED_WINDOW` such games (once a quarter of them are played), not one step's
handful.

``seat_policies: separate`` gives every seat a trainable policy of its own (a backend each, built like the
run's; the run's own is the first seat's, the others are saved in each checkpoint under ``seats/<seat>`` and
exported to ``final/seats/<seat>``): self-play games put each seat's policy in its seat, league games put
one of them in its seat against the member, and each policy updates on its own seat's games. The league's
ratings are then the first seat's policy's. Snapshots stay off in this mode (a snapshot would leave its seat).

With ``async_steps`` K > 0 (:mod:`tinkergym.trainers.async_rollouts`) the games of the next K steps are played
from snapshots of the learners' weights while a step updates: snapshots never change, so still no policy acts with
weights from the middle of an update. A step's games and opponents are drawn when the step is handed over (at the
start of step ``step - K``, from the league as it stood then), and a learner whose games were sampled more than K
versions before its update skips that update (its batch counts as one dropped group).

``trainer_args``: ``self_play_share`` (0.5), ``fixed_share`` (0.2), ``pfsp_exponent`` (2), ``max_snapshots``
(8), ``collapse_fixed_share`` (0.5), ``scale_by_std`` (true), ``seat_policies`` (shared).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Set as AbstractSet
from pathlib import Path
from typing import Any

from tinkergym.plumbing import timeline
from tinkergym.config import OPPONENT_KINDS, parse_opponents  # noqa: F401 - importable from here
from tinkergym.errors import ConfigError
from tinkergym.games import Game, GameResult, ModelPlayer, Player, ScriptedPlayer, SeatResult, play_games
from tinkergym.protocol.backend import Backend
from tinkergym.rollouts import RolloutConfig, Trajectory
from tinkergym.trainers.advantages import keyed_advantages
from tinkergym.trainers.async_rollouts import RolloutPipeline, policy_version, staleness_metrics
from tinkergym.trainers.base import EnvPool, StepOutput, TrainingContext
from tinkergym.trainers.collapse import CollapseDetector
from tinkergym.trainers.grpo import GRPOTrainer, phase_times
from tinkergym.trainers.league import League, LeagueMember
from tinkergym.trainers.matches import play_matches, scripted_opponent

LEARNER = "learner"
#: Games against fixed members the win rate the collapse detector watches is taken over (the newest ones).
FIXED_WINDOW = 64


class SelfPlayTrainer(GRPOTrainer):
    """Self-play with a rated opponent league, per-seat advantages and collapse detection (see the module docs)."""

    needs_env = True
    multi_agent = True
    known_args = frozenset({"scale_by_std", "self_play_share", "fixed_share", "pfsp_exponent", "max_snapshots", "collapse_fixed_share", "seat_policies"})
    advantage_name = "selfplay"

    def __init__(self, ctx: TrainingContext) -> None:
        super().__init__(ctx)
        c, args = ctx.config, ctx.config.trainer_args
        self.self_play_share = share_arg(args, "self_play_share", 0.5)
        self.collapse_fixed_share = share_arg(args, "collapse_fixed_share", 0.5)
        max_snapshots = int(args.get("max_snapshots", 8))
        self.league = League(max_snapshots=max_snapshots, fixed_share=share_arg(args, "fixed_share", 0.2), exponent=float(args.get("pfsp_exponent", 2.0)))
        self.detector = CollapseDetector()
        self.learner = ModelPlayer(LEARNER, ctx.backend)
        self.opponents = parse_opponents(c.opponents)
        self.snapshots_on = "snapshots" in self.opponents
        if self.snapshots_on and (c.backend_url or c.scheduler_url):
            raise ConfigError("snapshots are served from local checkpoints; with a training server use --opponents baseline,random.")
        self._players: dict[str, Player] = {}
        self._frozen: Any = None
        for name in self.opponents:
            if name in ("baseline", "random"):
                self._players[name] = scripted_opponent(c.env, name)
                self.league.add(LeagueMember(name, name))
            elif name.startswith("run:"):
                self.league.add(LeagueMember(name, "policy", source=name[4:]))
        self._fixed_outcomes: list[float] = []
        self.fired: list[str] = []
        self.seat_backends: dict[str, Backend] = {}  # each seat's but the first: its trainable backend (set by _seat_learners)
        self.seat_learners = self._seat_learners(args.get("seat_policies", "shared"))

    # ----- players -----------------------------------------------------------------------------------
    def _seat_learners(self, mode: Any) -> dict[str, ModelPlayer]:
        """``shared``: one learner for every seat ({}); ``separate``: a trainable backend of its own per seat."""
        if mode not in ("shared", "separate"):
            raise ConfigError(f"trainer arg seat_policies={mode!r}: choose shared (one policy plays every seat) or separate (one per seat).")
        if mode == "shared":
            return {}
        if self.ctx.make_backend is None:
            raise ConfigError("seat_policies=separate trains a backend per seat, built on this machine: leave out --backend-url and --scheduler.")
        if self.snapshots_on:
            raise ConfigError("seat_policies=separate has no snapshots (a snapshot would have to keep to one seat): use --opponents baseline,random.")
        with self._env_pool().lend(1) as envs:
            seats = list(envs[0].possible_agents)
        learners = {seats[0]: self.learner}
        for seat in seats[1:]:
            self.seat_backends[seat] = self.ctx.make_backend()
            learners[seat] = ModelPlayer(f"{LEARNER}@{seat}", self.seat_backends[seat])
        return learners

    def learners(self) -> dict[str, Any]:
        """Every trainable policy by player name, with its backend."""
        players = list(self.seat_learners.values()) or [self.learner]
        return {p.name: p.sampler for p in players}

    def _frozen_policies(self) -> Any:
        if self._frozen is None:
            from tinkergym.trainers.snapshots import FrozenPolicies

            c = self.ctx.config
            self._frozen = FrozenPolicies(c.model, c.dtype)
        return self._frozen

    def player(self, name: str) -> Player:
        """The player of league member ``name`` (frozen policies load on first use)."""
        if name not in self._players:
            member = self.league.get(name)
            if member.kind == "snapshot":
                sampler = self._frozen_policies().add_checkpoint(name, member.source)
            else:
                sampler = self._frozen_policies().add_run(name, member.source)
            self._players[name] = ModelPlayer(name, sampler)
        return self._players[name]

    def _env_pool(self) -> EnvPool:
        """The run's envs (the context's pool): each step's games (several at once when played ahead) borrow a set of their own."""
        if self.ctx.env_pool is None:
            raise ConfigError("self-play needs a multi-agent env (--env, e.g. tinker/GomokuDuel-v0).")
        return self.ctx.env_pool

    def settings(self, temperature: float | None = None, seed: int | None = None) -> RolloutConfig:
        """The rollout budgets of the run (``max_turns`` is moves per seat)."""
        c = self.ctx.config
        return RolloutConfig(max_turns=c.max_turns, max_new_tokens=c.max_new_tokens, max_context=c.max_context,
                             temperature=c.temperature if temperature is None else temperature, seed=seed)

    # ----- one step ----------------------------------------------------------------------------------
    def schedule(self, step: int, envs: list[Any], samplers: dict[str, Any] | None = None) -> tuple[list[Game], list[str]]:
        """The step's games in ``envs`` (one each; batch size x group size of them) and the opponent of each (``learner``
        for pure self-play): a pure function of the seed, the step and the league.

        ``samplers`` (by learner name) puts the learners' snapshots in their seats instead of their backends.
        """
        c = self.ctx.config
        count = c.batch_size * c.group_size
        seats = list(envs[0].possible_agents)
        rng = random.Random(f"selfplay:{c.seed}:{step}")
        learner, seat_learners = self.learner, self.seat_learners
        if samplers is not None:
            bound = {name: ModelPlayer(name, sampler) for name, sampler in samplers.items()}
            learner, seat_learners = bound[LEARNER], {seat: bound[p.name] for seat, p in self.seat_learners.items()}
        games, opponents = [], []
        for i, (env, seed) in enumerate(zip(envs, self.ctx.prompt_seeds(step, count))):
            mine = seats[i % len(seats)]
            opponent = LEARNER
            if len(self.league) and rng.random() >= self.self_play_share:
                opponent = self.league.sample_opponents(1, rng)[0]
            own = {a: seat_learners.get(a, learner) for a in seats}  # who plays each seat in self-play
            other = self.player(opponent) if opponent != LEARNER else None
            games.append(Game(env, {a: (own[a] if other is None or a == mine else other) for a in seats}, seed=seed))
            opponents.append(opponent)
        return games, opponents

    def train_step(self, step: int) -> StepOutput:
        """Rollout phase (every game to its end), then the update phase, then ratings, collapse checks and snapshots."""
        c = self.ctx.config
        if c.async_steps:
            results, opponents, metrics = self.update_ahead(step)
        else:
            started = time.perf_counter()
            with self._env_pool().lend(c.batch_size * c.group_size) as envs, timeline.span("rollout", games=len(envs)):
                games, opponents = self.schedule(step, envs)
                results = play_games(games, self.ctx.renderer, self.settings(seed=c.seed * 100_003 + step))
            rolled_out = time.perf_counter()
            with timeline.span("update"):
                metrics = self.update_learners(results)  # the update phase: every game has ended
            metrics.update(phase_times(started, rolled_out))
        every = [t for name in self.learners() for t in learner_seats(results, {name})[0]]
        for result, opponent in zip(results, opponents):
            seat = result.seat_of(LEARNER)
            if opponent != LEARNER and seat:  # with a policy per seat, the first seat's learner carries the rating
                outcome = result.outcome(seat[0])
                if outcome is not None:
                    self.league.record(opponent, outcome)
        metrics.update(game_metrics(results, opponents, set(self.learners())))
        self._fixed_outcomes = (self._fixed_outcomes + fixed_outcomes(results, opponents, self.league, set(self.learners())))[-FIXED_WINDOW:]
        if len(self._fixed_outcomes) >= FIXED_WINDOW // 4:  # a win rate from a handful of games is noise, not a signal
            metrics["league/winrate_fixed"] = sum(o == 1.0 for o in self._fixed_outcomes) / len(self._fixed_outcomes)
        metrics.update(self.league.metrics())
        self.fired = self.detector.update(step, metrics)
        metrics.update(self.detector.metrics())
        if self.fired:
            share = self.league.boost_fixed(self.collapse_fixed_share) if any(m.fixed for m in self.league.members) else self.league.fixed_share
            print(f"step {step}: self-play collapse signals: {', '.join(self.fired)}; fixed opponents now get at least {share:.0%} of league games", file=sys.stderr)
        if self.snapshots_on and c.snapshot_every and (step + 1) % c.snapshot_every == 0:
            self.take_snapshot(step)
        return StepOutput(metrics, every)

    def update_learners(self, results: list[GameResult], skip: AbstractSet[str] = frozenset()) -> dict[str, float]:
        """One update of each learner (but those in ``skip``) on its seats of ``results``; their metrics, other seats' prefixed."""
        metrics: dict[str, float] = {}
        jobs, prefixes = [], []
        for name, backend in self.learners().items():
            trajectories, seats = learner_seats(results, {name})
            if name in skip:
                trajectories, seats = [], []
            prefixes.append("" if name == LEARNER else f"{name.split('@', 1)[1]}/")
            jobs.append((backend, trajectories, seat_advantages(seats, self.scale_by_std)))
        for prefix, updated in zip(prefixes, self.update_many(jobs)):  # adapters of one shared base: one mixed pass
            metrics.update({prefix + k: v for k, v in updated.items()})
        return metrics

    def update_ahead(self, step: int) -> tuple[list[GameResult], list[str], dict[str, float]]:
        """The step's games, played ahead from snapshots; each learner updates on them unless they are more than ``async_steps`` versions old."""
        c = self.ctx.config
        if self.pipeline is None:
            self.pipeline = RolloutPipeline.for_run(self.learners(), c, self.plan_games)
        with timeline.span("rollout_wait"):
            rollout, waited = self.pipeline.take(step, c.steps - 1)
        trained = time.perf_counter()
        results, opponents = rollout.output
        gaps = {name: policy_version(backend) - rollout.versions[name] for name, backend in self.learners().items()}
        stale = {name for name, gap in gaps.items() if gap > c.async_steps}
        with timeline.span("update"):
            metrics = self.update_learners(results, skip=stale)
        sizes = {name: len(learner_seats(results, {name})[0]) for name in gaps}
        gaps_B = [gaps[name] for name in gaps for _ in range(sizes[name])]
        keep_B = [name not in stale for name in gaps for _ in range(sizes[name])]
        metrics.update(staleness_metrics(gaps_B, keep_B, dropped_groups=len(stale)))  # a learner's batch is one group
        metrics.update({"time/rollout_wait_s": waited, "time/update_s": time.perf_counter() - trained, "async/rollout_s": rollout.seconds,
                        "async/rollout_retries": float(rollout.retries)})
        return results, opponents, metrics

    def plan_games(self, step: int, samplers: dict[str, Any]) -> Callable[[], tuple[list[GameResult], list[str]]]:
        """Step ``step``'s games (drawn now, from the league as it stands) with the learners' snapshots ``samplers``, to play later."""
        c = self.ctx.config
        pool = self._env_pool()
        envs = pool.take(c.batch_size * c.group_size)
        games, opponents = self.schedule(step, envs[: c.batch_size * c.group_size], samplers)
        settings = self.settings(seed=c.seed * 100_003 + step)

        def play() -> tuple[list[GameResult], list[str]]:
            try:
                return play_games(games, self.ctx.renderer, settings), opponents
            finally:
                pool.give(envs)

        return play

    def close(self) -> None:
        """Stop playing ahead (games in flight are dropped)."""
        if self.pipeline is not None:
            self.pipeline.close()

    # The session saves, restores and exports the run's own backend; these do the same for the other seats' policies.
    def save_backends(self, folder: Path) -> None:
        """Save each other seat's policy into ``folder/seats/<seat>``."""
        for seat, backend in self.seat_backends.items():
            backend.save_state(str(Path(folder) / "seats" / seat))

    def load_backends(self, folder: Path) -> None:
        """Restore what :meth:`save_backends` wrote."""
        for seat, backend in self.seat_backends.items():
            backend.load_state(str(Path(folder) / "seats" / seat))

    def export_backends(self, folder: Path) -> None:
        """Export each other seat's policy to ``folder/seats/<seat>`` (the run's own export is the first seat's)."""
        for seat, backend in self.seat_backends.items():
            backend.export(str(Path(folder) / "seats" / seat))

    def take_snapshot(self, step: int) -> None:
        """Save the learner as ``snapshot:<step+1>`` (its weights after ``step + 1`` updates) and add it to the league."""
        folder = Path(self.ctx.config.out) / "snapshots" / f"step_{step + 1:06d}"
        self.ctx.backend.save_state(str(folder))
        self.league.add_snapshot(step + 1, str(folder))

    # ----- evaluation and state ----------------------------------------------------------------------
    def evaluate(self, step: int, seeds: list[int], make_env: Callable[[], Any] | None = None) -> tuple[dict[str, float], list[Trajectory]]:
        """Greedy games against each fixed member (the learner takes every seat in turn): win/draw/loss rates.

        ``make_env`` makes the games' envs (the session passes the eval env: ``env_kwargs`` with ``eval_env_kwargs``
        over them); the training env without it.
        """

        opponents = {m.name: self.player(m.name) for m in self.league.members if m.fixed}
        greedy: Any = ModelPlayer(LEARNER, self.ctx.backend, temperature=0.0)
        if self.seat_learners:  # a policy per seat: each plays its own seat
            greedy = {seat: ModelPlayer(p.name, p.sampler, temperature=0.0) for seat, p in self.seat_learners.items()}
        make_env = make_env or self.ctx.make_env
        if make_env is None:
            raise ConfigError("self-play needs a multi-agent env (--env, e.g. tinker/GomokuDuel-v0).")
        records, trajectories = play_matches(greedy, opponents, make_env, seeds, self.ctx.renderer, self.settings(temperature=0.0, seed=self.ctx.config.seed))
        metrics: dict[str, float] = {}
        for name, record in records.items():
            for outcome, rate in record.rates().items():
                metrics[f"eval/{outcome}_vs_{name}"] = rate
        return metrics, trajectories

    def state_dict(self) -> dict[str, Any]:
        """The league (members, ratings, results, fixed share) and the collapse detector."""
        return {"league": self.league.state_dict(), "collapse": self.detector.state_dict(), "fixed_outcomes": list(self._fixed_outcomes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; snapshot players reload from their checkpoints when next drawn."""
        if "league" in state:
            self.league.load_state_dict(state["league"])
        if "collapse" in state:
            self.detector.load_state_dict(state["collapse"])
        self._fixed_outcomes = [float(o) for o in state.get("fixed_outcomes", [])]
        self._players = {k: v for k, v in self._players.items() if isinstance(v, ScriptedPlayer)}
        if self.pipeline is not None:  # games played ahead from the weights before the restore
            self.pipeline.reset()


def share_arg(args: dict[str, Any], key: str, default: float) -> float:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"trainer arg {key}={value!r}: give a fraction from 0 to 1.")
    return float(value)


def seat_advantages(seats: list[str], scale_by_std: bool) -> Callable[[list[float], list[bool]], list[float]]:
    """Advantages against the rewards of the same seat (:func:`keyed_advantages`), as ``GRPOTrainer.update`` takes them."""
    return lambda rewards, valid: keyed_advantages(rewards, keys_B=seats, scale_by_std=scale_by_std, valid_B=valid)


def _trajectory(seat: SeatResult) -> Trajectory:
    """A learner's trajectory in a game: a model player's seat always has one."""
    assert seat.trajectory is not None
    return seat.trajectory


def learner_seats(results: list[GameResult], names: AbstractSet[str] = frozenset({LEARNER})) -> tuple[list[Trajectory], list[str]]:
    """Every trajectory the players ``names`` played, and the seat of each."""
    trajectories, seats = [], []
    for result in results:
        for agent in [a for a, s in result.seats.items() if s.player in names]:
            trajectories.append(_trajectory(result.seats[agent]))
            seats.append(agent)
    return trajectories, seats


def game_metrics(results: list[GameResult], opponents: list[str], learners: AbstractSet[str] = frozenset({LEARNER})) -> dict[str, float]:
    """Per-step self-play figures: draw and illegal-move rates, move lengths, per-seat returns and win rates
    (``opponents``: each game's, ``learner`` for a game of the learners alone)."""
    mine = [s for r in results for s in r.seats.values() if s.player in learners]
    learner_moves = sum(s.moves for s in mine)
    illegal = sum(s.illegal_moves for s in mine)
    tokens = sum(_trajectory(s).num_sampled_tokens for s in mine)
    finished = [r for r in results if r.error is None]
    metrics = {
        "selfplay/games": float(len(results)),
        "selfplay/moves": float(sum(r.moves for r in results)),
        "selfplay/draw_rate": sum(r.outcome(next(iter(r.seats))) == 0.5 for r in finished) / max(len(finished), 1),
        "selfplay/illegal_rate": illegal / max(learner_moves, 1),
        "selfplay/response_tokens": tokens / max(learner_moves, 1),
    }
    pure = [r for r, o in zip(results, opponents) if o == LEARNER and r.error is None]
    if pure:
        metrics["selfplay/reward"] = sum(s.reward for r in pure for s in r.seats.values()) / sum(len(r.seats) for r in pure)
    by_seat: dict[str, list[float]] = {}
    for r in finished:
        for agent in [a for a, s in r.seats.items() if s.player in learners]:
            by_seat.setdefault(agent, []).append(r.seats[agent].reward)
    for agent, rewards in sorted(by_seat.items()):
        metrics[f"selfplay/reward_{agent}"] = sum(rewards) / len(rewards)
    return metrics


def fixed_outcomes(results: list[GameResult], opponents: list[str], league: League, learners: AbstractSet[str] = frozenset({LEARNER})) -> list[float]:
    """The learners' outcomes (1, 0.5, 0) in this step's finished games against fixed members."""
    fixed = {m.name for m in league.members if m.fixed}
    outcomes = [r.outcome(next(a for a, s in r.seats.items() if s.player in learners)) for r, o in zip(results, opponents) if o in fixed and r.error is None]
    return [o for o in outcomes if o is not None]  # all of them: a game without an error has an outcome
