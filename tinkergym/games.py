"""The game coordinator: many turn-based multi-agent games at once, every seat a policy, batched sampling.

:func:`play_games` plays a batch of :class:`~tinkergym.aec.TextAECEnv` games (any PettingZoo AEC text env)
between players. It enforces the env's turn order (``agent_selection``), and in each round:

1. every game whose seat to move is a :class:`ScriptedPlayer` gets its move from that player's agent;
2. every seat to move that a :class:`ModelPlayer` holds is rendered with the model's chat template, and all
   of them are sampled together: one ``sample`` call per policy per round (per distinct token budget), not
   one per game; seats of several players that share a sampler share the call, and the policies that are adapters
   of one shared base (samplers with the same ``joint``) are sampled in one decode loop (:func:`sample_calls`);
3. every game steps its env with its move (concurrently, on the rollout's bounded thread pool).

Each model seat keeps its own token-faithful :class:`~tinkergym.rollouts.Trajectory`, exactly as the
single-agent rollout builds one: its own view (``env.observe(seat)``) rendered as user messages, its sampled
ids appended as sampled (mask 1, sampler logprobs kept), never re-tokenized. The reward of a seat's turn is
everything the env paid that seat from its move until its next one (its own illegal-move penalty, and the
loss the opponent's winning reply brings), so a seat's ``total_reward`` is its return in the game.

A game ends when the env ends it (every agent terminated or truncated), or when a seat's rollout budget
(``max_turns`` moves, ``max_episode_tokens``, ``max_context``) runs out: then every seat ends with that
budget's finish reason, and the game counts as a draw (:meth:`GameResult.outcome`). An env or template
error fails that game alone (its trajectories fully masked), never the batch.

Nothing runs between rounds but the env steps: :func:`play_games` returns only when every game of the batch
has ended, which is the phase boundary a trainer updates at (no policy acts with half-updated weights).
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from tinkergym.protocol.types import SampleRequest, SamplingParams
from tinkergym.chat import ChatRenderer
from tinkergym.rollouts import (
    EpisodeState,
    RolloutConfig,
    Sampler,
    Trajectory,
    EnvCalls,
    Episode,
    after_step,
    env_worker_count,
    group_by_budget,
    start_episode,
    take_sample,
)


@dataclass(frozen=True, eq=False)
class ModelPlayer:
    """A policy that samples its moves: a Backend, or anything with the Backend's ``sample``.

    Players are told apart by ``name``; players with the same ``sampler`` object share its sample calls.
    ``temperature`` overrides the rollout's (0 plays greedily, e.g. for evaluation).
    """

    name: str
    sampler: Sampler
    temperature: float | None = None


@dataclass(frozen=True, eq=False)
class ScriptedPlayer:
    """A scripted agent: ``make_agent(seed=...)`` builds a fresh ``agent(observation, info) -> move`` per game and seat."""

    name: str
    make_agent: Callable[..., Callable[[str, dict], str]]


Player = ModelPlayer | ScriptedPlayer


@dataclass
class Game:
    """One game to play: the env (a fresh game starts with ``env.reset(seed=seed)``) and who holds each seat."""

    env: Any
    players: dict[str, Player]
    seed: int | None = None


@dataclass
class SeatResult:
    """How one seat's game went: who held it, its return, its moves, and its trajectory (model players only)."""

    agent: str
    player: str
    reward: float = 0.0
    moves: int = 0
    illegal_moves: int = 0
    trajectory: Trajectory | None = None


@dataclass
class GameResult:
    """One finished game.

    ``finish_reason`` is ``"terminated"`` / ``"truncated"`` (the env ended it), a rollout budget's reason
    (``"max_turns"``, ``"max_episode_tokens"``, ``"context"``), or ``"error"`` (``error`` says what failed).
    ``final_rewards`` are the rewards the env paid on its last step (the win/loss/draw of the game).
    """

    seats: dict[str, SeatResult]
    finish_reason: str = ""
    error: str | None = None
    final_rewards: dict[str, float] = field(default_factory=dict)
    seed: int | None = None

    @property
    def moves(self) -> int:
        """Moves played by every seat, rejected ones included."""
        return sum(s.moves for s in self.seats.values())

    def outcome(self, agent: str) -> float | None:
        """1 if ``agent`` won, 0 if it lost, 0.5 for a draw (a budget-ended game is a draw); ``None`` after an error.

        Decided by the env's final rewards: the seat paid more than every other seat won.
        """
        if self.error is not None:
            return None
        if self.finish_reason not in ("terminated", "truncated") or not self.final_rewards:
            return 0.5
        mine = self.final_rewards.get(agent, 0.0)
        others = [r for a, r in self.final_rewards.items() if a != agent]
        if not others or all(mine == r for r in others):
            return 0.5
        return 1.0 if all(mine > r for r in others) else 0.0 if all(mine < r for r in others) else 0.5

    def seat_of(self, player: str) -> list[str]:
        """The seats ``player`` held in this game."""
        return [a for a, s in self.seats.items() if s.player == player]


@dataclass
class _Seat:
    agent: str
    player: Player
    result: SeatResult
    episode: Episode | None = None  # model players only
    agent_fn: Callable[[str, dict], str] | None = None  # scripted players only
    pending: float = 0.0  # reward paid since the seat's last move
    stopped: bool = False  # whether its last sample ended on a stop token
    moved: bool = False


def _model_seat(seat: _Seat) -> tuple[ModelPlayer, Episode]:
    """A model player's seat: its player and its episode (which :func:`_new_live` gives every model seat)."""
    assert isinstance(seat.player, ModelPlayer) and seat.episode is not None
    return seat.player, seat.episode


@dataclass
class _Live:
    game: Game
    seats: dict[str, _Seat]
    result: GameResult
    done: bool = False


def _over(env: Any) -> bool:
    """Whether the game is over: no agent left, or every one terminated or truncated."""
    return not env.agents or all(env.terminations.get(a, False) or env.truncations.get(a, False) for a in env.agents)


def _seat_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else seed * 7919 + index


def _new_live(game: Game) -> _Live:
    seats = {}
    agents = list(game.env.possible_agents)
    missing = [a for a in agents if a not in game.players]
    if missing:
        raise ValueError(f"no player for seat(s) {missing}; every seat of {agents} needs one")
    for index, agent in enumerate(agents):
        player = game.players[agent]
        seat = _Seat(agent, player, SeatResult(agent, player.name))
        if isinstance(player, ModelPlayer):
            seat.episode = Episode(game.env, game.seed)
            seat.result.trajectory = seat.episode.trajectory
        else:
            seat.agent_fn = player.make_agent(seed=_seat_seed(game.seed, index))
        seats[agent] = seat
    return _Live(game, seats, GameResult(seats={a: s.result for a, s in seats.items()}, seed=game.seed))


def _end(live: _Live, reason: str, error: str | None = None) -> None:
    """End the game for every seat: pay pending rewards, close trajectories with ``reason``."""
    live.done = True
    live.result.finish_reason = reason
    live.result.error = error
    for seat in live.seats.values():
        seat.result.reward += seat.pending if error is None else 0.0
        episode = seat.episode
        if episode is None:
            continue
        if episode.state is not EpisodeState.TERMINATED:
            if seat.moved:  # its last move's reward is what it was paid since
                episode.trajectory.rewards.append(float(seat.pending))
                episode.turns += 1
            episode.finish(reason, error)
        elif error is not None:
            episode.finish("error", error)
        seat.pending = 0.0


def _prepare(live: _Live, renderer: ChatRenderer, config: RolloutConfig) -> tuple[_Seat, str | None] | None:
    """The seat to move and, for a scripted one, its move; ends the game (returns ``None``) when it is over."""
    env = live.game.env
    if _over(env):
        truncated = any(env.truncations.get(a, False) for a in env.agents) and not any(env.terminations.values())
        _end(live, "truncated" if truncated else "terminated")
        return None
    seat = live.seats[env.agent_selection]
    observation, info = env.observe(seat.agent), dict(env.infos.get(seat.agent, {}))
    if seat.agent_fn is not None:
        return seat, seat.agent_fn(observation, info)
    _, episode = _model_seat(seat)
    if not seat.moved and episode.state is EpisodeState.PENDING:
        start_episode(episode, (observation, info), renderer, config)
    else:
        reward, seat.pending = seat.pending, 0.0
        seat.result.reward += reward
        after_step(episode, (observation, reward, False, False, info), seat.stopped, renderer, config)
    if episode.state is EpisodeState.TERMINATED:  # a budget ran out: the game ends here for everyone
        _end(live, episode.trajectory.finish_reason)
        return None
    return seat, None


def _sample_moves(waiting: list[tuple[_Live, _Seat]], renderer: ChatRenderer, config: RolloutConfig, round_index: int) -> dict[int, str]:
    """Sample every waiting model seat: one request per sampler (and temperature, and token budget), the requests of
    samplers that share a joint sampler (:func:`sample_calls`) in one call."""
    moves: dict[int, str] = {}
    by_policy: dict[tuple[int, float], list[tuple[_Live, _Seat]]] = {}
    for live, seat in waiting:
        player, _ = _model_seat(seat)
        temperature = config.temperature if player.temperature is None else player.temperature
        by_policy.setdefault((id(player.sampler), temperature), []).append((live, seat))
    calls: list[tuple[Sampler, SampleRequest, list[Episode], dict[int, tuple[_Live, _Seat]]]] = []
    for policy_index, ((_, temperature), members) in enumerate(by_policy.items()):
        sampler = _model_seat(members[0][1])[0].sampler
        by_episode = {id(seat.episode): (live, seat) for live, seat in members}
        for budget, episodes in group_by_budget([_model_seat(seat)[1] for _, seat in members], config).items():
            params = SamplingParams(
                max_new_tokens=budget, temperature=temperature, top_p=config.top_p, top_k=config.top_k,
                stop_token_ids=list(renderer.stop_token_ids),
                seed=None if config.seed is None else config.seed * 1_000_003 + round_index * 1009 + budget + policy_index * 7_919_009,
            )
            calls.append((sampler, SampleRequest(prompts=[e.trajectory.tokens for e in episodes], params=params), episodes, by_episode))
    responses = sample_calls([(sampler, request) for sampler, request, _, _ in calls])
    for (_, _, episodes, by_episode), response in zip(calls, responses):
        for episode, (sequence, *_) in zip(episodes, response.sequences, strict=True):
            live, seat = by_episode[id(episode)]
            try:
                moves[id(live)] = take_sample(episode, list(sequence.tokens), list(sequence.logprobs), renderer)
            except Exception as exc:  # noqa: BLE001 - a template failure ends this game only
                _end(live, "error", f"{type(exc).__name__}: {exc}")
                continue
            seat.stopped = sequence.finish_reason == "stop"
    for members in by_policy.values():
        for live, seat in members:  # a budget that left nothing to sample ends the game
            _, episode = _model_seat(seat)
            if episode.state is EpisodeState.TERMINATED and not live.done:
                _end(live, episode.trajectory.finish_reason)
    return moves


def sample_calls(calls: list[tuple[Sampler, SampleRequest]]) -> list[Any]:
    """Each ``(sampler, request)``'s response, in order. Samplers with the same ``joint`` attribute (the sessions of one
    shared base: :attr:`tinkergym.backends.torch.lora_session.LoraSession.joint`) are sampled in one
    ``joint.sample_many`` call, one decode loop with an adapter per row; a request's samples are the same either way
    (each draws from its own seed's streams). The others call their own ``sample``. A sampler's exception is raised."""
    responses: list[Any] = [None] * len(calls)
    together: dict[int, tuple[Any, list[int]]] = {}
    for i, (sampler, _) in enumerate(calls):
        joint = getattr(sampler, "joint", None)
        if joint is None:
            continue
        together.setdefault(id(joint), (joint, []))[1].append(i)
    for joint, indexes in together.values():
        if len(indexes) < 2:
            continue
        for i, outcome in zip(indexes, joint.sample_many([calls[i] for i in indexes])):
            if isinstance(outcome, BaseException):
                raise outcome
            responses[i] = outcome
    for i, (sampler, request) in enumerate(calls):
        if responses[i] is None:
            responses[i] = sampler.sample(request)
    return responses


def _apply(live: _Live, seat: _Seat) -> None:
    """After ``env.step``: count the move, collect every seat's reward, note the final rewards."""
    env = live.game.env
    seat.moved = True
    seat.result.moves += 1
    if env.infos.get(seat.agent, {}).get("error"):
        seat.result.illegal_moves += 1
    for agent, reward in env.rewards.items():
        if agent in live.seats:
            live.seats[agent].pending += float(reward)
    if env.agents and _over(env):
        live.result.final_rewards = {a: float(r) for a, r in env.rewards.items()}


def play_games(
    games: list[Game],
    renderer: ChatRenderer,
    config: RolloutConfig,
    on_round: Callable[[int, int], None] | None = None,
) -> list[GameResult]:
    """Play every game to its end, all at once, and return their results in order.

    Args:
        games: The games: env, seed, and the player of every seat (``env.possible_agents``).
        renderer: The model's chat template (all model players share the tokenizer).
        config: Budgets per seat (``max_turns`` is moves per seat), sampling settings, env threads.
        on_round: Called after each round with (round, games still running).
    """
    lives = [_new_live(g) for g in games]
    env_calls = EnvCalls(env_worker_count([g.env for g in games], config))
    try:
        for live, reset in [(live, env_calls.submit(live.game.env.reset, seed=live.game.seed)) for live in lives]:
            try:
                reset.result()
            except Exception as exc:  # noqa: BLE001 - an env's reset failure ends this game only
                _end(live, "error", f"{type(exc).__name__}: {exc}")
        round_index = 0
        while active := [live for live in lives if not live.done]:
            actions: dict[int, tuple[_Live, _Seat, str | None]] = {}
            for live in active:
                try:
                    prepared = _prepare(live, renderer, config)
                except Exception as exc:  # noqa: BLE001 - an env, agent or template failure ends this game only
                    _end(live, "error", f"{type(exc).__name__}: {exc}")
                    continue
                if prepared is not None:
                    actions[id(live)] = (live, *prepared)
            waiting = [(live, seat) for live, seat, move in actions.values() if move is None]
            sampled = _sample_moves(waiting, renderer, config, round_index)
            steps = []
            for key, (live, seat, move) in actions.items():
                move = move if move is not None else sampled.get(key)
                if live.done or move is None:
                    continue
                steps.append((live, seat, env_calls.submit(live.game.env.step, move)))
            for live, seat, step in steps:  # in submission order, whatever order the steps finished in
                try:
                    step.result()
                    _apply(live, seat)
                except Exception as exc:  # noqa: BLE001 - an env or agent failure ends this game only
                    _end(live, "error", f"{type(exc).__name__}: {exc}")
            round_index += 1
            if on_round is not None:
                on_round(round_index, sum(not live.done for live in lives))
    finally:
        env_calls.close()
    return [live.result for live in lives]
