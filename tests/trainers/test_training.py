"""Training end to end on the tiny model: CLI runs, exact resume, NaN stop, eval, a third-party trainer."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from tinkergym.cli import main
from tinkergym.errors import InvalidAction
from tinkergym.trainers.reporting import read_metrics

VOLATILE = ("time/", "tokens/per_s")


def _train_args(tiny: str, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--steps", "4",
        "--batch-size", "2", "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3",
        "--checkpoint-every", "1", "--quiet", "--out", str(out), *extra,
    ]


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_train_writes_the_run_folder(tiny, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B configured, as on a machine that uses it: without --wandb nothing of it is written
    out = tmp_path / "run"
    result = CliRunner().invoke(main, _train_args(tiny, out, "--eval-every", "2", "--eval-episodes", "4"), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [-1, 0, 1, 2, 3]
    assert set(records[0]) == {"step", *(k for k in records[0] if k.startswith("eval/"))}, "step -1: the model before training"
    assert "eval/reward_mean" in records[2] and "eval/reward_mean" not in records[1]
    for record in records[1:]:  # where a step's time went: the rollout, then the update, inside the step
        assert 0 < record["time/rollout_s"] and 0 < record["time/update_s"]
        assert record["time/rollout_s"] + record["time/update_s"] <= record["time/step_s"]
    assert json.loads((out / "config.json").read_text())["env"] == "tinker/Bandit-v0"
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    assert (out / "final" / "adapter_config.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    transcripts = [json.loads(line) for line in (out / "transcripts" / "train_step_000000.jsonl").read_text().splitlines()]
    assert transcripts[0]["messages"][0]["role"] == "system" and transcripts[0]["messages"][-1]["role"] == "assistant"
    assert not (out / "wandb").exists() and not (out / "wandb_id").exists()


@pytest.mark.slow
def test_resume_after_a_kill_is_exact(tiny, tmp_path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert CliRunner().invoke(main, _train_args(tiny, whole), catch_exceptions=False).exit_code == 0
    command = [sys.executable, "-m", "tinkergym", *_train_args(tiny, cut, "--steps", "4")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300

    def saved() -> list[Path]:  # the run keeps its newest checkpoints only: step 1's may be gone by the time it is looked for
        return sorted((cut / "checkpoints").glob("step_*")) if (cut / "checkpoints").is_dir() else []

    while not saved() and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert saved(), "the run was killed before its first checkpoint"
    result = CliRunner().invoke(main, ["train", "--resume", str(cut), "--quiet"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert _stable(read_metrics(cut / "metrics.jsonl")) == _stable(read_metrics(whole / "metrics.jsonl"))


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_checkpoint(tiny, tmp_path) -> None:
    out = tmp_path / "nan"
    result = CliRunner().invoke(main, _train_args(tiny, out, "--lr", "1e30", "--steps", "6", "--max-grad-norm", "0"))
    assert result.exit_code == 1
    assert "the run stopped and the last good checkpoint is" in result.output and "Lower --lr" in result.output
    assert any((out / "checkpoints").iterdir())


def test_eval_of_a_model_and_of_a_run(tiny, tmp_path) -> None:
    from tinkergym_bandit.env import BanditEnv

    out = tmp_path / "run"
    assert CliRunner().invoke(main, _train_args(tiny, out, "--steps", "1"), catch_exceptions=False).exit_code == 0
    for source in (["--model", tiny], ["--run", str(out)]):
        transcripts = tmp_path / "t.jsonl"
        result = CliRunner().invoke(main, ["eval", "--env", "tinker/Bandit-v0", *source, "--episodes", "3", "--max-new-tokens", "4", "--out", str(transcripts), "--json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        records = [json.loads(line) for line in transcripts.read_text().splitlines()]
        assert summary["episodes"] == 3.0 and len(records) == 3
        # Graded again here from the answers alone: an answer that names no single arm gets Bandit's penalty and fails;
        # one that does is paid 0 or 1 and succeeds when paid.
        env = BanditEnv()
        env.reset(seed=0)
        for record in records:
            answer = record["messages"][-1]["content"]
            try:
                env._parse(answer)
            except InvalidAction:
                assert record["total_reward"] == BanditEnv.invalid_action_penalty, record
            else:
                assert record["total_reward"] in (0.0, 1.0), record
        assert summary["reward_mean"] == pytest.approx(sum(r["total_reward"] for r in records) / 3)
        assert summary["success_rate"] == pytest.approx(sum(r["total_reward"] > 0 for r in records) / 3)


def test_train_and_eval_end_with_a_summary_and_say_which_checkpoint_they_load(tiny, tmp_path) -> None:
    out = tmp_path / "run"
    trained = CliRunner().invoke(main, _train_args(tiny, out, "--steps", "1", "--eval-every", "1", "--eval-episodes", "2"), catch_exceptions=False)
    assert trained.exit_code == 0, trained.output
    assert re.match(r"1 of 1 steps, reward -?[\d.]+(, loss \S+)?, eval reward -?[\d.]+, eval success [\d.]+%\n", trained.stdout), trained.stdout
    assert f"run folder: {out} (the model: {out / 'final'}; " in trained.stdout and "{" not in trained.stdout
    resumed = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", "2", "--quiet"], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming from checkpoint step_000000 in {out / 'checkpoints' / 'step_000000'}" in resumed.stderr
    assert resumed.stdout.startswith("2 of 2 steps, reward ")
    common = ["eval", "--env", "tinker/Bandit-v0", "--episodes", "2", "--max-new-tokens", "4", "--quiet"]
    of_run = CliRunner().invoke(main, [*common, "--run", str(out)], catch_exceptions=False)
    assert of_run.exit_code == 0, of_run.output
    assert f"evaluating checkpoint step_000001 of {out} ({out / 'checkpoints' / 'step_000001'})" in of_run.stderr
    assert re.fullmatch(r"tinker/Bandit-v0: 2 episodes, success [\d.]+%, mean reward -?[\d.]+ \([\d.]+ tokens per episode\)\n", of_run.stdout)
    of_model = CliRunner().invoke(main, [*common, "--model", tiny], catch_exceptions=False)
    assert of_model.exit_code == 0 and f"evaluating {tiny} (" in of_model.stderr


def test_eval_keeps_the_batches_that_ended_when_interrupted(tiny, tmp_path, monkeypatch) -> None:
    import tinkergym.trainers.evaluation as evaluation

    real, calls = evaluation.rollout, []

    def interrupted_at_the_third_batch(*args, **kwargs):  # Ctrl-C while the third batch of episodes plays
        calls.append(len(kwargs["seeds"]))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "rollout", interrupted_at_the_third_batch)
    transcripts = tmp_path / "t.jsonl"
    result = CliRunner().invoke(main, ["eval", "--env", "tinker/Bandit-v0", "--model", tiny, "--episodes", "6", "--batch-size", "2",
                                       "--max-new-tokens", "4", "--out", str(transcripts), "--quiet", "--json"])
    assert result.exit_code == 130, result.output
    assert calls == [2, 2, 2]
    assert "the 4 of 6 episodes that ended are kept" in result.stderr and str(transcripts) in result.stderr
    records = [json.loads(line) for line in transcripts.read_text().splitlines()]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(records) == 4 and summary["episodes"] == 4.0
    assert summary["reward_mean"] == pytest.approx(sum(r["total_reward"] for r in records) / 4)


def test_eval_prefix_cache_is_the_runs_unless_given(tiny, tmp_path) -> None:
    from tinkergym.trainers.session import load_backend_for_eval

    out = tmp_path / "run"
    assert CliRunner().invoke(main, _train_args(tiny, out, "--steps", "1", "--prefix-cache-mb", "7"), catch_exceptions=False).exit_code == 0
    assert load_backend_for_eval(run_dir=str(out)).prefix_cache.max_bytes == 7 * 2**20
    assert load_backend_for_eval(run_dir=str(out), prefix_cache_mb=3).prefix_cache.max_bytes == 3 * 2**20
    assert load_backend_for_eval(model=tiny, prefix_cache_mb=0).prefix_cache.max_bytes == 0
    result = CliRunner().invoke(main, ["eval", "--env", "tinker/Bandit-v0", "--model", "m", "--endpoint", "http://127.0.0.1:9/v1",
                                       "--prefix-cache-mb", "64"])
    assert result.exit_code == 2 and "--prefix-cache-mb sets a local model's sampler" in result.output


def test_loss_corrections_from_the_command_line(tiny, tmp_path) -> None:
    out = tmp_path / "run"
    extra = ("--steps", "1", "--temperature", "0.7", "--old-logprobs", "trainer", "--tis-cap", "2", "--kl-coef", "0.01",
             "--truncation", "mask", "--truncated-reward", "-1")
    result = CliRunner().invoke(main, _train_args(tiny, out, *extra), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["temperature"], config["old_logprobs"], config["tis_cap"]) == (0.7, "trainer", 2.0)
    assert (config["truncation"], config["truncated_reward"]) == ("mask", -1.0)
    record = read_metrics(out / "metrics.jsonl")[-1]
    assert record["batch/trained_sequences"] == 8, "with a KL term every sequence is trained on"
    assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and record["mismatch/logp_abs_max"] < 1e-3
    assert record["tis/weight_mean"] == pytest.approx(1.0, abs=1e-3)
    # Evaluation may truncate the distribution it samples from.
    result = CliRunner().invoke(main, ["eval", "--env", "tinker/Bandit-v0", "--run", str(out), "--episodes", "2", "--max-new-tokens", "4",
                                       "--temperature", "0.8", "--top-p", "0.9", "--top-k", "5"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env", "tinker/Bandt-v0"], "Did you mean: tinker/Bandit-v0"),
        (["--env", "tinker/Bandit-v0", "--trainer", "grpoo"], "Did you mean: grpo"),
        (["--env", "tinker/Bandit-v0", "--model", "gpt-17"], "smollm2-135m"),
        (["--env", "tinker/GomokuDuel-v0"], "multi-agent"),
        (["--env", "tinker/Bandit-v0", "--kwarg", "arms=99"], "arms=99"),
        (["--steps", "2"], "--env is required"),
        (["--env", "tinker/Bandit-v0", "--tis-cap", "2", "--old-logprobs", "sampler"], "--old-logprobs trainer"),
        (["--env", "tinker/Bandit-v0", "--temperature", "0"], "--temperature"),
    ],
)
def test_bad_input_exits_2_with_a_suggestion(args, message, tmp_path) -> None:
    result = CliRunner().invoke(main, ["train", *args, "--out", str(tmp_path / "x"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here (its lane trains with it)")
def test_vllm_sampler_without_vllm_exits_2_before_loading_a_model(tmp_path) -> None:
    result = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--model", "gpt-17", "--sampler", "vllm", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2, result.output
    assert "vllm" in result.output and "install" in result.output
    assert not (tmp_path / "x").exists()


TRAINER_PACKAGE = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tinkergym-trainer-sgd-demo"
        version = "0.0.1"
        [project.entry-points."tinkergym.trainers"]
        supervised-echo = "sgd_demo_trainer:EchoTrainer"
        [tool.setuptools]
        py-modules = ["sgd_demo_trainer"]
    """,
    "sgd_demo_trainer.py": '''
        """A third-party trainer: cross-entropy on the env's first prompt followed by a fixed answer."""
        from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams
        from tinkergym.trainers.base import StepOutput

        class EchoTrainer:
            needs_env = True

            def __init__(self, ctx):
                self.ctx = ctx

            def train_step(self, step):
                tokens = self.ctx.renderer.render([{"role": "user", "content": "Pick an arm."}, {"role": "assistant", "content": "red"}])
                datum = Datum(tokens=tokens, loss_mask=[0.0] * (len(tokens) - 3) + [1.0] * 3)
                metrics = self.ctx.backend.forward_backward(ForwardBackwardRequest([datum], LossSpec(name="cross_entropy"))).metrics
                metrics.update(self.ctx.backend.optim_step(OptimParams(learning_rate=self.ctx.config.lr)))
                return StepOutput(metrics)
    ''',
}


@pytest.mark.slow
def test_a_third_party_trainer_package_trains_by_name(tiny, tmp_path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    for name, text in TRAINER_PACKAGE.items():
        (package / name).write_text(textwrap.dedent(text))
    pip = [sys.executable, "-m", "pip"]
    installed = subprocess.run([*pip, "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(package)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    try:
        out = tmp_path / "run"
        run = subprocess.run(
            [sys.executable, "-m", "tinkergym", *_train_args(tiny, out, "--trainer", "supervised-echo", "--steps", "5")],
            capture_output=True, text=True, timeout=600,
        )
        assert run.returncode == 0, run.stderr
        losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
        assert len(losses) == 5 and losses[-1] < losses[0]
    finally:
        subprocess.run([*pip, "uninstall", "-y", "-q", "tinkergym-trainer-sgd-demo"], capture_output=True)


@pytest.mark.slow
def test_compare_example_warms_up_with_sft_then_trains(tiny, tmp_path) -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "train_and_compare.py"
    out = tmp_path / "example"
    command = [
        sys.executable, str(script), "--env", "tinker/Bandit-v0", "--model", tiny, "--warmup-sft-steps", "2", "--steps", "2",
        "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "4", "--out", str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "sft" / "final" / "config.json").is_file()  # the warm-up's full model, where RL started from
    assert json.loads((out / "config.json").read_text())["model"] == str(out / "sft" / "final")
    sft_steps = [r for r in read_metrics(out / "sft" / "metrics.jsonl") if r["step"] >= 0]
    assert sft_steps and all(r["tokens/per_s"] > 0 for r in sft_steps)  # SFT reports trained tokens per second
    assert "eval before:" in result.stdout and "eval after:" in result.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [-1, 0, 1]


def test_sft_on_data_alone_evaluates_nothing_and_runs_through(tiny, tmp_path) -> None:
    """An SFT run on --data with no env has nothing to evaluate: --eval-every is no error at any step."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("red", "green", "blue", "red")))
    out = tmp_path / "sft"
    result = CliRunner().invoke(main, ["train", "--trainer", "sft", "--data", str(data), "--model", tiny, "--steps", "2", "--batch-size", "2",
                                       "--eval-every", "1", "--dtype", "float32", "--quiet", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    steps = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1] and not any(k.startswith("eval/") for r in steps for k in r)


def test_sft_cuts_a_conversation_too_long_for_the_context_after_its_last_whole_turn_that_fits(tiny) -> None:
    """A long game is kept as its opening moves (on a turn's end), not dropped; one whose first answer cannot fit is."""
    from tinkergym.chat import ChatTemplateRenderer
    from tinkergym.trainers.sft import conversation_to_datum, fit_conversation

    renderer = ChatTemplateRenderer(tiny)
    messages = [{"role": "system", "content": "Play."}]
    for turn in range(12):
        messages += [{"role": "user", "content": f"board {turn} " + "x " * 40}, {"role": "assistant", "content": f"move {turn}"}]
    whole = {"messages": messages}
    length = len(renderer.render(messages))
    assert fit_conversation(renderer, whole, length) is whole
    cut = fit_conversation(renderer, whole, length // 2)
    assert cut is not None and cut["messages"][-1]["role"] == "assistant" and len(cut["messages"]) % 2 == 1
    assert len(renderer.render(cut["messages"])) <= length // 2
    longer = messages[: len(cut["messages"]) + 2]  # one more turn: over the bound, so the cut is the longest that fits
    assert len(renderer.render(longer)) > length // 2
    datum = conversation_to_datum(renderer, cut)
    assert sum(datum.loss_mask) > 0
    first_answer = len(renderer.render(messages[:3]))
    assert fit_conversation(renderer, whole, first_answer - 1) is None
    assert fit_conversation(renderer, whole, first_answer)["messages"] == messages[:3]
