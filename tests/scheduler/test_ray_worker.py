"""``tinkergym worker --ray``: one worker fronts a Ray cluster of two nodes started here on 127.0.0.1 (one CPU and one
declared GPU each: the GPUs are labels Ray schedules by; the ranks run on the CPU with gloo), and a job's ranks are Ray
actors in a placement group named after its lease (tinkergym.scheduler.worker.ray_pool).

- A 2-rank job lands on both nodes (one GPU each) and trains as one process does (its first step within float32's reach).
- A 1-rank job's actor is killed while its client waits: the lease ends (nothing reported, the lease left to expire), the
  job is queued again and resumes from its checkpoint at the next epoch, and every step is the local run's.
- A worker killed with SIGKILL leaves its job's actors running; started again under the same name, it stops them (their
  rank processes too), removes their group and lets the lease expire (it is not quarantined): the job comes back to it
  at the next epoch. A ``strict_spread`` job has one rank per node.
- A shared device's server runs as an actor; a LoRA job takes a seat on it; a restarted worker stops the one its killed
  process left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import testkit  # registered by tests/conftest.py

pytest.importorskip("torch")
if importlib.util.find_spec("ray") is None:  # not imported here: Ray reads its environment (below) when imported
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail("ray is not installed: run `make install` (it installs the ray extra); CI runs the Ray worker's tests", pytrace=False)
    pytest.skip("ray is not installed: pip install 'tinkergym[ray]'", allow_module_level=True)

from click.testing import CliRunner

from tinkergym.cli import main
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.worker.job_servers import WorkerOptions, placement_strategy, server_command
from tinkergym.serve.asgi import ThreadServer
from tinkergym.trainers.reporting import read_metrics
from workerkit import auth, job_row, query  # registered by conftest.py

# One Ray local cluster at a time on the machine: every test here runs in the same test process (xdist_group).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]
SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the scheduler's part is the same on both: the leases' tests cover PostgreSQL

#: Ray takes this machine's routable address for "127.0.0.1" unless told it is no cluster of machines; with this set its
#: nodes, the test's driver and the worker all stay on loopback (ray._private.services.get_node_ip_address).
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
NODE = {"num_cpus": 1, "num_gpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"}
RUN = ("--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--steps", "8", "--batch-size", "2", "--group-size", "2",
       "--max-new-tokens", "4", "--lr", "3e-2", "--checkpoint-every", "1", "--quiet")
VOLATILE = ("time/", "tokens/per_s")
WORKER = "rayw"
#: The scheduler's lease TTL here: a lease the tests end on purpose expires this long after its last heartbeat. A Ray
#: cluster of two nodes beside other tests on two cores has held a worker's heartbeats (every 0.5 s) back for over 3 s,
#: and a shorter TTL then ended a lease no test meant to end (the job ran at one epoch more than the test expects).
LEASE_TTL_S = 8.0


@pytest.fixture
def ray_cluster() -> Iterator[Any]:
    """Two Ray nodes on 127.0.0.1 (in a temporary folder of their own) and this process connected to them as a driver; a
    fresh cluster for each test: what one test's workers leave (actors, placement groups that Ray removes
    asynchronously) never holds the devices the next one needs (a shared server's placement waited 300 s once)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(*next(iter(RAY_LOOPBACK.items())))  # read when Ray is imported, in this process and in every Ray process
        import ray
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # what the variable sets, should Ray have been imported before
        temp = tempfile.mkdtemp(prefix="tgray", dir="/tmp")  # short: Ray's socket paths live under it
        patch.setenv("RAY_TMPDIR", temp)  # Ray's pointer to "the current cluster" too (not the machine's /tmp/ray, others' to use)
        os.mkdir(os.path.join(temp, "ray"))
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False, "temp_dir": temp})
            cluster.add_node(**NODE, temp_dir=temp)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, namespace="tinkergym", log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def start_worker(url: str, key: str, address: str, folder: Path, cache: Path, *extra: str) -> subprocess.Popen:
    """``tinkergym worker --ray ADDRESS`` named :data:`WORKER` (a fast heartbeat and poll), its log in ``folder/worker.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "tinkergym", "worker", "--scheduler", url, "--ray", address, "--models", "tiny", "--name", WORKER,
               "--work-dir", str(folder / "work"), "--heartbeat", "0.5", "--poll", "0.2", "--port-range", "21000-29999", *extra]
    env = {**os.environ, **RAY_LOOPBACK, "TINKERGYM_API_KEY": key, "TINKERGYM_CACHE": str(cache)}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(folder / "worker.log", "ab"), env=env)


def ranks_of(job_id: str, epoch: int | str) -> list[str]:
    """The names of the live rank actors of the job's lease at ``epoch`` (``ranks_of("shared", 0)``: the shared server of device 0)."""
    import ray

    return sorted(n for n in ray.util.list_named_actors() if n.startswith(f"tinkergym/{WORKER}/{job_id}/{epoch}/rank"))


def groups_of(job_id: str) -> dict[str, dict[str, Any]]:
    """The job's placement groups not removed, by name (``groups_of("shared")``: the shared servers')."""
    import ray

    return {info["name"]: info for info in ray.util.placement_group_table().values()
            if info["name"].startswith(f"tinkergym/{WORKER}/{job_id}/") and info["state"] != "REMOVED"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_the_placement_is_checked_on_every_worker(tmp_path: Path) -> None:
    options = WorkerOptions(name="w", host="127.0.0.1", devices=[], models=["tiny"], work_dir=tmp_path)
    lease = {"kind": "train", "devices": [0, 1], "config": {"model": "tiny", "placement": "diagonal"}}
    with pytest.raises(ValueError, match=r"config.placement 'diagonal': one of pack, spread, strict_pack, strict_spread"):
        server_command(options, lease, 8000, tmp_path, False, master_port=8001)
    assert placement_strategy({}) == "PACK" and placement_strategy({"placement": "strict_spread"}) == "STRICT_SPREAD"
    lease["config"] = {"model": "tiny"}
    rank = server_command(options, lease, 8000, tmp_path, False, host="10.0.0.7", lease_file=tmp_path / "lease.rank0", torchrun=False)
    assert rank[1:5] == ["-m", "tinkergym", "serve", "backend"] and "torch.distributed.run" not in rank
    assert rank[rank.index("--host") + 1] == "10.0.0.7" and rank[rank.index("--lease-file") + 1] == str(tmp_path / "lease.rank0")


def test_ray_options_are_checked_before_joining_a_cluster(tmp_path: Path) -> None:
    base = ["worker", "--scheduler", "http://127.0.0.1:1", "--key", "k", "--work-dir", str(tmp_path / "w")]
    for extra, said in ((["--ray", "not an address"], "--ray 'not an address': auto, or the cluster's address as host:port"),
                        (["--ray", "auto", "--gpus", "0"], "--gpus names GPUs of this machine; with --ray the devices are the cluster's")):
        result = CliRunner().invoke(main, [*base, *extra], env={"TINKERGYM_API_KEY": "", "TINKERGYM_SCHEDULER": ""})
        assert result.exit_code == 2 and said in result.output, (extra, result.output)
    assert not (tmp_path / "w").exists()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """:data:`RUN` in this process, one device: its run folder, and the model cache it built (the tiny model), shared."""
    folder = tmp_path_factory.mktemp("local")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKERGYM_CACHE", str(folder / "cache"))
        result = CliRunner().invoke(main, ["train", *RUN, "--out", str(folder / "run")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return folder / "run", folder / "cache"


def train_through(url: str, key: str, out: Path, gpus: int, cache: Path) -> subprocess.Popen:
    """``tinkergym train --scheduler URL --gpus N`` (:data:`RUN`) as a process, its stderr a pipe."""
    return subprocess.Popen([sys.executable, "-m", "tinkergym", "train", *RUN, "--out", str(out), "--scheduler", url, "--gpus", str(gpus)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TINKERGYM_API_KEY": key, "TINKERGYM_CACHE": str(cache)})


@SQLITE
def test_a_two_rank_job_spans_the_nodes_survives_a_killed_rank_and_trains_as_one_process(ray_cluster: Any, local_run: tuple[Path, Path],
                                                                                        db_url: str, keys: Any, tmp_path: Path) -> None:
    """Its rank 1's actor is killed before the run's first step (the client frozen meanwhile): rank 0 is stopped with it, the
    lease ends, and the job runs again at the next epoch, from the start."""
    import ray

    local, cache = local_run
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=LEASE_TTL_S, sweep_interval_s=0.2)))
    worker = start_worker(scheduler.url, worker_key, ray_cluster.address, tmp_path / "w", cache)
    out = tmp_path / "scheduled"
    client = train_through(scheduler.url, client_key, out, 2, tmp_path / "client-cache")
    log = testkit.log_text(tmp_path / "w" / "worker.log")
    try:
        job_id = testkit.wait_until("the job", lambda: query(db_url, "SELECT id FROM jobs"), timeout=120, every=0.01, process=client)[0][0]
        client.send_signal(signal.SIGSTOP)
        testkit.wait_until("the job's server", lambda: job_row(db_url, job_id)["state"] == "running", timeout=300, process=worker, output=log)
        (group,) = groups_of(job_id).values()
        assert group["name"] == f"tinkergym/{WORKER}/{job_id}/1" and group["strategy"] == "PACK"
        assert len(set(group["bundles_to_node_id"].values())) == 2  # one GPU a node: its two ranks are on both
        assert ranks_of(job_id, 1) == [f"{group['name']}/rank0", f"{group['name']}/rank1"]
        rank0 = ray.get(ray.get_actor(f"{group['name']}/rank0", namespace="tinkergym").info.remote())
        ray.kill(ray.get_actor(f"{group['name']}/rank1", namespace="tinkergym"))
        testkit.wait_until("the job's next lease", lambda: job_row(db_url, job_id)["lease_epoch"] == 2, timeout=120, process=worker, output=log)
        assert ranks_of(job_id, 1) == [] and group["name"] not in groups_of(job_id) and not alive(rank0["rank_pid"])
        client.send_signal(signal.SIGCONT)
        _, stderr = client.communicate(timeout=600)
    finally:
        if client.poll() is None:
            client.send_signal(signal.SIGCONT)
            client.kill()
            client.communicate()
        testkit.stop(worker, timeout=60)
        scheduler.stop()
    assert client.returncode == 0, stderr[-4000:]
    job = job_row(db_url, job_id)
    assert job["state"] == "succeeded" and job["lease_epoch"] == 2 and job["attempt"] == 1, job
    assert f"rank 1 of the job's server (Ray actor {group['name']}/rank1) is gone" in log()
    assert groups_of(job_id) == {} and ranks_of(job_id, 2) == []  # nothing left on the cluster
    states = [p for p in (tmp_path / "data").rglob("state.json") if ".sha256" not in p.parts]  # uploaded: sharded over 2 ranks
    assert len(states) == 8 and all(json.loads(p.read_text())["ranks"] == 2 for p in states), states
    mine, theirs = read_metrics(out / "metrics.jsonl"), read_metrics(local / "metrics.jsonl")
    assert [r["step"] for r in mine] == list(range(8))
    # Step 0 samples from the same starting weights on both, so it is the same step, within float32's reach (later steps
    # sample from weights that differ by the order of float sums; tests/backends/test_sharded.py shows the sharded step
    # equals one process's on the same batch).
    first, alone = _stable(mine)[0], _stable(theirs)[0]
    assert first.keys() == alone.keys()
    for key in first:
        assert first[key] == pytest.approx(alone[key], rel=1e-4, abs=1e-5), key


@SQLITE  # one rank: a sharded state's torch.distributed.checkpoint metadata (dcp/.metadata) is a hidden file, which the artifact store refuses
def test_a_killed_actor_ends_the_lease_and_the_job_resumes_from_its_checkpoint(ray_cluster: Any, local_run: tuple[Path, Path], db_url: str,
                                                                               keys: Any, tmp_path: Path) -> None:
    import ray

    local, cache = local_run
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=LEASE_TTL_S, sweep_interval_s=0.2)))
    worker = start_worker(scheduler.url, worker_key, ray_cluster.address, tmp_path / "w", cache)
    out = tmp_path / "scheduled"
    client = train_through(scheduler.url, client_key, out, 1, tmp_path / "client-cache")
    log = testkit.log_text(tmp_path / "w" / "worker.log")
    try:
        job_id = testkit.wait_until("the job", lambda: query(db_url, "SELECT id FROM jobs"), timeout=120, process=client)[0][0]
        # The tiny model's steps take milliseconds: the client is frozen at its first checkpoint (steps to go), the actor killed.
        testkit.wait_until("the run's first checkpoint", lambda: (out / "checkpoints" / "step_000000").is_dir(), timeout=300, every=0.005,
                           process=client)
        client.send_signal(signal.SIGSTOP)
        (rank0,) = ranks_of(job_id, 1)
        ray.kill(ray.get_actor(rank0, namespace="tinkergym"))
        testkit.wait_until("the job's next lease", lambda: job_row(db_url, job_id)["lease_epoch"] == 2, timeout=120, process=worker, output=log)
        assert ranks_of(job_id, 1) == [] and f"tinkergym/{WORKER}/{job_id}/1" not in groups_of(job_id)
        client.send_signal(signal.SIGCONT)
        _, stderr = client.communicate(timeout=600)
    finally:
        if client.poll() is None:
            client.send_signal(signal.SIGCONT)
            client.kill()
            client.communicate()
        testkit.stop(worker, timeout=60)
        scheduler.stop()
    assert client.returncode == 0, stderr[-4000:]
    redo = re.search(r"reconnected to its new server \(epoch 2\); redoing step (\d+) from checkpoint step_(\d{6})", stderr)
    assert redo and int(redo.group(1)) == int(redo.group(2)) + 1, stderr[-4000:]
    job = job_row(db_url, job_id)
    assert job["state"] == "succeeded" and job["lease_epoch"] == 2 and job["attempt"] == 1, job  # the lost lease counts, as a dead worker's
    assert f"rank 0 of the job's server (Ray actor {rank0}) is gone: The actor is dead because it was killed by `ray.kill`" in log()
    assert groups_of(job_id) == {}
    # One rank: the same server as the local run's, resumed from its checkpoint, so every step is the local one.
    assert _stable(read_metrics(out / "metrics.jsonl")) == _stable(read_metrics(local / "metrics.jsonl"))


@SQLITE
def test_a_restarted_worker_stops_the_actors_its_earlier_process_left(ray_cluster: Any, db_url: str, keys: Any, tmp_path: Path) -> None:
    import ray

    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=LEASE_TTL_S, sweep_interval_s=0.2)))
    body = {"kind": "train", "gpus": 2, "config": {"model": "tiny", "dtype": "float32", "placement": "strict_spread"}}
    first = start_worker(scheduler.url, worker_key, ray_cluster.address, tmp_path / "w", tmp_path / "cache")
    log = testkit.log_text(tmp_path / "w" / "worker.log")
    second = None
    try:
        import httpx

        answer = httpx.post(f"{scheduler.url}/v1/jobs", json=body, headers=auth(client_key), timeout=30)
        assert answer.status_code == 201, answer.text
        job_id = answer.json()["id"]
        testkit.wait_until("the job's server", lambda: job_row(db_url, job_id)["state"] == "running", timeout=300, process=first, output=log)
        (group,) = groups_of(job_id).values()
        assert group["strategy"] == "STRICT_SPREAD" and len(set(group["bundles_to_node_id"].values())) == 2
        names = ranks_of(job_id, 1)
        infos = [ray.get(ray.get_actor(name, namespace="tinkergym").info.remote()) for name in names]
        assert len(infos) == 2 and all(alive(info["rank_pid"]) for info in infos)

        first.send_signal(signal.SIGKILL)
        first.wait()
        assert ranks_of(job_id, 1) == names  # detached: they outlive the worker's process (their lease ends in LEASE_TTL_S, they in 60 s more)

        second = start_worker(scheduler.url, worker_key, ray_cluster.address, tmp_path / "w", tmp_path / "cache")
        # the actors are killed first and their group removed after (Ray removes a group asynchronously): all three are awaited
        testkit.wait_until("the earlier process's actors, their processes and their placement group to stop",
                           lambda: not ranks_of(job_id, 1) and not any(alive(info["rank_pid"]) for info in infos)
                           and group["name"] not in groups_of(job_id), timeout=120, process=second, output=log)
        testkit.wait_until("the job's next lease, on the restarted worker", lambda: job_row(db_url, job_id)["lease_epoch"] == 2,
                           timeout=60, process=second, output=log)
        assert "an earlier process of this worker left its 2 rank(s)" in log()
        (quarantined,) = query(db_url, "SELECT quarantined_at FROM workers")[0]
        assert quarantined is None
    finally:
        for process in (first, second):
            if process is not None:
                testkit.stop(process, timeout=60)
        scheduler.stop()
    assert groups_of(job_id) == {} and ranks_of(job_id, 2) == []  # a worker stopped with SIGTERM stops its actors


@SQLITE
def test_a_lora_job_takes_a_seat_of_a_shared_server_running_as_an_actor(ray_cluster: Any, local_run: tuple[Path, Path], db_url: str,
                                                                        keys: Any, tmp_path: Path) -> None:
    """Device 0 of the cluster is a shared server (its actor started at the first seat lease); a LoRA job takes a seat on it and
    trains. Killed with SIGKILL, the worker leaves the shared server's actor; started again, it stops it."""
    _, cache = local_run
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=LEASE_TTL_S, sweep_interval_s=0.2)))
    shared = ("--shared-devices", "0", "--seats", "2", "--shared-dtype", "float32", "--max-lora-rank", "16")
    worker = start_worker(scheduler.url, worker_key, ray_cluster.address, tmp_path / "w", cache, *shared)
    out = tmp_path / "scheduled"
    client = train_through(scheduler.url, client_key, out, 1, tmp_path / "client-cache")
    log = testkit.log_text(tmp_path / "w" / "worker.log")
    again = None
    try:
        job_id = testkit.wait_until("the job", lambda: query(db_url, "SELECT id FROM jobs"), timeout=120, process=client)[0][0]
        testkit.wait_until("the job's seat", lambda: job_row(db_url, job_id)["state"] == "running", timeout=300, process=worker, output=log)
        (seat,) = query(db_url, "SELECT d.seat_of FROM allocations a JOIN devices d ON d.id = a.device_id WHERE a.job_id = :j", j=job_id)
        assert seat == (0,) and ranks_of("shared", 0) == [f"tinkergym/{WORKER}/shared/0/rank0"] and ranks_of(job_id, 1) == []
        _, stderr = client.communicate(timeout=600)
        assert client.returncode == 0, stderr[-4000:]
        assert job_row(db_url, job_id)["state"] == "succeeded"
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(8))

        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert ranks_of("shared", 0) and groups_of("shared")  # detached: the shared server outlives the worker's process
        again = start_worker(scheduler.url, worker_key, ray_cluster.address, tmp_path / "w", cache, *shared)
        testkit.wait_until("the earlier shared server to stop", lambda: not ranks_of("shared", 0) and not groups_of("shared"), timeout=120,
                           process=again, output=log)
        assert "the shared server of device 0 that an earlier process of this worker left on the Ray cluster is stopped" in log()
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
        for process in (worker, again):
            if process is not None:
                testkit.stop(process, timeout=60)
        scheduler.stop()
