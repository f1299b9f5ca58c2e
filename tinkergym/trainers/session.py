"""A training run end to end: run folder, backend, trainer plugin, logging, checkpoints, eval and resume.

Run folder layout::

    config.json           the resolved TrainConfig
    metrics.jsonl         one line per step (training metrics, eval metrics beside them at eval steps;
                          with evaluation on, a first line with step -1 evaluates the model before training)
    tensorboard/          TensorBoard events of the same numbers
    learning_curve.png    reward (and eval reward) against step
    checkpoints/step_N/   backend state (weights or adapter, optimizer, RNG) and trainer_state.json (what a
                          stateful trainer's state_dict() returned after step N), written as one folder
    resumes.jsonl         one line per resume: the step it continued from and the settings it changed
    transcripts/          sample episodes as JSONL (train_step_N.jsonl, eval_step_N.jsonl)
    final/                the exported model (adapter or full) that plain transformers / peft load
    timeline.jsonl        spans of each step's phases (see :mod:`tinkergym.plumbing.timeline`; ``tinkergym trace``)

One rule holds for every file: a resume keeps what the steps up to its checkpoint wrote and drops the rest (a step
trained again is logged once, in metrics.jsonl, TensorBoard and timeline.jsonl alike); a new run in a folder that holds
one (``train --overwrite``) first removes every file of the old run (:data:`RUN_FILES`; other files are left) and says
which.

Every random choice of a step is a function of (seed, step) or restored from the checkpoint, so
``resume`` continues exactly: a resumed run logs the same metrics as an uninterrupted one. With
``async_steps`` K > 0 the rollouts sampled ahead and still in flight when a run stops are dropped, not saved: a
resume samples its next K steps again, from the checkpoint's weights where the uninterrupted run used the weights
of K steps before, so it continues from a consistent checkpoint but not bit for bit. A resume may
also extend a run: it may change the settings in :data:`RESUMABLE_FIELDS` (``steps`` above all), none of
which changes what a finished step meant; a finished run given more steps goes on from its last
checkpoint and exports ``final/`` again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

from tinkergym.backends.scheduled import BackendLost
from tinkergym.client import print_stderr
from tinkergym.plumbing import timeline
from tinkergym.errors import ConfigError, NonFiniteError, TinkergymError
from tinkergym.plumbing.folders import complete_checkpoints, latest_checkpoint, replace_dir
from tinkergym.trainers.base import (
    StepOutput,
    TrainerStateError,
    TrainingContext,
    check_async_steps,
    check_trainer_args,
    load_trainer,
    restore_trainer_state,
    trainer_state,
)
from tinkergym.config import TrainConfig, option_name as config_option_name
from tinkergym.trainers.evaluation import eval_rollout_config, eval_seeds, evaluate, transcript_record, write_transcripts
from tinkergym.trainers.reporting import MetricsLog, plot_learning_curve

KEEP_CHECKPOINTS = 2
TRAINER_STATE = "trainer_state.json"

#: Settings a resume may change: how far the run goes, how often it evaluates and checkpoints, and the step
#: size and clipping of the optimizer steps still to run (what a divergence calls for). None of them changes
#: what a finished step meant; every other setting is fixed for the life of a run.
RESUMABLE_FIELDS = ("steps", "eval_every", "eval_episodes", "checkpoint_every", "lr", "max_grad_norm")

#: Config fields that more than one option sets (the field's own and its shorthands).
_OPTION_NAMES = {"trainer_args": "--trainer-arg/--data/--demos", "lora_rank": "--lora-rank/--full"}


class TrainingDiverged(TinkergymError, RuntimeError):
    """The loss became NaN or infinite; the run stopped and the last good checkpoint is kept."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run before it was handed back (its job waited in the queue, or a resume loaded its checkpoint).

    ``folder`` and ``backend`` are the run's, so the caller can end or leave the job the run already holds.
    """

    def __init__(self, folder: Path, backend: Any) -> None:
        super().__init__()
        self.folder, self.backend = folder, backend


def env_factory(env_id: str, kwargs: dict[str, Any], multi_agent: bool = False, latency: float = 0.0, jitter: float = 0.0) -> Callable[[], Any]:
    """A function that makes ``env_id`` (single-agent, or AEC for ``multi_agent``) with ``kwargs``; checks the id now, not mid-run.
    ``latency``/``jitter`` > 0: each env is wrapped in a :class:`~tinkergym.wrappers.LatencyWrapper` (an AEC env in an
    :class:`~tinkergym.wrappers.AECLatencyWrapper`)."""
    import tinkergym
    from tinkergym.registry import make_checked

    env_spec = tinkergym.spec(env_id)
    if multi_agent and env_spec.kind != "aec":
        raise ConfigError(f"{env_id} is a single-agent env; self-play drives multi-agent (AEC) envs such as tinker/GomokuDuel-v0.")
    if not multi_agent and env_spec.kind != "env":
        raise ConfigError(f"{env_id} is a multi-agent env: train it with self-play (--selfplay), or pick a single-agent env (e.g. tinker/Gomoku-v0).")
    make_checked(env_id, kwargs, multi_agent=multi_agent).close()  # fail fast on bad kwargs
    if multi_agent:
        if latency or jitter:
            from tinkergym.wrappers import AECLatencyWrapper

            return lambda: AECLatencyWrapper(tinkergym.make_aec(env_id, **kwargs), delay=latency, jitter=jitter)
        return lambda: tinkergym.make_aec(env_id, **kwargs)
    if latency or jitter:
        from tinkergym.wrappers import LatencyWrapper

        return lambda: LatencyWrapper(tinkergym.make(env_id, **kwargs), delay=latency, jitter=jitter)
    return lambda: tinkergym.make(env_id, **kwargs)


class TrainingRun:
    """One run: ``TrainingRun(config).run()``, or ``TrainingRun.resume(folder).run()``."""

    def __init__(
        self, config: TrainConfig, backend: Any = None, start_step: int = 0, backend_token: str | None = None, api_key: str | None = None,
    ) -> None:
        self.config = config.validate()
        if config.backend_url and backend is None and not backend_token and not (config.backend == "tinker" and os.environ.get("TINKER_API_KEY")):
            raise ConfigError(f"training through the server at {config.backend_url} needs its token: pass --backend-token-file FILE.")
        self._backend_token = backend_token
        self._api_key = api_key
        self.folder = Path(config.out or f"runs/{config.env.split('/')[-1] or 'sft'}-{config.trainer}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.config.out = str(self.folder)
        self.start_step = start_step
        # Unknown trainers, bad env kwargs and an --out that cannot be written all fail before any model is loaded.
        trainer_class = load_trainer(config.trainer)
        check_trainer_args(trainer_class, config.trainer_args, config.trainer)
        check_async_steps(trainer_class, config)
        multi = getattr(trainer_class, "multi_agent", False)
        if multi is None and config.env:  # a trainer for either kind: the env's own
            import tinkergym

            multi = tinkergym.spec(config.env).kind == "aec"
        latency = (config.env_latency, config.env_latency_jitter)
        self.make_env = env_factory(config.env, config.env_kwargs, multi, *latency) if config.env else None
        self.make_eval_env = env_factory(config.env, {**config.env_kwargs, **config.eval_env_kwargs}, multi, *latency) if config.env else None
        created = _make_run_folder(self.folder)
        self.replaced = [] if start_step else clear_run_files(self.folder)
        if self.replaced:
            print_stderr(f"{self.folder} held a run: replaced its {', '.join(self.replaced)}")
        self.timeline = timeline.Timeline()  # the run's spans (see tinkergym.plumbing.timeline), written to the run folder per step
        try:
            with timeline.recording(self.timeline):  # a scheduler job's wait in the queue is a span
                self._build(config, trainer_class, backend, start_step)
            timeline.append_spans(self.folder, self.timeline.take())
        except BaseException as exc:
            if created and not any(self.folder.iterdir()):
                self.folder.rmdir()  # leave no empty run folder behind a run that never started
            if isinstance(exc, KeyboardInterrupt) and getattr(self, "backend", None) is not None:
                raise RunInterrupted(self.folder, self.backend) from exc
            raise

    def _build(self, config: TrainConfig, trainer_class: type, backend: Any, start_step: int) -> None:
        """Backend, renderer and trainer, then config.json and the metrics log in the run folder."""
        preferred = getattr(trainer_class, "default_backend", None)
        if backend is None and preferred and not (config.backend or config.backend_url or config.scheduler_url or config.sampler != "torch"):
            config.backend = preferred  # the trainer's own choice (the league's: shared), saved with the run for --resume
        self.backend = backend if backend is not None else self._build_backend()
        from tinkergym.chat import renderer_for

        if config.scheduler_url and config.scheduler_job != self.backend.job_id:
            config.scheduler_job = self.backend.job_id  # in config.json: --resume reattaches to the job
            config.save(self.folder / "config.json")  # before the wait in the queue, which Ctrl-C may end
        info = self.backend.info()
        if config.backend_url or config.scheduler_url:
            _adopt_server_settings(config, info, resumed=start_step > 0)
        self.renderer = renderer_for(info["tokenizer"])  # a vision-language model's folder renders its images as its image tokens
        local = not (config.backend_url or config.scheduler_url)
        self.ctx = TrainingContext(config, self.backend, self.renderer, self.make_env, make_backend=self._build_backend if local else None)
        self.trainer = trainer_class(self.ctx)
        config.save(self.folder / "config.json")
        self.log = self._metrics_log(start_step - 1 if start_step else None)
        timeline.trim_spans(self.folder, start_step - 1 if start_step else None)

    def _metrics_log(self, keep_through: int | None) -> MetricsLog:
        return MetricsLog(self.folder, keep_through=keep_through, wandb_project=self.config.wandb_project,
                          run_config=self.config.to_dict())

    def _build_backend(self) -> Any:
        """The run's backend, built by its plugin (entry-point group ``tinkergym.backends``; see :func:`backend_name`)."""
        from tinkergym.backends import BackendRequest, build_backend

        return build_backend(BackendRequest(self.config, backend_token=self._backend_token, api_key=self._api_key, name=self.folder.name))

    @classmethod
    def resume(
        cls, folder: str | Path, backend: Any = None, changes: dict[str, Any] | None = None, backend_token: str | None = None,
        api_key: str | None = None,
    ) -> TrainingRun:
        """Continue the run in ``folder`` from its latest checkpoint, with ``changes`` (field -> value) to its config.

        Only :data:`RESUMABLE_FIELDS` may change (see :func:`plan_resume`). The config with the changes is
        saved back to config.json, and resumes.jsonl notes the step the run continued from and what changed.
        A run trained through a server (``backend_url``) continues against the same server, with ``backend_token``.
        """
        plan = plan_resume(folder, changes)
        run = cls(plan.config, backend=backend, start_step=plan.start_step, backend_token=backend_token, api_key=api_key)
        if plan.checkpoint is not None:
            try:
                run.restore(plan.checkpoint)
            except ConfigError:
                if not plan.config.scheduler_url:
                    raise
                # A scheduler job's new server has the checkpoints that reached the artifact store: maybe an older one.
                run.start_step = run._restore_newest_available()
            except KeyboardInterrupt as exc:
                raise RunInterrupted(run.folder, run.backend) from exc
        note = {"step": run.start_step, "changed": {k: list(v) for k, v in plan.changed.items()}, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with (plan.folder / "resumes.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(note) + "\n")
        return run

    def restore(self, checkpoint: Path) -> None:
        """Load a checkpoint: the backend's state, then the trainer's (when the checkpoint holds one)."""
        self.backend.load_state(str(checkpoint))
        _trainer_hook(self.trainer, "load_backends", checkpoint)
        state_file = checkpoint / TRAINER_STATE
        if state_file.is_file():  # checkpoints of older runs and of stateless trainers have none: the trainer stays as built
            restore_trainer_state(self.trainer, json.loads(state_file.read_text(encoding="utf-8"))["state"])

    def run(self, progress: bool = True) -> dict[str, float]:
        """Train from ``start_step`` to ``config.steps``; returns the last step's metrics."""
        from tqdm.auto import tqdm

        c, last = self.config, {}
        if c.eval_every and self.start_step == 0 and self.make_eval_env is not None:
            self.log.write(-1, self.evaluate(-1))  # step -1: the policy before any update, the baseline to beat
        bar = tqdm(total=c.steps, initial=self.start_step, disable=not progress, desc="train", unit="step")
        step = self.start_step
        with timeline.recording(self.timeline):  # every thread's spans (env steps, sampling ahead) go to the run's timeline
            try:
                while True:
                    try:
                        while step < c.steps:
                            last = self._train_step(step)
                            step += 1
                            bar.update(1)
                            bar.set_postfix({k: f"{last[m]:.3g}" for k, m in (("reward", "reward/mean"), ("loss", "loss"), ("tok/s", "tokens/per_s")) if m in last})
                        self.backend.export(str(self.folder / "final"))
                        _trainer_hook(self.trainer, "export_backends", self.folder / "final")
                        complete = getattr(self.backend, "complete", None)
                        if callable(complete):  # a scheduler job: the run is done, its devices are freed now rather than at
                            complete()          # an idle timeout (a lease lost before its last state was stored: recovered below)
                        break
                    except BackendLost:  # a scheduler job whose server went away: the next lease's server takes over
                        step = self._recover()
                        bar.n = step
                        bar.refresh()
            finally:  # an interrupted run still leaves every logged step readable in TensorBoard
                _close_trainer(self.trainer)  # rollouts sampled ahead and still in flight are dropped (a resume samples them again)
                bar.close()
                self.log.close()
                timeline.append_spans(self.folder, self.timeline.take())
        plot_learning_curve(self.folder)
        self.close()
        return last

    def _recover(self) -> int:
        """After :class:`BackendLost`: reconnect to the job's next server, load the newest checkpoint it has; the step to go on from.

        The worker restores the checkpoints the scheduler's artifact store holds; one written just before the
        loss may not have reached it, so older checkpoints are tried in turn. With none, the run starts over.
        """
        while True:
            self.backend.reconnect()
            try:
                step = self._restore_newest_available()
                break
            except BackendLost:  # lost again while loading: wait for the server (or the next one) once more
                continue
        loaded = f"from checkpoint step_{step - 1:06d}" if step else "from the start (the new server has none of its checkpoints)"
        self.backend.say(f"job {self.backend.job_id}: reconnected to its new server (epoch {self.backend.epoch}); redoing step {step} {loaded}")
        return step

    def _restore_newest_available(self) -> int:
        """Load the newest checkpoint whose backend state the server has (older ones in turn); the step to go on from."""
        for checkpoint in reversed(complete_checkpoints(self.folder)):
            try:
                self.restore(checkpoint)
            except ConfigError:  # the new server lacks that state: try an older one
                continue
            step = int(checkpoint.name.split("_")[1]) + 1
            break
        else:
            _close_trainer(self.trainer)
            self.trainer = type(self.trainer)(self.ctx)  # the new server's weights are the base model's
            step = 0
        self.log.close()
        self.log = self._metrics_log(step - 1 if step else None)
        return step

    def _train_step(self, step: int) -> dict[str, float]:
        """One step: train, time it, save transcripts, evaluate, log and checkpoint when due; returns its metrics."""
        c = self.config
        started = time.perf_counter()
        try:
            with timeline.span("step", "step", step=step):
                output: StepOutput = self.trainer.train_step(step)
        except NonFiniteError as exc:
            self._diverged(step, str(exc))
        metrics = dict(output.metrics)
        metrics["time/step_s"] = time.perf_counter() - started
        # Sampled tokens per second where the step samples; trained (loss) tokens per second where it only trains (SFT).
        metrics["tokens/per_s"] = metrics.get("tokens/sampled", metrics.get("tokens", 0.0)) / max(metrics["time/step_s"], 1e-9)
        self._check_finite(step, metrics)
        transcripts = None
        if c.transcripts_every and (step % c.transcripts_every == 0 or step == c.steps - 1) and output.trajectories:
            transcripts = output.trajectories[: c.group_size * 2]
            write_transcripts(self.folder / "transcripts" / f"train_step_{step:06d}.jsonl", transcripts, step=step)
        if c.eval_every and ((step + 1) % c.eval_every == 0 or step == c.steps - 1) and self.make_eval_env is not None:
            with timeline.span("eval", step=step):
                metrics.update(self.evaluate(step))
        self.log.write(step, metrics)
        report = getattr(self.backend, "report_metrics", None)
        if callable(report):  # a scheduler job: its event stream shows the run's progress (tinkergym jobs logs --follow)
            report(step, metrics)
        report_transcripts = getattr(self.backend, "report_transcripts", None)
        if transcripts and callable(report_transcripts):  # ... and the job's page a few of the step's episodes
            report_transcripts(step, [transcript_record(t, episode=i) for i, t in enumerate(transcripts)])
        if (step + 1) % c.checkpoint_every == 0 or step == c.steps - 1:
            with timeline.span("checkpoint", step=step):
                self.checkpoint(step)
        timeline.append_spans(self.folder, self.timeline.take())
        return metrics

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
            "Lower --lr (or keep --max-grad-norm clipping on) and continue from the checkpoint: "
            f"tinkergym train --resume {self.folder} --lr LOWER_LR"
        )

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate on held-out seeds (greedy) and save the transcripts."""
        c = self.config
        own = getattr(self.trainer, "evaluate", None)
        if callable(own):  # e.g. self-play: games against the league's fixed members, on the eval env
            metrics, trajectories = own(step, eval_seeds(c.seed, c.eval_episodes), self.make_eval_env)
        else:
            assert self.make_eval_env is not None  # evaluate runs only for a run with an env (an SFT run on --data alone has none)
            metrics, trajectories = evaluate(self.make_eval_env, self.backend, self.renderer, eval_rollout_config(c), eval_seeds(c.seed, c.eval_episodes))
        write_transcripts(self.folder / "transcripts" / f"eval_step_{step:06d}.jsonl", trajectories, step=step)
        return metrics

    def checkpoint(self, step: int) -> Path:
        """Save the backend's and the trainer's state after ``step`` as one folder; keep the newest few checkpoints.

        Both go into a ``.tmp`` folder (which :func:`latest_checkpoint` skips) that is renamed into place last,
        so a checkpoint is whole or absent, never weights without the trainer state that goes with them.
        """
        checkpoints = self.folder / "checkpoints"
        path = checkpoints / f"step_{step:06d}"
        staging = checkpoints / f"{path.name}.staging.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        self.backend.save_state(str(staging))
        _trainer_hook(self.trainer, "save_backends", staging)
        state = trainer_state(self.trainer)
        if state is not None:
            _write_trainer_state(staging / TRAINER_STATE, self.config.trainer, step, state)
        replace_dir(str(staging), str(path))
        leftovers = [p for p in checkpoints.iterdir() if p.name.endswith(".tmp")]  # of interrupted writes
        for old in leftovers + complete_checkpoints(self.folder)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
        return path


def _adopt_server_settings(config: TrainConfig, info: dict[str, Any], resumed: bool) -> None:
    """Record a training server's model, LoRA settings, micro-batch size and dtype in ``config``: the server's are the run's.

    A resumed run must meet the server it was trained on: other settings there are a :class:`ConfigError`.
    """
    alpha = info.get("lora_alpha")
    served = {"model": info.get("model"), "lora_rank": info.get("lora_rank"),
              "lora_alpha": alpha if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0 else None,
              "lora_dropout": info.get("lora_dropout"), "micro_batch_size": info.get("micro_batch_size")}
    if info.get("dtype") in ("bfloat16", "float32"):
        served["dtype"] = info["dtype"]
    for flag in ("deterministic", "gradient_checkpointing"):
        if isinstance(info.get(flag), bool):
            served[flag] = info[flag]
    served = {k: v for k, v in served.items() if v is not None}
    if resumed:  # what decides whether a checkpoint fits: the model, the adapter's shape, the dtype
        differ = {k: (getattr(config, k), v) for k, v in served.items()
                  if k in ("model", "lora_rank", "dtype") and getattr(config, k) != v and not (k == "dtype" and config.dtype == "auto")}
        if differ:
            shown = ", ".join(f"{k} {theirs!r} (the run trained with {ours!r})" for k, (ours, theirs) in differ.items())
            raise ConfigError(
                f"the training server at {config.backend_url} now serves {shown}; its checkpoints would not fit. "
                "Start the server with the run's model and LoRA rank to continue it."
            )
    for key, value in served.items():
        setattr(config, key, value)
    config.check_types()


def _trainer_hook(trainer: Any, name: str, folder: Path) -> None:
    """Call a trainer's ``save_backends`` / ``load_backends`` / ``export_backends`` (policies beyond the run's backend), if it has one."""
    hook = getattr(trainer, name, None)
    if callable(hook):
        hook(folder)


def _close_trainer(trainer: Any) -> None:
    """Call a trainer's ``close()`` (one that samples ahead stops doing so), if it has one."""
    close = getattr(trainer, "close", None)
    if callable(close):
        close()


#: What a run writes in its folder (see the module docstring); a new run in a folder that holds one removes them first.
RUN_FILES = ("config.json", "metrics.jsonl", "timeline.jsonl", "resumes.jsonl", "learning_curve.png", "tensorboard", "checkpoints",
             "transcripts", "final", "wandb", "wandb_id")


def clear_run_files(folder: Path) -> list[str]:
    """Remove the files and folders of a run (:data:`RUN_FILES`) from ``folder``; the names of those it held. A new run starts
    from an empty layout: no old checkpoint for a later resume to find, no old step in the timeline or the transcripts."""
    removed = []
    for name in RUN_FILES:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _make_run_folder(folder: Path) -> bool:
    """Create a run folder (and its parents); return whether it was created. One that cannot be is a :class:`ConfigError`."""
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        if not folder.is_dir():
            raise ConfigError(f"--out {folder} is a file; a run needs a folder: choose another --out.") from None
        return False
    except OSError as exc:  # no permission, a name too long, a file where a parent folder should be
        raise ConfigError(f"cannot create the run folder {folder}: {exc.strerror or exc}; choose another --out.") from exc
    return True


def _write_trainer_state(path: Path, trainer: str, step: int, state: dict[str, Any]) -> None:
    """Write a trainer's state as JSON; state that JSON cannot hold is an error naming the trainer."""
    try:
        text = json.dumps({"trainer": trainer, "step": step, "state": state}, indent=2)
    except (TypeError, ValueError) as exc:
        raise TrainerStateError(
            f"the {trainer!r} trainer's state_dict() holds something JSON cannot store ({exc}); "
            "return dicts with string keys, lists, strings, numbers, booleans and None."
        ) from exc
    path.write_text(text + "\n", encoding="utf-8")


def option_name(field_name: str) -> str:
    """The command-line option that sets a config field (``eval_every`` -> ``--eval-every``, ``env_kwargs`` -> ``--kwarg``)."""
    return _OPTION_NAMES.get(field_name) or config_option_name(field_name)


@dataclass
class ResumePlan:
    """What resuming a run folder will do: the config it runs with, the step it starts at and what it changed."""

    folder: Path
    config: TrainConfig
    start_step: int
    checkpoint: Path | None
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def nothing_to_do(self) -> bool:
        """Every step is trained and ``final/`` was exported after the last checkpoint, so a resume would change nothing."""
        final = self.folder / "final"
        if self.start_step < self.config.steps or not final.is_dir() or self.checkpoint is None:
            return False
        # An extension interrupted after its last checkpoint leaves an older run's final/: export it again.
        return final.stat().st_mtime_ns >= self.checkpoint.stat().st_mtime_ns


def plan_resume(folder: str | Path, changes: dict[str, Any] | None = None) -> ResumePlan:
    """Check a resume of ``folder`` with ``changes`` (config field -> new value) before any model is loaded.

    Raises :class:`ConfigError` for a folder that holds no run, for a change to a field outside
    :data:`RESUMABLE_FIELDS`, and for ``steps`` below the steps the run has already trained (a resume only
    goes on). ``steps`` equal to them is allowed: nothing is left to train (see :attr:`ResumePlan.nothing_to_do`).
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} is not a run folder (no config.json); pass the --out folder of an earlier run.")
    saved = TrainConfig.load(folder / "config.json")
    saved.out = str(folder)
    old = saved.to_dict()
    config = TrainConfig.from_dict({**old, **(changes or {})})
    changed = {k: (old[k], v) for k, v in config.to_dict().items() if v != old[k]}
    fixed = [k for k in changed if k not in RESUMABLE_FIELDS]
    if fixed:
        refused = ", ".join(f"{option_name(k)} (from {json.dumps(changed[k][0])} to {json.dumps(changed[k][1])})" for k in fixed)
        raise ConfigError(
            f"a resume continues {folder} with the settings it was trained with, so it cannot change {refused}. "
            f"A resume may change only {', '.join(option_name(k) for k in RESUMABLE_FIELDS)}; "
            "to train with other settings, start a new run (another --out)."
        )
    config.validate()
    checkpoint = latest_checkpoint(folder)
    start = 0 if checkpoint is None else checkpoint[0] + 1
    if checkpoint is not None and config.steps < start:  # steps is positive: never fewer than 0
        raise ConfigError(
            f"--steps {config.steps} is fewer than the {start} steps {folder} has already trained (its latest checkpoint is "
            f"{checkpoint[1].name}); a resume only goes on: pass --steps {start} or more, or start a new run to train fewer steps."
        )
    return ResumePlan(folder, config, start, None if checkpoint is None else checkpoint[1], changed)


def load_backend_for_eval(model: str | None = None, run_dir: str | None = None, prefix_cache_mb: float | None = None) -> Any:
    """A backend for evaluation: a model as is, or a run's base model with its latest checkpoint loaded.

    ``prefix_cache_mb``: the sampler's prefix cache (default: the run's own setting, else the backend's default). A
    multi-turn evaluation of many episodes needs one that holds them all, or every turn runs its whole prompt again.
    """
    from tinkergym.backends.models import resolve_model

    if run_dir is None:
        path = resolve_model(model or "smollm2-135m")  # before torch is imported: a bad model fails fast
        from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

        config = TorchBackendConfig(model=path)
        return TorchBackend(config if prefix_cache_mb is None else replace(config, prefix_cache_mb=prefix_cache_mb))
    folder = Path(run_dir)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} is not a run folder (no config.json).")
    c = TrainConfig.load(folder / "config.json").validate()
    if c.backend_url:
        raise ConfigError(
            f"{folder} trained on the training server at {c.backend_url}, which holds its checkpoints; "
            f"the model it exported is in {folder / 'final'}."
        )
    checkpoint = latest_checkpoint(folder)
    if checkpoint is None:
        raise ConfigError(f"{folder} has no checkpoint yet; train it first, or evaluate its base model with --model {c.model}.")
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    backend = TorchBackend(TorchBackendConfig(model=resolve_model(c.model), lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, dtype=c.dtype, seed=c.seed,
                                              prefix_cache_mb=c.prefix_cache_mb if prefix_cache_mb is None else prefix_cache_mb))
    backend.load_state(str(checkpoint[1]))
    return backend
