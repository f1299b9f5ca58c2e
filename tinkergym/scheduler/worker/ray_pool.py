"""Jobs on a Ray cluster (``tinkergym worker --ray [ADDRESS]``): one worker process fronts the cluster, and each lease's
server runs as Ray actors, one per rank, in a placement group. ``ray`` is imported only here, and only when used.

The worker's devices are the cluster's (:func:`cluster_devices`): its GPUs when it has any, one device per GPU; else
its CPUs as slots, one per CPU (``--slots N`` asks for N CPU slots instead). A lease on N devices is a placement group of
N bundles (``{"GPU": 1}`` or ``{"CPU": 1}``) whose strategy is the job config's ``placement``
(:func:`~tinkergym.scheduler.worker.job_servers.placement_strategy`: ``pack`` by default, on one node where the
ranks fit; ``spread`` and the strict forms on request), named after the lease, ``tinkergym/<worker>/<job>/<epoch>``, in
the Ray namespace ``tinkergym``; its ranks are detached actors named ``<group>/rank<i>`` (:class:`RankActor`). Each
actor starts its rank's ``python -m tinkergym serve backend ...`` (the command a one-machine worker runs under
torchrun) with the environment torchrun would give it: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (rank 0's node),
``MASTER_PORT`` (a free port there), ``LOCAL_RANK`` 0 and ``CUDA_VISIBLE_DEVICES`` the one GPU Ray gave the actor (empty
for a CPU slot); the process dies with its actor (``PR_SET_PDEATHSIG``). Rank 0 serves HTTP on its node's Ray address,
the job's server URL. The worker's ``TINKERGYM_*``, ``HF_*``, ``TRANSFORMERS_*``, ``NCCL_*`` and ``GLOO_*`` variables
travel to the ranks (its key never does); each node must have the worker's Python (``--python``) and models.

A shared device (``--shared-devices``: :mod:`~tinkergym.scheduler.worker.seats`) runs its ``serve shared`` the same way, as
one actor in a group of one bundle, ``tinkergym/<worker>/shared/<device>``, started at its first seat lease; it has a lease
of its own (:data:`~.launchers.SHARED_LEASE_S`) that the worker's loop renews while it runs.

The job's folder (``<work-dir>/jobs/<job>/<epoch>/``: its token, run folder, states and server log, which every rank
appends to) must be the same folder on every node: put ``--work-dir`` on a shared filesystem for a cluster of several
machines, as Ray Train asks of its ``storage_path``. The lease's deadline, which a server reads on its own machine's
clock, is written for rank 0 by its actor (``lease.rank0``), moved on at every renewal the scheduler accepts.

A dead actor, or node, ends the lease as a dead worker does: the runner sees :class:`~.launchers.ServerLost`, stops the
other ranks, removes the group and renews the lease no more, so it expires, the job is queued again and resumes from
its last checkpoint at its next lease. An actor whose lease ended :data:`ORPHAN_GRACE_S` ago (its worker died and was
not restarted, or froze) stops its rank and removes its group itself. A worker that starts again
(:meth:`RayLauncher.reconcile`) stops the actors and groups its name's earlier process left (shared servers too), whose
servers no lease of this process serves, and lets their leases expire: the jobs are queued again. (The scheduler's ``release`` would
quarantine the worker, which is for a machine that cannot run a job, not for a restart.) One process per worker name:
a second one would stop the first's actors.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinkergym.client import SchedulerError
from tinkergym.plumbing.install import pip_install
from tinkergym.scheduler.worker.faults import WorkerFault
from tinkergym.scheduler.worker.job_servers import placement_strategy, server_command
from tinkergym.scheduler.worker.launchers import SHARED_LEASE_S, STOP_GRACE_S, ServerLost, spawn_lasting

log = logging.getLogger("tinkergym.worker")

NAMESPACE = "tinkergym"
#: Seconds past its lease's end after which an actor stops its rank and removes its group by itself.
ORPHAN_GRACE_S = 60.0
#: Seconds a lease waits for the cluster to place its group, and for its actors to start, before the worker gives it back.
PLACEMENT_TIMEOUT_S = 300.0
#: Seconds between two looks at the ranks (their processes' exit codes, their actors' lives).
POLL_EVERY_S = 0.5
CALL_TIMEOUT_S = 30.0
#: Seconds a renewal waits for the ranks (it runs on the heartbeat's thread, which must not stall: the next one tries again).
RENEW_TIMEOUT_S = 2.0
#: Prefixes of the worker's environment variables that travel to the ranks.
FORWARDED_ENV = ("TINKERGYM_", "HF_", "TRANSFORMERS_", "NCCL_", "GLOO_")
RANK0_LEASE = "lease.rank0"
#: A group's name, ``tinkergym/<worker>/<place>`` (``<job>/<epoch>``, or ``shared/<device>``, and ``.<try>`` past a lease's
#: first start), and its actors', ``<group>/rank<i>``.
NAME = re.compile(r"^tinkergym/(?P<worker>[^/]+)/(?P<place>shared/\d+|[^/]+/(?P<epoch>\d+))(\.\d+)?(/rank(?P<rank>\d+))?$")


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (``auto``: the one this machine runs; None: ``RAY_ADDRESS``, else a new one-machine
    instance) in the namespace ``tinkergym``; an :class:`ImportError` that says how to install Ray."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"--ray needs Ray, which does not import here ({exc}); install it with: {pip_install('ray')}") from exc
    ray.init(address=address, namespace=NAMESPACE, ignore_reinit_error=True, log_to_driver=False, logging_level=logging.WARNING)


def cluster_devices(slots: int | None = None) -> list[dict[str, Any]]:
    """The worker's devices from the cluster's resources: one per GPU when it has GPUs, else one CPU slot per CPU;
    ``slots``: that many CPU slots instead (a :class:`ValueError` when the cluster has fewer CPUs)."""
    import ray

    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if slots is None and gpus:
        return [{"index": i, "kind": "gpu", "name": f"ray gpu {i}"} for i in range(gpus)]
    count = cpus if slots is None else slots
    if count < 1 or count > cpus:
        raise ValueError(f"the Ray cluster has {cpus} CPU(s) and {gpus} GPU(s): it cannot lend {count} CPU slot(s)")
    return [{"index": i, "kind": "slot", "name": f"ray cpu slot {i}"} for i in range(count)]


def _summary(exc: BaseException) -> str:
    """One line of a Ray error: what it says of the cause, without the boilerplate."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("\t")]
    text = " ".join(line for line in lines if not line.startswith("The actor died unexpectedly"))[:300].rstrip(".")
    return text or type(exc).__name__


def _gone(exc: BaseException) -> bool:
    """Whether a Ray error says the actor (or its node, or its group) is gone for good."""
    from ray import exceptions as rx

    if isinstance(exc, rx.ActorUnavailableError):
        return False
    return isinstance(exc, (rx.RayActorError, rx.ActorPlacementGroupRemoved, rx.NodeDiedError, rx.ActorUnschedulableError))


class RankActor:
    """One rank of a job on a Ray node: starts its ``serve backend`` process, reports its exit, and stops it (a Ray actor:
    :class:`RayLauncher` makes it one). Past its lease's end plus :data:`ORPHAN_GRACE_S` it stops the rank and removes its
    group by itself."""

    def __init__(self, rank: int, group: Any, lease_file: str | None, epoch: int, seconds: float) -> None:
        self.rank, self.group, self.lease_file, self.epoch = rank, group, lease_file, epoch
        self.process: subprocess.Popen | None = None
        self.until = time.monotonic() + seconds
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="lease-watch", daemon=True).start()

    def info(self) -> dict[str, Any]:
        """Where it runs: its node's address and id, its pid and its rank process's pid (None before it started)."""
        import ray

        process = self.process
        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "rank_pid": process.pid if process is not None else None}

    def free_port(self, low: int, high: int, taken: list[int]) -> int:
        """A port of ``low``-``high`` that nothing listens on at this node's address, outside ``taken``."""
        import ray

        host = ray.util.get_node_ip_address()
        candidates = [p for p in range(low, high + 1) if p not in set(taken)]
        random.shuffle(candidates)
        for port in candidates:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
            return port
        raise RuntimeError(f"no free port in {low}-{high} on {host}")

    def renew(self, seconds: float) -> None:
        """The lease holds ``seconds`` more: rank 0 writes it, on this node's clock, to the lease file its server reads."""
        until = time.monotonic() + seconds
        self.until = until
        if self.lease_file is not None:
            from tinkergym.serve.auth import write_lease_file

            write_lease_file(self.lease_file, until, self.epoch)

    def start(self, command: list[str], env: dict[str, str], cwd: str, log_file: str) -> int:
        """Start the rank's process (its output appended to ``log_file``; it dies with this actor); its pid."""
        import ray

        full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TINKERGYM_API_KEY")}
        full.update(env, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in ray.get_gpu_ids()))
        with self._lock:
            self.process = spawn_lasting(command, full, cwd, log_file)
            return self.process.pid

    def poll(self) -> int | None:
        """The rank process's exit code once it exited; None while it runs (or before it started)."""
        process = self.process
        return process.poll() if process is not None else None

    def signal(self, sig: int) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace: float) -> int | None:
        """SIGTERM and ``grace`` seconds (none when 0), then SIGKILL; its exit code (None if it did not stop)."""
        process = self.process
        if process is None:
            return None
        if grace > 0 and process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        try:
            return process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            return None

    def _watch(self) -> None:
        while time.monotonic() < self.until + ORPHAN_GRACE_S:
            time.sleep(1.0)
        self.stop(0)
        import ray

        ray.util.remove_placement_group(self.group)  # its actors, this one too, end with it


class RayServer:
    """A job's server as rank actors in a placement group (:class:`RayLauncher`'s handle)."""

    def __init__(self, launcher: RayLauncher, group: Any, name: str) -> None:
        self.launcher, self.group, self.name = launcher, group, name
        self.actors: list[Any] = []
        self.host, self.port = "", 0
        self.ports: list[tuple[str, int]] = []
        self._polled: tuple[float, int | None] = (-1e9, None)
        self._stopped = False

    def exit_code(self) -> int | None:
        """Rank 0's exit code once it exited (else another rank's); :class:`ServerLost` when an actor is gone."""
        import ray

        at, code = self._polled
        if time.monotonic() - at < POLL_EVERY_S:
            return code
        codes: list[int | None] = []
        for rank, ref in enumerate([actor.poll.remote() for actor in self.actors]):
            try:
                codes.append(ray.get(ref, timeout=CALL_TIMEOUT_S))
            except ray.exceptions.GetTimeoutError:
                codes.append(None)
            except ray.exceptions.RayError as exc:
                if not _gone(exc):
                    codes.append(None)
                    continue
                raise ServerLost(f"rank {rank} of the job's server (Ray actor {self.name}/rank{rank}) is gone: {_summary(exc)}") from exc
        code = codes[0] if codes and codes[0] is not None else next((c for c in codes[1:] if c is not None), None)
        self._polled = (time.monotonic(), code)
        return code

    def kill(self) -> None:
        for actor in self.actors:
            actor.signal.remote(signal.SIGKILL)

    def stop(self, graceful: bool) -> None:
        import ray

        if self._stopped:
            return
        self._stopped = True
        grace = STOP_GRACE_S if graceful else 0.0
        refs = [actor.stop.remote(grace) for actor in self.actors]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=grace + STOP_GRACE_S + 5)
        except ray.exceptions.RayError:
            pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except (ray.exceptions.RayError, ValueError):
                pass
        try:
            ray.util.remove_placement_group(self.group)
        except (ray.exceptions.RayError, ValueError) as exc:
            log.warning("could not remove the Ray placement group %s: %s", self.name, exc)
        self.started()

    def renew(self, seconds: float) -> None:
        import ray

        try:
            ray.get([actor.renew.remote(seconds) for actor in self.actors], timeout=RENEW_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            if not _gone(exc):
                raise RuntimeError(_summary(exc)) from exc
            # a rank gone: the runner's next look at its server (exit_code) ends the lease

    def started(self) -> None:
        self.launcher.give_back_ports(self.ports)
        self.ports = []


class RayLauncher:
    """Runs each lease's server as rank actors on the Ray cluster the worker joined (see the module's notes)."""

    def __init__(self, options: Any) -> None:
        import ray

        self.options = options
        self.actor_class = ray.remote(RankActor)
        self._lock = threading.Lock()
        self._ports: set[tuple[str, int]] = set()
        self._launches: dict[str, int] = {}

    def give_back_ports(self, ports: list[tuple[str, int]]) -> None:
        with self._lock:
            self._ports.difference_update(ports)

    def _take_port(self, actor: Any, host: str) -> tuple[str, int]:
        import ray

        low, high = self.options.ports
        with self._lock:
            taken = [port for node, port in self._ports if node == host]
        port = ray.get(actor.free_port.remote(low, high, taken), timeout=CALL_TIMEOUT_S)
        with self._lock:
            self._ports.add((host, port))
        return host, port

    def launch(self, runner: Any) -> RayServer:
        options, lease, folder = runner.options, runner.lease, runner.folder
        strategy = placement_strategy(lease["config"])
        gpu = any(d["kind"] == "gpu" for d in options.devices if d["index"] in runner.devices)
        server_command(options, lease, 1, folder, gpu, runner.served, host="0.0.0.0", torchrun=False)  # the job's config, checked first
        ranks = len(runner.devices)

        def command(host: str, port: int) -> list[str]:
            return server_command(options, lease, port, folder, gpu, runner.served, host=host, lease_file=folder / RANK0_LEASE, torchrun=False)

        server = self._start(f"{runner.job_id}/{runner.epoch}", ranks, gpu, strategy, runner._check, runner._lease_left, folder / RANK0_LEASE,
                             command, folder)
        log.info("job %s epoch %s: %d rank(s) on the Ray cluster (group %s, %s), rank 0 at %s:%s", runner.job_id, runner.epoch, ranks,
                 server.name, strategy, server.host, server.port)
        return server

    def start_shared(self, server: Any, check: Callable[[], None]) -> RayServer:
        """A shared training server as one actor on a GPU (or CPU) of the cluster, for as long as the worker runs it (its own
        lease, :data:`~.launchers.SHARED_LEASE_S`, renewed by the worker's loop; its seats' adapters have theirs)."""
        gpu = server.device["kind"] == "gpu"
        return self._start(f"shared/{server.device['index']}", 1, gpu, "PACK", check, lambda: SHARED_LEASE_S, None, server.command, server.folder)

    def _start(self, place: str, ranks: int, gpu: bool, strategy: str, check: Callable[[], None], seconds: Callable[[], float],
               lease_file: Path | None, command: Callable[[str, int], list[str]], folder: Path) -> RayServer:
        """Place ``ranks`` bundles, start an actor on each and its rank's process (``command(host, port)``, rank 0's host and a
        free port there); the handle. ``seconds``: the lease's seconds left (rank 0 writes them to ``lease_file``)."""
        import ray
        from ray.util.placement_group import placement_group

        with self._lock:
            tries = self._launches[place] = self._launches.get(place, 0) + 1
        name = f"tinkergym/{self.options.name}/{place}" + (f".{tries}" if tries > 1 else "")
        bundle = {"GPU": 1} if gpu else {"CPU": 1}
        group = placement_group([dict(bundle) for _ in range(ranks)], strategy=strategy, name=name, lifetime="detached")
        server = RayServer(self, group, name)
        try:
            self._wait(check, [group.ready()], f"the Ray cluster to place {ranks} rank(s) ({bundle} each, {strategy})")
            self._start_ranks(server, ranks, bundle, check, seconds, lease_file, command, folder)
        except BaseException as exc:
            server.stop(graceful=False)
            if isinstance(exc, ray.exceptions.RayError) and _gone(exc):
                raise ServerLost(f"a rank of the server (Ray group {name}) is gone while starting: {_summary(exc)}") from exc
            raise
        return server

    def _start_ranks(self, server: RayServer, ranks: int, bundle: dict[str, int], check: Callable[[], None], seconds: Callable[[], float],
                     lease_file: Path | None, command: Callable[[str, int], list[str]], folder: Path) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        for rank in range(ranks):
            strategy = PlacementGroupSchedulingStrategy(server.group, placement_group_bundle_index=rank)
            actor = self.actor_class.options(name=f"{server.name}/rank{rank}", namespace=NAMESPACE, lifetime="detached", max_restarts=0,
                                             max_concurrency=4, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                             scheduling_strategy=strategy)
            rank_lease = str(lease_file) if rank == 0 and lease_file is not None else None
            server.actors.append(actor.remote(rank, server.group, rank_lease, self._epoch(server.name), seconds()))
        infos = self._wait(check, [actor.info.remote() for actor in server.actors], "the rank actors to start")
        server.ports.append(self._take_port(server.actors[0], infos[0]["ip"]))
        server.host, server.port = server.ports[0]
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV) and k != "TINKERGYM_API_KEY"}
        env["PYTHONUNBUFFERED"] = "1"
        if ranks > 1:
            server.ports.append(self._take_port(server.actors[0], server.host))
            env.update(WORLD_SIZE=str(ranks), MASTER_ADDR=server.host, MASTER_PORT=str(server.ports[1][1]), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        line = command(server.host, server.port)
        left = seconds()
        ray.get([actor.renew.remote(left) for actor in server.actors], timeout=CALL_TIMEOUT_S)  # rank 0's lease file, before it serves
        log_file = str(folder / "server.out")
        ray.get([actor.start.remote(line, {**env, **({"RANK": str(rank)} if ranks > 1 else {})}, str(folder), log_file)
                 for rank, actor in enumerate(server.actors)], timeout=CALL_TIMEOUT_S)

    @staticmethod
    def _epoch(name: str) -> int:
        match = NAME.match(name)
        return int(match["epoch"]) if match and match["epoch"] else 0

    def _wait(self, check: Callable[[], None], refs: list[Any], what: str) -> list[Any]:
        """The values of ``refs`` once ready, calling ``check`` meanwhile; :class:`WorkerFault` past :data:`PLACEMENT_TIMEOUT_S`."""
        import ray

        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        pending = list(refs)
        while pending:
            check()
            if time.monotonic() > deadline:
                raise WorkerFault(f"waited {PLACEMENT_TIMEOUT_S:g}s for {what}; the cluster's free resources: {ray.available_resources()}")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        return ray.get(refs)

    def reconcile(self, worker: Any) -> None:
        """Stop the rank actors and groups an earlier process of this worker left on the cluster, and let their leases
        expire (see the module's notes)."""
        import ray

        actors: dict[str, list[Any]] = {}
        for name in ray.util.list_named_actors():
            match = NAME.match(name)
            if match and match["worker"] == self.options.name and match["rank"] is not None:
                try:
                    actors.setdefault(match["place"], []).append(ray.get_actor(name, namespace=NAMESPACE))
                except ValueError:  # gone meanwhile
                    continue
        groups: dict[str, list[str]] = {}
        for info in ray.util.placement_group_table().values():
            match = NAME.match(info.get("name") or "")
            if match and match["worker"] == self.options.name and match["rank"] is None and info.get("state") != "REMOVED":
                groups.setdefault(match["place"], []).append(info["name"])
        for place in sorted(set(actors) | set(groups)):
            self._stop_orphans(place, actors.get(place, []), groups.get(place, []))
            job_id, _, epoch = place.partition("/")
            if job_id == "shared":
                log.warning("the shared server of device %s that an earlier process of this worker left on the Ray cluster is stopped", epoch)
                continue
            log.warning("job %s epoch %s: an earlier process of this worker left its %d rank(s) on the Ray cluster; they are stopped and "
                        "its lease left to expire, so the job is queued again", job_id, epoch, len(actors.get(place, [])))
            try:
                worker.client.event(job_id, int(epoch), "log", {"message": f"worker {self.options.name} started again and stopped the job's "
                                                                           "server its earlier process left; the job is queued again when this "
                                                                           "lease ends"})
            except SchedulerError:
                pass  # the lease is already gone

    @staticmethod
    def _stop_orphans(place: str, actors: list[Any], groups: list[str]) -> None:
        import ray

        try:
            ray.wait([actor.stop.remote(0) for actor in actors], num_returns=len(actors), timeout=STOP_GRACE_S + 5)
        except ray.exceptions.RayError:
            pass
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except (ray.exceptions.RayError, ValueError):
                pass
        for group_name in groups:
            try:
                ray.util.remove_placement_group(ray.util.get_placement_group(group_name))
            except (ray.exceptions.RayError, ValueError) as exc:
                log.warning("could not remove the Ray placement group %s: %s", group_name, exc)

    def close(self) -> None:
        import ray

        ray.shutdown()
