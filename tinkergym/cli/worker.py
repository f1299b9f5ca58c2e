"""``tinkergym worker``: lend this machine's GPUs (or CPU slots), or a Ray cluster's (``--ray``), to a scheduler and run its
jobs' servers.

The worker is standard library only (:mod:`tinkergym.scheduler.worker.agent`; ``ray`` with ``--ray``:
:mod:`tinkergym.scheduler.worker.ray_pool`); the servers it starts load torch.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import click

from tinkergym.cli.common import FiniteFloat, InputError, SafePath
from tinkergym.client import API_KEY_ENV, SCHEDULER_ENV

HOST = re.compile(r"^[A-Za-z0-9.:\[\]-]{1,255}$")
#: ``--ray``'s ADDRESS: ``auto``, ``local``, or a cluster's ``host:port`` (``ray://host:port`` through Ray Client).
RAY_ADDRESS = re.compile(r"^(auto|local|(ray://)?([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):\d{1,5})$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")


def parse_gpus(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]`` (unique indexes from 0 to 1023), else :class:`InputError`."""
    try:
        indexes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--gpus {text!r}: give CUDA device indexes such as 0,1") from None
    if not indexes or len(set(indexes)) != len(indexes) or any(not 0 <= i <= 1023 for i in indexes):
        raise InputError(f"--gpus {text!r}: give unique CUDA device indexes from 0 to 1023, such as 0,1")
    return indexes


def parse_ports(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d{1,5})-(\d{1,5})", text.strip())
    if not match or not 1024 <= int(match.group(1)) <= int(match.group(2)) <= 65535:
        raise InputError(f"--port-range {text!r}: give LOW-HIGH between 1024 and 65535, such as 20000-20999")
    return int(match.group(1)), int(match.group(2))


def _share(devices: list[dict], text: str, spec: dict, models: list[str]) -> None:
    """Mark the devices named by ``--shared-devices`` as shared servers of ``spec`` (an :class:`InputError` for a bad list)."""
    indexes = parse_gpus(text) if text.strip() else []
    known = {d["index"] for d in devices}
    if not indexes or set(indexes) - known:
        raise InputError(f"--shared-devices {text!r}: name some of this worker's devices ({', '.join(map(str, sorted(known)))})")
    if spec["model"] not in models:
        raise InputError(f"--shared-model {spec['model']!r} must be one of --models ({', '.join(models)})")
    for device in devices:
        if device["index"] in indexes:
            device["shared"] = dict(spec)


def _check_ray_options(address: str, gpus: str | None) -> None:
    if address and not RAY_ADDRESS.match(address):
        raise InputError(f"--ray {address!r}: auto, or the cluster's address as host:port (e.g. 10.0.0.2:6379), or nothing")
    if gpus is not None:
        raise InputError("--gpus names GPUs of this machine; with --ray the devices are the cluster's: its GPUs (else its CPUs as slots; "
                         "--slots N for N CPU slots)")


def _join_ray(address: str, slots: int | None) -> tuple[list[dict], type]:
    """Join the Ray cluster (``--ray``): its devices, and the launcher class of its jobs' ranks."""
    try:
        from tinkergym.scheduler.worker.ray_pool import RayLauncher, cluster_devices, connect

        connect(address or None)
        return cluster_devices(slots), RayLauncher
    except ImportError as exc:
        raise InputError(str(exc)) from None
    except ValueError as exc:
        raise InputError(f"--ray: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - Ray's errors are many (ConnectionError, RuntimeError, its own): one line, exit 2
        raise InputError(f"--ray {address or '(RAY_ADDRESS, else a new instance)'}: could not join the Ray cluster: "
                         f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None


def _memory(devices: list[dict], memory_gb: float | None, python: str, models: list[str]) -> dict:
    """Say each whole device's memory (``--device-memory-gb``, else a GPU's own) in ``devices``, and count the models'
    shapes where any memory is known: what the scheduler checks a training job against before a lease
    (:mod:`tinkergym.scheduler.memory`). A model that cannot be counted is said once and not checked."""
    from tinkergym.scheduler.worker.checks import gpu_memory_gb, model_shapes

    found = gpu_memory_gb([d["index"] for d in devices if d["kind"] == "gpu"]) if memory_gb is None else {}
    for device in devices:
        size = memory_gb if memory_gb is not None else found.get(device["index"])
        if size and not device.get("shared"):
            device["memory_gb"] = size
    if not any("memory_gb" in d for d in devices):
        return {}
    shapes, problem = model_shapes(python, models)
    if problem:
        click.echo(f"tinkergym worker: training jobs of some models are not checked against device memory: {problem}", err=True)
    return shapes


@click.command("worker")
@click.option("--scheduler", "scheduler_url", envvar=SCHEDULER_ENV, show_envvar=True, metavar="URL", help="The scheduler, e.g. http://10.0.0.2:8780.")
@click.option("--key", "api_key", envvar=API_KEY_ENV, show_envvar=True, metavar="KEY",
              help="A worker credential (made on the scheduler's machine: tinkergym scheduler workers create). Prefer the environment variable.")
@click.option("--gpus", default=None, metavar="0,1", help="CUDA device indexes this worker lends (each job gets CUDA_VISIBLE_DEVICES).")
@click.option("--slots", type=click.IntRange(1, 1024), default=None, help="Without GPUs: this many CPU slots (servers run on the CPU).")
@click.option("--name", default=None, help="The worker's name (default: the host name); registering it again updates it.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Where the job servers listen; clients connect there directly.")
@click.option("--models", default="tiny,smollm2-135m", show_default=True, help="Comma-separated model names this worker serves.")
@click.option("--work-dir", type=SafePath(file_okay=False, path_type=Path), default=Path("worker-data"), show_default=True,
              help="Folder for the jobs' run folders (jobs/<job>/<epoch>/: token, states, server log).")
@click.option("--port-range", default="20000-20999", show_default=True, help="Ports the job servers listen on.")
@click.option("--heartbeat", type=FiniteFloat(min=0.05, max=3600), default=None, help="Seconds between heartbeats (default: a third of the lease TTL).")
@click.option("--idle-timeout", type=FiniteFloat(min=1, max=7 * 86400), default=None,
              help="A job server whose client sent no call for this many seconds stops and the job fails (exit code 75).")
@click.option("--poll", type=FiniteFloat(min=0.05, max=60), default=1.0, show_default=True, help="Seconds between lease requests while nothing is granted.")
@click.option("--python", "python", default=sys.executable, show_default="this Python", metavar="PATH",
              help="The Python the job servers run under (it needs the train and serve extras).")
@click.option("--keep-states", type=click.IntRange(0, 10000), default=2, show_default=True,
              help="A job's saved states kept in its folder once uploaded, the newest (0: all); the scheduler keeps every one.")
@click.option("--shared-devices", default=None, metavar="0,1",
              help="Of this worker's GPUs (or slots), those that run a shared training server: its seats take LoRA jobs of one "
                   "base model together, one seat a job, instead of one job a device.")
@click.option("--seats", type=click.IntRange(1, 64), default=4, show_default=True, help="LoRA jobs one shared server holds at once.")
@click.option("--shared-model", default=None, metavar="MODEL", help="The shared servers' base model (default: the first of --models).")
@click.option("--shared-dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="The shared servers' dtype: a job takes a seat when its dtype is this one or auto.")
@click.option("--max-lora-rank", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="The largest rank of a job on a seat (a larger one takes a whole device): size --seats so that this many "
                   "adapters of this rank, with their optimizer state, fit the device beside the base.")
@click.option("--device-memory-gb", type=FiniteFloat(min=0.001, max=65536), default=None, metavar="GB",
              help="Each device's memory, for the scheduler's check before a lease: a training job whose weights, gradients and Adam "
                   "state cannot fit is not sent here (default: each GPU's own, from nvidia-smi; CPU slots: not checked).")
@click.option("--skip-model-check", is_flag=True, help="Start even when a model of --models is not available here yet (it is fetched when a job starts).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Serve the worker's Prometheus metrics at http://127.0.0.1:PORT/metrics (its devices and seats free and held, lease "
                   "polls, jobs ended): a listener of its own, on loopback, no key; 0: off.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Front a Ray cluster: lend its GPUs (else its CPUs as slots; --slots N: N CPU slots) and run each job's ranks as Ray "
                   "actors in a placement group. ADDRESS: auto (the cluster this machine is part of), host:port, or none (RAY_ADDRESS, "
                   "else a new Ray instance on this machine). Several machines need --work-dir on a filesystem they all share.")
def worker(
    scheduler_url: str | None, api_key: str | None, gpus: str | None, slots: int | None, name: str | None, host: str, models: str,
    work_dir: Path, port_range: str, heartbeat: float | None, idle_timeout: float | None, poll: float, python: str, keep_states: int,
    shared_devices: str | None, seats: int, shared_model: str | None, shared_dtype: str, max_lora_rank: int, skip_model_check: bool,
    metrics_port: int, ray_address: str | None, device_memory_gb: float | None,
) -> None:
    """Take the scheduler's leases for this machine's devices and run each job's server on them.

    \b
    Examples:
      TINKERGYM_API_KEY=tgk_... tinkergym worker --scheduler http://10.0.0.2:8780 --gpus 0,1
      tinkergym worker --scheduler http://127.0.0.1:8780 --slots 1 --models tiny     # no GPU: CPU servers
      tinkergym worker --scheduler URL --gpus 0,1 --shared-devices 1 --seats 8 --models smollm2-135m
                       # GPU 0 takes one job at a time; GPU 1 holds smollm2-135m once for 8 LoRA jobs
      tinkergym worker --scheduler URL --ray auto --work-dir /shared/tinkergym   # every GPU of the Ray cluster

    At start it checks that it can run what it offers (the servers' packages under --python, each model of --models,
    each GPU of --gpus) and refuses to start otherwise (exit 2). Stop it with Ctrl-C or SIGTERM: it stops its servers,
    and their jobs are queued again when their leases expire.
    """
    from tinkergym.errors import ConfigError

    if not scheduler_url:
        raise InputError(f"no scheduler: pass --scheduler URL or set {SCHEDULER_ENV} (e.g. http://127.0.0.1:8780)")
    if not api_key or not api_key.strip():
        raise InputError(f"no key: pass --key KEY or set {API_KEY_ENV} (a worker credential: tinkergym scheduler workers create NAME --devices N)")
    if ray_address is not None:
        _check_ray_options(ray_address, gpus)
    elif (gpus is None) == (slots is None):
        raise InputError("give exactly one of --gpus 0,1 (GPU indexes) or --slots N (CPU slots on a machine without a GPU)")
    if not HOST.match(host):
        raise InputError(f"--host {host!r} is not a host name or address")
    ports = parse_ports(port_range)
    model_list = sorted({m.strip() for m in models.split(",") if m.strip()})
    bad = [m for m in model_list if not MODEL.match(m) or ".." in m]
    if not model_list or bad:
        raise InputError(f"--models {models!r}: comma-separated model names such as tiny,smollm2-135m (not paths)")
    from tinkergym.scheduler.worker.pool import Worker, WorkerOptions, default_name
    from tinkergym.scheduler.worker.client import WorkerClient

    name = name or default_name()
    if not NAME.match(name):
        raise InputError(f"--name {name!r}: letters, digits, '.', '_' and '-', starting with a letter or digit")
    ray_launcher: type | None = None
    if ray_address is not None:
        devices, ray_launcher = _join_ray(ray_address, slots)
    elif gpus is not None:
        devices = [{"index": i, "kind": "gpu", "name": f"cuda:{i}"} for i in parse_gpus(gpus)]
    else:
        devices = [{"index": i, "kind": "slot", "name": f"slot {i}"} for i in range(slots or 0)]
    if shared_devices is not None:
        _share(devices, shared_devices, {"seats": seats, "model": shared_model or model_list[0], "dtype": shared_dtype,
                                         "max_lora_rank": max_lora_rank}, model_list)
    try:
        client = WorkerClient(scheduler_url, api_key)
    except ConfigError as exc:
        raise InputError(str(exc)) from exc
    from tinkergym.scheduler.worker.checks import WorkerCheckFailed, check_worker

    try:
        check_worker(python, devices if ray_launcher is None else [], model_list, check_models=not skip_model_check)  # Ray's GPUs: its nodes'
    except WorkerCheckFailed as exc:  # one line, before any registration: a worker never takes jobs it cannot run
        raise InputError(f"this worker cannot run what it offers: {exc}") from None
    shapes = _memory(devices, device_memory_gb, python, model_list)
    work_dir.mkdir(parents=True, exist_ok=True)
    options = WorkerOptions(name=name, host=host, devices=devices, models=model_list, work_dir=work_dir.resolve(), ports=ports,
                            heartbeat=heartbeat, idle_timeout=idle_timeout, poll=poll, python=python, keep_states=keep_states,
                            model_shapes=shapes)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s worker %(levelname)s %(message)s")
    pool = Worker(client, options, ray_launcher(options) if ray_launcher is not None else None)
    if metrics_port:
        from tinkergym.cli.serve.server import start_metrics

        start_metrics(pool.count_metrics(), metrics_port)
    code = pool.run()
    if code:
        raise SystemExit(code)
