"""``tinkergym serve backend``: the training server."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import click

from tinkergym.cli.common import SEED, FiniteFloat, InputError, SafePath
from tinkergym.cli.serve.server import (
    device_options,
    EXIT_WITH_PARENT_OPTION,
    HOST_OPTION,
    LEASE_FILE_OPTION,
    MAX_BODY_OPTION,
    METRICS_PORT_OPTION,
    TOKEN_HINT,
    call_limit_options,
    call_limits,
    request_logger,
    run_server,
)
from tinkergym.cli.connection_options import connection_limits, connection_options, is_loopback
from tinkergym.config import DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK, DEFAULT_MICRO_BATCH_SIZE

@click.command("backend")
@click.option("--model", required=True, help="Model name (tiny, smollm2-135m, a hub id) or a folder on this machine.")
@click.option("--lora-rank", type=click.IntRange(min=1), default=None, help=f"LoRA rank (default {DEFAULT_LORA_RANK}).")
@click.option("--full", is_flag=True, help="Train every weight instead of a LoRA adapter.")
@click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), default=None, help=f"LoRA alpha (default {DEFAULT_LORA_ALPHA}).")
@click.option("--lora-dropout", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True)
@click.option("--micro-batch-size", type=click.IntRange(min=1), default=DEFAULT_MICRO_BATCH_SIZE, show_default=True, help="Sequences per forward/backward pass (bounds memory).")
@device_options
@click.option("--seed", type=SEED, default=0, show_default=True)
@HOST_OPTION
@click.option("--port", type=click.IntRange(1, 65535), default=8765, show_default=True)
@click.option("--token-file", type=SafePath(dir_okay=False, path_type=Path), default=None, help="File with the bearer token (mode 600; required).")
@click.option("--run-dir", type=SafePath(file_okay=False, path_type=Path), required=True, help="Folder for states/, exports/ and server.log.")
@MAX_BODY_OPTION
@click.option("--keep-states", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep only this many newest saved states in --run-dir/states (0: keep all). Keep more than the client's checkpoints (2).")
@click.option("--idle-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop (exit code 75) when no client call came for this many seconds; a running call counts as activity.")
@click.option("--deterministic", is_flag=True, help="Deterministic kernels only (bit-for-bit repeatable on a GPU too; slower).")
@click.option("--gradient-checkpointing", is_flag=True,
              help="Recompute layer activations in the backward pass instead of keeping them: less memory, about a third more compute, same gradients.")
@click.option("--prefix-cache-mb", type=FiniteFloat(min=0), default=1024.0, show_default=True, metavar="MIB",
              help="Memory for the prefix cache: a multi-turn episode's next turn samples from its new tokens only (0 = off).")
@click.option("--lora-sampling", type=click.Choice(["adapter", "merged"]), default="adapter", show_default=True,
              help="How LoRA samples: through the adapter, or from a merged copy of the weights (faster on a CPU; see train --help).")
@click.option("--device-memory-gb", type=FiniteFloat(min=0), default=None, metavar="GB",
              help="Memory of each device, for the check that the model's weights, gradients and Adam state fit before it "
                   "loads (default: a GPU's own; no check on a CPU).")
@click.option("--rollouts", type=click.Choice(["auto", "split", "lockstep", "vllm"]), default="auto", show_default=True,
              help="How a sharded server (started by torchrun) samples: split, each rank its share of the prompts on a whole copy "
                   "of the model; lockstep, every rank the whole request on the sharded model; auto, split where the copy fits "
                   "on every device; vllm, a vLLM engine beside each rank (docs/training/sharded.md).")
@EXIT_WITH_PARENT_OPTION
@LEASE_FILE_OPTION
@METRICS_PORT_OPTION
@call_limit_options
@connection_options
def serve_backend(
    model: str, lora_rank: int | None, full: bool, lora_alpha: float | None, lora_dropout: float, micro_batch_size: int,
    dtype: str, device: str, seed: int, host: str, port: int,
    token_file: Path | None, run_dir: Path, max_body_mb: float, keep_states: int, idle_timeout: float | None, deterministic: bool,
    gradient_checkpointing: bool, prefix_cache_mb: float, lora_sampling: str, device_memory_gb: float | None, rollouts: str, exit_with_parent: bool,
    lease_file: Path | None, metrics_port: int, max_num_samples: int, max_request_new_tokens: int, max_request_sequences: int, max_request_tokens: int,
    header_timeout: float, body_timeout: float, max_connections: int,
) -> None:
    """Serve the Backend protocol over HTTP: sampling, gradients and optimizer steps for a remote trainer.

    Every call is checked against the --max-* limits before anything is allocated (GET /v1/info lists them);
    a call over one is refused with 400 naming it.

    \b
    Example:
      python -c "import secrets; print(secrets.token_urlsafe(32))" > token.txt && chmod 600 token.txt
      tinkergym serve backend --model tiny --token-file token.txt --run-dir runs/server --port 8765
    """
    from tinkergym.serve.auth import LeaseFile, read_token_file, token_digest

    if token_file is None:
        raise InputError(f"--token-file is required: every route but /health needs the token; {TOKEN_HINT}")
    if full and lora_rank is not None:
        raise click.UsageError("--full and --lora-rank exclude each other: --full trains every weight.")
    digest = token_digest(read_token_file(token_file))  # refuses a short or group/world-readable file: exit 2
    if not is_loopback(host):
        click.echo(f"warning: listening on {host}: the token and the data travel unencrypted unless a TLS proxy is in front.", err=True)

    from tinkergym.serve.lifetime import EnvironmentFault, environment_faults
    from tinkergym.errors import ConfigError

    sharded_rank0 = int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("RANK") == "0"
    with (record_exit_code(run_dir / "exit-code") if sharded_rank0 else contextlib.nullcontext()), \
            environment_faults():  # this machine's faults (a package, the model's files, a device) exit 69, not 2
        import uvicorn  # noqa: F401 - a missing package is this machine's fault, found before the model loads

        from tinkergym.backends.models import resolve_model
        from tinkergym.serve.training.app import create_app
        from tinkergym.serve.training.calls import CallWorker
        from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

        run_dir.mkdir(parents=True, exist_ok=True)
        lora: dict[str, Any] = {} if lora_alpha is None else {"lora_alpha": lora_alpha}
        config = TorchBackendConfig(model=model, lora_rank=0 if full else (lora_rank or DEFAULT_LORA_RANK), lora_dropout=lora_dropout, dtype=dtype,
                                    device=device, seed=seed, micro_batch_size=micro_batch_size, deterministic=deterministic,
                                    gradient_checkpointing=gradient_checkpointing, prefix_cache_mb=prefix_cache_mb,
                                    lora_sampling=lora_sampling, **lora)
        try:
            resolve_model(model)
        except ConfigError as exc:
            raise EnvironmentFault(f"model {model!r} is not available on this machine: {exc}") from exc
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        if rollouts != "auto" and ranks == 1:
            raise click.UsageError(f"--rollouts {rollouts} is for a server sharded over several ranks (started by torchrun); one process "
                                   "samples on its own model")
        check_memory(config, ranks, device_memory_gb)  # before any weight loads: a model that cannot fit says so (exit 2)
        if ranks > 1:  # started by torchrun: the model sharded over its ranks; rank 0 serves, the others follow
            return _serve_sharded(config, ranks, rollouts, run_dir, digest, max_body_mb, keep_states, host, port, idle_timeout, exit_with_parent,
                                  lease_file, metrics_port, (max_num_samples, max_request_new_tokens, max_request_sequences, max_request_tokens),
                                  (header_timeout, body_timeout, max_connections))
        logger = request_logger(run_dir.resolve())
        # Built on the thread that will run the calls: one thread runs the server's torch work (CallWorker says why).
        worker = CallWorker.building(lambda: TorchBackend(config), run_dir.resolve(), logger, keep_states)
    app = create_app(worker.backend, run_dir=run_dir, token_digest=digest, max_body_mb=max_body_mb, logger=logger,
                     keep_states=keep_states, limits=call_limits(max_num_samples, max_request_new_tokens, max_request_sequences, max_request_tokens),
                     lease=LeaseFile(lease_file) if lease_file is not None else None, worker=worker)
    click.echo(f"tinkergym training server: {model} on http://{host}:{port} (run folder {run_dir})", err=True)
    run_server(app, host, port, connection_limits(header_timeout, body_timeout, max_connections), idle_timeout, exit_with_parent,
               lambda: app.state.service.last_activity(), logger, metrics_port)


def check_memory(config: Any, ranks: int, device_memory_gb: float | None) -> None:
    """Refuse (:class:`~tinkergym.errors.ConfigError`, exit 2) a model whose weights, gradients and optimizer state alone
    exceed a device's memory (``device_memory_gb``, else a GPU's own; nothing to check on a CPU without it), with the
    figures and what to change (:mod:`tinkergym.backends.torch.sizing`). Activations depend on the batches the client
    sends, so they are not counted here: this refuses only what can never run."""
    import torch
    from transformers import AutoConfig

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.runtime import resolve_device, resolve_dtype
    from tinkergym.backends.torch.sizing import check_fits, model_shape, shape_dict, static_estimate

    device = resolve_device(config.device)  # each rank has one such device (cuda:LOCAL_RANK under torchrun)
    if device_memory_gb is not None:
        total = int(device_memory_gb * 2**30)
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        return
    shape = shape_dict(model_shape(AutoConfig.from_pretrained(resolve_model(config.model))))
    estimate = static_estimate(shape, lora_rank=config.lora_rank, dtype=str(resolve_dtype(config.dtype, device)), ranks=ranks,
                               device="cuda" if device.type == "cuda" else "cpu", gradient_checkpointing=config.gradient_checkpointing)
    check_fits(estimate, total)  # the figure the scheduler checks before a lease (tinkergym.scheduler.memory)


@contextlib.contextmanager
def record_exit_code(path: Path) -> Iterator[None]:
    """Write the exit code the block ends with to ``path``: torchrun, which starts a sharded server's ranks, exits 1 for any
    failure, and the worker reads a server's code (75 idle, 69 this machine's fault) from here."""
    code = 0
    try:
        yield
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except BaseException:
        code = 1
        raise
    finally:
        if path.parent.is_dir():  # a folder its worker already removed stays removed
            try:
                path.write_text(f"{code}\n")
            except OSError:
                pass


def _serve_sharded(config: Any, ranks: int, rollouts: str, run_dir: Path, digest: bytes, max_body_mb: float, keep_states: int, host: str, port: int,
                   idle_timeout: float | None, exit_with_parent: bool, lease_file: Path | None, metrics_port: int,
                   limits: tuple[int, int, int, int], connections: tuple[float, float, int]) -> None:
    """``serve backend`` on each rank torchrun started (``WORLD_SIZE`` > 1): every rank holds a shard of the model
    (:class:`~tinkergym.backends.torch.sharded.ShardedTorchBackend`, one device each: ``cuda:LOCAL_RANK`` on GPUs);
    rank 0 serves HTTP and sends each call to the others (:class:`~tinkergym.backends.torch.sharded.Lockstep`)."""
    import dataclasses

    from tinkergym.backends.torch.sharded import Lockstep, ShardedTorchBackend, follow, init_process_group
    from tinkergym.serve.auth import LeaseFile
    from tinkergym.serve.training.app import create_app

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = config.device
    if device in ("auto", "cuda"):
        import torch

        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    init_process_group(device)
    if rollouts == "vllm":
        from tinkergym.backends.vllm.ranks import sharded_with_vllm

        backend = sharded_with_vllm(dataclasses.replace(config, device=device))
    else:
        backend = ShardedTorchBackend(dataclasses.replace(config, device=device), rollouts=rollouts)
    if backend.rank != 0:
        follow(backend)
        return
    front = Lockstep(backend)
    try:
        logger = request_logger(run_dir.resolve())
        app = create_app(front, run_dir=run_dir, token_digest=digest, max_body_mb=max_body_mb, logger=logger, keep_states=keep_states,
                         limits=call_limits(*limits), lease=LeaseFile(lease_file) if lease_file is not None else None)
        click.echo(f"tinkergym training server: {config.model} sharded over {ranks} ranks on http://{host}:{port} (run folder {run_dir})", err=True)
        run_server(app, host, port, connection_limits(*connections), idle_timeout, exit_with_parent,
                   lambda: app.state.service.last_activity(), logger, metrics_port)
    finally:
        front.close()
