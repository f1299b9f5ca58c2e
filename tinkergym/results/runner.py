"""``tinkergym results run ROW``: train one row's recipe, evaluate it before, during and after on held-out seeds, and write
the row's folder of results.

The run itself is an ordinary training run (:class:`~tinkergym.trainers.session.TrainingRun`) in ``WORK/ROW``, so it
checkpoints as every run does, and running the row again resumes it from its newest checkpoint (a run killed in its
first evaluation starts over). The row's folder ``OUT/ROW`` gets:

    result.json        what the run was (commit, machine, command, seeds, recipe) and what it gave: success rate and
                       mean reward before and after with their 95% intervals, the change with its paired interval,
                       samples and tokens used, wall time (summed over the sittings a resumed run took)
    reward_curve.png   the training reward by step (and by samples seen)
    eval_curve.png     the held-out success rate at each evaluation, with Wilson intervals
    adapter/           the final LoRA adapter (peft), which ``tinkergym eval --model OUT/ROW/adapter`` evaluates again

Success is the env's own verdict (``info["is_success"]``), else a positive reward
(:func:`tinkergym.trainers.evaluation.succeeded`).
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from itertools import accumulate
from pathlib import Path
from typing import Any

from tinkergym.config import TrainConfig
from tinkergym.errors import ConfigError
from tinkergym.results.rows import Row
from tinkergym.results.stats import bootstrap_mean, paired_bootstrap_difference, wilson
from tinkergym.trainers.evaluation import eval_seeds

#: The version of result.json's layout (bumped when a key changes meaning).
SCHEMA = 1
#: Files of the final adapter copied into the row's folder (the tokenizer is the base model's, loaded from it).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
#: Seconds between two writes of the wall clock file: a killed sitting loses at most this much of its time.
WALL_EVERY_S = 1.0


class WallClock:
    """The wall time a row's run took, summed over the sittings that ran it (``wall.json`` in its run folder), and the
    cores other processes took meanwhile (a figure taken on a shared machine says so).

    A thread rewrites the file every second, so a sitting that is killed still counts (all but its last second).
    """

    def __init__(self, path: Path) -> None:
        from tinkergym.backends.torch.machine import CpuShare

        self.path = path
        self.sittings: list[dict[str, float]] = []
        if path.is_file():
            try:
                self.sittings = [{"seconds": float(s["seconds"]), "other_cores": float(s["other_cores"])}
                                 for s in json.loads(path.read_text(encoding="utf-8"))["sittings"]]
            except (OSError, ValueError, KeyError, TypeError):
                self.sittings = []
        self._start = time.monotonic()
        self._share = CpuShare()
        self.sittings.append({"seconds": 0.0, "other_cores": 0.0})
        self._write()  # the sitting is on record from its start, however soon it is killed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="results-wall-clock", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(WALL_EVERY_S):
            self._write()

    def _write(self) -> None:
        self.sittings[-1] = {"seconds": round(time.monotonic() - self._start, 1), "other_cores": round(self._share.stop()["other_cores"], 2)}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"sittings": self.sittings}), encoding="utf-8")
        tmp.replace(self.path)

    def stop(self) -> float:
        """Stop counting; the total over every sitting, in seconds."""
        self._stop.set()
        self._thread.join()
        self._write()
        return sum(s["seconds"] for s in self.sittings)

    def other_cores(self) -> float:
        """The cores other processes took, averaged over every sitting by its length."""
        total = sum(s["seconds"] for s in self.sittings)
        return sum(s["seconds"] * s["other_cores"] for s in self.sittings) / total if total else 0.0


def run_row(row: Row, out: Path, work: Path, quick: bool = False, progress: bool = True, command: str = "") -> dict[str, Any]:
    """Train ``row`` in ``work/ROW`` (or resume it there), then write its results into ``out/ROW``; the result.

    ``work/ROW`` holds ``rl/`` (the RL run), ``warmup/`` (the warm-up's SFT run, for a row that has one) with
    ``base_eval.jsonl`` (the untrained model's evaluation, the same episodes), and ``wall.json``.
    """
    folder = work / row.name
    folder.mkdir(parents=True, exist_ok=True)
    clock = WallClock(folder / "wall.json")
    try:
        model = None
        if row.warmup is not None:
            warm = row.warmup_config(str(folder / "warmup"), quick)
            _say(progress, f"{row.name}: warm-up, {warm.steps} SFT steps on the {row.warmup.demos} agent's episodes")
            _train(warm, progress, f"{row.name} warm-up")
            model = str((folder / "warmup" / "final").resolve())
        config = row.config(str(folder / "rl"), quick=quick, model=model)
        _say(progress, f"{row.name}: {config.trainer} on {config.env}, {config.steps} steps x {config.batch_size} prompts x "
                       f"{config.group_size} samples; {config.eval_episodes} held-out episodes evaluated before, every "
                       f"{config.eval_every} steps and after")
        resumed = _train(config, progress, row.name)
        if row.warmup is not None:
            _say(progress, f"{row.name}: evaluating the untrained model on the same episodes")
            _base_eval(row, config, folder / "base_eval.jsonl", quick)
    finally:
        wall = clock.stop()
    result = summarize(row, config, folder, wall, quick=quick, command=command, resumed_from=resumed)
    result["machine"]["other_cores"] = round(clock.other_cores(), 2)  # beside the run, averaged over its sittings
    write_row_folder(result, folder, out / row.name)
    return result


def _train(config: TrainConfig, progress: bool, what: str) -> int:
    """Run ``config`` in its folder, or resume it there; the step it resumed from (0: a new run)."""
    from tinkergym.trainers.session import TrainingRun, plan_resume

    folder = Path(config.out)
    if not (folder / "config.json").is_file():
        TrainingRun(config).run(progress=progress)
        return 0
    check_same_recipe(folder, config)
    plan = plan_resume(folder)
    if not plan.nothing_to_do:
        _say(progress, f"{what}: resuming {folder} at step {plan.start_step} of {config.steps}")
        TrainingRun.resume(folder).run(progress=progress)
    return plan.start_step


def _base_eval(row: Row, config: TrainConfig, path: Path, quick: bool) -> None:
    """The untrained model's evaluation (the episodes RL's evaluations play), once: for a row whose RL starts warmed up."""
    if not path.is_file():
        evaluate_model(row.training(quick)[1], config, path)


def evaluate_model(model: str, config: TrainConfig, path: Path) -> None:
    """Evaluate ``model`` (a name, a folder, an adapter folder) as a run of ``config`` evaluates: greedy, on its held-out
    seeds and env; the transcripts into ``path`` (written whole or not at all)."""
    from tinkergym.chat import renderer_for
    from tinkergym.trainers.evaluation import eval_rollout_config, evaluate, write_transcripts
    from tinkergym.trainers.session import env_factory, load_backend_for_eval

    backend = load_backend_for_eval(model=model, prefix_cache_mb=config.prefix_cache_mb)
    try:
        make_env = env_factory(config.env, {**config.env_kwargs, **config.eval_env_kwargs})
        _, trajectories = evaluate(make_env, backend, renderer_for(backend.info()["tokenizer"]), eval_rollout_config(config),
                                   eval_seeds(config.seed, config.eval_episodes))
    finally:
        getattr(backend, "close", lambda: None)()
    write_transcripts(path.with_suffix(".tmp"), trajectories, step=-1)
    path.with_suffix(".tmp").replace(path)


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def check_same_recipe(folder: Path, config: TrainConfig) -> None:
    """Refuse to resume a run whose recipe is not the row's any more (the row was edited, or ``--quick`` changed)."""
    saved = TrainConfig.load(folder / "config.json").to_dict()
    wanted = config.to_dict()
    changed = sorted(k for k in wanted if k != "out" and saved.get(k) != wanted[k])
    if changed:
        raise ConfigError(
            f"{folder} holds a run of another recipe than this row's (differs in: {', '.join(changed)}); "
            f"move it away or delete it to run the row again from the start."
        )


def eval_outcomes(folder: Path, step: int, path: Path | None = None) -> tuple[list[float], list[float]] | None:
    """The per-episode success (0/1) and total reward of the evaluation after ``step`` (-1: before training), from the
    run ``folder``'s transcripts (or from ``path``)."""
    path = path or folder / "transcripts" / f"eval_step_{step:06d}.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records.sort(key=lambda r: r["episode"])
    success = [1.0 if r.get("success") else 0.0 for r in records]
    reward = [float(r["total_reward"]) if r.get("total_reward") is not None else 0.0 for r in records]
    return success, reward


def arm(success: list[float], reward: list[float]) -> dict[str, Any]:
    """One evaluation's numbers: episodes, successes, success rate with its Wilson interval, mean reward with its bootstrap one."""
    wins = int(sum(success))
    return {
        "episodes": len(success), "successes": wins, "success_rate": wins / max(len(success), 1),
        "success_interval": list(wilson(wins, len(success))), "reward_mean": sum(reward) / max(len(reward), 1),
        "reward_interval": list(bootstrap_mean(reward)),
    }


def summarize(
    row: Row, config: TrainConfig, row_folder: Path, wall_s: float, quick: bool = False, command: str = "", resumed_from: int = 0,
) -> dict[str, Any]:
    """result.json's contents for a finished row whose folder (``work/ROW``) is ``row_folder``."""
    from tinkergym.trainers.reporting import read_metrics

    folder = row_folder / "rl"
    records = read_metrics(folder / "metrics.jsonl")
    last_step = config.steps - 1
    before, after = eval_outcomes(folder, -1), eval_outcomes(folder, last_step)
    if before is None or after is None:
        raise ConfigError(f"{folder} has no evaluation {'before training' if before is None else 'after its last step'}; "
                          f"run the row again to finish it.")
    base = eval_outcomes(row_folder, -1, row_folder / "base_eval.jsonl") if row.warmup is not None else None
    change, low, high = paired_bootstrap_difference(before[0], after[0])
    reward_change = paired_bootstrap_difference(before[1], after[1])
    curve = []
    for record in records:
        if "eval/success_rate" in record:
            outcome = eval_outcomes(folder, record["step"])
            episodes = len(outcome[0]) if outcome else int(record.get("eval/episodes", 0))
            wins = int(sum(outcome[0])) if outcome else round(record["eval/success_rate"] * episodes)
            rate = wins / episodes if outcome and episodes else record["eval/success_rate"]
            curve.append({"step": record["step"], "samples": samples_through(config, record["step"]), "success_rate": rate,
                          "success_interval": list(wilson(wins, episodes)), "reward_mean": record["eval/reward_mean"]})
    trained = [r for r in records if r["step"] >= 0 and "reward/mean" in r]
    seeds = eval_seeds(config.seed, config.eval_episodes)
    return {
        "schema": SCHEMA,
        "row": row.name,
        "task": row.task,
        "quick": quick,
        "env": config.env,
        "env_kwargs": config.env_kwargs,
        "eval_env_kwargs": config.eval_env_kwargs,
        "model": config.model if row.warmup is None else "warmup_adapter",
        "base_model": row.training(quick)[1],
        "trainer": config.trainer,
        "recipe": {k: getattr(config, k) for k in ("steps", "batch_size", "group_size", "lr", "lora_rank", "lora_alpha", "max_turns",
                                                   "max_new_tokens", "temperature", "micro_batch_size", "dtype", "kl_coef")},
        "why": row.why,
        "commit": _commit(),
        "machine": machine(),
        "command": command,
        "seeds": {"run": config.seed, "eval_first": seeds[0] if seeds else None, "eval_count": len(seeds),
                  "eval_rule": "tinkergym.trainers.evaluation.eval_seeds(run, count): at or above 2**31; training seeds are below"},
        "evaluation": {"greedy": True, "episodes": config.eval_episodes, "interval": "Wilson score, 95%",
                       "change_interval": "paired bootstrap over episodes, 10,000 resamples, 95% percentile"},
        "warmup": None if row.warmup is None else {**asdict(row.warmup), "steps": _warmup_steps(row_folder)},
        "base": None if base is None else arm(*base),
        "before": arm(*before),
        "after": arm(*after),
        "change": {"success_rate": change, "success_interval": [low, high], "reward_mean": reward_change[0],
                   "reward_interval": [reward_change[1], reward_change[2]]},
        "learns": low > 0,
        "samples": samples_through(config, last_step),
        "tokens_sampled": int(sum(r.get("tokens/sampled", 0) for r in trained)),
        "wall_s": round(wall_s, 1),
        "resumed_from_step": resumed_from,
        "reward_curve": [{"step": r["step"], "samples": samples_through(config, r["step"]), "reward_mean": r["reward/mean"], "train_s": round(s, 2)}
                         for r, s in zip(trained, accumulate(t.get("time/step_s", 0.0) for t in trained))],
        "eval_curve": curve,
    }


def _warmup_steps(row_folder: Path) -> int:
    """The steps the warm-up's SFT run took (from its config)."""
    return TrainConfig.load(row_folder / "warmup" / "config.json").steps


def samples_through(config: TrainConfig, step: int) -> int:
    """Episodes sampled for training through ``step`` (0 before the first)."""
    return (step + 1) * config.batch_size * config.group_size


def _commit() -> dict[str, Any]:
    """The source's git commit and whether the checkout had changes (``None`` outside a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True,
                               timeout=30, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": head, "dirty": dirty}


def machine() -> dict[str, Any]:
    """The machine's facts as the benchmarks record them (CPU, kernels, native precision, GPU) and its float32 matmul rate."""
    import torch

    from tinkergym.backends.torch.machine import machine_facts, matmul_rate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    facts = machine_facts(device)
    rate = matmul_rate(device, "float32", seconds=1.0)
    return {**facts, "device": device, "cores": _cores(), "python": platform.python_version(), "torch": torch.__version__,
            "float32_matmul_gflops": round(rate["matmul_flops"] / 1e9, 1)}


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def write_row_folder(result: dict[str, Any], row_folder: Path, dest: Path) -> None:
    """result.json, the two curves and the final adapter (and the warm-up's, which it is trained on top of) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    base = result["base_model"]  # the short name resolves offline anywhere; a cache path does not
    if result["warmup"] is not None:
        copy_adapter(row_folder / "warmup" / "final", dest / "warmup_adapter", base)
        base = "../warmup_adapter"  # read beside the adapter (tinkergym.backends.models.adapter_base)
    copy_adapter(row_folder / "rl" / "final", dest / "adapter", base)
    plot_curves(result, dest)
    (dest / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def copy_adapter(final: Path, dest: Path, base: str) -> None:
    """A run's exported peft adapter into ``dest`` (replaced), its base model named ``base``."""
    shutil.rmtree(dest, ignore_errors=True)
    if not (final / "adapter_config.json").is_file():
        return
    dest.mkdir()
    for name in ADAPTER_FILES:
        if (final / name).is_file():
            shutil.copy2(final / name, dest / name)
    name_adapter_base(dest, base)


def name_adapter_base(adapter: Path, base: str) -> None:
    """Make ``base`` the base model the peft adapter folder ``adapter`` names (its ``base_model_name_or_path``)."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("base_model_name_or_path") != base:
        config["base_model_name_or_path"] = base
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def plot_curves(result: dict[str, Any], dest: Path) -> None:
    """reward_curve.png (training reward by step and samples) and eval_curve.png (held-out success with intervals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{result['row']}: {result['env']}"
    figure, axis = plt.subplots(figsize=(7, 4))
    points = result["reward_curve"]
    axis.plot([p["samples"] for p in points], [p["reward_mean"] for p in points], marker="o" if len(points) < 30 else None)
    axis.set_xlabel("episodes sampled for training")
    axis.set_ylabel("mean training reward")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    figure.savefig(dest / "reward_curve.png", dpi=100, bbox_inches="tight")
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(7, 4))
    curve = result["eval_curve"]
    x = [p["samples"] for p in curve]
    y = [p["success_rate"] for p in curve]
    below = [max(0.0, p["success_rate"] - p["success_interval"][0]) for p in curve]
    above = [max(0.0, p["success_interval"][1] - p["success_rate"]) for p in curve]
    axis.errorbar(x, y, yerr=[below, above], marker="o", capsize=3)
    axis.set_xlabel("episodes sampled for training")
    axis.set_ylabel(f"held-out success rate ({result['evaluation']['episodes']} greedy episodes)")
    axis.set_ylim(-0.02, 1.02)
    axis.set_title(f"{title} (95% Wilson intervals)")
    axis.grid(alpha=0.3)
    figure.savefig(dest / "eval_curve.png", dpi=100, bbox_inches="tight")
    plt.close(figure)
