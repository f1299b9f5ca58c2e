"""The artifact store: each job's checkpoints as files, behind a small interface an object store can implement later.

:class:`ArtifactStore` is the interface (``open_upload``/``put_file``, ``open_file``, ``list_files``, ``delete``);
:class:`DirectoryStore` keeps ``<data_dir>/jobs/<job id>/<checkpoint name>/<relative path>`` on the scheduler's
disk. Paths can never leave the job's folder:

- a job id is ``job_<hex>`` and a checkpoint name one path component
  (:data:`tinkergym.scheduler.artifact_paths.CHECKPOINT_NAME`);
- a relative file path is ``/``-separated components, none empty, ``.`` or ``..``, none holding a backslash,
  a NUL or a control character, none starting with ``.`` (the store's own temporary and digest files do), its
  lengths counted in UTF-8 bytes (:func:`tinkergym.scheduler.artifact_paths.check_relpath`, which a worker
  applies to what it restores too);
- no symbolic link is followed: every existing component is checked with ``lstat``, files are opened with
  ``O_NOFOLLOW``, and the resolved path must still lie inside the job's folder.

An upload is written to a private temporary file in the job's folder and renamed into place once whole, with
its SHA-256 kept beside it (``<job>/.sha256/<name>/<path>``), so a listing does not read every byte again and
a half-written file is never listed.

Retention (:func:`sweep_artifacts`, run by the app's sweeper at most every ``retention_interval_s``): once a job
has ended (succeeded, failed, cancelled) for ``checkpoint_keep_s``, every checkpoint but its newest (highest
step) is deleted, rows first, then files, so a crash in between leaves unreferenced files (removed by a later
pass) and never a recorded checkpoint without its files. The newest stays: a job that continues the ended one
(its config's ``resume_job``) restores it. After ``artifact_retention_s`` the job's whole folder and its
checkpoint rows go, and a ``log`` event on the job says its artifacts expired; a job that a queued or running
job continues is kept until that job ends. A job that has not ended is never touched, so its uploads in
progress and its checkpoints stay whole. Each pass does bounded work (:data:`RETENTION_BATCH` jobs per kind
of work) and the next pass goes on, at once when work was left.

Bytes: a job's ``artifact_bytes`` is what its stored files hold, the count its tenant's ``max_artifact_bytes``
bounds (:mod:`tinkergym.scheduler.quotas`). An upload adds its size less the file it replaces, a worker's delete
and every retention delete give the bytes back, and a pass counts an ended job's files again where the count
differs (files stored before bytes were counted). Deleting whole ended jobs is :mod:`tinkergym.scheduler.retention`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import delete, func, select
from tinkergym.scheduler import quotas, states
from tinkergym.scheduler.artifact_paths import CHECKPOINT_NAME, MAX_COMPONENT_BYTES, MAX_PATH_BYTES, ArtifactPathError, check_relpath  # noqa: F401 - the store's rules
from tinkergym.scheduler.db import checkpoints, jobs

#: A job id as :func:`tinkergym.scheduler.repository.new_job_id` makes them.
JOB_ID = re.compile(r"^job_[0-9a-f]{1,36}$")
_CHUNK = 1 << 20
_DIGESTS = ".sha256"
_TMP = ".tmp"
_TRASH = ".trash"  # beside the job folders: deleted jobs' files, until the pass that deleted them empties it
#: Jobs one retention pass acts on at most, per kind of work (so lease sweeps are not held up).
RETENTION_BATCH = 50


class ArtifactTooLarge(Exception):
    """An upload past the store's size limit (HTTP 413)."""


@dataclass(frozen=True)
class FileInfo:
    """One stored file: its path inside the checkpoint folder, size in bytes and SHA-256 (hex)."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        raise ArtifactPathError(f"job id {str(job_id)[:80]!r} is not one the scheduler made")
    return job_id


def check_name(name: str) -> str:
    """A checkpoint name: one folder name of letters, digits, '.', '_' and '-' (starting with a letter or digit)."""
    if not isinstance(name, str) or not CHECKPOINT_NAME.match(name) or name in (".", ".."):
        raise ArtifactPathError(f"checkpoint name {str(name)[:100]!r}: one folder name of letters, digits, '.', '_' and '-'")
    return name


class ArtifactStore:
    """What the scheduler needs of an artifact store (a directory now; an object store can implement the same)."""

    def open_upload(self, job_id: str, name: str, relpath: str, max_bytes: int) -> Upload:
        """A writer for one file; nothing is visible until its :meth:`Upload.commit`."""
        raise NotImplementedError

    def put_file(self, job_id: str, name: str, relpath: str, stream: BinaryIO | Iterable[bytes], max_bytes: int) -> FileInfo:
        """Store one file from a binary file object or an iterable of byte chunks; its :class:`FileInfo`."""
        upload = self.open_upload(job_id, name, relpath, max_bytes)
        try:
            chunks = iter(lambda: stream.read(_CHUNK), b"") if hasattr(stream, "read") else stream
            for chunk in chunks:
                upload.write(chunk)
            return upload.commit()
        except BaseException:
            upload.abort()
            raise

    def open_file(self, job_id: str, name: str, relpath: str) -> tuple[BinaryIO, int]:
        """The stored file opened for reading, and its size; :class:`FileNotFoundError` when there is none."""
        raise NotImplementedError

    def list_files(self, job_id: str, name: str) -> list[FileInfo]:
        """Every file of a checkpoint (sorted by path); empty when there is none."""
        raise NotImplementedError

    def delete(self, job_id: str, name: str | None = None) -> None:
        """Remove a checkpoint's files (or, with no name, all of the job's)."""
        raise NotImplementedError

    def job_ids(self) -> list[str]:
        """The ids of the jobs that have anything stored (sorted)."""
        raise NotImplementedError

    def checkpoint_names(self, job_id: str) -> list[str]:
        """The checkpoint folders stored for a job, recorded or not (sorted); empty when there are none."""
        raise NotImplementedError

    def size_of(self, job_id: str, name: str, relpath: str) -> int:
        """The size of a stored file; 0 when there is none (what an upload to that path replaces)."""
        raise NotImplementedError

    def usage(self, job_id: str, name: str | None = None) -> int:
        """The bytes a checkpoint's files hold (or, with no name, all of the job's): what its tenant's quota counts."""
        raise NotImplementedError

    def trash(self, job_id: str) -> str | None:
        """Take all of a job's files out of view at once (quick: inside a transaction); a handle for :meth:`untrash`, or
        None when nothing is stored. :meth:`empty_trash` deletes them."""
        raise NotImplementedError

    def untrash(self, job_id: str, handle: str) -> None:
        """Put back what :meth:`trash` took (its transaction failed)."""
        raise NotImplementedError

    def empty_trash(self) -> int:
        """Delete everything trashed (also what a crash left there); how many jobs' files."""
        raise NotImplementedError


class Upload:
    """One file being written: :meth:`write` chunks, then :meth:`close` and :meth:`commit` (or :meth:`abort`)."""

    def __init__(self, tmp: Path, commit_to: Callable[[Path, int, str], FileInfo], max_bytes: int) -> None:
        self.tmp = tmp
        self._commit_to = commit_to
        self.max_bytes = max_bytes
        self.size = 0
        self.sha = hashlib.sha256()
        self._file = open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600), "wb")

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise ArtifactTooLarge(f"the file is larger than the artifact limit of {self.max_bytes:,} bytes")
        self.sha.update(chunk)
        self._file.write(chunk)

    def close(self) -> None:
        """Flush the bytes to disk (slow for a large file: do it before taking any lock)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def commit(self) -> FileInfo:
        """Move the whole file into place (quick once :meth:`close` ran); its :class:`FileInfo`."""
        self.close()
        return self._commit_to(self.tmp, self.size, self.sha.hexdigest())

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


class DirectoryStore(ArtifactStore):
    """Artifacts as files under ``root`` (``<data_dir>/jobs``): ``<root>/<job id>/<name>/<relative path>``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    # ----- paths ------------------------------------------------------------------------------------
    def _job_dir(self, job_id: str) -> Path:
        return self.root / check_job_id(job_id)

    def _inside(self, job_dir: Path, path: Path) -> Path:
        """``path`` if no existing component below the store's root is a symlink and it resolves inside ``job_dir``."""
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    raise ArtifactPathError(f"{current.relative_to(job_dir.parent)} is a symbolic link, which the store never follows")
            except FileNotFoundError:
                break
        resolved = os.path.realpath(path)
        if os.path.commonpath([resolved, str(job_dir)]) != str(job_dir):
            raise ArtifactPathError("the path resolves outside the job's folder")
        return path

    def path_of(self, job_id: str, name: str, relpath: str | None = None) -> Path:
        """Where a checkpoint (or one of its files) lives, checked to stay inside the job's folder."""
        job_dir = self._job_dir(job_id)
        path = job_dir / check_name(name)
        if relpath is not None:
            path = path.joinpath(*check_relpath(relpath))
        return self._inside(job_dir, path)

    def _digest_path(self, job_id: str, name: str, relpath: str) -> Path:
        return self._job_dir(job_id) / _DIGESTS / check_name(name) / Path(*check_relpath(relpath))

    def _mkdirs(self, job_dir: Path, folder: Path) -> None:
        """Create ``folder`` one component at a time, refusing a symlink anywhere on the way."""
        current = self.root
        for part in folder.relative_to(self.root).parts:
            current = current / part
            try:
                os.mkdir(current, 0o700)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(current).st_mode):
                    raise ArtifactPathError(f"{current.relative_to(self.root)} is not a folder (a file or a symbolic link)") from None
        self._inside(job_dir, folder)

    # ----- the interface ----------------------------------------------------------------------------
    def open_upload(self, job_id: str, name: str, relpath: str, max_bytes: int) -> Upload:
        job_dir = self._job_dir(job_id)
        final = self.path_of(job_id, name, relpath)
        digest_file = self._digest_path(job_id, name, relpath)
        tmp_dir = job_dir / _TMP
        self._mkdirs(job_dir, tmp_dir)
        tmp = tmp_dir / f"upload-{secrets.token_hex(8)}"

        def commit(tmp_file: Path, size: int, sha256: str) -> FileInfo:
            try:
                self._mkdirs(job_dir, final.parent)
                self._mkdirs(job_dir, digest_file.parent)
                self._inside(job_dir, final)
                if final.exists() and not final.is_file():
                    raise ArtifactPathError(f"{relpath[:100]!r} is a folder in checkpoint {name!r}")
                _write_atomic(digest_file, f"{sha256} {size}\n")
                os.replace(tmp_file, final)
            finally:
                tmp_file.unlink(missing_ok=True)
            return FileInfo(relpath, size, sha256)

        return Upload(tmp, commit, max_bytes)

    def open_file(self, job_id: str, name: str, relpath: str) -> tuple[BinaryIO, int]:
        path = self.path_of(job_id, name, relpath)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # FileNotFoundError / OSError(ELOOP) on a link
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise FileNotFoundError(relpath)
        return os.fdopen(fd, "rb"), info.st_size

    def list_files(self, job_id: str, name: str) -> list[FileInfo]:
        folder = self.path_of(job_id, name)
        if not os.path.isdir(folder) or os.path.islink(folder):
            return []
        found = []
        for relpath in _walk(folder):
            size = os.lstat(folder / relpath).st_size
            found.append(FileInfo(relpath, size, self._sha256(job_id, name, relpath, size)))
        return sorted(found, key=lambda f: f.path)

    def delete(self, job_id: str, name: str | None = None) -> None:
        job_dir = self._job_dir(job_id)
        targets = [job_dir] if name is None else [self.path_of(job_id, name), job_dir / _DIGESTS / check_name(name)]
        for target in targets:
            if os.path.islink(target):
                os.unlink(target)
            else:
                shutil.rmtree(target, ignore_errors=True)

    def job_ids(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if JOB_ID.match(n))

    def checkpoint_names(self, job_id: str) -> list[str]:
        try:
            names = os.listdir(self._job_dir(job_id))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if CHECKPOINT_NAME.match(n))

    def size_of(self, job_id: str, name: str, relpath: str) -> int:
        try:
            info = os.lstat(self.path_of(job_id, name, relpath))
        except (FileNotFoundError, NotADirectoryError):
            return 0
        return info.st_size if stat.S_ISREG(info.st_mode) else 0

    def usage(self, job_id: str, name: str | None = None) -> int:
        folder = self._job_dir(job_id) if name is None else self.path_of(job_id, name)
        if not os.path.isdir(folder) or os.path.islink(folder):
            return 0
        return sum(os.lstat(folder / relpath).st_size for relpath in _walk(folder))

    def trash(self, job_id: str) -> str | None:
        job_dir = self._job_dir(job_id)
        if not os.path.lexists(job_dir):
            return None
        (self.root / _TRASH).mkdir(mode=0o700, exist_ok=True)
        handle = f"{job_id}.{secrets.token_hex(4)}"
        os.rename(job_dir, self.root / _TRASH / handle)
        return handle

    def untrash(self, job_id: str, handle: str) -> None:
        os.rename(self.root / _TRASH / handle, self._job_dir(job_id))

    def empty_trash(self) -> int:
        try:
            entries = os.listdir(self.root / _TRASH)
        except FileNotFoundError:
            return 0
        for entry in entries:
            target = self.root / _TRASH / entry
            if os.path.islink(target) or not os.path.isdir(target):
                os.unlink(target)
            else:
                shutil.rmtree(target, ignore_errors=True)
        return len(entries)

    def _sha256(self, job_id: str, name: str, relpath: str, size: int) -> str:
        """The kept digest when it matches the file's size; otherwise the file is read again."""
        try:
            kept, kept_size = self._digest_path(job_id, name, relpath).read_text(encoding="ascii").split()
            if int(kept_size) == size and len(kept) == 64:
                return kept
        except (OSError, ValueError):
            pass
        handle, _ = self.open_file(job_id, name, relpath)
        sha = hashlib.sha256()
        with handle:
            for chunk in iter(lambda: handle.read(_CHUNK), b""):
                sha.update(chunk)
        return sha.hexdigest()


def _walk(folder: Path) -> Iterator[str]:
    """Relative paths of the regular files under ``folder`` (symlinks and hidden names skipped, never followed)."""
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not os.path.islink(os.path.join(dirpath, d))]
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            if filename.startswith(".") or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            yield os.path.relpath(path, folder).replace(os.sep, "/")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(text, encoding="ascii")
    os.replace(tmp, path)


# ----- retention -----------------------------------------------------------------------------------------
def retention_due(app: Any) -> bool:
    """Whether a retention pass should run now: one is configured and ``retention_interval_s`` of the app's clock
    has passed since the last (or the last left work, or the clock went back)."""
    settings = app.state.settings
    if not (settings.checkpoint_keep_s or settings.artifact_retention_s):
        return False
    now = app.state.store.clock()
    last = getattr(app.state, "retention_ran_at", None)
    return last is None or now < last or now - last >= settings.retention_interval_s


def continued_jobs(conn: Any, job_id: str | None = None) -> set[str]:
    """The jobs that queued or running (not ended) jobs continue (their config's ``resume_job``); with ``job_id``,
    that job if one does."""
    query = select(jobs.c.config).where(jobs.c.state.notin_(sorted(states.TERMINAL)))
    query = query.where(jobs.c.config.contains(job_id)) if job_id else query.where(jobs.c.config.contains('"resume_job"'))
    found = set()
    for (config,) in conn.execute(query):
        try:
            continued = json.loads(config).get("resume_job")
        except (ValueError, AttributeError):
            continue
        if isinstance(continued, str):
            found.add(continued)
    return found if job_id is None else found & {job_id}


def _ended_with_checkpoints(conn: Any, ended_by: float, at_least: int, skip: set[str]) -> list[str]:
    """Jobs ended no later than ``ended_by`` with at least ``at_least`` recorded checkpoints, oldest end first."""
    query = (
        select(checkpoints.c.job_id).select_from(checkpoints.join(jobs, jobs.c.id == checkpoints.c.job_id))
        .where(jobs.c.state.in_(sorted(states.TERMINAL)), jobs.c.finished_at <= ended_by)
        .group_by(checkpoints.c.job_id, jobs.c.finished_at).having(func.count() >= at_least)
        .order_by(jobs.c.finished_at, checkpoints.c.job_id).limit(RETENTION_BATCH)
    )
    if skip:
        query = query.where(checkpoints.c.job_id.notin_(sorted(skip)))
    return list(conn.execute(query).scalars())


def _ended_by(job: dict[str, Any], cutoff: float) -> bool:
    return job["state"] in states.TERMINAL and job["finished_at"] is not None and job["finished_at"] <= cutoff


def expire_job(store: Any, artifacts: ArtifactStore, job_id: str, ended_by: float) -> int:
    """Delete all of a job's artifacts (rows, then its folder) if it ended by ``ended_by`` and no live job continues
    it; the number of checkpoints deleted (a ``log`` event says so)."""
    with store.transaction() as conn:
        job = store.get(conn, job_id, for_update=True)
        if not _ended_by(job, ended_by) or continued_jobs(conn, job_id):
            return 0
        names = list(conn.execute(select(checkpoints.c.name).where(checkpoints.c.job_id == job_id)).scalars())
        if names:
            conn.execute(delete(checkpoints).where(checkpoints.c.job_id == job_id))
            store.append_event(conn, job_id, "log", {
                "message": f"artifacts expired: {len(names)} checkpoint(s) deleted", "artifacts": "expired", "checkpoints": len(names)})
        quotas.set_job_bytes(conn, job_id, 0)
    artifacts.delete(job_id)
    return len(names)


def prune_job(store: Any, artifacts: ArtifactStore, job_id: str, ended_by: float) -> int:
    """Delete every checkpoint of a job that ended by ``ended_by`` but its newest (rows, then files), and any
    unrecorded folder it left; the number of recorded checkpoints deleted (a ``log`` event says so)."""
    with store.transaction() as conn:
        job = store.get(conn, job_id, for_update=True)
        if not _ended_by(job, ended_by):
            return 0
        rows = conn.execute(
            select(checkpoints.c.id, checkpoints.c.name, checkpoints.c.step).where(checkpoints.c.job_id == job_id)
            .order_by(checkpoints.c.step.desc(), checkpoints.c.id.desc())
        ).all()
        older = rows[1:]
        if older:
            conn.execute(delete(checkpoints).where(checkpoints.c.id.in_([r.id for r in older])))
            store.append_event(conn, job_id, "log", {
                "message": f"deleted {len(older)} older checkpoint(s); kept the newest, {rows[0].name} (step {rows[0].step})",
                "artifacts": "pruned", "checkpoints": len(older), "kept": rows[0].name})
    keep = {rows[0].name} if rows else set()
    removed = [name for name in artifacts.checkpoint_names(job_id) if name not in keep]
    for name in removed:
        artifacts.delete(job_id, name)
    if removed:
        recount(store, artifacts, job_id)
    return len(older)


def recount(store: Any, artifacts: ArtifactStore, job_id: str) -> None:
    """Set an ended job's ``artifact_bytes`` to what its files hold (after deletes; or files stored before bytes were counted)."""
    with store.transaction() as conn:
        job = store.get(conn, job_id, for_update=True)
        if job["state"] in states.TERMINAL:  # an ended job's files change only here: the count is exact
            quotas.set_job_bytes(conn, job_id, artifacts.usage(job_id))


def _leftovers(app: Any, now: float, keep_s: float | None, retain_s: float | None, continued: set[str]) -> tuple[int, int]:
    """Walk the next :data:`RETENTION_BATCH` job folders on disk (a cursor goes round them, pass after pass) for what the
    database no longer names: unrecorded folders of ended jobs, folders of expired ones. (folders removed, checkpoints expired)."""
    store, artifacts = app.state.store, app.state.artifacts
    cursor = getattr(app.state, "retention_cursor", "")
    batch = [j for j in artifacts.job_ids() if j > cursor][:RETENTION_BATCH]
    app.state.retention_cursor = batch[-1] if len(batch) == RETENTION_BATCH else ""
    removed = expired = 0
    for job_id in batch:
        with store.read() as conn:
            row = conn.execute(select(jobs.c.state, jobs.c.finished_at, jobs.c.artifact_bytes).where(jobs.c.id == job_id)).mappings().first()
            if row is None or not _ended_by(dict(row), now):
                continue  # not a job of this database, or not ended: never touched
            recorded = set(conn.execute(select(checkpoints.c.name).where(checkpoints.c.job_id == job_id)).scalars())
        if retain_s and _ended_by(dict(row), now - retain_s) and job_id not in continued:
            expired += expire_job(store, artifacts, job_id, now - retain_s)
            removed += not recorded
            continue
        if keep_s and _ended_by(dict(row), now - keep_s):
            for name in set(artifacts.checkpoint_names(job_id)) - recorded:  # only shrinks once a job ended: never a recorded one
                artifacts.delete(job_id, name)
                removed += 1
        if artifacts.usage(job_id) != row["artifact_bytes"]:  # files stored before bytes were counted, or just removed
            recount(store, artifacts, job_id)
    return removed, expired


def sweep_artifacts(app: Any) -> dict[str, int]:
    """One retention pass (see the module's notes): ``{"pruned": older checkpoints deleted, "expired": checkpoints of
    expired jobs deleted, "removed": unrecorded folders removed}``."""
    store, artifacts, settings = app.state.store, app.state.artifacts, app.state.settings
    logger = getattr(app.state, "logger", None) or logging.getLogger("tinkergym.scheduler")
    now = store.clock()
    app.state.retention_ran_at = now
    keep_s, retain_s = settings.checkpoint_keep_s or None, settings.artifact_retention_s or None
    with store.read() as conn:
        continued = continued_jobs(conn)
        to_expire = _ended_with_checkpoints(conn, now - retain_s, 1, continued) if retain_s else []
        to_prune = _ended_with_checkpoints(conn, now - keep_s, 2, set(to_expire)) if keep_s else []
    done = {"pruned": 0, "expired": 0, "removed": 0}
    for job_id in to_expire:
        try:
            done["expired"] += expire_job(store, artifacts, job_id, now - retain_s)
        except Exception:  # noqa: BLE001 - one job's failure must not stop the others
            logger.exception("could not expire the artifacts of job %s", job_id)
    for job_id in to_prune:
        try:
            done["pruned"] += prune_job(store, artifacts, job_id, now - keep_s)
        except Exception:  # noqa: BLE001 - as above
            logger.exception("could not delete the older checkpoints of job %s", job_id)
    removed, expired = _leftovers(app, now, keep_s, retain_s, continued)
    done["removed"] += removed
    done["expired"] += expired
    if len(to_expire) == RETENTION_BATCH or len(to_prune) == RETENTION_BATCH:
        app.state.retention_ran_at = None  # work was left: the next sweep goes on
    if any(done.values()):
        logger.info("artifact retention: %(pruned)d older checkpoint(s) of ended jobs deleted, %(expired)d expired, "
                    "%(removed)d unrecorded folder(s) removed", done)
    return done
