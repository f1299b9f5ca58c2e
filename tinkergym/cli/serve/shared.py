"""``tinkergym serve shared``: one base model, many LoRA adapters, each with its own token."""

from __future__ import annotations

from pathlib import Path

import click

from tinkergym.cli.common import FiniteFloat, InputError, SafePath
from tinkergym.cli.connection_options import connection_limits, connection_options, is_loopback
from tinkergym.cli.serve.server import (
    device_options,
    EXIT_WITH_PARENT_OPTION,
    HOST_OPTION,
    METRICS_PORT_OPTION,
    LEASE_FILE_OPTION,
    MAX_BODY_OPTION,
    TOKEN_HINT,
    call_limit_options,
    call_limits,
    request_logger,
    run_server,
)
from tinkergym.config import DEFAULT_MICRO_BATCH_SIZE


@click.command("shared")
@click.option("--model", required=True, help="The base model: a name (tiny, smollm2-135m, a hub id) or a folder on this machine.")
@device_options
@click.option("--micro-batch-size", type=click.IntRange(min=1), default=DEFAULT_MICRO_BATCH_SIZE, show_default=True,
              help="Rows per training or scoring pass, across adapters (bounds the activations' memory).")
@click.option("--max-sample-batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Rows decoded together, across adapters (bounds the KV cache's memory; a request's sequences are batched by this many, "
                   "as a local backend batches them, and the longest another adapter waits behind a huge call is one such batch).")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=64, show_default=True, help="The largest rank an adapter may ask for.")
@click.option("--max-adapters", type=click.IntRange(min=1), default=64, show_default=True, help="Adapters open at once.")
@click.option("--memory-budget-mb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Memory for the adapters, their gradients and optimizer states (0: no bound); an adapter past it is refused with the figures.")
@click.option("--prefix-cache-mb", type=FiniteFloat(min=0), default=256.0, show_default=True, metavar="MIB",
              help="Memory for the prefix cache, shared by the adapters (a multi-turn episode's next turn runs its new tokens only; 0 = off).")
@click.option("--pass-tokens", type=click.IntRange(min=1), default=65536, show_default=True,
              help="Tokens of one round of calls across adapters; a larger call is worked in slices (decode batches, micro-batches) "
                   "over several rounds, with other adapters' calls between them.")
@click.option("--gather-ms", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="How long a round waits for other adapters' calls to join it (0: never).")
@HOST_OPTION
@click.option("--port", type=click.IntRange(1, 65535), default=8766, show_default=True)
@click.option("--token-file", type=SafePath(dir_okay=False, path_type=Path), default=None,
              help="File with the server's own token (mode 600; required): it opens and closes adapters.")
@click.option("--run-dir", type=SafePath(file_okay=False, path_type=Path), required=True, help="Folder for adapters/<id>/{states,exports} and server.log.")
@MAX_BODY_OPTION
@click.option("--keep-states", type=click.IntRange(min=0), default=3, show_default=True,
              help="Keep only this many newest saved states per adapter (0: all); keep more than the client's checkpoints (2).")
@click.option("--max-adapter-disk-mb", type=click.FloatRange(min=0), default=10240.0, show_default=True,
              help="Most bytes of one adapter's states and exports (0: no bound); a new state or export past it is refused.")
@click.option("--max-waiting-calls", type=click.IntRange(min=1), default=16, show_default=True,
              help="Most calls of one adapter waiting to run; more are refused (429).")
@click.option("--idle-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop (exit code 75) when no call came for this many seconds; a running call counts as activity.")
@EXIT_WITH_PARENT_OPTION
@LEASE_FILE_OPTION
@METRICS_PORT_OPTION
@call_limit_options
@connection_options
def serve_shared(
    model: str, dtype: str, device: str, micro_batch_size: int, max_sample_batch: int, max_lora_rank: int, max_adapters: int,
    memory_budget_mb: float, prefix_cache_mb: float, pass_tokens: int, gather_ms: float, host: str, port: int, token_file: Path | None, run_dir: Path,
    max_body_mb: float, keep_states: int, max_adapter_disk_mb: float, max_waiting_calls: int, idle_timeout: float | None, exit_with_parent: bool, lease_file: Path | None,
    metrics_port: int, max_num_samples: int, max_request_new_tokens: int, max_request_sequences: int, max_request_tokens: int,
    header_timeout: float, body_timeout: float, max_connections: int,
) -> None:
    """Serve one base model to many LoRA adapters: each adapter trains as through `tinkergym serve backend`, with a token of its own,
    and the calls of several adapters run together on the base.

    The server's token opens an adapter (POST /v1/adapters with lora_rank, lora_alpha, seed), which answers the
    adapter's id and token; that token reaches the adapter alone, through the routes of `tinkergym serve backend`, so
    `tinkergym train --backend-url URL` with the adapter's token trains it. GET /v1/adapters lists the adapters and
    the memory they hold; DELETE /v1/adapters/ID closes one.

    \b
    Example:
      python -c "import secrets; print(secrets.token_urlsafe(32))" > token.txt && chmod 600 token.txt
      tinkergym serve shared --model tiny --token-file token.txt --run-dir runs/shared --port 8766
      curl -s -X POST -H "Authorization: Bearer $(cat token.txt)" -H 'Content-Type: application/json' \\
           -d '{"lora_rank": 8}' http://127.0.0.1:8766/v1/adapters
    """
    from tinkergym.serve.auth import LeaseFile, read_token_file, token_digest

    if token_file is None:
        raise InputError(f"--token-file is required: every route but /health needs a token; {TOKEN_HINT}")
    digest = token_digest(read_token_file(token_file))
    if not is_loopback(host):
        click.echo(f"warning: listening on {host}: the tokens and the data travel unencrypted unless a TLS proxy is in front.", err=True)

    from tinkergym.errors import ConfigError
    from tinkergym.serve.lifetime import EnvironmentFault, environment_faults

    with environment_faults():  # this machine's faults (a package, the model's files, a device) exit 69, not 2
        import uvicorn  # noqa: F401 - a missing package is this machine's fault, found before the model loads

        from tinkergym.backends.models import resolve_model
        from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
        from tinkergym.serve.training.shared import create_shared_app

        run_dir.mkdir(parents=True, exist_ok=True)
        config = SharedBaseConfig(model=model, dtype=dtype, device=device, micro_batch_size=micro_batch_size, max_sample_batch=max_sample_batch,
                                  max_lora_rank=max_lora_rank, max_sessions=max_adapters, memory_budget_mb=memory_budget_mb,
                                  prefix_cache_mb=prefix_cache_mb)
        try:
            resolve_model(model)
        except ConfigError as exc:
            raise EnvironmentFault(f"model {model!r} is not available on this machine: {exc}") from exc
        base = SharedBase(config)
    logger = request_logger(run_dir.resolve())
    app = create_shared_app(base, run_dir=run_dir, token_digest=digest, max_body_mb=max_body_mb, logger=logger, keep_states=keep_states,
                            limits=call_limits(max_num_samples, max_request_new_tokens, max_request_sequences, max_request_tokens),
                            lease=LeaseFile(lease_file) if lease_file is not None else None, pass_tokens=pass_tokens, gather_ms=gather_ms,
                            max_waiting_calls=max_waiting_calls, max_adapter_disk_mb=max_adapter_disk_mb)
    click.echo(f"tinkergym shared training server: {model} on http://{host}:{port} (run folder {run_dir})", err=True)
    run_server(app, host, port, connection_limits(header_timeout, body_timeout, max_connections), idle_timeout, exit_with_parent,
               lambda: app.state.shared.last_activity(), logger, metrics_port)
