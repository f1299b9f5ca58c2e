"""The game coordinator: turn order, each seat's token-faithful view, batched sampling, rewards, budgets, errors."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tinkergym_gomoku")

from tinkergym_gomoku.agents import HeuristicAgent
from tinkergym_gomoku.duel import GomokuDuelEnv

from tinkergym.backends.models import build_tiny_model
from tinkergym.protocol.types import SampledSequence, SampleRequest, SampleResponse
from tinkergym.chat import ChatTemplateRenderer
from tinkergym.games import Game, ModelPlayer, ScriptedPlayer, play_games
from tinkergym.rollouts import RolloutConfig


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> ChatTemplateRenderer:
    from transformers import AutoTokenizer

    return ChatTemplateRenderer(AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny"))))


def last_user_message(renderer: ChatTemplateRenderer, prompt: list[int]) -> str:
    text = renderer.tokenizer.decode(prompt, skip_special_tokens=False)
    return text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


class BoardSampler:
    """Plays the heuristic move for the board in each prompt's last user message; every ``junk_every``-th answer is junk.

    Records the batch size of every call and the order of calls, so batching can be checked.
    """

    def __init__(self, renderer: ChatTemplateRenderer, junk_every: int = 0, seed: int = 0) -> None:
        self.renderer, self.junk_every, self.seed = renderer, junk_every, seed
        self.calls: list[int] = []
        self.answers = 0

    def sample(self, request: SampleRequest) -> SampleResponse:
        self.calls.append(len(request.prompts))
        out = []
        for prompt in request.prompts:
            self.answers += 1
            junk = self.junk_every and self.answers % self.junk_every == 0
            move = "zz" if junk else HeuristicAgent(seed=self.seed + self.answers)(last_user_message(self.renderer, prompt), {})
            ids = self.renderer.tokenizer.encode(move, add_special_tokens=False)[: request.params.max_new_tokens - 1]
            ids.append(self.renderer.tokenizer.eos_token_id)
            out.append([SampledSequence(tokens=ids, logprobs=[-0.25] * len(ids), finish_reason="stop")])
        return SampleResponse(sequences=out)


def duel(**kwargs) -> GomokuDuelEnv:
    return GomokuDuelEnv(size=kwargs.pop("size", 6), win_length=kwargs.pop("win_length", 4), **kwargs)


def replay_and_check(result, renderer) -> dict[str, float]:
    """Replay the game from the seats' assistant messages; each seat's user messages must be the env's view of it then."""
    env = duel()
    env.reset(seed=result.seed)
    users = {a: [m["content"] for m in s.trajectory.messages if m["role"] == "user"] for a, s in result.seats.items()}
    moves = {a: [m["content"] for m in s.trajectory.messages if m["role"] == "assistant"] for a, s in result.seats.items()}
    returns = {a: 0.0 for a in env.possible_agents}
    while not all(env.terminations.values()):
        agent = env.agent_selection
        assert env.observe(agent) == users[agent].pop(0), "a seat sees exactly its own view of the game"
        env.step(moves[agent].pop(0))
        for a, r in env.rewards.items():
            returns[a] += r
    assert not any(moves.values()) and not any(users.values())
    return returns


def test_each_seat_is_its_own_token_faithful_trajectory(renderer) -> None:
    sampler = BoardSampler(renderer, junk_every=7)
    learner = ModelPlayer("learner", sampler)
    games = [Game(duel(), {"player_0": learner, "player_1": learner}, seed=s) for s in range(4)]
    results = play_games(games, renderer, RolloutConfig(max_turns=40, max_new_tokens=8, max_context=4096))
    for result in results:
        assert result.finish_reason == "terminated" and result.error is None
        returns = replay_and_check(result, renderer)
        for agent, seat in result.seats.items():
            t = seat.trajectory
            assert t.tokens == renderer.render(t.messages)[: len(t.tokens)], "the trajectory is the template's rendering of the seat's view"
            assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) and t.finish_reason == "terminated"
            assert all(lp == -0.25 for lp, m in zip(t.logprobs, t.loss_mask) if m)
            assert len(t.rewards) == seat.moves, "one reward per move of the seat"
            assert t.total_reward == pytest.approx(returns[agent]) == pytest.approx(seat.reward)
        outcomes = sorted(result.outcome(a) for a in result.seats)
        assert outcomes in ([0.0, 1.0], [0.5, 0.5])
        winner = [a for a in result.seats if result.outcome(a) == 1.0]
        if winner:
            assert result.final_rewards[winner[0]] == 1.0
    illegal = sum(s.illegal_moves for r in results for s in r.seats.values())
    assert illegal > 0, "junk answers were played and counted as illegal moves"
    # one seat moves per game per round and both seats are one policy: one call per round, all live games in it
    assert sampler.calls[0] == 4 and len(sampler.calls) == max(r.moves for r in results)


def test_one_call_per_policy_per_round_and_scripted_seats_never_sample(renderer) -> None:
    a, b = BoardSampler(renderer, seed=1), BoardSampler(renderer, seed=2)
    pa, pb, bot = ModelPlayer("a", a), ModelPlayer("b", b), ScriptedPlayer("baseline", HeuristicAgent)
    games = [
        Game(duel(), {"player_0": pa, "player_1": pb}, seed=0),
        Game(duel(), {"player_0": pb, "player_1": pa}, seed=1),
        Game(duel(), {"player_0": pa, "player_1": bot}, seed=2),
        Game(duel(), {"player_0": bot, "player_1": pb}, seed=3),
    ]
    rounds = []
    results = play_games(games, renderer, RolloutConfig(max_turns=40, max_new_tokens=8), on_round=lambda r, left: rounds.append(left))
    assert len(a.calls) <= len(rounds) and len(b.calls) <= len(rounds), "at most one call per policy per round"
    assert a.calls[0] == 2 and b.calls[0] == 1, "round 1: player_0 moves everywhere; a holds it in games 0 and 2, b in game 1"
    assert sum(a.calls) == sum(r.seats[s].moves for r in results for s in r.seat_of("a"))
    assert sum(b.calls) == sum(r.seats[s].moves for r in results for s in r.seat_of("b"))
    for r in results:
        assert r.finish_reason == "terminated"
        for seat in r.seats.values():
            assert (seat.trajectory is None) == (seat.player == "baseline")
    assert rounds[-1] == 0


def test_a_budget_ends_the_game_for_every_seat_as_a_draw(renderer) -> None:
    sampler = BoardSampler(renderer)
    learner = ModelPlayer("learner", sampler)
    (result,) = play_games([Game(duel(size=8, win_length=5), {"player_0": learner, "player_1": learner}, seed=0)], renderer, RolloutConfig(max_turns=2, max_new_tokens=8))
    assert result.finish_reason == "max_turns" and result.outcome("player_0") == result.outcome("player_1") == 0.5
    for seat in result.seats.values():
        assert seat.trajectory.finish_reason == "max_turns" and seat.trajectory.budget_truncated
        assert seat.moves == 2 and len(seat.trajectory.rewards) == 2


class BrokenDuel(GomokuDuelEnv):
    def _play(self, agent, action):
        if len(self._game.moves) >= 3:
            raise RuntimeError("the game engine crashed")
        return super()._play(agent, action)


def test_an_env_error_fails_its_game_alone(renderer) -> None:
    sampler = BoardSampler(renderer)
    learner = ModelPlayer("learner", sampler)
    games = [Game(BrokenDuel(size=6, win_length=4), {"player_0": learner, "player_1": learner}, seed=0), Game(duel(), {"player_0": learner, "player_1": learner}, seed=1)]
    broken, fine = play_games(games, renderer, RolloutConfig(max_turns=40, max_new_tokens=8))
    assert broken.finish_reason == "error" and "crashed" in broken.error and broken.outcome("player_0") is None
    assert all(s.trajectory.failed and not any(s.trajectory.loss_mask) for s in broken.seats.values())
    assert fine.finish_reason == "terminated" and fine.error is None


def test_every_seat_needs_a_player(renderer) -> None:
    with pytest.raises(ValueError, match="player_1"):
        play_games([Game(duel(), {"player_0": ScriptedPlayer("baseline", HeuristicAgent)})], renderer, RolloutConfig())
