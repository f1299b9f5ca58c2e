"""``tinkergym serve model --scheduler URL``: a model served by a scheduler's worker, followed from here."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import click

#: Seconds between looks at the job (a move to another worker is noticed within this).
POLL_S = 2.0
#: Seconds between requests that keep the server from idling out (the scheduler's idle timeout is minutes).
KEEP_ALIVE_S = 30.0


def _announce(job: Any, key_file: Path, base_url: str) -> None:
    from tinkergym.plumbing.folders import write_private_file

    endpoint = job.endpoint
    write_private_file(key_file, endpoint.key + "\n")
    served = endpoint.models[-1] if endpoint.models else "MODEL"
    click.echo(f"job {job.job_id}: serving {', '.join(endpoint.models)} at {base_url} (use your API key); "
               "this endpoint follows the job when it moves to another worker", err=True)
    click.echo(f"  OpenAI client: OpenAI(base_url=\"{base_url}\", api_key=YOUR_API_KEY)", err=True)
    click.echo(f"  the worker's own server (lease epoch {endpoint.epoch}, changes with the worker): {endpoint.url}, its key in {key_file}",
               err=True)
    click.echo(f"  evaluate: tinkergym eval --endpoint {endpoint.url} --model {served} --api-key-file {key_file} --env ENV", err=True)
    click.echo(json.dumps({"job": job.job_id, "base_url": base_url, "url": endpoint.url, "models": endpoint.models, "epoch": endpoint.epoch,
                           "key_file": str(key_file)}), nl=True)


def _detached(job_id: str) -> None:
    click.echo(f"job {job_id} is queued and runs without this command: follow it with tinkergym jobs show {job_id} "
               f"(why it waits, its server) or tinkergym jobs logs {job_id} --follow; end it with tinkergym jobs cancel {job_id}", err=True)
    click.echo(json.dumps({"job": job_id}), nl=True)


def serve_through_scheduler(
    scheduler: str, api_key: str | None, *, model: str | None, run_dir: str | None, dtype: str | None, gpus: int, key_file: Path | None,
    detach: bool, poll: float = POLL_S, keep_alive: float = KEEP_ALIVE_S,
) -> None:
    """Submit an inference job, print its endpoint once it answers, then follow it until Ctrl-C.

    With ``detach``, print the job's id (and how to follow it) and return as soon as it is queued; with ``detach`` and
    ``key_file``, return once the endpoint answers and its key is written.
    """
    from tinkergym.backends.endpoint_sampler import EndpointError
    from tinkergym.client import SchedulerClient
    from tinkergym.errors import ConfigError
    from tinkergym.backends.inference_jobs import InferenceJob, InferenceJobEnded, default_key_file, gateway_url, job_config, served_name

    config = job_config(model=model, run_dir=run_dir, dtype=dtype)
    client = SchedulerClient(scheduler, api_key)
    label = f"serve {served_name(run_dir) if run_dir else model}"
    job = InferenceJob.submit(client, config, gpus=gpus, name=label, poll=min(poll, 1.0),
                              say=lambda line: click.echo(line, err=True))
    click.echo(f"job {job.job_id} submitted: {label} on {gpus} device(s)", err=True)
    if detach and key_file is None:
        client.close()
        _detached(job.job_id)
        return
    key_file = key_file or default_key_file(job.job_id)

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        try:
            job.wait()
            _announce(job, key_file, gateway_url(client.url, job.job_id))
            if detach:
                click.echo(f"job {job.job_id} keeps running until idle or: tinkergym jobs cancel {job.job_id}", err=True)
                return
            click.echo("Ctrl-C ends the job.", err=True)
            waiting, kept = False, time.monotonic()
            while True:
                time.sleep(poll)
                changed = job.changed()
                if changed:
                    waiting = False
                    _announce(job, key_file, gateway_url(client.url, job.job_id))
                elif changed is None and not waiting:
                    waiting = True
                    click.echo(f"job {job.job_id}: its server is gone (the worker stopped?); waiting for its next lease", err=True)
                elif changed is False and time.monotonic() - kept >= keep_alive:
                    try:
                        job.keep_alive()
                        kept = time.monotonic()
                    except (EndpointError, ConfigError) as exc:
                        click.echo(f"job {job.job_id}: the server did not answer ({exc})", err=True)
        except InferenceJobEnded as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            state = job.end()
            click.echo(f"job {job.job_id}: {state}", err=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        client.close()
