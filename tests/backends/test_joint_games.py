"""Games between adapters of one shared base: both seats of every game are sampled in one decode loop per round
(``LoraSession.joint``, :func:`tinkergym.games.sample_calls`), and the games are the ones each adapter's own calls play."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tinkergym_gomoku")

from tinkergym_gomoku.duel import GomokuDuelEnv  # noqa: E402

from tinkergym.backends.torch.shared import LoraSessionConfig, SharedBase, SharedBaseConfig  # noqa: E402
from tinkergym.chat import ChatTemplateRenderer  # noqa: E402
from tinkergym.games import Game, ModelPlayer, play_games  # noqa: E402
from tinkergym.protocol.types import SampleRequest, SampleResponse  # noqa: E402
from tinkergym.rollouts import RolloutConfig  # noqa: E402


class Alone:
    """A session's ``sample`` without its ``joint``: the player calls its adapter alone."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def sample(self, request: SampleRequest) -> SampleResponse:
        return self.session.sample(request)


class Counted(Alone):
    """A session whose ``joint`` is its base's ``sample_many``, counted."""

    def __init__(self, session: Any, calls: list[int]) -> None:
        super().__init__(session)
        self.joint, self.calls = self, calls

    def sample_many(self, calls: Any) -> Any:
        self.calls.append(len(calls))
        return self.session.base.sample_many([(seat.session, request) for seat, request in calls])


def games_between(a: Any, b: Any, count: int) -> list[Game]:
    """``count`` games of ``a`` against ``b``, who moves first alternating: each round both have moves to sample."""
    return [Game(GomokuDuelEnv(size=5, win_length=4), {"player_0": (a, b)[s % 2], "player_1": (b, a)[s % 2]}, seed=s) for s in range(count)]


def by_player(results: list[Any], name: str) -> list[Any]:
    return [seat.trajectory for r in results for seat in r.seats.values() if seat.player == name]


def moves(results: list[Any]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Every seat's tokens, game by game."""
    return [[(a, tuple(s.trajectory.tokens)) for a, s in sorted(r.seats.items())] for r in results]


def logprobs(results: list[Any]) -> list[float]:
    return [x for r in results for _, s in sorted(r.seats.items()) for x in s.trajectory.logprobs]


def test_two_adapters_play_in_one_decode_loop_and_the_same_games_as_alone(tiny: str) -> None:
    from transformers import AutoTokenizer

    renderer = ChatTemplateRenderer(AutoTokenizer.from_pretrained(tiny))
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", device="cpu"))
    a, b = (base.open_session(LoraSessionConfig(lora_rank=4, seed=seed)) for seed in (1, 2))
    for session in (a, b):  # adapters that differ, so that a mixed-up row would show
        with torch.no_grad():
            for p in session.params.values():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(session.id)) * 0.3)
    assert a.joint is b.joint is base
    config = RolloutConfig(max_turns=3, max_new_tokens=6, seed=5)

    def play(first: Any, second: Any) -> list[Any]:
        return play_games(games_between(ModelPlayer("a", first), ModelPlayer("b", second), 4), renderer, config)

    alone = play(Alone(a), Alone(b))
    calls: list[int] = []
    shared = Counted(a, calls)
    together = play(shared, _same_joint(shared, b))
    assert calls and all(n == 2 for n in calls), "each round: both players' requests in one call"
    assert moves(together) == moves(alone)
    # the logprobs of rows decoded beside other rows differ in float32's last places (another matmul shape), no more
    assert logprobs(together) == pytest.approx(logprobs(alone), abs=1e-3)
    assert moves(play(a, b)) == moves(alone), "the sessions themselves: their base samples them together"
    assert moves(play(Alone(a), Alone(a))) != moves(alone), "the second seat's adapter matters"


def _same_joint(shared: Counted, session: Any) -> Alone:
    """``session`` as a player whose ``joint`` is ``shared``'s."""
    seat = Alone(session)
    seat.joint = shared  # type: ignore[attr-defined]
    return seat


def test_two_adapters_update_in_one_mixed_pass_as_each_alone(tiny: str) -> None:
    """``GRPOTrainer.update_many``: the adapters of one base train in one ``forward_backward_many`` pass; each ends where
    its own update alone takes it (a player's rows never reach another's adapter or optimizer)."""
    from transformers import AutoTokenizer

    from tinkergym.config import TrainConfig
    from tinkergym.trainers.base import TrainingContext
    from tinkergym.trainers.grpo import GRPOTrainer

    renderer = ChatTemplateRenderer(AutoTokenizer.from_pretrained(tiny))

    def players() -> tuple[Any, Any, Any]:
        base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", device="cpu"))
        return base, base.open_session(LoraSessionConfig(lora_rank=4, seed=1)), base.open_session(LoraSessionConfig(lora_rank=4, seed=2))

    base, a, b = players()
    results = play_games(games_between(ModelPlayer("a", a), ModelPlayer("b", b), 4), renderer, RolloutConfig(max_turns=2, max_new_tokens=6, seed=3))
    mine = {name: [t for t in by_player(results, name) if t.num_sampled_tokens] for name in ("a", "b")}
    assert all(mine.values()), "each player has moves to train on"
    signs = lambda rewards, valid: [(-1.0) ** i for i in range(len(rewards))]  # noqa: E731 - every row trains
    trainer = GRPOTrainer(TrainingContext(TrainConfig(model=tiny, lr=0.05), a, renderer))

    bystander = base.open_session(LoraSessionConfig(lora_rank=4, seed=9))  # a third adapter of the base, in no job
    kept = {n: p.detach().clone() for n, p in bystander.params.items()}
    calls: list[int] = []
    original = base.forward_backward_many
    base.forward_backward_many = lambda jobs: calls.append(len(jobs)) or original(jobs)  # type: ignore[method-assign]
    together = trainer.update_many([(a, mine["a"], signs), (b, mine["b"], signs)])
    assert calls == [2], "one mixed pass for the two adapters"
    assert all(torch.equal(p, kept[n]) and p.grad is None for n, p in bystander.params.items()), "no gradient reached another adapter"
    assert not bystander.optimizer.state and bystander.step == 0, "nor its optimizer"

    _, a_alone, b_alone = players()
    alone = [trainer.update(a_alone, mine["a"], signs), trainer.update(b_alone, mine["b"], signs)]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in together] == pytest.approx([m[key] for m in alone], rel=1e-4, abs=1e-6), key
    for mixed, single in ((a, a_alone), (b, b_alone)):
        for name, p in mixed.params.items():
            torch.testing.assert_close(p, single.params[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(p, b.params[n]) for n, p in a.params.items()), "the two adapters moved apart"
