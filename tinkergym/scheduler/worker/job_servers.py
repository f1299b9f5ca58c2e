"""What a worker starts for a lease: the command line of the job's server, checked field by field from the job's config.

A train or sft job gets ``tinkergym serve backend`` with the config's model settings; an inference or eval job
gets ``tinkergym serve model`` (serving a trained run's restored checkpoint under its name). Every value that
reaches the command line is checked here first: a config the worker cannot start is a :class:`ValueError`. So is the
config's ``placement`` (:func:`placement_strategy`: how a ``--ray`` worker lays a job's ranks over its cluster's nodes),
checked on every worker so that a job fails alike wherever it lands. Standard library only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinkergym.config import DEFAULT_LORA_RANK, DTYPES, SERVED_NAME, is_model_name

#: Job kinds whose server is an inference server (``serve model``); the others get a training server.
SERVING_KINDS = ("inference", "eval")
#: A job config's ``placement`` -> the Ray placement group strategy of its ranks (``tinkergym worker --ray``): ``pack``
#: (the default) puts them on one node where they fit, else on as few as can hold them; ``spread`` over as many nodes as
#: it can; ``strict_pack`` on one node or nowhere; ``strict_spread`` one rank per node or nowhere.
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}


@dataclass
class WorkerOptions:
    """What ``tinkergym worker`` was started with."""

    name: str
    host: str
    devices: list[dict[str, Any]]  # {"index", "kind": "gpu"|"slot", "name"}, and "shared" (seats, model, dtype, max_lora_rank) for a shared one
    models: list[str]
    work_dir: Path
    ports: tuple[int, int] = (20000, 20999)
    heartbeat: float | None = None
    idle_timeout: float | None = None
    poll: float = 1.0
    python: str = field(default_factory=lambda: sys.executable)
    keep_states: int = 2  # a job's uploaded states kept in its folder, the newest (0: all)
    model_shapes: dict[str, Any] = field(default_factory=dict)  # each model's shape, for the scheduler's memory check

    def places(self) -> int:
        """The places it lends: whole devices, and the seats of its shared ones."""
        return sum(int(d["shared"]["seats"]) if d.get("shared") else 1 for d in self.devices)


def die_with_parent() -> None:
    """A server's ``preexec_fn``: it gets SIGKILL when the worker dies (``PR_SET_PDEATHSIG``)."""
    from tinkergym.serve import lifetime

    lifetime.die_with_parent()


def placement_strategy(config: dict[str, Any]) -> str:
    """The Ray placement strategy of the job's ranks from its config's ``placement`` (:data:`PLACEMENTS`; default ``pack``);
    a :class:`ValueError` for any other value."""
    placement = config.get("placement", "pack")
    if not isinstance(placement, str) or placement not in PLACEMENTS:
        raise ValueError(f"config.placement {str(placement)[:40]!r}: one of {', '.join(PLACEMENTS)} (how a Ray worker places the job's "
                         "ranks: pack them on one node where they fit, or spread them over nodes)")
    return PLACEMENTS[placement]


def server_command(options: WorkerOptions, lease: dict[str, Any], port: int, folder: Path, gpu: bool, served: str | None = None,
                   master_port: int | None = None, *, host: str | None = None, lease_file: Path | None = None,
                   torchrun: bool = True) -> list[str]:
    """The command line of the job's server (a :class:`ValueError` for a config it cannot start).

    ``served``: for an inference or eval job serving a trained run, the name of the restored checkpoint in ``states/``.
    A training job on several devices runs ``serve backend`` under torchrun, one rank per device, its ranks meeting on
    ``master_port`` of 127.0.0.1 (the model sharded over them: :mod:`tinkergym.backends.torch.sharded`); with
    ``torchrun`` False the command is one rank's, whose launcher sets the ranks' environment itself (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as torchrun would: :mod:`~tinkergym.scheduler.worker.ray_pool`).
    ``host``: where it listens (default the worker's ``--host``); ``lease_file``: the lease's deadline it reads (default
    ``<folder>/lease``, which the worker writes on this machine's clock).
    """
    config = lease["config"]
    placement_strategy(config)
    model = config.get("model")
    if not is_model_name(model):
        raise ValueError(f"config.model {str(model)[:100]!r} is not a model name")
    dtype = config.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ValueError(f"config.dtype {str(dtype)[:40]!r}: one of {', '.join(DTYPES)}")
    device = "auto" if gpu else "cpu"
    base = [options.python, "-m", "tinkergym"]
    idle = options.idle_timeout or lease.get("idle_timeout_s")  # the worker's own, else the scheduler's
    # The lease's deadline, renewed by the worker at every heartbeat: past it the server refuses every call.
    lifetime = ["--exit-with-parent", "--lease-file", str(lease_file or folder / "lease"), *(["--idle-timeout", f"{idle:g}"] if idle else [])]
    host = host or options.host
    if lease["kind"] in SERVING_KINDS:
        command = [*base, "serve", "model", "--model", model, "--api-key-file", str(folder / "token"), "--host", host,
                   "--port", str(port), "--dtype", dtype, "--device", device, *lifetime]
        if config.get("resume_job"):  # a run the scheduler trained: its newest checkpoint, restored into states/
            name = config.get("served_name", "model")
            if not isinstance(name, str) or not SERVED_NAME.match(name) or name == model:
                raise ValueError(f"config.served_name {str(name)[:100]!r}: letters, digits, '.', '_' and '-', not the base model's name")
            if served is None:
                raise ValueError(f"job {config['resume_job']} (the run this job serves) has no checkpoint to serve")
            command += ["--checkpoint", f"{name}={folder / 'states' / served}"]
        return command
    rank, seed = config.get("lora_rank", DEFAULT_LORA_RANK), config.get("seed", 0)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= 4096:
        raise ValueError(f"config.lora_rank {rank!r}: 0 (every weight) or a positive rank")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"config.seed {seed!r}: an integer from 0 to 2**32 - 1")
    ranks = len(lease.get("devices") or ()) if lease.get("seat") is None else 1
    if ranks > 1 and torchrun:
        if master_port is None:
            raise ValueError(f"a job on {ranks} devices needs a port for its ranks to meet on")
        base = [options.python, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                "--master-port", str(master_port), "-m", "tinkergym"]
    command = [*base, "serve", "backend", "--model", model, *(["--full"] if rank == 0 else ["--lora-rank", str(rank)]), "--dtype", dtype,
               "--seed", str(seed), "--device", device, "--host", host, "--port", str(port), "--token-file", str(folder / "token"),
               "--run-dir", str(folder)]
    for key, flag, kind in (("lora_alpha", "--lora-alpha", float), ("lora_dropout", "--lora-dropout", float),
                            ("micro_batch_size", "--micro-batch-size", int)):
        value = config.get(key)
        if value is None or (rank == 0 and key != "micro_batch_size"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise ValueError(f"config.{key} {value!r} is not a number")
        command += [flag, repr(kind(value))]  # serve backend checks the range
    for flag in ("deterministic", "gradient_checkpointing"):
        if config.get(flag) is True:
            command.append(f"--{flag.replace('_', '-')}")
    return command + lifetime
