"""``tinkergym results``: the intervals, held-out seeds that never meet a training seed, every row end to end on the tiny
model (training, evaluation, result.json, curves, adapter, table), and a row killed mid-run that resumes to the same
result. The learning itself is what the committed results under docs/results show, not what these tests check."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tinkergym.cli import main
from tinkergym.results.rows import ROWS, get_row
from tinkergym.results.stats import bootstrap_mean, paired_bootstrap_difference, wilson
from tinkergym.results.table import END, START, load_result, render
from tinkergym.trainers.base import TrainingContext
from tinkergym.trainers.evaluation import TRAIN_SEEDS, eval_seeds

ROOT = Path(__file__).resolve().parents[2]
#: What differs between two runs of the same row beside the numbers: when and where it ran, and how long it took.
CIRCUMSTANCES = ("wall_s", "machine", "commit", "command", "resumed_from_step")


def test_wilson_interval_matches_its_formula_and_stays_in_range() -> None:
    z2 = 1.959963984540054**2
    low, high = wilson(0, 64)
    assert low == 0.0 and high == pytest.approx(z2 / (64 + z2))  # at 0 successes the upper end is z^2 / (n + z^2)
    low, high = wilson(32, 64)  # at one half: 1/2 -+ z sqrt(n/4 + z^2/4) / (n + z^2)
    assert 0.5 - low == pytest.approx(high - 0.5) == pytest.approx(math.sqrt(z2) * math.sqrt(64 / 4 + z2 / 4) / (64 + z2))
    assert wilson(64, 64)[1] == 1.0 and wilson(64, 64)[0] == pytest.approx(64 / (64 + z2))
    for n in (1, 7, 64, 500):
        for k in range(0, n + 1, max(1, n // 7)):
            low, high = wilson(k, n)
            assert 0 <= low <= k / n <= high <= 1
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="within 0..n"):
        wilson(5, 4)


def test_bootstrap_intervals_cover_the_mean_and_repeat() -> None:
    rng = random.Random(3)
    before = [float(rng.random() < 0.2) for _ in range(64)]
    after = [float(rng.random() < 0.6) for _ in range(64)]
    change, low, high = paired_bootstrap_difference(before, after)
    assert change == pytest.approx(sum(after) / 64 - sum(before) / 64)
    assert low < change < high and low > 0  # a 40-point gain at 64 episodes is clear of zero
    assert paired_bootstrap_difference(before, after) == (change, low, high)  # seeded: the table repeats
    assert paired_bootstrap_difference(before, before) == (0.0, 0.0, 0.0)  # no change on any episode: no spread either
    # Paired is narrower than the two rates' own intervals when episodes share their difficulty.
    shared = [float(rng.random() < 0.5) for _ in range(64)]
    improved = [max(s, float(rng.random() < 0.2)) for s in shared]
    _, low, high = paired_bootstrap_difference(shared, improved)
    a, b = wilson(int(sum(shared)), 64), wilson(int(sum(improved)), 64)
    assert high - low < (a[1] - a[0] + b[1] - b[0]) / 2
    mean_low, mean_high = bootstrap_mean(after)
    assert mean_low < sum(after) / 64 < mean_high
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap_difference(before, after[:-1])


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_no_row_evaluates_on_a_seed_it_trains_on(quick: bool) -> None:
    """Every prompt seed of every step of every row (drawn by the trainer's own function) against its evaluation seeds."""
    for row in ROWS:
        config = row.config("unused", quick=quick)
        context = TrainingContext(config=config, backend=None, renderer=None)  # type: ignore[arg-type]  # seeds need neither
        trained = {seed for step in range(config.steps) for seed in context.prompt_seeds(step)}
        held_out = eval_seeds(config.seed, config.eval_episodes)
        assert len(held_out) == config.eval_episodes >= (6 if quick else 64)
        assert trained.isdisjoint(held_out), row.name
        assert max(trained) < TRAIN_SEEDS <= min(held_out) <= max(held_out) < 2**32  # NumPy seeds the whole range
        assert config.eval_every and config.steps % config.eval_every == 0 or config.steps // config.eval_every >= 2


def test_every_row_is_declared_whole() -> None:
    names = [row.name for row in ROWS]
    assert len(ROWS) >= 6 and len(set(names)) == len(names)
    kinds = {row.env for row in ROWS}
    for needed in ("tinker/Math-v0", "tinker/MathTool-v0", "tinker/Household-v0", "tinker/Gomoku-v0"):
        assert needed in kinds
    assert any(env.startswith("tinker/rg.") for env in kinds)
    for row in ROWS:
        assert row.eval_episodes >= 64 and row.why and row.model == "smollm2-135m"
        assert get_row(row.name) is row
    with pytest.raises(KeyError, match="the rows are: " + names[0]):
        get_row("no-such-row")
    result = CliRunner().invoke(main, ["results", "run", "no-such-row"])
    assert result.exit_code == 2 and "no results row 'no-such-row'" in result.output


def test_the_readme_shows_the_table_the_committed_results_give() -> None:
    result = CliRunner().invoke(main, ["results", "table", "--out", str(ROOT / "docs" / "results"), "--update", str(ROOT / "README.md"), "--check"])
    assert result.exit_code == 0, result.output


def _run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tinkergym", "results", *args], capture_output=True, text=True, timeout=900, **kwargs)


@pytest.fixture(scope="module")
def quick_suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every row with --quick, in one command: the folder of their results."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("results")
    done = _run(["run", "all", "--quick", "--quiet", "--out", str(root / "out"), "--work", str(root / "work")])
    assert done.returncode == 0, done.stderr[-4000:]
    assert [json.loads(line)["row"] for line in done.stdout.splitlines()] == [row.name for row in ROWS]
    return root


@pytest.mark.slow
def test_every_row_runs_end_to_end_on_the_tiny_model(quick_suite: Path) -> None:
    for row in ROWS:
        folder = quick_suite / "out" / row.name
        result = load_result(folder / "result.json")  # the schema check the table makes
        config = row.config("unused", quick=True)
        assert result["quick"] is True and result["row"] == row.name and result["env"] == row.env
        assert result["before"]["episodes"] == result["after"]["episodes"] == config.eval_episodes
        for arm in ("before", "after"):
            low, high = result[arm]["success_interval"]
            assert low <= result[arm]["success_rate"] <= high
            assert result[arm]["success_interval"] == list(wilson(result[arm]["successes"], result[arm]["episodes"]))
        low, high = result["change"]["success_interval"]
        assert low <= result["change"]["success_rate"] <= high and result["learns"] == (low > 0)
        assert result["samples"] == config.steps * config.batch_size * config.group_size
        assert [p["step"] for p in result["reward_curve"]] == list(range(config.steps))
        assert [p["step"] for p in result["eval_curve"]] == [-1, *range(config.eval_every - 1, config.steps, config.eval_every)]
        assert result["seeds"]["eval_first"] >= TRAIN_SEEDS and result["seeds"]["eval_count"] == config.eval_episodes
        assert result["machine"]["cores"] >= 1 and result["machine"]["float32_matmul_gflops"] > 0 and result["wall_s"] > 0
        for picture in ("reward_curve.png", "eval_curve.png"):
            assert (folder / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        adapter = json.loads((folder / "adapter" / "adapter_config.json").read_text())
        assert (folder / "adapter" / "adapter_model.safetensors").stat().st_size > 0
        if row.warmup is None:
            assert adapter["base_model_name_or_path"] == "tiny" and result["base"] is None
        else:  # RL's adapter sits on the warm-up's, which sits on the base model; the untrained model is evaluated too
            assert adapter["base_model_name_or_path"] == "../warmup_adapter"
            warm = json.loads((folder / "warmup_adapter" / "adapter_config.json").read_text())
            assert warm["base_model_name_or_path"] == "tiny" and result["warmup"]["steps"] == 2
            assert result["base"]["episodes"] == config.eval_episodes
            assert "after warm-up (untrained: " in render(quick_suite / "out").split(f"| {row.name} ", 1)[1].split("\n", 1)[0]
        transcripts = quick_suite / "work" / row.name / "rl" / "transcripts" / "eval_step_-00001.jsonl"
        outcomes = [json.loads(line)["success"] for line in transcripts.read_text().splitlines()]
        assert sum(outcomes) == result["before"]["successes"] and len(outcomes) == result["before"]["episodes"]

    table = render(quick_suite / "out")
    for row in ROWS:
        assert f"| {row.name} (quick: tiny model) |" in table
    readme = quick_suite / "README.md"
    readme.write_text(f"# Results\n\n{START}\nold\n{END}\nafter\n")
    runner = CliRunner()
    out = ["--out", str(quick_suite / "out")]
    assert runner.invoke(main, ["results", "table", *out, "--update", str(readme), "--check"]).exit_code == 1
    assert runner.invoke(main, ["results", "table", *out, "--update", str(readme)]).exit_code == 0
    assert readme.read_text() == f"# Results\n\n{START}\n{table}{END}\nafter\n"
    assert runner.invoke(main, ["results", "table", *out, "--update", str(readme), "--check"]).exit_code == 0
    listed = runner.invoke(main, ["results", "list", *out])
    assert listed.exit_code == 0 and listed.output.count(" done, ") == len(ROWS)

    # The adapter a row wrote evaluates again with `tinkergym eval`, from its folder alone (the base resolved by name; a
    # warmed-up row's adapter through the warm-up's beside it), from another working directory.
    warmed = next(row for row in ROWS if row.warmup is not None)
    adapter = quick_suite / "out" / warmed.name / "adapter"
    config = warmed.config("unused", quick=True)
    evaluated = subprocess.run(
        [sys.executable, "-m", "tinkergym", "eval", "--env", warmed.env, "--model", str(adapter), "--episodes", "3", "--quiet", "--json",
         "--max-turns", str(config.max_turns), "--max-new-tokens", str(config.max_new_tokens),
         *(f"--kwarg={k}={json.dumps(v)}" for k, v in {**config.env_kwargs, **config.eval_env_kwargs}.items())],
        capture_output=True, text=True, timeout=300, cwd=quick_suite)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout.splitlines()[-1])["episodes"] == 3


@pytest.mark.slow
def test_a_row_killed_mid_run_resumes_to_the_same_result(quick_suite: Path, tmp_path: Path) -> None:
    """Killed (SIGKILL, nothing flushed) after its first checkpoint, then run again: the result of the run never killed."""
    row = ROWS[0]
    out, work = tmp_path / "out", tmp_path / "work"
    args = [sys.executable, "-m", "tinkergym", "results", "run", row.name, "--quick", "--quiet", "--out", str(out), "--work", str(work)]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    checkpoints = work / row.name / "rl" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints.is_dir() and any(not p.name.endswith(".tmp") for p in checkpoints.iterdir())):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (out / row.name / "result.json").exists()
    done = _run(["run", row.name, "--quick", "--quiet", "--out", str(out), "--work", str(work)])
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = load_result(out / row.name / "result.json")
    whole = load_result(quick_suite / "out" / row.name / "result.json")
    assert resumed["resumed_from_step"] >= 1
    sittings = json.loads((work / row.name / "wall.json").read_text())["sittings"]
    assert len(sittings) == 2 and math.isclose(sum(s["seconds"] for s in sittings), resumed["wall_s"], abs_tol=0.2)
    assert all(s["seconds"] > 0 and s["other_cores"] >= 0 for s in sittings) and resumed["machine"]["other_cores"] >= 0
    for result in (resumed, whole):  # seconds per step are a circumstance too
        result["reward_curve"] = [{k: v for k, v in p.items() if k != "train_s"} for p in result["reward_curve"]]
    assert {k: v for k, v in resumed.items() if k not in CIRCUMSTANCES} == {k: v for k, v in whole.items() if k not in CIRCUMSTANCES}


def test_a_changed_recipe_is_not_resumed(tmp_path: Path) -> None:
    """A run folder of another recipe (here: a quick run, asked for as a full one) is refused, and left as it was."""
    from tinkergym.results.runner import check_same_recipe
    from tinkergym.errors import ConfigError

    row = ROWS[0]
    folder = tmp_path / row.name
    folder.mkdir()
    row.config(str(folder), quick=True).save(folder / "config.json")
    before = (folder / "config.json").read_text()
    with pytest.raises(ConfigError, match="another recipe than this row's .*steps"):
        check_same_recipe(folder, row.config(str(folder), quick=False))
    assert (folder / "config.json").read_text() == before
    check_same_recipe(folder, row.config(str(folder), quick=True))  # the same recipe resumes


@pytest.mark.slow
def test_trl_trains_a_single_turn_row_on_the_same_recipe_and_evaluation(quick_suite: Path) -> None:
    """--peer trl: TRL's GRPOTrainer on the row's prompts, its adapter evaluated on the same held-out episodes; a
    multi-turn row is refused before anything runs."""
    pytest.importorskip("trl")
    row = next(row for row in ROWS if row.recipe["max_turns"] == 1)
    config = row.config("unused", quick=True)
    args = ["--quick", "--quiet", "--peer", "trl", "--out", str(quick_suite / "out"), "--work", str(quick_suite / "work")]
    done = _run(["run", row.name, *args])
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout) == {**json.loads(done.stdout), "row": row.name, "peer": "trl"}  # one JSON line, TRL's log on stderr
    result = json.loads((quick_suite / "out" / row.name / "trl" / "result.json").read_text())
    ours = load_result(quick_suite / "out" / row.name / "result.json")
    assert result["before"] == ours["before"]  # the same start and the same episodes
    assert result["after"]["episodes"] == config.eval_episodes and result["samples"] == ours["samples"]
    assert [p["step"] for p in result["reward_curve"]] == list(range(config.steps))
    assert all(b["train_s"] >= a["train_s"] for a, b in zip(result["reward_curve"], result["reward_curve"][1:]))
    assert (quick_suite / "out" / row.name / "vs_trl.png").read_bytes()[:4] == b"\x89PNG"
    adapter = json.loads((quick_suite / "out" / row.name / "trl" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == config.lora_rank and adapter["base_model_name_or_path"] == ("../../warmup_adapter" if row.warmup else "tiny")

    assert result["steps"] == config.steps and result["tinkergym_after_as_many_samples"] == ours["after"]
    # TRL trained on the warmed-up model: its adapter is evaluated on that model, not on the base under it.
    trained = json.loads((quick_suite / "work" / row.name / f"trl-{config.steps}-steps" / "adapter" / "adapter_config.json").read_text())
    start = (quick_suite / "work" / row.name / "warmup" / "final").resolve() if row.warmup else None
    assert row.warmup is None or trained["base_model_name_or_path"] == str(start)
    uneven = _run(["run", row.name, *args, "--steps", str(config.eval_every + 1)])  # not a step tinkergym evaluated after
    assert uneven.returncode == 2 and f"evaluated {row.name} after every {config.eval_every} steps" in uneven.stderr
    alone = _run(["run", row.name, "--quick", "--steps", "2"])
    assert alone.returncode == 2 and "--steps goes with --peer" in alone.stderr

    multi = next(row for row in ROWS if row.recipe["max_turns"] > 1)
    refused = _run(["run", multi.name, *args])
    assert refused.returncode == 2 and f"row {multi.name} is multi-turn" in refused.stderr
    assert not (quick_suite / "out" / multi.name / "trl").exists()


@pytest.mark.parametrize("text, says", [
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "is not a JSON object"),
    (json.dumps({"schema": True}), "'schema' is missing or not of type int"),
    ("\ud800".encode("utf-8", "surrogatepass").decode("latin-1"), "cannot be read as JSON"),
], ids=["not-json", "not-object", "bool-for-int", "lone-surrogate"])
def test_a_broken_result_file_is_refused_with_what_to_do(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / ROWS[0].name).mkdir()
    (tmp_path / ROWS[0].name / "result.json").write_text(text, encoding="latin-1")
    result = CliRunner().invoke(main, ["results", "table", "--out", str(tmp_path)])
    assert result.exit_code == 2 and says in result.output and "run its row again" in result.output
    assert CliRunner().invoke(main, ["results", "table", "--out", "a\0b"]).exit_code == 2  # a NUL in a path: a usage error
