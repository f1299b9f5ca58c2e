"""``tinkergym serve model``: the OpenAI-compatible inference server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from tinkergym.cli.common import SafePath
from tinkergym.config import DTYPES
from tinkergym.cli.connection_options import connection_limits, connection_options
from tinkergym.cli.serve.server import METRICS_PORT_OPTION, start_metrics
from tinkergym.plumbing.install import pip_install

ENGINES = ("auto", "torch", "vllm")


def _adapter(value: str, option: str = "--adapter") -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path:
        raise click.BadParameter(f"{value!r}: expected NAME=PATH, e.g. bandit=runs/bandit", param_hint=option)
    return name.strip(), path


def _pick_engine(choice: str) -> str:
    """``torch`` or ``vllm`` for ``--engine`` (``auto``: vllm when it imports); ``vllm`` without vllm is a ConfigError."""
    if choice == "torch":
        return "torch"
    from tinkergym.backends.vllm.sampler import INSTALL_HINT
    from tinkergym.errors import ConfigError

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if choice == "vllm":
            raise ConfigError(f"--engine vllm needs the vllm package, which does not import here ({exc}); {INSTALL_HINT}; or serve with --engine torch") from exc
        return "torch"
    return "vllm"


def read_api_key(path: str) -> str:
    """The server's API key from its file (0600, at least 32 characters), errors naming ``--api-key-file``."""
    from tinkergym.serve.auth import read_token_file
    from tinkergym.errors import ConfigError

    try:
        return read_token_file(path)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--token-file", "--api-key-file")) from exc


def _check_model(model: str) -> None:
    """Exit 69 with one line (:func:`tinkergym.serve.lifetime.environment_faults`) when ``model`` is not available here."""
    from tinkergym.serve.lifetime import EnvironmentFault, environment_faults
    from tinkergym.backends.models import resolve_model
    from tinkergym.errors import ConfigError

    with environment_faults():
        try:
            resolve_model(model)
        except ConfigError as exc:
            raise EnvironmentFault(f"model {model!r} is not available on this machine: {exc}") from exc


@click.command("model")
@click.option("--model", help="Base model to serve (tiny, smollm2-135m, a local HF folder, a hub id); adapters attach to it.")
@click.option("--run", "run_dir", type=SafePath(exists=True, file_okay=False),
              help="A training run folder: its adapter on its base model (named after the folder), or a full fine-tuning run's model.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=PATH",
              help="A LoRA adapter served as NAME: a run folder, a checkpoint (checkpoints/step_N) or an exported adapter folder (repeatable).")
@click.option("--checkpoint", metavar="NAME=PATH",
              help="A checkpoint folder (checkpoints/step_N, with state.json) served as NAME on --model: a LoRA checkpoint as an "
                   "adapter, a full fine-tuning checkpoint as a model of its own.")
@click.option("--api-key-file", type=SafePath(exists=True, dir_okay=False),
              help="File holding the API key clients send as 'Authorization: Bearer KEY' (chmod 600, 32+ characters); required "
                   "unless --scheduler.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), help="Compute dtype (default: the run's, else auto).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, ...")
@click.option("--max-model-len", type=click.IntRange(2), help="Longest prompt plus completion (default: the model's position limit).")
@click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
              help="Who generates: vllm (a vLLM engine; needs vllm installed), torch (TorchBackend, as tinkergym eval computes), "
                   "or auto: vllm where it imports, else torch.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="vllm engine: fraction of GPU memory vLLM may take (default 0.9 on GPU, 0.3 on CPU).")
@click.option("--idle-timeout", type=click.FloatRange(min=0, min_open=True),
              help="Stop (exit code 75) when no request came for this many seconds (/health aside).")
@click.option("--exit-with-parent", is_flag=True, help="Stop (exit code 76) when the process that started this server dies (a worker).")
@click.option("--lease-file", type=SafePath(dir_okay=False, path_type=Path), default=None,
              help="A scheduler's worker renews the lease's deadline in this file; past it every call is refused (401 lease_ended).")
@click.option("--scheduler", metavar="URL",
              help="Serve as a job of a scheduler (tinkergym scheduler serve): a worker's devices serve --model, or the --run the "
                   "scheduler trained; this command prints the endpoint, keeps it alive and ends the job on Ctrl-C.")
@click.option("--api-key", envvar="TINKERGYM_API_KEY", show_envvar=True, help="With --scheduler: the scheduler key (tgk_...); never saved.")
@click.option("--gpus", type=click.IntRange(1, 64), default=1, show_default=True, help="With --scheduler: devices the job needs, all on one worker.")
@click.option("--key-file", type=SafePath(dir_okay=False, path_type=Path),
              help="With --scheduler: where to write the endpoint's key (mode 600; rewritten when the job moves to another "
                   "worker). Default: ~/.cache/tinkergym/jobs/JOB.key.")
@click.option("--detach", is_flag=True,
              help="With --scheduler: print the job's id and exit once it is queued, leaving it to run (until its idle timeout, "
                   "or tinkergym jobs cancel JOB); follow it with tinkergym jobs show JOB. With --key-file too: exit once the "
                   "endpoint answers and its key is written.")
@METRICS_PORT_OPTION
@connection_options
@click.pass_context
def serve_model(
    ctx: click.Context, model: str | None, run_dir: str | None, adapters: tuple[str, ...], checkpoint: str | None, api_key_file: str | None,
    host: str, port: int, dtype: str | None, device: str, max_model_len: int | None, engine: str, gpu_memory_utilization: float | None,
    idle_timeout: float | None, exit_with_parent: bool, lease_file: Path | None, scheduler: str | None, api_key: str | None, gpus: int, key_file: Path | None,
    detach: bool, metrics_port: int, header_timeout: float, body_timeout: float, max_connections: int,
) -> None:
    """Serve a model and its LoRA adapters through an OpenAI-compatible API.

    \b
    Examples:
      tinkergym serve model --run runs/bandit --api-key-file key.txt
      tinkergym serve model --model smollm2-135m --adapter a=runs/a --adapter b=runs/b/checkpoints/step_000009 \\
          --api-key-file key.txt --port 8001
      TINKERGYM_API_KEY=tgk_... tinkergym serve model --scheduler http://scheduler:8780 --run runs/bandit

    Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true included), and
    GET /health without the key. A request's "model" picks the base or an adapter. Evaluate through it with:
    tinkergym eval --endpoint http://127.0.0.1:8000/v1 --model NAME --tokenizer BASE --api-key-file key.txt --env ENV

    Engines: --engine auto (the default) serves with vLLM where vllm imports and with torch elsewhere;
    --engine vllm refuses to start without vllm; --engine torch computes as tinkergym eval does (--device
    applies to it only). Adapter checkpoints are converted to peft folders for vLLM when the server starts.

    With --scheduler the model is served by a worker of the scheduler, as a job: --model names a model the
    workers offer, --run a run trained with train --scheduler (the worker serves its newest checkpoint under
    the run folder's name). The endpoint and its key file are printed once it answers (a JSON line on stdout);
    the command then keeps the server from idling out until Ctrl-C, which ends the job.
    """
    if scheduler:
        given = [f"--{name.replace('_', '-')}" for name in ("adapters", "checkpoint", "api_key_file", "host", "port", "device", "max_model_len",
                                                          "engine", "gpu_memory_utilization", "idle_timeout", "exit_with_parent", "lease_file",
                                                          "header_timeout", "body_timeout", "max_connections")
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{', '.join(given).replace('--adapters', '--adapter')}: the worker sets these where it starts the job's "
                                   "server; with --scheduler give --model or --run, and --dtype, --gpus, --key-file, --detach.")
        from tinkergym.cli.serve.job import serve_through_scheduler

        serve_through_scheduler(scheduler, api_key, model=model, run_dir=run_dir, dtype=dtype, gpus=gpus, key_file=key_file, detach=detach)
        return
    given = [flag for flag, value in (("--key-file", key_file), ("--detach", detach)) if value] + [
        f"--{name.replace('_', '-')}" for name in ("api_key", "gpus") if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)} go with --scheduler URL.")
    if api_key_file is None:
        raise click.UsageError("--api-key-file is required: every route but /health needs the key (or serve through --scheduler URL).")
    from tinkergym.backends.serving import InferenceEngine, plan_serving
    from tinkergym.serve.auth import LeaseFile, token_digest

    key = read_api_key(api_key_file)
    choice, engine = engine, _pick_engine(engine)
    if model is not None:  # a model missing here is this machine's fault (exit 69), not the request's
        _check_model(model)
    plan = plan_serving(model=model, run=run_dir, adapters=[_adapter(a) for a in adapters], dtype=dtype,
                        checkpoint=_adapter(checkpoint, "--checkpoint") if checkpoint else None)
    try:
        import uvicorn

        from tinkergym.serve.inference.app import create_inference_app
        from tinkergym.serve.slow_clients import server_config
    except ImportError as exc:  # this machine's fault, not the request's: exit 69 (a worker gives the job back)
        from tinkergym.serve.lifetime import ENVIRONMENT_EXIT_CODE

        click.echo(f"error: tinkergym serve model needs the serve extra ({exc.name} is missing): {pip_install('serve')}", err=True)
        raise SystemExit(ENVIRONMENT_EXIT_CODE) from exc
    served: InferenceEngine | None = None
    if engine == "vllm":
        from tinkergym.backends.vllm.inference import VLLMInferenceEngine
        from tinkergym.errors import ConfigError

        try:
            served = VLLMInferenceEngine(plan, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization)
        except ConfigError as exc:  # e.g. a head size vLLM's CPU attention lacks: auto falls back, --engine vllm says so
            if choice != "auto":
                raise
            click.echo(f"vLLM cannot serve this ({exc}); serving with the torch engine", err=True)
            engine = "torch"
    if served is None:
        from tinkergym.backends.torch.inference import TorchInferenceEngine

        served = TorchInferenceEngine(plan, device=device, max_model_len=max_model_len)
    names = ", ".join(m.id for m in served.models())
    click.echo(f"serving {names} with the {engine} engine at http://{host}:{port}/v1", err=True)
    from tinkergym.serve.lifetime import Activity, Watchdog

    inner = create_inference_app(served, token_digest(key), lease=LeaseFile(lease_file) if lease_file is not None else None)
    if metrics_port:
        start_metrics(inner.state.metrics, metrics_port)
    app = Activity(inner)
    limits = connection_limits(header_timeout, body_timeout, max_connections)
    server = uvicorn.Server(server_config(app, limits, host=host, port=port, log_level="info", timeout_keep_alive=75))
    watchdog = None
    if idle_timeout is not None or exit_with_parent:
        watchdog = Watchdog(parent_pid=os.getppid() if exit_with_parent else None, idle_timeout=idle_timeout,
                            last_activity=app.last_activity, stop=lambda _code: setattr(server, "should_exit", True)).start()
    try:
        server.run()
    finally:
        if hasattr(served, "close"):
            served.close()
    if watchdog is not None and watchdog.exit_code is not None:
        sys.exit(watchdog.exit_code)
