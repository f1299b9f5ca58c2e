"""Tests of tinker/Gomoku-v0 and tinker/GomokuDuel-v0: rules, parsing, opponents, baseline, conformance."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

import tinkergym
from tinkergym.episodes import run_aec_episode, run_episode
from tinkergym.errors import ConfigError, InvalidAction
from tinkergym.testing import HOSTILE_ACTIONS, check_text_aec_env, check_text_env
from tinkergym_gomoku import GomokuDuelEnv, GomokuEnv, HeuristicAgent
from tinkergym_gomoku.game import BLACK, WHITE, Game, geometry
from tinkergym_gomoku.heuristic import ScoredGame, scores_from_lines

# A full 5x5 board without five in a row (row 1 first); X has 13 stones, O 12.
DRAWN_5X5 = ("XXOOX", "OOXXO", "XXOOX", "OOXXO", "XXOOX")


def cells_of(game: Game, names: list[str]) -> list[int]:
    return [game.geo.parse_move(name) for name in names]


# ----- move notation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("H8", "H8"),
        ("h8", "H8"),
        ("8,8", "H8"),
        (" 8, 8 ", "H8"),
        ("3,8", "H3"),
        ("(12, 3)", "C12"),
        ("My move: H8", "H8"),
        ("I considered A1, but my move is j9.", "J9"),
        ("O15", "O15"),
        ("a1", "A1"),
        ("I play h8\n", "H8"),
    ],
)
def test_move_forms(text: str, expected: str) -> None:
    geo = geometry(15, 5)
    assert geo.labels[geo.parse_move(text)] == expected


@pytest.mark.parametrize("text", ["P1", "A0", "H16", "16,1", "1,16", "H100"])
def test_off_board_moves_are_rejected(text: str) -> None:
    with pytest.raises(InvalidAction, match="off the board"):
        geometry(15, 5).parse_move(text)


@pytest.mark.parametrize("text", ["", "pass", "H 8", "row 8 col 8", "-1,-1", "99999999999999999999999999,1", "８,８"])
def test_unreadable_moves_are_rejected(text: str) -> None:
    with pytest.raises(InvalidAction, match="no move found"):
        geometry(15, 5).parse_move(text)


def test_center_is_h8_and_row_1_is_drawn_at_the_bottom() -> None:
    game = Game(15, 5)
    game.play(game.geo.parse_move("H8"), BLACK)
    game.play(game.geo.parse_move("A1"), WHITE)
    lines = game.draw().splitlines()
    assert lines[0].split() == list("ABCDEFGHIJKLMNO") == lines[-1].split()
    assert lines[8].split() == ["8", *"......." "X" ".......", "8"]
    assert lines[15].split()[:2] == ["1", "O"] and lines[1].split()[0] == "15"


# ----- win detection ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        ["A1", "B1", "C1", "D1", "E1"],  # across, bottom edge, left corner
        ["K15", "L15", "M15", "N15", "O15"],  # across, top edge, right corner
        ["O1", "O2", "O3", "O4", "O5"],  # down, right edge
        ["A11", "A12", "A13", "A14", "A15"],  # down, left edge
        ["A1", "B2", "C3", "D4", "E5"],  # diagonal from a corner
        ["K11", "L12", "M13", "N14", "O15"],  # diagonal into the opposite corner
        ["A15", "B14", "C13", "D12", "E11"],  # anti-diagonal from a corner
        ["K5", "L4", "M3", "N2", "O1"],  # anti-diagonal into a corner
        ["F6", "G7", "H8", "I9", "J10"],  # diagonal through the center
    ],
)
@pytest.mark.parametrize("scored", [False, True])
def test_five_in_a_row_wins_in_every_direction(line: list[str], scored: bool) -> None:
    for order in (line, line[::-1], line[2:] + line[:2]):  # the winning stone at an end or in the middle
        game = ScoredGame(15, 5, WHITE) if scored else Game(15, 5)
        cells = cells_of(game, order)
        results = [game.play(cell, BLACK) for cell in cells]
        assert results == [False] * 4 + [True]
        assert game.winner == BLACK


def test_four_a_gap_or_a_broken_line_does_not_win() -> None:
    game = Game(15, 5)
    for name in ["A1", "B1", "C1", "D1", "F1", "O15", "O14", "O13", "O12"]:
        assert not game.play(game.geo.parse_move(name), BLACK)
    assert not game.play(game.geo.parse_move("O11"), WHITE)  # the other color completes no line
    assert game.play(game.geo.parse_move("E1"), BLACK)  # six in a row (overline) wins too


def test_incremental_scores_and_wins_match_a_recount() -> None:
    rng = random.Random(7)
    for size, win_length in [(5, 5), (7, 4), (9, 3), (15, 5), (19, 6)]:
        plain, scored = Game(size, win_length), ScoredGame(size, win_length, WHITE, rng.randbytes(size * size))
        cells = list(range(size * size))
        rng.shuffle(cells)
        for i, cell in enumerate(cells[: size * size * 2 // 3]):
            color = BLACK if i % 2 == 0 else WHITE
            assert plain.play(cell, color) == scored.play(cell, color)
        fresh = scores_from_lines(scored, WHITE)
        assert [t >> 14 for t in scored.totals] == [t >> 14 for t in fresh]
        assert scored.board[scored.best()] == 0


# ----- the single-agent env -----------------------------------------------------------------------
def test_win_gives_plus_one_and_ends_the_episode() -> None:
    env = GomokuEnv(opponent="random")
    env.reset(seed=0, options={"moves": ["A1", "O15", "A2", "O14", "A3", "O13", "A4", "N15"]})
    obs, reward, terminated, truncated, info = env.step("A5")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["winner"] == "X" and info["is_success"] is True and "You win" in obs and json.dumps(info)
    assert env.step("B1")[2]  # after the end: still terminated, no exception


def test_loss_gives_minus_one_when_the_opponent_completes_a_line() -> None:
    env = GomokuEnv()
    env.reset(seed=0, options={"moves": ["A1", "H8", "A3", "H9", "A5", "H10", "O15", "H11"]})
    obs, reward, terminated, _, info = env.step("B14")  # ignores the four: the opponent takes the win
    assert (reward, terminated, info["winner"], info["is_success"]) == (-1.0, True, "O", False)
    assert info["opponent_move"] in ("H7", "H12") and "You lose" in obs


def test_full_board_is_a_draw() -> None:
    xs = [f"{'ABCDE'[c]}{r + 1}" for r, row in enumerate(DRAWN_5X5) for c, v in enumerate(row) if v == "X"]
    os_ = [f"{'ABCDE'[c]}{r + 1}" for r, row in enumerate(DRAWN_5X5) for c, v in enumerate(row) if v == "O"]
    opening = [m for pair in zip(xs, os_) for m in pair]  # 12 X and 12 O, alternating from X
    assert len(opening) == 24
    env = GomokuEnv(size=5, opponent="random")
    env.reset(seed=0, options={"moves": opening})
    obs, reward, terminated, _, info = env.step(xs[-1])
    assert (reward, terminated, info["winner"], info["is_success"]) == (0.0, True, "draw", False) and "draw" in obs


def test_invalid_moves_cost_the_penalty_and_the_third_forfeits() -> None:
    env = GomokuEnv(opponent="random", invalid_action_penalty=-0.25)
    env.reset(seed=3, options={"moves": ["H8", "A1"]})
    obs, reward, terminated, _, info = env.step("H8")
    assert (reward, terminated) == (-0.25, False) and "already taken" in obs and info["invalid_action"]
    assert "\n 8 " in obs and obs.rstrip().endswith("(5 in a row wins).")  # the feedback repeats the board
    obs, reward, terminated, _, _ = env.step("what a nice board")
    assert (reward, terminated) == (-0.25, False) and "no move found" in obs
    obs, reward, terminated, _, _ = env.step("Z99")
    assert (reward, terminated) == (-1.0, True) and "off the board" in obs


def test_max_invalid_actions_is_configurable() -> None:
    env = GomokuEnv(max_invalid_actions=1)
    env.reset(seed=0)
    assert env.step("nonsense")[1:3] == (-1.0, True)


@pytest.mark.parametrize(
    "opening, four, ends",
    [
        (["H8", "A1", "H9", "O15", "H10", "A15"], "H11", {"H7", "H12"}),  # open four: blocks an end
        (["H8", "H7", "H9", "O15", "H10", "A15"], "H11", {"H12"}),  # four closed at H7: blocks H12
        (["H8", "A1", "H9", "O15", "H11", "A15"], "H12", {"H10"}),  # split four: fills the gap
        (["H8", "A1", "H9", "O15"], "H10", {"H7", "H11"}),  # open three: blocks next to it
        (["D4", "A1", "E5", "O15"], "F6", {"C3", "G7"}),  # open diagonal three
    ],
)
def test_heuristic_opponent_blocks_fours_and_open_threes(opening: list[str], four: str, ends: set[str]) -> None:
    for seed in range(4):
        env = GomokuEnv()
        env.reset(seed=seed, options={"moves": opening})
        assert env.step(four)[4]["opponent_move"] in ends


def test_heuristic_opponent_wins_before_blocking() -> None:
    env = GomokuEnv()
    # O has four (A11-D11, open at E11); X has an open four too; O must take its win, not block.
    env.reset(seed=1, options={"moves": ["H3", "A11", "H4", "B11", "H5", "C11", "O1", "D11"]})
    _, reward, terminated, _, info = env.step("H6")
    assert (info["opponent_move"], reward, terminated) == ("E11", -1.0, True)


def test_agent_second_sees_the_opponents_first_move() -> None:
    env = GomokuEnv(agent_first=False)
    obs, info = env.reset(seed=5)
    assert info["you"] == "O" and "Opponent played" in obs and obs.count("X") >= 2
    assert obs.endswith("Move 2: your turn as O (5 in a row wins).")
    move = HeuristicAgent(seed=0)(obs, info)
    _, reward, _, _, info = env.step(move)
    assert reward == 0.0 and info["moves"] == 3


def test_callable_opponent_and_its_errors() -> None:
    seen = []

    def first_legal(state, rng):
        seen.append((state.player, state.size, len(state.moves)))
        return state.legal_moves()[0]

    env = GomokuEnv(size=7, opponent=first_legal)
    env.reset(seed=0)
    assert env.step("D4")[4]["opponent_move"] == "A1"
    assert env.step("D5")[4]["opponent_move"] == "B1"
    assert seen == [("O", 7, 1), ("O", 7, 3)]
    env = GomokuEnv(size=7, opponent=lambda state, rng: "D4")
    env.reset(seed=0)
    assert env.step("C3")[4]["opponent_move"] == "D4"
    with pytest.raises(ConfigError, match="not an empty cell"):
        env.step("C4")  # the callable names D4 again: a broken opponent is a configuration error


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": 4},
        {"size": 27},
        {"size": 15.0},
        {"win_length": 2},
        {"size": 7, "win_length": 8},
        {"opponent": "strong"},
        {"agent_first": "yes"},
        {"max_invalid_actions": 0},
        {"invalid_action_penalty": float("nan")},
    ],
)
def test_bad_kwargs_raise_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        GomokuEnv(**kwargs)


def test_bad_opening_options_raise_config_error() -> None:
    env = GomokuEnv()
    for moves in (["H8", "H8"], ["Z1"], "H8", ["A1", "O1", "A2", "O2", "A3", "O3", "A4", "O4", "A5"]):
        with pytest.raises(ConfigError):
            env.reset(seed=0, options={"moves": moves})


def test_seeded_episodes_are_identical() -> None:
    def play(seed: int) -> list:
        env = GomokuEnv()
        obs, info = env.reset(seed=seed)
        agent, out = HeuristicAgent(seed=11), [obs, info]
        for _ in range(200):
            obs, reward, terminated, truncated, info = env.step(agent(obs, info))
            out.append((obs, reward, terminated, info))
            if terminated:
                return out
        raise AssertionError("the game did not end")

    assert play(4) == play(4)
    assert len({json.dumps(play(seed)[2:4]) for seed in range(6)}) > 1  # the opponent varies with the seed


def test_baseline_beats_the_random_opponent() -> None:
    env = GomokuEnv(opponent="random")
    wins = sum(run_episode(env, HeuristicAgent(seed=s), seed=s).returns["agent"] == 1.0 for s in range(20))
    assert wins >= 18


def test_baseline_never_plays_an_illegal_move() -> None:
    for size, agent_first in [(7, True), (7, False), (15, True), (15, False), (26, False)]:
        for opponent in ("heuristic", "random"):
            env = GomokuEnv(size=size, opponent=opponent, agent_first=agent_first)
            for seed in range(3):
                transcript = run_episode(env, HeuristicAgent(seed=seed), seed=seed)
                assert transcript.turns[-1].terminated
                assert not any(turn.info.get("invalid_action") for turn in transcript.turns)


def test_baseline_recovers_after_a_rejected_move() -> None:
    env, agent = GomokuEnv(), HeuristicAgent(seed=0)
    obs, info = env.reset(seed=0)
    obs, *_ = env.step(agent(obs, info))
    obs, reward, *_ = env.step("not a move")  # a rejected move the agent did not make
    assert reward < 0
    for _ in range(100):
        obs, reward, terminated, _, info = env.step(agent(obs, info))
        assert not info.get("invalid_action")
        if terminated:
            break


def test_seven_by_seven_board() -> None:
    env = GomokuEnv(size=7)
    obs, _ = env.reset(seed=0)
    assert obs.splitlines()[2].split() == list("ABCDEFG") and "Move 1" in obs
    transcript = run_episode(env, HeuristicAgent(seed=0), seed=0)
    assert transcript.turns[-1].terminated and transcript.turns[-1].info["winner"] in ("X", "O", "draw")


def test_hostile_actions_never_raise() -> None:
    env = GomokuEnv(size=7)
    env.reset(seed=0)
    rng = random.Random(0)
    randoms = ["".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(40))) for _ in range(300)]
    junk = [*HOSTILE_ACTIONS, *randoms, "H8 " * 2000, "A1" * 9000]
    for action in junk:
        obs, reward, terminated, truncated, info = env.step(action)
        assert isinstance(obs, str) and json.dumps(info) and reward in (-0.1, -1.0, 0.0, 1.0)
        if terminated:
            env.reset()


# ----- the duel -----------------------------------------------------------------------------------
def test_duel_full_game_between_two_baselines() -> None:
    env = GomokuDuelEnv()
    agents = {"player_0": HeuristicAgent(seed=1), "player_1": HeuristicAgent(seed=2)}
    transcript = run_aec_episode(env, agents, seed=0)
    returns = transcript.returns
    assert sorted(returns.values()) in ([-1.0, 1.0], [0.0, 0.0])
    assert all(env.terminations.values())
    assert not any(turn.info.get("error") for turn in transcript.turns)
    winner = env._game.winner
    assert returns["player_0"] == (1.0 if winner == BLACK else -1.0 if winner == WHITE else 0.0)


def test_duel_views_and_illegal_moves() -> None:
    env = GomokuDuelEnv(size=7, max_invalid_actions=2)
    env.reset(seed=0)
    assert env.agent_selection == "player_0" and "You are X" in env.observe("player_0")
    assert env.observe("player_1").startswith("Waiting for the opponent.")
    env.step("D4")
    view = env.observe("player_1")
    assert "Opponent played D4." in view and view.endswith("Move 2: your turn as O (5 in a row wins).")
    assert "waiting for the opponent" in env.observe("player_0")
    env.step("D4")  # occupied: player_1 keeps the turn and pays the penalty
    assert env.agent_selection == "player_1" and env.rewards["player_1"] == -0.1
    assert env.observe("player_1").startswith("Invalid action: D4 is already taken")
    env.step("nowhere")  # second in a row: forfeit
    assert env.rewards == {"player_0": 1.0, "player_1": -1.0} and all(env.terminations.values())


def test_duel_win_rewards() -> None:
    env = GomokuDuelEnv(size=7, win_length=4)
    env.reset(seed=0)
    for move in ["A1", "G7", "B1", "G6", "C1", "G5", "D1"]:
        env.step(move)
    assert env.rewards == {"player_0": 1.0, "player_1": -1.0}
    assert "You win." in env.observe("player_0") and "You lose." in env.observe("player_1")


# ----- packaging and conformance ------------------------------------------------------------------
def test_made_through_the_hub() -> None:
    env = tinkergym.make("tinker/Gomoku-v0", size=9, opponent="random")
    obs, info = env.reset(seed=0)
    assert "9x9 board" in obs and "ROW,COL" in info["system_prompt"]
    duel = tinkergym.make_aec("tinker/GomokuDuel-v0", size=7)
    duel.reset(seed=0)
    assert duel.agent_selection == "player_0"


def test_import_is_light() -> None:
    code = "import sys, tinkergym_gomoku; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_conformance_single() -> None:
    check_text_env(GomokuEnv(size=7), baseline=HeuristicAgent)
    check_text_env(GomokuEnv(opponent="random", agent_first=False), baseline=HeuristicAgent)


def test_conformance_duel() -> None:
    check_text_aec_env(GomokuDuelEnv(size=7), baseline=HeuristicAgent)


def test_random_move_agent_only_plays_empty_cells_and_the_hub_finds_it() -> None:
    import tinkergym
    from tinkergym.registry import load_random_agent
    from tinkergym_gomoku.agents import RandomMoveAgent

    assert load_random_agent(tinkergym.spec("tinker/GomokuDuel-v0")) is RandomMoveAgent
    env = GomokuDuelEnv(size=5, win_length=4)
    for seed in range(5):
        env.reset(seed=seed)
        agents = {"player_0": RandomMoveAgent(seed=seed), "player_1": RandomMoveAgent(seed=seed + 100)}
        while not all(env.terminations.values()):
            agent = env.agent_selection
            env.step(agents[agent](env.observe(agent), {}))
            assert not env.infos[agent].get("error"), "a random move is always a legal one"
    first = [RandomMoveAgent(seed=3)(env.observe("player_0"), {}) for _ in range(2)]
    assert first[0] == first[1], "seeded"
