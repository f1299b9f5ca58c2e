"""A training run end to end: run folder, backend, trainer plugin, logging, checkpoints, eval and resume.

Run folder layout::

    config.json           the resolved TrainConfig
    metrics.jsonl         one line per step (training metrics, eval metrics beside them at eval steps;
                          with evaluation on, a first line with step -1 evaluates the model before training)
    tensorboard/          TensorBoard events of the same numbers
    learning_curve.png    reward (and eval reward) against step
    checkpoints/step_N/   backend state (weights or adapter, optimizer, RNG) + trainer position
    transcripts/          sample episodes as JSONL (train_step_N.jsonl, eval_step_N.jsonl)
    final/                the exported model (adapter or full) that plain transformers / peft load

Every random choice of a step is a function of (seed, step) or restored from the checkpoint, so
``resume`` continues exactly: a resumed run logs the same metrics as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from tinkergym.errors import ConfigError, NonFiniteError, TinkergymError
from tinkergym.trainers.base import StepOutput, TrainingContext, load_trainer
from tinkergym.trainers.config import TrainConfig
from tinkergym.trainers.evaluation import eval_seeds, evaluate, write_transcripts
from tinkergym.trainers.reporting import MetricsLog, plot_learning_curve

KEEP_CHECKPOINTS = 2


class TrainingDiverged(TinkergymError, RuntimeError):
    """The loss became NaN or infinite; the run stopped and the last good checkpoint is kept."""


def env_factory(env_id: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A function that makes ``env_id`` (single-agent) with ``kwargs``; checks the id now, not mid-run."""
    import tinkergym

    env_spec = tinkergym.spec(env_id)
    if env_spec.kind != "env":
        raise ConfigError(f"{env_id} is a multi-agent env; training drives single-agent envs (e.g. tinker/Gomoku-v0).")
    tinkergym.make(env_id, **kwargs).close()  # fail fast on bad kwargs
    return lambda: tinkergym.make(env_id, **kwargs)


class TrainingRun:
    """One run: ``TrainingRun(config).run()``, or ``TrainingRun.resume(folder).run()``."""

    def __init__(self, config: TrainConfig, backend: Any = None, start_step: int = 0) -> None:
        self.config = config.validate()
        self.folder = Path(config.out or f"runs/{config.env.split('/')[-1] or 'sft'}-{config.trainer}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.config.out = str(self.folder)
        self.start_step = start_step
        trainer_class = load_trainer(config.trainer)  # unknown names fail before any model is loaded
        self.make_env = env_factory(config.env, config.env_kwargs) if config.env else None
        self.make_eval_env = env_factory(config.env, {**config.env_kwargs, **config.eval_env_kwargs}) if config.env else None
        self.backend = backend if backend is not None else self._build_backend()
        from tinkergym.chat import ChatTemplateRenderer

        self.renderer = ChatTemplateRenderer(self.backend.info()["tokenizer"])
        self.ctx = TrainingContext(config, self.backend, self.renderer, self.make_env)
        self.trainer = trainer_class(self.ctx)
        self.folder.mkdir(parents=True, exist_ok=True)
        config.save(self.folder / "config.json")
        self.log = MetricsLog(self.folder, keep_through=start_step - 1 if start_step else None)

    def _build_backend(self) -> Any:
        from tinkergym.backends.models import resolve_model
        from tinkergym.backends.torch_backend import TorchBackend, TorchBackendConfig

        c = self.config
        if c.sampler == "vllm":
            from tinkergym.backends.vllm_sampler import require_vllm

            require_vllm()  # before the model loads: a missing vLLM is a quick, clear error
        backend = TorchBackend(
            TorchBackendConfig(
                model=resolve_model(c.model), lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                dtype=c.dtype, micro_batch_size=c.micro_batch_size, seed=c.seed,
            )
        )
        if c.sampler != "vllm":
            return backend
        from tinkergym.backends.vllm_sampler import VLLMBackend

        # Room for the whole episode: the rollout loop stops at max_context, plus one turn of new tokens.
        return VLLMBackend(backend, max_model_len=c.max_context + c.max_new_tokens, seed=c.seed)

    @classmethod
    def resume(cls, folder: str | Path, backend: Any = None) -> "TrainingRun":
        """Continue the run in ``folder`` from its latest checkpoint."""
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{folder} is not a run folder (no config.json); pass the --out folder of an earlier run.")
        config = TrainConfig.load(folder / "config.json")
        config.out = str(folder)
        checkpoint = latest_checkpoint(folder)
        run = cls(config, backend=backend, start_step=0 if checkpoint is None else checkpoint[0] + 1)
        if checkpoint is not None:
            run.backend.load_state(str(checkpoint[1]))
        return run

    def run(self, progress: bool = True) -> dict[str, float]:
        """Train from ``start_step`` to ``config.steps``; returns the last step's metrics."""
        from tqdm.auto import tqdm

        c, last = self.config, {}
        if c.eval_every and self.start_step == 0 and self.make_eval_env is not None:
            self.log.write(-1, self.evaluate(-1))  # step -1: the policy before any update, the baseline to beat
        bar = tqdm(range(self.start_step, c.steps), initial=self.start_step, total=c.steps, disable=not progress, desc="train", unit="step")
        for step in bar:
            started = time.perf_counter()
            try:
                output: StepOutput = self.trainer.train_step(step)
            except NonFiniteError as exc:
                self._diverged(step, str(exc))
            metrics = dict(output.metrics)
            metrics["time/step_s"] = time.perf_counter() - started
            metrics["tokens/per_s"] = metrics.get("tokens/sampled", 0.0) / max(metrics["time/step_s"], 1e-9)
            self._check_finite(step, metrics)
            if c.transcripts_every and (step % c.transcripts_every == 0 or step == c.steps - 1) and output.trajectories:
                write_transcripts(self.folder / "transcripts" / f"train_step_{step:06d}.jsonl", output.trajectories[: c.group_size * 2], step=step)
            if c.eval_every and ((step + 1) % c.eval_every == 0 or step == c.steps - 1):
                metrics.update(self.evaluate(step))
            self.log.write(step, metrics)
            if (step + 1) % c.checkpoint_every == 0 or step == c.steps - 1:
                self.checkpoint(step)
            bar.set_postfix({k: f"{metrics[m]:.3g}" for k, m in (("reward", "reward/mean"), ("loss", "loss"), ("tok/s", "tokens/per_s")) if m in metrics})
            last = metrics
        self.log.close()
        plot_learning_curve(self.folder)
        self.backend.export(str(self.folder / "final"))
        self.close()
        return last

    def close(self) -> None:
        """Release what the backend holds beyond this process's memory (a vLLM engine); safe to call twice."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

    def _check_finite(self, step: int, metrics: dict[str, float]) -> None:
        bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v) and k.startswith(("loss", "grad")))
        if bad:
            self._diverged(step, f"{', '.join(bad)} became non-finite")

    def _diverged(self, step: int, what: str) -> None:
        kept = latest_checkpoint(self.folder)
        where = f"the last good checkpoint is {kept[1]}" if kept else "no checkpoint had been written yet"
        self.log.close()
        raise TrainingDiverged(
            f"step {step}: {what}; the run stopped and {where}. "
            "Lower --lr (or keep --max-grad-norm clipping on) and continue from the checkpoint with --resume."
        )

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate on held-out seeds (greedy) and save the transcripts."""
        from tinkergym.rollouts import RolloutConfig

        c = self.config
        settings = RolloutConfig(max_turns=c.max_turns, max_new_tokens=c.max_new_tokens, max_context=c.max_context, temperature=0.0, seed=c.seed)
        metrics, trajectories = evaluate(self.make_eval_env, self.backend, self.renderer, settings, eval_seeds(c.seed, c.eval_episodes))
        write_transcripts(self.folder / "transcripts" / f"eval_step_{step:06d}.jsonl", trajectories, step=step)
        return metrics

    def checkpoint(self, step: int) -> Path:
        """Save the backend state for ``step``; keep the newest few checkpoints."""
        path = self.folder / "checkpoints" / f"step_{step:06d}"
        self.backend.save_state(str(path))
        for old in sorted((self.folder / "checkpoints").glob("step_*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
        return path


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint of a run folder as (step, path)."""
    found = sorted((folder / "checkpoints").glob("step_*")) if (folder / "checkpoints").is_dir() else []
    found = [p for p in found if p.is_dir() and not p.name.endswith(".tmp")]
    return (int(found[-1].name.split("_")[1]), found[-1]) if found else None


def load_backend_for_eval(model: str | None = None, run_dir: str | None = None) -> Any:
    """A backend for evaluation: a model as is, or a run's base model with its latest checkpoint loaded."""
    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch_backend import TorchBackend, TorchBackendConfig

    if run_dir is None:
        return TorchBackend(TorchBackendConfig(model=resolve_model(model or "smollm2-135m")))
    folder = Path(run_dir)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} is not a run folder (no config.json).")
    c = TrainConfig.load(folder / "config.json")
    backend = TorchBackend(TorchBackendConfig(model=resolve_model(c.model), lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, dtype=c.dtype, seed=c.seed))
    checkpoint = latest_checkpoint(folder)
    if checkpoint is None:
        raise ConfigError(f"{folder} has no checkpoint yet.")
    backend.load_state(str(checkpoint[1]))
    return backend
