"""Self-play learns: the tiny model, warmed up on the baseline's games, beats the random mover far more often after training.

The tiny model starts from random weights (a byte-level BPE tokenizer: a move such as C4 is the tokens ``C``
and ``4``). A short SFT on the Gomoku baseline playing itself teaches it the answer format and an opening, not
to read the board: greedy, it plays the same cells whatever the board shows (as X: C3, C4, then C4 again) and
loses every game to the random mover. The self-play trainer must then find moves that win, such as the third
stone of a line the random mover did not block. The measure is the GREEDY win rate against ``random`` on
held-out seeds, the learner taking each seat in turn: the warm model before, each run's trained model after,
over three seeds.

The board is 5x5 with three in a row to win, and one rejected move forfeits (``max_invalid_actions=1``): games
last a few moves, so contexts stay short on a CPU, and a repeated cell is the loss it is in the measure.
The league is the random mover alone (``self_play_share`` 0). This policy barely tells its seats apart, so
against itself it plays into its own cells: with half its games against itself (24 steps) its win rate against
random stayed at 0 while its illegal-move rate rose. Rollouts sample at temperature 0.5, which keeps most of
the warm policy's malformed answers out of the games, and a rank-4 adapter keeps each step's change small:
with full fine-tuning, or sampling at 0.7, greedy play flipped between winning and losing lines from step to step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("openskill")
pytest.importorskip("tinkergym_gomoku")

from tinkergym.backends.models import build_tiny_model
from tinkergym.config import TrainConfig
from tinkergym.trainers.evaluation import eval_seeds
from tinkergym.trainers.reporting import read_metrics
from tinkergym.trainers.session import TrainingRun

ENV = "tinker/GomokuDuel-v0"
BOARD = {"size": 5, "win_length": 3, "max_invalid_actions": 1}
MAX_TURNS = 4  # moves per seat: three make a line; a game still open after four each ends as a draw
MAX_NEW_TOKENS = 4  # a move is two tokens and the end-of-turn token
EVAL_GAMES = 64
SEEDS = (0, 1, 2)
COMMON = dict(env=ENV, env_kwargs=BOARD, dtype="float32", max_turns=MAX_TURNS, max_new_tokens=MAX_NEW_TOKENS, checkpoint_every=1000, transcripts_every=0)


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> str:
    """The tiny model after a short SFT on the baseline's games (full fine-tuning), exported as a plain HF folder."""
    root = tmp_path_factory.mktemp("warm")
    config = TrainConfig(
        trainer="sft", model=build_tiny_model(root / "tiny"), lora_rank=0, steps=20, batch_size=8, lr=3e-3, out=str(root / "sft"),
        trainer_args={"demos": "baseline", "demo_episodes": 32}, **COMMON,
    )
    run = TrainingRun(config)
    run.run(progress=False)
    losses = [r["loss"] for r in read_metrics(run.folder / "metrics.jsonl")]
    assert sum(losses[-3:]) / 3 < 0.25 * sum(losses[:3]) / 3, f"SFT must lower the loss: {losses}"
    return str(root / "sft" / "final")


def greedy_win_rate(backend) -> float:
    """The backend's greedy win rate against the random mover on the held-out seeds, taking each seat in turn."""
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.games import ModelPlayer
    from tinkergym.trainers.matches import LEARNER, match_settings, play_matches
    from tinkergym.trainers.matches import scripted_opponent
    from tinkergym.trainers.session import env_factory

    records, _ = play_matches(
        ModelPlayer(LEARNER, backend), {"random": scripted_opponent(ENV, "random")}, env_factory(ENV, BOARD, multi_agent=True),
        eval_seeds(0, EVAL_GAMES), ChatTemplateRenderer(backend.info()["tokenizer"]), match_settings(MAX_TURNS, MAX_NEW_TOKENS),
    )
    record = records["random"]
    assert record.games == EVAL_GAMES, f"{record.errors} of {EVAL_GAMES} evaluation games failed"
    return record.rates()["win"]


@pytest.mark.slow
def test_selfplay_raises_the_greedy_win_rate_against_random(warm_model, tmp_path) -> None:
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
    from tinkergym.trainers.collapse import SIGNALS
    from tinkergym.trainers.session import load_backend_for_eval

    # float32 as the runs train: "auto" is bfloat16 on a CPU with AVX512-BF16, and greedy ties then break otherwise
    before = greedy_win_rate(TorchBackend(TorchBackendConfig(model=warm_model, lora_rank=0, dtype="float32")))
    after, signals = {}, {}
    for seed in SEEDS:
        config = TrainConfig(
            trainer="selfplay", model=warm_model, lora_rank=4, lr=3e-3, steps=12, batch_size=8, group_size=4, temperature=0.5,
            opponents="random", trainer_args={"self_play_share": 0.0, "scale_by_std": False}, seed=seed, out=str(tmp_path / f"seed{seed}"),
            **COMMON,
        )
        TrainingRun(config).run(progress=False)
        metrics = read_metrics(tmp_path / f"seed{seed}" / "metrics.jsonl")
        signals[seed] = sorted({s for m in metrics for s in SIGNALS if m.get(f"collapse/{s}")})
        assert all(0 < m["time/rollout_s"] and 0 < m["time/update_s"] <= m["time/step_s"] for m in metrics if m["step"] >= 0)
        after[seed] = greedy_win_rate(load_backend_for_eval(run_dir=config.out))
    gain = sum(after[s] - before for s in SEEDS) / len(SEEDS)
    table = ", ".join(f"seed {s}: {before:.3f} -> {after[s]:.3f}" for s in SEEDS)
    assert gain >= 0.15, f"self-play raised the greedy win rate against random by {gain:+.3f} on average, not 0.15 or more ({table}; collapse signals {signals})"
