"""The self-play league: openskill ratings, PFSP opponent weights with a fixed-share floor, snapshot cap, state."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from tinkergym.errors import ConfigError
from tinkergym.trainers.league import League, LeagueMember, UnknownOpponentError


def baseline() -> LeagueMember:
    return LeagueMember("baseline", "baseline")


def played_league() -> League:
    """A league with fixed and snapshot members and a mix of results."""
    league = League([baseline(), LeagueMember("random", "random")], max_snapshots=3, exponent=2.0)
    for step in (10, 20, 30, 40):
        league.add_snapshot(step, source=f"/runs/x/checkpoints/{step}")
        for i in range(step // 10):
            league.record("random", 1.0)
            league.record("baseline", [1.0, 0.5, 0.0][i % 3])
            league.record(f"snapshot:{step}", [0.0, 0.5][i % 2])
    league.record_pair("snapshot:20", "baseline", 1.0)
    return league


def test_member_kind_sets_fixed_and_is_checked() -> None:
    assert baseline().fixed is True and LeagueMember("random", "random").fixed is True
    assert LeagueMember("run:/p", "policy").fixed is True
    assert LeagueMember("snapshot:3", "snapshot").fixed is False
    assert LeagueMember("snapshot:3", "snapshot", fixed=True).fixed is True
    with pytest.raises(ConfigError, match="use one of"):
        LeagueMember("x", "bot")
    with pytest.raises(ConfigError):
        LeagueMember("", "baseline")


def test_learner_that_keeps_winning_rises_above_the_baseline() -> None:
    league = League([baseline(), LeagueMember("random", "random")])
    for _ in range(20):
        league.record("baseline", 1.0)
    r = league.ratings()
    assert r["learner"]["mu"] > 25.0 > r["baseline"]["mu"]
    assert r["learner"]["ordinal"] > r["baseline"]["ordinal"]
    assert r["random"]["mu"] == 25.0 and r["random"]["games"] == 0, "an unplayed member keeps its prior"
    assert (r["baseline"]["wins"], r["baseline"]["games"], r["baseline"]["winrate"]) == (20, 20, 1.0)
    assert r["learner"]["games"] == 20
    lines = league.table().splitlines()
    assert lines[0].split()[0] == "name" and [line.split()[0] for line in lines[1:]] == ["learner", "random", "baseline"]


def test_losses_lower_the_learner_and_draws_between_equals_keep_mu() -> None:
    league = League([baseline()])
    league.record("baseline", 0.0)
    r = league.ratings()
    assert r["learner"]["mu"] < 25.0 < r["baseline"]["mu"] and r["baseline"]["losses"] == 1
    even = League([baseline()])
    even.record("baseline", 0.5)
    r = even.ratings()
    assert r["learner"]["mu"] == pytest.approx(25.0) and r["baseline"]["mu"] == pytest.approx(25.0)
    assert r["learner"]["sigma"] < 25.0 / 3.0, "a game, even a draw, makes the rating more certain"
    assert r["baseline"]["draws"] == 1 and r["baseline"]["winrate"] == 0.5


def test_pfsp_puts_weight_on_the_members_the_learner_loses_to() -> None:
    league = League()
    for name in ("beaten", "unbeaten", "unplayed"):
        league.add(LeagueMember(name, "snapshot"))
    for _ in range(10):
        league.record("beaten", 1.0)
        league.record("unbeaten", 0.0)
    weights = league.opponent_weights()
    assert weights["unbeaten"] > weights["unplayed"] > weights["beaten"]
    assert league.win_probability("unplayed") == 0.5 and league.win_probability("beaten") == 11 / 12
    f = {"beaten": (1 / 12) ** 2, "unbeaten": (11 / 12) ** 2, "unplayed": 0.25}
    assert weights == pytest.approx({k: v / sum(f.values()) for k, v in f.items()})
    assert sum(weights.values()) == pytest.approx(1.0)
    flat = League(exponent=0)
    for name in ("a", "b"):
        flat.add(LeagueMember(name, "snapshot"))
    flat.record("a", 1.0)
    assert flat.opponent_weights() == pytest.approx({"a": 0.5, "b": 0.5}), "exponent 0 plays every member alike"


def test_fixed_members_keep_their_share_when_the_learner_beats_them() -> None:
    league = League([baseline(), LeagueMember("random", "random")], fixed_share=0.2)
    for step in (1, 2, 3):
        league.add_snapshot(step)
        for _ in range(5):
            league.record(f"snapshot:{step}", 0.0)
    for _ in range(50):
        league.record("baseline", 1.0)
        league.record("random", 1.0)
    weights = league.opponent_weights()
    assert weights["baseline"] + weights["random"] == pytest.approx(0.2)
    assert weights["baseline"] == pytest.approx(weights["random"]), "the floor is spread evenly over the fixed members"
    draws = Counter(league.sample_opponents(20000, random.Random(0)))
    assert (draws["baseline"] + draws["random"]) / 20000 == pytest.approx(0.2, abs=0.015)
    assert draws["baseline"] / 20000 == pytest.approx(0.1, abs=0.01)
    assert league.boost_fixed(0.5) == 0.5 and league.fixed_share == 0.5
    draws = Counter(league.sample_opponents(20000, random.Random(1)))
    assert (draws["baseline"] + draws["random"]) / 20000 == pytest.approx(0.5, abs=0.015)
    assert league.boost_fixed(0.1) == 0.5, "boost_fixed never lowers the share"


def test_fixed_members_above_the_floor_keep_plain_pfsp_weights() -> None:
    league = League([baseline()], fixed_share=0.2)
    league.add_snapshot(1)
    for _ in range(5):
        league.record("baseline", 0.0)
        league.record("snapshot:1", 1.0)
    f_base, f_snap = (1 - 1 / 7) ** 2, (1 / 7) ** 2
    assert league.opponent_weights() == pytest.approx({"baseline": f_base / (f_base + f_snap), "snapshot:1": f_snap / (f_base + f_snap)})
    only_snapshots = League(fixed_share=0.9)
    only_snapshots.add_snapshot(1)
    assert only_snapshots.opponent_weights() == {"snapshot:1": 1.0}, "no fixed member: nothing to give the floor to"


def test_snapshot_cap_drops_the_oldest_snapshot_only() -> None:
    league = League([baseline(), LeagueMember("snapshot:0", "snapshot", fixed=True, step=0)], max_snapshots=2)
    for _ in range(4):
        league.record("baseline", 1.0)
    learner = league.ratings()["learner"]
    first = league.add_snapshot(10, source="/ckpt/10")
    assert (first.name, first.kind, first.fixed, first.source, first.step) == ("snapshot:10", "snapshot", False, "/ckpt/10", 10)
    assert league.ratings()["snapshot:10"]["mu"] == learner["mu"], "a snapshot starts from the learner's rating"
    league.record("snapshot:10", 0.0)
    league.add_snapshot(20)
    league.add_snapshot(30)
    assert [m.name for m in league.members] == ["baseline", "snapshot:0", "snapshot:20", "snapshot:30"]
    assert "snapshot:10" not in league and "snapshot:10" not in league.ratings()
    assert league.ratings()["learner"]["games"] == 5, "the learner's own tally keeps games against dropped members"
    league.add_snapshot(40)
    assert [m.name for m in league.members] == ["baseline", "snapshot:0", "snapshot:30", "snapshot:40"]


def test_record_pair_rates_two_members_and_leaves_the_learner_alone() -> None:
    league = League([baseline()])
    league.add_snapshot(5)
    league.record_pair("snapshot:5", "baseline", 1.0)
    r = league.ratings()
    assert r["snapshot:5"]["mu"] > 25.0 > r["baseline"]["mu"]
    assert r["learner"]["mu"] == 25.0 and r["baseline"]["games"] == 0 and r["learner"]["games"] == 0
    league.record_pair("baseline", "learner", 1.0)
    assert league.ratings()["baseline"]["losses"] == 1, "a pair with the learner is the learner's game"


def test_metrics_are_flat_floats() -> None:
    league = played_league()
    metrics = league.metrics()
    assert all(isinstance(v, float) for v in metrics.values())
    assert set(k for k in metrics if k.startswith("rating/")) == {f"rating/{n}" for n in ["learner", "baseline", "random", "snapshot:20", "snapshot:30", "snapshot:40"]}
    assert metrics["league/winrate_vs_random"] == 1.0 and metrics["league/members"] == 5.0
    assert metrics["league/fixed_share"] == 0.2
    assert metrics["rating/learner"] == pytest.approx(league.ratings()["learner"]["ordinal"])
    unplayed = League([baseline()])
    assert "league/winrate_vs_baseline" not in unplayed.metrics()


def test_state_round_trips_through_json_exactly() -> None:
    league = played_league()
    league.boost_fixed(0.35)
    state = league.state_dict()
    restored = League()
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    assert restored.ratings() == league.ratings()
    assert restored.members == league.members
    assert (restored.fixed_share, restored.max_snapshots, restored.exponent) == (0.35, 3, 2.0)
    assert restored.sample_opponents(50, random.Random(7)) == league.sample_opponents(50, random.Random(7))
    for copy in (league, restored):
        copy.record("snapshot:40", 1.0)
        copy.add_snapshot(50)
    assert restored.state_dict() == league.state_dict(), "the restored league goes on exactly as the original"
    assert [m.name for m in restored.members][-3:] == ["snapshot:30", "snapshot:40", "snapshot:50"]


def test_bad_arguments_raise_config_errors() -> None:
    for kwargs in ({"fixed_share": 1.5}, {"fixed_share": -0.1}, {"exponent": -1}, {"max_snapshots": 0}, {"max_snapshots": 2.5}):
        with pytest.raises(ConfigError):
            League(**kwargs)
    league = League([baseline()])
    with pytest.raises(ConfigError, match="already has"):
        league.add(baseline())
    with pytest.raises(ConfigError, match="learner"):
        league.add(LeagueMember("learner", "policy"))
    with pytest.raises(ConfigError, match="outcome"):
        league.record("baseline", 0.7)
    with pytest.raises(ConfigError):
        league.boost_fixed(2.0)
    with pytest.raises(ConfigError):
        league.sample_opponents(-1, random.Random(0))
    with pytest.raises(ConfigError):
        league.add_snapshot(-3)
    with pytest.raises(ConfigError, match="no members"):
        League().sample_opponents(1, random.Random(0))
    with pytest.raises(ConfigError):
        league.load_state_dict({"members": []})
    with pytest.raises(UnknownOpponentError, match="did you mean baseline") as caught:
        league.record("baselin", 1.0)
    assert isinstance(caught.value, KeyError)
    assert league.ratings()["learner"]["games"] == 0, "a refused game changes nothing"
