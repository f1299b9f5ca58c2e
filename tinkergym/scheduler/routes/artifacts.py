"""Artifacts: the checkpoint files a job's worker uploads, and their download by the worker and the job's owner.

Worker side (scope ``worker``, only the worker the key registered, fenced by the lease epoch in ``?epoch=``):

- ``PUT /v1/workers/{wid}/jobs/{job}/artifacts/{name}/{path}``: one file, the raw body streamed to a temporary
  file and moved into place once whole (``settings.max_artifact_bytes``, not the JSON body limit; an optional
  ``?sha256=`` is checked). A checkpoint already recorded never changes (409). The file counts toward its job's
  ``artifact_bytes`` and its tenant's ``max_artifact_bytes`` (413 over it: :mod:`tinkergym.scheduler.quotas`),
  a file uploaded again at the same path with its new size only.
- ``GET .../artifacts/{name}`` (files with size and SHA-256), ``GET .../artifacts/{name}/{path}`` (one file),
  ``DELETE .../artifacts/{name}`` (a partial upload of a checkpoint not recorded yet; its bytes are given back), and
  ``GET /v1/workers/{wid}/jobs/{job}/checkpoints``: the leased job's checkpoints and those of the job its config
  continues (``resume_job``, same tenant). With ``?source=<that job>``, the reads serve that job's recorded
  checkpoints, so a job that continues an ended one restores them.

Owner side (scope ``read``, own tenant; 404 otherwise): ``GET /v1/jobs/{job}/artifacts/{name}`` and
``GET /v1/jobs/{job}/artifacts/{name}/{path}``, for recorded checkpoints only.

The worker records a checkpoint (``POST /v1/workers/{wid}/jobs/{job}/checkpoints``) after all of its files are
uploaded; a lease's ``checkpoint`` then names the folder to restore.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, BinaryIO

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import HTTPException
from fastapi.responses import StreamingResponse
from pydantic import Field
from sqlalchemy import select
from tinkergym.serve.asgi import error_response
from tinkergym.scheduler import leases, quotas
from tinkergym.scheduler.deps import require
from tinkergym.scheduler.artifacts import (
    ArtifactPathError,
    ArtifactStore,
    ArtifactTooLarge,
    check_job_id,
    check_name,
)
from tinkergym.scheduler.auth import Principal
from tinkergym.scheduler.db import MAX_INT, checkpoints
from tinkergym.scheduler.repository import Conflict, JobStore, NotFound
from tinkergym.serve.wire import WireModel

worker_router = APIRouter(prefix="/v1/workers", tags=["artifacts"])
owner_router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])

#: The upload route's paths (decoded, as ASGI gives them): the only bodies exempt from the JSON body limit.
UPLOAD_PATH = re.compile(r"^/v1/workers/[^/]+/jobs/[^/]+/artifacts/[^/]+/.+$")
_CHUNK = 1 << 20
_BUFFER = 4 << 20
EPOCH = Query(ge=1, le=MAX_INT, description="the lease epoch this worker holds")
SOURCE = Query(None, max_length=40, description="read another job's recorded checkpoints: the job the leased job's config continues (resume_job)")


class ArtifactFile(WireModel):
    path: str
    size: int
    sha256: str


class ArtifactListing(WireModel):
    job_id: str
    name: str
    files: list[ArtifactFile]


class WorkerCheckpoint(WireModel):
    job_id: str = Field(description="the leased job, or the job its config continues (resume_job)")
    step: int
    name: str
    epoch: int


class WorkerCheckpointList(WireModel):
    checkpoints: list[WorkerCheckpoint] = Field(description="by job (the continued one first), then step")


def is_upload(scope: dict[str, Any]) -> bool:
    """Whether a request is an artifact upload (``PUT`` on :data:`UPLOAD_PATH`): :class:`BodyLimit` lets its body through."""
    return scope.get("method") == "PUT" and bool(UPLOAD_PATH.match(scope.get("path", "")))


def artifact_store(request: Request) -> ArtifactStore:
    return request.app.state.artifacts


def _store(request: Request) -> JobStore:
    return request.app.state.store


def _recorded(conn: Any, job_id: str, name: str) -> bool:
    return conn.execute(select(checkpoints.c.id).where(checkpoints.c.job_id == job_id, checkpoints.c.name == name)).first() is not None


def _fenced(conn: Any, store: JobStore, who: Principal, worker_id: str, job_id: str, epoch: int) -> dict[str, Any]:
    """The leased job's row if this key's worker holds it at ``epoch``: 404 for another key's worker, 409 when stale."""
    if len(worker_id) > 64 or "\x00" in worker_id or leases.owned_worker(conn, worker_id, who.key_id) is None:
        raise HTTPException(404, f"no worker {worker_id[:80]!r} registered with this key")
    check_job_id(job_id)
    return leases.held_job(conn, store, worker_id, job_id, epoch)


def _source(conn: Any, store: JobStore, job: dict[str, Any], source: str | None) -> tuple[str, bool]:
    """Whose artifacts a worker read serves, and whether only recorded checkpoints may be read."""
    if source is None or source == job["id"]:
        return job["id"], False
    try:
        continued = json.loads(job["config"]).get("resume_job")
    except (ValueError, AttributeError):
        continued = None
    if source != continued:
        raise NotFound(source)
    store.get(conn, source, job["tenant_id"])  # another tenant's job is not found
    return source, True


def _file_response(handle: BinaryIO, size: int) -> StreamingResponse:
    def chunks() -> Iterator[bytes]:  # a plain iterator: Starlette reads it in a thread
        with handle:
            yield from iter(lambda: handle.read(_CHUNK), b"")

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers={"Content-Length": str(size)})


def _open(artifacts: ArtifactStore, job_id: str, name: str, path: str) -> StreamingResponse:
    try:
        handle, size = artifacts.open_file(job_id, name, path)
    except ArtifactPathError:
        raise
    except OSError:  # missing, a folder, or a symbolic link (O_NOFOLLOW)
        raise HTTPException(404, f"no file {path[:200]!r} in checkpoint {name!r}") from None
    return _file_response(handle, size)


# ----- worker side -------------------------------------------------------------------------------------
@worker_router.put("/{worker_id}/jobs/{job_id}/artifacts/{name}/{path:path}", response_model=ArtifactFile,
                   responses={400: {}, 404: {}, 409: {}, 413: {}})
async def upload(
    worker_id: str, job_id: str, name: str, path: str, request: Request, epoch: int = EPOCH,
    sha256: str | None = Query(None, pattern=r"^[0-9a-f]{64}$", description="the file's SHA-256 (hex), checked when given"),
    who: Principal = Depends(require("worker")),
) -> Any:
    """Store one file of checkpoint ``name`` from the raw request body (fenced by ``epoch``, checked against ``sha256``)."""
    store, artifacts, limit = _store(request), artifact_store(request), request.app.state.settings.max_artifact_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return error_response(413, "body_too_large", f"the file is {int(declared):,} bytes; artifacts are at most {limit:,} bytes")
    check_name(name)

    def fence() -> tuple[dict[str, Any], int, int]:
        """The leased job, its tenant's max_artifact_bytes and the bytes it stores besides the file this one replaces."""
        with store.read() as conn:
            job = _fenced(conn, store, who, worker_id, job_id, epoch)
            if _recorded(conn, job_id, name):
                raise Conflict(f"checkpoint {name!r} of job {job_id} is recorded: its files do not change")
            quota, stored = quotas.artifact_usage(conn, job["tenant_id"])
            return job, quota, stored - artifacts.size_of(job_id, name, path)

    job, quota, stored = await run_in_threadpool(fence)
    if declared is not None and declared.isdigit() and stored + int(declared) > quota:  # refused before a byte is stored
        raise quotas.refuse_upload(job, int(declared), stored, quota)
    writer = await run_in_threadpool(artifacts.open_upload, job_id, name, path, limit)
    try:
        buffered: list[bytes] = []
        pending = 0
        async for chunk in request.stream():
            buffered.append(chunk)
            pending += len(chunk)
            if pending >= _BUFFER:
                await run_in_threadpool(writer.write, b"".join(buffered))
                buffered, pending = [], 0
                if stored + writer.size > quota:  # a body longer than it said, or of no declared length: stop storing it
                    raise quotas.refuse_upload(job, writer.size, stored, quota)
        await run_in_threadpool(writer.write, b"".join(buffered))
        await run_in_threadpool(writer.close)
        if sha256 is not None and writer.sha.hexdigest() != sha256:
            raise ValueError(f"the body's SHA-256 is {writer.sha.hexdigest()}, not the {sha256} the request names")

        def commit() -> Any:
            with store.transaction() as conn:  # the lease row stays locked while the file moves into place
                held = _fenced(conn, store, who, worker_id, job_id, epoch)
                if _recorded(conn, job_id, name):
                    raise Conflict(f"checkpoint {name!r} of job {job_id} is recorded: its files do not change")
                quotas.charge_upload(conn, held, writer.size, artifacts.size_of(job_id, name, path))  # exact: the tenant's row is locked
                return writer.commit()

        info = await run_in_threadpool(commit)
    except ArtifactTooLarge as exc:
        await run_in_threadpool(writer.abort)
        return error_response(413, "body_too_large", str(exc))
    except BaseException:
        await run_in_threadpool(writer.abort)
        raise
    return info.to_dict()


def _readable_checkpoint(request: Request, who: Principal, worker_id: str, job_id: str, epoch: int, source: str | None, name: str) -> str:
    """The job whose checkpoint ``name`` a worker may read (its leased job, or with ``source`` the job it continues), fenced."""
    store = _store(request)
    with store.read() as conn:
        owner, recorded_only = _source(conn, store, _fenced(conn, store, who, worker_id, job_id, epoch), source)
        if recorded_only and not _recorded(conn, owner, check_name(name)):
            raise HTTPException(404, f"job {owner} has no checkpoint {name[:100]!r}")
    return owner


@worker_router.get("/{worker_id}/jobs/{job_id}/artifacts/{name}", response_model=ArtifactListing, responses={400: {}, 404: {}, 409: {}})
def worker_listing(
    worker_id: str, job_id: str, name: str, request: Request, epoch: int = EPOCH, source: str | None = SOURCE,
    who: Principal = Depends(require("worker")),
) -> Any:
    """The files of checkpoint ``name`` of the leased job (or, with ``source``, of the job it continues), with sizes and SHA-256."""
    owner = _readable_checkpoint(request, who, worker_id, job_id, epoch, source, name)
    return {"job_id": owner, "name": name, "files": [f.to_dict() for f in artifact_store(request).list_files(owner, name)]}


@worker_router.get("/{worker_id}/jobs/{job_id}/artifacts/{name}/{path:path}", responses={200: {"content": {"application/octet-stream": {}}},
                                                                                        400: {}, 404: {}, 409: {}})
def worker_download(
    worker_id: str, job_id: str, name: str, path: str, request: Request, epoch: int = EPOCH, source: str | None = SOURCE,
    who: Principal = Depends(require("worker")),
) -> Any:
    """One file of checkpoint ``name`` of the leased job (or, with ``source``, of the job it continues)."""
    owner = _readable_checkpoint(request, who, worker_id, job_id, epoch, source, name)
    return _open(artifact_store(request), owner, name, path)


@worker_router.delete("/{worker_id}/jobs/{job_id}/artifacts/{name}", status_code=204, responses={400: {}, 404: {}, 409: {}})
def worker_delete(
    worker_id: str, job_id: str, name: str, request: Request, epoch: int = EPOCH, who: Principal = Depends(require("worker")),
) -> None:
    """Remove the files of a checkpoint that is not recorded (a partial upload, before it is sent again)."""
    store = _store(request)
    with store.transaction() as conn:
        _fenced(conn, store, who, worker_id, job_id, epoch)
        if _recorded(conn, job_id, check_name(name)):
            raise Conflict(f"checkpoint {name!r} of job {job_id} is recorded: it is kept")
        freed = artifact_store(request).usage(job_id, name)
        artifact_store(request).delete(job_id, name)
        quotas.release_bytes(conn, job_id, freed)


@worker_router.get("/{worker_id}/jobs/{job_id}/checkpoints", response_model=WorkerCheckpointList, responses={404: {}, 409: {}})
def worker_checkpoints(
    worker_id: str, job_id: str, request: Request, epoch: int = EPOCH, who: Principal = Depends(require("worker")),
) -> Any:
    """The recorded checkpoints a new server of the leased job may restore: those of the job it continues, then its own."""
    store = _store(request)
    found: list[dict[str, Any]] = []
    with store.read() as conn:
        job = _fenced(conn, store, who, worker_id, job_id, epoch)
        try:
            continued = json.loads(job["config"]).get("resume_job")
        except (ValueError, AttributeError):
            continued = None
        owners = [job_id]
        if isinstance(continued, str) and continued != job_id:
            try:
                store.get(conn, continued, job["tenant_id"])
                owners.insert(0, continued)
            except NotFound:
                pass  # another tenant's job, or none: nothing to restore from it
        for owner in owners:
            found += [{"job_id": owner, **{k: r[k] for k in ("step", "name", "epoch")}} for r in store.checkpoints(conn, owner)]
    return {"checkpoints": found}


# ----- owner side --------------------------------------------------------------------------------------
def _owned_checkpoint(request: Request, who: Principal, job_id: str, name: str) -> None:
    store = _store(request)
    with store.read() as conn:
        store.get(conn, job_id, who.tenant_filter())  # an operator key reads every tenant's
        if not _recorded(conn, job_id, check_name(name)):
            raise HTTPException(404, f"job {job_id} has no checkpoint {name[:100]!r}")


@owner_router.get("/{job_id}/artifacts/{name}", response_model=ArtifactListing, responses={400: {}, 404: {}})
def owner_listing(job_id: str, name: str, request: Request, who: Principal = Depends(require("read"))) -> Any:
    """The files of one of the job's recorded checkpoints, with sizes and SHA-256 (404 for another tenant's job)."""
    _owned_checkpoint(request, who, job_id, name)
    return {"job_id": job_id, "name": name, "files": [f.to_dict() for f in artifact_store(request).list_files(job_id, name)]}


@owner_router.get("/{job_id}/artifacts/{name}/{path:path}", responses={200: {"content": {"application/octet-stream": {}}}, 400: {}, 404: {}})
def owner_download(job_id: str, name: str, path: str, request: Request, who: Principal = Depends(require("read"))) -> Any:
    """One file of one of the job's recorded checkpoints (404 for another tenant's job)."""
    _owned_checkpoint(request, who, job_id, name)
    return _open(artifact_store(request), job_id, name, path)
