"""The artifact store and its routes: uploads fenced by the lease epoch, downloads by the worker and the job's owner,
paths that never leave the job's folder, tenants, size limits, and the body-limit exemption of the upload route only."""

from __future__ import annotations

import hashlib
import http.client
import os
from pathlib import Path
from typing import Any

import pytest
from tinkergym.scheduler.artifacts import (
    ArtifactPathError,
    DirectoryStore,
    check_relpath,
)
from workerkit import auth, register, submit  # registered by conftest.py

CONTENT = b"weights \x00\x01\x02" * 10


def put(client: Any, worker: Any, job_id: str, epoch: int, name: str, path: str, body: Any = CONTENT, **query: Any) -> Any:
    url = f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/{name}/{path}"
    return client.put(url, content=body, params={"epoch": epoch, **query}, headers=auth(worker.key))


def leased(client: Any, keys: Any, tenant: str = "acme", **config: Any) -> tuple[Any, str, dict[str, Any], str]:
    """A worker of ``tenant`` holding a lease on a fresh job of that tenant: (worker, job id, lease, owner key)."""
    owner = keys.new(tenant, "read,write")
    worker = register(client, keys.new(tenant, "worker"), name=f"w-{tenant}-{os.urandom(3).hex()}", devices=1)
    job_id = submit(client, owner, **({"config": {"model": "tiny", **config}} if config else {}))
    lease = worker.lease()
    assert lease is not None and lease["job_id"] == job_id
    return worker, job_id, lease, owner


def record(worker: Any, job_id: str, epoch: int, name: str, step: int) -> None:
    response = worker.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": step, "name": name})
    assert response.status_code == 200, response.text


def test_relative_paths_are_checked() -> None:
    assert check_relpath("a/b.safetensors") == ["a", "b.safetensors"]
    for bad in ("", "..", "a/../b", "/etc/passwd", "a//b", "./a", "a\\b", "a\x00b", ".hidden", "a/.tmp/b", "a\nb", "x" * 2000):
        with pytest.raises(ArtifactPathError):
            check_relpath(bad)
    # Lengths in UTF-8 bytes, as file systems count them: 128 two-byte characters are 256 bytes, one too many.
    assert check_relpath("é" * 127 + "a") == ["é" * 127 + "a"]
    for bad in ("é" * 128, "é/" * 400 + "x", "a\ud800b", "ok/\udfff"):
        with pytest.raises(ArtifactPathError):
            check_relpath(bad)


def test_upload_list_download_and_record(make_client, keys) -> None:
    client = make_client()
    worker, job_id, lease, owner = leased(client, keys)
    epoch = lease["epoch"]
    files = {"state.json": b'{"step": 1}', "sub/dir/trainable.safetensors": CONTENT}
    for path, body in files.items():
        response = put(client, worker, job_id, epoch, "step_000001", path, body, sha256=hashlib.sha256(body).hexdigest())
        assert response.status_code == 200, response.text
        assert response.json() == {"path": path, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    bad = put(client, worker, job_id, epoch, "step_000001", "other.bin", b"abc", sha256="0" * 64)
    assert bad.status_code == 400 and "SHA-256" in bad.json()["error"]["message"]
    # The owner sees only recorded checkpoints.
    assert client.get(f"/v1/jobs/{job_id}/artifacts/step_000001", headers=auth(owner)).status_code == 404
    listing = client.get(f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/step_000001", params={"epoch": epoch}, headers=auth(worker.key))
    assert [f["path"] for f in listing.json()["files"]] == sorted(files)
    record(worker, job_id, epoch, "step_000001", 1)
    listing = client.get(f"/v1/jobs/{job_id}/artifacts/step_000001", headers=auth(owner))
    assert listing.status_code == 200
    assert {f["path"]: (f["size"], f["sha256"]) for f in listing.json()["files"]} == {
        p: (len(b), hashlib.sha256(b).hexdigest()) for p, b in files.items()}
    for path, body in files.items():
        got = client.get(f"/v1/jobs/{job_id}/artifacts/step_000001/{path}", headers=auth(owner))
        assert got.status_code == 200 and got.content == body
        assert got.headers["content-type"] == "application/octet-stream"
    # A recorded checkpoint never changes; an unrecorded one's partial upload can be dropped.
    assert put(client, worker, job_id, epoch, "step_000001", "state.json", b"{}").status_code == 409
    delete = client.delete(f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/step_000001", params={"epoch": epoch}, headers=auth(worker.key))
    assert delete.status_code == 409
    assert put(client, worker, job_id, epoch, "partial", "a.bin", b"x").status_code == 200
    delete = client.delete(f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/partial", params={"epoch": epoch}, headers=auth(worker.key))
    assert delete.status_code == 204
    assert client.get(f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/partial", params={"epoch": epoch},
                      headers=auth(worker.key)).json()["files"] == []


def test_stale_epoch_and_other_workers_are_refused(make_client, keys) -> None:
    client = make_client()
    worker, job_id, lease, _ = leased(client, keys)
    assert put(client, worker, job_id, lease["epoch"] + 1, "step_000001", "a.bin").status_code == 409
    assert put(client, worker, job_id, lease["epoch"] - 1 or 1, "step_000001", "a.bin").status_code in (200, 409)
    other = register(client, keys.new("acme", "worker"), name="other", devices=1)
    assert put(client, other, job_id, lease["epoch"], "step_000001", "a.bin").status_code == 409  # not its lease
    stranger = register(client, keys.new("evil", "worker"), name="stranger", devices=1)
    stranger.id = worker.id  # another key acting for this worker
    assert put(client, stranger, job_id, lease["epoch"], "step_000001", "a.bin").status_code == 404
    # Once the job ends, its lease is gone: an upload is 409.
    assert worker.state(job_id, lease["epoch"], "starting").status_code == 200
    assert worker.state(job_id, lease["epoch"], "failed", error="x").status_code == 200
    assert put(client, worker, job_id, lease["epoch"], "step_000002", "a.bin").status_code == 409


def test_other_tenants_get_404(make_client, keys) -> None:
    client = make_client()
    worker, job_id, lease, _ = leased(client, keys)
    assert put(client, worker, job_id, lease["epoch"], "step_000001", "a.bin").status_code == 200
    record(worker, job_id, lease["epoch"], "step_000001", 1)
    evil = keys.new("evil", "read,write")
    for url in (f"/v1/jobs/{job_id}/artifacts/step_000001", f"/v1/jobs/{job_id}/artifacts/step_000001/a.bin"):
        response = client.get(url, headers=auth(evil))
        assert response.status_code == 404 and CONTENT not in response.content
    # A job of another tenant that names this one as the job it continues gets nothing of it.
    evil_worker, evil_job, evil_lease, _ = leased(client, keys, "evil", resume_job=job_id)
    query = {"epoch": evil_lease["epoch"], "source": job_id}
    base = f"/v1/workers/{evil_worker.id}/jobs/{evil_job}"
    assert client.get(f"{base}/artifacts/step_000001", params=query, headers=auth(evil_worker.key)).status_code == 404
    assert client.get(f"{base}/artifacts/step_000001/a.bin", params=query, headers=auth(evil_worker.key)).status_code == 404
    assert client.get(f"{base}/checkpoints", params={"epoch": evil_lease["epoch"]}, headers=auth(evil_worker.key)).json() == {"checkpoints": []}


def test_a_continuing_job_reads_the_checkpoints_of_the_job_it_continues(make_client, keys) -> None:
    client = make_client()
    worker, first, lease, owner = leased(client, keys)
    assert put(client, worker, first, lease["epoch"], "step_000003", "a.bin").status_code == 200
    assert put(client, worker, first, lease["epoch"], "unrecorded", "a.bin").status_code == 200
    record(worker, first, lease["epoch"], "step_000003", 3)
    assert worker.state(first, lease["epoch"], "starting").status_code == 200
    assert worker.state(first, lease["epoch"], "failed", error="client idle").status_code == 200
    second = submit(client, owner, config={"model": "tiny", "resume_job": first})
    lease2 = worker.lease()
    assert lease2["job_id"] == second
    base, key = f"/v1/workers/{worker.id}/jobs/{second}", auth(worker.key)
    found = client.get(f"{base}/checkpoints", params={"epoch": lease2["epoch"]}, headers=key).json()["checkpoints"]
    assert found == [{"job_id": first, "step": 3, "name": "step_000003", "epoch": lease["epoch"]}]
    query = {"epoch": lease2["epoch"], "source": first}
    assert [f["path"] for f in client.get(f"{base}/artifacts/step_000003", params=query, headers=key).json()["files"]] == ["a.bin"]
    assert client.get(f"{base}/artifacts/step_000003/a.bin", params=query, headers=key).content == CONTENT
    assert client.get(f"{base}/artifacts/unrecorded/a.bin", params=query, headers=key).status_code == 404  # recorded ones only
    unrelated = submit(client, owner)
    assert client.get(f"{base}/artifacts/step_000003", params={**query, "source": unrelated}, headers=key).status_code == 404


@pytest.mark.parametrize("path", ["%2e%2e/%2e%2e/%2e%2e/secret.txt", "..%2f..%2f..%2fsecret.txt", "%2Fetc%2Fpasswd", "a%5C..%5Csecret.txt",
                                  "a%00b", ".hidden", "a/%2e/b"])
def test_traversal_is_refused(make_client, keys, tmp_path: Path, path: str) -> None:
    client = make_client()
    worker, job_id, lease, owner = leased(client, keys)
    (tmp_path / "data" / "secret.txt").write_bytes(b"SECRET")
    assert put(client, worker, job_id, lease["epoch"], "step_000001", "ok.bin").status_code == 200
    record(worker, job_id, lease["epoch"], "step_000001", 1)
    response = put(client, worker, job_id, lease["epoch"], "step_000002", path)
    assert response.status_code in (400, 404), response.text
    for url, headers, query in (
        (f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/step_000001/{path}", auth(worker.key), {"epoch": lease["epoch"]}),
        (f"/v1/jobs/{job_id}/artifacts/step_000001/{path}", auth(owner), {}),
    ):
        response = client.get(url, params=query, headers=headers)
        assert response.status_code in (400, 404) and b"SECRET" not in response.content, (url, response.status_code)
    for name in ("%2e%2e", "a%2fb", "%2e"):  # a literal ".." is normalised away by the client: see the live test below
        response = client.get(f"/v1/jobs/{job_id}/artifacts/{name}", headers=auth(owner))
        assert response.status_code in (400, 404)
    data = tmp_path / "data"
    written = {p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file() and ".sha256" not in p.parts}
    assert written == {"scheduler.secret", "secret.txt", f"jobs/{job_id}/step_000001/ok.bin"}


def test_literal_dot_dot_on_the_wire(tmp_path: Path, db_url: str, keys: Any) -> None:
    """A raw request line with ``..`` (no client normalises it away) is refused on a live server."""
    from tinkergym.serve.asgi import ThreadServer
    from tinkergym.scheduler.app import SchedulerSettings, create_app

    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "live"), background=False))
    try:
        owner = keys.new("acme", "read")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        for url in ("/v1/jobs/job_00/artifacts/step_1/../../../scheduler.secret", "/v1/jobs/job_00/artifacts/../../scheduler.secret"):
            conn.request("GET", url, headers=auth(owner))
            response = conn.getresponse()
            body = response.read()
            assert response.status in (400, 404) and len(body) < 2000, (url, response.status)
        conn.close()
    finally:
        server.stop()


def test_symlinks_planted_in_the_store_are_never_followed(make_client, keys, tmp_path: Path) -> None:
    client = make_client()
    worker, job_id, lease, owner = leased(client, keys)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"SECRET")
    job_dir = tmp_path / "data" / "jobs" / job_id
    assert put(client, worker, job_id, lease["epoch"], "step_000001", "ok.bin").status_code == 200
    record(worker, job_id, lease["epoch"], "step_000001", 1)
    os.symlink(outside / "secret.txt", job_dir / "step_000001" / "leak.txt")  # a file link inside a checkpoint
    os.symlink(outside, job_dir / "step_000002")  # a checkpoint folder that is a link
    record(worker, job_id, lease["epoch"], "step_000002", 2)
    listing = client.get(f"/v1/jobs/{job_id}/artifacts/step_000001", headers=auth(owner)).json()
    assert [f["path"] for f in listing["files"]] == ["ok.bin"]
    for url in (f"/v1/jobs/{job_id}/artifacts/step_000001/leak.txt", f"/v1/jobs/{job_id}/artifacts/step_000002/secret.txt",
                f"/v1/jobs/{job_id}/artifacts/step_000002"):
        response = client.get(url, headers=auth(owner))
        assert response.status_code in (400, 404) and b"SECRET" not in response.content, url
    response = put(client, worker, job_id, lease["epoch"], "step_000003", "x.bin")
    assert response.status_code == 200
    os.symlink(outside, job_dir / "step_000004")
    assert put(client, worker, job_id, lease["epoch"], "step_000004", "planted.bin").status_code == 400
    assert not (outside / "planted.bin").exists()
    store = DirectoryStore(tmp_path / "data" / "jobs")
    with pytest.raises(ArtifactPathError):
        store.list_files(job_id, "step_000004")


def test_size_limits_and_the_body_limit_exemption(make_client, keys, tmp_path: Path) -> None:
    client = make_client(max_body_bytes=200, max_artifact_bytes=1000)
    worker, job_id, lease, owner = leased(client, keys)
    epoch = lease["epoch"]
    assert put(client, worker, job_id, epoch, "step_000001", "ok.bin", b"x" * 900).status_code == 200  # over the body limit: exempt
    too_big = put(client, worker, job_id, epoch, "step_000001", "big.bin", b"x" * 1001)
    assert too_big.status_code == 413
    streamed = put(client, worker, job_id, epoch, "step_000001", "big.bin", iter([b"x" * 600, b"x" * 600]))  # no Content-Length
    assert streamed.status_code == 413
    assert not list((tmp_path / "data" / "jobs" / job_id).rglob("big.bin"))
    assert not [p for p in (tmp_path / "data" / "jobs" / job_id / ".tmp").iterdir()]  # no temporary file left behind
    # Every other request keeps the JSON body limit, the upload path with another method included.
    big = b"x" * 900
    url = f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/step_000001/ok.bin?epoch={epoch}"
    assert client.post(url, content=big, headers=auth(worker.key)).status_code == 413
    assert client.request("GET", url, content=big, headers=auth(worker.key)).status_code == 413
    assert client.request("DELETE", f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts/step_000001?epoch={epoch}", content=big,
                          headers=auth(worker.key)).status_code == 413
    assert client.post(f"/v1/workers/{worker.id}/jobs/{job_id}/checkpoints", content=big, headers=auth(worker.key)).status_code == 413
    assert client.post("/v1/jobs", content=big, headers=auth(owner)).status_code == 413
    assert client.put(f"/v1/workers/{worker.id}/jobs/{job_id}/artifacts", content=big, headers=auth(worker.key)).status_code == 413
