"""``tinkergym serve-tinker``: the Tinker API (the ``tinker`` SDK's REST API) on one machine, for a user without a cluster."""

from __future__ import annotations

from pathlib import Path

import click

from tinkergym.cli.common import InputError, SafePath
from tinkergym.cli.connection_options import connection_limits, connection_options
from tinkergym.cli.scheduler import data_dir_option, db_option, open_database
from tinkergym.cli.serve import HOST_OPTION, _is_loopback, request_logger, run_server
from tinkergym.config import DEFAULT_DTYPE, DEFAULT_MICRO_BATCH_SIZE, DTYPES


@click.command("serve-tinker")
@click.option("--model", required=True, help="The base model: a name (tiny, smollm2-135m, a hub id) or a folder on this machine.")
@click.option("--model-name", default=None,
              help="The name clients ask for (create_lora_training_client(base_model=...)); default: --model.")
@click.option("--tokenizer-id", default=None,
              help="What get_info answers as the tokenizer (the SDK loads it with AutoTokenizer): a hub id or a folder the clients can read "
                   "(default: the model's folder on this machine).")
@click.option("--dtype", type=click.Choice(DTYPES), default=DEFAULT_DTYPE, show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto (cuda when available), cpu, cuda, cuda:1, ...")
@click.option("--micro-batch-size", type=click.IntRange(min=1), default=DEFAULT_MICRO_BATCH_SIZE, show_default=True,
              help="Rows per training or scoring pass, across training runs (bounds the activations' memory).")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=64, show_default=True, help="The largest LoRA rank a client may ask for.")
@click.option("--max-sessions", type=click.IntRange(min=2), default=64, show_default=True,
              help="Adapters held at once (training runs and samplers, of every tenant).")
@click.option("--memory-budget-mb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Memory for the adapters, their gradients and optimizer states (0: no bound); past it a new run is refused with the figures.")
@click.option("--max-runs-per-tenant", type=click.IntRange(min=1), default=8, show_default=True, help="Training runs one tenant holds at once.")
@click.option("--max-samplers-per-tenant", type=click.IntRange(min=1), default=32, show_default=True, help="Samplers one tenant holds at once.")
@click.option("--session-timeout", type=click.FloatRange(min=10), default=600.0, show_default=True,
              help="Seconds without a heartbeat after which a client's session ends and its runs and samplers are freed.")
@HOST_OPTION
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--run-dir", type=SafePath(file_okay=False, path_type=Path), required=True,
              help="Folder for runs/<id>/{states,exports} (the tinker:// checkpoints) and server.log.")
@db_option
@data_dir_option
@connection_options
def serve_tinker(
    model: str, model_name: str | None, tokenizer_id: str | None, dtype: str, device: str, micro_batch_size: int, max_lora_rank: int,
    max_sessions: int, memory_budget_mb: float, max_runs_per_tenant: int, max_samplers_per_tenant: int, session_timeout: float,
    host: str, port: int, run_dir: Path, db: str | None, data_dir: Path, header_timeout: float, body_timeout: float, max_connections: int,
) -> None:
    """Serve the Tinker API, so the tinker SDK and tinker-cookbook train and sample LoRA adapters of one base model here.

    Clients connect with tinker.ServiceClient(base_url="http://HOST:PORT") and TINKER_API_KEY=tml-<key>, where
    <key> is a tinkergym key made on this machine by `tinkergym scheduler keys create` on the same database (--db
    or --data-dir): each key's tenant reaches only its own training runs, samplers and checkpoints. Every training
    run is a LoRA adapter on the one base model loaded here, and the calls of several runs share passes.

    \b
    Example:
      tinkergym scheduler keys create --tenant alice --scopes read,write --data-dir tinker-data > alice.key
      tinkergym serve-tinker --model smollm2-135m --data-dir tinker-data --run-dir tinker-runs --port 8000
      TINKER_API_KEY=tml-$(cat alice.key) python -c "import tinker; print(tinker.ServiceClient(base_url='http://127.0.0.1:8000').get_server_capabilities())"
    """
    from tinkergym.errors import ConfigError
    from tinkergym.serve.lifetime import EnvironmentFault, environment_faults

    try:
        import tinker  # noqa: F401 - the SDK's types and protobuf schema are the wire
    except ImportError as exc:
        raise InputError("serve-tinker speaks the tinker SDK's own types: pip install 'tinkergym[tinker]' (tinker==0.38.0)") from exc
    if not _is_loopback(host):
        click.echo(f"warning: listening on {host}: keys and data travel unencrypted unless a TLS proxy is in front.", err=True)
    engine = open_database(db, data_dir)

    with environment_faults():
        from tinkergym.backends.models import resolve_model
        from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig

        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            resolve_model(model)
        except ConfigError as exc:
            raise EnvironmentFault(f"model {model!r} is not available on this machine: {exc}") from exc
        base = SharedBase(SharedBaseConfig(model=model, dtype=dtype, device=device, micro_batch_size=micro_batch_size,
                                           max_lora_rank=max_lora_rank, max_sessions=max_sessions, memory_budget_mb=memory_budget_mb))
    from tinkergym.tinker_api.server import create_server

    logger = request_logger(run_dir.resolve())
    app = create_server(base, run_dir.resolve(), engine, logger, model_name=model_name or model, tokenizer_id=tokenizer_id,
                        max_lora_rank=max_lora_rank, max_runs_per_tenant=max_runs_per_tenant, max_samplers_per_tenant=max_samplers_per_tenant,
                        session_timeout_s=session_timeout)
    click.echo(f"tinkergym Tinker API: {model_name or model} on http://{host}:{port} (run folder {run_dir})", err=True)
    run_server(app, host, port, connection_limits(header_timeout, body_timeout, max_connections), None, False,
               lambda: 0.0, logger)
