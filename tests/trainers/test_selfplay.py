"""Self-play training: phase synchronization, per-seat advantages, ratings and exact resume, collapse detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openskill")
pytest.importorskip("tinkergym_gomoku")

from tinkergym_gomoku.agents import HeuristicAgent

from tinkergym.backends.torch.backend import TorchBackend
from tinkergym.protocol.types import SampledSequence, SampleRequest, SampleResponse
from tinkergym.chat import ChatTemplateRenderer
from tinkergym.errors import ConfigError
from tinkergym.trainers.advantages import keyed_advantages
from tinkergym.trainers.base import TrainingContext
from tinkergym.config import TrainConfig
from tinkergym.trainers.selfplay import SelfPlayTrainer, parse_opponents
from tinkergym.trainers.session import TrainingRun, env_factory

ENV = "tinker/GomokuDuel-v0"


def config(out: Path, **changes) -> TrainConfig:
    settings = dict(
        env=ENV, env_kwargs={"size": 5, "win_length": 3}, trainer="selfplay", model="tiny", steps=3, batch_size=2, group_size=4,
        max_turns=10, max_new_tokens=6, snapshot_every=1, checkpoint_every=1, transcripts_every=0, out=str(out), seed=3,
    )
    settings.update(changes)
    return TrainConfig(**settings)


def metrics_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_seat_advantages_are_relative_to_the_seat() -> None:
    rewards = [1.0, 1.0, -1.0, 0.0, -1.0, 1.0]
    seats = ["player_0", "player_0", "player_0", "player_1", "player_1", "player_1"]
    adv = keyed_advantages(rewards, seats, scale_by_std=False)
    assert adv[:3] == pytest.approx([1 - 1 / 3, 1 - 1 / 3, -1 - 1 / 3]) and adv[3:] == pytest.approx([0.0, -1.0, 1.0])
    # the first mover's edge is no skill: every first-mover win against every second-mover loss is no signal
    assert keyed_advantages([1.0, 1.0, -1.0, -1.0], ["player_0", "player_0", "player_1", "player_1"]) == [0.0] * 4
    assert keyed_advantages([5.0, 1.0, 3.0], ["a", "a", "a"], valid_B=[True, False, True])[1] == 0.0


def test_opponents_are_checked_before_a_run(tmp_path) -> None:
    assert parse_opponents("baseline, random,run:/x") == ["baseline", "random", "run:/x"]
    for bad in ("baseline,champion", "random,random", "run:"):
        with pytest.raises(ConfigError):
            parse_opponents(bad)
    with pytest.raises(ConfigError, match="champion"):
        config(tmp_path / "r", opponents="champion").validate()
    with pytest.raises(ConfigError, match="self-play"):
        env_factory("tinker/Gomoku-v0", {}, multi_agent=True)
    with pytest.raises(ConfigError, match="--selfplay"):
        env_factory(ENV, {}, multi_agent=False)


@pytest.mark.slow
def test_no_policy_samples_during_an_update_and_ratings_resume_exactly(tmp_path, monkeypatch) -> None:
    events: list[tuple[str, int]] = []
    real_sample, real_fb, real_optim = TorchBackend.sample, TorchBackend.forward_backward, TorchBackend.optim_step

    def sample(self, request):
        events.append(("sample", id(self)))
        return real_sample(self, request)

    def forward_backward(self, request):
        events.append(("update_start", id(self)))
        return real_fb(self, request)

    def optim_step(self, params):
        out = real_optim(self, params)
        events.append(("update_end", id(self)))
        return out

    monkeypatch.setattr(TorchBackend, "sample", sample)
    monkeypatch.setattr(TorchBackend, "forward_backward", forward_backward)
    monkeypatch.setattr(TorchBackend, "optim_step", optim_step)
    straight = tmp_path / "straight"
    # the untrained tiny model forfeits every game alike (no advantage): a KL term keeps every step's update
    TrainingRun(config(straight, kl_coef=0.05)).run(progress=False)
    kinds = [k for k, _ in events]
    assert "update_start" in kinds and len({who for k, who in events if k == "sample"}) >= 2, "the learner and its snapshots sampled"
    inside = False
    for kind, _ in events:  # the learner's and every snapshot's samples all fall outside [update_start, update_end]
        assert not (inside and kind == "sample"), "a policy sampled in the middle of an update"
        inside = kind == "update_start" or (inside and kind != "update_end")

    first = tmp_path / "resumed"
    TrainingRun(config(first, steps=2, kl_coef=0.05)).run(progress=False)
    TrainingRun.resume(first, changes={"steps": 3}).run(progress=False)
    a, b = metrics_of(straight), metrics_of(first)
    assert len(a) == len(b) == 3
    for key in a[-1]:
        if key.startswith(("rating/", "league/", "selfplay/", "collapse/", "reward/", "loss")):
            assert a[-1][key] == b[-1][key], f"{key} differs after a resume"
    assert any(k.startswith("rating/snapshot:") for k in a[-1]) and a[-1]["league/members"] >= 3
    state = json.loads((first / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert "league" in json.dumps(state) and "snapshot:2" in json.dumps(state)


class ScriptedPolicy:
    """The learner's backend with a scripted ``sample``: the heuristic move for each board, or junk from ``junk_from``."""

    def __init__(self, backend: TorchBackend, renderer: ChatTemplateRenderer, junk_from: int | None) -> None:
        self.backend, self.renderer, self.junk_from = backend, renderer, junk_from
        self.step, self.answers = 0, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def sample(self, request: SampleRequest) -> SampleResponse:
        tok = self.renderer.tokenizer
        out = []
        for prompt in request.prompts:
            self.answers += 1
            text = tok.decode(prompt, skip_special_tokens=False).rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            degenerate = self.junk_from is not None and self.step >= self.junk_from
            move = "" if degenerate else HeuristicAgent(seed=self.answers)(text, {})
            ids = tok.encode(move, add_special_tokens=False)[: request.params.max_new_tokens - 1] + [tok.eos_token_id]
            out.append([SampledSequence(tokens=ids, logprobs=[-1.0] * len(ids), finish_reason="stop")])
        return SampleResponse(sequences=out)


def run_scripted(tmp_path: Path, tiny: str, junk_from: int | None, steps: int = 10) -> tuple[SelfPlayTrainer, list[list[str]]]:
    from tinkergym.backends.torch.backend import TorchBackendConfig

    c = config(tmp_path, model=tiny, opponents="baseline,random", env_kwargs={"size": 5, "win_length": 3}, batch_size=2, group_size=4,
               max_turns=13, steps=steps).validate()
    backend = TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4))
    renderer = ChatTemplateRenderer(backend.info()["tokenizer"])
    policy = ScriptedPolicy(backend, renderer, junk_from)
    trainer = SelfPlayTrainer(TrainingContext(c, policy, renderer, env_factory(ENV, c.env_kwargs, multi_agent=True)))
    fired = []
    for step in range(steps):
        policy.step = step
        trainer.train_step(step)
        fired.append(list(trainer.fired))
    return trainer, fired


@pytest.mark.slow
def test_collapse_detection_fires_on_a_degenerate_policy_and_stays_quiet_on_a_healthy_one(tmp_path, tiny) -> None:
    healthy, quiet = run_scripted(tmp_path / "healthy", tiny, junk_from=None)
    assert not any(quiet), f"a steady policy raised {quiet}"
    assert healthy.league.fixed_share == pytest.approx(0.2)
    degenerate, fired = run_scripted(tmp_path / "degenerate", tiny, junk_from=7)
    assert not any(fired[:7]), f"fired before the policy broke: {fired[:7]}"
    assert all(fired[7:]), "every step of the collapse is flagged"
    assert {"illegal_jump", "length_collapse"} <= set(fired[7])
    assert degenerate.league.fixed_share == pytest.approx(0.5), "a collapse raises the fixed opponents' share"


@pytest.mark.slow
def test_selfplay_from_the_command_line_then_eval_against_opponents(tmp_path, tiny) -> None:
    from click.testing import CliRunner

    from tinkergym.cli import main

    out = tmp_path / "duel"
    args = ["train", "--env", ENV, "--kwarg", "size=5", "--kwarg", "win_length=3", "--selfplay", "--model", tiny, "--steps", "2",
            "--batch-size", "1", "--group-size", "4", "--max-turns", "8", "--max-new-tokens", "6", "--snapshot-every", "1",
            "--eval-every", "2", "--eval-episodes", "2", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    last = metrics_of(out)[-1]
    assert {"eval/win_vs_baseline", "eval/loss_vs_random", "rating/learner", "collapse/any"} <= set(last)
    assert (out / "snapshots" / "step_000001" / "state.json").is_file()
    evaluated = CliRunner().invoke(main, ["eval", "--env", ENV, "--kwarg", "size=5", "--kwarg", "win_length=3", "--run", str(out),
                                          "--opponent", "baseline", "--opponent", "snapshot:1", "--episodes", "2", "--max-turns", "8", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    summary = json.loads(evaluated.stdout.strip().splitlines()[-1])["opponents"]
    assert set(summary) == {"baseline", "snapshot:1"} and summary["baseline"]["games"] + summary["baseline"]["errors"] == 2
    assert "ordinal" in evaluated.stderr
    missing = CliRunner().invoke(main, ["eval", "--env", ENV, "--run", str(out), "--opponent", "snapshot:7"])
    assert missing.exit_code != 0 and "snapshot:1" in missing.output
    single = CliRunner().invoke(main, ["train", "--env", "tinker/Gomoku-v0", "--selfplay", "--model", tiny, "--out", str(tmp_path / "x")])
    assert single.exit_code != 0 and "multi-agent" in single.output


@pytest.mark.slow
def test_a_policy_per_seat_trains_saves_and_resumes_each_seat(tmp_path) -> None:
    separate = dict(opponents="baseline,random", trainer_args={"seat_policies": "separate"}, kl_coef=0.05, steps=2)
    with pytest.raises(ConfigError, match="snapshots"):
        TrainingRun(config(tmp_path / "bad", trainer_args={"seat_policies": "separate"}))
    straight = tmp_path / "straight"
    TrainingRun(config(straight, **separate)).run(progress=False)
    last = metrics_of(straight)[-1]
    assert "loss" in last and "player_1/loss" in last and "player_1/reward/mean" in last
    assert (straight / "final" / "seats" / "player_1").is_dir()
    assert (straight / "checkpoints" / "step_000001" / "seats" / "player_1" / "state.json").is_file()
    resumed = tmp_path / "resumed"
    TrainingRun(config(resumed, **{**separate, "steps": 1})).run(progress=False)
    TrainingRun.resume(resumed, changes={"steps": 2}).run(progress=False)
    again = metrics_of(resumed)[-1]
    for key in ("loss", "player_1/loss", "player_1/reward/mean", "reward/mean", "rating/learner"):
        assert again[key] == last[key], f"{key} differs after a resume"


@pytest.mark.slow
def test_a_policy_per_seat_on_one_shared_base_trains_as_a_backend_each(tmp_path) -> None:
    """``--backend shared``: every seat's policy is an adapter of one base in this process (one copy of the model; both
    seats of a game in one decode loop, their updates in one mixed pass), and the run is the one whole backends train,
    metric for metric (float32; the adapters start from the same draws and every sample from its own seed's streams)."""
    separate = dict(opponents="baseline,random", trainer_args={"seat_policies": "separate"}, steps=2, dtype="float32", lora_rank=4, kl_coef=0.05)
    whole = TrainingRun(config(tmp_path / "whole", **separate))
    whole.run(progress=False)
    shared = TrainingRun(config(tmp_path / "shared", backend="shared", **separate))
    seat = shared.trainer.seat_backends["player_1"]
    assert seat.joint is shared.backend.joint and seat is not shared.backend, "two adapters of one base"
    shared.run(progress=False)
    for step, (a, b) in enumerate(zip(metrics_of(tmp_path / "whole"), metrics_of(tmp_path / "shared"), strict=True)):
        for key in ("loss", "grad_norm", "player_1/loss", "player_1/grad_norm", "reward/mean", "player_1/reward/mean", "selfplay/games"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (step, key)
    assert (tmp_path / "shared" / "final" / "seats" / "player_1" / "adapter_config.json").is_file()
    with pytest.raises(ConfigError, match="lora-rank above 0"):
        TrainingRun(config(tmp_path / "full", backend="shared", **{**separate, "lora_rank": 0}))


def test_selfplay_evaluation_plays_on_the_eval_env(tmp_path) -> None:
    # eval_env_kwargs apply over env_kwargs in self-play's games against the fixed members, as in single-agent evaluation.
    out = tmp_path / "eval-env"
    TrainingRun(config(out, steps=1, eval_every=1, eval_episodes=2, opponents="baseline", eval_env_kwargs={"size": 6})).run(progress=False)
    transcripts = sorted((out / "transcripts").glob("eval_step_*.jsonl"))
    text = "".join(path.read_text() for path in transcripts)
    assert transcripts and "6x6 board" in text and "5x5 board" not in text
    assert "eval/win_vs_baseline" in metrics_of(out)[-1]
