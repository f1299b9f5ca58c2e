"""The league trainer: N LoRA players of one shared base, paired by their results, updated in one mixed pass.

Matchmaking by the players' results (a property test), a league of one equal to self-play on the same backend, and a
league of three that trains, checkpoints every player, resumes exactly and exports each."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openskill")
pytest.importorskip("tinkergym_gomoku")

from tinkergym.config import TrainConfig  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402
from tinkergym.trainers.players import PlayerTable  # noqa: E402
from tinkergym.trainers.session import TrainingRun  # noqa: E402

NAMES = ["p0", "p1", "p2", "p3"]


def test_pairing_weights_follow_the_results() -> None:
    for trial in range(40):  # random leagues: any results, any exponent
        check_pairing(trial)


def check_pairing(trial: int) -> None:
    rng = random.Random(trial)
    exponent = rng.choice([0.0, 1.0, 2.0, 3.5])
    table = PlayerTable(NAMES, exponent)
    members = list(NAMES)
    for step in range(rng.randrange(0, 3)):  # frozen snapshots join, the oldest retire
        for name in NAMES[:2]:
            members.append(f"{name}@{step + 1}")
            table.add(members[-1])
        table.retire(members[len(NAMES)])
    games = [(rng.choice(members), rng.choice(members), rng.choice([0.0, 0.5, 1.0])) for _ in range(rng.randrange(0, 40))]
    for a, b, outcome in games:
        table.record(a, b, outcome)
    active = [m for m in members if m not in table.retired]
    assert table.active == active
    for a in NAMES:
        weights = table.opponent_weights(a)
        assert set(weights) == set(active) - {a} and sum(weights.values()) == pytest.approx(1.0)
        among = rng.sample(active, k=min(2, len(active)))
        assert set(table.opponent_weights(a, among)) == set(among) - {a}
        assert table.sample_opponent(a, random.Random(trial), among) in (set(among) - {a} or {a})
        for b in weights:  # the results are one game seen from both sides
            assert table.win_probability(a, b) + table.win_probability(b, a) == pytest.approx(1.0)
        ordered = sorted(weights, key=lambda b: table.win_probability(a, b))
        if exponent > 0:  # the players a loses to most are played most
            assert all(weights[x] >= weights[y] - 1e-12 for x, y in zip(ordered, ordered[1:]))
        else:
            assert len(set(round(w, 12) for w in weights.values())) == 1
    again = PlayerTable(NAMES, exponent)
    again.load_state_dict(json.loads(json.dumps(table.state_dict())))
    assert again.active == table.active and again.table() == table.table()
    assert again.metrics() == table.metrics() and again.opponent_weights("p0") == table.opponent_weights("p0")
    assert [again.sample_opponent("p1", random.Random(3)) for _ in range(5)] == [table.sample_opponent("p1", random.Random(3)) for _ in range(5)]




def test_a_player_that_keeps_losing_to_one_meets_it_most_and_ratings_order_them() -> None:
    table = PlayerTable(["p0", "p1", "p2"])
    for _ in range(6):
        table.record("p0", "p1", 0.0)  # p1 beats p0
        table.record("p0", "p2", 1.0)  # p0 beats p2
    weights = table.opponent_weights("p0")
    assert weights["p1"] > 0.9 and weights["p2"] < 0.05
    assert [r["player"] for r in table.table()] == ["p1", "p0", "p2"]
    assert table.metrics()["league/winrate_p0_vs_p1"] == 0.0 and table.metrics()["league/winrate_p0_vs_p2"] == 1.0
    table.record("p1", "p1", 1.0)  # a player against itself counts nothing
    assert table.metrics()["league/winrate_p0_vs_p1"] == 0.0
    with pytest.raises(ConfigError, match="other players"):
        PlayerTable(["p0", "p1"]).load_state_dict(table.state_dict())
    with pytest.raises(ConfigError, match="already has a member"):
        table.add("p1")


def config(out: Path, **changes) -> TrainConfig:
    settings_ = dict(env="tinker/GomokuDuel-v0", env_kwargs={"size": 5, "win_length": 3}, model="tiny", steps=2, batch_size=2, group_size=4,
                     max_turns=6, max_new_tokens=6, checkpoint_every=1, transcripts_every=0, out=str(out), seed=3, dtype="float32",
                     lora_rank=4, kl_coef=0.05, backend="shared")
    settings_.update(changes)
    return TrainConfig(**settings_)


def moved(run: TrainingRun) -> TrainingRun:
    """``run`` with every player's adapter moved off zero alike (a tiny model's games all end alike, so only the KL term
    to the base trains, and it needs an adapter that already differs from the base)."""
    import torch

    for index, backend in enumerate(run.trainer.learners().values()):
        with torch.no_grad():
            for name, param in sorted(backend.params.items()):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(index * 1000 + len(name))) * 0.05)
    return run


def metrics_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_league_of_one_is_self_play_and_a_league_of_three_trains_saves_resumes_and_exports(tmp_path: Path) -> None:
    one = tmp_path / "one"
    moved(TrainingRun(config(one, trainer="league", trainer_args={"players": 1}))).run(progress=False)
    selfplay = tmp_path / "selfplay"
    moved(TrainingRun(config(selfplay, trainer="selfplay", opponents=""))).run(progress=False)
    for step, (a, b) in enumerate(zip(metrics_of(one), metrics_of(selfplay), strict=True)):
        for key in ("loss", "grad_norm", "reward/mean", "selfplay/games", "selfplay/moves", "selfplay/reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (step, key)
        assert a["grad_norm"] > 0, "the step trained"

    three = dict(trainer="league", trainer_args={"players": 3, "learning_rates": [1e-3, 1e-3, 1e-9]}, eval_every=2, eval_episodes=1)
    straight = tmp_path / "three"
    run = moved(TrainingRun(config(straight, **three)))
    bases = {id(p.joint) for p in run.trainer.players.values()}
    assert len(run.trainer.players) == 3 and len(bases) == 1, "three adapters of one base"
    run.run(progress=False)
    last = metrics_of(straight)[-1]
    assert {"loss", "p1/loss", "p2/loss", "rating/p0", "rating/p2"} <= set(last)
    assert any(k.startswith("league/winrate_") for k in last), "the players met each other"
    evaluated = [m for m in metrics_of(straight) if "eval/win_vs_baseline" in m]  # every player against the scripted agents
    assert evaluated and all(f"{p}eval/{o}_vs_{a}" in evaluated[-1] for p in ("", "p1/", "p2/") for o in ("win", "loss") for a in ("baseline", "random"))
    assert (straight / "checkpoints" / "step_000001" / "players" / "p2" / "state.json").is_file()
    assert (straight / "final" / "players" / "p1" / "adapter_config.json").is_file() and (straight / "final" / "adapter_config.json").is_file()
    rates = [(m["learning_rate"], m.get("p1/learning_rate"), m.get("p2/learning_rate")) for m in metrics_of(straight) if "learning_rate" in m]
    assert all(r == (1e-3, 1e-3, 1e-9) for r in rates), f"each player steps at its own learning rate: {rates}"

    resumed = tmp_path / "resumed"
    moved(TrainingRun(config(resumed, **{**three, "steps": 1}))).run(progress=False)
    TrainingRun.resume(resumed, changes={"steps": 2}).run(progress=False)
    again = metrics_of(resumed)[-1]
    for key in ("loss", "p1/loss", "p2/loss", "p2/grad_norm", "rating/p0", "rating/p1", "selfplay/games"):
        assert again[key] == pytest.approx(last[key], rel=1e-6, abs=1e-7), f"{key} differs after a resume"
    assert last["p1/grad_norm"] > 0 and last["p2/grad_norm"] > 0

    with pytest.raises(ConfigError, match="--backend shared .* not --backend torch"):
        TrainingRun(config(tmp_path / "torch", **three, backend="torch"))
    implied = TrainingRun(config(tmp_path / "implied", **three, backend=None))  # the league's own backend when none is named
    assert implied.config.backend == "shared" and json.loads((tmp_path / "implied" / "config.json").read_text())["backend"] == "shared"
    with pytest.raises(ConfigError, match="one learning rate above 0 per player"):
        TrainingRun(config(tmp_path / "rates", trainer="league", trainer_args={"players": 2, "learning_rates": [1e-4]}))
    with pytest.raises(ConfigError, match="players=0"):
        TrainingRun(config(tmp_path / "none", trainer="league", trainer_args={"players": 0}))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_roles_snapshots_and_the_match_history_of_a_league_resume_exactly(tmp_path: Path) -> None:
    """``roles=true``: each player keeps its seat and meets only the other role; snapshots join as frozen members, the
    oldest retire; the rating table and every game are artifacts; a resumed run plays the same games."""
    import torch

    league = dict(trainer="league", trainer_args={"players": 2, "roles": True, "max_snapshots": 2}, snapshot_every=1, steps=3)
    straight = tmp_path / "straight"
    run = moved(TrainingRun(config(straight, **league)))
    run.run(progress=False)
    games = lines(straight / "league" / "matches.jsonl")
    assert len(games) == 3 * 8 and {g["step"] for g in games} == {0, 1, 2}
    for game in games:  # p0 and its snapshots move first, p1 and its snapshots second
        assert game["seats"]["player_0"].split("@")[0] == "p0" and game["seats"]["player_1"].split("@")[0] == "p1", game
    assert any("@" in name for g in games for name in g["seats"].values()), "snapshots played"
    table = json.loads((straight / "league" / "table.json").read_text())
    assert {r["player"] for r in table["members"]} == {"p0", "p1", "p0@1", "p1@1", "p0@2", "p1@2", "p0@3", "p1@3"}
    assert table["retired"] == ["p0@1", "p0@2", "p1@1", "p1@2"]
    assert (straight / "snapshots" / "p1" / "step_000002" / "adapter_config.json").is_file()
    snapshot = run.trainer.snapshot_folder("p0@1")
    from safetensors.torch import load_file
    first = load_file(str(snapshot / "adapter_model.safetensors"))
    final = load_file(str(straight / "final" / "adapter_model.safetensors"))
    assert any(not torch.equal(first[k], final[k]) for k in first), "the player went on after its snapshot"

    resumed = tmp_path / "resumed"
    moved(TrainingRun(config(resumed, **{**league, "steps": 2}))).run(progress=False)
    TrainingRun.resume(resumed, changes={"steps": 3}).run(progress=False)
    assert lines(resumed / "league" / "matches.jsonl") == games
    assert json.loads((resumed / "league" / "table.json").read_text()) == table
    assert metrics_of(resumed)[-1]["loss"] == pytest.approx(metrics_of(straight)[-1]["loss"], rel=1e-6, abs=1e-7)

    # any player of the finished league is a `tinkergym play` opponent
    from click.testing import CliRunner

    from tinkergym.cli import main

    jsonl = tmp_path / "played.jsonl"
    opponent = f"model:{straight / 'final' / 'players' / 'p1'}"
    played = CliRunner().invoke(main, ["play", "tinker/GomokuDuel-v0", "--agent", "random", "--seat", "player_1", "--opponent", opponent,
                                       "--kwarg", "size=5", "--kwarg", "win_length=3", "--seed", "1", "--jsonl", str(jsonl)], catch_exceptions=False)
    assert played.exit_code == 0, played.output
    transcript = json.loads(jsonl.read_text())
    assert transcript["turns"][0]["actor"] == "player_0" and transcript["turns"][0]["action"], "the league's player moved first"
    missing = CliRunner().invoke(main, ["play", "tinker/GomokuDuel-v0", "--agent", "random", "--opponent", f"model:{tmp_path / 'nope'}"])
    assert missing.exit_code == 2 and "model:PATH" in missing.output

    with pytest.raises(ConfigError, match="at least 2 players"):
        TrainingRun(config(tmp_path / "one", trainer="league", trainer_args={"players": 1, "roles": True}))
    with pytest.raises(ConfigError, match="max_snapshots"):
        TrainingRun(config(tmp_path / "many", trainer="league", trainer_args={"players": 2, "max_snapshots": 63}))
