"""``tinkergym serve tinker``: the Tinker API (the ``tinker`` SDK's REST API) on one machine, or in front of a scheduler's cluster."""

from __future__ import annotations

from pathlib import Path

import click

from tinkergym.cli.common import InputError, SafePath
from tinkergym.cli.connection_options import connection_limits, connection_options, is_loopback
from tinkergym.cli.scheduler.database import data_dir_option, db_option, open_database
from tinkergym.cli.serve.server import HOST_OPTION, METRICS_PORT_OPTION, device_options, request_logger, run_server
from tinkergym.config import DEFAULT_MICRO_BATCH_SIZE
from tinkergym.plumbing.install import pip_install


@click.command("tinker")
@click.option("--model", default=None, help="The base model served here: a name (tiny, smollm2-135m, a hub id) or a folder on this machine.")
@click.option("--scheduler", "scheduler_url", default=None, metavar="URL",
              help="Instead of --model: the front door of this scheduler's cluster; every run and sampler is a job on its workers.")
@click.option("--offer", "offers", multiple=True, metavar="MODEL[=TOKENIZER]",
              help="With --scheduler: a model the workers serve (a name jobs ask for), and the tokenizer clients load for it "
                   "(a hub id or a folder they can read; default: the model's folder on this machine for tiny, smollm2-135m or a "
                   "folder, a hub id as is, else the name, with a warning). Repeat for several.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=8, show_default=True,
              help="With --scheduler: optimizer steps between the states a run saves, from which a run moved to another worker replays.")
@click.option("--model-name", default=None,
              help="The name clients ask for (create_lora_training_client(base_model=...)); default: --model.")
@click.option("--tokenizer-id", default=None,
              help="What get_info answers as the tokenizer (the SDK loads it with AutoTokenizer): a hub id or a folder the clients can read "
                   "(default: the model's folder on this machine).")
@device_options
@click.option("--micro-batch-size", type=click.IntRange(min=1), default=DEFAULT_MICRO_BATCH_SIZE, show_default=True,
              help="Rows per training or scoring pass, across training runs (bounds the activations' memory).")
@click.option("--max-sample-batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Sequences decoded together, across runs and samplers (bounds the KV cache's memory, and the longest another "
                   "run's call waits behind a huge sample call: one such batch).")
@click.option("--pass-tokens", type=click.IntRange(min=1), default=65536, show_default=True,
              help="Tokens of one round of calls across runs and samplers; a larger call is worked in slices (decode batches, "
                   "micro-batches) over several rounds, with other runs' calls between them.")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=64, show_default=True, help="The largest LoRA rank a client may ask for.")
@click.option("--max-sessions", type=click.IntRange(min=2), default=64, show_default=True,
              help="Adapters held at once (training runs and samplers, of every tenant).")
@click.option("--memory-budget-mb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Memory for the adapters, their gradients and optimizer states (0: no bound); past it a new run is refused with the figures.")
@click.option("--max-runs-per-tenant", type=click.IntRange(min=1), default=8, show_default=True, help="Training runs one tenant holds at once.")
@click.option("--max-samplers-per-tenant", type=click.IntRange(min=1), default=32, show_default=True,
              help="Samplers one tenant holds at once; a new one past it closes the tenant's oldest (an RL loop's spent snapshots).")
# tinkergym.tinker_api.service's Limits.session_timeout_s, and three of SDK_HEARTBEAT_S (not imported here: it imports torch)
@click.option("--session-timeout", type=click.FloatRange(min=30), default=180.0, show_default=True,
              help="Seconds without a heartbeat after which a client's session ends (checked every 30 s): its runs and samplers are "
                   "freed (with --scheduler, their jobs end and free their seats, the reason in `tinkergym jobs show`); their saved "
                   "states are kept. The SDK sends a heartbeat every 10 s while its ServiceClient lives, busy or idle: only a client "
                   "that is gone (killed, or a script that ended without close()) comes near it.")
@click.option("--gather-ms", type=click.FloatRange(min=0, max=1000), default=2.0, show_default=True,
              help="Before a pass, wait until no call came for this long (at most ten times it), so several runs' calls share it.")
@click.option("--sample-gather-ms", type=click.FloatRange(min=0, max=1000), default=50.0, show_default=True,
              help="The same for a pass of sampling and scoring requests only: a client's concurrent requests (a rollout's "
                   "prompts) arrive tens of ms apart and then decode as one batch. 0 starts at once (lowest latency of one request).")
@HOST_OPTION
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@METRICS_PORT_OPTION
@click.option("--run-dir", type=SafePath(file_okay=False, path_type=Path), required=True,
              help="Folder for runs/<id>/{states,exports} (the tinker:// checkpoints) and server.log.")
@db_option
@data_dir_option
@connection_options
def serve_tinker(
    model: str | None, scheduler_url: str | None, offers: tuple[str, ...], checkpoint_every: int, model_name: str | None, tokenizer_id: str | None, dtype: str, device: str, micro_batch_size: int, max_sample_batch: int,
    pass_tokens: int, max_lora_rank: int,
    max_sessions: int, memory_budget_mb: float, max_runs_per_tenant: int, max_samplers_per_tenant: int, session_timeout: float,
    gather_ms: float, sample_gather_ms: float, host: str, port: int, metrics_port: int, run_dir: Path, db: str | None, data_dir: Path, header_timeout: float, body_timeout: float, max_connections: int,
) -> None:
    """Serve the Tinker API, so the tinker SDK and tinker-cookbook train and sample LoRA adapters of one base model here.

    Clients connect with tinker.ServiceClient(base_url="http://HOST:PORT") and TINKER_API_KEY=tml-<key>, where
    <key> is a tinkergym key made on this machine by `tinkergym scheduler keys create` on the same database (--db
    or --data-dir): each key's tenant reaches only its own training runs, samplers and checkpoints. Every training
    run is a LoRA adapter on the one base model loaded here, and the calls of several runs share passes.

    With --scheduler URL (and --offer for each model), it is the cluster's front door instead: it loads no model;
    each training run and sampler is a job submitted in the name of the client's key, on a worker's shared server,
    and a run whose worker dies goes on on another from its last stored state, its calls since replayed.

    \b
    Example:
      tinkergym scheduler keys create --tenant alice --scopes read,write --data-dir tinker-data > alice.key
      tinkergym serve tinker --model smollm2-135m --data-dir tinker-data --run-dir tinker-runs --port 8000
      TINKER_API_KEY=tml-$(cat alice.key) python -c "import tinker; print(tinker.ServiceClient(base_url='http://127.0.0.1:8000').get_server_capabilities())"
    """
    from tinkergym.errors import ConfigError
    from tinkergym.serve.lifetime import EnvironmentFault, environment_faults

    try:
        import tinker  # noqa: F401 - the SDK's types and protobuf schema are the wire
    except ImportError as exc:
        raise InputError(f"tinkergym serve tinker speaks the tinker SDK's own types (tinker==0.38.0): {pip_install('tinker')}") from exc
    if (model is None) == (scheduler_url is None):
        both = "not both" if model is not None else "one of them"
        raise InputError(f"give --model MODEL (serve it here) or --scheduler URL with --offer MODEL (the cluster's front door): {both}")
    if scheduler_url is None and offers:
        raise InputError("--offer names the models of a cluster: give --scheduler URL too, or serve one model here with --model")
    if scheduler_url is not None and not offers:
        raise InputError("--scheduler needs the models its workers serve: --offer MODEL[=TOKENIZER] (repeat for several)")
    if not is_loopback(host):
        click.echo(f"warning: listening on {host}: keys and data travel unencrypted unless a TLS proxy is in front.", err=True)
    engine = open_database(db, data_dir)
    if scheduler_url is not None:
        from tinkergym.plumbing.urls import check_scheduler_url
        from tinkergym.tinker_api.cluster import offered_tokenizer
        from tinkergym.tinker_api.server import create_front_door

        offered = {}
        for offer in offers:
            name, given, tokenizer = offer.partition("=")
            if not given:
                tokenizer, warning = offered_tokenizer(name)
                if warning:
                    click.echo(warning, err=True)
            offered[name] = tokenizer
        run_dir.mkdir(parents=True, exist_ok=True)
        logger = request_logger(run_dir.resolve())
        app = create_front_door(check_scheduler_url(scheduler_url), offered, run_dir.resolve(), engine, logger, max_lora_rank=max_lora_rank,
                                checkpoint_every=checkpoint_every, dtype=dtype, max_runs_per_tenant=max_runs_per_tenant,
                                max_samplers_per_tenant=max_samplers_per_tenant, session_timeout_s=session_timeout)
        click.echo(f"tinkergym Tinker API: the front door of {scheduler_url} ({', '.join(offered)}) on http://{host}:{port}", err=True)
        run_server(app, host, port, connection_limits(header_timeout, body_timeout, max_connections), None, False, lambda: 0.0, logger,
                   metrics_port)
        return
    assert model is not None

    with environment_faults():
        from tinkergym.backends.models import resolve_model
        from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig

        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            resolve_model(model)
        except ConfigError as exc:
            raise EnvironmentFault(f"model {model!r} is not available on this machine: {exc}") from exc
        base = SharedBase(SharedBaseConfig(model=model, dtype=dtype, device=device, micro_batch_size=micro_batch_size, max_sample_batch=max_sample_batch,
                                           max_lora_rank=max_lora_rank, max_sessions=max_sessions, memory_budget_mb=memory_budget_mb))
    from tinkergym.tinker_api.server import create_server

    logger = request_logger(run_dir.resolve())
    app = create_server(base, run_dir.resolve(), engine, logger, model_name=model_name or model, tokenizer_id=tokenizer_id,
                        max_lora_rank=max_lora_rank, gather_ms=gather_ms, sample_gather_ms=sample_gather_ms, pass_tokens=pass_tokens,
                        max_runs_per_tenant=max_runs_per_tenant,
                        max_samplers_per_tenant=max_samplers_per_tenant, session_timeout_s=session_timeout)
    click.echo(f"tinkergym Tinker API: {model_name or model} on http://{host}:{port} (run folder {run_dir})", err=True)
    run_server(app, host, port, connection_limits(header_timeout, body_timeout, max_connections), None, False,
               lambda: 0.0, logger, metrics_port)
