"""Resuming runs on the tiny model: trainer state in checkpoints, extending a run from the CLI, TensorBoard once per step."""

from __future__ import annotations

import json
import struct
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from tinkergym.cli import main
from tinkergym.config import TrainConfig
from tinkergym.trainers.reporting import read_metrics
from tinkergym.trainers.session import RESUMABLE_FIELDS, TrainingRun, latest_checkpoint, option_name

VOLATILE = ("time/", "tokens/per_s")

PLUGIN_MODULE = '''
"""Trainers for the resume tests: cross-entropy on a fixed answer, one of them with state."""
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams
from tinkergym.trainers.base import StepOutput

INTERRUPT_AT = None  # a test sets a step here: the run stops there as it would on Ctrl-C


class PlainTrainer:
    """Stateless: no state_dict / load_state_dict."""

    needs_env = True

    def __init__(self, ctx):
        self.ctx = ctx
        tokens = ctx.renderer.render([{"role": "user", "content": "Pick an arm."}, {"role": "assistant", "content": "red"}])
        self.datum = Datum(tokens=tokens, loss_mask=[0.0] * (len(tokens) - 3) + [1.0] * 3)

    def update(self, step, scale):
        if step == INTERRUPT_AT:
            raise KeyboardInterrupt
        request = ForwardBackwardRequest(data=[self.datum], loss=LossSpec(name="cross_entropy"))
        metrics = dict(self.ctx.backend.forward_backward(request).metrics)
        metrics.update(self.ctx.backend.optim_step(OptimParams(learning_rate=self.ctx.config.lr * scale)))
        return metrics

    def train_step(self, step):
        return StepOutput(self.update(step, 1.0))


class AdaptiveTrainer(PlainTrainer):
    """Scales its step size like an adaptive KL coefficient (up while the loss falls, down when it rises) and counts updates."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scale, self.updates, self.last_loss = 1.0, 0, None

    def train_step(self, step):
        metrics = self.update(step, self.scale)
        falling = self.last_loss is None or metrics["loss"] < self.last_loss
        self.scale, self.updates, self.last_loss = self.scale * (1.5 if falling else 0.5), self.updates + 1, metrics["loss"]
        return StepOutput({**metrics, "scale": self.scale, "updates": float(self.updates)})

    def state_dict(self):
        return {"scale": self.scale, "updates": self.updates, "last_loss": self.last_loss}

    def load_state_dict(self, state):
        self.scale, self.updates, self.last_loss = state["scale"], state["updates"], state["last_loss"]
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The test trainers, registered as 'adaptive-demo' and 'plain-demo' through a fake distribution's entry points."""
    site = tmp_path_factory.mktemp("site")
    (site / "resume_demo_trainers.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    info = site / "resume_demo_trainers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: resume-demo-trainers\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[tinkergym.trainers]\nadaptive-demo = resume_demo_trainers:AdaptiveTrainer\nplain-demo = resume_demo_trainers:PlainTrainer\n"
    )
    sys.path.insert(0, str(site))
    import resume_demo_trainers

    yield resume_demo_trainers
    sys.path.remove(str(site))
    sys.modules.pop("resume_demo_trainers", None)


def _config(tiny: str, out: Path, trainer: str) -> TrainConfig:
    return TrainConfig(
        env="tinker/Bandit-v0", trainer=trainer, model=tiny, dtype="float32", steps=5, checkpoint_every=2, lr=1e-2,
        batch_size=1, group_size=1, max_new_tokens=4, out=str(out),
    )


def _interrupted_then_resumed(plugin, config: TrainConfig, at: int, before_resume=lambda: None) -> None:
    plugin.INTERRUPT_AT = at
    try:
        with pytest.raises(KeyboardInterrupt):
            TrainingRun(config).run(progress=False)
    finally:
        plugin.INTERRUPT_AT = None
    before_resume()
    TrainingRun.resume(config.out).run(progress=False)


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each scalar tag, read back from the event files in the order TensorBoard reads them; checksums verified."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((folder / "tensorboard").glob("*tfevents*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            payload = data[pos + 12 : pos + 12 + length]
            assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
            assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == masked_crc32c(payload)
            event = Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
            pos += 16 + length
    return scalars


def _assert_tensorboard_matches_metrics(folder: Path) -> None:
    """Every step once per tag, in order, with the value metrics.jsonl holds."""
    records = read_metrics(folder / "metrics.jsonl")
    scalars = _tensorboard_scalars(folder)
    assert scalars, "no TensorBoard events were written"
    for tag, points in scalars.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"{tag}: steps {steps}"
        if tag == "step":  # TensorBoard's "step" is the backend's optimizer counter; metrics.jsonl's is the run's
            continue
        expected = [(r["step"], r[tag]) for r in records if tag in r]
        assert steps == [step for step, _ in expected], tag
        assert [value for _, value in points] == pytest.approx([value for _, value in expected], rel=1e-6), tag


def test_a_stateful_trainer_resumes_exactly(tiny, plugin, tmp_path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    TrainingRun(_config(tiny, whole, "adaptive-demo")).run(progress=False)

    def check_checkpoint() -> None:
        step, path = latest_checkpoint(cut)
        assert step == 1
        saved = json.loads((path / "trainer_state.json").read_text())
        assert saved["trainer"] == "adaptive-demo" and saved["step"] == 1 and saved["state"]["updates"] == 2
        assert [r["step"] for r in read_metrics(cut / "metrics.jsonl")] == [0, 1, 2], "step 2 ran after the checkpoint"

    # Interrupted in step 3: the checkpoint is of step 1, so step 2 runs (and is logged) twice.
    _interrupted_then_resumed(plugin, _config(tiny, cut, "adaptive-demo"), at=3, before_resume=check_checkpoint)
    records = read_metrics(cut / "metrics.jsonl")
    assert [r["updates"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert len({r["scale"] for r in records}) > 1, "the coefficient adapts, so restoring it matters"
    assert _stable(records) == _stable(read_metrics(whole / "metrics.jsonl"))
    _assert_tensorboard_matches_metrics(cut)


def test_a_plugin_without_state_methods_and_a_checkpoint_without_trainer_state_still_resume(tiny, plugin, tmp_path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    TrainingRun(_config(tiny, whole, "plain-demo")).run(progress=False)
    _interrupted_then_resumed(plugin, _config(tiny, cut, "plain-demo"), at=3)
    assert _stable(read_metrics(cut / "metrics.jsonl")) == _stable(read_metrics(whole / "metrics.jsonl"))
    assert not list((cut / "checkpoints").glob("*/trainer_state.json"))

    older = tmp_path / "older"  # a checkpoint as runs wrote them before trainers had state: the trainer starts as built

    def drop_trainer_state() -> None:
        (latest_checkpoint(older)[1] / "trainer_state.json").unlink()

    _interrupted_then_resumed(plugin, _config(tiny, older, "adaptive-demo"), at=3, before_resume=drop_trainer_state)
    assert [r["updates"] for r in read_metrics(older / "metrics.jsonl")] == [1.0, 2.0, 1.0, 2.0, 3.0]


def _train_args(tiny: str, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--steps", "4",
        "--batch-size", "2", "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3",
        "--checkpoint-every", "1", "--quiet", "--out", str(out), *extra,
    ]


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_resume_with_more_steps_extends_a_finished_run(tiny, tmp_path) -> None:
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert _cli(*_train_args(tiny, whole)).exit_code == 0
    assert _cli(*_train_args(tiny, run, "--steps", "2")).exit_code == 0
    first_export = (run / "final").stat().st_mtime_ns

    result = _cli("train", "--resume", str(run), "--steps", "4", "--quiet", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["run"] == str(run)
    assert _stable(read_metrics(run / "metrics.jsonl")) == _stable(read_metrics(whole / "metrics.jsonl"))
    assert json.loads((run / "config.json").read_text())["steps"] == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert (run / "final").stat().st_mtime_ns > first_export and (run / "final" / "adapter_config.json").is_file()
    notes = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert [(n["step"], n["changed"]) for n in notes] == [(2, {"steps": [2, 4]})]
    _assert_tensorboard_matches_metrics(run)

    # Done already: the same command, or no --steps, or an option at its saved value, changes nothing.
    before = {p: p.stat().st_mtime_ns for p in (run / "metrics.jsonl", run / "config.json", run / "final")}
    for extra in ([], ["--steps", "4"], ["--env", "tinker/Bandit-v0", "--lr", "1e-3"]):
        result = _cli("train", "--resume", str(run), "--quiet", "--json", *extra)
        assert result.exit_code == 0, result.output
        assert "nothing to do" in result.stderr and "--steps N with N above 4" in result.stderr
        assert "reward/mean" in json.loads(result.stdout.strip().splitlines()[-1])
    assert before == {p: p.stat().st_mtime_ns for p in before}
    assert len((run / "resumes.jsonl").read_text().splitlines()) == 1


@pytest.fixture(scope="module")
def finished_run(tiny, tmp_path_factory) -> Path:
    """A finished 2-step run that the tests below only read."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert _cli(*_train_args(tiny, run, "--steps", "2")).exit_code == 0
    return run


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "1"], "--steps 1 is fewer than the 2 steps"),
        (["--batch-size", "3"], "cannot change --batch-size (from 2 to 3)."),
        (["--kwarg", "arms=3", "--seed", "5"], "cannot change --kwarg (from {} to {\"arms\": 3}), --seed (from 0 to 5)."),  # the fields' order
        (["--full"], "cannot change --lora-rank/--full"),
        (["--config", "{config}"], "--config cannot be combined with --resume"),
    ],
)
def test_resume_refuses_what_it_cannot_change(finished_run, extra, message) -> None:
    run = finished_run
    config_before = (run / "config.json").read_text()
    extra = [e.format(config=run / "config.json") for e in extra]
    result = CliRunner().invoke(main, ["train", "--resume", str(run), *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    if "cannot change" in message:
        assert "may change only " + ", ".join(option_name(k) for k in RESUMABLE_FIELDS) in " ".join(result.output.split())
    assert (run / "config.json").read_text() == config_before


def test_train_help_names_every_option_a_resume_may_change() -> None:
    text = " ".join(_cli("train", "--help").output.split())
    assert all(option_name(k) in text.split("--resume DIRECTORY")[1] for k in RESUMABLE_FIELDS)
