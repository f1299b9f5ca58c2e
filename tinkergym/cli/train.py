"""``tinkergym train`` and ``tinkergym eval``: parse options into a TrainConfig and run the shared loops."""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import click

from tinkergym.cli.common import SEED, FiniteFloat, InputError, SafePath, parse_kwargs, save_transcripts, writable_file
from tinkergym.cli.settings import SectionedCommand, SectionOption, given, setting_options
from tinkergym.config import MAX_EPISODES, TrainConfig, option_name, setting_of

#: The options of ``train`` made from TrainConfig's fields: each sets the field of its name.
SETTING_OPTIONS = setting_options(TrainConfig)
#: Field names of the options a training server decides (set when it starts), not a client training through it.
_SERVER_OWNED = tuple(f.name for f in fields(TrainConfig) if (found := setting_of(f)) is not None and found.server_owned)


def build_config(options: dict[str, Any], base: Any = None) -> Any:
    """A TrainConfig from ``base`` or ``--config`` (if given) overridden by the options given on the command line.

    ``options`` holds the options the command line gave (:func:`~tinkergym.cli.settings.given`); each of
    :data:`SETTING_OPTIONS` sets its field, a mapping's ``KEY=VALUE`` pairs add to the mapping's keys.
    """
    if base is not None:
        config = TrainConfig.from_dict(base.to_dict())
    else:
        config = TrainConfig.load(options["config"]) if options.get("config") else TrainConfig()
    for param in SETTING_OPTIONS:
        name = param.name
        assert name is not None  # every setting's option is named after its field
        value = options.get(name)
        if value is None or value == ():
            continue
        if isinstance(getattr(config, name), dict):
            value = {**getattr(config, name), **parse_kwargs(value, option_name(name))}
        setattr(config, name, value)
    if options.get("selfplay"):
        if options.get("trainer") not in (None, "selfplay"):
            raise click.UsageError(f"--selfplay is the selfplay trainer; leave out --trainer {options['trainer']}.")
        config.trainer = "selfplay"
    if options.get("full"):
        config.lora_rank = 0
    args = dict(config.trainer_args)
    if options.get("data"):
        args["data_files"] = list(options["data"])
    if options.get("demos"):
        args["demos"] = options["demos"]
    config.trainer_args = args
    from tinkergym.backends import check_backend

    check_backend(config.validate())  # an unknown or contradicting --backend fails before anything loads
    return config


def read_backend_token(options: dict[str, Any]) -> str | None:
    """The token in ``--backend-token-file``, if given (the file must be private to its owner, as the server's)."""
    if not options.get("backend_token_file"):
        return None
    from tinkergym.serve.auth import read_token_file
    from tinkergym.errors import ConfigError

    try:
        return read_token_file(options["backend_token_file"])
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--token-file", "--backend-token-file")) from exc


def _check_token_use(token: str | None, backend_url: str | None) -> None:
    if token is not None and not backend_url:
        raise click.UsageError("--backend-token-file is the token of a training server: give the server with --backend-url URL.")


#: Options a Tinker endpoint takes from its client (``--backend tinker``): the base model and the LoRA rank.
_TINKER_CLIENT_OWNED = ("model", "lora_rank")


def _check_server_owned(options: dict[str, Any], backend_url: str | None) -> None:
    """Refuse model options beside --backend-url: the training server loaded its model with its own (a Tinker endpoint
    takes the base model and LoRA rank from its client)."""
    owned = [k for k in (*_SERVER_OWNED, "full") if not (options.get("backend") == "tinker" and k in _TINKER_CLIENT_OWNED)]
    named = [option_name(k) for k in owned if options.get(k) is not None and options.get(k) is not False]  # 0 is given
    if backend_url and named:
        raise click.UsageError(
            f"{', '.join(named)}: a training server's model is set where the server starts (tinkergym serve backend); "
            "leave these out with --backend-url."
        )


def resume_run(options: dict[str, Any], backend_token: str | None = None) -> Any:
    """The run that ``--resume`` continues, with the options given applied; ``None`` when nothing is left to do.

    Options are read against the run's own config.json: one that leaves its setting as it is passes, one
    that changes a setting outside RESUMABLE_FIELDS is a usage error that lists what a resume may change.
    """
    from tinkergym.errors import ConfigError
    from tinkergym.trainers.session import RESUMABLE_FIELDS, TrainingRun, option_name, plan_resume

    if options.get("config"):
        allowed = ", ".join(option_name(k) for k in RESUMABLE_FIELDS)
        raise ConfigError(f"--config cannot be combined with --resume: a resumed run keeps its own config.json. Pass what may change ({allowed}) as options.")
    saved = plan_resume(options["resume"]).config
    _check_token_use(backend_token, options.get("backend_url") or saved.backend_url)
    wanted = build_config(options, base=saved).to_dict()
    changes = {k: v for k, v in wanted.items() if v != getattr(saved, k)}
    plan = plan_resume(options["resume"], changes)
    if plan.nothing_to_do:
        click.echo(
            f"nothing to do: {plan.folder} has trained all {plan.config.steps} steps and exported final/; "
            f"pass --steps N with N above {plan.config.steps} to train it further.",
            err=True,
        )
        return None
    return TrainingRun.resume(options["resume"], changes=changes, backend_token=backend_token, api_key=options.get("api_key"))


#: The options of ``train`` that set no config field of their own: shorthands (--selfplay, --full, --data, --demos), what
#: the run starts from (--config, --resume), secrets that are never saved, and how the command reports.
COMMAND_LINE_OPTIONS = (
    SectionOption(["--data"], section="Run", multiple=True, type=SafePath(exists=True, dir_okay=False),
                  help="sft: JSONL chat transcripts (repeatable)."),
    SectionOption(["--demos"], section="Run", type=click.Choice(["baseline", "random"]),
                  help="sft: train on demonstrations of the env's baseline agent, or of its random agent (the action format, no strategy)."),
    SectionOption(["--config"], section="Run", type=SafePath(exists=True, dir_okay=False),
                  help="YAML/JSON file of the same settings (keys are the field names: lora_rank, scheduler_url); options override it."),
    SectionOption(["--resume"], section="Run", type=SafePath(exists=True, file_okay=False),
                  help="Continue the run in this folder from its last checkpoint, with its own settings; only --steps, "
                       "--eval-every, --eval-episodes, --checkpoint-every, --lr and --max-grad-norm may change them."),
    SectionOption(["--overwrite"], section="Run", is_flag=True,
                  help="Start a new run in an --out folder that already holds one (its metrics and checkpoints are replaced)."),
    SectionOption(["--full"], section="Model", is_flag=True, help="Train every parameter instead of a LoRA adapter."),
    SectionOption(["--backend-token-file"], section="Remote compute", type=SafePath(dir_okay=False),
                  help="File (mode 600) holding the training server's token; needed with --backend-url and to --resume such a run."),
    SectionOption(["--api-key"], section="Remote compute", envvar="TINKERGYM_API_KEY", show_envvar=True,
                  help="The scheduler key (tgk_...) for --scheduler and to --resume such a run; never saved."),
    SectionOption(["--keep-on-interrupt"], section="Remote compute", is_flag=True,
                  help="With --scheduler: Ctrl-C leaves the job running (reattach with --resume) instead of cancelling it."),
    SectionOption(["--selfplay"], section="Self-play", is_flag=True,
                  help="Self-play on a multi-agent env (e.g. tinker/GomokuDuel-v0): the learner against itself and a rated league."),
    SectionOption(["--quiet"], section="Output", is_flag=True, help="No progress bar."),
    SectionOption(["--json", "as_json"], section="Output", is_flag=True,
                  help="End with one JSON line (the run folder and the last step's reward, loss and eval numbers) instead of a summary."),
    SectionOption(["--metrics-port"], section="Output", type=click.IntRange(0, 65535), default=0, show_default=True,
                  help="Serve the run's Prometheus metrics at http://127.0.0.1:PORT/metrics while it trains: the time of each phase "
                       "(steps, sampling requests, env steps, tool calls and the sandbox's, forward_backward, optim_step); 0: off."),
)


@click.command(cls=SectionedCommand, params=[*SETTING_OPTIONS, *COMMAND_LINE_OPTIONS])
def train(**options: Any) -> None:
    """Train a model on an env with a trainer plugin (LoRA by default, --full for every parameter).

    \b
    Examples:
      tinkergym train --env tinker/Bandit-v0 --steps 30 --out runs/bandit
      tinkergym train --env tinker/Gomoku-v0 --kwarg size=7 --max-turns 8 --full
      tinkergym train --trainer sft --env tinker/Math-v0 --demos baseline --steps 50
      tinkergym train --env tinker/GomokuDuel-v0 --kwarg size=7 --kwarg win_length=4 --selfplay --opponents baseline,random,snapshots
      tinkergym train --resume runs/bandit
      tinkergym train --resume runs/bandit --steps 60       # extend a finished run to 60 steps
      tinkergym train --env tinker/Bandit-v0 --backend-url http://gpu-host:8765 --backend-token-file ~/.tinkergym/token
      tinkergym train --env tinker/MathTool-v0 --async-steps 2 --old-logprobs sampler --env-latency 0.5
      TINKER_API_KEY=tml-... tinkergym train --env tinker/MathTool-v0 --backend tinker --backend-url URL --model NAME --async-steps 1 --old-logprobs sampler
      TINKERGYM_API_KEY=tgk_... tinkergym train --env tinker/Bandit-v0 --scheduler http://scheduler:8780 --out runs/bandit

    A resume continues with the run's own settings. It may change only how far the run goes (--steps: never
    fewer than the steps already trained; as many is nothing to do once final/ is exported, exit 0), how often
    it evaluates and checkpoints (--eval-every, --eval-episodes, --checkpoint-every) and the optimizer
    steps still to run (--lr, --max-grad-norm); any other option that changes a setting exits with code 2.

    With --backend-url the model is the server's: its model, LoRA rank, dtype and micro-batch size are set
    where it starts (tinkergym serve backend) and recorded in the run's config.json; the token is never saved.

    With --async-steps K the rollouts of the next K steps are sampled from snapshots of the weights while a
    step trains, up to K of them at once (--max-episodes-in-flight bounds them); metrics async/* report the
    trained samples' version gap and dropped groups, time/rollout_wait_s the time a step waited for its rollout.

    With --scheduler the run is a job: it waits in the queue (its position is shown), then trains through
    the server a worker starts for it. If that worker dies, the run waits for the job's next lease and goes
    on from its newest checkpoint the new server has; --resume DIR reattaches to the job. Ctrl-C cancels the
    job (--keep-on-interrupt: leaves it running) and says how to resume; a second Ctrl-C exits at once (code 130).
    """
    from tinkergym.cli.interrupts import second_interrupt_exits

    options = given(options, SETTING_OPTIONS)  # a setting left out keeps the config file's (or the resumed run's)
    holder: dict[str, Any] = {}
    with second_interrupt_exits(lambda: _left_behind(holder.get("run"))):
        _train(options, holder)


def _train(options: dict[str, Any], holder: dict[str, Any]) -> None:
    """The train command's work; ``holder["run"]`` is the run once built (what a second Ctrl-C names)."""
    from tinkergym.trainers.reporting import read_metrics
    from tinkergym.trainers.session import RunInterrupted, plan_resume

    token = read_backend_token(options)
    if options.get("keep_on_interrupt") and not (options.get("scheduler_url") or (options["resume"] and plan_resume(options["resume"]).config.scheduler_url)):
        raise click.UsageError("--keep-on-interrupt leaves a scheduler job running: it goes with --scheduler URL (or --resume of such a run).")
    try:
        if options["resume"]:
            run = resume_run(options, token)
        else:
            run = _new_run(options, token)
    except RunInterrupted as exc:
        holder["run"] = exc  # its backend names the job a second Ctrl-C leaves
        _stop_run(exc.folder, exc.backend, options.get("keep_on_interrupt", False))
    holder["run"] = run
    if run is None:  # a finished run with no more steps to train
        folder, last = Path(options["resume"]), {}
    else:
        click.echo(f"run folder: {run.folder}", err=True)
        if options["resume"]:
            click.echo(_resumed_from(run.folder, run.start_step), err=True)
        if options.get("metrics_port"):
            _serve_run_metrics(run, options["metrics_port"])
        from tinkergym.client import JobEnded

        try:
            folder, last = run.folder, run.run(progress=not options["quiet"])
        except KeyboardInterrupt:
            _stop_run(run.folder, run.backend, options.get("keep_on_interrupt", False))
        except JobEnded as exc:  # the run's scheduler job was cancelled (or ended) under it
            raise click.ClickException(f"{exc}. The run folder {run.folder} stays resumable ({_checkpoints_kept(run.folder)}); "
                                       f"go on with: tinkergym train --resume {run.folder} (a new job starts from its checkpoints).") from exc
    records = read_metrics(folder / "metrics.jsonl")
    if not last:  # no step trained now: report the run's last logged step
        last = records[-1] if records else {}
    if options.get("as_json"):
        shown = {k: round(v, 4) for k, v in last.items() if k.startswith(("reward", "loss", "eval/"))}
        click.echo(json.dumps({"run": str(folder), **shown}))
        return
    from tinkergym.cli.summaries import train_summary

    steps = run.config.steps if run is not None else None
    click.echo(train_summary(folder, {**last, "step": records[-1]["step"]} if records else last, steps))


def _resumed_from(folder: Path, start_step: int) -> str:
    """The line that says which checkpoint a resume loaded (the step before ``start_step``), or that it starts over."""
    if start_step == 0:
        return f"resuming {folder} from the start: it has no checkpoint yet"
    name = f"step_{start_step - 1:06d}"
    return f"resuming from checkpoint {name} in {folder / 'checkpoints' / name} (next: step {start_step})"


def _serve_run_metrics(run: Any, port: int) -> None:
    """``--metrics-port``: the run's phases (its timeline's spans) as Prometheus metrics on 127.0.0.1:``port``."""
    try:
        from tinkergym.serve.metrics import PhaseMetrics, ServerMetrics
    except ImportError as exc:
        raise InputError(f"--metrics-port needs prometheus_client: pip install prometheus_client ({exc})") from exc
    from tinkergym.cli.serve.server import start_metrics

    metrics = ServerMetrics("trainer")
    run.timeline.add_listener(PhaseMetrics(metrics).observe)
    start_metrics(metrics, port)


def _new_run(options: dict[str, Any], token: str | None) -> Any:
    """A new :class:`TrainingRun` from the options, after the checks of its run folder and of the options that go together."""
    from tinkergym.trainers.session import TrainingRun

    config = build_config(options)
    if _holds_run(config.out) and not options.get("overwrite"):
        raise InputError(
            f"{config.out} already holds a run. Continue it with: tinkergym train --resume {config.out}; "
            f"or pick another --out; or add --overwrite to start over there (its metrics and checkpoints are replaced)."
        )
    _check_token_use(token, config.backend_url)
    _check_server_owned(options, config.backend_url)
    if options.get("api_key") and not config.scheduler_url:
        raise click.UsageError("--api-key is a scheduler key: give the scheduler with --scheduler URL.")
    return TrainingRun(config, backend_token=token, api_key=options.get("api_key"))


def _stop_run(folder: Path, backend: Any, keep: bool) -> NoReturn:
    """After Ctrl-C: cancel the run's scheduler job (or leave it: ``keep``), say how to go on, and exit with code 130."""
    from tinkergym.cli.interrupts import interrupted, job_outcome, stop_job

    click.echo("", err=True)
    kept = _checkpoints_kept(folder)
    job_id = getattr(backend, "job_id", None)
    if job_id is None:
        getattr(backend, "close", lambda: None)()
        interrupted(f"interrupted: the run folder {folder} stays resumable ({kept}); go on with: tinkergym train --resume {folder}")
    state = stop_job(backend.client, job_id, keep)
    backend.close()
    if keep:
        interrupted(f"interrupted: job {job_id} keeps running ({state}) without a client until its server's idle timeout; "
                    f"reattach with: tinkergym train --resume {folder} (or end it: tinkergym jobs cancel {job_id}). The run folder: {kept}.")
    interrupted(f"interrupted: {job_outcome(job_id, state)}; the run folder {folder} stays resumable ({kept}); "
                f"go on with: tinkergym train --resume {folder} (a new job starts from its checkpoints).")


def _checkpoints_kept(folder: Path) -> str:
    """``its checkpoints are kept (newest: step_000039)``, or that the run has none yet."""
    from tinkergym.plumbing.folders import latest_checkpoint

    checkpoint = latest_checkpoint(folder)
    return f"its checkpoints are kept (newest: {checkpoint[1].name})" if checkpoint else "it has no checkpoint yet"


def _left_behind(holder: Any) -> str:
    """What a second Ctrl-C leaves: the scheduler job of a run (or the eval job itself), if there is one, and how to end it."""
    job_id = getattr(holder, "job_id", None) or getattr(getattr(holder, "backend", None), "job_id", None)
    return f"; job {job_id} may still hold its devices: tinkergym jobs cancel {job_id}" if job_id else ""


def _holds_run(out: str) -> bool:
    """Whether ``out`` already holds a run (its config.json); a path that cannot be read is left to the run to report."""
    try:
        return (Path(out) / "config.json").is_file()
    except OSError:
        return False


@click.command("eval")
@click.option("--env", required=True, help="Env id to evaluate on.")
@click.option("--model", help="Model to evaluate (smollm2-135m, tiny, a local folder).")
@click.option("--run", "run_dir", type=SafePath(exists=True, file_okay=False), help="A training run folder: evaluates its latest checkpoint.")
@click.option("--episodes", type=click.IntRange(1, MAX_EPISODES), default=32, show_default=True)
@click.option("--kwarg", "kwargs", multiple=True, metavar="KEY=VALUE", help="Env keyword argument (repeatable).")
@click.option("--max-turns", type=click.IntRange(1), default=4, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--temperature", type=FiniteFloat(0, 100), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0, show_default=True, help="Nucleus sampling (1 = off).")
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="Top-k sampling (0 = off).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--out", "out", type=SafePath(dir_okay=False, path_type=Path), help="Write transcripts to this JSONL file.")
@click.option("--endpoint", metavar="URL",
              help="Evaluate a served model through its OpenAI-compatible /v1/completions (token ids in and out; "
                   "tinkergym serve model or vLLM); --model is then the served model's name.")
@click.option("--tokenizer", help="With --endpoint: the local model (name or folder) whose tokenizer and chat template the served "
                                  "model uses, e.g. the base model, or a run's final/ folder (default: the files the server sends, "
                                  "which tinkergym serve model does).")
@click.option("--api-key-file", type=SafePath(exists=True, dir_okay=False), help="With --endpoint: file holding the server's API key.")
@click.option("--scheduler", metavar="URL",
              help="Evaluate on a scheduler's worker: an eval job serves --model (a model the workers offer) or --run (a run trained "
                   "with --scheduler); the envs run here. The job ends with the evaluation.")
@click.option("--api-key", envvar="TINKERGYM_API_KEY", show_envvar=True, help="With --scheduler: the scheduler key (tgk_...); never saved.")
@click.option("--gpus", type=click.IntRange(1, 64),
              help="With --scheduler: devices the eval job needs (default 1; an eval job uses one today and the scheduler refuses more).")
@click.option("--opponent", "opponents", multiple=True, metavar="NAME",
              help="Multi-agent envs: play --run/--model against this opponent, seats alternating (repeatable): baseline, random, "
                   "snapshot:N (a self-play run's snapshot) or run:DIR. Prints win/draw/loss and a rating table.")
@click.option("--keep-on-interrupt", is_flag=True, help="With --scheduler: Ctrl-C leaves the eval job running instead of cancelling it.")
@click.option("--batch-size", type=click.IntRange(1, MAX_EPISODES), default=64, show_default=True,
              help="Episodes played at once (one decode batch). Ctrl-C keeps the batches that ended: --out gets their transcripts.")
@click.option("--prefix-cache-mb", type=FiniteFloat(0),
              help="A local model's prefix cache in MiB (default: the run's setting with --run, else 1024). A multi-turn env needs "
                   "one that holds a batch's episodes, or every turn runs its whole prompt again.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as one JSON line instead of a summary.")
def eval_command(
    env: str, model: str | None, run_dir: str | None, episodes: int, kwargs: tuple[str, ...], max_turns: int,
    max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int, out: Path | None,
    endpoint: str | None, tokenizer: str | None, api_key_file: str | None, scheduler: str | None, api_key: str | None, gpus: int | None,
    opponents: tuple[str, ...] = (), keep_on_interrupt: bool = False, batch_size: int = 64, prefix_cache_mb: float | None = None,
    quiet: bool = False, as_json: bool = False,
) -> None:
    """Evaluate a model (or a run's latest checkpoint, or a served model) on an env: success rate, mean reward, transcripts.

    \b
    Examples:
      tinkergym eval --env tinker/Bandit-v0 --run runs/bandit --episodes 64
      tinkergym eval --env tinker/Bandit-v0 --endpoint http://127.0.0.1:8000/v1 --model bandit --api-key-file key.txt
      TINKERGYM_API_KEY=tgk_... tinkergym eval --env tinker/Bandit-v0 --run runs/bandit --scheduler http://scheduler:8780
      tinkergym eval --env tinker/GomokuDuel-v0 --kwarg size=7 --kwarg win_length=4 --run runs/duel --opponent baseline --opponent snapshot:10

    Through --endpoint the same rollout loop renders prompts with the chat template of --tokenizer (or of the
    tokenizer files the server sends) and sends them as token ids; the server must return the sampled token
    ids (a server that answers with text only is refused). --scheduler does the same through a job's server.
    A bar on stderr shows the episodes done and the mean reward so far (--quiet: none). Ctrl-C cancels a
    --scheduler job (--keep-on-interrupt: leaves it running); a second Ctrl-C exits at once (code 130). The
    episodes of the batches that ended before Ctrl-C are kept: their transcripts go to --out, their metrics to stdout.
    The metrics are a summary line (--json: one JSON line).
    """
    if endpoint is None and (tokenizer or api_key_file):
        raise click.UsageError("--tokenizer and --api-key-file go with --endpoint.")
    from_command_line = click.get_current_context().get_parameter_source("api_key") is click.core.ParameterSource.COMMANDLINE
    if scheduler is None and ((api_key and from_command_line) or gpus or keep_on_interrupt):
        raise click.UsageError("--api-key, --gpus and --keep-on-interrupt go with --scheduler URL.")
    if endpoint is not None and (not model or run_dir or scheduler):
        raise click.UsageError("--endpoint needs --model (the served model's name), and no --run or --scheduler.")
    if bool(model) == bool(run_dir):
        raise click.UsageError("give --model or --run (exactly one).")
    if prefix_cache_mb is not None and (endpoint or scheduler):
        raise click.UsageError("--prefix-cache-mb sets a local model's sampler: leave it out with --endpoint or --scheduler (the server sets its own).")
    writable_file(out, "--out")
    if opponents:
        if endpoint or scheduler:
            raise click.UsageError("--opponent plays a local model: leave out --endpoint and --scheduler.")
        from tinkergym.cli.matches import eval_matches

        eval_matches(env, model, run_dir, opponents, episodes, parse_kwargs(kwargs), max_turns, max_new_tokens, temperature, seed, out,
                     as_json=as_json)
        return
    from tinkergym.cli.interrupts import second_interrupt_exits
    from tinkergym.rollouts import RolloutConfig
    from tinkergym.trainers.session import env_factory

    make_env = env_factory(env, parse_kwargs(kwargs))
    settings = RolloutConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    held: dict[str, Any] = {"done": []}  # the eval job, once submitted; the episodes of the batches that ended
    with second_interrupt_exits(lambda: _left_behind(held.get("job"))):
        try:
            _evaluate(make_env, settings, seed, episodes, batch_size, prefix_cache_mb, quiet, model, run_dir, endpoint, tokenizer,
                      api_key_file, scheduler, api_key, gpus, held)
        except KeyboardInterrupt:
            _stop_eval(held.get("job"), keep_on_interrupt, _keep_episodes(held["done"], out, env, episodes, as_json))
    _keep_episodes(held["done"], out, env, episodes, as_json)


def _keep_episodes(trajectories: list[Any], out: Path | None, env: str, episodes: int, as_json: bool = False) -> str:
    """Write the episodes played (their transcripts to ``out``, their metrics to stdout: a summary, or JSON with ``as_json``);
    what was kept, in words."""
    from tinkergym.cli.summaries import eval_summary
    from tinkergym.trainers.evaluation import summarize

    if not trajectories:
        return "nothing was written"
    save_transcripts(out, trajectories, env)
    metrics = {k.removeprefix("eval/"): round(v, 4) for k, v in summarize(trajectories).items()}
    click.echo(json.dumps({"env": env, **metrics}) if as_json else eval_summary(env, metrics))
    sys.stdout.flush()
    where = f"their transcripts are in {out}, " if out is not None else ""
    return f"the {len(trajectories)} of {episodes} episodes that ended are kept ({where}their metrics on stdout)"


def _evaluate(
    make_env: Any, settings: Any, seed: int, episodes: int, batch_size: int, prefix_cache_mb: float | None, quiet: bool, model: str | None,
    run_dir: str | None, endpoint: str | None, tokenizer: str | None, api_key_file: str | None, scheduler: str | None, api_key: str | None,
    gpus: int | None, held: dict[str, Any],
) -> None:
    """The evaluation of ``eval`` through its backend (a local model, an endpoint, or a scheduler job held in ``held["job"]``);
    the episodes into ``held["done"]``, a batch at a time."""
    from tinkergym.chat import renderer_for
    from tinkergym.trainers.evaluation import eval_seeds, play
    from tinkergym.trainers.session import load_backend_for_eval

    job = None
    try:
        if scheduler is not None:
            backend, job = _scheduled_endpoint(scheduler, api_key, model, run_dir, gpus or 1, held)
        elif endpoint is not None:
            from tinkergym.backends.endpoint_sampler import EndpointSampler, read_api_key_file, resolve_tokenizer

            key = read_api_key_file(api_key_file) if api_key_file else None
            assert model is not None  # eval refuses --endpoint without --model
            backend = EndpointSampler(endpoint, model, api_key=key, tokenizer=resolve_tokenizer(tokenizer) if tokenizer else None)
            if tokenizer is None:
                backend.fetch_tokenizer()
            backend.check()
        else:
            backend = load_backend_for_eval(model=model, run_dir=run_dir, prefix_cache_mb=prefix_cache_mb)
            click.echo(_evaluated_model(model, run_dir, getattr(backend, "model_path", None)), err=True)
        renderer = renderer_for(backend.info()["tokenizer"])
        for batch in play(make_env, backend, renderer, settings, eval_seeds(seed, episodes), batch_size, progress=not quiet):
            held["done"].extend(batch)
    except KeyboardInterrupt:
        raise  # the job is the caller's to cancel or leave
    except BaseException:
        if job is not None:
            click.echo(f"job {job.job_id}: {job.end()}", err=True)
        raise
    if job is not None:
        click.echo(f"job {job.job_id}: {job.end()}", err=True)


def _evaluated_model(model: str | None, run_dir: str | None, path: Any) -> str:
    """The line that says what a local evaluation loaded: a run's latest checkpoint (the one :func:`load_backend_for_eval`
    loads), or the model and its folder (``path``)."""
    from tinkergym.plumbing.folders import latest_checkpoint

    checkpoint = latest_checkpoint(Path(run_dir)) if run_dir is not None else None
    if checkpoint is not None:
        return f"evaluating checkpoint {checkpoint[1].name} of {run_dir} ({checkpoint[1]})"
    return f"evaluating {model or run_dir}" + (f" ({path})" if path else "")


def _stop_eval(job: Any, keep: bool, kept: str) -> NoReturn:
    """After Ctrl-C in ``eval``: cancel its scheduler job (or leave it: ``keep``), say so and what was ``kept``, and exit
    with code 130."""
    from tinkergym.cli.interrupts import interrupted, job_outcome, stop_job

    click.echo("", err=True)
    if job is None:
        interrupted(f"interrupted: the evaluation stopped; {kept}.")
    state = stop_job(job.client, job.job_id, keep)
    if keep:
        interrupted(f"interrupted: the evaluation stopped; {kept}; job {job.job_id} keeps running ({state}) until its server's idle "
                    f"timeout (end it: tinkergym jobs cancel {job.job_id}).")
    interrupted(f"interrupted: the evaluation stopped; {kept}; {job_outcome(job.job_id, state)}.")


def _scheduled_endpoint(
    scheduler: str, api_key: str | None, model: str | None, run_dir: str | None, gpus: int, held: dict[str, Any],
) -> tuple[Any, Any]:
    """An eval job's server as an :class:`EndpointSampler` (its tokenizer fetched), and the job (to end when done)."""
    from tinkergym.backends.endpoint_sampler import EndpointSampler
    from tinkergym.client import SchedulerClient
    from tinkergym.backends.inference_jobs import InferenceJob, job_config, served_name

    client = SchedulerClient(scheduler, api_key)
    name = served_name(run_dir) if run_dir else model
    assert name is not None  # eval takes exactly one of --model and --run
    job = InferenceJob.submit(client, job_config(model=model, run_dir=run_dir), kind="eval", gpus=gpus, name=f"eval {name}",
                              say=lambda line: click.echo(line, err=True))
    held["job"] = job
    try:
        endpoint = job.wait()
        click.echo(f"job {job.job_id}: evaluating {name} at {endpoint.url}", err=True)
        backend = EndpointSampler(endpoint.url, name, api_key=endpoint.key)
        backend.fetch_tokenizer()
        backend.check()
    except Exception:
        click.echo(f"job {job.job_id}: {job.end()}", err=True)
        raise
    return backend, job
