"""Tests of tinkergym-textarena: the generated catalog, every id through the checkers, invalid moves, NLTK games, training."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tinkergym
from tinkergym.registry.discovery import tomllib
from tinkergym.errors import ConfigError
from tinkergym.testing import HOSTILE_ACTIONS, check_text_aec_env, check_text_env
from tinkergym_textarena import BracketMoveAgent, catalog
from tinkergym_textarena.match import GameUnavailableError, nltk_data_installed, parse_ta_id

SPECS = [s for s in tinkergym.list_envs() if s.distribution == "tinkergym-textarena"]
PLAYABLE = [s for s in SPECS if all(nltk_data_installed(r) for r in s.extra.get("needs_nltk", []))]
NEEDS_DATA = [s for s in SPECS if s not in PLAYABLE]


# ----- the catalog: generated from TextArena's registry and checked against the installed one ---------------
def test_every_textarena_game_is_offered_or_skipped_with_a_reason_and_the_files_are_current() -> None:
    from textarena.envs.registration import ENV_REGISTRY

    assert catalog.differences() == [], "run: python -m tinkergym_textarena.catalog --write, then reinstall the package"
    games = {f"{p[0]}-v{p[1]}" for p in map(parse_ta_id, ENV_REGISTRY) if p is not None}
    offered = {f"{s.extra['textarena_game']}-v{s.id.rsplit('-v', 1)[1]}" for s in SPECS}
    skipped = set(tomllib.loads(catalog.SKIPPED.read_text(encoding="utf-8")))
    assert offered | skipped == games and not offered & skipped
    installed = {ep.name for ep in md.distribution("tinkergym-textarena").entry_points.select(group="tinkergym.envs")}
    assert installed == {s.id for s in SPECS}, "the installed entry points are stale: reinstall the package (pip install -e)"
    kinds = {s.kind for s in SPECS}
    assert kinds == {"env", "aec"} and all((s.kind == "env") == (s.agents == 1) for s in SPECS)
    assert tinkergym.spec("tinker/ta.TicTacToe-v0").kind == "aec" and tinkergym.spec("tinker/ta.Sudoku-v0").kind == "env"


@pytest.mark.slow
def test_listing_takes_under_a_second_and_imports_no_env_library() -> None:
    code = (
        "import sys, tinkergym; n = sum(s.id.startswith('tinker/ta.') for s in tinkergym.list_envs()); "
        "print(n, sorted(m for m in ('textarena', 'nltk', 'reasoning_gym', 'tinkergym_textarena', 'torch') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1) == [
        str(len(SPECS)), "[]\n"]
    # The command's CPU time, the best of three: its wall time on an idle machine, less sensitive to other work on a busy one.
    cli, best = [sys.executable, "-m", "tinkergym", "envs", "list"], math.inf
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        listing = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    assert all(spec.id in listing for spec in SPECS)
    assert best < 1.0, f"tinkergym envs list took {best:.2f} s of CPU time"


# ----- every id: Gymnasium's check_env or PettingZoo's api_test, our checker, the random-text fuzz -----------
@pytest.mark.slow
@pytest.mark.parametrize("env_spec", PLAYABLE, ids=lambda s: s.id)
def test_every_playable_game_passes_the_checkers(env_spec) -> None:
    if env_spec.kind == "aec":
        check_text_aec_env(tinkergym.make_aec(env_spec.id), baseline=BracketMoveAgent, fuzz_count=30, api_cycles=100)
    else:
        check_text_env(tinkergym.make(env_spec.id), baseline=BracketMoveAgent, fuzz_count=30)


@pytest.mark.parametrize("env_spec", NEEDS_DATA, ids=lambda s: s.id)
def test_a_game_whose_nltk_data_is_missing_is_refused_at_once(env_spec) -> None:
    start = time.monotonic()
    with pytest.raises(GameUnavailableError, match=r"needs the NLTK data .* python -m nltk\.downloader "):
        tinkergym.make_aec(env_spec.id) if env_spec.kind == "aec" else tinkergym.make(env_spec.id)
    assert time.monotonic() - start < 2.0


def test_a_game_with_its_nltk_data_installed_plays_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nltk

    folder = tmp_path / "nltk_data" / "corpora" / "words"
    folder.mkdir(parents=True)
    for name in ("en", "en-basic"):
        (folder / name).write_text("apple\nbanana\ncherry\nplanet\nrocket\n", encoding="utf-8")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data"), *nltk.data.path])
    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("nltk.download was called"))
    env = tinkergym.make("tinker/ta.Hangman-v0")
    obs, _ = env.reset(seed=0)
    assert "Hangman" in obs
    obs, reward, terminated, _, info = env.step("[a]")
    assert not info.get("invalid_action") and math.isfinite(reward)


# ----- moves, penalties, seeds --------------------------------------------------------------------------------
def test_tic_tac_toe_moves_invalid_moves_and_a_win() -> None:
    env = tinkergym.make_aec("tinker/ta.TicTacToe-v0")
    env.reset(seed=0)
    first = env.agent_selection
    other = "player_1" if first == "player_0" else "player_0"
    assert "Tic Tac Toe" in env.observe(first) and env.observe(other).startswith("[GAME]")
    env.step("4")  # no brackets: TextArena's default formatting adds them
    assert env.agent_selection == other and "placed their symbol" in env.observe(other)
    env.step("[4]")  # taken: a penalty, the turn is kept, TextArena's reason is the feedback
    assert env.agent_selection == other and env.rewards[other] == -0.1
    assert env.observe(other).startswith("Invalid action: cell 4 is already occupied.")
    for move in ("[0]", "[1]", "[8]"):  # other 0, first 1, other 8
        env.step(move)
    env.step("[7]")  # first: 4, 1, 7, the middle column
    assert all(env.terminations.values()) and env.rewards == {first: 1.0, other: -1.0}
    assert "You win." in env.observe(first) and "You lose." in env.observe(other)


def test_three_invalid_moves_in_a_row_forfeit() -> None:
    env = tinkergym.make_aec("tinker/ta.TicTacToe-v0", max_invalid_actions=2, invalid_action_penalty=-0.5)
    env.reset(seed=1)
    mover = env.agent_selection
    env.step("no idea")
    assert env.rewards[mover] == -0.5 and not any(env.terminations.values())
    env.step("still no idea")
    assert all(env.terminations.values()) and env.rewards[mover] == -1.0 and "forfeited" in env.observe(mover)


def test_single_player_invalid_moves_cost_the_penalty_and_the_game_goes_on() -> None:
    env = tinkergym.make("tinker/ta.GuessTheNumber-v0")
    obs, info = env.reset(seed=0)
    assert info["textarena_id"] == "GuessTheNumber-v0" and "guess" in obs.lower()
    obs, reward, terminated, _, info = env.step("[banana]")
    assert (reward, terminated, info["invalid_action"]) == (-0.1, False, True) and obs.startswith("Invalid action:")
    obs, reward, terminated, _, info = env.step("[10]")
    assert not info.get("invalid_action") and reward == 0.0 and ("higher" in obs or "lower" in obs or terminated)


def test_random_text_never_raises() -> None:
    env = tinkergym.make_aec("tinker/ta.ConnectFour-v0")
    env.reset(seed=0)
    for action in [*HOSTILE_ACTIONS, "[" * 5000, "[99999999999999999999]", "[-1]"] * 3:
        if not env.agents or all(env.terminations.values()):
            env.reset()
        agent = env.agent_selection
        env.step(action)
        assert env.observation_space(agent).contains(env.observe(agent))
        json.dumps(env.infos[agent])


def test_seeded_games_repeat_and_variants_and_kwargs_reach_textarena() -> None:
    env = tinkergym.make("tinker/ta.Minesweeper-v0")
    assert env.reset(seed=3) == env.reset(seed=3)
    small = tinkergym.make("tinker/ta.Minesweeper-v0", variant="small").unwrapped.match
    assert small.ta_id == "Minesweeper-v0-small" and small.env.rows < env.unwrapped.match.env.rows
    assert tinkergym.make("tinker/ta.Minesweeper-v0", rows=5, cols=5, num_mines=2).unwrapped.match.env.rows == 5
    with pytest.raises(ConfigError, match="variant='giant'"):
        tinkergym.make("tinker/ta.Minesweeper-v0", variant="giant")
    with pytest.raises(ConfigError, match="colour"):
        tinkergym.make("tinker/ta.Minesweeper-v0", colour=3)


# ----- self-play training ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_model_self_plays_a_few_steps_of_tic_tac_toe(tmp_path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("openskill")
    from tinkergym.config import TrainConfig
    from tinkergym.trainers.session import TrainingRun

    config = TrainConfig(env="tinker/ta.TicTacToe-v0", trainer="selfplay", model="tiny", steps=2, batch_size=1, group_size=2,
                         max_turns=2, max_new_tokens=4, lr=1e-3, kl_coef=0.01, dtype="float32", transcripts_every=0,
                         snapshot_every=1, out=str(tmp_path / "run"))
    TrainingRun(config).run(progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["episodes/failed"] == 0 and r["batch/trained_sequences"] > 0 for r in records), records
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
