"""What an owner does from any machine: ``tinkergym jobs download`` gets a job's checkpoint (the newest, or one by step or
name), every file checked against the size and SHA-256 the store lists (another tenant's job and an unknown checkpoint
are exit 2, a file that does not match its listing exit 1 with nothing kept); ``tinkergym jobs workers`` shows the
workers that serve the key's tenant and nothing of other tenants."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


from click.testing import CliRunner
from workerkit import auth, register, submit  # registered by conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.cli import main
from tinkergym.scheduler.app import SchedulerSettings, create_app

FILES = {"state.json": b'{"step": 1}', "adapter/adapter_model.safetensors": b"\x00\x01weights" * 50}


def _store(client: Any, worker: Any, job_id: str, epoch: int, name: str, step: int, files: dict[str, bytes]) -> None:
    for path, body in files.items():
        url = f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/{name}/{path}"
        response = client.put(url, content=body, params={"epoch": epoch, "sha256": hashlib.sha256(body).hexdigest()}, headers=auth(worker.key))
        assert response.status_code == 200, response.text
    assert worker.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": step, "name": name}).status_code == 200


def test_an_owner_downloads_a_jobs_checkpoints(make_client: Any, keys: Any, db_url: str, tmp_path: Path) -> None:
    client = make_client()
    owner, stranger = keys.new("acme", "read,write"), keys.new("globex", "read")
    worker = register(client, keys.worker(1), devices=1)
    job_id = submit(client, owner)
    lease = worker.lease()
    _store(client, worker, job_id, lease["epoch"], "step_000001", 1, FILES)
    _store(client, worker, job_id, lease["epoch"], "step_000002", 2, {**FILES, "state.json": b'{"step": 2}'})
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))

    def download(key: str, *args: str) -> Any:
        env = {"TINKERGYM_SCHEDULER": server.url, "TINKERGYM_API_KEY": key}
        return CliRunner().invoke(main, ["jobs", "download", job_id, *args], env=env)

    try:
        newest = download(owner, "--out", str(tmp_path / "newest"))
        assert newest.exit_code == 0, newest.output
        assert "step_000002" in newest.output
        assert (tmp_path / "newest" / "state.json").read_bytes() == b'{"step": 2}'
        assert (tmp_path / "newest" / "adapter" / "adapter_model.safetensors").read_bytes() == FILES["adapter/adapter_model.safetensors"]
        first = download(owner, "--checkpoint", "1", "--out", str(tmp_path / "first"))
        assert first.exit_code == 0 and (tmp_path / "first" / "state.json").read_bytes() == b'{"step": 1}'
        by_name = download(owner, "--checkpoint", "step_000001", "--out", str(tmp_path / "by-name"))
        assert by_name.exit_code == 0 and (tmp_path / "by-name" / "state.json").is_file()

        unknown = download(owner, "--checkpoint", "7", "--out", str(tmp_path / "none"))
        assert unknown.exit_code == 2 and "no checkpoint '7'" in unknown.output and "step_000002 (step 2)" in unknown.output
        theirs = download(stranger, "--out", str(tmp_path / "theirs"))
        assert theirs.exit_code == 2 and not (tmp_path / "theirs").exists()

        stored = tmp_path / "data" / "jobs" / job_id / "step_000001" / "state.json"
        stored.write_bytes(b'{"step": 9}')  # the store's file changed behind its listing
        bad = download(owner, "--checkpoint", "1", "--out", str(tmp_path / "bad"))
        assert bad.exit_code == 1 and "SHA-256" in bad.output
        assert not list((tmp_path / "bad").rglob("state.json*"))
    finally:
        server.stop()


def test_any_tenant_key_lists_the_workers_that_serve_it(make_client: Any, keys: Any, db_url: str, tmp_path: Path) -> None:
    client = make_client()
    reader = keys.new("acme", "read")
    register(client, keys.worker(2, tenants=("acme",)), name="acme-box", devices=2, models=("tiny", "org/big"))
    register(client, keys.worker(1, tenants=("globex",)), name="globex-box", devices=1)
    owner = keys.new("acme", "read,write")
    submit(client, owner)
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))
    try:
        env = {"TINKERGYM_SCHEDULER": server.url, "TINKERGYM_API_KEY": reader}
        listed = CliRunner().invoke(main, ["jobs", "workers"], env=env)
    finally:
        server.stop()
    assert listed.exit_code == 0, listed.output
    header, *rows = listed.output.strip().splitlines()
    assert header.split()[:3] == ["NAME", "STATUS", "MODELS"]
    assert len(rows) == 1 and rows[0].split()[:4] == ["acme-box", "alive", "org/big,tiny", "2"]
    assert "globex" not in listed.output and "job_" not in listed.output


def test_workers_list_counts_a_device_shared_by_seats_once(make_client: Any, keys: Any, db_url: str, tmp_path: Path) -> None:
    from tinkergym.cli.jobs.workers import DeviceCount, memory_text

    client = make_client()
    shared = {"seats": 2, "model": "tiny", "dtype": "float32", "max_lora_rank": 16}
    devices = [{"index": 0, "kind": "slot", "name": "slot 0"}, {"index": 1, "kind": "slot", "name": "slot 1", "shared": shared}]
    body = {"name": "seat-box", "host": "127.0.0.1", "devices": devices, "models": ["tiny"]}
    assert client.post("/v1/workers", json=body, headers=auth(keys.worker(2, tenants=("acme",)))).status_code == 200
    register(client, keys.worker(1, tenants=("acme",)), name="one-box", devices=1)
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))
    try:
        env = {"TINKERGYM_SCHEDULER": server.url, "TINKERGYM_API_KEY": keys.new("acme", "read")}
        listed = CliRunner().invoke(main, ["jobs", "workers"], env=env)
    finally:
        server.stop()
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[0]: line for line in listed.output.strip().splitlines()[1:]}
    assert "  2 slots (2 seats)  0 (0 of 2 seats)  " in rows["seat-box"], listed.output  # the 2 slots, not 3 (the shared one's seats)
    assert rows["one-box"].split()[3:6] == ["1", "slot", "0"], listed.output
    seats = [{"index": 0, "kind": "gpu", "active": True, "busy": False, "seat_of": None},
             {"index": 1024, "kind": "gpu", "active": True, "busy": True, "seat_of": 1},
             {"index": 1025, "kind": "gpu", "active": True, "busy": False, "seat_of": 1},
             {"index": 2, "kind": "gpu", "active": False, "busy": False, "seat_of": None}]
    count = DeviceCount.of(seats)
    assert (count.devices_text(), count.busy, count.busy_seats) == ("2 GPUs (2 seats)", 1, 1)
    assert memory_text(seats) == "-", "no server measured yet"
    gib = 2**30
    for seat in seats[1:3]:  # a shared server's measure is on each of its seats: shown once, by its device
        seat.update(peak_bytes=3 * gib, memory_bytes=80 * gib)
    seats[0]["peak_bytes"] = gib // 2
    assert memory_text(seats) == "0: 0.5 GiB, 1: 3.0/80 GiB"
