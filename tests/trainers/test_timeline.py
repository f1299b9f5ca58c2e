"""A run's timeline: the spans of every step nest, its phases add up to the step's time, env steps and tool calls are
on their own threads, and ``tinkergym trace`` writes a Trace Event Format file that Perfetto and chrome://tracing open."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from tinkergym.plumbing import timeline
from tinkergym.cli import main
from tinkergym.tools import ToolBox, ToolCall

pytest.importorskip("torch")

from tinkergym.config import TrainConfig  # noqa: E402
from tinkergym.trainers.session import TrainingRun  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def run(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("timeline") / "run"
    config = TrainConfig(env="tinker/Bandit-v0", trainer="grpo", model=tiny, dtype="float32", steps=STEPS, checkpoint_every=2, lr=1e-2,
                         batch_size=2, group_size=3, max_new_tokens=4, out=str(out))
    TrainingRun(config).run(progress=False)
    return out


def inside(child: timeline.Span, parent: timeline.Span) -> bool:
    return parent.start_us <= child.start_us and child.end_us <= parent.end_us


def test_each_steps_spans_nest_and_its_phases_add_up_to_the_step(run: Path) -> None:
    spans = timeline.read_spans(run)
    steps = sorted((s for s in spans if s.name == "step"), key=lambda s: s.args["step"])
    assert [s.args["step"] for s in steps] == list(range(STEPS))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_s = {m["step"]: m["time/step_s"] for m in metrics if "time/step_s" in m}
    for step in steps:
        assert step.seconds == pytest.approx(step_s[step.args["step"]], rel=0.05, abs=0.005)  # the span is the step's time/step_s
        (rollout,) = [s for s in spans if s.name == "rollout" and inside(s, step)]
        (update,) = [s for s in spans if s.name == "update" and inside(s, step)]
        assert rollout.end_us <= update.start_us  # one after the other, on the run's thread
        assert rollout.seconds + update.seconds == pytest.approx(step.seconds, rel=0.05)
        samples = [s for s in spans if s.name == "sample" and inside(s, rollout)]
        env_steps = [s for s in spans if s.name == "env.step" and inside(s, rollout)]
        assert samples and len(env_steps) >= 6  # every episode stepped at least once within the rollout
        assert {s.thread for s in env_steps} - {step.thread}  # on the env thread pool
        backend = [s.name for s in spans if s.cat == "backend" and inside(s, update)]
        assert backend in ([], ["forward_backward", "optim_step"])  # a step whose groups all tie trains nothing
    # the spans of one thread never cross: each pair is nested or apart
    for thread in {s.thread for s in spans}:
        mine = [s for s in spans if s.thread == thread]
        for a in mine:
            for b in mine:
                assert not (a.start_us < b.start_us < a.end_us < b.end_us), (a, b)
    checkpoints = [s.args["step"] for s in spans if s.name == "checkpoint"]
    assert checkpoints == [1, 2]


def test_tinkergym_trace_writes_a_trace_event_file(run: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["trace", str(run)])
    assert result.exit_code == 0, result.output
    trace = json.loads((run / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {"step", "rollout", "update", "sample", "env.step", "checkpoint"} <= {e["name"] for e in events}
    for event in events:
        assert set(event) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} and event["dur"] >= 0
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[1] == "run" and len(names) >= 2  # the run's thread and the env threads, each a lane
    one = CliRunner().invoke(main, ["trace", str(run), "--steps", "1:1", "--out", str(tmp_path / "one.json")])
    assert one.exit_code == 0, one.output
    picked = json.loads((tmp_path / "one.json").read_text())["traceEvents"]
    assert [e["args"]["step"] for e in picked if e["name"] == "step"] == [1]
    assert [e["args"]["step"] for e in picked if e["name"] == "checkpoint"] == [1]  # what ran after it, before the next step
    bad = CliRunner().invoke(main, ["trace", str(run), "--steps", "7:9"])
    assert bad.exit_code == 2 and "it has steps 0 to 2" in bad.output
    for steps in ("x", "1:2:3", "1:\x00", ":", "9" * 5000):
        malformed = CliRunner().invoke(main, ["trace", str(run), "--steps", steps])
        assert malformed.exit_code == 2 and "give A:B" in malformed.output, steps
    empty = CliRunner().invoke(main, ["trace", str(tmp_path)])
    assert empty.exit_code == 2 and "no timeline" in empty.output


def double(x: int) -> int:
    """Twice ``x``."""
    return 2 * x


def test_a_tool_call_is_a_span_of_the_thread_that_ran_it() -> None:
    box = ToolBox([double])
    name = box.names[0]
    recorded = timeline.Timeline()
    with timeline.recording(recorded):
        worker = threading.Thread(target=lambda: box.call(ToolCall(name, {"x": 4})))
        worker.start()
        worker.join()
    box.call(ToolCall(name, {"x": 5}))  # nothing records it: no timeline is recording
    (tool,) = recorded.take()
    assert tool.name == "tool" and tool.cat == "tool" and tool.args == {"tool": name} and tool.thread == worker.ident


def test_train_serves_its_phases_as_prometheus_metrics(tiny: str, tmp_path: Path) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from testkit import free_port

    port = free_port()
    result = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--steps", "2",
                                       "--batch-size", "1", "--group-size", "2", "--max-new-tokens", "3", "--out", str(tmp_path / "run"),
                                       "--quiet", "--metrics-port", str(port)])
    assert result.exit_code == 0, result.output
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:  # it serves while the process lives
        text = response.read().decode()
    counts = {s.labels["name"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "tinkergym_phase_duration_seconds_count"}
    assert counts["step"] == 2 and counts["rollout"] == 2 and counts["update"] == 2
    assert counts["sample"] >= 2 and counts["env.step"] >= 4 and counts["checkpoint"] >= 1


def test_tool_calls_are_counted_by_tool_name() -> None:
    from tinkergym.serve.metrics import PhaseMetrics, ServerMetrics

    metrics = ServerMetrics("trainer")
    recorded = timeline.Timeline()
    recorded.add_listener(PhaseMetrics(metrics).observe)
    box = ToolBox([double])
    with timeline.recording(recorded):
        for x in range(3):
            box.call(ToolCall(box.names[0], {"x": x}))
    text = metrics.render().decode()
    assert f'tinkergym_phase_duration_seconds_count{{name="tool",tool="{box.names[0]}"}} 3.0' in text


def test_a_resume_drops_the_spans_of_the_steps_it_trains_again(run: Path, tmp_path: Path) -> None:
    """A run that stopped after step 2 with its newest checkpoint at step 1 trains step 2 again: its timeline, as its metrics,
    then holds each step once."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000002")  # the checkpoint after step 2 never made it
    shutil.rmtree(copy / "final")
    TrainingRun.resume(copy).run(progress=False)
    spans = timeline.read_spans(copy)
    assert sorted(s.args["step"] for s in spans if s.name == "step") == list(range(STEPS))
    assert sorted(s.args["step"] for s in spans if s.name == "checkpoint") == [1, 2]
    assert [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()] == list(range(STEPS))


def test_an_overwritten_run_folder_holds_the_new_run_alone(tiny: str, tmp_path: Path) -> None:
    """train --overwrite over a finished run: every file of the old run is replaced (the timeline, the checkpoints and the
    transcripts too, not only the metrics) and the run says what it replaced; a file of the user's stays."""
    out = tmp_path / "run"
    common = ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--batch-size", "1", "--group-size", "2",
              "--max-new-tokens", "3", "--out", str(out), "--quiet", "--checkpoint-every", "1"]
    first = CliRunner().invoke(main, [*common, "--steps", "3"])
    assert first.exit_code == 0, first.output
    (out / "notes.txt").write_text("mine")
    second = CliRunner().invoke(main, [*common, "--steps", "2", "--overwrite"])
    assert second.exit_code == 0, second.output
    assert f"{out} held a run: replaced its config.json, metrics.jsonl, timeline.jsonl" in second.output
    assert sorted(s.args["step"] for s in timeline.read_spans(out) if s.name == "step") == [0, 1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000000", "step_000001"]
    assert not list((out / "transcripts").glob("*step_000002*"))
    assert (out / "notes.txt").read_text() == "mine"
